"""One training loop with the knobs of the performance checklist, timed phase by phase.

    >>> from perflab.train import NAIVE, OPTIMIZED, Workload, train
    >>> tiny = Workload(num_classes=3, train_per_class=20, val_per_class=4, image_size=32, epochs=1)
    >>> slow = train(NAIVE, tiny, progress=False)       # the anti-patterns, all of them
    >>> fast = train(OPTIMIZED, tiny, progress=False)   # the reference optimized pipeline
    >>> slow.samples, fast.samples                      # same model, same samples
    (60, 60)
    >>> print(f"speedup {fast.samples_per_s / slow.samples_per_s:.1f}x")    # on this machine, this run
    speedup ...x
    >>> fast                                            # samples/s, phase shares, accuracy, device
    TrainResult(optimized: ... samples/s, val accuracy ...%, 60 samples in ... s on ...; time: data_wait ...%, ...)

The course's own :class:`Workload` is 6 epochs of 5000 images (``train(NAIVE)`` takes minutes on a
laptop's CPU); the tiny one above trains one epoch of 60 images, in a fraction of a second.

What is trained (data, model, number of epochs, seed) is a :class:`Workload`; *how* it is
trained is a :class:`TrainConfig`. Changing the config may change the speed, never the task.

Used in: lecture 01 (gpu basics), lecture 02 (profiling), lab 12.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, replace
from typing import Literal

import torch
import torch.nn.functional as F
from torch.profiler import record_function
from tqdm.auto import tqdm

from perflab.data import cifar10_image_folder, make_image_folder
from perflab.device import pick_device, synchronize
from perflab.models import ResNet, ResNetConfig, count_parameters
from perflab.pipeline import CachedImages, cached_batches, center_crop, pil_loader, random_crop_flip, to_model_input
from perflab.render import Environment
from perflab.train_result import PHASES, TrainResult

__all__ = [
    "NAIVE",
    "OPTIMIZED",
    "OPTIMIZED_GPU",
    "PhaseTimer",
    "REFERENCE_BATCH_SIZE",
    "TrainConfig",
    "Workload",
    "build_model",
    "evaluate",
    "reference_for",
    "train",
]

_log = logging.getLogger(__name__)

REFERENCE_BATCH_SIZE = 32


@dataclass(frozen=True)
class Workload:
    """What is learned: fixed by the course, identical for every configuration compared."""

    num_classes: int = 10
    train_per_class: int = 500
    val_per_class: int = 100
    image_size: int = 64
    model: ResNetConfig = field(default_factory=ResNetConfig)
    epochs: int = 6
    seed: int = 0
    # CIFAR-10 you already have (the python pickles' folder) instead of the generated shapes:
    # the first ``*_per_class`` images of each class; ``image_size`` does not apply.
    cifar10_dir: str | None = None

    @property
    def train_samples(self) -> int:
        return self.num_classes * self.train_per_class


@dataclass(frozen=True)
class TrainConfig:
    """How to train: every field is a knob from the performance checklist."""

    name: str = "custom"
    # cached: decoded once, augmented by the host; device: the same cache in the device's memory, augmented there;
    # memory: the same few batches over and over, already on the device (the compute ceiling)
    pipeline: Literal["pil", "cached", "device", "memory"] = "pil"
    batch_size: int = 32
    lr: float = 0.1  # at batch size 32; scaled linearly with the effective batch size
    num_workers: int = 0
    pin_memory: bool = False
    persistent_workers: bool = False
    prefetch_factor: int | None = None
    non_blocking: bool = False
    channels_last: bool = False
    amp_dtype: Literal["bfloat16", "float16"] | None = None
    compile_mode: Literal["default", "reduce-overhead", "max-autotune"] | None = None
    checkpoint_blocks: bool = False
    accumulation_steps: int = 1
    log_every: int = 1  # steps between reading the loss on the host: each read is a sync
    python_metrics: bool = False  # count correct predictions sample by sample in Python
    set_to_none: bool = True
    eval_inference_mode: bool = True

    def __post_init__(self) -> None:
        if self.pipeline not in ("pil", "cached", "device", "memory"):
            raise ValueError(f"pipeline must be 'pil', 'cached', 'device' or 'memory', got {self.pipeline!r}")
        for name in ("batch_size", "accumulation_steps", "log_every"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name} must be a positive int, got {getattr(self, name)!r}")
        if self.num_workers < 0:
            raise ValueError(f"num_workers must be >= 0, got {self.num_workers}")
        if self.amp_dtype not in (None, "bfloat16", "float16"):
            raise ValueError(f"amp_dtype must be None, 'bfloat16' or 'float16', got {self.amp_dtype!r}")

    @property
    def effective_lr(self) -> float:
        """Linear scaling (Goyal et al., 2017): lr grows with the samples per optimizer step."""
        return self.lr * self.batch_size * self.accumulation_steps / REFERENCE_BATCH_SIZE


# What the seeds call anti-patterns, together: no workers, per-sample PIL transforms, a small
# batch, a sync and a log line every step, accuracy counted sample by sample in Python.
NAIVE = TrainConfig(
    name="naive",
    pipeline="pil",
    batch_size=32,
    log_every=1,
    python_metrics=True,
    set_to_none=False,
    eval_inference_mode=False,
)
# Decode once, augment whole batches as tensors, twice the batch, read the loss rarely. The
# learning rate scales linearly with the batch; a batch of 128 would be faster still, but in
# six epochs its 4x fewer steps cost accuracy.
OPTIMIZED = TrainConfig(name="optimized", pipeline="cached", batch_size=64, channels_last=True, log_every=50)
# On a GPU the host's per-batch work is the bottleneck left: the decoded images (19 MB) live in GPU
# memory and are cropped and flipped there, and the step runs under low-precision autocast.
OPTIMIZED_GPU = replace(OPTIMIZED, name="optimized for a GPU", pipeline="device", amp_dtype="bfloat16")


def reference_for(device: str | torch.device) -> TrainConfig:
    """The course's optimized pipeline for a device: :data:`OPTIMIZED_GPU` on CUDA (float16 autocast on a GPU
    without bfloat16 units, such as a T4), :data:`OPTIMIZED` elsewhere.

        >>> reference_for("cpu").name
        'optimized'
    """
    device = torch.device(device)
    if device.type != "cuda":
        return OPTIMIZED
    if torch.cuda.is_bf16_supported(including_emulation=False):
        return OPTIMIZED_GPU
    return replace(OPTIMIZED_GPU, amp_dtype="float16")


class PhaseTimer:
    """Seconds per phase per step, each phase also a ``record_function`` region for the profiler.

    Host clocks on the CPU, where each operator has finished when it returns; CUDA events on
    a GPU, which time the device's work without making the host wait for it.
    """

    def __init__(self, device: torch.device):
        self.use_events = device.type == "cuda"
        self.steps: list[dict[str, float]] = []
        self._events: list[tuple[int, str, torch.cuda.Event, torch.cuda.Event]] = []

    def new_step(self) -> None:
        self.steps.append(dict.fromkeys(PHASES, 0.0))

    @contextlib.contextmanager
    def phase(self, name: str, host_only: bool = False) -> Iterator[None]:
        with record_function(name):
            if self.use_events and not host_only:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                yield
                end.record()
                self._events.append((len(self.steps) - 1, name, start, end))
            else:
                start_s = time.perf_counter()
                yield
                self.steps[-1][name] += time.perf_counter() - start_s

    def resolve(self) -> list[dict[str, float]]:
        """The per-step phase times; reads the GPU's events, so call it once, after training."""
        for step, name, start, end in self._events:
            end.synchronize()
            self.steps[step][name] += start.elapsed_time(end) / 1e3
        self._events.clear()
        return self.steps


