"""Lab 12 (capstone), its unmeasured cells decided outside the learner's kernel, from its answer cells alone.

    >>> from perflab.grading.checks.lab12_capstone import CHECKS, break_even_cases, pays_off_cases
    >>> sorted(CHECKS)
    ['test_bottleneck', 'test_break_even', 'test_final', 'test_flops_per_sample']
    >>> [f"{compile_s:.0f} s, then {eager:.3f} s -> {compiled:.3f} s a step" for compile_s, eager, compiled in
    ...  break_even_cases(seed=3)][:2]                                  # drawn for every grading
    ['317 s, then 0.127 s -> 0.084 s a step', '164 s, then 0.306 s -> 0.189 s a step']
    >>> pays_off_cases(seed=3)[:2]     # (break-even, epochs, images per class, batch): pays off after 3 x 42 steps?
    [(125.5, 3, 353, 85), (78.0, 3, 239, 93)]

The child runs the answer cells without the notebook's trainings and measurements, and the checks
decide what needs none of them:

- ``BOTTLENECK`` against the course's answer, run in the trusted process. Not against the grader's
  own profile: on a 2-core EPYC under a load of 6 (torch 2.15) a profile of the first steps named
  another class than the one recorded in results/02_profiling: the verdict would depend on the load
  beside the grading, and the profile cost 12 s.
- the break-even: the learner's ``break_even_steps`` and ``compile_pays_off`` called on compile times,
  step times and runs drawn per grading, against the course's, instead of the one measurement the
  notebook made (a model compiled and timed, too slow to grade with, and a ratio no two runs share).
- ``final_config`` rebuilt from its configuration cells: a ``TrainConfig`` whose fields have their
  declared types, within the grader's bounds, that trains the course's task (:func:`perflab.capstone.refusal`).
- ``FLOPS_PER_SAMPLE`` against the course's count for its model (there is one model: nothing to draw).

Used by perflab.grading.checks.
"""

from __future__ import annotations

import dataclasses
import math
import random

import numpy as np

from perflab.grading.answers import AnswerError, train_config
from perflab.grading.checked import Check, differences

__all__ = ["ANSWERS", "CELLS", "CHECKS", "break_even_cases", "pays_off_cases"]

ANSWERS = (
    "bottleneck",
    "data_config",
    "batch_config",
    "amp_config",
    "ckpt_config",
    "break_even",
    "final_config",
    "flops_per_sample",
)
CELLS = ("colab_setup", "setup", *ANSWERS)
CLASSES = ("data-bound", "compute-bound", "memory-bound", "overhead-bound")
BREAK_EVEN_RTOL = 0.01  # the visible test's: a break-even rounded to a whole step passes (each drawn one is >= 100)


def _number(value):
    """A learner's number as data: a float (numpy's count), else what it is, shortly."""
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else repr(value)[:80]


def _probe_bottleneck(namespace: dict, seed: int):
    answer = namespace["BOTTLENECK"]
    return answer if type(answer) is str else repr(answer)[:80]


def _decide_bottleneck(got, want, seed: int) -> list[str]:
    if got not in CLASSES:
        return [f"BOTTLENECK is {got!r}: it must be one of {', '.join(map(repr, CLASSES))}"]
    if got != want:
        return [f"BOTTLENECK {got!r} is not the baseline's class: which phase takes most of its steps' time?"]
    return []


def break_even_cases(seed: int) -> list[tuple[float, float, float]]:
    """(compile seconds, eager step s, compiled step s): compiling that pays after 100 to 20,000 steps, then a
    compiled step as fast as the eager one, then a slower one."""
    draw = random.Random(seed)
    cases = []
    for _ in range(4):
        eager = draw.uniform(0.01, 0.5)
        saving = eager * draw.uniform(0.02, 0.6)
        cases.append((saving * draw.uniform(100, 20_000), eager, eager - saving))
    eager = draw.uniform(0.01, 0.5)
    return cases + [(draw.uniform(1, 90), eager, eager), (draw.uniform(1, 90), eager, eager * draw.uniform(1.01, 1.5))]


