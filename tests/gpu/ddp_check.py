#!/usr/bin/env python3
"""Unmodified PyTorch DDP under LD_PRELOAD=liblgreco.so: does compression keep training?

usage: ddp_check.py --lib build/lib/liblgreco.so --out DIR [--ranks 2,4] [--seconds 300]
                    [--steps 300] [--python PY] [--device cuda:0] [--table FILE]
                    [--runs plain,uniform,adaptive,families]

Run by tests/gpu/run.sh shim on the GPU machine. Steps:

 1. tools/lgreco-register writes the registration of tests/gpu/ddp_train.py's model
    (DDP on the CPU with gloo, one process; the same bucket layout DDP builds on CUDA).
 2. For each world size (2, then 4 while time is left), tests/gpu/ddp_train.py runs
    three ways, one process per rank, every rank on the same GPU with its own
    NCCL_HOSTID (NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 NCCL_NET=Socket
    NCCL_SOCKET_IFNAME=lo), the same seeds each time:
      plain     no LD_PRELOAD: the reference
      uniform   LD_PRELOAD, LGRECO_MODE=uniform LGRECO_CODEC=quant:bits=4
      adaptive  LD_PRELOAD, LGRECO_MODE=adaptive with a short schedule
                (LGRECO_WARMUP=20 LGRECO_PERIOD=50 LGRECO_WINDOW=5 LGRECO_SWITCH_LAG=4:
                assignment epochs from step ~25, every 50 steps) and LGRECO_DECISION_LOG
      families  (the first world size only) as adaptive, with LGRECO_CANDIDATES naming
                quantization, TopK and PowerSGD: the CUDA backend's TopK and PowerSGD
                paths (cuBLAS) in a real DDP job; the table's last column counts the
                layers of each family in the last assignment epoch
    both compressed runs with LGRECO_REGISTRATION=the file of step 1, LGRECO_DEBUG=INFO
    and LGRECO_DEBUG_FILE=DIR/ddp-N-RUN.rank<R>.lgreco.log.
 3. Verdicts. Every run: all ranks exit 0 and end with identical parameters. Compressed
    runs: test accuracy within 1.5 points of plain's, final training loss within 20% of
    plain's, and the shim's per-communicator line in the logs,
      lgreco shim: rank R/N: A allreduce calls, C compressed, P passed through;
      compressed calls: U gradient bytes, W bytes sent by this rank (plain ring allreduce: S);
      host waits for the device: H, K of them stalled
    with C > 0 (bytes ratio = sum of S / sum of W over ranks). Adaptive and families:
    rank 0's decision log holds at least one assignment epoch (docs/CONTROLLER.md), the
    same on every rank. The host's stalls (K) are reported, not judged: one per
    communicator (its first compressed call) is the expected figure.

Prints `RESULT: NAME PASS|FAIL|SKIP detail` per run, then the table (also written to
--table); exit 1 if any run failed. --device cpu runs the same on the CPU with gloo (no
NCCL, so the compressed runs fail for want of shim lines): a smoke test of this script.
"""
import argparse
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
TRAIN = os.path.join(HERE, "ddp_train.py")

SHIM_LINE = re.compile(
    r"lgreco shim: rank (\d+)/(\d+): (\d+) allreduce calls, (\d+) compressed, (\d+) passed through; "
    r"compressed calls: (\d+) gradient bytes, (\d+) bytes sent by this rank \(plain ring allreduce: (\d+)\)"
    r"(?:; host waits for the device: (\d+), (\d+) of them stalled)?")

ACCURACY_POINTS = 1.5
LOSS_RELATIVE = 0.20
SCHEDULE = {"LGRECO_WARMUP": "20", "LGRECO_PERIOD": "50", "LGRECO_WINDOW": "5", "LGRECO_SWITCH_LAG": "4"}
# Candidates of all three families around the default quant:bits=4.
FAMILIES = ";".join(["quant:bits=%d" % b for b in (2, 3, 4, 5, 6, 8)] +
                    ["topk:density=%s" % d for d in ("0.01", "0.05", "0.2")] +
                    ["powersgd:rank=%d" % r for r in (2, 4, 8)])
NCCL_ONE_GPU = {"NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1", "NCCL_NET": "Socket", "NCCL_SOCKET_IFNAME": "lo"}


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Deadline:
    def __init__(self, seconds):
        self.end = time.monotonic() + seconds

    def left(self):
        return self.end - time.monotonic()


