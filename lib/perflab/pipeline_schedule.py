"""Pipeline schedules measured per rank: when each stage computed each microbatch, the bubble, the activations held.

    >>> from perflab.pipeline_schedule import PipelineRun, RankTimeline, StageWork
    >>> from perflab.pipeline_schedule import bubble_fraction, microbatches_in_flight, point_to_point_sends
    >>> bubble_fraction(ranks=2, microbatches=4), bubble_fraction(2, 4, stages_per_rank=2)   # (p-1)/(v m + p-1)
    (0.2, 0.1111111111111111)
    >>> F, B = "forward", "backward"                       # stage, kind, microbatch, start and end in seconds
    >>> first = RankTimeline(rank=0, work=(StageWork(0, F, 0, 0.0, 1.0), StageWork(0, B, 0, 5.0, 7.0)), sends=1)
    >>> last = RankTimeline(rank=1, work=(StageWork(1, F, 0, 1.5, 2.5), StageWork(1, B, 0, 2.5, 4.5)), sends=1)
    >>> run = PipelineRun("GPipe", microbatches=1, timelines=(first, last))
    >>> run                                                # stage 1 started late: a slow send, say
    PipelineRun(GPipe, 2 ranks x 1 stage x 1 microbatch: bubble 0.57 measured, 0.50 replayed, 0.50 by (p-1)/(vm+p-1))
    >>> run.makespan_s, run.replayed_makespan_s
    (7.0, 6.0)
    >>> microbatches_in_flight("GPipe", ranks=4, microbatches=8, rank=0), microbatches_in_flight("1F1B", 4, 8, 0)
    (8, 4)
    >>> microbatches_in_flight("Interleaved1F1B", 2, 4, rank=0, stages_per_rank=2)   # forwards, counted per stage
    5
    >>> run.sends, point_to_point_sends(2, 1), point_to_point_sends(2, 1, stages_per_rank=2)   # 2 (p v - 1) m
    (2, 2, 6)

The bubble is the share of the step the ranks spend idle, 1 - (time computing, summed over the p
ranks) / (p x the step's span). With m microbatches whose forward and backward take the same time on
every stage, GPipe and 1F1B both leave (p - 1) / (m + p - 1) (Huang et al., 2019, "GPipe",
arXiv:1811.06965, section 2.3; the HF Ultra-Scale Playbook's r_bubble = (p - 1) / m is the same idle
time over the compute time, https://huggingface.co/spaces/nanotron/ultrascale-playbook). The
interleaved 1F1B schedule gives each rank v stages that are not adjacent (rank r holds stages r, r + p,
...): each does 1/v of the rank's work per microbatch, so the fill and drain shrink v-fold, to
(p - 1) / (v m + p - 1) of the step (Narayanan et al., 2021, "Efficient Large-Scale Language Model
Training on GPU Clusters Using Megatron-LM", arXiv:2104.04473, section 2.2.2, writes (1/v) (p - 1) / m,
idle over compute, as the Playbook's (p - 1) / (v m); it asks for m a multiple of p; torch's order,
replayed, meets it for every m >= p the tests try). The price: 2 (p v - 1) sends per microbatch instead
of 2 (p - 1), one per stage boundary and direction: v times as many on a rank inside the pipeline (the
paper's "the amount of communication also increases by v"), (p v - 1) / (p - 1) times in all.

*Replayed* runs each rank's measured work with free communication: above it, the measured bubble is time
spent sending and waking up; off the formula, it is work of unequal duration. GPipe holds m
microbatches' activations on each stage; 1F1B at most p - s on stage s (torch's ``Schedule1F1B`` warms
up with that many forwards); interleaved 1F1B counts per stage, a microbatch forwarded on two of a rank's
stages counting twice: torch's ``ScheduleInterleaved1F1B`` warms rank r up with (v - 1) k + 2 (p - 1 - r)
forwards, k = m / max(1, m // p) microbatches per round, at most all v m of them, then runs each forward
before its backward, so one more where forwards remain (``_get_warmup_ops``, ``_get_1f1b_rank_ops`` in
``torch/distributed/pipelining/schedules.py``).

``record_stages(*stages)`` measures the ``torch.distributed.pipelining.PipelineStage`` objects of one rank
during one ``schedule.step``: it wraps each stage's ``forward_one_chunk`` and ``backward_one_chunk``, the
calls in which a stage computes (the schedules wait for their sends and receives outside them), reads
``time.perf_counter`` around each (on Linux one clock for every process of a machine), counts the
activations autograd holds before each backward, the moments they peak, and the tensors the stages
hand to ``isend`` (``get_fwd_send_ops``, ``get_bwd_send_ops``)::

    with record_stages(*stages) as recording:
        schedule.step(inputs)                   # or, on the last stage's rank, schedule.step(target=targets)
    timeline = recording.timeline(rank=dist.get_rank())

Used in: lecture 11.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field

from perflab.memory import saved_tensors
from perflab.render import Table

__all__ = [
    "SCHEDULES",
    "PipelineRun",
    "RankTimeline",
    "StageRecording",
    "StageWork",
    "bubble_fraction",
    "median_run",
    "microbatches_in_flight",
    "point_to_point_sends",
    "record_stages",
]

SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B")  # torch's ScheduleGPipe, Schedule1F1B, ScheduleInterleaved1F1B
_KINDS = ("forward", "backward")


def bubble_fraction(ranks: int, microbatches: int, stages_per_rank: int = 1) -> float:
    """(p - 1) / (v m + p - 1): the idle share of a step of p ranks, v stages each, every stage's work the same.

    With v > 1 torch's interleaved order meets it from m = p microbatches on (the tests replay 2 to 4 ranks): with
    fewer, a microbatch waits to come round to its rank's next stage, and the step idles more than this."""
    if min(ranks, microbatches, stages_per_rank) < 1:
        raise ValueError(f"ranks, microbatches and stages per rank must be at least 1, got {ranks}, {microbatches}, "
                         f"{stages_per_rank}")  # fmt: skip
    return (ranks - 1) / (stages_per_rank * microbatches + ranks - 1)


