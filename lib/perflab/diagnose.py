"""Data-bound, compute-bound, memory-bound or overhead-bound? Decided from a profile's measurements.

    >>> from perflab.diagnose import diagnose
    >>> from perflab.profiling import profile_training
    >>> from perflab.train import NAIVE, Workload
    >>> tiny = Workload(num_classes=3, train_per_class=20, val_per_class=4, image_size=32, epochs=1)
    >>> diagnosis = diagnose(profile_training(NAIVE, tiny, steps=2))
    >>> diagnosis                  # the kind and the shares depend on the machine: see perflab.planted
    Diagnosis(...-bound: data ...%, compute ...%, memory ...%, overhead ...% of the steps' time)
    >>> list(diagnosis.shares), round(sum(diagnosis.shares.values()), 6)
    (['data', 'compute', 'memory', 'overhead'], 1.0)
    >>> diagnosis.operators[0]     # the largest operator: its name, its class, its share of the steps' time
    ('aten::...', '...', 0...)

The steps' time (the profiled phases: data_wait, h2d, fwd, bwd, opt, log) is split four ways:

- **data**: the ``data_wait`` and ``h2d`` phases, where the step waits for its input;
- **compute**: operators that do dense arithmetic: convolutions, matrix multiplies, attention kernels;
- **memory**: every other operator (elementwise, normalization, softmax, copies, the optimizer's
  updates), which moves more bytes than it computes on;
- **overhead**: the rest, where no operator ran: Python, dispatch, kernel launches, syncs and
  logging. On a GPU the operators' time is the device's, so this is the time the device sat idle.

The largest share names the bottleneck. Any loop can be diagnosed if it wraps its phases in
``torch.profiler.record_function`` regions with those names, as ``perflab.train`` does. The
operator classes go by name, which is a heuristic: a matmul on tiny matrices is memory- or
overhead-bound in truth. So the diagnosis lists the operators behind each share: judge them too.
``perflab.planted`` holds one short run of each kind, to see (and test) the diagnosis on.

Used in: lecture 02 (profiling), lab 02, lab 12.
"""

from __future__ import annotations

import bisect
import re
import statistics
from collections import defaultdict
from dataclasses import dataclass

from torch.autograd import DeviceType
from torch.profiler import profile

from perflab.profiling import ProfiledRun
from perflab.render import Table
from perflab.train_result import PHASES

__all__ = ["Diagnosis", "KINDS", "diagnose"]

KINDS = {"data": "data-bound", "compute": "compute-bound", "memory": "memory-bound", "overhead": "overhead-bound"}
_ADVICE = {
    "data-bound": "feed it faster: decode once, augment whole batches as tensors, DataLoader workers, "
    "pin_memory with non_blocking copies (chapter 03)",
    "compute-bound": "make the arithmetic cheaper: bf16 or fp16 autocast on tensor cores, TF32 (chapter 04), "
    "channels_last (chapter 06); or do less of it",
    "memory-bound": "move fewer bytes: fuse elementwise operators with torch.compile, a fused or compiled "
    "optimizer step (chapter 06), SDPA instead of materialising the attention scores (chapter 08)",
    "overhead-bound": "do more per call: a larger batch, fewer syncs (.item(), print), torch.compile, "
    "CUDA graphs (mode='reduce-overhead') on a GPU (chapters 01 and 06)",
}
_COMPUTE_OPERATOR = re.compile(r"conv|matmul|linear|attention|^(_int_|add|b|baddb)?mm$|^(addmv|mv|dot)$")
_WORK_PHASES = ("fwd", "bwd", "opt")


@dataclass(frozen=True)
class Diagnosis:
    """Where the steps' time went, and what that makes the run."""

    kind: str
    shares: dict[str, float]  # data, compute, memory, overhead: fractions of the steps' time
    operators: tuple[tuple[str, str, float], ...]  # (operator, class, share), largest first

    @property
    def advice(self) -> str:
        return _ADVICE[self.kind]

    def __repr__(self) -> str:
        shares = ", ".join(f"{name} {share:.0%}" for name, share in self.shares.items())
        return f"Diagnosis({self.kind}: {shares} of the steps' time)"

    def _repr_html_(self) -> str:
        shares = Table(
            list(self.shares),
            [[f"{share:.0%}" for share in self.shares.values()]],
            caption=f"{self.kind}: {self.advice}",
            numeric=range(len(self.shares)),
        )
        operators = Table(
            ("operator", "class", "share"),
            [(name, kind, f"{share:.1%}") for name, kind, share in self.operators],
            caption="largest operators",
            numeric=(2,),
        )
        return shares._repr_html_() + operators._repr_html_()


