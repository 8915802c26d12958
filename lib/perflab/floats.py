"""How float32, TF32, bfloat16 and float16 store a number: the bits, the value kept, the error made.

    >>> from perflab.floats import float_bits, compare_formats, format_ranges, bit_layout_figure
    >>> float_bits(0.1, "bfloat16")
    FloatBits(bfloat16: 0.1 -> 0.10009765625, sign 0 exponent 01111011 mantissa 1001101, relative error 9.8e-04)
    >>> compare_formats(65520)       # float16 overflows to inf, bfloat16 rounds to 65536
    format    stored value  bits (sign exponent mantissa)       relative error  flags
    float32   65520.0       0 10001110 11111111111000000000000  0.0e+00
    tfloat32  65536.0       0 10001111 0000000000               2.4e-04
    bfloat16  65536.0       0 10001111 0000000                  2.4e-04
    float16   inf           0 11111 0000000000                  inf             overflow
    65520.0 in each format
    >>> format_ranges()              # largest finite, smallest normal, epsilon, decimal digits (torch.finfo)
    format     max finite  smallest normal      epsilon  decimal digits
    float32   3.40282e+38      1.17549e-38  1.19209e-07               6
    tfloat32  3.40116e+38      1.17549e-38  0.000976562               3
    bfloat16  3.38953e+38      1.17549e-38    0.0078125               2
    float16         65504      6.10352e-05  0.000976562               3
    from torch.finfo, torch ...
    >>> bit_layout_figure(0.1)       # one row of bit boxes per format, coloured sign/exponent/mantissa
    <Figure size ... with 1 Axes>
    >>> float_bits(0.1, "tf32")      # TensorFloat-32: float32's exponent, float16's 10 mantissa bits
    FloatBits(tfloat32: 0.1 -> 0.0999755859375, sign 0 exponent 01111011 mantissa 1001100110, relative error 2.4e-04)

A Python number is first a float64; it is converted with ``torch.tensor(value, dtype=torch.float64)
.to(dtype)``, round to nearest, ties to even. Torch narrows float64 to bfloat16 and float16 *through
float32*, though, so a value a hair above a halfway point can be rounded twice and land one step
below the correctly rounded answer (``1 + 2**-11 + 2**-40`` becomes 1.0 in float16; numpy's
``float16`` gives 1.0009765625). What is shown is what torch stores. The bits are read from the
stored tensor itself (``tensor.view(torch.int16)``), never recomputed from the value.

TF32 (``"tfloat32"``) is not a storage type: NVIDIA's tensor cores read float32 inputs and keep only
the top 10 of their 23 mantissa bits, when ``torch.set_float32_matmul_precision("high")`` allows it.
Here the float32 value is rounded to 10 mantissa bits, to nearest, ties to even, and kept in a
float32 tensor whose low 13 bits are zero; the tensor cores' own conversion may differ in the last bit.

Used in: lecture 04 (mixed precision).
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import matplotlib.pyplot as plt
import torch
from matplotlib.figure import Figure
from matplotlib.patches import Patch, Rectangle

from perflab.render import Markup, Table, add_footer

__all__ = [
    "FORMATS",
    "FloatBits",
    "FormatComparison",
    "FormatRange",
    "FormatRanges",
    "bit_layout_figure",
    "compare_formats",
    "float_bits",
    "format_ranges",
]

FORMATS = ("float32", "tfloat32", "bfloat16", "float16")
_ALIASES = {
    "fp32": "float32",
    "tf32": "tfloat32",
    "tensorfloat32": "tfloat32",
    "bf16": "bfloat16",
    "fp16": "float16",
    "half": "float16",
}
_FIELD_COLOURS = {"sign": "#f4a3a3", "exponent": "#a9c9f2", "mantissa": "#b8e2b0"}
_INT_OF_WIDTH = {32: torch.int32, 16: torch.int16}
_TF32_MANTISSA_BITS = 10
_TF32_DROPPED_BITS = 23 - _TF32_MANTISSA_BITS  # float32 mantissa bits the tensor cores ignore


def _format_name(dtype: str | torch.dtype) -> str:
    if isinstance(dtype, torch.dtype):
        name = str(dtype).removeprefix("torch.")
    elif isinstance(dtype, str):
        name = _ALIASES.get(dtype.lower(), dtype.lower())
    else:
        raise TypeError(f"a float format is a name or a torch dtype, got {type(dtype).__name__} {dtype!r}")
    if name not in FORMATS:
        raise ValueError(
            f"unknown float format {dtype!r}: choose one of {', '.join(FORMATS)} (or {', '.join(_ALIASES)})"
        )
    return name


def _as_float(value: float) -> float:
    # bool is a number to Python, but never what a learner means; strings are refused rather than
    # parsed so that "0.1" and 0.1 cannot silently differ in how they reach float64.
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        hint = f"; convert it first, e.g. float({value!r})" if isinstance(value, str) else ""
        raise TypeError(f"expected a real number, got {type(value).__name__} {value!r}{hint}")
    return float(value)


def _field_widths(name: str) -> tuple[int, int]:
    """(exponent bits, mantissa bits): the mantissa has log2(1 / eps) bits, the sign one, the exponent the rest."""
    if name == "tfloat32":
        exponent, _ = _field_widths("float32")
        return exponent, _TF32_MANTISSA_BITS
    info = torch.finfo(getattr(torch, name))
    mantissa = round(-math.log2(info.eps))
    return info.bits - 1 - mantissa, mantissa


def _round_to_tf32(single: torch.Tensor) -> torch.Tensor:
    """A float32 scalar rounded to 10 mantissa bits (to nearest, ties to even), still a float32 tensor."""
    bits = single.view(torch.int32).item() & 0xFFFFFFFF
    if (bits >> 23) & 0xFF == 0xFF:  # inf and nan have nothing to round
        return single
    dropped = (1 << _TF32_DROPPED_BITS) - 1
    kept_lowest_bit = (bits >> _TF32_DROPPED_BITS) & 1
    # Adding just under half a step (plus one on a tie with an odd last kept bit) and cutting off the
    # dropped bits rounds to nearest, ties to even; a carry into the exponent is the right result,
    # up to infinity just above the largest finite value.
    rounded = (bits + (dropped >> 1) + kept_lowest_bit) & ~dropped & 0xFFFFFFFF
    signed = rounded - (1 << 32) if rounded >> 31 else rounded
    return torch.tensor(signed, dtype=torch.int32).view(torch.float32)


def _stored(number: float, name: str) -> torch.Tensor:
    if name == "tfloat32":
        return _round_to_tf32(torch.tensor(number, dtype=torch.float64).to(torch.float32))
    return torch.tensor(number, dtype=torch.float64).to(getattr(torch, name))


@dataclass(frozen=True)
class FloatBits:
    """One number as one format stores it: the value kept and the bits that keep it."""

    value: float  # as asked for, already a float64
    format: str
    stored: float  # what the format keeps, exactly (every one of these formats fits in a float64)
    sign: str
    exponent: str
    mantissa: str

    @property
    def fields(self) -> tuple[tuple[str, str], ...]:
        return ("sign", self.sign), ("exponent", self.exponent), ("mantissa", self.mantissa)

    @property
    def bits(self) -> str:
        return self.sign + self.exponent + self.mantissa

    @property
    def absolute_error(self) -> float:
        if self.stored == self.value:  # also inf kept as inf, where the subtraction would give nan
            return 0.0
        return abs(self.stored - self.value)

    @property
    def relative_error(self) -> float:
        # A zero input is always stored exactly, so the division only happens for nonzero values.
        return 0.0 if self.absolute_error == 0 else self.absolute_error / abs(self.value)

    @property
    def overflow(self) -> bool:
        """A finite input too large for the format, stored as infinity."""
        return math.isfinite(self.value) and math.isinf(self.stored)

    @property
    def underflow(self) -> bool:
        """A nonzero input too small for the format, stored as zero."""
        return self.value != 0 and self.stored == 0

    @property
    def subnormal(self) -> bool:
        """Below the smallest normal number: exponent field all zeros, so fewer significant bits remain."""
        return "1" not in self.exponent and "1" in self.mantissa

    @property
    def flags(self) -> tuple[str, ...]:
        return tuple(name for name in ("overflow", "underflow", "subnormal") if getattr(self, name))

    def _bits_html(self) -> str:
        boxes = (
            f'<span title="{field}" style="background:{_FIELD_COLOURS[field]};color:#000">{bits}</span>'
            for field, bits in self.fields
        )
        return "<code>" + " ".join(boxes) + "</code>"

    def _row(self) -> tuple[str | Markup, ...]:
        """This result as a table row; in HTML its bits are coloured by field."""
        bits = Markup(" ".join(bits for _, bits in self.fields), self._bits_html())
        return self.format, repr(self.stored), bits, f"{self.relative_error:.1e}", ", ".join(self.flags)

    def __repr__(self) -> str:
        flags = "".join(f", {flag}" for flag in self.flags)
        return (
            f"FloatBits({self.format}: {self.value!r} -> {self.stored!r}, sign {self.sign} exponent "
            f"{self.exponent} mantissa {self.mantissa}, relative error {self.relative_error:.1e}{flags})"
        )

    def _repr_html_(self) -> str:
        return Table(_BITS_HEADER, [self._row()], caption=f"{self.value!r} as {self.format}")._repr_html_()


_BITS_HEADER = ("format", "stored value", "bits (sign exponent mantissa)", "relative error", "flags")


def float_bits(value: float, dtype: str | torch.dtype) -> FloatBits:
    """``float_bits(0.1, "bfloat16")``: what ``dtype`` stores for ``value``, and its bits."""
    number, name = _as_float(value), _format_name(dtype)
    stored = _stored(number, name)
    width = torch.finfo(stored.dtype).bits
    # view() reinterprets the same bytes as a signed integer; the mask turns it into the unsigned pattern.
    pattern = format(stored.view(_INT_OF_WIDTH[width]).item() & (2**width - 1), f"0{width}b")
    exponent_bits, mantissa_bits = _field_widths(name)
    return FloatBits(
        value=number,
        format=name,
        stored=stored.item(),
        sign=pattern[0],
        exponent=pattern[1 : 1 + exponent_bits],
        mantissa=pattern[1 + exponent_bits : 1 + exponent_bits + mantissa_bits],
    )


@dataclass(frozen=True)
class FormatComparison:
    """One number in every format, side by side."""

    value: float
    results: tuple[FloatBits, ...]

    def __getitem__(self, dtype: str | torch.dtype) -> FloatBits:
        return {result.format: result for result in self.results}[_format_name(dtype)]

    def _table(self) -> Table:
        return Table(_BITS_HEADER, [result._row() for result in self.results], caption=f"{self.value!r} in each format")

    def __repr__(self) -> str:
        return str(self._table())

    def _repr_html_(self) -> str:
        return self._table()._repr_html_()


def compare_formats(value: float) -> FormatComparison:
    """``compare_formats(0.1)``: how float32, TF32, bfloat16 and float16 each store ``value``."""
    number = _as_float(value)
    return FormatComparison(number, tuple(float_bits(number, name) for name in FORMATS))


@dataclass(frozen=True)
class FormatRange:
    """What one format can hold, from ``torch.finfo`` (TF32, which has none, from its field widths)."""

    format: str
    max_finite: float
    smallest_normal: float
    epsilon: float  # gap between 1.0 and the next number up: the relative precision
    decimal_digits: int  # roughly how many significant decimal digits the format keeps


@dataclass(frozen=True)
class FormatRanges:
    """The range and precision of every format, as a table."""

    ranges: tuple[FormatRange, ...]

    def __getitem__(self, dtype: str | torch.dtype) -> FormatRange:
        return {limits.format: limits for limits in self.ranges}[_format_name(dtype)]

    def _table(self) -> Table:
        rows = [
            (r.format, f"{r.max_finite:.6g}", f"{r.smallest_normal:.6g}", f"{r.epsilon:.6g}", r.decimal_digits)
            for r in self.ranges
        ]
        header = ("format", "max finite", "smallest normal", "epsilon", "decimal digits")
        return Table(header, rows, caption=f"from torch.finfo, torch {torch.__version__}", numeric=(1, 2, 3, 4))

    def __repr__(self) -> str:
        return str(self._table())

    def _repr_html_(self) -> str:
        return self._table()._repr_html_()


def format_ranges() -> FormatRanges:
    """``format_ranges()["float16"].max_finite`` is 65504.0: each format's limits, from ``torch.finfo``."""

    def limits(name: str) -> FormatRange:
        exponent, mantissa = _field_widths(name)
        # As finfo.resolution reports it: a mantissa of m bits keeps floor(m * log10(2)) decimal digits.
        digits = math.floor(mantissa * math.log10(2))
        if name == "tfloat32":  # float32's exponent range with a shorter mantissa
            largest = (2 - 2.0**-mantissa) * 2.0 ** (2 ** (exponent - 1) - 1)
            return FormatRange(name, largest, torch.finfo(torch.float32).smallest_normal, 2.0**-mantissa, digits)
        info = torch.finfo(getattr(torch, name))
        return FormatRange(name, info.max, info.smallest_normal, info.eps, digits)

    return FormatRanges(tuple(limits(name) for name in FORMATS))


