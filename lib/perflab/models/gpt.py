"""A small GPT, the transformer workload of the course, in one file, after Karpathy's nanoGPT.

    >>> import torch
    >>> from perflab.models import GPT, GPTConfig
    >>> model = GPT(GPTConfig(vocab_size=256, block_size=128, n_layer=2, attention="tiled"))
    >>> idx = torch.randint(0, 256, (2, 128))
    >>> logits, loss = model(idx, targets=idx)
    >>> logits.shape
    torch.Size([2, 128, 256])
    >>> model.generate(idx[:1, :10], max_new_tokens=5).shape
    torch.Size([1, 15])

Attention comes in three interchangeable implementations, each a function of ``(B, H, T, D)``
queries, keys and values that returns ``(B, H, T, D)``:

- ``naive_attention``: the textbook formula; builds the whole T x T score matrix.
- ``sdpa_attention``: PyTorch's fused ``F.scaled_dot_product_attention``.
- ``tiled_attention``: FlashAttention's algorithm in plain PyTorch; never builds T x T.

``GPTConfig(attention=...)`` picks one; they compute the same function, so a model trained
with one can run with another. Each block runs inside ``record_function("gpt.block{i}")``, a
named region in profiler traces (eager mode only: ``torch.compile`` drops them).

Used in: lectures 01, 04, 05, 07, 08, 09 and 11, labs 05 and 08.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, get_args

import torch
import torch.nn.functional as F
from torch import nn
from torch.profiler import record_function
from torch.utils.checkpoint import checkpoint

__all__ = [
    "AttentionName",
    "Block",
    "CausalSelfAttention",
    "GPT",
    "GPTConfig",
    "MLP",
    "naive_attention",
    "sdpa_attention",
    "tiled_attention",
]


def naive_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True) -> torch.Tensor:
    """softmax(q k^T / sqrt(D)) v, with the full ``(B, H, T, T)`` score matrix in memory."""
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(q.size(-1))
    if causal:
        future = torch.ones(q.size(-2), k.size(-2), dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(future, float("-inf"))
    return F.softmax(scores, dim=-1) @ v


def sdpa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True) -> torch.Tensor:
    """The same function as ``naive_attention``, by whichever fused kernel PyTorch picks for the device."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal)


