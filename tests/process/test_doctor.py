"""``alpsck doctor`` and ``--version`` report what the core was built for (``_core.build_info()``), and
the Grace detection of CMakeLists.txt (cpp/cmake/grace.cmake) agrees with the doctor's."""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from support.lfs import Lfs

import alpsck
from alpsck import _core
from alpsck.tools import doctor

REPO = Path(__file__).resolve().parents[2]
PACKAGE = str(Path(alpsck.__file__).resolve().parent)


def _alpsck(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    # From a directory of its own, so that what runs is the package this test imported, not a source tree.
    r = subprocess.run([sys.executable, "-m", "alpsck", *args], capture_output=True, text=True, timeout=120, cwd=cwd)
    assert r.returncode == 0, r.stderr
    return r


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


# ---- doctor --alps: what matters on CSCS's Alps, driven in a subprocess with a controlled environment

NCCL_SET = {"NCCL_NET": "AWS Libfabric", "NCCL_NET_GDR_LEVEL": "PHB", "NCCL_CROSS_NIC": "1", "NCCL_PROTO": "^LL128",
            "FI_CXI_DEFAULT_CQ_SIZE": "131072", "FI_CXI_DEFAULT_TX_SIZE": "16384", "FI_CXI_DISABLE_HOST_REGISTER": "1",
            "FI_CXI_RX_MATCH_MODE": "software", "FI_MR_CACHE_MONITOR": "userfaultfd"}


def _tool(bin_dir: Path, name: str, body: str) -> Path:
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / name).write_text(f"#!/bin/sh\n{body}\n")
    (bin_dir / name).chmod(0o755)
    return bin_dir / name


