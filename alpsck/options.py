"""The engine's options, defined once in the core (``cpp/core/options.h``) and read from there.

One table (name, type, default, limits, meaning) that :class:`alpsck.Checkpointer`, the job
config's ``checkpoint`` section and the docs' option tables take their defaults and limits from,
so that a default is stated once and a value out of range is refused by name wherever it enters.
"""

from __future__ import annotations

import argparse
import difflib
import inspect
import math
import os
from collections.abc import Callable, Iterable, Mapping, MutableMapping
from typing import Any

from . import _core
from .errors import UsageError, echo

__all__ = ["CHECKPOINTER_OPTIONS", "DEFAULTS", "ENGINE_OPTIONS", "NONE_REFUSED", "SPECS", "check", "keep_best_text",
           "problem", "resolve", "with_options"]

SPECS: dict[str, dict[str, Any]] = {s["name"]: s for s in _core.engine_options()}
DEFAULTS: dict[str, Any] = {name: s["default"] for name, s in SPECS.items()}
# Who reads which (the table's scope): the engine's options go to _core.Engine(run_dir, options); a
# Checkpointer takes those and its own (spike_factor); the readers' (read_threads) are their argument.
ENGINE_OPTIONS: tuple[str, ...] = tuple(n for n, s in SPECS.items() if s["scope"] == "engine")
CHECKPOINTER_OPTIONS: tuple[str, ...] = tuple(n for n, s in SPECS.items() if s["scope"] in ("engine", "checkpointer"))
# Options where None takes no default (as it does for the others): it reads as "no limit", and the
# default would silently delete what the caller meant to keep. Refused, saying what to give instead.
NONE_REFUSED: dict[str, str] = {
    "keep_last": f"None is refused, not taken as the default ({DEFAULTS['keep_last']}), which would delete checkpoints: "
                 "give 0 to keep every checkpoint, or leave it out for the default",
}


def _range(spec: dict[str, Any]) -> str:
    zero = f" (0: {spec['zero_means']})" if spec["zero_means"] else ""
    return f"between {spec['min']:g} and {spec['max']:g}{zero}" if spec["type"] == "float" else \
        f"between {spec['min']} and {spec['max']}{zero}"


def problem(name: str, value: Any) -> str | None:
    """Why ``value`` is not a valid value of option ``name`` (naming the allowed range), or None."""
    spec = SPECS[name]
    kind = spec["type"]
    if value is None and name in NONE_REFUSED:
        return NONE_REFUSED[name]
    if kind == "bool":
        return None if isinstance(value, bool) else f"{echo(value)}: must be true or false"
    if kind == "text":
        return _text_problem(name, value)
    if kind == "cpus":
        if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple, range)):
            return f"{echo(value)}: must be a list of CPU numbers"
        bad = [c for c in value if isinstance(c, bool) or not isinstance(c, int) or not spec["min"] <= c <= spec["max"]]
        return f"{echo(bad[0])} is not a CPU number {_range(spec)}" if bad else None
    numeric: tuple[type, ...] = (int,) if kind == "int" else (int, float)
    if isinstance(value, bool) or not isinstance(value, numeric):
        return f"{echo(value)}: must be {'an integer' if kind == 'int' else 'a number'}"
    if value == 0 and spec["zero_means"]:  # 0 means something of its own ("off", "auto"), below min or not
        return None
    if not spec["min"] <= value <= spec["max"]:  # NaN compares false: refused too
        return f"{echo(value)}: must be {_range(spec)}"
    return None


def keep_best_text(value: Any) -> Any:
    """``keep_best`` as the core takes it: ``("val_loss", "min", 2)`` becomes ``"val_loss:min:2"``;
    anything else is returned as it is (and checked by :func:`problem`)."""
    if isinstance(value, (tuple, list)) and len(value) == 3 and all(isinstance(v, (str, int)) for v in value):
        return f"{value[0]}:{value[1]}:{value[2]}"
    return value


def _text_problem(name: str, value: Any) -> str | None:
    if not isinstance(value, str):
        return f"{echo(value)}: must be a string" + (" (METRIC:min:K or METRIC:max:K), or a (metric, mode, k) tuple"
                                                      if name == "keep_best" else "")
    if name == "keep_best" and value:
        try:  # the core parses it (retention.h): the rule is stated once
            _core.decide_retention([], 1, keep_best=value)
        except ValueError as e:
            text = str(e)
            return text[len("keep_best is "):] if text.startswith("keep_best is ") else text
    return None


