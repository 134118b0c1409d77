"""Plot loss curves: ``python -m alpsck.examples.llama.plot LOSS_CSV [LOSS_CSV ...] -o out.png``.

Reads the ``step,loss`` files the training writes (:func:`alpsck.tools.plot.read_losses`; ``alpsck plot
RUN_DIR`` draws one with the run's timeline); needs matplotlib (``pip install matplotlib``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from alpsck.out.figures import pyplot
from alpsck.tools.plot import read_losses  # the one reader of a loss file (alpsck plot draws it too)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m alpsck.examples.llama.plot", description="Plot step,loss CSV files.")
    p.add_argument("loss_csv", nargs="+", help="loss files (step,loss)")
    p.add_argument("-o", "--output", required=True, help="image to write (.png, .pdf, .svg)")
    p.add_argument("--title", default="training loss")
    p.add_argument("--logy", action="store_true", help="logarithmic loss axis")
    args = p.parse_args(argv)
    plt = pyplot()
    if plt is None:
        print("plot: matplotlib is not installed; run `pip install matplotlib`", file=sys.stderr)
        return 2
    fig, ax = plt.subplots(figsize=(8, 5))
    for path in args.loss_csv:
        steps, losses = read_losses(path)
        ax.plot(steps, losses, label=Path(path).name, linewidth=1)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(args.title)
    if args.logy:
        ax.set_yscale("log")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.output, dpi=120)
    plt.close(fig)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
