"""The multi-node local SLURM (slurm/local-cluster/start.sh --nodes N): each node in its own network, UTS
and mount namespaces, beside the one-node cluster. What the memory tier and the spare nodes will stand on:
a job spans the nodes, each node has its own host name, address and /dev/shm, and a killed node loses
its processes and its /dev/shm while SLURM records the failure and a --no-kill job keeps its allocation.

The tests share the cluster the module starts (and stops), so they run one after the other on one pytest-xdist
worker (``xdist_group``; tests/run.sh runs the tier with ``--dist loadgroup``). In CI they must run: as root, with
iproute2 and util-linux, which .ci/run's machine has; elsewhere they skip without them.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from support.slurm_helpers import clean_losses, events, job_config, submit, wait_done, wait_for

pytestmark = pytest.mark.xdist_group("multi-node-cluster")

HERE = Path(__file__).resolve().parents[2] / "slurm" / "local-cluster"
NODES = ["alpsck-n1", "alpsck-n2", "alpsck-n3"]
CONF = "/var/lib/alpsck-slurm-nodes/etc/slurm.conf"
ENV = {**os.environ, "SLURM_CONF": CONF}


def _sh(*cmd: str, timeout: float = 120, check: bool = True) -> str:
    r = subprocess.run(list(cmd), capture_output=True, text=True, timeout=timeout, env=ENV)
    if check:
        assert r.returncode == 0, f"{cmd}: exit {r.returncode}\n{r.stdout}\n{r.stderr}"
    return r.stdout


def _state(node: str) -> str:
    return _sh("sinfo", "-h", "-n", node, "-o", "%t").strip()


def _job_state(job: str) -> str:
    return _sh("squeue", "-h", "-j", job, "-o", "%T", check=False).strip()


@pytest.fixture(scope="module")
def nodes() -> object:
    missing = [t for t in ("ip", "unshare", "nsenter", "slurmctld") if shutil.which(t) is None]
    if os.geteuid() != 0 or missing:
        msg = f"the multi-node cluster needs root and {', '.join(missing) or 'namespaces'}"
        if os.environ.get("CI"):
            pytest.fail(msg)
        pytest.skip(msg)
    r = subprocess.run(["bash", str(HERE / "start.sh"), "--nodes", "3"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"export SLURM_CONF={CONF}" in r.stdout, r.stdout
    yield
    subprocess.run(["bash", str(HERE / "stop.sh"), "--nodes"], capture_output=True, text=True, timeout=300)


def test_three_nodes_each_with_its_own_name_address_and_dev_shm_and_a_killed_node_is_a_node_failure(
        nodes: object, tmp_path: Path) -> None:
    # 1. A job over the three nodes: one task per node, each on its own host with its own address, and a
    # file one task leaves in /dev/shm is seen by no other node.
    out = tmp_path / "out"
    script = tmp_path / "spread.sh"
    script.write_text("#!/bin/bash\nsrun -N 3 -n 3 bash -c 'touch /dev/shm/mark-$(hostname); "
                      "echo \"$(hostname) $(hostname -I | tr -d \" \") $(ls /dev/shm | tr \"\\n\" ,)\"'\n")
    job = _sh("sbatch", "--parsable", "-N", "3", "-o", str(out), str(script)).strip().split(";")[0]
    wait_for(lambda: _job_state(job) == "" and out.exists() and len(out.read_text().splitlines()) == 3, 120,
             f"job {job} on three nodes")
    rows = sorted(line.split(" ") for line in out.read_text().splitlines())
    assert [r[0] for r in rows] == NODES, rows
    assert [r[1] for r in rows] == ["10.77.0.11", "10.77.0.12", "10.77.0.13"], rows
    assert [r[2] for r in rows] == [f"mark-{n}," for n in NODES], rows  # its own mark, nobody else's
    # node.sh runs a command inside a node: its /dev/shm holds the mark the job left there, the host's does not.
    assert _sh("bash", str(HERE / "node.sh"), "alpsck-n2", "ls", "/dev/shm").split() == ["mark-alpsck-n2"]
    assert not Path("/dev/shm/mark-alpsck-n2").exists()

    # 2. A --no-kill job on all three; node 2 killed: its processes and /dev/shm gone, SLURM marks it down,
    # and the job keeps its allocation and id and can start a step on the survivors (srun --exclude).
    go, after = tmp_path / "go", tmp_path / "after"
    script.write_text("#!/bin/bash\nsrun --overlap -N 3 -n 3 sleep 600 &\n"
                      f"while [ ! -e {go} ]; do sleep 0.5; done\n"
                      f"srun --overlap -N 2 -n 2 --exclude alpsck-n2 hostname > {after}\n")
    job = _sh("sbatch", "--parsable", "--no-kill", "-N", "3", "-o", str(tmp_path / "nokill.out"),
              str(script)).strip().split(";")[0]
    wait_for(lambda: _job_state(job) == "RUNNING", 120, f"job {job} to run")
    wait_for(lambda: "sleep" in _sh("bash", str(HERE / "node.sh"), "alpsck-n2", "pgrep", "-a", "sleep", check=False),
             60, "the step's task on alpsck-n2")
    killed = _sh("bash", str(HERE / "kill-node.sh"), "alpsck-n2", timeout=90)
    assert "alpsck-n2 killed" in killed and "SLURM says alpsck-n2 is 'down" in killed, killed
    r = subprocess.run(["bash", str(HERE / "node.sh"), "alpsck-n2", "true"], capture_output=True, text=True, env=ENV)
    assert r.returncode != 0 and "is down" in r.stderr, r.stderr
    reason = _sh("sinfo", "-h", "-R", "-n", "alpsck-n2", "-o", "%E")
    assert "Not responding" in reason or "not responding" in reason.lower(), reason
    assert _job_state(job) == "RUNNING"  # --no-kill: the allocation survives the node
    go.touch()
    wait_for(lambda: after.exists() and len(after.read_text().split()) == 2, 120, "a step on the two survivors")
    assert sorted(after.read_text().split()) == ["alpsck-n1", "alpsck-n3"]
    _sh("scancel", job)

    # 3. start.sh again brings node 2 back, with an empty /dev/shm; the others keep theirs.
    t0 = time.monotonic()
    _sh("bash", str(HERE / "start.sh"), "--nodes", "3", timeout=300)
    assert _state("alpsck-n2") in ("idle", "mix", "alloc"), _state("alpsck-n2")
    assert _sh("bash", str(HERE / "node.sh"), "alpsck-n2", "ls", "/dev/shm").split() == []
    assert _sh("bash", str(HERE / "node.sh"), "alpsck-n1", "ls", "/dev/shm").split() == ["mark-alpsck-n1"]
    assert time.monotonic() - t0 < 60


# The reference training with two faults, as a user's entry module beside the config (issue 54's acceptance).
_FAULTS = '''"""The reference training; on the job step's first start rank 1 SIGKILLs itself at step {kill_at} (once its
node holds the memory checkpoint of step {memory_at}); on the second start rank 2 writes its host name to a mark at
step {node_at} and waits there, for its node to be killed from outside."""
import glob
import os
import pathlib
import signal
import time

from alpsck.examples.llama.train import slurm_entry


def main(job):
    attempt = os.environ.get("ALPSCK_ATTEMPT", "0")
    due = job.checkpoint_due

    def checkpoint_due(step):
        if attempt == "0" and job.rank == 1 and step == {kill_at}:
            t0 = time.monotonic()
            while not glob.glob("/dev/shm/alpsck-*/*/ranks-00000-00001/step-{memory_at:09d}") and time.monotonic() - t0 < 120:
                time.sleep(0.05)
            os.kill(os.getpid(), signal.SIGKILL)
        if attempt == "1" and job.rank == 2 and step == {node_at}:
            pathlib.Path({mark!r}).write_text(os.uname().nodename)
            time.sleep(3600)
        return due(step)

    job.checkpoint_due = checkpoint_due
    return slurm_entry(job)
'''


def test_a_job_restarts_from_memory_after_a_rank_dies_and_on_the_spare_from_the_replica_after_its_node_dies(
        nodes: object, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 54's acceptance through ``alpsck submit``: two nodes of two ranks and a spare (``slurm.spare_nodes: 1``,
    --no-kill), a memory checkpoint every 5 steps and one to the run directory every 50. Rank 1 SIGKILLed at step
    37: the step restarts in the allocation, from step 35 in its node's memory. Node 2 killed at step 57 (its
    processes and /dev/shm): SLURM drops it from the job, and the step restarts on node 1 and the spare, node 2's
    ranks from the replica of step 55 in node 1's memory. One job id, no requeue, the losses of an uninterrupted
    run bit for bit, and ``status --json`` names each restart's tier."""
    monkeypatch.setenv("SLURM_CONF", CONF)
    _sh("bash", str(HERE / "start.sh"), "--nodes", "3", timeout=300)  # every node up (the test above killed one)
    steps, mark = 70, tmp_path / "at-step-57"
    conf = tmp_path / "conf"
    conf.mkdir()
    (conf / "faults.py").write_text(_FAULTS.format(kill_at=37, memory_at=35, node_at=57, mark=str(mark)))
    run = tmp_path / "run"
    job = submit(job_config(conf / "job.yaml", run, steps=steps, time="10", every=50, tasks=2, entry="faults:main",
                            slurm_extra="nodes: 2\nspare_nodes: 1", checkpoint_extra="memory_every: 5"))
    clean = clean_losses(tmp_path, steps, world=4)  # meanwhile
    wait_for(mark.exists, 420, f"job {job}: the second start at step 57", poll=0.5)
    assert mark.read_text() == "alpsck-n2"

    def held(node: str) -> list[str]:
        found = _sh("bash", str(HERE / "node.sh"), node, "bash", "-c", "ls -d /dev/shm/alpsck-*/*/ranks-*/step-*",
                    check=False).split()
        return sorted(p.split("/")[-2] + "/" + p.split("/")[-1] for p in found)

    # Each node holds its own ranks' checkpoint and the other node's replica (step 55 at least: 60 is not reached).
    wait_for(lambda: "ranks-00002-00003/step-000000055" in held("alpsck-n1"), 60, "node 2's replica of step 55")
    assert "ranks-00000-00001/step-000000055" in held("alpsck-n1") and "ranks-00000-00001/step-000000055" in held(
        "alpsck-n2"), (held("alpsck-n1"), held("alpsck-n2"))
    _sh("bash", str(HERE / "kill-node.sh"), "alpsck-n2", timeout=90)
    assert wait_done(run, job, 420) == "finished", events(run)
    assert (run / "loss.csv").read_text() == clean
    evs = events(run)
    assert all(e["job_id"] == job for e in evs) and not events(run, "requeued"), evs
    starts = events(run, "started")
    assert [s.get("attempt", 0) for s in starts] == [0, 1, 2], starts
    assert [(r["step"], r["tier"]) for r in events(run, "restored")] == [(35, "memory"), (55, "replica")], evs
    assert all(r["taken_at"] > starts[0]["time"] for r in events(run, "restored")), evs  # goodput's work lost
    doc = json.loads(_sh(sys.executable, "-m", "alpsck", "status", str(run), "--json"))
    assert [r["tier"] for r in doc["goodput"]["restarts"]] == ["memory", "replica"], doc["goodput"]
    text = _sh(sys.executable, "-m", "alpsck", "status", str(run))
    assert "restored from memory 1, a replica 1" in text, text
    reason = _sh("sinfo", "-h", "-R", "-n", "alpsck-n2", "-o", "%E")  # SLURM's own record of the node's failure
    assert "not responding" in reason.lower(), reason
    assert _sh("squeue", "-h", "-j", job, "-o", "%T", check=False).strip() == ""


