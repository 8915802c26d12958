"""Pictures of measurements: each has a title, labelled axes with units, and says where its numbers came from.

>>> from dataclasses import replace
>>> from perflab.memory_budget import estimate_training_memory
>>> from perflab.models import GPTConfig
>>> from perflab.plots import memory_curve, phase_timeline, speedup_waterfall, throughput_curve
>>> from perflab.train import NAIVE, OPTIMIZED, Workload, train
>>> tiny = Workload(num_classes=3, train_per_class=20, val_per_class=4, image_size=32, epochs=1)
>>> baseline, final = train(NAIVE, tiny, progress=False), train(OPTIMIZED, tiny, progress=False)
>>> speedup_waterfall([baseline, final])                 # samples/s gained or lost by each change
<Figure size ... with 1 Axes>
>>> phase_timeline([baseline, final], seconds=0.5)       # where the first half second of each run went
<Figure size ... with 1 Axes>
>>> batch_sizes = [16, 32]
>>> results = [train(replace(OPTIMIZED, batch_size=size), tiny, progress=False) for size in batch_sizes]
>>> throughput_curve(batch_sizes, results, knob="batch size")
<Figure size ... with 1 Axes>
>>> lengths = [64, 128, 256]
>>> estimates = [estimate_training_memory(GPTConfig(block_size=256), batch_size=8, seq_len=n) for n in lengths]
>>> memory_curve(lengths, estimates, knob="sequence length (tokens)", caption="estimated for the course's GPT")
<Figure size ... with 1 Axes>

The other pictures draw what another module measures, and are shown there: ``trace_timeline``
in :mod:`perflab.profiling`, ``ceiling_chart`` in :mod:`perflab.ceiling`, ``diagnosis_shares``
in :mod:`perflab.planted`, ``tradeoff_curve`` in :mod:`perflab.tradeoff` and
``break_even_chart`` in :mod:`perflab.compiling`.

Used in: lectures 02, 03, 05 and 06, labs 03 and 12.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import matplotlib.pyplot as plt
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from perflab.bench import format_seconds
from perflab.diagnose import Diagnosis
from perflab.memory_budget import COMPONENTS
from perflab.profiling import ProfiledRun, Span
from perflab.render import add_footer
from perflab.train_result import PHASES, TrainResult

__all__ = [
    "break_even_chart",
    "ceiling_chart",
    "diagnosis_shares",
    "memory_curve",
    "phase_timeline",
    "provenance",
    "speedup_waterfall",
    "throughput_curve",
    "trace_timeline",
    "tradeoff_curve",
]

_PHASE_COLOURS = dict(zip(PHASES, ("#d62728", "#9467bd", "#1f77b4", "#ff7f0e", "#2ca02c", "#7f7f7f")))


def provenance(result: TrainResult) -> str:
    """One line naming the machine and software a result was measured with."""
    return f"measured on {result.environment}"


def speedup_waterfall(results: Sequence[TrainResult], *, title: str = "Where the speedup came from") -> Figure:
    """Baseline samples/s, then each change's gain (green) or loss (red), then the final total."""
    rates = [result.samples_per_s for result in results]
    figure, ax = plt.subplots(figsize=(max(6.0, 1.4 * (len(results) + 1)), 4))
    ax.bar(0, rates[0], color="#7f7f7f")
    for index in range(1, len(rates)):
        change = rates[index] - rates[index - 1]
        ax.bar(index, change, bottom=rates[index - 1], color="#2ca02c" if change >= 0 else "#d62728")
        ax.annotate(
            f"{rates[index] / rates[index - 1]:.2f}x",
            (index, max(rates[index], rates[index - 1])),
            ha="center",
            va="bottom",
            fontsize=9,
        )
    ax.bar(len(rates), rates[-1], color="#1f77b4")
    ax.annotate(f"{rates[-1] / rates[0]:.2f}x in all", (len(rates), rates[-1]), ha="center", va="bottom", fontsize=9)
    ax.set_xticks(range(len(rates) + 1), [result.name for result in results] + ["total"], rotation=20, ha="right")
    ax.set_ylim(0, 1.15 * max(rates))  # room for the ratios above the bars
    ax.set_ylabel("training throughput (samples/s)")
    ax.set_title(title)
    add_footer(figure, provenance(results[-1]))
    return figure


def _draw_timeline(rows: dict[str, list[Span]], *, seconds: float, title: str, caption: str) -> Figure:
    """One row per key: its spans, coloured by phase; white space is time nothing was recorded."""
    figure, ax = plt.subplots(figsize=(10, 1.2 + 0.7 * len(rows)))
    colours = {**_PHASE_COLOURS, "kernel": "#17becf"}
    for index, spans in enumerate(rows.values()):
        for span in spans:
            if span.start_s < seconds:
                ax.broken_barh(
                    [(span.start_s * 1e3, span.duration_s * 1e3)], (index - 0.35, 0.7), color=colours[span.name]
                )
    ax.set_yticks(range(len(rows)), list(rows))
    ax.set_ylim(len(rows) - 0.5, -0.5)
    ax.set_xlim(0, seconds * 1e3)
    ax.set_xlabel("time since the first step (ms)")
    ax.set_title(title)
    names = sorted({span.name for spans in rows.values() for span in spans}, key=list(colours).index)
    ax.legend(
        handles=[Patch(color=colours[name], label=name) for name in names],
        loc="upper left",
        bbox_to_anchor=(1.01, 1.0),
        fontsize=8,
        frameon=False,
    )
    add_footer(figure, caption)
    return figure


