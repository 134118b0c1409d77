"""One options type: the engine's options are defined once in the core, and every place that
states a default or a limit (the Checkpointer, the job config, the DCP backend, the reference
training, the docs) agrees with that table, and refuses an out-of-range value by name."""

from __future__ import annotations

import inspect
import math
import os
import re
import time
from pathlib import Path

import pytest
import torch

import alpsck
from alpsck import _core, options
from alpsck.dcp import AlpsckStorageReader, AlpsckStorageWriter
from alpsck.errors import ConfigError, StateTypeError, UsageError
from alpsck.examples.llama.train import TrainConfig
from alpsck.slurm.config import CheckpointConfig, load_config

ROOT = Path(__file__).resolve().parents[2]


def test_the_core_table_is_the_python_table_and_every_default_is_within_its_limits() -> None:
    names = [s["name"] for s in _core.engine_options()]
    assert names == list(options.SPECS) and len(set(names)) == len(names)
    for name, spec in options.SPECS.items():
        assert options.problem(name, options.DEFAULTS[name]) is None, name
        assert spec["doc"], name


def test_the_engine_binding_defaults_are_the_table_defaults(tmp_path: Path) -> None:
    """The binding states no default of its own: an Engine given no options opens with the table's."""
    assert _core.check_engine_options({}) == {n: options.DEFAULTS[n] for n in options.ENGINE_OPTIONS}
    engine = _core.Engine(str(tmp_path), {})
    try:
        for name in ("threads", "chunk_bytes"):  # (direct_io: what the file system allowed)
            assert getattr(engine, name) == options.DEFAULTS[name], name
    finally:
        engine.close()


def test_the_engine_takes_its_options_as_one_mapping_checked_by_name_through_the_table(tmp_path: Path) -> None:
    given = {"threads": 3, "keep_every_steps": 100, "keep_every_seconds": 60.0, "keep_best": "val_loss:min:2",
             "pin_cpus": [0], "direct_io": False, "numa_node": -1}
    assert _core.check_engine_options(given) == {**{n: options.DEFAULTS[n] for n in options.ENGINE_OPTIONS}, **given}
    engine = _core.Engine(str(tmp_path / "run"), {"threads": 3, "chunk_bytes": 1 << 20})
    try:
        assert (engine.threads, engine.chunk_bytes) == (3, 1 << 20)
    finally:
        engine.close()
    for bad, says in [({"thread": 3}, "no engine option is named 'thread'"),
                      ({"spike_factor": 2.0}, "spike_factor is not an engine option: the Checkpointer's save takes it"),
                      ({"read_threads": 2}, "read_threads is not an engine option"),
                      ({"threads": 0}, "threads is 0: it must be between 1 and 1024"),
                      ({"threads": "4"}, "threads is '4': it must be an integer"),
                      ({"threads": True}, "threads is True: it must be an integer"),
                      ({"keep_every_steps": 2**64}, f"keep_every_steps is {2**64}: it must be between 0 and"),
                      ({"direct_io": 1}, "direct_io is 1: it must be True or False"),
                      ({"pin_cpus": "0-3"}, "pin_cpus is '0-3': it must be a list of CPU numbers"),
                      ({"pin_cpus": [2000]}, "pin_cpus holds 2000"),
                      ({"keep_best": 3}, "keep_best is 3: it must be a string"),
                      ({"commit_timeout_s": math.nan}, "commit_timeout_s is not a number"),
                      ({"keep_last": 0, "keep_every_steps": 10}, "keep_every_steps is set, but keep_last is 0")]:
        with pytest.raises(UsageError, match=re.escape(says)):
            _core.check_engine_options(bad)
        with pytest.raises(UsageError, match=re.escape(says)):
            _core.Engine(str(tmp_path / "refused"), bad)
        assert not (tmp_path / "refused").exists()  # refused before the run directory was made