class _Data:
    """The dataset, and its decoded caches where the config or the evaluation needs them."""

    def __init__(self, config: TrainConfig, workload: Workload, progress: bool, device: torch.device):
        if workload.cifar10_dir:
            split = cifar10_image_folder(
                workload.cifar10_dir,
                train_per_class=workload.train_per_class,
                val_per_class=workload.val_per_class,
                progress=progress,
            )
        else:
            split = make_image_folder(
                num_classes=workload.num_classes,
                train_per_class=workload.train_per_class,
                val_per_class=workload.val_per_class,
                image_size=workload.image_size,
                seed=workload.seed,
                progress=progress,
            )
        self.train = split.train
        self.val = CachedImages(split.val, progress=progress)
        self.cache = CachedImages(split.train, progress=progress) if config.pipeline != "pil" else None
        if config.pipeline == "device":
            self.cache = self.cache.to(device)
        if config.pipeline == "memory":
            generator = torch.Generator().manual_seed(workload.seed)
            first = self.cache.images[: 4 * config.batch_size]
            self.memory_batches = [
                (
                    random_crop_flip(first[i : i + config.batch_size], generator).to(device),
                    self.cache.labels[i : i + config.batch_size].to(device),
                )
                for i in range(0, len(first), config.batch_size)
            ]

    def epoch(self, config: TrainConfig, workload: Workload, epoch: int):
        seed = workload.seed * 1000 + epoch
        if config.pipeline == "pil":
            return pil_loader(
                self.train,
                batch_size=config.batch_size,
                seed=seed,
                num_workers=config.num_workers,
                pin_memory=config.pin_memory,
                persistent_workers=config.persistent_workers,
                prefetch_factor=config.prefetch_factor,
            )
        if config.pipeline in ("cached", "device"):
            return cached_batches(self.cache, batch_size=config.batch_size, seed=seed, pin_memory=config.pin_memory)
        steps = math.ceil(len(self.cache) / config.batch_size)  # as many steps as a real epoch
        return (self.memory_batches[i % len(self.memory_batches)] for i in range(steps))


