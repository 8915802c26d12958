"""Timing done right: warm up, synchronize, repeat, report the spread, compare side by side.

    >>> import torch
    >>> from perflab.bench import benchmark, compare
    >>> x = torch.randn(256, 256)
    >>> benchmark(lambda: x @ x, label="matmul 256")
    Timing(matmul 256 on ...: median ..., IQR ..., p95 ...; 20 samples x ... calls, ... threads)
    >>> compare(lambda: x @ x, lambda: torch.mm(x, x), labels=("@", "mm"))   # the same kernel: no clear winner
    Comparison(mm vs @: ...x (95% CI ...x-...x) over 21 interleaved rounds; ...)

Each sample runs the function enough times to last ``min_sample_s`` (so the clock's own
resolution does not matter), with the device synchronized before the clock is read. That is the
method of ``torch.utils.benchmark.Timer``; the samples are taken by a loop of this module's own,
around ``time.perf_counter``, because ``Timer`` lacks what a comparison needs: its per-sample call,
``Timer.timeit``, runs at least two untimed calls before every sample (three calls per sample of a
training step), and its ``blocked_autorange`` picks its own number of samples, so neither can
alternate two functions round by round. The loop also synchronizes the device being timed
(``Timer``'s clock synchronizes the current accelerator) and runs at the *current* thread count
(``Timer`` pins one thread unless told). ``Timing.to_measurement()`` hands results to
``torch.utils.benchmark.Compare`` for tables:

    >>> from torch.utils.benchmark import Compare
    >>> cases = {"x @ x": lambda: x @ x, "x + x": lambda: x + x}
    >>> Compare([benchmark(f, label=name, samples=5).to_measurement() for name, f in cases.items()]).print()
    [...perflab...]
    ...
          x @ x  |  ...
          x + x  |  ...
    Times are in ...

Used in: lectures 01-08 and 10, labs 01, 02, 04, 05, 06 and 12.
"""

from __future__ import annotations

import math
import statistics
import time
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch

from perflab.device import pick_device, synchronize
from perflab.render import Table

__all__ = [
    "Comparison",
    "NEGLIGIBLE_CHANGE",
    "Timing",
    "benchmark",
    "compare",
    "format_seconds",
    "interleaved_rounds",
    "median_confidence_interval",
    "median_ratio",
    "time_call",
]


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
        return Table([name for name, _ in cells], [[value for _, value in cells]])._repr_html_()


class _Sampler:
    """Runs one function as timed samples of ``calls_per_sample`` calls each, after ``warmup`` untimed calls
    (why not ``torch.utils.benchmark.Timer``: see the module's docstring)."""

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


_T = TypeVar("_T")


def interleaved_rounds(
    sides: Sequence[Callable[[int], _T]],
    rounds: int,
    *,
    warmup: bool = True,
    after_round: Callable[[int, list[list[_T]]], object] | None = None,
) -> list[list[_T]]:
    """Run each side once per round, the order reversing every other round (AB, BA, AB...): one list per side.

    ``side(round_index)`` runs that side once and returns what it measured (seconds, an epoch, a
    training result); the round index doubles as a seed for sides that draw their data. Each
    round runs every side back to back, so whatever drifts during the run (clock boost, another
    process, a cache that warms) hits every side of a round alike, and the order reverses so that
    no side is always first. Compare the sides by the median of their per-round ratios
    (:func:`median_ratio`, :class:`Comparison`), not by each side's own median.

    ``warmup``: first run each side once, in order, untimed, with ``rounds`` as the index (a seed
    no timed round uses); its result is not returned, so a side that needs it (how many steps a
    warm-up epoch took) tells its warm-up by that index. Leave it out when the caller warms up
    its own way. ``after_round(round_index, results)`` is called after every round, between
    rounds, with the results so far (one list per side): to log, to check what the round
    returned, or to move a progress bar; when it returns True the rounds stop there (a result
    already wrong needs no more timing).
    """
    sides = list(sides)
    if not sides:
        raise ValueError("interleaved_rounds needs at least one side")
    if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 1:
        raise ValueError(f"rounds must be a positive integer, got {rounds!r}")
    if warmup:
        for side in sides:
            side(rounds)
    results: list[list[_T]] = [[] for _ in sides]
    for round_index in range(rounds):
        order = range(len(sides)) if round_index % 2 == 0 else reversed(range(len(sides)))
        for index in order:
            results[index].append(sides[index](round_index))
        if after_round is not None and after_round(round_index, results) is True:
            break
    return results


