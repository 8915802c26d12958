"""Lab 08 (FlashAttention's forward pass), decided outside the learner's kernel, on inputs drawn per grading.

    >>> from perflab.grading.checks.lab08_attention import CHECKS, attention_cases, row_cases
    >>> sorted(CHECKS)
    ['test_causal', 'test_memory', 'test_noncausal', 'test_streaming_row']
    >>> [(length, chunk, scale) for length, chunk, scale, _ in row_cases(seed=3)]   # fresh sizes for every grading
    [(117, 6, 1.0), (83, 1, 3.0), (47, 67, 1.0), (44, 44, 1.0), (310, 36, 500.0), (4189, 32, 1.0)]
    >>> attention_cases(seed=3, causal=True)[-1].shape    # (B, H, Tq, D) of the causal call with many small tiles
    (1, 2, 259, 8)

The learner's functions run in the child, on these inputs, under the course's rules (no SDPA, no
library attention: a call of either raises there) and its instruments (``largest_new_tensor``,
``count_flops``, ``peak_memory``); the child hands back their outputs and what the instruments
saw, as data. Here the outputs are compared with ``torch.softmax`` and SDPA in float64, computed
in this process, and the sizes, FLOPs and peaks with bounds from the grading's draws. Naive
attention's peaks, which the memory bound is relative to, are measured here too.

Used by perflab.grading.checks.
"""

from __future__ import annotations

import functools
import random

import torch
import torch.nn.functional as F

from perflab.attention import largest_new_tensor
from perflab.grading.checked import Check, differences
from perflab.grading.checks.lab08_attention_memory import decide_memory, naive_peaks, probe_memory
from perflab.grading.checks.lab08_attention_rules import AttentionCase, error_text, library_attention_refused
from perflab.models import count_flops

__all__ = ["ANSWERS", "CELLS", "CHECKS", "attention_cases", "flops_case", "row_cases"]

CELLS = ("colab_setup", "setup", "streaming_row", "rules", "flash_attention")
ANSWERS = ("streaming_row", "flash_attention")
ROW_ATOL = 1e-5  # |output - softmax(scores) @ values|, as the lab states
ROW_SUM_RTOL = 1e-4
TOLERANCE = 1e-4  # |flash_attention - SDPA in float64|, float32 inputs: the notebook's TOLERANCE


def row_cases(seed: int) -> list[tuple[int, int, float, int]]:
    """(keys N, chunk size, score scale, tensor seed) of each row: a chunk that does not divide N, chunks of 1, a chunk
    longer than N, exactly one chunk, scores that overflow exp without the maximum (x500), and a long row whose
    largest new tensor is measured (the last)."""
    draw = random.Random(seed)
    chunk = draw.randint(5, 9)
    uneven = draw.randint(80, 120)
    uneven += uneven % chunk == 0
    shorter = draw.randint(30, 60)
    one_chunk = draw.randint(40, 70)
    sizes = [
        (uneven, chunk, 1.0),
        (draw.randint(60, 100), 1, 3.0),
        (shorter, shorter + draw.randint(1, 20), 1.0),
        (one_chunk, one_chunk, 1.0),
        (draw.randint(250, 350), draw.randint(16, 40), 500.0),
        (draw.randint(3000, 5000), draw.choice((32, 64)), 1.0),
    ]
    return [(length, chunk_size, scale, draw.randrange(2**31)) for length, chunk_size, scale in sizes]


