"""Lab 06 (compile), decided outside the learner's kernel: its functions called on the grader's blocks and inputs.

    >>> from perflab.grading.checks.lab06_compile import CHECKS, traced_function
    >>> sorted(CHECKS)
    ['test_compiled_step', 'test_fixed_block', 'test_graph_break_lines']
    >>> print(traced_function(seed=3, breaks=2))   # Dynamo's graph breaks planted in a function drawn per grading
    def traced(y):
        y = y - y[y > 0].mean()
        y = torch.tanh(y) * 0.5 + 0.25
        if y.mean() > 0:
            y = y - 1
        y = torch.tanh(y) * 0.5 + 0.25
        return y

The lines Dynamo breaks at are what the course's ``graph_break_lines`` finds in the grader's process;
``FixedBlock`` is compared with the course's ``PlantedBlock``, outputs and gradients, and the compiled
step with the course's eager step, from the same weights and data. The one compilation with Inductor
is the learner's step's (``test_compiled_step``); ``test_compiled_speed`` is the lab's measured
grader's (perflab.grading.code_labs.grade_lab06).

Used by perflab.grading.checks.
"""

from __future__ import annotations

import contextlib
import io
import random

import torch

from perflab.compiling import graph_breaks
from perflab.grading.checked import Check, differences
from perflab.grading.code_labs import parameters_of

__all__ = ["ANSWERS", "CELLS", "CHECKS", "block_cases", "traced_function"]

CELLS = ("colab_setup", "setup", "planted", "graph_break_lines", "fixed_block", "training", "compiled_training_step")
ANSWERS = ("graph_break_lines", "fixed_block", "compiled_training_step")
WIDTH = 256  # the block's width
BREAKS = (
    'print("traced", {k})',
    "y = y * y.sum().item()",
    "if y.mean() > 0:\n        y = y - 1",
    "y = y - y[y > 0].mean()",
)
STEPS = 3


def traced_function(seed: int, breaks: int) -> str:
    """The source of ``traced(y)``: elementwise lines with ``breaks`` graph breaks among them, in an order drawn."""
    draw = random.Random(seed)
    lines = [f"y = torch.tanh(y) * {draw.choice((0.5, 1.25, 2.0))} + {draw.choice((0.25, 0.5))}"] * 2
    for template in draw.sample(BREAKS, breaks):
        lines.insert(draw.randint(0, len(lines)), template.format(k=draw.randint(1, 9)))
    return "def traced(y):\n" + "".join(f"    {line}\n" for line in lines) + "    return y\n"


def _traced(source: str):
    namespace = {"torch": torch}
    exec(compile(source, "<grader's traced function>", "exec"), namespace)
    return namespace["traced"]


def _sample(seed: int, scale: float = 3.0) -> torch.Tensor:
    return scale * torch.randn(
        random.Random(seed).randint(2, 4), 16, WIDTH, generator=torch.Generator().manual_seed(seed)
    )


def _break_lines(namespace: dict, seed: int) -> dict:
    graph_break_lines, device = namespace["graph_break_lines"], namespace["device"]
    sample = _sample(seed).to(device)
    found = {"PlantedBlock": graph_break_lines(namespace["make_block"](namespace["PlantedBlock"], seed % 100), sample)}
    for breaks in (0, random.Random(seed).randint(1, 3)):
        found[f"{breaks} breaks"] = graph_break_lines(_traced(traced_function(seed, breaks)), sample)
    return {name: [line if type(line) is int else repr(line)[:40] for line in lines] for name, lines in found.items()}


def _quietly(function):
    """``function``, its prints (the planted block's, a traced function's) kept from this process's standard output."""

    def quiet(*args):
        with contextlib.redirect_stdout(io.StringIO()):
            return function(*args)

    return quiet


def block_cases(seed: int) -> list[tuple[str, int, torch.Tensor]]:
    """(what, block seed, inputs): inputs that take and skip each of PlantedBlock's branches, on two blocks."""
    draw = random.Random(seed)
    generator = torch.Generator().manual_seed(seed)
    shape = (draw.randint(2, 4), 16, WIDTH)
    inputs = {
        "small (within the limit)": draw.uniform(0.3, 0.6) * torch.randn(shape, generator=generator),
        "large, normal (rescaled)": draw.uniform(2.5, 4.0) * torch.randn(shape, generator=generator),
        "large, uniform (rescaled, large spread)": draw.uniform(10, 14)
        * (torch.rand(shape, generator=generator) - 0.5),
    }
    block_seeds = draw.sample(range(1, 1000), 2)
    return [(what, block_seed, x) for what, x in inputs.items() for block_seed in block_seeds]


def _outputs_and_gradients(block, inputs: torch.Tensor) -> dict:
    inputs = inputs.detach().clone().requires_grad_()
    outputs = block(inputs)
    weights = torch.linspace(-1, 1, outputs.shape[-1], device=outputs.device)  # a loss that reaches every output
    gradients = torch.autograd.grad((outputs * weights).sum(), [inputs, *parameters_of(block)])
    return {"outputs": outputs.detach().cpu(), "gradients": [gradient.cpu() for gradient in gradients]}


def _blocks(namespace: dict, seed: int, block_class: str) -> dict:
    make_block, device = namespace["make_block"], namespace["device"]
    cls = namespace[block_class]
    results = {
        f"{what}, block seed {block_seed}": _outputs_and_gradients(make_block(cls, block_seed), x.to(device))
        for what, block_seed, x in block_cases(seed)
    }
    sample = _sample(seed).to(device)
    if block_class == "FixedBlock":
        report = graph_breaks(make_block(cls, seed % 100), sample)
        results["graphs and breaks"] = [report.graphs, len(report.breaks)]
        block = torch.compile(make_block(cls, seed % 100), fullgraph=True, backend="eager")  # Dynamo alone: cheap
    else:
        results["graphs and breaks"] = [1, 0]
        block = make_block(cls, seed % 100)
    results["fullgraph=True"] = block(sample).detach().cpu()
    return results