# Bad memory copies, then a time-limit stop (issue 54's last two acceptance points), as a user's entry module.
_BAD_COPIES = '''"""The reference training on two nodes of one rank. First start: at step 12 node 1's own memory copy of step 10
is made bad (once node 2 holds its replica) and rank 0 SIGKILLs itself. Second start: at step 22 both copies of
step 20 (node 1's own, node 2's replica) are made bad, and rank 0 dies again. Third start: at step 42 both ranks
wait for the stop signal (the test shortens the job's time limit). Only in the first allocation."""
import glob
import os
import pathlib
import signal
import time

from alpsck.examples.llama.train import slurm_entry

MARKS = pathlib.Path({marks!r})
COPY = "/dev/shm/alpsck-*/*/ranks-00000-00000/step-{{:09d}}/rank-*.bin"  # node 1's ranks, in this node's memory


def wait_for(pattern_or_mark):
    t0 = time.monotonic()
    while time.monotonic() - t0 < 120:
        found = sorted(glob.glob(str(pattern_or_mark)))
        if found:
            return found[0]
        time.sleep(0.05)
    raise SystemExit(f"faults: nothing at {{pattern_or_mark}} after 120 s")


def flip(path):
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0x04]))


def main(job):
    due, first_allocation = job.checkpoint_due, os.environ.get("SLURM_RESTART_COUNT", "0") == "0"
    attempt = os.environ.get("ALPSCK_ATTEMPT", "0")

    def checkpoint_due(step):
        if first_allocation and (attempt, step) in (("0", 12), ("1", 22)):
            memory_step = step - 2
            if job.rank == 1:  # node 2: its replica of node 1's step is there (and, the second time, made bad)
                replica = wait_for(COPY.format(memory_step))
                if attempt == "1":
                    flip(replica)
                (MARKS / f"replica-{{memory_step}}").touch()
            else:  # node 1: its own copy made bad, then the rank dies
                wait_for(MARKS / f"replica-{{memory_step}}")
                flip(wait_for(COPY.format(memory_step)))
                os.kill(os.getpid(), signal.SIGKILL)
        if first_allocation and attempt == "2" and step == 42:
            (MARKS / f"at-42-rank-{{job.rank}}").touch()
            while not job.stop_requested():
                time.sleep(0.1)
        return due(step)

    job.checkpoint_due = checkpoint_due
    return slurm_entry(job)
'''


