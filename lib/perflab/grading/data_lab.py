"""Lab 03's measured cell: the learner's input pipeline against the compute ceiling, the step taken here.

    grade_lab03(cells)   # cells: {"course": {grade_id: source}, "learner": {grade_id: source}}
    # {'test_ceiling': Verdict(pass: ...)}, after 15 interleaved rounds against the ceiling: minutes

The learner's ``fast_epoch`` runs in a sandboxed child on a random subset of the course's decoded
images that it learns only when grading starts, and only makes batches: each batch travels here
as raw bytes, the training step runs here on it, and then on one of the ceiling's batches, each on
this side's clock while the child is stopped (an epoch in which it gained CPU time meanwhile does
not count). The ceiling's batches, made before the clock starts, come from a child of their own
by the same road, so that both sides pay the same for the trip. Every batch is checked (outside
the clock) to be a crop or flipped crop of a subset image with that image's label, each image
once per epoch.

    >>> from perflab.grading.data_lab import MIN_SHARE, STEPS_PER_EPOCH
    >>> MIN_SHARE, STEPS_PER_EPOCH  # a pass: 90% of the ceiling's samples/s, over epochs of 8 steps
    (0.9, 8)

Used by perflab.grading.session.
"""

from __future__ import annotations

import hashlib
import itertools
import statistics
import time

import torch

from perflab.bench import Comparison, Timing
from perflab.device import synchronize
from perflab.grading.child import AnswerProcess, ChildError, IdleWatch, verdict_of
from perflab.grading.code_labs import answer_child, grader_seeds, measure_until_decided, run_cells
from perflab.grading.verdict import LoadMeter, Verdict, own_cpu_seconds

__all__ = [
    "LAB03_MACHINERY",
    "MIN_SHARE",
    "STEPS_PER_EPOCH",
    "child_lab03_ceiling_next",
    "child_lab03_load",
    "child_lab03_load_ceiling",
    "child_lab03_next",
    "child_lab03_start",
    "grade_lab03",
]

LAB03_MACHINERY = ["colab_setup", "setup"]
STEPS_PER_EPOCH = 8
MIN_SHARE = 0.9


def _digest(image: torch.Tensor) -> bytes:
    return hashlib.blake2b(image.contiguous().numpy().tobytes(), digest_size=16).digest()


def _crop_index(images: torch.Tensor) -> dict[bytes, set[int]]:
    """Each of the 50 crops and flipped crops (32 px of 36) of every image, by its digest: digest -> image indices."""
    index: dict[bytes, set[int]] = {}
    for i, image in enumerate(images.cpu()):
        crops = [image[:, top : top + 32, left : left + 32] for top in range(5) for left in range(5)]
        for crop in crops + [crop.flip(-1) for crop in crops]:
            index.setdefault(_digest(crop), set()).add(i)
    return index


def _batch_bytes(images: torch.Tensor, labels: torch.Tensor) -> bytes:
    return images.detach().to("cpu").contiguous().numpy().tobytes() + labels.detach().to("cpu").numpy().tobytes()


def _batch_from(result, payload: bytes) -> tuple[torch.Tensor, torch.Tensor]:
    count = result.get("count") if isinstance(result, dict) else None
    if type(count) is not int or not 0 < count <= 8192 or len(payload) != count * (3 * 32 * 32 + 8):
        raise ChildError("fast_epoch gave a batch that is not uint8 [B, 3, 32, 32] images with int64 labels")
    images = torch.frombuffer(bytearray(payload[: count * 3 * 32 * 32]), dtype=torch.uint8).view(count, 3, 32, 32)
    labels = torch.frombuffer(bytearray(payload[count * 3 * 32 * 32 :]), dtype=torch.int64)
    return images, labels


