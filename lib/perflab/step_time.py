"""How long one training step of a layout takes on nodes of GPUs: compute, each group's collectives over the link
that group crosses, and the pipeline's bubble; an estimate from datasheets.

    >>> from perflab.models import GPTConfig
    >>> from perflab.parallel_step import Layout
    >>> from perflab.step_time import DGX_H100, estimate_step_time
    >>> seven_b = GPTConfig(vocab_size=32000, block_size=4096, n_layer=32, n_head=32, n_embd=4096)
    >>> run = dict(global_batch=1024, seq_len=4096, precision="bfloat16")   # Llama 2's 4M tokens per step
    >>> estimate_step_time(seven_b, Layout(dp=16, zero=3), DGX_H100, **run)   # FSDP2 over two nodes
    StepTime(DP 16 (ZeRO-3) on 2 x DGX H100: compute 12.2 s; dp 94.2 s over InfiniBand NDR, 82.1 s exposed; step 94.2 s)
    >>> estimate_step_time(seven_b, Layout(dp=16, zero=3, replicate=2), DGX_H100, **run)   # HSDP: shards in a node
    StepTime(DP 16 (HSDP 2 x 8) on 2 x DGX H100: compute 12.2 s; dp 9.77 s over NVLink 4, 0.147 s exposed;
    replicate 0.0659 s over InfiniBand NDR, 0.00148 s exposed; step 12.3 s)

The model, and what it leaves out:

- **Compute**: the step's FLOPs, PaLM's ``6 N + 12 L T C`` per token
  (:func:`perflab.training_mfu.palm_flops_per_token`) and, when each block recomputes in full
  (``recompute="full"``), the blocks' forward once more, spread evenly over the GPUs, at the datasheet's dense
  peak for the precision (:mod:`perflab.datasheet`): MFU 1, a lower bound. Selective recomputation
  (``"selective"``, :data:`perflab.parallel_step.SELECTIVE_SAVE`) runs again only what PaLM's count does not
  count: LayerNorms, GELU, residual additions and casts, which read and write their tensors and do a few
  FLOPs per element, memory-bound, so it adds no FLOPs here. What they cost is their bytes at the memory's
  bandwidth, left out here as such operations are in every mode's forward and backward; lecture 11 measures
  the recomputation's time on a CPU.
- **Links**: a collective's bus bytes (:meth:`perflab.parallel_step.LayoutEstimate.sent`) over the
  per-direction bandwidth of the link its group crosses, NVLink inside a node or InfiniBand across, at the
  datasheet's rate: a lower bound too. Ranks are numbered as torchtitan lays out its mesh
  (``["pp", "dp_replicate", "dp_shard", "cp", "tp"]``, outermost first, in
  ``torchtitan/distributed/parallel_dims.py``): tensor-parallel ranks adjacent, then the data-parallel shards,
  the replicas, the pipeline stages. A group stays inside a node when the ranks it spans fit in one.
- **What waits for what**: tensor-parallel collectives are in the critical path (the next matmul reads their
  result; no asynchronous tensor parallelism), and so are pipeline sends (a stage waits for its input; counted
  whole, and at the slower link wherever the pipeline spans nodes: an upper bound) and anything in the
  optimizer step. Data-parallel traffic issued in every micro-batch (FSDP2's all-gathers and its
  reduce-scatters, ZeRO-2's) runs beside the step's compute and costs only what exceeds it; traffic issued once
  per step (DDP's all-reduce, ZeRO-1's reduce-scatter, HSDP's all-reduce over the replicas) runs beside the last
  micro-batch's backward only. What no compute is left to run beside is waited for whole, at its group's link
  (``Transfer.exposed``, :mod:`perflab.parallel_transfers`): FSDP2's all-gather of the root, before a
  micro-batch's first compute, and the reduction of the ends' gradients after its last (the tied embedding's
  gradient is complete only then): in every micro-batch under ZeRO-2 and ZeRO-3, once per step under DDP,
  ZeRO-1 and across HSDP's replicas.
  Within a group the seconds of its transfers add up; left out are contention between groups that share a
  link (tensor- and data-parallel traffic both on NVLink), what the collectives take from the compute (nccl
  runs on the GPU's own cores and memory), buckets larger than the ends' at the end of a backward, the next
  unit's (block 0's) all-gather and reduce-scatter, partly exposed with only the embedding beside them (FSDP2
  has no explicit forward prefetch by default, ``_states_to_forward_prefetch`` being empty, so block 0's
  all-gather, issued at its own ``pre_forward``, waits behind the root's; its reduce-scatter has only the
  embedding's backward left beside it), which would add to ZeRO-3's and HSDP's waits, and the optimizer's own
  arithmetic. Any of these can reorder layouts within a percent of each other: a measured step decides.
- **FSDP2 under a pipeline**: the ZeRO-3 x PP layouts are counted with FSDP2's defaults, re-gathered and
  reduce-scattered in every micro-batch. With ``torch.distributed.pipelining`` a stage's FSDP2 module
  reduce-scatters once per step and is not resharded after backward (``backward_maybe_with_nosync`` sets
  ``set_requires_gradient_sync(False)`` and ``set_reshard_after_backward(False)``, ``perform_reduce_grad``
  reduce-scatters after the last backward, in ``torch/distributed/pipelining/stage.py``), and torchtitan keeps
  it gathered after forward (``reshard_after_forward = not pp_enabled``): the estimate overcounts their
  traffic.
- **The bubble**: a pipeline's busy time (compute and what is exposed in every micro-batch) times
  (pp - 1) / m, m micro-batches per pipeline: (pp - 1) / (m + pp - 1) of the step.

Used in: lecture 11 (tensor pipeline parallel).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch

from perflab.datasheet import DatasheetPeak, datasheet_peak
from perflab.models.gpt import GPT, GPTConfig
from perflab.parallel_step import Layout, LayoutEstimate, estimate_layout
from perflab.parallel_transfers import GROUPS, Transfer
from perflab.render import Table
from perflab.training_mfu import palm_flops_per_token

__all__ = [
    "DGX_H100",
    "INFINIBAND_NDR",
    "NVLINK_4",
    "PCIE_GEN5_X16",
    "Cluster",
    "GroupTime",
    "Link",
    "StepTime",
    "estimate_step_time",
]


@dataclass(frozen=True)
class Link:
    """What one GPU can send over a link, per direction, as its datasheet gives it."""

    name: str
    bytes_per_s: float
    source: str


_H100 = "https://www.nvidia.com/en-us/data-center/h100/"
NVLINK_4 = Link("NVLink 4", 450e9, f"H100 SXM through NVSwitch: 900 GB/s both directions together, {_H100}")
PCIE_GEN5_X16 = Link("PCIe Gen5 x16", 64e9, f"128 GB/s both directions together, {_H100}")
INFINIBAND_NDR = Link(
    "InfiniBand NDR", 50e9, "400 Gb/s, one ConnectX-7 port per GPU, https://www.nvidia.com/en-us/data-center/dgx-h100/"
)


@dataclass(frozen=True)
class Cluster:
    """Nodes of GPUs: one GPU's datasheet and memory, GPUs per node, the link inside a node and the one across."""

    name: str
    gpu: DatasheetPeak
    memory_per_gpu: float
    gpus_per_node: int
    inside: Link
    across: Link

    def link(self, layout: Layout, group: str) -> Link:
        """The link a group's collectives cross: inside a node when the consecutive ranks it spans fit in one."""
        spans = {"tp": layout.tp, "dp": layout.shard * layout.tp, "replicate": layout.dp * layout.tp, "pp": layout.gpus}
        return self.inside if spans[group] <= self.gpus_per_node else self.across

    def describe(self, gpus: int) -> str:
        nodes, rest = divmod(gpus, self.gpus_per_node)
        return f"{nodes} x {self.name}" if nodes and not rest else f"{gpus} GPUs of a {self.name}"


