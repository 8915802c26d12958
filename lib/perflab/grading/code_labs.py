"""Labs whose answer is code (02, 03, 06): the learner's cells run in a sandboxed child, timed from outside.

    grade_lab02(cells)   # cells: {"course": {grade_id: source}, "learner": {grade_id: source}}
    # {'test_preprocess_speed': Verdict(pass: ...)}, after interleaved rounds in two sandboxed children

That grading starts two children and times them in interleaved rounds (minutes), so it is shown,
not run. The course's own cells run in this process, with ``run_cells``:

    >>> from perflab.grading.code_labs import run_cells
    >>> cells = {"setup": "import math", "answer": "area = math.pi * 2**2"}    # grade_id -> source
    >>> round(run_cells(cells, ["setup", "answer"])["area"], 3)
    12.566

The trusted side runs the course's own cells (the lab's machinery and the reference solution)
in this process; the child runs the same machinery and the learner's answer cells, as nbgrader
stored them. Every round draws fresh seeds here, which the child learns only with the request;
the child's results are checked against the reference's for those seeds, and the time is read
on this side's clock, around the request, while the other side is stopped. ``child_*`` functions
are the child's side of each request.

Used by perflab.grading.session and perflab.grading.data_lab.
"""

from __future__ import annotations

import math
import random

import torch

from perflab.bench import Comparison, Timing, interleaved_rounds
from perflab.device import synchronize
from perflab.grading.child import AnswerProcess, ChildError
from perflab.grading.verdict import LoadMeter, Verdict, noise_problems, own_cpu_seconds

__all__ = [
    "LAB02_MACHINERY",
    "LAB02_TRANSFORMS",
    "LAB06_ANSWERS",
    "LAB06_MACHINERY",
    "LAB06_STEPS",
    "answer_child",
    "child_lab02_outputs",
    "child_lab02_run",
    "child_lab06_minimum",
    "child_lab06_prepare",
    "child_lab06_setup",
    "child_lab06_state",
    "child_lab06_steps",
    "grade_lab02",
    "grade_lab06",
    "grader_seeds",
    "measure_until_decided",
    "run_cells",
]

_HANDLERS = __name__
grader_seeds = random.SystemRandom()  # seeds a learner cannot predict, drawn per round


def run_cells(sources: dict[str, str], names: list[str], namespace: dict | None = None) -> dict:
    """Run the course's own cells ``names`` here, in order, in ``namespace``."""
    namespace = {"__name__": "__main__"} if namespace is None else namespace
    for name in names:
        exec(compile(sources[name], f"<cell {name}>", "exec"), namespace)
    return namespace


def answer_child(
    cells: dict, machinery: list[str], answers: list[str], handlers: str = _HANDLERS, side: str = "learner"
) -> AnswerProcess:
    """A child running the lab's ``machinery`` cells, then the ``answers`` cells of ``side``: the learner's or the course's."""
    missing = [name for name in answers if name not in cells[side]]
    if missing:
        raise ChildError(f"the answer cells {missing} are missing from the notebook")
    return AnswerProcess(
        [(name, cells["course"][name]) for name in machinery] + [(name, cells[side][name]) for name in answers],
        handlers=handlers,
    )


def _pair(cells: dict, machinery: list[str], answers: list[str]) -> tuple[AnswerProcess, AnswerProcess]:
    """The course's reference and the learner's answer, each in a child started the same way: the same
    interpreter, allocator history and sandbox on both sides of every ratio."""
    reference = answer_child(cells, machinery, answers, side="course")
    try:
        return reference, answer_child(cells, machinery, answers)
    except ChildError:
        reference.close()
        raise


def _interleaved(children: tuple[AnswerProcess, AnswerProcess], run, check, *, rounds: int, labels: tuple[str, str]):
    """``rounds`` rounds of ``run(child, seed)`` on each child, AB then BA, each round on a fresh seed.

    ``run(child, side, seed)`` (side 0: the reference, 1: the learner's) returns (result, seconds by this side's
    clock); ``check(reference result, candidate result)`` returns why the candidate's result is wrong, or None.
    The first wrong result ends the rounds: the answer fails whatever its time.
    """
    seeds = [grader_seeds.randrange(2**31) for _ in range(rounds)]
    failures: list[str] = []

    def check_round(_round_index: int, measured: list[list[tuple[object, float]]]) -> bool:
        failure = check(*(side[-1][0] for side in measured))
        if failure:
            failures.append(failure)
        return bool(failure)

    with LoadMeter(ours=lambda: own_cpu_seconds() + sum(child.cpu_seconds() for child in children)) as load:
        measured = interleaved_rounds(
            [lambda round_index, side=side: run(children[side], side, seeds[round_index]) for side in (0, 1)],
            rounds,
            warmup=False,  # the children warmed up in setup
            after_round=check_round,
        )
    times = [tuple(seconds for _, seconds in side) for side in measured]
    comparison = Comparison(Timing(labels[0], times[0]), Timing(labels[1], times[1]), confidence=0.9)
    return comparison, failures, load


