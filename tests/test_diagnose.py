"""perflab.diagnose: one run of each kind of bottleneck, each named from its own profile.

Each run is built so that its bottleneck is large on any machine, not only on this one: the
deciding share is well over any other (measured on a 2-core CPU: about 1.8x or more).
"""
from __future__ import annotations

import html
from dataclasses import replace

import pytest
import torch
from torch.profiler import profile, record_function

from perflab.diagnose import diagnose
from perflab.models import GPT, GPTConfig, ResNetConfig
from perflab.profile import profile_training
from perflab.train import NAIVE, OPTIMIZED, Workload

IMAGES = Workload(num_classes=3, train_per_class=100, val_per_class=8, image_size=32, epochs=1)
pytestmark = pytest.mark.usefixtures("private_data_cache")  # conftest.py


def _profile_naive_attention_training(steps: int = 3) -> profile:
    """A GPT whose heads are 4 wide over 512 tokens: the T x T scores' softmax, scaling and masking
    outweigh the thin matmuls that make them."""
    config = GPTConfig(n_layer=2, n_head=16, n_embd=64, block_size=512, attention="naive")
    torch.manual_seed(0)
    model = GPT(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens, targets = torch.randint(config.vocab_size, (2, 4, 512))

    def step():
        with record_function("fwd"):
            _, loss = model(tokens, targets)
        with record_function("bwd"):
            loss.backward()
        with record_function("opt"):
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

    step()  # warm-up: allocations, the optimizer's state
    with profile() as profiler:
        for _ in range(steps):
            step()
    return profiler


RUNS = {
    # per-sample PIL decoding and transforms in the training process, a narrow model
    "data-bound": lambda: profile_training(NAIVE, replace(IMAGES, model=ResNetConfig(widths=(8, 16, 32))), steps=6),
    # batches already in memory, a wider model, a large batch: convolutions fill the step
    "compute-bound": lambda: profile_training(replace(OPTIMIZED, pipeline="memory", batch_size=128),
                                              replace(IMAGES, model=ResNetConfig(widths=(32, 64, 128))), steps=4),
    "memory-bound": _profile_naive_attention_training,
    # one image per step through a tiny model: Python and dispatch between small operators
    "overhead-bound": lambda: profile_training(replace(OPTIMIZED, pipeline="memory", batch_size=1, channels_last=False),
                                               replace(IMAGES, model=ResNetConfig(widths=(4, 8, 8))), steps=12),
}


@pytest.mark.parametrize("kind", RUNS)
def test_each_kind_of_run_is_named_from_its_profile(kind):
    diagnosis = diagnose(RUNS[kind]())
    assert diagnosis.kind == kind, diagnosis
    assert sum(diagnosis.shares.values()) == pytest.approx(1)
    assert kind in repr(diagnosis) and html.escape(diagnosis.advice) in diagnosis._repr_html_()


def test_evidence_names_the_operators_behind_the_shares():
    diagnosis = diagnose(RUNS["compute-bound"]())
    name, kind, share = diagnosis.operators[0]
    assert "conv" in name and kind == "compute" and 0 < share < diagnosis.shares["compute"] + 1e-9
    assert [s for _, _, s in diagnosis.operators] == sorted((s for _, _, s in diagnosis.operators), reverse=True)


def test_a_profile_without_phases_is_refused_with_what_to_do():
    with profile() as profiler:
        torch.randn(64, 64) @ torch.randn(64, 64)
    with pytest.raises(ValueError, match="record_function"):
        diagnose(profiler)
