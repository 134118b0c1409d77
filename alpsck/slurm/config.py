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

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from ..errors import ConfigError, UsageError, echo
from ..node_health import vetnode
from ..node_health.checks import Limits
from ..options import DEFAULTS, MAX_STEP, NONE_REFUSED, SPECS
from ..options import problem as option_problem
from ..store.lustre import layout_problem
from ..store.retention import RULES as RETENTION_RULES
from ..store.retention import Policy
from .batch_rules import SLURM_WORD, extra_value, parse_time_minutes, shell_problem
from .config_source import Loader, Loc, as_text, check_type, expand_path, unknown_key, utf8, yaml_error

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.+-]{0,127}")
_ENTRY_FN = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*")
_SIGNALS = ("USR1", "USR2")
# SLURM keeps node, task and CPU counts as uint32 with 0xfffffffe/0xffffffff as "unset"/"infinite":
# anything from there up is refused by sbatch, and far less already by any real cluster.
_MAX_SLURM_COUNT = 2**32 - 3
MAX_CONFIG_BYTES = 1 << 20  # a job config needs a few hundred bytes; a bigger file is a mistake (or an attack)
_DAY_S = 86_400
_MAX_S = 365 * _DAY_S  # the longest time limit: a longer wait or interval never comes in a job
# Every number a config holds, "section.key" -> (lowest, highest), checked when it loads (NaN and inf
# are refused too): a value past these crashed the job's threads (a poll of 1e10 s overflows a wait) or
# meant nothing. The engine's options (checkpoint.max_in_flight, threads, keep_*) take theirs from
# alpsck.options. docs/config.md lists the same (tests/unit/test_config_hostile.py compares).
RANGES: dict[str, tuple[int | float, int | float]] = {
    "slurm.nodes": (1, _MAX_SLURM_COUNT), "slurm.spare_nodes": (0, 100_000),
    "slurm.tasks_per_node": (1, _MAX_SLURM_COUNT),
    "slurm.gpus_per_node": (0, _MAX_SLURM_COUNT), "slurm.cpus_per_task": (1, _MAX_SLURM_COUNT),
    "checkpoint.every_steps": (1, MAX_STEP),  # steps are int64
    "checkpoint.every_seconds": (0.001, _MAX_S),
    "checkpoint.mtbf_s": (1, _MAX_S),
    "checkpoint.memory_every": (0, MAX_STEP),
    "requeue.max_restarts": (0, 100_000),
    "requeue.signal_delay_s": (1, _MAX_S),  # and less than the time limit
    "requeue.maintenance_margin_s": (0, 7 * _DAY_S),
    "requeue.maintenance_poll_s": (1, _DAY_S),  # the watcher runs scontrol show reservation once per poll
    "requeue.same_error_retries": (0, 100_000),
    "requeue.give_up_after_no_progress": (1, 100_000),
    "requeue.in_job_restarts": (0, 1_000),
    "requeue.hang_timeout_s": (0, _MAX_S),
    "requeue.hang_timeout_min_s": (1, _MAX_S),
    "health.timeout_s": (1, 3600), "health.max_fsync_s": (0.001, 3600),
    "health.min_free_memory_gib": (0, 1 << 20), "health.min_free_shm_gib": (0, 1 << 20),
    "health.max_gpu_temperature_c": (0, 200), "health.max_gpu_memory_used": (0, 1),
    "health.cordon_after_failures": (0, 1000), "health.min_link_gbps": (0, 100_000),
    "health.link_probe_mib": (1, 4096), "health.straggler_factor": (0, 1000), "health.straggler_saves": (2, 1000),
}
# The engine's options a job config may set (checkpoint.<option>): their type, default, limits and meaning come
# from alpsck.options' table (and the option table of docs/config.md), their values go to the Checkpointer as given.
ENGINE_OPTIONS = ("max_in_flight", "threads", *RETENTION_RULES, "spike_factor")
_OPTION_TYPES = {"int": "int", "float": "float", "text": "str", "bool": "bool"}  # the table's types, as the schema's


def _number(x: int | float) -> str:
    return f"{x:g}" if isinstance(x, float) else str(x)


def range_text(key: str) -> str:
    """The allowed values of a RANGES key as docs/config.md writes them: ``1 .. 86400``."""
    lo, hi = RANGES[key]
    return " .. ".join("2^32-3" if x == _MAX_SLURM_COUNT else "2^63-1" if x == MAX_STEP else _number(x) for x in (lo, hi))


