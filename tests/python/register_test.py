#!/usr/bin/env python3
"""Tests of lgreco-register: tools/lgreco-register and the lgreco package's lgreco.register.

Run from the repository root with the Python that has torch:

    /usr/bin/python3 tests/python/register_test.py

The layouts the tool writes are checked against an independent recording of what DDP
actually hands to allreduce: a comm hook that keeps, for every bucket of every step, the
flat buffer and each parameter's gradient. Every layer of the file must find its
parameter's gradient at its offset in that buffer. Tests that need torch are skipped (with
a message) when torch cannot be imported; `--check` is tested with torch made
unimportable.
"""

import copy
import importlib.util
import json
import math
import os
import random
import socket
import stat
import subprocess
import sys
import tempfile
import textwrap
import unittest

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
LAUNCHER = os.path.join(REPO, "tools", "lgreco-register")
CONFIG_TOOL = os.path.join(REPO, "build", "bin", "lgreco-config")
EXAMPLES = os.path.join(REPO, "config", "examples")
sys.path.insert(0, os.path.join(REPO, "python"))

import lgreco.register as lr  # noqa: E402

try:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    HAVE_TORCH = dist.is_available()
except ImportError:
    HAVE_TORCH = False

needs_torch = unittest.skipUnless(HAVE_TORCH, "torch (with torch.distributed) is not importable")

# The test model, as source: the command line imports it from a file, the tests from here.
# Mixed layer kinds: an embedding, Conv1d, LayerNorm, Linear, Conv2d, a scalar parameter,
# and a frozen Linear (requires_grad=False: not in any bucket). `head` is defined first and
# used last, so DDP's rebuilt order (gradient-ready order) differs from definition order.
MODEL_SOURCE = textwrap.dedent('''
    import torch
    from torch import nn

    class MixedNet(nn.Module):
        def __init__(self, vocab=40, dim=16, channels=24, hidden=48, classes=7):
            super().__init__()
            self.head = nn.Linear(hidden, classes)
            self.emb = nn.Embedding(vocab, dim)
            self.conv = nn.Conv1d(dim, channels, 3, padding=1)
            self.norm = nn.LayerNorm(channels)
            self.fc = nn.Linear(channels, hidden)
            self.frozen = nn.Linear(hidden, hidden)
            self.frozen.requires_grad_(False)
            self.conv2d = nn.Conv2d(1, 4, 3, padding=1)
            self.scale = nn.Parameter(torch.tensor(1.5))

        def forward(self, ids):
            x = self.emb(ids)                                   # B, T, dim
            x = self.conv(x.transpose(1, 2)).transpose(1, 2)    # B, T, channels
            x = self.norm(torch.relu(x))
            x = self.fc(x)                                      # B, T, hidden
            x = x + self.frozen(x)
            x = self.conv2d(x.unsqueeze(1)).mean(1)             # B, T, hidden
            return self.head(x.mean(1) * self.scale)            # B, classes

    def build(**kwargs):
        return MixedNet(**kwargs)
''')

# DDP settings that give this small model several buckets (it has about 3,600 elements).
BUCKET_CAP_MB = 0.004      # 4,194 bytes: about 1,000 float32 elements
FIRST_BUCKET_BYTES = 2048  # instead of DDP's 1 MiB, which would hold the whole model
VOCAB, SEQ = 40, 10


def _load_model_module():
    spec = importlib.util.spec_from_loader("register_test_models", loader=None)
    module = importlib.util.module_from_spec(spec)
    exec(MODEL_SOURCE, module.__dict__)
    return module


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def setUpModule():
    if HAVE_TORCH:
        os.environ["MASTER_ADDR"] = "127.0.0.1"
        os.environ["MASTER_PORT"] = str(_free_port())
        dist.init_process_group("gloo", rank=0, world_size=1)


def tearDownModule():
    if HAVE_TORCH and dist.is_initialized():
        dist.destroy_process_group()


def fresh_seed():
    return random.SystemRandom().randrange(2**31)