def microbatches_in_flight(schedule: str, ranks: int, microbatches: int, rank: int, stages_per_rank: int = 1) -> int:
    """The most forwards ``rank`` holds whose backward has not run: m under GPipe, min(m, p - r) under 1F1B,
    torch's warm-up plus one under interleaved 1F1B (counted per stage: v stages, v forwards per microbatch)."""
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}; choose one of {', '.join(SCHEDULES)}")
    if schedule != "Interleaved1F1B" and stages_per_rank != 1:
        raise ValueError(f"{schedule} runs one stage per rank, not {stages_per_rank}")
    if schedule == "GPipe":
        return microbatches
    if schedule == "1F1B":
        return min(microbatches, ranks - rank)
    per_round = microbatches // max(1, microbatches // ranks)
    warmup = (stages_per_rank - 1) * per_round + 2 * (ranks - 1 - rank)
    return min(warmup + 1, stages_per_rank * microbatches)


def point_to_point_sends(ranks: int, microbatches: int, stages_per_rank: int = 1) -> int:
    """Tensors sent in a step: each microbatch's activation forward and its gradient back across every stage boundary,
    2 (p v - 1) m with the p v stages placed round robin, so that every boundary lies between two ranks."""
    return 2 * (ranks * stages_per_rank - 1) * microbatches


@dataclass(frozen=True)
class StageWork:
    """One forward or backward of one microbatch on one stage, from start to end (seconds on the machine's clock)."""

    stage: int
    kind: str  # "forward" or "backward"
    microbatch: int
    start_s: float
    end_s: float

    @property
    def duration_s(self) -> float:
        return self.end_s - self.start_s


