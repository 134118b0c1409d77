"""alpsck installed where there is no torch: a login node on Alps (issue 52, item 3).

The command line (``--help``, ``submit --dry-run``, ``status``, ``cancel``, ``doctor``) must run without
torch, and the training side (``alpsck.Checkpointer``, a job's entry) must say in one line that it needs
torch. Tested as a user meets it: a wheel
built from this source tree (``pip wheel``), installed with its dependencies into a fresh venv that
has no torch (no ``--system-site-packages``), every command run from that venv's ``bin``.

The wheel is built once per session, without build isolation, by a build venv (scikit-build-core
and nanobind) and in a build directory that both stay under ``build/no-torch/``: pip's isolated
build would put nanobind in a new temporary path every time and so recompile the whole core. The
first build on a machine compiles the core (a few minutes on 2 cores); later ones only what changed.

Marked ``install`` (slower: about 35 s here once the core is built, about 6 minutes with the first
build; not deselected, CI runs it). A missing tool (cmake, ninja, venv, a package the index lacks)
skips the test outside CI and fails it under ``CI=true``; a build that fails fails it everywhere.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

pytestmark = pytest.mark.install

ROOT = Path(__file__).resolve().parents[2]
BUILD = ROOT / "build" / "no-torch"
EXAMPLES = ROOT / "slurm" / "examples"
MISSING_TORCH = "alpsck's training side needs torch; install torch (pip install torch=="


def _unavailable(why: str) -> None:
    """A tool or package this test needs is missing: a failure under CI (nothing is skipped there), else a skip."""
    if os.environ.get("CI"):
        pytest.fail(f"test_no_torch: {why} (CI runs this test: install what is missing)")
    pytest.skip(why)


def _run(argv: list[str], timeout: float, env: dict[str, str], cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL, env=env,
                          cwd=cwd)


def _clean_env() -> dict[str, str]:
    """This environment without what would let another alpsck or torch in (a source tree on PYTHONPATH)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV", "PIP_REQUIRE"))}
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    return env


def _pip(python: Path, *args: str, timeout: float = 600) -> None:
    """pip, this Python's, on the venv of ``python`` (``--python``: the venv needs no pip of its own)."""
    r = _run([sys.executable, "-m", "pip", "--python", str(python), *args], timeout, env=_clean_env())
    if r.returncode != 0:
        err = "\n".join(ln for ln in (r.stderr or r.stdout).splitlines() if not ln.startswith("WARNING: Location"))
        _unavailable(f"pip {' '.join(args)} failed:\n{err[-3000:]}")


def _build_requires() -> list[str]:
    text = (ROOT / "pyproject.toml").read_text()
    try:
        import tomllib

        return list(tomllib.loads(text)["build-system"]["requires"])
    except ImportError:  # Python 3.10
        m = re.search(r"^\[build-system\]\s*\nrequires\s*=\s*\[([^\]]*)\]", text, re.M)
        assert m, "pyproject.toml: no [build-system] requires"
        return re.findall(r'"([^"]+)"', m.group(1))


def _new_venv(path: Path, pip: bool = False) -> Path:
    """A fresh venv, without pip unless asked (ensurepip costs seconds of CPU; :func:`_pip` installs into it)."""
    shutil.rmtree(path, ignore_errors=True)
    r = _run([sys.executable, "-m", "venv", *([] if pip else ["--without-pip"]), str(path)], 300, env=_clean_env())
    python = path / "bin" / "python"
    if r.returncode != 0 or not python.exists():
        _unavailable(f"python -m venv failed: {r.stderr.strip()[-2000:]}")
    return python


def _build_python() -> Path:
    """The build venv (build/no-torch/buildenv, kept between sessions): this Python with the build requirements."""
    requires = _build_requires()
    python = BUILD / "buildenv" / "bin" / "python"
    probe = "import sys, importlib.metadata as m; from packaging.requirements import Requirement as R; " \
            "sys.exit(not all(R(r).specifier.contains(m.version(R(r).name)) for r in sys.argv[1:]))"
    if python.exists() and _run([str(python), "-c", probe, *requires], 60, env=_clean_env()).returncode == 0:
        return python
    python = _new_venv(BUILD / "buildenv", pip=True)  # it runs pip wheel itself
    _pip(python, "install", "-q", "packaging", *requires)
    return python


