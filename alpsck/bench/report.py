"""Render a :class:`BenchResult`: a text table, JSON, and a PNG plot (matplotlib optional)."""

from __future__ import annotations

from pathlib import Path

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
        "raw w / raw r: the raw disk sampled next to this method's saves / restore (s); x raw: durable / raw w",
        "",
        f"{'method':<36} {'stall s':>8} {'durable s':>10} {'GB/s':>6} {'raw w':>6} {'x raw':>6} {'restore s':>10} "
        f"{'raw r':>6} {'first stall':>12}",
    ]
    for m in r.measurements:
        mark = "*" if m.method == r.best else " "
        lines.append(f"{mark}{m.method:<35} {m.stall:8.3f} {m.durable:10.3f} {r.state_bytes / m.durable / 1e9:6.2f} "
                     f"{m.raw_write:6.3f} {m.durable / m.raw_write:6.2f} {m.restore:10.3f} {m.raw_read:6.3f} "
                     f"{m.first_stall:12.3f}")
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
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
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
