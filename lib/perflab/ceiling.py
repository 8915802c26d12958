"""How close an input pipeline comes to its compute ceiling: the same step on batches already in memory.

    >>> import torch
    >>> import torch.nn.functional as F
    >>> from perflab.ceiling import measure_against_ceiling
    >>> from perflab.data import make_image_folder
    >>> from perflab.models import ResNet, ResNetConfig
    >>> from perflab.pipeline import CachedImages, cached_batches, pil_loader, to_model_input
    >>> from perflab.plots import ceiling_chart
    >>> data = make_image_folder(num_classes=3, train_per_class=20, val_per_class=4, image_size=32, progress=False)
    >>> cache, model = CachedImages(data.train, progress=False), ResNet(ResNetConfig(num_classes=3))
    >>> optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    >>> def step(images, labels):        # one training step on one batch, whichever pipeline made it
    ...     images = to_model_input(images) if images.dtype == torch.uint8 else images
    ...     F.cross_entropy(model(images), labels).backward()
    ...     optimizer.step()
    ...     optimizer.zero_grad()
    >>> ceiling_batches = list(cached_batches(cache, batch_size=20, seed=0))   # ready before the clock starts
    >>> measured = measure_against_ceiling(
    ...     {"per-sample PIL": lambda seed: pil_loader(data.train, batch_size=20, seed=seed),
    ...      "decoded once": lambda seed: cached_batches(cache, batch_size=20, seed=seed)},
    ...     step, ceiling_batches, rounds=3)
    >>> measured                         # each pipeline's share of the ceiling, and the ceiling's samples/s
    CeilingMeasurement(per-sample PIL ...%, decoded once ...% of a ceiling of ... samples/s)
    >>> print(f"decoded once: {measured.share('decoded once'):.0%} of the ceiling")   # median of per-round ratios
    decoded once: ...% of the ceiling
    >>> measured.rounds, measured.samples_per_epoch("decoded once")
    (3, 60)
    >>> ceiling_chart(measured)          # perflab.plots: samples/s of each pipeline, the ceiling as a line
    <Figure size ... with 1 Axes>
    >>> decoded_once = {"decoded once": lambda seed: cached_batches(cache, batch_size=20, seed=seed)}
    >>> measure_against_ceiling(decoded_once, step, ceiling_batches, rounds=3, interleave="steps")   # CPU only
    CeilingMeasurement(decoded once ...% of a ceiling of ... samples/s)

A pipeline is a function ``epoch(seed)`` returning an iterable of ``(images, labels)`` batches;
``step(images, labels)`` trains on one batch (moving it to the device is its job). The ceiling
is ``step`` on ``ceiling_batches``, prepared before the clock starts: no input pipeline can feed
the step faster than that. Every round times one epoch of each pipeline and the ceiling, in
alternating order, so that whatever slows the machine down during the run (another process,
clock changes) hits both sides of each ratio alike; the share is the median of the per-round
ratios. Starting an epoch's iterator is inside the clock: a ``DataLoader`` starts its workers
there, as it does in training.

Used in: lecture 03 (data loading), lab 03.
"""

from __future__ import annotations

import itertools
import statistics
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from tqdm.auto import tqdm

from perflab.bench import interleaved_rounds, median_ratio
from perflab.device import pick_device, synchronize
from perflab.render import Environment, Table

__all__ = ["CEILING", "CeilingMeasurement", "Epoch", "measure_against_ceiling", "time_epoch"]

_Batch = Sequence[torch.Tensor]
CEILING = "ceiling"


@dataclass(frozen=True)
class Epoch:
    """One timed pass: samples, seconds, seconds spent waiting for the next batch, and steps."""

    samples: int
    seconds: float
    waiting_s: float
    steps: int

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.seconds


def time_epoch(
    batches: Callable[[], Iterable[_Batch]],
    step: Callable[..., object],
    device: torch.device,
    max_steps: int | None = None,
) -> Epoch:
    """Run ``step`` on every batch of ``batches()`` (at most ``max_steps``), with the device synchronized at both ends."""
    synchronize(device)
    start = time.perf_counter()
    samples, waiting_s, steps = 0, 0.0, 0
    iterator = iter(batches())
    while steps != max_steps:
        wait_start = time.perf_counter()
        batch = next(iterator, None)
        waiting_s += time.perf_counter() - wait_start
        if batch is None:
            break
        step(*batch)
        samples += len(batch[1])
        steps += 1
    synchronize(device)
    return Epoch(samples, time.perf_counter() - start, waiting_s, steps)


