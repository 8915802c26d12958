"""The caches between a device's arithmetic and its main memory, as the system reports them.

    >>> from perflab.caches import Cache, device_caches
    >>> caches = device_caches("cpu")     # Linux's sysfs; () where the system does not say
    >>> all(cache.size_bytes > 0 for cache in caches)
    True
    >>> [cache.name for cache in caches]  # doctest: +SKIP
    ['L1d', 'L2', 'L3']
    >>> Cache("L3", 32 * 2**20, shared_by=16)
    Cache(L3: 32 MiB, shared by 16 CPUs)

A working set that fits in a cache is read and written at the cache's bandwidth, not at main
memory's: an operator timed on data that fits can beat a roofline whose bandwidth roof was measured
on data that does not (lecture 01 sweeps an add across these sizes). A CPU's caches come from
``/sys/devices/system/cpu/cpu0/cache/index*/`` (``level``, ``type``, ``size``, ``shared_cpu_list``;
https://www.kernel.org/doc/Documentation/ABI/testing/sysfs-devices-system-cpu); instruction caches are
left out, since they hold code, not tensors. A CUDA GPU reports its L2
(``torch.cuda.get_device_properties(device).L2_cache_size``), shared by all its SMs.

Used in: lecture 01 (gpu basics).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = ["Cache", "device_caches", "format_bytes"]

_SYSFS = Path("/sys/devices/system/cpu/cpu0/cache")
_UNITS = {"K": 2**10, "M": 2**20, "G": 2**30}


def format_bytes(size: float) -> str:
    """``48 KiB``, ``1 MiB``, ``1.5 GiB``: binary prefixes, as caches are sized."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if size >= scale:
            return f"{size / scale:.3g} {unit}"
    return f"{size:.3g} B"


@dataclass(frozen=True)
class Cache:
    """One cache level: its name ("L1d", "L2", ...), its size, and how many CPUs share it (None: a whole GPU)."""

    name: str
    size_bytes: int
    shared_by: int | None = 1

    @property
    def label(self) -> str:
        """Its name and size, for a chart: ``L2 1 MiB``."""
        return f"{self.name} {format_bytes(self.size_bytes)}"

    def __repr__(self) -> str:
        size = format_bytes(self.size_bytes)
        shared = {1: "private to one CPU", None: "shared by the whole GPU"}.get(
            self.shared_by, f"shared by {self.shared_by} CPUs"
        )
        return f"Cache({self.name}: {size}, {shared})"


def _cpu_count(cpu_list: str) -> int:
    """CPUs in a sysfs list such as ``0-3,8-11``."""
    count = 0
    for part in cpu_list.strip().split(","):
        first, _, last = part.partition("-")
        count += int(last or first) - int(first) + 1
    return count


def _cpu_caches(root: Path = _SYSFS) -> tuple[Cache, ...]:
    caches = []
    for index in sorted(root.glob("index*")):
        try:
            read = {name: (index / name).read_text().strip() for name in ("level", "type", "size", "shared_cpu_list")}
        except OSError:
            continue
        if read["type"] == "Instruction":
            continue
        size = read["size"]
        size_bytes = int(size[:-1]) * _UNITS[size[-1]] if size[-1] in _UNITS else int(size)
        name = f"L{read['level']}" + ("d" if read["type"] == "Data" else "")
        caches.append(Cache(name, size_bytes, _cpu_count(read["shared_cpu_list"])))
    return tuple(sorted(caches, key=lambda cache: cache.size_bytes))


def device_caches(device: str | torch.device) -> tuple[Cache, ...]:
    """The data caches of ``device``, smallest first: a CPU's from sysfs, a CUDA GPU's L2; () where unknown."""
    device = torch.device(device)
    if device.type == "cpu":
        return _cpu_caches()
    if device.type == "cuda":
        return (Cache("L2", torch.cuda.get_device_properties(device).L2_cache_size, shared_by=None),)
    return ()
