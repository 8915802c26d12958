"""perflab.tradeoff: memory and time of variants of a step, measured together (chapter 05's trade-off curve)."""

from __future__ import annotations

import pytest
import torch
from perflab.plots import tradeoff_curve
from perflab.tradeoff import measure_tradeoff


def test_memory_is_what_each_variant_keeps_and_peaks_at():
    weight = torch.randn(1000, 1000, requires_grad=True)
    variants = {
        "exp": lambda: weight.exp().sum(),  # keeps its 4 MB output for backward
        "times two": lambda: (weight * 2).sum(),  # keeps nothing
        "square": lambda: (weight * weight).sum(),  # keeps only the weight itself, which is not an activation
    }
    tradeoff = measure_tradeoff(variants, parameters=[weight], rounds=1, device="cpu")
    assert [v.label for v in tradeoff.variants] == list(variants)
    assert tradeoff["exp"].saved_bytes == weight.nbytes
    assert tradeoff["times two"].saved_bytes == 0
    assert tradeoff["square"].saved_bytes == 0
    # the output and the gradient (4 MB each) exist together during backward
    assert tradeoff["exp"].peak_bytes >= 2 * weight.nbytes
    assert all(v.peak_bytes >= weight.nbytes for v in tradeoff.variants)  # every run allocates the gradient afresh
    assert weight.grad is None, "the gradients a measurement made are not left behind"


def test_time_is_relative_to_the_first_variant_and_sees_three_times_the_work():
    inputs, weight = torch.randn(256, 1024), torch.randn(1024, 1024, requires_grad=True)

    def once():
        return (inputs @ weight).sum()

    def thrice():
        return (inputs @ weight).sum() + (inputs @ weight).sum() + (inputs @ weight).sum()

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # on a shared two-core machine a second thread stalls waiting for a busy core
    try:
        tradeoff = measure_tradeoff({"once": once, "thrice": thrice}, parameters=[weight], rounds=5, device="cpu")
    finally:
        torch.set_num_threads(threads)
    assert tradeoff.relative_time("once") == 1.0
    # interleaved rounds: drift of a busy machine hits both; 3x the work stays well above 1.5x
    assert tradeoff.relative_time("thrice") > 1.5
    assert all(len(v.times) == 5 and v.median > 0 for v in tradeoff.variants)


def test_results_show_as_a_table_and_a_curve():
    weight = torch.randn(100, 100, requires_grad=True)
    tradeoff = measure_tradeoff(
        {"plain": lambda: weight.exp().sum(), "cheap": lambda: (weight * 2).sum()},
        parameters=[weight],
        rounds=1,
        device="cpu",
    )
    text = repr(tradeoff)
    assert text.splitlines()[-1].startswith("2 variants; forward + backward on cpu, median of 1 interleaved rounds")
    assert "time relative to 'plain'" in text and "cheap" in text and "MB" in text and "1.00x" in text
    assert "<table>" in tradeoff._repr_html_() and "cheap" in tradeoff._repr_html_()
    figure = tradeoff_curve(tradeoff, caption="a test machine")
    ax = figure.axes[0]
    assert ax.get_title() and ax.get_xlabel() == "memory (MB)" and "relative to 'plain'" in ax.get_ylabel()
    assert [text.get_text() for text in ax.texts] == ["plain", "cheap"]
    assert any("a test machine" in text.get_text() and "cpu" in text.get_text() for text in figure.texts)
    with pytest.raises(KeyError, match="no variant 'other'"):
        tradeoff.relative_time("other")


@pytest.mark.parametrize(
    "variants, rounds, message",
    [
        ({}, 3, "at least one variant"),
        ({"a": lambda: torch.ones(1, requires_grad=True).sum()}, 0, "rounds must be a positive int, got 0"),
    ],
)
def test_bad_input_is_refused_with_a_clear_message(variants, rounds, message):
    with pytest.raises(ValueError, match=message):
        measure_tradeoff(variants, parameters=[], rounds=rounds, device="cpu")


def test_a_meter_replaces_the_operator_count_for_the_peak():
    from perflab.memory import allocator_peak

    weight = torch.randn(256, 256, requires_grad=True)
    x = torch.randn(512, 256)
    variants = {"matmul": lambda: (x @ weight).square().sum()}
    by_operators = measure_tradeoff(variants, parameters=[weight], rounds=1, device="cpu")
    by_allocator = measure_tradeoff(variants, parameters=[weight], rounds=1, device="cpu", meter=allocator_peak)
    assert by_allocator.variants[0].peak_bytes >= by_operators.variants[0].peak_bytes > 0
    assert by_allocator.variants[0].saved_bytes == by_operators.variants[0].saved_bytes


def test_held_counts_what_the_forward_pass_leaves_held_the_loss_included_the_inputs_not():
    weight = torch.randn(1000, 1000, requires_grad=True)
    variants = {"exp": lambda: weight.exp().sum(), "times two": lambda: (weight * 2).sum()}
    saved = measure_tradeoff(variants, parameters=[weight], rounds=1, device="cpu")
    held = measure_tradeoff(variants, parameters=[weight], rounds=1, device="cpu", kept="held")
    loss_bytes = torch.ones(()).nbytes
    assert held["exp"].saved_bytes == saved["exp"].saved_bytes + loss_bytes == weight.nbytes + loss_bytes
    assert held["times two"].saved_bytes == loss_bytes  # weight * 2 is freed once sum has it: nothing kept
    assert held["exp"].peak_bytes == saved["exp"].peak_bytes  # the peak is counted the same way either way
    assert "left held" in held.caption and "left held" not in saved.caption


def test_held_sees_what_selective_checkpointing_keeps_outside_the_hooks_on_every_torch():
    import functools

    from perflab import torch_features
    from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

    x = torch.randn(64, 32)
    w1, w2 = torch.randn(32, 128, requires_grad=True), torch.randn(128, 32, requires_grad=True)

    def block(x):
        return (x @ w1).sin() @ w2  # two matmuls, and a pointwise op to recompute between them

    save_matmuls = functools.partial(create_selective_checkpoint_contexts, [torch.ops.aten.mm.default])
    variants = {
        "full": lambda: checkpoint(block, x, use_reentrant=False).sum(),
        "selective": lambda: checkpoint(block, x, use_reentrant=False, context_fn=save_matmuls).sum(),
    }
    matmul_outputs = (64 * 128 + 64 * 32) * 4
    by_kept = {kept: measure_tradeoff(variants, parameters=[w1, w2], rounds=1, kept=kept) for kept in ("saved", "held")}
    held = by_kept["held"]
    assert held["selective"].saved_bytes - held["full"].saved_bytes == matmul_outputs
    # without respect_saved_tensors_hooks=True the hooks never see the policy's outputs: on no torch do they count
    saved = by_kept["saved"]
    assert saved["selective"].saved_bytes == saved["full"].saved_bytes
    if torch_features.has("checkpoint_respects_saved_tensors_hooks"):  # with it, they do: the same difference
        respect = functools.partial(checkpoint, use_reentrant=False, respect_saved_tensors_hooks=True)
        variants = {
            "full": lambda: respect(block, x).sum(),
            "selective": lambda: respect(block, x, context_fn=save_matmuls).sum(),
        }
        counted = measure_tradeoff(variants, parameters=[w1, w2], rounds=1)
        assert counted["selective"].saved_bytes - counted["full"].saved_bytes == matmul_outputs


def test_kept_is_saved_or_held():
    with pytest.raises(ValueError, match='kept must be "saved" or "held"'):
        measure_tradeoff({"a": lambda: torch.ones(1, requires_grad=True).sum()}, parameters=[], kept="peak")
