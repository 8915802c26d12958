"""How much memory one training step of the course's GPT needs: worked out on paper, then measured.

    >>> from perflab.memory_budget import estimate_training_memory, measure_training_memory
    >>> from perflab.models import GPTConfig
    >>> config = GPTConfig(n_layer=2, attention="naive")
    >>> estimate = estimate_training_memory(config, batch_size=8, seq_len=128, optimizer="adamw")
    >>> estimate
    TrainingMemory(estimate: 30.30 MB = parameters 1.78 + gradients 1.78 + optimizer state 3.57 + activations 23.16)
    >>> estimate.compare(measure_training_memory(config, batch_size=8, seq_len=128, optimizer="adamw"))
    MemoryComparison(estimate / measured: parameters 1.000, gradients 1.000, optimizer state 1.000, activations 1.000, total 1.000)

Parameters, gradients and optimizer state follow from the parameter count alone. Activations,
the tensors autograd keeps from the forward pass for the backward pass, are counted op by op
from what ``perflab.models.gpt`` computes and what each PyTorch op saves on the CPU: there,
with torch 2.14, the estimate is exact to the byte. On CUDA autocast runs softmax in float32,
dropout keeps a bool mask and SDPA picks other kernels, so there the activations are an
approximation: check them against ``measure_training_memory(..., device="cuda")``.

Used in: lecture 05 (memory checkpointing).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, replace

import torch

from perflab.memory import saved_tensors
from perflab.models.gpt import GPT, GPTConfig
from perflab.render import Table

__all__ = [
    "COMPONENTS",
    "MemoryComparison",
    "OPTIMIZERS",
    "PRECISIONS",
    "TrainingMemory",
    "check_workload",
    "estimate_over_measured",
    "estimate_training_memory",
    "measure_training_memory",
]

PRECISIONS = ("float32", "bfloat16")  # bfloat16 means float32 weights with bfloat16 autocast
OPTIMIZERS = ("adamw", "sgd", "sgd_momentum")
COMPONENTS = ("parameters", "gradients", "optimizer_state", "activations")
_FLOAT32, _BFLOAT16, _INT64, _BOOL = 4, 2, 8, 1  # bytes per element


@dataclass(frozen=True)
class TrainingMemory:
    """Bytes one training step holds, by component; ``source`` says whether estimated or measured."""

    parameters: int
    gradients: int
    optimizer_state: int
    activations: int  # kept by autograd from forward until backward: not the weights, but autocast's copies of them
    source: str
    peak_allocated: int | None = None  # torch.cuda.max_memory_allocated over the step, when measured on CUDA

    @property
    def total(self) -> int:
        return sum(getattr(self, component) for component in COMPONENTS)

    def compare(self, measured: TrainingMemory) -> MemoryComparison:
        """This estimate against a measurement: ``estimate.compare(measured).ratios["activations"]``."""
        return MemoryComparison(estimate=self, measured=measured)

    def __repr__(self) -> str:
        parts = " + ".join(f"{_label(c)} {getattr(self, c) / 1e6:.2f}" for c in COMPONENTS)
        peak = "" if self.peak_allocated is None else f"; peak allocated {self.peak_allocated / 1e6:.2f} MB"
        return f"TrainingMemory({self.source}: {self.total / 1e6:.2f} MB = {parts}{peak})"

    def _repr_html_(self) -> str:
        rows = [(_label(c), getattr(self, c)) for c in COMPONENTS] + [("total", self.total)]
        if self.peak_allocated is not None:
            rows.append(("peak allocated", self.peak_allocated))
        megabytes = [(name, f"{count / 1e6:.2f} MB") for name, count in rows]
        return Table((), megabytes, caption=self.source, numeric=(1,))._repr_html_()


@dataclass(frozen=True)
class MemoryComparison:
    """An estimate next to a measurement; ``ratios`` is estimate / measured per component and in total."""

    estimate: TrainingMemory
    measured: TrainingMemory

    @property
    def ratios(self) -> dict[str, float]:
        return {
            c: estimate_over_measured(getattr(self.estimate, c), getattr(self.measured, c))
            for c in (*COMPONENTS, "total")
        }

    def __repr__(self) -> str:
        ratios = ", ".join(f"{_label(c)} {ratio:.3f}" for c, ratio in self.ratios.items())
        return f"MemoryComparison(estimate / measured: {ratios})"

    def _repr_html_(self) -> str:
        rows = [
            (
                _label(c),
                f"{getattr(self.estimate, c) / 1e6:.2f} MB",
                f"{getattr(self.measured, c) / 1e6:.2f} MB",
                f"{ratio:.3f}",
            )
            for c, ratio in self.ratios.items()
        ]
        header = ("", "estimate", "measured", "estimate / measured")
        return Table(header, rows, caption=self.measured.source, numeric=(1, 2, 3))._repr_html_()


def _label(component: str) -> str:
    return component.replace("_", " ")


def estimate_over_measured(estimate: int, measured: int) -> float:
    """``estimate / measured`` in bytes; 1.0 when both are zero (plain SGD's optimizer state), inf when only one is.

    >>> estimate_over_measured(0, 0), estimate_over_measured(3, 2)
    (1.0, 1.5)
    """
    if measured == 0:  # plain SGD keeps no optimizer state
        return 1.0 if estimate == 0 else math.inf
    return estimate / measured


def check_workload(config: GPTConfig, batch_size: int, seq_len: int, precision: str, optimizer: str) -> None:
    """Raise ValueError for a workload the estimates do not cover: sizes, precision, optimizer."""
    for name, value in (("batch_size", batch_size), ("seq_len", seq_len)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if seq_len > config.block_size:
        raise ValueError(f"seq_len {seq_len} is longer than the model's block_size {config.block_size}")
    if precision not in PRECISIONS:
        raise ValueError(f"unknown precision {precision!r}; choose one of {', '.join(PRECISIONS)}")
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {optimizer!r}; choose one of {', '.join(OPTIMIZERS)}")


def estimate_training_memory(
    config: GPTConfig,
    *,
    batch_size: int,
    seq_len: int,
    precision: str = "float32",
    optimizer: str = "adamw",
    checkpointing: bool | None = None,
) -> TrainingMemory:
    """Closed-form bytes of one training step of ``GPT(config)``; ``checkpointing=None`` follows the config.

    >>> from perflab.models import GPTConfig
    >>> estimate_training_memory(GPTConfig(), batch_size=32, seq_len=128, precision="bfloat16").activations
    85099524
    """
    check_workload(config, batch_size, seq_len, precision, optimizer)
    checkpointing = config.checkpoint_blocks if checkpointing is None else checkpointing
    C, L = config.n_embd, config.n_layer
    # Per block: two LayerNorms (2C each), qkv (3C^2 + 3C), proj (C^2 + C), up (4C^2 + 4C),
    # down (4C^2 + C). The output head shares the token embedding's matrix, so it adds nothing.
    parameter_count = config.vocab_size * C + config.block_size * C + L * (12 * C * C + 13 * C) + 2 * C
    parameter_tensors = 2 + 12 * L + 2  # embeddings, 12 per block, the final LayerNorm
    weights = parameter_count * _FLOAT32  # autocast leaves the weights (and so their gradients) in float32
    optimizer_state = {
        # exp_avg and exp_avg_sq per parameter, and a float32 step count per tensor
        "adamw": 2 * weights + parameter_tensors * _FLOAT32,
        "sgd": 0,
        "sgd_momentum": weights,  # one momentum buffer per parameter
    }[optimizer]
    return TrainingMemory(
        parameters=weights,
        gradients=weights,
        optimizer_state=optimizer_state,
        activations=_activation_bytes(config, batch_size, seq_len, precision, checkpointing),
        source="estimate",
    )


def _activation_bytes(config: GPTConfig, batch: int, length: int, precision: str, checkpointing: bool) -> int:
    """Bytes autograd keeps for backward: embeddings, the blocks, then the head and the loss."""
    tokens, C, V = batch * length, config.n_embd, config.vocab_size
    autocast = precision == "bfloat16"
    matmul = _BFLOAT16 if autocast else _FLOAT32  # what matmul inputs are saved in
    residual = tokens * C * _FLOAT32  # the residual stream stays float32 under autocast
    # On the CPU dropout multiplies by a noise tensor of the input's dtype, and keeps that.
    embeddings = tokens * _INT64 + length * _INT64 + (residual if config.dropout > 0 else 0)  # ids, positions
    if checkpointing:
        blocks = config.n_layer * residual  # only each block's input; the rest is recomputed in backward
    else:
        blocks = config.n_layer * _block_bytes(config, batch, length, matmul)
    head = (
        residual
        + 2 * tokens * _FLOAT32  # final LayerNorm: its input, mean and 1/std per token
        + tokens * C * matmul  # the output head's input
        + (V * C * _BFLOAT16 if autocast else 0)  # the head's bfloat16 copy of the tied embedding matrix
        + tokens * V * _FLOAT32  # log-probabilities: cross_entropy runs on float32 logits
        + tokens * _INT64
        + _FLOAT32  # targets, and the loss's normalizer (a float32 scalar)
    )
    return embeddings + blocks + head


def _block_bytes(config: GPTConfig, batch: int, length: int, matmul: int) -> int:
    """One transformer block.

    Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models")
    count ``s b h (34 + 5 a s / h)`` bytes per layer for 16-bit activations, sequence s, batch b,
    width h, a heads: 4sbh for LayerNorms, 11sbh + 5as^2b for attention (softmax output, its
    dropout mask and the dropped-out probabilities), 19sbh for the MLP with its dropout mask.
    This model has no attention dropout, its LayerNorms keep float32 inputs (the residual stream
    stays float32 under autocast) and per-token statistics, and autocast keeps bfloat16 weight
    copies: without dropout, naive attention in bfloat16 keeps 36sbh + 2as^2b, plus 16sb for the
    statistics, s^2 for the mask and 24h^2 for the weights.
    """
    tokens, C = batch * length, config.n_embd
    residual = tokens * C * _FLOAT32
    activation = tokens * C * matmul  # one (B, T, C) tensor as matmul inputs are saved
    total = (
        2 * (residual + 2 * tokens * _FLOAT32)  # both LayerNorms: float32 input, mean and 1/std
        + activation  # qkv's input
        + _attention_bytes(config, batch, length, matmul)  # from q, k, v to proj's input
        + activation  # up's input
        + 4 * activation  # GELU's input
        + 4 * activation  # down's input
    )
    if config.dropout > 0:
        total += 2 * activation  # noise of the attention and MLP dropouts, in their inputs' dtype
    if matmul == _BFLOAT16:
        total += 12 * C * C * _BFLOAT16  # autocast's bfloat16 copies of qkv, proj, up and down weights
    return total


def _attention_bytes(config: GPTConfig, batch: int, length: int, matmul: int) -> int:
    """q, k and v, what the attention keeps in between, and its (B, T, C) output that proj keeps."""
    heads = config.n_head
    activation = batch * length * config.n_embd * matmul
    if config.attention == "sdpa":
        # The CPU's flash kernel keeps q, k, v (views of qkv's output), its output (laid out so
        # that proj reads it as a view) and one float32 log-sum-exp per query row.
        return 3 * activation + activation + batch * heads * length * _FLOAT32
    if config.attention == "naive":
        # q @ k^T and probabilities @ v keep q, k and v (copies where matmul folds B and H into
        # one batch dimension; views of qkv's output, the same bytes, where B or H is 1); the
        # causal mask; softmax's T x T output per head, which the CPU's autocast leaves in
        # bfloat16; and the output, copied into (B, T, C).
        return 3 * activation + length * length * _BOOL + batch * heads * length * length * matmul + activation
    return _tiled_attention_bytes(config, batch, length, matmul)


def _tiled_attention_bytes(config: GPTConfig, batch: int, length: int, matmul: int) -> int:
    """``tiled_attention``: autograd keeps every visited tile's probabilities, so this is still O(T^2)."""
    rows, head_dim, tile = batch * config.n_head, config.n_embd // config.n_head, config.tile_size
    # Folding (B, H) of a q/k/v slice into one batch dimension is a view only when B or H is 1;
    # otherwise every matmul copies its tile of q, k or v, once per tile pair.
    copies = batch > 1 and config.n_head > 1
    total = 0 if copies else 3 * batch * length * config.n_embd * matmul  # qkv's output itself
    for q_start in range(0, length, tile):
        q_rows = min(tile, length - q_start)
        q_end = q_start + q_rows  # causal: this query tile reads keys 0 .. q_end - 1
        key_tiles = math.ceil(q_end / tile)
        total += rows * q_rows * q_end * _FLOAT32  # the probabilities exp(scores - max), in float32
        if matmul == _BFLOAT16:
            total += rows * q_rows * q_end * _BFLOAT16  # its bfloat16 copy for probabilities @ v
        if copies:
            total += (key_tiles * q_rows + 2 * q_end) * rows * head_dim * matmul  # the q, k and v tiles
        if q_rows > 1:
            total += q_rows * q_rows * _BOOL  # the causal mask of the diagonal tile
        total += (key_tiles - 1) * rows * q_rows * _FLOAT32  # rescale factors, from the 2nd key tile on
        total += rows * q_rows * (head_dim + 1) * _FLOAT32  # accumulator and running sum, for the division
    return total + batch * length * config.n_embd * matmul  # the output, copied into (B, T, C)


def measure_training_memory(
    config: GPTConfig,
    *,
    batch_size: int,
    seq_len: int,
    precision: str = "float32",
    optimizer: str = "adamw",
    checkpointing: bool | None = None,
    device: str | torch.device = "cpu",
) -> TrainingMemory:
    """Build ``GPT(config)`` on ``device`` and run one training step on random tokens, counting as it goes.

    >>> from perflab.models import GPTConfig
    >>> measure_training_memory(GPTConfig(n_layer=2), batch_size=4, seq_len=64, optimizer="sgd")
    TrainingMemory(measured on cpu, torch ...: 8.31 MB = parameters 1.78 + gradients 1.78 + optimizer state 0.00 + activations 4.74)
    """
    check_workload(config, batch_size, seq_len, precision, optimizer)
    checkpointing = config.checkpoint_blocks if checkpointing is None else checkpointing
    device = torch.device(device)
    model = GPT(replace(config, checkpoint_blocks=checkpointing)).to(device).train()
    parameters = list(model.parameters())  # the tied embedding / head matrix once
    idx, targets = torch.randint(config.vocab_size, (2, batch_size, seq_len), device=device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "bfloat16")
    with saved_tensors() as kept, autocast:
        _, loss = model(idx, targets)
    weights = _storages(parameters)
    activations = sum(nbytes for address, nbytes in kept.storages.items() if address not in weights)
    loss.backward()
    gradients = sum(_storages(p.grad for p in parameters).values())
    torch_optimizer = _make_optimizer(optimizer, parameters)
    torch_optimizer.step()
    state = (value for values in torch_optimizer.state.values() for value in values.values() if torch.is_tensor(value))
    return TrainingMemory(
        parameters=sum(weights.values()),
        gradients=gradients,
        optimizer_state=sum(_storages(state).values()),
        activations=activations,
        source=f"measured on {device}, torch {torch.__version__}",
        peak_allocated=torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None,
    )


def _storages(tensors: Iterable[torch.Tensor]) -> dict[int, int]:
    """Storage address -> bytes, so that tensors sharing memory count once."""
    return {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}


def _make_optimizer(name: str, parameters: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    if name == "adamw":
        return torch.optim.AdamW(parameters, lr=1e-3)
    return torch.optim.SGD(parameters, lr=0.1, momentum=0.9 if name == "sgd_momentum" else 0.0)