@dataclass(frozen=True)
class CeilingMeasurement:
    """Rounds of each pipeline's epoch and the ceiling epoch it is compared with: ``epochs[name][round]``."""

    names: tuple[str, ...]  # the pipelines
    epochs: Mapping[str, tuple[Epoch, ...]]
    ceilings: Mapping[str, tuple[Epoch, ...]]  # the ceiling's epoch each pipeline epoch is compared with
    interleave: str
    environment: Environment

    def samples_per_s(self, name: str) -> float:
        """Median over rounds; ``CEILING`` for the ceiling."""
        epochs = self._ceiling_epochs() if name == CEILING else self.epochs[name]
        return statistics.median(epoch.samples_per_s for epoch in epochs)

    def share(self, name: str) -> float:
        """Median over rounds of the pipeline's samples/s over the ceiling's in the same round."""
        return median_ratio(
            (epoch.samples_per_s for epoch in self.epochs[name]),
            (epoch.samples_per_s for epoch in self.ceilings[name]),
        )

    def waiting_share(self, name: str) -> float:
        """Median share of an epoch's time spent waiting for the next batch."""
        return statistics.median(epoch.waiting_s / epoch.seconds for epoch in self.epochs[name])

    def samples_per_epoch(self, name: str) -> int:
        return self.epochs[name][-1].samples

    @property
    def rounds(self) -> int:
        return len(self.epochs[self.names[0]])

    def _ceiling_epochs(self) -> list[Epoch]:
        unique = {id(epoch): epoch for side in self.ceilings.values() for epoch in side}
        return list(unique.values())

    @property
    def caption(self) -> str:
        unit = "step by step" if self.interleave == "steps" else "epoch by epoch"
        return f"median of {self.rounds} rounds interleaved {unit} on {self.environment}"

    def _table(self) -> Table:
        rows = [
            (name, f"{self.samples_per_s(name):,.0f}", f"{self.share(name):.0%}", f"{self.waiting_share(name):.0%}")
            for name in self.names
        ]
        rows.append((CEILING, f"{self.samples_per_s(CEILING):,.0f}", "100%", "0%"))
        header = ("pipeline", "samples/s", "of ceiling", "waiting for data")
        return Table(header, rows, caption=self.caption, numeric=(1, 2, 3))

    def __str__(self) -> str:
        return str(self._table())

    def __repr__(self) -> str:
        shares = ", ".join(f"{name} {self.share(name):.0%}" for name in self.names)
        return f"CeilingMeasurement({shares} of a ceiling of {self.samples_per_s(CEILING):,.0f} samples/s)"

    def _repr_html_(self) -> str:
        return self._table()._repr_html_()


def _paired_epoch(
    batches: Callable[[], Iterable[_Batch]], step: Callable[..., object], ceiling: Iterator[_Batch]
) -> tuple[Epoch, Epoch]:
    """One epoch of ``batches()``, each of its steps followed by a step on the next ``ceiling`` batch (CPU only).

    Returns the pipeline's epoch (starting the iterator and every ``next()`` included) and the
    ceiling's, made of the steps in between.
    """
    clock = time.perf_counter
    start = clock()
    iterator = iter(batches())
    pipeline_s, ceiling_s, waiting_s, samples, ceiling_samples, steps = clock() - start, 0.0, 0.0, 0, 0, 0
    while True:
        pipeline_start = clock()
        batch = next(iterator, None)
        waiting_s += clock() - pipeline_start
        if batch is None:
            pipeline_s += clock() - pipeline_start
            break
        step(*batch)
        samples, steps = samples + len(batch[1]), steps + 1
        # Freed before the ceiling's step, as a training loop would free it: a batch kept alive through the
        # other side's step would change what the allocator does there (keep memory, or give it back).
        del batch
        ceiling_start = clock()
        pipeline_s += ceiling_start - pipeline_start
        ceiling_batch = next(ceiling)
        step(*ceiling_batch)
        ceiling_s += clock() - ceiling_start
        ceiling_samples += len(ceiling_batch[1])
    return Epoch(samples, pipeline_s, waiting_s, steps), Epoch(ceiling_samples, ceiling_s, 0.0, steps)


