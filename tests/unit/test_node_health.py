"""The health gate (issue 55): a node's checks (alpsck/node_health/checks.py), the gate's decision
(alpsck/slurm/health_gate.py: cordon, exclude, requeue or give up), its config, its batch-script lines and what
``status`` shows. The probe's answers and SLURM's commands are stand-ins here; the real thing, a node whose view of
the run directory is read-only kept out of a job on the multi-node local SLURM, is tests/slurm/test_slurm_nodes.py."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from alpsck.errors import ConfigError
from alpsck.node_health import checks
from alpsck.node_health.checks import Limits, gpu_problems, gpu_rows, node_checks
from alpsck.slurm import health_gate, history, status, trace
from alpsck.slurm.config import parse_config
from alpsck.slurm.exits import GATE_REQUEUED_EXIT
from alpsck.slurm.health_gate import Answer, decide, parse_answers
from alpsck.slurm.submit import sbatch_script

CONFIG = """\
name: t
run_dir: {run}
slurm:
  time: "00:10:00"
  nodes: 2
  spare_nodes: 1
entry:
  function: alpsck.examples.llama.train:slurm_entry
health:
  gate: true
  min_free_shm_gib: 0.5
"""


def _by_name(found: list[checks.Check]) -> dict[str, checks.Check]:
    return {c.name: c for c in found}


def test_a_healthy_node_passes_every_check_and_leaves_nothing_in_the_run_directory(tmp_path: Path) -> None:
    found = _by_name(node_checks(tmp_path, Limits()))
    assert {"run_dir", "memory", "shm"} <= set(found)
    assert all(c.ok for c in found.values()), found
    assert "written, fsync'ed and read back" in found["run_dir"].detail
    assert list(tmp_path.iterdir()) == []  # the probe file is removed


def test_each_check_fails_with_what_it_found(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    missing = tmp_path / "gone"
    found = _by_name(node_checks(missing, Limits(min_free_memory_gib=1e6, min_free_shm_gib=1e6)))
    assert not found["run_dir"].ok and str(missing) in found["run_dir"].detail
    assert "No such file or directory" in found["run_dir"].detail
    assert not found["memory"].ok and "min_free_memory_gib 1e+06" in found["memory"].detail
    monkeypatch.setenv("ALPSCK_MEMORY_ROOT", str(tmp_path))
    shm = _by_name(node_checks(tmp_path, Limits(min_free_shm_gib=1e6)))["shm"]
    assert not shm.ok and str(tmp_path) in shm.detail
    slow = _by_name(node_checks(tmp_path, Limits(max_fsync_s=1e-9)))["run_dir"]  # nothing fsyncs in a nanosecond
    assert not slow.ok and "max_fsync_s" in slow.detail


def test_a_probe_file_a_killed_probe_left_is_removed_when_the_run_directory_next_opens(tmp_path: Path) -> None:
    """The probe's file is the core's name (a probe, as the engine's own): one a killed probe left (here made an
    hour old) goes when rank 0's engine next opens the run directory; a newer one, a probe in progress, stays."""
    from alpsck import Checkpointer, _core
    from alpsck.store.names import entry_kind

    left = _core.health_probe_file_name(checks.node_name(), 4242)
    assert entry_kind(left) == "probe"
    now = time.time()
    for name, age in ((left, 3600), (_core.health_probe_file_name("nid002", 7) + ".tmp", 3600),
                      (_core.health_probe_file_name("nid003", 8), 5)):
        (tmp_path / name).write_bytes(b"probe")
        os.utime(tmp_path / name, (now - age, now - age))
    Checkpointer(tmp_path).close()
    assert sorted(p.name for p in tmp_path.iterdir() if "probe" in p.name) == [_core.health_probe_file_name("nid003", 8)]


def test_a_run_directory_that_is_a_file_fails_the_write_check(tmp_path: Path) -> None:
    f = tmp_path / "file"
    f.write_text("x")
    c = _by_name(node_checks(f, Limits()))["run_dir"]
    assert not c.ok and "Not a directory" in c.detail


SMI = """\
0, 34, 1, 97871, 0, No
1, 91, 2, 97871, 0, No
2, 30, 60000, 97871, 3, Yes
3, 40, 0, 97871, [N/A], [N/A]
"""


