"""``alpsck doctor``: what this installation is and what it finds on this machine, one line per fact.

The alpsck version and the directory it is imported from (a source tree on ``sys.path``, such as
the current directory, shadows the installed package: the directory says which one runs, and a
warning says when it is not the installed one); what the C++ core was built for
(``_core.build_info()``: tuned for NVIDIA Grace, ``neoverse-v2``, or ``portable``); the CRC32C
path it uses on this CPU; the page size; torch and submitit; SLURM: ``sbatch``, ``srun`` and
``sinfo`` on the PATH, and whether a controller answers. On aarch64 it also reads which CPU this
is, and warns when it is a Grace but the core was not tuned for it (or the reverse). ``--json``
prints the same as one JSON document. The exit code is 0: a finding is not a failure.

``--alps [RUN_DIR]`` adds what matters on CSCS's Alps, one line per check, ``NAME: ok|warning|info:
what was found[, and what to do]``: the storage of the run directory (else of ``$SCRATCH``), its
purge window and Lustre quota; ``lfs`` and ``scontrol`` on the PATH; a ``uenv start`` session
(uenv v10 refuses sbatch there); the NCCL and libfabric variables CSCS says to set for GPU jobs;
transparent huge pages; the job's ``--mem``. The JSON document gets them under ``alps``.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import importlib.metadata
import os
import platform
import shlex
import shutil
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .. import __version__, _core
from ..errors import CheckpointError
from ..out import jsonout
from ..store import lustre, storage

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


# ----------------------------------------------------------------------------- --alps

# The NCCL and libfabric variables CSCS says to set for every GPU job (the Container Engine's
# aws-ofi-nccl hook sets them in a container), and the other values it accepts for some.
NCCL_ENV = {"NCCL_NET": "AWS Libfabric", "NCCL_NET_GDR_LEVEL": "PHB", "NCCL_CROSS_NIC": "1", "NCCL_PROTO": "^LL128",
            "FI_CXI_DEFAULT_CQ_SIZE": "131072", "FI_CXI_DEFAULT_TX_SIZE": "16384", "FI_CXI_DISABLE_HOST_REGISTER": "1",
            "FI_CXI_RX_MATCH_MODE": "software", "FI_MR_CACHE_MONITOR": "userfaultfd"}
NCCL_ALSO_FINE = {"FI_CXI_RX_MATCH_MODE": ("hybrid",)}  # CSCS's vetnode uses hybrid
THP_PATH = "/sys/kernel/mm/transparent_hugepage/enabled"
NODE_MEM = "450G"  # the --mem a GH200 node allows
NODE_MEM_MB = 450 * 1024
QUOTA_WARN_FRACTION = 0.9  # a quota this full warns
COMMAND_TIMEOUT_S = 10.0


@dataclasses.dataclass(frozen=True)
class Check:
    """One ``--alps`` check: ``status`` is ok, warning (something to act on) or info (nothing to judge)."""

    name: str
    status: str
    message: str

    def line(self) -> str:
        return f"{self.name}: {self.status}: {self.message}"


def _gib(n: int) -> str:
    return f"{n / (1 << 40):.2f} TiB" if n >= 1 << 40 else f"{n / (1 << 30):.2f} GiB"


def _existing(path: Path) -> Path:
    path = path.absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _quota_text(path: Path) -> tuple[str, bool]:
    """The user's Lustre quota on ``path``'s file system in words, and whether it is nearly full."""
    if shutil.which("lfs") is None:
        return "quota not checked (no `lfs` on PATH)", False
    try:
        q = lustre.lustre_quota(_existing(path))
    except CheckpointError as e:
        return f"quota not checked ({e})", False
    if q.limit_bytes is None and q.limit_inodes is None:
        return f"no Lustre quota set ({_gib(q.used_bytes)} and {q.used_inodes} inodes used)", False
    full = any(limit is not None and used >= QUOTA_WARN_FRACTION * limit
               for used, limit in ((q.used_bytes, q.limit_bytes), (q.used_inodes, q.limit_inodes)))
    text = (f"Lustre quota: {_gib(q.used_bytes)} of {_gib(q.limit_bytes) if q.limit_bytes else 'unlimited'} and "
            f"{q.used_inodes} of {q.limit_inodes or 'unlimited'} inodes used")
    return text + (f", over {QUOTA_WARN_FRACTION:.0%} of it: free space or ask for more" if full else ""), full


def check_storage(run_dir: str | None, env: Mapping[str, str]) -> tuple[Check, storage.Storage | None]:
    """Where the checkpoints go: ``run_dir``, else ``$SCRATCH``."""
    target = run_dir or env.get("SCRATCH") or None
    if target is None:
        return Check("storage", "info", "no RUN_DIR given and $SCRATCH is not set: give the run directory "
                     "(alpsck doctor --alps RUN_DIR)"), None
    st = storage.storage(target)
    what = f"{target}{'' if run_dir else ' ($SCRATCH)'}: {st.describe()}"
    quota, full = _quota_text(Path(target)) if st.kind == "lustre" else (f"quota not checked ({st.kind}, not Lustre)",
                                                                           False)
    warn = st.warning is not None or full
    return Check("storage", "warning" if warn else "ok", f"{what}; {quota}" + (f"; {st.warning}" if st.warning else "")), st


def check_lfs(st: storage.Storage | None) -> Check:
    exe = shutil.which("lfs")
    if exe is not None:
        return Check("lfs", "ok", exe)
    if st is not None and st.kind != "lustre":
        return Check("lfs", "info", f"not on PATH; not needed: the run directory is on {st.kind}, not Lustre")
    return Check("lfs", "warning", "not on PATH: on Lustre alpsck then neither sets the run directory's layout nor "
                 "checks the quota and storage targets before saves (one warning; saves go on): run where `lfs` "
                 "exists, or mount it into the container")


def check_scontrol() -> Check:
    need = ("the maintenance watcher (`scontrol show reservation`) and requeue from inside the job need it: in a "
            "container, mount what CSCS's PyTorch page lists (/etc/slurm, the uenv mount library, the pyxis config)")
    exe = shutil.which("scontrol")
    if exe is None:
        return Check("scontrol", "warning", f"not on PATH: {need}")
    from ..slurm import commands  # the one runner of SLURM's commands

    code, out, err = commands.once([exe, "--version"], COMMAND_TIMEOUT_S)
    if code < 0:  # the reason is stderr's last line (before it, what a command that hung had printed)
        return Check("scontrol", "warning", f"{exe} does not run ({err.strip().splitlines()[-1]}): {need}")
    said = (out.strip() or err.strip()).splitlines()
    if code != 0:
        return Check("scontrol", "warning", f"{exe} does not run (`scontrol --version` exit {code}"
                     + (f": {said[-1]}" if said else "") + f"): {need}")
    return Check("scontrol", "ok", f"{exe}" + (f" ({said[0]})" if said else ""))


def check_uenv(env: Mapping[str, str]) -> Check:
    """``UENV_MOUNT_LIST`` is set by squashfs-mount (``uenv start``, ``uenv run``) and by the uenv SLURM
    plugin (``--uenv``); outside a job it means a ``uenv start`` session."""
    mounts = env.get("UENV_MOUNT_LIST", "").strip()
    if not mounts:
        return Check("uenv", "ok", "not in a uenv session (UENV_MOUNT_LIST is not set)")
    view = env.get("UENV_VIEW", "").strip()
    what = f"{mounts}" + (f", view {view}" if view else "")
    if env.get("SLURM_JOB_ID"):
        return Check("uenv", "info", f"job {env['SLURM_JOB_ID']} runs with the uenv {what}")
    return Check("uenv", "warning", f"inside a `uenv start` session ({what}): uenv v10 refuses sbatch and salloc here, "
                 "so `alpsck submit` fails: exit the session first and give the job its uenv in the job config "
                 "(environment.uenv, environment.view)")


def check_nccl(env: Mapping[str, str]) -> Check:
    unset = [k for k in NCCL_ENV if k not in env]
    differing = [k for k, v in NCCL_ENV.items() if k in env and env[k].strip() not in (v, *NCCL_ALSO_FINE.get(k, ()))]
    if not unset and not differing:
        return Check("nccl env", "ok", f"the {len(NCCL_ENV)} NCCL/libfabric variables CSCS says to set are set")
    found = [f"unset: {', '.join(unset)}"] if unset else []
    if differing:
        found.append("differ: " + ", ".join(f"{k}={env[k]!r} (CSCS: {NCCL_ENV[k]!r})" for k in differing))
    wanted = " ".join(f"{k}={shlex.quote(NCCL_ENV[k])}" for k in NCCL_ENV if k in unset or k in differing)
    return Check("nccl env", "warning", f"{'; '.join(found)}: CSCS says to set them for every GPU job; in a container the "
                 f"aws-ofi-nccl hook of the EDF sets them, else export {wanted} in the job script")


def check_thp(path: str = THP_PATH) -> Check:
    try:
        text = Path(path).read_text().strip()
    except OSError:
        return Check("transparent huge pages", "info", f"not offered by this kernel ({path} cannot be read)")
    mode = text[text.index("[") + 1:text.index("]")] if "[" in text and "]" in text else text
    if mode in ("always", "madvise"):
        return Check("transparent huge pages", "ok", f"{mode}: the restore's read buffers use huge pages")
    return Check("transparent huge pages", "info", f"{mode}: the restore's read buffers use base pages (more system "
                 "CPU for O_DIRECT restores); nothing to do unless restores are slow")


def check_mem(env: Mapping[str, str], machine: str) -> Check:
    """SLURM's ``--mem`` of this job (``SLURM_MEM_PER_NODE``, in MB; 0 is all of the node's)."""
    advice = (f"a GH200 node allows --mem={NODE_MEM}; alpsck's staging memory (the copies of the state a save "
              "takes, max_in_flight of them) counts against the job's memory")
    if not env.get("SLURM_JOB_ID"):
        return Check("slurm --mem", "info", f"not in a SLURM job: {advice}")
    per_node = env.get("SLURM_MEM_PER_NODE", "").strip()
    if not per_node.isdigit():
        other = next((f"{k}={env[k]}" for k in ("SLURM_MEM_PER_GPU", "SLURM_MEM_PER_CPU") if env.get(k)), None)
        return Check("slurm --mem", "info", (f"{other}, not --mem" if other else "no --mem given (the partition's "
                                             "default)") + f": {advice}")
    mb = int(per_node)
    if mb == 0:
        return Check("slurm --mem", "ok", "--mem=0: all of the node's memory")
    if mb < NODE_MEM_MB and machine in ("aarch64", "arm64"):
        return Check("slurm --mem", "warning", f"--mem={mb}M ({mb / 1024:.0f} GiB) per node: {advice}: ask for "
                     f"--mem={NODE_MEM}")
    return Check("slurm --mem", "ok", f"--mem={mb}M ({mb / 1024:.0f} GiB) per node")


def alps(run_dir: str | None, env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Every ``--alps`` check (the ``alps`` part of the ``--json`` document)."""
    env = os.environ if env is None else env
    storage_check, st = check_storage(run_dir, env)
    checks = [storage_check, check_lfs(st), check_scontrol(), check_uenv(env), check_nccl(env), check_thp(),
              check_mem(env, platform.machine())]
    return {"run_dir": run_dir, "storage": dataclasses.asdict(st) if st is not None else None,
            "checks": [dataclasses.asdict(c) for c in checks],
            "warnings": sum(c.status == "warning" for c in checks)}