def recording_hook(log):
    """A comm hook that records each bucket DDP hands to allreduce, then allreduces it.

    log gets one list per step; each entry: count, dtype, the flat buffer (a copy), the
    bucket's parameters in order and each one's gradient (a copy) at that moment. With a
    comm hook registered, DDP copies gradients into the buffer without dividing them, so
    every parameter's gradient must appear verbatim in the buffer.
    """
    def hook(process_group, bucket):
        buf = bucket.buffer()
        if bucket.index() == 0:
            log.append([])
        params = bucket.parameters()
        log[-1].append({
            "index": bucket.index(), "count": buf.numel(), "dtype": buf.dtype,
            "buffer": buf.detach().clone(), "params": list(params),
            "grads": [p.grad.detach().clone() for p in params],
        })
        work = dist.all_reduce(buf, group=process_group, async_op=True)
        return work.get_future().then(lambda fut: fut.value()[0])
    return hook


class DDPCase(unittest.TestCase):
    """Helpers shared by the tests that build DDP models in this process."""

    models = None

    def setUp(self):
        if DDPCase.models is None:
            DDPCase.models = _load_model_module()
        self.tmp = tempfile.TemporaryDirectory(prefix="register_test_")
        self.addCleanup(self.tmp.cleanup)
        self.seed = fresh_seed()

    def path(self, name):
        return os.path.join(self.tmp.name, name)

    def make_ddp(self, seed=None, first_bucket_bytes=FIRST_BUCKET_BYTES, model=None, **ddp_kwargs):
        if model is None:
            torch.manual_seed(self.seed if seed is None else seed)
            model = self.models.build()
        saved = dist._DEFAULT_FIRST_BUCKET_BYTES
        dist._DEFAULT_FIRST_BUCKET_BYTES = first_bucket_bytes
        try:
            return DDP(model, bucket_cap_mb=ddp_kwargs.pop("bucket_cap_mb", BUCKET_CAP_MB), **ddp_kwargs)
        finally:
            dist._DEFAULT_FIRST_BUCKET_BYTES = saved

    def inputs(self, steps, seed):
        g = torch.Generator().manual_seed(seed)
        return [torch.randint(0, VOCAB, (3, SEQ), generator=g) for _ in range(steps)]

    def step(self, ddp, x):
        ddp(x).float().mean().backward()

    def check_against_recording(self, doc, recorded):
        """Every bucket and layer of the file against one step of recorded allreduces."""
        msg = f"(seed {self.seed})"
        self.assertEqual(len(doc["buckets"]), len(recorded), msg)
        names = {id(p): n for n, p in self.named.items()}
        for b, (bucket, rec) in enumerate(zip(doc["buckets"], recorded)):
            self.assertEqual(rec["index"], b, msg)
            self.assertEqual(bucket["count"], rec["count"], f"bucket {b} count {msg}")
            self.assertEqual(bucket["dtype"], str(rec["dtype"]).replace("torch.", ""), msg)
            self.assertEqual([layer["name"] for layer in bucket["layers"]],
                             [names[id(p)] for p in rec["params"]], f"bucket {b} order {msg}")
            for layer, grad in zip(bucket["layers"], rec["grads"]):
                piece = rec["buffer"][layer["offset"]:layer["offset"] + layer["numel"]]
                self.assertEqual(layer["numel"], grad.numel(), msg)
                self.assertEqual(layer["shape"], list(grad.shape), msg)
                self.assertTrue(torch.equal(piece.view(grad.shape), grad),
                                f"{layer['name']}: its gradient is not at offset {layer['offset']} of "
                                f"bucket {b} {msg}")

    def check_format(self, doc, text=None):
        problems = lr.validate_registration(doc)
        self.assertEqual(problems, [])
        self.assertEqual(set(doc), {"version", "model", "generator", "buckets"})
        self.assertIs(type(doc["version"]), int)
        names = []
        for bucket in doc["buckets"]:
            self.assertEqual(set(bucket), {"count", "dtype", "layers"})
            self.assertIs(type(bucket["count"]), int)
            offset = 0
            for layer in bucket["layers"]:
                self.assertEqual(set(layer), {"name", "offset", "numel", "shape"})  # no "compress"
                for key in ("offset", "numel"):
                    self.assertIs(type(layer[key]), int)
                self.assertTrue(all(type(d) is int for d in layer["shape"]))
                self.assertEqual(layer["offset"], offset)
                self.assertEqual(math.prod(layer["shape"]), layer["numel"])
                offset += layer["numel"]
                names.append(layer["name"])
            self.assertEqual(offset, bucket["count"])
        self.assertEqual(len(names), len(set(names)))
        if text is not None:
            self.assertTrue(text.endswith("}\n"))
            self.assertEqual(json.loads(text), doc)