def test_the_gpu_check_reads_nvidia_smi_ecc_retired_pages_temperature_and_memory_in_use() -> None:
    rows = gpu_rows(SMI + "garbage line\n")
    assert [r["index"] for r in rows] == ["0", "1", "2", "3"]
    bad = gpu_problems(rows, Limits(max_gpu_temperature_c=85, max_gpu_memory_used=0.2))
    assert bad == ["GPU 1: 91 C (max_gpu_temperature_c 85)",
                   "GPU 2: 3 uncorrected ECC error(s) since the driver loaded",
                   "GPU 2: pages pending retirement (the GPU needs a reset)",
                   "GPU 2: 60000 of 97871 MiB in use before the start (max_gpu_memory_used 0.2)"]
    assert gpu_problems(rows[:1] + rows[3:], Limits()) == []  # fields NVML does not report are no problem


def test_the_gpu_check_runs_nvidia_smi_where_there_is_one(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    smi = tmp_path / "nvidia-smi"  # a stand-in that prints what the real one prints for this query
    smi.write_text("#!/bin/sh\ncat <<'EOF'\n0, 95, 1, 97871, 0, No\nEOF\n")
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    gpu = _by_name(node_checks(tmp_path, Limits()))["gpu"]
    assert not gpu.ok and gpu.detail == "GPU 0: 95 C (max_gpu_temperature_c 85)"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # no GPU given to this job: none checked
    assert "gpu" not in _by_name(node_checks(tmp_path, Limits()))


def test_the_probe_prints_one_json_line_and_the_gate_reads_only_such_lines(tmp_path: Path) -> None:
    r = subprocess.run([sys.executable, "-c", health_gate.PROBE_CODE, str(tmp_path), json.dumps({"max_fsync_s": 5})],
                       capture_output=True, text=True, cwd=tmp_path, timeout=60)
    assert r.returncode == 0, r.stderr
    answers = parse_answers("srun: warning: something\n" + r.stdout + "{not json\n[1, 2]\n")
    [(node, answer)] = answers.items()
    assert answer.ok and [c["name"] for c in answer.checks][:3] == ["run_dir", "memory", "shm"]
    assert not Answer("n9", []).ok and Answer("n9", []).reason() == "no answer from the probe"


def test_nodes_srun_could_not_start_on_are_probed_again_one_by_one_and_only_those_fail(
        monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []

    def srun(args: list[str], timeout: float) -> tuple[int, str, str]:
        nodes = next(a for a in args if a.startswith("--nodelist=")).split("=")[1]
        calls.append(nodes)
        line = json.dumps({"node": "n1", "checks": [{"name": "run_dir", "ok": True, "detail": "fine"}]})
        if nodes == "n1,n2,n3":  # the step fails as a whole: n3 is dead, n2's answer is lost with it
            return 1, line + "\n", "srun: error: Node failure on n3"
        if nodes == "n2":
            return 0, line.replace('"n1"', '"n2"') + "\n", ""
        return 1, "", "srun: error: Node failure on n3"

    monkeypatch.setattr(health_gate.commands, "srun_gather", srun)
    got = health_gate.probe_nodes(["n1", "n2", "n3"], "/run", {}, ["python3"], 5.0)
    assert sorted(calls) == ["n1,n2,n3", "n2", "n3"]
    assert got["n1"].ok and got["n2"].ok and not got["n3"].ok
    assert got["n3"].reason() == "no answer from the probe (srun exit 1: srun: error: Node failure on n3)"


def test_a_probe_no_node_answers_is_the_gates_failure_and_cordons_nobody(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    Slurm(monkeypatch, ["n1", "n2"])  # e.g. alpsck not importable on the nodes: not a node's fault
    code, exclude = decide(str(tmp_path), "77", 0, ["n1", "n2"], set(), 2, 2, "debug",
                           lambda nodes: {n: Answer(n, [], "exit 1: ModuleNotFoundError") for n in nodes})
    assert (code, exclude) == (1, []) and not [e for e in history.read(tmp_path) if e["event"] == "cordoned"]


def _ok(node: str) -> Answer:
    return Answer(node, [{"name": "run_dir", "ok": True, "detail": "fine"}])


def _bad(node: str) -> Answer:
    return Answer(node, [{"name": "run_dir", "ok": True, "detail": "fine"},
                         {"name": "shm", "ok": False, "detail": "/dev/shm: 0.1 GiB free"}])


class Slurm:
    """Stand-ins for the gate's SLURM calls: what it asked (its updates and requeues), and a partition of ``nodes``;
    the job's record excludes ``before`` already."""

    before = "(null)"

    def scontrol(self, args: list[str], **_: Any) -> str:
        if args[:2] == ["show", "job"]:
            return f"JobId={args[2]} JobName=t\n   ReqNodeList=(null) ExcNodeList={self.before}\n"
        self.calls.append(list(args))
        return ""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, partition: list[str]) -> None:
        self.calls: list[list[str]] = []
        monkeypatch.setattr(health_gate, "_partition_nodes", lambda p: set(partition))
        monkeypatch.setattr(health_gate.commands, "scontrol", self.scontrol)
        monkeypatch.setattr(health_gate.commands, "scontrol_requeue", lambda job, **k: self.calls.append(["requeue", job]))


def _gate(run: Path, allocation: list[str], bad: set[str], *, need: int, excluded: frozenset[str] = frozenset(),
          allocated: int | None = None) -> tuple[int, list[str], list[list[str]]]:
    probed: list[list[str]] = []

    def answers_of(nodes: list[str]) -> dict[str, Answer]:
        probed.append(nodes)
        return {n: (_bad(n) if n in bad else _ok(n)) for n in nodes}

    code, exclude = decide(str(run), "77", 1, allocation, set(excluded), need, allocated or len(allocation), "debug",
                           answers_of)
    return code, exclude, probed


def test_a_failing_node_is_cordoned_once_and_excluded_from_every_later_step(tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    slurm = Slurm(monkeypatch, ["n1", "n2", "n3", "n4"])
    code, exclude, probed = _gate(tmp_path, ["n1", "n2", "n3"], {"n2"}, need=2)
    assert (code, exclude, probed) == (0, ["n2"], [["n1", "n2", "n3"]])
    [c] = [e for e in history.read(tmp_path) if e["event"] == "cordoned"]
    assert (c["node"], c["checks"], c["job_id"], c["attempt"]) == ("n2", "shm", "77", 1)
    assert c["reason"] == "shm: /dev/shm: 0.1 GiB free"
    # The next start: node 2 is not probed again, and stays out; a node SLURM cannot use stays out too.
    code, exclude, probed = _gate(tmp_path, ["n1", "n2", "n3"], set(), need=2, excluded=frozenset({"n3"}),
                                  allocated=3)
    assert probed == [["n1"]] and exclude == ["n2", "n3"]
    assert code == GATE_REQUEUED_EXIT  # one usable node of the two the step needs
    assert slurm.calls == [["requeue", "77"], ["update", "JobId=77", "ExcNodeList=n2"]]
    assert len([e for e in history.read(tmp_path) if e["event"] == "cordoned"]) == 1
    [rq] = [e for e in history.read(tmp_path) if e["event"] == "requeued"]
    assert (rq["reason"], rq["mechanism"], rq["progress"]) == ("health", "scontrol", False)


def test_too_few_healthy_nodes_requeues_excluding_the_cordoned_while_the_partition_has_enough(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    slurm = Slurm(monkeypatch, ["n1", "n2", "n3", "n4", "n5", "n6"])
    slurm.before = "n[5-6]"  # the user's own --exclude stays
    code, exclude, _ = _gate(tmp_path, ["n1", "n2"], {"n2"}, need=2)
    assert code == GATE_REQUEUED_EXIT and exclude == ["n2"]
    assert slurm.calls == [["requeue", "77"], ["update", "JobId=77", "ExcNodeList=n2,n5,n6"]]


def test_no_allocation_could_hold_enough_healthy_nodes_gives_up(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    slurm = Slurm(monkeypatch, ["n1", "n2", "n3"])
    code, _, _ = _gate(tmp_path, ["n1", "n2", "n3"], {"n2"}, need=3)
    assert code == health_gate.GIVE_UP_EXIT == 93 and slurm.calls == []
    [g] = [e for e in history.read(tmp_path) if e["event"] == "gave_up"]
    assert "the partition has 2 node(s) that are not cordoned, and the job asks for 3" in g["message"]
    assert g["exit_code"] == 93


def test_status_lists_the_cordoned_nodes_with_why_and_since(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    Slurm(monkeypatch, ["n1", "n2", "n3"])
    history.append(tmp_path, history.Submitted(backend="local", name="t"), job_id="4000000000")  # no such pid
    _gate(tmp_path, ["n1", "n2", "n3"], {"n2"}, need=2)
    s = status.report(tmp_path, shown=50, purge_days=None)
    [c] = s.cordoned
    assert (c["node"], c["checks"], c["job_id"]) == ("n2", "shm", "77") and c["since"] > 0
    assert "shm: /dev/shm: 0.1 GiB free" in c["reason"]
    r = subprocess.run([sys.executable, "-m", "alpsck", "status", str(tmp_path)], capture_output=True, text=True,
                       timeout=120, env={**os.environ, "PATH": str(tmp_path / "no-slurm-here")})
    assert "cordoned: n2 since " in r.stdout and "(job 77): shm: /dev/shm: 0.1 GiB free" in r.stdout, r.stdout


def test_the_batch_script_runs_the_gate_before_every_step_and_acts_on_its_answer(tmp_path: Path) -> None:
    text = sbatch_script(parse_config(CONFIG.format(run=tmp_path / "run")))
    assert subprocess.run(["bash", "-n"], input=text, text=True).returncode == 0
    loop = text[text.index("while :; do"):]
    assert loop.index("alpsck_place_step || break") < loop.index(f"  {health_gate.GATE}\n") < loop.index("\nsrun ")
    gate = text[text.index(f"{health_gate.GATE}() {{"):]
    gate = gate[:gate.index("\n}\n")]
    assert "--need=2 --allocated=3 " in gate and '"min_free_shm_gib": 0.5' in gate and "--cordon-after=2" in gate
    [srun] = [ln for ln in text.splitlines() if ln.startswith("srun ")]
    assert srun.endswith(' 2>"$alpsck_srun_log"; alpsck_rc=$?; cat "$alpsck_srun_log" >&2; (exit "$alpsck_rc")')
    assert '0) alpsck_exclude=$out ;;' in gate and "3) exit 0 ;;" in gate and "93) exit 93 ;;" in gate
    plain = sbatch_script(parse_config(CONFIG.format(run=tmp_path / "run").replace("gate: true", "gate: false")))
    assert health_gate.GATE not in plain


@pytest.mark.parametrize(("line", "error"), [
    ("  gaet: true", "health.gaet: unknown key (did you mean 'gate'?)"),
    ("  timeout_s: 0", "health.timeout_s: 0: must be between 1 and 3600"),
    ("  max_gpu_memory_used: 1.5", "health.max_gpu_memory_used: 1.5: must be between 0 and 1"),
    ("  gate: yes please", "health.gate"),
])
def test_a_bad_health_key_is_named(tmp_path: Path, line: str, error: str) -> None:
    text = CONFIG.format(run=tmp_path / "run") + line + "\n"
    with pytest.raises(ConfigError, match=re.escape(error)):
        parse_config(text.replace("  gate: true\n", "") if "gate:" in line else text)


def test_the_gate_is_refused_for_a_container_job(tmp_path: Path) -> None:
    text = CONFIG.format(run=tmp_path / "run") + "environment:\n  container: /x/edf.toml\n"
    with pytest.raises(ConfigError, match="health.gate: the gate runs its decision on the batch script's host"):
        parse_config(text)


def test_the_config_limits_reach_the_checks_unchanged(tmp_path: Path) -> None:
    cfg = parse_config(CONFIG.format(run=tmp_path / "run"))
    limits: dict[str, Any] = cfg.health.limits()
    assert Limits.from_dict(limits) == Limits(min_free_shm_gib=0.5)
    assert set(limits) == set(Limits.__dataclass_fields__)


SRUN_SAID = """\
srun: error: alpsck-n2: task 1: Killed
srun: launch/slurm: _step_signal: Terminating StepId=12.0
slurmstepd: error: *** STEP 12.0 ON alpsck-n1 CANCELLED AT 2026-11-30T01:00:00 ***
srun: error: alpsck-n1: task 0: Terminated
"""


@pytest.mark.parametrize(("said", "found"), [
    (SRUN_SAID, ("alpsck-n2", 1, "Killed")),
    ("srun: error: n3: tasks 4-7: Exited with exit code 7\n", ("n3", 4, "Exited with exit code 7")),
    ("srun: error: Node failure on n2\nsrun: error: n1: task 0: Terminated\n", ("n2", None, "node failure")),
    ("srun: error: n1: task 0: Terminated\nsrun: error: n2: task 1: Terminated\n", None),  # a cancel, a time limit
    # alpsck's own exits (every rank asked for the restart; gave up) blame nobody; a kill among them does
    ("srun: error: n1: task 0: Exited with exit code 75\nsrun: error: n2: task 1: Exited with exit code 75\n", None),
    ("srun: error: n1: task 0: Exited with exit code 93\n", None),
    ("srun: error: n1: task 0: Exited with exit code 75\nsrun: error: n2: task 1: Killed\n", ("n2", 1, "Killed")),
    ("", None),
])
def test_srun_says_where_a_step_failed_first(said: str, found: object) -> None:
    assert trace.culprit(said) == found


def test_a_node_the_steps_fail_on_first_twice_is_cordoned(tmp_path: Path) -> None:
    log = tmp_path / "srun.err"
    log.write_text(SRUN_SAID)
    trace.trace(str(tmp_path), "77", 0, str(log), 2)  # the first attempt has no step before it
    assert history.read(tmp_path) == []
    trace.trace(str(tmp_path), "77", 1, str(log), 2)
    [t] = [e for e in history.read(tmp_path) if e["event"] == "traced"]
    assert (t["attempt"], t["node"], t["task"], t["message"]) == (0, "alpsck-n2", 1, "Killed")
    assert not [e for e in history.read(tmp_path) if e["event"] == "cordoned"]
    trace.trace(str(tmp_path), "77", 2, str(log), 2)
    [c] = [e for e in history.read(tmp_path) if e["event"] == "cordoned"]
    assert (c["node"], c["checks"], c["attempt"]) == ("alpsck-n2", "failures", 2)
    assert c["reason"] == ("the job step failed first on it 2 times (job 77 attempt 0: task 1: Killed; job 77 "
                           "attempt 1: task 1: Killed)")
    trace.trace(str(tmp_path), "77", 3, str(log), 2)  # cordoned once
    assert len([e for e in history.read(tmp_path) if e["event"] == "cordoned"]) == 1
    never = tmp_path / "never"
    never.mkdir()
    for attempt in (1, 2, 3):
        trace.trace(str(never), "78", attempt, str(log), 0)  # 0: traced, never cordoned
    assert [e["event"] for e in history.read(never)] == ["traced"] * 3


def test_a_node_both_of_whose_links_are_slow_is_blamed_and_two_nodes_never_are() -> None:
    from alpsck.node_health.links import slow_nodes

    ring = [("n1", 90.0), ("n2", 0.5), ("n3", 0.4), ("n4", 80.0)]  # n1->n2 slow, n2->n3 slow
    assert slow_nodes(ring, 10) == {"n2": "its links run below min_link_gbps 10: 0.5 Gbit/s in from n1, 0.4 Gbit/s "
                                          "out to n3"}
    assert slow_nodes([("n1", 90.0), ("n2", 0.5), ("n3", 80.0)], 10) == {}  # one slow link: whose is not known
    assert slow_nodes([("n1", 0.5), ("n2", 0.5)], 10) == {}  # two nodes share both links
    assert slow_nodes([("n1", 0.5), ("n2", 0.5), ("n3", 0.5)], 10).keys() == {"n1", "n2", "n3"}


def test_the_link_probe_passes_a_buffer_round_a_ring_of_real_gloo_ranks(tmp_path: Path) -> None:
    from alpsck.node_health.links import CODE

    procs = []
    for rank in range(3):
        env = {**os.environ, "SLURM_PROCID": str(rank), "SLURM_NTASKS": "3", "SLURM_JOB_ID": str(os.getpid()),
               "SLURM_STEP_ID": "0", "SLURMD_NODENAME": f"n{rank + 1}"}
        procs.append(subprocess.Popen([sys.executable, "-c", CODE, "127.0.0.1", "4", "60"], env=env, cwd=tmp_path,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    docs = []
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
        docs.append(json.loads(out))
    assert [(d["node"], d["rank"]) for d in docs] == [("n1", 0), ("n2", 1), ("n3", 2)]
    assert all(d["gbps"] > 0 and d["seconds"] > 0 for d in docs), docs


def test_the_gate_judges_the_links_of_the_nodes_whose_checks_passed(monkeypatch: pytest.MonkeyPatch) -> None:
    asked: list[list[str]] = []

    def srun(args: list[str], timeout: float) -> tuple[int, str, str]:
        asked.append(args)
        rates = {"n1": 90.0, "n2": 0.5, "n4": 0.4, "n5": 80.0}
        lines = [json.dumps({"node": n, "rank": r, "gbps": g}) for r, (n, g) in enumerate(rates.items())]
        return 0, "\n".join(lines) + "\n", ""

    monkeypatch.setattr(health_gate.commands, "srun_gather", srun)
    answers = {n: (_bad(n) if n == "n3" else _ok(n)) for n in ("n1", "n2", "n3", "n4", "n5")}
    health_gate.probe_links(answers, ["python3"], 10.0, 8, 30.0)
    [args] = asked
    assert "--nodelist=n1,n2,n4,n5" in args and args[-3:] == ["n1", "8", "30"]  # n3 failed its checks: not probed
    assert [c["name"] for c in answers["n3"].checks] == ["run_dir", "shm"]
    assert not answers["n2"].ok and answers["n2"].reason() == ("links: its links run below min_link_gbps 10: 0.5 "
                                                                "Gbit/s in from n1, 0.4 Gbit/s out to n4")
    assert answers["n1"].ok and answers["n1"].checks[-1]["detail"] == "90 Gbit/s in from n5 (min_link_gbps 10)"
    health_gate.probe_links(answers, ["python3"], 0.0, 8, 30.0)  # off
    assert len(asked) == 1


def test_submitting_a_gated_job_to_the_local_executor_says_the_gate_does_not_run_there(tmp_path: Path) -> None:
    from alpsck.slurm.submit import local_unused

    cfg = parse_config(CONFIG.format(run=tmp_path / "run"))
    assert local_unused(cfg) == ["health.gate is not used by the local executor: there are no nodes to check "
                                 "(alpsck doctor --nodes checks this one)"]
    assert local_unused(parse_config(CONFIG.format(run=tmp_path / "run").replace("gate: true", "gate: false"))) == []


def test_doctor_nodes_prints_a_line_per_check_and_fails_with_a_failing_node(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}  # outside an allocation: this node

    def doctor(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "alpsck", "doctor", "--nodes", *args], capture_output=True,
                              text=True, timeout=120, env=env, cwd=tmp_path)

    ok = doctor(str(tmp_path))
    assert ok.returncode == 0, ok.stderr
    lines = ok.stdout.splitlines()
    assert [ln.split(": ")[1] for ln in lines][:3] == ["run_dir", "memory", "shm"]
    assert all(ln.startswith("node ") and ": ok: " in ln for ln in lines), lines
    bad = doctor(str(tmp_path / "gone"), "--json")
    assert bad.returncode == 1
    [(node, found)] = json.loads(bad.stdout).items()
    assert found[0]["name"] == "run_dir" and not found[0]["ok"] and "No such file or directory" in found[0]["detail"]


def test_a_hung_step_is_traced_to_no_node_and_rank_zeros_missing_ranks_come_before_sruns_word(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    log = tmp_path / "srun.err"
    log.write_text("srun: error: n1: task 0: Killed\n")  # the watchdog's own kill, or rank 0 ending the step
    hung = tmp_path / "hung"
    hung.mkdir()
    history.append(hung, history.Hang(section="step", seconds=900.0, attempt=0), job_id="77")
    trace.trace(str(hung), "77", 1, str(log), 1)
    assert [e["event"] for e in history.read(hung)] == ["hang"]
    assert "hung: the watchdog ended its tasks" in capsys.readouterr().err
    # The commit agreement heard nothing from rank 2: rank 0 names rank 2's node (its earlier saves' records), and
    # the gate before the next start counts that, not srun's word (which names rank 0's node, n1).
    message = "CheckpointError: step 40 was aborted: no shard from rank(s) 2 after 600 s"
    assert trace.trace_missing(str(tmp_path), "77", 0, message, {0: "n1", 1: "n2", 2: "n3"}) == ["n3"]
    assert trace.trace_missing(str(tmp_path), "77", 0, "some other error", {0: "n1"}) == []
    assert trace.trace_missing(str(tmp_path), "77", 0, "no shard from rank(s) 4, 5", {0: "n1"}) == []  # not known
    trace.trace(str(tmp_path), "77", 1, str(log), 1)
    [t] = [e for e in history.read(tmp_path) if e["event"] == "traced"]
    assert (t["attempt"], t["node"], t["task"], t["message"]) == (0, "n3", 2, "no shard from it at the commit agreement")
    [c] = [e for e in history.read(tmp_path) if e["event"] == "cordoned"]
    assert (c["node"], c["checks"], c["attempt"]) == ("n3", "failures", 1)
    # Requeued, the same job id starts at attempt 0 again: that attempt's step is traced by srun's word, not by the
    # rank-0 trace of the earlier allocation's attempt 0.
    history.append(tmp_path, history.Started(restart=1, rank=0, world_size=3), job_id="77")
    trace.trace(str(tmp_path), "77", 1, str(log), 5)
    assert [(e["node"], e["task"]) for e in history.read(tmp_path) if e["event"] == "traced"] == [("n3", 2), ("n1", 0)]


VETNODE = """\
name: Alps ML vetting
scheduler: slurm
evals:
- name: GPU idle
  type: vetnode.evaluations.gpu_eval.GPUEval
  max_temp: 30
  max_used_memory: 0.2
- name: Kernel
  type: vetnode.evaluations.cuda_eval.CUDAEval
- name: Internode
  type: vetnode.evaluations.nccl_lib_eval.NcclLibEval
  topology: internode
  payload: 8 GB
  min_bandwidth: 15 GB/s
- name: Env
  type: vetnode.evaluations.env_var_eval.EnvVarEval
"""


def test_a_vetnode_config_sets_the_thresholds_the_health_section_does_not_and_says_what_it_does_not_run(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "vet.yaml").write_text(VETNODE)
    h = parse_config(CONFIG.format(run=tmp_path / "run") + "  vetnode: vet.yaml\n  max_gpu_temperature_c: 70\n").health
    assert (h.max_gpu_temperature_c, h.max_gpu_memory_used, h.gpu_kernel) == (70, 0.2, True)  # the section's 70 wins
    assert json.loads(json.dumps(h.limits()))["max_gpu_memory_used"] == 0.2  # what the probe gets
    assert [line.split(" (")[0] for line in h.vetnode_skipped] == ["Internode", "Env"]
    assert "gloo's, host memory over TCP, which no NCCL bandwidth threshold fits" in h.vetnode_skipped[0]
    assert h.min_link_gbps == 0  # never taken from an NCCL threshold
    for text, error in [
        ("name: x\n", "health.vetnode: 'bad.yaml': no list of evals"),
        ("evals:\n- name: G\n  type: gpu-eval\n  max_used_memory: 256\n",
         "G: max_used_memory: 256: alpsck reads it as a fraction of the GPU's memory (0 to 1)"),
        ("evals:\n- name: G\n  type: gpu-eval\n  max_temp: hot\n", "G: max_temp: 'hot' is not a number"),
    ]:
        (tmp_path / "bad.yaml").write_text(text)
        with pytest.raises(ConfigError, match=re.escape(error)):
            parse_config(CONFIG.format(run=tmp_path / "run") + "  vetnode: bad.yaml\n")
    with pytest.raises(ConfigError, match=r"health.vetnode: 'nowhere.yaml': cannot read it: No such file"):
        parse_config(CONFIG.format(run=tmp_path / "run") + "  vetnode: nowhere.yaml\n")
