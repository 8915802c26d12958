"""Pictures of measurements: each has a title, labelled axes with units, and says where its numbers came from.

    >>> from perflab.plots import phase_timeline, speedup_waterfall
    >>> speedup_waterfall([baseline, cached, final])        # samples/s gained or lost by each change
    >>> phase_timeline([baseline, final], seconds=0.5)       # where the first half second of each run went
"""
from __future__ import annotations

from typing import Sequence

import matplotlib.pyplot as plt
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from perflab.train_result import PHASES, TrainResult

PHASE_COLOURS = dict(zip(PHASES, ("#d62728", "#9467bd", "#1f77b4", "#ff7f0e", "#2ca02c", "#7f7f7f")))


def provenance(result: TrainResult) -> str:
    """One line naming the machine and software a result was measured with."""
    env = result.environment
    return (f"measured on {env['device_name']} ({env['device']}, {env['threads']} threads), "
            f"torch {env['torch']}, {env['date']}, commit {env['commit']}")


def speedup_waterfall(results: Sequence[TrainResult], *, title: str = "Where the speedup came from") -> Figure:
    """Baseline samples/s, then each change's gain (green) or loss (red), then the final total."""
    rates = [result.samples_per_s for result in results]
    figure, ax = plt.subplots(figsize=(max(6.0, 1.4 * (len(results) + 1)), 4))
    ax.bar(0, rates[0], color="#7f7f7f")
    for index in range(1, len(rates)):
        change = rates[index] - rates[index - 1]
        ax.bar(index, change, bottom=rates[index - 1], color="#2ca02c" if change >= 0 else "#d62728")
        ax.annotate(f"{rates[index] / rates[index - 1]:.2f}x", (index, max(rates[index], rates[index - 1])),
                    ha="center", va="bottom", fontsize=9)
    ax.bar(len(rates), rates[-1], color="#1f77b4")
    ax.annotate(f"{rates[-1] / rates[0]:.2f}x in all", (len(rates), rates[-1]), ha="center", va="bottom", fontsize=9)
    ax.set_xticks(range(len(rates) + 1), [result.name for result in results] + ["total"], rotation=20, ha="right")
    ax.set_ylim(0, 1.15 * max(rates))  # room for the ratios above the bars
    ax.set_ylabel("training throughput (samples/s)")
    ax.set_title(title)
    figure.text(0.01, 0.005, provenance(results[-1]), fontsize=7, color="#555555")
    figure.tight_layout(rect=(0, 0.03, 1, 1))
    return figure


def phase_timeline(results: Sequence[TrainResult], *, seconds: float = 0.5,
                   title: str = "The first training steps, phase by phase") -> Figure:
    """One row per run: its first ``seconds`` of training steps laid end to end, coloured by phase."""
    figure, ax = plt.subplots(figsize=(10, 1.2 + 0.7 * len(results)))
    for row, result in enumerate(results):
        clock = 0.0
        for step in result.steps:
            for phase in PHASES:
                ax.broken_barh([(clock * 1e3, step[phase] * 1e3)], (row - 0.35, 0.7), color=PHASE_COLOURS[phase])
                clock += step[phase]
            ax.axvline(clock * 1e3, ymin=(row + 0.15) / len(results), ymax=(row + 0.85) / len(results),
                       color="white", linewidth=0.5)  # step boundary
            if clock >= seconds:
                break
    ax.set_yticks(range(len(results)), [f"{r.name}\n{r.config['batch_size']} samples/step" for r in results])
    ax.set_ylim(len(results) - 0.5, -0.5)
    ax.set_xlim(0, seconds * 1e3)
    ax.set_xlabel("time since the first step (ms)")
    ax.set_title(title)
    ax.legend(handles=[Patch(color=colour, label=phase) for phase, colour in PHASE_COLOURS.items()],
              loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    figure.text(0.01, 0.005, provenance(results[-1]), fontsize=7, color="#555555")
    figure.tight_layout(rect=(0, 0.03, 1, 1))
    return figure