def _row_inputs(length: int, scale: float, tensor_seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(tensor_seed)
    head_dim = 3 + tensor_seed % 6
    return torch.randn(length, generator=generator) * scale, torch.randn(length, head_dim, generator=generator)


def _probe_streaming_row(namespace: dict, seed: int) -> list[dict]:
    streaming_attention_row = namespace["streaming_attention_row"]
    rows = []
    for length, chunk_size, scale, tensor_seed in row_cases(seed):
        scores, values = _row_inputs(length, scale, tensor_seed)
        with largest_new_tensor() as largest:
            output, row_max, row_sum = streaming_attention_row(scores, values, chunk_size)
        rows.append({"output": output, "row_max": float(row_max), "row_sum": float(row_sum), "largest": largest.numel})
    return rows


def _exact_rows(reference: dict, seed: int) -> list[dict]:
    rows = []
    for length, _, scale, tensor_seed in row_cases(seed):
        scores, values = _row_inputs(length, scale, tensor_seed)
        rows.append(
            {
                "output": torch.softmax(scores, dim=0) @ values,
                "row_max": scores.max().item(),
                "row_sum": torch.exp(scores - scores.max()).sum().item(),
            }
        )
    return rows


def _decide_streaming_row(got: list, want: list, seed: int) -> list[str]:
    failures = []
    for row, exact, (length, chunk_size, scale, _) in zip(got, want, row_cases(seed)):
        where = f"N={length}, chunk {chunk_size}, scores x{scale:g}"
        output = row["output"]
        if isinstance(output, torch.Tensor) and output.is_floating_point() and not output.isfinite().all():
            failures.append(f"{where}: non-finite output; subtract the running maximum before exp")
        failures += differences(output, exact["output"], what=f"{where}: the output", atol=ROW_ATOL)
        failures += differences(row["row_max"], exact["row_max"], what=f"{where}: row_max (the largest score)")
        failures += differences(
            row["row_sum"], exact["row_sum"], what=f"{where}: row_sum (of exp(score - row_max))", rtol=ROW_SUM_RTOL
        )
        head_dim = exact["output"].numel()
        if row["largest"] > chunk_size * head_dim:
            failures.append(
                f"{where}: your function made a tensor of {row['largest']} elements, more than one chunk's "
                f"{chunk_size} x {head_dim}: never hold more than one chunk of terms at a time"
            )
    return failures


def attention_cases(seed: int, causal: bool) -> list[AttentionCase]:
    """The calls a grading makes: lengths that are not multiples of the tile, one tile, a tile longer than the
    sequence, a single token, large scores, and (not causal) more or fewer keys than queries, or (causal) many
    small tiles."""
    draw = random.Random(seed * 2 + causal)
    uneven = draw.choice((90, 100, 110, 120))
    one_tile = draw.choice((32, 48, 64))
    short = draw.randint(30, 60)
    sizes = [
        ((2, 3, draw.randint(200, 300), 16), None, 64, 1.0),
        ((2, 3, uneven, 16), None, 32, 1.0),
        ((1, 2, one_tile, 8), None, one_tile, 1.0),
        ((1, 1, short, 4), None, 64, 1.0),
        ((1, 1, 1, 4), None, 16, 1.0),
        ((1, 2, draw.randint(180, 220), 16), None, 48, 6.0),  # scores in the hundreds: exp overflows without the max
    ]
    if causal:
        sizes.append(((1, 2, draw.randint(250, 350), 8), None, draw.randint(5, 9), 1.0))
    else:
        sizes.append(((2, 2, draw.randint(60, 80), 8), draw.randint(120, 140), 32, 1.0))
        sizes.append(((1, 2, draw.randint(120, 140), 8), draw.randint(40, 50), 32, 1.0))
    return [
        AttentionCase(shape, shape[2] if keys is None else keys, tile, scale, draw.randrange(2**31))
        for shape, keys, tile, scale in sizes
    ]


def _run_attention(flash_attention, case: AttentionCase, causal: bool) -> dict:
    """One call under the rules: its output, or what it raised, and the largest tensor it made."""
    q, k, v = case.inputs()
    try:
        with library_attention_refused(), torch.no_grad(), largest_new_tensor() as largest:
            output = flash_attention(q, k, v, causal=causal, tile_size=case.tile_size)
    except Exception as error:  # noqa: BLE001 - what it raised is the answer
        return {"output": None, "raised": error_text(error), "largest": 0}
    return {"output": output, "raised": None, "largest": largest.numel}


def _sdpa_outputs(seed: int, causal: bool) -> list[dict]:
    """What each call must return: SDPA, computed here in float64."""
    return [
        {"output": F.scaled_dot_product_attention(*(x.double() for x in case.inputs()), is_causal=causal)}
        for case in attention_cases(seed, causal)
    ]


def _attention_failures(got: list, want: list, seed: int, causal: bool) -> list[str]:
    failures = []
    for run, exact, case in zip(got, want, attention_cases(seed, causal)):
        where = f"{case}, causal={causal}"
        output, expected = run["output"], exact["output"]
        if run["raised"]:
            failures.append(f"{where}: {run['raised']}")
        elif not isinstance(output, torch.Tensor) or output.shape != expected.shape:
            failures.append(f"{where}: output shape {list(getattr(output, 'shape', []))}, want {list(expected.shape)}")
        elif output.dtype != torch.float32:
            failures.append(f"{where}: output dtype {output.dtype}, want q's, torch.float32")
        else:
            failures += differences(
                output.double(), expected, what=f"{where}: your output against SDPA", atol=TOLERANCE
            )
        if run["largest"] > case.largest_allowed():
            failures.append(
                f"{where}: your function made a tensor of {run['largest']} elements, more than q and than one tile of "
                "scores per head: hold one tile_size x tile_size block of scores at a time"
            )
    return failures


def _probe_noncausal(namespace: dict, seed: int) -> list[dict]:
    return [_run_attention(namespace["flash_attention"], case, False) for case in attention_cases(seed, False)]


def flops_case(seed: int) -> tuple[int, int]:
    """(tiles along T, tile size) of the FLOP count: T = tiles x tile size."""
    draw = random.Random(seed)
    return draw.randint(7, 10), draw.choice((32, 64))


def _probe_causal(namespace: dict, seed: int) -> dict:
    flash_attention = namespace["flash_attention"]
    tiles, tile_size = flops_case(seed)
    q, k, v = AttentionCase((1, 2, tiles * tile_size, 16), tiles * tile_size, tile_size, 1.0, seed).inputs()
    flops = {}
    for causal in (False, True):
        try:
            with library_attention_refused():
                call = functools.partial(flash_attention, causal=causal, tile_size=tile_size)
                flops[str(causal)] = count_flops(call, q, k, v, backward=False)
        except Exception as error:  # noqa: BLE001 - what it raised is the answer
            flops[str(causal)] = error_text(error)
    return {
        "calls": [_run_attention(flash_attention, case, True) for case in attention_cases(seed, True)],
        "flops": flops,
    }


def _decide_causal(got: dict, want: dict, seed: int) -> list[str]:
    failures = _attention_failures(got["calls"], want["calls"], seed, causal=True)
    tiles, tile_size = flops_case(seed)
    where = f"FLOPs at T = {tiles * tile_size} with tiles of {tile_size}"
    flops = got["flops"]
    if not all(type(count) is int for count in flops.values()):
        return [*failures, f"{where}: {flops}"]
    if flops["False"] <= 0:
        return [*failures, f"{where}: no matmul FLOPs counted: compute the scores with matmuls (@)"]
    skipping = (tiles + 1) / (2 * tiles)  # the tiles on and below the diagonal: tiles (tiles + 1) / 2 of tiles**2
    most, ratio = skipping + 0.7 / tiles, flops["True"] / flops["False"]
    if ratio >= most:
        failures.append(
            f"{where}: the causal call did {ratio:.2f} of the non-causal FLOPs, at most {most:.2f} allowed (skipping "
            f"the tiles above the diagonal gives {skipping:.2f}): skip the key tiles after the query tile"
        )
    if ratio <= 0.4:
        failures.append(
            f"{where}: the causal call did only {ratio:.2f} of the non-causal FLOPs: it skips tiles it needs"
        )
    return failures


CHECKS = {
    "test_streaming_row": Check(
        "streaming_attention_row on rows drawn for this grading (uneven chunks, chunks of 1, longer than the row, "
        "scores that overflow exp) against softmax(scores) @ values, and its largest tensor against one chunk",
        _probe_streaming_row,
        _decide_streaming_row,
        needs=("streaming_row",),
        expected=_exact_rows,
    ),
    "test_noncausal": Check(
        "flash_attention(causal=False) on shapes and tiles drawn for this grading, under the rules (no SDPA, no "
        "library attention), against SDPA in float64, and its largest tensor against one tile of scores",
        _probe_noncausal,
        lambda got, want, seed: _attention_failures(got, want, seed, causal=False),
        needs=("flash_attention",),
        expected=lambda reference, seed: _sdpa_outputs(seed, causal=False),
    ),
    "test_causal": Check(
        "flash_attention(causal=True) on shapes and tiles drawn for this grading against SDPA in float64, its "
        "largest tensor, and its FLOPs against the non-causal call's: the tiles above the diagonal skipped",
        _probe_causal,
        _decide_causal,
        needs=("flash_attention",),
        expected=lambda reference, seed: {"calls": _sdpa_outputs(seed, causal=True), "flops": None},
    ),
    "test_memory": Check(
        "flash_attention's peak memory at T and 2T (drawn for this grading), causal and not: it must grow linearly "
        "and stay far below naive attention's, measured by the grader",
        probe_memory,
        decide_memory,
        needs=("flash_attention",),
        expected=naive_peaks,
    ),
}
