"""This process's memory as the kernel describes it: one field of the mapping that holds an address."""

from __future__ import annotations

from pathlib import Path


def mapping_field(addr: int, field: str) -> list[str]:
    """The values of ``field`` (``"Rss"``, ``"VmFlags"``, ...) for this process's mapping that holds
    ``addr``, from /proc/self/smaps; AssertionError when no mapping holds it."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= addr < hi
        elif inside and head == field + ":":
            return line.split()[1:]
    raise AssertionError(f"no mapping holds {addr:#x}")
