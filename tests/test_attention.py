"""perflab.attention: SDPA's backends measured, the largest tensor a block makes, memory and time against T."""

from __future__ import annotations

import pytest
import torch
from perflab.attention import attention_curves, largest_new_tensor, sdpa_backends
from perflab.models.gpt import naive_attention, sdpa_attention, tiled_attention


def qkv(length: int, heads: int = 2, head_dim: int = 16) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return list(torch.randn(3, 1, heads, length, head_dim, generator=generator).unbind(0))


def test_cpu_runs_its_flash_kernel_and_the_math_fallback_and_refuses_the_cuda_backends():
    report = sdpa_backends(*qkv(128), is_causal=True)
    assert report["default"].runs and report["default"].kernel == "_scaled_dot_product_flash_attention_for_cpu"
    assert report["FLASH_ATTENTION"].kernel == report["default"].kernel
    assert report["MATH"].runs and report["MATH"].kernel.startswith("unfused: ")
    assert "bmm" in report["MATH"].kernel and "softmax" in report["MATH"].kernel
    for backend in ("EFFICIENT_ATTENTION", "CUDNN_ATTENTION"):
        assert not report[backend].runs and report[backend].kernel == ""
        assert report[backend].reasons, f"{backend} was refused without a reason"
    assert report.working == ["MATH", "FLASH_ATTENTION"]


def test_a_refusal_carries_pytorchs_reasons_without_the_source_location():
    report = sdpa_backends(*qkv(64), dropout_p=0.1)
    flash = report["FLASH_ATTENTION"]
    assert not flash.runs
    assert any("dropout" in reason for reason in flash.reasons), flash.reasons
    assert not any("Triggered internally" in reason for reason in flash.reasons)
    assert report["default"].kernel.startswith("unfused: ")  # dropout sends SDPA to the math path
    assert "dropout_p=0.1" in repr(report) and "refused" in repr(report)
    assert "<table>" in report._repr_html_() and "#f4a3a3" in report._repr_html_()


def test_trying_the_backends_leaves_sdpa_as_it_was():
    q, k, v = qkv(64)
    sdpa_backends(q, k, v)
    assert sdpa_backends(q, k, v)["default"] == sdpa_backends(q, k, v)["default"]
    assert torch.allclose(sdpa_attention(q, k, v, causal=False), naive_attention(q, k, v, causal=False), atol=1e-6)
    with pytest.raises(KeyError, match="MATH"):
        sdpa_backends(q, k, v)["FLASH"]


def test_largest_new_tensor_finds_the_score_matrix_and_ignores_views_and_inputs():
    q, k, v = qkv(256)
    with largest_new_tensor() as largest:
        naive_attention(q, k, v, causal=False)
    assert largest.numel == 2 * 256 * 256  # one T x T block of scores per head
    with largest_new_tensor() as largest:
        tiled_attention(q, k, v, causal=False, tile_size=32)
    assert largest.numel <= q.numel()
    big = torch.randn(1000, 1000)
    with largest_new_tensor() as largest:
        big.t()[:5]  # views of an input: nothing new
        big.view(-1, 10)
        big.add_(1)  # in place: nothing new
    assert largest.shape is None and largest.numel == 0 and "nothing made" in repr(largest)


def test_curves_see_naive_memory_grow_quadratically_and_tiled_linearly():
    curves = attention_curves(
        {"naive": naive_attention, "tiled": tiled_attention},
        (256, 512, 1024),
        heads=2,
        head_dim=16,
        device="cpu",
        samples=None,
    )
    assert all(3.5 < growth < 4.5 for growth in curves.growth("naive"))
    assert all(1.0 < growth < 2.6 for growth in curves.growth("tiled"))
    assert curves.times == {} and curves.allocator_bytes == {}
    assert curves.peak_bytes["naive"][-1] >= 2 * 1024 * 1024 * 4  # at least one float32 score matrix
    with pytest.raises(ValueError, match="samples"):
        curves.growth("naive", of="time")
    with pytest.raises(ValueError, match="'memory' or 'time'"):
        curves.growth("naive", of="speed")
    assert "naive x" in repr(curves) and "causal" in repr(curves)


def test_timed_curves_have_a_timing_per_length_and_a_labelled_figure():
    import matplotlib.pyplot as plt

    curves = attention_curves({"sdpa": sdpa_attention}, (64, 128), heads=1, head_dim=8, device="cpu", samples=2)
    assert [timing.label for timing in curves.times["sdpa"]] == ["sdpa T=64", "sdpa T=128"]
    assert len(curves.growth("sdpa", of="time")) == 1
    figure = curves.figure()
    try:
        memory_ax, time_ax = figure.axes
        assert "MB" in memory_ax.get_ylabel() and "ms" in time_ax.get_ylabel()
        assert "tokens" in memory_ax.get_xlabel() and any("torch" in text.get_text() for text in figure.texts)
    finally:
        plt.close(figure)
    assert "<table>" in curves._repr_html_()


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: attention_curves({}, (64,)), "at least one implementation"),
        (lambda: attention_curves({"naive": naive_attention}, ()), "lengths"),
        (lambda: attention_curves({"naive": naive_attention}, (64, 0)), "lengths"),
    ],
)
def test_bad_input_is_refused(call, message):
    with pytest.raises(ValueError, match=message):
        call()
