"""Render a :class:`BenchResult`: a text table, JSON, and a PNG plot (matplotlib optional)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from ..out.figures import pyplot

if TYPE_CHECKING:  # .run imports torch
    from .run import BenchResult


def table(r: BenchResult) -> str:
    gib = r.state_bytes / 2**30
    lines = [
        f"state {gib:.2f} GiB on {r.directory.rsplit('/', 1)[0]}  ({r.machine['cpus']} CPUs, {r.machine['arch']}, "
        f"torch {r.machine['torch']})",
        f"raw O_DIRECT write {r.raw_write_bps / 1e9:.2f} GB/s -> {r.state_bytes / r.raw_write_bps:.2f} s;"
        f"  read {r.raw_read_bps / 1e9:.2f} GB/s -> {r.state_bytes / r.raw_read_bps:.2f} s (medians)",
        f"  [{r.raw_tool}]",
        f"copy into pre-faulted memory: {r.copy_seconds:.3f} s",
        "",
        "stall, durable, CPU, restore: medians of the repeats; raw w / raw r: the raw disk sampled next to this "
        "method's saves / restores (s); x raw: durable / raw w;",
        "r/raw: restore bandwidth / raw read bandwidth, each restore against the raw reads just before and after "
        "it (median);",
        "CPU s: CPU time of one save, call to durable, every thread (what it takes from a training on busy cores)",
        "",
        f"{'method':<36} {'stall s':>8} {'durable s':>10} {'GB/s':>6} {'raw w':>6} {'x raw':>6} {'CPU s':>6} "
        f"{'restore s':>10} {'raw r':>6} {'r/raw':>6} {'first stall':>12}",
    ]
    for m in r.measurements:
        mark = "*" if m.method == r.best else " "
        lines.append(f"{mark}{m.method:<35} {m.stall:8.3f} {m.durable:10.3f} {r.state_bytes / m.durable / 1e9:6.2f} "
                     f"{m.raw_write:6.3f} {m.durable / m.raw_write:6.2f} {m.cpu:6.3f} {m.restore:10.3f} "
                     f"{m.raw_read:6.3f} {m.restore_vs_raw:6.2f} {m.first_stall:12.3f}")
    lines += ["", "ratios (* = best alpsck setting: lowest stall; 'urgent' = copy and write overlapped):"]
    lines += [f"  {k:<40} {v:6.2f}" for k, v in r.ratios.items()]
    a = r.advice
    lines += [
        "",
        f"recommended: {a['settings']}",
        f"  checkpoint at most every {a['min_interval_iterations']} iterations to stay under "
        f"{a['inputs']['tolerated_slowdown']:.0%} slowdown ({a['rule']})",
        f"  Young/Daly interval for MTBF {a['inputs']['mtbf_hours']} h: {a['young_daly_interval_seconds']:.0f} s "
        f"(~{a['young_daly_interval_iterations']} iterations of {a['inputs']['iteration_seconds']} s)",
    ]
    return "\n".join(lines)


def plot(r: BenchResult, path: Path) -> bool:
    """Bar chart of stall / durable / restore per method. False when matplotlib is missing."""
    plt = pyplot()
    if plt is None:
        return False
    names = [m.method for m in r.measurements]
    fig, ax = plt.subplots(figsize=(max(8, len(names) * 0.9), 4.5))
    xs = range(len(names))
    w = 0.27
    ax.bar([x - w for x in xs], [m.stall for m in r.measurements], w, label="stall")
    ax.bar(list(xs), [m.durable for m in r.measurements], w, label="time to durable")
    ax.bar([x + w for x in xs], [m.restore for m in r.measurements], w, label="restore")
    ax.axhline(r.state_bytes / r.raw_write_bps, color="k", ls="--", lw=1, label="raw O_DIRECT write")
    ax.axhline(r.copy_seconds, color="grey", ls=":", lw=1, label="pre-faulted copy")
    ax.set_xticks(list(xs), names, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("seconds")
    ax.set_title(f"checkpoint of {r.state_bytes / 2**30:.2f} GiB")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def _series(results: list[BenchResult]) -> dict[str, list[tuple[float, float, float]]]:
    """Per method, (GiB, stall s, durable s) at each size: alpsck's best setting as one line, each peer."""
    out: dict[str, list[tuple[float, float, float]]] = {}
    for r in results:
        gib = r.state_bytes / 2**30
        for m in r.measurements:
            if m.method.startswith("alpsck") and m.method != r.best or m.method.startswith("core "):
                continue
            name = "alpsck (best setting)" if m.method == r.best else m.method
            out.setdefault(name, []).append((gib, m.stall, m.durable))
    return out


def plot_sizes(results: list[BenchResult], path: Path) -> bool:
    """Stall and time to durable against state size (log-log), alpsck and each peer, with the raw
    O_DIRECT write and the pre-faulted copy of each size. False when matplotlib is missing."""
    plt = pyplot()
    if plt is None:
        return False
    from matplotlib.ticker import NullFormatter
    results = sorted(results, key=lambda r: r.state_bytes)
    gibs = [r.state_bytes / 2**30 for r in results]
    fig, (a_stall, a_dur) = plt.subplots(1, 2, figsize=(11, 4.5))
    for name, pts in _series(results).items():
        style = {"lw": 2.5} if name.startswith("alpsck") else {"lw": 1.2}
        a_stall.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name, **style)
        a_dur.plot([p[0] for p in pts], [p[2] for p in pts], marker="o", label=name, **style)
    a_stall.plot(gibs, [r.copy_seconds for r in results], "k:", lw=1, label="one copy into pre-faulted memory")
    a_dur.plot(gibs, [r.state_bytes / r.raw_write_bps for r in results], "k--", lw=1, label="raw O_DIRECT write")
    for ax, what in ((a_stall, "stall: time inside save() (s)"), (a_dur, "time from save() to durable (s)")):
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xticks(gibs, [f"{g:.3g}" for g in gibs])
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_xlabel("state size (GiB)")
        ax.set_ylabel(what)
        ax.legend(fontsize=7)
        ax.grid(True, which="both", alpha=0.3)
    fig.suptitle(f"checkpoint stall and time to durable against size ({results[0].machine['cpus']} CPUs, "
                 f"{results[0].directory.rsplit('/', 1)[0]})")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True
