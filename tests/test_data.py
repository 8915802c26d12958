"""perflab.data: generated image folders and CIFAR-10 conversion, decoding, the text corpus and its batches."""

from __future__ import annotations

import math
import os
import pickle
import re
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from perflab.data import (
    CharTokenizer,
    char_corpus,
    cifar10_image_folder,
    decode_all,
    export_formats,
    get_batch,
    images,
    make_image_folder,
    make_text,
)
from perflab.train import OPTIMIZED, Workload, train
from PIL import Image
from torch import nn
from torchvision import transforms
from torchvision.datasets import ImageFolder

SMALL = dict(train_per_class=3, val_per_class=2, image_size=32, progress=False)
CIFAR_CLASSES = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]


def _files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*.jpg"))}


def _stamps(folder: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(folder)): (p.stat().st_mtime_ns, p.stat().st_ino) for p in folder.rglob("*")}


def test_same_seed_gives_the_same_bytes_and_another_seed_other_images(tmp_path):
    first = make_image_folder(tmp_path / "a", seed=0, **SMALL)
    again = make_image_folder(tmp_path / "b", seed=0, **SMALL)
    other = make_image_folder(tmp_path / "c", seed=1, **SMALL)
    assert len(_files(first.root)) == 10 * (3 + 2)
    assert _files(first.root) == _files(again.root)
    first_files, other_files = _files(first.root), _files(other.root)
    assert first_files.keys() == other_files.keys()
    assert all(first_files[name] != other_files[name] for name in first_files)


def test_layout_is_what_image_folder_reads(tmp_path):
    data = make_image_folder(tmp_path, **SMALL)
    for split, per_class, count in ((data.train, 3, data.num_train), (data.val, 2, data.num_val)):
        dataset = ImageFolder(split)
        assert tuple(dataset.classes) == data.classes and len(data.classes) == 10
        assert len(dataset) == count == 10 * per_class
        assert np.bincount(dataset.targets).tolist() == [per_class] * 10
        image, _ = dataset[0]
        assert image.mode == "RGB" and image.size == (32, 32)
    assert "10 classes, 30 train + 20 val" in repr(data)
    fewer = make_image_folder(tmp_path, num_classes=3, **SMALL)
    assert fewer.root != data.root and len(ImageFolder(fewer.train).classes) == 3


def test_second_call_finds_the_files_instead_of_generating_them(tmp_path, monkeypatch):
    data = make_image_folder(tmp_path, **SMALL)
    before = _stamps(data.root)

    def must_not_render(*args):
        raise AssertionError("generated again")

    monkeypatch.setattr(images, "render_shape", must_not_render)
    start = time.perf_counter()
    assert make_image_folder(tmp_path, **SMALL) == data
    assert time.perf_counter() - start < 0.5
    assert _stamps(data.root) == before


def test_default_root_is_the_environment_variable(tmp_path, monkeypatch):
    monkeypatch.setenv("PERFLAB_DATA", str(tmp_path))
    data = make_image_folder(num_classes=2, **SMALL)
    assert data.root.parent == tmp_path and data.train.is_dir()


def test_interrupted_generation_is_not_mistaken_for_a_complete_one(tmp_path, monkeypatch):
    render, calls = images.render_shape, []

    def interrupted_render(*args):
        calls.append(args)
        if len(calls) > 7:
            raise KeyboardInterrupt
        return render(*args)

    monkeypatch.setattr(images, "render_shape", interrupted_render)
    with pytest.raises(KeyboardInterrupt):
        make_image_folder(tmp_path / "cache", **SMALL)
    assert list((tmp_path / "cache").iterdir()) == []  # neither a half-written folder nor leftovers
    monkeypatch.setattr(images, "render_shape", render)
    data = make_image_folder(tmp_path / "cache", **SMALL)
    assert _files(data.root) == _files(make_image_folder(tmp_path / "fresh", **SMALL).root)


