"""perflab.floats: known bit patterns, overflow and underflow, and the explorer's tables and figure."""

from __future__ import annotations

import math

import matplotlib.pyplot as plt
import numpy as np
import pytest
import torch
from perflab.floats import FORMATS, bit_layout_figure, compare_formats, float_bits, format_ranges

TORCH_FORMATS = [name for name in FORMATS if name != "tfloat32"]  # TF32 is no torch dtype: no finfo
WIDTHS = {"float32": 32, "tfloat32": 19, "bfloat16": 16, "float16": 16}


def from_fields(result) -> float:
    """The value an IEEE-style sign/exponent/mantissa pattern encodes, computed independently of torch."""
    exponent, mantissa = int(result.exponent, 2), int(result.mantissa, 2)
    bias, mantissa_bits = 2 ** (len(result.exponent) - 1) - 1, len(result.mantissa)
    sign = -1.0 if result.sign == "1" else 1.0
    if exponent == 0:  # subnormal (or zero): no implicit leading 1, smallest exponent
        return sign * mantissa * 2.0 ** (1 - bias - mantissa_bits)
    return sign * (1 + mantissa / 2**mantissa_bits) * 2.0 ** (exponent - bias)


def tf32_reference(value: float) -> float:
    """float32, then the nearest number with 11 significant bits (ties to even), by arithmetic on Python floats."""
    with np.errstate(over="ignore"):
        single = float(np.float32(value))
    if not math.isfinite(single) or single == 0:
        return single
    _, exponent = math.frexp(single)  # single = m * 2**exponent with 0.5 <= |m| < 1
    step = 2.0 ** (max(exponent, -125) - 11)  # below float32's smallest normal the step stays that of 2**-126
    rounded = round(single / step) * step  # round() on a float rounds half to even
    return rounded if abs(rounded) <= (2 - 2**-10) * 2.0**127 else math.copysign(math.inf, single)


def test_one_in_float32():
    one = float_bits(1.0, "float32")
    assert (one.sign, one.exponent, one.mantissa) == ("0", "01111111", "0" * 23)
    assert one.stored == 1.0 and one.absolute_error == 0 and one.relative_error == 0 and one.flags == ()


@pytest.mark.parametrize(
    "name, exponent, mantissa_bits",
    [("float32", "10000000", 23), ("tfloat32", "10000000", 10), ("bfloat16", "10000000", 7), ("float16", "10000", 10)],
)
def test_minus_two_sets_the_sign_and_one_exponent_step(name, exponent, mantissa_bits):
    two = float_bits(-2.0, name)
    assert (two.sign, two.exponent, two.mantissa) == ("1", exponent, "0" * mantissa_bits)
    assert two.stored == -2.0


def test_negative_zero_keeps_its_sign_bit():
    zero = float_bits(-0.0, "float16")
    assert zero.bits == "1" + "0" * 15 and not zero.underflow


def test_65504_is_the_largest_float16():
    top = float_bits(65504, "float16")
    assert (top.sign, top.exponent, top.mantissa) == ("0", "11110", "1" * 10)
    assert top.stored == torch.finfo(torch.float16).max and not top.overflow


def test_65520_overflows_float16_but_not_bfloat16():
    # 65520 is exactly halfway between 65504 and 65536 (which float16 cannot hold): ties-to-even picks inf.
    comparison = compare_formats(65520)
    half = comparison["float16"]
    assert half.overflow and half.stored == math.inf and half.bits == "0" + "11111" + "0" * 10
    assert half.relative_error == math.inf and "overflow" in repr(half)
    brain = comparison["bfloat16"]
    assert not brain.overflow and brain.stored == 65536.0 and brain.exponent == "10001111"
    assert comparison["float32"].stored == 65520.0


def test_1e_minus_8_underflows_float16_only():
    # float16's smallest subnormal is 2**-24 ~ 6e-8; 1e-8 is below half of it, so it rounds to zero.
    comparison = compare_formats(1e-8)
    half = comparison["float16"]
    assert half.underflow and half.stored == 0.0 and half.bits == "0" * 16 and half.relative_error == 1.0
    for name, epsilon in (("bfloat16", 2**-8), ("tfloat32", 2**-11), ("float32", 2**-24)):
        kept = comparison[name]
        assert not kept.underflow and not kept.subnormal and kept.relative_error < epsilon


