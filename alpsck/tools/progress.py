"""What the tools show on a terminal: sizes in binary units, and a progress bar for long verifications."""

from __future__ import annotations

import time
from typing import TextIO


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TiB"




class ProgressBar:
    """A one-line terminal bar: ``label [#####.....]  42.0%  1.2 GiB / 2.9 GiB`` (redrawn at most 10x/s)."""

    def __init__(self, total: int, stream: TextIO, label: str = "verifying", width: int = 30) -> None:
        self.total, self.stream, self.label, self.width = max(0, int(total)), stream, label, width
        self.done = 0
        self._last_draw = 0.0
        self._drawn = False

    def update(self, done: int) -> None:
        self.done = min(max(int(done), self.done), self.total) if self.total else int(done)
        now = time.monotonic()
        if now - self._last_draw >= 0.1 or (self.total and self.done >= self.total):
            self._last_draw = now
            self.draw()

    def draw(self) -> None:
        frac = (self.done / self.total) if self.total else 1.0
        filled = int(round(frac * self.width))
        bar = "#" * filled + "." * (self.width - filled)
        self.stream.write(f"\r{self.label} [{bar}] {100 * frac:5.1f}%  {human(self.done)} / {human(self.total)}")
        self.stream.flush()
        self._drawn = True

    def close(self, complete: bool = True) -> None:
        if complete:
            self.done = self.total
        self.draw()
        self.stream.write("\n")
        self.stream.flush()


class ShardProgress:
    """Turns the core's progress callbacks (bytes done *in the current shard*) into one running total.

    The core verifies shards one after another (in directory order) and restarts its count at each;
    a count that does not grow means a new shard began, so the previous one's count is banked. (A
    shard smaller than the next one's first chunk can go unnoticed: the total then lags by less
    than one chunk.)
    """

    def __init__(self, bar: ProgressBar) -> None:
        self.bar = bar
        self.base, self.last = 0, 0

    def __call__(self, done: int) -> None:
        if done <= self.last:
            self.base += self.last
        self.last = done
        self.bar.update(self.base + done)
