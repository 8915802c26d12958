"""Compute accounting: the FLOPs and bytes a piece of work needs, this machine's two peaks, and the roofline.

    >>> import torch
    >>> from perflab.roofline import Roofline, count_bytes, measure_peaks, measure_point, mfu
    >>> peaks = measure_peaks("cpu")      # a large matmul and a large copy, timed here: about a second
    >>> peaks
    Peaks(cpu: ... GFLOP/s (matmul 1024x1024 float32), ... GB/s (copy 64 MiB, read + write); ridge at ... FLOP/byte)
    >>> x, y = torch.randn(2**20), torch.randn(2**20)
    >>> count_bytes(lambda: x + y) == 3 * x.nbytes          # two inputs read, one output written
    True
    >>> add = measure_point("x + y", lambda: x + y, flops=x.numel())   # FlopCounterMode counts no elementwise op
    >>> add.intensity                                        # 1 FLOP per 12 bytes: far left of any ridge
    0.08333333333333333
    >>> a = torch.randn(512, 512)
    >>> roofline = Roofline(peaks, (add, measure_point("matmul 512", lambda: a @ a)))
    >>> roofline       # a table: FLOPs, bytes, intensity, time, FLOP/s, share of the peak and of the roof
    what ... bound
    x + y ... memory
    matmul 512 ... compute
    Peaks(cpu: ...
    >>> mfu(flops_per_sample=6e6, samples_per_s=1000, peak_flops_per_s=50e9)   # 6 GFLOP/s achieved of 50
    0.12

The **roofline** (Williams et al., CACM 2009, https://doi.org/10.1145/1498765.1498785) bounds the FLOP/s
of work of arithmetic intensity ``I`` (FLOP per byte moved) at ``min(peak FLOP/s, I x peak bytes/s)``;
the roofs meet at the **ridge**: left of it work is memory-bound, right of it compute-bound.

FLOPs are counted by ``torch.utils.flop_counter.FlopCounterMode`` (matmuls, convolutions, attention;
pass ``flops=`` for elementwise work). Bytes are counted as PyTorch's own roofline estimator counts
them (``torch/utils/_runtime_estimation.py``): for each operator that runs, its distinct inputs and
its outputs once each, views skipped, a broadcast dimension once. For one operator that is the least
it must move; summed over a training step, the traffic of eager execution when nothing stays in
cache between operators (caches lower it; fusion, lecture 06, removes whole terms).

Used in: lecture 01 (gpu basics), lecture 10 (triton), lab 12.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch.utils._python_dispatch import TorchDispatchMode  # documented: "Extending all torch API with Modes"
from torch.utils.flop_counter import FlopCounterMode

from perflab.bench import benchmark, format_seconds
from perflab.device import pick_device
from perflab.render import Environment, Table, add_footer

if TYPE_CHECKING:  # matplotlib is imported when a chart is drawn: measuring needs none
    from matplotlib.figure import Figure

__all__ = [
    "Peaks",
    "Roofline",
    "RooflinePoint",
    "count_bytes",
    "measure_peaks",
    "measure_point",
    "mfu",
    "roofline_chart",
]

# (matmul size, copy MiB) per device type: each large enough to reach the device's plateau, small enough for seconds.
_PEAK_SIZES = {"cpu": (1024, 64), "mps": (4096, 256), "cuda": (8192, 1024)}

# Operators that move no data though tensors go in and out: a view not marked as one, allocations that write nothing.
_NO_TRAFFIC = {getattr(torch.ops.aten, op) for op in ("_unsafe_view", "empty", "empty_like", "empty_strided")}


def _si(value: float, unit: str) -> str:
    for prefix, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(value) >= scale:
            return f"{value / scale:.3g} {prefix}{unit}"
    return f"{value:.3g} {unit}"


def _distinct_bytes(tree) -> int:
    """Bytes of the distinct tensors in nested lists, tuples and dicts: ``x + x`` reads ``x`` once, and so
    does ``x @ x.T``; a broadcast (stride 0) dimension holds one element."""
    seen, stack = set(), [tree]
    while stack:
        item = stack.pop()
        if isinstance(item, torch.Tensor):
            elements = math.prod(size for size, stride in zip(item.shape, item.stride()) if stride != 0)
            seen.add((item.data_ptr(), elements * item.element_size()))
        elif isinstance(item, (list, tuple, dict)):
            stack.extend(item.values() if isinstance(item, dict) else item)
    return sum(size for _, size in seen)


class _TrafficCounter(TorchDispatchMode):
    """Sees every operator PyTorch runs, backward included, and adds up the bytes it reads and writes."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if not func.is_view and func.overloadpacket not in _NO_TRAFFIC:
            self.bytes += _distinct_bytes((args, kwargs)) + _distinct_bytes(out)
        return out


def _count(fn: Callable[[], object]) -> tuple[int, int]:  # (FLOPs, bytes) of one call
    flops, traffic = FlopCounterMode(display=False), _TrafficCounter()
    with flops, traffic:
        fn()
    return flops.get_total_flops(), traffic.bytes