def test_subnormals_lose_the_implicit_leading_one():
    tiny = float_bits(2**-24, "float16")
    assert tiny.subnormal and tiny.exponent == "00000" and tiny.mantissa == "0000000001" and tiny.stored == 2**-24
    rounded = float_bits(1e-7, "float16")  # ~1.68 smallest steps: rounds to 2 of them
    assert rounded.subnormal and rounded.mantissa == "0000000010" and rounded.stored == 2 * 2**-24
    assert rounded.relative_error == pytest.approx(abs(2 * 2**-24 - 1e-7) / 1e-7)
    assert float_bits(1e-40, "float32").subnormal and not float_bits(1e-40, "bfloat16").underflow
    assert not float_bits(1e-7, "float32").subnormal and not float_bits(1.0, "float16").subnormal


def test_one_tenth_in_bfloat16():
    tenth = float_bits(0.1, "bfloat16")
    assert tenth.stored == 0.10009765625
    assert (tenth.sign, tenth.exponent, tenth.mantissa) == ("0", "01111011", "1001101")
    assert tenth.relative_error == pytest.approx(abs(0.10009765625 - 0.1) / 0.1, rel=1e-12)
    assert repr(tenth) == (
        "FloatBits(bfloat16: 0.1 -> 0.10009765625, sign 0 exponent 01111011 mantissa 1001101, relative error 9.8e-04)"
    )
    html = tenth._repr_html_()
    assert "<table>" in html and html.count("<span") == 3 and "1001101" in html


def test_bits_encode_the_stored_value_for_random_numbers():
    rng = np.random.default_rng(0)
    # Magnitudes from float32's subnormals to past bfloat16's maximum, both signs.
    values = rng.choice([-1.0, 1.0], 300) * 10.0 ** rng.uniform(-44, 39, 300)
    for value in values.tolist():
        for name in FORMATS:
            result = float_bits(value, name)
            if name == "tfloat32":
                assert result.stored == tf32_reference(value), (value, result)
            else:
                assert result.stored == torch.tensor(value, dtype=torch.float64).to(getattr(torch, name)).item()
            assert len(result.bits) == WIDTHS[name]
            if math.isinf(result.stored):
                assert result.overflow and result.exponent == "1" * len(result.exponent)
            else:
                assert from_fields(result) == result.stored, (value, name, result)


def test_torch_rounds_float64_to_float16_through_float32():
    # Just above halfway between 1 and the next float16: rounding once gives 1 + 2**-10 (as numpy does),
    # but the 2**-40 is lost on the way through float32 and the remaining tie goes to even, 1.0.
    value = 1 + 2**-11 + 2**-40
    assert float(np.float16(value)) == 1 + 2**-10
    assert float_bits(value, "float16").stored == 1.0


def test_tf32_keeps_ten_mantissa_bits_rounding_ties_to_even():
    # 1 + 2**-11 lies halfway between 1 and 1 + 2**-10: the tie goes to the even neighbour, 1.
    assert float_bits(1 + 2**-11, "tf32").stored == 1.0
    # 1 + 3 * 2**-11 lies halfway between 1 + 2**-10 (odd last bit) and 1 + 2**-9 (even): up.
    assert float_bits(1 + 3 * 2**-11, "tf32").stored == 1 + 2**-9
    assert float_bits(1 + 2**-11 + 2**-20, "tf32").stored == 1 + 2**-10  # just past halfway: up
    carried = float_bits(2 - 2**-12, "tf32")  # rounds up to 2: the carry moves into the exponent
    assert carried.stored == 2.0 and (carried.exponent, carried.mantissa) == ("10000000", "0" * 10)
    tenth = float_bits(0.1, "tf32")
    assert tenth.stored == float_bits(0.1, "float16").stored  # same 10 mantissa bits, ample exponent here
    assert tenth.bits == float_bits(0.1, "float32").bits[:19]  # the first bit dropped is 0: rounds down


def test_tf32_has_float32_range_and_float16_precision():
    comparison = compare_formats(70000)
    assert comparison["tf32"].stored == 70016.0 and not comparison["tf32"].overflow  # float16 overflows
    assert comparison["float16"].overflow
    tiny = float_bits(1e-30, "tf32")
    assert not tiny.underflow and not tiny.subnormal and tiny.relative_error < 2**-11
    below_normal = float_bits(1e-40, "tf32")  # a float32 subnormal: tf32 keeps its top mantissa bits only
    assert below_normal.subnormal and below_normal.stored == tf32_reference(1e-40)
    assert float_bits(-math.inf, "tf32").stored == -math.inf and math.isnan(float_bits(math.nan, "tf32").stored)


