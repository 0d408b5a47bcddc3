"""`lgreco plot DECISION_LOG`: the controller's decisions drawn.

A decision log (LGRECO_DECISION_LOG, lgreco-demo --decision-log) holds one JSON line per
solved assignment (docs/CONTROLLER.md, "Decision log"). This draws one run of it:

  * the codec chosen for every layer in every epoch, a heat map: layers by name, grouped
    by bucket; epoch 0 is the defaults, before the first switch; one labelled colour scale
    for quantization bits, TopK densities and PowerSGD ranks;
  * each layer's realized relative error (the normalized metric's `window_relative`), when
    the log has it: the window read at solve e measured the assignment of epoch e - 1;
  * bytes against the defaults' per epoch;
  * the predicted and the realized error over the budget per epoch;
  * alpha and the closed loop's alpha_eff (epochs that kept the defaults marked);
  * the solve times.

Reading the log needs nothing beyond the standard library (`load`); drawing needs
matplotlib, imported by `figure` only.
"""

import argparse
import importlib
import json
import math
import os
import re
import sys

from . import LgrecoError

PROG = "lgreco plot"
LOG_VERSION = 1  # controller/problem_json.h, kDecisionLogVersion

# Fields every line must have, and what they hold: (name, kind).
_LINE_FIELDS = (("epoch", "count"), ("effective_step", "count"), ("alpha", "number"), ("alpha_eff", "number"),
                ("bytes", "count"), ("default_bytes", "count"), ("error", "number"), ("budget", "number"),
                ("solve_ms", "number"), ("layers", "list"))
_LAYER_FIELDS = (("name", "string"), ("codec", "string"))
_OPTIONAL_LAYER_NUMBERS = ("window_relative", "relative", "relative_bound")


def _is_kind(value, kind):
    if kind == "string":
        return isinstance(value, str)
    if kind == "list":
        return isinstance(value, list)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    if kind == "count":
        return isinstance(value, int) and value >= 0
    return math.isfinite(value)


_KIND_TEXT = {"string": "a string", "list": "a list", "count": "a non-negative integer", "number": "a finite number"}


def _check_line(record, where):
    if not isinstance(record, dict):
        raise LgrecoError("%s: a decision-log line is a JSON object, this is %s" % (where, type(record).__name__))
    if "log_version" not in record:
        raise LgrecoError("%s: no log_version: not an lgreco decision log, or one written before format version %d "
                          "(docs/CONTROLLER.md, \"Decision log\")" % (where, LOG_VERSION))
    version = record["log_version"]
    if version != LOG_VERSION:
        raise LgrecoError("%s: a decision log of format version %s; this lgreco reads version %d (draw it with the "
                          "lgreco that wrote it)" % (where, json.dumps(version), LOG_VERSION))
    for name, kind in _LINE_FIELDS:
        if name not in record:
            raise LgrecoError("%s: no '%s' in the line" % (where, name))
        if not _is_kind(record[name], kind):
            raise LgrecoError("%s: '%s' is %s; expected %s" % (where, name, json.dumps(record[name]), _KIND_TEXT[kind]))
    if not record["layers"]:
        raise LgrecoError("%s: 'layers' is empty" % where)
    for i, layer in enumerate(record["layers"]):
        at = "%s: layers[%d]" % (where, i)
        if not isinstance(layer, dict):
            raise LgrecoError("%s: expected an object" % at)
        for name, kind in _LAYER_FIELDS:
            if not _is_kind(layer.get(name), kind):
                raise LgrecoError("%s: '%s' is %s; expected %s" % (at, name, json.dumps(layer.get(name)),
                                                                   _KIND_TEXT[kind]))
        for name in _OPTIONAL_LAYER_NUMBERS:
            if name in layer and not _is_kind(layer[name], "number"):
                raise LgrecoError("%s: '%s' is %s; expected a finite number" % (at, name, json.dumps(layer[name])))


