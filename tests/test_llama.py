"""The Llama reference training: model pieces, and crash + resume reproducing losses byte for byte."""

from __future__ import annotations

import importlib.util
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from alpsck.errors import ConfigError
from alpsck.examples.llama.data import SyntheticBatches, TextBatches
from alpsck.examples.llama.model import (
    ModelArgs,
    Transformer,
    apply_rope,
    ffn_hidden_dim,
    rope_frequencies,
)
from alpsck.examples.llama.train import (
    FAIL_EXIT_CODE,
    TrainConfig,
    config_from_args,
    train,
)

REPO = Path(__file__).resolve().parents[1]
TINY = ModelArgs(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64, multiple_of=32)


def test_forward_shapes_and_gqa_projections() -> None:
    torch.manual_seed(0)
    model = Transformer(TINY)
    assert model(torch.randint(0, 64, (3, 10))).shape == (3, 10, 64)
    attn = model.layers[0].attention
    assert attn.wq.weight.shape == (32, 32) and attn.wk.weight.shape == (16, 32)
    assert attn.wv.weight.shape == (16, 32) and model.output.weight.data_ptr() != model.tok_embeddings.weight.data_ptr()


def test_gqa_equals_mha_with_repeated_kv_heads() -> None:
    torch.manual_seed(0)
    gqa = Transformer(TINY)
    mha = Transformer(ModelArgs(**{**TINY.__dict__, "n_kv_heads": 4}))
    sd = gqa.state_dict()
    hd = TINY.head_dim
    for k, v in sd.items():
        if k.endswith(("wk.weight", "wv.weight")):  # kv head j serves query heads 2j, 2j+1
            sd[k] = v.view(2, hd, -1).repeat_interleave(2, dim=0).reshape(4 * hd, -1)
    mha.load_state_dict(sd)
    tokens = torch.randint(0, 64, (2, 12))
    torch.testing.assert_close(gqa(tokens), mha(tokens))


def test_rope_uses_theta_and_is_relative() -> None:
    freqs = rope_frequencies(8, 500000.0)
    torch.testing.assert_close(freqs, 500000.0 ** (-torch.arange(0, 8, 2) / 8))
    x = torch.randn(1, 6, 2, 8)
    a, b = apply_rope(x, 500000.0), apply_rope(x, 10000.0)
    torch.testing.assert_close(a[:, 0], x[:, 0])  # position 0 is not rotated
    assert not torch.allclose(a[:, 1:], b[:, 1:])
    torch.testing.assert_close(a.norm(dim=-1), x.norm(dim=-1))
    # <rope(q)_m, rope(k)_n> depends only on m - n
    q, k = torch.randn(8), torch.randn(8)
    seq = torch.stack([q if i % 2 == 0 else k for i in range(6)]).view(1, 6, 1, 8)
    r = apply_rope(seq, 500000.0)[0, :, 0]
    torch.testing.assert_close(r[2] @ r[1], r[4] @ r[3])
    m1 = Transformer(ModelArgs(**{**TINY.__dict__, "rope_theta": 10000.0}))
    m2 = Transformer(TINY)
    m2.load_state_dict(m1.state_dict())
    tokens = torch.randint(0, 64, (1, 8))
    assert not torch.allclose(m1(tokens), m2(tokens))


def test_swiglu_hidden_dim_rule() -> None:
    assert ffn_hidden_dim(4096, 1024, 1.3) == 14336  # Llama-3-8B
    assert ffn_hidden_dim(32, 256, None) == 256
    assert ffn_hidden_dim(96, 32, None) == 256  # int(2 * 384 / 3) = 256
    assert Transformer(TINY).layers[0].feed_forward.w1.weight.shape == (96, 32)


def test_llama3_8b_is_constructible_on_meta() -> None:
    args = ModelArgs(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, vocab_size=128256,
                     multiple_of=1024, ffn_dim_multiplier=1.3)
    with torch.device("meta"):
        model = Transformer(args)
    assert sum(p.numel() for p in model.parameters()) == 8_030_261_248


