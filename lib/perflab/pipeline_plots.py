"""Pipeline runs drawn: each rank's timeline of forwards and backwards, and the bubble against the microbatches.

    >>> from perflab.pipeline_plots import bubble_chart, pipeline_timeline
    >>> from perflab.pipeline_schedule import PipelineRun, RankTimeline, StageWork
    >>> F, B = "forward", "backward"
    >>> first = RankTimeline(rank=0, work=(StageWork(0, F, 0, 0.0, 1.0), StageWork(0, B, 0, 5.0, 7.0)), sends=1)
    >>> last = RankTimeline(rank=1, work=(StageWork(1, F, 0, 1.5, 2.5), StageWork(1, B, 0, 2.5, 4.5)), sends=1)
    >>> run = PipelineRun("GPipe", microbatches=1, timelines=(first, last))
    >>> pipeline_timeline([run], caption="two stages, one microbatch")
    <Figure size ... with 1 Axes>
    >>> bubble_chart([run], caption="two stages, one microbatch")
    <Figure size ... with 1 Axes>

Kept apart from :mod:`perflab.pipeline_schedule`, which the ranks import to record a step: they draw nothing,
and matplotlib's import costs each of them about 0.4 s.

Used in: lecture 11.
"""

from __future__ import annotations

from collections.abc import Sequence

import matplotlib.pyplot as plt
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from perflab.pipeline_schedule import SCHEDULES, PipelineRun, bubble_fraction
from perflab.render import add_footer

__all__ = ["bubble_chart", "pipeline_timeline"]

_KINDS = ("forward", "backward")
_COLOURS = {"forward": "#4c72b0", "backward": "#dd8452"}
_MARKERS = {"GPipe": ("o", "#4c72b0"), "1F1B": ("s", "#c44e52"), "Interleaved1F1B": ("^", "#55a868")}


def pipeline_timeline(runs: Sequence[PipelineRun], *, caption: str, title: str | None = None) -> Figure:
    """One panel per run, one row per rank: its forwards and backwards, numbered by microbatch; white is idle.
    Where a rank holds several stages, the work of its later ones is hatched."""
    figure, axes = plt.subplots(len(runs), 1, figsize=(10, 0.9 + 1.0 * sum(r.ranks for r in runs)), sharex=True)
    axes = [axes] if len(runs) == 1 else list(axes)
    span_ms = max(run.makespan_s for run in runs) * 1e3
    for ax, run in zip(axes, runs):
        for row, timeline in enumerate(run.timelines):
            for w in timeline.work:
                start, width = (w.start_s - run.start_s) * 1e3, w.duration_s * 1e3
                later = w.stage != timeline.stages[0]
                ax.broken_barh([(start, width)], (row - 0.4, 0.8), facecolor=_COLOURS[w.kind], edgecolor="white",
                               hatch="///" if later else None)  # fmt: skip
                if width > run.makespan_s * 1e3 / 80:  # a number only where it fits
                    ax.text(start + width / 2, row, w.microbatch, ha="center", va="center", fontsize=7, color="white")
        ax.set_yticks(range(run.ranks), [f"rank {t.rank}\nstage {', '.join(map(str, t.stages))}"
                                         for t in run.timelines], fontsize=8)  # fmt: skip
        ax.set_ylim(run.ranks - 0.5, -0.5)
        ax.set_title(
            f"{run.schedule}, {run.microbatches} microbatches: idle {run.bubble:.0%} of the step measured, "
            f"{run.replayed_bubble:.0%} replayed with free sends, {run.formula_bubble:.0%} by (p-1)/(vm+p-1)",
            fontsize=9,
        )
    axes[-1].set_xlim(-0.01 * span_ms, 1.15 * span_ms)  # room on the right for the legend
    axes[-1].set_xlabel("time since the step's first forward (ms)")
    legend = [Patch(color=_COLOURS[k], label=k) for k in _KINDS]
    if any(run.stages_per_rank > 1 for run in runs):
        legend.append(Patch(facecolor="white", edgecolor="grey", hatch="///", label="a rank's later stage"))
    axes[0].legend(handles=legend, loc="upper right", fontsize=8)
    figure.suptitle(title or "Each rank's forwards and backwards, numbered by microbatch: white is idle")
    add_footer(figure, caption)
    return figure


def bubble_chart(runs: Sequence[PipelineRun], *, caption: str, title: str | None = None) -> Figure:
    """The bubble against the number of microbatches: measured, replayed and (p - 1) / (v m + p - 1), per schedule."""
    figure, ax = plt.subplots(figsize=(8, 4.2))
    ranks, counts = runs[0].ranks, sorted({run.microbatches for run in runs})
    curve = [m / 4 for m in range(4 * counts[0], 4 * counts[-1] + 1)]
    for v, style in zip(sorted({run.stages_per_rank for run in runs}), ("-", "--", ":")):
        ax.plot(curve, [bubble_fraction(ranks, m, v) * 100 for m in curve], color="black", ls=style,
                label=f"(p-1)/(vm+p-1), v = {v}")  # fmt: skip
    schedules = [s for s in SCHEDULES if any(run.schedule == s for run in runs)]
    for offset, schedule in zip((-0.06, 0.0, 0.06), schedules):
        marker, colour = _MARKERS[schedule]
        mine = sorted((run for run in runs if run.schedule == schedule), key=lambda run: run.microbatches)
        x = [run.microbatches * 2**offset for run in mine]  # side by side on the log axis
        ax.plot(x, [run.bubble * 100 for run in mine], marker, ls="-", color=colour, label=f"{schedule}: measured")
        ax.plot(x, [run.replayed_bubble * 100 for run in mine], marker, ls=":", mfc="none", color=colour,
                label=f"{schedule}: replayed, sends free")  # fmt: skip
    ax.set_xscale("log", base=2)
    ax.set_xticks(counts, [str(m) for m in counts])
    ax.set_xlabel("microbatches per step, m")
    ax.set_ylabel("bubble: idle share of the step (%)")
    ax.set_ylim(0, 100)
    ax.set_title(title or f"The pipeline bubble on {ranks} ranks: measured against (p-1)/(vm+p-1)")
    ax.legend(fontsize=8, ncol=2)
    add_footer(figure, caption)
    return figure
