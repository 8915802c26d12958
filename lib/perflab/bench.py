"""Timing done right: warm up, synchronize, repeat, report the spread, compare side by side.

    >>> from perflab.bench import benchmark, compare
    >>> x = torch.randn(512, 512)
    >>> benchmark(lambda: x @ x, label="matmul 512")
    Timing(matmul 512 on cpu: median ..., IQR ..., p95 ...; 20 samples x ... calls, 2 threads)
    >>> compare(lambda: x @ x, lambda: torch.mm(x, x), labels=("@", "mm"))
    Comparison(mm vs @: ...x (95% CI ...x-...x) over 21 interleaved rounds; no clear difference)

Each sample runs the function enough times to last ``min_sample_s`` (so the clock's own
resolution does not matter), with the device synchronized before the clock is read, at the
*current* thread count (``torch.utils.benchmark.Timer`` would pin it to one thread unless told).
``Timing.to_measurement()`` hands results to ``torch.utils.benchmark.Compare`` for tables:

    >>> Compare([benchmark(f, label=name).to_measurement() for name, f in cases]).print()
"""

from __future__ import annotations

import html
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from perflab.device import pick_device, synchronize


def format_seconds(seconds: float) -> str:
    """``0.00123`` -> ``'1.23 ms'``: a duration in the unit that reads best."""
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        # Compare after rounding, so 999.7 us reads "1 ms", not "1e+03 us".
        if abs(float(f"{seconds / scale:.3g}")) >= 1:
            return f"{seconds / scale:.3g} {unit}"
    return f"{seconds / 1e-9:.3g} ns"


def _percentile(sorted_values: list[float], fraction: float) -> float:
    """Linear interpolation between closest ranks, as numpy's default."""
    position = fraction * (len(sorted_values) - 1)
    low, high = math.floor(position), math.ceil(position)
    return sorted_values[low] + (sorted_values[high] - sorted_values[low]) * (position - low)


@dataclass(frozen=True)
class Timing:
    """Seconds per call of one function, one entry per sample, with what it ran on."""

    label: str
    times: tuple[float, ...]
    calls_per_sample: int = 1
    device: str = "cpu"
    num_threads: int = 1

    def __post_init__(self) -> None:
        if len(self.times) == 0:
            raise ValueError(f"Timing {self.label!r} has no samples")
        if not all(math.isfinite(t) and t > 0 for t in self.times):
            raise ValueError(f"Timing {self.label!r}: every time must be a positive finite number of seconds")

    @property
    def median(self) -> float:
        return statistics.median(self.times)

    @property
    def mean(self) -> float:
        return statistics.fmean(self.times)

    @property
    def iqr(self) -> float:
        """Interquartile range: the spread of the middle half of the samples."""
        ordered = sorted(self.times)
        return _percentile(ordered, 0.75) - _percentile(ordered, 0.25)

    @property
    def p95(self) -> float:
        return _percentile(sorted(self.times), 0.95)

    def to_measurement(self, table: str = "perflab") -> torch.utils.benchmark.Measurement:
        """This timing as a ``torch.utils.benchmark.Measurement``, which ``Compare`` tabulates:
        one table per ``table`` name, one row per timing label, one column per device."""
        # Imported here: torch.utils.benchmark warns about CUDA_HOME on import on machines without one.
        from torch.utils.benchmark import Measurement
        from torch.utils.benchmark.utils.common import TaskSpec

        spec = TaskSpec(
            stmt=self.label,
            setup="",
            label=table,
            sub_label=self.label,
            description=self.device,
            num_threads=self.num_threads,
        )
        return Measurement(self.calls_per_sample, [t * self.calls_per_sample for t in self.times], spec)

    def _summary(self) -> str:
        return (
            f"median {format_seconds(self.median)}, IQR {format_seconds(self.iqr)}, "
            f"p95 {format_seconds(self.p95)}; {len(self.times)} samples x {self.calls_per_sample} calls, "
            f"{self.num_threads} threads"
        )

    def __repr__(self) -> str:
        return f"Timing({self.label} on {self.device}: {self._summary()})"

    def _repr_html_(self) -> str:
        cells = [
            ("what", self.label),
            ("device", self.device),
            ("median", format_seconds(self.median)),
            ("IQR", format_seconds(self.iqr)),
            ("p95", format_seconds(self.p95)),
            ("samples", f"{len(self.times)} x {self.calls_per_sample} calls"),
            ("threads", self.num_threads),
        ]
        header = "".join(f"<th>{name}</th>" for name, _ in cells)
        row = "".join(f"<td>{html.escape(str(value))}</td>" for _, value in cells)
        return f"<table><tr>{header}</tr><tr>{row}</tr></table>"


