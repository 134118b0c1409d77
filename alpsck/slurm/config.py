"""The job config (YAML), validated before anything is submitted.

Every error names the key and, where known, the file and line (``config.yaml:12: slurm.tme:
unknown key (did you mean 'time'?)``). The YAML is read with ``yaml.safe_load`` semantics (the
safe composer; no tags are constructed). ``$VAR``, ``${VAR}`` and a leading ``~`` in ``run_dir``,
``entry.script`` and the ``environment`` paths expand where the config is loaded; an unset
variable is an error naming it. Where a value is text (text keys, ``slurm.extra`` values,
``entry.args``), a number or boolean is taken as written: ``010`` stays ``010``, not 8. Values
that reach sbatch are checked against strict patterns, so no config value can inject a line or a
shell word; ``environment.setup`` lines are the one place where you write shell yourself (they
run verbatim in the batch script, as one ``eval`` of their text; under the local executor, bash
runs them before the job). A setup block that does not parse, or leaves the shell open at its
end, is refused (:func:`shell_problem`).

Hostile input is bounded: a file over MAX_CONFIG_BYTES is refused before it is parsed, every
number has a range (RANGES, and the engine's own table for its options), and an error quotes at
most the start of a value (:func:`alpsck.errors.echo`).
"""

from __future__ import annotations

import datetime
import difflib
import os
import re
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from ..errors import ECHO_CHARS, ConfigError, UsageError, echo
from ..options import DEFAULTS, MAX_STEP, NONE_REFUSED
from ..options import problem as option_problem
from ..store.lustre import layout_problem
from ..store.names import is_text
from ..store.retention import RULES as RETENTION_RULES
from ..store.retention import Policy

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.+-]{0,127}")
_SLURM_WORD = re.compile(r"[A-Za-z0-9_.,:=+@%/-]{1,256}")  # partition, account, qos, constraint lists...
_TIME = re.compile(r"(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?")
_ENTRY_FN = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*")
_SIGNALS = ("USR1", "USR2")
_MAX_TIME_MINUTES = 365 * 1440
# SLURM keeps node, task and CPU counts as uint32 with 0xfffffffe/0xffffffff as "unset"/"infinite":
# anything from there up is refused by sbatch, and far less already by any real cluster.
_MAX_SLURM_COUNT = 2**32 - 3
_MAX_YAML_DEPTH = 64  # nesting of lists and mappings a config may have (a job config needs 4)
MAX_CONFIG_BYTES = 1 << 20  # a job config needs a few hundred bytes; a bigger file is a mistake (or an attack)
_DAY_S = 86_400
_MAX_S = 365 * _DAY_S  # the longest time limit: a longer wait or interval never comes in a job
# Every number a config holds, "section.key" -> (lowest, highest), checked when it loads (NaN and inf
# are refused too): a value past these crashed the job's threads (a poll of 1e10 s overflows a wait) or
# meant nothing. The engine's options (checkpoint.max_in_flight, threads, keep_*) take theirs from
# alpsck.options. docs/config.md lists the same (tests/test_config_hostile.py compares).
RANGES: dict[str, tuple[int | float, int | float]] = {
    "slurm.nodes": (1, _MAX_SLURM_COUNT), "slurm.tasks_per_node": (1, _MAX_SLURM_COUNT),
    "slurm.gpus_per_node": (0, _MAX_SLURM_COUNT), "slurm.cpus_per_task": (1, _MAX_SLURM_COUNT),
    "checkpoint.every_steps": (1, MAX_STEP),  # steps are int64
    "checkpoint.every_seconds": (0.001, _MAX_S),
    "checkpoint.mtbf_s": (1, _MAX_S),
    "requeue.max_restarts": (0, 100_000),
    "requeue.signal_delay_s": (1, _MAX_S),  # and less than the time limit
    "requeue.maintenance_margin_s": (0, 7 * _DAY_S),
    "requeue.maintenance_poll_s": (1, _DAY_S),  # the watcher runs scontrol show reservation once per poll
    "requeue.same_error_retries": (0, 100_000),
    "requeue.give_up_after_no_progress": (1, 100_000),
    "requeue.in_job_restarts": (0, 1_000),
    "requeue.hang_timeout_s": (0, _MAX_S),
    "requeue.hang_timeout_min_s": (1, _MAX_S),
}
# checkpoint.<option>: alpsck.options' table
ENGINE_OPTIONS = ("max_in_flight", "threads", *RETENTION_RULES, "spike_factor")


