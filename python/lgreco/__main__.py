"""The `lgreco` command (also `python -m lgreco`).

    lgreco info            this package's version and library; the NCCL and CUDA a job
                           would find; the effective parameters (lgreco-config show)
    lgreco run ...         the same as lgreco-run ...
    lgreco plot LOG        a decision log drawn (lgreco plot --help; needs matplotlib)
"""

import argparse
import ctypes
import ctypes.util
import os
import signal
import sys

from . import LgrecoError, _config, build_info, config_tool_path, library_path

PROG = "lgreco"


def _cuda_text(version):
    return "%d.%d" % (version // 1000, version % 1000 // 10)


def _loaded_nccl_paths():
    """The libnccl files mapped into this process (what the shim would use)."""
    paths = []
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.split()[-1] if len(line.split()) >= 6 else ""
                if "libnccl" in os.path.basename(path) and path not in paths:
                    paths.append(path)
    except OSError:
        pass
    return paths


def _nccl_version_of(path):
    """ncclGetVersion() of a libnccl file, as "2.28.9"; loading it initialises nothing."""
    try:
        lib = ctypes.CDLL(path, mode=os.RTLD_LAZY | os.RTLD_LOCAL)
        code = ctypes.c_int(0)
        if lib.ncclGetVersion(ctypes.byref(code)) != 0:
            return None
    except (OSError, AttributeError):
        return None
    v = code.value
    return "%d.%d.%d" % (v // 10000, v // 100 % 100, v % 100) if v >= 10000 else str(v)


def nccl_report(use_torch):
    """Lines saying which NCCL a job would use: torch's (the framework's copy, which the
    shim uses), else the system's libnccl.so.2."""
    lines = []
    if use_torch:
        try:
            import torch  # noqa: PLC0415 (optional)
        except ImportError:
            lines.append("torch: not importable here (the NCCL a PyTorch job uses comes with its torch)")
        else:
            nccl = None
            try:
                if torch.cuda.is_available() or hasattr(torch.cuda, "nccl"):
                    nccl = torch.cuda.nccl.version()
            except (RuntimeError, AttributeError, TypeError):
                nccl = None
            if nccl:
                v = ".".join(str(x) for x in nccl) if isinstance(nccl, tuple) else str(nccl)
                where = ", ".join(_loaded_nccl_paths()) or "linked into torch"
                lines.append("torch %s: NCCL %s (%s)" % (torch.__version__, v, where))
            else:
                lines.append("torch %s: built without NCCL (a CPU build: lgreco's shim has nothing to intercept; "
                             "CPU jobs use gloo)" % torch.__version__)
    system = ctypes.util.find_library("nccl")
    if system:
        version = _nccl_version_of(system)
        lines.append("system: %s%s" % (system, ", NCCL " + version if version else " (ncclGetVersion failed)"))
    else:
        lines.append("system: no libnccl on the loader's path (ldconfig -p)")
    return lines


def info(args):
    build = build_info()
    lib = library_path()
    print("lgreco %s (git %s)" % (build["wheel_version"], build.get("git", "unknown")))
    print("library:        %s (%.1f MiB)" % (lib, os.path.getsize(lib) / 2**20))
    print("lgreco-config:  %s" % config_tool_path())
    versions = _config.version()  # this host's driver, from the tool built with the library
    runtime = int(versions.get("cuda_runtime", 0))
    print("built against:  nccl.h %s; %s" % (
        versions.get("nccl_header") or "none",
        "CUDA runtime %s, linked statically" % _cuda_text(runtime) if runtime else "no CUDA (CPU only)"))
    if runtime:
        driver = int(versions.get("cuda_driver", 0))
        need = versions.get("driver_required", "")
        if driver == 0:
            state = "no NVIDIA driver found on this host (the library loads; compression on GPUs needs one)"
        elif driver < runtime // 1000 * 1000:
            state = "this host's driver supports CUDA %s only: too old, update it" % _cuda_text(driver)
        else:
            state = "this host's driver supports CUDA %s: fine" % _cuda_text(driver)
        print("CUDA driver:    needs NVIDIA driver >= %s (CUDA %s); %s" % (need, _cuda_text(runtime // 1000 * 1000),
                                                                            state))
    print("NCCL:")
    for line in nccl_report(not args.no_torch):
        print("  " + line)
    print("parameters (lgreco-config show):")
    status, out, err = _config.show(dict(os.environ))
    for line in out.splitlines():
        print("  " + line)
    for line in err.splitlines():
        print("  " + line)
    return 0 if status == 0 else 1


def build_parser():
    p = argparse.ArgumentParser(prog=PROG, description="lgreco's command-line tools (docs/USAGE.md).")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    i = sub.add_parser("info", help="versions, library path, the NCCL and CUDA a job would find, the parameters",
                       description="Prints this package's version and library, what it was built against, this "
                                   "host's CUDA driver, the NCCL a job would use, and lgreco-config show. "
                                   "Exit status 1 when the configuration in the environment is invalid.")
    i.add_argument("--no-torch", action="store_true", help="do not import torch to find its NCCL")
    sub.add_parser("run", help="the same as lgreco-run (lgreco run --help)", add_help=False)
    sub.add_parser("plot", help="draw a decision log (lgreco plot --help; needs matplotlib)", add_help=False)
    return p


def main(argv=None):
    # `lgreco info | head` ends quietly, as a shell tool does.
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "run":
        from . import run  # noqa: PLC0415
        return run.main(argv[1:])
    if argv and argv[0] == "plot":
        from . import plot  # noqa: PLC0415
        return plot.main(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    try:
        return info(args)
    except LgrecoError as e:
        sys.stderr.write("%s: error: %s\n" % (PROG, e))
        return 1


if __name__ == "__main__":
    sys.exit(main())