class _Sampler:
    """Runs one function as timed samples of ``calls_per_sample`` calls each.

    ``torch.utils.benchmark.Timer.timeit`` would re-warm before every sample (at least two
    extra calls), which triples the cost of timing a one-second training step, so samples are
    taken here with the same synchronized clock that ``Timer`` would be given.
    """

    def __init__(self, fn: Callable[[], object], device: torch.device, warmup: int, min_sample_s: float):
        if not callable(fn):
            raise TypeError(f"benchmark needs a function to call, got {type(fn).__name__}")
        self.fn, self.device = fn, device
        for _ in range(warmup):
            fn()
        self.calls_per_sample = 1
        one_call = self.sample()
        self.calls_per_sample = max(1, math.ceil(min_sample_s / max(one_call, 1e-9)))

    def _clock(self) -> float:
        synchronize(self.device)
        return time.perf_counter()

    def sample(self) -> float:
        fn, calls = self.fn, self.calls_per_sample
        start = self._clock()
        for _ in range(calls):
            fn()
        return (self._clock() - start) / calls


def time_call(fn: Callable[[], object], device: str | torch.device) -> float:
    """Seconds one ``fn()`` takes, the device synchronized before and after: for a call that runs once
    (a first call that compiles) or whose rounds the caller interleaves itself."""
    synchronize(device)
    start = time.perf_counter()
    fn()
    synchronize(device)
    return time.perf_counter() - start


def _check_counts(repeats: int, warmup: int, min_sample_s: float) -> None:
    if not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats must be a positive integer, got {repeats!r}")
    if not isinstance(warmup, int) or warmup < 0:
        raise ValueError(f"warmup must be a non-negative integer, got {warmup!r}")
    if not min_sample_s > 0:
        raise ValueError(f"min_sample_s must be positive, got {min_sample_s!r}")


def benchmark(
    fn: Callable[[], object],
    *,
    label: str | None = None,
    device: str | torch.device | None = None,
    repeats: int = 20,
    warmup: int = 3,
    min_sample_s: float = 2e-3,
) -> Timing:
    """Time ``fn()``: ``warmup`` untimed calls, then ``repeats`` synchronized samples."""
    _check_counts(repeats, warmup, min_sample_s)
    device = pick_device(device)
    sampler = _Sampler(fn, device, warmup, min_sample_s)
    times = tuple(sampler.sample() for _ in range(repeats))
    return Timing(
        label=label or getattr(fn, "__name__", "fn"),
        times=times,
        calls_per_sample=sampler.calls_per_sample,
        device=str(device),
        num_threads=torch.get_num_threads(),
    )


def median_confidence_interval(values: list[float], confidence: float = 0.95) -> tuple[float, float]:
    """A distribution-free confidence interval for the median, from order statistics.

    The k-th smallest and k-th largest values bound the median with probability
    1 - 2 P(Binomial(n, 1/2) < k); k is the largest that keeps that at least ``confidence``.
    """
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must lie strictly between 0 and 1, got {confidence!r}")
    n = len(values)
    ordered = sorted(values)
    below = 0.0  # P(Binomial(n, 1/2) < k), grown one k at a time
    k = 0
    while k < n // 2:
        next_below = below + math.comb(n, k) / 2**n
        if 1 - 2 * next_below < confidence:
            break
        below, k = next_below, k + 1
    if k == 0:
        smallest = next(m for m in range(1, 64) if 1 - 2 / 2**m >= confidence)
        raise ValueError(
            f"{n} values are too few for a {confidence:.0%} interval on the median; use at least {smallest}"
        )
    return ordered[k - 1], ordered[n - k]


