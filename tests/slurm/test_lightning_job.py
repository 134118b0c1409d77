"""Lightning's ``fit`` as an ``alpsck submit`` job on the local SLURM cluster (issue 56, item 2): the
:class:`alpsck.integrations.lightning_job.AlpsckJob` bridge, with the recipe of docs/lightning.md
(tests/support/lightning_job_worker.py)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from support.slurm_helpers import TERMINAL, events, final_state, submit, wait_done, wait_for

from alpsck import _core
from alpsck.store.picker import pick

SUPPORT = Path(__file__).resolve().parents[1] / "support"


def _ended(run: Path) -> bool:
    return final_state(run) in TERMINAL


def _steps(losses: Path) -> list[int]:
    try:
        return [int(line.split()[0]) for line in losses.read_text().splitlines()]
    except FileNotFoundError:
        return []


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_a_lightning_fit_stops_at_a_time_limit_and_a_preemption_and_resumes_bit_exact(cluster: None, tmp_path: Path,
                                                                                      strategy: str) -> None:
    """Two ranks (gloo), dropout, a resumable loader; a checkpoint every 10 steps. DDP, its checkpoints through
    the CheckpointIO plugin; or FSDP2, every rank writing its shard as a DCP step of the run directory. A time-limit signal (USR2)
    in the first start, SIGTERM (a preemption's: the job stays RUNNING) in the second. Each time: a final
    checkpoint at the next optimizer step, written durably into the run directory, then the requeue, and the next
    start resumes from exactly that step. SIGTERM is the case Lightning would have answered itself, raising at its
    next batch before any checkpoint. The losses of every step equal an uninterrupted fit's, bit for bit: the
    model, the optimizer, the scheduler, the loader's position in its epoch and every rank's dropout stream."""
    steps, pace = 60, 0.25
    for worker in ("lightning_job_worker.py", "lightning_worker.py"):
        shutil.copy(SUPPORT / worker, tmp_path)
    run, losses = tmp_path / "run", tmp_path / "losses.txt"
    cfg = tmp_path / "job.yaml"
    cfg.write_text(f"name: lightning\nrun_dir: {run}\n"
                   "slurm:\n  time: '5'\n  cpus_per_task: 1\n  tasks_per_node: 2\n  mem: 2G\n  partition: debug\n"
                   f"entry:\n  function: lightning_job_worker:main\n  args: ['{losses}', '{steps}', '{pace}', {strategy}]\n"
                   "checkpoint:\n  every_steps: 10\n  keep_last: 2\n  keep_every_steps: 20\n  keep_best: loss:min:1\n"
                   "requeue:\n  signal_delay_s: 60\n  max_restarts: 5\n")
    reference = tmp_path / "reference.txt"  # meanwhile: Lightning starts its second rank itself
    clean = subprocess.Popen([sys.executable, str(tmp_path / "lightning_job_worker.py"), str(reference), str(steps),
                              strategy], cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        job = submit(cfg)
        # The signals go to a training that has run 12 steps, then to the next start's step 32: each leaves at least
        # 28 steps (7 s) before the job would be done. (CI once ran the reference first: the job had finished.)
        wait_for(lambda: len(_steps(losses)) >= 12 or _ended(run), 300, "the first start's 12th step", poll=0.1)
        assert not _ended(run), events(run)
        subprocess.run(["scancel", "--signal=USR2", job], check=True, timeout=30)
        wait_for(lambda: len(events(run, "started")) == 2 and _steps(losses)[-1] >= 32, 300,
                 "the second start's step 32", poll=0.1)
        subprocess.run(["scancel", "--signal=TERM", job], check=True, timeout=30)
        assert wait_done(run, job, 600) == "finished", events(run)
    finally:
        _, err = clean.communicate(timeout=600)
    assert clean.returncode == 0, err[-3000:]

    assert losses.read_text() == reference.read_text()  # steps 1..60 once each: no step trained twice
    finals, starts = events(run, "final_checkpoint"), events(run, "started")
    assert [e["reason"] for e in events(run, "requeued")] == [e["reason"] for e in finals] == ["timeout", "preemption"]
    assert [s.get("step") for s in starts] == [None, *(e["step"] for e in finals)], events(run)
    assert 12 <= finals[0]["step"] < finals[1]["step"] < steps and not events(run, "failed"), events(run)
    assert events(run, "finished")[0]["step"] == steps  # the last periodic checkpoint: every 10 steps
    kind = "dcp" if strategy == "fsdp" else "alpsck"  # each rank's shard, or rank 0's whole state
    assert pick(run, kind=kind, verify_data=True).step == steps
    # The config's retention, by either route (the Checkpointer's engine, or the DCP writer's): the newest 2, every
    # 20th and the lowest loss (rank 0's, which the bridge records from what the model logged) of the checkpoints
    # written (every 10 steps, and the two final ones).
    written = {*range(10, steps + 1, 10), *(e["step"] for e in finals)}
    loss = {int(s): float.fromhex(v) for s, v in (line.split() for line in losses.read_text().splitlines())}
    infos = {i["step"]: i for i in _core.scan(str(run)) if i["status"] == "committed"}
    best = min(written, key=lambda s: loss[s])
    want = {s for s in written if s % 20 == 0} | set(sorted(written)[-2:]) | {best}
    assert sorted(infos) == sorted(want), (sorted(infos), sorted(written), {s: loss[s] for s in written})
    assert all(i["metrics"] == {"loss": loss[s]} for s, i in infos.items()), infos