WHEEL_ENV = "ALPSCK_WHEEL"  # a wheel already built from this tree (.ci/run builds one and installs it for the suite)


def _build_wheel(dest: Path) -> Path:
    given = os.environ.get(WHEEL_ENV)
    if given:
        assert Path(given).is_file(), f"{WHEEL_ENV}={given}: no such wheel"
        return Path(given)
    for tool in ("cmake", "ninja"):
        if shutil.which(tool) is None:
            _unavailable(f"{tool} is not on the PATH (pip wheel builds the core with it)")
    python = _build_python()
    r = _run([str(python), "-m", "pip", "wheel", str(ROOT), "--no-deps", "--no-build-isolation", "-w", str(dest),
              "-C", f"build-dir={BUILD}/{{wheel_tag}}"], 1800, env=_clean_env(), cwd=ROOT)
    # Every tool is there (no download either: no build isolation): a failure here is the build's own.
    assert r.returncode == 0, f"pip wheel failed:\n{(r.stdout + r.stderr)[-4000:]}"
    wheels = list(dest.glob("alpsck-*.whl"))
    assert len(wheels) == 1, f"pip wheel left {wheels} in {dest}"
    return wheels[0]


@dataclass
class Venv:
    bin: Path
    work: Path  # a directory outside the source tree to run the commands in
    build_s: float
    install_s: float

    def env(self, **extra: str) -> dict[str, str]:
        env = _clean_env()
        env["PATH"] = f"{self.bin}{os.pathsep}{env.get('PATH', '')}"
        env["VIRTUAL_ENV"] = str(self.bin.parent)
        env.update(extra)
        return env

    def run(self, *argv: str, timeout: float = 120, **extra: str) -> subprocess.CompletedProcess[str]:
        exe = argv[0] if "/" in argv[0] else str(self.bin / argv[0])
        return _run([exe, *argv[1:]], timeout, env=self.env(**extra), cwd=self.work)


@pytest.fixture(scope="module")
def venv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Venv]:
    tmp = tmp_path_factory.mktemp("no-torch")
    t0 = time.monotonic()
    wheel = _build_wheel(tmp / "wheel")
    t1 = time.monotonic()
    python = _new_venv(tmp / "venv")
    _pip(python, "install", "-q", "--no-compile", str(wheel))  # no bytecode for all of numpy: imports make theirs
    t2 = time.monotonic()
    work = tmp / "work"
    work.mkdir()
    v = Venv(python.parent, work, t1 - t0, t2 - t1)
    print(f"\ntest_no_torch: wheel built in {v.build_s:.1f} s, venv made and installed in {v.install_s:.1f} s")
    yield v


def test_the_venv_has_no_torch(venv: Venv) -> None:
    r = venv.run("python", "-c", "import importlib.util, alpsck; print(importlib.util.find_spec('torch')); "
                                 "print(alpsck.__file__)")
    assert r.returncode == 0, r.stderr
    spec, where = r.stdout.split()
    assert spec == "None", "torch is importable in the venv: the test would prove nothing"
    assert Path(where).is_relative_to(venv.bin.parent), f"alpsck came from {where}, not the venv"


def test_import_alpsck_does_not_import_torch(venv: Venv) -> None:
    r = venv.run("python", "-c", "import alpsck, sys; assert 'torch' not in sys.modules; "
                                 "print(sorted(alpsck.__all__))")
    assert r.returncode == 0, r.stderr
    assert "Checkpointer" in r.stdout