def count_bytes(fn: Callable[[], object]) -> int:
    """Bytes ``fn()`` moves, counted operator by operator (inputs and outputs once each); ``fn`` runs once."""
    return _count(fn)[1]


@dataclass(frozen=True)
class Peaks:
    """The best this device does, measured: FLOP/s of a large matmul, bytes/s of a large copy."""

    flops_per_s: float
    bytes_per_s: float
    matmul: str  # what gave flops_per_s, e.g. "matmul 1024x1024 float32"
    copy: str  # what gave bytes_per_s
    environment: Environment

    @property
    def ridge(self) -> float:
        """FLOP/byte where the two roofs meet: an operator needs more to be compute-bound."""
        return self.flops_per_s / self.bytes_per_s

    def attainable(self, intensity: float) -> float:
        """The roof at ``intensity`` FLOP/byte: the most FLOP/s such work can reach here."""
        return min(self.flops_per_s, intensity * self.bytes_per_s)

    def __repr__(self) -> str:
        return (
            f"Peaks({self.environment.device}: {_si(self.flops_per_s, 'FLOP/s')} ({self.matmul}), "
            f"{_si(self.bytes_per_s, 'B/s')} ({self.copy}); ridge at {self.ridge:.3g} FLOP/byte)"
        )


def measure_peaks(
    device: str | torch.device | None = None,
    *,
    dtype: torch.dtype = torch.float32,
    matmul_size: int | None = None,
    copy_mib: int | None = None,
    samples: int = 10,
) -> Peaks:
    """The fastest of ``samples`` of a square ``dtype`` matmul (``2 n^3`` FLOPs) and of a copy (its bytes read once,
    written once), sized to reach the device's plateau in a second or so: what PyTorch achieves, below any datasheet.
    The label says "TF32 allowed" where ``torch.backends.cuda.matmul.fp32_precision`` lets float32 matmuls use TF32."""
    device = pick_device(device)
    tf32 = device.type == "cuda" and dtype == torch.float32 and torch.backends.cuda.matmul.fp32_precision == "tf32"
    n, mib = (given or default for given, default in zip((matmul_size, copy_mib), _PEAK_SIZES[device.type]))
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    matmul = benchmark(lambda: a @ b, device=device, samples=samples, warmup=1)
    src = torch.randn(mib * 2**20 // 4, device=device)
    dst = torch.empty_like(src)
    copy = benchmark(lambda: dst.copy_(src), device=device, samples=samples, warmup=1)
    return Peaks(
        flops_per_s=2 * n**3 / min(matmul.times),  # a peak is the best the machine did: noise only slows
        bytes_per_s=2 * src.nbytes / min(copy.times),
        matmul=f"matmul {n}x{n} {str(dtype).removeprefix('torch.')}{', TF32 allowed' if tf32 else ''}",
        copy=f"copy {mib} MiB, read + write",
        environment=Environment.capture(device),
    )


@dataclass(frozen=True)
class RooflinePoint:
    """One piece of work measured: its FLOPs, the bytes it moves, and seconds per call."""

    label: str
    flops: float
    bytes: float
    seconds: float

    def __post_init__(self) -> None:
        if not all(math.isfinite(value) and value > 0 for value in (self.flops, self.bytes, self.seconds)):
            raise ValueError(
                f"{self.label!r}: flops, bytes and seconds must be positive: {self.flops, self.bytes, self.seconds}"
            )

    @property
    def intensity(self) -> float:
        """Arithmetic intensity, FLOP per byte moved."""
        return self.flops / self.bytes

    @property
    def flops_per_s(self) -> float:
        return self.flops / self.seconds

    def __repr__(self) -> str:
        return (
            f"RooflinePoint({self.label}: {_si(self.flops, 'FLOP')}, {_si(self.bytes, 'B')}, "
            f"{self.intensity:.3g} FLOP/byte, {format_seconds(self.seconds)}: {_si(self.flops_per_s, 'FLOP/s')})"
        )


def measure_point(
    label: str,
    fn: Callable[[], object],
    *,
    flops: float | None = None,
    device: str | torch.device | None = None,
    samples: int = 5,
) -> RooflinePoint:
    """Count ``fn()``'s FLOPs and bytes in one call (its warm-up), then time it with ``perflab.bench.benchmark``.
    ``flops`` replaces ``FlopCounterMode``'s count, which misses elementwise ops (and the CPU's fused attention)."""
    counted_flops, moved = _count(fn)
    flops = counted_flops if flops is None else flops
    if not flops:
        raise ValueError(f"{label!r}: FlopCounterMode counted no FLOPs (an elementwise op?); pass flops=")
    timing = benchmark(fn, label=label, device=pick_device(device), samples=samples, warmup=0)  # counting warmed up
    return RooflinePoint(label, flops, moved, timing.median)


def mfu(flops_per_sample: float, samples_per_s: float, peak_flops_per_s: float | Peaks) -> float:
    """Model FLOPs utilization: the share of the peak FLOP/s a training run turns into the model's FLOPs.

    ``flops_per_sample``: ``count_flops`` of a batch (forward and backward) over its size; ``samples_per_s``:
    measured (``TrainResult.samples_per_s``); the peak: a number, or :class:`Peaks` measured on that device."""
    peak = peak_flops_per_s.flops_per_s if isinstance(peak_flops_per_s, Peaks) else peak_flops_per_s
    for name, value in (("flops_per_sample", flops_per_sample), ("samples_per_s", samples_per_s), ("peak", peak)):
        if not value > 0:
            raise ValueError(f"mfu needs a positive {name}, got {value!r}")
    return flops_per_sample * samples_per_s / peak


@dataclass(frozen=True)
class Roofline:
    """Measured points against this device's measured roofs."""

    peaks: Peaks
    points: tuple[RooflinePoint, ...]

    def bound(self, point: RooflinePoint) -> str:
        """``"memory"`` left of the ridge, ``"compute"`` right of it."""
        return "memory" if point.intensity < self.peaks.ridge else "compute"

    def share_of_roof(self, point: RooflinePoint) -> float:
        """Achieved FLOP/s over the roof at the point's intensity; far below 1: overhead, not hardware, limits it."""
        return point.flops_per_s / self.peaks.attainable(point.intensity)

    def _table(self) -> Table:
        rows = [
            (p.label, _si(p.flops, "FLOP"), _si(p.bytes, "B"), f"{p.intensity:.3g}", format_seconds(p.seconds))
            + (_si(p.flops_per_s, "FLOP/s"), f"{p.flops_per_s / self.peaks.flops_per_s:.1%}")
            + (f"{self.share_of_roof(p):.0%}", self.bound(p))
            for p in self.points
        ]
        header = ("what", "FLOPs", "bytes", "FLOP/byte", "time", "achieved", "of peak", "of roof", "bound")
        return Table(header, rows, caption=f"{self.peaks!r}, on {self.peaks.environment}", numeric=range(1, 8))

    def __repr__(self) -> str:
        return str(self._table())

    def _repr_html_(self) -> str:
        return self._table()._repr_html_()


def roofline_chart(roofline: Roofline, *, title: str | None = None) -> Figure:
    """Log-log: achieved FLOP/s against arithmetic intensity, under the two measured roofs and their ridge."""
    import matplotlib.pyplot as plt

    peaks, points = roofline.peaks, roofline.points
    intensities = [p.intensity for p in points] + [peaks.ridge]
    low, high = min(intensities) / 4, max(intensities) * 4
    xs = [low * (high / low) ** (i / 200) for i in range(201)]
    figure, ax = plt.subplots(figsize=(8.5, 5))
    ax.plot(xs, [peaks.attainable(x) / 1e9 for x in xs], color="black", linewidth=2, label="roof: min of the two peaks")
    ax.axhline(peaks.flops_per_s / 1e9, color="#d62728", linestyle=":", label=f"peak: {peaks.matmul}")
    ax.plot(xs, [x * peaks.bytes_per_s / 1e9 for x in xs], ":", color="#1f77b4", label=f"bandwidth: {peaks.copy}")
    ax.axvline(peaks.ridge, color="grey", linestyle="--", linewidth=1)
    ax.annotate(f" ridge: {peaks.ridge:.3g} FLOP/byte", (peaks.ridge, peaks.flops_per_s / 1e9 * 1.3), fontsize=8)
    placed = []
    for point in points:
        where = (point.intensity, point.flops_per_s / 1e9)
        ax.scatter(*where, color="#1f77b4" if roofline.bound(point) == "memory" else "#d62728", zorder=3)
        near = any(all(max(a / b, b / a) < 1.5 for a, b in zip(where, other)) for other in placed)  # label below
        ax.annotate(point.label, where, xytext=(4, -10 if near else 4), textcoords="offset points", fontsize=8)
        placed.append(where)
    ax.set(xscale="log", yscale="log", xlabel="arithmetic intensity (FLOP per byte moved)")
    lowest = min([p.flops_per_s for p in points] + [peaks.attainable(low)]) / 1e9
    highest = max([p.flops_per_s for p in points] + [peaks.flops_per_s]) / 1e9
    ax.set_ylim(lowest / 2, highest * 3)
    for axis in (ax.xaxis, ax.yaxis):
        axis.set_major_formatter(plt.FuncFormatter(lambda value, _: f"{value:g}"))
    ax.set_ylabel("achieved throughput (GFLOP/s)")
    ax.set_title(title or f"Roofline of {peaks.environment.device_name}: measured peaks, measured points")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(loc="upper left", fontsize=8)
    add_footer(figure, f"{peaks.environment}; bytes: each operator's inputs and outputs once (blue: memory-bound)")
    return figure