def launch(name, ranks, cmd, extra_env, timeout, out, cuda):
    """Runs cmd once per rank; returns (exit codes, seconds). {rank} in extra_env's values
    becomes the rank. A run past its timeout is killed (exit code 124)."""
    port = free_port()
    procs, logs = [], []
    start = time.monotonic()
    for r in range(ranks):
        env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD" and not k.startswith("LGRECO_")}
        env.update(RANK=str(r), WORLD_SIZE=str(ranks), LOCAL_RANK="0", LOCAL_WORLD_SIZE=str(ranks),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), PYTHONUNBUFFERED="1")
        if cuda:
            env.update(NCCL_ONE_GPU, NCCL_HOSTID="lgreco-%s-%d" % (name, r))
        env.update({k: v.replace("{rank}", str(r)) for k, v in extra_env.items()})
        log = open(os.path.join(out, "%s.rank%d.log" % (name, r)), "w")
        logs.append(log)
        procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
                                      start_new_session=True))
    codes = []
    for p in procs:
        try:
            codes.append(p.wait(timeout=max(1.0, timeout - (time.monotonic() - start))))
        except subprocess.TimeoutExpired:
            codes.append(124)
            for q in procs:
                if q.poll() is None:
                    os.killpg(q.pid, signal.SIGKILL)
    for p in procs:
        p.wait()
    for log in logs:
        log.close()
    return codes, time.monotonic() - start


def last_json(path):
    try:
        lines = open(path).read().splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        if line.startswith("{"):
            try:
                return json.loads(line)
            except ValueError:
                return None
    return None


def shim_lines(paths):
    """Every shim summary line in these files, as dicts."""
    found = []
    for path in paths:
        try:
            text = open(path, errors="replace").read()
        except OSError:
            continue
        for m in SHIM_LINE.finditer(text):
            r, n, a, c, p, u, w, s = (int(x) for x in m.groups()[:8])
            waits, stalls = (int(x) if x is not None else -1 for x in m.groups()[8:])
            found.append(dict(rank=r, size=n, calls=a, compressed=c, passed=p, gradient_bytes=u, sent=w, plain=s,
                              waits=waits, stalls=stalls))
    return found


def family_counts(codecs):
    """'n2 p3 q7 t2': how many layers of an epoch use each family (none, powersgd, quant, topk)."""
    counts = {}
    for c in codecs:
        f = (c or "?").split(":")[0]
        counts[f] = counts.get(f, 0) + 1
    return " ".join("%s%d" % (f[0], counts[f]) for f in sorted(counts))


