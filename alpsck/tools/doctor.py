"""``alpsck doctor``: what this installation is and what it finds on this machine, one line per fact.

The alpsck version and the directory it is imported from (a source tree on ``sys.path``, such as
the current directory, shadows the installed package: the directory says which one runs, and a
warning says when it is not the installed one); what the C++ core was built for
(``_core.build_info()``: tuned for NVIDIA Grace, ``neoverse-v2``, or ``portable``); the CRC32C
path it uses on this CPU; the page size; torch and submitit; SLURM: ``sbatch``, ``srun`` and
``sinfo`` on the PATH, and whether a controller answers. On aarch64 it also reads which CPU this
is, and warns when it is a Grace but the core was not tuned for it (or the reverse). ``--json``
prints the same as one JSON document. The exit code is 0: a finding is not a failure.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import platform
import shutil
from pathlib import Path
from typing import Any

from .. import __version__, _core
from . import jsonout

SLURM_COMMANDS = ("sbatch", "srun", "sinfo")
# CPU implementer and part of an Arm Neoverse-V2 (NVIDIA Grace), as /proc/cpuinfo spells them: the
# same test as CMakeLists.txt's ALPSCK_TUNE_GRACE=AUTO (cpp/cmake/grace.cmake).
NEOVERSE_V2 = ("0x41", "0xd4f")


def cpu_cores(root: str = "") -> list[tuple[str, str]]:
    """(implementer, part) of every core the kernel lists: from /proc/cpuinfo, else from each core's
    MIDR_EL1 in sysfs (as cpp/cmake/grace.cmake reads them); [] where neither says (not aarch64)."""
    cores: list[tuple[str, str]] = []
    try:
        implementer = ""
        for line in Path(f"{root}/proc/cpuinfo").read_text(errors="replace").lower().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "cpu implementer":
                implementer = value.strip()
            elif key.strip() == "cpu part":
                cores.append((implementer, value.strip()))
                implementer = ""
    except OSError:
        pass
    if cores:
        return cores
    for f in sorted(Path(f"{root}/sys/devices/system/cpu").glob("cpu*/regs/identification/midr_el1")):
        try:
            midr = int(f.read_text().strip(), 16)
        except (OSError, ValueError):
            continue
        cores.append((hex((midr >> 24) & 0xFF), hex((midr >> 4) & 0xFFF)))
    return cores


def _installed_package_dir() -> str | None:
    """Where pip installed alpsck, or None (not installed, or an editable install)."""
    try:
        dist = importlib.metadata.distribution("alpsck")
    except importlib.metadata.PackageNotFoundError:
        return None
    init = Path(str(dist.locate_file("alpsck/__init__.py")))
    return str(init.parent.resolve()) if init.is_file() else None


def _version(module: str, warnings: list[str]) -> str | None:
    """The module's version; None, and a warning that says why, when it does not import."""
    try:
        return str(importlib.import_module(module).__version__)
    except Exception as e:  # not installed, or broken: either is what doctor reports
        warnings.append(f"{module} is not importable ({type(e).__name__}: {e})")
        return None


def _slurm() -> dict[str, Any]:
    commands = {c: shutil.which(c) for c in SLURM_COMMANDS}
    try:
        from ..slurm.submit import slurm_unavailable
    except Exception as e:
        unavailable: str | None = f"cannot check ({type(e).__name__}: {e})"
    else:
        unavailable = slurm_unavailable()
    return {"commands": commands, "controller": unavailable is None, "unavailable": unavailable}