@needs_torch
class LayoutTest(DDPCase):
    # (DDP options, the step during whose forward the buckets are final)
    CONFIGS = [
        ({}, 2),
        ({"gradient_as_bucket_view": True}, 2),
        ({"find_unused_parameters": True}, 1),   # DDP never rebuilds: final from the start
        ({"static_graph": True}, 3),             # DDP rebuilds one iteration later
    ]

    def test_layout_matches_allreduce(self):
        for i, (options, final_step) in enumerate(self.CONFIGS):
            with self.subTest(**options):
                self.seed = fresh_seed()
                ddp = self.make_ddp(**dict(options))
                self.named = dict(ddp.module.named_parameters())
                log = []
                out = self.path(f"layout_{i}.json")
                # The user's comm hook may come before or after register_ddp.
                if i % 2 == 0:
                    ddp.register_comm_hook(ddp.process_group, recording_hook(log))
                reg = lr.register_ddp(ddp, out, model_name="mixednet", strict=True,
                                      first_bucket_mb=FIRST_BUCKET_BYTES / 2**20)
                if i % 2 == 1:
                    ddp.register_comm_hook(ddp.process_group, recording_hook(log))
                written_at = None
                for step, x in enumerate(self.inputs(4, self.seed), start=1):
                    self.step(ddp, x)
                    if written_at is None and os.path.exists(out):
                        written_at = step
                self.assertEqual(written_at, final_step, f"(seed {self.seed})")
                self.assertTrue(reg.done)
                with open(out) as f:
                    text = f.read()
                doc = json.loads(text)
                self.check_format(doc, text)
                self.assertGreaterEqual(len(doc["buckets"]), 3, "the test needs several buckets")
                # The step that wrote the file and the last step reduce exactly this layout.
                self.check_against_recording(doc, log[final_step - 1])
                self.check_against_recording(doc, log[-1])
                # Frozen parameters are in no bucket; every trainable one is in exactly one.
                file_names = [layer["name"] for b in doc["buckets"] for layer in b["layers"]]
                trainable = sorted(n for n, p in ddp.module.named_parameters() if p.requires_grad)
                self.assertEqual(sorted(file_names), trainable)
                self.assertNotIn("frozen.weight", file_names)
                scale = [layer for b in doc["buckets"] for layer in b["layers"] if layer["name"] == "scale"]
                self.assertEqual(scale[0]["shape"], [])
                gen = doc["generator"]
                self.assertEqual(gen["tool"], "lgreco-register")
                self.assertEqual(gen["torch"], torch.__version__)
                self.assertEqual(gen["bucket_cap_mb"], BUCKET_CAP_MB)
                self.assertEqual(gen["first_bucket_mb"], FIRST_BUCKET_BYTES / 2**20)
                for key in ("find_unused_parameters", "gradient_as_bucket_view", "static_graph"):
                    self.assertEqual(gen[key], options.get(key, False))
                self.assertEqual(doc["model"], "mixednet")

    def test_rebuilt_order_differs_from_construction_order(self):
        # Makes sure the layout tests above would notice a pre-rebuild layout.
        ddp = self.make_ddp()
        before = lr.bucket_layout(ddp, require_final=False)
        for x in self.inputs(2, self.seed):
            self.step(ddp, x)
        after = lr.bucket_layout(ddp)
        self.assertNotEqual(before, after)
        with self.assertRaises(lr.RegisterError):
            lr.bucket_layout(self.make_ddp())  # not final yet

    def test_gradient_accumulation_with_no_sync(self):
        # Step 1 accumulates under no_sync (no allreduce), so DDP records the ready order
        # in step 2 and rebuilds at the forward of step 3: the file must wait for that.
        ddp = self.make_ddp()
        self.named = dict(ddp.module.named_parameters())
        log = []
        ddp.register_comm_hook(None, recording_hook(log))
        out = self.path("no_sync.json")
        lr.register_ddp(ddp, out, strict=True)
        xs = self.inputs(4, self.seed)
        with ddp.no_sync():
            self.step(ddp, xs[0])
        self.step(ddp, xs[1])
        self.assertFalse(os.path.exists(out))
        self.step(ddp, xs[2])
        self.assertTrue(os.path.exists(out))
        self.step(ddp, xs[3])
        with open(out) as f:
            doc = json.load(f)
        self.assertEqual(len(log), 3)
        self.check_against_recording(doc, log[1])  # the step after the rebuild
        self.check_against_recording(doc, log[2])


