"""How results show themselves: tables for a terminal and a notebook, where a measurement was taken, figure footers.

    >>> from perflab.render import Environment, Table
    >>> where = Environment("cpu", "AMD EPYC 7B13", "2.14.1", 2, "3.11.7", "2026-11-24", "40eb828")
    >>> table = Table(("format", "max finite"), [("float16", 65504), ("bfloat16", "3.39e+38")], caption=f"on {where}")
    >>> print(table)
    format    max finite
    float16   65504
    bfloat16  3.39e+38
    on cpu (AMD EPYC 7B13, 2 threads), torch 2.14.1, Python 3.11.7, 2026-11-24, commit 40eb828
    >>> table._repr_html_()
    '<table><caption>on cpu (AMD EPYC 7B13, 2 threads), ...</caption><tr><th>format</th><th>max finite</th></tr>...'
    >>> Environment.from_dict(where.to_dict()) == where
    True

Every result class renders through this module: a ``Table`` is its ``__repr__`` in a terminal
and its ``_repr_html_`` in a notebook, an ``Environment`` is the one line that says where its
numbers were measured, and ``add_footer`` puts that line under every figure.

Used in: lectures 01, 02, 04-11, labs 04-11.
"""

from __future__ import annotations

import datetime
import functools
import html
import platform
import subprocess
import textwrap
from collections.abc import Collection, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from perflab.device import device_name

if TYPE_CHECKING:  # only for the annotation: the grader's child processes render no figure and skip matplotlib
    from matplotlib.figure import Figure

__all__ = ["Environment", "Markup", "Table", "add_footer"]

_FOOTER_POINTS = 7  # the footer's font size


@dataclass(frozen=True)
class Markup:
    """A table cell with HTML of its own: ``text`` in a terminal, ``html`` as it is (not escaped) in a notebook."""

    text: str
    html: str


@dataclass(frozen=True)
class Table:
    """Rows of cells under a header (none when empty), with a caption below them.

    Cells are strings, anything ``str()`` turns into one, or a :class:`Markup`. Columns listed
    in ``numeric`` are aligned right, so that numbers line up on their last digit;
    ``row_colours`` (one per row, "" for none) gives rows a background in HTML, where the text
    form says the same in words.
    """

    header: Sequence[str]
    rows: Sequence[Sequence[object]]
    caption: str = ""
    numeric: Collection[int] = ()
    row_colours: Sequence[str] = ()

    def __post_init__(self) -> None:
        rows = tuple(tuple(cell if isinstance(cell, Markup) else str(cell) for cell in row) for row in self.rows)
        object.__setattr__(self, "header", tuple(str(cell) for cell in self.header))
        object.__setattr__(self, "rows", rows)
        object.__setattr__(self, "numeric", frozenset(self.numeric))
        object.__setattr__(self, "row_colours", tuple(self.row_colours))
        columns = {len(row) for row in (self.header, *rows) if row}
        if len(columns) > 1:
            raise ValueError(f"every row of a table needs as many cells as the header; got rows of {sorted(columns)}")
        if self.row_colours and len(self.row_colours) != len(rows):
            raise ValueError(f"{len(self.row_colours)} row colours for {len(rows)} rows")

    def __str__(self) -> str:
        lines = [row for row in (self.header, *self.rows) if row]
        texts = [[cell.text if isinstance(cell, Markup) else cell for cell in row] for row in lines]
        widths = [max(len(row[column]) for row in texts) for column in range(len(texts[0]))] if texts else []
        text = [
            "  ".join(
                cell.rjust(width) if column in self.numeric else cell.ljust(width)
                for column, (cell, width) in enumerate(zip(row, widths))
            ).rstrip()
            for row in texts
        ]
        return "\n".join(text + ([self.caption] if self.caption else []))

    def _repr_html_(self) -> str:
        caption = "<br>".join(html.escape(line) for line in self.caption.splitlines())
        parts = ["<table>", f"<caption>{caption}</caption>" if caption else ""]
        if self.header:
            parts.append(f"<tr>{self._cells_html('th', self.header)}</tr>")
        for row, colour in zip(self.rows, self.row_colours or [""] * len(self.rows)):
            # Dark notebook themes write white text: a coloured row keeps it black to stay readable.
            style = f' style="background:{colour};color:#000"' if colour else ""
            parts.append(f"<tr{style}>{self._cells_html('td', row)}</tr>")
        return "".join([*parts, "</table>"])

    def _cells_html(self, tag: str, cells: Sequence[str | Markup]) -> str:
        right = ' style="text-align:right"'
        return "".join(
            f"<{tag}{right if column in self.numeric else ''}>"
            f"{cell.html if isinstance(cell, Markup) else html.escape(cell)}</{tag}>"
            for column, cell in enumerate(cells)
        )


@functools.cache  # one lookup per process: every training run captures its Environment
def _git_commit() -> str:
    try:
        return (
            subprocess.run(
                ["git", "rev-parse", "--short", "HEAD"],
                cwd=Path(__file__).parent,
                capture_output=True,
                text=True,
                timeout=10,
            ).stdout.strip()
            or "unknown"
        )
    except (OSError, subprocess.SubprocessError):
        return "unknown"


@dataclass(frozen=True)
class Environment:
    """Where a measurement was taken: enough to tell two machines' (or two versions') results apart."""

    device: str  # as torch names it: "cpu", "cuda:0"
    device_name: str  # the CPU's model or the GPU's marketing name
    torch: str
    threads: int  # torch.get_num_threads() while measuring
    python: str
    date: str  # ISO 8601, the day it was measured
    commit: str  # perflab's git commit, "unknown" outside a checkout

    @classmethod
    def capture(cls, device: str | torch.device) -> Environment:
        """This process, now, measuring on ``device``."""
        return cls(
            device=str(device),
            device_name=device_name(device),
            torch=torch.__version__,
            threads=torch.get_num_threads(),
            python=platform.python_version(),
            date=datetime.date.today().isoformat(),
            commit=_git_commit(),
        )

    def to_dict(self) -> dict:
        """Plain JSON types, for results that cross processes or files; :meth:`from_dict` reads it back."""
        return asdict(self)

    @classmethod
    def from_dict(cls, fields: Mapping) -> Environment:
        return cls(**fields)

    def __str__(self) -> str:
        threads = "1 thread" if self.threads == 1 else f"{self.threads} threads"
        return (
            f"{self.device} ({self.device_name}, {threads}), torch {self.torch}, "
            f"Python {self.python}, {self.date}, commit {self.commit}"
        )


def add_footer(figure: Figure, text: str) -> None:
    """Write where a figure's numbers come from along its bottom edge, and lay the plots out above it."""
    # Matplotlib wraps the text at the figure's edge when it draws it, so that a long provenance line is not
    # cut off. The strip below the plots needs its lines counted now: a character of this font is about
    # 3.7 points wide on average, and 4 leaves a margin.
    lines = len(textwrap.wrap(text, width=int(figure.get_figwidth() * 72 / 4))) or 1
    figure.text(0.01, 0.005, text, fontsize=_FOOTER_POINTS, color="#555555", va="bottom", wrap=True)
    # The strip is fixed in points (each line, and a little room above), so its share of a short figure is larger.
    strip_points = lines * 1.3 * _FOOTER_POINTS + 4
    figure.tight_layout(rect=(0, strip_points / 72 / figure.get_figheight(), 1, 1))