def test_tf32_overflows_just_above_its_largest_value():
    largest = format_ranges()["tf32"].max_finite
    assert float_bits(largest, "tf32").stored == largest and float_bits(largest, "tf32").mantissa == "1" * 10
    assert float_bits(largest * (1 + 2**-12), "tf32").stored == largest  # below halfway to 2**128
    assert float_bits(largest * (1 + 2**-11), "tf32").overflow  # past halfway to 2**128: rounds up to inf
    assert float_bits(largest * (1 + 2**-11), "float32").stored < math.inf  # float32 itself still holds it


def test_formats_can_be_named_by_dtype_or_alias():
    assert float_bits(0.1, torch.bfloat16) == float_bits(0.1, "bf16") == float_bits(0.1, "BFloat16")
    assert float_bits(0.1, "tf32") == float_bits(0.1, "TensorFloat32") == float_bits(0.1, "tfloat32")
    assert float_bits(3, "half").stored == 3.0 and float_bits(np.float32(0.5), "fp32").stored == 0.5


@pytest.mark.parametrize("dtype", ["float8", "int16", torch.int32, torch.float64])
def test_unknown_formats_are_refused_by_name(dtype):
    with pytest.raises(ValueError, match="bfloat16"):
        float_bits(1.0, dtype)


@pytest.mark.parametrize(
    "value, dtype", [("0.1", "float16"), (None, "float16"), (True, "float16"), (1 + 2j, "float32"), (1.0, 16)]
)
def test_non_numbers_are_refused(value, dtype):
    with pytest.raises(TypeError):
        float_bits(value, dtype)


def test_a_string_is_refused_with_a_hint():
    with pytest.raises(TypeError, match=r"float\('0.1'\)"):
        compare_formats("0.1")


def test_format_ranges_come_from_finfo():
    ranges = format_ranges()
    assert [limits.format for limits in ranges.ranges] == list(FORMATS)
    for name in TORCH_FORMATS:
        info, limits = torch.finfo(getattr(torch, name)), ranges[name]
        assert (limits.max_finite, limits.smallest_normal, limits.epsilon) == (info.max, info.smallest_normal, info.eps)
    assert [ranges[name].decimal_digits for name in FORMATS] == [6, 3, 2, 3]
    assert "65504" in repr(ranges) and ranges._repr_html_().count("<tr>") == 1 + len(FORMATS)


def test_tf32_range_is_float32_exponent_with_ten_mantissa_bits():
    tf32, single = format_ranges()["tfloat32"], torch.finfo(torch.float32)
    assert tf32.smallest_normal == single.smallest_normal and tf32.epsilon == 2**-10
    assert tf32.max_finite == (2 - 2**-10) * 2.0**127 and tf32.max_finite < single.max


def test_comparison_table_lists_every_format():
    comparison = compare_formats(0.1)
    text = repr(comparison)
    assert text.splitlines()[-1] == "0.1 in each format"
    for result in comparison.results:
        assert result.format in text and repr(result.stored) in text and result.exponent in text
    assert len(text.splitlines()) == 2 + len(FORMATS)
    html = comparison._repr_html_()
    assert html.count("<tr>") == 1 + len(FORMATS) and all(name in html for name in FORMATS)


def test_bit_layout_figure_is_titled_labelled_and_sourced():
    figure = bit_layout_figure(65520)
    try:
        ax = figure.axes[0]
        assert "65520" in ax.get_title() and ax.get_xlabel() == "bit position (most significant first)"
        rows = [label.get_text() for label in ax.get_yticklabels()]
        assert len(rows) == len(FORMATS) and all(row.startswith(name) for row, name in zip(rows, FORMATS))
        assert "inf" in rows[-1] and "overflow" in rows[-1]  # float16
        assert len(ax.patches) == sum(WIDTHS.values()) and ax.get_legend() is not None
        assert any(torch.__version__ in text.get_text() for text in figure.texts)
    finally:
        plt.close(figure)
