"""Hostile and odd job configs (#41, "Job configs"): each test looks for a class of bug, not one case.

1. setup lines that leave the shell open must not swallow the srun line;
2. ``slurm.extra`` must not restate an sbatch option alpsck writes, however it is spelt;
3. every number has a range, upper bound included (NaN and inf refused);
4. a config has a size cap, and no error echoes a long value whole;
5. a text key written as a number or date keeps its text;
6. a run_dir that cannot be a directory, and ``keep_last=None``, are refused.
"""

from __future__ import annotations

import os
import re
import time
from pathlib import Path
from typing import Any

import pytest
from support.hostile_configs import GOOD, OPEN_BLOCKS, json_str, with_setup

from alpsck.errors import ConfigError, UsageError
from alpsck.options import NONE_REFUSED, problem
from alpsck.slurm import submit as submit_mod
from alpsck.slurm.config import MAX_CONFIG_BYTES, RANGES, load_config, parse_config, range_text
from alpsck.slurm.submit import sbatch_script, submit

ROOT = Path(__file__).resolve().parents[2]


# ------------------------------------------------------------------ 1. setup lines left open


@pytest.fixture()
def good(tmp_path: Path) -> str:
    return GOOD.format(run_dir=tmp_path / "run")


@pytest.mark.parametrize("lines", OPEN_BLOCKS, ids=lambda b: " / ".join(b))
@pytest.mark.parametrize("where", ["alone", "first", "last"])
def test_a_setup_block_left_open_is_refused_naming_the_key(good: str, lines: list[str], where: str) -> None:
    block = {"alone": lines, "first": [*lines, "export B=2"], "last": ["export B=2", *lines]}[where]
    if where == "first" and lines[-1].endswith("\\"):
        block = lines  # inside the block a trailing backslash continues the line (accepted below); at its end it leaks
    with pytest.raises(ConfigError, match=r"<config>:\d+: environment\.setup: does not parse"):
        parse_config(with_setup(good, block))


@pytest.mark.parametrize("lines", [
    ["cat > f <<EOF", "hello 'x' \"y\"", "EOF"],  # a here-document over several items, closed
    ["if true; then", "  export A=1", "fi"],
    ["echo a \\", "  b"],                           # a continuation inside the block
    ["# a comment only"],
    ["f() { echo in-f; }", "f"],
    ["export A='it''s'", 'echo "$A" # trailing comment'],
    ["# a comment ending in a backslash \\"],
    ["shopt -s extglob", "ls !(*.tmp) >/dev/null 2>&1 || true"],  # bash -n runs no shopt: extglob is on for it
])
def test_a_closed_setup_block_is_accepted(good: str, lines: list[str]) -> None:
    assert parse_config(with_setup(good, lines)).environment.setup == lines