def test_every_user_facing_default_is_the_table_default() -> None:
    ck = inspect.signature(alpsck.Checkpointer).parameters  # every option of the table, spelled out
    for name in options.CHECKPOINTER_OPTIONS:
        assert ck[name].kind is inspect.Parameter.KEYWORD_ONLY and ck[name].default == options.DEFAULTS[name], name
    assert "read_threads" not in ck  # the readers' option, not a Checkpointer's
    cfg = CheckpointConfig()
    train = TrainConfig()
    for name in ("max_in_flight", "threads", "keep_last"):
        assert getattr(cfg, name) == options.DEFAULTS[name] == getattr(train, name), name
    w = AlpsckStorageWriter("/nonexistent-never-opened", 1)
    assert (w.threads, w.chunk_bytes, w.commit_timeout_s) == tuple(
        options.DEFAULTS[n] for n in ("threads", "chunk_bytes", "commit_timeout_s"))
    assert AlpsckStorageReader("/nonexistent-never-opened").threads == options.DEFAULTS["read_threads"]
    for fn in (alpsck.restore_into, alpsck.checkpointer.read_checkpoint):
        assert inspect.signature(fn).parameters["threads"].default == options.DEFAULTS["read_threads"]


def test_the_docs_option_table_is_generated_from_the_core_table() -> None:
    text = (ROOT / "docs" / "python-api.md").read_text()
    block = text.split("<!-- options:begin -->\n", 1)[1].split("<!-- options:end -->", 1)[0]
    assert block == options.markdown_table(), "regenerate it: alpsck.options.markdown_table()"


def test_the_config_reference_states_the_table_defaults_and_limits() -> None:
    text = (ROOT / "docs" / "config.md").read_text()
    for name in ("max_in_flight", "threads", "keep_last", "keep_every_steps", "keep_every_seconds", "keep_best",
                 "spike_factor"):
        row = re.search(rf"^\| `{name}` \| ([^|]+) \| ([^|]+) \|", text, re.M)
        assert row, name
        assert (row.group(1).strip(), row.group(2).strip()) == (options.range_text(name), options.default_text(name))


@pytest.mark.parametrize(("name", "value", "says"), [
    ("threads", 0, "threads: 0: must be between 1 and 1024"),
    ("threads", 2.5, "threads: 2.5: must be an integer"),
    ("threads", True, "must be an integer"),
    ("max_in_flight", 5000, "max_in_flight: 5000: must be between 1 and 1024"),
    ("keep_last", -1, "keep_last: -1: must be between 0 and 4294967295 (0: keep all)"),
    ("chunk_bytes", 2**31, "chunk_bytes: 2147483648"),
    ("commit_timeout_s", math.nan, "commit_timeout_s: nan"),
    ("commit_timeout_s", 0, "commit_timeout_s: 0: must be between 0.001 and 604800"),
    ("pin_cpus", [0, -1], "pin_cpus: -1 is not a CPU number between 0 and 1023"),
    ("pin_cpus", "0-3", "must be a list of CPU numbers"),
    ("direct_io", "yes", "direct_io: 'yes': must be true or false"),
    ("background_nice", 20, "background_nice: 20: must be between 0 and 19"),
    ("background_nice", -5, "background_nice: -5: must be between 0 and 19"),
])
def test_the_checkpointer_refuses_an_out_of_range_option_by_name_before_touching_the_run_dir(
        tmp_path: Path, name: str, value: object, says: str) -> None:
    run = tmp_path / "run"
    with pytest.raises(UsageError) as e:
        alpsck.Checkpointer(run, **{name: value})
    assert says in str(e.value)
    assert not run.exists()


def test_the_checkpointer_takes_every_option_of_the_table_by_name_and_none_means_the_default(tmp_path: Path) -> None:
    """A Checkpointer's options are the table's: none is a parameter of its own, so a new row is a new
    option without touching it; None takes the table's default (keep_last's None is refused)."""
    names = [n for n, s in options.SPECS.items() if s["scope"] in ("engine", "checkpointer")]
    assert list(options.CHECKPOINTER_OPTIONS) == names and "spike_factor" in names
    with alpsck.Checkpointer(tmp_path / "run", **{n: None for n in names if n not in options.NONE_REFUSED}) as ck:
        assert (ck.engine.threads, ck.engine.chunk_bytes) == (options.DEFAULTS["threads"], options.DEFAULTS["chunk_bytes"])
    with pytest.raises(UsageError, match="keep_last: None is refused"):
        alpsck.Checkpointer(tmp_path / "none", keep_last=None)
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'thread' \(did you mean 'threads'\?\)"):
        alpsck.Checkpointer(tmp_path / "typo", thread=4)
    with pytest.raises(TypeError, match="unexpected keyword argument 'read_threads'"):
        alpsck.Checkpointer(tmp_path / "typo", read_threads=4)
    with pytest.raises(UsageError, match="keep_every_steps is set, but keep_last is 0"):  # the core's check of the set
        alpsck.Checkpointer(tmp_path / "typo", keep_last=0, keep_every_steps=10)
    assert not (tmp_path / "none").exists() and not (tmp_path / "typo").exists()


