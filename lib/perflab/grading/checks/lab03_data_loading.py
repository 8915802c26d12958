"""Lab 03 (data loading), decided outside the learner's kernel: its functions called on the grader's inputs.

    >>> from perflab.grading.checks.lab03_data_loading import CHECKS, crop_choices, epoch_case
    >>> sorted(CHECKS)
    ['test_batch_crop_flip', 'test_decode_once', 'test_fast_epoch', 'test_seed_worker']
    >>> epoch_case(seed=3)[:2]          # (samples, batch size, ...): fresh for every grading
    (351, 66)
    >>> images = torch.arange(2 * 3 * 36 * 36).reshape(2, 3, 36, 36).to(torch.uint8)
    >>> crop_choices(images, torch.stack([images[0, :, 1:33, 4:36], images[1, :, :32, :32].flip(-1)]))
    [9, 25]

Every input is drawn from the grading's seed. The crops are decided here, on the images the learner's
code returned: each must be one of the 50 crops and flipped crops of its input (``crop_choices``).
``test_ceiling`` is the lab's measured grader's (perflab.grading.data_lab.grade_lab03).

Used by perflab.grading.checks.
"""

from __future__ import annotations

import multiprocessing
import random
import tempfile

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from perflab.data import make_image_folder
from perflab.grading.checked import Check, differences

__all__ = [
    "ANSWERS",
    "CELLS",
    "CHECKS",
    "JitteredIndices",
    "crop_case",
    "crop_choices",
    "epoch_case",
    "folder_case",
    "tagged",
    "worker_case",
]

CELLS = ("colab_setup", "setup", "decode_once", "batch_crop_flip", "fast_epoch", "seed_worker")
ANSWERS = ("decode_once", "batch_crop_flip", "fast_epoch", "seed_worker")
CROP, PADDED = 32, 36
FLIP_SHARE = (0.35, 0.65)  # the share of flipped crops a fair coin gives over 300 or more images


def _cpu(tensor) -> torch.Tensor:
    if type(tensor) is not torch.Tensor:
        raise TypeError(f"expected a torch.Tensor, got a {type(tensor).__name__}")
    return tensor.detach().cpu()


def crop_choices(images: torch.Tensor, crops: torch.Tensor) -> list[int | None]:
    """Which of its input's 50 crops each crop is (top * 5 + left, plus 25 if flipped); None: none, or several."""
    windows = images.unfold(2, CROP, 1).unfold(3, CROP, 1).permute(0, 2, 3, 1, 4, 5).flatten(1, 2)
    candidates = torch.cat([windows, windows.flip(-1)], dim=1)  # [n, 50, channels, 32, 32]
    matches = (candidates == crops[:, None]).flatten(2).all(2)
    return [int(row.nonzero()) if row.sum() == 1 else None for row in matches]


def folder_case(seed: int) -> dict:
    """The image folder decode_once is tried on."""
    draw = random.Random(seed)
    return {
        "num_classes": draw.randint(2, 5),
        "train_per_class": draw.randint(2, 4),
        "image_size": draw.randint(40, 64),
        "seed": draw.randrange(10**6),
    }


def _decoded(namespace: dict, seed: int, decode) -> dict:
    with tempfile.TemporaryDirectory() as folder:
        small = make_image_folder(folder, val_per_class=1, progress=False, **folder_case(seed))
        images, labels = decode(small.train, namespace["device"])
        return {"images": _cpu(images), "labels": _cpu(labels), "devices": [images.device.type, labels.device.type]}


def crop_case(seed: int) -> tuple[torch.Tensor, int, int]:
    """(uint8 images, a generator seed, another one) on which batch_crop_flip is tried."""
    draw = random.Random(seed)
    count, first, second = draw.randint(300, 500), draw.randrange(10**6), draw.randrange(10**6)
    pixels = torch.Generator().manual_seed(draw.randrange(10**6))
    images = torch.randint(0, 256, (count, 3, PADDED, PADDED), dtype=torch.uint8, generator=pixels)
    return images, first, second + (second == first)


def _probe_batch_crop_flip(namespace: dict, seed: int) -> dict:
    batch_crop_flip, device = namespace["batch_crop_flip"], namespace["device"]
    images, first, second = crop_case(seed)
    results = {
        name: _cpu(batch_crop_flip(images, torch.Generator().manual_seed(generator_seed)))
        for name, generator_seed in (("first", first), ("again", first), ("other", second))
    }
    on_device = batch_crop_flip(images.to(device), torch.Generator().manual_seed(first))
    return {**results, "on the device": _cpu(on_device), "device": on_device.device.type}


