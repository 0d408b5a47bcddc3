"""lgreco: layer-wise adaptive gradient compression (L-GreCo) inside NCCL's allreduce.

The product is a shared library, liblgreco.so, that a job loads with LD_PRELOAD (it
intercepts ncclAllReduce) or as NCCL's net plugin. This package carries it and the tools
around it:

    lgreco-run [options] -- torchrun ...   run a job with the library loaded
    lgreco info                            versions, paths, what the library would find
    lgreco plot DECISION_LOG               the controller's decisions drawn (matplotlib)
    lgreco-register                        write a model's registration file (PyTorch)
    lgreco.torch.register_ddp(ddp, path)   the same from a training script

Nothing here imports torch or matplotlib unless the function that needs them is called.
"""

import json
import os

__all__ = ["__version__", "library_path", "config_tool_path", "build_info", "LgrecoError"]


class LgrecoError(Exception):
    """A problem the user can fix; the command-line tools print its message and exit 1."""


_PACKAGE = os.path.dirname(os.path.abspath(__file__))
# In a source tree (PYTHONPATH=python, or `pip install -e .`) the Makefile's outputs.
_SOURCE_BUILD = os.path.normpath(os.path.join(_PACKAGE, "..", "..", "build"))


def _installed(relative):
    path = os.path.join(_PACKAGE, relative)
    return path if os.path.isfile(path) else None


def _find(relative, build_relative, what):
    path = _installed(relative)
    if path:
        return path
    source = os.path.join(_SOURCE_BUILD, build_relative)
    if os.path.isfile(source):
        return source
    raise LgrecoError("lgreco's %s is missing: looked for %s (an installed package) and %s (a source tree's build); "
                      "reinstall the package (pip install .) or build it (make)" %
                      (what, os.path.join(_PACKAGE, relative), source))


def library_path():
    """The absolute path of liblgreco.so, for LD_PRELOAD and NCCL_NET_PLUGIN."""
    return _find(os.path.join("_lib", "liblgreco.so"), os.path.join("lib", "liblgreco.so"), "library liblgreco.so")


def config_tool_path():
    """The absolute path of lgreco-config, built with the same sources as the library."""
    return _find(os.path.join("_bin", "lgreco-config"), os.path.join("bin", "lgreco-config"), "tool lgreco-config")


def build_info():
    """What the library was built from: version, git, variant (cpu, cu130), CUDA runtime.

    An installed package reads what its wheel recorded; a source tree asks its built
    lgreco-config.
    """
    path = _installed("_build_info.json")
    if path:
        with open(path) as f:
            return json.load(f)
    from . import _config  # noqa: PLC0415 (only a source tree needs the tool for this)
    info = _config.version()
    info["wheel_version"] = "%s+%s" % (info["version"], info["variant"])
    return info


def __getattr__(name):
    # __version__ on first use: in a source tree it runs lgreco-config, which an import
    # should not do.
    if name == "__version__":
        try:
            return build_info()["wheel_version"]
        except (LgrecoError, OSError, ValueError, KeyError):
            return "unknown"
    raise AttributeError("module 'lgreco' has no attribute %r" % name)