@needs_torch
class RegisterFunctionTest(DDPCase):
    def test_writes_once_only_after_rebuild(self):
        ddp = self.make_ddp()
        hooks_before = len(ddp.module._forward_pre_hooks)
        out = self.path("once.json")
        reg = lr.register_ddp(ddp, out, strict=True)
        self.assertTrue(reg.pending)
        xs = self.inputs(3, self.seed)
        with torch.no_grad():  # evaluation passes do not count
            ddp(xs[0])
        self.step(ddp, xs[0])
        self.assertFalse(os.path.exists(out), "written before DDP rebuilt its buckets")
        self.assertFalse(ddp._has_rebuilt_buckets)
        self.step(ddp, xs[1])
        self.assertTrue(ddp._has_rebuilt_buckets)
        self.assertTrue(os.path.exists(out))
        self.assertTrue(reg.done and not reg.pending)
        self.assertEqual(len(ddp.module._forward_pre_hooks), hooks_before, "the hook did not remove itself")
        first = os.stat(out)
        self.assertEqual(stat.S_IMODE(first.st_mode) & 0o600, 0o600)
        self.step(ddp, xs[2])
        again = os.stat(out)
        self.assertEqual((first.st_ino, first.st_mtime_ns), (again.st_ino, again.st_mtime_ns))
        leftovers = [n for n in os.listdir(self.tmp.name) if n.endswith(".tmp")]
        self.assertEqual(leftovers, [])
        with open(out) as f:
            self.assertEqual(json.load(f)["model"], "MixedNet")  # default: the class name

    def test_training_numerics_unchanged(self):
        torch.manual_seed(self.seed)
        base = self.models.build()
        plain, registered = copy.deepcopy(base), copy.deepcopy(base)
        ddp_plain = self.make_ddp(model=plain)
        ddp_reg = self.make_ddp(model=registered)
        reg = lr.register_ddp(ddp_reg, self.path("numerics.json"), strict=True)
        opts = [torch.optim.SGD(d.parameters(), lr=0.1, momentum=0.9) for d in (ddp_plain, ddp_reg)]
        for x in self.inputs(3, self.seed + 1):
            for d, opt in zip((ddp_plain, ddp_reg), opts):
                opt.zero_grad()
                self.step(d, x)
                opt.step()
        self.assertTrue(reg.done)
        for (name, a), b in zip(plain.named_parameters(), registered.parameters()):
            self.assertTrue(torch.equal(a, b), f"{name} differs after 3 steps (seed {self.seed})")
            if a.grad is not None:
                self.assertTrue(torch.equal(a.grad, b.grad), f"{name}.grad differs (seed {self.seed})")

    def test_other_rank_does_not_write(self):
        ddp = self.make_ddp()
        out = self.path("rank1.json")
        reg = lr.register_ddp(ddp, out, write_rank=1)
        self.assertFalse(reg.writes)
        for x in self.inputs(3, self.seed):
            self.step(ddp, x)
        self.assertFalse(os.path.exists(out))
        self.assertEqual(len(ddp.module._forward_pre_hooks), 0)

    def test_write_error_warns_and_training_goes_on(self):
        ddp = self.make_ddp()
        reg = lr.register_ddp(ddp, self.path("no/such/folder/x.json"))
        xs = self.inputs(3, self.seed)
        self.step(ddp, xs[0])
        with self.assertWarnsRegex(RuntimeWarning, "could not write"):
            self.step(ddp, xs[1])
        self.step(ddp, xs[2])
        self.assertFalse(reg.done or reg.pending)
        self.assertIsInstance(reg.error, OSError)

    def test_rejects_non_ddp(self):
        with self.assertRaises(lr.RegisterError):
            lr.register_ddp(self.models.build(), self.path("x.json"))

    def test_missing_torch_internals_are_named(self):
        from types import SimpleNamespace as NS
        with self.assertRaisesRegex(lr.RegisterError, "_get_zeros_like_grad_buckets"):
            lr.bucket_layout(NS(reducer=object(), _has_rebuilt_buckets=True, module=self.models.build()))
        with self.assertRaisesRegex(lr.RegisterError, "_has_rebuilt_buckets"):
            lr.buckets_are_final(NS(find_unused_parameters=False))

    def test_sparse_embedding_is_refused(self):
        model = self.models.build()
        model.emb.sparse = True
        ddp = self.make_ddp(model=model)
        with self.assertRaisesRegex(lr.RegisterError, "emb.weight has sparse gradients"):
            lr.bucket_layout(ddp, require_final=False)


