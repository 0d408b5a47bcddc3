#!/usr/bin/env python3
"""Real training through lgreco: a character transformer on the license texts every Debian
machine has (/usr/share/common-licenses), 4 ranks of DDP on gloo, gradients through
lgreco's DDP comm hook (lgreco.torch), against no compression.

    /usr/bin/python3 tests/accuracy/char_lm.py --size quick        # make test: ~2 minutes
    /usr/bin/python3 tests/accuracy/char_lm.py --size full         # make accuracy

Modes (each a separate 4-process job with the same seeds, data order and model):
  none       DDP's own allreduce (gloo), float32
  uniform    every compressible layer at quant:bits=4 (LGRECO_MODE=uniform)
  adaptive   L-GreCo over quant 2..8 bits, alpha 1, the normalized error metric (the defaults)
  topk       L-GreCo over quant 2..8 bits and TopK densities 0.1%..5%

Each job prints its final validation and training loss, the gradient bytes lgreco sent
(one encoding) over float32's, the mean bits per compressed value, and its wall time;
the runner prints one summary line per mode (`RESULT mode=... val_loss=...`) and, with
--check, asserts the quick variant's bounds (docs/PERF.md says where they come from),
reading rank 0's decision logs (kept in a temporary folder unless --decision-log says
where) for the bounds on each layer's relative error and on the bytes' swings.
--plot FILE draws the modes' training-loss curves and their gap to no compression
(matplotlib); --plot-from JSONL --plot FILE redraws them from an earlier --json file.

The data: each license text (symlinks resolved, each file once) split 90% / 10% by
position into training and validation text; bytes above 127 map to one symbol. The
schedule is shortened to fit (LGRECO_WARMUP/PERIOD 20 in quick, 50 in full, the window
5, the probe's lead 5); the defaults (100/100) would leave a short run no adaptive epochs.
"""

import argparse
import json
import math
import os
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.normpath(os.path.join(HERE, "..", ".."))
sys.path.insert(0, os.path.join(REPO, "tests", "python"))
import rank_launcher  # noqa: E402 (the ranks' launcher, shared with comm_hook_test.py)

LICENSES = "/usr/share/common-licenses"
VOCAB = 129  # bytes 0..127, and one symbol for everything above

SIZES = {
    # ~0.1M parameters: 3 blocks of width 48; 21 weight matrices (embeddings, q/k/v, attention
    # output, two MLP layers per block, head).
    "quick": dict(width=48, blocks=3, heads=4, context=32, batch=16, steps=150, lr=3e-3, schedule=(20, 20, 5, 2, 5)),
    # ~0.22M parameters: 4 blocks of width 64; 27 weight matrices. 800 steps, 15 adaptive
    # epochs: about 10 minutes per mode on 2 cores (0.34 s per step and rank on one core).
    "full": dict(width=64, blocks=4, heads=4, context=64, batch=16, steps=800, lr=3e-3,
                 schedule=(50, 50, 5, 2, 5)),
    # ~0.8M parameters, 1000 steps: 5.8 s per step and rank on one core, about 3 hours per
    # mode on 2 cores. For a machine with cores to spare (not run to the end so far).
    "large": dict(width=128, blocks=4, heads=4, context=128, batch=32, steps=1000, lr=2e-3,
                  schedule=(50, 50, 5, 2, 5)),
}

MODES = {
    "none": None,
    "uniform": {"LGRECO_MODE": "uniform"},
    "adaptive": {},
    "topk": {"LGRECO_CANDIDATES": ";".join(["quant:bits=%d" % b for b in range(2, 9)] +
                                           ["topk:density=%g" % d for d in (0.001, 0.0025, 0.005, 0.01, 0.02,
                                                                              0.05)])},
}


def load_text():
    seen, train, val = set(), bytearray(), bytearray()
    for name in sorted(os.listdir(LICENSES)):
        path = os.path.realpath(os.path.join(LICENSES, name))
        if path in seen or not os.path.isfile(path):
            continue
        seen.add(path)
        with open(path, "rb") as f:
            data = f.read()
        cut = int(len(data) * 0.9)
        train += data[:cut]
        val += data[cut:]
    if len(train) < 100000:
        raise SystemExit("char_lm: %s holds only %d bytes of text" % (LICENSES, len(train)))
    return train, val


