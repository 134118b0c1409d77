"""Sixteen ranks end to end: a job killed in its save loop resumes bit for bit.

16 gloo processes train a tiny model data-parallel (gradients all-reduced), with a checkpoint
every step: the model replicated (written once, spread over the ranks), the optimizer, a per-rank
tensor, the RNG streams (each rank draws its own data from the global torch generator) and the
step. Once rank 0 has seen two checkpoints durable, every process is SIGKILLed mid-loop. 16 fresh
processes, their model, data stream and per-rank tensor deliberately wrong, restore the newest
checkpoint, train a few more steps, then train a fresh model from scratch for the same number of
steps in one go: every rank's loss sequence (the killed run's up to the restored step, then the
resumed run's) and its final parameters, optimizer state and per-rank tensor equal the
uninterrupted run's, bit for bit.

Kept light for CI on 2 cores: tiny tensors, one thread per process, a short commit timeout.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from support.ranks import free_port, kill_all, rank_env
from support.warm import WarmProcess

from alpsck import _core

WORLD = 16
EXTRA = 4  # steps trained after the restore

WORKER = r"""
import datetime, hashlib, json, os, sys, time, torch, torch.distributed as dist, alpsck
torch.set_num_threads(1)
mode, run_dir = sys.argv[1], sys.argv[2]
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
rank, world = dist.get_rank(), dist.get_world_size()
OPTIONS = dict(replicated=("model",), keep_last=2, max_in_flight=2, commit_timeout_s=20)

def build(model_seed, data_seed):
    torch.manual_seed(model_seed)  # the same model on every rank (model_seed 0), like DDP's broadcast
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    torch.manual_seed(data_seed)  # each rank its own data stream, from the global generator
    return model, opt

def train_step(model, opt, local):
    x = torch.randn(4, 8)
    y = x.sum(1, keepdim=True).sin()
    loss = torch.nn.functional.mse_loss(model(x), y)
    opt.zero_grad()
    loss.backward()
    grads = torch.cat([p.grad.flatten() for p in model.parameters()])
    dist.all_reduce(grads)
    grads /= world
    offset = 0
    for p in model.parameters():
        p.grad.copy_(grads[offset:offset + p.numel()].view_as(p))
        offset += p.numel()
    opt.step()
    local.mul_(0.5).add_(loss.detach())  # per-rank state: differs on every rank
    return loss.item()

def state(model, opt, local, step):
    return {"model": model, "optim": opt, "local": local, "rng": alpsck.RNGState(), "step": step}

