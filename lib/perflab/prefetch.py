"""Copy the next batch to the GPU while the current one computes: a prefetcher on a side CUDA stream.

    >>> import torch.nn.functional as F
    >>> from perflab.data import make_image_folder
    >>> from perflab.models import ResNet, ResNetConfig
    >>> from perflab.pipeline import CachedImages, cached_batches, to_model_input
    >>> from perflab.prefetch import CudaPrefetcher
    >>> data = make_image_folder(num_classes=3, train_per_class=20, val_per_class=4, image_size=32, progress=False)
    >>> cache, model = CachedImages(data.train, progress=False), ResNet(ResNetConfig(num_classes=3))
    >>> batches = cached_batches(cache, batch_size=16, pin_memory=True)  # doctest: +SKIP
    >>> batches = cached_batches(cache, batch_size=16)      # on a CPU: nothing to pin (pinned: the copy is asynchronous)
    >>> prefetcher = CudaPrefetcher(batches, "cuda", transform=to_model_input)  # doctest: +SKIP
    >>> prefetcher = CudaPrefetcher(batches, "cpu", transform=to_model_input)   # on a CPU: the batches pass through
    >>> for images, labels in prefetcher:
    ...     loss = F.cross_entropy(model(images), labels)   # on a GPU, batch k computes while k+1 copies
    >>> images.dtype, images.shape                          # the last batch, converted by the transform
    (torch.float32, torch.Size([12, 3, 32, 32]))

``x.to("cuda", non_blocking=True)`` from pinned memory only queues the copy and returns. Queued
on the compute stream, though, the copy waits behind the kernels already queued there, and the
next kernels wait behind it: copy and compute take turns. On a stream of its own the copy runs
on the GPU's copy engine *during* the current batch's kernels. Two rules keep that correct: the
compute stream waits for the copy stream before it uses a batch (``wait_stream``), and every
tensor made on the copy stream is marked as used by the compute stream (``record_stream``), so
that the caching allocator does not give its memory to a new tensor while kernels still read it.

On any other device there is no copy to hide: the batches pass through in the same order, moved
with ``.to(device)`` and transformed.

Used in: lecture 03 (data loading).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence

import torch

__all__ = ["CudaPrefetcher"]


class CudaPrefetcher:
    """Iterate over ``batches`` (tuples of tensors, images first) already on ``device``, one batch ahead.

    ``transform`` (images -> images, e.g. ``to_model_input``) runs on the device, on the copy
    stream, so that converting the next batch overlaps with computing the current one too.
    """

    def __init__(
        self,
        batches: Iterable[Sequence[torch.Tensor]],
        device: str | torch.device,
        transform: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ):
        self.batches = batches
        self.device = torch.device(device)
        self.transform = transform

    def _moved(self, batch: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        images, *rest = (tensor.to(self.device, non_blocking=True) for tensor in batch)
        return (self.transform(images) if self.transform else images, *rest)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, ...]]:
        if self.device.type != "cuda":
            yield from map(self._moved, self.batches)
            return
        compute = torch.cuda.current_stream(self.device)
        copy = torch.cuda.Stream(self.device)
        upcoming = iter(self.batches)

        def queue_next() -> tuple[torch.Tensor, ...] | None:
            batch = next(upcoming, None)
            if batch is None:
                return None
            with torch.cuda.stream(copy):
                return self._moved(batch)

        ready = queue_next()
        while ready is not None:
            compute.wait_stream(copy)  # kernels queued from now on start after this batch has arrived
            for tensor in ready:
                tensor.record_stream(compute)
            following = queue_next()  # queued before the caller queues its kernels for `ready`
            yield ready
            ready = following
