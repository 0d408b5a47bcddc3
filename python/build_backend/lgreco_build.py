"""lgreco's PEP 517 build backend: `pip install .` and `pip wheel .` without setuptools.

Why an in-tree backend: pip builds in an isolated environment and would download the
backend it is told to use; the GPU machines and many clusters have no network. This one
needs nothing beyond the standard library (`requires = []` in pyproject.toml), so
`PIP_NO_INDEX=1 pip install .` works offline.

What it does:
  1. `make` in the source tree builds build/lib/liblgreco.so and build/bin/lgreco-config,
     reusing what build/ already holds (the CUDA objects take minutes; nothing is built
     twice). Setuptools' own build folder never exists: nothing here writes under build/
     but the Makefile.
  2. Copies of both, stripped of debug information and local symbols, go into the wheel as
     lgreco/_lib/liblgreco.so and lgreco/_bin/lgreco-config, next to the Python sources
     of python/lgreco. One copy of the library only: a wheel cannot hold the plugin name's
     symlink, and a second copy would load lgreco twice under LD_PRELOAD plus
     NCCL_NET_PLUGIN (lgreco-run sets NCCL_NET_PLUGIN to the library's absolute path).
  3. The version comes from the built lgreco-config (`version`): "0.1.0+cu130" for a build
     with CUDA 13.0's runtime, "0.1.0+cpu" without CUDA. The tag is py3-none-linux_x86_64:
     the Python side is version-independent, the library is not portable beyond x86-64
     Linux.

Settings (environment): LGRECO_MAKE (default "make"), LGRECO_MAKE_JOBS (default: the
CPUs), LGRECO_MAKEFLAGS (more arguments for make, e.g. "CUDA_HOME=/opt/cuda").
"""

import base64
import hashlib
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import zipfile

NAME = "lgreco"
TAG = "py3-none-linux_x86_64"
SUMMARY = "Layer-wise adaptive gradient compression (L-GreCo) for NCCL allreduce: LD_PRELOAD shim and NCCL net plugin"
LIBRARY = "build/lib/liblgreco.so"
CONFIG_TOOL = "build/bin/lgreco-config"
ENTRY_POINTS = """[console_scripts]
lgreco = lgreco.__main__:main
lgreco-run = lgreco.run:main
lgreco-register = lgreco.register:main
"""


class BuildError(Exception):
    pass


def _root():
    # pip runs the backend with the source tree as the working directory.
    root = os.path.abspath(os.getcwd())
    if not os.path.isfile(os.path.join(root, "Makefile")) or not os.path.isdir(os.path.join(root, "python", NAME)):
        raise BuildError("lgreco's build backend must run in lgreco's source tree (with Makefile and python/lgreco); "
                         "the working directory is %s" % root)
    return root


def _log(text):
    sys.stderr.write("lgreco build: %s\n" % text)
    sys.stderr.flush()


def _make(root):
    make = os.environ.get("LGRECO_MAKE", "make")
    if shutil.which(make) is None:
        raise BuildError("cannot find '%s' (GNU make) to build liblgreco.so; install it (Debian: apt-get install make), "
                         "or set LGRECO_MAKE" % make)
    jobs = os.environ.get("LGRECO_MAKE_JOBS") or str(os.cpu_count() or 1)
    cmd = [make, "-C", root, "-j" + jobs] + shlex.split(os.environ.get("LGRECO_MAKEFLAGS", "")) + [LIBRARY, CONFIG_TOOL]
    _log("running " + " ".join(shlex.quote(c) for c in cmd))
    # make's output goes to stderr: pip shows it with -v, and on failure.
    rc = subprocess.call(cmd, stdout=sys.stderr.fileno(), stderr=sys.stderr.fileno())
    if rc != 0:
        raise BuildError("make failed (exit %d) building %s and %s; the build's packages come from `make deps` "
                         "(root, Debian), README.md says which" % (rc, LIBRARY, CONFIG_TOOL))
    for path in (LIBRARY, CONFIG_TOOL):
        if not os.path.isfile(os.path.join(root, path)):
            raise BuildError("make succeeded but %s is missing" % path)


def _build_info(root):
    tool = os.path.join(root, CONFIG_TOOL)
    try:
        out = subprocess.run([tool, "version"], check=True, capture_output=True, text=True, timeout=60).stdout
        info = json.loads(out)
    except (OSError, subprocess.SubprocessError, ValueError) as e:
        raise BuildError("cannot read the build's versions from %s version: %s" % (tool, e)) from e
    # The local version label names the build's variant: cu130 for CUDA 13.0, cpu without CUDA.
    info["wheel_version"] = "%s+%s" % (info["version"], info["variant"])
    return info


def _strip(src, dst):
    """Copies src to dst without debug information and local symbols (dynamic symbols stay)."""
    strip = os.environ.get("STRIP", "strip")
    if shutil.which(strip) is None:
        raise BuildError("cannot find '%s' (binutils) to strip %s; install binutils or set STRIP" % (strip, src))
    subprocess.run([strip, "--strip-unneeded", "-o", dst, src], check=True)