def _check_counts(count: int, name: str, warmup: int, min_sample_s: float) -> None:
    if not isinstance(count, int) or count < 1:
        raise ValueError(f"{name} must be a positive integer, got {count!r}")
    if not isinstance(warmup, int) or warmup < 0:
        raise ValueError(f"warmup must be a non-negative integer, got {warmup!r}")
    if not min_sample_s > 0:
        raise ValueError(f"min_sample_s must be positive, got {min_sample_s!r}")


def _renamed_keyword(function: str, old: str, new: str, value: int) -> int:
    """``value``, given under the keyword's old name: accepted for one release, with a warning naming the new one."""
    warnings.warn(
        f"{function}({old}=...) is deprecated and will be removed in the next release: use {function}({new}=...)",
        DeprecationWarning,
        stacklevel=3,
    )
    return value


def benchmark(
    fn: Callable[[], object],
    *,
    label: str | None = None,
    device: str | torch.device | None = None,
    samples: int = 20,
    warmup: int = 3,
    min_sample_s: float = 2e-3,
    repeats: int | None = None,
) -> Timing:
    """Time ``fn()``: ``warmup`` untimed calls, then ``samples`` synchronized samples.

    ``repeats`` is the old name of ``samples``, accepted for one release with a ``DeprecationWarning``.
    """
    if repeats is not None:
        samples = _renamed_keyword("benchmark", "repeats", "samples", repeats)
    _check_counts(samples, "samples", warmup, min_sample_s)
    device = pick_device(device)
    sampler = _Sampler(fn, device, warmup, min_sample_s)
    times = tuple(sampler.sample() for _ in range(samples))
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


def median_ratio(numerators: Iterable[float], denominators: Iterable[float]) -> float:
    """The median over rounds of ``numerator / denominator``, both measured in the same round.

    A ratio of neighbours cancels whatever drifted between rounds; the ratio of two medians
    would not. :class:`Comparison` adds the confidence interval for times.
    """
    return statistics.median(n / d for n, d in zip(numerators, denominators, strict=True))


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

    def _table(self) -> Table:
        low, high = self.interval
        rows = [
            (t.label, format_seconds(t.median), format_seconds(t.iqr), format_seconds(t.p95))
            for t in (self.baseline, self.candidate)
        ]
        caption = (
            f"speedup {self.speedup:.2f}x ({self.confidence:.0%} CI {low:.2f}x-{high:.2f}x, "
            f"{len(self.ratios)} interleaved rounds on {self.baseline.device}): {self.verdict}"
        )
        return Table(("what", "median", "IQR", "p95"), rows, caption=caption, numeric=(1, 2, 3))

    def _repr_html_(self) -> str:
        return self._table()._repr_html_()


def compare(
    baseline: Callable[[], object],
    candidate: Callable[[], object],
    *,
    labels: tuple[str, str] = ("baseline", "candidate"),
    device: str | torch.device | None = None,
    rounds: int = 21,
    warmup: int = 3,
    min_sample_s: float = 2e-3,
    confidence: float = 0.95,
    repeats: int | None = None,
) -> Comparison:
    """Time two functions in alternating order (AB, BA, AB...), in one run, and compare them.

    Interleaving matters: timing A for a minute and then B for a minute lets anything that
    changes in between (clock boost, another process, a warm cache) pass for a speedup. Each
    function gets ``warmup`` untimed calls first; then each of the ``rounds`` takes one sample of
    each (:func:`interleaved_rounds`). ``repeats`` is the old name of ``rounds``, accepted for one
    release with a ``DeprecationWarning``.
    """
    if repeats is not None:
        rounds = _renamed_keyword("compare", "repeats", "rounds", repeats)
    _check_counts(rounds, "rounds", warmup, min_sample_s)
    median_confidence_interval([1.0] * rounds, confidence)  # fail now, not after the timing
    device = pick_device(device)
    samplers = [_Sampler(fn, device, warmup, min_sample_s) for fn in (baseline, candidate)]
    # The samplers warmed up as they were made: no second warm-up here.
    times = interleaved_rounds([lambda _, s=sampler: s.sample() for sampler in samplers], rounds, warmup=False)
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