def phase_timeline(
    results: Sequence[TrainResult], *, seconds: float = 0.5, title: str = "The first training steps, phase by phase"
) -> Figure:
    """One row per run: its first ``seconds`` of steps, phases laid end to end from the step timer."""
    rows = {}
    for result in results:
        spans, clock = [], 0.0
        for step in result.steps:
            for phase in PHASES:
                spans.append(Span("host", phase, clock, step[phase]))
                clock += step[phase]
            if clock >= seconds:
                break
        rows[f"{result.name}\n{result.config['batch_size']} samples/step"] = spans
    return _draw_timeline(rows, seconds=seconds, title=title, caption=provenance(results[-1]))


def trace_timeline(run: ProfiledRun, *, seconds: float | None = None, title: str | None = None) -> Figure:
    """The profiler's own trace: phase regions on the host row, kernels on the device row (on a GPU).

    Gaps are real: time the host spent outside every phase, or the device spent idle.
    """
    spans = run.phase_spans()
    rows = {"host (CPU)": [span for span in spans if span.row == "host"]}
    device_spans = [span for span in spans if span.row == "device"]
    caption = provenance(run.result)
    if device_spans:
        rows["device (GPU kernels)"] = device_spans
    else:
        caption += "; on a CPU the operators run inside the host's phases: there is no separate device row"
    end = max(span.start_s + span.duration_s for span in spans)
    return _draw_timeline(
        rows,
        seconds=seconds or end,
        caption=caption,
        title=title or f"Profiler trace of {len(run.result.steps)} steps of {run.result.name}",
    )


def throughput_curve(
    values: Sequence, results: Sequence[TrainResult], *, knob: str, title: str | None = None
) -> Figure:
    """Samples/s against one knob (batch size, workers...), one measured run per value."""
    figure, ax = plt.subplots(figsize=(6, 4))
    ax.plot([str(v) for v in values], [r.samples_per_s for r in results], marker="o")
    ax.set_xlabel(knob)
    ax.set_ylabel("training throughput (samples/s)")
    ax.set_ylim(bottom=0)
    ax.set_title(title or f"Throughput against {knob}")
    add_footer(figure, provenance(results[-1]))
    return figure


def memory_curve(values: Sequence, memories: Sequence, *, knob: str, caption: str, title: str | None = None) -> Figure:
    """Training memory against one knob, stacked by where it goes; ``memories`` are ``TrainingMemory``s."""
    figure, ax = plt.subplots(figsize=(6, 4))
    ax.stackplot(
        [float(v) for v in values],
        *[[getattr(m, part) / 1e6 for m in memories] for part in COMPONENTS],
        labels=[part.replace("_", " ") for part in COMPONENTS],
        alpha=0.85,
    )
    ax.set_xlabel(knob)
    ax.set_ylabel("memory (MB)")
    ax.set_title(title or f"Training memory against {knob}")
    ax.legend(loc="upper left", fontsize=8)
    add_footer(figure, caption)
    return figure


def ceiling_chart(measured, *, title: str = "Input pipelines against their compute ceiling") -> Figure:
    """Samples/s of each pipeline of a ``perflab.ceiling.CeilingMeasurement``, the ceiling as a dashed line."""
    pipelines, ceiling = measured.names, measured.samples_per_s("ceiling")
    rates = [measured.samples_per_s(name) for name in pipelines]
    figure, ax = plt.subplots(figsize=(max(6.0, 1.5 * len(pipelines) + 2), 4))
    ax.bar(range(len(pipelines)), rates, color="#1f77b4")
    ax.axhline(ceiling, color="#d62728", linestyle="--", label=f"compute ceiling: {ceiling:,.0f} samples/s")
    for index, (name, rate) in enumerate(zip(pipelines, rates)):
        ax.annotate(f"{measured.share(name):.0%}", (index, rate), ha="center", va="bottom", fontsize=9)
    ax.set_xticks(range(len(pipelines)), pipelines, fontsize=8)
    ax.set_ylabel("training throughput (samples/s)")
    ax.set_ylim(0, 1.15 * max(ceiling, *rates))
    ax.set_title(title)
    ax.legend(loc="upper left", fontsize=8)
    add_footer(figure, f"{measured.caption}; labels: share of the ceiling")
    return figure


