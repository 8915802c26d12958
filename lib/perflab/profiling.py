"""``torch.profiler`` around the course's training loop, and the phase spans its trace holds.

    >>> import tempfile
    >>> from pathlib import Path
    >>> from perflab.plots import trace_timeline
    >>> from perflab.profiling import profile_training
    >>> from perflab.train import NAIVE, Workload
    >>> tiny = Workload(num_classes=3, train_per_class=20, val_per_class=4, image_size=32, epochs=1)
    >>> run = profile_training(NAIVE, tiny, steps=2)
    >>> run
    ProfiledRun(2 steps of naive, ... events)
    >>> print(run.table(row_limit=3))      # operators by self time, torch.profiler's own table
    -----...
    Name    Self CPU %    Self CPU ...
    Self CPU time total: ...
    >>> sorted({span.name for span in run.phase_spans()})   # the phases, by name, in the trace
    ['bwd', 'data_wait', 'fwd', 'h2d', 'log', 'opt']
    >>> with tempfile.TemporaryDirectory() as folder:
    ...     run.export(Path(folder) / "naive_trace.json")    # opens in https://ui.perfetto.dev or chrome://tracing
    >>> trace_timeline(run)                # the phases on the host and the kernels on the device, gaps included
    <Figure size ... with 1 Axes>

``profile_training(NAIVE, tiny, steps=2, profile_memory=True)`` also records every allocation,
so that its table can sort by memory: ``.table(sort_by="self_cpu_memory_usage")``, or
``"self_device_memory_usage"`` for a GPU's memory. The profiler's names say ``device``, not ``cuda``
(``self_device_time_total``): torch 2.14 deprecates the ``cuda`` spellings.

``perflab.train`` wraps every phase of a step (data_wait, h2d, fwd, bwd, opt, log) in a
``record_function`` region, so the trace carries them by name next to every operator.

Used in: lecture 02 (profiling), lab 12.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from perflab.device import pick_device
from perflab.train import TrainConfig, Workload, train
from perflab.train_result import PHASES, TrainResult

__all__ = ["ProfiledRun", "Span", "profile_training"]


@dataclass(frozen=True)
class Span:
    """One stretch of time on one row of a timeline, in seconds from the row's first span."""

    row: str  # "host" or "device"
    name: str  # a phase, or "kernel" on the device row
    start_s: float
    duration_s: float


@dataclass
class ProfiledRun:
    """A short training run and the profiler that watched it."""

    result: TrainResult
    profiler: profile

    def table(self, sort_by: str | None = None, row_limit: int = 12) -> str:
        """Operators sorted by self time on the device when there is one, else on the CPU."""
        device_run = self.result.environment.device.startswith("cuda")
        sort_by = sort_by or ("self_device_time_total" if device_run else "self_cpu_time_total")
        return self.profiler.key_averages().table(sort_by=sort_by, row_limit=row_limit)

    def export(self, path: str) -> None:
        """A trace in the Chrome trace format (JSON): open it in https://ui.perfetto.dev or chrome://tracing."""
        self.profiler.export_chrome_trace(str(path))

    def phase_spans(self) -> list[Span]:
        """Every phase region on the host and every kernel on the device, from the trace's own clock."""
        events = self.profiler.events()
        phases = [e for e in events if e.name in PHASES and e.device_type == DeviceType.CPU]
        kernels = [e for e in events if e.device_type == DeviceType.CUDA]
        if not phases:
            return []
        origin = min(e.time_range.start for e in phases)
        spans = [
            Span("host", e.name, (e.time_range.start - origin) / 1e6, e.time_range.elapsed_us() / 1e6) for e in phases
        ]
        spans += [
            Span("device", "kernel", (e.time_range.start - origin) / 1e6, e.time_range.elapsed_us() / 1e6)
            for e in kernels
            if e.time_range.start >= origin
        ]
        return sorted(spans, key=lambda span: (span.row, span.start_s))

    def __repr__(self) -> str:
        return (
            f"ProfiledRun({len(self.result.steps)} steps of {self.result.name}, {len(self.profiler.events())} events)"
        )


def profile_training(
    config: TrainConfig,
    workload: Workload = Workload(),
    *,
    steps: int = 8,
    device: str | torch.device | None = None,
    profile_memory: bool = False,
) -> ProfiledRun:
    """Profile the first ``steps`` steps of ``train(config, workload)``, after a two-step warm-up run.

    ``profile_memory=True`` also records every allocation and free, so the table can sort by
    ``self_cpu_memory_usage`` (or ``self_device_memory_usage``), at the price of a slower profile.
    """
    device = pick_device(device)
    train(config, workload, device=device, progress=False, max_steps=2)  # caches, allocator, kernels
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities, profile_memory=profile_memory) as profiler:
        result = train(config, workload, device=device, progress=False, max_steps=steps)
    return ProfiledRun(result, profiler)
