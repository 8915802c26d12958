import math

import matplotlib
import pytest
import torch
from perflab.render import Environment
from perflab.roofline import (
    Peaks,
    Roofline,
    RooflinePoint,
    count_bytes,
    measure_peaks,
    measure_point,
    mfu,
    roofline_chart,
)

matplotlib.use("Agg")

HERE = Environment("cpu", "test CPU", torch.__version__, 2, "3.11", "2026-01-01", "abc1234")


def _peaks(flops_per_s=100e9, bytes_per_s=10e9):
    return Peaks(flops_per_s, bytes_per_s, "matmul (given)", "copy (given)", HERE)


def test_bytes_are_each_input_and_output_once():
    x, y = torch.randn(1000), torch.randn(1000)
    assert count_bytes(lambda: x + y) == 3 * 4000
    assert count_bytes(lambda: x + x) == 2 * 4000, "an input passed twice is read once"
    a = torch.randn(64, 32)
    assert count_bytes(lambda: a @ a.T) == (64 * 32 + 64 * 64) * 4, "a.T is a view of the same bytes, read once"


def test_views_move_nothing_and_a_broadcast_input_counts_once():
    a = torch.randn(100, 100)
    assert count_bytes(lambda: a.view(-1)[:10].unsqueeze(0).T) == 0
    assert count_bytes(lambda: a.T.reshape(-1)) == 2 * a.nbytes, "a transposed tensor is not flat: reshape copies"
    row = torch.randn(100)
    assert count_bytes(lambda: a + row.expand(100, 100)) == (2 * 100 * 100 + 100) * 4


def test_a_training_step_moves_more_than_its_forward():
    model = torch.nn.Linear(64, 64)
    x = torch.randn(32, 64)
    forward = count_bytes(lambda: model(x))
    assert forward == (32 * 64 + 64 * 64 + 64 + 32 * 64) * 4  # input, weight, bias, output: one addmm
    assert count_bytes(lambda: model(x).sum().backward()) > 2 * forward, "backward reads and writes as much again"


def test_the_intensity_of_a_matmul_is_n_over_6_in_float32():
    n = 96
    a, b = torch.randn(n, n), torch.randn(n, n)
    point = measure_point("matmul", lambda: a @ b, samples=3)
    assert point.flops == 2 * n**3 and point.bytes == 3 * n * n * 4
    assert math.isclose(point.intensity, n / 6)
    assert point.seconds > 0 and math.isclose(point.flops_per_s, point.flops / point.seconds)


def test_an_elementwise_op_needs_its_flops_stated():
    x = torch.randn(1000)
    with pytest.raises(ValueError, match="flops="):
        measure_point("relu", lambda: torch.relu(x))
    assert measure_point("relu", lambda: torch.relu(x), flops=x.numel(), samples=3).intensity == 1 / 8


def test_mfu_is_achieved_model_flops_over_peak():
    assert math.isclose(mfu(flops_per_sample=2e6, samples_per_s=500, peak_flops_per_s=4e9), 0.25)
    assert math.isclose(mfu(2e6, 500, _peaks(flops_per_s=1e9)), 1.0), "a Peaks stands for its FLOP/s"
    with pytest.raises(ValueError, match="samples_per_s"):
        mfu(2e6, 0, 4e9)


def test_the_roof_is_the_lower_of_the_two_peaks_and_meets_at_the_ridge():
    peaks = _peaks(flops_per_s=100e9, bytes_per_s=10e9)
    assert peaks.ridge == 10
    assert peaks.attainable(1) == 10e9 and peaks.attainable(10) == 100e9 and peaks.attainable(1000) == 100e9
    assert "ridge at 10 FLOP/byte" in repr(peaks)


def test_a_memory_bound_op_lands_left_of_the_measured_ridge_and_a_large_matmul_right_of_it():
    peaks = measure_peaks("cpu", matmul_size=512, copy_mib=16, samples=3)
    x, y = torch.randn(2**18), torch.randn(2**18)
    a = torch.randn(256, 256)
    add = measure_point("add", lambda: x + y, flops=x.numel(), samples=3)
    matmul = measure_point("matmul", lambda: a @ a, samples=3)
    roofline = Roofline(peaks, (add, matmul))
    assert roofline.bound(add) == "memory" and add.intensity < peaks.ridge
    # 64 FLOP/byte (a @ a reads a once): right of the float32 ridge of any CPU or GPU (an H100's is about 20).
    assert roofline.bound(matmul) == "compute" and matmul.intensity == 256 / 4
    assert 0 < roofline.share_of_roof(matmul)
    text = repr(roofline)
    assert "add" in text and "memory" in text and "compute" in text and "ridge" in text


def test_a_point_refuses_impossible_values():
    with pytest.raises(ValueError, match="must be positive"):
        RooflinePoint("x", 1.0, 1.0, 0.0)


def test_the_chart_is_log_log_with_labelled_axes_a_title_and_provenance():
    peaks = _peaks()
    roofline = Roofline(peaks, (RooflinePoint("add", 1e6, 12e6, 2e-3), RooflinePoint("matmul", 1e9, 1e7, 0.02)))
    figure = roofline_chart(roofline)
    ax = figure.axes[0]
    assert ax.get_xscale() == "log" and ax.get_yscale() == "log"
    assert "FLOP" in ax.get_xlabel() and "GFLOP/s" in ax.get_ylabel() and ax.get_title()
    assert any("test CPU" in text.get_text() for text in figure.texts), "the footer says where it was measured"
    labels = {text.get_text() for text in ax.texts}
    assert {"add", "matmul"} <= labels and any("ridge" in label for label in labels)
