"""Lab 08's memory check: flash_attention's peak memory at T and 2T, drawn per grading, causal and not, against
naive attention's, measured by the grader with the same instrument (``perflab.memory.peak_memory``).

    >>> from perflab.grading.checks.lab08_attention_memory import memory_lengths
    >>> memory_lengths(seed=3)
    (384, 768)

Used by perflab.grading.checks.lab08_attention.
"""

from __future__ import annotations

import contextlib
import random

import torch

import perflab.models.gpt
from perflab.grading.checked import GraderFault
from perflab.grading.checks.lab08_attention_rules import AttentionCase, error_text, library_attention_refused
from perflab.memory import peak_memory

__all__ = ["decide_memory", "memory_lengths", "naive_peaks", "probe_memory"]

MEMORY_GROWTH = 2.6  # the most a linear peak may grow when T doubles
NAIVE_GROWTH = 3.5  # the least naive attention's peak grows when T doubles: the instrument sees the T x T scores
BELOW_NAIVE = 10  # the learner's peak at 2T must be this many times below naive's


def memory_lengths(seed: int) -> tuple[int, int]:
    """T and 2T of the peak-memory measurement: shorter than the notebook's 1024 and 2048, as a tiled forward's
    seconds grow as T**2, and long enough for naive attention's T x T scores to dominate its peak."""
    length = random.Random(seed).choice((384, 512, 640))
    return length, 2 * length


def _forward_peaks(attention, seed: int, causal: bool, rules) -> list:
    """The peak bytes of one forward pass at T and at 2T (B=1, H=2, D=16), or what it raised."""
    peaks = []
    for length in memory_lengths(seed):
        q, k, v = AttentionCase((1, 2, length, 16), length, 64, 1.0, seed + length).inputs()
        try:
            with rules(), torch.no_grad(), peak_memory() as peak:
                attention(q, k, v, causal=causal)
        except Exception as error:  # noqa: BLE001 - what it raised is the answer
            return [error_text(error)]
        peaks.append(peak.bytes)
    return peaks


def probe_memory(namespace: dict, seed: int) -> dict:
    flash_attention = namespace["flash_attention"]
    return {
        f"causal={causal}": _forward_peaks(flash_attention, seed, causal, library_attention_refused)
        for causal in (False, True)
    }


def naive_peaks(reference: dict, seed: int) -> list:
    return _forward_peaks(perflab.models.gpt.naive_attention, seed, True, contextlib.nullcontext)


def decide_memory(got: dict, naive: list, seed: int) -> list[str]:
    short, long = memory_lengths(seed)
    if len(naive) != 2:
        raise GraderFault(f"naive attention's peaks could not be measured: {naive}")
    if naive[1] / naive[0] <= NAIVE_GROWTH:
        return [f"the grader's instrument saw naive attention grow only x{naive[1] / naive[0]:.2f}: not measured"]
    failures = []
    for name, peaks in got.items():
        where = f"{name}, T = {short} then {long}"
        if not all(type(peak) is int for peak in peaks) or len(peaks) != 2:
            failures.append(f"{where}: {peaks}")
            continue
        output_bytes = [2 * length * 16 * 4 for length in (short, long)]
        if any(peak < least for peak, least in zip(peaks, output_bytes)):
            failures.append(f"{where}: peaks of {peaks} bytes, less than the output itself ({output_bytes} bytes)")
        elif peaks[1] / peaks[0] >= MEMORY_GROWTH:
            failures.append(
                f"{where}: your peak memory grew x{peaks[1] / peaks[0]:.2f} when T doubled: it must grow linearly "
                f"(< {MEMORY_GROWTH}x)"
            )
        if peaks[-1] >= naive[1] / BELOW_NAIVE:
            failures.append(
                f"{where}: your peak at T = {long} ({peaks[-1] / 1e6:.2f} MB) must be far below naive's "
                f"({naive[1] / 1e6:.2f} MB; under a {BELOW_NAIVE}th)"
            )
    return failures