def test_help_and_version(venv: Venv) -> None:
    r = venv.run("alpsck", "--help")
    assert r.returncode == 0, r.stderr
    for command in ("submit", "status", "cancel", "doctor", "inspect-checkpoints", "export", "bench"):
        assert re.search(rf"^\s+{command}\s", r.stdout, re.M), f"`alpsck --help` lists no {command}:\n{r.stdout}"
    r = venv.run("alpsck", "--version")  # loads the compiled core from the wheel
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("alpsck 0.") and "core tuning" in r.stdout
    for command in ("submit", "status", "cancel", "doctor", "export", "bench", "plot"):
        r = venv.run("alpsck", command, "--help")
        assert r.returncode == 0 and "usage: alpsck" in r.stdout, (command, r.stderr)


@pytest.mark.parametrize("example", ["alps-gh200", "alps-gh200-uenv"])
def test_submit_dry_run_prints_the_batch_script(venv: Venv, tmp_path: Path, example: str) -> None:
    """Both Alps examples, as a login node submits them: the batch script, with the account, the
    requeue signal, and the container (srun --environment) or the uenv (#SBATCH --uenv/--view)."""
    cfg = yaml.safe_load((EXAMPLES / f"{example}.yaml").read_text())
    home = tmp_path / "home"
    home.mkdir()
    r = venv.run("alpsck", "submit", str(EXAMPLES / f"{example}.yaml"), "--dry-run",
                 SCRATCH=str(tmp_path / "scratch"), HOME=str(home), USER="alpsck-test")
    assert r.returncode == 0, r.stderr
    script = r.stdout
    assert script.startswith("#!"), script[:500]
    assert re.search(rf"^#SBATCH --account={re.escape(cfg['slurm']['account'])}$", script, re.M), script
    assert re.search(r"^#SBATCH --signal=USR2@\d+$", script, re.M), script
    assert re.search(r"^\s*srun .*-m submitit\.core\._submit ", script, re.M), script
    # The checkpoints on Capstor scratch, where CSCS says they go, and the dry run says so.
    assert re.search(r"^mkdir -p /capstor/scratch/cscs/alpsck-test/alpsck/", script, re.M), script
    assert "alpsck: dry run: checkpoints go to /capstor/scratch/cscs/alpsck-test/" in r.stderr, r.stderr
    env = cfg["environment"]
    if "venv" in env:  # activated inside each srun'd task, where the uenv's Python exists
        srun = next(line for line in script.splitlines() if line.startswith("srun "))
        assert "source " + env["venv"].replace("$HOME", str(home)) + "/bin/activate" in srun, srun
    if "uenv" in env:
        assert re.search(rf"^#SBATCH --uenv={re.escape(env['uenv'])}\b", script, re.M), script
        assert re.search(rf"^#SBATCH --view={re.escape(env['view'])}$", script, re.M), script
    else:
        edf = env["container"].replace("$HOME", str(home))
        assert f"--environment={edf}" in script, script
    assert "Traceback" not in r.stderr, r.stderr


def _history(run_dir: Path) -> None:
    t = 1_767_000_000.0
    # A run of the local executor (its job id a pid that runs no controller of this run), so that status
    # and cancel ask no SLURM: the same answers with and without a cluster.
    events: list[tuple[str, dict[str, Any]]] = [
              ("submitted", {"job_id": "4242", "backend": "local"}),
              ("started", {"job_id": "4242", "restart": 0, "step": None, "rank": 0, "world_size": 1, "backend": "local"}),
              ("finished", {"job_id": "4242", "step": 300})]
    run_dir.mkdir()
    with open(run_dir / "history.jsonl", "w") as f:
        for i, (event, fields) in enumerate(events):
            f.write(json.dumps({"time": t + 60 * i, "event": event, **fields, "host": "nid001"}) + "\n")


