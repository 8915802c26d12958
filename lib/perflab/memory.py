"""Memory meters that work on every device.

    >>> from perflab.memory import saved_tensors
    >>> with saved_tensors() as saved:
    ...     loss = model(images).sum()      # forward only: what autograd keeps for backward
    >>> saved
    SavedTensors(2.10 MB in 31 tensors kept for backward)

On a GPU ``torch.cuda.max_memory_allocated`` also counts the caching allocator's view; the
saved-tensor count is the part of it that activation checkpointing shrinks, on any device.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Iterator

import torch


@dataclass
class SavedTensors:
    """Tensors autograd stored for the backward pass, each storage counted once."""

    storages: dict[int, int] = field(default_factory=dict)  # storage address -> bytes

    @property
    def bytes(self) -> int:
        return sum(self.storages.values())

    @property
    def count(self) -> int:
        return len(self.storages)

    def __repr__(self) -> str:
        return f"SavedTensors({self.bytes / 1e6:.2f} MB in {self.count} tensors kept for backward)"


@contextlib.contextmanager
def saved_tensors() -> Iterator[SavedTensors]:
    """Count what autograd saves for backward inside this block (parameters included).

    Several saved tensors often share one storage (a view and its base, a weight saved by
    two ops): counting storages, not tensors, gives the memory actually held.
    """
    saved = SavedTensors()

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        saved.storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        yield saved