def load(path):
    """The runs in a decision log: a list of runs, each a list of its lines (dicts, with
    "_line" their line number), in the file's order.

    A run ends where the epoch does not grow or the layers change: a restarted job appends
    to the same file. Raises LgrecoError naming the file and line of the first problem.
    """
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise LgrecoError("cannot read the decision log %s: %s" % (path, e.strerror or e)) from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise LgrecoError("%s: not text (byte %d is not UTF-8): not a decision log" % (path, e.start)) from None
    runs = []
    previous = None
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        where = "%s:%d" % (path, number)
        try:
            record = json.loads(line)
        except ValueError as e:
            raise LgrecoError("%s: not JSON (%s)" % (where, e)) from None
        _check_line(record, where)
        record["_line"] = number
        names = [layer["name"] for layer in record["layers"]]
        if previous is None or record["epoch"] <= previous[0] or names != previous[1]:
            runs.append([])
        runs[-1].append(record)
        previous = (record["epoch"], names)
    if not runs:
        raise LgrecoError("%s: no decision in it (empty): the job solved no assignment yet, or wrote its log "
                          "elsewhere (LGRECO_DECISION_LOG's %%r is the rank)" % path)
    return runs


# ---- codecs and their colours -------------------------------------------------------

_FAMILY_ORDER = {"quant": 0, "topk": 1, "powersgd": 2, "none": 3}


def _option(text, key):
    m = re.search(r"(?:^|[:,])%s=([^,]+)" % key, text)
    return m.group(1) if m else None


def describe_codec(text):
    """(family, value, label) of a codec as the log writes it (CodecSpec::str):
    quant:bits=3,... -> ("quant", 3, "3 bits"), topk:density=0.01 -> ("topk", 0.01, "topk 1%"),
    powersgd:rank=4 -> ("powersgd", 4, "rank 4"), none -> ("none", 0, "none (float)").
    Anything else is ("other", 0, text)."""
    family = text.split(":", 1)[0]
    try:
        if family == "quant":
            bits = int(_option(text, "bits"))
            return family, bits, "%d bit%s" % (bits, "" if bits == 1 else "s")
        if family == "topk":
            density = float(_option(text, "density"))
            return family, density, "topk %s%%" % ("%.4g" % (100 * density))
        if family == "powersgd":
            rank = int(_option(text, "rank"))
            return family, rank, "rank %d" % rank
    except (TypeError, ValueError):
        return "other", 0, text
    if text == "none":
        return "none", 0, "none (float)"
    return "other", 0, text


def codec_order(codecs):
    """The codecs of a run in the colour scale's order: quantization by bits, TopK by
    density, PowerSGD by rank, then none and anything unknown; fewest bytes first in each."""
    def key(text):
        family, value, _ = describe_codec(text)
        return (_FAMILY_ORDER.get(family, 4), value, text)
    return sorted(set(codecs), key=key)


def codec_labels(order):
    """Labels for the colour scale; where two codecs share one (quant at two bucket
    sizes), the codec's own text."""
    labels = [describe_codec(c)[2] for c in order]
    return [c if labels.count(label) > 1 else label for c, label in zip(order, labels)]


def codec_colours(order):
    """An RGB triple in [0, 1] per codec of `order`: quantization on viridis at fixed
    points (2..8 bits, darkest fewest, the same colour for a width in every plot), TopK
    dark red to peach (sparsest darkest), PowerSGD on greens (lowest rank darkest), none a
    light grey, unknown codecs a dark grey."""
    from matplotlib import colormaps  # noqa: PLC0415

    viridis, reds, greens = colormaps["viridis"], colormaps["OrRd_r"], colormaps["Greens_r"]
    topk = sorted({describe_codec(c)[1] for c in order if describe_codec(c)[0] == "topk"})
    ranks = sorted({describe_codec(c)[1] for c in order if describe_codec(c)[0] == "powersgd"})

    def spread(values, v, low, high):  # the position of v among values, from low to high
        return low if len(values) < 2 else low + (high - low) * values.index(v) / (len(values) - 1)

    colours = []
    for c in order:
        family, value, _ = describe_codec(c)
        if family == "quant":
            rgb = viridis(min(max((value - 2) / 6.0, 0.0), 1.0))
        elif family == "topk":
            rgb = reds(spread(topk, value, 0.0, 0.7))
        elif family == "powersgd":
            rgb = greens(spread(ranks, value, 0.1, 0.7))
        elif family == "none":
            rgb = (0.85, 0.85, 0.85)
        else:
            rgb = (0.3, 0.3, 0.3)
        colours.append(tuple(float(x) for x in rgb[:3]))
    return colours


