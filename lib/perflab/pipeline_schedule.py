"""Pipeline schedules measured per rank: when each stage computed each microbatch, the bubble, the activations held.

    >>> from perflab.pipeline_schedule import PipelineRun, RankTimeline, StageWork
    >>> from perflab.pipeline_schedule import bubble_fraction, microbatches_in_flight
    >>> bubble_fraction(stages=2, microbatches=4)          # GPipe's (p - 1) / (m + p - 1)
    0.2
    >>> F, B = "forward", "backward"                       # one microbatch through two stages, in seconds
    >>> first = RankTimeline(rank=0, stage=0, work=(StageWork(F, 0, 0.0, 1.0), StageWork(B, 0, 5.0, 7.0)))
    >>> last = RankTimeline(rank=1, stage=1, work=(StageWork(F, 0, 1.5, 2.5), StageWork(B, 0, 2.5, 4.5)))
    >>> run = PipelineRun("GPipe", microbatches=1, timelines=(first, last))
    >>> run                                                # stage 1 started late: a slow send, say
    PipelineRun(GPipe, 2 stages x 1 microbatch: bubble 0.57 measured, 0.50 replayed, 0.50 by (p-1)/(m+p-1))
    >>> run.makespan_s, run.replayed_makespan_s
    (7.0, 6.0)
    >>> microbatches_in_flight("GPipe", stages=4, microbatches=8, stage=0), microbatches_in_flight("1F1B", 4, 8, 0)
    (8, 4)

The bubble is the share of the step the ranks spend idle, 1 - (time computing, summed over the p
ranks) / (p x the step's span). With m microbatches whose forward and backward take the same time on
every stage, GPipe and 1F1B both leave (p - 1) / (m + p - 1) (Huang et al., 2019, "GPipe",
arXiv:1811.06965, section 2.3; the HF Ultra-Scale Playbook's r_bubble = (p - 1) / m is the same idle
time over the compute time, https://huggingface.co/spaces/nanotron/ultrascale-playbook). *Replayed*
runs each rank's measured work with free communication: above it, the measured bubble is time spent
sending and waking up; off the formula, it is work of unequal duration. GPipe holds m microbatches'
activations on each stage; 1F1B at most p - s on stage s (torch's ``Schedule1F1B`` warms up with
that many forwards).

``record_stage(stage)`` measures a ``torch.distributed.pipelining.PipelineStage`` during one
``schedule.step``: it wraps the stage's ``forward_one_chunk`` and ``backward_one_chunk``, the calls in
which a stage computes (the schedules wait for their sends and receives outside them), reads
``time.perf_counter`` around each (on Linux one clock for every process of a machine), and counts
the activations autograd holds before each backward, the moments they peak::

    with record_stage(stage) as recording:
        schedule.step(inputs)                   # or, on the last stage, schedule.step(target=targets)
    timeline = recording.timeline(rank=dist.get_rank())

Used in: lecture 11.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field

import matplotlib.pyplot as plt
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from perflab.memory import saved_tensors
from perflab.render import Table, add_footer

__all__ = [
    "SCHEDULES",
    "PipelineRun",
    "RankTimeline",
    "StageRecording",
    "StageWork",
    "bubble_chart",
    "bubble_fraction",
    "median_run",
    "microbatches_in_flight",
    "pipeline_timeline",
    "record_stage",
]

SCHEDULES = ("GPipe", "1F1B")
_KINDS = ("forward", "backward")
_COLOURS = {"forward": "#4c72b0", "backward": "#dd8452"}


def bubble_fraction(stages: int, microbatches: int) -> float:
    """(p - 1) / (m + p - 1): the idle share of a step when every stage's work per microbatch takes the same time."""
    if stages < 1 or microbatches < 1:
        raise ValueError(f"stages and microbatches must be at least 1, got {stages} and {microbatches}")
    return (stages - 1) / (microbatches + stages - 1)


def microbatches_in_flight(schedule: str, stages: int, microbatches: int, stage: int) -> int:
    """The most microbatches whose activations ``stage`` holds at once: m under GPipe, min(m, p - s) under 1F1B."""
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}; choose one of {', '.join(SCHEDULES)}")
    return microbatches if schedule == "GPipe" else min(microbatches, stages - stage)


@dataclass(frozen=True)
class StageWork:
    """One forward or backward of one microbatch on one stage, from start to end (seconds on the machine's clock)."""

    kind: str  # "forward" or "backward"
    microbatch: int
    start_s: float
    end_s: float

    @property
    def duration_s(self) -> float:
        return self.end_s - self.start_s