def _elapsed_s(job: str) -> int:
    """The job's elapsed time as squeue says it (M:SS, H:MM:SS or D-H:MM:SS)."""
    text = _sh("squeue", "-h", "-j", job, "-o", "%M").strip()
    days, _, clock = text.rpartition("-")
    seconds = 0
    for part in clock.split(":"):
        seconds = 60 * seconds + int(part)
    return seconds + 86400 * int(days or 0)


def test_bad_memory_copies_fall_back_to_the_replica_then_the_run_directory_and_a_time_limit_stop_requeues(
        nodes: object, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 54's acceptance on the multi-node SLURM, two nodes of one rank, memory every 5 steps, the run directory
    every 15. Node 1's own copy of step 10 bad: its rank reads node 2's replica, with one warning. Both copies of
    step 20 bad: every rank reads the run directory's step 15, with one warning each; never a loop. Then a
    time-limit stop (the job's limit shortened while it waits at step 42, not a memory step): the final checkpoint
    goes to the run directory and the requeued job resumes from it. The losses of an uninterrupted run, bit for
    bit."""
    monkeypatch.setenv("SLURM_CONF", CONF)
    _sh("bash", str(HERE / "start.sh"), "--nodes", "3", timeout=300)  # every node up (a test above killed one)
    steps, marks = 100, tmp_path / "marks"
    marks.mkdir()
    conf = tmp_path / "conf"
    conf.mkdir()
    (conf / "faults.py").write_text(_BAD_COPIES.format(marks=str(marks)))
    run = tmp_path / "run"
    job = submit(job_config(conf / "job.yaml", run, steps=steps, time="10", every=15, tasks=1, entry="faults:main",
                            slurm_extra="nodes: 2", checkpoint_extra="memory_every: 5",
                            extra_args=["--min-step-seconds", "0.1"]))
    clean = clean_losses(tmp_path, steps, world=2)  # meanwhile
    wait_for(lambda: len(list(marks.glob("at-42-rank-*"))) == 2, 420, f"job {job}: its third start at step 42", poll=0.5)
    # A time limit that leaves 45-105 s: under the signal's 60 s, SLURM signals the job at its next check.
    _sh("scontrol", "update", f"JobId={job}", f"TimeLimit={-(-(_elapsed_s(job) + 45) // 60)}")
    assert wait_done(run, job, 420) == "finished", events(run)
    assert (run / "loss.csv").read_text() == clean
    assert [(r["step"], r["tier"]) for r in events(run, "restored")] == [(10, "replica")], events(run)
    [requeued] = events(run, "requeued")
    [final] = events(run, "final_checkpoint")
    assert requeued["reason"] == "timeout" and final["reason"] == "timeout" and final["step"] >= 42, events(run)
    starts = events(run, "started")
    assert [(s.get("restart", 0), s.get("attempt", 0)) for s in starts] == [(0, 0), (0, 1), (0, 2), (1, 0)], starts
    assert [s.get("step") for s in starts[1:]] == [None, 15, final["step"]], starts  # the run directory's picks
    doc = json.loads(_sh(sys.executable, "-m", "alpsck", "status", str(run), "--json"))
    assert [r["tier"] for r in doc["goodput"]["restarts"]] == ["replica", "run_dir", "run_dir"], doc["goodput"]
    # One warning per bad copy on the rank that read it (each task's log: its steps' output, appended), and one on
    # every rank for the run directory's fall back.
    logs = [(run / "submitit" / f"{job}_{task}_log.out").read_text() for task in (0, 1)]
    own = [re.findall(r"the memory copy of step (\d+) of ranks \S+ is not usable", log) for log in logs]
    assert own == [["10", "20"], []], logs[0][-3000:]  # node 1's own copies; node 2's were good
    whole = [re.findall(r"the memory checkpoint of step (\d+) is not usable for every node's ranks", log) for log in logs]
    assert whole == [["20"], ["20"]], logs[1][-3000:]


# The reference training; in the job's first allocation rank 1 marks step 12 and waits there, for nodes to be killed.
_WAIT_AT_12 = '''import os
import pathlib
import time

from alpsck.examples.llama.train import slurm_entry


def main(job):
    due = job.checkpoint_due

    def checkpoint_due(step):
        if os.environ.get("SLURM_RESTART_COUNT", "0") == "0" and job.rank == 1 and step == 12:
            pathlib.Path({mark!r}).write_text(os.uname().nodename)
            time.sleep(3600)
        return due(step)

    job.checkpoint_due = checkpoint_due
    return slurm_entry(job)
'''


def test_a_job_left_with_too_few_nodes_is_requeued_says_so_and_resumes_bit_exact(
        nodes: object, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two nodes of one rank and a spare, the run directory every 10 steps. At step 12 both nodes beside the batch
    host die (rank 1's and the spare): one usable node is left and the job step needs two, so the batch script
    requeues the job instead of a restart in the allocation. The history says so (``requeued``, reason ``nodes``,
    written by the batch shell), ``alpsck status`` too, and SLURM holds the job pending. With the nodes back, the
    same job id starts again, resumes from step 10 and ends with the losses of an uninterrupted run, bit for bit."""
    monkeypatch.setenv("SLURM_CONF", CONF)
    _sh("bash", str(HERE / "start.sh"), "--nodes", "3", timeout=300)  # every node up (a test above killed one)
    steps, mark = 30, tmp_path / "at-step-12"
    conf = tmp_path / "conf"
    conf.mkdir()
    (conf / "faults.py").write_text(_WAIT_AT_12.format(mark=str(mark)))
    run = tmp_path / "run"
    job = submit(job_config(conf / "job.yaml", run, steps=steps, time="10", every=10, tasks=1, entry="faults:main",
                            slurm_extra="nodes: 2\nspare_nodes: 1", extra_args=["--min-step-seconds", "0.1"]))
    clean = clean_losses(tmp_path, steps, world=2)  # meanwhile
    wait_for(mark.exists, 300, f"job {job}: rank 1 at step 12", poll=0.5)
    batch_host = _job_field(job, "BatchHost")
    kills = [subprocess.Popen(["bash", str(HERE / "kill-node.sh"), node], env=ENV, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for node in NODES if node != batch_host]
    for k in kills:
        out, _ = k.communicate(timeout=90)
        assert k.returncode == 0, out
    wait_for(lambda: events(run, "requeued"), 180, f"job {job}: the requeue for too few nodes", poll=1)
    [requeued] = events(run, "requeued")
    assert (requeued["reason"], requeued["mechanism"], requeued["job_id"], requeued["host"]) == (
        "nodes", "scontrol", job, batch_host), requeued
    wait_for(lambda: _job_state(job) == "PENDING", 60, f"job {job} pending after its requeue")
    doc = json.loads(_sh(sys.executable, "-m", "alpsck", "status", str(run), "--json"))
    assert doc["state"] == "requeued", doc
    _sh("bash", str(HERE / "start.sh"), "--nodes", "3", timeout=300)  # the nodes back: the job can run again
    assert wait_done(run, job, 420) == "finished", events(run)
    assert (run / "loss.csv").read_text() == clean
    starts = events(run, "started")
    assert [(s.get("restart", 0), s.get("attempt", 0)) for s in starts] == [(0, 0), (1, 0)], starts
    assert starts[1].get("step") == 10 and all(e["job_id"] == job for e in events(run)), events(run)


def _read_only_in(node: str, path: Path) -> None:
    """``path`` read-only as ``node`` sees it (a read-only bind mount in its own mount namespace: the host and the
    other nodes still write there); undone by :func:`_writable_in`."""
    _sh("bash", str(HERE / "node.sh"), node, "mount", "--bind", "-o", "ro", str(path), str(path))
    r = subprocess.run(["bash", str(HERE / "node.sh"), node, "touch", str(path / "probe")], capture_output=True,
                       text=True, env=ENV)
    assert r.returncode != 0 and "Read-only file system" in r.stderr, r.stderr


def _writable_in(node: str, path: Path) -> None:
    _sh("bash", str(HERE / "node.sh"), node, "umount", str(path), check=False)


# The reference training, as a user's entry module, each rank leaving a mark named after its node and attempt.
_WHERE = '''import os
import pathlib

from alpsck.examples.llama.train import slurm_entry


def main(job):
    pathlib.Path({marks!r}, f"{{job.job_id}}-{{os.environ.get('ALPSCK_ATTEMPT', '0')}}-rank{{job.rank}}-"
                 f"{{os.uname().nodename}}").touch()
    return slurm_entry(job)
'''


def _where_config(tmp_path: Path, name: str, run: Path, slurm_extra: str, health: str = "") -> tuple[Path, Path]:
    """A job config of 20 steps gated by the health gate (and ``health``'s keys), whose ranks mark where they ran
    (:data:`_WHERE`)."""
    marks, conf = tmp_path / f"{name}-marks", tmp_path / f"{name}-conf"
    marks.mkdir()
    conf.mkdir()
    (conf / "where.py").write_text(_WHERE.format(marks=str(marks)))
    return job_config(conf / "job.yaml", run, steps=20, time="10", every=10, tasks=1, entry="where:main",
                      slurm_extra=slurm_extra, health="gate: true\n" + health), marks


def _beside_a_bad_node(tmp_path: Path, bad: Any, good: Any, health: str = "") -> tuple[str, Path, Path]:
    """A job of two nodes and a spare, gated, submitted while ``bad(run_dir)`` holds and undone by ``good(run_dir)``
    once it finished: its id, run directory and the directory of its ranks' marks."""
    run = tmp_path / "run"
    run.mkdir()
    cfg, marks = _where_config(tmp_path, "spare", run, "nodes: 2\nspare_nodes: 1", health)
    bad(run)
    try:
        job = submit(cfg)
        assert wait_done(run, job, 300) == "finished", events(run)
    finally:
        good(run)
    return job, run, marks


def _job_field(job: str, name: str) -> str:
    """One field of SLURM's record of ``job`` (scontrol show job: kept MinJobAge, 120 s, after its end)."""
    found = re.search(rf"\b{name}=(\S*)", _sh("scontrol", "show", "job", job))
    assert found, _sh("scontrol", "show", "job", job)
    return found.group(1)


def test_a_node_that_fails_the_health_gate_is_cordoned_and_never_runs_a_step_of_the_training(
        nodes: object, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 55's first acceptance point: three nodes, the job needs two (``spare_nodes: 1``) and gates every start.
    Node 2's view of the run directory is read-only: the gate cordons it (``run_dir``, the error it met), the job
    runs on nodes 1 and 3, no step of the training ever runs on node 2, and ``status`` says why."""
    monkeypatch.setenv("SLURM_CONF", CONF)
    _sh("bash", str(HERE / "start.sh"), "--nodes", "3", timeout=300)
    job, run, marks = _beside_a_bad_node(tmp_path, lambda run: _read_only_in("alpsck-n2", run),
                                         lambda run: _writable_in("alpsck-n2", run))
    [c] = events(run, "cordoned")
    assert (c["node"], c["checks"], c["job_id"]) == ("alpsck-n2", "run_dir", job), c
    assert "Read-only file system" in c["reason"], c
    # The training ran once, on nodes 1 and 3: never on node 2.
    assert sorted(p.name for p in marks.iterdir()) == [f"{job}-0-rank0-alpsck-n1", f"{job}-0-rank1-alpsck-n3"]
    assert not events(run, "requeued") and len(events(run, "started")) == 1, events(run)
    doc = json.loads(_sh(sys.executable, "-m", "alpsck", "status", str(run), "--json"))
    assert [(x["node"], x["checks"]) for x in doc["cordoned"]] == [("alpsck-n2", "run_dir")], doc["cordoned"]
    text = _sh(sys.executable, "-m", "alpsck", "status", str(run))
    assert "cordoned: alpsck-n2 since " in text and "Read-only file system" in text, text


def test_a_cordoned_node_is_excluded_by_slurm_after_the_requeue_and_with_none_left_the_run_gives_up(
        nodes: object, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 55's acceptance on exclusion: a job of two nodes and no spare lands on nodes 1 and 2, node 2 fails the
    gate: the job's own record excludes it (ExcNodeList) and the job is requeued, and its next allocation, which
    SLURM makes, is nodes 1 and 3, where it finishes. A job that needs all three nodes cannot get enough healthy
    ones: it gives up at once, exit 93, which SLURM records as FAILED 93:0."""
    monkeypatch.setenv("SLURM_CONF", CONF)
    _sh("bash", str(HERE / "start.sh"), "--nodes", "3", timeout=300)
    run, run3 = tmp_path / "run", tmp_path / "run3"
    run.mkdir()
    run3.mkdir()
    cfg, marks = _where_config(tmp_path, "two", run, "nodes: 2")
    cfg3, marks3 = _where_config(tmp_path, "three", run3, "nodes: 3")
    _read_only_in("alpsck-n2", tmp_path)
    try:
        job = submit(cfg)
        assert wait_done(run, job, 300) == "finished", events(run)
        assert _job_field(job, "ExcNodeList") == "alpsck-n2"
        job3 = submit(cfg3)
        assert wait_done(run3, job3, 300) == "gave_up", events(run3)
        assert (_job_field(job3, "JobState"), _job_field(job3, "ExitCode")) == ("FAILED", "93:0")
    finally:
        _writable_in("alpsck-n2", tmp_path)
    [c] = events(run, "cordoned")
    assert (c["node"], c["job_id"]) == ("alpsck-n2", job) and "Read-only file system" in c["reason"], c
    [rq] = events(run, "requeued")
    assert (rq["reason"], rq["job_id"]) == ("health", job), rq
    # The first allocation (nodes 1 and 2) ran no step of the training; the requeued job's ran on nodes 1 and 3.
    assert sorted(p.name for p in marks.iterdir()) == [f"{job}-0-rank0-alpsck-n1", f"{job}-0-rank1-alpsck-n3"]
    assert _job_field(job, "NodeList") == "alpsck-n[1,3]"
    [g] = events(run3, "gave_up")
    assert g["exit_code"] == 93 and "no allocation can hold enough healthy nodes" in g["message"], g
    assert list(marks3.iterdir()) == [] and not events(run3, "started"), events(run3)


# The reference training, whose rank on alpsck-n2 SIGKILLs itself 8 steps into every start (after a checkpoint).
_BAD_NODE = '''import os
import signal

from alpsck.examples.llama.train import slurm_entry


def main(job):
    due = job.checkpoint_due
    first = []

    def checkpoint_due(step):
        first.append(step)
        if os.uname().nodename == "alpsck-n2" and step == first[0] + 7:
            os.kill(os.getpid(), signal.SIGKILL)
        return due(step)

    job.checkpoint_due = checkpoint_due
    return slurm_entry(job)
'''


def test_a_node_the_job_step_fails_on_first_twice_is_cordoned_and_the_restart_takes_the_spare(
        nodes: object, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 55's second acceptance point: two nodes of one rank and a spare; the rank on node 2 dies (SIGKILL) 8
    steps into every start. srun says where: each restart's gate traces the step before to node 2, and after the
    second the node is cordoned and the restart goes to nodes 1 and 3. The losses of an uninterrupted run, bit for
    bit; one job, no requeue."""
    monkeypatch.setenv("SLURM_CONF", CONF)
    _sh("bash", str(HERE / "start.sh"), "--nodes", "3", timeout=300)
    steps = 20
    conf = tmp_path / "conf"
    conf.mkdir()
    (conf / "badnode.py").write_text(_BAD_NODE)
    run = tmp_path / "run"
    job = submit(job_config(conf / "job.yaml", run, steps=steps, time="10", every=5, tasks=1, entry="badnode:main",
                            slurm_extra="nodes: 2\nspare_nodes: 1", health="gate: true"))
    clean = clean_losses(tmp_path, steps, world=2)  # meanwhile
    assert wait_done(run, job, 400) == "finished", events(run)
    assert (run / "loss.csv").read_text() == clean
    traced = [(e["attempt"], e["node"], e["task"], e["message"]) for e in events(run, "traced")]
    assert traced == [(0, "alpsck-n2", 1, "Killed"), (1, "alpsck-n2", 1, "Killed")], events(run)
    [c] = events(run, "cordoned")
    assert (c["node"], c["checks"], c["attempt"]) == ("alpsck-n2", "failures", 2), c
    starts = events(run, "started")
    assert [(s.get("attempt", 0), s.get("step")) for s in starts] == [(0, None), (1, 5), (2, 10)], starts
    assert not events(run, "requeued") and all(e["job_id"] == job for e in events(run)), events(run)
    doc = json.loads(_sh(sys.executable, "-m", "alpsck", "status", str(run), "--json"))
    assert [x["node"] for x in doc["cordoned"]] == ["alpsck-n2"], doc["cordoned"]
    [bad] = doc["goodput"]["bad_nodes"]  # what node 2's two failures cost
    assert (bad["node"], bad["failures"]) == ("alpsck-n2", 2) and bad["cost_s"] > 0, doc["goodput"]
    assert [r.get("node") for r in doc["goodput"]["restarts"]] == ["alpsck-n2", "alpsck-n2"], doc["goodput"]


def _slow_link(node: str, rate: str | None) -> None:
    """``node``'s link to the bridge limited to ``rate`` both ways (a token bucket on each end of its veth pair:
    this kernel has no netem), or unlimited again (None)."""
    veth = "ack-" + node.removeprefix("alpsck-")  # start_nodes.sh's name for the bridge's end
    for cmd in (["tc", "qdisc", "del", "dev", veth, "root"], ["ip", "netns", "exec", node, "tc", "qdisc", "del", "dev",
                                                               "eth0", "root"]):
        subprocess.run(cmd, capture_output=True, timeout=30)
    if rate is not None:
        tbf = ["root", "tbf", "rate", rate, "burst", "64kb", "latency", "200ms"]
        _sh("tc", "qdisc", "add", "dev", veth, *tbf)
        _sh("ip", "netns", "exec", node, "tc", "qdisc", "add", "dev", "eth0", *tbf)


def test_a_node_whose_links_are_slow_is_cordoned_by_the_link_probe(
        nodes: object, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 55's gate, its collective part: node 2's link limited to 200 Mbit/s both ways (the others run at
    5-9 Gbit/s here), ``min_link_gbps: 1``: the link probe's ring finds both of node 2's links slow, node 2 is
    cordoned (``links``) and the job runs on nodes 1 and 3."""
    monkeypatch.setenv("SLURM_CONF", CONF)
    _sh("bash", str(HERE / "start.sh"), "--nodes", "3", timeout=300)
    job, run, marks = _beside_a_bad_node(tmp_path, lambda _: _slow_link("alpsck-n2", "200mbit"),
                                         lambda _: _slow_link("alpsck-n2", None), "min_link_gbps: 1\nlink_probe_mib: 8")
    [c] = events(run, "cordoned")
    assert (c["node"], c["checks"]) == ("alpsck-n2", "links"), c
    assert re.fullmatch(r"links: its links run below min_link_gbps 1: 0\.\d+ Gbit/s in from alpsck-n1, 0\.\d+ Gbit/s "
                        r"out to alpsck-n3", c["reason"]), c
    assert sorted(p.name for p in marks.iterdir()) == [f"{job}-0-rank0-alpsck-n1", f"{job}-0-rank1-alpsck-n3"]


def _throttle_cpu(node: str, percent: float | None) -> None:
    """Every process of ``node`` (its slurmd, so every later step's too) given ``percent`` of one CPU, in slices of
    10 ms (a CPU cgroup's quota: a slow node), or let go again (None)."""
    v2 = Path("/sys/fs/cgroup/cgroup.controllers")
    root = Path("/sys/fs/cgroup") if v2.exists() and "cpu" in v2.read_text().split() else Path("/sys/fs/cgroup/cpu")
    assert (root / "cgroup.procs").exists(), f"no CPU cgroup to throttle {node} with at {root}"
    group = root / f"alpsck-{node}"
    slurmd = int("".join(c for c in Path(f"/var/lib/alpsck-slurm-nodes/run/{node}.pid").read_text() if c.isdigit()))
    net = os.readlink(f"/proc/{slurmd}/ns/net")
    if percent is None:
        if group.exists():
            for pid in (group / "cgroup.procs").read_text().split():
                subprocess.run(["sh", "-c", f"echo {int(pid)} > {root}/cgroup.procs"], capture_output=True)
            group.rmdir()
        return
    group.mkdir(exist_ok=True)
    if root == v2.parent:
        (root / "cgroup.subtree_control").write_text("+cpu")
        (group / "cpu.max").write_text(f"{int(percent * 100)} 10000")
    else:
        (group / "cpu.cfs_period_us").write_text("10000")
        (group / "cpu.cfs_quota_us").write_text(str(int(percent * 100)))
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and os.readlink(proc / "ns" / "net") == net:
                (group / "cgroup.procs").write_text(proc.name)
        except OSError:  # gone meanwhile, or a kernel thread
            pass


def test_a_rank_on_a_node_whose_cpu_is_throttled_is_named_a_straggler(
        nodes: object, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 55's last acceptance point: a job on nodes 1 and 2, node 2's CPU throttled to 15 % of one core from
    outside: its rank's part of each save is the slow one, and ``status --json`` names node 2 (rank 1) a straggler,
    node 1 not; the run still finishes. Meanwhile, the control: the same job's two ranks side by side on node 3,
    which nobody throttles, name nobody: a rank is compared with other nodes' ranks only (in CI at 17773f4, when it
    was compared with its node's other rank, one was named at 2.27x: two ranks share one node's disk and CPU)."""
    monkeypatch.setenv("SLURM_CONF", CONF)
    _sh("bash", str(HERE / "start.sh"), "--nodes", "3", timeout=300)
    runs = {"slow": tmp_path / "slow", "even": tmp_path / "even"}
    where = {"slow": "nodes: 2\nextra: {nodelist: 'alpsck-n1,alpsck-n2'}", "even": "nodes: 1\nextra: {nodelist: alpsck-n3}"}
    cfgs = {k: job_config(tmp_path / f"{k}.yaml", run, steps=30, time="10", every=2, tasks=1 if k == "slow" else 2,
                          slurm_extra=where[k], health="straggler_saves: 3")
            for k, run in runs.items()}
    _throttle_cpu("alpsck-n2", 15)
    try:
        jobs = {k: submit(cfg) for k, cfg in cfgs.items()}
        for k, run in runs.items():
            assert wait_done(run, jobs[k], 400) == "finished", events(run)
    finally:
        _throttle_cpu("alpsck-n2", None)
    run, job = runs["slow"], jobs["slow"]
    doc = json.loads(_sh(sys.executable, "-m", "alpsck", "status", str(run), "--json"))
    [g] = doc["stragglers"]
    assert (g["node"], g["rank"], g["times"], g["job_id"]) == ("alpsck-n2", 1, 1, job), doc["stragglers"]
    assert g["factor"] >= 2 and g["work_s"] - g["peers_s"] >= 0.01, g  # the default straggler_factor
    [e] = events(run, "straggler")
    assert e["saves"] == 3 and e["attempt"] == 0, e
    text = _sh(sys.executable, "-m", "alpsck", "status", str(run))
    assert "straggler: alpsck-n2 (rank 1): its part of a save took " in text, text
    assert not events(runs["even"], "straggler") and len(events(runs["even"], "started")) == 1, events(runs["even"])


# The reference training, whose rank 0 raises once at step 24 (a failure worth a restart in the allocation), each
# rank leaving a mark named after its node and attempt.
_FAILS_ONCE = '''import os
import pathlib

from alpsck.examples.llama.train import slurm_entry


def main(job):
    due, flag = job.checkpoint_due, pathlib.Path({flag!r})
    pathlib.Path({marks!r}, f"{{job.job_id}}-{{os.environ.get('ALPSCK_ATTEMPT', '0')}}-rank{{job.rank}}-"
                 f"{{os.uname().nodename}}").touch()

    def checkpoint_due(step):
        if step == 24 and job.rank == 0 and not flag.exists():
            flag.touch()
            raise RuntimeError("a failure worth a restart")
        return due(step)

    job.checkpoint_due = checkpoint_due
    return slurm_entry(job)
'''


def test_a_straggler_is_cordoned_by_the_gate_before_the_next_start_and_a_spare_takes_its_place(
        nodes: object, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``cordon_stragglers``: two nodes of one rank and a spare, node 2's CPU throttled. Node 2 is named a straggler
    in the first start; rank 0 then fails once (an exception: the restart's gate traces no node for it), and the
    gate before the restart cordons node 2 (checks ``pace``), so the restart runs on nodes 1 and 3. The losses of an
    uninterrupted run, bit for bit; one job, no requeue."""
    monkeypatch.setenv("SLURM_CONF", CONF)
    _sh("bash", str(HERE / "start.sh"), "--nodes", "3", timeout=300)
    steps, marks, conf, run = 30, tmp_path / "marks", tmp_path / "conf", tmp_path / "run"
    marks.mkdir()
    conf.mkdir()
    (conf / "once.py").write_text(_FAILS_ONCE.format(flag=str(tmp_path / "failed-once"), marks=str(marks)))
    cfg = job_config(conf / "job.yaml", run, steps=steps, time="10", every=2, tasks=1, entry="once:main",
                     slurm_extra="nodes: 2\nspare_nodes: 1",
                     health="gate: true\nstraggler_factor: 1.5\nstraggler_saves: 3\ncordon_stragglers: true")
    # Harder than the test above (10 %), a lower factor and 11 saves before the failure: named in the first start
    # even beside CI's other lanes (at 15 %, 2x and 7 saves it once was not: 3.2x, named only in the second start).
    _throttle_cpu("alpsck-n2", 10)
    try:
        job = submit(cfg)
        clean = clean_losses(tmp_path, steps, world=2)  # meanwhile
        assert wait_done(run, job, 400) == "finished", events(run)
    finally:
        _throttle_cpu("alpsck-n2", None)
    assert (run / "loss.csv").read_text() == clean
    # The first start's: node 2, throttled. The second start runs on unthrottled nodes 1 and 3; with two ranks
    # each one's peer median is the other rank, and beside CI's other lanes factor 1.5 was once reached there too
    # (CI at f62fba4): a second start's naming is load, not this test's subject.
    [g] = [e for e in events(run, "straggler") if e["attempt"] == 0]
    assert (g["node"], g["rank"]) == ("alpsck-n2", 1), g
    [c] = events(run, "cordoned")
    assert (c["node"], c["checks"], c["attempt"]) == ("alpsck-n2", "pace", 1) and "a straggler: rank 1" in c["reason"], c
    assert not events(run, "traced"), events(run)  # rank 0's exception is no node's fault
    assert sorted(p.name for p in marks.iterdir()) == [f"{job}-0-rank0-alpsck-n1", f"{job}-0-rank1-alpsck-n2",
                                                       f"{job}-1-rank0-alpsck-n1", f"{job}-1-rank1-alpsck-n3"]
    assert not events(run, "requeued") and len(events(run, "started")) == 2, events(run)