def grade_lab03(cells: dict, rounds: int = 15) -> dict[str, Verdict]:
    namespace = run_cells(cells["course"], LAB03_MACHINERY + ["step"])
    device, batch_size, step = namespace["device"], namespace["BATCH"], namespace["training_step"]
    course_cache = namespace["CachedImages"](namespace["data"].train, progress=False)
    ceiling_batches = [
        [t.to(device) for t in batch]
        for _, batch in zip(
            range(4), namespace["cached_batches"](course_cache.to(device), batch_size=batch_size, seed=0)
        )
    ]
    subset = torch.randperm(len(course_cache), generator=torch.Generator().manual_seed(grader_seeds.randrange(2**31)))
    images, labels = (
        t.index_select(0, subset[: STEPS_PER_EPOCH * batch_size]) for t in (course_cache.images, course_cache.labels)
    )
    index = _crop_index(images)
    try:
        child = answer_child(cells, LAB03_MACHINERY, ["batch_crop_flip", "fast_epoch"], handlers=__name__)
    except ChildError as error:
        return {"test_ceiling": verdict_of(error)}
    ceiling = AnswerProcess([], handlers=__name__)
    orders: set[tuple[int, ...]] = set()
    ceiling.call(
        "lab03_load_ceiling",
        b"".join(_batch_bytes(*batch) for batch in ceiling_batches),
        counts=[len(labels) for _, labels in ceiling_batches],
    )

    def epoch(seed: int, watch: IdleWatch, round_index: int) -> tuple[float, float, int, int]:
        """One paired epoch: (pipeline seconds, ceiling seconds, pipeline samples, ceiling samples); raises if wrong."""
        _, _, pipeline_s = child.call("lab03_start", seed=seed)
        ceiling_s, samples, ceiling_samples, seen = 0.0, 0, 0, []
        while True:
            result, payload, seconds = child.call("lab03_next")
            pipeline_s += seconds
            if result == "done":
                break
            batch = _batch_from(result, payload)
            # Frozen until its next request, the learner's child must not make its next batch meanwhile (the
            # ceiling's child runs no learner code).
            with watch.while_frozen(child, round_index):
                start = time.perf_counter()
                step(*batch)
                synchronize(device)
                pipeline_s += time.perf_counter() - start
                result, payload, seconds = ceiling.call("lab03_ceiling_next")
                ceiling_batch = _batch_from(result, payload)
                start = time.perf_counter()
                step(*ceiling_batch)
                synchronize(device)
                ceiling_s += seconds + time.perf_counter() - start
                samples, ceiling_samples = samples + len(batch[1]), ceiling_samples + len(ceiling_batch[1])
                for image, label in zip(*batch):  # outside the clock
                    owners = [i for i in index.get(_digest(image), ()) if labels[i] == label]
                    if not owners:
                        raise ChildError("a batch image is not a crop of a subset image with its own label")
                    seen.append(owners[0])
        if sorted(seen) != list(range(len(labels))):
            raise ChildError(
                f"an epoch gave {len(seen)} samples ({len(set(seen))} different) of {len(labels)}: "
                "every sample exactly once"
            )
        if tuple(seen) in orders:
            raise ChildError(
                "two epochs with different seeds came in the same order: each epoch must be drawn from its seed"
            )
        orders.add(tuple(seen))
        return pipeline_s, ceiling_s, samples, ceiling_samples

    def measure_once(n: int):
        times: tuple[list[float], list[float]] = ([], [])
        watch = IdleWatch()
        with LoadMeter(ours=lambda: own_cpu_seconds() + child.cpu_seconds() + ceiling.cpu_seconds()) as load:
            for round_index in range(n):
                pipeline_s, ceiling_s, samples, ceiling_samples = epoch(
                    grader_seeds.randrange(2**31), watch, round_index
                )
                times[0].append(ceiling_s / ceiling_samples)
                times[1].append(pipeline_s / samples)
        return (
            Comparison(Timing("ceiling", tuple(times[0])), Timing("yours", tuple(times[1])), confidence=0.9),
            [],
            load,
            len(watch.rounds),
        )

    try:
        child.call(
            "lab03_load", images.numpy().tobytes() + labels.numpy().tobytes(), count=len(labels), batch_size=batch_size
        )
        epoch(grader_seeds.randrange(2**31), IdleWatch(), 0)  # warm-up
        comparison, failures, problems = measure_until_decided(measure_once, rounds, MIN_SHARE)
    except ChildError as error:
        return {"test_ceiling": verdict_of(error)}
    finally:
        child.close()
        ceiling.close()
    share = comparison.speedup
    low, high = comparison.interval
    measured = (
        f"your pipeline reaches {share:.0%} of the compute ceiling (median of {len(comparison.ratios)} rounds "
        f"interleaved step by step, 90% CI {low:.0%}-{high:.0%}), {statistics.median(comparison.baseline.times) ** -1:,.0f} "
        f"samples/s at the ceiling, on {len(labels)} images the grader chose"
    )
    if share < MIN_SHARE:
        failures.append(
            f"{share:.0%} of the ceiling: the step still waits for data (at least {MIN_SHARE:.0%} expected)"
        )
    return {"test_ceiling": Verdict.decide(measured, failures, problems)}


def child_lab03_load(namespace, payload, count, batch_size):
    pixels = count * 3 * 36 * 36
    namespace["_images"] = (
        torch.frombuffer(bytearray(payload[:pixels]), dtype=torch.uint8).view(count, 3, 36, 36).to(namespace["device"])
    )
    namespace["_labels"] = torch.frombuffer(bytearray(payload[pixels:]), dtype=torch.int64).to(namespace["device"])
    namespace["_batch_size"] = batch_size
    return None, b""


def child_lab03_start(namespace, payload, seed):
    namespace["_epoch"] = iter(
        namespace["fast_epoch"](
            namespace["_images"], namespace["_labels"], batch_size=namespace["_batch_size"], seed=seed
        )
    )
    return None, b""


def child_lab03_next(namespace, payload):
    batch = next(namespace["_epoch"], None)
    if batch is None:
        return "done", b""
    images, labels = batch
    if images.dtype != torch.uint8 or tuple(images.shape[1:]) != (3, 32, 32) or labels.dtype != torch.int64:
        raise TypeError(
            f"a batch must be uint8 [B, 3, 32, 32] images and int64 labels, got {images.dtype} "
            f"{tuple(images.shape)} and {labels.dtype}"
        )
    return {"count": len(labels)}, _batch_bytes(images, labels)


def child_lab03_load_ceiling(namespace, payload, counts):
    batches, offset = [], 0
    for count in counts:
        size = count * (3 * 32 * 32 + 8)
        batches.append(({"count": count}, payload[offset : offset + size]))
        offset += size
    namespace["_ceiling"] = itertools.cycle(batches)
    return None, b""


def child_lab03_ceiling_next(namespace, payload):
    return next(namespace["_ceiling"])
