"""Page faults per training step, and how to keep freed memory in the process (Linux, glibc).

    >>> import torch
    >>> from perflab.allocator import keep_freed_memory, page_faults
    >>> with page_faults() as faults:
    ...     activations = torch.ones(2**24)   # 64 MiB, above any threshold glibc serves from freed memory:
    ...                                       # fresh pages, each 4 KiB faulting in when first written
    >>> faults.count is not None              # the block's minor page faults; None where the system has no count
    True
    >>> keep_freed_memory()                   # for the rest of the process; False (changing nothing) without glibc
    True

A CPU training step allocates and frees tens of megabytes of activations and gradients. glibc's
``malloc`` serves large blocks with fresh memory mappings (from 128 KiB, a threshold it raises
as such blocks are freed), and gives the free memory at the top of its heap back to the
operating system once there is more of it than a threshold. The next step then asks the kernel
for the same memory again: every 4 KiB page is a page fault and a page of zeros written.
:func:`keep_freed_memory` raises both thresholds with ``mallopt``, which is what the
environment variables ``MALLOC_MMAP_THRESHOLD_`` and ``MALLOC_TRIM_THRESHOLD_`` do at start-up,
so that freed blocks are reused. jemalloc and tcmalloc (loaded with ``LD_PRELOAD``) reuse memory
by design; PyTorch's performance tuning guide recommends them for CPU training
(https://pytorch.org/tutorials/recipes/recipes/tuning_guide.html). On a GPU the activations
live in the CUDA caching allocator, which keeps freed blocks already.

Used in: lecture 03 (data loading), lecture 05 (memory checkpointing), lab 03.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import sys
from collections.abc import Iterator
from dataclasses import dataclass

try:
    import resource
except ImportError:  # Windows
    resource = None

__all__ = ["PageFaults", "keep_freed_memory", "page_faults"]

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # from glibc's malloc.h
_LARGEST_MMAP_THRESHOLD = 32 * 2**20  # glibc refuses more on 64-bit machines


@dataclass
class PageFaults:
    """Minor page faults counted by :func:`page_faults`; ``None`` where the system does not count them."""

    count: int | None = None


@contextlib.contextmanager
def page_faults() -> Iterator[PageFaults]:
    """Count the minor page faults of this process (all its threads) inside the block."""
    faults = PageFaults()
    if resource is None:
        yield faults
        return
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    yield faults
    faults.count = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


def keep_freed_memory(keep_bytes: int = 2**30) -> bool:
    """Let glibc keep up to ``keep_bytes`` of freed memory and serve blocks up to 32 MiB from it.

    Lasts for the rest of the process. Returns False, changing nothing, where the C library has
    no ``mallopt`` (macOS, Windows, musl).
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, _LARGEST_MMAP_THRESHOLD)) and bool(mallopt(_M_TRIM_THRESHOLD, keep_bytes))
