"""One training run of each kind of bottleneck, planted on purpose: the diagnosis's test cases.

    >>> from perflab.diagnose import diagnose
    >>> from perflab.planted import PLANTED_KINDS, planted_run
    >>> from perflab.plots import diagnosis_shares
    >>> diagnoses = {kind: diagnose(planted_run(kind)) for kind in PLANTED_KINDS}
    >>> {kind: diagnosis.kind for kind, diagnosis in diagnoses.items()}   # each one named right
    {'data-bound': 'data-bound', 'compute-bound': 'compute-bound',
     'memory-bound': 'memory-bound', 'overhead-bound': 'overhead-bound'}
    >>> diagnosis_shares(diagnoses, caption="the planted runs, on this machine")   # perflab.plots: one bar each
    <Figure size ... with 1 Axes>

Each run takes a second or a few on a 2-core CPU, and is sized so that its kind wins by a wide
margin there (on a quiet 2-core EPYC, the deciding share measured at least 1.6 times the next; slowed to
a third of that CPU and shared with a busy process, each run was still named right, by as little as 1.3
times). They run on the CPU whatever the machine has, because a GPU moves the balance: its convolutions are so fast that the compute-bound run's batch would leave it
waiting on Python, overhead-bound. A run's kind belongs to the run *and* the machine. They also run on one thread: a multi-threaded operator on
a machine shared with other busy processes can stall many times over waiting for its second
thread to be scheduled, which would misname the run.

Used in: lecture 02 (profiling).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import replace

import torch
from torch.profiler import profile, record_function

from perflab.models import GPT, GPTConfig, ResNetConfig
from perflab.profiling import ProfiledRun, profile_training
from perflab.train import NAIVE, OPTIMIZED, Workload

__all__ = ["PLANTED_IMAGES", "PLANTED_KINDS", "planted_run"]

PLANTED_KINDS = ("data-bound", "compute-bound", "memory-bound", "overhead-bound")
# 300 small generated JPEGs: a few seconds to generate once, then found in the data cache.
PLANTED_IMAGES = Workload(num_classes=3, train_per_class=100, val_per_class=8, image_size=32, epochs=1)


@contextlib.contextmanager
def _one_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@_one_thread()
def _data_bound() -> ProfiledRun:
    """Per-sample JPEG decoding and PIL transforms in the training process, feeding a narrow ResNet."""
    return profile_training(
        NAIVE, replace(PLANTED_IMAGES, model=ResNetConfig(widths=(4, 8, 16))), steps=6, device="cpu"
    )


@_one_thread()
def _compute_bound() -> ProfiledRun:
    """Batches already in memory, a wider ResNet and a batch of 128: convolutions fill the step."""
    return profile_training(
        replace(OPTIMIZED, name="wide ResNet, batch 128", pipeline="memory", batch_size=128),
        replace(PLANTED_IMAGES, model=ResNetConfig(widths=(32, 64, 128))),
        steps=4,
        device="cpu",
    )


@_one_thread()
def _memory_bound(steps: int = 2) -> profile:
    """A GPT with 16 heads 4 wide over 512 tokens and textbook attention: the 512 x 512 scores'
    softmax, scaling and masking outweigh the thin matmuls that make them."""
    config = GPTConfig(n_layer=2, n_head=16, n_embd=64, block_size=512, attention="naive")
    torch.manual_seed(0)
    model = GPT(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens, targets = torch.randint(config.vocab_size, (2, 2, 512))

    def step():
        with record_function("fwd"):
            _, loss = model(tokens, targets)
        with record_function("bwd"):
            loss.backward()
        with record_function("opt"):
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

    step()  # allocations, the optimizer's state
    with profile() as profiler:
        for _ in range(steps):
            step()
    return profiler


@_one_thread()
def _overhead_bound() -> ProfiledRun:
    """One image per step through a tiny ResNet: Python and dispatch between operators that do almost nothing."""
    return profile_training(
        replace(OPTIMIZED, name="tiny ResNet, batch 1", pipeline="memory", batch_size=1, channels_last=False),
        replace(PLANTED_IMAGES, model=ResNetConfig(widths=(4, 8, 8))),
        steps=12,
        device="cpu",
    )


_PLANTED_RUNS = dict(zip(PLANTED_KINDS, (_data_bound, _compute_bound, _memory_bound, _overhead_bound)))


def planted_run(kind: str) -> ProfiledRun | profile:
    """Run and profile the planted run of ``kind``, one of :data:`PLANTED_KINDS`."""
    if kind not in _PLANTED_RUNS:
        raise ValueError(f"no planted run of kind {kind!r}; the kinds are {', '.join(PLANTED_KINDS)}")
    return _PLANTED_RUNS[kind]()