@dataclass(frozen=True)
class RankTimeline:
    """What one rank's stage computed during a step, in order, and the most activation bytes it held."""

    rank: int
    stage: int
    work: tuple[StageWork, ...]
    activation_peak: int = 0  # bytes autograd kept for backward at the most, parameters excluded

    def __post_init__(self) -> None:
        work = (StageWork(**w) if isinstance(w, dict) else w for w in self.work)
        object.__setattr__(self, "work", tuple(sorted(work, key=lambda w: w.start_s)))

    @property
    def busy_s(self) -> float:
        return sum(w.duration_s for w in self.work)

    @property
    def max_in_flight(self) -> int:
        """The most microbatches forwarded and not yet backwarded at once, counted off the timeline."""
        held = most = 0
        for w in self.work:
            held += 1 if w.kind == "forward" else -1
            most = max(most, held)
        return most

    def median_s(self, kind: str) -> float:
        return statistics.median(w.duration_s for w in self.work if w.kind == kind)


@dataclass(frozen=True)
class PipelineRun:
    """One step of a schedule on p ranks, one stage each: the ranks' timelines, the bubble measured and expected."""

    schedule: str
    microbatches: int
    timelines: tuple[RankTimeline, ...]
    source: str = ""  # where it was measured

    def __post_init__(self) -> None:
        timelines = (RankTimeline(**t) if isinstance(t, dict) else t for t in self.timelines)
        object.__setattr__(self, "timelines", tuple(sorted(timelines, key=lambda t: t.stage)))

    @property
    def stages(self) -> int:
        return len(self.timelines)

    @property
    def start_s(self) -> float:
        return min(t.work[0].start_s for t in self.timelines)

    @property
    def makespan_s(self) -> float:
        return max(t.work[-1].end_s for t in self.timelines) - self.start_s

    @property
    def busy_s(self) -> float:
        return sum(t.busy_s for t in self.timelines)

    @property
    def bubble(self) -> float:
        return 1 - self.busy_s / (self.stages * self.makespan_s)

    @property
    def formula_bubble(self) -> float:
        return bubble_fraction(self.stages, self.microbatches)

    @property
    def replayed_makespan_s(self) -> float:
        """The step's span with these durations, in this order, if sending took no time and waking up none."""
        ends: dict[tuple[int, str, int], float] = {}
        queues = [list(t.work) for t in self.timelines]
        clocks = [0.0] * self.stages
        while any(queues):
            placed = False
            for stage, queue in enumerate(queues):
                while queue:
                    w = queue[0]
                    waits_for = {
                        "forward": (stage - 1, "forward", w.microbatch) if stage > 0 else None,
                        "backward": (stage + 1, "backward", w.microbatch) if stage < self.stages - 1 else None,
                    }[w.kind]
                    if waits_for is not None and waits_for not in ends:
                        break
                    clocks[stage] = max(clocks[stage], ends.get(waits_for, 0.0)) + w.duration_s
                    ends[stage, w.kind, w.microbatch] = clocks[stage]
                    queue.pop(0)
                    placed = True
            if not placed:
                raise ValueError(f"{self.schedule}: the timelines' orders wait on each other; no step ran like this")
        return max(clocks)

    @property
    def replayed_bubble(self) -> float:
        return 1 - self.busy_s / (self.stages * self.replayed_makespan_s)

    def to_dict(self) -> dict:
        """Plain JSON types, for a rank's results to cross into the notebook; the constructor reads them back."""
        return asdict(self)

    def __repr__(self) -> str:
        m = f"{self.microbatches} microbatch{'es' if self.microbatches > 1 else ''}"
        return (
            f"PipelineRun({self.schedule}, {self.stages} stages x {m}: bubble {self.bubble:.2f} measured, "
            f"{self.replayed_bubble:.2f} replayed, {self.formula_bubble:.2f} by (p-1)/(m+p-1))"
        )

    def _repr_html_(self) -> str:
        rows = [
            (t.rank, t.stage, *(f"{t.median_s(kind) * 1e3:.1f}" for kind in _KINDS), f"{t.busy_s * 1e3:.1f}",
             f"{(self.makespan_s - t.busy_s) * 1e3:.1f}", t.max_in_flight, f"{t.activation_peak / 1e6:.2f}")
            for t in self.timelines
        ]  # fmt: skip
        header = ("rank", "stage", "forward (ms, median)", "backward (ms, median)", "busy (ms)", "idle (ms)",
                  "most microbatches in flight", "activations at the peak (MB)")  # fmt: skip
        caption = f"{self!r}; step {self.makespan_s * 1e3:.1f} ms" + (f"; {self.source}" if self.source else "")
        return Table(header, rows, caption=caption, numeric=range(2, 8))._repr_html_()


