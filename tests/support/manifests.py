"""Rewriting a MANIFEST.json in a test: the edit is sealed with its own CRC by the rule in docs/format.md.

Written independently of the C++ sealing code, so a test that passes through it also checks that
the documented rule is the one recovery applies.
"""

from __future__ import annotations

import json
import re
from typing import Any

from alpsck import _core

_CRC = re.compile(rb'"manifest_crc32c":"[0-9a-f]{8}"')


def reseal(text: bytes) -> bytes:
    """``text`` (holding one ``"manifest_crc32c":"<8 hex>"``) with that CRC recomputed."""
    assert len(_CRC.findall(text)) == 1, text
    zeroed = _CRC.sub(b'"manifest_crc32c":"00000000"', text)
    return zeroed.replace(b'"manifest_crc32c":"00000000"', b'"manifest_crc32c":"%08x"' % _core.crc32c(zeroed))


def sealed(manifest: dict[str, Any]) -> bytes:
    """``manifest`` as a sealed /2 file (compact JSON and a newline, as the core writes it)."""
    doc = {k: v for k, v in manifest.items() if k != "manifest_crc32c"}
    doc["manifest_crc32c"] = "00000000"
    return reseal(json.dumps(doc, separators=(",", ":")).encode() + b"\n")
