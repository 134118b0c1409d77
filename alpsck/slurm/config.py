"""The job config (YAML), validated before anything is submitted.

Every error names the key and, where known, the file and line (``config.yaml:12: slurm.tme:
unknown key (did you mean 'time'?)``). The YAML is read with ``yaml.safe_load`` semantics (the
safe composer; no tags are constructed). ``$VAR``, ``${VAR}`` and a leading ``~`` in ``run_dir``,
``entry.script`` and the ``environment`` paths expand where the config is loaded; an unset
variable is an error naming it. Where a value is text (text keys, ``slurm.extra`` values,
``entry.args``), a number or boolean is taken as written: ``010`` stays ``010``, not 8. Values
that reach sbatch are checked against strict patterns, so no config value can inject a line or a
shell word; ``environment.setup`` lines are the one place where you write shell yourself (they
run verbatim in the batch script; under the local executor, bash runs them before the job).
"""

from __future__ import annotations

import difflib
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from ..errors import ConfigError
from ..options import DEFAULTS
from ..options import problem as option_problem
from ..store.filesystem import layout_problem

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
# sbatch options alpsck (or submitit for it) writes itself, and what sets them instead. An extra
# option would replace ours silently: ``signal`` breaks the time-limit stop, ``requeue`` the requeue.
_CONTROLLED = {
    "signal": "use requeue.signal and requeue.signal_delay_s", "requeue": "it always requeues",
    "no-requeue": "it always requeues", "time": "use slurm.time", "job-name": "use name",
    "output": "logs go to RUN_DIR/submitit/", "error": "logs go to RUN_DIR/submitit/",
    "open-mode": "a requeued job appends to its log", "nodes": "use slurm.nodes",
    "ntasks-per-node": "use slurm.tasks_per_node", "ntasks": "use slurm.nodes and slurm.tasks_per_node",
    "cpus-per-task": "use slurm.cpus_per_task", "partition": "use slurm.partition",
    "gpus-per-node": "use slurm.gpus_per_node", "mem": "use slurm.mem", "constraint": "use slurm.constraint",
    "account": "use slurm.account", "qos": "use slurm.qos", "reservation": "use slurm.reservation",
    "environment": "use environment.container", "uenv": "use environment.uenv", "view": "use environment.view",
    "wrap": "the entry runs through submitit", "array": "one job per config",
}
# sbatch takes any unambiguous abbreviation of a long option (--sig is --signal); these options
# of its own start like one of ours and are not abbreviations of it.
_SBATCH_OPTIONS_LIKE_OURS = ("gpus",)


def parse_time_minutes(text: str) -> float:
    """Minutes of a SLURM time string: M, M:S, H:M:S, D-H, D-H:M, D-H:M:S."""
    m = _TIME.fullmatch(text.strip())
    if not m:
        raise ValueError(f"bad time {text!r}: use M, M:S, H:M:S, D-H, D-H:M or D-H:M:S")
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
        raise ValueError(f"bad time {text!r}: a field is out of range")
    total = d * 1440 + h * 60 + mi + s / 60
    if total <= 0:
        raise ValueError(f"bad time {text!r}: must be positive")
    if total > _MAX_TIME_MINUTES:
        raise ValueError(f"bad time {text!r}: more than 365 days")
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
    max_in_flight: int = DEFAULTS["max_in_flight"]  # the engine's options: defaults from alpsck.options
    threads: int = DEFAULTS["threads"]
    keep_last: int = DEFAULTS["keep_last"]
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
    return ConfigError(f"{where}: {f'{key}: ' if key else ''}not valid YAML: {getattr(e, 'problem', None) or e}")


class _Loader(yaml.SafeLoader):
    """``yaml.SafeLoader``, where a value its constructors refuse (a date that does not exist,
    ``!!int abc``) is an error at the value's line, as the YAML errors are, not a ValueError."""

    def construct_object(self, node: yaml.Node, deep: bool = False) -> Any:
        try:
            return super().construct_object(node, deep=deep)
        except (ValueError, TypeError, OverflowError) as e:
            raise yaml.constructor.ConstructorError(None, None, f"{node.value!r}: {e}", node.start_mark) from None