def _decide_batch_crop_flip(got: dict, want: dict, seed: int) -> list[str]:
    images, _, _ = crop_case(seed)
    out = got["first"]
    if out.dtype != torch.uint8 or tuple(out.shape) != (len(images), 3, CROP, CROP):
        return [f"a {out.dtype} batch of shape {list(out.shape)}, expected uint8 {[len(images), 3, CROP, CROP]}"]
    chosen = crop_choices(images, out)
    failures = [f"image {chosen.index(None)} is not a crop (or flipped crop) of its input"] if None in chosen else []
    offsets, flipped = {c % 25 for c in chosen if c is not None}, sum(c >= 25 for c in chosen if c is not None)
    if len(offsets) != 25:
        failures.append(f"{len(offsets)} of the 25 offsets occur among {len(images)} images: each should")
    if not FLIP_SHARE[0] < flipped / len(images) < FLIP_SHARE[1]:
        failures.append(f"flipped {flipped} of {len(images)}: should be about half")
    if not torch.equal(got["again"], out):
        failures.append("the same generator state must give the same batch")
    if torch.equal(got["other"], out):
        failures.append("another generator state gave the same batch: the generator must decide")
    if got["device"] != want["device"] or not torch.equal(got["on the device"], out):
        failures.append(f"on the {want['device']} (got a batch on the {got['device']}), the same batch expected")
    return failures


def epoch_case(seed: int) -> tuple[int, int, int, int, int]:
    """(samples, batch size, tagged images' seed, an epoch's seed, another one) on which fast_epoch is tried."""
    draw = random.Random(seed)
    first = draw.randrange(10**6)
    return draw.randint(200, 400), draw.randint(32, 80), draw.randrange(10**6), first, first + draw.randint(1, 99)


