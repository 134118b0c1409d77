"""``alpsck plot RUN_DIR [-o OUT.png] [--loss FILE]``: a run's timeline and its loss, as one PNG.

``alpsck status`` says where the time went in numbers; this draws it, for whoever would rather look
than read. Top: each start of the run as a bar in wall-clock time since the first start, coloured by
how it ended, with markers for crashes, hangs, failures, nodes cordoned, stop signals, final checkpoints and
requeues, and the gaps between starts shaded (restarts inside the allocation apart from the queue).
Bottom: the loss against the step (``RUN_DIR/loss.csv``, the reference training's file), with a
dashed line at each step a start resumed from, coloured by where it read that state (the run directory, its
node's memory, a replica).

Everything comes from the run's timeline (:mod:`alpsck.slurm.timeline`, the fold of its history) and
its goodput (:func:`alpsck.slurm.goodput.goodput`). The default output is ``./<run-dir-name>-timeline.png`` in
the current directory, never a file in the run directory: like ``status`` this command only reads a
run, whose directory a live job may be writing, another user may own, and whose names belong to the
core. matplotlib is imported only when drawing, so the CLI starts without it.
"""

from __future__ import annotations

import argparse
import bisect
import csv
import time
from pathlib import Path
from typing import Any

from ..errors import UsageError
from ..out.figures import pyplot
from ..out.textout import printable
from ..slurm import goodput, history, timeline
from ..slurm.history import (
    Cancelled,
    Cordoned,
    Crashed,
    Failed,
    FinalCheckpoint,
    Finished,
    GaveUp,
    Hang,
    Requeued,
    Signal,
)
from ..slurm.timeline import RUNNING, UNKNOWN, Timeline

WIDTH_PX, HEIGHT_PX, DPI = 1600, 900, 100  # the PNG's size: readable on a laptop screen, at a glance
LOSS_FILE = "loss.csv"  # what the reference training writes into the run directory

OUTCOME_COLOURS = {
    Finished.KIND: "#2ca02c", RUNNING: "#1f77b4", Crashed.KIND: "#d62728", Hang.KIND: "#9467bd",
    Failed.KIND: "#8c2d04", Requeued.KIND: "#ff9f1c", Cancelled.KIND: "#7f7f7f", GaveUp.KIND: "#222222",
    UNKNOWN: "#c7c7c7"}
# Events drawn as markers above their start's bar: (marker, colour, legend label, height above the
# bar's centre). Three heights, so that a stop signal, its final checkpoint and the requeue seconds
# apart stay apart: incidents, stops, saves.
MARKERS = {
    Crashed.KIND: ("X", "#d62728", "crash (srun ended)", 0.34), Hang.KIND: ("P", "#9467bd", "hang detected", 0.34),
    Failed.KIND: ("x", "#8c2d04", "failure (exception)", 0.34), GaveUp.KIND: ("*", "#222222", "gave up", 0.34),
    Cordoned.KIND: ("h", "#e377c2", "node cordoned (health gate)", 0.34),
    Signal.KIND: ("v", "#444444", "stop signal", 0.46), Requeued.KIND: (">", "#ff9f1c", Requeued.KIND, 0.46),
    Cancelled.KIND: ("s", "#7f7f7f", Cancelled.KIND, 0.46),
    FinalCheckpoint.KIND: ("D", "#17becf", "final checkpoint", 0.58)}
GAP_COLOURS = {"restart_gap": "#f4b6b6", "queue": "#fde2b0"}  # shaded between starts
# The dashed line at each step a start resumed from, by where its state came from (Checkpointer.restored_tier).
TIER_LINES = {"run_dir": ("#555555", "a start resumed from this step (the run directory)"),
              "memory": ("#2ca02c", "... from its node's memory"), "replica": ("#9467bd", "... from a replica in memory")}


def read_losses(path: str | Path) -> tuple[list[int], list[float]]:
    """Steps and losses of one loss CSV (header ``step,loss``), in file order: after a resume the
    recomputed steps appear again, and a plot shows them as they are."""
    steps: list[int] = []
    losses: list[float] = []
    with open(path, newline="", encoding="utf-8") as f:
        for row in csv.DictReader(f):
            steps.append(int(row["step"]))
            losses.append(float(row["loss"]))
    return steps, losses