def diagnose() -> dict[str, Any]:
    """Every fact ``alpsck doctor`` reports (the ``--json`` document)."""
    build = dict(_core.build_info())
    package = str(Path(__file__).resolve().parents[1])  # alpsck/, above tools/
    installed = _installed_package_dir()
    machine = platform.machine()
    warnings: list[str] = []
    if installed is not None and installed != package:
        warnings.append(f"alpsck is imported from {package}, not from the installed {installed}: a source tree "
                        "on sys.path (the current directory?) shadows the install")
    grace: bool | None = None
    cores: list[tuple[str, str]] = []
    if machine in ("aarch64", "arm64"):
        cores = cpu_cores()
        grace = all(c == NEOVERSE_V2 for c in cores) if cores else None
        if grace and build["tuning"] != "neoverse-v2":
            warnings.append(f"this CPU is an NVIDIA Grace (Neoverse-V2) but the core was built {build['tuning']}: "
                            "rebuild it on this node (pip install . from the source tree tunes for it; "
                            "-C cmake.define.ALPSCK_TUNE_GRACE=ON forces it)")
        elif grace is False and build["tuning"] == "neoverse-v2":
            warnings.append(f"the core was tuned for NVIDIA Grace ({build['arch_flags']}) but this CPU is not one: it "
                            "may stop on an illegal instruction; reinstall here (ALPSCK_TUNE_GRACE=AUTO builds portable)")
    return {
        "version": __version__,
        "package_path": package,
        "installed_path": installed,
        "core_path": str(Path(_core.__file__).resolve()),
        "tuning": build["tuning"],
        "build": build,
        "crc32c": _core.crc32c_backend(),
        "page_size": _core.page_size(),
        "torch": _version("torch", warnings),
        "submitit": _version("submitit", warnings),
        "slurm": _slurm(),
        "machine": machine,
        "cpu_cores": sorted({f"{i}/{p}" for i, p in cores}),
        "grace_cpu": grace,
        "warnings": warnings,
    }


def _lines(d: dict[str, Any]) -> list[str]:
    b = d["build"]
    flags = f"{b['arch_flags']}, " if b["arch_flags"] else ""
    crc = d["crc32c"]
    if crc == "portable" and b["crc32c_hardware"] != "none":
        crc += f" (this CPU lacks the build's {b['crc32c_hardware']})"
    slurm = d["slurm"]
    commands = ", ".join(f"{c} {p}" if p else f"{c} not found" for c, p in slurm["commands"].items())
    if d["machine"] not in ("aarch64", "arm64"):
        cpu = d["machine"]
    elif d["grace_cpu"] is None:
        cpu = f"{d['machine']}, which CPU is not known (no CPU part in /proc/cpuinfo nor MIDR_EL1 in sysfs)"
    elif d["grace_cpu"]:
        cpu = f"{d['machine']}, NVIDIA Grace (Neoverse-V2)"
    else:
        cpu = f"{d['machine']}, not a Neoverse-V2 (implementer/part {', '.join(d['cpu_cores'])})"
    return [
        f"alpsck: {d['version']} ({d['package_path']})",
        f"core tuning: {d['tuning']} ({flags}{b['compiler']}, {b['arch']}, {b['build_type']})",
        f"crc32c: {crc}",
        f"page size: {d['page_size']}",
        f"torch: {d['torch'] or 'not importable'}",
        f"submitit: {d['submitit'] or 'not importable'}",
        f"slurm commands: {commands}",
        f"slurm controller: {'answers' if slurm['controller'] else slurm['unavailable']}",
        f"cpu: {cpu}",
        *(f"warning: {w}" for w in d["warnings"]),
    ]


def _doctor_cmd(args: argparse.Namespace) -> int:
    d = diagnose()
    print(jsonout.dumps(d, indent=2) if args.json else "\n".join(_lines(d)))
    return 0


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "doctor", help="the version, the core's tuning, the CRC32C path, torch, submitit and SLURM found here",
        description="One line per fact: the alpsck version and where it is imported from, what the C++ core was "
                    "built for (tuned for NVIDIA Grace or portable), the CRC32C path on this CPU, the page size, the "
                    "torch and submitit versions, whether sbatch/srun/sinfo are on the PATH and a SLURM controller "
                    "answers, and on aarch64 whether this CPU is a Grace the core was not tuned for. Exits 0.")
    p.add_argument("--json", action="store_true", help="print one JSON document instead")
    p.set_defaults(func=_doctor_cmd)
