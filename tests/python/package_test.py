#!/usr/bin/env python3
"""Tests of the lgreco Python package (pyproject.toml, python/): installed as a user would.

Run from the repository root, after `make` (the build is reused, not redone), with the
Python that has Debian's packages:

    /usr/bin/python3 tests/python/package_test.py

A fresh virtual environment (python -m venv --system-site-packages, so Debian's torch is
visible) gets `pip install .` with PIP_NO_INDEX=1: nothing may come from the network.
Then the installed commands are run as a user would, from a folder outside the source
tree: lgreco-run's environment, its checks and its errors; interception of the stand-in
libnccl program (tests/interpose/probe.c) through lgreco-run; lgreco info; the installed
lgreco-register and lgreco.torch. `pip wheel .` is checked for its tags and contents,
and `pip install -e .` for a source tree's paths.
"""

import json
import os
import shutil
import subprocess
import sys
import tempfile
import unittest
import zipfile

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
BUILD_LIB = os.path.join(REPO, "build", "lib", "liblgreco.so")
CONFIG_TOOL = os.path.join(REPO, "build", "bin", "lgreco-config")
PROBE = os.environ.get("LGRECO_TEST_INTERPOSE_PROBE", os.path.join(REPO, "build", "bin", "lgreco-interpose-probe"))
FAKE_NCCL_COUNTS = "fake nccl: allreduce=2 allgather=0 broadcast=1 send=0 recv=0 group_start=1 group_end=1 destroy=1"


def run(cmd, env=None, cwd=None, timeout=300, input_text=None):
    proc = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout, input=input_text)
    return proc.returncode, proc.stdout, proc.stderr