NEGLIGIBLE_CHANGE = 0.02


@dataclass(frozen=True)
class Comparison:
    """Baseline and candidate timed in alternating rounds; speedup = baseline time / candidate time."""

    baseline: Timing
    candidate: Timing
    confidence: float = 0.95

    def __post_init__(self) -> None:
        if len(self.baseline.times) != len(self.candidate.times):
            raise ValueError("a Comparison needs the same number of interleaved samples on each side")

    @property
    def ratios(self) -> list[float]:
        """Per-round speedups: each pair was measured back to back, so slow drift cancels."""
        return [b / c for b, c in zip(self.baseline.times, self.candidate.times)]

    @property
    def speedup(self) -> float:
        return statistics.median(self.ratios)

    @property
    def interval(self) -> tuple[float, float]:
        return median_confidence_interval(self.ratios, self.confidence)

    @property
    def verdict(self) -> str:
        """Faster or slower only when the whole interval says so and the change is over 2%:
        smaller differences are within what the machine itself varies between runs."""
        low, high = self.interval
        if low > 1 and self.speedup > 1 + NEGLIGIBLE_CHANGE:
            return f"{self.candidate.label} is faster"
        if high < 1 and self.speedup < 1 - NEGLIGIBLE_CHANGE:
            return f"{self.candidate.label} is slower"
        return "no clear difference"

    def __repr__(self) -> str:
        low, high = self.interval
        return (
            f"Comparison({self.candidate.label} vs {self.baseline.label}: {self.speedup:.2f}x "
            f"({self.confidence:.0%} CI {low:.2f}x-{high:.2f}x) over {len(self.ratios)} interleaved rounds; "
            f"{self.verdict})"
        )

    def _repr_html_(self) -> str:
        low, high = self.interval
        rows = "".join(
            f"<tr><td>{html.escape(t.label)}</td><td>{format_seconds(t.median)}</td>"
            f"<td>{format_seconds(t.iqr)}</td><td>{format_seconds(t.p95)}</td></tr>"
            for t in (self.baseline, self.candidate)
        )
        return (
            "<table><tr><th>what</th><th>median</th><th>IQR</th><th>p95</th></tr>"
            f"{rows}</table><p><b>speedup {self.speedup:.2f}x</b> ({self.confidence:.0%} CI {low:.2f}x&ndash;"
            f"{high:.2f}x, {len(self.ratios)} interleaved rounds on {html.escape(self.baseline.device)}): "
            f"{html.escape(self.verdict)}</p>"
        )


def compare(
    baseline: Callable[[], object],
    candidate: Callable[[], object],
    *,
    labels: tuple[str, str] = ("baseline", "candidate"),
    device: str | torch.device | None = None,
    repeats: int = 21,
    warmup: int = 3,
    min_sample_s: float = 2e-3,
    confidence: float = 0.95,
) -> Comparison:
    """Time two functions in alternating order (AB, BA, AB...), in one run, and compare them.

    Interleaving matters: timing A for a minute and then B for a minute lets anything that
    changes in between (clock boost, another process, a warm cache) pass for a speedup.
    """
    _check_counts(repeats, warmup, min_sample_s)
    median_confidence_interval([1.0] * repeats, confidence)  # fail now, not after the timing
    device = pick_device(device)
    samplers = [_Sampler(fn, device, warmup, min_sample_s) for fn in (baseline, candidate)]
    times: list[list[float]] = [[], []]
    for round_index in range(repeats):
        order = (0, 1) if round_index % 2 == 0 else (1, 0)
        for side in order:
            times[side].append(samplers[side].sample())
    timings = [
        Timing(
            label=label,
            times=tuple(side_times),
            calls_per_sample=sampler.calls_per_sample,
            device=str(device),
            num_threads=torch.get_num_threads(),
        )
        for label, side_times, sampler in zip(labels, times, samplers)
    ]
    return Comparison(baseline=timings[0], candidate=timings[1], confidence=confidence)