def _number(x: int | float) -> str:
    return f"{x:g}" if isinstance(x, float) else str(x)


def range_text(key: str) -> str:
    """The allowed values of a RANGES key as docs/config.md writes them: ``1 .. 86400``."""
    lo, hi = RANGES[key]
    return " .. ".join("2^32-3" if x == _MAX_SLURM_COUNT else "2^63-1" if x == MAX_STEP else _number(x) for x in (lo, hi))


# sbatch options alpsck (or submitit for it) writes itself, or that would contradict what it writes: the
# long name -> (the short spelling, or "", and what sets it instead). An extra option would replace or
# fight ours silently: ``signal`` breaks the time-limit stop, ``requeue`` the requeue, ``gpus`` the GPUs.
_CONTROLLED: dict[str, tuple[str, str]] = {
    "signal": ("", "use requeue.signal and requeue.signal_delay_s"), "requeue": ("", "it always requeues"),
    "no-requeue": ("", "it always requeues"), "time": ("t", "use slurm.time"), "job-name": ("J", "use name"),
    "output": ("o", "logs go to RUN_DIR/submitit/"), "error": ("e", "logs go to RUN_DIR/submitit/"),
    "open-mode": ("", "a requeued job appends to its log"), "nodes": ("N", "use slurm.nodes"),
    "ntasks-per-node": ("", "use slurm.tasks_per_node"), "ntasks": ("n", "use slurm.nodes and slurm.tasks_per_node"),
    "cpus-per-task": ("c", "use slurm.cpus_per_task"), "partition": ("p", "use slurm.partition"),
    "gpus-per-node": ("", "use slurm.gpus_per_node"), "gpus-per-task": ("", "use slurm.gpus_per_node"),
    "mem": ("", "use slurm.mem"), "constraint": ("C", "use slurm.constraint"),
    "account": ("A", "use slurm.account"), "qos": ("q", "use slurm.qos"), "reservation": ("", "use slurm.reservation"),
    "environment": ("", "use environment.container"), "uenv": ("", "use environment.uenv"),
    "view": ("", "use environment.view"), "wrap": ("", "the entry runs through submitit"),
    "array": ("a", "one job per config"),
    # The job needs the submitting shell's environment (PATH, $SCRATCH, SLURM's and submitit's variables):
    # --export=NONE drops it; and it runs where `alpsck submit` ran (entry.function's module is found there).
    "export": ("", "the job needs the environment it is submitted from; put variables in environment.setup"),
    "chdir": ("D", "the job runs in the directory alpsck submit runs in, where it finds entry.function's module"),
}
_SHORT = {short: long for long, (short, _) in _CONTROLLED.items() if short}
# sbatch options of its own that start like one of ours and are not abbreviations of it. --gpus (the
# job's GPUs in all) is free while slurm.gpus_per_node is 0, when alpsck writes no GPU option.
_SBATCH_OPTIONS_LIKE_OURS = ("gpus",)


def parse_time_minutes(text: str) -> float:
    """Minutes of a SLURM time string: M, M:S, H:M:S, D-H, D-H:M, D-H:M:S."""
    m = _TIME.fullmatch(text.strip())
    if not m:
        raise ValueError(f"bad time {echo(text)}: use M, M:S, H:M:S, D-H, D-H:M or D-H:M:S")
    days, a, b, c = m.group(1), m.group(2), m.group(3), m.group(4)
    d = int(days or 0)
    if days is not None:  # D-H[:M[:S]]
        h, mi, s = int(a), int(b or 0), int(c or 0)
    elif c is not None:  # H:M:S
        h, mi, s = int(a), int(b), int(c)
    elif b is not None:  # M:S
        h, mi, s = 0, int(a), int(b)
    else:  # M
        h, mi, s = 0, int(a), 0
    has_hours = days is not None or c is not None  # minutes then sit below hours: < 60
    has_seconds = c is not None or (days is None and b is not None)
    if (has_hours and mi >= 60) or (has_seconds and s >= 60) or (days is not None and h >= 24):
        raise ValueError(f"bad time {echo(text)}: a field is out of range")
    total = d * 1440 + h * 60 + mi + s / 60
    if total <= 0:
        raise ValueError(f"bad time {echo(text)}: must be positive")
    if total > _MAX_TIME_MINUTES:
        raise ValueError(f"bad time {echo(text)}: more than 365 days")
    return total