def measure_against_ceiling(
    pipelines: Mapping[str, Callable[[int], Iterable[_Batch]]],
    step: Callable[..., object],
    ceiling_batches: Sequence[_Batch],
    *,
    rounds: int = 5,
    max_steps: int | None = None,
    interleave: Literal["epochs", "steps"] = "epochs",
    device: str | torch.device | None = None,
    progress: bool = False,
) -> CeilingMeasurement:
    """Time each pipeline's epoch (seed = round number) against the ceiling, in alternating order, after a warm-up epoch.

    ``interleave="epochs"``: a whole epoch of each pipeline, then as many steps of the ceiling
    as the first pipeline's warm-up epoch had, cycling through ``ceiling_batches``; the order
    reverses every other round. Right for every pipeline and device. ``max_steps`` cuts every
    epoch short: quicker, but it weighs each epoch's start-up (starting workers, for one) more.

    ``interleave="steps"`` (CPU only): every step of a pipeline's epoch next to a step of the
    ceiling, so that each pair sees the same machine: on a CPU shared with other work, far
    steadier than whole epochs. Only for pipelines that make each batch inside ``next()``: work
    done in the background (``DataLoader`` workers, threads) would also run during the ceiling's
    steps and look free. On a GPU the host runs ahead of the device, so a single step has no
    time of its own without a sync that would stop that overlap.
    """
    if not pipelines or CEILING in pipelines:
        raise ValueError(f"give at least one pipeline, none of them named {CEILING!r}")
    if rounds < 1 or not ceiling_batches:
        raise ValueError("need rounds >= 1 and at least one ceiling batch")
    device = pick_device(device)
    if interleave not in ("epochs", "steps") or (interleave == "steps" and device.type != "cpu"):
        raise ValueError(f"interleave must be 'epochs', or 'steps' on a CPU; got {interleave!r} on {device}")
    bar = tqdm(
        total=(len(pipelines) + (interleave == "epochs")) * (rounds + 1),
        desc="interleaved epochs",
        unit="epoch",
        disable=not progress,
    )
    ceiling_steps = None

    def run_epoch(name: str, seed: int) -> Epoch:
        if name == CEILING:
            epoch = time_epoch(lambda: itertools.islice(itertools.cycle(ceiling_batches), ceiling_steps), step, device)
        else:
            epoch = time_epoch(lambda: pipelines[name](seed), step, device, max_steps)
        bar.update()
        return epoch

    def run_paired(name: str, seed: int) -> tuple[Epoch, Epoch]:
        pair = _paired_epoch(
            lambda: itertools.islice(pipelines[name](seed), max_steps), step, itertools.cycle(ceiling_batches)
        )
        bar.update()
        return pair

    def paired_side(name: str) -> Callable[[int], tuple[Epoch, Epoch]]:
        def run(round_index: int) -> tuple[Epoch, Epoch]:
            pair = run_paired(name, seed=round_index)
            if round_index == rounds and pair[0].steps == 0:  # the warm-up
                raise ValueError(f"pipeline {name!r} gave no batch")
            return pair

        return run

    def pipeline_side(name: str) -> Callable[[int], Epoch]:
        def run(round_index: int) -> Epoch:
            nonlocal ceiling_steps
            epoch = run_epoch(name, seed=round_index)
            if round_index == rounds:  # the warm-up: first calls, allocator, caches, files in the page cache
                if epoch.steps == 0:
                    raise ValueError(f"pipeline {name!r} gave no batch")
                ceiling_steps = ceiling_steps or epoch.steps  # the first pipeline's, before the ceiling's warm-up
            return epoch

        return run

    epochs: dict[str, list[Epoch]] = {}
    ceilings: dict[str, list[Epoch]] = {}
    if interleave == "steps":
        for name, side in zip(pipelines, interleaved_rounds([paired_side(name) for name in pipelines], rounds)):
            epochs[name] = [pipeline_epoch for pipeline_epoch, _ in side]
            ceilings[name] = [ceiling_epoch for _, ceiling_epoch in side]
    else:
        *sides, ceiling_side = interleaved_rounds(
            [*(pipeline_side(name) for name in pipelines), lambda round_index: run_epoch(CEILING, seed=round_index)],
            rounds,
        )
        for name, side in zip(pipelines, sides):
            epochs[name], ceilings[name] = side, ceiling_side
    bar.close()
    return CeilingMeasurement(
        tuple(pipelines),
        {name: tuple(side) for name, side in epochs.items()},
        {name: tuple(side) for name, side in ceilings.items()},
        interleave,
        Environment.capture(device),
    )
