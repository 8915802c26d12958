"""What one call dispatches, counted by ``torch.profiler``: operators called, operators in all, kernels on a GPU.

    >>> import torch
    >>> from perflab.launches import count_launches
    >>> weights = [torch.randn(64) for _ in range(10)]
    >>> updates = [torch.randn(64) for _ in range(10)]
    >>> count_launches(lambda: [w.add_(u) for w, u in zip(weights, updates)], device="cpu")  # one call per tensor
    Launches(10 operators called, 10 in all: aten::add_ x10)
    >>> count_launches(lambda: torch._foreach_add_(weights, updates), device="cpu")          # one for the list
    Launches(1 operator called, 11 in all: aten::_foreach_add_ x1)

Every operator called costs a fixed overhead (Python, the dispatcher), and on a GPU every kernel
costs a launch; a step that runs many small operators spends its time there rather than on
arithmetic. The counts say how many times that overhead is paid:

- **called**: the ATen operators the call ran that no other ATen operator ran: what Python (or
  compiled code) asked for, each paying the dispatcher's overhead;
- **in all**: those and the operators they ran in turn (a ``_foreach_`` operator on a CPU runs
  the single-tensor operator once per tensor, in C++);
- **kernels**: on a GPU, the kernels the device ran (copies and memsets left out); ``None`` on a
  CPU, where an operator's kernel is an ordinary function call.

Code that ``torch.compile`` generated is not an ATen operator: on a CPU its C++ kernels do not
show here (``perflab.compiling.generated_code`` lists them); on a GPU its Triton kernels count
as kernels.

Used in: lecture 06 (compile).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from perflab.device import pick_device, synchronize
from perflab.render import Table

__all__ = ["Launches", "count_launches"]

# The profiler records device activity under these activities; a device absent here has no kernel count.
_DEVICE_ACTIVITIES = {"cuda": (ProfilerActivity.CUDA, DeviceType.CUDA)}
_NOT_KERNELS = ("Memcpy", "Memset")  # device activity that moves or fills memory


@dataclass(frozen=True)
class Launches:
    """The operators and kernels of one call (see the module's docstring for what each count means)."""

    called: dict[str, int]  # operator name -> times called, most called first
    operators: int  # every ATen operator, nested ones included
    kernels: int | None  # device kernels; None where the device has none to count (a CPU)
    device: str

    @property
    def calls(self) -> int:
        """How many operators were called (not counting the ones they ran)."""
        return sum(self.called.values())

    def _most_called(self, limit: int = 3) -> str:
        names = [f"{name} x{count}" for name, count in list(self.called.items())[:limit]]
        others = len(self.called) - limit
        return ", ".join(names + ([f"{others} more"] if others > 0 else [])) or "no ATen operator"

    def __repr__(self) -> str:
        kernels = "" if self.kernels is None else f"; {_plural(self.kernels, 'kernel')} on {self.device}"
        return (
            f"Launches({_plural(self.calls, 'operator')} called, {self.operators} in all{kernels}: "
            f"{self._most_called()})"
        )

    def _repr_html_(self) -> str:
        rows = [(name, count) for name, count in self.called.items()]
        caption = f"{_plural(self.calls, 'operator')} called, {self.operators} in all"
        if self.kernels is not None:
            caption += f"; {_plural(self.kernels, 'kernel')} on {self.device}"
        return Table(("operator called", "times"), rows, caption=caption, numeric=(1,))._repr_html_()


def _plural(count: int, noun: str) -> str:
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"


def _is_operator(event) -> bool:
    return event.name.startswith("aten::") and event.device_type == DeviceType.CPU


def count_launches(fn: Callable[[], object], *, device: str | torch.device | None = None, warmup: int = 1) -> Launches:
    """Run ``fn()`` ``warmup`` times unwatched (first calls set up state), then once under the profiler; count."""
    if not isinstance(warmup, int) or warmup < 0:
        raise ValueError(f"warmup must be a non-negative integer, got {warmup!r}")
    device = pick_device(device)
    for _ in range(warmup):
        fn()
    synchronize(device)
    activity, device_type = _DEVICE_ACTIVITIES.get(device.type, (None, None))
    with profile(activities=[ProfilerActivity.CPU] + ([activity] if activity else [])) as profiler:
        fn()
        synchronize(device)
    events = profiler.events()
    operators = [event for event in events if _is_operator(event)]
    top = [event for event in operators if event.cpu_parent is None or not _is_operator(event.cpu_parent)]
    kernels = None
    if device_type is not None:
        kernels = sum(
            1 for event in events if event.device_type == device_type and not event.name.startswith(_NOT_KERNELS)
        )
    return Launches(
        called=dict(Counter(event.name for event in top).most_common()),
        operators=len(operators),
        kernels=kernels,
        device=str(device),
    )