DGX_H100 = Cluster("DGX H100", datasheet_peak("NVIDIA H100 80GB HBM3"), 80e9, 8, NVLINK_4, INFINIBAND_NDR)


@dataclass(frozen=True)
class GroupTime:
    """One group's collectives of a step on one GPU: their bus bytes, their time on the group's link, and the part
    of it the step waits for (the bubble aside)."""

    group: str
    link: Link
    bus_bytes: int
    seconds: float
    exposed_s: float


@dataclass(frozen=True)
class StepTime:
    """One training step of a layout on a cluster, estimated: compute + exposed communication + bubble."""

    estimate: LayoutEstimate
    cluster: Cluster
    precision: str
    compute_s: float  # at the datasheet's peak
    groups: tuple[GroupTime, ...]
    bubble_s: float

    @property
    def layout(self) -> Layout:
        return self.estimate.layout

    @property
    def exposed_s(self) -> float:
        return sum(g.exposed_s for g in self.groups)

    @property
    def step_s(self) -> float:
        return self.compute_s + self.exposed_s + self.bubble_s

    def __repr__(self) -> str:
        parts = [f"compute {self.compute_s:.3g} s"]
        parts += [f"{g.group} {g.seconds:.3g} s over {g.link.name}, {g.exposed_s:.3g} s exposed" for g in self.groups]
        parts += [f"bubble {self.bubble_s:.3g} s"] if self.layout.pp > 1 else []
        where = self.cluster.describe(self.layout.gpus)
        return f"StepTime({self.layout.label} on {where}: {'; '.join(parts)}; step {self.step_s:.3g} s)"

    def _repr_html_(self) -> str:
        rows = [("compute", "", "", f"{self.compute_s:.3f}", f"{self.compute_s:.3f}")]
        for g in self.groups:
            rows.append(
                (
                    f"{g.group} collectives",
                    g.link.name,
                    f"{g.bus_bytes / 1e9:.1f}",
                    f"{g.seconds:.3f}",
                    f"{g.exposed_s:.3f}",
                )
            )
        rows += [
            ("bubble", "", "", f"{self.bubble_s:.3f}", f"{self.bubble_s:.3f}"),
            ("step", "", "", "", f"{self.step_s:.3f}"),
        ]
        where = self.cluster.describe(self.layout.gpus)
        caption = (
            f"{self.layout.label} on {where}, one GPU, estimate: compute at the {self.precision} datasheet peak, "
            f"links at their datasheet bandwidth"
        )
        header = ("", "link", "bus bytes (GB)", "seconds", "the step waits (s)")
        return Table(header, rows, caption=caption, numeric=(2, 3, 4))._repr_html_()