def _alps_lines(a: dict[str, Any]) -> list[str]:
    lines = [Check(**c).line() for c in a["checks"]]
    warned = [c["name"] for c in a["checks"] if c["status"] == "warning"]
    lines.append(f"alps: {len(warned)} of {len(a['checks'])} checks warn" + (f" ({', '.join(warned)})" if warned else ""))
    return lines


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


def nodes_report(run_dir: str) -> dict[str, list[dict[str, Any]]]:
    """``--nodes``: the health gate's checks (:mod:`alpsck.node_health.checks`, default thresholds) of every node of
    the SLURM allocation this runs in (one srun task per node, as the gate probes them), else of this node."""
    from ..job_env import JobEnv
    from ..node_health.checks import Limits, node_checks, node_name
    from ..slurm.health_gate import probe_nodes

    nodes = JobEnv.detect(os.environ).nodes
    if nodes and shutil.which("srun"):
        limits = dataclasses.asdict(Limits())
        answers = probe_nodes(nodes, run_dir, limits, [sys.executable], 60.0)
        return {n: a.checks for n, a in answers.items()}
    return {node_name(): [c.as_dict() for c in node_checks(run_dir, Limits())]}


def _node_lines(report: dict[str, list[dict[str, Any]]]) -> list[str]:
    lines = []
    for node, checks in report.items():
        if not checks:
            lines.append(f"node {node}: FAIL: no answer from the probe (srun could not start it, or it timed out)")
        for c in checks:
            lines.append(f"node {node}: {c.get('name')}: {'ok' if c.get('ok') else 'FAIL'}: {c.get('detail')} "
                         f"({c.get('seconds')} s)")
    return lines


