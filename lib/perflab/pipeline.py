"""Where training batches come from: three sources of the same augmented images.

    >>> from perflab.data import make_image_folder
    >>> from perflab.pipeline import pil_loader, CachedImages, cached_batches
    >>> data = make_image_folder(num_classes=3, train_per_class=20, val_per_class=4, image_size=32, progress=False)
    >>> loader = pil_loader(data.train, batch_size=16)                # decode + PIL transforms per sample
    >>> images, labels = next(iter(loader))
    >>> images.shape, images.dtype
    (torch.Size([16, 3, 32, 32]), torch.float32)
    >>> cache = CachedImages(data.train, progress=False)              # decode and resize once, keep uint8
    >>> images, labels = next(cached_batches(cache, batch_size=16, seed=0))   # crop + flip whole batches
    >>> images.shape, images.dtype                                    # uint8 until it reaches the device
    (torch.Size([16, 3, 32, 32]), torch.uint8)

Both give the same distribution of training inputs: resize to 36 px, random 32 px crop,
random horizontal flip, scale to [-1, 1]. The PIL path does it image by image in Python,
decoding every JPEG every epoch; the cached path decodes and resizes each image once (kept
in a file beside the dataset), then crops and flips a whole batch with a few tensor ops, on
whichever device holds the cache (``cache.to("cuda")``: the GPU augments its own batches).

Used in: lecture 02 (profiling), lecture 03 (data loading), labs 03 and 12.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Iterator
from pathlib import Path

import torch
from torch.utils.data import DataLoader
from torchvision import transforms
from torchvision.datasets import ImageFolder

from perflab.data import decode_all

__all__ = [
    "CROP",
    "CachedImages",
    "RESIZE",
    "cached_batches",
    "center_crop",
    "pil_loader",
    "pil_transform",
    "random_crop_flip",
    "to_model_input",
]

RESIZE = 36
CROP = 32


def pil_transform(train: bool) -> transforms.Compose:
    """The per-sample torchvision pipeline, the way most tutorials write it."""
    crop = [transforms.RandomCrop(CROP), transforms.RandomHorizontalFlip()] if train else [transforms.CenterCrop(CROP)]
    return transforms.Compose(
        [
            transforms.Resize(RESIZE),
            *crop,
            transforms.ToTensor(),
            transforms.Normalize((0.5,) * 3, (0.5,) * 3),
        ]
    )


def pil_loader(
    split_dir: str | os.PathLike,
    *,
    batch_size: int,
    seed: int = 0,
    num_workers: int = 0,
    pin_memory: bool = False,
    persistent_workers: bool = False,
    prefetch_factor: int | None = None,
) -> DataLoader:
    """A shuffled ``DataLoader`` over an ``ImageFolder`` with :func:`pil_transform`."""
    dataset = ImageFolder(split_dir, transform=pil_transform(train=True))
    return DataLoader(
        dataset,
        batch_size=batch_size,
        shuffle=True,
        generator=torch.Generator().manual_seed(seed),
        num_workers=num_workers,
        pin_memory=pin_memory,
        persistent_workers=persistent_workers and num_workers > 0,
        prefetch_factor=prefetch_factor if num_workers > 0 else None,
    )


class CachedImages:
    """Every image of a split decoded and resized once, as ``uint8 [N, 3, 36, 36]`` plus labels.

    The first use writes ``.decoded-<split>-36px.pt`` beside the split folder (about 19 MB for
    5000 images: 5000 x 3 x 36 x 36 bytes); later uses load it in a fraction of a second.

    >>> from perflab.data import make_image_folder
    >>> data = make_image_folder(num_classes=3, train_per_class=20, val_per_class=4, image_size=32, progress=False)
    >>> cache = CachedImages(data.train, progress=False)
    >>> cache.images.shape, cache.images.dtype, cache.images.nbytes    # 60 x 3 x 36 x 36 bytes
    (torch.Size([60, 3, 36, 36]), torch.uint8, 233280)
    """

    def __init__(self, split_dir: str | os.PathLike, *, progress: bool = True):
        split_dir = Path(split_dir)
        cache_file = split_dir.parent / f".decoded-{split_dir.name}-{RESIZE}px.pt"
        if not cache_file.exists():
            # The same PIL resize as the per-sample path: identical pixels, decoded once.
            images, labels = decode_all(split_dir, transform=transforms.Resize(RESIZE), progress=progress)
            partial = cache_file.with_suffix(f".partial-{os.getpid()}")
            torch.save({"images": images, "labels": labels}, partial)
            os.replace(partial, cache_file)  # never leave a half-written cache where a reader looks
        saved = torch.load(cache_file, weights_only=True)
        self.images: torch.Tensor = saved["images"]
        self.labels: torch.Tensor = saved["labels"]

    def __len__(self) -> int:
        return len(self.labels)

    def to(self, device: str | torch.device) -> CachedImages:
        """The same images and labels on ``device`` (19 MB for 5000 images): batches are then cut and augmented there."""
        moved = copy.copy(self)  # no second decode or load: only the tensors move
        moved.images, moved.labels = self.images.to(device), self.labels.to(device)
        return moved


def random_crop_flip(images: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Crop each image of a batch at its own random offset to 32x32 and flip half of them.

    One ``gather`` over the flattened pixels does every image's crop and flip at once: three
    times faster on a CPU than indexing with four broadcast index tensors. The offsets are drawn
    from ``generator`` (a CPU one: the same draws on every device) and sent to the images' device.
    """
    n, channels, height, width = images.shape
    device = images.device
    top = torch.randint(0, height - CROP + 1, (n, 1, 1), generator=generator).to(device, non_blocking=True)
    left = torch.randint(0, width - CROP + 1, (n, 1, 1), generator=generator).to(device, non_blocking=True)
    flip = (torch.rand(n, generator=generator) < 0.5).to(device, non_blocking=True)
    columns = torch.arange(CROP, device=device).view(1, 1, CROP)
    columns = torch.where(flip.view(n, 1, 1), CROP - 1 - columns, columns) + left
    rows = torch.arange(CROP, device=device).view(1, CROP, 1) + top
    pixel_index = (rows * width + columns).view(n, 1, CROP * CROP).expand(n, channels, CROP * CROP)
    return images.reshape(n, channels, height * width).gather(2, pixel_index).view(n, channels, CROP, CROP)


