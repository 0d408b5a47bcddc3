"""lgreco-register: the registration file of a PyTorch DDP model.

The lgreco shim that intercepts ncclAllReduce sees only (pointer, count, dtype). The
registration file tells it which parameters make up each gradient bucket that
torch.nn.parallel.DistributedDataParallel (DDP) allreduces, in the order DDP reduces
them every step. This module writes that file, in two ways:

* from the user's own training script, without changing its numbers::

      from lgreco.torch import register_ddp     # the lgreco package (pip install .)
      ddp = DistributedDataParallel(model, ...)
      register_ddp(ddp, "model.json", model_name="mymodel")
      # train as usual: the file appears once DDP's buckets are final

* from the command line (lgreco-register, installed by the package; in a source tree
  tools/lgreco-register), which builds a model from an import
  path, runs a few training steps in a one-process gloo group on the CPU and writes the
  file; `--check FILE` runs the C++ validator.

docs/REGISTER_TOOL.md describes both; docs/REGISTRATION.md (the C++ side) the format.

How the layout is read. DDP assigns parameters to buckets when it is built, then, unless
find_unused_parameters=True without static_graph, rebuilds the buckets once, from the
order in which gradients became ready in the first backward pass (at the start of the
second forward; with static_graph, of the third). The reducer's current buckets are
read with `DistributedDataParallel.reducer._get_zeros_like_grad_buckets()`: one
GradBucket per bucket, in reduction order, with the flat buffer (a zero copy: same count
and dtype as the buffer handed to allreduce), the parameters in buffer order and each
parameter's view into the buffer (its offset). The layout is read only once the buckets
are final: after `DistributedDataParallel._has_rebuilt_buckets` became true, or at once
where DDP never rebuilds. Nothing is registered on the communication path: no comm hook,
so training is bit-for-bit what it would be without this module, and a user's own comm
hook keeps working.

torch is imported only inside the functions that need it: `--check` runs without it.
"""

import argparse
import importlib
import importlib.util
import json
import math
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import warnings

FORMAT_VERSION = 1
TOOL_NAME = "lgreco-register"

# Gradient dtypes the C++ side compresses (torch's name -> the file's name).
_FILE_DTYPES = {"torch.float32": "float32", "torch.float16": "float16", "torch.bfloat16": "bfloat16"}

# Keys of each object of the file, exactly (the C++ validator rejects others).
TOP_KEYS = ("version", "model", "generator", "buckets")
BUCKET_KEYS = ("count", "dtype", "layers")
LAYER_KEYS = ("name", "offset", "numel", "shape", "compress")


class RegisterError(Exception):
    """A failure with a message meant for the user (the CLI exits 1)."""

    exit_code = 1


class UsageError(RegisterError):
    """A mistake on the command line (the CLI exits 2)."""

    exit_code = 2


def _import_torch():
    try:
        import torch  # noqa: F401  (imported lazily: --check runs without torch)
        import torch.distributed as dist
    except Exception as e:  # ImportError, or a broken installation
        raise RegisterError(f"cannot import torch ({type(e).__name__}: {_first_line(e)}; python: "
                            f"{sys.executable}); building a registration file needs PyTorch") from None
    if not dist.is_available():
        raise RegisterError(f"torch {torch.__version__} was built without torch.distributed")
    return torch


def _first_line(e):
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def _number(x):
    """25.0 -> 25, 0.5 -> 0.5: MiB values as JSON writes them most plainly."""
    x = float(x)
    return int(x) if x.is_integer() else x


def _mib(nbytes):
    """A byte count DDP derived with int(mb * 2**20), back in MiB: the shortest decimal that
    gives the same byte count (4194 bytes -> 0.004, as in bucket_cap_mb=0.004)."""
    for digits in range(1, 16):
        mb = round(nbytes / 2**20, digits)
        if int(mb * 1024 * 1024) == nbytes:
            return _number(mb)
    return _number(nbytes / 2**20)


# ---------------------------------------------------------------------------------------
# Reading the layout from a DDP model.


def _reducer(ddp):
    reducer = getattr(ddp, "reducer", None)
    if reducer is None:
        raise RegisterError(
            "this DistributedDataParallel has no reducer (all parameters delayed with "
            "delay_all_reduce_named_params?); there are no buckets to register")
    if not hasattr(reducer, "_get_zeros_like_grad_buckets"):
        import torch
        raise RegisterError(
            f"torch {torch.__version__}: DDP's reducer has no _get_zeros_like_grad_buckets(); "
            "this version of lgreco-register cannot read its buckets")
    return reducer


def buckets_are_final(ddp):
    """True once DDP will not reassign parameters to buckets any more.

    DDP rebuilds its buckets exactly once (in the forward pass after the first backward
    that reduced gradients; with static_graph one iteration later), except with
    find_unused_parameters=True and static_graph=False, where it never rebuilds.
    """
    if getattr(ddp, "_has_rebuilt_buckets", False):
        return True
    if not hasattr(ddp, "_has_rebuilt_buckets"):
        import torch
        raise RegisterError(f"torch {torch.__version__}: DistributedDataParallel has no "
                            "_has_rebuilt_buckets; cannot tell when its buckets are final")
    return bool(getattr(ddp, "find_unused_parameters", False)) and not bool(getattr(ddp, "static_graph", False))


