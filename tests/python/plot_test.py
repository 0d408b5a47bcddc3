#!/usr/bin/env python3
"""Tests of `lgreco plot` (python/lgreco/plot.py) on decision logs lgreco-demo writes.

    /usr/bin/python3 tests/python/plot_test.py      (after make: it runs build/bin/lgreco-demo)

The demo runs a small registration on 4 ranks with TopK among the candidates; its rank 0
decision log is what a job's LGRECO_DECISION_LOG holds. Checked: the command draws it
(exit 0, a PNG); the heat map's matrix is the log's codecs, epoch 0 the defaults; the
rendered cells have the colour scale's colours; a file a restarted job appended to holds
two runs and --run picks one; every bad input (no file, not JSON, another format
version, a missing field, an empty file, no matplotlib, an unwritable output, --run out
of range) ends in one message naming it and exit status 1, with no picture written.
The drawing cases need matplotlib (Debian python3-matplotlib, which make deps installs):
without it they fail, they are not skipped.
"""

import json
import os
import shutil
import subprocess
import sys
import tempfile
import unittest

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
DEMO = os.path.join(os.environ.get("LGRECO_TEST_BIN_DIR", os.path.join(REPO, "build", "bin")), "lgreco-demo")
sys.path.insert(0, os.path.join(REPO, "python"))

from lgreco import LgrecoError, plot  # noqa: E402

# Two buckets, four adaptive layers (one bucket bfloat16), three kept float32: the
# registration tests/unit/demo_test.cc runs.
REGISTRATION = os.path.join(REPO, "tests", "data", "tiny_registration.json")
SOLVES = 3  # --steps 17: epochs 1, 2, 3 solved


def run_plot(args, env_extra=None):
    env = dict(os.environ, PYTHONPATH=os.path.join(REPO, "python"))
    env.update(env_extra or {})
    return subprocess.run([sys.executable, "-m", "lgreco", "plot"] + args, env=env, capture_output=True, text=True,
                          timeout=300)


class PlotTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.dir = tempfile.mkdtemp(prefix="lgreco-plot-test-")
        reg = REGISTRATION
        cls.log = os.path.join(cls.dir, "decisions.jsonl")
        if not os.access(DEMO, os.X_OK):
            raise RuntimeError("%s is missing: run make first" % DEMO)
        r = subprocess.run([DEMO, "--steps", "17", "--families", "quant,topk", "--registration", reg,
                            "--decision-log", cls.log], capture_output=True, text=True, timeout=600)
        if r.returncode != 0:
            raise RuntimeError("lgreco-demo failed (%d):\n%s%s" % (r.returncode, r.stdout, r.stderr))
        with open(cls.log) as f:
            cls.lines = [json.loads(line) for line in f if line.strip()]

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.dir, ignore_errors=True)

    def path(self, name):
        return os.path.join(self.dir, name)

    def write(self, name, text):
        with open(self.path(name), "w") as f:
            f.write(text)
        return self.path(name)

    def assert_fails(self, args, *needles, env_extra=None):
        """exit 1, one line on stderr that names the problem, nothing on stdout."""
        r = run_plot(args, env_extra)
        self.assertEqual(r.returncode, 1, r.stdout + r.stderr)
        lines = r.stderr.splitlines()
        self.assertEqual(len(lines), 1, r.stderr)
        self.assertTrue(lines[0].startswith("lgreco plot: error: "), r.stderr)
        for needle in needles:
            self.assertIn(needle, lines[0])
        self.assertEqual(r.stdout, "")
        return lines[0]

    # ---- reading the log (stdlib only) ------------------------------------------------

    def test_the_log_loads_as_one_run_of_the_solves(self):
        self.assertEqual(len(self.lines), SOLVES)
        runs = plot.load(self.log)
        self.assertEqual(len(runs), 1)
        self.assertEqual([r["epoch"] for r in runs[0]], [1, 2, 3])
        self.assertEqual([r["_line"] for r in runs[0]], [1, 2, 3])

    def test_the_grid_is_the_logs_codecs_with_the_defaults_first(self):
        grid = plot.Grid(plot.load(self.log)[0])
        names = [layer["name"] for layer in self.lines[0]["layers"]]
        self.assertEqual(grid.names, names)
        self.assertEqual(len(names), 4)
        self.assertEqual(grid.epochs, [0, 1, 2, 3])
        for r, name in enumerate(names):
            default = self.lines[0]["layers"][r]["default_codec"]
            self.assertTrue(default.startswith("quant:bits=4,"), default)
            expected = [default] + [line["layers"][r]["codec"] for line in self.lines]
            self.assertEqual(grid.codec[r], expected, name)
        used = {c for row in grid.codec for c in row}
        self.assertEqual(set(grid.order), used)
        self.assertTrue(any(c.startswith("topk:") for c in used), used)  # what the demo test also checks
        # Quantization by bits first, then TopK by density.
        families = [plot.describe_codec(c)[0] for c in grid.order]
        self.assertEqual(families, sorted(families, key=["quant", "topk"].index))
        # The window a solve read measured the epoch before it.
        for r in range(len(names)):
            for e, line in enumerate(self.lines):
                self.assertEqual(grid.relative[r][e], line["layers"][r].get("window_relative"))
            self.assertIsNone(grid.relative[r][-1])
        # Bucket groups from the names' "b/" prefix, in the log's order.
        prefixes = [n.split("/", 1)[0] for n in names]
        self.assertEqual([g[2] for g in grid.groups], sorted(set(prefixes), key=prefixes.index))

    def test_codec_descriptions(self):
        self.assertEqual(plot.describe_codec("quant:bits=3,bucket=1024,rounding=stochastic"), ("quant", 3, "3 bits"))
        self.assertEqual(plot.describe_codec("topk:density=0.0025"), ("topk", 0.0025, "topk 0.25%"))
        self.assertEqual(plot.describe_codec("powersgd:rank=4,warm_start=1"), ("powersgd", 4, "rank 4"))
        self.assertEqual(plot.describe_codec("none"), ("none", 0, "none (float)"))
        self.assertEqual(plot.describe_codec("quant:bucket=1024"), ("other", 0, "quant:bucket=1024"))
        order = plot.codec_order(["topk:density=0.01", "quant:bits=8", "quant:bits=2", "topk:density=0.001",
                                  "powersgd:rank=2", "none", "quant:bits=2"])
        self.assertEqual(order, ["quant:bits=2", "quant:bits=8", "topk:density=0.001", "topk:density=0.01",
                                 "powersgd:rank=2", "none"])
        # Two codecs with one label are told apart by their text.
        self.assertEqual(plot.codec_labels(["quant:bits=4,bucket=512", "quant:bits=4,bucket=1024", "quant:bits=2"]),
                         ["quant:bits=4,bucket=512", "quant:bits=4,bucket=1024", "2 bits"])

    def test_restarted_job_appends_a_second_run(self):
        with open(self.log) as f:
            text = f.read()
        doubled = self.write("doubled.jsonl", text + "\n" + text)  # a blank line between is allowed
        runs = plot.load(doubled)
        self.assertEqual(len(runs), 2)
        self.assertEqual(runs[1][0]["_line"], SOLVES + 2)
        self.assertEqual([r["epoch"] for r in runs[1]], [1, 2, 3])

    def test_bad_logs_name_file_and_line(self):
        good = json.dumps(self.lines[0])
        cases = [
            ("notjson.jsonl", good + "\n{not json\n", "notjson.jsonl:2: not JSON"),
            ("array.jsonl", "[1, 2]\n", "array.jsonl:1: a decision-log line is a JSON object"),
            ("v0.jsonl", json.dumps({k: v for k, v in self.lines[0].items() if k != "log_version"}) + "\n",
             "v0.jsonl:1: no log_version"),
            ("v2.jsonl", json.dumps(dict(self.lines[0], log_version=2)) + "\n",
             "v2.jsonl:1: a decision log of format version 2; this lgreco reads version 1"),
            ("nobudget.jsonl", good + "\n" + json.dumps({k: v for k, v in self.lines[1].items() if k != "budget"}),
             "nobudget.jsonl:2: no 'budget' in the line"),
            ("nan.jsonl", json.dumps(dict(self.lines[0], solve_ms="fast")) + "\n",
             "nan.jsonl:1: 'solve_ms' is \"fast\"; expected a finite number"),
            ("nolayers.jsonl", json.dumps(dict(self.lines[0], layers=[])) + "\n",
             "nolayers.jsonl:1: 'layers' is empty"),
            ("noname.jsonl", json.dumps(dict(self.lines[0], layers=[{"codec": "none"}])) + "\n",
             "noname.jsonl:1: layers[0]: 'name' is null; expected a string"),
            ("empty.jsonl", "\n\n", "empty.jsonl: no decision in it"),
            ("binary.jsonl", None, "binary.jsonl: not text (byte 0 is not UTF-8)"),
        ]
        for name, text, needle in cases:
            with self.subTest(name=name):
                if text is None:
                    with open(self.path(name), "wb") as f:
                        f.write(b"\xff\xfe\x00")
                    path = self.path(name)
                else:
                    path = self.write(name, text)
                with self.assertRaises(LgrecoError) as caught:
                    plot.load(path)
                self.assertIn(needle, str(caught.exception))
                # The command says the same, once, and draws nothing.
                out = self.path(name + ".png")
                self.assert_fails([path, "-o", out], needle)
                self.assertFalse(os.path.exists(out))

    def test_missing_log(self):
        missing = self.path("none.jsonl")
        self.assert_fails([missing], "cannot read the decision log %s: No such file or directory" % missing)

    def test_run_out_of_range(self):
        self.assert_fails([self.log, "--run", "2", "-o", self.path("x.png")], "--run 2: ", "holds 1 run")
        self.assert_fails([self.log, "--run", "0", "-o", self.path("x.png")], "--run 0: ")

    def test_usage_errors_exit_2(self):
        for args in ([], ["--bogus", self.log], [self.log, "--run", "x"]):
            r = run_plot(args)
            self.assertEqual(r.returncode, 2, args)
            self.assertIn("usage: lgreco plot", r.stderr)
        r = run_plot(["--help"])
        self.assertEqual(r.returncode, 0)
        self.assertIn("DECISION_LOG", r.stdout)

    def test_no_matplotlib_names_the_package(self):
        # A matplotlib that cannot be imported, first on the path: what a machine without it sees.
        fake = os.path.join(self.dir, "fake")
        os.makedirs(os.path.join(fake, "matplotlib"), exist_ok=True)
        with open(os.path.join(fake, "matplotlib", "__init__.py"), "w") as f:
            f.write("raise ImportError('No module named matplotlib (a test stand-in)')\n")
        out = self.path("nompl.png")
        pythonpath = os.pathsep.join([fake, os.path.join(REPO, "python")])
        self.assert_fails([self.log, "-o", out], "needs matplotlib", "apt-get install python3-matplotlib",
                          "pip install matplotlib", env_extra={"PYTHONPATH": pythonpath})
        self.assertFalse(os.path.exists(out))

    # ---- drawing (matplotlib) ---------------------------------------------------------

    def test_the_command_draws_a_png_by_default_next_to_the_log(self):
        log = self.path("drawn.jsonl")
        shutil.copy(self.log, log)
        r = run_plot([log])
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        png = self.path("drawn.png")
        self.assertIn("lgreco plot: %s: 3 epochs, 4 layers, codecs " % png, r.stdout)
        self.assertEqual(r.stderr, "")
        with open(png, "rb") as f:
            head = f.read(24)
        self.assertEqual(head[:8], b"\x89PNG\r\n\x1a\n")
        width, height = int.from_bytes(head[16:20], "big"), int.from_bytes(head[20:24], "big")
        self.assertGreater(width, 600)
        self.assertGreater(height, 500)
        # The suffix picks the format.
        svg = self.path("drawn.svg")
        r = run_plot([log, "-o", svg, "--title", "tiny, quant and topk"])
        self.assertEqual(r.returncode, 0, r.stderr)
        with open(svg) as f:
            text = f.read()
        self.assertIn("<svg", text)

    def test_two_runs_draws_the_last_and_says_so(self):
        with open(self.log) as f:
            text = f.read()
        doubled = self.write("twice.jsonl", text + text)
        r = run_plot([doubled, "-o", self.path("twice.png")])
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIn("holds 2 runs", r.stderr)
        self.assertIn("drawing run 2, from line %d" % (SOLVES + 1), r.stderr)
        r = run_plot([doubled, "--run", "1", "-o", self.path("first.png")])
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIn("drawing run 1, from line 1", r.stderr)

    def test_unwritable_output(self):
        self.assert_fails([self.log, "-o", "/proc/lgreco-none/x.png"], "cannot write /proc/lgreco-none/x.png")

    def test_heat_map_cells_have_the_scales_colours(self):
        import numpy as np
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        fig, axes, grid = plot.figure(plot.load(self.log)[0])
        self.assertEqual(set(axes), {"codec", "relative", "bytes", "error", "alpha", "solve"})
        canvas = FigureCanvasAgg(fig)
        canvas.draw()
        pixels = np.asarray(canvas.buffer_rgba())[:, :, :3].astype(float) / 255.0
        height = pixels.shape[0]
        colours = plot.codec_colours(grid.order)
        self.assertEqual(len(set(colours)), len(colours))  # every codec its own colour
        ax = axes["codec"]
        for r in range(len(grid.names)):
            for c in range(len(grid.epochs)):
                x, y = ax.transData.transform((c, r))
                got = pixels[int(round(height - y)), int(round(x))]
                want = colours[grid.order.index(grid.codec[r][c])]
                self.assertLess(np.abs(got - np.array(want)).max(), 2.5 / 255, (r, c, grid.codec[r][c]))
        # The colour bar names every codec of the run.
        labels = [t.get_text() for t in fig.axes[1].get_yticklabels()]
        self.assertEqual(labels, plot.codec_labels(grid.order))
        # The error panel draws the solves' predicted error over the budget.
        predicted = axes["error"].get_lines()[0]
        self.assertEqual(list(predicted.get_xdata()), [1, 2, 3])
        np.testing.assert_allclose(predicted.get_ydata(), [line["error"] / line["budget"] for line in self.lines])

    def test_quant_colours_do_not_depend_on_the_run(self):
        a = plot.codec_colours(["quant:bits=2", "quant:bits=4", "quant:bits=8"])
        b = plot.codec_colours(["quant:bits=4", "topk:density=0.01"])
        self.assertEqual(a[1], b[0])
        self.assertNotEqual(a[0], a[2])


if __name__ == "__main__":
    unittest.main(verbosity=2)