def test_batches_are_pure_functions_of_seed_index_rank(tmp_path: Path) -> None:
    a, b = SyntheticBatches(64, 4, 16, seed=1), SyntheticBatches(64, 4, 16, seed=1)
    b.load_state_dict({"seed": 1, "position": 5})
    for _ in range(5):
        a.next()
    assert all(torch.equal(x, y) for x, y in zip(a.next(), b.next(), strict=True))
    assert not torch.equal(SyntheticBatches(64, 4, 16, seed=1, rank=1).batch(0)[0], a.batch(0)[0])
    text = TextBatches(torch.arange(100) % 256, 2, 8, seed=0)
    inputs, targets = text.batch(3)
    assert inputs.shape == (2, 8) and torch.equal(inputs[:, 1:], targets[:, :-1])


def _cfg(tmp_path: Path, **kw: object) -> TrainConfig:
    base = {"dim": 32, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "multiple_of": 32, "sequence_length": 32,
            "batch_size": 8, "training_steps": 30, "checkpoint_freq": 0, "warmup_steps": 3, "lr": 1e-2,
            "checkpoint_dir": str(tmp_path / "ckpt"), "log_every": 0, "device": "cpu"}
    return TrainConfig(**{**base, **kw})  # type: ignore[arg-type]


def test_loss_decreases(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path, loss_file=str(tmp_path / "loss.csv"))
    train(cfg)
    losses = [float(line.split(",")[1]) for line in (tmp_path / "loss.csv").read_text().splitlines()[1:]]
    assert len(losses) == 30
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.5


def test_stop_requested_saves_and_resume_matches(tmp_path: Path) -> None:
    full = tmp_path / "full.csv"
    train(_cfg(tmp_path, training_steps=12, checkpoint_dir=str(tmp_path / "a"), loss_file=str(full)))
    polls = iter(range(100))
    cfg = _cfg(tmp_path, training_steps=12, checkpoint_freq=5, loss_file=str(tmp_path / "c.csv"))
    first = train(cfg, stop_requested=lambda: next(polls) == 7)  # polled before steps 1..8
    assert first.stopped and first.final_step == 7 and first.saved_steps == [5, 7]
    second = train(_cfg(tmp_path, training_steps=12, checkpoint_freq=5, loss_file=str(tmp_path / "c.csv"),
                        load_checkpoint=True))
    assert second.restored_step == 7 and not second.stopped and second.final_step == 12
    assert (tmp_path / "c.csv").read_bytes() == full.read_bytes()


def test_a_resume_past_a_corrupt_newest_checkpoint_keeps_its_progress(tmp_path: Path) -> None:
    """The job stops at step 25 (final checkpoint); step 25 turns out corrupt, so the next start
    resumes from 20 and stops at 25 again. That final save of step 25 used to be skipped as 'already
    committed': the corrupt checkpoint stayed, and every later start went back to step 20. Now it
    is written (the corrupt one is moved aside), the third start resumes from 25, and the loss
    trace still equals the uninterrupted run's byte for byte."""
    full = tmp_path / "full.csv"
    train(_cfg(tmp_path, training_steps=30, checkpoint_dir=str(tmp_path / "a"), loss_file=str(full)))
    loss = str(tmp_path / "c.csv")

    def stop_after(step: int, start: int) -> object:
        polls = iter(range(start + 1, 1000))  # polled before each step from start + 1 on
        return lambda: next(polls) == step + 1

    first = train(_cfg(tmp_path, training_steps=30, checkpoint_freq=10, loss_file=loss),
                  stop_requested=stop_after(25, 0))  # type: ignore[arg-type]
    assert first.saved_steps == [10, 20, 25]
    shard = tmp_path / "ckpt" / "step-000000025" / "rank-00000.bin"
    data = bytearray(shard.read_bytes())
    data[200] ^= 0x01
    shard.write_bytes(bytes(data))
    with pytest.warns(RuntimeWarning) as caught:
        second = train(_cfg(tmp_path, training_steps=30, checkpoint_freq=10, loss_file=loss, load_checkpoint=True),
                       stop_requested=stop_after(25, 20))  # type: ignore[arg-type]
    msgs = [str(w.message) for w in caught]
    assert any("step-000000025" in m and "CRC mismatch" in m for m in msgs), msgs
    assert any("abandoned history" in m for m in msgs), msgs
    assert second.restored_step == 20 and second.stopped and second.saved_steps == [25]
    third = train(_cfg(tmp_path, training_steps=30, checkpoint_freq=10, loss_file=loss, load_checkpoint=True))
    assert third.restored_step == 25 and third.final_step == 30
    assert Path(loss).read_bytes() == full.read_bytes()
    assert [p.name[:len("superseded-step-000000025")] for p in (tmp_path / "ckpt").iterdir()
            if p.name.startswith("superseded-")] == ["superseded-step-000000025"]