@dataclass
class SlurmConfig:
    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    reservation: str | None = None
    nodes: int = 1
    spare_nodes: int = 0  # more nodes allocated, --no-kill: an in-job restart after a node's loss takes one (spare_nodes.py)
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
    lustre_layout: str = "auto"  # on Lustre: "auto", "none" or lfs setstripe options (alpsck.store.filesystem)
    preflight: bool = True  # check space, inodes and quota before the first save (Checkpointer's preflight)
    memory_every: int = 0  # also a checkpoint to the memory tier every N steps (alpsck.store.memory_tier; 0: off)
    # The engine's options the config gives (checkpoint.<option> of ENGINE_OPTIONS): typed, defaulted and checked
    # by alpsck.options' table, forwarded to the Checkpointer as they are (engine_options).
    engine: dict[str, Any] = field(default_factory=dict)

    def engine_options(self) -> dict[str, Any]:
        """Every engine option a job config may set: the value given, else the table's default."""
        return {name: self.engine.get(name, DEFAULTS[name]) for name in ENGINE_OPTIONS}

    def __getattr__(self, name: str) -> Any:  # ck.threads, ck.keep_last: an engine option by its name
        if name in ENGINE_OPTIONS:
            return self.__dict__.get("engine", {}).get(name, DEFAULTS[name])
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")


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
class HealthConfig(Limits):
    """The health gate before every start's job step (:mod:`alpsck.slurm.health_gate`): whether it runs, how long
    a node's probe may take, and the thresholds of the checks (:class:`alpsck.node_health.checks.Limits`)."""

    gate: bool = False
    timeout_s: float = 60.0  # a node whose probe has not answered by then fails the gate
    cordon_after_failures: int = 2  # a node the run's job steps failed on first this many times is cordoned (0: never)
    min_link_gbps: float = 0.0  # the links between the nodes timed (alpsck.node_health.links); 0: not probed
    link_probe_mib: int = 64
    straggler_factor: float = 2.0  # a rank whose part of its saves takes this many times its peers' is named (0: off)
    straggler_saves: int = 5  # ... as the median over its last this many saves
    cordon_stragglers: bool = False  # the gate cordons a node named as a straggler before the next start
    vetnode: str = ""  # a vetnode config whose GPU and CUDA evals set the thresholds not given here (node_health.vetnode)
    vetnode_skipped: list[str] = field(default_factory=list)  # not a key: the vetnode config's evals alpsck does not run

    def limits(self) -> dict[str, Any]:
        """The thresholds, as :meth:`alpsck.node_health.checks.Limits.from_dict` takes them."""
        return {k: getattr(self, k) for k in Limits.__dataclass_fields__}


@dataclass
class JobConfig:
    name: str
    run_dir: str
    slurm: SlurmConfig
    environment: EnvironmentConfig
    entry: EntryConfig
    checkpoint: CheckpointConfig
    requeue: RequeueConfig
    health: HealthConfig = field(default_factory=HealthConfig)
    source: str = "<config>"
    workdir: str = ""               # where `alpsck submit` ran: the base of relative paths, and the job's cwd
    config_dir: str | None = None   # the config file's directory (the job imports entry modules from it too)
    unset: tuple[str, ...] = ()     # a dry run's $VARs that were not set here (each read as unset_stand_in)


# key -> (type, validator or None); nested sections handled below
_SECTIONS: dict[str, type] = {"slurm": SlurmConfig, "environment": EnvironmentConfig, "entry": EntryConfig,
                              "checkpoint": CheckpointConfig, "requeue": RequeueConfig, "health": HealthConfig}