def median_run(runs: Sequence[PipelineRun]) -> PipelineRun:
    """Of several steps of one configuration, the one whose measured bubble is the median (the lower of two)."""
    if not runs:
        raise ValueError("no runs")
    return sorted(runs, key=lambda run: run.bubble)[(len(runs) - 1) // 2]


@dataclass
class StageRecording:
    """What :func:`record_stage` saw: each piece of work, and the activation bytes held before each backward."""

    stage: int
    work: list[StageWork] = field(default_factory=list)
    held: list[int] = field(default_factory=list)

    def timeline(self, rank: int) -> RankTimeline:
        return RankTimeline(
            rank=rank, stage=self.stage, work=tuple(self.work), activation_peak=max(self.held, default=0)
        )


@contextlib.contextmanager
def record_stage(stage, *, clock: Callable[[], float] = time.perf_counter) -> Iterator[StageRecording]:
    """Time every forward and backward a pipeline stage runs in the block, and count the activations it holds."""
    recording = StageRecording(stage=stage.stage_index)
    parameters = list(stage.submod.parameters())

    def timed(kind: str, compute: Callable) -> Callable:
        def run(chunk: int, *args, **kwargs):
            if kind == "backward":  # what forwards and losses saved is all there: the activations peak now
                recording.held.append(saved.held_now(excluding=parameters))
            start = clock()
            result = compute(chunk, *args, **kwargs)
            recording.work.append(StageWork(kind, chunk, start, clock()))
            return result

        return run

    with saved_tensors() as saved:
        stage.forward_one_chunk = timed("forward", stage.forward_one_chunk)
        stage.backward_one_chunk = timed("backward", stage.backward_one_chunk)
        try:
            yield recording
        finally:  # the instance's wrappers go, the class's methods show through again
            del stage.forward_one_chunk, stage.backward_one_chunk


def pipeline_timeline(runs: Sequence[PipelineRun], *, caption: str, title: str | None = None) -> Figure:
    """One panel per run, one row per rank: its forwards and backwards, numbered by microbatch; white is idle."""
    figure, axes = plt.subplots(len(runs), 1, figsize=(10, 0.9 + 1.0 * sum(r.stages for r in runs)), sharex=True)
    axes = [axes] if len(runs) == 1 else list(axes)
    span_ms = max(run.makespan_s for run in runs) * 1e3
    for ax, run in zip(axes, runs):
        for row, timeline in enumerate(run.timelines):
            for w in timeline.work:
                start, width = (w.start_s - run.start_s) * 1e3, w.duration_s * 1e3
                ax.broken_barh([(start, width)], (row - 0.4, 0.8), facecolor=_COLOURS[w.kind], edgecolor="white")
                if width > run.makespan_s * 1e3 / 80:  # a number only where it fits
                    ax.text(start + width / 2, row, w.microbatch, ha="center", va="center", fontsize=7, color="white")
        ax.set_yticks(range(run.stages), [f"rank {t.rank}\nstage {t.stage}" for t in run.timelines], fontsize=8)
        ax.set_ylim(run.stages - 0.5, -0.5)
        ax.set_title(
            f"{run.schedule}, {run.microbatches} microbatches: idle {run.bubble:.0%} of the step measured, "
            f"{run.replayed_bubble:.0%} replayed with free sends, {run.formula_bubble:.0%} by (p-1)/(m+p-1)",
            fontsize=9,
        )
    axes[-1].set_xlim(-0.01 * span_ms, 1.15 * span_ms)  # room on the right for the legend
    axes[-1].set_xlabel("time since the step's first forward (ms)")
    axes[0].legend(handles=[Patch(color=_COLOURS[k], label=k) for k in _KINDS], loc="upper right", fontsize=8)
    figure.suptitle(title or "Each rank's forwards and backwards, numbered by microbatch: white is idle")
    add_footer(figure, caption)
    return figure


def bubble_chart(runs: Sequence[PipelineRun], *, caption: str, title: str | None = None) -> Figure:
    """The bubble against the number of microbatches: measured, replayed and (p - 1) / (m + p - 1), per schedule."""
    figure, ax = plt.subplots(figsize=(8, 4.2))
    stages, most = runs[0].stages, max(run.microbatches for run in runs)
    curve = [m / 4 for m in range(4, 4 * most + 1)]
    ax.plot(curve, [(stages - 1) / (m + stages - 1) * 100 for m in curve], color="black", label="(p-1)/(m+p-1)")
    for offset, schedule, marker, colour in ((-0.04, "GPipe", "o", "#4c72b0"), (0.04, "1F1B", "s", "#c44e52")):
        mine = sorted((run for run in runs if run.schedule == schedule), key=lambda run: run.microbatches)
        x = [run.microbatches * 2**offset for run in mine]  # side by side on the log axis
        ax.plot(x, [run.bubble * 100 for run in mine], marker, ls="-", color=colour, label=f"{schedule}: measured")
        ax.plot(x, [run.replayed_bubble * 100 for run in mine], marker, ls=":", mfc="none", color=colour,
                label=f"{schedule}: replayed, sends free")  # fmt: skip
    ax.set_xscale("log", base=2)
    ax.set_xticks(sorted({run.microbatches for run in runs}), [str(m) for m in sorted({r.microbatches for r in runs})])
    ax.set_xlabel("microbatches per step, m")
    ax.set_ylabel("bubble: idle share of the step (%)")
    ax.set_ylim(0, 100)
    ax.set_title(title or f"The pipeline bubble on {stages} stages: measured against (p-1)/(m+p-1)")
    ax.legend(fontsize=8)
    add_footer(figure, caption)
    return figure