def _label(value: Any, limit: int = 24) -> str:
    """A history value as figure text: escaped like the terminal's (the log is anyone's to write),
    short, and with ``$`` escaped, which matplotlib would otherwise parse as mathematics."""
    return printable(value, limit).replace("$", r"\$")


def _time_unit(span_s: float) -> tuple[float, str]:
    """Seconds per x unit and its name: hours for a long run, minutes, or seconds for a short test."""
    return (3600.0, "hours") if span_s >= 3 * 3600 else (60.0, "minutes") if span_s >= 180 else (1.0, "seconds")


def _title(name: str, g: dict[str, Any]) -> str:
    ettr = "-" if g["ettr"] is None else f"{100 * g['ettr']:.0f}%"
    causes = goodput.restart_causes(g)
    why = f" ({', '.join(f'{n} {_label(c)}' for c, n in causes.items())})" if causes else ""
    return (f"{_label(name, 60)}: ETTR {ettr} (training {goodput.duration(g['training_s'])} of "
            f"{goodput.duration(g['wall_s'])} wall); {len(g['restarts'])} restart(s){why}")


def _rows(starts: list[dict[str, Any]]) -> list[int]:
    """The timeline row of each start: one row per allocation, a new one at each start that is not
    a restart inside the allocation (attempt 0 or none), so in-allocation restarts line up."""
    rows, row = [], -1
    for s in starts:
        if not s.get("attempt") or row < 0:
            row += 1
        rows.append(row)
    return rows


def _draw_timeline(ax: Any, tl: Timeline, starts: list[dict[str, Any]], g: dict[str, Any],
                   t_first: float, unit: float, unit_name: str) -> None:
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    rows = _rows(starts)

    def x(t: float) -> float:
        return (t - t_first) / unit

    t_last = t_first + float(g.get("wall_s") or 0.0)
    span = max(x(max([t_last] + [s["end"] for s in starts])), 1e-9)
    shown: dict[str, Any] = {}
    for k, s in enumerate(starts):  # the gap before each start, then the start
        if k > 0 and s["t0"] > starts[k - 1]["end"]:
            kind = "restart_gap" if s.get("attempt") else "queue"
            ax.axvspan(x(starts[k - 1]["end"]), x(s["t0"]), color=GAP_COLOURS[kind], zorder=0)
            shown.setdefault(kind, Patch(color=GAP_COLOURS[kind], label="restart in the allocation" if kind ==
                                         "restart_gap" else "queue (requeued / resubmitted)"))
        colour = OUTCOME_COLOURS.get(s["outcome"], OUTCOME_COLOURS[UNKNOWN])
        w = x(s["end"]) - x(s["t0"])
        ax.barh(rows[k], w, left=x(s["t0"]), height=0.5, color=colour, edgecolor="black", linewidth=0.6, zorder=2)
        shown.setdefault(s["outcome"], Patch(facecolor=colour, edgecolor="black", label=f"start: {_label(s['outcome'])}"))
        if w >= 0.03 * span:  # a label only where it fits; the row names the job anyway
            ax.text(x(s["t0"]) + w / 2, rows[k], f"attempt {_label(s.get('attempt') or 0)}", ha="center",
                    va="center", fontsize=9, color="white", zorder=4, clip_on=True)
    if starts and starts[-1]["outcome"] != RUNNING and t_last - starts[-1]["end"] > 1.0:  # awaits its next start
        ax.axvspan(x(starts[-1]["end"]), x(t_last), color=GAP_COLOURS["queue"], zorder=0)
        shown.setdefault("queue", Patch(color=GAP_COLOURS["queue"], label="queue (requeued / resubmitted)"))
    t0s = [s["t0"] for s in starts]
    points: dict[str, tuple[list[float], list[float]]] = {}
    for kind, t in tl.markers(MARKERS):  # each kind in one call: a long history holds thousands of signals
        xs, ys = points.setdefault(kind, ([], []))
        xs.append(x(t))
        ys.append(rows[max(0, bisect.bisect_right(t0s, t) - 1)] - MARKERS[kind][3])  # the start it hit
    for kind, (xs, ys) in points.items():
        marker, colour, text, _ = MARKERS[kind]
        ax.plot(xs, ys, marker=marker, color=colour, markersize=9, markeredgecolor="black", markeredgewidth=0.5,
                linestyle="none", zorder=5)
        shown["m:" + kind] = Line2D([], [], marker=marker, color=colour, markeredgecolor="black", linestyle="none",
                                    markersize=8, label=text)
    n_rows = max(rows) + 1 if rows else 1
    first_of_row = {r: starts[k] for k, r in reversed(list(enumerate(rows)))}
    # A requeued SLURM job keeps its id: the row says which allocation of it this is.
    ax.set_yticks(range(n_rows), [f"job {_label(first_of_row[r].get('job_id') or '?')}\nallocation {r + 1}"
                                  for r in range(n_rows)])
    ax.set_ylim(n_rows - 0.6, -0.7)  # first allocation on top, room above each bar for its markers
    ax.set_xlim(min(0.0, x(min(t0s))) - 0.01 * span, span * 1.01)
    when = time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(t_first))
    ax.set_xlabel(f"wall-clock time since the first start ({when}), {unit_name}")
    ax.grid(axis="x", alpha=0.3)
    order = sorted(shown, key=lambda k: (k.startswith("m:"), k in GAP_COLOURS))  # outcomes, gaps, markers
    ax.legend(handles=[shown[k] for k in order], loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=9,
              title="timeline", frameon=False)