def bit_layout_figure(value: float) -> Figure:
    """``bit_layout_figure(0.1)``: one row per format, one box per bit, coloured by field.

    Rows start at the most significant bit, so float32, TF32 and bfloat16 line up: TF32 is float32's
    top 19 bits and bfloat16 its top 16 (rounded), the same exponent with a shorter mantissa.
    """
    comparison = compare_formats(value)
    results = comparison.results
    width = max(len(result.bits) for result in results)
    figure, ax = plt.subplots(figsize=(12, 1.4 + 0.7 * len(results)))
    for row, result in enumerate(results):
        fields = [field for field, bits in result.fields for _ in bits]
        for position, (field, bit) in enumerate(zip(fields, result.bits)):
            ax.add_patch(Rectangle((position, row - 0.4), 1, 0.8, facecolor=_FIELD_COLOURS[field], edgecolor="white"))
            ax.text(position + 0.5, row, bit, ha="center", va="center", fontsize=8, family="monospace")
    ax.set_xlim(0, width)
    ax.set_ylim(len(results) - 0.5, -0.5)
    ax.set_xticks([position + 0.5 for position in range(width)], [str(p) for p in range(width)], fontsize=7)
    ax.set_yticks(
        range(len(results)), [f"{r.format}\n{r.stored!r}" + "".join(f" ({flag})" for flag in r.flags) for r in results]
    )
    ax.set_xlabel("bit position (most significant first)")
    ax.set_title(f"How {comparison.value!r} is stored in each format")
    ax.legend(
        handles=[Patch(facecolor=colour, label=field) for field, colour in _FIELD_COLOURS.items()],
        loc="upper left",
        bbox_to_anchor=(1.01, 1.0),
        fontsize=8,
        frameon=False,
    )
    ax.set_frame_on(False)
    add_footer(
        figure,
        f"bits read from torch tensors with tensor.view(int), torch {torch.__version__}; "
        "converted from float64 (torch rounds through float32), ties to even; TF32 is float32 rounded "
        "to 10 mantissa bits here (tensor cores may round differently)",
    )
    return figure