@dataclass(frozen=True)
class RankTimeline:
    """What one rank's stages computed during a step, in order, the most activation bytes it held, what it sent."""

    rank: int
    work: tuple[StageWork, ...]
    activation_peak: int = 0  # bytes autograd kept for backward at the most, parameters excluded
    sends: int = 0  # tensors handed to isend: activations forward, gradients back
    sent_bytes: int = 0

    def __post_init__(self) -> None:
        work = (StageWork(**w) if isinstance(w, dict) else w for w in self.work)
        object.__setattr__(self, "work", tuple(sorted(work, key=lambda w: w.start_s)))

    @property
    def stages(self) -> tuple[int, ...]:
        return tuple(sorted({w.stage for w in self.work}))

    @property
    def busy_s(self) -> float:
        return sum(w.duration_s for w in self.work)

    @property
    def max_in_flight(self) -> int:
        """The most forwards not yet backwarded at once, counted off the timeline (per stage, as the schedules do)."""
        return self.held_by_order(dict.fromkeys(self.stages, 1))

    def held_by_order(self, unit: Mapping[int, int]) -> int:
        """The most bytes held at once if each forward on stage s kept ``unit[s]`` until its backward, in this order."""
        held = most = 0
        for w in self.work:
            held += unit[w.stage] if w.kind == "forward" else -unit[w.stage]
            most = max(most, held)
        return most

    def median_s(self, kind: str, stage: int | None = None) -> float:
        """The median duration of this rank's forwards or backwards: on all of its stages, or on ``stage``."""
        return statistics.median(w.duration_s for w in self.work if w.kind == kind and stage in (None, w.stage))


@dataclass(frozen=True)
class PipelineRun:
    """One step of a schedule on p ranks, v stages each: the ranks' timelines, the bubble measured and expected."""

    schedule: str
    microbatches: int
    timelines: tuple[RankTimeline, ...]
    source: str = ""  # where it was measured

    def __post_init__(self) -> None:
        timelines = (RankTimeline(**t) if isinstance(t, dict) else t for t in self.timelines)
        object.__setattr__(self, "timelines", tuple(sorted(timelines, key=lambda t: t.rank)))

    @property
    def ranks(self) -> int:
        return len(self.timelines)

    @property
    def stages_per_rank(self) -> int:
        return len({w.stage for t in self.timelines for w in t.work}) // self.ranks

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
        return 1 - self.busy_s / (self.ranks * self.makespan_s)

    @property
    def formula_bubble(self) -> float:
        return bubble_fraction(self.ranks, self.microbatches, self.stages_per_rank)

    @property
    def sends(self) -> int:
        return sum(t.sends for t in self.timelines)

    @property
    def replayed_makespan_s(self) -> float:
        """The step's span with these durations, in this order, if sending took no time and waking up none."""
        last = self.ranks * self.stages_per_rank - 1
        ends: dict[tuple[int, str, int], float] = {}
        queues = [list(t.work) for t in self.timelines]
        clocks = [0.0] * self.ranks
        while any(queues):
            placed = False
            for rank, queue in enumerate(queues):
                while queue:
                    w = queue[0]
                    waits_for = {  # the neighbouring stage's work on the same microbatch, on another rank
                        "forward": (w.stage - 1, "forward", w.microbatch) if w.stage > 0 else None,
                        "backward": (w.stage + 1, "backward", w.microbatch) if w.stage < last else None,
                    }[w.kind]
                    if waits_for is not None and waits_for not in ends:
                        break
                    clocks[rank] = max(clocks[rank], ends.get(waits_for, 0.0)) + w.duration_s
                    ends[w.stage, w.kind, w.microbatch] = clocks[rank]
                    queue.pop(0)
                    placed = True
            if not placed:
                raise ValueError(f"{self.schedule}: the timelines' orders wait on each other; no step ran like this")
        return max(clocks)

    @property
    def replayed_bubble(self) -> float:
        return 1 - self.busy_s / (self.ranks * self.replayed_makespan_s)

    def to_dict(self) -> dict:
        """Plain JSON types, for a rank's results to cross into the notebook; the constructor reads them back."""
        return asdict(self)

    def __repr__(self) -> str:
        v, m = self.stages_per_rank, f"{self.microbatches} microbatch{'es' if self.microbatches > 1 else ''}"
        return (
            f"PipelineRun({self.schedule}, {self.ranks} ranks x {v} stage{'s' if v > 1 else ''} x {m}: bubble "
            f"{self.bubble:.2f} measured, {self.replayed_bubble:.2f} replayed, {self.formula_bubble:.2f} by "
            f"(p-1)/(vm+p-1))"
        )

    def _repr_html_(self) -> str:
        rows = [
            (t.rank, ", ".join(map(str, t.stages)), *(f"{t.median_s(kind) * 1e3:.1f}" for kind in _KINDS),
             f"{t.busy_s * 1e3:.1f}", f"{(self.makespan_s - t.busy_s) * 1e3:.1f}", t.max_in_flight,
             f"{t.activation_peak / 1e6:.2f}", t.sends)
            for t in self.timelines
        ]  # fmt: skip
        header = ("rank", "stages", "forward (ms, median)", "backward (ms, median)", "busy (ms)", "idle (ms)",
                  "most forwards in flight", "activations at the peak (MB)", "tensors sent")  # fmt: skip
        caption = f"{self!r}; step {self.makespan_s * 1e3:.1f} ms" + (f"; {self.source}" if self.source else "")
        return Table(header, rows, caption=caption, numeric=range(2, 9))._repr_html_()


