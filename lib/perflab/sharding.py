"""What one rank holds and sends per training step under DDP and the ZeRO stages: on paper, then measured.

    >>> from perflab.models import GPTConfig
    >>> from perflab.sharding import estimate_sharded_step
    >>> config = GPTConfig(n_layer=2, attention="naive")
    >>> ddp, zero3 = (estimate_sharded_step(config, batch_size=8, seq_len=128, world_size=4, stage=stage)
    ...               for stage in ("ddp", "zero3"))
    >>> ddp
    ShardedStep(DDP on 4 ranks, estimate: keeps parameters 1.78 + gradients 1.78 + optimizer state 3.57 MB; peak 30.30 MB; bus bytes 2.68 MB per step)
    >>> zero3
    ShardedStep(ZeRO-3 on 4 ranks, estimate: keeps parameters 0.45 + gradients 0.45 + optimizer state 0.89 MB; peak 26.73 MB; bus bytes 3.87 MB per step)
    >>> zero3.at_peak["activations"] == ddp.at_peak["activations"]    # every rank still runs its whole batch
    True

The formulas are the ZeRO paper's (Rajbhandari et al., 2020, "ZeRO: Memory Optimizations Toward
Training Trillion Parameter Models", arXiv:1910.02054, section 5): of the parameters, gradients
and AdamW state (16 bytes a parameter in float32) that DDP keeps whole on each of N ranks, ZeRO-1
divides the optimizer state by N, ZeRO-2 the gradients too, ZeRO-3 the parameters too, and then
gathers each layer in full while it computes. No stage divides the activations, which come, with
the rest, from :func:`perflab.memory_budget.estimate_training_memory`. ZeRO-3 follows FSDP2 on
this GPT with one unit per block and a root unit for the embeddings and final LayerNorm: the
root stays gathered from forward to backward, and backward gathers the next block while one
computes, so the peak holds the root and two blocks; with ``reshard_after_forward=False``, all of
it. The estimated peak adds the parts up, as the paper does.

Communication is counted in *bus bytes*: each collective's payload S times its bus factor, as
nccl-tests defines it (https://github.com/NVIDIA/nccl-tests/blob/master/doc/PERFORMANCE.md):
2(N-1)/N for an all-reduce, (N-1)/N for a reduce-scatter or an all-gather, 1 for a broadcast, so
that a collective takes at least its bus bytes / the link's bandwidth. With bandwidth-optimal
algorithms every rank sends that much in the first three; in a broadcast the root sends all S
bytes, which bounds its time, while the others send less: (N-1)/N S is a rank's average only when
every rank is the root for an equal share. ZeRO-1 is PyTorch's ``ZeroRedundancyOptimizer`` under
DDP, which all-reduces and then broadcasts each updated parameter from the rank that owns it.
:func:`profile_collectives` reads the collectives of one step off a ``torch.profiler`` run of a
gloo rank, :class:`SentBytes` what the processes really sent, and :func:`peak_parts` the parts of
a peak off PyTorch's memory trackers.

Used in: lecture 07 (ddp), lecture 09 (sharding), lecture 11 (tensor pipeline parallel).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch
from torch.autograd.profiler_util import FunctionEvent

from perflab import torch_features
from perflab.memory_budget import estimate_over_measured, estimate_training_memory
from perflab.models.gpt import GPTConfig
from perflab.render import Table

__all__ = [
    "COMPONENTS",
    "PEAK_PARTS",
    "STAGES",
    "Collective",
    "SentBytes",
    "ShardedStep",
    "ShardingComparison",
    "StepCollectives",
    "estimate_sharded_step",
    "peak_parts",
    "bus_factor",
    "profile_collectives",
]

STAGES = ("ddp", "zero1", "zero2", "zero3")
COMPONENTS = ("parameters", "gradients", "optimizer_state")  # what a rank keeps from step to step
PEAK_PARTS = ("parameters", "gathered", "gradients", "optimizer_state", "activations", "other")
_DIVIDED = {"ddp": (), "zero1": ("optimizer_state",), "zero2": ("optimizer_state", "gradients"), "zero3": COMPONENTS}
_FLOAT32 = 4  # bytes per element
_GATHERED_BLOCKS = 2  # the block that computes its backward and the next one, prefetched


@dataclass(frozen=True)
class ShardedStep:
    """Bytes one rank keeps, holds at its peak, and sends for one training step; ``source``: estimated or measured.

    ``parameters``, ``gradients`` and ``optimizer_state`` are what the rank keeps of each, its
    shard or all of it. ``at_peak`` says what it holds at the step's peak, by part (see
    :data:`PEAK_PARTS`: ``gathered`` are parameters all-gathered in full, ``other`` the
    temporaries no formula counts). ``sent`` is the step's bus bytes: each collective's payload
    times its :func:`bus_factor`, what the collectives cost in time at a given bandwidth.
    """

    stage: str
    world_size: int
    parameters: int
    gradients: int
    optimizer_state: int
    at_peak: Mapping[str, int] = field(hash=False)  # a dict: compared, but not hashed
    sent: int
    source: str
    reshard_after_forward: bool = True  # ZeRO-3 only

    def __post_init__(self) -> None:
        if self.stage not in STAGES:
            raise ValueError(f"unknown stage {self.stage!r}; choose one of {', '.join(STAGES)}")
        unknown = set(self.at_peak) - set(PEAK_PARTS)
        if unknown:
            raise ValueError(f"unknown parts {sorted(unknown)} at the peak; the parts are {', '.join(PEAK_PARTS)}")
        object.__setattr__(self, "at_peak", {part: self.at_peak.get(part, 0) for part in PEAK_PARTS})

    @property
    def peak(self) -> int:
        return sum(self.at_peak.values())

    @property
    def label(self) -> str:
        name = {"ddp": "DDP", "zero1": "ZeRO-1", "zero2": "ZeRO-2", "zero3": "ZeRO-3"}[self.stage]
        return name if self.stage != "zero3" or self.reshard_after_forward else f"{name}, no reshard after forward"

    def compare(self, measured: ShardedStep) -> ShardingComparison:
        """This estimate against a measurement: ``estimate.compare(measured).ratios["peak"]``."""
        return ShardingComparison(estimate=self, measured=measured)

    def __repr__(self) -> str:
        kept = " + ".join(f"{_label(c)} {getattr(self, c) / 1e6:.2f}" for c in COMPONENTS)
        return (
            f"ShardedStep({self.label} on {self.world_size} ranks, {self.source}: keeps {kept} MB; "
            f"peak {self.peak / 1e6:.2f} MB; bus bytes {self.sent / 1e6:.2f} MB per step)"
        )

    def _repr_html_(self) -> str:
        rows = [(f"keeps {_label(c)}", getattr(self, c)) for c in COMPONENTS]
        rows += [(f"at the peak: {_label(part)}", count) for part, count in self.at_peak.items()]
        rows += [("peak", self.peak), ("bus bytes per step", self.sent)]
        megabytes = [(name, _mb(count)) for name, count in rows]
        caption = f"{self.label} on {self.world_size} ranks, per rank: {self.source}"
        return Table((), megabytes, caption=caption, numeric=(1,))._repr_html_()


_COMPARED = (*COMPONENTS, "peak", "sent")


@dataclass(frozen=True)
class ShardingComparison:
    """An estimate next to a measurement; ``ratios`` is estimate / measured for each compared quantity."""

    estimate: ShardedStep
    measured: ShardedStep

    @property
    def ratios(self) -> dict[str, float]:
        return {
            name: estimate_over_measured(getattr(self.estimate, name), getattr(self.measured, name))
            for name in _COMPARED
        }

    def __repr__(self) -> str:
        ratios = ", ".join(f"{_label(name)} {ratio:.3f}" for name, ratio in self.ratios.items())
        where = f"{self.estimate.label} on {self.estimate.world_size} ranks, {self.measured.source}"
        return f"ShardingComparison({where}; estimate / measured: {ratios})"

    def _repr_html_(self) -> str:
        sides = (self.estimate, self.measured)
        rows = [
            (_label(name), *(_mb(getattr(side, name)) for side in sides), f"{ratio:.3f}")
            for name, ratio in self.ratios.items()
        ]
        header = ("per rank", "estimate", "measured", "estimate / measured")
        caption = f"{self.estimate.label} on {self.estimate.world_size} ranks: {self.measured.source}"
        return Table(header, rows, caption=caption, numeric=(1, 2, 3))._repr_html_()


def _label(name: str) -> str:
    return {"sent": "bus bytes per step"}.get(name, name.replace("_", " "))


def _mb(count: int) -> str:
    return f"{count / 1e6:.2f} MB"


def estimate_sharded_step(
    config: GPTConfig,
    *,
    batch_size: int,
    seq_len: int,
    world_size: int,
    stage: str,
    reshard_after_forward: bool = True,
    optimizer: str = "adamw",
) -> ShardedStep:
    """Closed-form bytes one of ``world_size`` ranks keeps, holds and sends in a float32 training step of ``GPT(config)``.

    ``batch_size`` is per rank; ``reshard_after_forward`` applies to ZeRO-3 only.

    >>> from perflab.models import GPTConfig
    >>> ddp, zero3 = (estimate_sharded_step(GPTConfig(), batch_size=4, seq_len=128, world_size=8, stage=stage)
    ...               for stage in ("ddp", "zero3"))
    >>> (ddp.parameters + ddp.gradients + ddp.optimizer_state) / (zero3.parameters + zero3.gradients + zero3.optimizer_state)
    8.0
    """
    if stage not in STAGES:
        raise ValueError(f"unknown stage {stage!r}; choose one of {', '.join(STAGES)}")
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    whole = estimate_training_memory(config, batch_size=batch_size, seq_len=seq_len, optimizer=optimizer)
    kept = {c: getattr(whole, c) // world_size if c in _DIVIDED[stage] else getattr(whole, c) for c in COMPONENTS}
    weights, width = whole.parameters, config.n_embd
    block = (12 * width * width + 13 * width) * _FLOAT32  # one transformer block: one FSDP unit
    root = weights - config.n_layer * block  # the embeddings (tied with the head) and the final LayerNorm
    gathered = 0
    if stage == "zero3":
        gathered = root + min(_GATHERED_BLOCKS, config.n_layer) * block if reshard_after_forward else weights
    n = world_size
    sent = {  # payload x bus factor, collective by collective
        "ddp": weights * bus_factor("all-reduce", n),  # all-reduce the gradients
        # DDP's all-reduce, then each updated parameter broadcast from the rank that owns it
        "zero1": weights * bus_factor("all-reduce", n) + weights * bus_factor("broadcast", n),
        # reduce-scatter the gradients, all-gather the updated parameters
        "zero2": weights * (bus_factor("reduce-scatter", n) + bus_factor("all-gather", n)),
        # all-gather in forward, again in backward but for the root, which stays gathered; reduce-scatter
        "zero3": (
            (2 * weights - root if reshard_after_forward else weights) * bus_factor("all-gather", n)
            + weights * bus_factor("reduce-scatter", n)
        ),
    }[stage]
    return ShardedStep(
        stage=stage,
        world_size=world_size,
        reshard_after_forward=reshard_after_forward,
        **kept,
        at_peak={**kept, "gathered": gathered, "activations": whole.activations},
        sent=round(sent),
        source="estimate",
    )


# PyTorch's memory trackers (torch.distributed._tools.mem_tracker.MemTracker and its FSDP2 version,
# FSDPMemTracker) name what each tensor is; here is the part of the peak each name belongs to.
_TRACKER_PARTS = {
    category: part
    for part, categories in {
        "parameters": ("Parameter", "Sharded Param"),
        "gathered": ("Unsharded Param", "All Gather"),  # FSDP2 copies the all-gather's output into the parameters
        "gradients": ("Gradient", "Sharded Grad", "Unsharded Grad"),
        "optimizer_state": ("Optstate", "OptState"),
        "activations": ("Activation",),
        # gradients of activations, DDP's gradient buckets, the reduce-scatter's input, the optimizer's temporaries
        "other": ("Temp", "Reduce Scatter", "Buffer", "Inputs", "Other"),
    }.items()
    for category in categories
}


def peak_parts(snapshot: Mapping[str, int]) -> dict[str, int]:
    """One device's snapshot from a PyTorch memory tracker, bytes by tracker category, as :data:`PEAK_PARTS`.

    >>> peak_parts({"Sharded Param": 100, "Unsharded Param": 40, "All Gather": 10, "Optstate": 200, "Total": 350})
    {'parameters': 100, 'gathered': 50, 'gradients': 0, 'optimizer_state': 200, 'activations': 0, 'other': 0}
    """
    parts = dict.fromkeys(PEAK_PARTS, 0)
    for category, count in snapshot.items():
        name = getattr(category, "value", category)  # the trackers' keys are str enums, and "Total"
        if name == "Total":
            continue
        if name not in _TRACKER_PARTS:
            raise ValueError(f"unknown memory tracker category {name!r}")
        parts[_TRACKER_PARTS[name]] += count
    return parts


# The collective each c10d operator is, and what it is about: an all-gather's output, a
# reduce-scatter's input, the tensor itself otherwise.
_ISSUED = {
    "c10d::allreduce_": "all-reduce",
    "c10d::broadcast_": "broadcast",
    "c10d::_allgather_base_": "all-gather",
    "c10d::_reduce_scatter_base_": "reduce-scatter",
    # DTensor's collectives (torch.distributed._functional_collectives), which issue c10d's inside them
    "_c10d_functional::all_reduce": "all-reduce",
    "_c10d_functional::all_gather_into_tensor": "all-gather",
    "_c10d_functional::reduce_scatter_tensor": "reduce-scatter",
}
_FUNCTIONAL = "_c10d_functional::"
_RUN_BY_GLOO = {"gloo:all_reduce": "all-reduce", "gloo:broadcast": "broadcast", "gloo:all_gather": "all-gather"}


def bus_factor(kind: str, world_size: int) -> float:
    """Bus bytes per payload byte of one collective on ``world_size`` ranks (nccl-tests' PERFORMANCE.md).

    >>> [bus_factor(kind, 4) for kind in ("all-reduce", "reduce-scatter", "all-gather", "broadcast")]
    [1.5, 0.75, 0.75, 1]
    """
    if world_size == 1:
        return 0  # nothing leaves a world of one
    if kind == "broadcast":
        return 1  # the root sends the whole payload, however many ranks receive it
    ring = (world_size - 1) / world_size  # each rank sends all pieces but its own
    return {"all-reduce": 2 * ring, "reduce-scatter": ring, "all-gather": ring}[kind]


@dataclass(frozen=True)
class Collective:
    """The calls of one kind of collective in a profiled window, and what gloo ran for them."""

    kind: str  # "all-reduce", "broadcast", "all-gather" or "reduce-scatter"
    count: int
    payload: int  # bytes of the whole tensors the calls are about
    seconds: float  # time gloo's threads spent running them, waiting for the other ranks included
    ran_as: str  # gloo's own operation: it runs a reduce-scatter as an all-reduce of the whole input

    def sent(self, world_size: int) -> int:
        """The calls' bus bytes: payload x :func:`bus_factor`; what each rank sends with a bandwidth-optimal algorithm,
        but for a broadcast, where the root sends it and the other ranks less."""
        return round(self.payload * bus_factor(self.kind, world_size))

    def total_sent(self, world_size: int) -> int:
        """Bytes all ranks send together for these calls with bandwidth-optimal algorithms: every rank receives
        (N-1)/N of the payload (all of it in a broadcast, but the root), twice in an all-reduce."""
        receivers = world_size - 1
        return round(self.payload * receivers * (2 if self.kind == "all-reduce" else 1))


@dataclass(frozen=True)
class StepCollectives:
    """The collectives of one annotated window of a profiled rank, and how long the window took."""

    seconds: float
    collectives: tuple[Collective, ...]

    def sent(self, world_size: int) -> int:
        """The window's bus bytes (:meth:`Collective.sent`)."""
        return sum(collective.sent(world_size) for collective in self.collectives)

    def total_sent(self, world_size: int) -> int:
        """What all ranks send together in the window with bandwidth-optimal algorithms (:meth:`Collective.total_sent`)."""
        return sum(collective.total_sent(world_size) for collective in self.collectives)


def profile_collectives(profile: torch.profiler.profile, window: str) -> StepCollectives:
    """The collectives inside the ``record_function(window)`` region of a finished profile of one gloo rank.

    Profile with ``record_shapes=True``: c10d records the shapes of an all-gather's output and a
    reduce-scatter's input, gloo those of every tensor it sends. gloo runs a reduce-scatter as an
    all-reduce of the whole input, which its size tells apart from an all-reduce issued as such.
    End the profile with a ``dist.barrier()``: gloo closes a collective's record just after it has
    handed back the result, and a record still open when the profiler stops is lost.
    """
    events = sorted(profile.events(), key=lambda event: event.time_range.start)
    windows = [event for event in events if event.name == window]
    if len(windows) != 1:
        raise ValueError(f"expected one region named {window!r} in the profile, found {len(windows)}")
    start, end = windows[0].time_range.start, windows[0].time_range.end
    inside = [event for event in events if start <= event.time_range.start <= end]
    return StepCollectives(seconds=(end - start) / 1e6, collectives=_collectives(inside, _input_dtypes(profile)))


def _input_dtypes(profile: torch.profiler.profile) -> Callable[[FunctionEvent], list[str]]:
    """How to read an event's input dtypes: ``FunctionEvent.input_dtypes`` (torch >= 2.12), or the Kineto event's."""
    if torch_features.has("profiler_input_dtypes"):
        return lambda event: event.input_dtypes
    # Older torch records the same dtypes but drops them when it builds FunctionEvents, whose ids are the
    # correlation ids of the Kineto events they are built from.
    recorded = {event.correlation_id(): event.dtypes() for event in profile.profiler.kineto_results.events()}
    return lambda event: recorded[event.id]


class SentBytes:
    """Bytes sent while a ``with`` block runs, as Linux counts them (``None`` elsewhere), in two places.

    ``process``: what this process, every thread of it, passed to ``write`` and ``writev`` calls
    (``wchar`` in ``/proc/self/io``; ``send`` and ``sendmsg`` are not counted): gloo's sends over its
    TCP sockets, and whatever else the process writes in the block, so keep files and prints out of
    it. ``loopback``: what left through the loopback interface (``lo`` in ``/proc/net/dev``), packet
    headers included, from every process of this network namespace: all the ranks of a one-machine
    job together, and anything that runs beside them.

    >>> import os
    >>> sink = os.open(os.devnull, os.O_WRONLY)
    >>> with SentBytes() as sent:
    ...     _ = os.write(sink, b"x" * 1000)
    >>> os.close(sink)
    >>> sent.process is None or sent.process >= 1000
    True
    """

    def __init__(self) -> None:
        self.process: int | None = None
        self.loopback: int | None = None

    def __enter__(self) -> SentBytes:
        self._start = (_written(), _loopback_sent())
        return self

    def __exit__(self, *exc_info) -> None:
        ends = (_written(), _loopback_sent())
        self.process, self.loopback = (
            None if start is None or end is None else end - start for start, end in zip(self._start, ends)
        )

    def __repr__(self) -> str:
        return f"SentBytes(process={self.process}, loopback={self.loopback})"


def _written() -> int | None:
    try:
        with open("/proc/self/io") as counters:
            return next(int(line.split(":")[1]) for line in counters if line.startswith("wchar:"))
    except (OSError, StopIteration):
        return None


def _loopback_sent() -> int | None:
    try:
        with open("/proc/net/dev") as counters:
            for line in counters:
                name, _, fields = line.partition(":")
                if name.strip() == "lo":
                    return int(fields.split()[8])  # receive: 8 fields, then transmit: bytes first
    except OSError:
        pass
    return None


def _bytes(shape: list[int], dtype: str) -> int:
    # The profiler names dtypes as C++ does: torch.float32 is "float", torch.bfloat16 "c10::BFloat16".
    itemsize = {"float": 4, "double": 8, "c10::Half": 2, "c10::BFloat16": 2}
    if dtype not in itemsize:
        raise ValueError(f"a collective on {dtype!r} tensors: only floating-point ones are counted")
    return torch.Size(shape).numel() * itemsize[dtype]


def _collectives(events: list, dtypes: Callable[[FunctionEvent], list[str]]) -> tuple[Collective, ...]:
    """What c10d issued, paired with what gloo ran for it; ``events`` in time order, ``dtypes`` their input dtypes."""
    issued, payload, scatters = Counter(), Counter(), Counter()
    outer_end = -1.0
    for event in events:
        kind = _ISSUED.get(event.name)
        if kind is None or event.time_range.start <= outer_end:
            continue  # an operator dispatched through a Python mode (a memory tracker's) is recorded again inside
        outer_end = event.time_range.end
        issued[kind] += 1
        functional = event.name.startswith(_FUNCTIONAL)
        if kind == "all-gather":  # c10d's shapes: output, input; a functional one's: input, group size
            size = _bytes(event.input_shapes[0], dtypes(event)[0])
            payload[kind] += size * event.concrete_inputs[1] if functional else size
        elif kind == "reduce-scatter":  # c10d's: output, input; a functional one's: input
            which = 0 if functional else 1
            size = _bytes(event.input_shapes[which], dtypes(event)[which])
            payload[kind] += size
            scatters[size] += 1
    ran, seconds, ran_as = Counter(), Counter(), {}
    for event in events:
        kind = _RUN_BY_GLOO.get(event.name)
        if kind is None:
            continue
        size = _bytes(event.input_shapes[0], dtypes(event)[0])
        if kind == "all-reduce" and scatters[size] > 0:
            scatters[size] -= 1
            kind = "reduce-scatter"
        elif kind in ("all-reduce", "broadcast"):  # c10d records no shapes for these: gloo's are the same tensors
            payload[kind] += size
        ran[kind] += 1
        seconds[kind] += (event.time_range.end - event.time_range.start) / 1e6
        ran_as[kind] = event.name
    if ran != issued:
        raise RuntimeError(
            f"c10d issued {dict(issued)} but gloo ran {dict(ran)}: is the backend gloo, "
            "and did the ranks pass a dist.barrier() before the profile ended?"
        )
    return tuple(Collective(kind, issued[kind], payload[kind], seconds[kind], ran_as[kind]) for kind in sorted(issued))
