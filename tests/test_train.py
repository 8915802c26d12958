"""perflab.pipeline and perflab.train: the same augmented inputs by every route, and a loop whose knobs all run."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import numpy as np
import pytest
import torch
from perflab.data import make_image_folder
from perflab.device import pick_device
from perflab.pipeline import (
    CROP,
    RESIZE,
    CachedImages,
    cached_batches,
    center_crop,
    pil_loader,
    pil_transform,
    random_crop_flip,
    to_model_input,
)
from perflab.train import NAIVE, OPTIMIZED, PhaseTimer, TrainConfig, Workload, reference_for, train
from perflab.train_result import PHASES, TrainResult
from PIL import Image
from torchvision import transforms
from torchvision.datasets import ImageFolder

TINY = Workload(num_classes=3, train_per_class=24, val_per_class=8, image_size=32, epochs=1)
pytestmark = pytest.mark.usefixtures("private_data_cache")  # conftest.py


@pytest.fixture(scope="module")
def split():
    return make_image_folder(num_classes=3, train_per_class=24, val_per_class=8, image_size=32, progress=False)


def test_random_crop_flip_matches_cropping_each_image_by_hand():
    images = torch.randint(0, 256, (16, 3, RESIZE, RESIZE), dtype=torch.uint8)
    batch = random_crop_flip(images, torch.Generator().manual_seed(3))
    generator = torch.Generator().manual_seed(3)  # the same draws, in the same order
    top = torch.randint(0, RESIZE - CROP + 1, (16, 1, 1), generator=generator).flatten()
    left = torch.randint(0, RESIZE - CROP + 1, (16, 1, 1), generator=generator).flatten()
    flip = torch.rand(16, generator=generator) < 0.5
    for i in range(16):
        expected = images[i, :, top[i] : top[i] + CROP, left[i] : left[i] + CROP]
        if flip[i]:
            expected = expected.flip(-1)
        assert torch.equal(batch[i], expected)
    assert 0 < int(flip.sum()) < 16, "this seed should flip some images and not others"


def test_center_crop_and_model_input_match_torchvision():
    images = torch.randint(0, 256, (2, 3, RESIZE, RESIZE), dtype=torch.uint8)
    pil = Image.fromarray(images[0].permute(1, 2, 0).numpy())
    expected = transforms.Compose(
        [transforms.CenterCrop(CROP), transforms.ToTensor(), transforms.Normalize((0.5,) * 3, (0.5,) * 3)]
    )(pil)
    torch.testing.assert_close(to_model_input(center_crop(images))[0], expected, atol=1e-6, rtol=0)


def test_cached_images_hold_the_pixels_the_pil_path_resizes_and_are_reused(split):
    first = CachedImages(split.train, progress=False)
    cache_file = split.train.parent / f".decoded-train-{RESIZE}px.pt"
    stamp = cache_file.stat().st_mtime_ns
    again = CachedImages(split.train, progress=False)
    assert cache_file.stat().st_mtime_ns == stamp, "the second use must load the cache, not rebuild it"
    assert torch.equal(first.images, again.images)
    path, label = ImageFolder(split.train).samples[5]
    with Image.open(path) as image:
        resized = np.array(transforms.Resize(RESIZE)(image.convert("RGB")))
    assert torch.equal(first.images[5], torch.from_numpy(resized).permute(2, 0, 1))
    assert int(first.labels[5]) == label


def test_cached_batches_cover_every_sample_once_per_epoch(split):
    cache = CachedImages(split.train, progress=False)
    batches = list(cached_batches(cache, batch_size=10, seed=1))
    assert [len(labels) for _, labels in batches] == [10] * 7 + [2]
    assert batches[0][0].shape == (10, 3, CROP, CROP) and batches[0][0].dtype == torch.uint8
    seen = torch.cat([labels for _, labels in batches]).sort().values
    assert torch.equal(seen, cache.labels.sort().values)


def test_pil_loader_gives_normalized_crops(split):
    images, labels = next(iter(pil_loader(split.train, batch_size=8)))
    assert images.shape == (8, 3, CROP, CROP) and images.dtype == torch.float32
    assert -1.0 <= float(images.min()) and float(images.max()) <= 1.0
    assert pil_transform(train=False).transforms[1].size == (CROP, CROP)


@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(pipeline="disk"), "pipeline"),
        (dict(batch_size=0), "batch_size"),
        (dict(log_every=1.5), "log_every"),
        (dict(num_workers=-1), "num_workers"),
        (dict(amp_dtype="float8"), "amp_dtype"),
    ],
)
def test_config_rejects_what_it_cannot_run(fields, message):
    with pytest.raises(ValueError, match=message):
        TrainConfig(**fields)


def test_learning_rate_scales_with_samples_per_optimizer_step():
    assert TrainConfig(lr=0.1, batch_size=128).effective_lr == pytest.approx(0.4)
    assert TrainConfig(lr=0.1, batch_size=64, accumulation_steps=2).effective_lr == pytest.approx(0.4)


def _check_result(result: TrainResult, config: TrainConfig, workload: Workload) -> None:
    samples = workload.epochs * workload.train_samples
    assert result.samples == samples
    assert (
        len(result.steps)
        == len(result.losses)
        == workload.epochs * math.ceil(workload.train_samples / config.batch_size)
    )
    assert all(set(step) == set(PHASES) and all(t >= 0 for t in step.values()) for step in result.steps)
    assert sum(result.phase_totals.values()) <= result.train_s * 1.01
    assert all(math.isfinite(loss) for loss in result.losses)
    assert 0 <= result.val_accuracy <= 1 and 0 <= result.train_accuracy <= 1
    assert result.model_parameters > 0


@pytest.mark.parametrize(
    "config",
    [
        NAIVE,
        OPTIMIZED,
        replace(
            NAIVE,
            name="workers",
            num_workers=2,
            pin_memory=torch.cuda.is_available(),
            persistent_workers=True,
            prefetch_factor=4,
            non_blocking=True,
        ),
        replace(OPTIMIZED, name="memory", pipeline="memory"),
        replace(
            OPTIMIZED,
            name="bf16, checkpointed, accumulated",
            amp_dtype="bfloat16",
            checkpoint_blocks=True,
            batch_size=16,
            accumulation_steps=2,
            set_to_none=False,
            eval_inference_mode=False,
        ),
        replace(OPTIMIZED, name="fp16 + scaler", amp_dtype="float16", batch_size=24),
    ],
    ids=lambda config: config.name,
)
def test_every_knob_trains(config):
    result = train(config, TINY, progress=False)
    _check_result(result, config, TINY)
    assert result.name == config.name


def test_compiled_training_trains():
    config = replace(OPTIMIZED, name="compiled", compile_mode="default", batch_size=36)
    _check_result(train(config, TINY, progress=False), config, TINY)


def test_naive_and_optimized_train_the_same_model_on_the_same_samples():
    # The shares are timings: a busy neighbour (the suite's other worker) can stall either run, so the comparison
    # gets a second pair of runs; a pipeline that waits less in truth does not lose both.
    for _ in range(2):
        naive, optimized = (train(config, TINY, progress=False) for config in (NAIVE, OPTIMIZED))
        assert naive.samples == optimized.samples and naive.model_parameters == optimized.model_parameters
        if naive.phase_shares["data_wait"] > optimized.phase_shares["data_wait"]:
            break
    assert naive.phase_shares["data_wait"] > optimized.phase_shares["data_wait"], "the PIL path waits for data longer"


@pytest.mark.parametrize(
    "device",
    [
        "cpu",
        pytest.param(
            "cuda",
            marks=[pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")],
        ),
    ],
)
def test_a_cache_in_device_memory_trains_on_the_batches_the_host_cache_draws(device):
    host, on_device = (
        train(replace(OPTIMIZED, pipeline=pipeline), TINY, device=device, progress=False)
        for pipeline in ("cached", "device")
    )
    # The same crops and flips from the same CPU generator: the same losses (to a GPU's run-to-run noise).
    assert on_device.losses == pytest.approx(host.losses, rel=1e-3)
    assert reference_for(device).pipeline == ("device" if device == "cuda" else "cached")


def test_result_round_trips_through_json_and_prints_its_figures():
    result = train(OPTIMIZED, TINY, progress=False)
    again = TrainResult.from_json(result.to_json())
    assert again == result and json.loads(result.to_json())["environment"]["device"] == str(pick_device())
    assert "samples/s" in repr(result) and "val accuracy" in repr(result)
    assert "<table>" in result._repr_html_() and "samples/s" in result._repr_html_()
    assert set(result.phase_shares) == {*PHASES, "other"}


def test_phase_timer_adds_up_each_phase_on_the_host():
    timer = PhaseTimer(torch.device("cpu"))
    timer.new_step()
    for _ in range(2):
        with timer.phase("fwd"):
            torch.randn(200, 200) @ torch.randn(200, 200)
    steps = timer.resolve()
    assert steps[0]["fwd"] > 0 and steps[0]["bwd"] == 0


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA events time the GPU's work: needs a CUDA device")
def test_phase_timer_times_gpu_work_with_events():
    timer = PhaseTimer(torch.device("cuda"))
    timer.new_step()
    x = torch.randn(2048, 2048, device="cuda")
    with timer.phase("fwd"):
        for _ in range(10):
            x = x @ x.T / 2048
    assert timer.steps[0]["fwd"] == 0, "events are read only at resolve()"
    assert timer.resolve()[0]["fwd"] > 0