@dataclass
class SlurmConfig:
    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    reservation: str | None = None
    nodes: int = 1
    tasks_per_node: int = 1
    gpus_per_node: int = 0
    cpus_per_task: int = 1
    time: str = "01:00:00"
    constraint: str | None = None
    mem: str | None = None
    extra: dict[str, str] = field(default_factory=dict)

    @property
    def time_minutes(self) -> float:
        return parse_time_minutes(self.time)


@dataclass
class EnvironmentConfig:
    container: str | None = None  # Alps Container Engine EDF (srun/sbatch --environment)
    uenv: str | None = None       # --uenv
    view: str | None = None       # --view of the uenv ("default" when a uenv is given)
    venv: str | None = None       # a virtual environment to activate
    setup: list[str] = field(default_factory=list)


@dataclass
class EntryConfig:
    function: str | None = None   # "module:function", called in-process with a JobContext
    script: str | None = None     # a Python script, run in-process (runpy) with sys.argv = [script, *args]
    args: list[str] = field(default_factory=list)


@dataclass
class CheckpointConfig:
    every_steps: int | None = 50
    every_seconds: float | None = None
    every: str | None = None  # "auto": the interval by Young/Daly from the measured save cost (alpsck.slurm.interval)
    mtbf_s: float | None = None  # for every: auto; unset: observed in the history, else a day
    max_in_flight: int = DEFAULTS["max_in_flight"]  # the engine's options: defaults from alpsck.options
    threads: int = DEFAULTS["threads"]
    keep_last: int = DEFAULTS["keep_last"]
    keep_every_steps: int = DEFAULTS["keep_every_steps"]  # retention (docs/retention.md): the engine's rules
    keep_every_seconds: float = DEFAULTS["keep_every_seconds"]
    keep_best: str = DEFAULTS["keep_best"]  # "METRIC:min:K" or "METRIC:max:K"
    spike_factor: float = DEFAULTS["spike_factor"]  # a saved loss this many times the recent median is unhealthy
    lustre_layout: str = "auto"  # on Lustre: "auto", "none" or lfs setstripe options (alpsck.store.filesystem)
    preflight: bool = True  # check space, inodes and quota before the first save (Checkpointer's preflight)


@dataclass
class RequeueConfig:
    max_restarts: int = 20
    signal: str = "USR2"
    signal_delay_s: int | None = None  # default: min(120 s, half the time limit)
    on_maintenance: bool = True
    maintenance_margin_s: int = 300
    maintenance_poll_s: int = 60
    on_failure: bool = True
    same_error_retries: int = 1  # requeues of a start that failed as the one before, with no checkpoint between
    give_up_after_no_progress: int = 3
    in_job_restarts: int = 3  # a job step that dies starts again in its allocation, this many times per allocation
    hang_timeout_s: float = 900.0  # no progress in a step for this long is a hang (other sections: 4x); 0: no watchdog
    hang_timeout: str = "fixed"    # "learned": 5x the longest visit of each section seen in the run, once seen enough
    hang_timeout_min_s: float = 60.0  # the least a learned timeout can be


@dataclass
class JobConfig:
    name: str
    run_dir: str
    slurm: SlurmConfig
    environment: EnvironmentConfig
    entry: EntryConfig
    checkpoint: CheckpointConfig
    requeue: RequeueConfig
    source: str = "<config>"
    workdir: str = ""               # where `alpsck submit` ran: the base of relative paths, and the job's cwd
    config_dir: str | None = None   # the config file's directory (the job imports entry modules from it too)
    unset: tuple[str, ...] = ()     # a dry run's $VARs that were not set here (each read as unset_stand_in)


# key -> (type, validator or None); nested sections handled below
_SECTIONS: dict[str, type] = {"slurm": SlurmConfig, "environment": EnvironmentConfig, "entry": EntryConfig,
                              "checkpoint": CheckpointConfig, "requeue": RequeueConfig}


def _check_depth(text: str, source: str) -> None:
    """ConfigError naming the line where lists and mappings nest deeper than _MAX_YAML_DEPTH. The
    scanner is iterative; the composer and the constructors recurse (a RecursionError traceback)."""
    depth = 0
    try:
        for token in yaml.scan(text, Loader=yaml.SafeLoader):
            if isinstance(token, (yaml.BlockMappingStartToken, yaml.BlockSequenceStartToken,
                                  yaml.FlowMappingStartToken, yaml.FlowSequenceStartToken)):
                depth += 1
                if depth > _MAX_YAML_DEPTH:
                    raise ConfigError(f"{source}:{token.start_mark.line + 1}: lists and mappings nested deeper than "
                                      f"{_MAX_YAML_DEPTH} levels")
            elif isinstance(token, (yaml.BlockEndToken, yaml.FlowMappingEndToken, yaml.FlowSequenceEndToken)):
                depth -= 1
    except yaml.YAMLError:
        return  # the composer reports it, with its line