def _ratio_text(comparison: Comparison, what: str) -> str:
    try:
        low, high = comparison.interval
    except ValueError:  # too few rounds for an interval: they stopped at a wrong result
        return f"{what}: stopped after {len(comparison.ratios)} round(s), at a result that differs from the reference's"
    return (
        f"{what}: {comparison.speedup:.2f}x median over {len(comparison.ratios)} interleaved rounds "
        f"({comparison.confidence:.0%} CI {low:.2f}x-{high:.2f}x)"
    )


def measure_until_decided(measure_once, rounds: int) -> tuple[Comparison, list[str], list[str]]:
    """Measure; if noisy, once more with twice the rounds. Returns (comparison, failures, noise problems)."""
    for attempt_rounds in (rounds, 2 * rounds):
        comparison, failures, load = measure_once(attempt_rounds)
        if failures:  # a wrong result fails however noisy its time
            return comparison, failures, []
        problems = noise_problems(comparison, load)
        if not problems:
            return comparison, failures, []
    return comparison, failures, problems


def _same_floats(a, b, rel_tol: float) -> bool:
    return len(a) == len(b) and all(isinstance(x, float) and math.isclose(x, y, rel_tol=rel_tol) for x, y in zip(a, b))


def _close(a, b) -> bool:
    """As the lab's own test compares weights: within 1e-4 relative and 1e-5 absolute."""
    return (
        isinstance(a, list)
        and len(a) == len(b)
        and all(isinstance(x, float) for x in a)
        and torch.allclose(torch.tensor(a), torch.tensor(b), rtol=1e-4, atol=1e-5)
    )


def _compare_pair(
    cells: dict, machinery: list[str], answers: list[str], *, setup, run, check, labels: tuple[str, str], rounds: int
):
    """Start the reference's and the learner's children, ``setup(children)``, then measure them interleaved.

    Returns (comparison, failures, noise problems, what ``setup`` returned); raises ``ChildError``.
    """
    children = _pair(cells, machinery, answers)
    try:
        prepared = setup(children)
        measured = measure_until_decided(lambda n: _interleaved(children, run, check, rounds=n, labels=labels), rounds)
        return (*measured, prepared)
    finally:
        for child in children:
            child.close()


# Lab 02: preprocess_fast against preprocess, whole pipeline runs of 4 steps on images drawn from a fresh seed.
LAB02_MACHINERY = ["colab_setup", "setup", "pipeline"]
LAB02_TRANSFORMS = ("preprocess", "preprocess_fast")


def _lab02_setup(children) -> None:
    seed = grader_seeds.randrange(2**31)
    want, got = (
        child.call("lab02_outputs", seed=seed, count=16, transform=name)[1]
        for child, name in zip(children, LAB02_TRANSFORMS)
    )
    if len(got) != len(want) or not torch.allclose(
        *(torch.frombuffer(bytearray(b), dtype=torch.float32) for b in (got, want)), atol=1e-6
    ):
        raise ChildError("preprocess_fast does not return what preprocess returns")
    for child, name in zip(children, LAB02_TRANSFORMS):  # warm-up
        child.call("lab02_run", steps=1, seed=0, transform=name)


def _lab02_run(child, side, seed):
    result, _, seconds = child.call("lab02_run", steps=4, seed=seed, transform=LAB02_TRANSFORMS[side])
    return result, seconds


def _lab02_check(reference, candidate):
    same = (
        isinstance(candidate, list)
        and len(candidate) == 2
        and candidate[1] == reference[1]
        and _same_floats(candidate[0], reference[0], 1e-4)
    )
    return None if same else "the pipeline with preprocess_fast learns differently from the original"


def grade_lab02(cells: dict, rounds: int = 9) -> dict[str, Verdict]:
    try:
        comparison, failures, problems, _ = _compare_pair(
            cells,
            LAB02_MACHINERY,
            ["preprocess_fast"],
            setup=_lab02_setup,
            run=_lab02_run,
            check=_lab02_check,
            labels=LAB02_TRANSFORMS,
            rounds=rounds,
        )
    except ChildError as error:
        return {"test_preprocess_speed": Verdict.refused(str(error))}
    if comparison.speedup < 1.5:
        failures.append(f"the fixed pipeline should be at least 1.5x faster; it is {comparison.speedup:.2f}x")
    return {
        "test_preprocess_speed": Verdict.decide(
            _ratio_text(comparison, "run_pipeline with preprocess_fast over preprocess"), failures, problems
        )
    }