def check(name: str, value: Any, where: str | None = None) -> None:
    """Raise UsageError naming ``where`` (default: the option's name) when ``value`` is out of range."""
    why = problem(name, value)
    if why is not None:
        raise UsageError(f"{where or name}: {why}")


def resolve(given: Mapping[str, Any], names: Iterable[str], caller: str) -> dict[str, Any]:
    """Every option of ``names`` by name, as ``caller`` (``"Checkpointer()"``) takes them: the given
    values (None: the table's default, except where NONE_REFUSED says why not), the table's defaults
    for the rest. A name not among ``names`` raises TypeError, as an unexpected keyword argument
    does; a value out of range UsageError naming the option (:func:`check`)."""
    names = tuple(names)
    for name in given:
        if name not in names:
            near = difflib.get_close_matches(str(name), names, n=1)
            hint = f" (did you mean {near[0]!r}?)" if near else ""
            raise TypeError(f"{caller} got an unexpected keyword argument {name!r}{hint}; its options: "
                            f"{', '.join(names)} (docs/python-api.md#options)")
    out = {}
    for name in names:
        value = given.get(name, DEFAULTS[name])
        if value is None and name not in NONE_REFUSED:
            value = DEFAULTS[name]
        elif name == "keep_best":
            value = keep_best_text(value)
        elif SPECS[name]["type"] == "cpus" and isinstance(value, (tuple, range)):
            value = list(value)
        check(name, value)
        out[name] = value
    return out


def with_options(init: Callable[..., Any], names: Iterable[str]) -> inspect.Signature:
    """The signature of a class whose ``__init__`` takes ``**options``, as its callers see it: the
    ``**options`` spelled out as one keyword-only parameter per option of ``names``, its default the
    table's (a class's ``__signature__``: help() and editors list the options)."""
    params = [p for p in inspect.signature(init).parameters.values() if p.kind is not p.VAR_KEYWORD][1:]  # no self
    params += [inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY, default=DEFAULTS[n]) for n in names]
    return inspect.Signature(params)