class _Loc:
    """Line numbers of keys in the YAML document (from the composed node tree)."""

    def __init__(self, text: str, source: str) -> None:
        self.source = source
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
                if k.value in first:  # YAML would keep the last one and drop the other silently
                    raise ConfigError(f"{self.source}:{line}: {key}: given twice (also on line {first[k.value]})")
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
        """A number or boolean as the config wrote it, where the text is meant (YAML reads
        1:30:00 as 5400, 0042 as 34, 010 as 8 and 1.10 as 1.1; SLURM and a script's argv get the
        text); other values unchanged."""
        if isinstance(value, (int, float, bool)):
            return self.raw.get(key, str(value))
        return value

    def key_at(self, line: int) -> str | None:
        """The innermost key written on ``line``, if any."""
        return next((k for k, n in reversed(self.lines.items()) if n == line), None)

    def err(self, key: str, msg: str) -> ConfigError:
        line = self.lines.get(key)
        where = f"{self.source}:{line}" if line else self.source
        return ConfigError(f"{where}: {key}: {msg}")


def _expand(value: str, key: str, loc: _Loc) -> str:
    def sub(m: re.Match[str]) -> str:
        name = m.group(1) or m.group(2)
        if name not in os.environ:
            raise loc.err(key, f"environment variable ${name} is not set")
        return os.environ[name]

    return re.sub(r"\$(?:\{([A-Za-z_]\w*)\}|([A-Za-z_]\w*))", sub, value)


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
        raise loc.err(key, f"expected {want}, got {type(value).__name__} {value!r}")
    if want == "list[str]":
        return [str(x) for x in value]
    return value


_TYPES: dict[str, dict[str, str]] = {
    "slurm": {"partition": "str", "account": "str", "qos": "str", "reservation": "str", "nodes": "int",
              "tasks_per_node": "int", "gpus_per_node": "int", "cpus_per_task": "int", "time": "str",
              "constraint": "str", "mem": "str", "extra": "dict"},
    "environment": {"container": "str", "uenv": "str", "view": "str", "venv": "str", "setup": "list[str]"},
    "entry": {"function": "str", "script": "str", "args": "list[str]"},
    "checkpoint": {"every_steps": "int", "every_seconds": "float", "max_in_flight": "int", "threads": "int",
                   "keep_last": "int", "lustre_layout": "str", "preflight": "bool"},
    "requeue": {"max_restarts": "int", "signal": "str", "signal_delay_s": "int", "on_maintenance": "bool",
                "maintenance_margin_s": "int", "maintenance_poll_s": "int", "on_failure": "bool",
                "same_error_retries": "int", "give_up_after_no_progress": "int"},
}
_TOP = ("name", "run_dir", *_SECTIONS)


def _extra_value(key: str, option: Any, value: Any, loc: _Loc) -> str:
    """One ``slurm.extra`` option's value as sbatch gets it: the text as written, "" for a flag."""
    if not isinstance(option, str) or not re.fullmatch(r"[a-z][a-z0-9-]*", option):
        raise loc.err(key, "sbatch option names are lower-case words with dashes (e.g. 'exclusive')")
    if option in _CONTROLLED:
        raise loc.err(key, f"alpsck sets --{option} itself ({_CONTROLLED[option]})")
    ours = [] if option in _SBATCH_OPTIONS_LIKE_OURS else [o for o in _CONTROLLED if o.startswith(option)]
    if ours:
        hint = f" ({_CONTROLLED[ours[0]]})" if len(ours) == 1 else ""
        raise loc.err(key, f"sbatch takes --{option} as an abbreviation of --{' or --'.join(ours)}, which alpsck "
                           f"sets itself{hint}; write the full name of an option alpsck does not set")
    text = loc.as_written(key, value)
    if isinstance(value, bool):  # YAML 1.1 booleans: true is a flag, yes/no/on/off stay text (--kill-on-invalid-dep=no)
        if text.lower() == "true":
            return ""
        if text.lower() == "false":
            raise loc.err(key, "false is not an sbatch value; leave the option out to not set it")
    if not isinstance(text, str) or not _SLURM_WORD.fullmatch(text):
        raise loc.err(key, f"{value!r} is not a plain sbatch option value")
    return text


