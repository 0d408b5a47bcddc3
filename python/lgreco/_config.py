"""lgreco-config, the library's own tool, as Python sees it.

The parameter table lives in the library's sources (config/params.cc) only: lgreco-run's
options and `lgreco info` read it from lgreco-config, built from the same sources as the
library, instead of keeping a second copy here.
"""

import json
import subprocess

from . import LgrecoError, config_tool_path


def _run(args, env=None, check=True):
    tool = config_tool_path()
    try:
        proc = subprocess.run([tool] + args, capture_output=True, text=True, env=env, timeout=120)
    except OSError as e:
        raise LgrecoError("cannot run %s: %s" % (tool, e)) from e
    except subprocess.TimeoutExpired as e:
        raise LgrecoError("%s %s did not answer within 120 s" % (tool, " ".join(args))) from e
    if check and proc.returncode != 0:
        raise LgrecoError("%s %s failed (exit %d): %s" % (tool, " ".join(args), proc.returncode,
                                                           proc.stderr.strip() or proc.stdout.strip()))
    return proc


def _json(args):
    proc = _run(args)
    try:
        return json.loads(proc.stdout)
    except ValueError as e:
        raise LgrecoError("%s %s printed no valid JSON (%s); is it from another lgreco version?" %
                          (config_tool_path(), " ".join(args), e)) from e


def version():
    """{"version", "git", "nccl_header", "cuda_runtime", "cuda_driver", "driver_required", "variant"}."""
    return _json(["version"])


def parameters():
    """The parameter table: a list of {"name", "default", "accepted", "meaning"}."""
    return _json(["params"])


def show(env):
    """`lgreco-config show` under `env`: (exit status, stdout, stderr)."""
    proc = _run(["show"], env=env, check=False)
    return proc.returncode, proc.stdout, proc.stderr
