"""Which NUMA node a rank's staging memory belongs on: the one of its GPU's CPU.

On a GH200 node each of the four GPUs has its own Grace CPU with its own memory (one NUMA node
each). A rank's device-to-host copies and the writers' reads of its staging memory stay on that
superchip only if the memory is there too; elsewhere every byte crosses the links between the
chips. Pass the node to the Checkpointer as ``numa_node`` (the engine option, which places the
staging pool there with ``mbind``; -1, the default, leaves it wherever the thread that faults it
in runs)::

    ck = alpsck.Checkpointer(run_dir, numa_node=alpsck.gpu_numa_node())

The node is read from the kernel (the GPU's PCI device in sysfs), never guessed from the local
rank: a wrong guess would be worse than the default.
"""

from __future__ import annotations

from pathlib import Path

import torch

from . import _core

__all__ = ["gpu_numa_node"]


def _pci_address(device: torch.device) -> str | None:
    """The sysfs name of a CUDA device's PCI function (``0000:01:00.0``), or None if torch does not say."""
    props = torch.cuda.get_device_properties(device)
    bus, dev, domain = (getattr(props, f"pci_{k}_id", None) for k in ("bus", "device", "domain"))
    if not all(isinstance(v, int) for v in (bus, dev, domain)):
        return None
    return f"{domain:04x}:{bus:02x}:{dev:02x}.0"


def gpu_numa_node(device: torch.device | int | None = None, *, sysfs: str | Path = "/sys") -> int:
    """The NUMA node of the CPU attached to CUDA ``device`` (default: the current one), or -1.

    -1 (the ``numa_node`` option's "no placement") when there is no CUDA device, when the kernel
    does not know the device's node (sysfs says -1, as on many VMs), or when that node has no
    CPUs (a node of GPU memory: staging memory belongs on the CPU's node).
    """
    if not torch.cuda.is_available():
        return -1
    dev = torch.device("cuda", torch.cuda.current_device() if device is None else device) \
        if not isinstance(device, torch.device) else device
    address = _pci_address(dev)
    if address is None:
        return -1
    return node_of_pci_device(address, sysfs=sysfs)


def node_of_pci_device(address: str, *, sysfs: str | Path = "/sys") -> int:
    """The NUMA node sysfs gives PCI function ``address`` if that node has CPUs, else -1."""
    try:
        node = int((Path(sysfs) / "bus" / "pci" / "devices" / address / "numa_node").read_text().strip())
    except (OSError, ValueError):
        return -1
    if node < 0:
        return -1
    return node if node in _core.cpu_numa_nodes(str(sysfs)) else -1
