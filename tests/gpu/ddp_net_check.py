#!/usr/bin/env python3
"""Unmodified PyTorch DDP with lgreco loaded only as NCCL's net plugin (no LD_PRELOAD).

usage: ddp_net_check.py --plugin build/lib/libnccl-net-lgreco.so --out DIR [--ranks 2]
                        [--seconds 280] [--steps 300] [--python PY] [--device cuda:0]
                        [--registration FILE] [--table FILE]

Run by tests/gpu/run.sh net on the GPU machine. tests/gpu/ddp_train.py runs twice, one
process per rank, every rank on the same GPU with its own NCCL_HOSTID
(NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 NCCL_SOCKET_IFNAME=lo), the same seeds each time,
launched as tests/gpu/ddp_check.py launches it (its launch() is used):
  net-plain   NCCL_NET=Socket NCCL_NET_PLUGIN=none: NCCL's own transport, the reference
  net-plugin  NCCL_NET=lgreco NCCL_NET_PLUGIN=<--plugin, absolute> LGRECO_NET=socket
              LGRECO_SOCKET_IFNAME=lo LGRECO_MODE=uniform LGRECO_CODEC=quant:bits=4
              LGRECO_DEBUG=INFO, automatic segments (or LGRECO_REGISTRATION=--registration);
              no LD_PRELOAD anywhere (launch() drops it from the environment)
Both with NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,NET,ENV,COLL on the rank's stdout: loaded
as a net plugin, lgreco hands its log lines to NCCL's logger, which prints them only for
those subsystems (the shim's lines travel as COLL, the loader's as NET); the plugin run
also sets LGRECO_DEBUG_FILE=DIR/net-plugin.rank<R>.lgreco.log, and both files are searched.

Verdicts. Both runs: every rank exits 0 and ends with the same parameters as the others,
and every rank's NCCL log says `Using network Socket` resp. `Using network lgreco`. The
plugin run also needs, on every rank: NCCL's `Successfully loaded external network plugin`
line, the plugin's line that it installed the shim,
  rebound N call sites in OBJECT to lgreco's shim (... ncclAllReduce ...)
and the shim's per-communicator line (tests/gpu/ddp_check.py's SHIM_LINE) with compressed
calls > 0; and training as good as tests/gpu/run.sh shim asks: test accuracy within 1.5
points and final loss within 20% of the plain run's.

Prints `RESULT: NAME PASS|FAIL|SKIP detail` per run, then a table (also written to
--table); exit 1 if a run failed. --device cpu runs the same on the CPU with gloo (no
NCCL, so the plugin run fails for want of NCCL's lines): a smoke test of this script.
"""
import argparse
import os
import re
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import ddp_check  # noqa: E402  (launch, last_json, shim_lines and the shim section's limits)

TRAIN = os.path.join(HERE, "ddp_train.py")
NCCL_LOG = {"INIT", "NET", "ENV", "COLL"}
USING = re.compile(r"NCCL INFO Using network (\S+)")
LOADED = re.compile(r"NCCL INFO .*Successfully loaded external network plugin (\S+)")
REBOUND = re.compile(r"rebound (\d+) call sites in (.+?) to lgreco's shim \(([^)]*)\)")
# Seconds one run may take at most (2 ranks: about a minute on the H200).
CAP = {2: 120, 4: 150}