class FormatTest(unittest.TestCase):
    def test_validator_catches_broken_documents(self):
        good = {"version": 1, "model": "m", "buckets": [{"count": 6, "dtype": "float32", "layers": [
            {"name": "a", "offset": 0, "numel": 2, "shape": [2]},
            {"name": "b", "offset": 2, "numel": 4, "shape": [2, 2]}]}]}
        self.assertEqual(lr.validate_registration(good), [])
        text = lr.format_registration(good)
        self.assertEqual(json.loads(text), good)
        self.assertTrue(text.endswith("\n"))
        breakages = {
            "gap": lambda d: d["buckets"][0]["layers"][1].update(offset=3),
            "count": lambda d: d["buckets"][0].update(count=7),
            "shape": lambda d: d["buckets"][0]["layers"][1].update(shape=[3]),
            "name": lambda d: d["buckets"][0]["layers"][1].update(name="a"),
            "dtype": lambda d: d["buckets"][0].update(dtype="float64"),
            "key": lambda d: d.update(extra=1),
            "bool": lambda d: d["buckets"][0]["layers"][0].update(numel=True),
        }
        for what, breaking in breakages.items():
            doc = json.loads(json.dumps(good))
            breaking(doc)
            self.assertNotEqual(lr.validate_registration(doc), [], what)

    def test_first_bucket_cap_as_recorded_by_newer_torch(self):
        from types import SimpleNamespace as NS
        # torch 1.13 and early 2.x record nothing: the caller falls back to the global.
        self.assertIsNone(lr._ddp_first_bucket_bytes(NS(bucket_bytes_cap=26214400)))
        # Newer 2.x: an explicit bucket_cap_mb also caps the first bucket.
        self.assertEqual(lr._ddp_first_bucket_bytes(NS(bucket_bytes_cap=4194, bucket_bytes_cap_default=False)), 4194)
        self.assertIsNone(lr._ddp_first_bucket_bytes(NS(bucket_bytes_cap=26214400, bucket_bytes_cap_default=True)))
        config = NS(first_bucket_bytes_cap=1048576)
        self.assertEqual(lr._ddp_first_bucket_bytes(NS(_bucket_config=config, bucket_bytes_cap_default=True)),
                         1048576)
        self.assertEqual((lr._mib(4194), lr._mib(26214400), lr._mib(2048)), (0.004, 25, 0.001953125))

    def test_examples_are_valid(self):
        names = sorted(n for n in os.listdir(EXAMPLES) if n.endswith(".json"))
        self.assertIn("resnet50.json", names)
        for name in names:
            with open(os.path.join(EXAMPLES, name)) as f:
                text = f.read()
            doc = json.loads(text)
            self.assertEqual(lr.validate_registration(doc), [], name)
            self.assertTrue(text.endswith("\n"))
        with open(os.path.join(EXAMPLES, "resnet50.json")) as f:
            doc = json.load(f)
        # torchvision's ResNet-50 has 25,557,032 parameters, all trainable.
        self.assertEqual(sum(b["count"] for b in doc["buckets"]), 25557032)
        self.assertEqual(sum(len(b["layers"]) for b in doc["buckets"]), 161)


def run_tool(args, cwd=None, env=None, python=None):
    full_env = dict(os.environ)
    full_env.update(env or {})
    return subprocess.run([python or sys.executable, LAUNCHER] + list(args), cwd=cwd or REPO,
                          env=full_env, capture_output=True, text=True, timeout=120)


