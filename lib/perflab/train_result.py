"""What a training run measured: speed, where the time went, and what it learned.

>>> result = perflab.train.train(perflab.train.NAIVE)
>>> result.samples_per_s, result.val_accuracy
>>> result.phase_shares        # {'data_wait': 0.6, 'h2d': 0.01, 'fwd': 0.12, ...}
>>> result                     # prints a one-line summary; a table in a notebook
"""

from __future__ import annotations

import datetime
import html
import json
import platform
import subprocess
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from perflab.device import device_name

# data_wait: waiting for the next batch; h2d: copy to the device (and uint8 -> float);
# fwd / bwd / opt: forward, backward, optimizer step; log: losses, metrics and log lines.
PHASES = ("data_wait", "h2d", "fwd", "bwd", "opt", "log")


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


def environment(device: torch.device) -> dict:
    """Where a measurement was taken: enough to tell two machines' results apart."""
    return {
        "device": str(device),
        "device_name": device_name(device),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "date": datetime.date.today().isoformat(),
        "commit": _git_commit(),
    }


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
    environment: dict

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
            f"{self.samples} samples in {self.train_s:.2f} s on {self.environment['device']}; time: {self._shares_text()})"
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
            (
                "measured on",
                f"{self.environment['device_name']} ({self.environment['device']}), torch "
                f"{self.environment['torch']}, {self.environment['threads']} threads",
            ),
        ]
        body = "".join(f"<tr><th style='text-align:left'>{k}</th><td>{html.escape(str(v))}</td></tr>" for k, v in rows)
        return f"<table>{body}</table>"

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> TrainResult:
        return cls(**json.loads(text))
