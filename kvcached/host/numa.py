"""Placing the host pool on the GPU's NUMA node (`--numa auto|off|N`).

auto: the node the CUDA device's PCI slot reports in sysfs (nothing to do on a CPU device or
where the kernel reports none); N: that node; off: the kernel's default policy. The binding is
set with mbind(2) on the pool's mapping before its pages are first touched, so every page is
allocated there.
"""
from __future__ import annotations

import ctypes
import logging
import os
import platform

from ..errors import StartupError

log = logging.getLogger(__name__)

MPOL_BIND = 2
_SYS_MBIND = {"x86_64": 237, "aarch64": 235}


def node_of_device(device: str) -> int | None:
    """The NUMA node of a CUDA device's PCI slot, or None when unknown."""
    if not device.startswith("cuda"):
        return None
    import torch

    index = int(device.split(":")[1]) if ":" in device else 0
    props = torch.cuda.get_device_properties(index)
    bus = getattr(props, "pci_bus_id", None)
    if bus is None:
        return None
    slot = f"{getattr(props, 'pci_domain_id', 0):04x}:{bus:02x}:{getattr(props, 'pci_device_id', 0):02x}.0"
    try:
        with open(f"/sys/bus/pci/devices/{slot}/numa_node") as f:
            node = int(f.read().strip())
    except OSError:
        return None
    return node if node >= 0 else None


def resolve_node(setting: str, device: str) -> int | None:
    if setting == "off":
        return None
    node = node_of_device(device) if setting == "auto" else int(setting)
    if node is not None and not os.path.isdir(f"/sys/devices/system/node/node{node}"):
        raise StartupError(f"--numa {setting}: NUMA node {node} does not exist on this machine")
    return node


def bind(address: int, length: int, node: int) -> None:
    """Bind [address, address+length) to `node` (before first touch)."""
    nr = _SYS_MBIND.get(platform.machine())
    if nr is None:
        raise StartupError(f"--numa: mbind is not wired for {platform.machine()}; use --numa off")
    mask = (ctypes.c_ulong * 16)()
    mask[node // 64] = 1 << (node % 64)
    libc = ctypes.CDLL(None, use_errno=True)
    rc = libc.syscall(nr, ctypes.c_void_p(address), ctypes.c_ulong(length), MPOL_BIND,
                      mask, ctypes.c_ulong(16 * 64), 0)
    if rc != 0:
        err = ctypes.get_errno()
        raise StartupError(f"--numa: mbind to node {node} failed: {os.strerror(err)}")
    log.info("[host] host pool bound to NUMA node %d", node)