def tiled_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True, tile_size: int = 64
) -> torch.Tensor:
    """The same function as ``naive_attention``, one ``tile_size x tile_size`` block of scores at a time.

    This is the forward algorithm of FlashAttention (Dao et al., 2022): for each tile of
    queries, walk over the tiles of keys and values, keeping per query row a running maximum
    ``m`` and running sum ``l`` of the exponentiated scores (an "online softmax"). When a new
    tile raises the maximum, everything accumulated so far is rescaled by ``exp(m_old - m_new)``,
    so the result is exact, not an approximation. The largest intermediate is one tile of
    scores, whatever T is; with ``causal=True`` tiles wholly above the diagonal are skipped.

    Autograd differentiates through the loops, but it keeps every tile's probabilities for the
    backward pass, so training memory still grows as T x T in total: FlashAttention avoids
    that with a hand-written backward that recomputes the tiles instead.

    >>> import torch
    >>> q = k = v = torch.randn(1, 2, 200, 16)     # 200 tokens: query and key tiles of 64, 64, 64 and 8
    >>> torch.allclose(tiled_attention(q, k, v), naive_attention(q, k, v), atol=1e-5)
    True
    """
    if tile_size < 1:
        raise ValueError(f"tile_size must be a positive int, got {tile_size!r}")
    scale = 1.0 / math.sqrt(q.size(-1))
    # Statistics and the accumulator stay in (at least) float32 when q is bfloat16 or float16,
    # as in FlashAttention: sums of many small exponentials lose too much in 8 mantissa bits.
    stats_dtype = torch.promote_types(q.dtype, torch.float32)
    num_queries, num_keys = q.size(-2), k.size(-2)
    output_tiles = []
    for q_start in range(0, num_queries, tile_size):
        q_end = min(q_start + tile_size, num_queries)
        q_tile = q[..., q_start:q_end, :]
        running_max = q.new_full((*q_tile.shape[:-1], 1), float("-inf"), dtype=stats_dtype)
        running_sum = torch.zeros_like(running_max)
        accumulator = q.new_zeros(q_tile.shape, dtype=stats_dtype)
        keys_needed = min(q_end, num_keys) if causal else num_keys
        for k_start in range(0, keys_needed, tile_size):
            k_end = min(k_start + tile_size, keys_needed)
            scores = (q_tile @ k[..., k_start:k_end, :].transpose(-2, -1)).to(stats_dtype) * scale
            if causal and k_end > q_start + 1:  # the tile reaches past the diagonal
                query_index = torch.arange(q_start, q_end, device=q.device).unsqueeze(-1)
                key_index = torch.arange(k_start, k_end, device=q.device)
                scores = scores.masked_fill(key_index > query_index, float("-inf"))
            # The result does not depend on which maximum is subtracted (it cancels between
            # numerator and denominator), so no gradient needs to flow through it.
            new_max = torch.maximum(running_max, scores.amax(dim=-1, keepdim=True)).detach()
            # Key 0 is in the first tile and visible to every query, so new_max is finite from
            # the first tile on, and exp(-inf - finite) = 0 wipes the empty initial state.
            rescale = torch.exp(running_max - new_max)
            probabilities = torch.exp(scores - new_max)
            running_sum = running_sum * rescale + probabilities.sum(dim=-1, keepdim=True)
            tile_values = probabilities.to(v.dtype) @ v[..., k_start:k_end, :]
            accumulator = accumulator * rescale + tile_values.to(stats_dtype)
            running_max = new_max
        output_tiles.append((accumulator / running_sum).to(q.dtype))
    return torch.cat(output_tiles, dim=-2)


AttentionName = Literal["naive", "sdpa", "tiled"]
_ATTENTION_NAMES: tuple[str, ...] = get_args(AttentionName)


@dataclass(frozen=True)
class GPTConfig:
    """Sizes of a GPT; change one with ``dataclasses.replace(config, attention="tiled")``.

    The defaults are a 0.84M-parameter model over bytes with a 128-token context.
    """

    vocab_size: int = 256
    block_size: int = 128  # the longest sequence the model accepts (its position embeddings)
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.0
    attention: AttentionName = "sdpa"
    tile_size: int = 64  # used by attention="tiled" only
    checkpoint_blocks: bool = False  # recompute each block's activations in backward instead of storing them

    def __post_init__(self) -> None:
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd", "tile_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.n_embd % self.n_head != 0:
            raise ValueError(
                f"n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head}): "
                "each head gets n_embd // n_head channels"
            )
        if self.attention not in _ATTENTION_NAMES:
            raise ValueError(f"unknown attention {self.attention!r}; choose one of {', '.join(_ATTENTION_NAMES)}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout!r}")


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.qkv = nn.Linear(config.n_embd, 3 * config.n_embd)  # one matmul for q, k and v together
        self.proj = nn.Linear(config.n_embd, config.n_embd)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, channels = x.shape
        heads = self.config.n_head
        # (B, T, 3C) -> three (B, H, T, C/H) tensors
        q, k, v = self.qkv(x).view(batch, length, 3, heads, channels // heads).permute(2, 0, 3, 1, 4)
        # Dropout is applied to the block's output, not to the attention probabilities, so the
        # three implementations compute the same function and can be swapped freely.
        if self.config.attention == "naive":
            y = naive_attention(q, k, v, causal=True)
        elif self.config.attention == "sdpa":
            y = sdpa_attention(q, k, v, causal=True)
        else:
            y = tiled_attention(q, k, v, causal=True, tile_size=self.config.tile_size)
        y = y.transpose(1, 2).reshape(batch, length, channels)
        return self.dropout(self.proj(y))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.up = nn.Linear(config.n_embd, 4 * config.n_embd)
        self.down = nn.Linear(4 * config.n_embd, config.n_embd)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.down(F.gelu(self.up(x))))


