"""The job config's YAML source: read with ``yaml.safe_load`` semantics, bounded in depth, every key's line
known (:class:`Loc`, for errors that name the file, the line and the key), ``$VAR`` and ``~`` expanded
(:func:`expand_path`), and each value's type checked against the schema's (:func:`check_type`).
:mod:`alpsck.slurm.config` holds the schema and its rules."""

from __future__ import annotations

import datetime
import difflib
import os
import re
from typing import Any

import yaml

from ..errors import ECHO_CHARS, ConfigError, echo
from ..store.names import is_text

MAX_YAML_DEPTH = 64  # nesting of lists and mappings a config may have (a job config needs 4)


def check_depth(text: str, source: str) -> None:
    """ConfigError naming the line where lists and mappings nest deeper than MAX_YAML_DEPTH. The
    scanner is iterative; the composer and the constructors recurse (a RecursionError traceback)."""
    depth = 0
    try:
        for token in yaml.scan(text, Loader=yaml.SafeLoader):
            if isinstance(token, (yaml.BlockMappingStartToken, yaml.BlockSequenceStartToken,
                                  yaml.FlowMappingStartToken, yaml.FlowSequenceStartToken)):
                depth += 1
                if depth > MAX_YAML_DEPTH:
                    raise ConfigError(f"{source}:{token.start_mark.line + 1}: lists and mappings nested deeper than "
                                      f"{MAX_YAML_DEPTH} levels")
            elif isinstance(token, (yaml.BlockEndToken, yaml.FlowMappingEndToken, yaml.FlowSequenceEndToken)):
                depth -= 1
    except yaml.YAMLError:
        return  # the composer reports it, with its line


def yaml_error(e: yaml.YAMLError, source: str, loc: Loc | None = None) -> ConfigError:
    mark = getattr(e, "problem_mark", None)
    where = f"{source}:{mark.line + 1}" if mark is not None else source
    key = loc.key_at(mark.line + 1) if loc is not None and mark is not None else None
    said = echo(getattr(e, "problem", None) or e, 2 * ECHO_CHARS, quoted=False)  # it may quote a tag, say
    return ConfigError(f"{where}: {f'{echo(key, quoted=False)}: ' if key else ''}not valid YAML: {said}")


class Loader(yaml.SafeLoader):
    """``yaml.SafeLoader``, where a value its constructors refuse (a date that does not exist,
    ``!!int abc``) is an error at the value's line, as the YAML errors are, not a ValueError."""

    def construct_object(self, node: yaml.Node, deep: bool = False) -> Any:
        try:
            return super().construct_object(node, deep=deep)
        except (ValueError, TypeError, OverflowError) as e:
            raise yaml.constructor.ConstructorError(None, None, f"{echo(node.value)}: {e}", node.start_mark) from None


def unset_stand_in(name: str) -> str:
    """What ``$name`` reads as in a dry run where it is not set: a path that says so."""
    return f"/{name}-is-not-set-here"


class Loc:
    """Line numbers of keys in the YAML document (from the composed node tree)."""

    def __init__(self, text: str, source: str, dry_run: bool = False) -> None:
        self.source = source
        self.dry_run = dry_run  # an unset $VAR becomes a stand-in (unset_stand_in), named in JobConfig.unset
        self.unset: dict[str, str] = {}
        self.lines: dict[str, int] = {}
        self.raw: dict[str, str] = {}  # scalars as written, before YAML resolved their type
        self._walked: set[int] = set()
        check_depth(text, source)  # before anything recursive reads it
        try:
            node = yaml.compose(text, Loader=yaml.SafeLoader)
        except yaml.YAMLError as e:
            raise yaml_error(e, source) from None
        if node is not None:
            self._walk(node, "")

    def _walk(self, node: yaml.Node, prefix: str) -> None:
        # Each mapping once: an alias may make the tree recursive (``&a {b: *a}``) or exponential.
        if isinstance(node, yaml.MappingNode) and id(node) not in self._walked:
            self._walked.add(id(node))
            first: dict[str, int] = {}  # key -> its line, in this mapping
            for k, v in node.value:
                if not isinstance(k, yaml.ScalarNode):  # a list or mapping as a key: the loader refuses it
                    continue
                key = f"{prefix}{k.value}"
                line = k.start_mark.line + 1
                if k.tag != "tag:yaml.org,2002:str":  # YAML 1.1 reads on/off/yes/no as booleans, 1 as a number
                    raise ConfigError(f"{self.source}:{line}: {echo(key, quoted=False)}: YAML reads this key as a "
                                      f"{k.tag.rsplit(':', 1)[-1]}, not as its text; every key is text (quote it: "
                                      f"'{k.value}')")
                if k.value in first:  # YAML would keep the last one and drop the other silently
                    raise ConfigError(f"{self.source}:{line}: {echo(key, quoted=False)}: given twice (also on line "
                                      f"{first[k.value]})")
                first[k.value] = line
                self.lines[key] = line
                if isinstance(v, yaml.ScalarNode):
                    self.raw[key] = str(v.value)
                elif isinstance(v, yaml.SequenceNode):  # list items as ``key[i]``
                    for i, item in enumerate(v.value):
                        if isinstance(item, yaml.ScalarNode):
                            self.raw[f"{key}[{i}]"] = str(item.value)
                self._walk(v, key + ".")

    def as_written(self, key: str, value: Any) -> Any:
        """A number, boolean or date as the config wrote it, where the text is meant (YAML reads
        1:30:00 as 5400, 0042 as 34, 010 as 8, 1.10 as 1.1 and 2024-01-02 as a date; SLURM and a
        script's argv get the text); other values unchanged."""
        if isinstance(value, (int, float, bool, datetime.date)):
            return self.raw.get(key, str(value))
        return value

    def key_at(self, line: int) -> str | None:
        """The innermost key written on ``line``, if any."""
        return next((k for k, n in reversed(self.lines.items()) if n == line), None)

    def err(self, key: str, msg: str) -> ConfigError:
        line = self.lines.get(key)
        where = f"{self.source}:{line}" if line else self.source
        return ConfigError(f"{where}: {echo(key, quoted=False)}: {msg}")


