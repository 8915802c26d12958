"""The collectives one GPU calls in a training step of the course GPT under data (DDP, ZeRO, FSDP2, HSDP), tensor
and pipeline parallelism: one :class:`Transfer` per group, phase and kind, in bus bytes.

    >>> from perflab.parallel_step import Layout
    >>> from perflab.parallel_transfers import Transfer, data_parallel_transfers
    >>> Transfer("dp", "backward", "reduce-scatter", 1, 1000).sent(4)   # 1000 bytes x (4 - 1) / 4
    750
    >>> for t in data_parallel_transfers(Layout(dp=4, zero=3), blocks=2, per_block=100, ends=50, microbatches=3):
    ...     print(t.phase, t.kind, t.count, t.payload, "exposed" if t.exposed else "beside the compute")
    forward all-gather 6 2400 beside the compute
    forward all-gather 3 600 exposed
    backward all-gather 6 2400 beside the compute
    backward reduce-scatter 6 2400 beside the compute
    backward reduce-scatter 3 600 exposed

Tensor parallelism (lecture 11's plan): per micro-batch and block, two all-reduces in forward and two in
backward (Megatron-LM, arXiv:1909.08053, section 3), an all-gather and a reduce-scatter each under sequence
parallelism; the embedding's all-reduce; ``loss_parallel``'s three of a float per token; under sequence
parallelism the LayerNorms' partial gradients, all-reduced in each micro-batch's
backward with data parallelism (as FSDP2 does), else at each of AdamW's three reads of a gradient (``lerp_`` and
``addcmul_``, single-tensor as on a CPU or foreach as on a GPU, ``torch/optim/adam.py``; ``fused=True`` reads it
once). Activation collectives move 4 bytes an element in float32, 2 in bfloat16 (as Megatron-LM's do).

Recomputation runs a block's forward again in backward, collectives included, but only up to the last tensor
backward needs, ``down``'s input: non-reentrant ``checkpoint`` stops there (``early_stop``,
``torch/utils/checkpoint.py``), so *g* after ``down`` is not issued again. Under ``"full"`` that is *g* after
``proj`` (an all-reduce, or SP's reduce-scatter) and, under sequence parallelism, *f*'s all-gathers before ``qkv``
and ``up``: per block one all-reduce, or two all-gathers and one reduce-scatter. Under ``"selective"`` the
reduce-scatter's output is kept (:data:`perflab.parallel_step.SELECTIVE_SAVE`), the all-gathers are issued again:
the gathered input is recomputed from this rank's share, as Megatron-LM does by design under sequence parallelism
(``LinearWithGradAccumulationAndAsyncCommunication`` saves the share and all-gathers it again in backward,
``megatron/core/tensor_parallel/layers.py``; Korthikanti et al., arXiv:2205.05198, section 4.2.2). Both modes are
measured on two gloo ranks in lecture 11 (section 2), from gloo's own records: ``torch.profiler`` also records an
operator that selective checkpointing answers from its cache, which never reaches gloo.

Data parallelism: FSDP2 (``zero=3``, one unit per block and a root) gathers every unit in forward, every block in
backward (the root stays gathered), and reduce-scatters every unit, per micro-batch: its defaults, which
re-gather in every micro-batch and reshard after forward, with float32 parameters (no ``MixedPrecisionPolicy``).
DDP all-reduces once per step (``no_sync`` until the last micro-batch), ZeRO-1 reduce-scatters once, ZeRO-2 once
per micro-batch (it keeps only its shard of the gradients), and both all-gather the updated parameters once.
HSDP (``replicate`` > 1, ``fully_shard`` on a 2-D mesh) is FSDP2 within each replica, and all-reduces each
unit's gradient shard over the replicas once per step (``set_requires_all_reduce(False)`` until the last
micro-batch; ``torch/distributed/fsdp/_fully_shard/_fully_shard.py``). Pipeline parallelism sends each
micro-batch's activation to the next stage and its gradient back.

Two flags say when a transfer runs, for :mod:`perflab.step_time`: ``once_per_step``, issued in the last
micro-batch only; ``exposed``, issued where no compute is left to run beside it: FSDP2's all-gather of the root
before a micro-batch's first compute, and the reduction of the ends' gradients (the root's, or the last bucket's)
after its last, since the tied embedding's gradient is complete only when the embedding's backward, the last
compute of a backward, has run. The next unit's (block 0's) all-gather and reduce-scatter are partly exposed
too, with only the embedding beside them (FSDP2 has no explicit forward prefetch by default, so block 0's
all-gather, issued at its own ``pre_forward``, waits behind the root's), and are left out: they would add to
ZeRO-3's and HSDP's waits.

Used by perflab.parallel_step and perflab.step_time.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from perflab.sharding import bus_factor

if TYPE_CHECKING:
    from perflab.models.gpt import GPTConfig
    from perflab.parallel_step import Layout

__all__ = [
    "GROUPS",
    "PHASES",
    "Transfer",
    "data_parallel_transfers",
    "pipeline_transfers",
    "tensor_parallel_transfers",
]

PHASES = ("forward", "backward", "optimizer step")
GROUPS = ("tp", "dp", "replicate", "pp")  # "dp": the ranks that reduce (and shard); "replicate": HSDP's replicas
_FLOAT32 = 4


@dataclass(frozen=True)
class Transfer:
    """``count`` calls of one collective (or ``send``, point to point) in one group and phase of a step, per GPU."""

    group: str  # one of GROUPS
    phase: str  # "forward", "backward" or "optimizer step"
    kind: str  # "all-reduce", "all-gather", "reduce-scatter" or "send"
    count: int
    payload: int  # bytes of the whole tensors the calls are about (an all-gather's output, a reduce-scatter's input)
    once_per_step: bool = False  # issued in the last micro-batch only, not in every one
    exposed: bool = False  # before a micro-batch's first compute or after its last: nothing to run beside

    def sent(self, group_size: int) -> int:
        """Bus bytes: payload x :func:`perflab.sharding.bus_factor`; a send moves its payload once."""
        return self.payload if self.kind == "send" else round(self.payload * bus_factor(self.kind, group_size))


def tensor_parallel_transfers(
    config: GPTConfig, layout: Layout, blocks: int, tokens: int, element: int, microbatches: int, recompute: str
) -> tuple[Transfer, ...]:
    """The collectives of lecture 11's plan, per step: microbatches x (the blocks' and both ends'); ``tokens`` per
    micro-batch, activations of ``element`` bytes; ``recompute`` one of :data:`perflab.parallel_step.RECOMPUTE`."""
    if layout.tp == 1:
        return ()
    m, activation, L = microbatches, tokens * config.n_embd * element, blocks
    # What each block's recomputation issues again in backward, up to down's input (see the module's docstring): g
    # after proj, but the reduce-scatter selective recomputation keeps, and under SP f's all-gathers before qkv and up
    if recompute == "none":
        again = {}
    elif not layout.sequence_parallel:
        again = {"all-reduce": L}
    else:
        again = {"all-gather": 2 * L} | ({"reduce-scatter": L} if recompute == "full" else {})
    recomputed = tuple(Transfer("tp", "backward", kind, m * n, m * n * activation) for kind, n in again.items())
    per_token = 3 * tokens * _FLOAT32  # loss_parallel: max, sum of exponentials, the target's logit
    norms = 2 * (2 * L + 1)  # LayerNorm weights and biases: partial gradients under SP
    if not layout.sequence_parallel:  # all-reduces: the embedding's and g's in forward, f's in backward
        return (
            Transfer("tp", "forward", "all-reduce", m * (2 * L + 4), m * ((2 * L + 1) * activation + per_token)),
            Transfer("tp", "backward", "all-reduce", m * (2 * L + 1), m * (2 * L + 1) * activation),
            *recomputed,
        )
    # g's all-reduce becomes a reduce-scatter, f's identity an all-gather, and the other way round in backward
    return (
        Transfer("tp", "forward", "all-reduce", m * 4, m * (activation + per_token)),
        Transfer("tp", "forward", "all-gather", m * (2 * L + 1), m * (2 * L + 1) * activation),
        Transfer("tp", "forward", "reduce-scatter", m * 2 * L, m * 2 * L * activation),
        Transfer("tp", "backward", "all-gather", m * (2 * L + 1), m * (2 * L + 1) * activation),
        Transfer("tp", "backward", "reduce-scatter", m * (2 * L + 1), m * (2 * L + 1) * activation),
        # With data parallelism (FSDP2's) in each micro-batch's backward; else unfused AdamW's three reads in the step
        Transfer("tp", "backward", "all-reduce", m * norms, m * norms * config.n_embd * _FLOAT32)
        if layout.dp > 1
        else Transfer("tp", "optimizer step", "all-reduce", 3 * norms, 3 * norms * config.n_embd * _FLOAT32),
        *recomputed,
    )


def data_parallel_transfers(
    layout: Layout, blocks: int, per_block: int, ends: int, microbatches: int
) -> tuple[Transfer, ...]:
    """The data-parallel collectives of a step: ``blocks`` of ``per_block`` parameters and ``ends`` (the embeddings,
    the final LayerNorm) on this GPU, before ZeRO divides them."""
    if layout.dp == 1:
        return ()
    m, body, edge = microbatches, blocks * per_block * _FLOAT32, ends * _FLOAT32
    if layout.zero in (0, 1):  # DDP all-reduces the gradients, ZeRO-1 reduce-scatters them: once, summed over the m
        kind = "all-reduce" if layout.zero == 0 else "reduce-scatter"
        reduced = (
            Transfer("dp", "backward", kind, 1, body, once_per_step=True),
            Transfer("dp", "backward", kind, 1, edge, once_per_step=True, exposed=True),  # the last bucket
        )
        gathered = (Transfer("dp", "optimizer step", "all-gather", 1, body + edge, once_per_step=True),)
        return reduced + (gathered if layout.zero else ())
    if layout.zero == 2:
        # ZeRO-2 keeps only its shard, so each micro-batch's gradients are reduced before the next backward adds to
        # them (DeepSpeed, deepspeedai/DeepSpeed#2252: "gradient reduction is required after every backward").
        return (
            Transfer("dp", "backward", "reduce-scatter", m, m * body),
            Transfer("dp", "backward", "reduce-scatter", m, m * edge, exposed=True),
            Transfer("dp", "optimizer step", "all-gather", 1, body + edge, once_per_step=True),
        )
    # FSDP2, one unit per block and a root: forward gathers every unit (the root first, before any compute),
    # backward every block again (the root stays gathered), and each unit's gradients are reduce-scattered (the
    # root's last); every micro-batch, with FSDP2's defaults.
    sharded = (
        Transfer("dp", "forward", "all-gather", m * blocks, m * body),
        Transfer("dp", "forward", "all-gather", m, m * edge, exposed=True),
        Transfer("dp", "backward", "all-gather", m * blocks, m * body),
        Transfer("dp", "backward", "reduce-scatter", m * blocks, m * body),
        Transfer("dp", "backward", "reduce-scatter", m, m * edge, exposed=True),
    )
    if layout.replicate == 1:
        return sharded
    # HSDP: each unit's gradient shard is also all-reduced over the replicas, once per step with
    # set_requires_all_reduce(False) on all but the last micro-batch (FSDP2 sums the shards in between).
    shard = layout.shard
    return (
        *sharded,
        Transfer("replicate", "backward", "all-reduce", blocks, body // shard, once_per_step=True),
        Transfer("replicate", "backward", "all-reduce", 1, edge // shard, once_per_step=True, exposed=True),
    )


def pipeline_transfers(layout: Layout, hop: int, microbatches: int) -> tuple[Transfer, ...]:
    """Each micro-batch's activation (``hop`` bytes) to the next stage, its gradient back."""
    if layout.pp == 1:
        return ()
    return (
        Transfer("pp", "forward", "send", microbatches, microbatches * hop),
        Transfer("pp", "backward", "send", microbatches, microbatches * hop),
    )
