"""The multi-node local SLURM (slurm/local-cluster/start.sh --nodes N): each node in its own network, UTS
and mount namespaces, beside the one-node cluster. What the memory tier and the spare nodes will stand on:
a job spans the nodes, each node has its own host name, address and /dev/shm, and a killed node loses
its processes and its /dev/shm while SLURM records the failure and a --no-kill job keeps its allocation.

One test, in order (the steps share the cluster it starts, so they cannot run side by side). In CI it must
run: as root, with iproute2 and util-linux, which .ci/run's machine has; elsewhere it skips without them.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support.slurm_helpers import wait_for

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


def _ranks_job(tmp_path: Path, name: str, mode: str, run: Path, nodes: list[str], *args: str) -> list[list[str]]:
    """support/memory_worker.py on two ranks per node of ``nodes`` (srun, gloo across the nodes' own
    addresses, each node's real /dev/shm): each rank's RESTORED line, by rank (none for a save)."""
    out = tmp_path / f"{name}.out"
    worker = Path(__file__).resolve().parents[1] / "support" / "memory_worker.py"
    words = " ".join(shlex.quote(w) for w in (sys.executable, str(worker), mode, str(run), *args))
    script = tmp_path / f"{name}.sh"
    script.write_text("#!/bin/bash\nexport MASTER_ADDR=$(hostname) MASTER_PORT=29533 OMP_NUM_THREADS=1\n"
                      f"srun -N {len(nodes)} -n {2 * len(nodes)} --ntasks-per-node 2 bash -c "
                      f"{shlex.quote(f'RANK=$SLURM_PROCID WORLD_SIZE=$SLURM_NTASKS exec {words}')}\n"
                      "echo \"srun exit $?\"\n")
    job = _sh("sbatch", "--parsable", "-N", str(len(nodes)), "--ntasks-per-node", "2", "-w", ",".join(nodes),
              "-o", str(out), str(script)).strip().split(";")[0]
    wait_for(lambda: _job_state(job) == "", 240, f"job {job} ({mode} on {nodes})")
    text = out.read_text()
    assert "srun exit 0" in text, text
    rows = [line.split()[1:] for line in text.splitlines() if line.startswith("RESTORED ")]
    assert mode != "restore" or len(rows) == 2 * len(nodes), text
    return rows


def test_a_killed_nodes_ranks_restore_on_a_spare_from_the_replica_in_another_nodes_memory(
        nodes: object, tmp_path: Path) -> None:
    """The memory tier on real nodes (issue 54): two nodes of two ranks save steps 5 and 10 to memory, each
    node's /dev/shm holding its own ranks' checkpoint and the other node's replica; they restore from memory;
    node 2 is killed (its /dev/shm with it), and its ranks restore on node 3 from the replica node 1 sends."""
    run = tmp_path / "run"
    _ranks_job(tmp_path, "save", "save", run, NODES[:2], "0:run_dir,5:memory,10:memory")
    held = {n: _sh("bash", str(HERE / "node.sh"), n, "bash", "-c", "ls -d /dev/shm/alpsck-*/*/ranks-*/step-*").split()
            for n in NODES[:2]}
    for n in NODES[:2]:
        assert sorted(p.split("/")[-2] + "/" + p.split("/")[-1] for p in held[n]) == [
            "ranks-00000-00001/step-000000010", "ranks-00002-00003/step-000000010"], held
    assert _ranks_job(tmp_path, "back", "restore", run, NODES[:2]) == [["10", "memory", "True"]] * 4

    _sh("bash", str(HERE / "kill-node.sh"), "alpsck-n2", timeout=90)
    got = _ranks_job(tmp_path, "spare", "restore", run, [NODES[0], NODES[2]])
    assert got == [["10", "replica", "True"]] * 4  # ranks 2-3 on alpsck-n3, their bytes from alpsck-n1's memory
