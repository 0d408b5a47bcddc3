#!/usr/bin/env python3
"""Which drift law forecasts real gradients' energy: the controller's against others.

    /usr/bin/python3 tests/accuracy/drift_law.py [--optimizer sgd|adamw] [--steps N] [--seed S]

Under the squared error metric the controller scales each layer's errors from the window
it measured to the epoch that runs the assignment by the drift (docs/CONTROLLER.md,
"Drift"): the magnitude m = sum |g| of the last two windows, as a power of the step
counted from 1. This script trains char_lm.py's quick model (the same text, model, batch
and data order per rank) for --steps steps, 4 ranks emulated in one process (each rank's
batch backward in turn, the mean gradient applied), records each weight matrix's
magnitude per step (summed over the ranks, as the engine sums them), and replays two
schedules on those magnitudes: char_lm's quick one (warmup 20, period 20, window 5,
switch lag 2) and the demo's (5, 5, 2, 2). For every window after the first, each law
forecasts the epoch's mean energy m^2 from the window's and the window before's; the
realized mean over the epoch's steps is the truth. Laws:
  power      the controller's: (m1/m0)^(2h), h = log(t2/t1) / log(t1/t0)
  none       the window's energy as it is
  rate       a constant rate: (m1/m0)^(2 (t2 - t1) / (t1 - t0))
Printed per schedule and law: over the layer-epochs, the mean of log(forecast / realized)
(its bias), the median of its absolute value, and the share over-forecast; and the same
weighted by each layer-epoch's realized energy (the budget's view: a forecast miss
matters as much as the layer's share of its epoch's error).
"""

import argparse
import math
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import char_lm  # noqa: E402 (the model, the text and the sizes)

SCHEDULES = {"char_lm quick (20, 20, 5, 2)": (20, 20, 5, 2), "demo (5, 5, 2, 2)": (5, 5, 2, 2)}
RANKS = 4


def magnitudes(args):
    """Per step, per weight matrix: sum over the ranks of sum |g|."""
    import torch
    torch.set_num_threads(2)
    cfg = dict(char_lm.SIZES["quick"])
    train, _ = char_lm.load_text()
    train_t = torch.tensor([min(c, 128) for c in train], dtype=torch.long)
    torch.manual_seed(args.seed)
    model = char_lm.build_model(torch, cfg)
    params = [(n, p) for n, p in model.named_parameters() if p.dim() >= 2]
    if args.optimizer == "adamw":
        opt = torch.optim.AdamW(model.parameters(), lr=cfg["lr"], weight_decay=0.01)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=cfg["lr"] * 100, momentum=0.9)
    ctx, batch = cfg["context"], cfg["batch"]
    gens = [torch.Generator().manual_seed(args.seed * 1000 + r) for r in range(RANKS)]
    out = []
    for _ in range(args.steps):
        summed = [torch.zeros_like(p) for p in model.parameters()]
        m = [0.0] * len(params)
        for r in range(RANKS):
            starts = torch.randint(0, len(train_t) - ctx - 1, (batch,), generator=gens[r])
            x = torch.stack([train_t[s:s + ctx] for s in starts])
            y = torch.stack([train_t[s + 1:s + ctx + 1] for s in starts])
            model.zero_grad()
            torch.nn.functional.cross_entropy(model(x).reshape(-1, char_lm.VOCAB), y.reshape(-1)).backward()
            for k, (_, p) in enumerate(params):
                m[k] += float(p.grad.abs().sum())
            for s, p in zip(summed, model.parameters()):
                s += p.grad
        for s, p in zip(summed, model.parameters()):
            p.grad = s / RANKS
        opt.step()
        out.append(m)
    return [n for n, _ in params], out


def replay(series, schedule):
    """Per law: (log(forecast / realized), realized energy, epoch) of every layer-epoch."""
    warmup, period, window, lag = schedule
    steps, layers = len(series), len(series[0])
    misses = {"power": [], "none": [], "rate": []}
    last = warmup - 1
    windows = []
    while last + lag + period <= steps:  # the epoch after it lies within the run
        windows.append(last)
        last += period
    for epoch, (before, now) in enumerate(zip(windows, windows[1:])):
        t0 = before + 1 - (window - 1) / 2  # middles counted from 1, as the controller's
        t1 = now + 1 - (window - 1) / 2
        t2 = now + 1 + lag + (period - 1) / 2
        first = now + lag  # the epoch's steps
        for layer in range(layers):
            m0 = sum(series[s][layer] for s in range(before - window + 1, before + 1)) / window
            m1 = sum(series[s][layer] for s in range(now - window + 1, now + 1)) / window
            realized = sum(series[s][layer] ** 2 for s in range(first, first + period)) / period
            ratio = min(max((m1 / m0) ** 2, 1 / 8), 8)
            forecasts = {"power": m1 * m1 * ratio ** (math.log(t2 / t1) / math.log(t1 / t0)),
                         "none": m1 * m1,
                         "rate": m1 * m1 * ratio ** ((t2 - t1) / (t1 - t0))}
            for law, f in forecasts.items():
                misses[law].append((math.log(f / realized), realized, epoch))
    return misses


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--optimizer", choices=("sgd", "adamw"), default="sgd")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    # Two windows and the epoch after the second, in every schedule.
    least = max(warmup - 1 + 2 * period + lag for warmup, period, _, lag in SCHEDULES.values())
    if args.steps < least:
        raise SystemExit("drift_law: --steps %d leaves a schedule no epoch to forecast (at least %d)" %
                         (args.steps, least))
    names, series = magnitudes(args)
    print("# %d weight matrices, %d steps, optimizer %s, seed %d" % (len(names), args.steps, args.optimizer,
                                                                     args.seed))
    print("# per law: mean log(forecast/realized) (bias), median |log|, share over-forecast; "
          "then the same with each layer-epoch weighed by its share of its epoch's energy")
    for title, schedule in SCHEDULES.items():
        misses = replay(series, schedule)
        for law, m in misses.items():
            logs = sorted(x for x, _, _ in m)
            over = sum(1 for x in logs if x > 0) / len(logs)
            # Each layer-epoch by its share of its epoch's energy, each epoch alike.
            total = {}
            for _, w, e in m:
                total[e] = total.get(e, 0.0) + w
            weighted = sum(x * w / total[e] for x, w, e in m) / len(total)
            weighted_abs = sum(abs(x) * w / total[e] for x, w, e in m) / len(total)
            print("%-28s %-6s layer-epochs %4d  bias %+.4f  median |log| %.4f  over %.2f  |  weighted bias %+.4f  "
                  "weighted |log| %.4f" % (title, law, len(logs), sum(logs) / len(logs),
                                           sorted(abs(x) for x in logs)[len(logs) // 2], over, weighted,
                                           weighted_abs))


if __name__ == "__main__":
    main()
