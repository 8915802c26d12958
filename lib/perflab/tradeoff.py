"""What each variant of a training step costs in memory and in time, measured side by side.

    >>> import torch
    >>> from torch.utils.checkpoint import checkpoint
    >>> from perflab.plots import tradeoff_curve
    >>> from perflab.tradeoff import measure_tradeoff
    >>> mlp = lambda: torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64))
    >>> blocks, x = torch.nn.ModuleList(mlp() for _ in range(4)), torch.randn(512, 64)
    >>> def forward(checkpointed):             # a variant: runs the forward pass, returns the loss
    ...     h = x
    ...     for index, block in enumerate(blocks):
    ...         h = checkpoint(block, h, use_reentrant=False) if index < checkpointed else block(h)
    ...     return h.square().mean()
    >>> tradeoff = measure_tradeoff({f"{k} of 4": lambda k=k: forward(k) for k in range(5)},
    ...                             parameters=blocks.parameters(), rounds=3)
    >>> [f"{variant.saved_bytes / 1e6:.2f} MB" for variant in tradeoff.variants]   # kept for backward
    ['4.85 MB', '3.80 MB', '2.75 MB', '1.70 MB', '0.66 MB']
    >>> [f"{variant.peak_bytes / 1e6:.2f} MB" for variant in tradeoff.variants]    # peak of forward + backward
    ['5.31 MB', '4.26 MB', '3.21 MB', '2.17 MB', '2.17 MB']
    >>> print(f"all 4 blocks recomputed: {tradeoff.relative_time('4 of 4'):.2f}x the time of none")
    all 4 blocks recomputed: ...x the time of none
    >>> tradeoff_curve(tradeoff, caption="4 MLP blocks, batch 512")   # perflab.plots: the trade-off curve
    <Figure size ... with 1 Axes>

A variant's memory is measured once, since it is deterministic: the peak of its forward and
backward passes, gradients included (``perflab.memory.peak_memory``), and the activations its
forward pass keeps for backward (``perflab.memory.saved_tensors``, without the weights, which exist
anyway; ``kept="held"`` counts instead what the forward pass leaves held, which also sees what
bypasses saved-tensor hooks). Its time is taken over interleaved rounds, each running every variant
once in an order that reverses every round, so that a machine that slows down or speeds up in
between affects all variants alike; ``relative_time`` is the median of the per-round ratios to the
first variant.

Used in: lecture 05 (memory checkpointing), lecture 11 (tensor pipeline parallel).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Iterable, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass

import torch

from perflab.bench import format_seconds, interleaved_rounds, median_ratio, time_call
from perflab.device import pick_device
from perflab.memory import PeakMemory, peak_memory, saved_tensors
from perflab.render import Table

__all__ = ["Tradeoff", "VariantCost", "measure_tradeoff"]


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
    kept: str = "saved"  # how "kept for backward" was counted: see measure_tradeoff

    def __getitem__(self, label: str) -> VariantCost:
        for variant in self.variants:
            if variant.label == label:
                return variant
        raise KeyError(f"no variant {label!r}; there are {[v.label for v in self.variants]}")

    def relative_time(self, label: str) -> float:
        """Median over rounds of this variant's time / the baseline's time in the same round."""
        baseline, variant = self.variants[0], self[label]
        return median_ratio(variant.times, baseline.times)

    @property
    def caption(self) -> str:
        text = f"forward + backward on {self.device}, median of {len(self.variants[0].times)} interleaved rounds"
        return text + ("; kept for backward: what the forward pass left held" if self.kept == "held" else "")

    def _table(self) -> Table:
        rows = [
            (
                v.label,
                f"{v.peak_bytes / 1e6:.2f} MB",
                f"{v.saved_bytes / 1e6:.2f} MB",
                format_seconds(v.median),
                f"{self.relative_time(v.label):.2f}x",
            )
            for v in self.variants
        ]
        header = ("variant", "peak memory", "kept for backward", "median step", "time relative")
        caption = f"{len(self.variants)} variants; {self.caption}; time relative to '{self.variants[0].label}'"
        return Table(header, rows, caption=caption, numeric=(1, 2, 3, 4))

    def __repr__(self) -> str:
        return str(self._table())

    def _repr_html_(self) -> str:
        return self._table()._repr_html_()


def measure_tradeoff(
    variants: Mapping[str, Callable[[], torch.Tensor]],
    *,
    parameters: Iterable[torch.Tensor],
    rounds: int = 5,
    device: str | torch.device | None = None,
    meter: Callable[[torch.device], AbstractContextManager[PeakMemory]] | None = None,
    kept: str = "saved",
) -> Tradeoff:
    """Measure each ``forward()`` (which returns a scalar loss) followed by ``loss.backward()``.

    ``parameters`` are the tensors whose gradients the backward pass fills: they are reset to None
    before every run, so that each run allocates its gradients afresh and the peak counts them.
    ``meter(device)`` measures the peak: ``perflab.memory.peak_memory()`` by default; pass
    ``perflab.memory.allocator_peak`` for variants compiled with ``torch.compile``, whose buffers
    only the allocator sees.

    ``kept`` says how the activations kept for backward are counted. ``"saved"``: every tensor
    autograd's saved-tensor hooks see, each storage once, the weights left out
    (``perflab.memory.saved_tensors``). ``"held"``: what the tensors made by the forward pass still
    hold when it returns, as ``meter`` sees it (its ``held_bytes``; the loss is in it, inputs made
    before are not). It also counts what is kept outside autograd's saved tensors, such as the
    outputs selective activation checkpointing keeps where ``checkpoint`` has no
    ``respect_saved_tensors_hooks`` (``perflab.torch_features``).
    """
    if kept not in ("saved", "held"):
        raise ValueError(f'kept must be "saved" or "held", got {kept!r}')
    if not variants:
        raise ValueError("measure_tradeoff needs at least one variant")
    if not isinstance(rounds, int) or rounds < 1:
        raise ValueError(f"rounds must be a positive int, got {rounds!r}")
    device = pick_device(device)
    parameters = list(parameters)
    weights = {p.untyped_storage().data_ptr() for p in parameters}

    def release_gradients() -> None:
        for parameter in parameters:
            parameter.grad = None

    def run(forward: Callable[[], torch.Tensor]) -> None:
        release_gradients()
        forward().backward()

    memory = {}
    for label, forward in variants.items():
        # Measured first, these runs are also the warm-up: first-call costs stay out of the timed rounds.
        release_gradients()  # before the meter starts: the gradients freed are not the variant's
        with peak_memory() if meter is None else meter(device) as peak:
            forward().backward()
        if kept == "saved":
            with saved_tensors() as saved:
                loss = forward()  # kept alive to the end of the block, so that what it saved is counted
            del loss
            activations = sum(nbytes for address, nbytes in saved.storages.items() if address not in weights)
        else:
            with peak_memory() if meter is None else meter(device) as forward_pass:
                loss = forward()  # kept alive to the end of the block, so that what its graph holds is counted
            del loss
            activations = forward_pass.held_bytes
        memory[label] = (peak.bytes, activations)

    labels = list(variants)
    times = interleaved_rounds(
        [lambda _, forward=forward: time_call(lambda: run(forward), device) for forward in variants.values()],
        rounds,
        warmup=False,  # the memory runs above were the warm-up
    )
    for parameter in parameters:
        parameter.grad = None
    return Tradeoff(
        tuple(VariantCost(label, *memory[label], tuple(side)) for label, side in zip(labels, times)), str(device), kept
    )
