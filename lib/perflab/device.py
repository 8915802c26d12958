"""Which device to run on, how to wait for it, and where a program waits for it.

    >>> import torch
    >>> from perflab.device import pick_device, synchronize, SyncCounter
    >>> device = pick_device()            # cuda if present, else mps, else cpu
    >>> x = torch.randn(256, 256, device=device)
    >>> y = x @ x                          # on a GPU this only *queues* the matmul
    >>> synchronize(device)                # returns once the queued work has finished
    >>> with SyncCounter() as syncs:
    ...     loss = y.sum().item()           # .item() makes the host wait for the device
    >>> syncs.total
    1

Set ``PERFLAB_DEVICE=cpu`` (or ``cuda:1``, ``mps``...) to override the automatic choice.

Used in: every notebook, lectures 01-11 and labs 01-12.
"""

from __future__ import annotations

import functools
import os
import platform
import threading
import warnings
from collections import Counter
from dataclasses import dataclass, field

import torch

__all__ = [
    "DEVICE_ENV_VAR",
    "SyncCount",
    "SyncCounter",
    "available_devices",
    "device_name",
    "pick_device",
    "synchronize",
]

DEVICE_ENV_VAR = "PERFLAB_DEVICE"


def available_devices() -> list[str]:
    """The device types this machine can run on, best first, e.g. ``['cuda', 'cpu']``."""
    found = []
    if torch.cuda.is_available():
        found.append("cuda")
    if torch.backends.mps.is_available():
        found.append("mps")
    found.append("cpu")
    return found


def pick_device(preferred: str | torch.device | None = None) -> torch.device:
    """The device to use: ``preferred``, else ``$PERFLAB_DEVICE``, else the best available.

    Raises a ``RuntimeError`` naming what *is* available when the requested device is not,
    rather than falling back silently to a slower one.
    """
    requested = preferred if preferred is not None else os.environ.get(DEVICE_ENV_VAR)
    if requested is None or requested == "":
        return torch.device(available_devices()[0])
    try:
        device = torch.device(requested)
    except RuntimeError as error:
        raise ValueError(f"{requested!r} is not a device name such as 'cpu', 'cuda' or 'cuda:1'") from error
    if device.type not in available_devices():
        source = f"${DEVICE_ENV_VAR}" if preferred is None else "pick_device()"
        raise RuntimeError(
            f"{source} asked for {str(device)!r}, which this machine does not have; "
            f"available here: {', '.join(available_devices())}"
        )
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise RuntimeError(f"{device} asked for, but this machine has {torch.cuda.device_count()} CUDA device(s)")
    return device


def device_name(device: str | torch.device) -> str:
    """The GPU's marketing name, or the CPU's model name from the OS."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def synchronize(device: str | torch.device | None = None) -> None:
    """Block the calling thread until all work queued on ``device`` has finished.

    A no-op on the CPU, whose operators run to completion on the calling thread before they
    return. On an accelerator, kernels are queued and run later: a clock read without this
    call measures how long it took to *queue* the work, not to do it.
    """
    device = pick_device() if device is None else torch.device(device)
    if device.type == "cpu":
        return
    if torch.accelerator.is_available() and torch.accelerator.current_accelerator().type == device.type:
        torch.accelerator.synchronize(device)
        return
    raise RuntimeError(f"cannot synchronize {device}: it is not this machine's accelerator")


# Tensor methods that copy a value to the host, so on an accelerator the host must first wait
# for every queued kernel that produces it.
_SYNCING_METHODS = (
    "item",
    "tolist",
    "numpy",
    "cpu",
    "nonzero",
    "__bool__",
    "__float__",
    "__int__",
    "__index__",
    "__repr__",
    "__format__",
)


@dataclass
class SyncCount:
    """How many times code asked for a device value on the host, by method."""

    by_method: Counter = field(default_factory=Counter)

    @property
    def total(self) -> int:
        return sum(self.by_method.values())

    def __repr__(self) -> str:
        if not self.by_method:
            return "SyncCount(0 host-device sync points)"
        parts = ", ".join(f"{name} x{count}" for name, count in self.by_method.most_common())
        return f"SyncCount({self.total} host-device sync points: {parts})"


class SyncCounter:
    """Count the host-device synchronization points that Python code runs.

    Works on every device, a CPU included, because it counts *requests* for a value on the
    host (``.item()``, ``print(t)``, ``if t:``, ``.cpu()``...), each of which makes the host
    wait for the accelerator. On a CPU nothing waits, but the same code on a GPU would stall
    at each one. ``torch.cuda.set_sync_debug_mode`` does this on CUDA alone.

    >>> import torch
    >>> weights = torch.randn(8, requires_grad=True)
    >>> with SyncCounter() as syncs:
    ...     for step in range(100):
    ...         loss = (weights * weights).sum()
    ...         logged = loss.item()               # logging the loss every step: a sync every step
    >>> syncs
    SyncCount(100 host-device sync points: item x100)

    A call made inside another counted call (``print`` calling ``.tolist()``) counts once.
    Every tensor counts, a CPU tensor too (an optimizer's step counter read with ``.item()``),
    because on a CPU there is no telling which tensors would live on the device. Not counted:
    syncs hidden inside operators, such as ``t.to("cpu")``, indexing with a boolean mask, or
    ``torch.nonzero`` called as a function; ``torch.cuda.set_sync_debug_mode("warn")`` finds
    those on a GPU.
    """

    def __init__(self) -> None:
        self.result = SyncCount()
        self._originals: dict[str, object | None] = {}
        self._inside = threading.local()

    def _counting(self, name: str, method):
        @functools.wraps(method)
        def wrapper(tensor, *args, **kwargs):
            if getattr(self._inside, "active", False):
                return method(tensor, *args, **kwargs)
            self._inside.active = True
            try:
                self.result.by_method[name] += 1
                return method(tensor, *args, **kwargs)
            finally:
                self._inside.active = False

        return wrapper

    def __enter__(self) -> SyncCount:
        if self._originals:
            raise RuntimeError("this SyncCounter is already counting; make a new one to nest")
        for name in _SYNCING_METHODS:
            # None marks a method inherited from the C base class: restored by deleting ours.
            self._originals[name] = torch.Tensor.__dict__.get(name)
            setattr(torch.Tensor, name, self._counting(name, getattr(torch.Tensor, name)))
        return self.result

    def __exit__(self, *exc_info) -> None:
        for name, original in self._originals.items():
            if original is None:
                delattr(torch.Tensor, name)
            else:
                setattr(torch.Tensor, name, original)
        self._originals.clear()


def count_syncs() -> SyncCounter:
    """Deprecated: the old name of :class:`SyncCounter`, kept for one release."""
    warnings.warn(
        "count_syncs() was renamed SyncCounter(); the old name goes away in the next release",
        DeprecationWarning,
        stacklevel=2,
    )
    return SyncCounter()