def expand(value: str, key: str, loc: Loc) -> str:
    def sub(m: re.Match[str]) -> str:
        name = m.group(1) or m.group(2)
        if name not in os.environ:
            if loc.dry_run:  # a script to read, here (off Alps: $SCRATCH): a stand-in that says so
                loc.unset.setdefault(name, unset_stand_in(name))
                return loc.unset[name]
            raise loc.err(key, f"environment variable ${name} is not set")
        return utf8(os.environ[name], key, loc, f"${name} expands to")

    return re.sub(r"\$(?:\{([A-Za-z_]\w*)\}|([A-Za-z_]\w*))", sub, value)


def utf8(value: str, key: str, loc: Loc, what: str) -> str:
    """``value`` if it is UTF-8 text, else a ConfigError naming ``key``: a value from the environment or the
    file system (``$X`` holding bytes that are not UTF-8, which Python keeps as surrogate escapes) cannot be
    written into the batch script, given to sbatch or to bash, which all take UTF-8 text."""
    if not is_text(value):
        shown = value.encode("utf-8", "surrogateescape")
        raise loc.err(key, f"{what} bytes that are not UTF-8 ({echo(shown)}), which the batch script cannot hold; "
                           "give a path that is UTF-8 text")
    return value


def expand_path(value: str, key: str, loc: Loc) -> str:
    """``$VAR``, ``${VAR}`` and a leading ``~`` expanded (:func:`expand`), each part UTF-8 text."""
    expanded = expand(value, key, loc)
    if expanded.startswith("~"):
        expanded = utf8(os.path.expanduser(expanded), key, loc, f"{echo(expanded.split('/', 1)[0])} expands to")
    return expanded


def check_type(key: str, value: Any, want: str, loc: Loc) -> Any:
    ok = {
        "str": isinstance(value, str),
        "int": isinstance(value, int) and not isinstance(value, bool),
        "float": isinstance(value, (int, float)) and not isinstance(value, bool),
        "bool": isinstance(value, bool),
        "list[str]": isinstance(value, list) and all(isinstance(x, (str, int, float)) and not isinstance(x, bool)
                                                     for x in value),
        "dict": isinstance(value, dict),
    }[want]
    if not ok:
        raise loc.err(key, f"expected {want}, got {type(value).__name__} {echo(value)}")
    if want == "list[str]":
        return [str(x) for x in value]
    return value


def as_text(value: Any, key: str, loc: Loc) -> Any:
    """A text key's value: a number or date as written (unquoted, YAML reads slurm.time 1:30:00 as
    5400, an account or a name 0042 as 34, 2024-01-02 as a date, while SLURM reads 1 h 30 min and
    the account "0042"); a boolean stays one (``account: yes`` is more likely a mistake than a name),
    and so does anything else, for the type check to refuse."""
    if isinstance(value, (int, float, datetime.date)) and not isinstance(value, bool):
        return loc.as_written(key, value)
    return value


def unknown_key(key: str, options: list[str] | tuple[str, ...], loc: Loc) -> ConfigError:
    close = difflib.get_close_matches(key.rsplit(".", 1)[-1], options, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else f" (known: {', '.join(options)})"
    return loc.err(key, f"unknown key{hint}")
