"""What each variant of a training step costs in memory and in time, measured side by side.

    >>> from perflab.tradeoff import measure_tradeoff
    >>> def checkpointing(k):                  # a variant: a function that runs the forward pass, returns the loss
    ...     return lambda: forward_checkpointing(model, idx, targets, checkpointed=k)
    >>> tradeoff = measure_tradeoff({f"{k} of 6": checkpointing(k) for k in range(7)},
    ...                             parameters=model.parameters(), device=device)
    >>> tradeoff
    Tradeoff(7 variants; forward + backward on cpu, median of 5 interleaved rounds; time relative to '0 of 6')
    variant  peak memory  kept for backward  median step  time relative
    0 of 6   25.10 MB     24.80 MB           61.2 ms      1.00x
    ...
    >>> tradeoff_curve(tradeoff, caption=...)  # perflab.plots: the compute-memory trade-off curve

A variant's memory is measured once, since it is deterministic: the peak of its forward and
backward passes, gradients included (``perflab.memory.peak_memory``), and the activations its
forward pass keeps for backward (``perflab.memory.saved_tensors``, without the weights, which exist
anyway). Its time is taken over interleaved rounds, each running every variant once in an order
that reverses every round, so that a machine that slows down or speeds up in between affects all
variants alike; ``relative_time`` is the median of the per-round ratios to the first variant.
"""

from __future__ import annotations

import html
import statistics
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import torch

from perflab.bench import format_seconds, time_call
from perflab.device import pick_device
from perflab.memory import peak_memory, saved_tensors
from perflab.tables import text_table

_HEADER = ("variant", "peak memory", "kept for backward", "median step", "time relative")


@dataclass(frozen=True)
class VariantCost:
    """One variant's memory (bytes) and its forward-and-backward times (seconds, one per round)."""

    label: str
    peak_bytes: int
    saved_bytes: int
    times: tuple[float, ...]

    @property
    def median(self) -> float:
        return statistics.median(self.times)


@dataclass(frozen=True)
class Tradeoff:
    """Variants of one step measured together; the first is the baseline of ``relative_time``."""

    variants: tuple[VariantCost, ...]
    device: str

    def __getitem__(self, label: str) -> VariantCost:
        for variant in self.variants:
            if variant.label == label:
                return variant
        raise KeyError(f"no variant {label!r}; there are {[v.label for v in self.variants]}")

    def relative_time(self, label: str) -> float:
        """Median over rounds of this variant's time / the baseline's time in the same round."""
        baseline, variant = self.variants[0], self[label]
        return statistics.median(t / b for t, b in zip(variant.times, baseline.times))

    @property
    def caption(self) -> str:
        return f"forward + backward on {self.device}, median of {len(self.variants[0].times)} interleaved rounds"

    def _rows(self) -> list[tuple[str, ...]]:
        return [
            (
                v.label,
                f"{v.peak_bytes / 1e6:.2f} MB",
                f"{v.saved_bytes / 1e6:.2f} MB",
                format_seconds(v.median),
                f"{self.relative_time(v.label):.2f}x",
            )
            for v in self.variants
        ]

    def __repr__(self) -> str:
        return (
            f"Tradeoff({len(self.variants)} variants; {self.caption}; time relative to '{self.variants[0].label}')\n"
            + text_table(_HEADER, self._rows())
        )

    def _repr_html_(self) -> str:
        head = "".join(f"<th>{name}</th>" for name in _HEADER)
        body = "".join(
            "<tr>" + "".join(f"<td>{html.escape(cell)}</td>" for cell in row) + "</tr>" for row in self._rows()
        )
        return f"<table><caption>{html.escape(self.caption)}</caption><tr>{head}</tr>{body}</table>"


def measure_tradeoff(
    variants: Mapping[str, Callable[[], torch.Tensor]],
    *,
    parameters: Iterable[torch.Tensor],
    rounds: int = 5,
    device: str | torch.device | None = None,
) -> Tradeoff:
    """Measure each ``forward()`` (which returns a scalar loss) followed by ``loss.backward()``.

    ``parameters`` are the tensors whose gradients the backward pass fills: they are reset to None
    before every run, so that each run allocates its gradients afresh and the peak counts them.
    """
    if not variants:
        raise ValueError("measure_tradeoff needs at least one variant")
    if not isinstance(rounds, int) or rounds < 1:
        raise ValueError(f"rounds must be a positive int, got {rounds!r}")
    device = pick_device(device)
    parameters = list(parameters)
    weights = {p.untyped_storage().data_ptr() for p in parameters}

    def run(forward: Callable[[], torch.Tensor]) -> None:
        for parameter in parameters:
            parameter.grad = None
        forward().backward()

    memory = {}
    for label, forward in variants.items():
        # Measured first, these runs are also the warm-up: first-call costs stay out of the timed rounds.
        with peak_memory() as peak:
            run(forward)
        with saved_tensors() as saved:
            loss = forward()  # kept alive to the end of the block, so that what it saved is counted
        del loss
        activations = sum(nbytes for address, nbytes in saved.storages.items() if address not in weights)
        memory[label] = (peak.bytes, activations)

    labels = list(variants)
    times: dict[str, list[float]] = {label: [] for label in labels}
    for round_index in range(rounds):
        for label in labels if round_index % 2 == 0 else reversed(labels):
            times[label].append(time_call(lambda: run(variants[label]), device))  # noqa: B023 (called at once)
    for parameter in parameters:
        parameter.grad = None
    return Tradeoff(tuple(VariantCost(label, *memory[label], tuple(times[label])) for label in labels), str(device))
