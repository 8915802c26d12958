"""Lab 01 (timing), decided outside the learner's kernel: its functions called on the grader's inputs.

    >>> from perflab.grading.checks.lab01_timing import CHECKS, train_cases
    >>> sorted(CHECKS)
    ['test_hidden_syncs', 'test_summarize', 'test_time_it', 'test_train_fixed']
    >>> [(steps, log_every) for steps, log_every, _ in train_cases(seed=3)]   # fresh sizes for every grading
    [(20, 10), (32, 9), (11, 100)]

Every draw comes from the grading's seed, so that no answer can be fitted to the inputs.

Used by perflab.grading.checks.
"""

from __future__ import annotations

import random

import numpy as np
import torch

from perflab.grading.checked import Check, differences, raised

__all__ = ["ANSWERS", "CELLS", "CHECKS", "time_it_case", "train_cases"]

CELLS = ("colab_setup", "setup", "simulated_gpu", "time_it", "summarize", "naive_loop", "hidden_syncs", "train_fixed")
ANSWERS = ("time_it", "summarize", "hidden_syncs", "train_fixed")
QUEUED_S = (0.01, 0.02)  # each timed call's queued work on the simulated GPU, drawn in this range
WARMUP_S = 0.2  # the warm-up's queued work, which a timer that does not wait for it sees in its first call


def _floats(values) -> list:
    """A learner's list of timings as data: each a Python float (numpy's count: they are floats too)."""
    return [float(value) if isinstance(value, float) else repr(value)[:80] for value in values]


def time_it_case(seed: int) -> tuple[int, int, float]:
    """(warm-up calls, timed calls, seconds of work each call queues) of a grading."""
    draw = random.Random(seed)
    return draw.randint(1, 4), draw.randint(3, 8), draw.uniform(*QUEUED_S)


def _probe_time_it(namespace: dict, seed: int) -> dict:
    time_it, gpu = namespace["time_it"], namespace["gpu"]
    warmup, repeats, queued = time_it_case(seed)
    calls = []
    counted = time_it(lambda: calls.append(1), sync=lambda: None, warmup=warmup, repeats=repeats)
    synced = time_it(lambda: gpu.launch(queued), sync=gpu.synchronize, warmup=1, repeats=3)
    durations = iter([WARMUP_S] + [queued] * 4)
    after_warmup = time_it(lambda: gpu.launch(next(durations)), sync=gpu.synchronize, warmup=1, repeats=4)
    return {
        "durations counted": len(counted),
        "calls made": len(calls),
        "durations": _floats(counted),
        "synced": _floats(synced),
        "after warm-up": _floats(after_warmup),
        "repeats=0": raised(lambda: time_it(lambda: None, sync=lambda: None, repeats=0)),
        "warmup=-1": raised(lambda: time_it(lambda: None, sync=lambda: None, warmup=-1)),
    }


def _decide_time_it(got: dict, want: dict, seed: int) -> list[str]:
    failures = [
        f"{key}: {got[key]}, expected {want[key]}"
        for key in ("durations counted", "calls made")
        if got[key] != want[key]
    ]
    if not all(type(t) is float and t >= 0 for t in got["durations"]):
        failures.append(f"each duration a float of seconds, >= 0: got {got['durations'][:8]}")
    least = 0.8 * time_it_case(seed)[2]
    if not all(type(t) is float and t > least for t in got["synced"]):
        failures.append(
            f"each call's queued work must be inside its timing (over {least:.4f} s): did you sync? {got['synced']}"
        )
    after = got["after warm-up"]
    if not after or not all(type(t) is float for t in after) or max(after) >= WARMUP_S / 2 or min(after) <= least:
        failures.append(f"the warm-up's work leaked into the timing, or a call's work was left out: {after}")
    failures += [
        f"time_it({key}) must raise ValueError, raised {got[key]}"
        for key in ("repeats=0", "warmup=-1")
        if got[key] != "ValueError"
    ]
    return failures