def build_model(torch, cfg):
    nn = torch.nn

    class Block(nn.Module):
        def __init__(self, width, heads):
            super().__init__()
            self.norm1 = nn.LayerNorm(width)
            self.q = nn.Linear(width, width)
            self.k = nn.Linear(width, width)
            self.v = nn.Linear(width, width)
            self.out = nn.Linear(width, width)
            self.norm2 = nn.LayerNorm(width)
            self.fc1 = nn.Linear(width, 4 * width)
            self.fc2 = nn.Linear(4 * width, width)
            self.heads = heads

        def forward(self, x, mask):
            b, t, w = x.shape
            h = self.norm1(x)
            split = lambda z: z.view(b, t, self.heads, w // self.heads).transpose(1, 2)  # noqa: E731
            q, k, v = split(self.q(h)), split(self.k(h)), split(self.v(h))
            att = (q @ k.transpose(-2, -1)) / math.sqrt(w // self.heads)
            att = att.masked_fill(mask[:t, :t], float("-inf")).softmax(-1)
            x = x + self.out((att @ v).transpose(1, 2).reshape(b, t, w))
            return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.norm2(x))))

    class CharLM(nn.Module):
        def __init__(self):
            super().__init__()
            w = cfg["width"]
            self.embed = nn.Embedding(VOCAB, w)
            self.position = nn.Embedding(cfg["context"], w)
            self.blocks = nn.ModuleList(Block(w, cfg["heads"]) for _ in range(cfg["blocks"]))
            self.norm = nn.LayerNorm(w)
            self.head = nn.Linear(w, VOCAB)
            # A plain attribute, not a buffer: DDP would broadcast it, and gloo has no bool.
            self.mask = torch.triu(torch.ones(cfg["context"], cfg["context"], dtype=torch.bool), 1)

        def forward(self, idx):
            x = self.embed(idx) + self.position(torch.arange(idx.shape[1]))
            for block in self.blocks:
                x = block(x, self.mask)
            return self.head(self.norm(x))

    return CharLM()