def _human_bytes(n: int) -> str:
    for unit, size in (("EiB", 1 << 60), ("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size and n % size == 0:
            return f"{n // size} {unit}"
    return str(n)


def default_text(name: str) -> str:
    """The default of option ``name`` as the docs write it."""
    spec, value = SPECS[name], DEFAULTS[name]
    if spec["type"] == "cpus":
        return "none"
    if spec["type"] == "text":
        return value or "off"
    if value == 0 and spec["zero_means"]:
        return spec["zero_means"]
    if name.endswith("_bytes"):
        return _human_bytes(value)
    return f"{value:g}" if spec["type"] == "float" else str(value)


def range_text(name: str) -> str:
    """The allowed values of option ``name`` as the docs write them."""
    spec = SPECS[name]
    if spec["type"] == "bool":
        return "true/false"
    if spec["type"] == "cpus":
        return f"CPU numbers {spec['min']} .. {spec['max']}"
    if spec["type"] == "text":
        return "text"
    zero = f" (0: {'auto' if spec['zero_means'].startswith('auto') else spec['zero_means']})" if spec["zero_means"] else ""
    if spec["type"] == "float":
        return f"{spec['min']:g} .. {spec['max']:g}{zero}"

    def num(n: int) -> str:
        if name.endswith("_bytes"):
            return _human_bytes(n)
        if n > 1 << 20 and n & (n - 1) == 0:
            return f"2^{n.bit_length() - 1}"
        return f"2^{(n + 1).bit_length() - 1}-1" if n > 1 << 20 and (n + 1) & n == 0 else str(n)

    return f"{num(spec['min'])} .. {num(spec['max'])}{zero}"


def markdown_table() -> str:
    """The option table of docs/python-api.md, generated from the core's table (tests/unit/test_options.py
    checks the docs hold exactly this)."""
    rows = ["| option | default | values | meaning |", "|---|---|---|---|"]
    for name, spec in SPECS.items():
        rows.append(f"| `{name}` | {default_text(name)} | {range_text(name)} | {spec['doc']} |")
    return "\n".join(rows) + "\n"



# ------------------------------------------------------------------ inputs every entry point checks alike

MAX_STEP = 2**63 - 1  # steps are int64 on disk (LATEST, the history) and in the core's bookkeeping


def check_step(step: Any, what: str = "step", allow_none: bool = False) -> None:
    """Raise UsageError naming ``what`` unless ``step`` is an int in 0 .. 2^63-1 (or None, if allowed)."""
    if step is None and allow_none:
        return
    if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step <= MAX_STEP:
        none = "None or " if allow_none else ""
        raise UsageError(f"{what} must be {none}an integer between 0 and 2^63-1, not {echo(step)}")


def check_state(state: Any, mutable: bool = False) -> None:
    """Raise UsageError unless ``state`` is a mapping (a mutable one for a restore), naming its type."""
    if not isinstance(state, MutableMapping if mutable else Mapping):
        raise UsageError(f"state must be a mapping of names to tensors, modules, optimizers and values, "
                         f"not {type(state).__name__}")


MAX_METRICS = 64  # the core's kMaxMetrics (commit.h)


def check_metrics(metrics: Any) -> list[tuple[str, float]]:
    """``save(..., metrics=)`` as the core takes it: (name, value) pairs, in the mapping's order. Raise
    UsageError naming the problem unless it is a mapping of at most 64 names (1-64 printable ASCII
    characters, no space) to real numbers (a Python or NumPy number, a one-element tensor; NaN and the
    infinities included: they are what a health check must see)."""
    if metrics is None:
        return []
    if not isinstance(metrics, Mapping):
        raise UsageError(f"metrics must be a mapping of names to numbers, not {type(metrics).__name__}")
    if len(metrics) > MAX_METRICS:
        raise UsageError(f"metrics: at most {MAX_METRICS} per checkpoint, not {len(metrics)}")
    out = []
    for name, value in metrics.items():
        if not isinstance(name, str) or not 0 < len(name) <= 64 or any(not "!" <= c <= "~" for c in name):
            raise UsageError(f"metric name {echo(name)}: use 1-64 printable ASCII characters, no space")
        if isinstance(value, (bool, str, bytes)):
            raise UsageError(f"metric {name!r} must be a number, not {echo(value)}")
        try:
            out.append((name, float(value)))
        except (TypeError, ValueError, RuntimeError):
            raise UsageError(f"metric {name!r} must be a number (or a one-element tensor), not "
                             f"{type(value).__name__}") from None
    return out


def check_run_dir_arg(run_dir: Any) -> None:
    """Raise UsageError unless ``run_dir`` is a usable path: a non-empty str or os.PathLike."""
    path = os.fspath(run_dir) if isinstance(run_dir, (str, os.PathLike)) else None
    if not path or not isinstance(path, (str, bytes)) or ("\0" in path if isinstance(path, str) else b"\0" in path):
        raise UsageError(f"run_dir must be a non-empty path without NUL bytes, not {echo(run_dir)}")


# ------------------------------------------------------------------ command-line argument types
# argparse `type=` callables: a value out of range is argparse's one-line error naming the option,
# exit 2, before any work starts.

MAX_RANK = 2**32 - 2  # ranks are uint32 on disk, below a world size of at most 2^32 - 1


def _whole(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {echo(text)}") from None


def arg_int(lo: int, hi: int | None = None) -> Callable[[str], int]:
    """A whole number in [lo, hi] (hi None: no upper bound)."""

    def parse(text: str) -> int:
        n = _whole(text)
        if n < lo or (hi is not None and n > hi):
            raise argparse.ArgumentTypeError(f"{n} is out of range: " + (f"at least {lo}" if hi is None else f"{lo} to {hi}"))
        return n

    return parse


def arg_real(lo: float, hi: float, *, lo_open: bool = True, hi_open: bool = False) -> Callable[[str], float]:
    """A finite number between lo and hi (each end open or closed)."""

    def parse(text: str) -> float:
        try:
            x = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {echo(text)}") from None
        below = x <= lo if lo_open else x < lo
        above = x >= hi if hi_open else x > hi
        if not math.isfinite(x) or below or above:
            raise argparse.ArgumentTypeError(f"{text} is out of range: {'(' if lo_open else '['}{lo:.4g}, {hi:.4g}"
                                             f"{')' if hi_open else ']'}")
        return x

    return parse


def arg_option(name: str) -> Callable[[str], int]:
    """A whole number that engine option ``name`` accepts (its range from the core's table)."""

    def parse(text: str) -> int:
        n = _whole(text)
        why = problem(name, n)
        if why is not None:
            raise argparse.ArgumentTypeError(why)
        return n

    return parse


arg_step = arg_int(0, MAX_STEP)
arg_rank = arg_int(0, MAX_RANK)
