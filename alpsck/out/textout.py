"""Text for the terminal from files alpsck does not control (a run directory's history, a job's
log): one escaping function, :func:`printable`, for everything such a command prints.

A history line or a log line is written by whoever can write the run directory. Printed raw, an
ESC starts a terminal control sequence (retitle the terminal, move the cursor, clear the
screen), a ``\\r`` or a newline inside a field fakes a line of the timeline, a lone surrogate
(``"\\ud800"`` in JSON) ends the print in a UnicodeEncodeError. Here every character that
``str.isprintable`` rejects (C0 including ESC, ``\\r`` and newline, DEL, C1, line and paragraph
separators, bidirectional overrides, surrogates) is shown escaped, as Python writes it in a
string literal: ``\\x1b``, ``\\n``, ``\\u202e``, ``\\ud800``.
"""

from __future__ import annotations

import datetime as dt
import json
from typing import Any

LIMIT = 2000  # characters of one value shown; the rest is counted, not printed

_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _escape(c: str) -> str:
    if c.isprintable():
        return c
    o = ord(c)
    return _NAMED.get(c) or (f"\\x{o:02x}" if o < 0x100 else f"\\u{o:04x}" if o < 0x10000 else f"\\U{o:08x}")


def printable(value: Any, limit: int = LIMIT) -> str:
    """``value`` as one line of terminal-safe text: a string as it is, any other JSON value as
    JSON; at most ``limit`` characters of it (then how many more there were), every character
    that is not printable escaped."""
    text = value if isinstance(value, str) else json.dumps(value, default=repr)
    more = len(text) - limit
    if more > 0:
        text = text[:limit]
    if not text.isprintable():
        text = "".join(map(_escape, text))
    return f"{text}... ({more} more characters)" if more > 0 else text


def local_time(t: float) -> str:
    """Unix seconds as the local time every listing prints them in: ``2026-11-28 04:21:52``."""
    return dt.datetime.fromtimestamp(t).strftime("%Y-%m-%d %H:%M:%S")