def build_model(config: TrainConfig, workload: Workload, device: torch.device) -> torch.nn.Module:
    torch.manual_seed(workload.seed)  # every configuration starts from the same weights
    model = ResNet(replace(workload.model, checkpoint_blocks=config.checkpoint_blocks)).to(device)
    if config.channels_last:
        model = model.to(memory_format=torch.channels_last)
    return model


def train(
    config: TrainConfig = NAIVE,
    workload: Workload = Workload(),
    *,
    device: str | torch.device | None = None,
    progress: bool = True,
    max_steps: int | None = None,
) -> TrainResult:
    """Train ``workload`` the way ``config`` says; returns speed, phase times and accuracy.

    ``max_steps`` stops early, for a quick measurement of speed (explorers, profiles): the
    result then covers fewer samples than the workload, and its accuracy means little.
    The progress bar's updates cost microseconds against steps of milliseconds.
    """
    device = pick_device(device)
    setup_start = time.perf_counter()
    data = _Data(config, workload, progress, device)
    model = build_model(config, workload, device)
    step_model = torch.compile(model, mode=config.compile_mode) if config.compile_mode else model
    optimizer = torch.optim.SGD(
        model.parameters(), lr=config.effective_lr, momentum=0.9, nesterov=True, weight_decay=5e-4
    )
    steps_per_epoch = math.ceil(workload.train_samples / config.batch_size)
    # One-cycle (Smith & Topor, 2017): warm up, then anneal. Without the warmup a large batch's
    # scaled-up rate diverges in the first steps.
    schedule = torch.optim.lr_scheduler.OneCycleLR(
        optimizer,
        max_lr=config.effective_lr,
        total_steps=max(1, workload.epochs * steps_per_epoch // config.accumulation_steps),
    )
    scaler = torch.amp.GradScaler(device.type, enabled=config.amp_dtype == "float16")
    autocast = torch.autocast(
        device.type, dtype=getattr(torch, config.amp_dtype or "float32"), enabled=config.amp_dtype is not None
    )
    memory_format = torch.channels_last if config.channels_last else torch.contiguous_format
    setup_s = time.perf_counter() - setup_start

    timer = PhaseTimer(device)
    losses, correct, samples, step = [], torch.zeros((), device=device, dtype=torch.long), 0, 0
    python_correct = 0
    total_steps = (
        workload.epochs * steps_per_epoch if max_steps is None else min(max_steps, workload.epochs * steps_per_epoch)
    )
    bar = tqdm(total=total_steps, desc=f"training {config.name}", unit="step", disable=not progress)
    model.train()
    synchronize(device)
    start = time.perf_counter()
    for epoch in range(workload.epochs):
        if step == max_steps:
            break
        batches = iter(data.epoch(config, workload, epoch))
        while step != max_steps:
            timer.new_step()
            with timer.phase("data_wait", host_only=True):
                batch = next(batches, None)
            if batch is None:
                timer.steps.pop()
                break
            images, labels = batch
            with timer.phase("h2d"):
                images = images.to(device, non_blocking=config.non_blocking)
                labels = labels.to(device, non_blocking=config.non_blocking)
                if images.dtype == torch.uint8:
                    images = to_model_input(images)
                images = images.contiguous(memory_format=memory_format)
            with timer.phase("fwd"), autocast:
                logits = step_model(images)
                loss = F.cross_entropy(logits, labels) / config.accumulation_steps
            with timer.phase("bwd"):
                scaler.scale(loss).backward()
            with timer.phase("opt"):
                if (step + 1) % config.accumulation_steps == 0:
                    scaler.step(optimizer)
                    scaler.update()
                    schedule.step()
                    optimizer.zero_grad(set_to_none=config.set_to_none)
            with timer.phase("log"):
                losses.append(loss.detach() * config.accumulation_steps)
                predictions = logits.detach().argmax(dim=1)
                if config.python_metrics:
                    python_correct += sum(int(predictions[i] == labels[i]) for i in range(len(labels)))
                else:
                    correct += (predictions == labels).sum()
                if step % config.log_every == 0:  # formatting the loss reads it on the host: a sync
                    _log.info(f"{config.name} step {step}: loss {losses[-1]:.4f}")
            samples += len(labels)
            step += 1
            bar.update()
    synchronize(device)
    train_s = time.perf_counter() - start
    bar.close()

    eval_start = time.perf_counter()
    accuracy = evaluate(model, data.val, device, memory_format, autocast, config.eval_inference_mode)
    eval_s = time.perf_counter() - eval_start
    train_correct = python_correct if config.python_metrics else int(correct)
    return TrainResult(
        config=asdict(config),
        model_parameters=count_parameters(model),
        samples=samples,
        train_s=train_s,
        setup_s=setup_s,
        eval_s=eval_s,
        steps=timer.resolve(),
        losses=torch.stack(losses).tolist(),
        train_accuracy=train_correct / samples,
        val_accuracy=accuracy,
        environment=Environment.capture(device),
    )


def evaluate(
    model, val: CachedImages, device, memory_format, autocast, inference_mode: bool, batch_size: int = 500
) -> float:
    """Top-1 accuracy on the center-cropped validation images."""
    model.eval()
    correct = 0
    context = torch.inference_mode() if inference_mode else contextlib.nullcontext()
    with context, autocast:
        for start in range(0, len(val), batch_size):
            images = to_model_input(center_crop(val.images[start : start + batch_size]).to(device))
            logits = model(images.contiguous(memory_format=memory_format))
            correct += int((logits.argmax(dim=1) == val.labels[start : start + batch_size].to(device)).sum())
    model.train()
    return correct / len(val)