_SHARE_COLOURS = {"data": "#d62728", "compute": "#1f77b4", "memory": "#ff7f0e", "overhead": "#7f7f7f"}


def diagnosis_shares(
    diagnoses: Mapping[str, Diagnosis],
    *,
    caption: str,
    title: str = "Where the steps' time went, and the kind of run it makes",
) -> Figure:
    """One bar per run: its data, compute, memory and overhead shares, labelled with the kind they give."""
    names = list(diagnoses)
    figure, ax = plt.subplots(figsize=(9, 1.4 + 0.7 * len(names)))
    left = [0.0] * len(names)
    for part, colour in _SHARE_COLOURS.items():
        widths = [100 * diagnoses[name].shares[part] for name in names]
        ax.barh(range(len(names)), widths, left=left, color=colour, label=part)
        for row, (start, width) in enumerate(zip(left, widths)):
            if width >= 7:  # room for the label inside the bar
                ax.text(start + width / 2, row, f"{width:.0f}%", ha="center", va="center", fontsize=8, color="white")
        left = [start + width for start, width in zip(left, widths)]
    ax.set_yticks(range(len(names)), [f"{name}\ndiagnosed {diagnoses[name].kind}" for name in names], fontsize=8)
    ax.set_ylim(len(names) - 0.5, -0.5)
    ax.set_xlim(0, 100)
    ax.set_xlabel("share of the profiled steps' time (%)")
    ax.set_title(title)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    add_footer(figure, caption)
    return figure


def tradeoff_curve(tradeoff, *, caption: str, title: str = "Compute against memory, one point per variant") -> Figure:
    """A ``perflab.tradeoff.Tradeoff``: each variant's time relative to the first against its memory."""
    figure, ax = plt.subplots(figsize=(8, 4.2))
    relative = [tradeoff.relative_time(v.label) for v in tradeoff.variants]
    ax.plot([v.peak_bytes / 1e6 for v in tradeoff.variants], relative, marker="o", label="peak of forward + backward")
    ax.plot(
        [v.saved_bytes / 1e6 for v in tradeoff.variants],
        relative,
        marker="o",
        markerfacecolor="none",
        linestyle=":",
        label="activations kept for backward",
    )
    for variant, time in zip(tradeoff.variants, relative):
        ax.annotate(
            variant.label, (variant.peak_bytes / 1e6, time), textcoords="offset points", xytext=(5, 4), fontsize=8
        )
    ax.axhline(1.0, color="#7f7f7f", linewidth=0.8)
    ax.set_xlim(left=0)
    ax.set_xlabel("memory (MB)")
    ax.set_ylabel(f"step time relative to '{tradeoff.variants[0].label}'")
    ax.set_title(title)
    ax.legend(loc="upper right", fontsize=8)
    add_footer(figure, f"{tradeoff.caption}; {caption}")
    return figure


def break_even_chart(
    costs: Mapping, *, caption: str, title: str = "Eager against compiled: total time as the calls add up"
) -> Figure:
    """One panel per ``perflab.compiling.CompileCost``: total seconds after n calls, eager and compiled.

    The compiled line starts at the compile time and rises more slowly when compiling pays; a dotted
    line marks the call where the two totals meet.
    """
    figure, axes = plt.subplots(1, len(costs), figsize=(4.8 * len(costs), 3.8), squeeze=False)
    for ax, (name, cost) in zip(axes[0], costs.items()):
        eager, compiled = cost.comparison.baseline.median, cost.comparison.candidate.median
        # Past the break-even when there is one, else far enough for eager to spend the compile time three times.
        horizon = 2 * cost.break_even_calls if cost.pays_off else max(3 * cost.compile_seconds / eager, 10)
        ax.plot([0, horizon], [0, eager * horizon], color="#7f7f7f", label=f"eager: {format_seconds(eager)} per call")
        ax.plot(
            [0, horizon],
            [cost.compile_seconds, cost.compile_seconds + compiled * horizon],
            color="#1f77b4",
            label=f"compiled: {format_seconds(cost.compile_seconds)}, then {format_seconds(compiled)} per call",
        )
        if cost.pays_off:
            ax.axvline(cost.break_even_calls, color="#2ca02c", linestyle=":")
            ax.annotate(
                f"breaks even after {cost.break_even_calls:,} calls",
                (cost.break_even_calls, 0),
                textcoords="offset points",
                xytext=(4, 4),
                fontsize=8,
                color="#2ca02c",
            )
        else:
            ax.annotate(
                "no measurable saving per call:\nnever breaks even",
                (0.97, 0.05),
                xycoords="axes fraction",
                ha="right",
                fontsize=8,
                color="#d62728",
            )
        ax.set_xlim(0, horizon)
        ax.set_ylim(bottom=0)
        ax.set_xlabel("calls (steps)")
        ax.set_ylabel("total time (s)")
        ax.set_title(name, fontsize=10)
        ax.legend(loc="upper left", fontsize=7)
    figure.suptitle(title)
    add_footer(figure, caption)
    return figure
