"""What a training run measured: speed, where the time went, and what it learned.

>>> from perflab.train import NAIVE, Workload, train
>>> tiny = Workload(num_classes=3, train_per_class=20, val_per_class=4, image_size=32, epochs=1)
>>> result = train(NAIVE, tiny, progress=False)
>>> result.samples, len(result.steps)          # 60 samples in batches of 32: two steps, each timed by phase
(60, 2)
>>> list(result.phase_shares)                  # shares of the training time; "other": what no phase covered
['data_wait', 'h2d', 'fwd', 'bwd', 'opt', 'log', 'other']
>>> round(sum(result.phase_shares.values()), 6)
1.0
>>> result                                     # a one-line summary; a table in a notebook
TrainResult(naive: ... samples/s, val accuracy ...%, 60 samples in ... s on ...; time: data_wait ...%, ...)
>>> TrainResult.from_json(result.to_json()) == result
True

Used in: lecture 02 (profiling), lab 02.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

from perflab.render import Environment, Table

__all__ = ["PHASES", "TrainResult"]

# data_wait: waiting for the next batch; h2d: copy to the device (and uint8 -> float);
# fwd / bwd / opt: forward, backward, optimizer step; log: losses, metrics and log lines.
PHASES = ("data_wait", "h2d", "fwd", "bwd", "opt", "log")


@dataclass(frozen=True)
class TrainResult:
    config: dict
    model_parameters: int
    samples: int
    train_s: float
    setup_s: float
    eval_s: float
    steps: list  # one {phase: seconds} per step
    losses: list  # one per step
    train_accuracy: float
    val_accuracy: float
    environment: Environment

    @property
    def name(self) -> str:
        return self.config["name"]

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.train_s

    @property
    def phase_totals(self) -> dict[str, float]:
        return {phase: sum(step[phase] for step in self.steps) for phase in PHASES}

    @property
    def phase_shares(self) -> dict[str, float]:
        """Each phase's share of the training time; ``other`` is what no phase covered."""
        shares = {phase: seconds / self.train_s for phase, seconds in self.phase_totals.items()}
        shares["other"] = max(0.0, 1.0 - sum(shares.values()))
        return shares

    def _shares_text(self) -> str:
        return ", ".join(f"{phase} {share:.0%}" for phase, share in self.phase_shares.items())

    def __repr__(self) -> str:
        return (
            f"TrainResult({self.name}: {self.samples_per_s:,.0f} samples/s, val accuracy {self.val_accuracy:.1%}, "
            f"{self.samples} samples in {self.train_s:.2f} s on {self.environment.device}; time: {self._shares_text()})"
        )

    def _repr_html_(self) -> str:
        rows = [
            ("configuration", self.name),
            ("samples/s", f"{self.samples_per_s:,.0f}"),
            ("validation accuracy", f"{self.val_accuracy:.1%}"),
            ("training accuracy", f"{self.train_accuracy:.1%}"),
            ("samples seen", self.samples),
            ("training time", f"{self.train_s:.2f} s"),
            ("setup (data, caches, model)", f"{self.setup_s:.2f} s"),
            ("time per phase", self._shares_text()),
        ]
        return Table((), rows, caption=f"measured on {self.environment}")._repr_html_()

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> TrainResult:
        fields = json.loads(text)
        return cls(**fields | {"environment": Environment.from_dict(fields["environment"])})
