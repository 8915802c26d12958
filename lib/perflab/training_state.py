"""Training-state checkpoints that resume a run exactly and survive a crash in the middle of a save.

    >>> import tempfile
    >>> from pathlib import Path
    >>> import torch
    >>> from perflab.training_state import load_training_state, save_training_state
    >>> model = torch.nn.Linear(4, 2)
    >>> optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    >>> schedule = torch.optim.lr_scheduler.StepLR(optimizer, step_size=10)
    >>> scaler, shuffle = torch.amp.GradScaler("cpu"), torch.Generator().manual_seed(0)
    >>> runs = tempfile.TemporaryDirectory()
    >>> path = save_training_state(Path(runs.name) / "last.pt", step=7, model=model, optimizer=optimizer,
    ...                            scheduler=schedule, scaler=scaler, generators={"shuffle": shuffle})
    >>> next_order = torch.randperm(5, generator=shuffle)         # what the run would draw next
    >>> step = load_training_state(path, model=model, optimizer=optimizer, scheduler=schedule,
    ...                            scaler=scaler, generators={"shuffle": shuffle})
    >>> step, torch.equal(torch.randperm(5, generator=shuffle), next_order)   # the same draw again: resumed exactly
    (7, True)
    >>> runs.cleanup()

A resumed run continues exactly as the uninterrupted one would have, to the bit, only if
everything that decides the next step comes back: the weights, the optimizer's moments, the
learning-rate schedule's position, the grad scaler's scale, and every random number generator
(torch's on the CPU and on each GPU, Python's, NumPy's, and the ``torch.Generator``s you made
yourself, for shuffling say). A save goes to a temporary file first and replaces the old
checkpoint only once it is complete on disk, so a crash mid-save leaves the last good one.
Loading uses ``torch.load(..., weights_only=True)``: a checkpoint from elsewhere can hold
tensors and plain data, never code that runs when it is opened.

Used in: lecture 05 (memory checkpointing), lab 05.
"""

from __future__ import annotations

import os
import random
from pathlib import Path

import numpy as np
import torch

__all__ = ["load_training_state", "save_training_state"]

_FORMAT = 1


def save_training_state(
    path: str | os.PathLike,
    *,
    step: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler=None,
    scaler: torch.amp.GradScaler | None = None,
    generators: dict[str, torch.Generator] | None = None,
) -> Path:
    """Write everything the next step depends on to ``path``, atomically; return the path."""
    state = {
        "format": _FORMAT,
        "step": step,
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "scheduler": None if scheduler is None else scheduler.state_dict(),
        "scaler": None if scaler is None else scaler.state_dict(),
        "generators": {name: generator.get_state() for name, generator in (generators or {}).items()},
        "rng": _global_rng_states(),
    }
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
    try:
        with open(partial, "wb") as file:
            torch.save(state, file)
            file.flush()
            os.fsync(file.fileno())  # on disk before it takes the old checkpoint's name
        os.replace(partial, path)  # atomic: readers see the old file or the new one, never half of one
        _sync_directory(path.parent)
    finally:
        partial.unlink(missing_ok=True)
    return path


def load_training_state(
    path: str | os.PathLike,
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler=None,
    scaler: torch.amp.GradScaler | None = None,
    generators: dict[str, torch.Generator] | None = None,
    map_location: str | torch.device | None = None,
) -> int:
    """Restore what :func:`save_training_state` wrote into these objects; return the step it was saved at."""
    state = torch.load(path, map_location=map_location, weights_only=True)
    if state.get("format") != _FORMAT:
        raise ValueError(f"{path} is not a perflab training state (format {state.get('format')!r}, expected {_FORMAT})")
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    for name, target in (("scheduler", scheduler), ("scaler", scaler)):
        if (target is None) != (state[name] is None):
            raise ValueError(
                f"{path} was saved {'with' if state[name] is not None else 'without'} a {name}: "
                f"pass {'one' if state[name] is not None else 'none'} to resume exactly"
            )
        if target is not None:
            target.load_state_dict(state[name])
    generators = generators or {}
    if set(generators) != set(state["generators"]):
        raise ValueError(f"{path} holds generators {sorted(state['generators'])}, got {sorted(generators)}")
    for name, generator in generators.items():
        generator.set_state(state["generators"][name])
    _restore_global_rng_states(state["rng"])
    return state["step"]


def _global_rng_states() -> dict:
    # NumPy's state is a tuple holding an array, which weights_only loading refuses: keep plain ints.
    kind, keys, position, has_gauss, cached_gaussian = np.random.get_state()
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "python": random.getstate(),
        "numpy": (kind, keys.tolist(), position, has_gauss, cached_gaussian),
    }


def _restore_global_rng_states(states: dict) -> None:
    torch.set_rng_state(states["torch"])
    if states["cuda"]:
        torch.cuda.set_rng_state_all(states["cuda"])
    random.setstate(states["python"])
    kind, keys, position, has_gauss, cached_gaussian = states["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), position, has_gauss, cached_gaussian))


def _sync_directory(directory: Path) -> None:
    """Make the rename itself durable (POSIX); Windows has no directory handles to sync."""
    if os.name == "posix":
        handle = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(handle)
        finally:
            os.close(handle)