def test_stop_is_not_polled_after_the_last_step(tmp_path: Path) -> None:
    """A stop polled (and so taken) after the last step made the SLURM runner requeue a finished
    run, or give up on it with exit 1 when no restarts were left."""
    polls: list[int] = []
    result = train(_cfg(tmp_path, training_steps=4), stop_requested=lambda: bool(polls.append(1)))
    assert result.final_step == 4 and not result.stopped
    assert len(polls) == 4  # before steps 1, 2, 3 and 4; none after step 4


def test_text_data_file(tmp_path: Path) -> None:
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the quick brown fox jumps over the lazy dog. " * 20)
    result = train(_cfg(tmp_path, training_steps=4, vocab_size=258, data_file=str(corpus)))
    assert result.final_step == 4 and math.isfinite(result.last_loss or math.nan)


def test_cli_flags() -> None:
    cfg = config_from_args(["--load-checkpoint", "--model-dtype", "bf16", "--n-kv-heads", "8", "--dim", "4096",
                            "--n-layers", "32", "--n-heads", "32", "--checkpointer", "alpsck"])
    assert cfg.load_checkpoint and cfg.load_checkpoint_dir is None and cfg.model_dtype == "bf16"
    assert (cfg.dim, cfg.n_layers, cfg.n_heads, cfg.n_kv_heads) == (4096, 32, 32, 8)
    cfg.validate()
    assert config_from_args(["--load-checkpoint", "runs/x"]).load_checkpoint_dir == "runs/x"
    assert not config_from_args([]).load_checkpoint


def test_min_step_seconds_sets_the_pace_and_changes_no_loss(tmp_path: Path) -> None:
    fast, slow = tmp_path / "fast.csv", tmp_path / "slow.csv"
    train(_cfg(tmp_path / "a", training_steps=5, loss_file=str(fast)))
    t = time.perf_counter()
    train(_cfg(tmp_path / "b", training_steps=5, loss_file=str(slow), min_step_seconds=0.3))
    assert time.perf_counter() - t >= 5 * 0.3
    assert slow.read_text() == fast.read_text()
    for bad in (-0.1, math.nan, math.inf):
        with pytest.raises(ConfigError, match=r"min_step_seconds must be finite and >= 0"):
            train(_cfg(tmp_path / "c", min_step_seconds=bad))


def test_plot_without_matplotlib_says_how_to_install(tmp_path: Path) -> None:
    from alpsck.examples.llama import plot

    csv = tmp_path / "l.csv"
    csv.write_text("step,loss\n1,2.5\n2,2.0\n")
    out = tmp_path / "l.png"
    proc = subprocess.run([sys.executable, "-m", "alpsck.examples.llama.plot", str(csv), "-o", str(out)],
                          capture_output=True, text=True, env=_env(), check=False)
    if importlib.util.find_spec("matplotlib") is None:
        assert proc.returncode == 2 and "pip install matplotlib" in proc.stderr
    else:
        assert proc.returncode == 0 and out.stat().st_size > 0
    assert plot.read_losses(csv) == ([1, 2], [2.5, 2.0])


# ---------------------------------------------------- the torch.save baseline checkpointer