def _unknown(key: str, options: list[str] | tuple[str, ...], loc: _Loc) -> ConfigError:
    close = difflib.get_close_matches(key.rsplit(".", 1)[-1], options, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else f" (known: {', '.join(options)})"
    return loc.err(key, f"unknown key{hint}")


def load_config(path: str | os.PathLike[str]) -> JobConfig:
    """Read and validate a job config file."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")  # YAML's own encoding, whatever the locale's
    except OSError as e:
        raise ConfigError(f"{path}: cannot read the config: {e.strerror}") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not UTF-8 text (byte {e.start}: {e.reason})") from None
    return parse_config(text, source=str(path), base_dir=p.resolve().parent)


def parse_config(text: str, source: str = "<config>", base_dir: Path | None = None) -> JobConfig:
    loc = _Loc(text, source)
    try:
        doc = yaml.load(text, Loader=_Loader)  # a SafeLoader
    except yaml.YAMLError as e:  # what the composer accepts and no safe constructor builds: !tags, unhashable keys
        raise _yaml_error(e, source, loc) from None
    if not isinstance(doc, dict):
        raise ConfigError(f"{source}: the config must be a mapping of keys (name, run_dir, slurm, entry, ...)")
    for k in doc:
        if k not in _TOP:
            raise _unknown(str(k), _TOP, loc)
    name = doc.get("name")
    if name is None:
        raise loc.err("name", "missing (a job name such as 'llama-8b')")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise loc.err("name", f"{name!r} is not a valid job name (letters, digits, _ . + -; at most 128)")
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
            if v is None:
                continue
            if _TYPES[sec][k] == "str" and isinstance(v, (int, float)) and not isinstance(v, bool):
                # A text key written as a number means the text as written: unquoted, YAML reads
                # slurm.time 1:30:00 as 5400 (base 60) and an account 0042 as 34 (octal), while SLURM reads
                # 1 h 30 min and the account "0042".
                v = loc.as_written(key, v)
            elif _TYPES[sec][k] == "list[str]" and isinstance(v, list):  # entry.args: [--seed, 010] is "010"
                v = [x if isinstance(x, bool) else loc.as_written(f"{key}[{i}]", x) for i, x in enumerate(v)]
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
            raise loc.err(f"slurm.{k}", f"{v!r} contains characters SLURM does not accept here")
    try:
        slurm.time_minutes  # noqa: B018 (validates)
    except ValueError as e:
        raise loc.err("slurm.time", str(e)) from None
    for k in ("nodes", "tasks_per_node", "cpus_per_task"):
        if getattr(slurm, k) < 1:
            raise loc.err(f"slurm.{k}", "must be at least 1")
    if slurm.gpus_per_node < 0:
        raise loc.err("slurm.gpus_per_node", "must be 0 or more")
    for k in ("nodes", "tasks_per_node", "cpus_per_task", "gpus_per_node"):
        if getattr(slurm, k) > _MAX_SLURM_COUNT:
            raise loc.err(f"slurm.{k}", f"{getattr(slurm, k)}: more than SLURM can count ({_MAX_SLURM_COUNT})")
    slurm.extra = {str(k): _extra_value(f"slurm.extra.{k}", k, v, loc) for k, v in slurm.extra.items()}

    if env.view is not None and env.uenv is None:
        raise loc.err("environment.view", "a view of a uenv: give environment.uenv too")
    if env.uenv is not None and env.view is None:
        env.view = "default"  # CSCS: the default view puts the uenv's python3, CUDA and NCCL on the PATH
    for k in ("container", "uenv", "view", "venv"):
        v = getattr(env, k)
        if v is not None:
            # ~ too: the batch script quotes the path, so its shell would not expand it
            v = os.path.expanduser(_expand(v, f"environment.{k}", loc))
            if k == "venv" and not os.path.isabs(v):  # relative paths: to where `alpsck submit` runs
                v = os.path.join(os.getcwd(), v)
            if not re.fullmatch(r"[^\s'\"`$;&|<>\\\x00]{1,1024}", v):
                raise loc.err(f"environment.{k}", f"{v!r} must be a plain path or name (no spaces or shell characters)")
            setattr(env, k, v)
    for i, line in enumerate(env.setup):
        if "\n" in line:
            raise loc.err("environment.setup", f"line {i + 1} contains a newline; give one list item per line")
        if "\x00" in line:  # no shell line can hold one (nor the local executor's environment)
            raise loc.err("environment.setup", f"line {i + 1} contains a NUL character")

    if (entry.function is None) == (entry.script is None):
        raise loc.err("entry", "give exactly one of entry.function ('module:function') or entry.script (a .py file)")
    if entry.function is not None and not _ENTRY_FN.fullmatch(entry.function):
        raise loc.err("entry.function", f"{entry.function!r} is not 'package.module:function'")
    workdir = Path.cwd()  # one base for every relative path in a config: where `alpsck submit` runs
    if entry.script is not None:
        sp = Path(_expand(entry.script, "entry.script", loc)).expanduser()
        if not sp.is_absolute():
            sp = workdir / sp
        if not sp.is_file():
            raise loc.err("entry.script", f"{sp} does not exist")
        entry.script = str(sp)

    if ck.every_steps is not None and ck.every_steps < 1:
        raise loc.err("checkpoint.every_steps", "must be at least 1 (or omit it)")
    if ck.every_seconds is not None and not (0 < ck.every_seconds < math.inf):  # .nan compared false: never due
        raise loc.err("checkpoint.every_seconds", f"{ck.every_seconds!r}: must be a positive number (or omit it)")
    # The engine's own limits (alpsck.options): the Checkpointer would refuse them only in the job, after it
    # waited in the queue.
    for option in ("max_in_flight", "threads", "keep_last"):
        why = option_problem(option, getattr(ck, option))
        if why is not None:
            raise loc.err(f"checkpoint.{option}", why)
    why = layout_problem(ck.lustre_layout)
    if why is not None:
        raise loc.err("checkpoint.lustre_layout", why)
    if rq.signal not in _SIGNALS:
        raise loc.err("requeue.signal", f"{rq.signal!r}: use one of {', '.join(_SIGNALS)}")
    if rq.signal_delay_s is None:
        rq.signal_delay_s = int(min(120, slurm.time_minutes * 30))
        if rq.signal_delay_s < 1:  # the default, not the user's value, is what does not fit
            raise loc.err("slurm.time", f"{slurm.time!r} leaves no time for the time-limit signal: give at least "
                                        "2 seconds (the signal comes half the limit, at most 120 s, before the end)")
    if rq.signal_delay_s < 1 or rq.signal_delay_s >= slurm.time_minutes * 60:
        raise loc.err("requeue.signal_delay_s", f"must be between 1 and the time limit ({slurm.time_minutes * 60:.0f} s)")
    if rq.max_restarts < 0:
        raise loc.err("requeue.max_restarts", "must be 0 or more")
    if rq.same_error_retries < 0:
        raise loc.err("requeue.same_error_retries", "must be 0 or more")
    if rq.give_up_after_no_progress < 1:
        raise loc.err("requeue.give_up_after_no_progress", "must be at least 1")
    if rq.maintenance_margin_s < 0:
        raise loc.err("requeue.maintenance_margin_s", "must be 0 or more")
    if rq.maintenance_poll_s < 1:  # the watcher runs scontrol show reservation once per poll
        raise loc.err("requeue.maintenance_poll_s", "must be at least 1")

    raw_run_dir = doc.get("run_dir", f"runs/{name}")
    if not isinstance(raw_run_dir, str):
        raise loc.err("run_dir", f"expected a path, got {raw_run_dir!r}")
    if not raw_run_dir:
        raise loc.err("run_dir", "empty: leave it out for runs/<name>, or write . for the directory you submit from")
    run_dir = Path(_expand(raw_run_dir, "run_dir", loc)).expanduser()
    if not run_dir.is_absolute():  # relative to where `alpsck submit` runs, like sbatch's own paths
        run_dir = workdir / run_dir
    if any(c in str(run_dir) for c in "\n\r"):
        raise loc.err("run_dir", "contains a newline")
    # The job's log paths (--output) hold the run dir: SLURM reads % there as a pattern (%j, %x...)
    # and sbatch drops a backslash from an #SBATCH line, even quoted; submitit turns %j in it
    # into the job id too. The logs and submitit's files would land in another directory.
    rewritten = "which SLURM and submitit would rewrite in the job's log and submitit paths"
    for c, what in (("%", f"a percent sign, {rewritten}"), ("\\", f"a backslash, {rewritten}"),
                    ("\x00", "a NUL character, which no path can hold")):
        if c in str(run_dir):
            raise loc.err("run_dir", f"{str(run_dir)!r} contains {what}")
    return JobConfig(name=name, run_dir=str(run_dir), slurm=slurm, environment=env, entry=entry, checkpoint=ck,
                     requeue=rq, source=source, workdir=str(workdir),
                     config_dir=None if base_dir is None else str(base_dir))