@needs_torch
class CommandLineTest(DDPCase):
    def setUp(self):
        super().setUp()
        self.models_dir = self.path("models")
        os.mkdir(self.models_dir)
        with open(os.path.join(self.models_dir, "mixed_models.py"), "w") as f:
            f.write(MODEL_SOURCE)

    def assertOneLineError(self, proc, code, *fragments):
        self.assertEqual(proc.returncode, code, proc.stderr)
        lines = proc.stderr.strip().splitlines()
        self.assertEqual(len(lines), 1, proc.stderr)
        self.assertTrue(lines[0].startswith("lgreco-register: error: "), proc.stderr)
        self.assertNotIn("Traceback", proc.stderr)
        for fragment in fragments:
            self.assertIn(fragment, lines[0])

    def cli_args(self, out):
        return ["--input-shape", f"3,{SEQ}", "--input-dtype", "long", "--input-high", str(VOCAB),
                "--bucket-cap-mb", str(BUCKET_CAP_MB), "--first-bucket-mb", str(FIRST_BUCKET_BYTES / 2**20),
                "-o", out]

    def test_cli_matches_in_process_layout(self):
        out = self.path("cli.json")
        proc = run_tool(["--model", "mixed_models:build", "--model-name", "mixed"] + self.cli_args(out),
                        cwd=self.models_dir)
        self.assertEqual(proc.returncode, 0, proc.stderr)
        self.assertIn("wrote", proc.stderr)
        with open(out) as f:
            text = f.read()
        doc = json.loads(text)
        self.check_format(doc, text)
        self.assertEqual(doc["model"], "mixed")
        gen = doc["generator"]
        self.assertEqual((gen["bucket_cap_mb"], gen["first_bucket_mb"], gen["steps"]),
                         (BUCKET_CAP_MB, FIRST_BUCKET_BYTES / 2**20, 2))
        self.assertEqual(gen["input_shape"], [3, SEQ])
        # The same model and settings in this process, checked against what DDP allreduced.
        ddp = self.make_ddp()
        self.named = dict(ddp.module.named_parameters())
        log = []
        ddp.register_comm_hook(None, recording_hook(log))
        for x in self.inputs(2, self.seed):
            self.step(ddp, x)
        self.check_against_recording(doc, log[1])

    def test_cli_file_path_model_args_and_options(self):
        out = self.path("file.json")
        model = os.path.join(self.models_dir, "mixed_models.py") + ":build"
        args = ["--model", model, "--model-args", '{"hidden": 32}', "--static-graph",
                "--gradient-as-bucket-view"] + self.cli_args(out)
        proc = run_tool(args)
        self.assertEqual(proc.returncode, 0, proc.stderr)
        with open(out) as f:
            doc = json.load(f)
        self.check_format(doc)
        self.assertEqual(doc["model"], "build")
        gen = doc["generator"]
        self.assertEqual(gen["model_args"], {"hidden": 32})
        self.assertTrue(gen["static_graph"] and gen["gradient_as_bucket_view"] and gen["buckets_rebuilt"])
        self.assertEqual(gen["steps"], 3)
        head = [layer for b in doc["buckets"] for layer in b["layers"] if layer["name"] == "head.weight"]
        self.assertEqual(head[0]["shape"], [7, 32])

    def test_cli_errors(self):
        out = self.path("err.json")
        rest = ["--input-shape", "2,5", "-o", out]
        self.assertOneLineError(run_tool(["--model", "no_such_module_zq:build"] + rest, cwd=self.models_dir),
                                2, "no module named 'no_such_module_zq'")
        self.assertOneLineError(run_tool(["--model", "mixed_models:nope"] + rest, cwd=self.models_dir),
                                2, "has no attribute 'nope'")
        self.assertOneLineError(run_tool(["--model", "no-colon"] + rest), 2, "MODULE:CALLABLE")
        self.assertOneLineError(run_tool(["--model", "mixed_models:build", "--input-shape", "2,x", "-o", out],
                                         cwd=self.models_dir), 2, "--input-shape '2,x'")
        self.assertOneLineError(run_tool(["--model", "mixed_models:build", "--input-shape", "2,0", "-o", out],
                                         cwd=self.models_dir), 2, "--input-shape")
        # A shape the model cannot take: parsed fine, fails in the forward pass.
        self.assertOneLineError(run_tool(["--model", "mixed_models:build", "--input-shape", "2,3,4,5",
                                          "--input-dtype", "long", "-o", out], cwd=self.models_dir),
                                1, "forward pass", "shape 2x3x4x5")
        self.assertOneLineError(run_tool(["--model", "mixed_models:build", "--input-shape", "2,5"],
                                         cwd=self.models_dir), 2, "missing -o/--output")
        self.assertOneLineError(run_tool(["--model", "mixed_models:build", "--model-args", "[1]"] + rest,
                                         cwd=self.models_dir), 2, "--model-args")
        self.assertOneLineError(run_tool(["--bogus"]), 2, "--bogus")
        self.assertFalse(os.path.exists(out))


