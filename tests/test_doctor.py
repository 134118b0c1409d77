"""``alpsck doctor`` and ``--version`` report what the core was built for (``_core.build_info()``), and
the Grace detection of CMakeLists.txt (cpp/cmake/grace.cmake) agrees with the doctor's."""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import alpsck
from alpsck import _core
from alpsck.tools import doctor

REPO = Path(__file__).resolve().parent.parent
PACKAGE = str(Path(alpsck.__file__).resolve().parent)


def _alpsck(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    # From a directory of its own, so that what runs is the package this test imported, not a source tree.
    r = subprocess.run([sys.executable, "-m", "alpsck", *args], capture_output=True, text=True, timeout=120, cwd=cwd)
    assert r.returncode == 0, r.stderr
    return r


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


def test_version_line_names_the_tuning(tmp_path: Path) -> None:
    line = _alpsck("--version", cwd=tmp_path).stdout
    assert line.count("\n") == 1  # one line, however narrow the terminal
    assert f"; core tuning: {_core.build_info()['tuning']}; crc32c: {_core.crc32c_backend()};" in line


def test_doctor_prints_one_line_per_fact(tmp_path: Path) -> None:
    pairs = [line.split(": ", 1) for line in _alpsck("doctor", cwd=tmp_path).stdout.splitlines()]
    facts = dict(pairs)
    b = _core.build_info()
    assert facts["alpsck"] == f"{alpsck.__version__} ({PACKAGE})"
    assert facts["core tuning"].startswith(f"{b['tuning']} (") and b["compiler"] in facts["core tuning"]
    assert facts["crc32c"].split(" ")[0] == _core.crc32c_backend()
    assert facts["page size"] == str(_core.page_size())
    assert facts["torch"] == torch.__version__
    assert facts["submitit"] == __import__("submitit").__version__
    for c in ("sbatch", "srun", "sinfo"):
        assert (f"{c} {shutil.which(c)}" if shutil.which(c) else f"{c} not found") in facts["slurm commands"]
    assert facts["slurm controller"]
    assert facts["cpu"].startswith(platform.machine())
    keys = [k for k, _ in pairs]
    assert keys[:9] == ["alpsck", "core tuning", "crc32c", "page size", "torch", "submitit", "slurm commands",
                        "slurm controller", "cpu"]
    assert all(k == "warning" for k in keys[9:])


def test_doctor_json(tmp_path: Path) -> None:
    d = json.loads(_alpsck("doctor", "--json", cwd=tmp_path).stdout)
    assert d["version"] == alpsck.__version__ and d["package_path"] == PACKAGE
    assert d["tuning"] == _core.build_info()["tuning"] and d["build"] == _core.build_info()
    assert d["crc32c"] == _core.crc32c_backend() and d["page_size"] == _core.page_size()
    assert d["torch"] == torch.__version__
    assert d["slurm"]["commands"] == {c: shutil.which(c) for c in ("sbatch", "srun", "sinfo")}
    assert d["slurm"]["controller"] == (d["slurm"]["unavailable"] is None)
    assert d["machine"] == platform.machine()
    if platform.machine() == "x86_64":
        assert d["tuning"] == "portable" and d["grace_cpu"] is None
    shadowed = d["installed_path"] is not None and d["installed_path"] != PACKAGE
    assert any("shadows the install" in w for w in d["warnings"]) == shadowed


def test_doctor_names_a_source_tree_that_shadows_the_install(tmp_path: Path) -> None:
    # `python -m alpsck` run from a checkout: the checkout's package is imported, not the installed one.
    shutil.copytree(PACKAGE, tmp_path / "alpsck", ignore=shutil.ignore_patterns("__pycache__"))
    d = json.loads(_alpsck("doctor", "--json", cwd=tmp_path).stdout)
    assert d["package_path"] == str((tmp_path / "alpsck").resolve())
    installed = doctor._installed_package_dir()
    if installed is None:
        pytest.skip("alpsck is not pip-installed here (or editable): no install to shadow")
    assert d["installed_path"] == installed
    assert any(f"imported from {d['package_path']}, not from the installed {installed}" in w for w in d["warnings"])


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


# ---- the Grace detection of ALPSCK_TUNE_GRACE=AUTO, on fake /proc and /sys trees

def _cpuinfo(*parts: str, implementer: str = "0x41") -> str:
    return "".join(f"processor\t: {i}\nBogoMIPS\t: 2000.00\nFeatures\t: fp asimd crc32 sve2\n"
                   f"CPU implementer\t: {implementer}\nCPU architecture: 8\nCPU variant\t: 0x0\n"
                   f"CPU part\t: {part}\nCPU revision\t: 0\n\n" for i, part in enumerate(parts))


TREES = {
    "grace": ({"proc/cpuinfo": _cpuinfo(*["0xd4f"] * 72)}, True),
    "grace-upper-case": ({"proc/cpuinfo": _cpuinfo("0xD4F", "0xD4F")}, True),
    "neoverse-v1": ({"proc/cpuinfo": _cpuinfo("0xd40", "0xd40")}, False),
    "one-core-not-v2": ({"proc/cpuinfo": _cpuinfo("0xd4f", "0xd4f", "0xd40")}, False),
    "other-implementer": ({"proc/cpuinfo": _cpuinfo("0xd4f", implementer="0x42")}, False),
    "x86": ({"proc/cpuinfo": "processor\t: 0\nvendor_id\t: GenuineIntel\ncpu family\t: 6\nmodel\t\t: 85\n\n"}, False),
    "midr-only": ({"proc/cpuinfo": "processor\t: 0\n\n",
                   "sys/devices/system/cpu/cpu0/regs/identification/midr_el1": "0x00000000410fd4f0\n",
                   "sys/devices/system/cpu/cpu1/regs/identification/midr_el1": "0x00000000410fd4f1\n"}, True),
    "midr-not-v2": ({"sys/devices/system/cpu/cpu0/regs/identification/midr_el1": "0x00000000410fd0c0\n"}, False),
    "nothing": ({}, False),
}


@pytest.mark.parametrize("name", sorted(TREES))
def test_cmake_and_doctor_agree_on_which_cpu_is_a_grace(tmp_path: Path, name: str) -> None:
    files, grace = TREES[name]
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    cores = doctor.cpu_cores(str(tmp_path))
    assert (bool(cores) and all(c == doctor.NEOVERSE_V2 for c in cores)) == grace
    cmake = shutil.which("cmake")
    if cmake is None:
        if os.environ.get("CI"):
            pytest.fail("cmake is missing (CI installs it)")
        pytest.skip("no cmake here")
    r = subprocess.run([cmake, f"-DROOT={tmp_path}", "-P", str(REPO / "cpp" / "cmake" / "grace.cmake")],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and not r.stderr, r.stderr
    assert r.stdout.startswith(f"-- {'TRUE' if grace else 'FALSE'}: "), r.stdout


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