def test_status_and_cancel(venv: Venv, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    _history(run_dir)
    r = venv.run("alpsck", "status", str(run_dir))
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[0].startswith(f"{run_dir}: finished"), r.stdout
    r = venv.run("alpsck", "status", str(run_dir), "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert (doc["state"], doc["job_ids"], doc["last_step"]) == ("finished", ["4242"], 300)
    r = venv.run("alpsck", "cancel", str(run_dir))
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == f"{run_dir}: no live job to cancel (state: finished)", r.stdout


def test_doctor(venv: Venv, tmp_path: Path) -> None:
    r = venv.run("alpsck", "doctor", "--alps", str(tmp_path), timeout=180)  # a login node's check, without torch
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    assert re.search(r"^storage: (ok|warning|info): ", r.stdout, re.M) and re.search(r"^alps: \d of 7 checks warn", r.stdout,
                                                                                      re.M), r.stdout
    r = venv.run("alpsck", "doctor", "--json", timeout=180)
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["torch"] is None and doc["submitit"], doc
    assert Path(doc["package_path"]).is_relative_to(venv.bin.parent), doc["package_path"]
    r = venv.run("alpsck", "doctor", timeout=180)
    assert r.returncode == 0, r.stderr
    assert re.search(r"^torch: not importable$", r.stdout, re.M), r.stdout


def test_the_training_side_says_it_needs_torch(venv: Venv) -> None:
    """alpsck.Checkpointer (and every other name that needs torch) fails with one line that says how to
    install torch: an AlpsckError, and an ImportError (so `except ImportError` still catches it)."""
    script = textwrap.dedent("""
        import alpsck, sys
        from alpsck.errors import AlpsckError
        for name in ("Checkpointer", "RNGState", "peek", "TorchSaveCheckpointer"):
            try:
                getattr(alpsck, name)
            except ImportError as e:
                assert isinstance(e, AlpsckError), type(e).__mro__
                print(e)
            else:
                sys.exit(f"alpsck.{name} without torch did not raise")
        try:
            from alpsck import Rollback
        except ImportError as e:
            print(e)
        assert 'torch' not in sys.modules
    """)
    r = venv.run("python", "-c", script)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert [ln.split(":")[0] for ln in lines] == ["alpsck.Checkpointer", "alpsck.RNGState", "alpsck.peek",
                                                  "alpsck.TorchSaveCheckpointer", "alpsck.Rollback"], lines
    assert all(MISSING_TORCH in ln for ln in lines), lines
    # Uncaught, as a user's script meets it: the traceback ends in that one line.
    r = venv.run("python", "-c", "import alpsck\nwith alpsck.Checkpointer('runs/x') as c: pass")
    assert r.returncode == 1
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("alpsck.errors.TorchMissingError: alpsck.Checkpointer: " + MISSING_TORCH), r.stderr


def test_a_job_without_torch_fails_with_the_one_line(venv: Venv, tmp_path: Path) -> None:
    """The job side: a local job (submitit's local executor) whose entry needs torch ends `failed`, not
    requeued, and its history and log carry the one line."""
    run_dir = tmp_path / "run"
    config = tmp_path / "job.yaml"
    config.write_text(textwrap.dedent(f"""
        name: no-torch
        run_dir: {run_dir}
        slurm:
          time: "5"
        entry:
          function: alpsck.examples.llama.train:slurm_entry
          args: [--training-steps, "10"]
    """))
    r = venv.run("alpsck", "submit", str(config), "--local", "--no-check", "--wait", timeout=300)
    events = [json.loads(ln) for ln in (run_dir / "history.jsonl").read_text().splitlines()]
    failed = [e for e in events if e["event"] == "failed"]
    assert failed, (events, r.stdout, r.stderr)
    assert failed[-1]["message"].startswith("alpsck.errors.TorchMissingError: the job's entry "
                                            "alpsck.examples.llama.train:slurm_entry: " + MISSING_TORCH), failed[-1]
    assert not failed[-1]["will_requeue"] and "not_requeued" in failed[-1], failed[-1]
    assert [e["event"] for e in events].count("started") == 1, events
    status = venv.run("alpsck", "status", str(run_dir), "--json")
    assert json.loads(status.stdout)["state"] == "failed", status.stdout
