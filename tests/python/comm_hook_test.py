#!/usr/bin/env python3
"""Tests of lgreco's DDP comm hook (lgreco.torch.comm_hook), 2 ranks of gloo DDP on the CPU.

    /usr/bin/python3 tests/python/comm_hook_test.py      (after make: it loads build/lib/liblgreco.so)

Each case starts two rank processes (this file with --rank-main) that train the same
small MLP on the same data: once with DDP's own allreduce, once with the hook. Checked:
the ranks end with identical weights; iterations 0 and 1 go through the process group and
every later call through the engine; the trained weights stay close to the plain run's
(compression error, not a different computation); an invalid parameter on every rank, or
a configuration that differs between the ranks, makes every call pass through to the
process group, so the result equals the plain run's bit for bit.
"""

import json
import os
import sys
import unittest

import rank_launcher  # tests/python, this file's folder (first on sys.path)

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
STEPS = 30


def rank_main(mode):
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    sys.path.insert(0, os.path.join(REPO, "python"))
    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 256), torch.nn.ReLU(),
                                torch.nn.Linear(256, 10))
    # 1.3 MB of gradients: after DDP's rebuild, a first bucket of at most 1 MiB and a second.
    ddp = DDP(model, bucket_cap_mb=0.5)
    state = None
    if mode == "hook":
        from lgreco.torch import CommHookState, comm_hook
        state = CommHookState(ddp)
        ddp.register_comm_hook(state, comm_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(100 + rank)
    for _ in range(STEPS):
        x = torch.randn(32, 64, generator=g)
        y = torch.randint(0, 10, (32,), generator=g)
        loss = torch.nn.functional.cross_entropy(ddp(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).double()
    out = {"weights": flat.tolist()[:4096], "norm": float(flat.norm())}
    if state is not None:
        out["counters"] = state.counters()
        out["through_process_group"] = state.passed_through_calls
        out["compressed_calls"] = state.compressed_calls
        out["iterations"] = state.iteration + 1
        state.close()
    print("RESULT " + json.dumps(out), flush=True)
    dist.destroy_process_group()


def run(mode, env_by_rank=None, ranks=2):
    base = {k: v for k, v in os.environ.items() if not k.startswith("LGRECO_")}
    base.update({"LGRECO_WARMUP": "4", "LGRECO_PERIOD": "5", "LGRECO_WINDOW": "2", "LGRECO_SWITCH_LAG": "2",
                 "LGRECO_PROBE_LEAD": "1", "LGRECO_DEBUG": "WARN", "OMP_NUM_THREADS": "1"})
    try:
        return rank_launcher.launch([sys.executable, __file__, "--rank-main", mode], base, ranks, 240, "RESULT ",
                                    env_by_rank)
    except rank_launcher.RankError as e:
        raise AssertionError("mode %s: %s" % (mode, e)) from None


class CommHook(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        try:
            import importlib
            importlib.import_module("torch")
        except ImportError:
            raise unittest.SkipTest("torch is not importable by %s" % sys.executable)
        cls.plain, _ = run("plain")

    def test_the_ranks_agree_and_every_call_after_iteration_1_is_compressed(self):
        results, logs = run("hook")
        a, b = results
        self.assertEqual(a["weights"], b["weights"], "the ranks' weights differ")
        # Iterations 0 and 1 (before and after DDP's rebuild) through the process group,
        # every later one through the engine.
        buckets = a["counters"]["calls"] // (STEPS - 2)
        self.assertEqual(buckets, 2)
        self.assertEqual(a["counters"]["calls"], (STEPS - 2) * buckets)
        self.assertGreaterEqual(a["through_process_group"], buckets + 1)  # iteration 0 may have fewer buckets
        self.assertLessEqual(a["through_process_group"], 8)
        self.assertEqual(a["compressed_calls"], (STEPS - 2) * buckets)
        self.assertEqual(a["counters"]["compressed_calls"], (STEPS - 2) * buckets)
        self.assertLess(a["counters"]["encoded_bytes"], a["counters"]["uncompressed_bytes"] * 0.25)
        # Compressed, so not equal to the plain run; close to it.
        diff = sum((x - y) ** 2 for x, y in zip(a["weights"], self.plain[0]["weights"])) ** 0.5
        ref = sum(y * y for y in self.plain[0]["weights"]) ** 0.5
        self.assertGreater(diff, 0)
        self.assertLess(diff / ref, 0.05, "the hook's training drifted %.3f from the plain run's" % (diff / ref))
        self.assertNotIn("Traceback", "".join(logs))

    def test_an_invalid_parameter_passes_every_call_to_the_process_group(self):
        results, logs = run("hook", {0: {"LGRECO_ALPHA": "-1"}, 1: {"LGRECO_ALPHA": "-1"}})
        for r in results:
            self.assertEqual(r["compressed_calls"], 0)
            self.assertEqual(r["weights"], self.plain[0]["weights"], "pass-through must be the plain allreduce")
        self.assertIn("LGRECO_ALPHA", "".join(logs))

    def test_ranks_that_disagree_pass_through_together(self):
        results, logs = run("hook", {1: {"LGRECO_CODEC": "quant:bits=3"}})
        for r in results:
            self.assertEqual(r["compressed_calls"], 0)
            self.assertEqual(r["weights"], self.plain[0]["weights"])
        self.assertIn("differ", "".join(logs))


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--rank-main":
        rank_main(sys.argv[2])
        sys.exit(0)
    unittest.main(verbosity=2)
