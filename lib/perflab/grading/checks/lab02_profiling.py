"""Lab 02 (profiling), decided outside the learner's kernel: its answers read as data, its fix run on the grader's inputs.

    >>> from perflab.grading.checks.lab02_profiling import CHECKS, fix_case, one_line
    >>> sorted(CHECKS)
    ['test_phase_syncs_kind', 'test_preprocess_fast', 'test_slowest_function', 'test_slowest_lines']
    >>> fix_case(seed=3)          # (images, their seed, first sample index, pipeline seed): fresh for every grading
    (15, 621429, 557, 17094)
    >>> one_line("  y = torch.tanh(x)\\n      * 2")
    'y = torch.tanh(x) * 2'

The measured answers (which function, which lines, which phase, which kind) are compared with what
the course's reference solution measures in the grader's process; the syncs per step are counted
there with ``perflab.SyncCounter``, on a run of a length drawn from the seed. ``test_preprocess_speed``
is the lab's measured grader's (perflab.grading.code_labs.grade_lab02).

Used by perflab.grading.checks.
"""

from __future__ import annotations

import contextlib
import io
import random

import torch

from perflab.device import SyncCounter
from perflab.grading.checked import Check, differences

__all__ = ["ANSWERS", "CELLS", "CHECKS", "fix_case", "one_line", "sync_count_steps", "typed"]

CELLS = (
    "colab_setup",
    "setup",
    "pipeline",
    "slowest_function",
    "slowest_lines",
    "phase_syncs_kind",
    "preprocess_fast",
)
ANSWERS = ("slowest_function", "slowest_lines", "phase_syncs_kind", "preprocess_fast")
LONGEST_EXTRA = 60  # characters an answer may add to the line it names (a line number, the timing columns)


def typed(value, kind: type):
    """``value`` as data if it is exactly a ``kind``, else what it is instead (so that a wrong type shows).

    >>> typed(65, int), typed(65.0, int), typed(True, int)
    (65, '<a float>', '<a bool>')
    """
    return value if type(value) is kind else f"<a {type(value).__name__}>"


def one_line(text: str) -> str:
    """The text with its whitespace runs made single spaces, as ``line_profiler`` and ``inspect`` may differ."""
    return " ".join(text.split())


def _probe_slowest_function(namespace: dict, seed: int) -> str:
    return typed(namespace["SLOWEST_FUNCTION"], str)


def _probe_slowest_lines(namespace: dict, seed: int) -> dict:
    return {name: typed(namespace[name], str) for name in ("SLOWEST_LINE", "FORWARD_SLOWEST_LINE")}


def _decide_slowest_lines(got: dict, want: dict, seed: int) -> list[str]:
    failures = []
    for name, where in (("SLOWEST_LINE", "the slowest function"), ("FORWARD_SLOWEST_LINE", "SmallNet.forward")):
        answer, line = got[name], one_line(want[name])
        if not (line in one_line(answer) and len(one_line(answer)) < len(line) + LONGEST_EXTRA):
            failures.append(f"{name}: {answer!r:.200} is not the slowest line of {where}")
    return failures


def _probe_phase_syncs_kind(namespace: dict, seed: int) -> dict:
    return {
        "BOTTLENECK_PHASE": typed(namespace["BOTTLENECK_PHASE"], str),
        "SYNCS_PER_STEP": typed(namespace["SYNCS_PER_STEP"], int),
        "KIND": typed(namespace["KIND"], str),
    }


def sync_count_steps(seed: int) -> tuple[int, int]:
    """(steps, pipeline seed) of the run on which the grader counts the syncs per step: at least 3 steps, as a run
    adds one sync of its own, which rounds away only over 3 steps or more (131 in 2 steps: 65.5 per step, rounded 66)."""
    draw = random.Random(seed)
    return draw.randint(3, 5), draw.randrange(10**5)


def _expected_phase_syncs_kind(reference: dict, seed: int) -> dict:
    """The reference's measured phase and kind; the syncs per step counted here, without the profiler."""
    steps, pipeline_seed = sync_count_steps(seed)
    with SyncCounter() as syncs, contextlib.redirect_stdout(io.StringIO()):
        reference["run_pipeline"](steps=steps, seed=pipeline_seed, transform=reference["preprocess_fast"])
    return {
        "BOTTLENECK_PHASE": reference["BOTTLENECK_PHASE"],
        "SYNCS_PER_STEP": round((syncs.by_method["item"] + syncs.by_method["__int__"]) / steps),
        "KIND": reference["KIND"],
    }


def fix_case(seed: int) -> tuple[int, int, int, int]:
    """(images, their seed, the first one's sample index, the pipeline's seed) on which preprocess_fast is compared."""
    draw = random.Random(seed)
    return draw.randint(12, 24), draw.randrange(10**6), draw.randrange(1000), draw.randrange(10**5)


def _fix_results(namespace: dict, seed: int, transform: str) -> dict:
    count, images_seed, first_index, pipeline_seed = fix_case(seed)
    images, _ = namespace["make_images"](count, images_seed)
    function = namespace[transform]
    outputs = [function(images[i], first_index + i) for i in range(count)]
    losses, correct = namespace["run_pipeline"](steps=2, seed=pipeline_seed, transform=function)
    return {
        "outputs": [
            output.detach().cpu() if type(output) is torch.Tensor else typed(output, torch.Tensor) for output in outputs
        ],
        "losses": [typed(loss, float) for loss in losses],
        "correct": typed(correct, int),
    }


def _decide_preprocess_fast(got: dict, want: dict, seed: int) -> list[str]:
    """The outputs as close as ``torch.allclose(..., atol=1e-6)`` makes them; the pipeline learning as before."""
    return (
        differences(got["outputs"], want["outputs"], what="preprocess_fast's outputs", atol=1e-6, rtol=1e-5)
        + differences(got["losses"], want["losses"], what="the pipeline's losses with it", rtol=1e-4)
        + differences(got["correct"], want["correct"], what="its correct predictions")
    )


CHECKS = {
    "test_slowest_function": Check(
        "SLOWEST_FUNCTION: the function the course's reference finds slowest in cProfile's cumulative times",
        _probe_slowest_function,
        lambda got, want, seed: differences(got, want, what="SLOWEST_FUNCTION"),
        needs=("slowest_function",),
    ),
    "test_slowest_lines": Check(
        "SLOWEST_LINE and FORWARD_SLOWEST_LINE: the lines the course's reference finds slowest with line_profiler",
        _probe_slowest_lines,
        _decide_slowest_lines,
        needs=("slowest_lines",),
    ),
    "test_phase_syncs_kind": Check(
        "BOTTLENECK_PHASE and KIND against the course's reference profile, SYNCS_PER_STEP against the syncs the "
        "grader counts on a run of its own",
        _probe_phase_syncs_kind,
        lambda got, want, seed: differences(got, want, what="the answer"),
        needs=("phase_syncs_kind",),
        expected=_expected_phase_syncs_kind,
    ),
    "test_preprocess_fast": Check(
        "preprocess_fast against the course's preprocess on images and sample indices drawn for this grading, and "
        "the pipeline's losses and correct predictions with it",
        lambda namespace, seed: _fix_results(namespace, seed, "preprocess_fast"),
        _decide_preprocess_fast,
        needs=("preprocess_fast",),
        expected=lambda reference, seed: _fix_results(reference, seed, "preprocess"),
    ),
}