def test_torch_checkpointer_retention_and_corrupt_fallback(tmp_path: Path) -> None:
    from alpsck.errors import StateMismatchError
    from alpsck.torch_save import TorchSaveCheckpointer, checkpoint_path

    model = torch.nn.Linear(3, 2)
    with TorchSaveCheckpointer(tmp_path, keep_last=2, max_in_flight=4) as ckpt:
        for step in (10, 20, 30):
            with torch.no_grad():
                model.weight.fill_(step)
            handle = ckpt.save(step, {"model": model, "step": step})
            handle.wait()
            assert handle.done() and handle.step == step
        ckpt.wait()
    # (.lock: the run directory's writer lock, which the baseline takes too; emptied on close)
    assert [p.name for p in sorted(tmp_path.iterdir())] == [".lock", "torch-step-000000020.pt", "torch-step-000000030.pt"]
    assert (tmp_path / ".lock").read_text() == ""
    reader = TorchSaveCheckpointer(tmp_path)
    assert reader.latest_step() == 30
    newest = checkpoint_path(tmp_path, 30)
    newest.write_bytes(newest.read_bytes()[:100])  # torn file
    state = {"model": torch.nn.Linear(3, 2), "step": 0}
    with pytest.warns(UserWarning, match="torch-step-000000030.pt"):
        assert reader.restore(state) == 20
    assert state["step"] == 20 and bool((state["model"].weight == 20).all())
    with pytest.raises(StateMismatchError, match="model/weight"), pytest.warns(UserWarning, match="skipping"):
        reader.restore({"model": torch.nn.Linear(3, 4), "step": 0})
    assert TorchSaveCheckpointer(tmp_path / "empty").restore(state) is None


# --------------------------------------------------------------------- the acceptance test

def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = "1"
    return env


