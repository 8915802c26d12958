"""Image classification data as real JPEG files in the ``torchvision.datasets.ImageFolder`` layout.

    >>> import torchvision
    >>> from torchvision import transforms
    >>> from perflab.data import make_image_folder, decode_all
    >>> data = make_image_folder(num_classes=3, train_per_class=20, val_per_class=4, image_size=32, progress=False)
    >>> data                                    # generated once, then found in the cache
    ImageFolderSplit(shapes3-32px-20train-4val-seed0: 3 classes, 60 train + 12 val JPEGs of 32x32 at ...)
    >>> train_set = torchvision.datasets.ImageFolder(data.train, transform=transforms.ToTensor())
    >>> len(train_set), train_set.classes
    (60, ['disk', 'square', 'triangle'])
    >>> images, labels = decode_all(data.val, progress=False)   # every JPEG decoded once
    >>> images.shape, images.dtype, labels.shape
    (torch.Size([12, 3, 32, 32]), torch.uint8, torch.Size([12]))

With its defaults, ``make_image_folder()`` makes the course's dataset: 10 classes, 5000 train +
1000 val JPEGs of 64x64, generated once (about 10 s on 2 cores).


Ten classes (disk, square, triangle, ring, cross, star, crescent, stripes, checker, dots), each
a dark shape of random colour, position, size and rotation on a light gradient of random colour,
among line and blob clutter (some of it in front), plus sensor-like noise. Every class paints the
same area on average, so neither the mean colour nor the amount of ink gives the class away. The
course's ResNet-8 needs the 6 epochs of ``perflab.train.Workload`` to pass 95% (chance: 10%;
``python -m perflab bench capstone`` prints the accuracies): learnable, not trivial.
Files, not tensors, on purpose: opening, decoding and transforming each sample costs what it
costs in real projects, which is what the course's data-loading lessons measure and speed up.

``cifar10_image_folder`` turns a CIFAR-10 you already have on disk into the same layout.
Nothing here ever downloads. The cache lives in ``$PERFLAB_DATA``, else ``~/.cache/perflab/data``.

Used in: lecture 02 (profiling), lecture 03 (data loading), lab 03.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import pickle
import shutil
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageDraw
from tqdm.auto import tqdm

__all__ = [
    "DATA_ENV_VAR",
    "ImageFolderSplit",
    "STALE_PARTIAL_S",
    "cifar10_image_folder",
    "data_root",
    "decode_all",
    "make_image_folder",
    "render_shape",
]

DATA_ENV_VAR = "PERFLAB_DATA"
_FORMAT_VERSION = 2  # bump whenever the same parameters would produce different files
_MANIFEST = "manifest.json"
_JPEG_QUALITY = 90
_SUPERSAMPLE = 2  # shapes are drawn at twice the size, then box-filtered down: smooth edges at any angle
STALE_PARTIAL_S = 3600  # an unfinished build this old belongs to a process that died, not one still writing

# Unit shapes (radius about 1, pointing up); each image scales, rotates and places one.
_CIRCLE = [(0.8 * math.cos(k * math.pi / 24), 0.8 * math.sin(k * math.pi / 24)) for k in range(48)]
_TRIANGLE = [(math.sin(k * 2 * math.pi / 3), -math.cos(k * 2 * math.pi / 3)) for k in range(3)]
_SQUARE = [(-0.72, -0.72), (0.72, -0.72), (0.72, 0.72), (-0.72, 0.72)]
_STAR = [(r * math.sin(k * math.pi / 5), -r * math.cos(k * math.pi / 5)) for k, r in enumerate([1, 0.42] * 5)]
_ARM = 0.3  # half-width of the cross's arms
_CROSS = [
    (_ARM, -1),
    (_ARM, -_ARM),
    (1, -_ARM),
    (1, _ARM),
    (_ARM, _ARM),
    (_ARM, 1),
    (-_ARM, 1),
    (-_ARM, _ARM),
    (-1, _ARM),
    (-1, -_ARM),
    (-_ARM, -_ARM),
    (-_ARM, -1),
]
_PERIOD = 0.5  # of the textures, in units of the radius: 3+ pixels per period even at 32x32
_PAPER, _INK = (140, 256), (0, 110)  # ranges of the background's and the shape's colour channels
_EQUAL_INK = 1.4  # area painted by every shape of radius 1: that of the stripes, mid-way between dots and a square


def _disk(draw: ImageDraw.ImageDraw, x: float, y: float, radius: float, fill: int | tuple[int, ...]) -> None:
    draw.ellipse((x - radius, y - radius, x + radius, y + radius), fill=fill)


def _polygon(points: list[tuple[float, float]]) -> Callable:
    def draw_mask(mask: Image.Image, x: float, y: float, radius: float, angle: float) -> None:
        cos, sin = math.cos(angle), math.sin(angle)
        placed = [(x + radius * (u * cos - v * sin), y + radius * (u * sin + v * cos)) for u, v in points]
        ImageDraw.Draw(mask).polygon(placed, fill=255)

    return draw_mask


def _ring(mask: Image.Image, x: float, y: float, radius: float, angle: float) -> None:
    draw = ImageDraw.Draw(mask)
    _disk(draw, x, y, 0.9 * radius, 255)
    _disk(draw, x, y, 0.5 * radius, 0)


def _crescent(mask: Image.Image, x: float, y: float, radius: float, angle: float) -> None:
    draw = ImageDraw.Draw(mask)
    _disk(draw, x, y, 0.9 * radius, 255)
    _disk(draw, x + 0.45 * radius * math.cos(angle), y + 0.45 * radius * math.sin(angle), 0.75 * radius, 0)


def _texture(pattern: Callable[[np.ndarray, np.ndarray], np.ndarray]) -> Callable:
    """A round patch of ``pattern(u, v)``: True where to paint, at rotated coordinates counted in periods."""

    def draw_mask(mask: Image.Image, x: float, y: float, radius: float, angle: float) -> None:
        grid = (np.arange(mask.size[0], dtype=np.float32) + 0.5) / radius
        dx, dy = grid - x / radius, (grid - y / radius)[:, None]
        u = dx * math.cos(angle) + dy * math.sin(angle)
        v = dy * math.cos(angle) - dx * math.sin(angle)
        inside = u * u + v * v < 0.95**2
        # Shifted positive so int truncation is floor: np.floor and np.mod are slow on CPUs without SIMD.
        painted = inside & pattern(u / _PERIOD + 64, v / _PERIOD + 64)
        mask.paste(Image.fromarray(painted.astype(np.uint8) * 255))

    return draw_mask


def _fraction(t: np.ndarray) -> np.ndarray:
    return t - t.astype(np.int32)


# Class name -> how to draw its mask. The order fixes which classes ``num_classes < 10`` keeps.
_SHAPES: dict[str, Callable] = {
    "disk": _polygon(_CIRCLE),
    "square": _polygon(_SQUARE),
    "triangle": _polygon(_TRIANGLE),
    "ring": _ring,
    "cross": _polygon(_CROSS),
    "star": _polygon(_STAR),
    "crescent": _crescent,
    "stripes": _texture(lambda u, v: (2 * u).astype(np.int32) % 2 == 0),
    "checker": _texture(lambda u, v: (u.astype(np.int32) + v.astype(np.int32)) % 2 == 0),
    "dots": _texture(lambda u, v: (_fraction(u) - 0.5) ** 2 + (_fraction(v) - 0.5) ** 2 < 0.3**2),
}


def _colour(rng: np.random.Generator) -> tuple[int, int, int]:
    return tuple(int(c) for c in rng.integers(0, 256, 3))


def _clutter(draw: ImageDraw.ImageDraw, size: int, rng: np.random.Generator, lines: int, blobs: int) -> None:
    for _ in range(lines):
        draw.line(tuple(rng.uniform(0, size, 4)), fill=_colour(rng), width=int(rng.integers(1, 4)) * _SUPERSAMPLE)
    for _ in range(blobs):
        x, y = rng.uniform(0, size, 2)
        _disk(draw, x, y, rng.uniform(0.02, 0.06) * size, fill=_colour(rng))


@functools.cache
def _ink_area(name: str) -> float:
    """The area a shape of radius 1 paints; radii are scaled by ``sqrt(_EQUAL_INK / area)`` to even it out."""
    mask = Image.new("L", (128, 128))
    _SHAPES[name](mask, 64, 64, 32, 0.0)
    return float(np.asarray(mask).mean()) / 255 * (128 / 32) ** 2


def render_shape(name: str, size: int, rng: np.random.Generator) -> Image.Image:
    """One ``size`` x ``size`` RGB image of the shape class ``name``, every choice drawn from ``rng``.

    >>> import numpy as np
    >>> render_shape("star", 64, np.random.default_rng(0))
    <PIL.Image.Image image mode=RGB size=64x64 at 0x...>
    """
    n = size * _SUPERSAMPLE
    # Dark ink on light paper, in random colours: with the polarity random too, the course's
    # ResNet-8 stays near chance for 6 epochs; this way it learns the shapes in a few.
    low, high = rng.integers(*_PAPER, 3), rng.integers(*_PAPER, 3)
    slope = rng.uniform(0, 2 * math.pi)
    axis = np.linspace(-0.5, 0.5, n, dtype=np.float32)
    ramp = (axis * math.cos(slope) + axis[:, None] * math.sin(slope)) / math.sqrt(2) + 0.5
    channels = [Image.fromarray((float(a) + float(b - a) * ramp).astype(np.uint8)) for a, b in zip(low, high)]
    canvas = Image.merge("RGB", channels)
    draw = ImageDraw.Draw(canvas)
    _clutter(draw, n, rng, lines=int(rng.integers(2, 6)), blobs=int(rng.integers(0, 4)))

    radius = rng.uniform(0.22, 0.36) * n * math.sqrt(_EQUAL_INK / _ink_area(name))
    x, y = rng.uniform(0.85 * radius, n - 0.85 * radius, 2)
    mask = Image.new("L", (n, n))
    _SHAPES[name](mask, x, y, radius, rng.uniform(0, 2 * math.pi))
    canvas.paste(tuple(int(c) for c in rng.integers(*_INK, 3)), mask=mask)
    _clutter(draw, n, rng, lines=int(rng.integers(0, 3)), blobs=0)  # in front: the shape is partly hidden

    pixels = np.asarray(canvas.reduce(_SUPERSAMPLE), dtype=np.float32)
    noise = rng.uniform(2, 10) * rng.standard_normal((size, size, 1), dtype=np.float32)
    return Image.fromarray(np.clip(pixels + noise + 0.5, 0, 255).astype(np.uint8))


@dataclass(frozen=True)
class ImageFolderSplit:
    """Where a generated or converted dataset lives: ``train`` and ``val`` are ``ImageFolder`` roots."""

    root: Path
    name: str
    classes: tuple[str, ...]
    num_train: int
    num_val: int
    image_size: int

    @property
    def train(self) -> Path:
        return self.root / "train"

    @property
    def val(self) -> Path:
        return self.root / "val"

    def __repr__(self) -> str:
        return (
            f"ImageFolderSplit({self.name}: {len(self.classes)} classes, {self.num_train} train + {self.num_val} val "
            f"JPEGs of {self.image_size}x{self.image_size} at {self.root})"
        )

    @classmethod
    def _from_manifest(cls, root: Path, manifest: dict) -> ImageFolderSplit:
        return cls(
            root,
            manifest["name"],
            tuple(manifest["classes"]),
            manifest["counts"]["train"],
            manifest["counts"]["val"],
            manifest["image_size"],
        )


def data_root(root: str | os.PathLike | None = None) -> Path:
    """``root``, else ``$PERFLAB_DATA``, else ``~/.cache/perflab/data``."""
    return Path(root or os.environ.get(DATA_ENV_VAR) or "~/.cache/perflab/data").expanduser()


def _build_once(folder: Path, params: dict, build: Callable[[Path], dict]) -> dict:
    """The manifest of ``folder``, running ``build(empty_folder)`` first unless a complete build of ``params`` is there.

    A build writes into a hidden sibling that is renamed to ``folder`` only after its manifest is
    written, so an interrupted build is never mistaken for a complete one: the next call redoes it.
    """
    with contextlib.suppress(OSError, ValueError):  # no manifest, or a truncated one: build
        manifest = json.loads((folder / _MANIFEST).read_text())
        if manifest.get("format_version") == _FORMAT_VERSION and manifest.get("params") == params:
            return manifest
    folder.parent.mkdir(parents=True, exist_ok=True)
    prefix = f".{folder.name}.partial-"
    for leftover in folder.parent.glob(prefix + "*"):
        with contextlib.suppress(OSError):  # another process may be removing it too
            if time.time() - leftover.stat().st_mtime > STALE_PARTIAL_S:
                shutil.rmtree(leftover)
    partial = folder.parent / f"{prefix}{uuid.uuid4().hex[:12]}"
    partial.mkdir()
    try:
        start = time.perf_counter()
        manifest = {"format_version": _FORMAT_VERSION, "params": params, **build(partial)}
        manifest["build_seconds"] = round(time.perf_counter() - start, 3)
        (partial / _MANIFEST).write_text(json.dumps(manifest, indent=2))
        if folder.exists():  # an older format, other parameters, or a build from before this scheme
            shutil.rmtree(folder)
        os.replace(partial, folder)
    except BaseException:  # KeyboardInterrupt included: a stopped notebook cell leaves nothing behind
        shutil.rmtree(partial, ignore_errors=True)
        raise
    return manifest


def _write_jpegs(
    folder: Path, samples: Iterable[tuple[str, str, int, Image.Image]], total: int | None, desc: str, progress: bool
) -> dict[str, int]:
    """Saves each ``(split, class_name, index, image)`` as ``folder/split/class_name/index.jpg``; counts per split."""
    counts = Counter()
    for split, class_name, index, image in tqdm(samples, total=total, desc=desc, unit="img", disable=not progress):
        path = folder / split / class_name / f"{index:05d}.jpg"  # zero-padded: name order is index order
        path.parent.mkdir(parents=True, exist_ok=True)
        image.save(path, quality=_JPEG_QUALITY)
        counts[split] += 1
    return {"train": counts["train"], "val": counts["val"]}


def make_image_folder(
    root: str | os.PathLike | None = None,
    *,
    num_classes: int = 10,
    train_per_class: int = 500,
    val_per_class: int = 100,
    image_size: int = 64,
    seed: int = 0,
    progress: bool = True,
) -> ImageFolderSplit:
    """The shapes dataset in ``data_root(root)/<a name made of the parameters>``, generated unless already there.

    >>> data = make_image_folder(num_classes=3, train_per_class=20, val_per_class=4, image_size=32, progress=False)
    >>> data.train.relative_to(data_root()).as_posix()     # data_root(): $PERFLAB_DATA, else ~/.cache/perflab/data
    'shapes3-32px-20train-4val-seed0/train'
    >>> data.classes
    ('disk', 'square', 'triangle')

    Image ``i`` of a class and split depends only on (``seed``, split, class, ``i``, ``image_size``):
    the same call gives byte-identical files on every machine with the same Pillow and libjpeg.
    """
    if not (isinstance(num_classes, int) and 1 <= num_classes <= len(_SHAPES)):
        raise ValueError(f"num_classes must be an int from 1 to {len(_SHAPES)}, got {num_classes!r}")
    for what, value, smallest in (
        ("train_per_class", train_per_class, 1),
        ("val_per_class", val_per_class, 1),
        ("image_size", image_size, 16),
        ("seed", seed, 0),
    ):
        if not (isinstance(value, int) and value >= smallest):
            raise ValueError(f"{what} must be an int of at least {smallest}, got {value!r}")
    params = {
        "num_classes": num_classes,
        "train_per_class": train_per_class,
        "val_per_class": val_per_class,
        "image_size": image_size,
        "seed": seed,
    }
    name = f"shapes{num_classes}-{image_size}px-{train_per_class}train-{val_per_class}val-seed{seed}"
    classes = list(_SHAPES)[:num_classes]
    counts = {"train": train_per_class, "val": val_per_class}

    def samples() -> Iterator[tuple[str, str, int, Image.Image]]:
        for split_code, (split, per_class) in enumerate(counts.items()):
            for class_code, class_name in enumerate(classes):
                for index in range(per_class):
                    rng = np.random.default_rng([seed, split_code, class_code, index])
                    yield split, class_name, index, render_shape(class_name, image_size, rng)

    def build(folder: Path) -> dict:
        total = num_classes * (train_per_class + val_per_class)
        written = _write_jpegs(folder, samples(), total, f"generating {name}", progress)
        return {"name": name, "classes": sorted(classes), "image_size": image_size, "counts": written}

    folder = data_root(root) / name
    return ImageFolderSplit._from_manifest(folder, _build_once(folder, params, build))


_CIFAR_FOLDER = "cifar-10-batches-py"
_CIFAR_FILES = {"train": [f"data_batch_{i}" for i in range(1, 6)], "val": ["test_batch"]}


def _find_cifar(cifar_dir: Path) -> Path:
    for candidate in (cifar_dir, cifar_dir / _CIFAR_FOLDER):
        if all((candidate / f).is_file() for f in ["batches.meta", *_CIFAR_FILES["train"], *_CIFAR_FILES["val"]]):
            return candidate
    raise FileNotFoundError(
        f"No CIFAR-10 at {cifar_dir}: expected the folder {_CIFAR_FOLDER}/ (or its contents: batches.meta, "
        f"data_batch_1 ... data_batch_5, test_batch), the 'CIFAR-10 python version' from "
        f"https://www.cs.toronto.edu/~kriz/cifar.html unpacked there. perflab never downloads: copy it there, "
        f"pass its path, or use make_image_folder() instead."
    )


def _unpickle(path: Path) -> dict:
    with open(path, "rb") as file:
        return pickle.load(file, encoding="latin1")  # written by Python 2: latin1 keeps the uint8 arrays intact


def cifar10_image_folder(
    cifar_dir: str | os.PathLike,
    root: str | os.PathLike | None = None,
    *,
    train_per_class: int | None = None,
    val_per_class: int | None = None,
    progress: bool = True,
) -> ImageFolderSplit:
    """CIFAR-10 already on disk (the python pickles) as JPEGs in the same layout as ``make_image_folder``.

    Given the folder where the CIFAR-10 pickles were unpacked, it converts them once::

        data = cifar10_image_folder("~/datasets/cifar-10-batches-py", train_per_class=1000)
        # ImageFolderSplit(cifar10-1000train-allval: 10 classes, 10000 train + 10000 val JPEGs of 32x32 at ...)

    Where there is no CIFAR-10, it says what it expected, and downloads nothing:

    >>> cifar10_image_folder("no-such-folder")
    Traceback (most recent call last):
    ...
    FileNotFoundError: No CIFAR-10 at no-such-folder: expected the folder cifar-10-batches-py/ ...

    The test batch becomes ``val``. ``*_per_class`` keeps the first images of each class, in file
    order (``None``: all of them). Class folders are named after ``batches.meta``'s label names,
    whose alphabetical order is CIFAR's label order, so ``ImageFolder``'s targets are CIFAR's labels.
    """
    for what, value in (("train_per_class", train_per_class), ("val_per_class", val_per_class)):
        if not (value is None or (isinstance(value, int) and value >= 1)):
            raise ValueError(f"{what} must be None (all images) or a positive int, got {value!r}")
    source = _find_cifar(Path(cifar_dir).expanduser()).resolve()
    params = {"source": str(source), "train_per_class": train_per_class, "val_per_class": val_per_class}
    name = f"cifar10-{train_per_class or 'all'}train-{val_per_class or 'all'}val"
    classes = list(_unpickle(source / "batches.meta")["label_names"])
    limits = {"train": train_per_class, "val": val_per_class}

    def samples() -> Iterator[tuple[str, str, int, Image.Image]]:
        for split, files in _CIFAR_FILES.items():
            kept = [0] * len(classes)
            for file in files:
                batch = _unpickle(source / file)
                pixels = np.asarray(batch["data"], dtype=np.uint8).reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1)
                for image, label in zip(pixels, batch["labels"]):
                    if limits[split] is None or kept[label] < limits[split]:
                        yield split, classes[label], kept[label], Image.fromarray(image)
                        kept[label] += 1

    def build(folder: Path) -> dict:
        written = _write_jpegs(folder, samples(), None, f"converting {name}", progress)  # total: unknown until read
        return {"name": name, "classes": sorted(classes), "image_size": 32, "counts": written}

    folder = data_root(root) / name
    return ImageFolderSplit._from_manifest(folder, _build_once(folder, params, build))


def decode_all(
    split_dir: str | os.PathLike,
    *,
    transform: Callable[[Image.Image], Image.Image] | None = None,
    progress: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every image of an ``ImageFolder`` split decoded once: ``(uint8 [N, 3, H, W], int64 [N])``.

    ``transform`` (PIL image -> PIL image, a ``transforms.Resize(36)`` say) is applied to each
    image after decoding.

    >>> data = make_image_folder(num_classes=3, train_per_class=20, val_per_class=4, image_size=32, progress=False)
    >>> images, labels = decode_all(data.train, progress=False)
    >>> images.shape, images.dtype, labels[:3]
    (torch.Size([60, 3, 32, 32]), torch.uint8, tensor([0, 0, 0]))

    Same order, labels and pixels as ``ImageFolder(split_dir)`` with ``PILToTensor``: the
    decode-once cache that takes JPEG decoding out of every epoch (5000 x 64x64 x 3 = 61 MB).
    """
    # Imported here: torchvision takes a second to import, and the grader's sandbox reads data_root from this
    # package in processes that need no dataset.
    from torchvision.datasets import ImageFolder

    samples = ImageFolder(split_dir).samples
    images = None
    for k, (path, _) in enumerate(
        tqdm(samples, desc=f"decoding {Path(split_dir).name}", unit="img", disable=not progress)
    ):
        with Image.open(path) as image:
            image = image.convert("RGB")
            pixels = torch.from_numpy(np.array(transform(image) if transform else image)).permute(2, 0, 1)
        if images is None:
            images = torch.empty((len(samples), *pixels.shape), dtype=torch.uint8)
        if pixels.shape != images.shape[1:]:
            raise ValueError(
                f"{path} is {tuple(pixels.shape)}, the first image {tuple(images.shape[1:])}: "
                f"decode_all needs images of one size"
            )
        images[k] = pixels
    return images, torch.tensor([label for _, label in samples], dtype=torch.int64)
