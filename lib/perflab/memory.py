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
import weakref
from dataclasses import dataclass, field
from typing import Iterator

import torch


@dataclass
class SavedTensors:
    """Tensors autograd still keeps for the backward pass, each storage counted once."""

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
    """Count what autograd keeps for backward from this block (parameters included).

    Counted when the block ends, so keep its output (the loss) alive to the end of the block:
    a discarded output frees its graph and what it saved. Only storages still held then count,
    which drops what an op saved for a result that was then thrown away (``tiled_attention``
    detaches each tile's running maximum), and a freed address that gets reused is not
    mistaken for the new storage. Several saved tensors often share one storage (a view and
    its base, a weight saved by two ops): counting storages gives the memory actually held.
    """
    saved = SavedTensors()
    packed: list[tuple[weakref.ref, int, int]] = []  # (the saved tensor, its storage's address, bytes)

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        # The autograd node holds what this returns, so the weak reference dies with the node.
        # Returning ``tensor`` itself would, for an op that saves its own output, make a cycle
        # (node -> output -> its grad_fn -> node) that keeps a discarded node alive for good.
        detached = tensor.detach()
        packed.append((weakref.ref(detached), storage.data_ptr(), storage.nbytes()))
        return detached

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        yield saved
    saved.storages = {address: nbytes for tensor, address, nbytes in packed if tensor() is not None}