def child_lab02_outputs(namespace, payload, seed, count, transform):
    images, _ = namespace["make_images"](count, seed)
    outputs = torch.stack([namespace[transform](images[i], i) for i in range(count)])
    return None, outputs.detach().to("cpu", torch.float32).contiguous().numpy().tobytes()


def child_lab02_run(namespace, payload, steps, seed, transform):
    losses, correct = namespace["run_pipeline"](steps=steps, seed=seed, transform=namespace[transform])
    return [[float(loss) for loss in losses], int(correct)], b""


# Lab 06: the learner's compiled training step against the course's eager one, from the same fresh weights and data.
LAB06_MACHINERY = ["colab_setup", "setup", "planted", "training"]
LAB06_ANSWERS = ["fixed_block", "compiled_training_step"]
LAB06_STEPS = 8


def _lab06_setup(children) -> float:
    children[0].call("lab06_setup", compiled=False)
    children[1].call("lab06_setup", compiled=True, timeout_s=600)
    return children[0].call("lab06_minimum")[0]


def _lab06_run(child, side, seed):
    child.call("lab06_prepare", seed=seed)
    _, _, seconds = child.call("lab06_steps", steps=LAB06_STEPS)
    return child.call("lab06_state")[0], seconds  # read after the clock: losses and the weights they led to


def _lab06_check(reference, candidate):
    same = (
        isinstance(candidate, dict)
        and set(candidate) == {"losses", "weights"}
        and _same_floats(candidate["losses"], reference["losses"], 1e-4)
        and _close(candidate["weights"], reference["weights"])
    )
    return (
        None
        if same
        else "the compiled step's losses or updated weights differ from the eager step's on the same weights and data"
    )


def grade_lab06(cells: dict, rounds: int = 15) -> dict[str, Verdict]:
    try:
        comparison, failures, problems, minimum = _compare_pair(
            cells,
            LAB06_MACHINERY,
            LAB06_ANSWERS,
            setup=_lab06_setup,
            run=_lab06_run,
            check=_lab06_check,
            labels=("eager step", "compiled step"),
            rounds=rounds,
        )
    except ChildError as error:
        return {"test_compiled_speed": Verdict.refused(str(error))}
    if comparison.speedup < minimum:
        failures.append(f"the compiled step is {comparison.speedup:.2f}x the eager one; at least {minimum}x expected")
    return {
        "test_compiled_speed": Verdict.decide(
            _ratio_text(comparison, f"{LAB06_STEPS} compiled steps over eager ones"), failures, problems
        )
    }


def child_lab06_setup(namespace, payload, compiled):
    block = namespace["make_block"](namespace["FixedBlock"], 0)
    make_step = namespace["compiled_training_step" if compiled else "eager_training_step"]
    namespace["_block"] = block
    namespace["_step"] = make_step(block, torch.optim.SGD(block.parameters(), lr=namespace["LEARNING_RATE"]))
    child_lab06_prepare(namespace, payload, 0)
    child_lab06_steps(namespace, payload, 2)  # warm-up: the compiled side compiles here
    return None, b""


def child_lab06_minimum(namespace, payload):
    return float(namespace["MIN_SPEEDUP"]), b""


def child_lab06_prepare(namespace, payload, seed):
    """Reset the block's weights in place (no recompilation) and draw a batch, from ``seed``."""
    fresh = namespace["make_block"](namespace["FixedBlock"], seed % 1000)
    with torch.no_grad():
        for parameter, value in zip(namespace["_block"].parameters(), fresh.parameters()):
            parameter.copy_(value)
    generator = torch.Generator().manual_seed(seed)
    shape, device = namespace["batch_shape"], namespace["device"]
    namespace["_batch"] = (
        (3 * torch.randn(*shape, generator=generator)).to(device),
        torch.randn(*shape, generator=generator).to(device),
    )
    return None, b""


def child_lab06_steps(namespace, payload, steps):
    namespace["_losses"] = [namespace["_step"](*namespace["_batch"]) for _ in range(steps)]
    synchronize(namespace["device"])
    return None, b""


def child_lab06_state(namespace, payload):
    weights = torch.cat([parameter.detach().flatten() for parameter in namespace["_block"].parameters()])
    return {"losses": [float(loss) for loss in namespace["_losses"]], "weights": weights.cpu().tolist()}, b""
