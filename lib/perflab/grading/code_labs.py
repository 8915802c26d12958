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
on this side's clock, around the request, while the other side is stopped (a round in which the
stopped side gained CPU time does not count). ``child_*`` functions are the child's side of each
request.

Used by perflab.grading.session and perflab.grading.data_lab.
"""

from __future__ import annotations

import math
import random

import torch

from perflab.bench import Comparison, Timing, interleaved_rounds
from perflab.grading.child import AnswerProcess, ChildError, IdleWatch, remember_source, verdict_of
from perflab.grading.verdict import LoadMeter, Verdict, noise_problems, own_cpu_seconds

__all__ = [
    "LAB02_MACHINERY",
    "LAB02_MIN_SPEEDUP",
    "LAB02_TRANSFORMS",
    "LAB06_ANSWERS",
    "LAB06_MACHINERY",
    "LAB06_STEPS",
    "answer_child",
    "child_lab02_outputs",
    "child_lab02_run",
    "child_lab06_setup",
    "child_lab06_steps",
    "grade_lab02",
    "grade_lab06",
    "grader_seeds",
    "measure_until_decided",
    "parameters_of",
    "run_cells",
]

_HANDLERS = __name__
grader_seeds = random.SystemRandom()  # seeds a learner cannot predict, drawn per round


def run_cells(sources: dict[str, str], names: list[str], namespace: dict | None = None) -> dict:
    """Run the course's own cells ``names`` here, in order, in ``namespace``."""
    namespace = {"__name__": "__main__"} if namespace is None else namespace
    for name in names:
        exec(compile(remember_source(sources[name], name), f"<cell {name}>", "exec"), namespace)
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
    The first wrong result ends the rounds: the answer fails whatever its time. Returns what
    :func:`measure_until_decided` takes: (comparison, failures, load, rounds in which the idle side ran).
    """
    seeds = [grader_seeds.randrange(2**31) for _ in range(rounds)]
    failures: list[str] = []
    watch = IdleWatch()

    def run_side(side: int, round_index: int):
        with watch.while_frozen(children[1 - side], round_index):
            return run(children[side], side, seeds[round_index])

    def check_round(_round_index: int, measured: list[list[tuple[object, float]]]) -> bool:
        failure = check(*(side[-1][0] for side in measured))
        if failure:
            failures.append(failure)
        return bool(failure)

    with LoadMeter(ours=lambda: own_cpu_seconds() + sum(child.cpu_seconds() for child in children)) as load:
        measured = interleaved_rounds(
            [lambda round_index, side=side: run_side(side, round_index) for side in (0, 1)],
            rounds,
            warmup=False,  # the children warmed up in setup
            after_round=check_round,
        )
    times = [tuple(seconds for _, seconds in side) for side in measured]
    comparison = Comparison(Timing(labels[0], times[0]), Timing(labels[1], times[1]), confidence=0.9)
    return comparison, failures, load, len(watch.rounds)


def _ratio_text(comparison: Comparison, what: str) -> str:
    try:
        low, high = comparison.interval
    except ValueError:  # too few rounds for an interval: they stopped at a wrong result
        return f"{what}: stopped after {len(comparison.ratios)} round(s), at a result that differs from the reference's"
    return (
        f"{what}: {comparison.speedup:.2f}x median over {len(comparison.ratios)} interleaved rounds "
        f"({comparison.confidence:.0%} CI {low:.2f}x-{high:.2f}x)"
    )


def measure_until_decided(measure_once, rounds: int, threshold: float) -> tuple[Comparison, list[str], list[str]]:
    """Measure; if that leaves open whether the median ratio reaches ``threshold``, once more with twice the rounds.
    Returns (comparison, failures, problems: why the decision is still open, see ``noise_problems``).

    ``measure_once(rounds)`` returns (comparison, failures, load, rounds in which the idle side ran). An idle
    side that ran makes a measurement inconclusive; when it runs again in the second measurement, the answer
    fails: a frozen child runs only when its own processes resume it.
    """
    idle_before = None
    for attempt_rounds in (rounds, 2 * rounds):
        comparison, failures, load, idle_rounds = measure_once(attempt_rounds)
        if failures:  # a wrong result fails however noisy its time
            return comparison, failures, []
        problems = noise_problems(comparison, load, threshold)
        if idle_rounds and idle_before:
            again = f"and during {idle_rounds} of {attempt_rounds} measured again: the answer ran while it was frozen"
            return comparison, [f"{idle_before}, {again}"], []
        if idle_rounds:
            idle_before = f"the idle side ran during {idle_rounds} of {attempt_rounds} rounds"
            problems.append(idle_before)
        if not problems:
            return comparison, failures, []
    return comparison, failures, problems


def _same_floats(a, b, rel_tol: float) -> bool:
    return (
        isinstance(a, list)
        and len(a) == len(b)
        and all(isinstance(x, float) and math.isclose(x, y, rel_tol=rel_tol) for x, y in zip(a, b))
    )


def _close_weights(a: bytes, b: bytes) -> bool:
    """float32 weights, compared as the lab's own test does: within 1e-4 relative and 1e-5 absolute."""
    return (
        len(a) == len(b)
        and len(a) % 4 == 0
        and torch.allclose(*(torch.frombuffer(bytearray(w), dtype=torch.float32) for w in (a, b)), rtol=1e-4, atol=1e-5)
    )


