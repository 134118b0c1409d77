"""From a rank's SIGKILL to the first training step of the restarted job step, on a real SLURM
(the targets of issue #42): ``restart_latency.py --ranks 2 --repeats 5``.

Each run submits the reference training (``alpsck.examples.llama``) through ``alpsck submit`` with a
user entry beside the config that, on the job step's first start, SIGKILLs rank 0 once a checkpoint
past step 20 is durable (noting the time first), and on the next start notes when rank 0's loop polls
for the first time (the restore is done) and for the second (its first step is done). With the history
(``crashed.time_of_end``: srun returned; ``started``: the runner of the new step began) each restart is
split into: detect and tear down (kill -> srun returned), start (-> the runner started: srun launch,
Python, ``import torch``, submitit), restore (-> first poll), first step (-> second poll). One job
at a time (each takes the node's CPUs); ``--model`` ``small`` (a few MB of state) or ``100mb`` (~100 MB
restored). Prints one row per (model, ranks) with the median of ``--repeats`` and writes every run to
``--out``. Needs a SLURM cluster (slurm/local-cluster/start.sh) and an installed alpsck.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MODELS = {
    "small": ["--dim", "48", "--n-layers", "2", "--n-heads", "4", "--n-kv-heads", "2"],
    "100mb": ["--dim", "384", "--n-layers", "6", "--n-heads", "6", "--n-kv-heads", "2"],
}
COMMON = ["--sequence-length", "32", "--batch-size", "4", "--torch-threads", "1", "--log-every", "0",
          "--min-step-seconds", "0.25", "--training-steps", "60"]

ENTRY = '''
import os, signal, threading, time
from alpsck.examples.llama.train import slurm_entry
from alpsck.store.picker import pick

NOTES = {notes!r}


def note(what):
    with open(NOTES, "a") as f:
        f.write(f"{{what}} {{time.time():.6f}}\\n")


def main(job):
    attempt = int(os.environ.get("ALPSCK_ATTEMPT", "0"))
    if job.rank == 0 and attempt == 0:
        def killer():
            while (pick(job.run_dir).step or 0) < 20:
                time.sleep(0.05)
            note("kill")
            os.kill(os.getpid(), signal.SIGKILL)
        threading.Thread(target=killer, daemon=True).start()
    if job.rank == 0 and attempt == 1:
        polls = [0]
        polled = job.stop_requested

        def stop_requested():
            polls[0] += 1
            if polls[0] <= 2:
                note(f"poll{{polls[0]}}")
            return polled()
        job.stop_requested = stop_requested
    return slurm_entry(job)
'''


def one_run(root: Path, model: str, ranks: int) -> dict[str, float]:
    run, conf = root / "run", root / "conf"
    conf.mkdir(parents=True)
    notes = root / "notes.txt"
    (conf / "bench_entry.py").write_text(ENTRY.format(notes=str(notes)))
    args = [*MODELS[model], *COMMON]
    (conf / "job.yaml").write_text("\n".join([
        "name: restart-latency", f"run_dir: {run}", "slurm:", "  time: '10'", "  cpus_per_task: 1",
        f"  tasks_per_node: {ranks}", f"  mem: {ranks}G", "entry:", "  function: bench_entry:main",
        "  args: [" + ", ".join(f"'{a}'" for a in args) + "]", "checkpoint:", "  every_steps: 10",
        "requeue:", "  in_job_restarts: 2"]) + "\n")
    r = subprocess.run([sys.executable, "-m", "alpsck", "submit", str(conf / "job.yaml"), "--json"],
                       capture_output=True, text=True, timeout=120)
    if r.returncode != 0:
        raise SystemExit(f"submit failed: {r.stdout}{r.stderr}")
    deadline = time.monotonic() + 600
    events: list[dict[str, object]] = []
    while time.monotonic() < deadline:
        hist = run / "history.jsonl"
        events = [json.loads(x) for x in hist.read_text().splitlines()] if hist.exists() else []
        if any(e["event"] in ("finished", "failed", "gave_up") for e in events):
            break
        time.sleep(1)
    t = dict(line.split() for line in notes.read_text().splitlines())
    crashed = next(e for e in events if e["event"] == "crashed")
    started = [e for e in events if e["event"] == "started"][-1]
    kill, end, start = float(t["kill"]), float(crashed["time_of_end"]), float(started["time"])
    poll1, poll2 = float(t["poll1"]), float(t["poll2"])
    return {"detect_teardown_s": end - kill, "start_s": start - end, "restore_s": poll1 - start,
            "first_step_s": poll2 - poll1, "kill_to_first_step_s": poll2 - kill,
            "finished": float(any(e["event"] == "finished" for e in events))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", default="2", help="comma-separated task counts")
    ap.add_argument("--model", default="small,100mb", help="comma-separated: small, 100mb")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=None, help="write every run here (JSON)")
    a = ap.parse_args()
    rows = []
    print(f"{'model':>6} {'ranks':>5} | {'detect+teardown':>15} {'start':>6} {'restore':>7} {'1st step':>8} | "
          f"{'kill->1st step (median, min-max)':>32}")
    for model in a.model.split(","):
        for ranks in (int(x) for x in a.ranks.split(",")):
            runs = []
            for _ in range(a.repeats):
                with tempfile.TemporaryDirectory(prefix="alpsck-restart-", dir=os.environ.get("TMPDIR")) as d:
                    runs.append(one_run(Path(d), model, ranks))
            med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
            total = [r["kill_to_first_step_s"] for r in runs]
            print(f"{model:>6} {ranks:>5} | {med['detect_teardown_s']:>15.2f} {med['start_s']:>6.2f} "
                  f"{med['restore_s']:>7.2f} {med['first_step_s']:>8.2f} | {med['kill_to_first_step_s']:>10.2f} s "
                  f"({min(total):.2f}-{max(total):.2f}), {sum(r['finished'] for r in runs):.0f}/{len(runs)} finished",
                  flush=True)
            rows.append({"model": model, "ranks": ranks, "runs": runs, "median": med})
    if a.out:
        Path(a.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
