#!/usr/bin/env python3
"""Tests of tests/accuracy/char_lm.py --report: the real-training targets' verdicts from
--json lines (no training, no torch).

    /usr/bin/python3 tests/python/char_lm_report_test.py
"""

import json
import os
import subprocess
import sys
import tempfile
import unittest

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
CHAR_LM = os.path.join(REPO, "tests", "accuracy", "char_lm.py")


def line(mode, seed, val, fraction, **extra):
    out = {"mode": mode, "seed": seed, "size": "full", "optimizer": "adamw", "set": {}, "val_loss": val,
           "bytes_vs_fp32": fraction, "losses": [val]}
    out.update(extra)
    return out


class ReportTest(unittest.TestCase):
    def report(self, lines):
        with tempfile.NamedTemporaryFile("w", suffix=".jsonl", delete=False) as f:
            f.write("".join(json.dumps(x) + "\n" for x in lines))
        try:
            return subprocess.run([sys.executable, CHAR_LM, "--report", f.name], capture_output=True, text=True,
                                  timeout=60)
        finally:
            os.unlink(f.name)

    def targets(self, out):
        # "TARGET MODE seed=S ..." by (MODE, S)
        return {(t.split()[1], t.split()[2].split("=")[1]): t for t in out.splitlines() if t.startswith("TARGET ")}

    def test_each_target_is_judged_on_its_own_seed(self):
        r = self.report([line("none", 1, 2.000, 1.0), line("none", 2, 1.900, 1.0),
                         line("uniform", 1, 2.010, 0.14), line("uniform", 2, 1.930, 0.14),
                         line("uniform", 3, 1.990, 0.14),
                         # seed 1: +0.75% over none, +0.005 over uniform (spread 0.08), 1.4x fewer bytes.
                         line("adaptive", 1, 2.015, 0.10),
                         # seed 2: +3.7% over none, +0.04 over uniform, 1.17x fewer bytes.
                         line("adaptive", 2, 1.970, 0.12)])
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIn("uniform's spread over 3 seeds: 0.0800", r.stdout)
        t = self.targets(r.stdout)
        self.assertIn("vs_none=+0.75%", t[("adaptive", "1")])
        self.assertIn("vs_uniform=+0.0050 (<= spread: met)", t[("adaptive", "1")])
        self.assertIn("(<= +1%: met)", t[("adaptive", "1")])
        self.assertIn("fewer_bytes_than_uniform=1.400x (>= 1.3x: met)", t[("adaptive", "1")])
        self.assertIn("vs_none=+3.68% (<= +1%: NOT met)", t[("adaptive", "2")])
        self.assertIn("vs_uniform=+0.0400 (<= spread: met)", t[("adaptive", "2")])
        self.assertIn("(>= 1.3x: NOT met)", t[("adaptive", "2")])
        self.assertIn("MODE uniform seeds=1,2,3 val_loss mean=1.9767", r.stdout)

    def test_beyond_the_spread_and_unknowns(self):
        r = self.report([line("uniform", 1, 2.0, 0.14), line("uniform", 2, 2.01, 0.14), line("topk", 1, 2.05, 0.13),
                         line("topk", 3, 2.0, 0.13)])
        self.assertEqual(r.returncode, 0, r.stderr)
        t = self.targets(r.stdout)
        self.assertIn("vs_none=? (<= +1%: unknown)", t[("topk", "1")])
        self.assertIn("vs_uniform=+0.0500 (<= spread: NOT met)", t[("topk", "1")])
        self.assertIn("vs_uniform=? (<= spread: unknown)", t[("topk", "3")])
        one = self.report([line("uniform", 1, 2.0, 0.14), line("adaptive", 1, 2.0, 0.1)])
        self.assertIn("unknown (needs 2 or more seeds)", one.stdout)
        self.assertIn("(<= spread: unknown)", one.stdout)

    def test_lines_of_different_experiments_are_refused(self):
        r = self.report([line("uniform", 1, 2.0, 0.14), line("uniform", 2, 2.0, 0.14, optimizer="sgd")])
        self.assertNotEqual(r.returncode, 0)
        self.assertIn("mix sizes, optimizers or --set parameters", r.stdout + r.stderr)
        bad = self.report([{"mode": "none"}])
        self.assertNotEqual(bad.returncode, 0)
        self.assertIn("not a char_lm --json line", bad.stdout + bad.stderr)


if __name__ == "__main__":
    unittest.main(verbosity=2)
