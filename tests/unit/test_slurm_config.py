"""Job config validation (errors name key and line) and the generated sbatch script (golden)."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from support import SUPPORT

from alpsck.errors import ConfigError
from alpsck.slurm.config import load_config, parse_config, parse_time_minutes
from alpsck.slurm.submit import sbatch_script

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = SUPPORT / "golden" / "quickstart.sbatch"

GOOD = """\
name: t
run_dir: /tmp/x
slurm:
  time: "00:02:00"
entry:
  function: alpsck.examples.llama.train:slurm_entry
"""


def test_good_config_and_defaults() -> None:
    cfg = parse_config(GOOD)
    assert cfg.slurm.time_minutes == 2 and cfg.requeue.signal == "USR2" and cfg.checkpoint.max_in_flight == 2


@pytest.mark.parametrize(("text", "want"), [
    ("2", 2), ("2:30", 2.5), ("1:00:00", 60), ("1-0", 1440), ("1-2:03", 1440 + 123), ("0-0:0:30", 0.5)])
def test_time_formats(text: str, want: float) -> None:
    assert parse_time_minutes(text) == pytest.approx(want)


@pytest.mark.parametrize(("text", "ok"), [("90:00", True), ("1:59", True), ("1:99", False), ("1:60", False),
                                         ("1:90:00", False), ("100:59:59", True), ("1-23:59", True), ("1-24", False),
                                         ("1-2:60", False), ("1-2:3:60", False)])
def test_time_fields_are_range_checked_where_slurm_checks_them(text: str, ok: bool) -> None:
    """In M:S the seconds must be below 60 and the minutes may be anything (90:00 is 90 minutes)."""
    if ok:
        assert parse_time_minutes(text) > 0
    else:
        with pytest.raises(ValueError, match="out of range"):
            parse_time_minutes(text)


@pytest.mark.parametrize("key", ["signal", "requeue", "time", "output", "job-name"])
def test_extra_cannot_override_what_alpsck_sets(key: str) -> None:
    with pytest.raises(ConfigError, match=rf"slurm\.extra\.{key}: alpsck sets --{key}( \(-\w\))? itself"):
        parse_config(GOOD.replace("slurm:\n", f"slurm:\n  extra:\n    {key}: B:USR1@90\n"))


@pytest.mark.parametrize(("key", "match"), [
    ("sig", r"slurm\.extra\.sig: sbatch takes --sig as an abbreviation of --signal, which alpsck sets itself "
            r"\(use requeue\.signal"),
    ("requ", r"abbreviation of --requeue, which"),
    ("n", r"alpsck sets --ntasks \(-n\) itself"),  # sbatch's -n; as --n, an abbreviation of ours too
    ("nt", r"abbreviation of --ntasks-per-node or --ntasks, which alpsck sets itself; write the full name"),
    ("environment", r"alpsck sets --environment itself \(use environment\.container\)"),
    ("uenv", r"use environment\.uenv"),
    ("ntasks", r"use slurm\.nodes and slurm\.tasks_per_node"),
])
def test_extra_cannot_override_what_alpsck_sets_even_abbreviated(key: str, match: str) -> None:
    """sbatch takes any unambiguous abbreviation of a long option: --sig=USR1@90 is --signal."""
    with pytest.raises(ConfigError, match=match):
        parse_config(GOOD.replace("slurm:\n", f"slurm:\n  extra:\n    {key}: x\n"))


def test_extra_values_are_the_text_as_written() -> None:
    """YAML reads 1:30:00 as 5400, 010 as 8 and no as False; sbatch must get what was written."""
    cfg = parse_config(GOOD.replace("slurm:\n", "slurm:\n  extra:\n    time-min: 1:30:00\n    nice: 010\n"
                                                 "    kill-on-invalid-dep: no\n    exclusive: true\n    gpus: 4\n"))
    assert cfg.slurm.extra == {"time-min": "1:30:00", "nice": "010", "kill-on-invalid-dep": "no", "exclusive": "",
                               "gpus": "4"}
    text = sbatch_script(cfg)
    for line in ("--time-min=1:30:00", "--nice=010", "--kill-on-invalid-dep=no", "--exclusive", "--gpus=4"):
        assert f"#SBATCH {line}\n" in text
    with pytest.raises(ConfigError, match=r"slurm\.extra\.exclusive: false is not an sbatch value; leave the option out"):
        parse_config(GOOD.replace("slurm:\n", "slurm:\n  extra:\n    exclusive: false\n"))


def test_entry_args_are_the_text_as_written() -> None:
    cfg = parse_config(GOOD + "  args: [--seed, 010, --rev, 1.10, --t, 1:30, --lr, 3e-4, --n, 7]\n")
    assert cfg.entry.args == ["--seed", "010", "--rev", "1.10", "--t", "1:30", "--lr", "3e-4", "--n", "7"]
    cfg = parse_config(GOOD + "  args:\n    - --seed\n    - 010\n")
    assert cfg.entry.args == ["--seed", "010"]


def test_paths_expand_a_leading_tilde(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The batch script quotes the venv path, so its shell never expands ~ there."""
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("VENVS", "~/venvs")
    (tmp_path / "train.py").write_text("")
    cfg = parse_config(GOOD.replace("  function: alpsck.examples.llama.train:slurm_entry", "  script: ~/train.py")
                       + "environment:\n  venv: $VENVS/a\n  container: ~/edf.toml\n")
    assert cfg.environment.venv == f"{tmp_path}/venvs/a" and cfg.environment.container == f"{tmp_path}/edf.toml"
    assert cfg.entry.script == str(tmp_path / "train.py")
    # with a container, the venv is activated in the task's command (bash -c), its path expanded here
    assert f"source {tmp_path}/venvs/a/bin/activate && exec python3" in sbatch_script(cfg)