def test_the_whole_batch_script_is_checked_with_bash_n(good: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Were the setup lines written into the script raw (as they were), the script check refuses it."""
    cfg = parse_config(good)
    cfg.environment.setup = ["cat <<EOF"]
    monkeypatch.setattr(submit_mod, "environment_lines", lambda c, **_: list(c.environment.setup))
    with pytest.raises(ConfigError, match=r"<config>: environment\.setup: the batch script .* does not parse"):
        sbatch_script(cfg)


# ------------------------------------------------------------------ 2. sbatch options alpsck sets

OURS = {  # what the error must point to instead, per spelling
    "time": "slurm.time", "t": "slurm.time", "-t": "slurm.time", "--time": "slurm.time", "tim": "slurm.time",
    "job-name": "use name", "J": "use name", "job_name": "use name", "signal": "requeue.signal",
    "sig": "requeue.signal", "requeue": "always requeues", "no-requeue": "always requeues",
    "output": "RUN_DIR/submitit", "o": "RUN_DIR/submitit", "error": "RUN_DIR/submitit", "e": "RUN_DIR/submitit",
    "open-mode": "appends", "nodes": "slurm.nodes", "N": "slurm.nodes", "ntasks": "slurm.tasks_per_node",
    "n": "slurm.tasks_per_node", "ntasks-per-node": "slurm.tasks_per_node", "cpus-per-task": "slurm.cpus_per_task",
    "c": "slurm.cpus_per_task", "partition": "slurm.partition", "p": "slurm.partition", "account": "slurm.account",
    "A": "slurm.account", "qos": "slurm.qos", "q": "slurm.qos", "constraint": "slurm.constraint",
    "C": "slurm.constraint", "reservation": "slurm.reservation", "mem": "slurm.mem",
    "gpus-per-node": "slurm.gpus_per_node", "gpus-per-task": "slurm.gpus_per_node",
    "environment": "environment.container", "uenv": "environment.uenv", "view": "environment.view",
    "array": "one job", "a": "one job", "wrap": "submitit",
    # --export=NONE drops the environment the job needs; --chdir moves it from where alpsck expects it
    "export": "environment.setup", "--export": "environment.setup", "exp": "environment.setup",
    "chdir": "alpsck submit runs in", "D": "alpsck submit runs in", "-D": "alpsck submit runs in",
    "chd": "alpsck submit runs in",
}


@pytest.mark.parametrize(("option", "instead"), OURS.items())
def test_an_extra_option_alpsck_sets_is_refused_naming_what_to_use(good: str, option: str, instead: str) -> None:
    text = good.replace("slurm:\n", f"slurm:\n  extra:\n    {json_str(option)}: '1'\n")
    with pytest.raises(ConfigError, match=rf"<config>:\d+: slurm\.extra\.{re.escape(option)}: .*{re.escape(instead)}"):
        parse_config(text)


@pytest.mark.parametrize("slurm", [
    "{gpus_per_node: 4, tasks_per_node: 4, account: a, partition: p, mem: 4G, constraint: c, qos: q, reservation: r}",
    "{gpus_per_node: 3, tasks_per_node: 2, nodes: 2, cpus_per_task: 8}",
])
def test_every_option_the_batch_script_sets_is_one_extra_refuses(tmp_path: Path, slurm: str) -> None:
    """The table of options alpsck sets covers what the script really writes: each #SBATCH line's
    option, given again in slurm.extra, is refused."""
    good = GOOD.format(run_dir=tmp_path / "run").replace('slurm:\n  time: "00:02:00"\n', f"slurm: {slurm}\n")
    written = re.findall(r"^#SBATCH --([a-z-]+)", sbatch_script(parse_config(good)), flags=re.M)
    assert {"time", "signal", "requeue", "job-name", "output", "nodes"} <= set(written)
    for option in written:
        with pytest.raises(ConfigError, match=rf"slurm\.extra\.{option}: alpsck sets --{option}"):
            parse_config(re.sub(r"^slurm: \{", f"slurm: {{extra: {{{option}: '1'}}, ", good, flags=re.M))


@pytest.mark.parametrize("option", ["d", "x", "-k", "Exclusive", "comment_", "x" * 65])
def test_an_extra_key_that_is_not_a_long_option_name_is_refused(good: str, option: str) -> None:
    with pytest.raises(ConfigError, match=r"slurm\.extra\..*: sbatch option names are lower-case long names"):
        parse_config(good.replace("slurm:\n", f"slurm:\n  extra:\n    {json_str(option)}: '1'\n"))


def test_extra_gpus_is_refused_only_beside_gpus_per_node(good: str) -> None:
    """--gpus (the job's GPUs in all) is free while alpsck writes no GPU option; beside
    slurm.gpus_per_node (--gpus-per-task or --gpus-per-node) it would ask for GPUs twice."""
    extra = "  extra: {gpus: 4}\n"
    assert parse_config(good.replace("slurm:\n", "slurm:\n" + extra)).slurm.extra == {"gpus": "4"}
    with pytest.raises(ConfigError, match=r"slurm\.extra\.gpus: alpsck sets --gpus-per-task or --gpus-per-node"):
        parse_config(good.replace("slurm:\n", "slurm:\n  gpus_per_node: 4\n" + extra))
    for spelt in ("G", "--gpus"):  # not a long name: refused whatever it means
        with pytest.raises(ConfigError, match=rf"slurm\.extra\.{re.escape(spelt)}: sbatch option names are"):
            parse_config(good.replace("slurm:\n", f"slurm:\n  extra: {{{json_str(spelt)}: 4}}\n"))


def test_extra_options_alpsck_does_not_set_reach_the_script(good: str) -> None:
    text = good.replace("slurm:\n", "slurm:\n  extra: {exclusive: true, time-min: 1:30:00, gres: 'nvme:1', "
                                    "comment: 0042}\n")
    script = sbatch_script(parse_config(text))
    for line in ("#SBATCH --exclusive", "#SBATCH --time-min=1:30:00", "#SBATCH --gres=nvme:1", "#SBATCH --comment=0042"):
        assert line in script.splitlines()


# ------------------------------------------------------------------ 3. every number has a range

def _put(good: str, key: str, value: str) -> str:
    sec, k = key.split(".")
    if sec == "slurm":
        return good.replace("slurm:\n", f"slurm:\n  {k}: {value}\n")
    return good + f"{sec}:\n  {k}: {value}\n"


@pytest.mark.parametrize("key", sorted(RANGES))
def test_every_number_has_a_lower_and_an_upper_bound(good: str, key: str) -> None:
    lo, hi = RANGES[key]
    outside = [repr(lo - 1) if isinstance(lo, int) else "0.0", str(hi + 1) if isinstance(hi, int) else repr(hi * 10),
               "100000000000000000000000000000"]
    if isinstance(lo, float):
        outside += [".nan", ".inf", "-.inf", "-1.0"]
    for value in outside:
        with pytest.raises(ConfigError, match=rf"<config>:\d+: {re.escape(key)}: .*must be between"):
            parse_config(_put(good, key, value))
    assert getattr(getattr(parse_config(_put(good, key, str(lo))), key.split(".")[0]), key.split(".")[1]) == lo
    if key != "requeue.signal_delay_s":  # that one must also stay below the time limit
        parse_config(_put(good.replace('"00:02:00"', '"365-0"'), key, str(hi)))


def test_a_poll_interval_that_would_overflow_a_wait_is_refused(good: str) -> None:
    with pytest.raises(ConfigError, match=r"requeue\.maintenance_poll_s: 10000000000: must be between 1 and 86400"):
        parse_config(good + "requeue:\n  maintenance_poll_s: 10000000000\n")


def test_the_docs_list_every_range(good: str) -> None:
    doc = (ROOT / "docs" / "config.md").read_text()
    for key in RANGES:
        row = next((ln for ln in doc.splitlines() if ln.startswith(f"| `{key.split('.')[1]}` |")), None)
        assert row is not None and f"| {range_text(key)} |" in row, (key, row, range_text(key))


# ------------------------------------------------------------------ 4. size cap and echoed values

def test_a_config_over_the_cap_is_refused_fast_naming_size_and_cap(good: str, tmp_path: Path) -> None:
    big = tmp_path / "big.yaml"
    big.write_text(good)
    os.truncate(big, 100 * MAX_CONFIG_BYTES)  # 100 MiB (sparse): parsing it took minutes
    t0 = time.monotonic()
    with pytest.raises(ConfigError, match=rf"big\.yaml: {big.stat().st_size} bytes: .*at most {MAX_CONFIG_BYTES} "
                                          r"bytes \(1 MiB\)"):
        load_config(big)
    assert time.monotonic() - t0 < 30  # parsing it took minutes
    with pytest.raises(ConfigError, match=r"more than 1048576 bytes"):
        load_config("/dev/zero")  # endless: only the cap is read
    with pytest.raises(ConfigError, match=r"<config>: \d+ bytes: a job config may have at most"):
        parse_config(good + "#" + "é" * MAX_CONFIG_BYTES)
    just = tmp_path / "just.yaml"
    just.write_text(good + "#" + "x" * (MAX_CONFIG_BYTES - len(good) - 2) + "\n")
    assert just.stat().st_size == MAX_CONFIG_BYTES and load_config(just).name == "t"


LONG = "x" * 20_000  # far past what any message may echo (600 characters), and quick to parse
KEY = "x" * 1000  # YAML takes implicit keys up to 1024 characters


@pytest.mark.parametrize(("patch", "key"), [
    (("name: t", f"name: a b{LONG}"), "name"),
    (("run_dir: ", f"run_dir: /%{LONG}"), "run_dir"),
    (("slurm:\n", f"slurm:\n  partition: 'a b{LONG}'\n"), "slurm.partition"),
    (('"00:02:00"', f"'{LONG}'"), "slurm.time"),
    (("slurm:\n", f"slurm:\n  nodes: '{LONG}'\n"), "slurm.nodes"),
    (("slurm:\n", f"slurm:\n  nodes: 1{'0' * 10_000}\n"), "slurm.nodes"),  # past int()'s digit limit
    (("slurm:\n", f"slurm:\n  extra: {{comment: 'a b{LONG}'}}\n"), "slurm.extra.comment"),
    (("slurm:\n", f"slurm:\n  extra: {{{KEY}: '1'}}\n"), "slurm.extra.x"),
    (("slurm:\n", f"slurm:\n  extra: {{{KEY}: true}}\n"), "slurm.extra.x"),
    (("slurm:\n", f"slurm:\n  {KEY}: 1\n"), "slurm.x"),
    (("name: t\n", f"name: t\n{KEY}: 1\n"), "x"),
    (("name: t\n", f"name: t\n? {LONG}\n: 1\n"), "x"),
    (("name: t\n", f"name: t\nslurm_:\n  ? {LONG}\n  : 1\n  ? {LONG}\n  : 2\n"), "given twice"),
    (("name: t", f"name: !{LONG} t"), "name: not valid YAML"),
    (("name: t", f"name: !!int {LONG}"), "name: not valid YAML"),
    (("slurm:\n", f"slurm:\n  extra: {{comment: [{LONG}]}}\n"), "slurm.extra.comment"),
    (("function: alpsck.examples.llama.train:slurm_entry", f"function: '{LONG}'"), "entry.function"),
], ids=lambda p: p[1].split(":")[0][:40] if isinstance(p, tuple) else None)
def test_no_error_echoes_a_long_value_whole(good: str, patch: tuple[str, str], key: str) -> None:
    text = good.replace(*patch)
    assert text != good
    with pytest.raises(ConfigError) as e:
        parse_config(text)
    msg = str(e.value)
    assert key in msg and len(msg) < 600 and "x" * 200 not in msg, msg[:1000]


@pytest.mark.parametrize("tail", [f"environment:\n  setup: ['echo \"{LONG}']\n",
                                  f"environment:\n  venv: '/a b{LONG}'\n",
                                  f"requeue:\n  signal: {LONG}\n",
                                  f"checkpoint:\n  threads: '{LONG}'\n"], ids=lambda t: t.split(":")[0])
def test_no_error_echoes_a_long_value_whole_in_any_section(good: str, tail: str) -> None:
    with pytest.raises(ConfigError) as e:
        parse_config(good + tail)
    assert len(str(e.value)) < 600 and "x" * 100 not in str(e.value), str(e.value)[:1000]


# ------------------------------------------------------------------ 5. text keys keep their text

@pytest.mark.parametrize(("written", "text"), [("0012", "0012"), ("12", "12"), ("1.50", "1.50"), ("0x1F", "0x1F"),
                                               ("2024-01-02", "2024-01-02"), ("1_000", "1_000"), ("1e3", "1e3")])
def test_a_text_key_written_as_a_number_or_date_keeps_its_text(good: str, tmp_path: Path, written: str, text: str) -> None:
    cfg = parse_config(good.replace("name: t", f"name: {written}").replace("slurm:\n", f"slurm:\n  account: {written}\n"
                                                                                      f"  extra: {{comment: {written}}}\n")
                       + f"environment:\n  setup: [echo {written}, {written}]\n  uenv: {written}\n  view: {written}\n")
    assert cfg.name == text and cfg.slurm.account == text and cfg.slurm.extra["comment"] == text
    assert cfg.environment.setup == [f"echo {written}", text] and cfg.environment.uenv == text
    assert cfg.environment.view == text
    cfg = parse_config(good.replace(f"run_dir: {tmp_path / 'run'}", f"run_dir: {written}"))
    assert cfg.run_dir == str(Path.cwd() / text)
    args = parse_config(good.replace("slurm_entry\n", f"slurm_entry\n  args: [--x, {written}]\n")).entry.args
    assert args == ["--x", text]


def test_a_name_written_as_a_boolean_is_still_refused(good: str) -> None:
    with pytest.raises(ConfigError, match=r"<config>:1: name: True is not a valid job name"):
        parse_config(good.replace("name: t", "name: yes"))


# ------------------------------------------------------------------ 6. run_dir and keep_last


@pytest.mark.parametrize("kind", ["file", "empty-dir"])
def test_a_venv_that_exists_here_and_is_not_one_is_refused(good: str, tmp_path: Path, kind: str) -> None:
    venv = tmp_path / "venv"
    if kind == "file":
        venv.write_text("x")
    else:
        venv.mkdir()
    with pytest.raises(ConfigError, match=r"<config>:\d+: environment\.venv: .* is not a virtual environment"):
        parse_config(good + f"environment:\n  venv: {venv}\n")
    (tmp_path / "real" / "bin").mkdir(parents=True)
    (tmp_path / "real" / "bin" / "activate").write_text("")
    for ok in (tmp_path / "real", tmp_path / "only-on-the-nodes"):
        assert parse_config(good + f"environment:\n  venv: {ok}\n").environment.venv == str(ok)


def test_submit_and_the_history_make_a_new_run_directory_durable_in_its_parent(
        good: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The run directory ``alpsck submit`` makes (and the job history's first line, where it makes one) is fsync'ed
    into its parent: the Checkpointer then finds it there and syncs no parent, so without it a power loss could
    take the directory with every checkpoint committed in it."""
    import alpsck.store.durable
    from alpsck.slurm import history

    synced: list[Path] = []
    real = alpsck.store.durable.fsync_path

    def record(path: Any) -> None:
        synced.append(Path(path))
        real(path)

    class Stop(Exception):
        pass

    def stop(*_a: Any, **_k: Any) -> None:
        raise Stop  # the executor comes after the run directory: nothing is started

    monkeypatch.setattr(alpsck.store.durable, "fsync_path", record)
    monkeypatch.setattr(submit_mod, "make_executor", stop)
    cfg = parse_config(good)
    with pytest.raises(Stop):
        submit(cfg, local=True)
    assert synced == [tmp_path] and Path(cfg.run_dir).is_dir()
    synced.clear()
    history.append(tmp_path / "new" / "run", "started", job_id="1")
    assert synced == [tmp_path, tmp_path / "new"]
    assert (tmp_path / "new" / "run" / history.HISTORY).is_file()


def test_submit_refuses_a_run_dir_that_became_a_file(good: str, tmp_path: Path) -> None:
    cfg = parse_config(good)
    Path(cfg.run_dir).write_text("not a directory")
    with pytest.raises(ConfigError, match=r"run_dir: cannot make the run directory"):
        submit(cfg, local=True)


@pytest.mark.parametrize("value", ["", " null", " ~"])
def test_an_empty_keep_last_is_refused_not_taken_as_the_default(good: str, value: str) -> None:
    with pytest.raises(ConfigError, match=r"<config>:\d+: checkpoint\.keep_last: None is refused, not taken as the "
                                          r"default \(3\), .*give 0 to keep every checkpoint"):
        parse_config(good + f"checkpoint:\n  keep_last:{value}\n")
    assert parse_config(good + "checkpoint:\n  threads:\n").checkpoint.threads == 8  # others: the default, as documented


def test_keep_last_none_is_refused_by_the_checkpointer(tmp_path: Path) -> None:
    from alpsck import Checkpointer

    assert set(NONE_REFUSED) == {"keep_last"}
    with pytest.raises(UsageError, match=r"keep_last: None is refused, .*give 0 to keep every checkpoint"):
        Checkpointer(tmp_path / "run", keep_last=None)  # type: ignore[arg-type]
    assert not (tmp_path / "run").exists()
    assert problem("keep_last", None) is not None and problem("threads", 8) is None


@pytest.mark.parametrize("value", ["NONE", "ALL", "NONE,PATH"])
def test_extra_export_is_refused_whatever_its_value(good: str, value: str) -> None:
    with pytest.raises(ConfigError, match=r"slurm\.extra\.export: alpsck sets --export itself"):
        parse_config(good.replace("slurm:\n", f"slurm:\n  extra: {{export: {json_str(value)}}}\n"))


# ------------------------------------------------------------------ YAML 1.1 keys that are not text

@pytest.mark.parametrize("key", ["on", "off", "yes", "no", "On", "NO", "true", "1", "1.5", "~"])
@pytest.mark.parametrize("where", ["top", "slurm", "requeue", "slurm.extra", "environment"])
def test_a_key_yaml_reads_as_a_boolean_or_number_is_refused_naming_it(good: str, key: str, where: str) -> None:
    """docs/config.md: a key is text; `on:` would otherwise reach the checks as True (an error
    naming `True`, which the config never wrote)."""
    line = f"{key}: x"
    text = {"top": good + line + "\n", "slurm": good.replace("slurm:\n", f"slurm:\n  {line}\n"),
            "requeue": good + f"requeue:\n  {line}\n", "environment": good + f"environment:\n  {line}\n",
            "slurm.extra": good.replace("slurm:\n", f"slurm:\n  extra:\n    {line}\n")}[where]
    prefix = "" if where == "top" else where + "."
    with pytest.raises(ConfigError, match=rf"<config>:\d+: {re.escape(prefix + key)}: YAML reads this key as a "
                                          rf"\w+, not as its text; every key is text \(quote it"):
        parse_config(text)


@pytest.mark.parametrize("key", ["on", "no", "yes", "off"])
def test_a_quoted_key_is_its_text(good: str, key: str) -> None:
    with pytest.raises(ConfigError, match=rf"<config>:\d+: requeue\.{key}: unknown key"):
        parse_config(good + f"requeue:\n  '{key}': true\n")