def read(path):
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def verdict_of(args, name, ranks, codes, want_net, plugin, base):
    """(verdict, why, row) of one run."""
    logs = [os.path.join(args.out, "%s.rank%d.log" % (name, r)) for r in range(ranks)]
    texts = [read(p) for p in logs]
    lgreco_logs = [os.path.join(args.out, "%s.rank%d.lgreco.log" % (name, r)) for r in range(ranks)]
    problems, why = [], []
    if any(c != 0 for c in codes):
        problems.append("exit codes %s (%s.rank*.log)" % (codes, name))
    out = ddp_check.last_json(logs[0])
    if not out:
        problems.append("no JSON result in %s.rank0.log" % name)
    else:
        why.append("acc %.2f%%, loss %.4f, %.1f ms/step" % (out["test_accuracy"], out["final_loss"], out["step_ms"]))
        if not out.get("replicas_identical"):
            problems.append("ranks ended with different parameters")
    if args.device.startswith("cuda") or plugin:
        nets = [sorted(set(USING.findall(t))) for t in texts]
        if all(n == [want_net] for n in nets):
            why.append("every rank: Using network %s" % want_net)
        else:
            problems.append("NCCL's 'Using network' per rank: %s, want %s" % (nets, want_net))
    compressed = "-"
    if plugin:
        loaded = [LOADED.findall(t) for t in texts]
        if not all(loaded):
            problems.append("no 'Successfully loaded external network plugin' line from NCCL on ranks %s" %
                            [r for r in range(ranks) if not loaded[r]])
        rebound = [[m for m in REBOUND.findall(t + read(lgreco_logs[r])) if "ncclAllReduce" in m[2]]
                   for r, t in enumerate(texts)]
        if all(rebound):
            why.append("shim installed by the plugin: %s" %
                       "; ".join("rank %d: %s call sites in %s" % (r, m[0][0], os.path.basename(m[0][1]))
                                 for r, m in enumerate(rebound)))
        else:
            problems.append("no \"rebound N call sites in ... to lgreco's shim (... ncclAllReduce ...)\" line on "
                            "ranks %s" % [r for r in range(ranks) if not rebound[r]])
        # A rank's lines from its log, else from its lgreco log (never both: the same
        # line can reach both places).
        lines = []
        for r in range(ranks):
            lines += ddp_check.shim_lines([logs[r]]) or ddp_check.shim_lines([lgreco_logs[r]])
        if not lines:
            problems.append("no 'lgreco shim: rank R/N: ...' line in %s.rank*.log or %s.rank*.lgreco.log" %
                            (name, name))
        else:
            per_rank = {r: sum(l["compressed"] for l in lines if l["rank"] == r) for r in range(ranks)}
            sent = sum(l["sent"] for l in lines)
            compressed = str(per_rank.get(0, 0))
            why.append("compressed calls per rank %s of %d calls (all ranks), %s bytes ratio" %
                       ([per_rank[r] for r in range(ranks)], sum(l["calls"] for l in lines),
                        "%.2fx" % (sum(l["plain"] for l in lines) / sent) if sent else "no"))
            if any(per_rank[r] == 0 for r in range(ranks)):
                problems.append("no compressed call on ranks %s" % [r for r in range(ranks) if per_rank[r] == 0])
        if base is None:
            problems.append("no plain run to compare with")
        elif out:
            d_acc = out["test_accuracy"] - base["test_accuracy"]
            d_loss = (out["final_loss"] - base["final_loss"]) / base["final_loss"]
            why.append("vs plain: %+.2f points, loss %+.1f%%" % (d_acc, 100 * d_loss))
            if abs(d_acc) > ddp_check.ACCURACY_POINTS:
                problems.append("accuracy %+.2f points from plain's (limit %.1f)" % (d_acc, ddp_check.ACCURACY_POINTS))
            if abs(d_loss) > ddp_check.LOSS_RELATIVE:
                problems.append("loss %+.1f%% from plain's (limit %.0f%%)" %
                                (100 * d_loss, 100 * ddp_check.LOSS_RELATIVE))
    row = (name, "%.2f" % out["test_accuracy"] if out else "-", "%.4f" % out["final_loss"] if out else "-", compressed)
    if problems:
        return "FAIL", "; ".join(problems + why), row
    return "PASS", "; ".join(why), row


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--plugin", required=True, help="lgreco's net plugin (build/lib/libnccl-net-lgreco.so)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--seconds", type=float, default=280, help="deadline for both runs")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--python", default=sys.executable)
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--registration", default=None, help="LGRECO_REGISTRATION for the plugin run (default: "
                    "automatic segments)")
    ap.add_argument("--table", default=None)
    args = ap.parse_args()
    if args.ranks < 2:
        ap.error("--ranks must be at least 2")

    deadline = ddp_check.Deadline(args.seconds)
    os.makedirs(args.out, exist_ok=True)
    plugin = os.path.abspath(args.plugin)
    cuda = args.device.startswith("cuda")
    results, table = [], []
    train = [args.python, TRAIN, "--steps", str(args.steps), "--device", args.device]
    nccl_log = {"NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": ",".join(sorted(NCCL_LOG))}
    plugin_env = dict(nccl_log, NCCL_NET="lgreco", NCCL_NET_PLUGIN=plugin, LGRECO_NET="socket",
                      LGRECO_SOCKET_IFNAME="lo", LGRECO_MODE="uniform", LGRECO_CODEC="quant:bits=4",
                      LGRECO_DEBUG="INFO")
    if args.registration:
        plugin_env["LGRECO_REGISTRATION"] = os.path.abspath(args.registration)
    runs = [("net-plain", "Socket", False, dict(nccl_log, NCCL_NET="Socket", NCCL_NET_PLUGIN="none")),
            ("net-plugin", "lgreco", True, plugin_env)]
    if not os.path.exists(plugin):
        print("RESULT: net-plugin FAIL no plugin at %s" % plugin, flush=True)
        return finish(args, [("net-plugin", "FAIL", "")], table)
    base = None
    for name, want_net, is_plugin, env in runs:
        env = dict(env)
        if is_plugin:
            env["LGRECO_DEBUG_FILE"] = os.path.join(args.out, name + ".rank{rank}.lgreco.log")
            for r in range(args.ranks):  # appended to
                path = os.path.join(args.out, "%s.rank%d.lgreco.log" % (name, r))
                if os.path.exists(path):
                    os.remove(path)
        timeout = min(CAP.get(args.ranks, 180), deadline.left())
        if timeout < 30:
            results.append((name, "FAIL", "out of time (%.0f s left)" % deadline.left()))
            print("RESULT: %s FAIL out of time" % name, flush=True)
            continue
        codes, seconds = ddp_check.launch(name, args.ranks, train + ["--out", os.path.join(args.out, name + ".json")],
                                          env, timeout, args.out, cuda)
        verdict, why, row = verdict_of(args, name, args.ranks, codes, want_net, is_plugin, base)
        if 124 in codes:
            why = "timed out after %.0f s; %s" % (timeout, why)
        if not is_plugin and not any(c != 0 for c in codes):
            base = ddp_check.last_json(os.path.join(args.out, name + ".rank0.log"))
        table.append(row + (verdict,))
        results.append((name, verdict, why))
        print("RESULT: %s %s %s (%.0f s)" % (name, verdict, why, seconds), flush=True)
    return finish(args, results, table)


def finish(args, results, table):
    lines = ["== DDP with lgreco as NCCL's net plugin, no LD_PRELOAD (tests/gpu/ddp_train.py, %d ranks, %d steps;"
             " plugin run: accuracy within %.1f points, loss within %.0f%% of plain's) ==" %
             (args.ranks, args.steps, ddp_check.ACCURACY_POINTS, 100 * ddp_check.LOSS_RELATIVE),
             "%-12s %9s %9s %11s %s" % ("run", "accuracy", "loss", "compressed", "verdict")]
    lines += ["%-12s %9s %9s %11s %s" % row for row in table]
    text = "\n".join(lines) + "\n"
    if args.table:
        with open(args.table, "w") as f:
            f.write(text)
    print()
    print(text, end="", flush=True)
    return 1 if any(v == "FAIL" for _, v, _ in results) else 0


if __name__ == "__main__":
    sys.exit(main())