def tagged(count: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Image i: channel 0 holds i % 256, channel 1 i // 256, channel 2 random pixels; its label 7 * i % 10."""
    images = torch.empty(count, 3, PADDED, PADDED, dtype=torch.uint8)
    ids = torch.arange(count)
    images[:, 0] = (ids % 256).view(count, 1, 1)
    images[:, 1] = (ids // 256).view(count, 1, 1)
    images[:, 2] = torch.randint(
        0, 256, (count, PADDED, PADDED), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed)
    )
    return images, 7 * ids % 10


def _probe_fast_epoch(namespace: dict, seed: int) -> dict:
    fast_epoch, device = namespace["fast_epoch"], namespace["device"]
    count, batch_size, images_seed, first, second = epoch_case(seed)
    images, labels = (tensor.to(device) for tensor in tagged(count, images_seed))

    def epoch(epoch_seed: int) -> list[dict]:
        return [
            {
                "images": _cpu(batch),
                "labels": _cpu(batch_labels),
                "devices": [batch.device.type, batch_labels.device.type],
            }
            for batch, batch_labels in fast_epoch(images, labels, batch_size=batch_size, seed=epoch_seed)
        ]

    return {"first": epoch(first), "again": epoch(first), "other": epoch(second), "device": device.type}


def _epoch_order(batches: list[dict], images: torch.Tensor, labels: torch.Tensor, device: str) -> tuple[list, list]:
    """The sample ids of an epoch's batches, in order, and what is wrong with the batches."""
    seen, failures = [], []
    for index, batch in enumerate(batches):
        where, pixels, batch_labels = f"batch {index}", batch["images"], batch["labels"]
        if batch["devices"] != [device, device]:
            failures.append(f"{where}: on the {batch['devices']}, expected both on the {device}")
        if pixels.dtype != torch.uint8 or pixels.dim() != 4 or tuple(pixels.shape[1:]) != (3, CROP, CROP):
            return seen, [*failures, f"{where}: {pixels.dtype} {list(pixels.shape)}, expected uint8 [B, 3, 32, 32]"]
        if batch_labels.dtype != torch.int64 or tuple(batch_labels.shape) != (len(pixels),):
            return seen, [
                *failures,
                f"{where}: labels {batch_labels.dtype} {list(batch_labels.shape)}, expected int64 [B]",
            ]
        ids = (pixels[:, 0, 0, 0].long() + 256 * pixels[:, 1, 0, 0].long()).clamp(max=len(labels) - 1)
        if not torch.equal(batch_labels, labels[ids]):
            failures.append(f"{where}: an image without its own label")
        if None in crop_choices(images[ids][:, 2:], pixels[:, 2:]):
            failures.append(f"{where}: an image that is not a crop of a sample")
        seen += ids.tolist()
    return seen, failures


def _decide_fast_epoch(got: dict, want: dict, seed: int) -> list[str]:
    count, batch_size, images_seed, _, _ = epoch_case(seed)
    images, labels = tagged(count, images_seed)
    sizes = [len(batch["labels"]) for batch in got["first"]]
    expected_sizes = [batch_size] * (count // batch_size) + [count % batch_size] * (count % batch_size > 0)
    failures = [f"batch sizes {sizes}, expected {expected_sizes}"] if sizes != expected_sizes else []
    seen, problems = _epoch_order(got["first"], images, labels, want["device"])
    failures += problems
    if sorted(seen) != list(range(count)):
        failures.append(f"{len(seen)} samples ({len(set(seen))} different) of {count}: every sample exactly once")
    elif seen == sorted(seen):
        failures.append("the samples came in their own order: shuffle them")
    same = differences(got["again"], got["first"], what="the epoch again")
    failures += ["the same seed must give the same epoch: " + same[0]] if same else []
    if _epoch_order(got["other"], images, labels, want["device"])[0] == seen:
        failures.append("another seed gave the same order")
    return failures


class JitteredIndices(Dataset):
    """The lab's dataset: each sample's draw from one NumPy generator, made once (a worker's copy repeats it)."""

    def __init__(self, size: int, seed: int):
        self.size, self.rng = size, np.random.default_rng(seed)

    def __len__(self):
        return self.size

    def __getitem__(self, index):
        return index, int(self.rng.integers(1_000_000))


def worker_case(seed: int) -> list[tuple[int, int, int]]:
    """(loader seed, workers, samples) of each epoch drawn: the same seed twice, another seed, three workers."""
    draw = random.Random(seed)
    first, size = draw.randrange(10**6), draw.randint(24, 48)
    return [
        (first, 2, size),
        (first, 2, size),
        (first + draw.randint(1, 99), 2, size),
        (draw.randrange(10**6), 3, size),
    ]


def _probe_seed_worker(namespace: dict, seed: int) -> list[list[int]]:
    fork = "fork" if "fork" in multiprocessing.get_all_start_methods() else None
    epochs = []
    for loader_seed, workers, size in worker_case(seed):
        loader = DataLoader(
            JitteredIndices(size, seed=loader_seed % 7), batch_size=4, shuffle=True, num_workers=workers,
            worker_init_fn=namespace["seed_worker"], generator=torch.Generator().manual_seed(loader_seed),
            multiprocessing_context=fork,
        )  # fmt: skip
        draws = {index: value for indices, values in loader for index, value in zip(indices.tolist(), values.tolist())}
        epochs.append([draws.get(index) for index in range(size)])
    return epochs


def _decide_seed_worker(got: list, want: list, seed: int) -> list[str]:
    first, again, other, three = got
    failures = [
        f"{where}: {len(set(draws))} distinct draws for {len(draws)} samples"
        for where, draws in (("two workers", first), ("three workers", three))
        if len(set(draws)) != len(draws) or None in draws
    ]
    if again != first:
        failures.append("the same DataLoader seed must give the same draws")
    if set(other) == set(first):  # not only the same draws given to other samples: a worker's stream from its seed
        failures.append("another DataLoader seed must give other draws, not the same ones in another order")
    return failures


CHECKS = {
    "test_decode_once": Check(
        "decode_once on an image folder drawn for this grading, against the course's (ImageFolder and Resize(36)), "
        "image by image",
        lambda namespace, seed: _decoded(namespace, seed, namespace["decode_once"]),
        lambda got, want, seed: differences(got, want, what="decode_once"),
        needs=("decode_once",),
    ),
    "test_batch_crop_flip": Check(
        "batch_crop_flip on images and generator seeds drawn for this grading: each output a crop or flipped crop of "
        "its input, every offset, about half flipped, decided by the generator, the same on the device",
        _probe_batch_crop_flip,
        _decide_batch_crop_flip,
        needs=("batch_crop_flip",),
        expected=lambda reference, seed: {"device": reference["device"].type},
    ),
    "test_fast_epoch": Check(
        "fast_epoch on tagged images, batch sizes and seeds drawn for this grading: every sample once with its label, "
        "cropped, shuffled, the same for the same seed and another for another, on the device",
        _probe_fast_epoch,
        _decide_fast_epoch,
        needs=("batch_crop_flip", "fast_epoch"),
        expected=lambda reference, seed: {"device": reference["device"].type},
    ),
    "test_seed_worker": Check(
        "seed_worker in DataLoader workers, on loader seeds drawn for this grading: distinct draws with two and three "
        "workers, the same for the same seed, others for another",
        _probe_seed_worker,
        _decide_seed_worker,
        needs=("seed_worker",),
        expected=lambda reference, seed: None,
    ),
}