def _doctor_cmd(args: argparse.Namespace) -> int:
    if args.nodes is not None:
        report = nodes_report(args.nodes or os.getcwd())
        print(jsonout.dumps(report, indent=2) if args.json else "\n".join(_node_lines(report)))
        return 0 if all(checks and all(c.get("ok") for c in checks) for checks in report.values()) else 1
    d = diagnose()
    if args.alps is not None:
        d["alps"] = alps(args.alps or None)
    lines = _lines(d) + (_alps_lines(d["alps"]) if "alps" in d else [])
    print(jsonout.dumps(d, indent=2) if args.json else "\n".join(lines))
    return 0


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "doctor", help="the version, the core's tuning, the CRC32C path, torch, submitit and SLURM found here",
        description="One line per fact: the alpsck version and where it is imported from, what the C++ core was "
                    "built for (tuned for NVIDIA Grace or portable), the CRC32C path on this CPU, the page size, the "
                    "torch and submitit versions, whether sbatch/srun/sinfo are on the PATH and a SLURM controller "
                    "answers, and on aarch64 whether this CPU is a Grace the core was not tuned for. With --alps, one "
                    "line per check of what matters on CSCS's Alps (ok, warning or info, and what to do): the run "
                    "directory's storage, purge window and quota, lfs, scontrol, a uenv start session, the NCCL "
                    "variables, transparent huge pages and the job's --mem. Exits 0: a finding is not a failure.")
    p.add_argument("--json", action="store_true", help="print one JSON document instead")
    p.add_argument("--alps", nargs="?", const="", default=None, metavar="RUN_DIR",
                   help="also check what matters on Alps, for RUN_DIR (default: $SCRATCH)")
    p.add_argument("--nodes", nargs="?", const="", default=None, metavar="RUN_DIR",
                   help="only the health gate's checks, one line per check and node: of every node of the SLURM "
                        "allocation this runs in, else of this node; RUN_DIR: the run directory to write (default: "
                        "the current directory). Exits 1 when a node fails a check")
    p.set_defaults(func=_doctor_cmd)
