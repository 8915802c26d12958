"""perflab.memory_budget: the closed-form training-memory estimate against a measured step."""

from __future__ import annotations

import itertools

import pytest
import torch
from perflab.memory_budget import (
    COMPONENTS,
    OPTIMIZERS,
    PRECISIONS,
    estimate_training_memory,
    measure_training_memory,
)
from perflab.models import GPTConfig
from perflab.plots import memory_curve

# (n_layer, n_embd, n_head, seq_len, batch_size, dropout, tile_size), each shape chosen for a case
# the formulas treat apart: batch 1 and one head make q/k/v tiles views instead of copies, 40 and
# 17 tokens leave ragged last tiles (17: a one-row tile, which needs no causal mask).
SHAPES = {
    "batch1": (1, 32, 2, 16, 1, 0.0, 16),
    "wide": (2, 64, 4, 128, 4, 0.0, 32),
    "onehead-dropout": (2, 32, 1, 40, 3, 0.1, 16),
    "ragged-dropout": (1, 48, 4, 17, 2, 0.2, 8),
}


def gpt_config(shape: str, attention: str) -> GPTConfig:
    n_layer, n_embd, n_head, _, _, dropout, tile_size = SHAPES[shape]
    return GPTConfig(
        vocab_size=64,
        block_size=128,
        n_layer=n_layer,
        n_embd=n_embd,
        n_head=n_head,
        attention=attention,
        dropout=dropout,
        tile_size=tile_size,
    )


@pytest.fixture(autouse=True)
def one_thread():
    # These tensors are tiny: a second thread buys nothing, and on a shared two-core machine
    # its spin-waiting made each step up to a hundred times slower.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize(
    "shape, attention, precision, checkpointing, optimizer",
    list(itertools.product(SHAPES, ("naive", "sdpa", "tiled"), PRECISIONS, (False, True), OPTIMIZERS)),
)
def test_estimate_matches_measurement(shape, attention, precision, checkpointing, optimizer):
    # Exact, activations included: the estimate counts every tensor each op keeps, so any
    # difference means the formula misses one, or a torch upgrade changed what an op saves
    # (torch is pinned, and the course's numbers should then be looked at again).
    config = gpt_config(shape, attention)
    workload = dict(
        batch_size=SHAPES[shape][4],
        seq_len=SHAPES[shape][3],
        precision=precision,
        optimizer=optimizer,
        checkpointing=checkpointing,
    )
    estimate = estimate_training_memory(config, **workload)
    measured = measure_training_memory(config, **workload)
    comparison = estimate.compare(measured)
    for component in COMPONENTS:
        assert getattr(estimate, component) == getattr(measured, component), comparison
    assert set(comparison.ratios.values()) == {1.0}


BATCH, HEADS = 2, 4


def seq_len_squared_bytes(attention: str) -> float:
    """The T^2 coefficient of the measured activations, from T = 32, 64 and 96 tokens.

    For a(T) = q T^2 + l T + c the second difference a(96) - 2 a(64) + a(32) is 2 * 32^2 * q,
    whatever l and c are: it is 0 for memory that grows linearly.
    """
    config = GPTConfig(
        vocab_size=64, block_size=128, n_layer=1, n_embd=32, n_head=HEADS, attention=attention, tile_size=16
    )
    small, medium, large = (
        measure_training_memory(config, batch_size=BATCH, seq_len=seq_len).activations for seq_len in (32, 64, 96)
    )
    return (large - 2 * medium + small) / (2 * 32**2)


def test_naive_attention_memory_grows_quadratically():
    # at least one float32 probability per head for every (query, key) pair
    assert seq_len_squared_bytes("naive") >= BATCH * HEADS * 4


def test_tiled_attention_memory_still_grows_quadratically():
    # autograd keeps every tile's probabilities; causal skipping saves only the upper half
    assert seq_len_squared_bytes("tiled") >= BATCH * HEADS * 4 / 2


def test_sdpa_memory_grows_linearly():
    assert seq_len_squared_bytes("sdpa") == 0


@pytest.mark.parametrize("attention", ["naive", "sdpa", "tiled"])
def test_checkpointing_cuts_activations(attention):
    config = GPTConfig(vocab_size=64, block_size=128, n_layer=2, n_embd=32, n_head=4, attention=attention)
    kept = {
        checkpointing: measure_training_memory(config, batch_size=2, seq_len=64, checkpointing=checkpointing)
        for checkpointing in (False, True)
    }
    assert kept[True].activations < kept[False].activations / 3
    assert kept[True].parameters == kept[False].parameters


def test_checkpointing_defaults_to_the_config():
    config = GPTConfig(n_layer=2, checkpoint_blocks=True)
    assert estimate_training_memory(config, batch_size=2, seq_len=32) == estimate_training_memory(
        config, batch_size=2, seq_len=32, checkpointing=True
    )


@pytest.mark.parametrize("calculate", [estimate_training_memory, measure_training_memory])
@pytest.mark.parametrize(
    "bad, message",
    [
        (dict(optimizer="lion"), "unknown optimizer 'lion'; choose one of adamw, sgd, sgd_momentum"),
        (dict(precision="float16"), "unknown precision 'float16'; choose one of float32, bfloat16"),
        (dict(batch_size=0), "batch_size must be a positive int, got 0"),
        (dict(seq_len=-1), "seq_len must be a positive int, got -1"),
        (dict(seq_len=129), "seq_len 129 is longer than the model's block_size 128"),
    ],
)
def test_bad_input_is_refused_with_a_clear_message(calculate, bad, message):
    workload = dict(batch_size=2, seq_len=16) | bad
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        calculate(GPTConfig(), **workload)


def test_results_show_megabytes_and_ratios():
    config = GPTConfig(vocab_size=64, n_layer=1, n_embd=32)
    estimate = estimate_training_memory(config, batch_size=2, seq_len=16, optimizer="sgd")
    measured = measure_training_memory(config, batch_size=2, seq_len=16, optimizer="sgd")
    assert repr(estimate).startswith("TrainingMemory(estimate: ")
    assert "optimizer state 0.00" in repr(estimate)
    assert "measured on cpu" in repr(measured)
    assert estimate.total == sum(getattr(estimate, component) for component in COMPONENTS)
    assert "<table>" in estimate._repr_html_() and "MB" in estimate._repr_html_()
    comparison = estimate.compare(measured)
    assert comparison.ratios["optimizer_state"] == 1.0  # nothing estimated, nothing measured
    assert "activations 1.000" in repr(comparison)
    assert "estimate / measured" in comparison._repr_html_()
    assert measured.peak_allocated is None  # only CUDA reports an allocator peak


def test_memory_curve_stacks_each_component_to_the_total():
    lengths = [64, 128, 256]
    estimates = [
        estimate_training_memory(GPTConfig(n_layer=2, block_size=256), batch_size=4, seq_len=length)
        for length in lengths
    ]
    figure = memory_curve(lengths, estimates, knob="sequence length (tokens)", caption="estimated for a 2-layer GPT")
    ax = figure.axes[0]
    assert ax.get_title() and ax.get_xlabel() == "sequence length (tokens)" and "MB" in ax.get_ylabel()
    top = ax.collections[-1].get_paths()[0].vertices[:, 1].max()
    assert top == pytest.approx(estimates[-1].total / 1e6)
    assert [text.get_text() for text in ax.get_legend().get_texts()] == [
        "parameters",
        "gradients",
        "optimizer state",
        "activations",
    ]
    assert any("estimated" in text.get_text() for text in figure.texts)