def _launch(tmp_path: Path, name: str, checkpointer: str, dtype: str, *extra: str) -> subprocess.Popen[str]:
    args = [sys.executable, "-m", "alpsck.examples.llama", "--seed", "3", "--training-steps", "70",
            "--checkpoint-freq", "25", "--model-dtype", dtype, "--checkpointer", checkpointer,
            "--dim", "32", "--n-layers", "2", "--n-heads", "4", "--n-kv-heads", "2", "--multiple-of", "32",
            "--sequence-length", "32", "--batch-size", "4", "--warmup-steps", "5", "--device", "cpu",
            "--torch-threads", "1", "--log-every", "0", "--checkpoint-dir", str(tmp_path / f"ckpt-{name}"),
            "--loss-file", str(tmp_path / f"{name}.csv"), *extra]
    return subprocess.Popen(args, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _finish(proc: subprocess.Popen[str], expected_rc: int = 0) -> None:
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == expected_rc, out


@pytest.mark.parametrize(("checkpointer", "dtype"), [
    ("torch", "fp32"), ("torch", "bf16"), ("alpsck", "fp32"), ("alpsck", "bf16"),
    # The pipelined snapshot (the GPU path, run here on CPU): copies overlap the next step.
    ("alpsck --overlap-copy", "bf16")])
def test_crash_and_resume_reproduces_losses_byte_for_byte(tmp_path: Path, checkpointer: str, dtype: str) -> None:
    # A, B (clean) and C's first half (crash on reaching step 51) run side by side.
    kind, *flags = checkpointer.split()
    a = _launch(tmp_path, "a", kind, dtype, *flags)
    b = _launch(tmp_path, "b", kind, dtype, *flags)
    c = _launch(tmp_path, "c", kind, dtype, "--fail-at-step", "51", *flags)
    _finish(a)
    _finish(b)
    _finish(c, FAIL_EXIT_CODE)
    assert len((tmp_path / "c.csv").read_text().splitlines()) == 1 + 50
    _finish(_launch(tmp_path, "c", kind, dtype, "--load-checkpoint", *flags))
    ref = (tmp_path / "a.csv").read_bytes()
    assert len(ref.splitlines()) == 1 + 70
    assert (tmp_path / "b.csv").read_bytes() == ref
    assert (tmp_path / "c.csv").read_bytes() == ref


@pytest.mark.parametrize("checkpointer", ["alpsck", "torch"])
def test_resume_from_another_runs_checkpoints(tmp_path: Path, checkpointer: str) -> None:
    """--load-checkpoint PATH: start from the newest checkpoint of another run, save into our own dir."""
    a = _launch(tmp_path, "a", checkpointer, "fp32")
    c = _launch(tmp_path, "c", checkpointer, "fp32", "--fail-at-step", "51")
    _finish(a)
    _finish(c, FAIL_EXIT_CODE)
    _finish(_launch(tmp_path, "d", checkpointer, "fp32", "--load-checkpoint", str(tmp_path / "ckpt-c")))
    ref = (tmp_path / "a.csv").read_text().splitlines()
    # c saved every 25 steps and crashed at 51, so its newest checkpoint is step 50, or 25 when the
    # crash beat the step-50 save to durability. d starts right after it, exactly as the clean run.
    if checkpointer == "alpsck":
        from alpsck import _core

        newest = max(i["step"] for i in _core.scan(str(tmp_path / "ckpt-c")) if i["status"] == "committed")
    else:
        newest = max(int(p.stem.rsplit("-", 1)[1]) for p in (tmp_path / "ckpt-c").glob("torch-step-*.pt"))
    assert newest in (25, 50)
    assert (tmp_path / "d.csv").read_text().splitlines() == ref[:1] + ref[newest + 1:]
    before = sorted(p.name for p in (tmp_path / "ckpt-c").iterdir())
    assert any(p.name.endswith(("000000070", "000000070.pt")) for p in (tmp_path / "ckpt-d").iterdir())
    assert sorted(p.name for p in (tmp_path / "ckpt-c").iterdir()) == before  # the source run is only read


def _launch_ddp(tmp_path: Path, name: str, port: int, *extra: str) -> subprocess.Popen[str]:
    """Two gloo ranks of the reference training under torchrun (torch.distributed.run)."""
    args = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
            "--master-port", str(port), "-m", "alpsck.examples.llama", "--training-steps", "12", "--checkpoint-freq", "5",
            "--dim", "32", "--multiple-of", "32", "--sequence-length", "16", "--batch-size", "4",
            "--warmup-steps", "2", "--device", "cpu", "--torch-threads", "1", "--log-every", "0",
            "--checkpoint-dir", str(tmp_path / f"ckpt-{name}"), "--loss-file", str(tmp_path / f"{name}.csv"), *extra]
    return subprocess.Popen(args, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_ddp_gloo_crash_and_resume(tmp_path: Path) -> None:
    """torchrun, two gloo ranks, crash at step 8, resume: rank 0's loss file equals the clean run's."""
    clean = _launch_ddp(tmp_path, "a", _free_port())
    crash = _launch_ddp(tmp_path, "c", _free_port(), "--fail-at-step", "8")
    _finish(clean)
    out, _ = crash.communicate(timeout=120)
    assert crash.returncode != 0 and f"exitcode  : {FAIL_EXIT_CODE}" in out, out  # torchrun reports the crash
    _finish(_launch_ddp(tmp_path, "c", _free_port(), "--load-checkpoint"))
    ref = (tmp_path / "a.csv").read_bytes()
    assert len(ref.splitlines()) == 13 and (tmp_path / "c.csv").read_bytes() == ref
    # Every checkpoint is sharded: one file per rank, the model and optimizer written once.
    from alpsck import _core

    infos = [i for i in _core.scan(str(tmp_path / "ckpt-c"), verify=True) if i["status"] == "committed"]
    assert infos and all(i["shards"] == ["rank-00000.bin", "rank-00001.bin"] for i in infos)
    extents = [{n for n, _, _ in _core.ShardReader(f"{infos[-1]['path']}/rank-{r:05d}.bin").extents} for r in (0, 1)]
    assert not {n for n in extents[0] & extents[1] if n.startswith(("model/", "optim/"))}