# ---- what is drawn --------------------------------------------------------------------

class Grid:
    """A run as the heat maps show it: layers (rows, in the log's order) by epochs
    (columns, 0 = the defaults). codec[row][col] is a codec's text, or None where the log
    does not say (epoch 0 of a log without default_codec); relative[row][col] the realized
    relative error, or None."""

    def __init__(self, run):
        self.run = run
        self.names = [layer["name"] for layer in run[0]["layers"]]
        self.epochs = [0] + [record["epoch"] for record in run]
        self.switch_steps = [None] + [record["effective_step"] for record in run]
        rows = range(len(self.names))
        defaults = [run[0]["layers"][r].get("default_codec") for r in rows]
        self.codec = [[defaults[r] if isinstance(defaults[r], str) else None] +
                      [record["layers"][r]["codec"] for record in run] for r in rows]
        # The window a solve read measured the epoch before it; the last epoch has none.
        self.relative = [[record["layers"][r].get("window_relative") for record in run] + [None] for r in rows]
        self.has_relative = any(v is not None for row in self.relative for v in row)
        self.groups = []  # (first row, last row, label): buckets, from the names' "b/" prefix
        for r, name in enumerate(self.names):
            group = name.split("/", 1)[0] if "/" in name else ""
            if not self.groups or self.groups[-1][2] != group:
                self.groups.append([r, r, group])
            self.groups[-1][1] = r
        self.order = codec_order(c for row in self.codec for c in row if c is not None)

    def short_name(self, row):
        name = self.names[row]
        return name.split("/", 1)[1] if "/" in name and len(self.groups) > 1 else name

    def codec_index(self):
        """codec[][] as indices into self.order (-1: unknown)."""
        return [[self.order.index(c) if c is not None else -1 for c in row] for row in self.codec]