def median_run(runs: Sequence[PipelineRun]) -> PipelineRun:
    """Of several steps of one configuration, the one whose measured bubble is the median (the lower of two)."""
    if not runs:
        raise ValueError("no runs")
    return sorted(runs, key=lambda run: run.bubble)[(len(runs) - 1) // 2]


@dataclass
class StageRecording:
    """What :func:`record_stages` saw: each piece of work, the activation bytes held before each backward, the sends."""

    work: list[StageWork] = field(default_factory=list)
    held: list[int] = field(default_factory=list)
    sent: list[int] = field(default_factory=list)  # bytes of each tensor handed to isend

    def timeline(self, rank: int) -> RankTimeline:
        return RankTimeline(rank=rank, work=tuple(self.work), activation_peak=max(self.held, default=0),
                            sends=len(self.sent), sent_bytes=sum(self.sent))  # fmt: skip


@contextlib.contextmanager
def record_stages(*stages, clock: Callable[[], float] = time.perf_counter) -> Iterator[StageRecording]:
    """Time every forward and backward one rank's pipeline stages run in the block, count what they hold and send."""
    recording = StageRecording()
    parameters = [p for stage in stages for p in stage.submod.parameters()]

    def timed(stage, kind: str, compute: Callable) -> Callable:
        def run(chunk: int, *args, **kwargs):
            if kind == "backward":  # what forwards and losses saved is all there: the activations peak now
                recording.held.append(saved.held_now(excluding=parameters))
            start = clock()
            result = compute(chunk, *args, **kwargs)
            recording.work.append(StageWork(stage.stage_index, kind, chunk, start, clock()))
            return result

        return run

    def counted(send_ops: Callable) -> Callable:
        def run(chunk: int, *args, **kwargs):
            ops = send_ops(chunk, *args, **kwargs)
            recording.sent.extend(op.tensor.nbytes for op in ops)
            return ops

        return run

    with saved_tensors() as saved:  # one count for all of the rank's stages: hooks entered inside would replace it
        for stage in stages:
            stage.forward_one_chunk = timed(stage, "forward", stage.forward_one_chunk)
            stage.backward_one_chunk = timed(stage, "backward", stage.backward_one_chunk)
            stage.get_fwd_send_ops = counted(stage.get_fwd_send_ops)
            stage.get_bwd_send_ops = counted(stage.get_bwd_send_ops)
        try:
            yield recording
        finally:  # the instances' wrappers go, the class's methods show through again
            for stage in stages:
                del stage.forward_one_chunk, stage.backward_one_chunk, stage.get_fwd_send_ops, stage.get_bwd_send_ops
