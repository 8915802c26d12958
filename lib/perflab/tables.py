"""Plain-text tables for the ``__repr__`` of result objects, where no HTML renders (terminals, nbval).

>>> from perflab.tables import text_table
>>> print(text_table(("format", "max finite"), [("float16", "65504"), ("bfloat16", "3.39e+38")]))
format    max finite
float16   65504
bfloat16  3.39e+38
"""

from __future__ import annotations

from collections.abc import Sequence


def text_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """Left-aligned columns, each as wide as its widest cell, two spaces apart."""
    widths = [max(len(row[column]) for row in [header, *rows]) for column in range(len(header))]
    return "\n".join(
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in [header, *rows]
    )