def _yaml_error(e: yaml.YAMLError, source: str, loc: _Loc | None = None) -> ConfigError:
    mark = getattr(e, "problem_mark", None)
    where = f"{source}:{mark.line + 1}" if mark is not None else source
    key = loc.key_at(mark.line + 1) if loc is not None and mark is not None else None
    said = echo(getattr(e, "problem", None) or e, 2 * ECHO_CHARS, quoted=False)  # it may quote a tag, say
    return ConfigError(f"{where}: {f'{echo(key, quoted=False)}: ' if key else ''}not valid YAML: {said}")


class _Loader(yaml.SafeLoader):
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


class _Loc:
    """Line numbers of keys in the YAML document (from the composed node tree)."""

    def __init__(self, text: str, source: str, dry_run: bool = False) -> None:
        self.source = source
        self.dry_run = dry_run  # an unset $VAR becomes a stand-in (unset_stand_in), named in JobConfig.unset
        self.unset: dict[str, str] = {}
        self.lines: dict[str, int] = {}
        self.raw: dict[str, str] = {}  # scalars as written, before YAML resolved their type
        self._walked: set[int] = set()
        _check_depth(text, source)  # before anything recursive reads it
        try:
            node = yaml.compose(text, Loader=yaml.SafeLoader)
        except yaml.YAMLError as e:
            raise _yaml_error(e, source) from None
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


def _expand(value: str, key: str, loc: _Loc) -> str:
    def sub(m: re.Match[str]) -> str:
        name = m.group(1) or m.group(2)
        if name not in os.environ:
            if loc.dry_run:  # a script to read, here (off Alps: $SCRATCH): a stand-in that says so
                loc.unset.setdefault(name, unset_stand_in(name))
                return loc.unset[name]
            raise loc.err(key, f"environment variable ${name} is not set")
        return _utf8(os.environ[name], key, loc, f"${name} expands to")

    return re.sub(r"\$(?:\{([A-Za-z_]\w*)\}|([A-Za-z_]\w*))", sub, value)


def _utf8(value: str, key: str, loc: _Loc, what: str) -> str:
    """``value`` if it is UTF-8 text, else a ConfigError naming ``key``: a value from the environment or the
    file system (``$X`` holding bytes that are not UTF-8, which Python keeps as surrogate escapes) cannot be
    written into the batch script, given to sbatch or to bash, which all take UTF-8 text."""
    if not is_text(value):
        shown = value.encode("utf-8", "surrogateescape")
        raise loc.err(key, f"{what} bytes that are not UTF-8 ({echo(shown)}), which the batch script cannot hold; "
                           "give a path that is UTF-8 text")
    return value


def _expand_path(value: str, key: str, loc: _Loc) -> str:
    """``$VAR``, ``${VAR}`` and a leading ``~`` expanded (:func:`_expand`), each part UTF-8 text."""
    expanded = _expand(value, key, loc)
    if expanded.startswith("~"):
        expanded = _utf8(os.path.expanduser(expanded), key, loc, f"{echo(expanded.split('/', 1)[0])} expands to")
    return expanded


def _check_type(key: str, value: Any, want: str, loc: _Loc) -> Any:
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


_TYPES: dict[str, dict[str, str]] = {
    "slurm": {"partition": "str", "account": "str", "qos": "str", "reservation": "str", "nodes": "int",
              "tasks_per_node": "int", "gpus_per_node": "int", "cpus_per_task": "int", "time": "str",
              "constraint": "str", "mem": "str", "extra": "dict"},
    "environment": {"container": "str", "uenv": "str", "view": "str", "venv": "str", "setup": "list[str]"},
    "entry": {"function": "str", "script": "str", "args": "list[str]"},
    "checkpoint": {"every_steps": "int", "every_seconds": "float", "every": "str", "mtbf_s": "float",
                   "max_in_flight": "int", "threads": "int",
                   "keep_last": "int", "keep_every_steps": "int", "keep_every_seconds": "float", "keep_best": "str",
                   "spike_factor": "float",
                   "lustre_layout": "str", "preflight": "bool"},
    "requeue": {"max_restarts": "int", "signal": "str", "signal_delay_s": "int", "on_maintenance": "bool",
                "maintenance_margin_s": "int", "maintenance_poll_s": "int", "on_failure": "bool",
                "same_error_retries": "int", "give_up_after_no_progress": "int", "in_job_restarts": "int",
                "hang_timeout_s": "float", "hang_timeout": "str", "hang_timeout_min_s": "float"},
}
_TOP = ("name", "run_dir", *_SECTIONS)