def test_folder_without_its_manifest_is_rebuilt(tmp_path):
    data = make_image_folder(tmp_path, **SMALL)
    (data.root / "manifest.json").unlink()
    victim = next(data.val.rglob("*.jpg"))
    victim.unlink()
    assert make_image_folder(tmp_path, **SMALL) == data
    assert victim.is_file() and (data.root / "manifest.json").is_file()


def test_only_stale_leftovers_of_a_killed_build_are_swept(tmp_path):
    name = make_image_folder(tmp_path, **SMALL).root.name
    stale, fresh = tmp_path / f".{name}.partial-stale", tmp_path / f".{name}.partial-fresh"
    stale.mkdir(), fresh.mkdir()
    old = time.time() - 2 * images.STALE_PARTIAL_S
    os.utime(stale, (old, old))
    make_image_folder(tmp_path, seed=7, **SMALL)  # another name: its leftovers are not this build's business
    assert stale.exists()
    (tmp_path / name / "manifest.json").unlink()
    make_image_folder(tmp_path, **SMALL)
    assert not stale.exists() and fresh.exists()  # a recent one may belong to a build still running


def test_decode_all_matches_image_folder_with_to_tensor(tmp_path):
    data = make_image_folder(tmp_path, **SMALL)
    decoded, labels = decode_all(data.val, progress=False)
    reference = ImageFolder(data.val, transform=transforms.ToTensor())
    assert decoded.dtype == torch.uint8 and decoded.shape == (len(reference), 3, 32, 32)
    assert labels.dtype == torch.int64 and labels.tolist() == reference.targets
    for k in range(len(reference)):
        assert torch.allclose(decoded[k].float() / 255, reference[k][0], atol=1e-6)


def _smooth_images(rng: np.random.Generator, count: int) -> np.ndarray:
    """``count`` 32x32 RGB uint8 images that JPEG keeps nearly intact, each channel its own pattern."""
    coarse = torch.from_numpy(rng.uniform(0, 255, (count, 3, 4, 4))).float()
    return F.interpolate(coarse, size=32, mode="bicubic", align_corners=True).clamp(0, 255).round().byte().numpy()


@pytest.fixture
def cifar_dir(tmp_path) -> tuple[Path, dict[str, list[tuple[int, np.ndarray]]]]:
    """A tiny CIFAR-10 in the real pickle format, and its (label, HWC image) pairs per split in file order."""
    folder, rng, originals = tmp_path / "downloads" / "cifar-10-batches-py", np.random.default_rng(0), {}
    folder.mkdir(parents=True)
    batches = {"train": [f"data_batch_{i}" for i in range(1, 6)], "val": ["test_batch"]}
    for split, files in batches.items():
        originals[split] = []
        for file in files:
            labels = rng.permutation(np.repeat(np.arange(10), 2)).tolist()
            pixels = _smooth_images(rng, len(labels))  # [N, 3, 32, 32]: CIFAR rows are R plane, G plane, B plane
            with open(folder / file, "wb") as out:
                pickle.dump({"batch_label": file, "labels": labels, "data": pixels.reshape(len(labels), 3072)}, out)
            originals[split] += list(zip(labels, pixels.transpose(0, 2, 3, 1)))
    with open(folder / "batches.meta", "wb") as out:
        pickle.dump({"label_names": CIFAR_CLASSES, "num_cases_per_batch": 20, "num_vis": 3072}, out)
    return folder, originals


def test_cifar_converts_to_the_same_layout_with_labels_and_pixels_intact(tmp_path, cifar_dir):
    folder, originals = cifar_dir
    data = cifar10_image_folder(folder.parent, tmp_path / "cache", progress=False)  # the parent works too
    assert data.classes == tuple(CIFAR_CLASSES) and (data.num_train, data.num_val) == (100, 20)
    for split_dir, split in ((data.train, "train"), (data.val, "val")):
        decoded, labels = decode_all(split_dir, progress=False)
        # decode_all orders by class, then by index within the class: file order.
        expected = sorted(originals[split], key=lambda pair: pair[0])
        assert labels.tolist() == [label for label, _ in expected]
        errors = [
            np.abs(decoded[k].permute(1, 2, 0).numpy().astype(int) - image).mean()
            for k, (_, image) in enumerate(expected)
        ]
        # JPEG at quality 90 with 4:2:0 chroma costs these 2-3 grey levels; a wrong pixel layout costs tens.
        assert max(errors) < 5, f"JPEG round trip off by {max(errors):.1f} grey levels on average"
    subset = cifar10_image_folder(folder, tmp_path / "cache", train_per_class=2, progress=False)
    assert (subset.num_train, subset.num_val) == (20, 20) and subset.root != data.root
    first_two = [image for label, image in originals["train"] if label == 0][:2]
    kept = decode_all(subset.train, progress=False)[0][:2].permute(0, 2, 3, 1).numpy().astype(int)
    assert np.abs(kept - np.stack(first_two)).mean() < 5