def figure(run, title=None):
    """The matplotlib figure of one run, and a dict of its axes ("codec", "relative" when
    drawn, "bytes", "error", "alpha", "solve") and the Grid drawn. Needs matplotlib."""
    # A Figure of its own, not pyplot's: no display, no global state.
    import matplotlib  # noqa: PLC0415
    import numpy as np  # noqa: PLC0415 (matplotlib depends on it)
    from matplotlib.figure import Figure  # noqa: PLC0415
    from matplotlib.colors import BoundaryNorm, ListedColormap, LogNorm  # noqa: PLC0415

    grid = Grid(run)
    layers, columns = len(grid.names), len(grid.epochs)
    heat_height = min(max(2.5, 0.16 * layers), 40.0)
    fig = Figure(figsize=(13, heat_height + 5.5), layout="constrained")
    gs = fig.add_gridspec(3, 2, height_ratios=[heat_height, 2.5, 2.5])
    axes = {}

    # The codec heat map.
    ax = axes["codec"] = fig.add_subplot(gs[0, 0] if grid.has_relative else gs[0, :])
    index = np.array(grid.codec_index(), dtype=float)
    index[index < 0] = np.nan
    colours = codec_colours(grid.order)
    cmap = ListedColormap(colours)
    cmap.set_bad((1, 1, 1))
    image = ax.imshow(index, aspect="auto", interpolation="nearest", cmap=cmap,
                      norm=BoundaryNorm(np.arange(len(grid.order) + 1) - 0.5, len(grid.order)))
    bar = fig.colorbar(image, ax=ax, ticks=range(len(grid.order)), fraction=0.05, pad=0.02)
    bar.ax.set_yticklabels(codec_labels(grid.order))
    bar.set_label("codec (bits per value, TopK density, PowerSGD rank)")
    _layer_axis(ax, grid, labels=True)
    _epoch_axis(ax, grid)
    ax.set_title("codec per layer (epoch 0: the defaults)")

    if grid.has_relative:
        ax = axes["relative"] = fig.add_subplot(gs[0, 1], sharey=axes["codec"])
        rel = np.array([[np.nan if v is None else v for v in row] for row in grid.relative], dtype=float)
        positive = rel[np.isfinite(rel) & (rel > 0)]
        norm = LogNorm(vmin=positive.min(), vmax=max(positive.max(), positive.min() * 1.01)) if positive.size else None
        cmap_rel = matplotlib.colormaps["magma_r"].copy()
        cmap_rel.set_bad((1, 1, 1))
        image = ax.imshow(np.where(rel > 0, rel, np.nan), aspect="auto", interpolation="nearest", cmap=cmap_rel,
                          norm=norm)
        bar = fig.colorbar(image, ax=ax, fraction=0.05, pad=0.02)
        bar.set_label("realized relative error (window_relative)")
        _layer_axis(ax, grid, labels=False)
        _epoch_axis(ax, grid)
        ax.set_title("realized relative error per layer (the last epoch: no window after it)")

    epochs = np.array(grid.epochs)
    solved = epochs[1:]

    ax = axes["bytes"] = fig.add_subplot(gs[1, 0])
    ratio = [1.0] + [r["bytes"] / r["default_bytes"] if r["default_bytes"] else float("nan") for r in run]
    ax.plot(epochs, ratio, "o-", color="tab:blue", label="bytes / the defaults' bytes")
    ax.axhline(1.0, color="0.5", lw=0.8, ls="--")
    ax.set_xlabel("epoch")
    ax.set_ylabel("bytes vs the defaults")
    ax.set_title("bytes per call, against the defaults (epoch 0)")
    ax.legend(loc="best", fontsize="small")

    ax = axes["error"] = fig.add_subplot(gs[1, 1])
    predicted = [r["error"] / r["budget"] if r["budget"] > 0 else float("nan") for r in run]
    ax.plot(solved, predicted, "o-", color="tab:orange", label="predicted / budget (the solve's)")
    windows = [(r["epoch"] - 1, r.get("window")) for r in run]
    realized = [(e, w["realized"] / w["budget"]) for e, w in windows
                if isinstance(w, dict) and _is_kind(w.get("realized"), "number") and
                _is_kind(w.get("budget"), "number") and w["budget"] > 0]
    if realized:
        ax.plot([e for e, _ in realized], [v for _, v in realized], "s-", color="tab:red",
                label="realized / budget (the next window's reading)")
    ax.axhline(1.0, color="0.5", lw=0.8, ls="--", label="budget")
    ax.set_xlabel("epoch")
    ax.set_ylabel("error / budget")
    metric = run[0].get("metric")
    ax.set_title("error against the budget" + (" (metric: %s)" % metric if isinstance(metric, str) else ""))
    ax.legend(loc="best", fontsize="small")

    ax = axes["alpha"] = fig.add_subplot(gs[2, 0])
    ax.plot(solved, [r["alpha"] for r in run], "--", color="0.4", label="alpha (the user's)")
    ax.plot(solved, [r["alpha_eff"] for r in run], "o-", color="tab:green", label="alpha_eff (the closed loop's)")
    kept = [(r["epoch"], r["alpha_eff"]) for r in run if r.get("kept_defaults") is True]
    if kept:
        ax.plot([e for e, _ in kept], [a for _, a in kept], "x", color="black", ms=9, label="kept the defaults")
    ax.set_xlabel("epoch")
    ax.set_ylabel("alpha")
    ax.set_title("the error budget's alpha")
    ax.legend(loc="best", fontsize="small")

    ax = axes["solve"] = fig.add_subplot(gs[2, 1])
    ax.bar(solved, [r["solve_ms"] for r in run], color="tab:purple", label="solve")
    ax.set_xlabel("epoch")
    ax.set_ylabel("ms")
    ax.set_title("solve time (on the controller's thread)")
    ax.legend(loc="best", fontsize="small")
    for name in ("bytes", "error", "alpha", "solve"):
        axes[name].set_xlim(-0.5, columns - 0.5)
        axes[name].grid(True, alpha=0.3)

    fig.suptitle(title or "lgreco decisions: %d epochs, %d layers in %d group%s" % (
        len(run), layers, len(grid.groups), "" if len(grid.groups) == 1 else "s"))
    return fig, axes, grid