def _spelled(option: str) -> str:
    """``--time (-t)``: an sbatch option alpsck sets, in both spellings."""
    short = _CONTROLLED[option][0]
    return f"--{option} (-{short})" if short else f"--{option}"


def _extra_value(key: str, option: Any, value: Any, loc: _Loc) -> str:
    """One ``slurm.extra`` option's value as sbatch gets it: the text as written, "" for a flag."""
    if not isinstance(option, str):  # YAML reads the key `no` as false, `1` as 1
        raise loc.err(key, f"YAML reads this key as the {type(option).__name__} {echo(option)}: sbatch option names are "
                           "lower-case words with dashes (e.g. 'exclusive')")
    # The option sbatch would read, however it is spelt: with its dashes, its short letter, or with
    # underscores (submitit writes job_name as --job-name).
    bare = option.lstrip("-").replace("_", "-")
    long = _SHORT.get(bare, bare)
    if long in _CONTROLLED:
        raise loc.err(key, f"alpsck sets {_spelled(long)} itself ({_CONTROLLED[long][1]})")
    ours = [o for o in _CONTROLLED if o.startswith(long)] if long and long not in _SBATCH_OPTIONS_LIKE_OURS else []
    if ours:
        hint = f" ({_CONTROLLED[ours[0]][1]})" if len(ours) == 1 else ""
        raise loc.err(key, f"sbatch takes --{long} as an abbreviation of --{' or --'.join(ours)}, which alpsck "
                           f"sets itself{hint}; write the full name of an option alpsck does not set")
    if not re.fullmatch(r"[a-z][a-z0-9-]{1,63}", option):
        raise loc.err(key, "sbatch option names are lower-case long names with dashes, without the leading -- "
                           "(e.g. 'exclusive'), at most 64 characters; a one-letter key would reach sbatch as --x, "
                           "not as -x")
    text = loc.as_written(key, value)
    if isinstance(value, bool):  # YAML 1.1 booleans: true is a flag, yes/no/on/off stay text (--kill-on-invalid-dep=no)
        if text.lower() == "true":
            return ""
        if text.lower() == "false":
            raise loc.err(key, "false is not an sbatch value; leave the option out to not set it")
    if not isinstance(text, str) or not _SLURM_WORD.fullmatch(text):
        raise loc.err(key, f"{echo(value)} is not a plain sbatch option value")
    return text


def shell_problem(text: str) -> str | None:
    """Why bash would not run ``text`` (shell lines) as a block of its own, or None.

    ``bash -n`` finds the syntax errors (an unterminated quote, ``$(`` or ``if``), and warns of an
    unterminated here-document, which it accepts. The block is also parsed inside a group,
    ``{ :; <text>; }``: a line left open at its end (that here-document, a trailing backslash)
    swallows the group's ``}`` and fails to parse, where in a script it would have swallowed the
    lines after the block. None too where bash is not on the PATH (nothing to check with)."""
    bash = shutil.which("bash")
    if bash is None:
        return None
    for i, wrapped in enumerate((text, "{\n:\n" + text + "\n}\n")):
        try:
            # extglob on: a block may turn it on (shopt -s extglob) before it uses it, and -n runs no shopt
            r = subprocess.run([bash, "-O", "extglob", "-n"], input=wrapped, capture_output=True, text=True, timeout=60,
                               env={"PATH": os.environ.get("PATH", ""), "LC_ALL": "C"})
        except (OSError, subprocess.SubprocessError) as e:
            return f"bash -n could not check it: {e}"
        said = [re.sub(r"^\S*bash: (line \d+: )", r"\1", ln) for ln in r.stderr.splitlines() if ln.strip()]
        if r.returncode == 0 and not said:
            continue
        if i == 0:  # bash's own words name the line (line N: the N-th line of the block)
            return echo("; ".join(said) or f"bash -n exit code {r.returncode}", 240, quoted=False)
        last = text.rstrip("\n").rsplit("\n", 1)[-1]
        if (len(last) - len(last.rstrip("\\"))) % 2:
            return "its last line ends with a backslash, which would join the line after the block to it"
        return "a line leaves the shell open at its end (a here-document, say), so it would swallow the lines after it"
    return None