def _decide_fixed_block(got: dict, want: dict, seed: int) -> list[str]:
    failures = []
    if got["graphs and breaks"] != [1, 0]:
        graphs, breaks = got["graphs and breaks"]
        failures.append(f"FixedBlock must be one graph without breaks: Dynamo found {graphs} graphs, {breaks} breaks")
    failures += differences(
        got["fullgraph=True"], want["fullgraph=True"], what="compiled fullgraph", rtol=1e-4, atol=1e-5
    )
    for case in want.keys() - {"graphs and breaks", "fullgraph=True"}:
        failures += differences(
            got[case]["outputs"], want[case]["outputs"], what=f"{case}: outputs", rtol=1e-4, atol=1e-5
        )
        if len(got[case]["gradients"]) != len(want[case]["gradients"]):
            failures.append(f"{case}: {len(got[case]['gradients']) - 1} parameters, expected PlantedBlock's")
            continue
        names = ["the input", "gain", "shift", "gate"]
        for name, g, w in zip(names, got[case]["gradients"], want[case]["gradients"]):
            tolerance = 1e-6 * w.abs().max().item()
            failures += differences(g, w, what=f"{case}: the gradient of {name}", rtol=1e-4, atol=tolerance)
    return failures


def _step_case(seed: int) -> tuple[int, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    shape = (random.Random(seed).randint(2, 6), 32, WIDTH)
    return seed % 1000, 3 * torch.randn(shape, generator=generator), torch.randn(shape, generator=generator)


def _steps(namespace: dict, seed: int, make_step: str) -> dict:
    make_block, device = namespace["make_block"], namespace["device"]
    block_seed, inputs, targets = _step_case(seed)
    block = make_block(namespace["FixedBlock"], block_seed)
    step = namespace[make_step](block, torch.optim.SGD(parameters_of(block), lr=namespace["LEARNING_RATE"]))
    losses = [step(inputs.to(device), targets.to(device)) for _ in range(STEPS)]
    return {
        "losses": [loss.detach().cpu() if type(loss) is torch.Tensor else repr(loss)[:80] for loss in losses],
        "detached": [type(loss) is torch.Tensor and not loss.requires_grad for loss in losses],
        "weights": [parameter.detach().cpu() for parameter in parameters_of(block)],
    }


@contextlib.contextmanager
def _without_code_generation():
    """``torch.compile`` with the ``aot_eager`` backend unless the answer names one: Dynamo traces, breaks and refuses
    as it would (``fullgraph``), and AOTAutograd splits forward and backward, without Inductor's code generation, which
    costs tens of seconds a grading; the measured cell compiles the answer for real and checks its results."""
    compile_ = torch.compile

    def compile_for_results(model=None, **options):
        options.setdefault("backend", "aot_eager")
        return compile_(model, **options) if model is not None else compile_(**options)

    torch.compile = compile_for_results
    try:
        yield
    finally:
        torch.compile = compile_


def _probe_compiled_step(namespace: dict, seed: int) -> dict:
    with _without_code_generation():
        broken = namespace["make_block"](namespace["PlantedBlock"], seed % 100)
        broken_step = namespace["compiled_training_step"](broken, torch.optim.SGD(parameters_of(broken), lr=0.01))
        sample = _sample(seed).to(namespace["device"])
        try:
            broken_step(sample, torch.zeros_like(sample))
            refused = False
        except torch._dynamo.exc.TorchDynamoException:
            refused = True
        return {**_steps(namespace, seed, "compiled_training_step"), "PlantedBlock refused": refused}


def _decide_compiled_step(got: dict, want: dict, seed: int) -> list[str]:
    failures = differences(got["losses"], want["losses"], what="the losses (0-dim tensors)", rtol=1e-4)
    if not all(got["detached"]):
        failures.append("each step returns its loss as a torch.Tensor, detached")
    failures += differences(
        got["weights"], want["weights"], what=f"the weights after {STEPS} steps", rtol=1e-4, atol=1e-5
    )
    if not got["PlantedBlock refused"]:
        failures.append("compile the model with fullgraph=True: the planted block compiled despite its breaks")
    return failures


CHECKS = {
    "test_graph_break_lines": Check(
        "graph_break_lines on PlantedBlock and on functions drawn for this grading, against the course's",
        _break_lines,
        lambda got, want, seed: differences(got, want, what="the break lines"),
        needs=("graph_break_lines",),
        expected=_quietly(_break_lines),
    ),
    "test_fixed_block": Check(
        "FixedBlock against PlantedBlock, outputs and gradients, on blocks and inputs drawn for this grading that take "
        "and skip each branch; one graph without breaks, also with fullgraph=True",
        lambda namespace, seed: _blocks(namespace, seed, "FixedBlock"),
        _decide_fixed_block,
        needs=("fixed_block",),
        expected=_quietly(lambda reference, seed: _blocks(reference, seed, "PlantedBlock")),
    ),
    "test_compiled_step": Check(
        f"the compiled step against the course's eager one, {STEPS} steps from weights and data drawn for this "
        "grading: losses and weights; PlantedBlock refused by fullgraph=True",
        _probe_compiled_step,
        _decide_compiled_step,
        needs=("fixed_block", "compiled_training_step"),
        expected=lambda reference, seed: {
            **_steps(reference, seed, "eager_training_step"),
            "PlantedBlock refused": True,
        },
    ),
}
