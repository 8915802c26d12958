"""perflab.prefetch and the device side of perflab.pipeline: batches copied ahead, augmented where they live."""

from __future__ import annotations

import pytest
import torch
from perflab.data import make_image_folder
from perflab.pipeline import CachedImages, cached_batches, random_crop_flip, to_model_input
from perflab.prefetch import CudaPrefetcher

pytestmark = pytest.mark.usefixtures("private_data_cache")  # conftest.py


@pytest.fixture(scope="module")
def cache():
    split = make_image_folder(num_classes=3, train_per_class=10, val_per_class=2, image_size=32, progress=False)
    return CachedImages(split.train, progress=False)


def _batches(count=5):
    generator = torch.Generator().manual_seed(0)
    return [
        (torch.randint(0, 256, (4, 3, 8, 8), dtype=torch.uint8, generator=generator), torch.arange(4) + 4 * k)
        for k in range(count)
    ]


def test_prefetcher_passes_batches_through_in_order_on_the_cpu():
    source = _batches()
    out = list(CudaPrefetcher(source, "cpu"))
    assert len(out) == len(source)
    assert all(a is x and b is y for (a, b), (x, y) in zip(out, source)), "nothing to copy on the CPU: same tensors"
    converted = list(CudaPrefetcher(iter(source), "cpu", transform=to_model_input))
    for (images, labels), (raw, raw_labels) in zip(converted, source):
        assert images.dtype == torch.float32 and torch.equal(images, to_model_input(raw))
        assert torch.equal(labels, raw_labels)
    assert list(CudaPrefetcher([], "cpu")) == []


def test_cached_batches_are_what_indexing_each_batch_gives(cache):
    """index_select replaced images[index]: the same pixels, labels and order."""
    generator = torch.Generator().manual_seed(4)
    order = torch.randperm(len(cache), generator=generator)
    for k, (images, labels) in enumerate(cached_batches(cache, batch_size=8, seed=4)):
        index = order[8 * k : 8 * k + 8]
        assert torch.equal(images, random_crop_flip(cache.images[index], generator))
        assert torch.equal(labels, cache.labels[index])


def test_cache_moved_to_a_device_keeps_its_pixels(cache):
    moved = cache.to("cpu")
    assert len(moved) == len(cache) and torch.equal(moved.images, cache.images)
    first = next(cached_batches(moved, batch_size=8, seed=1))
    assert all(torch.equal(a, b) for a, b in zip(first, next(cached_batches(cache, batch_size=8, seed=1))))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="copies on a side CUDA stream: needs a CUDA device")
def test_prefetcher_delivers_the_same_batches_on_the_gpu():
    source = [(images.pin_memory(), labels.pin_memory()) for images, labels in _batches(6)]
    out = list(CudaPrefetcher(source, "cuda", transform=to_model_input))
    torch.cuda.synchronize()
    assert len(out) == 6
    for (images, labels), (raw, raw_labels) in zip(out, source):
        assert images.is_cuda and labels.is_cuda and images.dtype == torch.float32
        # The reference is computed where the prefetcher computes: CUDA divides by a CPU scalar as a multiplication by
        # its reciprocal (aten/src/ATen/native/cuda/BinaryDivTrueKernel.cu), one ulp away from the CPU's division.
        assert torch.equal(images, to_model_input(raw.cuda())) and torch.equal(labels.cpu(), raw_labels)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="augments a cache in GPU memory: needs a CUDA device")
def test_augmenting_on_the_gpu_gives_the_cpu_pixels(cache):
    on_gpu = next(cached_batches(cache.to("cuda"), batch_size=8, seed=2))
    on_cpu = next(cached_batches(cache, batch_size=8, seed=2))
    assert on_gpu[0].is_cuda
    assert all(torch.equal(a.cpu(), b) for a, b in zip(on_gpu, on_cpu)), (
        "one CPU generator: the same draws on every device"
    )
