"""numa_node: the staging pool on the NUMA node asked for, and the node of a rank's GPU read from sysfs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import alpsck
from alpsck import _core
from alpsck.errors import UsageError
from alpsck.staging import gpu_numa_node, node_of_pci_device

MPOL_DEFAULT, MPOL_PREFERRED = 0, 1


def _state() -> dict[str, object]:
    torch.manual_seed(0)
    return {"model": torch.nn.Linear(256, 256), "step": 1}


@pytest.mark.parametrize("node", ["-1", "last"])
def test_the_staging_pool_is_placed_on_the_node_asked_for_and_saves_restore(tmp_path: Path, node: str) -> None:
    nodes = _core.cpu_numa_nodes()
    assert nodes, "this Linux machine names no NUMA node with CPUs in /sys/devices/system/node/has_cpu"
    want = -1 if node == "-1" else nodes[-1]
    state = _state()
    with alpsck.Checkpointer(tmp_path, numa_node=want, chunk_bytes=64 << 10) as ck:
        ck.save(1, state).wait()
        mode, got = _core.numa_policy_of(ck.engine.staging_address)
    assert (mode, got) == ((MPOL_DEFAULT, -1) if want < 0 else (MPOL_PREFERRED, want))
    fresh = _state()
    with torch.no_grad():
        fresh["model"].weight.zero_()  # type: ignore[union-attr]
    with alpsck.Checkpointer(tmp_path) as ck:
        assert ck.restore(fresh) == 1
    assert torch.equal(fresh["model"].weight, state["model"].weight)  # type: ignore[union-attr]


def test_a_node_without_cpus_or_out_of_range_is_refused_by_name_before_the_run_dir_is_made(tmp_path: Path) -> None:
    missing = max(_core.cpu_numa_nodes()) + 1  # within the option's range, not a node of this machine
    with pytest.raises(UsageError, match=f"numa_node {missing} is not a NUMA node with CPUs on this machine"):
        alpsck.Checkpointer(tmp_path / "a", numa_node=missing)
    assert not (tmp_path / "a").exists()
    with pytest.raises(UsageError, match="numa_node: 1024: must be between -1 and 1023"):
        alpsck.Checkpointer(tmp_path / "b", numa_node=1024)
    assert not (tmp_path / "b").exists()


def _fake_sysfs(root: Path, has_cpu: str, devices: dict[str, str]) -> Path:
    node_dir = root / "devices" / "system" / "node"
    node_dir.mkdir(parents=True)
    (node_dir / "has_cpu").write_text(has_cpu)
    for address, numa_node in devices.items():
        d = root / "bus" / "pci" / "devices" / address
        d.mkdir(parents=True)
        (d / "numa_node").write_text(numa_node)
    return root


def test_the_gpus_node_is_read_from_sysfs_and_only_a_node_with_cpus_counts(tmp_path: Path) -> None:
    # A GH200 node as the kernel shows it: four Graces (nodes 0-3, with CPUs); the GPUs' own
    # memory appears as further nodes without CPUs.
    sysfs = _fake_sysfs(tmp_path, "0-3\n", {"0009:01:00.0": "2\n", "0019:01:00.0": "4\n", "0000:00:01.0": "-1\n",
                                             "0000:00:02.0": "not a number\n"})
    assert node_of_pci_device("0009:01:00.0", sysfs=sysfs) == 2
    assert node_of_pci_device("0019:01:00.0", sysfs=sysfs) == -1  # a memory-only node: not for staging
    assert node_of_pci_device("0000:00:01.0", sysfs=sysfs) == -1  # the kernel does not know (VMs)
    assert node_of_pci_device("0000:00:02.0", sysfs=sysfs) == -1
    assert node_of_pci_device("0000:00:03.0", sysfs=sysfs) == -1  # no such device


def test_gpu_numa_node_is_a_node_with_cpus_or_minus_one() -> None:
    got = gpu_numa_node()
    if torch.cuda.is_available():
        assert got == -1 or got in _core.cpu_numa_nodes()
    else:
        assert got == -1
    assert alpsck.gpu_numa_node is gpu_numa_node