def decision_epochs(path):
    """Assignment epochs in a decision log: (number of lines with an epoch, their layers' codecs)."""
    epochs = []
    try:
        for line in open(path):
            line = line.strip()
            if not line:
                continue
            d = json.loads(line)
            if "epoch" in d:
                epochs.append((d["epoch"], [l.get("codec") for l in d.get("layers", [])]))
    except (OSError, ValueError):
        pass
    return epochs


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lib", required=True, help="liblgreco.so for LD_PRELOAD")
    ap.add_argument("--out", required=True)
    ap.add_argument("--ranks", default="2,4", help="world sizes, in order, while time is left")
    ap.add_argument("--seconds", type=float, default=420, help="deadline for everything")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--python", default=sys.executable)
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--config-tool", default=os.path.join(ROOT, "build", "bin", "lgreco-config"))
    ap.add_argument("--table", default=None)
    ap.add_argument("--runs", default="plain,uniform,adaptive,families",
                    help="which runs, of plain,uniform,adaptive,families (plain is the reference: always first)")
    args = ap.parse_args()
    wanted = [r for r in args.runs.split(",") if r]
    unknown = sorted(set(wanted) - {"plain", "uniform", "adaptive", "families"})
    if unknown or "plain" not in wanted:
        ap.error("--runs: %s" % ("unknown run(s) " + ", ".join(unknown) if unknown else "plain must be one of them"))

    deadline = Deadline(args.seconds)
    os.makedirs(args.out, exist_ok=True)
    lib = os.path.abspath(args.lib)
    cuda = args.device.startswith("cuda")
    results, table = [], []
    failed = False

    def result(name, verdict, detail):
        nonlocal failed
        failed |= verdict == "FAIL"
        results.append((name, verdict, detail))
        print("RESULT: %s %s %s" % (name, verdict, detail), flush=True)

    # 1. The registration of the model's DDP buckets.
    reg = os.path.join(args.out, "ddp_train.json")
    cmd = [args.python, os.path.join(ROOT, "tools", "lgreco-register"), "--model", TRAIN + ":build_model",
           "--input-shape", "32,64", "--model-name", "ddp_train_mlp", "-o", reg]
    with open(os.path.join(args.out, "ddp-register.log"), "w") as log:
        rc = subprocess.call(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, timeout=max(10, min(180, deadline.left())))
    if rc != 0 or not os.path.exists(reg):
        result("register", "FAIL", "lgreco-register exit %d (ddp-register.log)" % rc)
        return finish(args, results, table)
    counts = [b["count"] for b in json.load(open(reg))["buckets"]]
    detail = "buckets %s" % counts
    if os.access(args.config_tool, os.X_OK):
        ok = subprocess.call([args.config_tool, "check", reg], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) == 0
        if not ok:
            result("register", "FAIL", "lgreco-config check rejects %s" % reg)
            return finish(args, results, table)
        detail += ", lgreco-config check OK"
    result("register", "PASS", detail)

    train = [args.python, TRAIN, "--steps", str(args.steps), "--device", args.device]
    preload = {"LD_PRELOAD": lib, "LGRECO_REGISTRATION": reg, "LGRECO_DEBUG": "INFO"}
    runs = [("plain", {}),
            ("uniform", dict(preload, LGRECO_MODE="uniform", LGRECO_CODEC="quant:bits=4")),
            ("adaptive", dict(preload, LGRECO_MODE="adaptive", **SCHEDULE)),
            ("families", dict(preload, LGRECO_MODE="adaptive", LGRECO_CODEC="quant:bits=4",
                              LGRECO_CANDIDATES=FAMILIES, **SCHEDULE))]
    runs = [(run, env) for run, env in runs if run in wanted]
    # Seconds a world size needs for its runs on the H200 (importing torch and setting up
    # NCCL take most of it), and the most one run may take.
    need, cap = {2: 135, 4: 150}, {2: 120, 4: 150}
    sizes = [int(x) for x in args.ranks.split(",") if x]
    for ranks in sizes:
        if deadline.left() < need.get(ranks, 200):
            result("ddp-%d" % ranks, "SKIP", "not enough time left (%.0f s)" % deadline.left())
            continue
        base = None
        for run, env in runs:
            if run == "families" and ranks != sizes[0]:
                continue
            name = "ddp-%d-%s" % (ranks, run)
            env = dict(env)
            if run != "plain":
                env["LGRECO_DEBUG_FILE"] = os.path.join(args.out, name + ".rank{rank}.lgreco.log")
            if run in ("adaptive", "families"):
                env["LGRECO_DECISION_LOG"] = os.path.join(args.out, name + ".decisions.r%r.jsonl")
            for r in range(ranks):  # both files are appended to
                for f in (name + ".rank%d.lgreco.log" % r, name + ".decisions.r%d.jsonl" % r):
                    if os.path.exists(os.path.join(args.out, f)):
                        os.remove(os.path.join(args.out, f))
            timeout = min(cap.get(ranks, 200), deadline.left())
            if timeout < 30:
                result(name, "SKIP", "out of time")
                continue
            codes, seconds = launch(name, ranks, train + ["--out", os.path.join(args.out, name + ".json")], env,
                                    timeout, args.out, cuda)
            verdict, why = check_run(args, name, run, ranks, codes, base)
            if 124 in codes and timeout < cap.get(ranks, 200) and ranks != sizes[0]:
                # A world size beyond the first runs only while time is left: the
                # deadline cutting it short is no failure of the shim.
                verdict, why = "SKIP", "cut short by the deadline after %.0f s" % timeout
            out = last_json(os.path.join(args.out, name + ".rank0.log"))
            if run == "plain" and verdict == "PASS":
                base = out
            lines = shim_lines([os.path.join(args.out, name + ".rank%d.lgreco.log" % r) for r in range(ranks)])
            mine = [l for l in lines if l["rank"] == 0]
            sent = sum(l["sent"] for l in lines)
            ratio = "%.2f" % (sum(l["plain"] for l in lines) / sent) if sent else "-"
            epochs = decision_epochs(os.path.join(args.out, name + ".decisions.r0.jsonl"))
            table.append((name, "%.2f" % out["test_accuracy"] if out else "-", "%.4f" % out["final_loss"] if out else "-",
                          str(sum(l["compressed"] for l in mine)) if run != "plain" else "-",
                          ratio if run != "plain" else "-",
                          str(len(epochs)) if run in ("adaptive", "families") else "-",
                          family_counts(epochs[-1][1]) if run == "families" and epochs else "-", verdict))
            result(name, verdict, "%s (%.0f s)" % (why, seconds))
    return finish(args, results, table)