def _metadata(info):
    readme = ("lgreco compresses the gradients of data-parallel training layer by layer (L-GreCo) inside NCCL's "
              "allreduce, with no change to the training script: `lgreco-run -- torchrun ...`.\n\n"
              "Optional, never installed by pip: PyTorch (lgreco-register, lgreco.torch), matplotlib (lgreco plot). "
              "Built with CUDA runtime %s (static): %s.\n" %
              (info["cuda_runtime"] or "none",
               "needs an NVIDIA driver >= %s" % info["driver_required"] if info["driver_required"] else "CPU only"))
    return ("Metadata-Version: 2.1\nName: %s\nVersion: %s\nSummary: %s\n"
            "Requires-Python: >=3.8\nClassifier: Operating System :: POSIX :: Linux\n"
            "Description-Content-Type: text/markdown\n\n%s" % (NAME, info["wheel_version"], SUMMARY, readme))


def _wheel_text():
    return "Wheel-Version: 1.0\nGenerator: lgreco_build\nRoot-Is-Purelib: false\nTag: %s\n" % TAG


class _Wheel:
    """A wheel file: zip entries plus the RECORD of their hashes (PEP 427)."""

    def __init__(self, path):
        self.zip = zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED)
        self.records = []

    def add(self, name, data, executable=False):
        entry = zipfile.ZipInfo(name, date_time=(2020, 1, 1, 0, 0, 0))
        entry.compress_type = zipfile.ZIP_DEFLATED
        entry.external_attr = ((0o755 if executable else 0o644) | 0o100000) << 16
        self.zip.writestr(entry, data)
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        self.records.append("%s,sha256=%s,%d" % (name, digest, len(data)))

    def close(self, record_name):
        self.records.append(record_name + ",,")
        self.zip.writestr(zipfile.ZipInfo(record_name, date_time=(2020, 1, 1, 0, 0, 0)),
                          "\n".join(self.records) + "\n")
        self.zip.close()


def _python_sources(root):
    base = os.path.join(root, "python")
    for dirpath, dirnames, filenames in os.walk(os.path.join(base, NAME)):
        dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
        for f in sorted(filenames):
            if f.endswith(".py"):
                full = os.path.join(dirpath, f)
                yield os.path.relpath(full, base).replace(os.sep, "/"), full


def _dist_info(info):
    return "%s-%s.dist-info" % (NAME, info["wheel_version"])


# ---------------------------------------------------------------------------------------
# PEP 517 hooks

def get_requires_for_build_wheel(config_settings=None):
    return []


def get_requires_for_build_editable(config_settings=None):
    return []


def _build(wheel_directory, add_payload):
    """make, then a wheel of add_payload(wheel, root, info)'s files and the metadata."""
    try:
        root = _root()
        _make(root)
        info = _build_info(root)
        name = "%s-%s-%s.whl" % (NAME, info["wheel_version"], TAG)
        dist_info = _dist_info(info)
        path = os.path.join(wheel_directory, name)
        wheel = _Wheel(path)
        add_payload(wheel, root, info)
        wheel.add(dist_info + "/METADATA", _metadata(info).encode())
        wheel.add(dist_info + "/WHEEL", _wheel_text().encode())
        wheel.add(dist_info + "/entry_points.txt", ENTRY_POINTS.encode())
        wheel.close(dist_info + "/RECORD")
        _log("wrote %s (%.1f MiB)" % (path, os.path.getsize(path) / 2**20))
        return name
    except BuildError as e:
        # One line pip shows as the cause, instead of a traceback through this file.
        raise SystemExit("error: %s" % e) from None


def _installed_payload(wheel, root, info):
    for arcname, full in _python_sources(root):
        with open(full, "rb") as f:
            wheel.add(arcname, f.read())
    build_info = {k: info[k] for k in ("version", "git", "variant", "nccl_header", "cuda_runtime", "driver_required")}
    build_info["wheel_version"] = info["wheel_version"]
    wheel.add(NAME + "/_build_info.json", (json.dumps(build_info, indent=1, sort_keys=True) + "\n").encode())
    with tempfile.TemporaryDirectory(prefix="lgreco-wheel-") as tmp:
        for src, arcname in ((LIBRARY, NAME + "/_lib/liblgreco.so"), (CONFIG_TOOL, NAME + "/_bin/lgreco-config")):
            stripped = os.path.join(tmp, os.path.basename(src))
            _strip(os.path.join(root, src), stripped)
            with open(stripped, "rb") as f:
                wheel.add(arcname, f.read(), executable=True)


def _editable_payload(wheel, root, info):
    wheel.add("__editable__.%s.pth" % NAME, (os.path.join(root, "python") + "\n").encode())


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    return _build(wheel_directory, _installed_payload)


def build_editable(wheel_directory, config_settings=None, metadata_directory=None):
    """`pip install -e .`: a .pth file puts python/ on the path; the library is build/lib's."""
    return _build(wheel_directory, _editable_payload)


def build_sdist(sdist_directory, config_settings=None):
    raise SystemExit("error: lgreco has no source distribution; install from the source tree (pip install .) "
                     "or build a wheel (pip wheel .)")