def test_the_job_config_refuses_an_out_of_range_option_naming_the_key(tmp_path: Path) -> None:
    cfg = tmp_path / "job.yaml"
    cfg.write_text("name: t\nentry: {function: 'm:f'}\ncheckpoint: {threads: 5000}\n")
    with pytest.raises(ConfigError) as e:
        load_config(cfg)
    assert "checkpoint.threads" in str(e.value) and "between 1 and 1024" in str(e.value)


@pytest.mark.parametrize("step", [-1, 2**63, 2**64, 1.5, True, "3", None])
def test_a_step_out_of_int64_or_not_an_integer_is_refused_by_every_writer(tmp_path: Path, step: object) -> None:
    state = {"w": torch.ones(2)}
    with alpsck.Checkpointer(tmp_path / "run", keep_last=0) as ck:
        with pytest.raises(UsageError, match=r"step must be an integer between 0 and 2\^63-1"):
            ck.save(step, state)  # type: ignore[arg-type]
        if step is not None:
            with pytest.raises(UsageError, match=r"step must be None or an integer between 0 and 2\^63-1"):
                ck.restore(state, step=step)  # type: ignore[arg-type]
        ck.save(2**63 - 1, state).wait()  # the largest is fine
        assert ck.restore({"w": torch.zeros(2)}) == 2**63 - 1
    if step is None:  # no step: the DCP writer's checkpoint-directory mode (the path is the checkpoint)
        assert AlpsckStorageWriter(tmp_path / "dcp", step).named
    else:
        with pytest.raises(UsageError, match="step must be"):
            AlpsckStorageWriter(tmp_path / "dcp", step)  # type: ignore[arg-type]
    from alpsck.torch_save import TorchSaveCheckpointer

    with TorchSaveCheckpointer(tmp_path / "torch") as base, pytest.raises(UsageError, match="step must be"):
        base.save(step, state)  # type: ignore[arg-type]


@pytest.mark.parametrize("state", [[1, 2], None, "x", 3])
def test_a_state_that_is_not_a_mapping_is_refused_naming_its_type(tmp_path: Path, state: object) -> None:
    with alpsck.Checkpointer(tmp_path, keep_last=0) as ck:
        with pytest.raises(UsageError, match=f"state must be a mapping .* not {type(state).__name__}"):
            ck.save(1, state)  # type: ignore[arg-type]
        with pytest.raises(UsageError, match="state must be a mapping"):
            ck.restore(state)  # type: ignore[arg-type]


@pytest.mark.parametrize("run_dir", ["", None, 5, "run\0dir", b"run\0dir"])
def test_an_empty_or_unusable_run_dir_is_refused(run_dir: object) -> None:
    with pytest.raises(UsageError, match="run_dir must be a non-empty path"):
        alpsck.Checkpointer(run_dir)  # type: ignore[arg-type]


def _unsaveable() -> dict[str, object]:
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # nested tensors and quantization are "prototype"/deprecated
        return {
            "nested": torch.nested.nested_tensor([torch.zeros(2), torch.zeros(3)]),
            "sparse": torch.zeros(3, 3).to_sparse(),
            "meta": torch.empty(3, device="meta"),
            "quantized": torch.quantize_per_tensor(torch.zeros(3), 0.1, 0, torch.qint8),
            "object": object(),
        }