def diagnose(run: ProfiledRun | profile, top: int = 6) -> Diagnosis:
    """Classify a profiled run by the largest of its data, compute, memory and overhead shares.

    Each share is its kind's median seconds per step, over the sum of the four medians: from three steps on, one step
    stalled by something outside the run (the OS pausing the process while it was in one operator) counts no more
    than any other step.
    """
    events = (run.profiler if isinstance(run, ProfiledRun) else run).events()
    phases = sorted(
        (e.time_range.start, e.time_range.end, e.name)
        for e in events
        if e.name in PHASES and e.device_type == DeviceType.CPU
    )
    if not phases:
        raise ValueError(
            "no phase regions in this profile: wrap each phase of the step in "
            f"torch.profiler.record_function(name), name one of {', '.join(PHASES)}"
        )
    on_device = any(e.device_type == DeviceType.CUDA for e in events)
    starts = [start for start, _, _ in phases]
    step_of = _steps(phases)
    seconds = [defaultdict(float) for _ in range(step_of[-1] + 1)]  # per step: data, phases, compute, memory
    for (start, end, name), step in zip(phases, step_of):
        seconds[step]["data" if name in ("data_wait", "h2d") else "phases"] += (end - start) / 1e6
    by_operator: dict[str, float] = defaultdict(float)
    for event in events:
        if not event.name.startswith("aten::") or event.device_type != DeviceType.CPU:
            continue
        index = bisect.bisect_right(starts, event.time_range.start) - 1
        if index < 0 or event.time_range.start > phases[index][1] or phases[index][2] not in _WORK_PHASES:
            continue  # outside fwd / bwd / opt: the input pipeline's tensor ops count as data
        self_us = event.self_device_time_total if on_device else event.self_cpu_time_total
        by_operator[event.name] += self_us / 1e6
        seconds[step_of[index]][_operator_class(event.name)] += self_us / 1e6
    worked = {step for (_, _, name), step in zip(phases, step_of) if name in _WORK_PHASES}
    steps = [_split(step) for index, step in enumerate(seconds) if index in worked or not worked]
    medians = {
        kind: statistics.median(step[kind] for step in steps) for kind in ("data", "compute", "memory", "overhead")
    }
    shares = {kind: spent / (sum(medians.values()) or 1.0) for kind, spent in medians.items()}
    by_class: dict[str, float] = defaultdict(float)
    for name, spent in by_operator.items():
        by_class[_operator_class(name)] += spent
    # Each class's share, split among its operators by their time in every step.
    operators = [
        (name, kind, shares[kind] * spent / by_class[kind] if by_class[kind] else 0.0)
        for name, spent in by_operator.items()
        for kind in [_operator_class(name)]
    ]
    return Diagnosis(
        kind=KINDS[max(shares, key=shares.get)],
        shares=shares,
        operators=tuple(sorted(operators, key=lambda operator: operator[2], reverse=True)[:top]),
    )


def _operator_class(name: str) -> str:
    return "compute" if _COMPUTE_OPERATOR.search(name.removeprefix("aten::")) else "memory"


def _steps(phases: list[tuple[int, int, str]]) -> list[int]:
    """The step of each phase, in order: a step starts at a phase that comes no later in PHASES than the one before,
    once the step so far has updated the weights where the run has an ``opt`` phase at all (so that the micro-batches
    of gradient accumulation belong to the step they end in)."""
    has_opt = any(name == "opt" for _, _, name in phases)
    steps, step, previous, updated = [], 0, len(PHASES), False
    for _, _, name in phases:
        if steps and PHASES.index(name) <= previous and (updated or not has_opt):
            step, updated = step + 1, False
        previous, updated = PHASES.index(name), updated or name == "opt"
        steps.append(step)
    return steps


def _split(step: dict[str, float]) -> dict[str, float]:
    """One step's seconds as data, compute, memory and overhead: the phases' time where no operator ran."""
    total = max(step["data"] + step["phases"], step["data"] + step["compute"] + step["memory"])
    split = {"data": step["data"], "compute": step["compute"], "memory": step["memory"]}
    return {**split, "overhead": total - sum(split.values())}