def check_run(args, name, run, ranks, codes, base):
    """(verdict, why) of one run."""
    if any(c != 0 for c in codes):
        return "FAIL", "exit codes %s (%s.rank*.log)" % (codes, name)
    out = last_json(os.path.join(args.out, name + ".rank0.log"))
    if not out:
        return "FAIL", "no JSON result in %s.rank0.log" % name
    if not out.get("replicas_identical"):
        return "FAIL", "ranks ended with different parameters"
    why = ["acc %.2f%%, loss %.4f, %.1f ms/step" % (out["test_accuracy"], out["final_loss"], out["step_ms"])]
    if run == "plain":
        return "PASS", why[0]
    problems = []
    if base is None:
        problems.append("no plain run to compare with")
    else:
        d_acc = out["test_accuracy"] - base["test_accuracy"]
        d_loss = (out["final_loss"] - base["final_loss"]) / base["final_loss"]
        why.append("vs plain: %+.2f points, loss %+.1f%%" % (d_acc, 100 * d_loss))
        if abs(d_acc) > ACCURACY_POINTS:
            problems.append("accuracy %+.2f points from plain's (limit %.1f)" % (d_acc, ACCURACY_POINTS))
        if abs(d_loss) > LOSS_RELATIVE:
            problems.append("loss %+.1f%% from plain's (limit %.0f%%)" % (100 * d_loss, 100 * LOSS_RELATIVE))
    lines = shim_lines([os.path.join(args.out, name + ".rank%d.lgreco.log" % r) for r in range(ranks)])
    if not lines:
        problems.append("no 'lgreco shim: rank R/N: ...' line in %s.rank*.lgreco.log" % name)
    else:
        compressed = sum(l["compressed"] for l in lines)
        sent = sum(l["sent"] for l in lines)
        plain = sum(l["plain"] for l in lines)
        why.append("%d of %d calls compressed (all ranks), %s bytes ratio" %
                   (compressed, sum(l["calls"] for l in lines), "%.2fx" % (plain / sent) if sent else "no"))
        if compressed == 0:
            problems.append("no call was compressed")
        # A figure, not a verdict: the first compressed call of each communicator waits
        # for the configurations' comparison; after it, a stall means the host waited for
        # work it had just queued (docs/ENGINE.md, "The host waits for nothing it just queued").
        if all(l["stalls"] >= 0 for l in lines):
            why.append("host stalls %d in %d waits (expected: %d, one per communicator)" %
                       (sum(l["stalls"] for l in lines), sum(l["waits"] for l in lines), len(lines)))
        if {l["rank"] for l in lines} != set(range(ranks)):
            problems.append("shim lines from ranks %s only" % sorted({l["rank"] for l in lines}))
    if run in ("adaptive", "families"):
        per_rank = [decision_epochs(os.path.join(args.out, name + ".decisions.r%d.jsonl" % r)) for r in range(ranks)]
        why.append("%d assignment epochs%s" % (len(per_rank[0]), "" if all(p == per_rank[0] for p in per_rank)
                                                else ", decision logs differ between ranks"))
        if not per_rank[0]:
            problems.append("no assignment epoch in %s.decisions.r0.jsonl" % name)
    if problems:
        return "FAIL", "; ".join(problems + why)
    return "PASS", "; ".join(why)


def finish(args, results, table):
    lines = ["== DDP under LD_PRELOAD (tests/gpu/ddp_train.py, %d steps; compressed runs: accuracy within %.1f points,"
             " loss within %.0f%% of plain's) ==" % (args.steps, ACCURACY_POINTS, 100 * LOSS_RELATIVE),
             "%-18s %9s %9s %11s %11s %7s %-12s %s" % ("run", "accuracy", "loss", "compressed", "bytes_ratio",
                                                         "epochs", "families", "verdict")]
    lines += ["%-18s %9s %9s %11s %11s %7s %-12s %s" % row for row in table]
    text = "\n".join(lines) + "\n"
    if args.table:
        with open(args.table, "w") as f:
            f.write(text)
    print()
    print(text, end="", flush=True)
    return 1 if any(v == "FAIL" for _, v, _ in results) else 0


if __name__ == "__main__":
    sys.exit(main())
