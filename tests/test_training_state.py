"""perflab.training_state: a resumed run continues bit for bit, a crash mid-save keeps the last good state."""

from __future__ import annotations

import importlib
import random
import sys
from dataclasses import dataclass

import numpy as np
import perflab.training_state
import pytest
import torch
from perflab.training_state import load_training_state, save_training_state
from torch import nn

STEPS, CRASH_AT, BATCH = 24, 11, 16


@dataclass
class Run:
    """A small training run whose every step draws on each kind of random state a real one uses."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    scaler: torch.amp.GradScaler
    shuffle: torch.Generator

    @classmethod
    def fresh(cls, seed: int) -> Run:
        torch.manual_seed(seed)
        model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.2), nn.Linear(32, 1))  # dropout: torch's RNG
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=1e-2, total_steps=STEPS)
        return cls(model, optimizer, scheduler, torch.amp.GradScaler("cpu"), torch.Generator().manual_seed(seed))

    def step(self, inputs: torch.Tensor, targets: torch.Tensor) -> float:
        chosen = torch.randperm(len(inputs), generator=self.shuffle)[:BATCH]
        noise = random.gauss(0, 0.01) + np.random.normal(0, 0.01)  # Python's and NumPy's RNGs
        loss = nn.functional.mse_loss(self.model(inputs[chosen]).squeeze(1), targets[chosen] + noise)
        self.optimizer.zero_grad(set_to_none=True)
        self.scaler.scale(loss).backward()
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.scheduler.step()
        return loss.item()

    def objects(self) -> dict:
        return {
            "model": self.model,
            "optimizer": self.optimizer,
            "scheduler": self.scheduler,
            "scaler": self.scaler,
            "generators": {"shuffle": self.shuffle},
        }


@pytest.fixture
def problem():
    generator = torch.Generator().manual_seed(0)
    inputs = torch.randn(256, 8, generator=generator)
    return inputs, inputs.sum(dim=1).sin()


def _seed_global_rngs(seed: int) -> None:
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)


def _uninterrupted_and_interrupted(problem) -> tuple[Run, list[float], Run, list[float]]:
    """The same run twice: once for all STEPS, once stopped at CRASH_AT."""
    runs, losses = [], []
    for steps in (STEPS, CRASH_AT):
        run = Run.fresh(seed=1)
        _seed_global_rngs(2)
        runs.append(run)
        losses.append([run.step(*problem) for _ in range(steps)])
    return runs[0], losses[0], runs[1], losses[1]


def test_a_resumed_run_continues_exactly(tmp_path, problem):
    run, uninterrupted, first, losses = _uninterrupted_and_interrupted(problem)
    save_training_state(tmp_path / "last.pt", step=CRASH_AT, **first.objects())

    resumed = Run.fresh(seed=99)  # a new process: other weights, other random states
    _seed_global_rngs(99)
    step = load_training_state(tmp_path / "last.pt", **resumed.objects())
    losses += [resumed.step(*problem) for _ in range(step, STEPS)]

    assert step == CRASH_AT
    assert losses == uninterrupted  # bit for bit, not approximately
    for mine, reference in zip(resumed.model.parameters(), run.model.parameters()):
        assert torch.equal(mine, reference)
    assert resumed.scheduler.get_last_lr() == run.scheduler.get_last_lr()


def test_without_the_random_states_the_run_would_diverge(tmp_path, problem):
    """The control: the same resume, minus the generators and global RNGs, is not the same run."""
    _, uninterrupted, first, losses = _uninterrupted_and_interrupted(problem)
    weights_only = {
        "model": first.model.state_dict(),
        "optimizer": first.optimizer.state_dict(),
        "scheduler": first.scheduler.state_dict(),
        "scaler": first.scaler.state_dict(),
    }
    resumed = Run.fresh(seed=99)
    _seed_global_rngs(99)
    for name, state in weights_only.items():
        getattr(resumed, name).load_state_dict(state)
    losses += [resumed.step(*problem) for _ in range(CRASH_AT, STEPS)]
    assert losses[:CRASH_AT] == uninterrupted[:CRASH_AT]
    assert losses[CRASH_AT:] != uninterrupted[CRASH_AT:]


def test_a_crash_mid_save_keeps_the_last_good_checkpoint(tmp_path, problem, monkeypatch):
    run = Run.fresh(seed=1)
    path = save_training_state(tmp_path / "last.pt", step=5, **run.objects())
    before = path.read_bytes()

    def crash_halfway(state, file):
        file.write(b"\x80half a checkpoint")
        raise KeyboardInterrupt("the job was killed mid-save")

    monkeypatch.setattr(perflab.training_state.torch, "save", crash_halfway)
    with pytest.raises(KeyboardInterrupt):
        save_training_state(path, step=6, **run.objects())
    monkeypatch.undo()

    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.pt"]  # no partial file left behind
    assert load_training_state(path, **Run.fresh(seed=3).objects()) == 5


class Payload:
    def __reduce__(self):
        return (print, ("this ran while the checkpoint was being opened",))


def test_loading_refuses_code_hidden_in_a_checkpoint(tmp_path):
    run = Run.fresh(seed=1)
    path = save_training_state(tmp_path / "last.pt", step=1, **run.objects())
    state = torch.load(path, weights_only=True)
    state["model"]["0.weight"] = Payload()
    torch.save(state, path)
    with pytest.raises(Exception, match="[Ww]eights only load failed"):
        load_training_state(path, **Run.fresh(seed=1).objects())


def test_resuming_without_what_was_saved_is_an_error(tmp_path):
    run = Run.fresh(seed=1)
    path = save_training_state(tmp_path / "last.pt", step=1, **run.objects())
    objects = Run.fresh(seed=1).objects()
    with pytest.raises(ValueError, match="with a scheduler"):
        load_training_state(path, **{**objects, "scheduler": None})
    with pytest.raises(ValueError, match="generators"):
        load_training_state(path, **{**objects, "generators": {}})


def test_the_old_module_name_still_imports_but_warns(monkeypatch):
    monkeypatch.delitem(sys.modules, "perflab.checkpoint", raising=False)  # a cached module would not warn again
    with pytest.warns(DeprecationWarning, match="perflab.training_state"):
        old = importlib.import_module("perflab.checkpoint")
    assert old.save_training_state is save_training_state and old.load_training_state is load_training_state