def _check_no_sparse(ddp):
    import torch
    ignored = set(getattr(ddp, "parameters_to_ignore", ()) or ())
    for mname, m in ddp.module.named_modules():
        if isinstance(m, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and m.sparse:
            pname = f"{mname}.weight" if mname else "weight"
            if m.weight.requires_grad and pname not in ignored:
                raise RegisterError(
                    f"parameter {pname} has sparse gradients (sparse=True): DDP reduces it "
                    "without a flat bucket, and lgreco cannot register or compress it")


def bucket_layout(ddp, require_final=True):
    """The buckets DDP reduces now, in reduction order, as the file's bucket objects.

    Each bucket: {"count", "dtype", "layers": [{"name", "offset", "numel", "shape"}]}.
    Parameters without elements are left out (they occupy no part of the buffer).
    Allocates, for a moment, one zero buffer per bucket (the reducer's API returns them).
    """
    torch = _import_torch()
    if require_final and not buckets_are_final(ddp):
        raise RegisterError("DDP's buckets are not final yet: DDP rebuilds them after the first "
                            "iteration (with static_graph, the second); run more iterations first")
    reducer = _reducer(ddp)
    _check_no_sparse(ddp)
    names = {}
    by_storage = {}
    for name, p in ddp.module.named_parameters():
        names.setdefault(id(p), name)
        by_storage.setdefault((p.data_ptr(), tuple(p.shape), p.dtype), name)

    def name_of(p):
        name = names.get(id(p))
        if name is None:  # a different Python object for the same tensor
            name = by_storage.get((p.data_ptr(), tuple(p.shape), p.dtype))
        if name is None:
            raise RegisterError(f"a parameter of shape {list(p.shape)} in a DDP bucket is not among "
                                "ddp.module.named_parameters()")
        return name

    with torch.no_grad():
        grad_buckets = reducer._get_zeros_like_grad_buckets()
        layout = []
        for position, gb in enumerate(grad_buckets):
            index = gb.index()
            if index != position:
                raise RegisterError(f"reducer returned bucket {index} at position {position}")
            buf = gb.buffer()
            if buf is None or buf.layout != torch.strided:
                raise RegisterError(f"bucket {index} has no dense flat buffer (sparse gradients?)")
            dtype = _FILE_DTYPES.get(str(buf.dtype))
            if dtype is None:
                params = ", ".join(name_of(p) for p in gb.parameters()[:3])
                raise RegisterError(f"bucket {index} ({params}, ...) has gradient dtype "
                                    f"{str(buf.dtype).replace('torch.', '')}; lgreco compresses "
                                    "float32, float16 and bfloat16 only")
            count = buf.numel()
            params = gb.parameters()
            views = gb.gradients()
            if len(views) != len(params):
                raise RegisterError(f"bucket {index}: {len(params)} parameters but {len(views)} gradient views")
            base = buf.storage_offset()
            layers = []
            expected = 0
            for p, v in zip(params, views):
                numel = p.numel()
                offset = v.storage_offset() - base
                if v.numel() != numel or offset != expected:
                    raise RegisterError(f"bucket {index}: parameter {name_of(p)} is at offset {offset} "
                                        f"({v.numel()} elements); expected {expected} ({numel})")
                expected += numel
                if numel == 0:
                    continue
                layers.append({"name": name_of(p), "offset": offset, "numel": numel,
                               "shape": [int(d) for d in p.shape]})
            if expected != count:
                raise RegisterError(f"bucket {index}: its parameters hold {expected} elements, "
                                    f"its buffer {count}")
            if not layers:
                raise RegisterError(f"bucket {index} holds no elements")
            layout.append({"count": count, "dtype": dtype, "layers": layers})
        del grad_buckets
    if not layout:
        raise RegisterError("DDP has no gradient buckets")
    return layout


def _first_bucket_bytes():
    import torch.distributed as dist
    return getattr(dist, "_DEFAULT_FIRST_BUCKET_BYTES", None)


def _ddp_first_bucket_bytes(ddp):
    """The first-bucket cap a DDP model was built with, where the torch says; else None.

    torch 1.13 and early 2.x do not record it (it is torch.distributed.
    _DEFAULT_FIRST_BUCKET_BYTES as it was at construction). Newer 2.x releases record
    whether bucket_cap_mb was left at its default (bucket_bytes_cap_default): when it was
    given explicitly, the first bucket gets the same cap as the others.
    """
    config = getattr(ddp, "_bucket_config", None)
    value = getattr(config, "first_bucket_bytes_cap", None)
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if getattr(ddp, "bucket_bytes_cap_default", None) is False:
        return getattr(ddp, "bucket_bytes_cap", None)
    return None


def ddp_generator_info(ddp, first_bucket_bytes=None):
    """Provenance of a layout: torch version and the DDP settings that shape it."""
    import torch
    import torch.distributed as dist
    info = {"tool": TOOL_NAME, "torch": torch.__version__}
    cap = getattr(ddp, "bucket_bytes_cap", None)
    if cap is not None:
        info["bucket_cap_mb"] = _mib(cap)
    if first_bucket_bytes is None:
        first_bucket_bytes = _ddp_first_bucket_bytes(ddp)
    if first_bucket_bytes is None:
        first_bucket_bytes = _first_bucket_bytes()
    if first_bucket_bytes is not None:
        info["first_bucket_mb"] = _mib(first_bucket_bytes)
    info["find_unused_parameters"] = bool(getattr(ddp, "find_unused_parameters", False))
    info["gradient_as_bucket_view"] = bool(getattr(ddp, "gradient_as_bucket_view", False))
    info["static_graph"] = bool(getattr(ddp, "static_graph", False))
    info["buckets_rebuilt"] = bool(getattr(ddp, "_has_rebuilt_buckets", False))
    try:
        info["world_size"] = dist.get_world_size(ddp.process_group)
    except Exception:
        pass
    if getattr(ddp, "mixed_precision", None) is not None:
        info["ddp_mixed_precision"] = str(ddp.mixed_precision)
    delayed = getattr(ddp, "_delay_all_reduce_params", None)
    if delayed:
        info["note"] = (f"{len(delayed)} parameters (delay_all_reduce_named_params) are reduced "
                        "in a separate allreduce that this file does not describe")
    return info


def registration(ddp, model_name=None, generator=None, first_bucket_bytes=None, require_final=True):
    """The registration document (a dict) for a DDP model's current buckets."""
    doc = {"version": FORMAT_VERSION,
           "model": model_name if model_name is not None else type(ddp.module).__name__}
    gen = ddp_generator_info(ddp, first_bucket_bytes)
    gen.update(generator or {})
    doc["generator"] = gen
    doc["buckets"] = bucket_layout(ddp, require_final=require_final)
    problems = validate_registration(doc)
    if problems:
        raise RegisterError("internal error, the layout breaks the format: " + "; ".join(problems[:5]))
    return doc


# ---------------------------------------------------------------------------------------
# The file: checks and writing (no torch needed).


def validate_registration(doc):
    """The format's invariants, checked in Python; returns a list of problems (empty: valid).

    The C++ validator (`lgreco-config check`) is the reference; this is the same set of
    rules, for files made here.
    """
    problems = []

    def is_uint(x):
        return isinstance(x, int) and not isinstance(x, bool) and x >= 0

    if not isinstance(doc, dict):
        return ["the document is not a JSON object"]
    for key in doc:
        if key not in TOP_KEYS:
            problems.append(f"unknown key {key!r}")
    if doc.get("version") != FORMAT_VERSION or isinstance(doc.get("version"), bool):
        problems.append(f"version: {doc.get('version')!r}; expected {FORMAT_VERSION}")
    if "model" in doc and not isinstance(doc["model"], str):
        problems.append("model: not a string")
    if "generator" in doc and not isinstance(doc["generator"], dict):
        problems.append("generator: not an object")
    buckets = doc.get("buckets")
    if not isinstance(buckets, list) or not buckets:
        problems.append("buckets: missing, not an array or empty")
        return problems
    seen = {}
    for b, bucket in enumerate(buckets):
        where = f"buckets[{b}]"
        if not isinstance(bucket, dict):
            problems.append(f"{where}: not an object")
            continue
        for key in bucket:
            if key not in BUCKET_KEYS:
                problems.append(f"{where}: unknown key {key!r}")
        count = bucket.get("count")
        if not is_uint(count) or count == 0:
            problems.append(f"{where}.count: {count!r}; expected a positive integer")
        if bucket.get("dtype") not in _FILE_DTYPES.values():
            problems.append(f"{where}.dtype: {bucket.get('dtype')!r}; expected float32, float16 or bfloat16")
        layers = bucket.get("layers")
        if not isinstance(layers, list) or not layers:
            problems.append(f"{where}.layers: missing, not an array or empty")
            continue
        expected = 0
        for i, layer in enumerate(layers):
            lw = f"{where}.layers[{i}]"
            if not isinstance(layer, dict):
                problems.append(f"{lw}: not an object")
                continue
            for key in layer:
                if key not in LAYER_KEYS:
                    problems.append(f"{lw}: unknown key {key!r}")
            name, offset, numel, shape = (layer.get(k) for k in ("name", "offset", "numel", "shape"))
            if not isinstance(name, str) or not name:
                problems.append(f"{lw}.name: {name!r}; expected a non-empty string")
            elif name in seen:
                problems.append(f"{lw}.name: {name!r} is also the name of {seen[name]}")
            else:
                seen[name] = lw
            if not is_uint(offset) or offset != expected:
                problems.append(f"{lw}.offset: {offset!r}; expected {expected} (layers are contiguous)")
            if not is_uint(numel) or numel == 0:
                problems.append(f"{lw}.numel: {numel!r}; expected a positive integer")
                continue
            if not isinstance(shape, list) or not all(is_uint(d) for d in shape):
                problems.append(f"{lw}.shape: {shape!r}; expected a list of non-negative integers")
            elif math.prod(shape) != numel:
                problems.append(f"{lw}.shape: {shape} holds {math.prod(shape)} elements, numel is {numel}")
            if "compress" in layer and not isinstance(layer["compress"], str):
                problems.append(f"{lw}.compress: not a string")
            expected += numel
        if is_uint(count) and expected != count:
            problems.append(f"{where}: the layers hold {expected} elements, count is {count}")
    return problems


def format_registration(doc):
    """The document as text: readable, one layer per line, ending with a newline."""
    def dumps(x):
        return json.dumps(x, separators=(", ", ": "))

    lines = ["{"]
    top = [k for k in TOP_KEYS if k in doc and k != "buckets"]
    for key in top:
        if key == "generator" and isinstance(doc[key], dict) and doc[key]:
            items = [f"  {json.dumps(k)}: {dumps(v)}" for k, v in doc[key].items()]
            lines.append(' "generator": {')
            lines.append(",\n".join(items))
            lines.append(" },")
        else:
            lines.append(f" {json.dumps(key)}: {dumps(doc[key])},")
    lines.append(' "buckets": [')
    buckets = doc["buckets"]
    for b, bucket in enumerate(buckets):
        head = {k: bucket[k] for k in bucket if k != "layers"}
        lines.append("  " + dumps(head)[:-1] + ', "layers": [')
        layers = bucket["layers"]
        for i, layer in enumerate(layers):
            lines.append("   " + dumps(layer) + ("," if i + 1 < len(layers) else ""))
        lines.append("  ]}" + ("," if b + 1 < len(buckets) else ""))
    lines.append(" ]")
    lines.append("}")
    text = "\n".join(lines) + "\n"
    if json.loads(text) != doc:  # the formatter must not change the document
        text = json.dumps(doc, indent=1) + "\n"
    return text


def write_registration_file(doc, path):
    """Writes the document atomically: a temporary file in the same folder, then rename."""
    text = format_registration(doc)
    if path == "-":
        sys.stdout.write(text)
        sys.stdout.flush()
        return
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=folder, prefix="." + os.path.basename(path) + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def write_registration(ddp, path, model_name=None, generator=None, first_bucket_bytes=None):
    """Writes the file for a DDP model now (its buckets must be final); returns the document.

    first_bucket_bytes: the first-bucket cap to record (default: the current
    torch.distributed._DEFAULT_FIRST_BUCKET_BYTES)."""
    doc = registration(ddp, model_name, generator, first_bucket_bytes)
    write_registration_file(doc, path)
    return doc


# ---------------------------------------------------------------------------------------
# Deferred registration from a training script.


class Registration:
    """What register_ddp returns: the state of a pending or finished registration.

    done: the file was written (on this rank). document: what was written. error: the
    exception, when writing failed and strict was False. remove(): gives up (removes the
    hook) before the file is written.
    """

    def __init__(self, path, writes):
        self.path = path
        self.writes = writes
        self.done = False
        self.document = None
        self.error = None
        self._handle = None

    @property
    def pending(self):
        return self._handle is not None

    def remove(self):
        if self._handle is not None:
            self._handle.remove()
            self._handle = None

    def __repr__(self):
        state = "written" if self.done else ("failed" if self.error else ("pending" if self.pending else "inactive"))
        return f"<lgreco.register.Registration {self.path!r} {state}>"


def register_ddp(ddp, path, model_name=None, generator=None, write_rank=0, strict=False,
                 first_bucket_mb=None):
    """Writes the registration file of `ddp` once its buckets are final.

    Call it right after constructing DistributedDataParallel (before the first forward),
    then train as usual. A forward pre-hook on ddp.module checks, at each forward pass with
    gradients enabled, whether the buckets are final (DDP rebuilds them at the start of the
    second forward, or the third with static_graph); the first time they are, it reads the
    layout, writes `path` atomically and removes itself. It registers no comm hook and
    touches no gradient, so training is numerically unchanged, and it composes with a comm
    hook of the user's (registered before or after). Reading the layout allocates, once and
    for a moment, a zero buffer the size of all gradient buckets.

    path: the file to write; model_name: the file's "model" (default: the class name of
    ddp.module); generator: extra provenance merged into "generator". write_rank: the
    global rank that writes (default 0; all ranks have the same layout); None makes every
    rank write its own `path`. strict: raise errors from the hook (stopping training)
    instead of warning. first_bucket_mb: the first-bucket cap to record in "generator"
    (default: what DDP records on newer torch 2.x; elsewhere
    torch.distributed._DEFAULT_FIRST_BUCKET_BYTES as it is when register_ddp is called).
    It is provenance only: the layout is read from DDP, whatever the cap was.

    Under torch.compile the hook may not run as plain Python; call write_registration()
    after the second (or third, static_graph) training step instead.
    """
    torch = _import_torch()
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel
    if not isinstance(ddp, DistributedDataParallel):
        raise RegisterError(f"register_ddp needs a DistributedDataParallel, got {type(ddp).__name__}")
    _reducer(ddp)
    buckets_are_final(ddp)  # raises at once if this torch lacks what it relies on
    writes = write_rank is None or (dist.is_initialized() and dist.get_rank() == write_rank)
    state = Registration(path, writes)
    if not writes:
        return state
    if first_bucket_mb is not None:
        first_bucket_bytes = int(first_bucket_mb * 1024 * 1024)
    else:
        first_bucket_bytes = _ddp_first_bucket_bytes(ddp)
        if first_bucket_bytes is None:
            first_bucket_bytes = _first_bucket_bytes()

    def hook(module, inputs):
        if not torch.is_grad_enabled() or not buckets_are_final(ddp):
            return None
        state.remove()
        try:
            state.document = write_registration(ddp, path, model_name, generator, first_bucket_bytes)
            state.done = True
        except Exception as e:
            state.error = e
            if strict:
                raise
            warnings.warn(f"lgreco-register: could not write {path}: {type(e).__name__}: {e}",
                          RuntimeWarning, stacklevel=2)
        return None

    state._handle = ddp.module.register_forward_pre_hook(hook)
    return state


# ---------------------------------------------------------------------------------------
# Building a model from the command line.


def parse_shape(text):
    parts = [p.strip() for p in text.replace("x", ",").split(",")]
    try:
        dims = [int(p) for p in parts]
    except ValueError:
        raise UsageError(f"--input-shape {text!r}: expected positive integers separated by commas, "
                         "such as 2,3,224,224") from None
    if not dims or any(d <= 0 for d in dims):
        raise UsageError(f"--input-shape {text!r}: every dimension must be a positive integer")
    return dims


_INPUT_DTYPES = {
    "float32": "float32", "float": "float32", "float16": "float16", "half": "float16",
    "bfloat16": "bfloat16", "float64": "float64", "double": "float64",
    "int64": "int64", "long": "int64", "int32": "int32", "int": "int32",
}
_PARAM_DTYPES = ("float32", "float16", "bfloat16")


def _load_callable(spec, cwd=None):
    """`module:callable` or `path/to/file.py:callable`; the callable may be dotted (Cls.build)."""
    module_part, sep, attr_part = spec.rpartition(":")
    if not sep or not module_part or not attr_part:
        raise UsageError(f"--model {spec!r}: expected MODULE:CALLABLE (such as torchvision.models:resnet50) "
                         "or FILE.py:CALLABLE")
    if module_part.endswith(".py") or os.sep in module_part:
        path = os.path.abspath(module_part)
        if not os.path.isfile(path):
            raise UsageError(f"--model {spec!r}: no file {module_part}")
        name = "lgreco_register_user_" + os.path.splitext(os.path.basename(path))[0].replace("-", "_")
        sys.path.insert(0, os.path.dirname(path))  # so the file can import its neighbours
        try:
            loader_spec = importlib.util.spec_from_file_location(name, path)
            module = importlib.util.module_from_spec(loader_spec)
            sys.modules[name] = module
            loader_spec.loader.exec_module(module)
        except RegisterError:
            raise
        except Exception as e:
            raise RegisterError(f"--model {spec!r}: importing {module_part} failed: "
                                f"{type(e).__name__}: {_first_line(e)}") from None
    else:
        if cwd is not None and cwd not in sys.path:
            sys.path.insert(0, cwd)  # like `python -m`: the user's own packages
        try:
            module = importlib.import_module(module_part)
        except ModuleNotFoundError as e:
            missing = e.name or ""
            if module_part == missing or module_part.startswith(missing + "."):
                raise UsageError(f"--model {spec!r}: no module named {missing!r} "
                                 f"(python: {sys.executable})") from None
            raise RegisterError(f"--model {spec!r}: importing {module_part} failed: "
                                f"{type(e).__name__}: {_first_line(e)}") from None
        except Exception as e:
            raise RegisterError(f"--model {spec!r}: importing {module_part} failed: "
                                f"{type(e).__name__}: {_first_line(e)}") from None
    obj = module
    for part in attr_part.split("."):
        if not hasattr(obj, part):
            raise UsageError(f"--model {spec!r}: {module_part} has no attribute {attr_part!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise UsageError(f"--model {spec!r}: {attr_part} is not callable")
    return obj


def _output_tensors(out, torch):
    """Floating-point tensors of a model output, in order (tensors, sequences, mappings, .logits)."""
    if isinstance(out, torch.Tensor):
        if out.is_floating_point():
            yield out
        return
    if isinstance(out, dict):  # also transformers' ModelOutput
        if "logits" in out:
            yield from _output_tensors(out["logits"], torch)
        for key, value in out.items():
            if key != "logits":
                yield from _output_tensors(value, torch)
        return
    if isinstance(out, (list, tuple)):
        for value in out:
            yield from _output_tensors(value, torch)
        return
    for attr in ("logits", "last_hidden_state"):
        value = getattr(out, attr, None)
        if isinstance(value, torch.Tensor):
            yield from _output_tensors(value, torch)
            return


def make_loss(out, mode, torch):
    """first: mean of the primary tensor (the tensor itself, .logits, the first element of a
    tuple); all: sum of the means of every floating-point tensor of the output."""
    tensors = [t for t in _output_tensors(out, torch) if t.requires_grad]
    if not tensors:
        raise RegisterError(f"the model's output ({type(out).__name__}) holds no floating-point tensor "
                            "that requires grad; nothing to differentiate")
    if mode == "first":
        return tensors[0].float().mean()
    return sum(t.float().mean() for t in tensors)


def _free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _record_hook(records):
    """A comm hook recording what DDP hands to allreduce, then doing the allreduce (CLI only)."""
    import torch.distributed as dist

    def hook(process_group, bucket):
        if bucket.index() == 0:
            records.append([])
        buf = bucket.buffer()
        records[-1].append((buf.numel(), str(buf.dtype), [id(p) for p in bucket.parameters()]))
        work = dist.all_reduce(buf, group=process_group, async_op=True)
        return work.get_future().then(lambda fut: fut.value()[0])

    return hook


def generate(model_spec, input_shape, output, model_args=None, model_name=None, input_dtype="float32",
             input_high=2, param_dtype=None, loss="first", bucket_cap_mb=None, first_bucket_mb=None,
             find_unused_parameters=False, gradient_as_bucket_view=False, static_graph=False, seed=0,
             cwd=None, max_steps=4):
    """The command line's work: build, wrap in DDP (one-process gloo group on the CPU), train
    until the buckets are final, write the file. Returns the document."""
    if model_args is None:
        model_args = {}
    torch = _import_torch()
    factory = _load_callable(model_spec, cwd)
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    if first_bucket_mb is not None and not hasattr(dist, "_DEFAULT_FIRST_BUCKET_BYTES"):
        raise UsageError(f"--first-bucket-mb: torch {torch.__version__} has no "
                         "torch.distributed._DEFAULT_FIRST_BUCKET_BYTES to set")
    torch.manual_seed(seed)
    try:
        model = factory(**model_args)
    except Exception as e:
        raise RegisterError(f"--model {model_spec!r}: building the model failed: "
                            f"{type(e).__name__}: {_first_line(e)}") from None
    if not isinstance(model, torch.nn.Module):
        raise RegisterError(f"--model {model_spec!r} returned a {type(model).__name__}, not a torch.nn.Module")
    if not any(p.requires_grad for p in model.parameters()):
        raise RegisterError(f"--model {model_spec!r}: the model has no parameter that requires grad")
    if param_dtype is not None:
        model = model.to(getattr(torch, param_dtype))
    model.train()

    in_dtype = getattr(torch, _INPUT_DTYPES[input_dtype])
    if in_dtype.is_floating_point and param_dtype is not None and input_dtype == "float32":
        in_dtype = getattr(torch, param_dtype)  # a float input follows the parameters

    def example():
        if in_dtype.is_floating_point:
            return torch.randn(*input_shape, dtype=in_dtype)
        return torch.randint(0, input_high, tuple(input_shape), dtype=in_dtype)

    created_group = False
    saved_first = getattr(dist, "_DEFAULT_FIRST_BUCKET_BYTES", None)
    if not dist.is_initialized():
        env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())}
        if "GLOO_SOCKET_IFNAME" not in os.environ and os.path.exists("/sys/class/net/lo"):
            env["GLOO_SOCKET_IFNAME"] = "lo"
        saved_env = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            dist.init_process_group("gloo", rank=0, world_size=1)
        except Exception as e:
            raise RegisterError(f"cannot start a one-process gloo group on 127.0.0.1: {_first_line(e)}") from None
        finally:
            for k, v in saved_env.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        created_group = True
    try:
        if first_bucket_mb is not None:
            dist._DEFAULT_FIRST_BUCKET_BYTES = int(first_bucket_mb * 1024 * 1024)
        ddp_kwargs = {"find_unused_parameters": find_unused_parameters,
                      "gradient_as_bucket_view": gradient_as_bucket_view, "static_graph": static_graph}
        if bucket_cap_mb is not None:  # else DDP's default, which on newer torch differs from 25
            ddp_kwargs["bucket_cap_mb"] = bucket_cap_mb
        try:
            ddp = DistributedDataParallel(model, **ddp_kwargs)
        except Exception as e:
            hint = ""
            if "Invalid scalar type" in str(e):
                hint = f" (this torch's gloo backend cannot handle {param_dtype} tensors)"
            raise RegisterError(f"wrapping the model in DistributedDataParallel failed: "
                                f"{type(e).__name__}: {_first_line(e)}{hint}") from None
        finally:
            first_bytes = _first_bucket_bytes()
            if first_bucket_mb is not None:
                dist._DEFAULT_FIRST_BUCKET_BYTES = saved_first
        recorded_first = _ddp_first_bucket_bytes(ddp)
        if recorded_first is not None:
            if first_bucket_mb is not None and recorded_first != first_bytes:
                raise UsageError(f"--first-bucket-mb has no effect on torch {torch.__version__} together with "
                                 "--bucket-cap-mb (DDP then caps the first bucket like the others)")
            first_bytes = recorded_first

        records = []
        ddp.register_comm_hook(ddp.process_group, _record_hook(records))
        extra = {"model_spec": model_spec, "model_args": model_args, "input_shape": list(input_shape),
                 "input_dtype": str(in_dtype).replace("torch.", ""), "loss": loss, "steps": None}
        if param_dtype is not None:
            extra["param_dtype"] = param_dtype
        sink = {}

        def capture(module, inputs):
            if torch.is_grad_enabled() and buckets_are_final(ddp) and "doc" not in sink:
                sink["doc"] = registration(ddp, model_name, extra, first_bytes)
                sink["step"] = len(records) + 1
            return None

        handle = ddp.module.register_forward_pre_hook(capture)
        shape_text = "x".join(str(d) for d in input_shape)
        for step in range(1, max_steps + 1):
            x = example()
            try:
                out = ddp(x)
            except RegisterError:
                raise
            except Exception as e:
                if "finished reduction in the prior iteration" in str(e):
                    raise RegisterError(
                        f"step {step}: DDP found parameters that received no gradient in step {step - 1}; "
                        "if other outputs of the model use them, try --loss all, otherwise "
                        "--find-unused-parameters (as the training job must)") from None
                raise RegisterError(f"forward pass of {model_spec} on a random input ("
                                    f"{str(in_dtype).replace('torch.', '')}, shape {shape_text}) failed: "
                                    f"{type(e).__name__}: {_first_line(e)} "
                                    "(check --input-shape / --input-dtype)") from None
            lossv = make_loss(out, loss, torch)
            try:
                lossv.backward()
            except Exception as e:
                raise RegisterError(f"step {step}: backward pass failed: {type(e).__name__}: "
                                    f"{_first_line(e)}") from None
            if "doc" in sink and len(records) >= sink["step"]:
                break
        handle.remove()
        if "doc" not in sink:
            raise RegisterError(f"DDP's buckets were not final after {max_steps} steps")
        doc = sink["doc"]
        doc["generator"]["steps"] = sink["step"]
        _cross_check(doc, records[sink["step"] - 1], ddp)
        write_registration_file(doc, output)
        return doc
    finally:
        if created_group:
            dist.destroy_process_group()


