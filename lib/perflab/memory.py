"""Memory meters that work on every device.

    >>> import torch
    >>> from perflab.memory import allocator_peak, peak_memory, saved_tensors
    >>> from perflab.models import ResNet, ResNetConfig
    >>> from perflab.models.gpt import naive_attention
    >>> model, images = ResNet(ResNetConfig()), torch.randn(16, 3, 32, 32)
    >>> with saved_tensors() as saved:
    ...     loss = model(images).sum()      # forward only: what autograd keeps for backward
    >>> saved
    SavedTensors(3.07 MB in 73 tensors kept for backward)
    >>> f"{saved.bytes_excluding(model.parameters()) / 1e6:.2f} MB of activations"   # without the weights
    '2.76 MB of activations'
    >>> f"{saved.packed_bytes / 1e6:.2f} MB saved, a tensor counted each time an op saves it"
    '4.58 MB saved, a tensor counted each time an op saves it'
    >>> q = k = v = torch.randn(1, 4, 512, 32)
    >>> with peak_memory() as peak:
    ...     out = naive_attention(q, k, v)  # the most memory the block's tensors held at once
    >>> peak                                # 4 heads of 512 x 512 float32 scores are 4.19 MB
    PeakMemory(8.91 MB at peak, 0.26 MB still held at the end)
    >>> with allocator_peak() as allocated:  # the allocator's own count: compiled code's buffers too
    ...     again = naive_attention(q, k, v)
    >>> allocated
    PeakMemory(8.91 MB at peak, 0.26 MB still held at the end)

On a GPU ``torch.cuda.max_memory_allocated`` also counts the caching allocator's view; the
saved-tensor count is the part of it that activation checkpointing shrinks, on any device.
``packed_bytes`` counts a tensor each time an operation saves it (``bytes`` counts each storage
once): what a pack hook that copies, such as ``torch.autograd.graph.save_on_cpu``, copies.

``allocator_peak`` asks the allocator instead of watching operators, so it also counts the buffers
of code that ``torch.compile`` generated, which calls no operator for them.

Used in: lecture 05 (memory checkpointing), lecture 06 (compile), lecture 08 (flash attention), lecture 09
(sharding), lecture 11 (tensor pipeline parallel), labs 05, 08, 10 and 12.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import weakref
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

__all__ = ["PeakMemory", "SavedTensors", "allocator_peak", "new_tensors", "peak_memory", "saved_tensors"]


@dataclass
class SavedTensors:
    """Tensors autograd still keeps for the backward pass, each storage counted once."""

    storages: dict[int, int] = field(default_factory=dict)  # storage address -> bytes
    packed_bytes: int = 0  # each saved tensor's own bytes, counted every time an operation saved it
    # (the saved tensor, its storage's address, the storage's bytes, the tensor's own bytes), as the hook saw them
    _packed: list[tuple[weakref.ref, int, int, int]] = field(default_factory=list, repr=False, compare=False)

    @property
    def bytes(self) -> int:
        return sum(self.storages.values())

    @property
    def count(self) -> int:
        return len(self.storages)

    def bytes_excluding(self, tensors: Iterable[torch.Tensor]) -> int:
        """The bytes kept in storages that none of ``tensors`` uses: pass the parameters to get the activations."""
        excluded = {tensor.untyped_storage().data_ptr() for tensor in tensors}
        return sum(nbytes for address, nbytes in self.storages.items() if address not in excluded)

    def held_now(self, excluding: Iterable[torch.Tensor] = ()) -> int:
        """Inside the block: the bytes of the saved storages still alive at this moment, ``excluding`` left out.

        Autograd frees what a backward pass used, so called between pieces of work this follows the
        activations held as they rise with each forward and fall with each backward.
        """
        excluded = {tensor.untyped_storage().data_ptr() for tensor in excluding}
        alive = {address: nbytes for ref, address, nbytes, _ in self._packed if ref() is not None}
        return sum(nbytes for address, nbytes in alive.items() if address not in excluded)

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

    Selective activation checkpointing keeps the outputs its policy saves outside the autograd
    graph; pass ``respect_saved_tensors_hooks=True`` to ``torch.utils.checkpoint.checkpoint`` so
    that they pass through these hooks and are counted. Hooks entered inside the block (such as
    ``save_on_cpu``) replace these for what is saved under them.
    """
    saved = SavedTensors()
    packed = saved._packed

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        # The autograd node holds what this returns, so the weak reference dies with the node.
        # Returning ``tensor`` itself would, for an op that saves its own output, make a cycle
        # (node -> output -> its grad_fn -> node) that keeps a discarded node alive for good.
        detached = tensor.detach()
        packed.append((weakref.ref(detached), storage.data_ptr(), storage.nbytes(), tensor.nbytes))
        return detached

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        yield saved
    alive = [entry for entry in packed if entry[0]() is not None]
    saved.storages = {address: nbytes for _, address, nbytes, _ in alive}
    saved.packed_bytes = sum(own_bytes for *_, own_bytes in alive)


