"""Choosing a layout: every way to split a model over nodes of GPUs, what each GPU would hold, which layouts fit
with room to spare, and how long a step of each would take; the fastest first.

    >>> from perflab.models import GPTConfig
    >>> from perflab.parallel_layout import layouts_for
    >>> from perflab.step_time import DGX_H100
    >>> seven_b = GPTConfig(vocab_size=32000, block_size=4096, n_layer=32, n_head=32, n_embd=4096)
    >>> table = layouts_for(seven_b, gpus=8, cluster=DGX_H100, global_batch=1024, seq_len=4096)  # bfloat16
    >>> len(table.steps), len(table.fitting)
    (28, 25)
    >>> [(step.layout.label, round(step.step_s, 2)) for step in table.fitting[:3]]   # seconds: within a percent
    [('DP 4 (ZeRO-1) x PP 2', 24.47), ('DP 8 (ZeRO-2)', 24.52), ('DP 2 x PP 4', 24.54)]

Each layout is estimated by :func:`perflab.step_time.estimate_step_time`, per GPU: its memory by
:func:`perflab.parallel_step.estimate_layout` (the model state, the activations of one micro-batch of one
sequence, or of ``pp`` of them on a pipeline's first stage, the peak as their sum) and its step's time. Tensor
parallelism stays within a node, with sequence parallelism; every ZeRO stage is tried when there is data
parallelism, and HSDP too (ZeRO-3 within a node, replicated across nodes) where the data-parallel ranks span
nodes. A layout fits when its estimated peak leaves :data:`MEMORY_HEADROOM` of the GPU's memory free.

Used in: lecture 11 (tensor pipeline parallel).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from perflab.models.gpt import GPTConfig
from perflab.parallel_step import Layout, estimate_layout
from perflab.render import Table
from perflab.step_time import Cluster, StepTime, estimate_step_time

__all__ = ["MEMORY_HEADROOM", "LayoutTable", "layouts_for"]

# The share of a GPU's memory a layout must leave free. The estimate counts the tensors a step keeps; a real step
# also holds what it does not count: the CUDA context and the libraries' workspaces (cuBLAS, nccl's buffers), the
# caching allocator's free blocks that are too small to reuse (fragmentation, lecture 05), the temporaries between
# kept tensors (a matmul's output before its input is freed; under recomputation, the block being recomputed).
MEMORY_HEADROOM = 0.10
_FLOAT32 = 4
_GROUP_COLUMNS = (("tp", "tp"), ("dp", "dp"), ("replicate", "HSDP replicas"), ("pp", "pp sends"))


@dataclass(frozen=True)
class LayoutTable:
    """Every layout of a model on ``gpus`` GPUs of a cluster, the least estimated step time first."""

    steps: tuple[StepTime, ...]
    cluster: Cluster
    description: str

    @property
    def usable_memory(self) -> float:
        return (1 - MEMORY_HEADROOM) * self.cluster.memory_per_gpu

    @property
    def fitting(self) -> tuple[StepTime, ...]:
        """The layouts that fit with :data:`MEMORY_HEADROOM` to spare, the least estimated step time first."""
        return tuple(s for s in self.steps if s.estimate.fits(self.usable_memory))

    def _row(self, step: StepTime) -> tuple[str, ...]:
        times = {g.group: f"{g.seconds:.2f} {g.link.name}" for g in step.groups}
        return (
            step.layout.label,
            f"{step.estimate.peak / 1e9:.1f}",
            "yes" if step.estimate.fits(self.usable_memory) else "no",
            f"{step.compute_s:.2f}",
            *(times.get(group, "") for group, _ in _GROUP_COLUMNS),
            *(f"{seconds:.2f}" for seconds in (step.exposed_s, step.bubble_s, step.step_s)),
        )

    def _table(self) -> Table:
        header = (
            "layout",
            "peak (GB)",
            f"fits in {self.usable_memory / 1e9:g} GB",
            "compute (s)",
            *(f"{name} (s, link)" for _, name in _GROUP_COLUMNS),
            "communication the step waits for (s)",
            "bubble (s)",
            "step (s)",
        )
        rows = [self._row(step) for step in self.steps]
        return Table(header, rows, caption=self.description, numeric=(1, 3, *range(4, 11)))

    def __repr__(self) -> str:
        return str(self._table())

    def _repr_html_(self) -> str:
        return self._table()._repr_html_()


def layouts_for(
    config: GPTConfig,
    *,
    gpus: int,
    cluster: Cluster,
    global_batch: int,
    seq_len: int,
    precision: str = "bfloat16",
    recompute: str = "none",
) -> LayoutTable:
    """Every dp x tp x pp layout of ``gpus`` GPUs of ``cluster`` (tp within a node, with SP; every ZeRO stage when
    dp > 1, and HSDP when the dp ranks span nodes) for ``global_batch`` sequences per step in micro-batches of one
    sequence, each block recomputing as ``recompute`` says (:data:`perflab.parallel_step.RECOMPUTE`); the least
    estimated step time first."""
    workload = dict(global_batch=global_batch, seq_len=seq_len, precision=precision, recompute=recompute)
    layouts = _layouts(config, gpus, cluster.gpus_per_node, global_batch, seq_len)
    steps = sorted(
        (estimate_step_time(config, layout, cluster, **workload) for layout in layouts),
        key=lambda step: (step.step_s, step.estimate.peak),
    )
    parameters = estimate_layout(config, Layout(), batch_size=1, seq_len=seq_len).parameters // _FLOAT32
    description = (
        f"{parameters / 1e9:.2f} billion parameters, {global_batch} x {seq_len} tokens per step in micro-batches of "
        f"one sequence, {precision}, {'no' if recompute == 'none' else recompute} recomputation; "
        f"{cluster.describe(gpus)} "
        f"({cluster.memory_per_gpu / 1e9:g} GB per GPU, {cluster.inside.name} inside a node, {cluster.across.name} "
        f"across); estimate per GPU: compute at the datasheet's {precision} peak, links at their datasheet bandwidth"
    )
    return LayoutTable(tuple(steps), cluster, description)


def _layouts(config: GPTConfig, gpus: int, node: int, global_batch: int, seq_len: int) -> Iterator[Layout]:
    for tp in (t for t in range(1, min(gpus, node) + 1) if gpus % t == 0 and config.n_head % t == 0):
        for pp in (p for p in range(1, gpus // tp + 1) if (gpus // tp) % p == 0 and config.n_layer % p == 0):
            dp = gpus // (tp * pp)
            if global_batch % dp or config.vocab_size % tp or seq_len % tp:
                continue
            for zero in (0, 1, 2, 3) if dp > 1 else (0,):
                yield Layout(dp=dp, tp=tp, pp=pp, zero=zero, sequence_parallel=tp > 1)
            shard = node // tp  # HSDP: ZeRO-3 over the data-parallel ranks of a node, replicated across nodes
            if dp * tp > node and node % tp == 0 and shard > 1 and dp % shard == 0:
                yield Layout(dp=dp, tp=tp, pp=pp, zero=3, sequence_parallel=tp > 1, replicate=dp // shard)