class Block(nn.Module):
    """Pre-LayerNorm transformer block: x + attention(LN(x)), then x + MLP(LN(x))."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_attention = nn.LayerNorm(config.n_embd)
        self.attention = CausalSelfAttention(config)
        self.ln_mlp = nn.LayerNorm(config.n_embd)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.ln_attention(x))
        return x + self.mlp(self.ln_mlp(x))


class GPT(nn.Module):
    """Decoder-only language model: ``(B, T)`` token ids -> ``(B, T, vocab_size)`` next-token logits."""

    def __init__(self, config: GPTConfig | None = None) -> None:
        super().__init__()
        self.config = config if config is not None else GPTConfig()
        self.token_embedding = nn.Embedding(self.config.vocab_size, self.config.n_embd)
        self.position_embedding = nn.Embedding(self.config.block_size, self.config.n_embd)
        self.dropout = nn.Dropout(self.config.dropout)
        self.blocks = nn.ModuleList(Block(self.config) for _ in range(self.config.n_layer))
        self.ln_final = nn.LayerNorm(self.config.n_embd)
        self.lm_head = nn.Linear(self.config.n_embd, self.config.vocab_size, bias=False)
        # Weight tying (Press & Wolf, 2017): reading a token in and predicting it out share one
        # matrix, which saves vocab_size * n_embd parameters and helps small models.
        self.lm_head.weight = self.token_embedding.weight
        self.apply(self._init_weights)
        # GPT-2's scaled init: each residual branch's last layer is scaled down by
        # 1/sqrt(2 * n_layer) so that the residual stream's variance does not grow with depth.
        for name, parameter in self.named_parameters():
            if name.endswith(("proj.weight", "down.weight")):
                nn.init.normal_(parameter, mean=0.0, std=0.02 / math.sqrt(2 * self.config.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits for every position, and the mean cross-entropy against ``targets`` when given."""
        length = idx.size(1)
        if length > self.config.block_size:
            raise ValueError(f"sequence of length {length} is longer than block_size {self.config.block_size}")
        positions = torch.arange(length, device=idx.device)
        x = self.dropout(self.token_embedding(idx) + self.position_embedding(positions))
        for i, block in enumerate(self.blocks):
            with record_function(f"gpt.block{i}"):
                if self.config.checkpoint_blocks and self.training:
                    x = checkpoint(block, x, use_reentrant=False)
                else:
                    x = block(x)
        logits = self.lm_head(self.ln_final(x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
        return logits, loss

    @torch.no_grad()
    def generate(
        self, idx: torch.Tensor, max_new_tokens: int, temperature: float = 1.0, top_k: int | None = None
    ) -> torch.Tensor:
        """Extend ``(B, T)`` token ids by ``max_new_tokens`` sampled tokens; returns ``(B, T + max_new_tokens)``.

        Lower ``temperature`` makes sampling greedier; ``top_k`` samples only among the k most
        likely tokens. Each step reruns the model on the last ``block_size`` tokens (no KV cache).
        """
        for _ in range(max_new_tokens):
            context = idx[:, -self.config.block_size :]
            logits, _ = self(context)
            logits = logits[:, -1, :].float() / temperature
            if top_k is not None:
                kth_largest = torch.topk(logits, min(top_k, logits.size(-1))).values[:, [-1]]
                logits = logits.masked_fill(logits < kth_largest, float("-inf"))
            next_token = torch.multinomial(F.softmax(logits, dim=-1), num_samples=1)
            idx = torch.cat((idx, next_token), dim=1)
        return idx
