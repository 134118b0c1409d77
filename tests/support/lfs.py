"""A stand-in ``lfs`` (support/lfs_standin.py) installed on PATH: Lustre's layouts and quotas without Lustre."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from support import SUPPORT

STANDIN = SUPPORT / "lfs_standin.py"


class Lfs:
    """The stand-in installed as ``lfs`` on PATH: its state and the calls it received."""

    def __init__(self, root: Path) -> None:
        self.bin = root / "bin"
        self.bin.mkdir()
        (self.bin / "lfs").write_text(f"#!/bin/sh\nexec {sys.executable} {STANDIN} \"$@\"\n")
        (self.bin / "lfs").chmod(0o755)
        self.state_path, self.log = root / "lfs-state.json", root / "lfs-calls.jsonl"

    def set(self, **state: Any) -> None:
        old = json.loads(self.state_path.read_text()) if self.state_path.exists() else {}
        self.state_path.write_text(json.dumps({**old, **state}))

    def calls(self) -> list[list[str]]:
        if not self.log.exists():
            return []
        return [json.loads(line) for line in self.log.read_text().splitlines()]

    def layouts(self) -> dict[str, list[str]]:
        return dict(json.loads(self.state_path.read_text()).get("layouts", {})) if self.state_path.exists() else {}
