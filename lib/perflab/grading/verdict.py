"""What the trusted grader decided for one graded cell, and whether its measurement deserves a decision.

    >>> import time
    >>> from perflab.bench import Comparison, Timing
    >>> from perflab.grading.verdict import LoadMeter, Verdict, noise_problems
    >>> with LoadMeter() as load:                      # cores' worth of CPU other processes take meanwhile
    ...     time.sleep(0.2)                            # where the grader's interleaved rounds would run
    >>> print(f"other processes: {load.other_cores:.2f} cores")
    other processes: ... cores
    >>> rounds = Comparison(Timing("baseline", (2.0, 3.0, 2.0, 4.0, 2.0)), Timing("final", (1.0,) * 5), confidence=0.9)
    >>> noise_problems(rounds, load)[0]                # seconds made up for the example: rounds that disagree
    'the rounds disagree: 90% CI 2.00x-4.00x is wider than 1.3x from end to end'
    >>> Verdict.decide("2.31x faster", failures=[], problems=noise_problems(rounds, load))
    Verdict(inconclusive: 2.31x faster; inconclusive: re-grade on a quiet machine; the rounds disagree: ...)
    >>> Verdict.decide("2.31x faster", failures=[], problems=[])   # a measurement that may decide
    Verdict(pass: 2.31x faster)

A speedup measured beside a busy neighbour is not a smaller or larger copy of the quiet one:
the per-sample Python pipeline of a baseline loses far more to contention than an optimized
one, so load inflates speedups. A pass or a fail is issued only when the interval of the
per-round ratios is narrow (``MAX_SPREAD``) and processes other than the grader's own took
little CPU while it measured (``MAX_OTHER_LOAD``); otherwise the grader re-measures with more
rounds and, failing that, says "inconclusive": zero points and a request to re-grade on a quiet
machine, never a verdict.

Used by perflab.capstone and perflab.grading.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import psutil

from perflab.bench import Comparison

__all__ = [
    "INCONCLUSIVE",
    "LoadMeter",
    "MAX_OTHER_LOAD",
    "MAX_SPREAD",
    "Verdict",
    "noise_problems",
    "own_cpu_seconds",
    "tree_cpu_seconds",
]

MAX_SPREAD = 1.3  # the interval's high end over its low end
MAX_OTHER_LOAD = 0.3  # cores' worth of CPU taken by other processes (steal time included) while measuring
INCONCLUSIVE = "inconclusive: re-grade on a quiet machine"


def tree_cpu_seconds(root: psutil.Process) -> float:
    """CPU time of ``root`` and every live descendant, with that of their exited, waited-for children."""
    total = 0.0
    try:
        tree = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return total
    for process in tree:
        try:
            times = process.cpu_times()
            total += times.user + times.system + times.children_user + times.children_system
        except psutil.NoSuchProcess:
            pass
    return total


def own_cpu_seconds() -> float:
    """This process's CPU time and its children's."""
    return tree_cpu_seconds(psutil.Process())


def _busy_seconds() -> float:
    times = psutil.cpu_times()
    idle = times.idle + getattr(times, "iowait", 0.0)
    return sum(times) - idle - getattr(times, "guest", 0.0) - getattr(times, "guest_nice", 0.0)  # guest time is in user


class LoadMeter:
    """How many cores' worth of CPU time processes other than ours took during a block."""

    def __init__(self, ours: Callable[[], float] = own_cpu_seconds):
        self.ours = ours
        self.other_cores = 0.0

    def __enter__(self) -> LoadMeter:
        self._start = (time.perf_counter(), _busy_seconds(), self.ours())
        return self

    def __exit__(self, *exc) -> None:
        wall, busy, ours = self._start
        elapsed = time.perf_counter() - wall
        self.other_cores = max(0.0, (_busy_seconds() - busy) - (self.ours() - ours)) / max(elapsed, 1e-9)


def noise_problems(comparison: Comparison, load: LoadMeter) -> list[str]:
    """Why this measurement may not decide a grade; empty when it may."""
    problems = []
    low, high = comparison.interval
    if high / low > MAX_SPREAD:
        problems.append(
            f"the rounds disagree: {comparison.confidence:.0%} CI {low:.2f}x-{high:.2f}x is wider than "
            f"{MAX_SPREAD}x from end to end"
        )
    if load.other_cores > MAX_OTHER_LOAD:
        problems.append(
            f"other processes kept {load.other_cores:.2f} cores busy while it measured "
            f"(at most {MAX_OTHER_LOAD} allowed)"
        )
    return problems


@dataclass(frozen=True)
class Verdict:
    """``pass``, ``fail`` or ``inconclusive``, what was measured, and every reason it did not pass."""

    status: Literal["pass", "fail", "inconclusive"]
    measured: str
    reasons: tuple[str, ...] = ()

    @classmethod
    def decide(cls, measured: str, failures: list[str], problems: list[str] = ()) -> Verdict:
        """Inconclusive when the measurement was noisy, else fail on any failed check, else pass."""
        if problems:
            return cls("inconclusive", measured, (INCONCLUSIVE, *problems))
        return cls("fail" if failures else "pass", measured, tuple(failures))

    @classmethod
    def refused(cls, reason: str) -> Verdict:
        """A failure found before any measurement: no answer, an answer that is not data, a changed task."""
        return cls("fail", "not measured", (reason,))

    @property
    def passed(self) -> bool:
        return self.status == "pass"

    def text(self) -> str:
        lines = [f"Re-measured by the course's grader, outside your notebook: {self.status.upper()}", self.measured]
        return "\n".join([*lines, *(f"- {reason}" for reason in self.reasons)])

    def __repr__(self) -> str:
        return f"Verdict({self.status}: {self.measured}" + "".join(f"; {r}" for r in self.reasons) + ")"

    def to_dict(self) -> dict:
        return {"status": self.status, "measured": self.measured, "reasons": list(self.reasons)}

    @classmethod
    def from_dict(cls, fields: dict) -> Verdict:
        return cls(fields["status"], fields["measured"], tuple(fields["reasons"]))
