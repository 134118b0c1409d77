"""alpsck doctor's facts read in-process (the build info, the tuning check, transparent huge pages, the job's
memory, every command's help); the runs of the command are tests/process/test_doctor.py."""

from __future__ import annotations

import argparse
import platform
from pathlib import Path

import pytest

from alpsck import _core
from alpsck.tools import doctor


def test_build_info_names_what_the_core_was_built_for() -> None:
    b = _core.build_info()
    assert set(b) == {"tuning", "arch_flags", "compiler", "arch", "build_type", "crc32c_hardware"}
    assert b["tuning"] in ("neoverse-v2", "portable")
    assert (b["arch_flags"] == "") == (b["tuning"] == "portable")
    if platform.machine() == "x86_64":
        # ALPSCK_TUNE_GRACE=AUTO, the default of the install this tests: portable anywhere but on a Grace.
        assert b == {**b, "tuning": "portable", "arch": "x86_64", "crc32c_hardware": "sse42"}
    if _core.crc32c_backend() != "portable":
        assert _core.crc32c_backend() == b["crc32c_hardware"]


@pytest.mark.parametrize(("cores", "tuning", "warned"), [
    ([doctor.NEOVERSE_V2] * 4, "portable", "is an NVIDIA Grace (Neoverse-V2) but the core was built portable"),
    ([doctor.NEOVERSE_V2] * 4, "neoverse-v2", None),
    ([("0x41", "0xd0c")] * 4, "neoverse-v2", "tuned for NVIDIA Grace (-mcpu=neoverse-v2) but this CPU is not one"),
    ([("0x41", "0xd0c")] * 4, "portable", None),
    ([], "portable", None),  # the CPU is not known: nothing to say about it
])
def test_doctor_warns_when_the_tuning_does_not_fit_this_aarch64(monkeypatch: pytest.MonkeyPatch,
                                                                 cores: list[tuple[str, str]], tuning: str,
                                                                 warned: str | None) -> None:
    flags = "-mcpu=neoverse-v2" if tuning == "neoverse-v2" else ""
    monkeypatch.setattr(platform, "machine", lambda: "aarch64")
    monkeypatch.setattr(doctor, "cpu_cores", lambda: cores)
    monkeypatch.setattr(doctor, "_slurm", lambda: {"commands": {}, "controller": False, "unavailable": "not asked"})
    built = {**_core.build_info(), "tuning": tuning, "arch_flags": flags}
    monkeypatch.setattr(_core, "build_info", lambda: built)
    d = doctor.diagnose()
    assert d["grace_cpu"] == (cores == [doctor.NEOVERSE_V2] * 4 if cores else None)
    tuned = [w for w in d["warnings"] if "Grace" in w]
    assert [warned in w for w in tuned] == ([True] if warned else [])
    assert sum(line.startswith("warning: ") for line in doctor._lines(d)) == len(d["warnings"])
    assert any(line.startswith("cpu: aarch64, ") for line in doctor._lines(d))


def test_every_command_says_what_it_does_in_its_help() -> None:
    """`alpsck COMMAND --help` gives a description, not only the usage and the options (status,
    submit and bench had none)."""
    from alpsck.cli import build_parser

    parser = build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    assert set(commands.choices) >= {"submit", "status", "inspect-checkpoints", "export", "prune", "promote", "doctor",
                                     "bench", "import-dcp"}
    for name, sub in commands.choices.items():
        assert sub.description and len(sub.description) > 40, f"alpsck {name} --help has no description"


@pytest.mark.parametrize(("text", "want"), [("always [madvise] never", "ok: madvise: "),
                                            ("[always] madvise never", "ok: always: "),
                                            ("always madvise [never]", "info: never: the restore's read buffers use base")])
def test_doctor_alps_reads_transparent_huge_pages(tmp_path: Path, text: str, want: str) -> None:
    (tmp_path / "enabled").write_text(text + "\n")
    assert doctor.check_thp(str(tmp_path / "enabled")).line().startswith(f"transparent huge pages: {want}")
    assert doctor.check_thp(str(tmp_path / "missing")).status == "info"


@pytest.mark.parametrize(("env", "machine", "want"), [
    ({"SLURM_JOB_ID": "1", "SLURM_MEM_PER_NODE": "102400"}, "aarch64",
     "warning: --mem=102400M (100 GiB) per node: a GH200 node allows --mem=450G"),
    ({"SLURM_JOB_ID": "1", "SLURM_MEM_PER_NODE": "102400"}, "x86_64", "ok: --mem=102400M (100 GiB) per node"),
    ({"SLURM_JOB_ID": "1", "SLURM_MEM_PER_NODE": "0"}, "aarch64", "ok: --mem=0: all of the node's memory"),
    ({"SLURM_JOB_ID": "1", "SLURM_MEM_PER_GPU": "8192"}, "aarch64", "info: SLURM_MEM_PER_GPU=8192, not --mem: "),
    ({"SLURM_JOB_ID": "1"}, "aarch64", "info: no --mem given (the partition's default): "),
])
def test_doctor_alps_reads_the_jobs_mem(env: dict[str, str], machine: str, want: str) -> None:
    check = doctor.check_mem(env, machine)
    assert check.line().startswith(f"slurm --mem: {want}"), check.line()
    assert check.status == want.split(":")[0]