def _doctor_alps(tmp_path: Path, *args: str, path: list[Path], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """`alpsck doctor --alps ARGS` with PATH made of ``path`` alone and no variable of the caller's
    but PYTHONPATH (which alpsck this is): nothing of this machine's NCCL, uenv or SLURM leaks in."""
    base = {"PATH": os.pathsep.join(map(str, path)), "HOME": str(tmp_path / "users" / "me"), "LANG": "C.UTF-8"}
    if "PYTHONPATH" in os.environ:
        base["PYTHONPATH"] = os.environ["PYTHONPATH"]
    r = subprocess.run([sys.executable, "-m", "alpsck", "doctor", "--alps", *args], capture_output=True, text=True,
                       timeout=120, cwd=tmp_path, env={**base, **env})
    assert r.returncode == 0, r.stderr  # findings are not failures, as for the doctor without --alps
    return r


def _alps_lines(out: str) -> dict[str, str]:
    names = ("storage", "lfs", "scontrol", "uenv", "nccl env", "transparent huge pages", "slurm --mem", "alps")
    found = {}
    for line in out.splitlines():
        name, _, rest = line.partition(": ")
        if name in names:
            assert name not in found, f"two {name} lines: {out}"
            found[name] = rest
    assert list(found) == list(names), out  # every check, one line each, in this order, the summary last
    return found


def _thp_expected() -> str:
    try:
        text = Path(doctor.THP_PATH).read_text()
    except OSError:
        return "info: not offered by this kernel"
    mode = text[text.index("[") + 1:text.index("]")]
    return f"{'ok' if mode in ('always', 'madvise') else 'info'}: {mode}: "


def test_doctor_alps_on_a_login_node_in_a_uenv_on_iopsstor_without_lfs(tmp_path: Path) -> None:
    """Clariden's $SCRATCH (Iopsstor), inside `uenv start`, a container-like PATH without lfs, some
    NCCL variables set and one set otherwise: each check says what is wrong and what to do."""
    scratch = tmp_path / "iopsstor" / "scratch" / "cscs" / "me"
    scratch.mkdir(parents=True)
    scontrol = _tool(tmp_path / "bin", "scontrol", "echo 'slurm 24.05.4'")
    out = _doctor_alps(tmp_path, path=[tmp_path / "bin"], env={
        "SCRATCH": str(scratch), "ALPSCK_FS_KIND": "lustre",
        "UENV_MOUNT_LIST": "file:///capstor/uenv/pytorch.squashfs:/user-environment",
        "UENV_VIEW": "/user-environment:default", "NCCL_NET": "AWS Libfabric", "NCCL_PROTO": "simple",
        "FI_CXI_RX_MATCH_MODE": "hybrid"}).stdout
    lines = _alps_lines(out)
    assert lines["storage"].startswith(f"warning: {scratch} ($SCRATCH): Iopsstor scratch (Lustre), purged after 14 days "
                                       "without access; quota not checked (no `lfs` on PATH); Iopsstor"), lines
    assert "/capstor/scratch/cscs/$USER" in lines["storage"]
    assert lines["lfs"].startswith("warning: not on PATH: on Lustre alpsck then neither sets the run directory's layout")
    assert lines["scontrol"] == f"ok: {scontrol} (slurm 24.05.4)"
    assert lines["uenv"].startswith("warning: inside a `uenv start` session (file:///capstor/uenv/pytorch.squashfs:"
                                    "/user-environment, view /user-environment:default): uenv v10 refuses sbatch")
    assert "exit the session" in lines["uenv"]
    nccl = lines["nccl env"]
    unset = [k for k in NCCL_SET if k not in ("NCCL_NET", "NCCL_PROTO", "FI_CXI_RX_MATCH_MODE")]
    assert nccl.startswith(f"warning: unset: {', '.join(unset)}; differ: NCCL_PROTO='simple' (CSCS: '^LL128'): "), nccl
    assert "aws-ofi-nccl hook" in nccl and "export NCCL_NET_GDR_LEVEL=PHB " in nccl and "NCCL_PROTO='^LL128'" in nccl
    assert "FI_CXI_RX_MATCH_MODE" not in nccl  # hybrid (vetnode's) is fine too
    assert lines["transparent huge pages"].startswith(_thp_expected())
    assert lines["slurm --mem"].startswith("info: not in a SLURM job: a GH200 node allows --mem=450G")
    assert lines["alps"] == "4 of 7 checks warn (storage, lfs, uenv, nccl env)"


def test_doctor_alps_in_a_job_on_capstor_with_everything_set(tmp_path: Path) -> None:
    """The run directory on Capstor scratch, lfs there (the stand-in: its quota is read), the NCCL
    variables set, --mem=450G, a uenv given to the job: nothing warns; --json has the same."""
    lfs = Lfs(tmp_path)
    lfs.set(quota=[1 << 20, 0, 150 * (1 << 30), 1000, 0, 1_000_000])  # 1 GiB of 150 TiB, in KiB
    scontrol = _tool(tmp_path / "tools", "scontrol", "echo 'slurm 24.05.4'")
    run = tmp_path / "capstor" / "scratch" / "cscs" / "me" / "run"  # not made yet
    run.parent.mkdir(parents=True)
    env = {"ALPSCK_FS_KIND": "lustre", "LFS_STANDIN_STATE": str(lfs.state_path), "LFS_STANDIN_LOG": str(lfs.log),
           "SLURM_JOB_ID": "4242", "SLURM_MEM_PER_NODE": str(450 * 1024), "UENV_MOUNT_LIST": "file:///u.sqfs:/user-environment",
           **NCCL_SET}
    lines = _alps_lines(_doctor_alps(tmp_path, str(run), path=[lfs.bin, tmp_path / "tools"], env=env).stdout)
    assert lines["storage"] == (f"ok: {run}: Capstor scratch (Lustre), purged after 30 days without access; Lustre quota: "
                                "1.00 GiB of 150.00 TiB and 1000 of 1000000 inodes used")
    assert ["quota", "-q", "-u", str(os.getuid()), str(run.parent)] in lfs.calls()
    assert lines["lfs"] == f"ok: {lfs.bin / 'lfs'}"
    assert lines["scontrol"] == f"ok: {scontrol} (slurm 24.05.4)"
    assert lines["uenv"] == "info: job 4242 runs with the uenv file:///u.sqfs:/user-environment"
    assert lines["nccl env"] == "ok: the 9 NCCL/libfabric variables CSCS says to set are set"
    assert lines["slurm --mem"] == "ok: --mem=460800M (450 GiB) per node"
    assert lines["alps"] == "0 of 7 checks warn"
    d = json.loads(_doctor_alps(tmp_path, str(run), "--json", path=[lfs.bin, tmp_path / "tools"], env=env).stdout)
    assert d["version"] == alpsck.__version__  # the doctor's own facts are still there
    alps = d["alps"]
    assert alps["run_dir"] == str(run) and alps["warnings"] == 0
    assert alps["storage"] == {"name": "capstor", "kind": "lustre", "purge_days": 30, "warning": None,
                               "needs_opt_in": False}
    assert [c["name"] for c in alps["checks"]] == ["storage", "lfs", "scontrol", "uenv", "nccl env",
                                                   "transparent huge pages", "slurm --mem"]
    assert {c["status"] for c in alps["checks"]} <= {"ok", "info"}


def test_doctor_alps_with_a_run_dir_in_an_nfs_home_and_a_broken_scontrol(tmp_path: Path) -> None:
    """Home on NFS (Alps): the opt-in's warning; lfs not needed off Lustre; scontrol there but
    failing, as in a container without /etc/slurm; a quota nearly full on Lustre warns too."""
    home = tmp_path / "users" / "me"
    home.mkdir(parents=True)
    _tool(tmp_path / "bin", "scontrol", "echo 'scontrol: fatal: Could not establish a configuration source' >&2; exit 1")
    lines = _alps_lines(_doctor_alps(tmp_path, str(home / "runs" / "x"), path=[tmp_path / "bin"],
                                     env={"ALPSCK_FS_KIND": "nfs"}).stdout)
    assert lines["storage"].startswith(f"warning: {home / 'runs' / 'x'}: home directory (NFS, a 50 GB and 500k inodes "
                                       "quota); quota not checked (nfs, not Lustre); $HOME is NFS with a 50 GB"), lines
    assert lines["lfs"] == "info: not on PATH; not needed: the run directory is on nfs, not Lustre"
    assert lines["scontrol"].startswith(f"warning: {tmp_path / 'bin' / 'scontrol'} does not run (`scontrol --version` "
                                        "exit 1: scontrol: fatal: Could not establish a configuration source)")
    assert "/etc/slurm" in lines["scontrol"]
    assert lines["uenv"] == "ok: not in a uenv session (UENV_MOUNT_LIST is not set)"
    assert lines["alps"] == "3 of 7 checks warn (storage, scontrol, nccl env)"

    (tmp_path / "lustre").mkdir()
    lfs = Lfs(tmp_path / "lustre")  # a 1 GiB quota with 950 MiB used
    lfs.set(quota=[950 * 1024, 0, 1 << 20, 10, 0, 1_000_000])
    run = tmp_path / "capstor" / "scratch" / "cscs" / "me"
    run.mkdir(parents=True)
    lines = _alps_lines(_doctor_alps(tmp_path, str(run), path=[lfs.bin], env={
        "ALPSCK_FS_KIND": "lustre", "LFS_STANDIN_STATE": str(lfs.state_path), "LFS_STANDIN_LOG": str(lfs.log)}).stdout)
    assert lines["storage"].startswith("warning: ") and lines["storage"].endswith(
        "0.93 GiB of 1.00 GiB and 10 of 1000000 inodes used, over 90% of it: free space or ask for more"), lines