def _text(value: Any, key: str, loc: _Loc) -> Any:
    """A text key's value: a number or date as written (unquoted, YAML reads slurm.time 1:30:00 as
    5400, an account or a name 0042 as 34, 2024-01-02 as a date, while SLURM reads 1 h 30 min and
    the account "0042"); a boolean stays one (``account: yes`` is more likely a mistake than a name),
    and so does anything else, for the type check to refuse."""
    if isinstance(value, (int, float, datetime.date)) and not isinstance(value, bool):
        return loc.as_written(key, value)
    return value


def _unknown(key: str, options: list[str] | tuple[str, ...], loc: _Loc) -> ConfigError:
    close = difflib.get_close_matches(key.rsplit(".", 1)[-1], options, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else f" (known: {', '.join(options)})"
    return loc.err(key, f"unknown key{hint}")


def load_config(path: str | os.PathLike[str], *, dry_run: bool = False) -> JobConfig:
    """Read and validate a job config file. ``dry_run``: for a script to read, not to submit: an
    environment variable that is not set here (``$SCRATCH`` off Alps) reads as a stand-in path
    that says so (:func:`unset_stand_in`), named in ``JobConfig.unset``, instead of an error."""
    p = Path(path)
    try:
        with open(p, "rb") as f:  # no more than the cap is read: the file may be huge, or endless (/dev/zero)
            size = os.fstat(f.fileno()).st_size
            data = f.read(MAX_CONFIG_BYTES + 1)
    except OSError as e:
        raise ConfigError(f"{path}: cannot read the config: {e.strerror}") from None
    if len(data) > MAX_CONFIG_BYTES:
        raise ConfigError(_too_big(str(path), size if size > MAX_CONFIG_BYTES else None))
    try:
        text = data.decode("utf-8")  # YAML's own encoding, whatever the locale's
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not UTF-8 text (byte {e.start}: {e.reason})") from None
    return parse_config(text, source=str(path), base_dir=p.resolve().parent, dry_run=dry_run)


def _too_big(source: str, size: int | None) -> str:
    return (f"{source}: {'more than ' + str(MAX_CONFIG_BYTES) if size is None else size} bytes: a job config may "
            f"have at most {MAX_CONFIG_BYTES} bytes (1 MiB)")


def _run_dir_problem(run_dir: Path) -> str | None:
    """Why ``run_dir`` cannot become a directory: it, or the nearest of its parents that exists, is
    something else (a regular file, a symlink to nothing...)."""
    for p in (run_dir, *run_dir.parents):
        if os.path.lexists(p):
            if os.path.isdir(p):
                return None
            what = "a regular file" if os.path.isfile(p) else "a symbolic link to nothing" if os.path.islink(p) \
                else "not a directory"
            return f"{echo(str(p))} is {what}" + ("" if p == run_dir else ", so the run directory cannot be made there")
    return None


def parse_config(text: str, source: str = "<config>", base_dir: Path | None = None, *, dry_run: bool = False) -> JobConfig:
    if len(text) > MAX_CONFIG_BYTES // 4 and len(text.encode("utf-8", "surrogatepass")) > MAX_CONFIG_BYTES:
        raise ConfigError(_too_big(source, len(text.encode("utf-8", "surrogatepass"))))
    loc = _Loc(text, source, dry_run)
    try:
        doc = yaml.load(text, Loader=_Loader)  # a SafeLoader
    except yaml.YAMLError as e:  # what the composer accepts and no safe constructor builds: !tags, unhashable keys
        raise _yaml_error(e, source, loc) from None
    if not isinstance(doc, dict):
        raise ConfigError(f"{source}: the config must be a mapping of keys (name, run_dir, slurm, entry, ...)")
    for k in doc:
        if k not in _TOP:
            raise _unknown(str(k), _TOP, loc)
    name = _text(doc.get("name"), "name", loc)
    if name is None:
        raise loc.err("name", "missing (a job name such as 'llama-8b')")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise loc.err("name", f"{echo(name)} is not a valid job name (letters, digits, _ . + -; at most 128)")
    sections: dict[str, Any] = {}
    for sec, cls in _SECTIONS.items():
        raw = doc.get(sec)
        raw = {} if raw is None else raw  # an empty section; [] or '' is a mistake
        if not isinstance(raw, dict):
            raise loc.err(sec, f"expected a mapping, got {type(raw).__name__}")
        kwargs: dict[str, Any] = {}
        for k, v in raw.items():
            key = f"{sec}.{k}"
            if k not in _TYPES[sec]:
                raise _unknown(key, list(_TYPES[sec]), loc)
            if v is None:  # an empty value takes the default, except where it would read as "no limit"
                if sec == "checkpoint" and k in NONE_REFUSED:
                    raise loc.err(key, str(option_problem(k, None)))
                continue
            if _TYPES[sec][k] == "str":
                v = _text(v, key, loc)
            elif _TYPES[sec][k] == "list[str]" and isinstance(v, list):  # entry.args: [--seed, 010] is "010"
                v = [_text(x, f"{key}[{i}]", loc) for i, x in enumerate(v)]
            kwargs[k] = _check_type(key, v, _TYPES[sec][k], loc)
        sections[sec] = cls(**kwargs)
    slurm: SlurmConfig = sections["slurm"]
    env: EnvironmentConfig = sections["environment"]
    entry: EntryConfig = sections["entry"]
    ck: CheckpointConfig = sections["checkpoint"]
    rq: RequeueConfig = sections["requeue"]

    for k in ("partition", "account", "qos", "reservation", "constraint", "mem"):
        v = getattr(slurm, k)
        if v is not None and not _SLURM_WORD.fullmatch(v):
            raise loc.err(f"slurm.{k}", f"{echo(v)} contains characters SLURM does not accept here")
    try:
        slurm.time_minutes  # noqa: B018 (validates)
    except ValueError as e:
        raise loc.err("slurm.time", str(e)) from None
    for key, (lo, hi) in RANGES.items():
        sec, k = key.split(".")
        v = getattr(sections[sec], k)
        if v is not None and not lo <= v <= hi:  # NaN compares false: refused too
            raise loc.err(key, f"{echo(v)}: must be between {_number(lo)} and {_number(hi)}")
    slurm.extra = {str(k): _extra_value(f"slurm.extra.{k}", k, v, loc) for k, v in slurm.extra.items()}
    if "gpus" in slurm.extra and slurm.gpus_per_node:
        raise loc.err("slurm.extra.gpus", "alpsck sets --gpus-per-task or --gpus-per-node itself (slurm.gpus_per_node "
                                             "is given): give the GPUs one way, not both")

    if env.view is not None and env.uenv is None:
        raise loc.err("environment.view", "a view of a uenv: give environment.uenv too")
    if env.uenv is not None and env.view is None:
        env.view = "default"  # CSCS: the default view puts the uenv's python3, CUDA and NCCL on the PATH
    for k in ("container", "uenv", "view", "venv"):
        v = getattr(env, k)
        if v is not None:
            # ~ too: the batch script quotes the path, so its shell would not expand it
            v = _expand_path(v, f"environment.{k}", loc)
            if k == "venv" and not os.path.isabs(v):  # relative paths: to where `alpsck submit` runs
                v = _utf8(os.path.join(os.getcwd(), v), "environment.venv", loc,
                          "relative to the current directory, it is a path of")
            if not re.fullmatch(r"[^\s'\"`$;&|<>\\\x00]{1,1024}", v):
                raise loc.err(f"environment.{k}", f"{echo(v)} must be a plain path or name (no spaces or shell characters)")
            # A venv that exists here must be one: the batch shell's `source` of a missing activate only
            # complains, and the job runs on without it. One that does not exist here may on the nodes.
            if k == "venv" and os.path.lexists(v) and not os.path.isfile(os.path.join(v, "bin", "activate")):
                raise loc.err("environment.venv", f"{echo(v)} is not a virtual environment (no bin/activate)")
            setattr(env, k, v)
    for i, line in enumerate(env.setup):
        if "\n" in line:
            raise loc.err("environment.setup", f"line {i + 1} contains a newline; give one list item per line")
        if "\x00" in line:  # no shell line can hold one (nor the local executor's environment)
            raise loc.err("environment.setup", f"line {i + 1} contains a NUL character")
    if env.setup:  # they run in the batch script through eval (submit.environment_lines): refused here, not there
        why = shell_problem("\n".join(env.setup))
        if why is not None:
            raise loc.err("environment.setup", f"does not parse as a block of shell lines: {why}")

    if (entry.function is None) == (entry.script is None):
        raise loc.err("entry", "give exactly one of entry.function ('module:function') or entry.script (a .py file)")
    if entry.function is not None and not _ENTRY_FN.fullmatch(entry.function):
        raise loc.err("entry.function", f"{echo(entry.function)} is not 'package.module:function'")
    workdir = Path.cwd()  # one base for every relative path in a config: where `alpsck submit` runs
    if entry.script is not None:
        sp = Path(_expand_path(entry.script, "entry.script", loc))
        if not sp.is_absolute():
            sp = Path(_utf8(str(workdir / sp), "entry.script", loc, "relative to the current directory, it is a path of"))
        if not sp.is_file():
            raise loc.err("entry.script", f"{sp} does not exist")
        entry.script = str(sp)

    # The engine's own limits (alpsck.options): the Checkpointer would refuse them only in the job, after it
    # waited in the queue.
    for option in ENGINE_OPTIONS:
        why = option_problem(option, getattr(ck, option))
        if why is not None:
            raise loc.err(f"checkpoint.{option}", why)
    try:  # the rules together (keep_last 0 keeps all: another rule would be moot), by the core's one check
        Policy(**{o: getattr(ck, o) for o in RETENTION_RULES})
    except UsageError as e:
        option = next((o for o in RETENTION_RULES if str(e).startswith(o)), "keep_last")
        raise loc.err(f"checkpoint.{option}", str(e)) from None
    why = layout_problem(ck.lustre_layout)
    if why is not None:
        raise loc.err("checkpoint.lustre_layout", why)
    if ck.every not in (None, "auto"):
        raise loc.err("checkpoint.every", f"{echo(ck.every)}: the only value is auto (or give every_steps or "
                                          "every_seconds)")
    if rq.hang_timeout not in ("fixed", "learned"):
        raise loc.err("requeue.hang_timeout", f"{echo(rq.hang_timeout)}: use fixed or learned")
    if rq.signal not in _SIGNALS:
        raise loc.err("requeue.signal", f"{echo(rq.signal)}: use one of {', '.join(_SIGNALS)}")
    if rq.signal_delay_s is None:
        rq.signal_delay_s = int(min(120, slurm.time_minutes * 30))
        if rq.signal_delay_s < 1:  # the default, not the user's value, is what does not fit
            raise loc.err("slurm.time", f"{echo(slurm.time)} leaves no time for the time-limit signal: give at least "
                                        "2 seconds (the signal comes half the limit, at most 120 s, before the end)")
    if rq.signal_delay_s < 1 or rq.signal_delay_s >= slurm.time_minutes * 60:
        raise loc.err("requeue.signal_delay_s", f"must be between 1 and the time limit ({slurm.time_minutes * 60:.0f} s)")

    raw_run_dir = _text(doc.get("run_dir", f"runs/{name}"), "run_dir", loc)
    if not isinstance(raw_run_dir, str):
        raise loc.err("run_dir", f"expected a path, got {echo(raw_run_dir)}")
    if not raw_run_dir:
        raise loc.err("run_dir", "empty: leave it out for runs/<name>, or write . for the directory you submit from")
    run_dir = Path(_expand_path(raw_run_dir, "run_dir", loc))
    if not run_dir.is_absolute():  # relative to where `alpsck submit` runs, like sbatch's own paths
        run_dir = Path(_utf8(str(workdir / run_dir), "run_dir", loc, "relative to the current directory, it is a path of"))
    if any(c in str(run_dir) for c in "\n\r"):
        raise loc.err("run_dir", "contains a newline")
    # The job's log paths (--output) hold the run dir: SLURM reads % there as a pattern (%j, %x...)
    # and sbatch drops a backslash from an #SBATCH line, even quoted; submitit turns %j in it
    # into the job id too. The logs and submitit's files would land in another directory.
    rewritten = "which SLURM and submitit would rewrite in the job's log and submitit paths"
    for c, what in (("%", f"a percent sign, {rewritten}"), ("\\", f"a backslash, {rewritten}"),
                    ("\x00", "a NUL character, which no path can hold")):
        if c in str(run_dir):
            raise loc.err("run_dir", f"{echo(str(run_dir))} contains {what}")
    why = _run_dir_problem(run_dir)
    if why is not None:
        raise loc.err("run_dir", f"{why}: give a directory, or a path where one can be made")
    return JobConfig(name=name, run_dir=str(run_dir), slurm=slurm, environment=env, entry=entry, checkpoint=ck,
                     requeue=rq, source=source, workdir=str(workdir),
                     config_dir=None if base_dir is None else str(base_dir), unset=tuple(loc.unset))