def test_the_python_in_the_job_command_is_quoted(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "executable", "/opt/my tools/bin/python3")
    text = sbatch_script(parse_config(GOOD))
    assert " --kill-on-bad-exit=1 '/opt/my tools/bin/python3' -u -c " in text and "' -u -m submitit.core._submit " in text


def test_the_local_job_command_runs_the_environment_lines_in_bash_then_this_python(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The local executor's job command (submitit splits it with shlex) gives bash the venv
    activation and the setup lines exactly as the batch script has them, then execs this Python."""
    import shlex

    from alpsck.errors import UsageError
    from alpsck.slurm.submit import local_python

    monkeypatch.setattr(sys, "executable", "/opt/my tools/bin/python3")
    assert local_python(parse_config(GOOD)) == "'/opt/my tools/bin/python3'"  # nothing to run first: as before
    cfg = parse_config(GOOD + "environment:\n  venv: /opt/venvs/a\n  setup:\n    - 'export A=\"it''s $B\"  # hi'\n")
    words = shlex.split(local_python(cfg) + " -u -m submitit.core._submit /run")
    setup = shlex.quote('export A="it\'s $B"  # hi')  # one eval: no setup line reaches past it (#41)
    assert Path(words[0]).name == "bash" and words[1:] == [
        "-c", "source /opt/venvs/a/bin/activate\n# environment.setup, as one block: no line of it reaches past it\n"
        f"eval {setup}\nexec \"$@\"", "alpsck-setup",
        "/opt/my tools/bin/python3", "-u", "-m", "submitit.core._submit", "/run"]
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(UsageError, match=r"environment\.venv and environment\.setup: the local executor runs them "
                                         r"with bash, as the batch script would, and bash is not on the PATH"):
        local_python(cfg)


@pytest.mark.parametrize(("written", "minutes"), [("90", 90), ("1:30:00", 90), ("30:00", 30), ("'1:30:00'", 90)])
def test_an_unquoted_time_means_what_slurm_would_read(written: str, minutes: float) -> None:
    # YAML alone reads 1:30:00 as 5400 and 30:00 as 1800 (base 60); SLURM reads 1 h 30 min and 30 min.
    cfg = parse_config(GOOD.replace('"00:02:00"', written))
    assert cfg.slurm.time_minutes == minutes and cfg.slurm.time == written.strip("'")


def test_a_text_key_written_as_a_number_keeps_its_text() -> None:
    cfg = parse_config(GOOD.replace("slurm:\n", "slurm:\n  account: 0042\n  qos: 1.50\n"))
    assert (cfg.slurm.account, cfg.slurm.qos) == ("0042", "1.50")
    with pytest.raises(ConfigError, match=r"slurm\.account: expected str, got bool"):
        parse_config(GOOD.replace("slurm:\n", "slurm:\n  account: yes\n"))


@pytest.mark.parametrize(("patch", "match"), [
    (("  time:", "  tme:"), r"<config>:4: slurm\.tme: unknown key \(did you mean 'time'\?\)"),
    (('"00:02:00"', '"2 hours"'), r"<config>:4: slurm\.time: bad time '2 hours'"),
    (('"00:02:00"', '"1:75:00"'), r"slurm\.time: bad time .*out of range"),
    (("name: t\n", ""), r"name: missing"),
    (("name: t", "name: 'a b'"), r"name: 'a b' is not a valid job name"),
    (("entry:\n  function: alpsck.examples.llama.train:slurm_entry\n", "entry: {}\n"), r"entry: give exactly one"),
    (("function: alpsck.examples.llama.train:slurm_entry", "function: 'os.system; rm'"), r"entry\.function"),
    (("run_dir: /tmp/x", "run_dir: $ALPSCK_SURELY_UNSET/x"), r"run_dir: environment variable \$ALPSCK_SURELY_UNSET"),
    (("slurm:\n", "slurm:\n  partition: \"debug\\nrm -rf /\"\n"), r"slurm\.partition: .*characters"),
    (("slurm:\n", "slurm:\n  nodes: two\n"), r"slurm\.nodes: expected int, got str"),
    (("name: t\n", "name: t\nrequeu: {}\n"), r"<config>:2: requeu: unknown key \(did you mean 'requeue'\?\)"),
    (("name: t\n", "name: t\nrequeue: []\n"), r"<config>:2: requeue: expected a mapping, got list"),
    (("name: t\n", 'name: t\nenvironment:\n  setup: ["ok", "a\\0b"]\n'), r"environment\.setup: line 2 contains a NUL"),
    (("name: t\n", 'name: t\nenvironment:\n  venv: "/a\\0b"\n'), r"environment\.venv: .* must be a plain path"),
])
def test_bad_configs_name_the_key_and_line(patch: tuple[str, str], match: str) -> None:
    text = GOOD.replace(*patch)
    with pytest.raises(ConfigError, match=match):
        parse_config(text)


@pytest.mark.parametrize(("patch", "key"), [
    (("name: t", 'name: "t\\n"'), "name"),
    (("slurm:\n", 'slurm:\n  partition: "debug\\n"\n'), "slurm.partition"),
    (("slurm:\n", 'slurm:\n  account: "a-g34\\n"\n'), "slurm.account"),
    (("slurm:\n", 'slurm:\n  extra:\n    comment: "x\\n"\n'), "slurm.extra.comment"),
    (("slurm:\n", 'slurm:\n  extra:\n    "exclusive\\n": true\n'), "slurm.extra.exclusive"),
    (("name: t\n", 'name: t\nenvironment:\n  container: "/edf.toml\\n"\n'), "environment.container"),
    (("name: t\n", 'name: t\nenvironment:\n  venv: "/venv\\n"\n'), "environment.venv"),
    (("function: alpsck.examples.llama.train:slurm_entry", 'function: "a.b:c\\n"'), "entry.function"),
])
def test_a_trailing_newline_is_refused_naming_the_key(patch: tuple[str, str], key: str) -> None:
    """The checks matched with ``^...$``, and ``$`` also matches before a final newline: name "t\\n"
    passed and broke its #SBATCH line in two, so sbatch ignored every directive after it (--requeue,
    --signal, --time...)."""
    with pytest.raises(ConfigError, match=rf"{re.escape(key)}"):
        parse_config(GOOD.replace(*patch))


@pytest.mark.parametrize(("tail", "match"), [
    # 0 or less: the maintenance watcher ran scontrol show reservation in a loop without pause
    ("requeue:\n  maintenance_poll_s: 0\n", r"<config>:8: requeue\.maintenance_poll_s: 0: must be between 1 and 86400"),
    ("requeue:\n  maintenance_poll_s: -60\n", r"requeue\.maintenance_poll_s: -60: must be between 1 and"),
    ("requeue:\n  maintenance_margin_s: -300\n",
     r"<config>:8: requeue\.maintenance_margin_s: -300: must be between 0 and 604800"),
    # .nan compares false with everything: a checkpoint was never due by time
    ("checkpoint:\n  every_seconds: .nan\n",
     r"<config>:8: checkpoint\.every_seconds: nan: must be between 0.001 and 31536000"),
    ("checkpoint:\n  every_seconds: .inf\n", r"checkpoint\.every_seconds: inf: must be between"),
    # the Checkpointer refused these only in the job, after it waited in the queue
    ("checkpoint:\n  threads: 1025\n", r"<config>:8: checkpoint\.threads: 1025: must be between 1 and 1024"),
    ("checkpoint:\n  keep_last: 4294967296\n",
     r"checkpoint\.keep_last: 4294967296: must be between 0 and 4294967295 \(0: keep all\)"),
    ("checkpoint:\n  max_in_flight: 4294967296\n", r"checkpoint\.max_in_flight: 4294967296: must be between 1 and 1024"),
    ("checkpoint:\n  threads: 0\n", r"checkpoint\.threads: 0: must be between 1 and 1024"),
])
def test_numbers_out_of_range_name_the_key(tail: str, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        parse_config(GOOD + tail)


@pytest.mark.parametrize(("slurm_line", "match"), [
    # nonsense SLURM would refuse (#24): counts it cannot hold, a time limit of centuries
    ("  nodes: 1000000000000000000000000000000\n", r"<config>:4: slurm\.nodes: 10+: must be between 1 and 4294967293"),
    ("  gpus_per_node: 4294967296\n", r"slurm\.gpus_per_node: 4294967296: must be between 0 and 4294967293"),
    ("  tasks_per_node: 4294967294\n", r"slurm\.tasks_per_node: 4294967294: must be between 1 and 4294967293"),
])
def test_slurm_counts_beyond_what_slurm_holds_name_the_key(slurm_line: str, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        parse_config(GOOD.replace("slurm:\n", "slurm:\n" + slurm_line))


def test_a_time_limit_of_centuries_names_the_key() -> None:
    with pytest.raises(ConfigError, match=r"slurm\.time: bad time '36500-00:00:00': more than 365 days"):
        parse_config(GOOD.replace('time: "00:02:00"', "time: 36500-00:00:00"))
    assert parse_config(GOOD.replace('time: "00:02:00"', "time: 365-00:00:00")).slurm.time_minutes == 365 * 1440


def test_a_config_nested_10000_deep_is_one_error_naming_the_line_not_a_recursion_traceback() -> None:
    for deep in ("x: " + "[" * 10_000 + "]" * 10_000 + "\n",
                 "".join("  " * i + f"k{i}:\n" for i in range(200)) + "  " * 200 + "v: 1\n"):
        with pytest.raises(ConfigError, match=r"<config>:\d+: lists and mappings nested deeper than 64 levels"):
            parse_config(GOOD + deep)


def test_the_thread_limit_is_the_engines_own(tmp_path: Path) -> None:
    """The config's limit is read from the engine, not restated: the largest value it accepts opens an
    engine, and one more is refused by both."""
    from alpsck import _core

    assert parse_config(GOOD + f"checkpoint:\n  threads: {_core.MAX_THREADS}\n").checkpoint.threads == _core.MAX_THREADS
    with pytest.raises(ConfigError, match=f"between 1 and {_core.MAX_THREADS}"):
        parse_config(GOOD + f"checkpoint:\n  threads: {_core.MAX_THREADS + 1}\n")
    with pytest.raises(ValueError, match=f"threads is {_core.MAX_THREADS + 1}: it must be between 1 and {_core.MAX_THREADS}"):
        _core.Engine(str(tmp_path / "run"), {"threads": _core.MAX_THREADS + 1})


def test_invalid_yaml_and_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"<config>:2: not valid YAML"):
        parse_config("name: t\n  bad: [\n")
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "nope.yaml")


@pytest.mark.parametrize(("text", "match"), [
    # what the YAML parser accepts and the safe loader cannot build was a traceback
    (GOOD.replace("name: t", "name: !foo t"), r"<config>:1: name: not valid YAML: could not determine a constructor"),
    (GOOD.replace("slurm:\n", "slurm:\n  extra:\n    begin: 2024-13-45\n"),
     r"<config>:5: slurm\.extra\.begin: not valid YAML: '2024-13-45': month must be in 1\.\.12"),
    (GOOD.replace("slurm:\n", "slurm:\n  nodes: !!int two\n"), r"<config>:4: slurm\.nodes: not valid YAML: 'two'"),
    (GOOD.replace("slurm:\n", "slurm:\n  ? [a]\n  : 1\n"), r"<config>:4: not valid YAML: found unhashable key"),
    # a mapping that holds itself (an alias) was a RecursionError
    (GOOD + "requeue: &r {x: *r}\n", r"<config>:7: requeue\.x: unknown key"),
    # YAML keeps the last of two equal keys: the first was lost without a word
    (GOOD + "slurm:\n  partition: big\n", r"<config>:7: slurm: given twice \(also on line 3\)"),
    (GOOD.replace("slurm:\n", "slurm:\n  nodes: 2\n  nodes: 3\n"), r"<config>:5: slurm\.nodes: given twice \(also on line 4\)"),
])
def test_yaml_the_loader_refuses_is_one_error_naming_the_line(text: str, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        parse_config(text)


def test_signal_delay_must_fit_the_time_limit() -> None:
    with pytest.raises(ConfigError, match=r"requeue\.signal_delay_s"):
        parse_config(GOOD + "requeue:\n  signal_delay_s: 500\n")
    # A limit too short for the default delay names the limit, not a key the user never wrote.
    with pytest.raises(ConfigError, match=r"slurm\.time: '0:1' leaves no time for the time-limit signal"):
        parse_config(GOOD.replace('"00:02:00"', '"0:1"'))


def test_env_vars_expand(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SCRATCH", "/scratch/me")
    cfg = parse_config(GOOD.replace("run_dir: /tmp/x", "run_dir: ${SCRATCH}/runs/$SCRATCH"))
    assert cfg.run_dir == "/scratch/me/runs/scratch/me"  # Path normalises the //


def test_examples_are_valid(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SCRATCH", "/scratch/me")
    monkeypatch.setenv("USER", "me")
    for p in sorted((ROOT / "slurm" / "examples").glob("*.yaml")):
        cfg = load_config(p)
        assert cfg.name and cfg.entry.function


def _normalised_script(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> str:
    monkeypatch.chdir(tmp_path)
    cfg = load_config(ROOT / "slurm" / "examples" / "quickstart.yaml")
    text = sbatch_script(cfg)
    return text.replace(str(tmp_path), "<CWD>").replace(sys.executable, "<PYTHON>")


@pytest.mark.parametrize("example", ["alps-gh200", "alps-gh200-uenv"])
def test_the_alps_examples_scripts_match_golden(monkeypatch: pytest.MonkeyPatch, example: str) -> None:
    """As CSCS documents: the container on srun (per step), never on the batch script; the uenv on the
    batch script (#SBATCH --uenv/--view, as CSCS's PyTorch job script), which every step inherits; the
    tasks run python3 from it, not a host path; one GPU per task; srun repeats --cpus-per-task and
    ends the step when a task dies; no --wckey; the run directory on Capstor scratch."""
    monkeypatch.setenv("USER", "user")
    monkeypatch.setenv("HOME", "/users/user")
    text = sbatch_script(load_config(ROOT / "slurm" / "examples" / f"{example}.yaml"))
    golden = GOLDEN.parent / f"{example}.sbatch"
    if os.environ.get("ALPSCK_UPDATE_GOLDEN"):
        golden.write_text(text)
    assert text == golden.read_text(), "sbatch script changed; review, then ALPSCK_UPDATE_GOLDEN=1 pytest ..."
    params = [line for line in text.splitlines() if line.startswith("#SBATCH")]
    srun = next(line for line in text.splitlines() if line.startswith("srun "))
    assert not any(p.startswith(("#SBATCH --environment", "#SBATCH --wckey")) for p in params)
    assert (["#SBATCH --uenv=pytorch/v2.9.1:v2", "#SBATCH --view=default"] == [p for p in params if
                                                                           p.startswith(("#SBATCH --uenv", "#SBATCH --view"))]
            ) == (example == "alps-gh200-uenv")
    assert f"mkdir -p /capstor/scratch/cscs/user/alpsck/{'llama-8b-uenv' if 'uenv' in example else 'llama-8b'}" in text
    assert "#SBATCH --gpus-per-task=1" in params and "#SBATCH --ntasks-per-node=4" in params
    assert "--cpus-per-task=72" in srun and "--kill-on-bad-exit=1" in srun and sys.executable not in srun
    # the uenv example's venv is activated in the task, then its python3 runs (CSCS: inside srun)
    assert (" python3 -u -c " in srun) == (example == "alps-gh200")
    assert (""" bash -c 'source /users/user/venvs/alpsck-pytorch-v2.9.1/bin/activate && exec python3 "$@"' \
alpsck-task -u -c """ in srun) == (example == "alps-gh200-uenv")
    assert ("--environment=/users/user/.edf/alps-gh200.toml" in srun) == (example == "alps-gh200")
    assert "--uenv" not in srun and "--view" not in srun
    # The batch shell outlives the signals SLURM sends it, and its EXIT trap acts on the request.
    assert text.index("trap '' USR1 USR2 HUP INT") < text.index("mkdir -p")
    assert "trap alpsck_stopping=1 TERM" in text and "trap alpsck_requeue_on_request EXIT" in text


def test_a_uenv_gets_the_default_view_unless_told(tmp_path: Path) -> None:
    """Without --view a uenv is only mounted, and python3 would be the node's own (CSCS: use the
    default view); a view without a uenv names the key."""
    from alpsck.slurm.submit import uenv_parameters

    base = GOOD + "environment:\n  uenv: pytorch/v2.8.0:v1\n"
    assert uenv_parameters(parse_config(base)) == {"uenv": "pytorch/v2.8.0:v1", "view": "default"}
    assert uenv_parameters(parse_config(base + "  view: modules\n"))["view"] == "modules"
    assert uenv_parameters(parse_config(GOOD)) == {}
    with pytest.raises(ConfigError, match=r"environment\.view.*environment\.uenv"):
        parse_config(GOOD + "environment:\n  view: default\n")
    with pytest.raises(ConfigError, match=r"environment\.view"):
        parse_config(base + "  view: 'a b'\n")
    with pytest.raises(ConfigError, match=r"slurm\.extra\.view.*environment\.view"):
        parse_config(GOOD.replace("slurm:\n", "slurm:\n  extra: {view: default}\n", 1))


def test_sbatch_script_matches_golden(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    text = _normalised_script(monkeypatch, tmp_path)
    if os.environ.get("ALPSCK_UPDATE_GOLDEN"):
        GOLDEN.write_text(text)
    assert text == GOLDEN.read_text(), "sbatch script changed; review, then ALPSCK_UPDATE_GOLDEN=1 pytest ..."
    for must in ("#SBATCH --signal=USR2@60", "#SBATCH --open-mode=append", "#SBATCH --requeue", "#SBATCH --time=2",
                 "trap alpsck_requeue_on_request EXIT"):
        assert must in text


@pytest.mark.parametrize("sig", ["USR1", "USR2"])
def test_the_configured_signal_is_the_one_slurm_sends_and_submitit_expects(sig: str) -> None:
    cfg = parse_config(GOOD + f"requeue:\n  signal: {sig}\n  signal_delay_s: 45\n")
    text = sbatch_script(cfg)
    assert f"#SBATCH --signal={sig}@45\n" in text and text.count("#SBATCH --signal=") == 1
    assert f"export SUBMITIT_PREEMPT_SIGNAL={sig}\n" in text


def test_values_reaching_the_script_are_quoted(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    odd = tmp_path / "dir with 'quote' and space"
    cfg = parse_config(GOOD.replace("run_dir: /tmp/x", f'run_dir: "{odd}"'))
    text = sbatch_script(cfg)
    assert "mkdir -p '" in text and "'\"'\"'quote'\"'\"'" in text  # shlex.quote of the run dir


@pytest.mark.parametrize(("run_dir", "match"), [
    ("''", r"<config>:2: run_dir: empty: leave it out for runs/<name>"),
    ("/scratch/a%jb", r"<config>:2: run_dir: '/scratch/a%jb' contains a percent sign, which SLURM and submitit would"),
    ("'/scratch/a\\b'", r"<config>:2: run_dir: .* contains a backslash"),
    ('"/scratch/a\\0b"', r"<config>:2: run_dir: .* contains a NUL character"),
])
def test_a_run_dir_the_job_could_not_use_as_written_is_refused(run_dir: str, match: str) -> None:
    """'' became the directory of the submit; a NUL was a ValueError at submit. In the batch
    script's --output, SLURM reads % as a pattern and sbatch drops a backslash even inside quotes
    (and submitit replaces %j in its folder): the logs would land in another directory."""
    with pytest.raises(ConfigError, match=match):
        parse_config(GOOD.replace("run_dir: /tmp/x", f"run_dir: {run_dir}"))


def test_submit_without_srun_is_one_line(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from alpsck.errors import SlurmError
    from alpsck.slurm.submit import make_executor

    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(SlurmError, match="srun not found"):
        make_executor(parse_config(GOOD), local=False)


def test_submit_falls_back_to_local_only_without_a_working_slurm(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from alpsck.slurm.submit import slurm_unavailable

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    monkeypatch.setenv("PATH", str(bin_dir))
    assert slurm_unavailable() == "sbatch not found"
    # slurm-wlm installed, but its controller is down (sinfo fails): still no SLURM to submit to.
    for name, body in (("sbatch", "exit 0"), ("sinfo", "echo 'Unable to contact slurm controller' >&2; exit 1")):
        (bin_dir / name).write_text(f"#!/bin/sh\n{body}\n")
        (bin_dir / name).chmod(0o755)
    why = slurm_unavailable()
    assert why is not None and "no SLURM controller answers" in why and "Unable to contact" in why
    (bin_dir / "sinfo").write_text("#!/bin/sh\necho debug\n")
    assert slurm_unavailable() is None


# ------------------------------------------------------------------ the Alps examples, after CSCS's pages

EXAMPLES = Path(__file__).resolve().parents[2] / "slurm" / "examples"
# https://docs.cscs.ch/software/communication/nccl/: "should always be set ... when using NCCL with uenv"
CSCS_NCCL_ENV = {"NCCL_NET": "AWS Libfabric", "NCCL_NET_GDR_LEVEL": "PHB", "NCCL_CROSS_NIC": "1",
                 "NCCL_PROTO": "^LL128", "FI_CXI_DEFAULT_CQ_SIZE": "131072", "FI_CXI_DEFAULT_TX_SIZE": "16384",
                 "FI_CXI_DISABLE_HOST_REGISTER": "1", "FI_CXI_RX_MATCH_MODE": "software",
                 "FI_MR_CACHE_MONITOR": "userfaultfd"}


def _example(name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[object, str]:
    monkeypatch.setenv("USER", "me")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    cfg = load_config(EXAMPLES / name)
    script = sbatch_script(cfg)
    assert subprocess.run(["bash", "-n"], input=script, text=True).returncode == 0
    return cfg, script


def _srun_line(script: str) -> str:
    (line,) = [ln for ln in script.splitlines() if ln.startswith("srun ")]
    return line


def test_the_uenv_example_activates_its_venv_inside_the_srun_task(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """CSCS: the venv on top of the uenv is activated inside the srun command, where the uenv's
    Python exists; the batch script (on the host) never sources it. Run the srun line with an srun
    that only drops its options: the task's python3 is the venv's."""
    _, script = _example("alps-gh200-uenv.yaml", tmp_path, monkeypatch)
    srun = _srun_line(script)
    host = script[:script.index(srun)]
    assert "bin/activate" not in host
    venv = tmp_path / "home" / "venvs" / "alpsck-pytorch-v2.9.1"
    assert "#SBATCH --uenv=pytorch/" in host and srun.index(f"source {venv}/bin/activate") < srun.index("python3")
    (venv / "bin").mkdir(parents=True)
    out = tmp_path / "task.out"
    (venv / "bin" / "activate").write_text(f'export VIRTUAL_ENV={venv}\nexport PATH="{venv}/bin:$PATH"\n')
    (venv / "bin" / "python3").write_text(f'#!/bin/sh\necho "$VIRTUAL_ENV $0 $*" > {out}\n')
    (venv / "bin" / "python3").chmod(0o755)
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    (bin_ / "srun").write_text('#!/bin/bash\nwhile [ $# -gt 0 ]; do case $1 in --output) shift 2;; --*) shift;; '
                               '*) break;; esac; done\nexec "$@"\n')
    (bin_ / "srun").chmod(0o755)
    env = {"PATH": f"{bin_}:{os.environ['PATH']}"}
    subprocess.run(["bash", "-c", srun], env=env, check=True, timeout=60)
    words = out.read_text().split()
    assert words[:2] == [str(venv), str(venv / "bin" / "python3")] and words[2:4] == ["-u", "-c"]
    assert words[-3:] == ["-m", "submitit.core._submit", "/capstor/scratch/cscs/me/alpsck/llama-8b-uenv/submitit"]


def test_the_uenv_example_exports_the_nccl_variables_cscs_says_to_always_set(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from alpsck.slurm.submit import environment_lines
    cfg, _ = _example("alps-gh200-uenv.yaml", tmp_path, monkeypatch)
    lines = environment_lines(cfg, batch=True)  # type: ignore[arg-type]
    got = subprocess.run(["bash", "-c", "\n".join([*lines, "env -0"])], capture_output=True, text=True, check=True,
                         env={"PATH": os.environ["PATH"]}).stdout
    env = dict(kv.split("=", 1) for kv in got.split("\0") if "=" in kv)
    assert {k: env.get(k) for k in CSCS_NCCL_ENV} == CSCS_NCCL_ENV
    assert env["MPICH_GPU_SUPPORT_ENABLED"] == "0" and "NCCL_NET_PLUGIN" not in env  # the NCCL page warns of it


def test_the_container_example_uses_the_edf_example_with_the_nccl_hook(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """The hook sets CSCS's NCCL variables inside the container (the NCCL page); the EDF mounts
    the run directory's file system (Capstor scratch) and names a workdir."""
    import tomllib
    cfg, script = _example("alps-gh200.yaml", tmp_path, monkeypatch)
    edf_name = Path(cfg.environment.container).name  # type: ignore[attr-defined]
    assert f"--environment={tmp_path}/home/.edf/{edf_name}" in _srun_line(script)
    assert f"slurm/examples/{edf_name}" in (Path(__file__).resolve().parents[2] / "docs" / "slurm.md").read_text()
    edf = tomllib.loads((EXAMPLES / edf_name).read_text())
    assert edf["annotations"]["com"]["hooks"]["aws_ofi_nccl"]["enabled"] == "true"
    assert edf["image"].endswith(".sqsh") and "/capstor" in edf["mounts"] and edf["workdir"]
    assert edf["env"]["MPICH_GPU_SUPPORT_ENABLED"] == "0"


def test_a_host_venv_stays_in_the_batch_script_and_a_container_venv_moves_into_the_task() -> None:
    host = sbatch_script(parse_config(GOOD + "environment:\n  venv: /opt/v\n"))
    assert "source /opt/v/bin/activate\n" in host and "bash -c" not in _srun_line(host)
    inside = sbatch_script(parse_config(GOOD + "environment:\n  venv: /opt/v\n  container: /e.toml\n"))
    srun = _srun_line(inside)
    assert "bin/activate" not in inside[:inside.index(srun)]
    words = shlex.split(srun)
    assert words[words.index("--environment=/e.toml") + 1:][:3] == [
        "bash", "-c", "source /opt/v/bin/activate && exec python3 \"$@\""]