def rank_main(args):
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    cfg = SIZES[args.size]
    dist.init_process_group("gloo", rank=rank, world_size=world)
    train, val = load_text()
    to_tensor = lambda b: torch.tensor([min(c, 128) for c in b], dtype=torch.long)  # noqa: E731
    train_t, val_t = to_tensor(train), to_tensor(val)
    torch.manual_seed(args.seed)
    model = build_model(torch, cfg)
    ddp = DDP(model)
    state = None
    if args.mode != "none":
        sys.path.insert(0, os.path.join(REPO, "python"))
        from lgreco.torch import CommHookState, comm_hook
        state = CommHookState(ddp)
        ddp.register_comm_hook(state, comm_hook)
    opt = torch.optim.AdamW(ddp.parameters(), lr=cfg["lr"], weight_decay=0.01) if args.optimizer == "adamw" else \
        torch.optim.SGD(ddp.parameters(), lr=cfg["lr"] * 100, momentum=0.9)
    ctx, batch = cfg["context"], cfg["batch"]
    # The same data order in every mode: batch k of rank r from one generator per (seed, rank).
    gen = torch.Generator().manual_seed(args.seed * 1000 + rank)
    losses = []
    start = time.time()
    for step in range(cfg["steps"]):
        starts = torch.randint(0, len(train_t) - ctx - 1, (batch,), generator=gen)
        x = torch.stack([train_t[s:s + ctx] for s in starts])
        y = torch.stack([train_t[s + 1:s + ctx + 1] for s in starts])
        loss = torch.nn.functional.cross_entropy(ddp(x).reshape(-1, VOCAB), y.reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss))
    wall = time.time() - start
    # Validation: the same fixed windows on every rank, with the (identical) model.
    model.eval()
    with torch.no_grad():
        vgen = torch.Generator().manual_seed(12345)
        starts = torch.randint(0, len(val_t) - ctx - 1, (64,), generator=vgen)
        x = torch.stack([val_t[s:s + ctx] for s in starts])
        y = torch.stack([val_t[s + 1:s + ctx + 1] for s in starts])
        val_loss = float(torch.nn.functional.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1)))
    result = {"mode": args.mode, "rank": rank, "val_loss": val_loss,
              "train_loss": sum(losses[-20:]) / len(losses[-20:]), "wall_s": wall,
              "parameters": sum(p.numel() for p in model.parameters()),
              "weight_sum": float(sum(p.double().sum() for p in model.parameters())),
              "losses": losses[::max(1, len(losses) // 100)], "loss_every": max(1, len(losses) // 100)}
    if state is not None:
        c = state.counters() or {}
        result.update(c)
        if c.get("uncompressed_bytes"):
            result["bytes_vs_fp32"] = c["encoded_bytes"] / c["uncompressed_bytes"]
            result["bits_per_value"] = 32 * c["encoded_bytes"] / c["uncompressed_bytes"]
        result["hook_calls_through_process_group"] = state.passed_through_calls
        state.close()
    print("RANK_RESULT " + json.dumps(result), flush=True)
    dist.destroy_process_group()


def run_mode(args, mode):
    cfg = SIZES[args.size]
    env = {k: v for k, v in os.environ.items() if not k.startswith("LGRECO_")}
    warmup, period, window, lag, lead = cfg["schedule"]
    env.update({"LGRECO_WARMUP": str(warmup), "LGRECO_PERIOD": str(period), "LGRECO_WINDOW": str(window),
                "LGRECO_SWITCH_LAG": str(lag), "LGRECO_PROBE_LEAD": str(lead), "OMP_NUM_THREADS": "1"})
    env.update(MODES[mode] or {})
    if MODES[mode] is not None:
        env.update(args.set)  # after the mode's own: an experiment's override wins
    if args.decision_log and MODES[mode] is not None:
        env["LGRECO_DECISION_LOG"] = "%s.%s.%%r.jsonl" % (args.decision_log, mode)  # %r: the rank
    cmd = [sys.executable, __file__, "--rank-main", "--mode", mode, "--size", args.size, "--seed", str(args.seed),
           "--optimizer", args.optimizer]
    try:
        return rank_launcher.launch(cmd, env, args.ranks, args.timeout, "RANK_RESULT ")
    except rank_launcher.RankError as e:
        raise SystemExit("char_lm: mode %s: %s" % (mode, e)) from None


def setting(text):
    name, eq, value = text.partition("=")
    if not eq or not name.startswith("LGRECO_"):
        raise argparse.ArgumentTypeError("%r: expected LGRECO_NAME=VALUE" % text)
    return name, value


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", choices=sorted(SIZES), default="quick")
    p.add_argument("--modes", default="none,uniform,adaptive,topk")
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--optimizer", choices=("adamw", "sgd"), default="adamw")
    p.add_argument("--timeout", type=int, default=900, help="seconds per mode")
    p.add_argument("--json", help="append each mode's summary as a JSON line to this file")
    p.add_argument("--check", action="store_true", help="assert the quick variant's bounds")
    p.add_argument("--set", metavar="LGRECO_NAME=VALUE", action="append", default=[], type=setting,
                   help="a library parameter for every compressed mode (repeatable), e.g. LGRECO_ERROR_METRIC=squared")
    p.add_argument("--decision-log", metavar="PREFIX",
                   help="each compressed mode's decision logs go to PREFIX.MODE.RANK.jsonl")
    p.add_argument("--plot", metavar="FILE", help="draw the modes' loss curves into FILE (.png, .svg; matplotlib)")
    p.add_argument("--plot-from", metavar="JSONL", help="draw --plot from the lines of an earlier run's --json file "
                                                          "instead of training")
    p.add_argument("--report", metavar="JSONL", help="print the issue's accuracy and bytes targets, met or not, from "
                                                     "the lines of earlier runs' --json file instead of training")
    p.add_argument("--rank-main", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--mode", help=argparse.SUPPRESS)
    args = p.parse_args()
    logs_dir = None  # held until main returns: the folder goes with it
    if args.check and not args.decision_log and not args.rank_main:
        logs_dir = tempfile.TemporaryDirectory(prefix="char_lm.")
        args.decision_log = os.path.join(logs_dir.name, "decisions")
    if args.rank_main:
        return rank_main(args)
    if args.report:
        return report(read_summaries(args.report))
    if args.plot_from:
        if not args.plot:
            raise SystemExit("char_lm: --plot-from needs --plot FILE")
        return plot_losses(read_summaries(args.plot_from), args.plot)
    summary = {}
    for mode in args.modes.split(","):
        if mode not in MODES:
            raise SystemExit("char_lm: unknown mode %r (modes: %s)" % (mode, ", ".join(MODES)))
        results, _ = run_mode(args, mode)
        r0 = results[0]
        same = len({r["weight_sum"] for r in results}) == 1
        line = {"mode": mode, "size": args.size, "seed": args.seed, "optimizer": args.optimizer, "ranks": args.ranks,
                "set": dict(args.set),
                "val_loss": r0["val_loss"], "train_loss": r0["train_loss"],
                "bytes_vs_fp32": r0.get("bytes_vs_fp32", 1.0), "bits_per_value": r0.get("bits_per_value", 32.0),
                "compressed_calls": r0.get("compressed_calls", 0), "calls": r0.get("calls", 0),
                "wall_s": max(r["wall_s"] for r in results), "parameters": r0["parameters"],
                "ranks_identical": same, "losses": r0["losses"], "loss_every": r0["loss_every"]}
        summary[mode] = line
        print("RESULT mode=%s val_loss=%.4f train_loss=%.4f bytes_vs_fp32=%.4f bits_per_value=%.2f "
              "compressed_calls=%d/%d wall_s=%.1f parameters=%d ranks_identical=%s" %
              (mode, line["val_loss"], line["train_loss"], line["bytes_vs_fp32"], line["bits_per_value"],
               line["compressed_calls"], line["calls"], line["wall_s"], line["parameters"], same), flush=True)
        if args.json:
            with open(args.json, "a") as f:
                f.write(json.dumps(line) + "\n")
    status = 0
    if args.plot:
        status = plot_losses(list(summary.values()), args.plot)
    if args.check:
        status = check(summary, args.decision_log) or status
    return status


def read_summaries(path):
    """The lines of a --json file (one mode of one run each)."""
    try:
        with open(path) as f:
            lines = [json.loads(line) for line in f if line.strip()]
    except (OSError, ValueError) as e:
        raise SystemExit("char_lm: cannot read %s: %s" % (path, e))
    for i, line in enumerate(lines, 1):
        if not isinstance(line, dict) or not {"mode", "losses", "val_loss", "bytes_vs_fp32"} <= set(line):
            raise SystemExit("char_lm: %s:%d: not a char_lm --json line" % (path, i))
    return lines


MODE_COLOURS = {"none": "black", "uniform": "tab:blue", "adaptive": "tab:red", "topk": "tab:green"}


def plot_losses(lines, path):
    """Training loss over the steps of every mode's rank 0 (the ranks train identical
    models), smoothed over 5 points with the raw points faint; the legend gives each
    mode's validation loss and bytes against float32. Lines of one mode with several
    seeds are drawn dashed after the first. Returns the exit status."""
    try:
        from matplotlib.figure import Figure
    except ImportError as e:
        print("char_lm: --plot needs matplotlib (%s): apt-get install python3-matplotlib" % e)
        return 1
    fig = Figure(figsize=(10, 8), layout="constrained")
    ax, gap = fig.subplots(2, 1, sharex=True, height_ratios=[3, 2])

    def smoothed(y):
        return [sum(y[max(0, i - 4):i + 1]) / len(y[max(0, i - 4):i + 1]) for i in range(len(y))]

    # The compressed modes' curves lie within a few percent of each other: the lower panel
    # draws each one's gap to no compression's of the same seed, where the differences show.
    reference = {line.get("seed"): smoothed(line["losses"]) for line in lines if line["mode"] == "none"}
    seen = set()
    for line in lines:
        mode = line["mode"]
        every = line.get("loss_every", 1)
        x = [i * every for i in range(len(line["losses"]))]
        smooth = smoothed(line["losses"])
        colour = MODE_COLOURS.get(mode, "tab:gray")
        style = "-" if mode not in seen else "--"
        seen.add(mode)
        label = "%s%s: val loss %.4f, %.4f of float32's bytes" % (
            mode, " (seed %s)" % line["seed"] if "seed" in line else "", line["val_loss"], line["bytes_vs_fp32"])
        ax.plot(x, line["losses"], ".", color=colour, alpha=0.2, ms=3)
        ax.plot(x, smooth, style, color=colour, lw=1.5, label=label)
        base = reference.get(line.get("seed"))
        if mode != "none" and base and len(base) == len(smooth):
            gap.plot(x, [a - b for a, b in zip(smooth, base)], style, color=colour, lw=1.5, label=label.split(":")[0])
    first = lines[0] if lines else {}
    ax.set_ylabel("training loss (rank 0, nats)")
    ax.set_title("char_lm %s, %s, %s ranks of DDP on gloo: training loss by mode (mean of 5 points; dots: raw)" % (
        first.get("size", "?"), first.get("optimizer", "?"), first.get("ranks", 4)))
    ax.legend(loc="upper right", fontsize="small")
    gap.axhline(0.0, color="black", lw=0.8)
    gap.set_xlabel("step")
    gap.set_ylabel("loss - no compression's")
    gap.set_title("gap to no compression (same seed, both smoothed)")
    if gap.get_lines()[1:]:
        gap.legend(loc="upper right", fontsize="small")
    for a in (ax, gap):
        a.grid(True, alpha=0.3)
    try:
        fig.savefig(path, dpi=100)
    except (OSError, ValueError) as e:
        print("char_lm: cannot write %s: %s" % (path, getattr(e, "strerror", None) or e))
        return 1
    print("char_lm: loss curves of %d runs: %s" % (len(lines), path))
    return 0


def report(lines):
    """The targets of real training (docs/PERF.md, "Real training"), from --json lines of
    one size and optimizer: adaptive's validation loss within 1% of no compression's and
    no worse than uniform 4 bits' beyond uniform's spread over its seeds (max - min), and
    adaptive sending at least 1.3x fewer bytes than uniform. Seeds that ran in both modes
    are compared pairwise; the spread is over every uniform seed. Prints one line per
    mode and one per target; returns 0 (a report, not a check)."""
    kinds = {(line.get("size"), line.get("optimizer"), json.dumps(line.get("set", {}), sort_keys=True))
             for line in lines}
    if len(kinds) > 1:
        raise SystemExit("char_lm: --report: the lines mix sizes, optimizers or --set parameters (%s); give it one "
                         "experiment's file" % "; ".join(sorted(str(k) for k in kinds)))
    by_mode = {}
    for line in lines:
        by_mode.setdefault(line["mode"], {})[line.get("seed")] = line  # a rerun's line replaces the earlier
    for mode, runs in by_mode.items():
        vals = [r["val_loss"] for r in runs.values()]
        print("MODE %s seeds=%s val_loss mean=%.4f min=%.4f max=%.4f bytes_vs_fp32=%.4f" % (
            mode, ",".join(str(s) for s in sorted(runs)), sum(vals) / len(vals), min(vals), max(vals),
            sum(r["bytes_vs_fp32"] for r in runs.values()) / len(runs)))
    none, uniform = by_mode.get("none", {}), by_mode.get("uniform", {})
    spread = max(r["val_loss"] for r in uniform.values()) - min(r["val_loss"] for r in uniform.values()) \
        if len(uniform) >= 2 else None
    print("uniform's spread over %d seeds: %s" % (len(uniform), "%.4f" % spread if spread is not None else
                                                  "unknown (needs 2 or more seeds)"))
    def verdict(ok):
        return "unknown" if ok is None else ("met" if ok else "NOT met")

    def shown(fmt, value):
        return "?" if value is None else fmt % value

    for mode in ("adaptive", "topk"):
        for seed, run in sorted(by_mode.get(mode, {}).items()):
            base, uni = none.get(seed), uniform.get(seed)
            rel = run["val_loss"] / base["val_loss"] - 1 if base else None
            gap = run["val_loss"] - uni["val_loss"] if uni else None
            ratio = uni["bytes_vs_fp32"] / run["bytes_vs_fp32"] if uni else None
            print("TARGET %s seed=%s vs_none=%s (<= +1%%: %s) vs_uniform=%s (<= spread: %s) "
                  "fewer_bytes_than_uniform=%s (>= 1.3x: %s)" % (
                      mode, seed,
                      shown("%+.2f%%", None if rel is None else 100 * rel),
                      verdict(None if rel is None else rel <= 0.01),
                      shown("%+.4f", gap), verdict(None if gap is None or spread is None else gap <= spread),
                      shown("%.3fx", ratio), verdict(None if ratio is None else ratio >= 1.3)))
    return 0


def decisions(prefix, mode):
    """Rank 0's decision log of a mode, one dict per solve; [] without one."""
    path = "%s.%s.0.jsonl" % (prefix, mode) if prefix else None
    if not path or not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


RELATIVE_SLACK = 1.25  # a window's realized relative error over its solve's bound


def check_decisions(mode, log):
    """Issue 24's bounds on the steady epochs, from the decision log: each layer's realized
    relative error in a window at most 1.25x the bound the solve in effect held its
    prediction to (docs/CONTROLLER.md, "What the optimizer sees": the window comes an epoch
    after the solve's, and measured up to 1.09x); each epoch's bytes within 25% of the
    epoch before's, from the third adaptive epoch on."""
    failures = []
    # Line i's window measured line i-1's assignment; line 1's window the first adaptive
    # epoch, where the residuals of the default still drain: steady from line 2 on.
    for i in range(2, len(log)):
        before, now = log[i - 1], log[i]
        for was, layer in zip(before["layers"], now["layers"]):
            bound = was.get("relative_bound", 0)
            if bound > 0 and layer.get("window_relative", 0) > RELATIVE_SLACK * bound:
                failures.append("%s: epoch %d, layer %s realized relative error %.4f above %g x its bound %.4f" %
                                (mode, before["epoch"], layer["name"], layer["window_relative"], RELATIVE_SLACK, bound))
        if i >= 3 and abs(now["bytes"] - before["bytes"]) > 0.25 * before["bytes"]:
            failures.append("%s: epoch %d sends %d bytes, epoch %d %d: more than 25%% apart" %
                            (mode, now["epoch"], now["bytes"], before["epoch"], before["bytes"]))
    return failures


def check(summary, decision_log=None):
    """The quick variant's bounds (docs/PERF.md, "Real training")."""
    failures = []
    for mode in ("adaptive", "topk"):
        if mode in summary:
            log = decisions(decision_log, mode)
            if len(log) < 4:
                failures.append("%s: %d decisions in rank 0's log, expected at least 4" % (mode, len(log)))
            failures += check_decisions(mode, log)
    none = summary.get("none")
    for mode, s in summary.items():
        if not s["ranks_identical"]:
            failures.append("%s: the ranks' weights differ" % mode)
        if not math.isfinite(s["val_loss"]):
            failures.append("%s: validation loss %r" % (mode, s["val_loss"]))
        if mode != "none":
            if s["compressed_calls"] < s["calls"] * 0.9 or s["calls"] == 0:
                failures.append("%s: %d of %d calls compressed" % (mode, s["compressed_calls"], s["calls"]))
            if none and s["val_loss"] > none["val_loss"] * 1.05:
                failures.append("%s: validation loss %.4f, more than 5%% above no compression's %.4f" %
                                (mode, s["val_loss"], none["val_loss"]))
    uniform, adaptive = summary.get("uniform"), summary.get("adaptive")
    if uniform and adaptive and not adaptive["bytes_vs_fp32"] < uniform["bytes_vs_fp32"]:
        failures.append("adaptive sent %.4f of float32's bytes, not fewer than uniform's %.4f" %
                        (adaptive["bytes_vs_fp32"], uniform["bytes_vs_fp32"]))
    for f in failures:
        print("FAIL " + f)
    print("char_lm check: %s" % ("FAILED" if failures else "passed"))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