_TYPES: dict[str, dict[str, str]] = {
    "slurm": {"partition": "str", "account": "str", "qos": "str", "reservation": "str", "nodes": "int",
              "spare_nodes": "int", "tasks_per_node": "int", "gpus_per_node": "int", "cpus_per_task": "int", "time": "str",
              "constraint": "str", "mem": "str", "extra": "dict"},
    "environment": {"container": "str", "uenv": "str", "view": "str", "venv": "str", "setup": "list[str]"},
    "entry": {"function": "str", "script": "str", "args": "list[str]"},
    "checkpoint": {"every_steps": "int", "every_seconds": "float", "every": "str", "mtbf_s": "float",
                   **{o: _OPTION_TYPES[SPECS[o]["type"]] for o in ENGINE_OPTIONS},  # the engine's table says
                   "lustre_layout": "str", "preflight": "bool", "memory_every": "int"},
    "requeue": {"max_restarts": "int", "signal": "str", "signal_delay_s": "int", "on_maintenance": "bool",
                "maintenance_margin_s": "int", "maintenance_poll_s": "int", "on_failure": "bool",
                "same_error_retries": "int", "give_up_after_no_progress": "int", "in_job_restarts": "int",
                "hang_timeout_s": "float", "hang_timeout": "str", "hang_timeout_min_s": "float"},
    "health": {"gate": "bool", "timeout_s": "float", "max_fsync_s": "float", "min_free_memory_gib": "float",
               "min_free_shm_gib": "float", "max_gpu_temperature_c": "float", "max_gpu_memory_used": "float",
               "gpu_kernel": "bool", "cordon_after_failures": "int", "min_link_gbps": "float",
               "link_probe_mib": "int", "straggler_factor": "float", "straggler_saves": "int",
               "cordon_stragglers": "bool", "vetnode": "str"},
}
_TOP = ("name", "run_dir", *_SECTIONS)


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
    """Validate a job config's text (see the module docstring); ConfigError naming the key and its line."""
    if len(text) > MAX_CONFIG_BYTES // 4 and len(text.encode("utf-8", "surrogatepass")) > MAX_CONFIG_BYTES:
        raise ConfigError(_too_big(source, len(text.encode("utf-8", "surrogatepass"))))
    loc = Loc(text, source, dry_run)
    try:
        doc = yaml.load(text, Loader=Loader)  # a SafeLoader
    except yaml.YAMLError as e:  # what the composer accepts and no safe constructor builds: !tags, unhashable keys
        raise yaml_error(e, source, loc) from None
    if not isinstance(doc, dict):
        raise ConfigError(f"{source}: the config must be a mapping of keys (name, run_dir, slurm, entry, ...)")
    for k in doc:
        if k not in _TOP:
            raise unknown_key(str(k), _TOP, loc)
    name = as_text(doc.get("name"), "name", loc)
    if name is None:
        raise loc.err("name", "missing (a job name such as 'llama-8b')")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise loc.err("name", f"{echo(name)} is not a valid job name (letters, digits, _ . + -; at most 128)")
    sections = {sec: _section(doc, sec, loc) for sec in _SECTIONS}
    workdir = Path.cwd()  # one base for every relative path in a config: where `alpsck submit` runs
    _apply_vetnode(sections["health"], doc.get("health") or {}, workdir, loc)
    slurm: SlurmConfig = sections["slurm"]
    _check_slurm(slurm, loc)
    for key, (lo, hi) in RANGES.items():
        sec, k = key.split(".")
        v = getattr(sections[sec], k)
        if v is not None and not lo <= v <= hi:  # NaN compares false: refused too
            raise loc.err(key, f"{echo(v)}: must be between {_number(lo)} and {_number(hi)}")
    if slurm.spare_nodes and slurm.nodes + slurm.spare_nodes > _MAX_SLURM_COUNT:
        raise loc.err("slurm.spare_nodes", f"nodes + spare_nodes is {slurm.nodes + slurm.spare_nodes}: SLURM counts "
                                           f"nodes up to {_MAX_SLURM_COUNT}")
    slurm.extra = {str(k): extra_value(f"slurm.extra.{k}", k, v, loc) for k, v in slurm.extra.items()}
    if "gpus" in slurm.extra and slurm.gpus_per_node:
        raise loc.err("slurm.extra.gpus", "alpsck sets --gpus-per-task or --gpus-per-node itself (slurm.gpus_per_node "
                                             "is given): give the GPUs one way, not both")
    _check_environment(sections["environment"], loc)
    _check_entry(sections["entry"], workdir, loc)
    _check_checkpoint(sections["checkpoint"], loc)
    _check_requeue(sections["requeue"], slurm, loc)
    h = sections["health"]
    if 0 < h.straggler_factor < 1.1:
        raise loc.err("health.straggler_factor", f"{h.straggler_factor:g} would name ranks no slower than their peers: "
                                                 "give 1.1 or more, or 0 to name none")
    if h.cordon_stragglers and not (h.gate and h.straggler_factor > 0):
        raise loc.err("health.cordon_stragglers", "the health gate cordons them before the next start: needs "
                                                  "health.gate: true and a straggler_factor above 0")
    if sections["health"].gate and sections["environment"].container:
        raise loc.err("health.gate", "the gate runs its decision on the batch script's host, which has no alpsck "
                                     "when the job runs in a container (environment.container): leave it out there")
    return JobConfig(name=name, run_dir=str(_run_dir(doc, name, workdir, loc)), slurm=slurm,
                     environment=sections["environment"], entry=sections["entry"], checkpoint=sections["checkpoint"],
                     requeue=sections["requeue"], health=sections["health"], source=source, workdir=str(workdir),
                     config_dir=None if base_dir is None else str(base_dir), unset=tuple(loc.unset))


