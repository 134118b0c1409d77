"""What a job config may hand to sbatch and to the batch script: the time limit (:func:`parse_time_minutes`),
plain SLURM words, the ``slurm.extra`` options (:func:`extra_value`: never one alpsck sets itself, however
spelt) and the ``environment.setup`` shell lines (:func:`shell_problem`: a block bash parses, left closed).
No config value reaches the script as a line or a shell word of its own."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from typing import TYPE_CHECKING, Any

from ..errors import echo

if TYPE_CHECKING:
    from .config_source import Loc

SLURM_WORD = re.compile(r"[A-Za-z0-9_.,:=+@%/-]{1,256}")  # partition, account, qos, constraint lists...
_TIME = re.compile(r"(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?")
MAX_TIME_MINUTES = 365 * 1440


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
    if total > MAX_TIME_MINUTES:
        raise ValueError(f"bad time {echo(text)}: more than 365 days")
    return total


def _spelled(option: str) -> str:
    """``--time (-t)``: an sbatch option alpsck sets, in both spellings."""
    short = _CONTROLLED[option][0]
    return f"--{option} (-{short})" if short else f"--{option}"


def extra_value(key: str, option: Any, value: Any, loc: Loc) -> str:
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
    if not isinstance(text, str) or not SLURM_WORD.fullmatch(text):
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