def test_training_runs_on_cifar_when_the_learner_has_it(tmp_path, cifar_dir, monkeypatch):
    monkeypatch.setenv("PERFLAB_DATA", str(tmp_path / "cache"))
    result = train(
        OPTIMIZED, Workload(cifar10_dir=str(cifar_dir[0]), train_per_class=4, val_per_class=2, epochs=1), progress=False
    )
    assert result.samples == 40 and 0 <= result.val_accuracy <= 1


def test_missing_cifar_says_what_to_put_where(tmp_path):
    with pytest.raises(FileNotFoundError, match="cifar-10-batches-py") as error:
        cifar10_image_folder(tmp_path / "nowhere", tmp_path)
    assert str(tmp_path / "nowhere") in str(error.value) and "never downloads" in str(error.value)


def test_classes_are_learnable_and_not_given_away_by_colour(tmp_path):
    data = make_image_folder(tmp_path, train_per_class=100, val_per_class=30, image_size=32, progress=False)
    train_raw, train_y = decode_all(data.train, progress=False)
    val_raw, val_y = decode_all(data.val, progress=False)

    def standardize(x):  # per image: colours are random, shapes are what matters
        x = x.float() / 255
        return (x - x.mean((1, 2, 3), keepdim=True)) / (x.std((1, 2, 3), keepdim=True) + 1e-3)

    train_x, val_x = standardize(train_raw), standardize(val_raw)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # on a busy 2-core machine 2 threads spin and wait: many times slower
    try:
        torch.manual_seed(0)
        layers = []
        for inputs, outputs, stride in ((3, 8, 2), (8, 16, 1), (16, 32, 2), (32, 32, 1)):
            layers += [nn.Conv2d(inputs, outputs, 3, stride, 1, bias=False), nn.BatchNorm2d(outputs), nn.ReLU()]
        model = nn.Sequential(*layers, nn.AdaptiveMaxPool2d(1), nn.Flatten(), nn.Linear(32, 10))
        epochs, batch = 10, 64
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=1e-4)
        steps = epochs * math.ceil(len(train_x) / batch)
        schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, 1e-2, total_steps=steps)
        for _ in range(epochs):
            for idx in torch.randperm(len(train_x)).split(batch):
                # The classes do not change under rotation and mirroring: 8x the data for free.
                x = torch.rot90(train_x[idx], int(torch.randint(4, ())), (2, 3))
                x = x.flip(3) if torch.rand(()) < 0.5 else x
                optimizer.zero_grad()
                F.cross_entropy(model(x), train_y[idx]).backward()
                optimizer.step()
                schedule.step()
        model.eval()
        with torch.no_grad():
            accuracy = (model(val_x).argmax(1) == val_y).float().mean().item()
    finally:
        torch.set_num_threads(threads)
    assert accuracy > 0.5, f"a small CNN reached {accuracy:.0%} on 10 classes: chance is 10%"

    # Mean colour alone: a linear classifier on it should be no better than chance, give or take noise.
    colour = nn.Linear(3, 10)
    optimizer = torch.optim.Adam(colour.parameters(), lr=1e-2)
    train_colour, val_colour = (raw.float().mean((2, 3)) / 255 for raw in (train_raw, val_raw))
    for _ in range(300):
        optimizer.zero_grad()
        F.cross_entropy(colour(train_colour), train_y).backward()
        optimizer.step()
    colour_accuracy = (colour(val_colour).argmax(1) == val_y).float().mean().item()
    assert colour_accuracy < 0.2, f"mean colour alone predicts {colour_accuracy:.0%} of classes"


