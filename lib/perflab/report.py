"""An optimization report: every step from a baseline to the final pipeline, measured.

    >>> from dataclasses import replace
    >>> from perflab.report import OptimizationReport
    >>> from perflab.train import NAIVE, OPTIMIZED, Workload, train
    >>> tiny = Workload(num_classes=3, train_per_class=20, val_per_class=4, image_size=32, epochs=1)
    >>> steps = [NAIVE, replace(NAIVE, name="decoded once", pipeline="cached"), OPTIMIZED]
    >>> report = OptimizationReport([train(config, tiny, progress=False) for config in steps])
    >>> report              # configuration, samples/s, speedup vs baseline, accuracy; and where it was measured
    configuration  samples/s  speedup vs baseline  val accuracy  biggest phase
    naive                ...                1.00x  ...
    decoded once         ...
    optimized            ...
    measured on ...
    >>> report.waterfall()  # each step's gain or loss in samples/s
    <Figure size ... with 1 Axes>
    >>> report.timelines()  # the first half second of the baseline and of the final run, phase by phase
    <Figure size ... with 1 Axes>

The first result is the baseline; each later one is a change on the way to the last.

Used in: lab 12.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from matplotlib.figure import Figure

from perflab.plots import phase_timeline, provenance, speedup_waterfall
from perflab.render import Table
from perflab.train_result import TrainResult

__all__ = ["OptimizationReport"]


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

    def _table(self) -> Table:
        rows = [
            (
                row["configuration"],
                f"{row['samples/s']:,.0f}",
                f"{row['speedup vs baseline']:.2f}x",
                f"{row['val accuracy']:.1%}",
                f"{row['biggest phase'][0]} {row['biggest phase'][1]:.0%}",
            )
            for row in self.rows()
        ]
        header = ("configuration", "samples/s", "speedup vs baseline", "val accuracy", "biggest phase")
        return Table(header, rows, caption="\n".join(self.environments()), numeric=(1, 2, 3))

    def __repr__(self) -> str:
        return str(self._table())

    def _repr_html_(self) -> str:
        return self._table()._repr_html_()

    def waterfall(self) -> Figure:
        return speedup_waterfall(self.results)

    def timelines(self, seconds: float = 0.5) -> Figure:
        return phase_timeline(
            [self.baseline, self.final],
            seconds=seconds,
            title="Before and after: the first training steps, phase by phase",
        )