def pays_off_cases(seed: int) -> list[tuple[float, int, int, int]]:
    """(break-even, epochs, training images per class, batch size): runs of 2 to 8 epochs whose last batch is a
    partial one, and a break-even just under the run's steps, at them, just over them, or never."""
    draw = random.Random(seed)
    cases = []
    for offset in (-0.5, 0.0, 0.5, math.inf):
        epochs, per_class = draw.randint(2, 8), draw.randint(50, 500)
        batch = draw.choice([size for size in range(16, 129) if (10 * per_class) % size])
        run_steps = epochs * math.ceil(10 * per_class / batch)
        cases.append((math.inf if offset == math.inf else run_steps + offset, epochs, per_class, batch))
    return cases


def _probe_break_even(namespace: dict, seed: int) -> dict:
    break_even_steps, compile_pays_off = namespace["break_even_steps"], namespace["compile_pays_off"]
    from perflab.train import NAIVE, Workload

    paid = []
    for break_even, epochs, per_class, batch in pays_off_cases(seed):
        answer = compile_pays_off(
            break_even, dataclasses.replace(NAIVE, batch_size=batch), Workload(epochs=epochs, train_per_class=per_class)
        )
        paid.append(bool(answer) if isinstance(answer, (bool, np.bool_)) else repr(answer)[:80])
    return {"break-even": [_number(break_even_steps(*case)) for case in break_even_cases(seed)], "pays off": paid}


def _decide_break_even(got: dict, want: dict, seed: int) -> list[str]:
    failures = []
    for case, steps, expected in zip(break_even_cases(seed), got["break-even"], want["break-even"]):
        what = "break_even_steps(compile_seconds={:.3f}, eager_step_s={:.4f}, compiled_step_s={:.4f})".format(*case)
        failures += differences(steps, expected, what=what, rtol=BREAK_EVEN_RTOL)
    for (break_even, epochs, per_class, batch), paid, expected in zip(
        pays_off_cases(seed), got["pays off"], want["pays off"]
    ):
        what = f"compile_pays_off({break_even:g}, batch_size={batch}, {epochs} epochs of {10 * per_class} images)"
        failures += differences(paid, expected, what=what)
    return failures


def _probe_final(namespace: dict, seed: int) -> dict:
    from perflab.train import TrainConfig

    config = namespace["final_config"]
    if type(config) is not TrainConfig:
        return {"not a TrainConfig": type(config).__name__}
    return {"TrainConfig": dataclasses.asdict(config)}


def _decide_final(got: dict, want: dict, seed: int) -> list[str]:
    from perflab.capstone import refusal

    if "TrainConfig" not in got:
        return [f"final_config must be a TrainConfig (build it with replace(...)), not a {got['not a TrainConfig']}"]
    try:
        config = train_config(got)
    except AnswerError as error:
        return [f"final_config: {error}"]
    reason = refusal(config)
    return [f"final_config: {reason}"] if reason else []


CHECKS = {
    "test_bottleneck": Check(
        "BOTTLENECK: the class of the baseline's bottleneck",
        _probe_bottleneck,
        _decide_bottleneck,
        needs=("bottleneck",),
    ),
    "test_break_even": Check(
        "break_even_steps and compile_pays_off on compile times, step times and runs drawn for this grading",
        _probe_break_even,
        _decide_break_even,
        needs=("break_even",),
    ),
    "test_final": Check(
        "final_config, rebuilt from your configuration cells: a TrainConfig that trains the course's task, within "
        "the grader's bounds",
        _probe_final,
        _decide_final,
        needs=("final_config",),
    ),
    "test_flops_per_sample": Check(
        "FLOPS_PER_SAMPLE against the course's count of its model's forward and backward, within 1%",
        lambda namespace, seed: _number(namespace["FLOPS_PER_SAMPLE"]),
        lambda got, want, seed: differences(got, want, what="FLOPS_PER_SAMPLE", rtol=0.01),
        needs=("flops_per_sample",),
    ),
}