def test_storage_formats_hold_the_same_pixels_and_are_written_once(tmp_path):
    data = make_image_folder(tmp_path, **SMALL)
    stored = export_formats(data.train, count=6)
    pixels = np.load(stored.array, mmap_mode="r")
    assert pixels.shape == (6, 32, 32, 3) and pixels.dtype == np.uint8
    samples = ImageFolder(data.train).samples
    assert len({samples[i * 30 // 6][1] for i in range(6)}) == 6, "spread over the classes, not all from the first"
    for index in range(6):
        original = samples[index * 30 // 6][0]
        assert stored.jpeg[index].read_bytes() == Path(original).read_bytes()
        with Image.open(stored.png[index]) as png, Image.open(original) as jpeg:
            assert np.array_equal(np.asarray(png), np.asarray(jpeg.convert("RGB"))), "PNG is lossless"
            assert np.array_equal(pixels[index], np.asarray(png))
    sizes = stored.bytes_on_disk
    assert sizes["raw .npy"] >= 6 * 32 * 32 * 3 and sizes["JPEG"] < sizes["PNG"]
    stamp = stored.array.stat().st_mtime_ns
    assert export_formats(data.train, count=6) == stored and stored.array.stat().st_mtime_ns == stamp
    with pytest.raises(ValueError, match="count"):
        export_formats(data.train, count=31)


def test_text_is_deterministic_and_about_the_size_asked():
    text = make_text(20_000, seed=0)
    assert text == make_text(20_000, seed=0) and text != make_text(20_000, seed=1)
    assert 20_000 <= len(text) < 22_000
    assert text.isascii() and "\n\n" in text and text[0].isupper()
    # Structure a model can learn because the grammar never breaks it: a verb agrees with its subject.
    pairs = re.findall(r"\b(cat|dog|fox|cats|dogs|foxes) (is|was|sleeps|are|were|sleep)\b", make_text(100_000))
    assert len(pairs) > 50
    assert all((noun in ("cat", "dog", "fox")) == (verb in ("is", "was", "sleeps")) for noun, verb in pairs)


def test_tokenizer_round_trips_and_rejects_unknown_characters():
    text = make_text(5_000)
    tokenizer = CharTokenizer(text)
    ids = tokenizer.encode(text)
    assert ids.dtype == torch.int64 and int(ids.min()) == 0 and int(ids.max()) == tokenizer.vocab_size - 1
    assert tokenizer.decode(ids) == text and tokenizer.decode(ids.tolist()) == text
    assert list(tokenizer.chars) == sorted(set(text))
    with pytest.raises(ValueError, match="'@'"):
        tokenizer.encode("a@b")


def test_char_corpus_keeps_the_last_tenth_for_validation():
    text = make_text(10_000)
    corpus = char_corpus(text, val_fraction=0.1)
    assert len(corpus.train) + len(corpus.val) == len(text)
    assert abs(len(corpus.val) - len(text) / 10) <= 1
    assert corpus.tokenizer.decode(corpus.train) + corpus.tokenizer.decode(corpus.val) == text


def test_get_batch_gives_windows_and_their_next_tokens():
    tokens = torch.arange(1000)  # each token is its own position: x and y say where they were cut
    x, y = get_batch(tokens, 16, 32, generator=torch.Generator().manual_seed(0))
    assert x.shape == y.shape == (16, 32) and x.dtype == y.dtype == torch.int64
    assert torch.equal(x, x[:, :1] + torch.arange(32)) and torch.equal(y, x + 1)
    assert int(y.max()) <= 999
    same, _ = get_batch(tokens, 16, 32, generator=torch.Generator().manual_seed(0))
    other, _ = get_batch(tokens, 16, 32, generator=torch.Generator().manual_seed(1))
    assert torch.equal(x, same) and not torch.equal(x, other)
    with pytest.raises(ValueError):
        get_batch(tokens[:32], 4, 32)