def center_crop(images: torch.Tensor) -> torch.Tensor:
    top = (images.shape[-2] - CROP) // 2
    left = (images.shape[-1] - CROP) // 2
    return images[..., top : top + CROP, left : left + CROP]


def to_model_input(images: torch.Tensor) -> torch.Tensor:
    """uint8 pixels -> float in [-1, 1], as ``ToTensor`` + ``Normalize(0.5, 0.5)`` would give."""
    return images.float().div_(127.5).sub_(1.0)


def cached_batches(
    cache: CachedImages, *, batch_size: int, seed: int = 0, pin_memory: bool = False
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """One shuffled epoch of ``(uint8 images [B, 3, 32, 32], labels)``, augmented a batch at a time.

    The batches are on the cache's device. ``index_select`` copies whole images: on a CPU it is
    about 20x faster than ``images[index]``, which indexes uint8 tensors byte by byte.
    """
    generator = torch.Generator().manual_seed(seed)
    order = torch.randperm(len(cache), generator=generator).to(cache.images.device)
    for start in range(0, len(order), batch_size):
        index = order[start : start + batch_size]
        images = random_crop_flip(cache.images.index_select(0, index), generator)
        labels = cache.labels.index_select(0, index)
        if pin_memory and images.device.type == "cpu":  # a cache on the GPU needs no copy to get there
            images, labels = images.pin_memory(), labels.pin_memory()
        yield images, labels
