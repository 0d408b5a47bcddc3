#!/usr/bin/env python3
"""How much of lgreco's DDP comm hook exchange hides behind backward: a measurement, not a test.

    /usr/bin/python3 tests/python/hook_overlap.py [--ranks 2] [--steps 40]

Two ranks of gloo DDP train an MLP of 8 layers of 512x512 (one layer per 1 MiB bucket,
so DDP hands the hook a bucket as soon as that layer's gradient is ready) in three modes:
  gloo      DDP's own allreduce
  hook      lgreco's comm hook: the exchange runs on the hook's worker thread and DDP's
            future completes from there, while autograd computes the next layers
  blocking  the same hook, waited for inside the hook (what a hook without a worker
            thread would do): autograd stalls for every bucket
For the steps after the first 10 (the hook compresses from iteration 2; its first
adaptive decisions come later, and the default schedule leaves this run at the default
codec), each mode prints the median step time (forward, backward and the wait for the
last bucket), the median time backward waited after its last gradient was computed
(the exposed exchange), and the median sum of the buckets' exchange times (from the
hook's call to its future's completion). With the worker thread the exposed part is a
fraction of the exchanges; blocking, the step pays all of them.
"""

import argparse
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.normpath(os.path.join(HERE, "..", ".."))
sys.path.insert(0, HERE)
import rank_launcher  # noqa: E402

WIDTH, LAYERS, BATCH, SKIP = 512, 8, 16, 10


def rank_main(mode, steps):
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    sys.path.insert(0, os.path.join(REPO, "python"))
    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    layers = []
    for _ in range(LAYERS):
        layers += [torch.nn.Linear(WIDTH, WIDTH), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers)
    ddp = DDP(model, bucket_cap_mb=1)
    exchanges = []  # (call, completion) per bucket of the current step
    state = None
    if mode != "gloo":
        from lgreco.torch import CommHookState, comm_hook
        state = CommHookState(ddp)

        def timed_hook(hook_state, bucket):
            called = time.perf_counter()
            future = comm_hook(hook_state, bucket)
            slot = [called, None]
            exchanges.append(slot)

            def finished(f):
                slot[1] = time.perf_counter()
                return f.value()
            chained = future.then(finished)
            if mode == "blocking":
                chained.wait()
            return chained
        ddp.register_comm_hook(state, timed_hook)
    last_grad = [0.0]
    # The first layer's weight gets its gradient last in backward.
    model[0].weight.register_hook(lambda g: last_grad.__setitem__(0, time.perf_counter()))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(100 + rank)
    rows = []
    for _ in range(steps):
        x = torch.randn(BATCH, WIDTH, generator=g)
        exchanges.clear()
        start = time.perf_counter()
        loss = ddp(x).square().mean()
        opt.zero_grad()
        loss.backward()
        end = time.perf_counter()
        opt.step()
        rows.append({"step": end - start, "exposed": end - last_grad[0],
                     "exchange": sum(done - called for called, done in exchanges if done is not None)})
    out = {"rows": rows[SKIP:]}
    if state is not None:
        out["compressed_calls"] = state.compressed_calls
        state.close()
    print("OVERLAP " + json.dumps(out), flush=True)
    dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--rank-main", metavar="MODE", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.steps <= SKIP:
        raise SystemExit("hook_overlap: --steps must be above %d (the steps left out)" % SKIP)
    if args.rank_main:
        return rank_main(args.rank_main, args.steps)
    env = {k: v for k, v in os.environ.items() if not k.startswith("LGRECO_")}
    env["OMP_NUM_THREADS"] = "1"
    for mode in ("gloo", "hook", "blocking"):
        cmd = [sys.executable, __file__, "--rank-main", mode, "--steps", str(args.steps)]
        try:
            results, _ = rank_launcher.launch(cmd, env, args.ranks, 600, "OVERLAP ")
        except rank_launcher.RankError as e:
            raise SystemExit("hook_overlap: mode %s: %s" % (mode, e)) from None
        rows = results[0]["rows"]

        def median_ms(key):
            return 1e3 * statistics.median(r[key] for r in rows)
        print("MODE %-8s step_ms=%.1f exposed_ms=%.1f exchange_ms=%s compressed_calls=%s" % (
            mode, median_ms("step"), median_ms("exposed"),
            "%.1f" % median_ms("exchange") if mode != "gloo" else "-", results[0].get("compressed_calls", "-")),
            flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