def digest(model, opt, local):
    h = hashlib.sha256()
    for t in [*model.state_dict().values(), local,
              *(opt.state[p]["momentum_buffer"] for p in opt.param_groups[0]["params"])]:
        h.update(t.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()

if mode == "train":        # saves every step until killed
    model, opt = build(0, 1000 + rank)
    local = torch.zeros(1)
    ck = alpsck.Checkpointer(run_dir, **OPTIONS)
    pending = []
    for step in range(1, 100_000):
        print(f"loss {step} {train_step(model, opt, local)!r}", flush=True)
        pending.append(ck.save(step, state(model, opt, local, step)))
        for h in [h for h in pending if h.done()]:
            pending.remove(h)
            try:
                h.wait()
                print(f"durable {h.step}", flush=True)
            except alpsck.errors.CheckpointError as e:
                print(f"failed {h.step} {e}", flush=True)
        time.sleep(0.02)
elif mode == "resume":     # restores into a wrong state, trains a few steps, then the reference from scratch
    extra = int(sys.argv[3])
    model, opt = build(7 + rank, 5000 + rank)  # wrong on purpose: restore must replace all of it
    torch.randn(100)
    st = state(model, opt, torch.full((1,), -1.0), -1)
    ck = alpsck.Checkpointer(run_dir, **OPTIONS)
    restored = ck.restore(st)
    assert restored == st["step"], (restored, st["step"])
    losses = []
    for step in range(restored + 1, restored + extra + 1):
        losses.append(train_step(st["model"], st["optim"], st["local"]))
        ck.save(step, state(st["model"], st["optim"], st["local"], step))
    ck.close()
    resumed = digest(st["model"], st["optim"], st["local"])
    model, opt = build(0, 1000 + rank)  # the uninterrupted run, from scratch
    local = torch.zeros(1)
    reference = [train_step(model, opt, local) for _ in range(restored + extra)]
    print("RESULT " + json.dumps({"rank": rank, "restored": restored, "losses": losses, "reference": reference,
                                  "digest": resumed, "reference_digest": digest(model, opt, local)}), flush=True)
dist.destroy_process_group()
"""


def _launch(tmp_path: Path, logs: list[Path], *args: str) -> list[WarmProcess]:
    script = tmp_path / "scale_worker.py"
    script.write_text(WORKER)
    port = free_port()
    return [WarmProcess(script, list(args), rank_env(rank, WORLD, port), logs[rank]) for rank in range(WORLD)]


def _lines(log: Path, word: str) -> list[list[str]]:
    """The words after ``word`` on the log's complete lines (a killed process may leave half a line)."""
    return [line.split()[1:] for line in log.read_text().split("\n")[:-1] if line.startswith(word + " ")]


def test_sixteen_ranks_killed_mid_save_loop_resume_bit_for_bit(tmp_path: Path) -> None:
    run = tmp_path / "run"
    logs = [tmp_path / f"train-{r}.log" for r in range(WORLD)]
    procs = _launch(tmp_path, logs, "train", str(run))
    try:
        deadline = time.monotonic() + 120
        while len(_lines(logs[0], "durable")) < 2:  # waits on what rank 0 reports: start-up under load varies
            exited = [(r, p.returncode) for r, p in enumerate(procs) if p.poll() is not None]
            assert not exited and time.monotonic() < deadline, (
                f"no two durable checkpoints (exited: {exited}):\n" + logs[exited[0][0] if exited else 0].read_text()[-3000:])
            time.sleep(0.05)
        time.sleep(0.3)  # a few more steps: saves are in flight when the job dies
        assert all(p.poll() is None for p in procs), "a rank left its save loop before the kill"
    finally:
        kill_all(procs)
    trained = [{int(s): float(v) for s, v in _lines(log, "loss")} for log in logs]
    infos = _core.scan(str(run), verify=True)
    assert not [i for i in infos if i["status"] == "corrupt"], infos
    committed = [i for i in infos if i["status"] == "committed"]
    assert len(committed) >= 2 and all(i["ranks"] == WORLD and len(i["shards"]) == WORLD for i in committed), committed
    newest = max(i["step"] for i in committed)
    assert newest >= max(int(s) for s, *_ in _lines(logs[0], "durable"))
    # A save that failed (say, the commit timeout under load) is tolerated, but never committed.
    assert not {int(s) for log in logs for s, *_ in _lines(log, "failed")} & {i["step"] for i in committed}

    logs = [tmp_path / f"resume-{r}.log" for r in range(WORLD)]
    procs = _launch(tmp_path, logs, "resume", str(run), str(EXTRA))
    try:
        deadline = time.monotonic() + 120
        for r, p in enumerate(procs):
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
            assert p.returncode == 0, logs[r].read_text()[-3000:]
    finally:
        kill_all(procs)
    results = []
    for log in logs:
        line = next(line for line in log.read_text().splitlines() if line.startswith("RESULT "))
        results.append(json.loads(line[len("RESULT "):]))
    assert [r["rank"] for r in results] == list(range(WORLD))
    assert {r["restored"] for r in results} == {newest}
    for rank, r in enumerate(results):
        assert len(r["reference"]) == newest + EXTRA
        # The killed run up to the checkpoint, then the resumed run: the uninterrupted run's losses exactly.
        assert [trained[rank][s] for s in range(1, newest + 1)] == r["reference"][:newest], rank
        assert r["losses"] == r["reference"][newest:], rank
        assert r["digest"] == r["reference_digest"], rank  # parameters, momentum, per-rank tensor
    assert len({r["reference"][-1] for r in results}) == WORLD  # each rank its own data: a per-rank check
    # The resumed run's own saves committed too.
    steps = [i["step"] for i in _core.scan(str(run), verify=True) if i["status"] == "committed"]
    assert steps[-2:] == [newest + EXTRA - 1, newest + EXTRA], steps
