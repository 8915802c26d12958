"""What one GPU holds and sends per training step of the course GPT under data, ZeRO, tensor and pipeline parallelism.

    >>> from perflab.models import GPTConfig
    >>> from perflab.parallel_step import Layout, estimate_layout
    >>> config = GPTConfig(vocab_size=256, block_size=32, n_layer=2, n_head=4, n_embd=128)
    >>> tp = estimate_layout(config, Layout(tp=2, sequence_parallel=True), batch_size=4, seq_len=32)
    >>> tp
    LayoutEstimate(TP 2 + SP on 2 GPUs, estimate per GPU: parameters 0.88 + gradients 0.88 + optimizer state 1.76 + activations 1.42 MB; bus bytes per step: tp 0.71 MB)
    >>> tp.count("all-gather", phase="forward"), tp.count("reduce-scatter", phase="backward")   # 2 per block, +1
    (5, 5)
    >>> from perflab.parallel_step import RECOMPUTE
    >>> {mode: estimate_layout(config, Layout(), batch_size=4, seq_len=32, recompute=mode).block_activations
    ...  for mode in RECOMPUTE}   # bytes a block keeps: about 16, 11 and 1 activations of 4 x 32 x 128 floats
    {'none': 1052672, 'selective': 722944, 'full': 65536}

Tensor parallelism follows lecture 11's plan: the token embedding (tied to the head) split by
vocabulary rows, ``qkv`` and ``up`` by output columns, ``proj`` and ``down`` by input rows; the
LayerNorms, the row-parallel biases and the position embedding whole on every rank. Activations are
``perflab.memory_budget``'s (float32 or bfloat16 autocast, ``sdpa``, no dropout), divided as
Korthikanti et al. (2022, arXiv:2205.05198, section 4.2) divide them: attention and the MLP's hidden
layer by tp, the LayerNorms' inputs too under sequence parallelism; PyTorch keeps the gathered inputs
of ``qkv`` and ``up`` whole. ``activations`` is what forward leaves alive, as ``MemTracker`` counts it
after forward (the kept tensors, the logits, the loss); the peak adds every part. ZeRO
(arXiv:1910.02054) divides state over ``dp`` as :mod:`perflab.sharding` does, but AdamW's step
counts, which FSDP2 keeps whole. A pipeline stage (GPipe, arXiv:1811.06965; 1F1B, arXiv:1806.03377)
holds ``n_layer / pp`` blocks and, as an upper bound, both ends; under 1F1B the first keeps ``pp``
micro-batches' activations; the bubble is (pp - 1) / (m + pp - 1).

``recompute`` says what each block keeps for backward (:data:`RECOMPUTE`), every block run under
``torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)`` but for ``"none"``. ``"full"``:
the block's input only. ``"selective"``: the block's input and what ``create_selective_checkpoint_contexts``
caches under a policy that keeps the outputs of :data:`SELECTIVE_SAVE` (torchtitan's op-level list,
``_op_sac_save_list`` in ``torchtitan/models/llama3/infra/parallelize.py``, with ``addmm`` for
``nn.Linear``'s bias; torchtitan also recomputes every second ``mm``, ``_apply_op_sac`` in
``torchtitan/distributed/activation_checkpoint.py``) and recomputes the rest: LayerNorms, GELU, residual
additions, casts, views and the other collectives. Korthikanti et al. (section 5) recompute what takes much
memory and few FLOPs; with ``sdpa`` no ``a s^2`` tensor is left to drop, so here that is the pointwise
operations. The cache holds those outputs whether backward needs them or not: ``qkv``'s, ``sdpa``'s (and
its log-sum-exp) and ``up``'s, split by tp; ``proj``'s and ``down``'s, each rank's partial sums, whole;
under sequence parallelism the reduce-scatters' outputs, split by tp. ``down``'s (and its reduce-scatter's)
are held for nothing: backward never reads them, and the recomputation stops before ``down`` runs
(``early_stop``, :mod:`perflab.parallel_transfers`). Under sequence parallelism with recomputation the
first block keeps its input whole, since the plan splits it inside the block's call. Measured: to the byte
in one process on a CPU, float32 and bfloat16 autocast (``tests/test_parallel_step.py``), and per rank on
two gloo ranks under TP and TP + SP, float32 (lecture 11, section 2).

Communication is a tuple of :class:`perflab.parallel_transfers.Transfer` s, in bus bytes
(:func:`perflab.sharding.bus_factor`): every collective of the step, by group, phase and kind, as
:mod:`perflab.parallel_transfers` lists them.

Used in: lecture 11 (tensor pipeline parallel).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from perflab.memory_budget import check_workload
from perflab.models.gpt import GPTConfig
from perflab.parallel_transfers import (
    GROUPS,
    PHASES,
    Transfer,
    data_parallel_transfers,
    pipeline_transfers,
    tensor_parallel_transfers,
)
from perflab.render import Table

__all__ = ["GROUPS", "PHASES", "RECOMPUTE", "SELECTIVE_SAVE", "Layout", "LayoutEstimate", "Transfer", "estimate_layout"]

RECOMPUTE = ("none", "selective", "full")  # what each block recomputes in backward: nothing, the cheap ops, all of it
# The operators whose outputs selective recomputation keeps, by OpOverload.name(): torchtitan's list as this model
# calls them: the matmuls (mm, and addmm, which nn.Linear runs with a bias), scaled_dot_product_attention's kernel on
# each backend (the CPU's too), and sequence parallelism's reduce-scatter (DTensor's functional collective).
SELECTIVE_SAVE = (
    "aten::mm",
    "aten::addmm",
    "aten::_scaled_dot_product_flash_attention",
    "aten::_scaled_dot_product_flash_attention_for_cpu",
    "aten::_scaled_dot_product_efficient_attention",
    "aten::_scaled_dot_product_cudnn_attention",
    "_c10d_functional::reduce_scatter_tensor",
)
_FLOAT32, _BFLOAT16, _INT64 = 4, 2, 8
_GATHERED_BLOCKS = 2  # FSDP2: the block computing and the next one, prefetched (as perflab.sharding)


@dataclass(frozen=True)
class Layout:
    """How the GPUs are split: ``dp`` x ``tp`` x ``pp`` of them; ZeRO stage ``zero`` over the ``dp`` ranks or, with
    ``replicate`` > 1 (HSDP, FSDP2's 2-D mesh), over each of ``replicate`` groups of ``dp // replicate`` of them."""

    dp: int = 1
    tp: int = 1
    pp: int = 1
    zero: int = 0
    sequence_parallel: bool = False
    replicate: int = 1

    def __post_init__(self) -> None:
        for name in ("dp", "tp", "pp"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name} must be a positive int, got {getattr(self, name)!r}")
        if self.zero not in (0, 1, 2, 3) or (self.zero and self.dp == 1):
            raise ValueError(f"zero must be 0, 1, 2 or 3, and needs dp > 1 to shard over; got {self!r}")
        if self.sequence_parallel and self.tp == 1:
            raise ValueError("sequence parallelism splits the sequence over the tensor-parallel ranks: it needs tp > 1")
        if self.replicate != 1 and (self.zero != 3 or self.dp % self.replicate or not 1 < self.replicate < self.dp):
            raise ValueError(f"HSDP replicates ZeRO-3 shards: replicate must divide dp, between 1 and dp; got {self!r}")

    @property
    def shard(self) -> int:
        """The data-parallel ranks a ZeRO stage divides the state over: all of them, or one replica's under HSDP."""
        return self.dp // self.replicate

    def group_size(self, group: str) -> int:
        return {"tp": self.tp, "dp": self.shard, "replicate": self.replicate, "pp": self.pp}[group]

    @property
    def gpus(self) -> int:
        return self.dp * self.tp * self.pp

    @property
    def label(self) -> str:
        parts = []
        if self.dp > 1:
            hsdp = f"HSDP {self.replicate} x {self.shard}" if self.replicate > 1 else f"ZeRO-{self.zero}"
            parts.append(f"DP {self.dp}" + (f" ({hsdp})" if self.zero else ""))
        if self.tp > 1:
            parts.append(f"TP {self.tp}" + (" + SP" if self.sequence_parallel else ""))
        if self.pp > 1:
            parts.append(f"PP {self.pp}")
        return " x ".join(parts) or "1 GPU"


@dataclass(frozen=True)
class LayoutEstimate:
    """Bytes one GPU keeps and holds, and what it sends, for one training step under a :class:`Layout`."""

    layout: Layout
    microbatches: int
    parameters: int
    gradients: int
    optimizer_state: int
    activations: int  # what forward leaves alive: the tensors kept for backward and the logits
    block_activations: int  # of which one block's, for one micro-batch
    gathered: int  # ZeRO-3: parameters all-gathered in full at the peak
    transfers: tuple[Transfer, ...] = field(repr=False)

    @property
    def peak(self) -> int:
        return self.parameters + self.gradients + self.optimizer_state + self.activations + self.gathered

    @property
    def bubble(self) -> float:
        """The share of a pipeline step a stage waits: (pp - 1) / (m + pp - 1)."""
        return (self.layout.pp - 1) / (self.microbatches + self.layout.pp - 1)

    def count(self, kind: str, *, group: str | None = None, phase: str | None = None) -> int:
        return sum(t.count for t in self._select(kind, group, phase))

    def payload(self, kind: str, *, group: str | None = None, phase: str | None = None) -> int:
        return sum(t.payload for t in self._select(kind, group, phase))

    def sent(self, group: str | None = None) -> int:
        """Bus bytes per step of this GPU, in one group or all."""
        return sum(t.sent(self.layout.group_size(t.group)) for t in self.transfers if group in (None, t.group))

    def fits(self, memory_per_gpu: float) -> bool:
        return self.peak <= memory_per_gpu

    def _select(self, kind: str, group: str | None, phase: str | None) -> list[Transfer]:
        return [t for t in self.transfers if t.kind == kind and group in (None, t.group) and phase in (None, t.phase)]

    def __repr__(self) -> str:
        kept = " + ".join(f"{name.replace('_', ' ')} {getattr(self, name) / 1e6:.2f}" for name in _PARTS)
        sent = ", ".join(f"{g} {self.sent(g) / 1e6:.2f} MB" for g in GROUPS if self.sent(g)) or "nothing"
        return (
            f"LayoutEstimate({self.layout.label} on {self.layout.gpus} GPUs, estimate per GPU: {kept} MB; "
            f"bus bytes per step: {sent})"
        )

    def _repr_html_(self) -> str:
        rows = [(name.replace("_", " "), f"{getattr(self, name) / 1e6:.2f} MB") for name in (*_PARTS, "gathered")]
        rows += [("peak", f"{self.peak / 1e6:.2f} MB")]
        groups = [g for g in GROUPS if self.layout.group_size(g) > 1]
        rows += [(f"bus bytes per step, {g}", f"{self.sent(g) / 1e6:.2f} MB") for g in groups]
        caption = f"{self.layout.label} on {self.layout.gpus} GPUs, per GPU: estimate"
        return Table((), rows, caption=caption, numeric=(1,))._repr_html_()


_PARTS = ("parameters", "gradients", "optimizer_state", "activations")


def estimate_layout(
    config: GPTConfig,
    layout: Layout,
    *,
    batch_size: int,
    seq_len: int,
    microbatches: int = 1,
    precision: str = "float32",
    recompute: str = "none",
) -> LayoutEstimate:
    """Closed-form bytes per GPU of one step of ``GPT(config)`` with AdamW; ``batch_size`` sequences per micro-batch
    and data-parallel rank, ``microbatches`` of them per step (pipelined, or accumulated when ``pp`` is 1); each block
    recomputing in backward as ``recompute`` says (one of :data:`RECOMPUTE`)."""
    _check(config, layout, batch_size, seq_len, microbatches, precision, recompute)
    C, V, L, tp, sp = config.n_embd, config.vocab_size, config.n_layer, layout.tp, layout.sequence_parallel
    blocks = L // layout.pp
    # Per block: what each rank holds of qkv, proj's and down's weights, up (split) and of the rest (whole).
    block_split, block_whole = 12 * C * C + 7 * C, 6 * C  # LayerNorms 4C, proj's and down's biases 2C
    ends_split, ends_whole = V * C, config.block_size * C + 2 * C  # tied embedding; positions, final LayerNorm
    per_block = block_split // tp + block_whole
    ends = ends_split // tp + ends_whole
    elements = blocks * per_block + ends
    tensors = 12 * blocks + 4  # AdamW keeps a float32 step count per tensor
    shard, zero = layout.shard, layout.zero
    parameters = elements * _FLOAT32 // (shard if zero == 3 else 1)
    gradients = elements * _FLOAT32 // (shard if zero >= 2 else 1)
    optimizer_state = 2 * elements * _FLOAT32 // (shard if zero >= 1 else 1) + tensors * _FLOAT32
    gathered = (ends + min(_GATHERED_BLOCKS, blocks) * per_block) * _FLOAT32 if zero == 3 else 0
    in_flight = min(layout.pp, microbatches)  # 1F1B: the first stage holds pp micro-batches' activations
    block_activations = _block_activations(config, layout, batch_size, seq_len, precision, recompute)
    ends_activations = _ends_activations(config, layout, batch_size, seq_len, precision, recompute)
    activations = in_flight * blocks * block_activations + ends_activations
    element = _FLOAT32 if precision == "float32" else _BFLOAT16  # what activation collectives move
    tokens = batch_size * seq_len
    transfers = (
        *tensor_parallel_transfers(config, layout, blocks, tokens, element, microbatches, recompute),
        *data_parallel_transfers(layout, blocks, per_block, ends, microbatches),
        # each micro-batch's activation on, its gradient back: the stage's sequence share under SP
        *pipeline_transfers(layout, tokens * C * element // (tp if sp else 1), microbatches),
    )
    return LayoutEstimate(
        layout,
        microbatches,
        parameters,
        gradients,
        optimizer_state,
        activations,
        block_activations,
        gathered,
        tuple(t for t in transfers if t.count),
    )


def _check(config, layout, batch_size, seq_len, microbatches, precision, recompute) -> None:
    check_workload(config, batch_size, seq_len, precision, "adamw")
    if recompute not in RECOMPUTE:
        raise ValueError(f"unknown recompute {recompute!r}; choose one of {', '.join(RECOMPUTE)}")
    if not isinstance(microbatches, int) or microbatches < 1:
        raise ValueError(f"microbatches must be a positive int, got {microbatches!r}")
    if config.attention != "sdpa" or config.dropout or config.checkpoint_blocks:
        raise ValueError("the estimate covers sdpa attention without dropout; recomputation is estimate_layout's own")
    if config.n_head % layout.tp or config.vocab_size % layout.tp or config.n_layer % layout.pp:
        raise ValueError(f"{layout.label}: tp must divide n_head and vocab_size, pp must divide n_layer")
    if layout.sequence_parallel and seq_len % layout.tp:
        raise ValueError(f"sequence parallelism needs seq_len divisible by tp; got {seq_len} and {layout.tp}")


def _block_activations(config, layout, batch, length, precision, recompute) -> int:
    """One block's kept tensors on one rank, as perflab.memory_budget counts them, divided as the plan divides them."""
    tokens, C, tp = batch * length, config.n_embd, layout.tp
    sequence_share = tp if layout.sequence_parallel else 1
    residual = tokens * C * _FLOAT32  # the residual stream stays float32 under autocast
    if recompute == "full":
        return residual // sequence_share  # only the block's input; the rest is recomputed in backward
    matmul = _FLOAT32 if precision == "float32" else _BFLOAT16  # what matmul inputs are saved in
    activation = tokens * C * matmul
    log_sum_exp = batch * config.n_head * length * _FLOAT32  # sdpa's, one per query row and head
    if recompute == "selective":  # the block's input and SELECTIVE_SAVE's outputs, needed by backward or not
        split = 3 * activation + activation + log_sum_exp + 4 * activation  # qkv's, sdpa's, up's: this rank's heads
        partial_sums = 2 * activation  # proj's and down's outputs, before g sums them: whole on every rank
        scattered = 2 * activation if layout.sequence_parallel else 0  # g's reduce-scatters: this rank's tokens
        return residual // sequence_share + split // tp + partial_sums + scattered // tp
    layer_norms = 2 * (residual + 2 * tokens * _FLOAT32)  # inputs, mean and 1/std: split by SP only
    gathered_inputs = 2 * activation  # qkv's and up's inputs: whole on every rank, SP or not
    # sdpa keeps q, k, v, its output and a log-sum-exp per query row; GELU's and down's inputs are 4C wide
    split = 4 * activation + log_sum_exp + 8 * activation
    if precision == "bfloat16":
        split += 12 * C * C * _BFLOAT16  # autocast's bfloat16 copies of this rank's matrices
    return layer_norms // sequence_share + gathered_inputs + split // tp


def _ends_activations(config, layout, batch, length, precision, recompute) -> int:
    """Embeddings, final LayerNorm, head, loss: what forward keeps there, the token ids and targets included."""
    tokens, C, V, tp = batch * length, config.n_embd, config.vocab_size, layout.tp
    sequence_share = tp if layout.sequence_parallel else 1
    matmul = _FLOAT32 if precision == "float32" else _BFLOAT16
    embeddings = length * _INT64 + tokens * _INT64  # positions; the ids the embedding keeps (masked, when split)
    if recompute != "none":
        # The first block's checkpoint keeps its input, the embeddings' sum, whole: under SP the plan's
        # PrepareModuleInput on blocks.0 splits it inside the checkpointed call (counted here, not as a block's)
        embeddings += tokens * C * _FLOAT32 - tokens * C * _FLOAT32 // sequence_share
    head = (
        (tokens * C * _FLOAT32 + 2 * tokens * _FLOAT32) // sequence_share  # final LayerNorm's input, mean, 1/std
        + tokens * C * matmul  # the head's input, gathered whole
        + (V * C * _BFLOAT16 // tp if precision == "bfloat16" else 0)  # autocast's copy of this rank's vocabulary
        + tokens * V * _FLOAT32 // tp  # log-probabilities, this rank's vocabulary (loss_parallel)
        + tokens * V * matmul // tp  # the logits, returned
        + tokens * _INT64  # the targets, which the loss keeps
        + 2 * _FLOAT32  # the loss and its normalizer
    )
    return embeddings + head