def _layer_axis(ax, grid, labels):
    layers = len(grid.names)
    step = max(1, int(math.ceil(layers / 80.0)))  # at most ~80 names on the axis
    ticks = list(range(0, layers, step))
    ax.set_yticks(ticks)
    if labels:
        ax.set_yticklabels([grid.short_name(r) for r in ticks], fontsize=7 if layers > 30 else 9)
    else:
        ax.tick_params(axis="y", labelleft=False)
    for first, _, _ in grid.groups[1:]:
        ax.axhline(first - 0.5, color="white", lw=2)
    if labels and len(grid.groups) > 1:
        twin = ax.twinx()
        twin.set_ylim(ax.get_ylim())
        twin.set_yticks([(first + last) / 2.0 for first, last, _ in grid.groups])
        twin.set_yticklabels(["bucket %s" % g for _, _, g in grid.groups], fontsize=8)
        twin.tick_params(axis="y", length=0)
    ax.set_ylabel("layer")


def _epoch_axis(ax, grid):
    columns = len(grid.epochs)
    step = max(1, int(math.ceil(columns / 25.0)))
    ticks = list(range(0, columns, step))
    ax.set_xticks(ticks)
    ax.set_xticklabels(["%d" % grid.epochs[c] + ("" if grid.switch_steps[c] is None else "\n@%d" % grid.switch_steps[c])
                        for c in ticks], fontsize=8)
    ax.set_xlabel("epoch (@ the step it starts at)")


# ---- the command ----------------------------------------------------------------------

def default_output(log_path):
    base, ext = os.path.splitext(log_path)
    return (base if ext in (".jsonl", ".json", ".log", ".txt") else log_path) + ".png"


def build_parser():
    p = argparse.ArgumentParser(
        prog=PROG, formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Draws a decision log (LGRECO_DECISION_LOG, one JSON line per solve): the codec per layer "
                    "over the epochs, each layer's realized relative error, bytes, predicted and realized error "
                    "against the budget, alpha, and the solve times. Needs matplotlib.",
        epilog="A file a restarted job appended to holds several runs (the epoch starts over); the last is "
               "drawn unless --run says otherwise.\nexit status: 0 drawn, 1 an unreadable or invalid log, no "
               "matplotlib, an unwritable output; 2 a usage error.")
    p.add_argument("log", metavar="DECISION_LOG", help="the decision log (one rank's file)")
    p.add_argument("-o", "--output", metavar="FILE",
                   help="the picture (default: DECISION_LOG with .png for .jsonl); its suffix picks the format "
                        "(.png, .svg, .pdf)")
    p.add_argument("--run", type=int, metavar="K", help="draw the K-th run of the file (1 = the first; default the "
                                                         "last)")
    p.add_argument("--title", help="the figure's title")
    return p


def _import_matplotlib():
    try:
        for module in ("numpy", "matplotlib"):
            importlib.import_module(module)
    except ImportError as e:
        raise LgrecoError("lgreco plot needs matplotlib (%s): apt-get install python3-matplotlib, or pip install "
                          "matplotlib" % e) from None


def main(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        runs = load(args.log)
        if args.run is not None and not 1 <= args.run <= len(runs):
            raise LgrecoError("--run %d: %s holds %d run%s" % (args.run, args.log, len(runs),
                                                               "" if len(runs) == 1 else "s"))
        k = args.run if args.run is not None else len(runs)
        run = runs[k - 1]
        if len(runs) > 1:
            sys.stderr.write("%s: %s holds %d runs (a new one starts where the epoch starts over); drawing run %d, "
                             "from line %d (--run K picks another)\n" % (PROG, args.log, len(runs), k, run[0]["_line"]))
        output = args.output or default_output(args.log)
        _import_matplotlib()
        fig, _, grid = figure(run, args.title)
        try:
            fig.savefig(output, dpi=100)
        except (OSError, ValueError) as e:
            raise LgrecoError("cannot write %s: %s" % (output, getattr(e, "strerror", None) or e)) from None
    except LgrecoError as e:
        sys.stderr.write("%s: error: %s\n" % (PROG, e))
        return 1
    print("%s: %s: %d epochs, %d layers, codecs %s" % (PROG, output, len(run), len(grid.names),
                                                       ", ".join(codec_labels(grid.order))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
