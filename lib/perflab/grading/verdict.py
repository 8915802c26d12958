"""What the trusted grader decided for one graded cell, and whether its measurement deserves a decision.

    >>> import time
    >>> from perflab.bench import Comparison, Timing
    >>> from perflab.grading.verdict import LoadMeter, Verdict, noise_problems
    >>> with LoadMeter() as load:                      # cores' worth of CPU other processes take meanwhile
    ...     time.sleep(0.2)                            # where the grader's interleaved rounds would run
    >>> print(f"other processes: {load.other_cores:.2f} cores")
    other processes: ... cores
    >>> rounds = Comparison(Timing("baseline", (2.0, 3.0, 2.0, 4.0, 2.0)), Timing("final", (1.0,) * 5), confidence=0.9)
    >>> quiet = LoadMeter()                            # seconds and load made up for the example
    >>> rounds.interval, quiet.other_cores             # a wide interval, measured on a quiet machine
    ((2.0, 4.0), 0.0)
    >>> noise_problems(rounds, quiet, threshold=2.5)   # it straddles the threshold: pass or fail is open
    ['the rounds leave pass or fail open: their 90% CI 2.00x-4.00x straddles the 2.5x threshold']
    >>> Verdict.decide("2.00x", failures=[], problems=noise_problems(rounds, quiet, threshold=2.5))
    Verdict(inconclusive: 2.00x; inconclusive: re-grade on a quiet machine; the rounds leave pass or fail open: ...)
    >>> noise_problems(rounds, quiet, threshold=1.5)   # as wide, but wholly above 1.5x: decided
    []
    >>> Verdict.decide("2.00x median (90% CI 2.00x-4.00x)", failures=[], problems=[])   # a measurement that decides
    Verdict(pass: 2.00x median (90% CI 2.00x-4.00x))
    >>> Verdict.grading_failed("the grading ran past its limit of 1800 s")   # the grader's failure, not the answer's
    Verdict(error: grading failed: not scored; the grading ran past its limit of 1800 s)
    >>> Verdict.refused("x" * 100_000).reasons[0][-29:]   # text the learner controls, cut to MAX_TEXT_CHARS
    'x [... 98,040 characters cut]'

A speedup measured beside a busy neighbour is not a smaller or larger copy of the quiet one:
the per-sample Python pipeline of a baseline loses far more to contention than an optimized
one, so load inflates speedups. A pass or a fail compares the median of the per-round ratios
with a threshold, and is issued only when the evidence decides it: the interval of those ratios
(``perflab.bench.median_confidence_interval``) lies wholly on one side of the threshold, and
processes other than the grader's own took little CPU while it measured (``MAX_OTHER_LOAD``).
A wide interval on one side decides (its width is the figure's precision, reported with it, not
doubt about the verdict). Otherwise the grader re-measures once with twice the rounds and,
failing that, says "inconclusive": zero points and a request to re-grade on a quiet machine,
never a verdict. "error" is the grader's own failure (a crash, a timeout, a watchdog, an
out-of-memory kill): the cell is not scored, nothing is cached, and it is graded again later.

A verdict's texts carry what the learner controls (an exception's message, a string forced into
a configuration) and cross a pipe and the gradebook, so each is cut to ``MAX_TEXT_CHARS``
whichever way the verdict is made, ``from_dict`` included.

Used by perflab.capstone and perflab.grading.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, get_args

import psutil

from perflab.bench import Comparison
from perflab.grading.machine_lock import lent_machine

__all__ = [
    "INCONCLUSIVE",
    "LoadMeter",
    "MAX_OTHER_LOAD",
    "MAX_TEXT_CHARS",
    "NOT_SCORED",
    "Status",
    "Verdict",
    "noise_problems",
    "own_cpu_seconds",
    "tree_cpu_seconds",
]

MAX_OTHER_LOAD = 0.3  # cores' worth of CPU taken by other processes (steal time included) while measuring
INCONCLUSIVE = "inconclusive: re-grade on a quiet machine"
NOT_SCORED = "grading failed: not scored"
MAX_TEXT_CHARS = 2_000  # per reason and for the measured text: a verdict line stays far under a pipe's 64 KiB


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
    """How many cores' worth of CPU time processes other than ours took during a block: a measurement. On a machine
    lent to this grading (:func:`perflab.grading.machine_lock.lent_machine`), the block has the machine alone."""

    def __init__(self, ours: Callable[[], float] = own_cpu_seconds):
        self.ours = ours
        self.other_cores = 0.0
        self._alone = contextlib.ExitStack()

    def __enter__(self) -> LoadMeter:
        if machine := lent_machine():
            self._alone.enter_context(machine.alone())
        self._start = (time.perf_counter(), _busy_seconds(), self.ours())
        return self

    def __exit__(self, *exc) -> None:
        wall, busy, ours = self._start
        elapsed = time.perf_counter() - wall
        self.other_cores = max(0.0, (_busy_seconds() - busy) - (self.ours() - ours)) / max(elapsed, 1e-9)
        self._alone.close()


def noise_problems(comparison: Comparison, load: LoadMeter, threshold: float) -> list[str]:
    """Why this measurement may not decide a verdict that compares its median ratio with ``threshold``; empty when
    it may.

    Open when the interval straddles the threshold (``low < threshold <= high``: the true median may lie on
    either side; at ``low == threshold`` every median in it reaches the threshold) or when other processes
    took CPU time while it measured, whatever the interval says.
    """
    problems = []
    low, high = comparison.interval
    if low < threshold <= high:
        problems.append(
            f"the rounds leave pass or fail open: their {comparison.confidence:.0%} CI {low:.2f}x-{high:.2f}x "
            f"straddles the {threshold:g}x threshold"
        )
    if load.other_cores > MAX_OTHER_LOAD:
        problems.append(
            f"other processes kept {load.other_cores:.2f} cores busy while it measured "
            f"(at most {MAX_OTHER_LOAD} allowed)"
        )
    return problems


Status = Literal["pass", "fail", "inconclusive", "error"]


def _capped(text: str) -> str:
    if len(text) <= MAX_TEXT_CHARS:
        return text
    kept = MAX_TEXT_CHARS - 40  # room for the marker, whatever the count it gives
    return f"{text[:kept]} [... {len(text) - kept:,} characters cut]"


@dataclass(frozen=True)
class Verdict:
    """``pass``, ``fail``, ``inconclusive`` or ``error``, what was measured, and every reason it did not pass."""

    status: Status
    measured: str
    reasons: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.status not in get_args(Status):
            raise ValueError(f"a verdict's status is one of {', '.join(get_args(Status))}, not {self.status!r:.80}")
        if type(self.measured) is not str:
            raise ValueError(f"a verdict's measured text must be a str, not {type(self.measured).__name__}")
        if type(self.reasons) is not tuple:
            raise ValueError(f"a verdict's reasons must be a tuple, not {type(self.reasons).__name__}")
        if any(type(reason) is not str for reason in self.reasons):
            raise ValueError("a verdict's reasons must all be str")
        object.__setattr__(self, "measured", _capped(self.measured))
        object.__setattr__(self, "reasons", tuple(map(_capped, self.reasons)))

    @classmethod
    def decide(cls, measured: str, failures: list[str], problems: list[str] = ()) -> Verdict:
        """Inconclusive when the measurement left the decision open (``noise_problems``), else fail on any failed check,
        else pass."""
        if problems:
            return cls("inconclusive", measured, (INCONCLUSIVE, *problems))
        return cls("fail" if failures else "pass", measured, tuple(failures))

    @classmethod
    def refused(cls, reason: str) -> Verdict:
        """A failure found before any measurement: no answer, an answer that is not data, a changed task."""
        return cls("fail", "not measured", (reason,))

    @classmethod
    def grading_failed(cls, reason: str) -> Verdict:
        """The grader itself failed on this cell (crash, timeout, watchdog, out of memory): not the answer's doing."""
        return cls("error", NOT_SCORED, (reason,))

    @property
    def passed(self) -> bool:
        return self.status == "pass"

    def text(self) -> str:
        if self.status == "error":
            headline = "The course's grader failed on this cell: NOT SCORED, and it will be graded again"
        else:
            headline = f"Re-measured by the course's grader, outside your notebook: {self.status.upper()}"
        return "\n".join([headline, self.measured, *(f"- {reason}" for reason in self.reasons)])

    def __repr__(self) -> str:
        return f"Verdict({self.status}: {self.measured}" + "".join(f"; {r}" for r in self.reasons) + ")"

    def to_dict(self) -> dict:
        return {"status": self.status, "measured": self.measured, "reasons": list(self.reasons)}

    @classmethod
    def from_dict(cls, fields) -> Verdict:
        """A verdict read back from JSON; ValueError for anything that is not exactly :meth:`to_dict`'s shape."""
        if not isinstance(fields, dict) or set(fields) != {"status", "measured", "reasons"}:
            raise ValueError(f"not a verdict: {str(fields)[:200]}")
        if type(fields["reasons"]) is not list:
            raise ValueError(f"a verdict's reasons must be a list, not {type(fields['reasons']).__name__}")
        return cls(fields["status"], fields["measured"], tuple(fields["reasons"]))