def _probe_summarize(namespace: dict, seed: int) -> dict:
    summarize = namespace["summarize"]
    rng = np.random.default_rng(seed)
    samples = [[1.0, 2.0, 3.0, 4.0, 100.0]] + [list(map(float, rng.lognormal(size=n))) for n in (1, 2, 10, 101)]
    summaries = []
    for sample in samples:
        summary = summarize(sample)
        summaries.append({str(key): float(value) for key, value in summary.items()})
    return {"summaries": summaries, "summarize([])": raised(lambda: summarize([]))}


def _probe_hidden_syncs(namespace: dict, seed: int) -> dict:
    answer = namespace["HIDDEN_SYNCS"]
    return {"a set": type(answer) is set, "labels": sorted(str(label) for label in answer)}


def train_cases(seed: int) -> list[tuple[int, int, int]]:
    """(steps, log_every, problem seed) of each training the grader compares: the notebook's own, then two drawn."""
    draw = random.Random(seed)
    return [
        (20, 10, 0),
        (draw.randint(25, 40), draw.randint(5, 9), draw.randrange(1000)),
        (draw.randint(10, 15), 100, draw.randrange(1000)),
    ]


def _probe_train_fixed(namespace: dict, seed: int) -> list[dict]:
    make_problem, train_fixed, sync_counter = (
        namespace["make_problem"],
        namespace["train_fixed"],
        namespace["perflab"].SyncCounter,
    )
    runs = []
    for steps, log_every, problem_seed in train_cases(seed):
        model, optimizer, batches = make_problem(steps=steps, seed=problem_seed)
        with sync_counter() as syncs:
            history, best = train_fixed(model, optimizer, batches, log_every=log_every)
        runs.append(
            {
                "floats": all(isinstance(value, float) for value in history),
                "history": torch.tensor([float(value) for value in history]),
                "best": float(best),
                "weights": [parameter.detach().cpu() for parameter in model.parameters()],
                "syncs": syncs.total,
            }
        )
    return runs


def _decide_train_fixed(got: list, want: list, seed: int) -> list[str]:
    failures = []
    for run, expected, (steps, log_every, _) in zip(got, want, train_cases(seed)):
        where = f"{steps} steps, log_every={log_every}"
        if not run["floats"]:
            failures.append(f"{where}: the losses must be a list of Python floats")
        failures += differences(run["history"], expected["history"], what=f"{where}: the losses", atol=1e-6)
        failures += differences(run["best"], expected["best"], what=f"{where}: the best loss", atol=1e-6)
        failures += differences(run["weights"], expected["weights"], what=f"{where}: the trained weights", atol=1e-6)
        if run["syncs"] > -(-steps // log_every) + 2:
            failures.append(f"{where}: {run['syncs']} syncs, at most {-(-steps // log_every) + 2} allowed")
    return failures


CHECKS = {
    "test_time_it": Check(
        "time_it on the grader's warm-up and repeat counts, on the simulated GPU's queued work and its warm-up, and "
        "on invalid arguments",
        _probe_time_it,
        _decide_time_it,
        needs=("time_it",),
    ),
    "test_summarize": Check(
        "summarize on samples drawn for this grading (1 to 101 timings) and on none",
        _probe_summarize,
        lambda got, want, seed: differences(got, want, what="summarize", rtol=1e-5, atol=1e-8),
        needs=("summarize",),
    ),
    "test_hidden_syncs": Check(
        "HIDDEN_SYNCS: the labels of the lines that wait for the device",
        _probe_hidden_syncs,
        lambda got, want, seed: differences(got, want, what="HIDDEN_SYNCS"),
        needs=("hidden_syncs",),
    ),
    "test_train_fixed": Check(
        "train_fixed on problems drawn for this grading: its losses, best loss and trained weights against the "
        "course's, and its syncs counted",
        _probe_train_fixed,
        _decide_train_fixed,
        needs=("train_fixed",),
    ),
}