def _cross_check(doc, recorded, ddp):
    """The file against what the comm hook saw in the same step: counts, dtypes, order."""
    names, sizes = {}, {}
    for name, p in ddp.module.named_parameters():
        names.setdefault(id(p), name)
        sizes[name] = p.numel()
    if len(recorded) != len(doc["buckets"]):
        raise RegisterError(f"internal check failed: {len(doc['buckets'])} buckets in the layout, "
                            f"{len(recorded)} allreduced")
    for b, (bucket, (count, dtype, ids)) in enumerate(zip(doc["buckets"], recorded)):
        seen = [names.get(i, "?") for i in ids]
        seen = [n for n in seen if sizes.get(n, 1) > 0]  # the file omits parameters without elements
        if (bucket["count"] != count or _FILE_DTYPES.get(dtype) != bucket["dtype"]
                or [layer["name"] for layer in bucket["layers"]] != seen):
            raise RegisterError(f"internal check failed: bucket {b} differs from what DDP allreduced "
                                f"({count} {dtype} elements)")


# ---------------------------------------------------------------------------------------
# --check: the C++ validator.


def find_config_tool(script_dirs):
    """lgreco-config: $LGRECO_CONFIG_TOOL, the package's own (or its source tree's build),
    next to the launcher, ../build/bin from it, or PATH."""
    env = os.environ.get("LGRECO_CONFIG_TOOL")
    if env:
        if os.path.isfile(env) and os.access(env, os.X_OK):
            return env
        raise RegisterError(f"LGRECO_CONFIG_TOOL={env} is not an executable file")
    try:
        from . import LgrecoError, config_tool_path  # noqa: PLC0415
        try:
            return config_tool_path()
        except LgrecoError:
            pass
    except ImportError:  # loaded as a plain file, outside the package
        pass
    tried = []
    for d in script_dirs:
        for candidate in (os.path.join(d, "lgreco-config"),
                          os.path.normpath(os.path.join(d, "..", "build", "bin", "lgreco-config"))):
            if candidate in tried:
                continue
            tried.append(candidate)
            if os.path.isfile(candidate) and os.access(candidate, os.X_OK):
                return candidate
    found = shutil.which("lgreco-config")
    if found:
        return found
    raise RegisterError("cannot find lgreco-config (tried $LGRECO_CONFIG_TOOL, " + ", ".join(tried) +
                        " and PATH); build it with `make` or set LGRECO_CONFIG_TOOL")


