"""Choosing a layout: every way to split a model over a number of GPUs, what each GPU would hold and send, what fits.

    >>> from perflab.models import GPTConfig
    >>> from perflab.parallel_layout import layouts_for
    >>> seven_b = GPTConfig(vocab_size=32000, block_size=4096, n_layer=32, n_head=32, n_embd=4096)
    >>> table = layouts_for(seven_b, gpus=8, memory_per_gpu=80e9, global_batch=8, seq_len=4096)  # bfloat16
    >>> len(table.estimates), len(table.fitting)
    (28, 25)
    >>> [e.layout.label for e in table.fitting if e.layout.tp == e.layout.pp == 1]   # data parallel only
    ['DP 8 (ZeRO-2)', 'DP 8 (ZeRO-3)']

Each layout is estimated by :func:`perflab.parallel_step.estimate_layout`: per GPU, the model state,
the activations of one micro-batch of one sequence (of ``pp`` of them on a pipeline's first stage),
the peak as their sum, and the bus bytes of a step by group. Tensor parallelism stays within a node
(``gpus_per_node``), with sequence parallelism; every ZeRO stage is tried when there is data
parallelism. Which of the layouts that fit to choose is a trade the table lays out: bus bytes per
step, on links of different speeds (tensor parallelism's inside a node, over NVLink), against the
pipeline's bubble, (pp - 1) / (m + pp - 1).

Used in: lecture 11 (tensor pipeline parallel).
"""

from __future__ import annotations

from dataclasses import dataclass

from perflab.models.gpt import GPTConfig
from perflab.parallel_step import GROUPS, Layout, LayoutEstimate, estimate_layout
from perflab.render import Table

__all__ = ["LayoutTable", "layouts_for"]

_FLOAT32 = 4


@dataclass(frozen=True)
class LayoutTable:
    """Every layout of a model on ``gpus`` GPUs of ``memory_per_gpu`` bytes, the least bus bytes per GPU first."""

    estimates: tuple[LayoutEstimate, ...]
    memory_per_gpu: float
    description: str

    @property
    def fitting(self) -> tuple[LayoutEstimate, ...]:
        return tuple(e for e in self.estimates if e.fits(self.memory_per_gpu))

    def _rows(self) -> list[tuple]:
        return [
            (
                e.layout.label,
                f"{(e.parameters + e.gradients + e.optimizer_state) / 1e9:.1f}",
                f"{e.activations / 1e9:.1f}",
                f"{e.peak / 1e9:.1f}",
                "yes" if e.fits(self.memory_per_gpu) else "no",
                *(f"{e.sent(g) / 1e9:.2f}" for g in GROUPS),
                f"{e.bubble:.0%}",
            )
            for e in self.estimates
        ]

    def _table(self) -> Table:
        header = (
            "layout",
            "model state (GB)",
            "activations (GB)",
            "peak (GB)",
            "fits",
            "bus bytes per step: tp (GB)",
            "dp (GB)",
            "pp (GB)",
            "bubble",
        )
        return Table(header, self._rows(), caption=self.description, numeric=range(1, 9))

    def __repr__(self) -> str:
        return str(self._table())

    def _repr_html_(self) -> str:
        return self._table()._repr_html_()


def layouts_for(
    config: GPTConfig,
    *,
    gpus: int,
    memory_per_gpu: float,
    global_batch: int,
    seq_len: int,
    precision: str = "bfloat16",
    checkpointing: bool = False,
    gpus_per_node: int = 8,
) -> LayoutTable:
    """Every dp x tp x pp layout of ``gpus`` GPUs (tp within a node of ``gpus_per_node``, with SP; every ZeRO stage
    when dp > 1), for ``global_batch`` sequences per step in micro-batches of one sequence; least bus bytes first."""
    estimates = []
    for tp in (t for t in range(1, min(gpus, gpus_per_node) + 1) if gpus % t == 0 and config.n_head % t == 0):
        for pp in (p for p in range(1, gpus // tp + 1) if (gpus // tp) % p == 0 and config.n_layer % p == 0):
            dp = gpus // (tp * pp)
            if global_batch % dp or config.vocab_size % tp or seq_len % tp:
                continue
            for zero in (0, 1, 2, 3) if dp > 1 else (0,):
                layout = Layout(dp=dp, tp=tp, pp=pp, zero=zero, sequence_parallel=tp > 1)
                estimates.append(
                    estimate_layout(
                        config,
                        layout,
                        batch_size=1,
                        seq_len=seq_len,
                        microbatches=global_batch // dp,
                        precision=precision,
                        checkpointing=checkpointing,
                    )
                )
    estimates.sort(key=lambda e: (e.sent(), e.peak))
    parameters = estimate_layout(config, Layout(), batch_size=1, seq_len=seq_len).parameters // _FLOAT32
    description = (
        f"{parameters / 1e9:.2f} billion parameters, {global_batch} x {seq_len} tokens per step, "
        f"{precision}{', checkpointing' if checkpointing else ''}; {gpus} GPUs of "
        f"{memory_per_gpu / 1e9:g} GB; estimate per GPU"
    )
    return LayoutTable(tuple(estimates), memory_per_gpu, description)