@pytest.mark.parametrize("what", list(_unsaveable()))
def test_a_value_alpsck_cannot_save_is_one_error_naming_where_it_is(tmp_path: Path, what: str) -> None:
    state = {"model": {"ok": torch.ones(2), "bad": _unsaveable()[what]}}
    with alpsck.Checkpointer(tmp_path, keep_last=0) as ck:
        with pytest.raises(StateTypeError, match="model/bad: cannot checkpoint") as e:
            ck.save(1, state)
        assert isinstance(e.value, TypeError) and isinstance(e.value, UsageError)  # both families catch it
        with pytest.raises(StateTypeError, match="state keys must be non-empty str, got 1"):
            ck.save(1, {1: torch.ones(2)})  # type: ignore[dict-item]
        ck.save(2, {"ok": torch.ones(2)}).wait()  # the refusals left the checkpointer usable
    back = {"ok": torch.zeros(2)}
    assert alpsck.restore_into(tmp_path, back) == 2 and torch.equal(back["ok"], torch.ones(2))


def _thread_nices() -> dict[int, int]:
    """Nice value of every thread of this process, from /proc (field 19 of stat; the name may hold spaces)."""
    out = {}
    for task in Path("/proc/self/task").iterdir():
        try:
            stat = (task / "stat").read_text()
        except OSError:  # the thread ended meanwhile
            continue
        out[int(task.name)] = int(stat.rsplit(")", 1)[1].split()[16])
    return out


@pytest.mark.parametrize("nice", [0, 7, None])
def test_background_nice_lowers_the_writer_and_committer_threads_and_nothing_else(tmp_path: Path,
                                                                                  nice: int | None) -> None:
    """The writers and the committer run at background_nice; the caller's thread (training) keeps its own."""
    before = _thread_nices()
    mine = os.getpriority(os.PRIO_PROCESS, 0)  # the calling thread's nice
    ck = alpsck.Checkpointer(tmp_path / "run", threads=3, background_nice=nice)
    try:
        ck.save(1, {"w": torch.arange(1000.0)})
        ck.wait()
        want = options.DEFAULTS["background_nice"] if nice is None else nice
        deadline = time.monotonic() + 10  # each thread nices itself as it starts
        while True:
            new = {t: n for t, n in _thread_nices().items() if t not in before}
            if sorted(new.values()).count(want) >= 2 or time.monotonic() > deadline:
                break
            time.sleep(0.01)
        # The committer, and the writers started so far (one at open, more as chunks are queued, up to 3).
        assert len(new) >= 2, new
        assert list(new.values()).count(want) >= 2, new
        assert os.getpriority(os.PRIO_PROCESS, 0) == mine, "the caller's own thread is left alone"
    finally:
        ck.close()


@pytest.mark.parametrize("crc_in_copy", [True, False, None])
def test_crc_in_copy_either_way_the_crcs_are_those_of_the_bytes_on_disk(tmp_path: Path,
                                                                        crc_in_copy: bool | None) -> None:
    """Wherever the chunk CRCs are taken (inside the snapshot copy, or by the writers afterwards), in
    the default and the urgent (overlapped) snapshot: both checkpoints restore bit for bit, and one
    flipped data byte makes the newest corrupt, so restore falls back to the one before."""
    from support.corrupt import flip_byte

    g = torch.Generator().manual_seed(3)
    state = {f"t{i}": torch.randn(n, generator=g) for i, n in enumerate([70_000, 3, 0, 150_000, 33_333])}
    run = tmp_path / "run"
    with alpsck.Checkpointer(run, chunk_bytes=64 << 10, keep_last=0, crc_in_copy=crc_in_copy) as ck:
        ck.save(1, state)
        ck.save(2, state, urgent=True)
    for step in (1, 2):
        live = {k: torch.full_like(v, -1.0) for k, v in state.items()}
        assert alpsck.restore_into(run, live, step=step) == step
        assert all(torch.equal(live[k], state[k]) for k in state)
    flip_byte(run / _core.step_dir_name(2) / _core.shard_file_name(0), 5 * (64 << 10) + 17)  # chunk 5's data
    live = {k: torch.zeros_like(v) for k, v in state.items()}
    with pytest.warns(RuntimeWarning, match="CRC|crc|corrupt"):
        assert alpsck.restore_into(run, live) == 1
    assert all(torch.equal(live[k], state[k]) for k in state)