def _draw_loss(ax: Any, loss_csv: Path | None, starts: list[dict[str, Any]]) -> None:
    if loss_csv is None:
        ax.text(0.5, 0.5, f"no loss file ({LOSS_FILE} not in the run directory; --loss FILE names one)",
                ha="center", va="center", transform=ax.transAxes, fontsize=12, color="#555555")
        ax.set_xticks([])
        ax.set_yticks([])
        return
    steps, losses = _losses(loss_csv)
    # After a resume the recomputed steps appear again: each run of rising steps is drawn in file
    # order, so a later segment lies over the one it repeats.
    cuts = [0] + [i for i in range(1, len(steps)) if steps[i] <= steps[i - 1]] + [len(steps)]
    for a, b in zip(cuts, cuts[1:], strict=False):  # (a segment of one row is a dot)
        ax.plot(steps[a:b], losses[a:b], color="#1f77b4", linewidth=1.2, zorder=2 + a / max(len(steps), 1),
                marker="." if b - a == 1 else None, label="loss" if a == 0 else None)
    resumed = resume_lines(starts)
    for (step, tier), who in sorted(resumed.items()):
        colour, _ = TIER_LINES.get(tier, TIER_LINES["run_dir"])
        ax.axvline(step, color=colour, linestyle="--", linewidth=1, zorder=1)
        more = f" (+{len(who) - 1})" if len(who) > 1 else ""
        where = "" if tier == "run_dir" else f" ({_label(goodput.TIER_NAMES.get(tier, tier))})"
        ax.text(step, 0.98, f" resumed from {step}{where}: {who[0]}{more}", rotation=90, va="top", ha="right",
                fontsize=8, color="#333333", transform=ax.get_xaxis_transform())
    for tier in dict.fromkeys(t for _, t in sorted(resumed)):
        colour, text = TIER_LINES.get(tier, TIER_LINES["run_dir"])
        ax.plot([], [], color=colour, linestyle="--", label=text)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=9, frameon=False)


def resume_lines(starts: list[dict[str, Any]]) -> dict[tuple[int, str], list[str]]:
    """The loss panel's dashed lines: (the step a start resumed from, where its state came from) -> the starts
    (attempt, job), in the order they came."""
    resumed: dict[tuple[int, str], list[str]] = {}
    for s in starts:
        step = s.get("resumed_step", s.get("resume_step"))
        if step is not None:
            tier = str(s.get("tier") or "run_dir")
            resumed.setdefault((int(step), tier), []).append(f"attempt {_label(s.get('attempt') or 0)}, "
                                                             f"job {_label(s.get('job_id') or '?')}")
    return resumed