class CheckTest(unittest.TestCase):
    """--check runs lgreco-config and must work where torch cannot be imported."""

    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory(prefix="register_check_")
        self.addCleanup(self.tmp.cleanup)
        self.blocker = os.path.join(self.tmp.name, "blocker")
        os.mkdir(self.blocker)
        with open(os.path.join(self.blocker, "torch.py"), "w") as f:
            f.write('raise ImportError("torch is blocked by register_test")\n')
        self.env = {"PYTHONPATH": self.blocker}
        proc = subprocess.run([sys.executable, "-c", "import torch"], env=dict(os.environ, **self.env),
                              capture_output=True, text=True)
        self.assertIn("blocked", proc.stderr)  # the blocker works

    def test_check_runs_the_tool_without_torch(self):
        fake = os.path.join(self.tmp.name, "fake-config")
        with open(fake, "w") as f:
            f.write('#!/bin/sh\necho "fake-config $*"\nexit 3\n')
        os.chmod(fake, 0o755)
        proc = run_tool(["--check", "some file.json"], env=dict(self.env, LGRECO_CONFIG_TOOL=fake))
        self.assertEqual(proc.returncode, 3, proc.stderr)
        self.assertEqual(proc.stdout.strip(), "fake-config check some file.json")
        self.assertNotIn("Traceback", proc.stderr)

    def test_help_without_torch(self):
        proc = run_tool(["--help"], env=self.env)
        self.assertEqual(proc.returncode, 0, proc.stderr)
        for option in ("--model", "--model-args", "--model-name", "--input-shape", "--input-dtype",
                       "--input-high", "--param-dtype", "--loss", "--bucket-cap-mb", "--first-bucket-mb",
                       "--find-unused-parameters", "--gradient-as-bucket-view", "--static-graph", "--seed",
                       "--output", "--check"):
            self.assertIn(option, proc.stdout)

    def test_check_errors(self):
        proc = run_tool(["--check", "x.json"], env=dict(self.env, LGRECO_CONFIG_TOOL="/nonexistent/lgreco-config"))
        self.assertEqual(proc.returncode, 1)
        self.assertIn("LGRECO_CONFIG_TOOL", proc.stderr)
        proc = run_tool(["--check", "x.json", "--model", "a:b"], env=self.env)
        self.assertEqual(proc.returncode, 2)
        self.assertIn("cannot be combined", proc.stderr)
        # Building a model does need torch: a clear one-line error, no traceback.
        proc = run_tool(["--model", "torchvision.models:resnet50", "--input-shape", "2,3,8,8", "-o",
                         os.path.join(self.tmp.name, "o.json")], env=self.env)
        self.assertEqual(proc.returncode, 1, proc.stderr)
        self.assertIn("cannot import torch", proc.stderr)
        self.assertNotIn("Traceback", proc.stderr)

    def test_check_with_the_real_validator(self):
        if not (os.path.isfile(CONFIG_TOOL) and os.access(CONFIG_TOOL, os.X_OK)):
            print(f"\n  skipped the part of --check that needs {os.path.relpath(CONFIG_TOOL, REPO)} "
                  "(not built)", file=sys.stderr)
            self.skipTest(f"{CONFIG_TOOL} is not built")
        env = dict(self.env)
        env["PATH"] = os.environ.get("PATH", "")
        os.environ.pop("LGRECO_CONFIG_TOOL", None)
        for name in sorted(os.listdir(EXAMPLES)):
            if name.endswith(".json"):
                proc = run_tool(["--check", os.path.join(EXAMPLES, name)], env=env)
                self.assertEqual(proc.returncode, 0, name + ": " + proc.stdout + proc.stderr)
        with open(os.path.join(EXAMPLES, "resnet50.json")) as f:
            doc = json.load(f)
        doc["buckets"][1]["layers"][2]["offset"] += 1
        broken = os.path.join(self.tmp.name, "broken.json")
        with open(broken, "w") as f:
            json.dump(doc, f)
        proc = run_tool(["--check", broken], env=env)
        self.assertEqual(proc.returncode, 1, proc.stdout + proc.stderr)
        self.assertIn("broken.json", proc.stdout + proc.stderr)
        self.assertIn("buckets[1].layers[2]", proc.stdout + proc.stderr)


if __name__ == "__main__":
    if not HAVE_TORCH:
        print("register_test: torch is not importable with " + sys.executable +
              "; the tests that build DDP models are skipped", file=sys.stderr)
    unittest.main(verbosity=2)