def run_check(path, script_dirs):
    tool = find_config_tool(script_dirs)
    sys.stdout.flush()
    try:
        return subprocess.call([tool, "check", path])
    except OSError as e:
        raise RegisterError(f"cannot run {tool}: {e.strerror}") from None


# ---------------------------------------------------------------------------------------
# Command line.

DESCRIPTION = """\
Writes lgreco's registration file for a PyTorch DDP model: which parameters make up each
gradient bucket that DistributedDataParallel allreduces, in order. The model is built from
an import path, wrapped in DDP in a one-process gloo group on the CPU (127.0.0.1, a free
port) and trained on random input until DDP's buckets are final (2 steps; 1 with
--find-unused-parameters, 3 with --static-graph). Use the same DDP settings (--bucket-cap-mb ...) and the same torch as the
training job: the layout depends on both. From a training script, use
lgreco.torch.register_ddp() instead (docs/REGISTER_TOOL.md)."""

EPILOG = """\
examples:
  lgreco-register --model torchvision.models:resnet50 --input-shape 2,3,224,224 -o resnet50.json
  lgreco-register --model mypkg.models:build --model-args '{"layers": 12}' \\
      --input-shape 2,128 --input-dtype long --input-high 30522 -o mymodel.json
  lgreco-register --model path/to/models.py:bert_base --input-shape 2,128 --input-dtype long -o bert.json
  lgreco-register --check resnet50.json

exit status: 0 success (--check: lgreco-config's status: 0 valid, 1 invalid);
1 failure; 2 command-line mistake."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise UsageError(f"{message} (see --help)")


def build_parser():
    p = _Parser(prog=TOOL_NAME, description=DESCRIPTION, epilog=EPILOG,
                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", metavar="MODULE:CALLABLE",
                   help="the callable that returns the model (an nn.Module): MODULE:CALLABLE, imported "
                        "with the current folder on the path (torchvision.models:resnet50, "
                        "mypkg.models:build), or FILE.py:CALLABLE")
    p.add_argument("--model-args", metavar="JSON", default="{}",
                   help="keyword arguments for the callable, a JSON object (default: {})")
    p.add_argument("--model-name", metavar="NAME",
                   help="the file's \"model\" field (default: the callable's name)")
    p.add_argument("--input-shape", metavar="N,...",
                   help="shape of the random example input, such as 2,3,224,224 (a small batch is enough)")
    p.add_argument("--input-dtype", metavar="DTYPE", default="float32", choices=sorted(_INPUT_DTYPES),
                   help="dtype of the input: float32 (default; follows --param-dtype), float16, bfloat16, "
                        "float64, int64/long, int32/int (token ids)")
    p.add_argument("--input-high", metavar="N", type=int, default=2,
                   help="integer inputs are drawn uniformly from [0, N) (default 2: valid for any "
                        "embedding; the layout does not depend on the values)")
    p.add_argument("--param-dtype", metavar="DTYPE", choices=_PARAM_DTYPES,
                   help="convert the model's parameters (and so its gradient buckets) to float16 or "
                        "bfloat16 (default: as built; under AMP gradients stay float32). Needs "
                        "CPU kernels and gloo support for that dtype in the installed torch")
    p.add_argument("--loss", choices=("first", "all"), default="first",
                   help="first (default): mean of the output tensor, of .logits or of the first "
                        "element of a tuple; all: sum of the means of every floating-point output")
    p.add_argument("--bucket-cap-mb", metavar="MB", type=float,
                   help="DDP's bucket_cap_mb, in MiB (default: not passed, so DDP's default, 25). Give it "
                        "only if the training job passes bucket_cap_mb: on newer torch 2.x an explicit "
                        "bucket_cap_mb, even 25, also caps the first bucket (instead of 1 MiB)")
    p.add_argument("--first-bucket-mb", metavar="MB", type=float,
                   help="cap of DDP's first bucket, in MiB (torch.distributed._DEFAULT_FIRST_BUCKET_BYTES; "
                        "default: the installed torch's, 1 MiB)")
    p.add_argument("--find-unused-parameters", action="store_true",
                   help="DDP's find_unused_parameters=True (DDP then never rebuilds its buckets)")
    p.add_argument("--gradient-as-bucket-view", action="store_true",
                   help="DDP's gradient_as_bucket_view=True")
    p.add_argument("--static-graph", action="store_true", help="DDP's static_graph=True")
    p.add_argument("--seed", type=int, default=0, help="random seed for the model and input (default 0)")
    p.add_argument("-o", "--output", metavar="FILE", help="the file to write ('-': standard output)")
    p.add_argument("--check", metavar="FILE",
                   help="validate FILE with lgreco-config check (found through $LGRECO_CONFIG_TOOL, the "
                        "lgreco package's, or PATH) and exit with its status; needs no torch")
    return p


def _cli(argv, script_dirs):
    args = build_parser().parse_args(argv)
    if args.check is not None:
        model_opts = [o for o, v in (("--model", args.model), ("--input-shape", args.input_shape),
                                     ("-o", args.output)) if v is not None]
        if model_opts:
            raise UsageError(f"--check cannot be combined with {', '.join(model_opts)} (see --help)")
        return run_check(args.check, script_dirs)
    missing = [o for o, v in (("--model", args.model), ("--input-shape", args.input_shape),
                              ("-o/--output", args.output)) if v is None]
    if missing:
        raise UsageError(f"missing {', '.join(missing)} (or use --check FILE; see --help)")
    shape = parse_shape(args.input_shape)
    try:
        model_args = json.loads(args.model_args)
    except ValueError as e:
        raise UsageError(f"--model-args: not valid JSON ({e})") from None
    if not isinstance(model_args, dict):
        raise UsageError("--model-args: expected a JSON object of keyword arguments, such as {\"depth\": 12}")
    if args.bucket_cap_mb is not None and (args.bucket_cap_mb <= 0 or not math.isfinite(args.bucket_cap_mb)):
        raise UsageError("--bucket-cap-mb: must be a positive number")
    if args.first_bucket_mb is not None and (args.first_bucket_mb <= 0 or not math.isfinite(args.first_bucket_mb)):
        raise UsageError("--first-bucket-mb: must be a positive number")
    if args.input_high <= 0:
        raise UsageError("--input-high: must be a positive integer")
    if args.output != "-":
        folder = os.path.dirname(os.path.abspath(args.output))
        if not os.path.isdir(folder):
            raise UsageError(f"-o {args.output}: no folder {folder}")
    model_name = args.model_name or args.model.rpartition(":")[2].rpartition(".")[2]
    doc = generate(args.model, shape, args.output, model_args=model_args, model_name=model_name,
                   input_dtype=args.input_dtype, input_high=args.input_high, param_dtype=args.param_dtype,
                   loss=args.loss, bucket_cap_mb=args.bucket_cap_mb, first_bucket_mb=args.first_bucket_mb,
                   find_unused_parameters=args.find_unused_parameters,
                   gradient_as_bucket_view=args.gradient_as_bucket_view, static_graph=args.static_graph,
                   seed=args.seed, cwd=os.getcwd())
    layers = sum(len(b["layers"]) for b in doc["buckets"])
    elements = sum(b["count"] for b in doc["buckets"])
    where = "standard output" if args.output == "-" else args.output
    print(f"{TOOL_NAME}: wrote {where}: {doc['model']}, {len(doc['buckets'])} buckets, {layers} layers, "
          f"{elements} elements (torch {doc['generator']['torch']}, bucket_cap_mb "
          f"{doc['generator'].get('bucket_cap_mb')})", file=sys.stderr)
    return 0


def main(argv=None, script_dir=None):
    """Command-line entry point; returns the exit status."""
    dirs = []
    for d in (script_dir,):
        if d and d not in dirs:
            dirs.append(d)
    try:
        return _cli(sys.argv[1:] if argv is None else argv, dirs)
    except RegisterError as e:
        print(f"{TOOL_NAME}: error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print(f"{TOOL_NAME}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