@dataclass
class PeakMemory:
    """The most bytes the tensors made inside a block held at once, and what they still hold at its end.

    ``allocator_peak_bytes`` is CUDA's own view (``torch.cuda.max_memory_allocated`` above the
    start), which also counts kernels' workspaces and the allocator's rounding; None elsewhere.
    """

    bytes: int = 0
    held_bytes: int = 0
    allocator_peak_bytes: int | None = None

    def __repr__(self) -> str:
        text = f"PeakMemory({self.bytes / 1e6:.2f} MB at peak, {self.held_bytes / 1e6:.2f} MB still held at the end"
        if self.allocator_peak_bytes is not None:
            text += f"; CUDA allocator peak {self.allocator_peak_bytes / 1e6:.2f} MB"
        return text + ")"


def new_tensors(args, kwargs, out) -> list[torch.Tensor]:
    """The tensors in an operator's output ``out`` that are new memory, for a ``TorchDispatchMode``.

    A view or an in-place op returns storage one of its inputs already has: that is no new memory.
    """
    inputs = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
    return [
        t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs
    ]


class _StorageTracker(TorchDispatchMode):
    """Sees every op's outputs below autograd and counts each new storage until it is freed."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, int] = {}  # storage address -> bytes, for storages made in the block
        self.live_bytes = 0
        self.peak_bytes = 0

    def _release(self, address: int) -> None:
        self.live_bytes -= self.live.pop(address, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in new_tensors(args, kwargs, out):
            storage = tensor.untyped_storage()
            address, nbytes = storage.data_ptr(), storage.nbytes()
            if nbytes == 0 or address in self.live:
                continue
            self.live[address] = nbytes
            self.live_bytes += nbytes
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)
            weakref.finalize(storage, self._release, address)
        return out


@contextlib.contextmanager
def peak_memory(device: torch.device | str | None = None) -> Iterator[PeakMemory]:
    """Measure the peak memory of the tensors a block creates, on any device, forward or backward.

    Counted op by op, as PyTorch's own memory tracker does it: each operator's new output
    storages from the moment they are made until they are freed. Tensors that existed before
    the block are not counted. What a fused kernel allocates inside itself and frees before it
    returns (a workspace) is invisible here; on CUDA ``allocator_peak_bytes`` sees it too.
    Pass ``device="cuda"`` to also read the CUDA allocator's peak.
    """
    result = PeakMemory()
    on_cuda = device is not None and torch.device(device).type == "cuda"
    if on_cuda:
        torch.cuda.synchronize(device)
        start = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
    tracker = _StorageTracker()
    with tracker:
        yield result
    result.bytes, result.held_bytes = tracker.peak_bytes, tracker.live_bytes
    if on_cuda:
        torch.cuda.synchronize(device)
        result.allocator_peak_bytes = torch.cuda.max_memory_allocated(device) - start


@contextlib.contextmanager
def allocator_peak(device: torch.device | str | None = None) -> Iterator[PeakMemory]:
    """The peak of what the allocator handed out inside the block, compiled code's buffers included.

    ``peak_memory`` watches operators, which code generated by ``torch.compile`` does not call:
    Inductor allocates its buffers directly (``empty_strided_cpu``). The allocator sees them. On
    CUDA this is ``torch.cuda.max_memory_allocated`` above the start; on a CPU, where PyTorch keeps
    no such counter, ``torch.profiler`` with ``profile_memory=True`` records every allocation and
    free of the CPU allocator, and the peak is the largest running sum of them. Memory allocated
    before the block and freed inside it is unknown to that record (the profiler warns): release
    such tensors (gradients, say) before the block. Slower than ``peak_memory``: one profile.
    """
    result = PeakMemory()
    if device is not None and torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
        start = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        yield result
        torch.cuda.synchronize(device)
        result.bytes = torch.cuda.max_memory_allocated(device) - start
        result.held_bytes = torch.cuda.memory_allocated(device) - start
        result.allocator_peak_bytes = result.bytes
        return
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as recorded:
        yield result
    with tempfile.TemporaryDirectory() as folder:  # the trace holds the allocations in order, with their sizes
        trace = os.path.join(folder, "trace.json")
        recorded.export_chrome_trace(trace)
        with open(trace) as file:
            events = json.load(file)["traceEvents"]
    allocations = sorted(
        (event for event in events if event.get("name") == "[memory]" and event["args"].get("Device Type") == 0),
        key=lambda event: (event["ts"], event["args"].get("Ev Idx", 0)),
    )
    live = 0
    for event in allocations:
        live += event["args"]["Bytes"]
        result.bytes = max(result.bytes, live)
    result.held_bytes = live
