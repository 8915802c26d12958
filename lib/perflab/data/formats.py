"""The same images stored three ways: JPEG (as generated), PNG, and one raw uint8 array (``.npy``).

    >>> import numpy as np
    >>> from perflab.data import make_image_folder
    >>> from perflab.data.formats import export_formats
    >>> data = make_image_folder(num_classes=3, train_per_class=20, val_per_class=4, image_size=32, progress=False)
    >>> stored = export_formats(data.train, count=30)       # written once, beside the dataset
    >>> stored.jpeg[0].name, stored.png[0].name, stored.array.name   # where each format's files are
    ('00000.jpg', '00000.png', 'images.npy')
    >>> stored.bytes_on_disk                                # 30 x 32 x 32 x 3 bytes raw, plus the .npy header
    {'JPEG': ..., 'PNG': ..., 'raw .npy': 92288}
    >>> np.load(stored.array, mmap_mode="r").shape
    (30, 32, 32, 3)

JPEG is lossy and small; decoding it means entropy decoding and an inverse DCT per 8x8 block.
PNG is lossless and larger; decoding it means inflating zlib streams and undoing the filters.
The raw array needs no decoding, only its bytes: ``np.load(path, mmap_mode="r")`` maps the
file, and image ``i`` is the slice ``array[i]``. Which one wins depends on what is scarcer:
CPU time to decode (JPEG loses) or bytes to read from disk or network (raw arrays lose).

Used in: lecture 03 (data loading).
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import numpy as np
from PIL import Image

from perflab.data.images import _build_once

__all__ = ["StoredImages", "export_formats"]


@dataclass(frozen=True)
class StoredImages:
    """``count`` images of a split as JPEG files, PNG files and one ``uint8 [count, H, W, 3]`` array."""

    folder: Path
    count: int

    @cached_property  # a list built once: reading image i should not cost a list of every path
    def jpeg(self) -> list[Path]:
        return [self.folder / "jpeg" / f"{i:05d}.jpg" for i in range(self.count)]

    @cached_property
    def png(self) -> list[Path]:
        return [self.folder / "png" / f"{i:05d}.png" for i in range(self.count)]

    @property
    def array(self) -> Path:
        return self.folder / "images.npy"

    @property
    def bytes_on_disk(self) -> dict[str, int]:
        return {
            "JPEG": sum(p.stat().st_size for p in self.jpeg),
            "PNG": sum(p.stat().st_size for p in self.png),
            "raw .npy": self.array.stat().st_size,
        }


def export_formats(split_dir: str | os.PathLike, *, count: int = 256) -> StoredImages:
    """``count`` images of an ``ImageFolder`` split, spread over its classes, in the three formats (cached).

    The JPEG files are copies of the originals, byte for byte; the PNG files and the array hold
    the pixels those JPEGs decode to, so every format stores the same image.
    """
    split_dir = Path(split_dir)
    # Imported here: torchvision takes a second to import, and the grader's sandbox reads data_root from this
    # package in processes that need no dataset.
    from torchvision.datasets import ImageFolder

    samples = ImageFolder(split_dir).samples
    if not (isinstance(count, int) and 1 <= count <= len(samples)):
        raise ValueError(f"count must be an int from 1 to {len(samples)}, got {count!r}")
    chosen = [samples[i * len(samples) // count][0] for i in range(count)]
    folder = split_dir.parent / f".formats-{split_dir.name}-{count}"

    def build(partial: Path) -> dict:
        (partial / "jpeg").mkdir()
        (partial / "png").mkdir()
        pixels = []
        for index, path in enumerate(chosen):
            shutil.copyfile(path, partial / "jpeg" / f"{index:05d}.jpg")
            with Image.open(path) as image:
                image = image.convert("RGB")
                image.save(partial / "png" / f"{index:05d}.png")
                pixels.append(np.asarray(image))
        np.save(partial / "images.npy", np.stack(pixels))
        return {"name": folder.name, "count": count}

    _build_once(folder, {"source": str(split_dir.resolve()), "count": count}, build)
    return StoredImages(folder, count)