def _compare_pair(
    cells: dict, machinery: list[str], answers: list[str], *, setup, run, check, labels: tuple[str, str], rounds: int
):
    """Start the reference's and the learner's children, ``setup(children)``, then measure them interleaved.

    ``setup`` returns the speedup the answer must reach. Returns (comparison, failures, problems, that speedup);
    raises ``ChildError``.
    """
    children = _pair(cells, machinery, answers)
    try:
        minimum = setup(children)
        measured = measure_until_decided(
            lambda n: _interleaved(children, run, check, rounds=n, labels=labels), rounds, minimum
        )
        return (*measured, minimum)
    finally:
        for child in children:
            child.close()


# Lab 02: preprocess_fast against preprocess, whole pipeline runs of 4 steps on images drawn from a fresh seed.
LAB02_MACHINERY = ["colab_setup", "setup", "pipeline"]
LAB02_TRANSFORMS = ("preprocess", "preprocess_fast")
LAB02_MIN_SPEEDUP = 1.5


def _lab02_setup(children) -> float:
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
    return LAB02_MIN_SPEEDUP


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
        comparison, failures, problems, minimum = _compare_pair(
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
        return {"test_preprocess_speed": verdict_of(error)}
    if comparison.speedup < minimum:
        failures.append(f"the fixed pipeline should be at least {minimum}x faster; it is {comparison.speedup:.2f}x")
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
    minimum = children[0].call("lab06_setup", compiled=False)[0]  # the lab's MIN_SPEEDUP, from the course's cells
    children[1].call("lab06_setup", compiled=True, timeout_s=600)
    return minimum


def _lab06_run(child, side, seed):
    losses, weights, seconds = child.call("lab06_steps", seed=seed, steps=LAB06_STEPS)
    return (losses, weights), seconds


def _lab06_check(reference, candidate):
    (want_losses, want_weights), (losses, weights) = reference, candidate
    if _same_floats(losses, want_losses, 1e-4) and _close_weights(weights, want_weights):
        return None
    return "the compiled step's losses or updated weights differ from the eager step's on the same weights and data"


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
        return {"test_compiled_speed": verdict_of(error)}
    if comparison.speedup < minimum:
        failures.append(f"the compiled step is {comparison.speedup:.2f}x the eager one; at least {minimum}x expected")
    return {
        "test_compiled_speed": Verdict.decide(
            _ratio_text(comparison, f"{LAB06_STEPS} compiled steps over eager ones"), failures, problems
        )
    }


def parameters_of(module: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The module's parameters, in ``parameters()``'s order, read from where nn.Module keeps them: not through
    ``parameters()`` or ``named_parameters()``, which the learner's class may override to finish a step's work."""
    state = vars(module)
    found = [parameter for parameter in dict.values(state["_parameters"]) if parameter is not None]
    for parameter in found:
        if type(parameter) is not torch.nn.Parameter:
            raise TypeError(f"a parameter of the block is a {type(parameter).__name__}, not a torch.nn.Parameter")
    for submodule in dict.values(state["_modules"]):
        found += parameters_of(submodule) if submodule is not None else []
    return list({id(parameter): parameter for parameter in found}.values())  # a shared parameter once


def _loss_values(losses: list) -> list[float]:
    for loss in losses:
        if type(loss) is not torch.Tensor or loss.numel() != 1:
            raise TypeError(
                f"the training step returned a {type(loss).__name__}: it must return its loss as a torch.Tensor "
                "of one element (not a subclass), as eager_training_step does"
            )
    return torch.stack([loss.detach().reshape(()) for loss in losses]).to("cpu", torch.float64).tolist()


def child_lab06_setup(namespace, payload, compiled):
    block = namespace["make_block"](namespace["FixedBlock"], 0)
    make_step = namespace["compiled_training_step" if compiled else "eager_training_step"]
    namespace["_block"] = block
    namespace["_step"] = make_step(block, torch.optim.SGD(parameters_of(block), lr=namespace["LEARNING_RATE"]))
    child_lab06_steps(namespace, payload, seed=0, steps=2)  # warm-up: the compiled side compiles here
    return float(namespace["MIN_SPEEDUP"]), b""


def child_lab06_steps(namespace, payload, seed, steps):
    """One timed round: weights and a batch drawn from ``seed``, ``steps`` steps, then their losses and weights.

    All of it inside the request the grader times: nothing of the learner's runs between a round's data
    and what is read back, so no work can wait for after the clock (a lazy loss, a ``parameters()``
    that finishes the step).
    """
    block = namespace["_block"]
    fresh = namespace["make_block"](namespace["FixedBlock"], seed % 1000)
    with torch.no_grad():  # in place: no recompilation
        for parameter, value in zip(parameters_of(block), parameters_of(fresh), strict=True):
            parameter.copy_(value)
    generator = torch.Generator().manual_seed(seed)
    shape, device = namespace["batch_shape"], namespace["device"]
    inputs = (3 * torch.randn(*shape, generator=generator)).to(device)
    targets = torch.randn(*shape, generator=generator).to(device)
    losses = _loss_values([namespace["_step"](inputs, targets) for _ in range(steps)])
    weights = torch.cat([parameter.detach().reshape(-1) for parameter in parameters_of(block)])
    return losses, weights.to("cpu", torch.float32).numpy().tobytes()