def _apply_vetnode(health: HealthConfig, given: dict[Any, Any], workdir: Path, loc: Loc) -> None:
    """``health.vetnode``: the vetnode config's thresholds for the keys the section does not give itself."""
    if not health.vetnode:
        return
    path = Path(expand_path(health.vetnode, "health.vetnode", loc))
    path = path if path.is_absolute() else workdir / path
    try:
        with open(path, "rb") as f:
            text = f.read(vetnode.MAX_BYTES + 1).decode("utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise loc.err("health.vetnode", f"{echo(health.vetnode)}: cannot read it: {getattr(e, 'strerror', None) or e}") from None
    if len(text) > vetnode.MAX_BYTES:
        raise loc.err("health.vetnode", f"{echo(health.vetnode)}: more than {vetnode.MAX_BYTES} bytes: not a vetnode config")
    try:
        keys, health.vetnode_skipped = vetnode.thresholds(text)
    except vetnode.VetnodeError as e:
        raise loc.err("health.vetnode", f"{echo(health.vetnode)}: {e}") from None
    for k, v in keys.items():
        if k not in given:
            setattr(health, k, v)


def _section(doc: dict[Any, Any], sec: str, loc: Loc) -> Any:
    """One section of the config as its dataclass: each key known and of its type (a text key as written)."""
    raw = doc.get(sec)
    raw = {} if raw is None else raw  # an empty section; [] or '' is a mistake
    if not isinstance(raw, dict):
        raise loc.err(sec, f"expected a mapping, got {type(raw).__name__}")
    kwargs: dict[str, Any] = {}
    for k, v in raw.items():
        key = f"{sec}.{k}"
        if k not in _TYPES[sec]:
            raise unknown_key(key, list(_TYPES[sec]), loc)
        if v is None:  # an empty value takes the default, except where it would read as "no limit"
            if sec == "checkpoint" and k in NONE_REFUSED:
                raise loc.err(key, str(option_problem(k, None)))
            continue
        if _TYPES[sec][k] == "str":
            v = as_text(v, key, loc)
        elif _TYPES[sec][k] == "list[str]" and isinstance(v, list):  # entry.args: [--seed, 010] is "010"
            v = [as_text(x, f"{key}[{i}]", loc) for i, x in enumerate(v)]
        kwargs[k] = check_type(key, v, _TYPES[sec][k], loc)
    if sec == "checkpoint":  # the engine's options: one mapping, forwarded as it is (alpsck.options' table)
        kwargs["engine"] = {k: kwargs.pop(k) for k in list(kwargs) if k in ENGINE_OPTIONS}
    return _SECTIONS[sec](**kwargs)


def _check_slurm(slurm: SlurmConfig, loc: Loc) -> None:
    for k in ("partition", "account", "qos", "reservation", "constraint", "mem"):
        v = getattr(slurm, k)
        if v is not None and not SLURM_WORD.fullmatch(v):
            raise loc.err(f"slurm.{k}", f"{echo(v)} contains characters SLURM does not accept here")
    try:
        slurm.time_minutes  # noqa: B018 (validates)
    except ValueError as e:
        raise loc.err("slurm.time", str(e)) from None


def _check_environment(env: EnvironmentConfig, loc: Loc) -> None:
    if env.view is not None and env.uenv is None:
        raise loc.err("environment.view", "a view of a uenv: give environment.uenv too")
    if env.uenv is not None and env.view is None:
        env.view = "default"  # CSCS: the default view puts the uenv's python3, CUDA and NCCL on the PATH
    for k in ("container", "uenv", "view", "venv"):
        v = getattr(env, k)
        if v is not None:
            # ~ too: the batch script quotes the path, so its shell would not expand it
            v = expand_path(v, f"environment.{k}", loc)
            if k == "venv" and not os.path.isabs(v):  # relative paths: to where `alpsck submit` runs
                v = utf8(os.path.join(os.getcwd(), v), "environment.venv", loc,
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


def _check_entry(entry: EntryConfig, workdir: Path, loc: Loc) -> None:
    if (entry.function is None) == (entry.script is None):
        raise loc.err("entry", "give exactly one of entry.function ('module:function') or entry.script (a .py file)")
    if entry.function is not None and not _ENTRY_FN.fullmatch(entry.function):
        raise loc.err("entry.function", f"{echo(entry.function)} is not 'package.module:function'")
    if entry.script is not None:
        sp = Path(expand_path(entry.script, "entry.script", loc))
        if not sp.is_absolute():
            sp = Path(utf8(str(workdir / sp), "entry.script", loc, "relative to the current directory, it is a path of"))
        if not sp.is_file():
            raise loc.err("entry.script", f"{sp} does not exist")
        entry.script = str(sp)


def _check_checkpoint(ck: CheckpointConfig, loc: Loc) -> None:
    # The engine's own limits (alpsck.options): the Checkpointer would refuse them only in the job, after it
    # waited in the queue.
    options = ck.engine_options()
    for option, value in options.items():
        why = option_problem(option, value)
        if why is not None:
            raise loc.err(f"checkpoint.{option}", why)
    try:  # the rules together (keep_last 0 keeps all: another rule would be moot), by the core's one check
        Policy(**{o: options[o] for o in RETENTION_RULES})
    except UsageError as e:
        option = next((o for o in RETENTION_RULES if str(e).startswith(o)), "keep_last")
        raise loc.err(f"checkpoint.{option}", str(e)) from None
    why = layout_problem(ck.lustre_layout)
    if why is not None:
        raise loc.err("checkpoint.lustre_layout", why)
    if ck.every not in (None, "auto"):
        raise loc.err("checkpoint.every", f"{echo(ck.every)}: the only value is auto (or give every_steps or "
                                          "every_seconds)")


def _check_requeue(rq: RequeueConfig, slurm: SlurmConfig, loc: Loc) -> None:
    if rq.hang_timeout not in ("fixed", "learned"):
        raise loc.err("requeue.hang_timeout", f"{echo(rq.hang_timeout)}: use fixed or learned")
    if rq.signal not in _SIGNALS:
        raise loc.err("requeue.signal", f"{echo(rq.signal)}: use one of {', '.join(_SIGNALS)}")
    if rq.signal_delay_s is None:
        rq.signal_delay_s = int(min(120, slurm.time_minutes * 30))
        if rq.signal_delay_s < 1:  # the default, not the user's value, is what does not fit
            raise loc.err("slurm.time", f"{echo(slurm.time)} leaves no time for the time-limit signal: give at least "
                                        "2 seconds (the signal comes half the limit, at most 120 s, before the end)")
    if slurm.spare_nodes and not rq.in_job_restarts:
        raise loc.err("slurm.spare_nodes", "spare nodes serve the restarts inside the allocation, and "
                                           "requeue.in_job_restarts is 0: give it 1 or more, or leave the spares out")
    if rq.signal_delay_s < 1 or rq.signal_delay_s >= slurm.time_minutes * 60:
        raise loc.err("requeue.signal_delay_s", f"must be between 1 and the time limit ({slurm.time_minutes * 60:.0f} s)")


def _run_dir(doc: dict[Any, Any], name: str, workdir: Path, loc: Loc) -> Path:
    """``run_dir`` (default ``runs/<name>``), expanded and absolute: a path where a directory is or can be made."""
    raw_run_dir = as_text(doc.get("run_dir", f"runs/{name}"), "run_dir", loc)
    if not isinstance(raw_run_dir, str):
        raise loc.err("run_dir", f"expected a path, got {echo(raw_run_dir)}")
    if not raw_run_dir:
        raise loc.err("run_dir", "empty: leave it out for runs/<name>, or write . for the directory you submit from")
    run_dir = Path(expand_path(raw_run_dir, "run_dir", loc))
    if not run_dir.is_absolute():  # relative to where `alpsck submit` runs, like sbatch's own paths
        run_dir = Path(utf8(str(workdir / run_dir), "run_dir", loc, "relative to the current directory, it is a path of"))
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
    return run_dir
