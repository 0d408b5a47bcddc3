"""Starts the ranks of a torch.distributed job on this host, for the tests that train.

tests/python/comm_hook_test.py and tests/accuracy/char_lm.py run their own file once per
rank (gloo on loopback, like torchrun would); each rank prints one line starting with a
marker and a JSON object. This starts them, waits for all of them within one deadline,
kills every rank when one runs past it, and returns the JSON objects in rank order.
"""

import json
import socket
import subprocess
import tempfile
import time


class RankError(Exception):
    """A rank failed, ran past the deadline or reported no result; the message says which."""


def free_port():
    """A TCP port on 127.0.0.1 that nothing listens on now, for MASTER_PORT."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(cmd, env, ranks, timeout, marker, env_by_rank=None):
    """Runs `cmd` as `ranks` processes with RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and
    MASTER_PORT set over `env` (then env_by_rank[r], if given). Returns (results, logs):
    results[r] the JSON after `marker` in rank r's output, logs[r] its output (stdout and
    stderr together). Raises RankError when a rank exits non-zero, prints no result, or
    the ranks are not all done `timeout` seconds after the start."""
    base = dict(env, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE=str(ranks))
    # Outputs go to files, not pipes: a rank that fills a pipe nobody reads yet would block,
    # and the others with it, in their next collective.
    outputs = [tempfile.TemporaryFile(mode="w+") for _ in range(ranks)]
    procs = []
    for r in range(ranks):
        e = dict(base, RANK=str(r), LOCAL_RANK=str(r))
        e.update((env_by_rank or {}).get(r, {}))
        procs.append(subprocess.Popen(cmd, env=e, stdout=outputs[r], stderr=subprocess.STDOUT, text=True))
    deadline = time.time() + timeout
    results, logs = [], []
    try:
        for r, p in enumerate(procs):
            try:
                p.wait(timeout=max(1.0, deadline - time.time()))
            except subprocess.TimeoutExpired:
                raise RankError("the %d ranks did not finish within %d s (rank %d still running)" %
                                (ranks, timeout, r)) from None
            outputs[r].seek(0)
            out = outputs[r].read()
            logs.append(out)
            if p.returncode != 0:
                raise RankError("rank %d exited %d:\n%s" % (r, p.returncode, out[-4000:]))
            found = [line[len(marker):] for line in out.splitlines() if line.startswith(marker)]
            if len(found) != 1:
                raise RankError("rank %d printed %d '%s' lines, not 1:\n%s" % (r, len(found), marker.strip(),
                                                                              out[-4000:]))
            results.append(json.loads(found[0]))
    finally:
        for p in procs:  # after a failure, the others would wait for it forever
            if p.poll() is None:
                p.kill()
                p.wait()
        for f in outputs:
            f.close()
    return results, logs