def _losses(path: Path) -> tuple[list[int], list[float]]:
    """:func:`read_losses`, with a file that is not a ``step,loss`` CSV as a one-line error."""
    try:
        steps, losses = read_losses(path)
    except (KeyError, ValueError, TypeError, UnicodeDecodeError, csv.Error) as e:
        raise UsageError(f"{path} is not a step,loss CSV: {type(e).__name__}: {printable(str(e), 200)}") from None
    if not steps:
        raise UsageError(f"{path} holds no step,loss rows")
    return steps, losses


def _pyplot() -> Any:
    """matplotlib.pyplot on the Agg backend (:func:`alpsck.out.figures.pyplot`), or a UsageError saying
    how to install it: matplotlib is optional (the ``bench`` and ``test`` extras)."""
    plt = pyplot()
    if plt is None:
        raise UsageError("alpsck plot needs matplotlib: pip install matplotlib")
    return plt


def default_output(run_dir: str | Path) -> Path:
    """``./<run-dir-name>-timeline.png``: in the current directory, named after the run (see the
    module docstring for why not in the run directory)."""
    return Path(f"{Path(run_dir).resolve().name or 'run'}-timeline.png")


def plot_run(run_dir: str | Path, output: str | Path, loss_csv: str | Path | None = None) -> Path:
    """Draw the run in ``run_dir`` into the PNG ``output`` (WIDTH_PX x HEIGHT_PX) and return its
    path. ``loss_csv``: the loss file (default ``RUN_DIR/loss.csv`` when there is one; without one
    the loss panel says so). A run directory without a history, or with no start yet, is a
    UsageError naming it; so is a missing matplotlib."""
    run = Path(run_dir)
    tl = timeline.read(run)
    events = tl.events
    if not events:
        why = "is not a directory" if not run.is_dir() else f"has no readable {history.HISTORY}"
        raise UsageError(f"{run} {why}: nothing to plot (is it the run directory of an alpsck job?)")
    now = time.time()
    g = goodput.goodput(tl, now=now)
    if g is None:
        raise UsageError(f"{run}: the run has not started yet ({len(events)} event(s), no 'started'): nothing to plot")
    if loss_csv is not None and not Path(loss_csv).is_file():
        raise UsageError(f"loss file {loss_csv} does not exist or is not a file")
    loss = Path(loss_csv) if loss_csv is not None else run / LOSS_FILE if (run / LOSS_FILE).is_file() else None
    starts = g["starts"]  # the timeline's starts: the one walk over them
    plt = _pyplot()
    t_first = min(s["t0"] for s in starts)
    unit, unit_name = _time_unit(max(float(g.get("wall_s") or 0.0), max(s["end"] for s in starts) - t_first))
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(WIDTH_PX / DPI, HEIGHT_PX / DPI), dpi=DPI,
                                      gridspec_kw={"height_ratios": [1, 1.3]})
    try:
        _draw_timeline(top, tl, starts, g, t_first, unit, unit_name)
        top.set_title(_title(run.resolve().name, g), fontsize=13, loc="left")
        _draw_loss(bottom, loss, starts)
        fig.subplots_adjust(left=0.08, right=0.80, top=0.94, bottom=0.07, hspace=0.32)
        out = Path(output)
        try:
            fig.savefig(out, dpi=DPI, format="png")
        except OSError as e:
            raise UsageError(f"cannot write {out}: {e.strerror or e} (-o names another file)") from None
    finally:
        plt.close(fig)
    return out


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "plot", help="draw a run's timeline (starts, crashes, requeues) and its loss as a PNG",
        description="Draw a run as one PNG: each start in wall-clock time, coloured by how it ended, with its "
                    "crashes, hangs, failures, signals, final checkpoints and requeues, the queue and restart gaps "
                    "shaded, and ETTR in the title; below, the loss against the step with the steps the starts "
                    "resumed from. Reads the run directory only.")
    p.add_argument("run_dir")
    p.add_argument("-o", "--output", metavar="OUT.png",
                   help="the PNG to write (default: ./<run-dir-name>-timeline.png in the current directory)")
    p.add_argument("--loss", metavar="FILE", help=f"a step,loss CSV (default: RUN_DIR/{LOSS_FILE} when present)")

    def run(a: argparse.Namespace) -> int:
        print(plot_run(a.run_dir, a.output or default_output(a.run_dir), a.loss))
        return 0

    p.set_defaults(func=run)
