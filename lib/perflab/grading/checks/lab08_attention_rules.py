"""Lab 08's rules and calls, shared by its checks: the course's own copy of the rules a learner's attention runs
under, and one call of flash_attention on inputs drawn from a seed.

    >>> from perflab.grading.checks.lab08_attention_rules import AttentionCase
    >>> case = AttentionCase((1, 2, 100, 8), key_length=100, tile_size=32, scale=1.0, tensor_seed=7)
    >>> [tuple(x.shape) for x in case.inputs()], case.largest_allowed()
    ([(1, 2, 100, 8), (1, 2, 100, 8), (1, 2, 100, 8)], 2048)

Used by perflab.grading.checks.lab08_attention and perflab.grading.checks.lab08_attention_memory.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch
from torch.overrides import TorchFunctionMode

import perflab.models.gpt

__all__ = ["AttentionCase", "error_text", "library_attention_refused"]


class _RefuseLibraryAttention(TorchFunctionMode):
    """Sees every torch function and operator call, whatever name it was reached by."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if "scaled_dot_product" in getattr(func, "__name__", ""):
            raise AssertionError(f"flash_attention must compute attention itself, not call {func.__name__}")
        return func(*args, **(kwargs or {}))


def _refuse(*args, **kwargs):
    raise AssertionError("flash_attention must compute attention itself, not call the course library's version")


@contextlib.contextmanager
def library_attention_refused():
    """The lab's rules, the grader's own copy: SDPA (any of its operators) and the library's attention raise."""
    library = (perflab.models.gpt.tiled_attention, perflab.models.gpt.sdpa_attention)
    originals = [function.__code__ for function in library]
    try:
        for function in library:
            function.__code__ = _refuse.__code__  # swapping the code catches the function under any name
        with _RefuseLibraryAttention():
            yield
    finally:
        for function, code in zip(library, originals):
            function.__code__ = code


def error_text(error: Exception) -> str:
    return f"{type(error).__name__}: {str(error)[:200]}"


@dataclass(frozen=True)
class AttentionCase:
    """One call of flash_attention: q (B, H, Tq, D), keys and values (B, H, Tk, D), its tile and score scale."""

    shape: tuple[int, int, int, int]
    key_length: int
    tile_size: int
    scale: float
    tensor_seed: int

    def inputs(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        generator = torch.Generator().manual_seed(self.tensor_seed)
        batch, heads, _, head_dim = self.shape
        keys = (batch, heads, self.key_length, head_dim)
        q = torch.randn(self.shape, generator=generator) * self.scale
        k = torch.randn(keys, generator=generator) * self.scale
        return q, k, torch.randn(keys, generator=generator)

    def largest_allowed(self) -> int:
        """No more numbers than q holds, or than one tile_size x tile_size block of scores per head."""
        batch, heads, _, _ = self.shape
        return max(math.prod(self.shape), batch * heads * self.tile_size**2)

    def __str__(self) -> str:
        return f"q {self.shape}, {self.key_length} keys, tile_size={self.tile_size}, scores x{self.scale**2:g}"
