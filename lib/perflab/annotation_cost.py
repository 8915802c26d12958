"""What marking code for a profiler costs while no profiler records: NVTX ranges, ``emit_nvtx``, ``record_function``.

    >>> from perflab.annotation_cost import annotation_costs
    >>> costs = annotation_costs(rounds=6)
    >>> costs.record_function_s > 0
    True
    >>> costs                               # on a CUDA build, NVTX's costs too (see below for what needs a GPU)
    AnnotationCosts(...)

Three ways to mark code, three costs:

- ``torch.cuda.nvtx.range("name")`` calls NVTX's ``nvtxRangePushA`` and ``nvtxRangePop``. With no
  tool attached they return at once: the functions of NVIDIA's header-only NVTX 3 check a
  pointer that only a tool (Nsight Systems' injection library) sets, and return
  ``NVTX_NO_PUSH_POP_TRACKING`` (-2) otherwise (``nvtx3/nvtxDetail/nvtxImplCore.h``, NVIDIA/NVTX).
  ``range_push`` returning -2 is how :attr:`AnnotationCosts.tool_attached` knows. It needs a CUDA
  build of torch (``torch.version.cuda``), not a GPU: a CPU-only build raises.
- ``torch.autograd.profiler.emit_nvtx()`` is not one range but a profiler mode. Its ``__enter__``
  calls ``torch.cuda.synchronize()`` and turns on the profiler in ``ProfilerState.NVTX``, whose
  callbacks push a range named after every operator (with its sequence number, and its input
  shapes under ``record_shapes=True``) and pop it after; ``__exit__`` synchronizes again
  (``torch/autograd/profiler.py``). So it costs at every operator, tool or not, and it makes the
  host wait for the GPU's queue on entry and on exit. Without a GPU the synchronize raises: the
  per-operator cost is measured here by turning on the same profiler state, the call that
  ``emit_nvtx.__enter__`` makes after synchronizing; the waits are measured only on a GPU.
- ``torch.profiler.record_function("name")`` (what ``perflab.train`` marks its phases with)
  records only while a profiler runs, but costs more than a Python call without one: entering calls
  the operator ``torch.ops.profiler._record_function_enter_new``, which goes through the dispatcher and
  creates a ``_RecordFunction`` object, and leaving calls ``_record_function_exit`` on it
  (``torch/autograd/profiler.py``): microseconds per region, more than a small operator.

Used in: lecture 02 (profiling).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch.autograd.profiler import (
    ProfilerConfig,
    ProfilerState,
    _disable_profiler,
    _enable_profiler,
    _ExperimentalConfig,
)

from perflab.bench import benchmark, compare, format_seconds
from perflab.render import Table

__all__ = ["AnnotationCosts", "annotation_costs", "nvtx_callbacks"]

_RANGES = 1000  # ranges per timed call: one range alone is shorter than the clock's resolution
_OPERATORS = 200  # small operators per timed call of the chain
_SAMPLE_S = 0.02  # per timed sample: long enough that one slice of another process's time is a small part of it


@contextlib.contextmanager
def nvtx_callbacks(record_shapes: bool = False) -> Iterator[None]:
    """The profiler state ``emit_nvtx`` turns on (``ProfilerState.NVTX``), without its two synchronizations."""
    config = ProfilerConfig(ProfilerState.NVTX, record_shapes, False, False, False, False, _ExperimentalConfig())
    _enable_profiler(config, set())
    try:
        yield
    finally:
        _disable_profiler()


@dataclass(frozen=True)
class AnnotationCosts:
    """Seconds per range or per operator; None where this build or device cannot measure it."""

    record_function_s: float
    nvtx_range_s: float | None = None  # one torch.cuda.nvtx.range, entered and left
    tool_attached: bool | None = None  # whether an NVTX tool (Nsight Systems) listens
    emit_nvtx_per_operator_s: float | None = None
    emit_nvtx_shapes_per_operator_s: float | None = None
    operator_s: float | None = None  # one small operator without any of it, for scale
    emit_nvtx_wait_s: float | None = None  # on a GPU: host time of entering and leaving emit_nvtx behind queued work
    queued_work_s: float | None = None  # that queued work's own time on the GPU

    def _rows(self) -> list[tuple[str, str, str]]:
        def shown(seconds: float | None, why: str) -> str:
            return why if seconds is None else format_seconds(seconds)

        no_cuda = "not measured: torch.version.cuda is None (a CPU-only build has no NVTX)"
        listening = "" if self.tool_attached is None else f" ({'a tool' if self.tool_attached else 'no tool'} attached)"
        rows = [
            ("record_function, no profiler", "per region", shown(self.record_function_s, "")),
            (f"torch.cuda.nvtx.range{listening}", "per range", shown(self.nvtx_range_s, no_cuda)),
            ("emit_nvtx's callbacks", "per operator", shown(self.emit_nvtx_per_operator_s, no_cuda)),
            (
                "emit_nvtx's callbacks, record_shapes=True",
                "per operator",
                shown(self.emit_nvtx_shapes_per_operator_s, no_cuda),
            ),
            ("a small operator, for scale", "per operator", shown(self.operator_s, no_cuda)),
        ]
        no_gpu = "not measured: no CUDA GPU (emit_nvtx synchronizes it)"
        rows.append(("emit_nvtx entered and left, work queued", "per use", shown(self.emit_nvtx_wait_s, no_gpu)))
        rows.append(("  that queued work on the GPU", "", shown(self.queued_work_s, no_gpu)))
        return rows

    def _table(self) -> Table:
        return Table(("annotation", "cost", "median"), self._rows(), caption="host time; no profiler recording")

    def __repr__(self) -> str:
        return "AnnotationCosts(" + "; ".join(f"{name} {value}" for name, _, value in self._rows()) + ")"

    def __str__(self) -> str:
        return str(self._table())

    def _repr_html_(self) -> str:
        return self._table()._repr_html_()


def annotation_costs(rounds: int = 11) -> AnnotationCosts:
    """Measure each annotation's cost on this machine (with no profiler recording), in interleaved rounds."""

    def record_functions() -> None:
        for _ in range(_RANGES):
            with torch.profiler.record_function("region"):
                pass

    found: dict[str, object] = {
        "record_function_s": benchmark(
            record_functions, device="cpu", samples=rounds, warmup=1, min_sample_s=_SAMPLE_S
        ).median
        / _RANGES
    }
    if torch.version.cuda is not None:
        found["tool_attached"] = torch.cuda.nvtx.range_push("probe") != -2  # NVTX_NO_PUSH_POP_TRACKING
        torch.cuda.nvtx.range_pop()

        def nvtx_ranges() -> None:
            for _ in range(_RANGES):
                with torch.cuda.nvtx.range("region"):
                    pass

        found["nvtx_range_s"] = (
            benchmark(nvtx_ranges, device="cpu", samples=rounds, warmup=1, min_sample_s=_SAMPLE_S).median / _RANGES
        )
        x = torch.randn(64)

        def chain() -> None:
            y = x
            for _ in range(_OPERATORS // 2):
                y = y * 1.01 + 0.1

        def chain_with_callbacks(record_shapes: bool) -> None:
            with nvtx_callbacks(record_shapes):
                chain()

        for key, shapes in (("emit_nvtx_per_operator_s", False), ("emit_nvtx_shapes_per_operator_s", True)):
            comparison = compare(
                chain,
                lambda shapes=shapes: chain_with_callbacks(shapes),
                device="cpu",
                rounds=rounds,
                warmup=1,
                min_sample_s=_SAMPLE_S,
            )
            # The median of per-round ratios, not a difference of medians: robust to a machine that drifts.
            operator = comparison.baseline.median / _OPERATORS
            found[key] = max(0.0, 1 / comparison.speedup - 1) * operator
            found["operator_s"] = operator
    if torch.cuda.is_available():
        found.update(_emit_nvtx_wait(rounds))
    return AnnotationCosts(**found)


def _emit_nvtx_wait(rounds: int) -> dict[str, float]:
    """On a GPU: host time to enter and leave emit_nvtx right after queueing a large matmul, and the matmul's time."""
    gpu = torch.device("cuda")
    matrix = torch.randn(4096, 4096, device=gpu)
    matrix @ matrix
    torch.cuda.synchronize(gpu)
    waits, kernels = [], []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        matrix @ matrix  # queued: the host goes on at once
        end.record()
        began = time.perf_counter()
        with torch.autograd.profiler.emit_nvtx():
            pass
        waits.append(time.perf_counter() - began)
        torch.cuda.synchronize(gpu)
        kernels.append(start.elapsed_time(end) / 1e3)
    return {"emit_nvtx_wait_s": sorted(waits)[len(waits) // 2], "queued_work_s": sorted(kernels)[len(kernels) // 2]}