def clean_env(**extra):
    """The environment without this checkout's LGRECO_* and preloads, plus offline pip."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("LGRECO_") and k not in ("LD_PRELOAD", "NCCL_NET_PLUGIN", "PYTHONPATH")}
    env["PIP_NO_INDEX"] = "1"
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    env.update(extra)
    return env


def make_venv(path):
    rc, out, err = run([sys.executable, "-m", "venv", "--system-site-packages", path], env=clean_env())
    if rc != 0:
        raise RuntimeError("python -m venv failed (Debian: apt-get install python3-venv): " + err + out)
    return os.path.join(path, "bin")


def build_variant():
    rc, out, err = run([CONFIG_TOOL, "version"])
    assert rc == 0, err
    return json.loads(out)


class InstalledPackage(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        for path in (BUILD_LIB, CONFIG_TOOL):
            if not os.path.isfile(path):
                raise unittest.SkipTest("%s is missing: run make first" % path)
        cls.tmp = tempfile.mkdtemp(prefix="lgreco-package-test-")
        cls.bin = make_venv(os.path.join(cls.tmp, "venv"))
        cls.python = os.path.join(cls.bin, "python")
        lib_before = os.stat(BUILD_LIB).st_mtime_ns
        rc, out, err = run([os.path.join(cls.bin, "pip"), "install", "--no-cache-dir", REPO], env=clean_env(),
                           cwd=cls.tmp)
        if rc != 0:
            raise AssertionError("pip install failed offline:\n" + out + err)
        cls.lib_rebuilt = os.stat(BUILD_LIB).st_mtime_ns != lib_before
        cls.work = os.path.join(cls.tmp, "work")  # a folder outside the source tree
        os.mkdir(cls.work)
        rc, out, err = run([cls.python, "-c", "import lgreco, json; print(json.dumps("
                            "[lgreco.__version__, lgreco.library_path(), lgreco.config_tool_path()]))"],
                           env=clean_env(), cwd=cls.work)
        assert rc == 0, err
        cls.version, cls.lib, cls.tool = json.loads(out)

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.tmp, ignore_errors=True)

    def cmd(self, name, *args, env=None, **kw):
        return run([os.path.join(self.bin, name)] + list(args), env=env or clean_env(), cwd=self.work, **kw)

    def test_the_install_reused_the_build_and_holds_one_stripped_library(self):
        self.assertFalse(self.lib_rebuilt, "pip install relinked build/lib/liblgreco.so: the build was not reused")
        site = os.path.dirname(os.path.dirname(self.lib))
        self.assertTrue(self.lib.startswith(os.path.join(self.tmp, "venv")), self.lib)
        self.assertEqual(os.path.basename(self.lib), "liblgreco.so")
        libs = [os.path.join(d, f) for d, _, files in os.walk(site) for f in files if f.endswith(".so")]
        self.assertEqual(libs, [self.lib], "exactly one copy of the library")
        rc, sections, err = run(["readelf", "-S", "-W", self.lib])
        self.assertEqual(rc, 0, err)
        self.assertNotIn(".debug_info", sections)
        self.assertNotIn(".symtab", sections)
        self.assertLess(os.path.getsize(self.lib), os.path.getsize(BUILD_LIB))
        # The stripped copy still exports what LD_PRELOAD and NCCL look up.
        rc, dynsym, err = run(["readelf", "--dyn-syms", "-W", self.lib])
        for symbol in ("ncclAllReduce", "ncclNetPlugin_v11", "lgreco_version"):
            self.assertIn(symbol, dynsym)

    def test_the_version_names_the_builds_variant(self):
        info = build_variant()
        self.assertEqual(self.version, "%s+%s" % (info["version"], info["variant"]))
        self.assertIn(info["variant"], ("cpu", "cu%d%d" % (info["cuda_runtime"] // 1000,
                                                            info["cuda_runtime"] % 1000 // 10)))

    def test_lgreco_run_preloads_the_packaged_library_before_an_existing_preload(self):
        rc, out, err = self.cmd("lgreco-run", "--", "sh", "-c", "echo $LD_PRELOAD; echo $NCCL_NET_PLUGIN")
        self.assertEqual(rc, 0, err)
        self.assertEqual(out.splitlines(), [self.lib, self.lib])
        other = os.path.join(self.tmp, "other.so")
        rc, out, err = self.cmd("lgreco-run", "--", "sh", "-c", "echo $LD_PRELOAD",
                                env=clean_env(LD_PRELOAD=other))
        self.assertEqual(out.strip(), self.lib + ":" + other)
        rc, out, err = self.cmd("lgreco-run", "--no-net-plugin", "--", "sh", "-c", "echo ${NCCL_NET_PLUGIN:-unset}")
        self.assertEqual(out.strip(), "unset")

    def test_lgreco_run_options_come_from_the_librarys_parameter_table(self):
        rc, out, err = run([self.tool, "params"])
        self.assertEqual(rc, 0, err)
        table = json.loads(out)
        rc, docs, _ = run([self.tool, "docs"])
        self.assertEqual([row["name"] for row in table],
                         [line.split("`")[1] for line in docs.splitlines() if line.startswith("| `LGRECO_")])
        rc, helptext, err = self.cmd("lgreco-run", "--help")
        self.assertEqual(rc, 0, err)
        for row in table:
            option = "--" + row["name"][len("LGRECO_"):].lower().replace("_", "-")
            self.assertIn(option + " VALUE", helptext)
        rc, out, err = self.cmd("lgreco-run", "--print-env", "--alpha", "0.8", "--decision-log", "d-%r.jsonl",
                                "--codec", "quant:bits=3", "--registration", os.path.join(REPO, "config", "examples",
                                                                                           "resnet50.json"))
        self.assertEqual(rc, 0, err)
        lines = out.splitlines()
        self.assertIn("LGRECO_ALPHA=0.8", lines)
        self.assertIn("LGRECO_DECISION_LOG=d-%r.jsonl", lines)
        self.assertIn("LGRECO_CODEC=quant:bits=3", lines)
        rc, out, err = self.cmd("lgreco-run", "--window", "7", "--", "sh", "-c", "echo $LGRECO_WINDOW")
        self.assertEqual((rc, out.strip()), (0, "7"), err)

    def test_lgreco_run_refuses_what_the_library_would_refuse_before_starting_anything(self):
        marker = os.path.join(self.tmp, "started")
        rc, out, err = self.cmd("lgreco-run", "--alpha", "7000", "--", "touch", marker)
        self.assertEqual(rc, 2)
        self.assertIn("LGRECO_ALPHA=7000 (--alpha): out of range", err)
        self.assertFalse(os.path.exists(marker))
        rc, out, err = self.cmd("lgreco-run", "--registration", "/nonexistent.json", "--", "touch", marker)
        self.assertEqual(rc, 2)
        self.assertIn("/nonexistent.json", err)
        self.assertFalse(os.path.exists(marker))

    def test_lgreco_run_errors_name_the_problem(self):
        rc, out, err = self.cmd("lgreco-run", "--", "no-such-command-lgreco")
        self.assertEqual(rc, 127)
        self.assertIn("command not found: no-such-command-lgreco", err)
        rc, out, err = self.cmd("lgreco-run", "true")
        self.assertEqual(rc, 2)
        self.assertIn("COMMAND goes after '--'", err)
        rc, out, err = self.cmd("lgreco-run", "--alpah", "1", "--", "true")
        self.assertEqual(rc, 2)
        self.assertIn("--alpah", err)
        rc, out, err = self.cmd("lgreco-run")
        self.assertEqual(rc, 2)
        self.assertIn("missing COMMAND", err)
        rc, out, err = self.cmd("lgreco-run", "--", "sh", "-c", "exit 7")
        self.assertEqual(rc, 7, "COMMAND's exit status is lgreco-run's")

    def test_a_program_started_through_lgreco_run_is_intercepted(self):
        if not os.path.isfile(PROBE):
            self.fail("%s is missing (make test builds it)" % PROBE)
        rc, out, err = self.cmd("lgreco-run", "--debug", "INFO", "--", PROBE)
        text = out + err
        self.assertEqual(rc, 0, text)
        self.assertIn("probe: results ok, recv[12345]=12345", text)
        self.assertIn(FAKE_NCCL_COUNTS, text)
        self.assertIn("LGRECO INFO SHIM interposing NCCL 2.28.9 at ", text)
        self.assertIn("lgreco shim: rank 0/1: 2 allreduce calls", text)
        self.assertNotIn("WARN", text)
        rc, out, err = self.cmd("lgreco-run", "--mode", "off", "--debug", "INFO", "--", PROBE)
        self.assertIn("every allreduce goes to NCCL untouched: LGRECO_MODE=off", out + err)
        rc, out, err = run([PROBE], env=clean_env(), cwd=self.work)
        self.assertNotIn("LGRECO", out + err, "without lgreco-run nothing of lgreco is loaded")

    def test_lgreco_plot(self):
        # A two-epoch log of two layers, as the controller writes it (log_version 1).
        def line(epoch, codecs):
            layers = [{"name": "0/%s" % n, "codec": c, "default_codec": "quant:bits=4,bucket=1024,rounding=stochastic",
                       "bytes": 100, "error": 1.0} for n, c in zip(("fc.weight", "conv.weight"), codecs)]
            return json.dumps({"log_version": 1, "epoch": epoch, "effective_step": 5 * epoch + 1, "alpha": 1.0,
                               "alpha_eff": 0.9, "bytes": 200, "default_bytes": 400, "error": 1.0, "budget": 1.1,
                               "solve_ms": 0.2, "layers": layers})
        log = os.path.join(self.work, "decisions.jsonl")
        with open(log, "w") as f:
            f.write(line(1, ["quant:bits=2", "quant:bits=3"]) + "\n")
            f.write(line(2, ["quant:bits=2", "topk:density=0.01"]) + "\n")
        rc, out, err = self.cmd("lgreco", "plot", log)
        self.assertEqual(rc, 0, out + err)
        self.assertIn("decisions.png: 2 epochs, 2 layers, codecs 2 bits, 3 bits, 4 bits, topk 1%", out)
        with open(os.path.join(self.work, "decisions.png"), "rb") as f:
            self.assertEqual(f.read(8), b"\x89PNG\r\n\x1a\n")

    def test_lgreco_info(self):
        for cmd in ([os.path.join(self.bin, "lgreco"), "info", "--no-torch"],
                    [self.python, "-m", "lgreco", "info", "--no-torch"]):
            rc, out, err = run(cmd, env=clean_env(), cwd=self.work)
            self.assertEqual(rc, 0, err)
            self.assertIn("lgreco %s (git " % self.version, out)
            self.assertIn("library:        %s" % self.lib, out)
            self.assertIn("LGRECO_ALPHA=1  # default", out)
            self.assertIn("# valid; mode in effect: adaptive", out)
            info = build_variant()
            if info["cuda_runtime"]:
                self.assertIn("needs NVIDIA driver >= %s" % info["driver_required"], out)
        rc, out, err = run([self.python, "-m", "lgreco", "info", "--no-torch"], env=clean_env(LGRECO_ALPHA="-1"),
                           cwd=self.work)
        self.assertEqual(rc, 1)
        self.assertIn("LGRECO_ALPHA=-1 (environment)", out)

    def test_lgreco_register_and_lgreco_torch_are_installed(self):
        rc, out, err = self.cmd("lgreco-register", "--check", os.path.join(REPO, "config", "examples", "resnet50.json"))
        self.assertEqual(rc, 0, err)
        self.assertIn('valid: model "resnet50"', out)
        rc, out, err = run([self.python, "-c", "import lgreco.torch, lgreco.register; "
                            "print(lgreco.torch.register_ddp is lgreco.register.register_ddp, lgreco.register.__file__)"],
                           env=clean_env(), cwd=self.work)
        self.assertEqual(rc, 0, err)
        flag, path = out.split()
        self.assertEqual(flag, "True")
        self.assertTrue(path.startswith(os.path.join(self.tmp, "venv")), path)

    def test_a_missing_library_is_named(self):
        # A copy of the installed package with its library removed, as a broken install.
        broken = os.path.join(self.tmp, "broken")
        shutil.copytree(os.path.dirname(os.path.dirname(self.lib)), os.path.join(broken, "lgreco"))
        os.remove(os.path.join(broken, "lgreco", "_lib", "liblgreco.so"))
        rc, out, err = run([self.python, "-m", "lgreco.run", "--", "true"], env=clean_env(PYTHONPATH=broken),
                           cwd=self.work)
        self.assertEqual(rc, 2)
        self.assertIn("library liblgreco.so is missing", err)
        self.assertIn(os.path.join(broken, "lgreco", "_lib", "liblgreco.so"), err)


class Wheel(unittest.TestCase):
    def test_pip_wheel_has_a_platform_tag_the_variant_and_no_links(self):
        with tempfile.TemporaryDirectory(prefix="lgreco-wheel-test-") as tmp:
            # A venv's pip: Debian's python3 has none without python3-pip.
            bin_dir = make_venv(os.path.join(tmp, "venv"))
            rc, out, err = run([os.path.join(bin_dir, "pip"), "wheel", "--no-deps", "--no-cache-dir", "-w", tmp, REPO],
                               env=clean_env(), cwd=tmp)
            self.assertEqual(rc, 0, out + err)
            wheels = [f for f in os.listdir(tmp) if f.endswith(".whl")]
            self.assertEqual(len(wheels), 1, wheels)
            info = build_variant()
            self.assertEqual(wheels[0], "lgreco-%s+%s-py3-none-linux_x86_64.whl" % (info["version"], info["variant"]))
            with zipfile.ZipFile(os.path.join(tmp, wheels[0])) as z:
                names = z.namelist()
                self.assertEqual([n for n in names if n.endswith(".so")], ["lgreco/_lib/liblgreco.so"])
                self.assertIn("lgreco/plot.py", names)
                for entry in z.infolist():
                    mode = entry.external_attr >> 16
                    self.assertNotEqual(mode & 0o170000, 0o120000, "%s is a symlink" % entry.filename)
                record = z.read("lgreco-%s+%s.dist-info/RECORD" % (info["version"], info["variant"])).decode()
                self.assertEqual(sorted(line.split(",")[0] for line in record.splitlines()), sorted(names))
                wheel_meta = z.read("lgreco-%s+%s.dist-info/WHEEL" % (info["version"], info["variant"])).decode()
                self.assertIn("Tag: py3-none-linux_x86_64", wheel_meta)
                self.assertIn("Root-Is-Purelib: false", wheel_meta)
                metadata = z.read("lgreco-%s+%s.dist-info/METADATA" % (info["version"], info["variant"])).decode()
                self.assertNotIn("Requires-Dist", metadata, "torch and matplotlib are never dependencies")
                self.assertTrue((z.getinfo("lgreco/_bin/lgreco-config").external_attr >> 16) & 0o111)

    def test_editable_install_uses_the_source_tree(self):
        with tempfile.TemporaryDirectory(prefix="lgreco-editable-test-") as tmp:
            bin_dir = make_venv(os.path.join(tmp, "venv"))
            rc, out, err = run([os.path.join(bin_dir, "pip"), "install", "--no-cache-dir", "-e", REPO],
                               env=clean_env(), cwd=tmp)
            self.assertEqual(rc, 0, out + err)
            rc, out, err = run([os.path.join(bin_dir, "lgreco-run"), "--", "sh", "-c", "echo $LD_PRELOAD"],
                               env=clean_env(), cwd=tmp)
            self.assertEqual((rc, out.strip()), (0, BUILD_LIB), err)


if __name__ == "__main__":
    unittest.main(verbosity=2)
