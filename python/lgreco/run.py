"""lgreco-run: run a command (torchrun, mpirun, python ...) with lgreco loaded.

    lgreco-run [options] -- COMMAND [ARGS...]

Sets, for COMMAND and everything it starts:
  LD_PRELOAD       the packaged liblgreco.so, in front of what LD_PRELOAD held
  NCCL_NET_PLUGIN  the same file's absolute path (NCCL 2.28 accepts a path), so that the
                   net plugin and the shim are one library, loaded once; --no-net-plugin
                   leaves it alone
  LGRECO_*         one per option: --alpha 0.8 sets LGRECO_ALPHA=0.8

The options are the library's parameter table (lgreco-config params), not a copy: every
LGRECO_NAME has an option --name. Before COMMAND starts, the resulting configuration is
checked as the library will check it (lgreco-config show); an invalid one is an error
here, not a job that runs uncompressed. Then lgreco-run replaces itself with COMMAND
(exec): signals reach COMMAND directly and its exit status is lgreco-run's.
"""

import argparse
import os
import shutil
import sys

from . import LgrecoError, _config, library_path

PROG = "lgreco-run"


def option_name(parameter):
    """LGRECO_DECISION_LOG -> --decision-log."""
    return "--" + parameter[len("LGRECO_"):].lower().replace("_", "-")


def _plain(text):
    # argparse expands % in help texts; the table's path patterns hold %h, %p, %r.
    return text.replace("`", "").replace("%", "%%")


def build_parser(table):
    parser = argparse.ArgumentParser(
        prog=PROG, allow_abbrev=False, usage="%(prog)s [options] -- COMMAND [ARGS...]",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Runs COMMAND with lgreco's library loaded (LD_PRELOAD, NCCL_NET_PLUGIN) and LGRECO_* set "
                    "from the options below.",
        epilog="examples:\n"
               "  lgreco-run --registration resnet50.json -- torchrun --nproc-per-node 8 train.py\n"
               "  lgreco-run --codec 'quant:bits=4' --alpha 1 --decision-log 'decisions-%r.jsonl' -- python train.py\n"
               "  lgreco-run --mode off -- torchrun ...      (the library loaded, every call to NCCL untouched)\n"
               "Options left out keep the environment's LGRECO_* or the defaults (docs/CONFIG.md).\n"
               "exit status: COMMAND's; 2 for a usage error or an invalid configuration, 127 when COMMAND is not found.")
    own = parser.add_argument_group("lgreco-run")
    own.add_argument("--no-net-plugin", action="store_true",
                     help="do not set NCCL_NET_PLUGIN (compression through LD_PRELOAD only)")
    own.add_argument("--print-env", action="store_true",
                     help="print the variables lgreco-run would set, as NAME=VALUE lines, and exit")
    params = parser.add_argument_group("lgreco's parameters (each sets its LGRECO_ variable)")
    for row in table:
        default = row["default"] or "unset"
        params.add_argument(option_name(row["name"]), dest=row["name"], metavar="VALUE", default=None,
                            help="%s [%s; default %s; %s]" % (_plain(row["meaning"]), _plain(row["accepted"]),
                                                               default, row["name"]))
    return parser


def split_command(argv):
    """(lgreco-run's arguments, COMMAND) split at the first '--'."""
    if "--" not in argv:
        return argv, None
    i = argv.index("--")
    return argv[:i], argv[i + 1:]


def prepend_path_list(value, path):
    """LD_PRELOAD with `path` first (entries are separated by ':' or spaces; an existing
    copy of `path` is dropped so that it is not loaded twice)."""
    entries = [e for e in (value or "").replace(" ", ":").split(":") if e and e != path]
    return ":".join([path] + entries)


def environment_for(args, table, base_env, lib):
    """The variables to set (ordered dict) and the full environment for COMMAND."""
    changes = {}
    for row in table:
        value = getattr(args, row["name"])
        if value is not None:
            changes[row["name"]] = value
    changes["LD_PRELOAD"] = prepend_path_list(base_env.get("LD_PRELOAD"), lib)
    if not args.no_net_plugin:
        changes["NCCL_NET_PLUGIN"] = lib
    env = dict(base_env)
    env.update(changes)
    return changes, env


def _name_the_option(line, changes):
    """The library's message names LGRECO_ALPHA=7000 (environment); say which option set it."""
    for name in changes:
        if name.startswith("LGRECO_") and (name + "=") in line:
            return line.replace("(environment)", "(%s)" % option_name(name), 1)
    return line


def _warn(text):
    sys.stderr.write("%s: %s\n" % (PROG, text))


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    own, command = split_command(argv)
    try:
        table = _config.parameters()
        lib = library_path()
    except LgrecoError as e:
        _warn("error: %s" % e)
        return 2
    parser = build_parser(table)
    args, extra = parser.parse_known_args(own)  # exits 2 with argparse's message on a bad option value
    if extra:
        first = extra[0]
        if first.startswith("-"):
            parser.error("unknown option %s (lgreco-run --help lists them)" % first)
        parser.error("%s: COMMAND goes after '--' (lgreco-run [options] -- COMMAND [ARGS...])" % first)
    if not args.print_env and not command:
        parser.error("missing COMMAND: put it after '--' (lgreco-run [options] -- COMMAND [ARGS...])")
    base = dict(os.environ)
    existing_plugin = base.get("NCCL_NET_PLUGIN")
    changes, env = environment_for(args, table, base, lib)
    if not args.no_net_plugin and existing_plugin and existing_plugin != lib:
        _warn("NCCL_NET_PLUGIN was %r; lgreco-run replaces it with %s (a second lgreco, or another plugin, would "
              "load beside this one); --no-net-plugin keeps it" % (existing_plugin, lib))
    # The configuration as the library will read it: an invalid value would turn
    # compression off on every rank, with one WARN per rank buried in the job's log.
    try:
        check_env = {k: v for k, v in env.items() if k not in ("LD_PRELOAD", "NCCL_NET_PLUGIN")}
        status, _out, err = _config.show(check_env)
    except LgrecoError as e:
        _warn("error: %s" % e)
        return 2
    for line in err.splitlines():
        if line.startswith("warning: "):
            _warn(line)
    if status != 0:
        for line in err.splitlines():
            if not line.startswith("warning: "):
                _warn(_name_the_option(line, changes))
        _warn("error: not starting %s: fix the configuration above (lgreco-config show prints it whole)" %
              (" ".join(command) if command else "anything"))
        return 2
    if args.print_env:
        for name, value in changes.items():
            print("%s=%s" % (name, value))
        return 0
    program = command[0]
    if shutil.which(program, path=env.get("PATH")) is None:
        _warn("error: command not found: %s%s" % (program, "" if "/" in program else " (searched PATH)"))
        return 127
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execvpe(program, command, env)
    except OSError as e:
        _warn("error: cannot run %s: %s" % (program, e.strerror or e))
        return 126
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main())
