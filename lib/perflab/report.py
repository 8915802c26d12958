"""An optimization report: every step from a baseline to the final pipeline, measured.

    >>> from perflab.report import OptimizationReport
    >>> report = OptimizationReport([baseline, cached_data, bigger_batch, final])
    >>> report              # a table: configuration, samples/s, speedup vs baseline, accuracy; and the environment
    >>> report.waterfall()  # each step's gain or loss in samples/s
    >>> report.timelines()  # the first half second of the baseline and of the final run, phase by phase

The first result is the baseline; each later one is a change on the way to the last.
"""

from __future__ import annotations

import html
from collections.abc import Sequence
from dataclasses import dataclass

from matplotlib.figure import Figure

from perflab.plots import phase_timeline, provenance, speedup_waterfall
from perflab.train_result import TrainResult


@dataclass(frozen=True)
class OptimizationReport:
    results: tuple[TrainResult, ...]

    def __init__(self, results: Sequence[TrainResult]):
        if len(results) < 2:
            raise ValueError("a report needs a baseline and at least one change: pass two or more TrainResults")
        if not all(isinstance(result, TrainResult) for result in results):
            raise TypeError("a report is made of TrainResults, as perflab.train.train returns them")
        object.__setattr__(self, "results", tuple(results))

    @property
    def baseline(self) -> TrainResult:
        return self.results[0]

    @property
    def final(self) -> TrainResult:
        return self.results[-1]

    @property
    def speedup(self) -> float:
        """The final run's samples/s over the baseline's, as measured in this notebook (the grader re-measures)."""
        return self.final.samples_per_s / self.baseline.samples_per_s

    def rows(self) -> list[dict]:
        return [
            {
                "configuration": result.name,
                "samples/s": result.samples_per_s,
                "speedup vs baseline": result.samples_per_s / self.baseline.samples_per_s,
                "val accuracy": result.val_accuracy,
                "biggest phase": max(result.phase_shares.items(), key=lambda kv: kv[1]),
            }
            for result in self.results
        ]

    def environments(self) -> list[str]:
        """Where the runs were measured; more than one line means the report mixes machines."""
        return sorted({provenance(result) for result in self.results})

    def __repr__(self) -> str:
        lines = [f"{'configuration':<24}{'samples/s':>11}{'speedup':>9}{'accuracy':>10}  biggest phase"]
        for row in self.rows():
            phase, share = row["biggest phase"]
            lines.append(
                f"{row['configuration']:<24}{row['samples/s']:>11,.0f}{row['speedup vs baseline']:>8.2f}x"
                f"{row['val accuracy']:>10.1%}  {phase} {share:.0%}"
            )
        return "\n".join(lines + self.environments())

    def _repr_html_(self) -> str:
        header = "".join(
            f"<th>{name}</th>"
            for name in ("configuration", "samples/s", "speedup vs baseline", "val accuracy", "biggest phase")
        )
        body = "".join(
            f"<tr><td>{html.escape(row['configuration'])}</td><td>{row['samples/s']:,.0f}</td>"
            f"<td>{row['speedup vs baseline']:.2f}x</td><td>{row['val accuracy']:.1%}</td>"
            f"<td>{row['biggest phase'][0]} {row['biggest phase'][1]:.0%}</td></tr>"
            for row in self.rows()
        )
        environment = "<br>".join(html.escape(line) for line in self.environments())
        return f"<table><tr>{header}</tr>{body}</table><p><small>{environment}</small></p>"

    def waterfall(self) -> Figure:
        return speedup_waterfall(self.results)

    def timelines(self, seconds: float = 0.5) -> Figure:
        return phase_timeline(
            [self.baseline, self.final],
            seconds=seconds,
            title="Before and after: the first training steps, phase by phase",
        )