@functools.lru_cache
def _flop_counts(config: GPTConfig, seq_len: int) -> tuple[float, int]:
    """PaLM's training FLOPs per token and the blocks' parameters, of the model built on the meta device (no memory)."""
    with torch.device("meta"):
        model = GPT(dataclasses.replace(config, block_size=seq_len))
    return palm_flops_per_token(model), sum(p.numel() for p in model.blocks.parameters())


def estimate_step_time(
    config: GPTConfig,
    layout: Layout,
    cluster: Cluster,
    *,
    global_batch: int,
    seq_len: int,
    precision: str = "bfloat16",
    recompute: str = "none",
) -> StepTime:
    """One step of ``global_batch`` sequences of ``seq_len`` tokens, in micro-batches of one sequence: each of the
    ``dp`` replicas accumulates ``global_batch // dp`` of them (its pipeline's m); ``recompute`` is
    :func:`perflab.parallel_step.estimate_layout`'s."""
    if global_batch % layout.dp:
        raise ValueError(f"{layout.label}: dp must divide the global batch ({global_batch} sequences)")
    m = global_batch // layout.dp
    workload = dict(batch_size=1, seq_len=seq_len, microbatches=m, precision=precision, recompute=recompute)
    estimate = estimate_layout(config, layout, **workload)
    palm, block_parameters = _flop_counts(config, seq_len)
    # Full recomputation runs each block's forward again in backward: 2 FLOPs per weight and 4 L T C of attention;
    # selective recomputation keeps the matmuls' and attention's outputs and runs again no FLOP PaLM counts.
    recomputed = 2 * block_parameters + 4 * config.n_layer * seq_len * config.n_embd if recompute == "full" else 0
    flops, backward_flops = palm + recomputed, 2 * palm / 3 + recomputed  # PaLM's count: backward is 2/3 of it
    compute = flops * global_batch * seq_len / layout.gpus / cluster.gpu.flops_per_s(precision)
    last_backward = compute / m * backward_flops / flops
    groups, busy = [], compute  # busy: what every micro-batch of a pipeline waits for, which the bubble multiplies
    for group in (g for g in GROUPS if estimate.sent(g)):
        link, size = cluster.link(layout, group), layout.group_size(group)
        seconds = dict.fromkeys(_OVERLAPS, 0.0)
        for t in (t for t in estimate.transfers if t.group == group):
            seconds[_overlap(t)] += t.sent(size) / link.bytes_per_s
        each = seconds["critical path"] + max(0.0, seconds["beside the compute"] - compute)
        once = max(0.0, seconds["beside the last backward"] - last_backward) + seconds["after the backward"]
        groups.append(
            GroupTime(group, link, estimate.sent(group), estimate.sent(group) / link.bytes_per_s, each + once)
        )
        busy += each
    bubble = busy * estimate.bubble / (1 - estimate.bubble)  # idle (pp - 1) / (m + pp - 1) of the step
    return StepTime(estimate, cluster, precision, compute, tuple(groups), bubble)


_OVERLAPS = ("critical path", "beside the compute", "beside the last backward", "after the backward")


def _overlap(transfer: Transfer) -> str:
    """What compute a transfer can run beside, by the module's model: one of _OVERLAPS."""
    if transfer.phase == "optimizer step" or (transfer.exposed and transfer.once_per_step):
        return "after the backward"
    if transfer.group in ("tp", "pp") or transfer.exposed:
        return "critical path"  # waited for in every micro-batch
    return "beside the last backward" if transfer.once_per_step else "beside the compute"
