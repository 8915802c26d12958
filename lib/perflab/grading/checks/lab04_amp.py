"""Lab 04 (mixed precision), decided outside the learner's kernel: its policy and step run on the grader's draws.

    >>> from perflab.grading.checks.lab04_amp import CHECKS, amp_step_case, overflow_case, precision_cases
    >>> sorted(CHECKS)
    ['test_amp_step', 'test_choose_precision', 'test_clipping', 'test_overflow']
    >>> precision_cases(seed=3)[:2]     # every branch, and two device types drawn among those without a GradScaler
    [('cuda', False, True), ('hpu', False, True)]
    >>> amp_step_case(seed=3)           # (problems of the two 30-step curves, their batch size, one step's problem)
    ([3898, 9709], 112, 6061)
    >>> overflow_case(seed=3)           # a problem, then each batch: clean (None) or an input (row, column) set bad
    (7687, [(inf, 33, 23), None, (nan, 121, 4), None])

Every draw comes from the grading's seed, so that no answer can be fitted to the inputs. The float16 checks run on
``scaler_device`` (where ``torch.amp.GradScaler`` runs), as the notebook's do, and the learner's low-precision curves
and updates are held against the course's float32 ones on ``device``: the same device, but on a device type without a
GradScaler, where float16 runs on the CPU and float32's rounding differs between the two far below the tolerances.

Used by perflab.grading.checks.
"""

from __future__ import annotations

import math
import random

import torch

from perflab.grading.checked import Check, differences

__all__ = ["ANSWERS", "CELLS", "CHECKS", "amp_step_case", "clipping_case", "overflow_case", "precision_cases"]

# The lab's cells a grading needs: `capabilities` defines Capabilities and Precision; the cell that measures this
# machine's capabilities (`measure_capabilities`, seconds of matmul timings) is left out.
CELLS = ("colab_setup", "setup", "capabilities", "choose_precision", "problem", "amp_step")
ANSWERS = ("choose_precision", "amp_step")
TOLERANCE = 0.02  # the notebook's: the largest |loss - float32 loss| a low-precision 30-step curve may show
CURVE_STEPS = 30
LOW_PRECISIONS = ("BFLOAT16", "FLOAT16")
NO_SCALER_DEVICE_TYPES = ("xpu", "hpu", "xla", "mtia", "maia", "privateuseone")


def precision_cases(seed: int) -> list[tuple[str, bool, bool]]:
    """(device type, bf16_fast, fp16_fast) of every Capabilities the grader hands choose_precision, in a drawn order."""
    draw = random.Random(seed)
    device_types = ("cuda", "cpu", "mps", *draw.sample(NO_SCALER_DEVICE_TYPES, 2))
    cases = [
        (device_type, bf16, fp16) for device_type in device_types for bf16 in (False, True) for fp16 in (False, True)
    ]
    draw.shuffle(cases)
    return cases


def _probe_choose_precision(namespace: dict, seed: int) -> list[dict]:
    answers = []
    for device_type, bf16_fast, fp16_fast in precision_cases(seed):
        capabilities = namespace["Capabilities"](device_type, bf16_fast=bf16_fast, fp16_fast=fp16_fast)
        precision = namespace["choose_precision"](capabilities)
        answers.append(
            {
                "a Precision": type(precision) is namespace["Precision"],
                "dtype": str(precision.dtype),
                "use_scaler": precision.use_scaler,
            }
        )
    return answers


def _decide_choose_precision(got: list, want: list, seed: int) -> list[str]:
    return [
        problem
        for (device_type, bf16_fast, fp16_fast), answer, expected in zip(precision_cases(seed), got, want)
        for problem in differences(
            answer, expected, what=f"choose_precision({device_type}, bf16_fast={bf16_fast}, fp16_fast={fp16_fast})"
        )
    ]


def _device(namespace: dict, precision: str) -> torch.device:
    """Where the notebook runs a precision: float16 with its GradScaler on `scaler_device`, the others on `device`."""
    return namespace["scaler_device" if precision == "FLOAT16" else "device"]


def _flat_weights(model) -> torch.Tensor:
    return torch.cat([parameter.detach().reshape(-1).cpu() for parameter in model.parameters()])


def _train(namespace: dict, precision: str, problem_seed: int, steps: int, batch_size: int = 128):
    """The losses of `steps` calls of the learner's amp_step on a fresh problem, and the trained model."""
    on = _device(namespace, precision)
    model, optimizer, batches = namespace["make_problem"](problem_seed, steps, batch_size, on=on)
    scaler, amp_step = namespace["make_scaler"](namespace[precision], on), namespace["amp_step"]
    losses = [amp_step(model, optimizer, scaler, inputs, targets, namespace[precision]) for inputs, targets in batches]
    return losses, model


def amp_step_case(seed: int) -> tuple[list[int], int, int]:
    """(problem seeds of the 30-step curves, their batch size, problem seed of the one-step checks) of a grading."""
    draw = random.Random(seed)
    return [draw.randrange(10_000), draw.randrange(10_000)], draw.randint(96, 160), draw.randrange(10_000)


def _one_step(namespace: dict, precision: str, problem_seed: int) -> dict:
    """What one step shows of autocast (the first layer's output dtype), of the scaler, of the loss and of the master
    weights. Its scaler grows the scale after every good step: that it grew says the step went through the scaler."""
    on = _device(namespace, precision)
    model, optimizer, batches = namespace["make_problem"](problem_seed, 1, on=on)
    seen = []
    model[0].register_forward_hook(lambda module, args, output: seen.append(str(output.dtype)))
    scaler = torch.amp.GradScaler(on.type, enabled=namespace[precision].use_scaler, growth_interval=1)
    loss = namespace["amp_step"](model, optimizer, scaler, *batches[0], namespace[precision])
    return {
        "first layer's output dtypes": seen,
        "scale after the step (grown by a step through the scaler)": scaler.get_scale(),
        "loss": loss,
        "loss requires grad": bool(getattr(loss, "requires_grad", False)),
        "parameter dtypes": [str(parameter.dtype) for parameter in model.parameters()],
        "gradient dtypes": [None if p.grad is None else str(p.grad.dtype) for p in model.parameters()],
    }


def _probe_amp_step(namespace: dict, seed: int) -> dict:
    curve_seeds, batch_size, step_seed = amp_step_case(seed)
    result = {"float32 losses": [], "float32 weights": [], "low-precision curves": {}, "master weight dtypes": {}}
    for curve_seed in curve_seeds:
        losses, model = _train(namespace, "FLOAT32", curve_seed, CURVE_STEPS, batch_size)
        result["float32 losses"].append(losses)
        result["float32 weights"].append(_flat_weights(model))
        for precision in LOW_PRECISIONS:
            losses, model = _train(namespace, precision, curve_seed, CURVE_STEPS, batch_size)
            result["low-precision curves"].setdefault(precision, []).append([float(loss) for loss in losses])
            result["master weight dtypes"].setdefault(precision, []).append([str(p.dtype) for p in model.parameters()])
    result["one step"] = {
        precision: _one_step(namespace, precision, step_seed) for precision in ("FLOAT32",) + LOW_PRECISIONS
    }
    return result


def _decide_amp_step(got: dict, want: dict, seed: int) -> list[str]:
    curve_seeds, batch_size, _ = amp_step_case(seed)
    failures = differences(
        got["float32 losses"], want["float32 losses"], what="float32, a plain training step: the losses", atol=1e-5
    )
    failures += differences(
        got["float32 weights"], want["float32 weights"], what="float32: the trained weights", atol=1e-5
    )
    for index, curve_seed in enumerate(curve_seeds):
        float32_curve = torch.stack(want["float32 losses"][index]).double()
        for precision in LOW_PRECISIONS:
            curve = torch.tensor(got["low-precision curves"][precision][index], dtype=torch.float64)
            gap = (curve - float32_curve).abs().nan_to_num(nan=math.inf).max().item()
            if not gap <= TOLERANCE:
                failures.append(
                    f"{precision} (problem {curve_seed}, batch size {batch_size}): the loss curve strays {gap:.4g} "
                    f"from float32's (tolerance {TOLERANCE})"
                )
    failures += differences(
        got["master weight dtypes"], want["master weight dtypes"], what="the master weights' dtypes"
    )
    failures += differences(got["one step"], want["one step"], what="one step", atol=TOLERANCE)
    return failures


def overflow_case(seed: int) -> tuple[int, list]:
    """(problem seed, and per batch None or (bad value, row, column) of the input set to it): a bad batch first, then
    one more bad one and two clean ones in a drawn order."""
    draw = random.Random(seed)
    bad = [(draw.choice((math.inf, -math.inf, math.nan)), draw.randrange(128), draw.randrange(32)) for _ in range(2)]
    rest = [bad[1], None, None]
    draw.shuffle(rest)
    return draw.randrange(10_000), [bad[0], *rest]


def _probe_overflow(namespace: dict, seed: int) -> dict:
    problem_seed, plan = overflow_case(seed)
    on, float16 = namespace["scaler_device"], namespace["FLOAT16"]
    model, optimizer, batches = namespace["make_problem"](problem_seed, len(plan), on=on)
    scaler = namespace["make_scaler"](float16, on)
    result = {"losses": [], "weights": [_flat_weights(model)], "scales": [scaler.get_scale()], "optimizer states": []}
    for (inputs, targets), bad in zip(batches, plan):
        if bad is not None:
            value, row, column = bad
            inputs = inputs.clone()
            inputs[row, column] = value
        result["losses"].append(float(namespace["amp_step"](model, optimizer, scaler, inputs, targets, float16)))
        result["weights"].append(_flat_weights(model))
        result["scales"].append(scaler.get_scale())
        result["optimizer states"].append(len(optimizer.state))
    return result


def _decide_overflow(got: dict, want: dict, seed: int) -> list[str]:
    failures = []
    for step, bad in enumerate(overflow_case(seed)[1]):
        where = f"step {step + 1}" + (f", an input set to {bad[0]}" if bad else ", a clean batch")
        loss, expected = got["losses"][step], want["losses"][step]
        if math.isfinite(loss) != math.isfinite(expected):
            failures.append(
                f"{where}: the loss is {loss}, expected {'a finite one' if math.isfinite(expected) else 'inf or nan'}"
            )
        elif math.isfinite(expected):
            failures += differences(loss, expected, what=f"{where}: the loss", atol=1e-3)
        before, after = got["weights"][step], got["weights"][step + 1]
        if bad and not torch.equal(before, after):
            failures.append(f"{where}: the step changed the parameters: it must be skipped")
        if not bad and torch.equal(before, after):
            failures.append(f"{where}: the step left the parameters as they were: training must go on")
        failures += differences(after, want["weights"][step + 1], what=f"{where}: the parameters", atol=1e-4)
    failures += differences(
        got["optimizer states"],
        want["optimizer states"],
        what="the optimizer's state entries after each step (a skipped step must not reach optimizer.step())",
    )
    failures += differences(got["scales"], want["scales"], what="the scale before and after each step")
    return failures


def clipping_case(seed: int) -> tuple[int, float]:
    """(problem seed, the clipping norm as a fraction of the first step's true gradient norm) of a grading."""
    draw = random.Random(seed)
    return draw.randrange(10_000), draw.uniform(0.15, 0.6)


def _probe_clipping(namespace: dict, seed: int) -> dict:
    problem_seed, fraction = clipping_case(seed)
    make_problem, make_scaler, amp_step = namespace["make_problem"], namespace["make_scaler"], namespace["amp_step"]
    model, _, batches = make_problem(problem_seed, 1)
    inputs, targets = batches[0]
    torch.nn.functional.cross_entropy(model(inputs), targets).backward()
    max_grad_norm = fraction * torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]).item()

    def update(name: str, max_grad_norm):
        on, precision = _device(namespace, name), namespace[name]
        model, optimizer, batches = make_problem(problem_seed, 1, on=on)
        before = _flat_weights(model)
        amp_step(model, optimizer, make_scaler(precision, on), *batches[0], precision, max_grad_norm=max_grad_norm)
        return _flat_weights(model) - before

    return {
        f"{precision}, {clipped}": update(precision, max_grad_norm if clipped == "clipped" else None)
        for precision in ("FLOAT32", "FLOAT16")
        for clipped in ("clipped", "unclipped")
    }


def _decide_clipping(got: dict, want: dict, seed: int) -> list[str]:
    failures = []
    for clipped in ("clipped", "unclipped"):
        name = f"FLOAT32, {clipped}"
        failures += differences(got[name], want[name], what=f"float32, {clipped}: the update", rtol=1e-3, atol=1e-7)
    clipped, expected = got["FLOAT16, clipped"].double(), want["FLOAT32, clipped"].double()
    ratio = (clipped.norm() / expected.norm()).item()
    if not abs(ratio - 1) < 0.02:
        failures.append(
            f"float16 with a GradScaler, clipped: the update is {ratio:.3g}x float32's: unscale the gradients before "
            "clipping them"
        )
    error = ((clipped - expected).norm() / expected.norm()).item()
    if not error < 0.02:
        failures.append(
            f"float16 with a GradScaler, clipped: the update differs from float32's by {error:.3g} (relative)"
        )
    unclipped = "float16 with a GradScaler, unclipped: the update"
    failures += differences(got["FLOAT16, unclipped"], want["FLOAT32, unclipped"], what=unclipped, rtol=0.05, atol=1e-5)
    return failures


CHECKS = {
    "test_choose_precision": Check(
        "choose_precision on every combination of fast bfloat16 and float16, on the device types with a GradScaler "
        "and two drawn among those without",
        _probe_choose_precision,
        _decide_choose_precision,
        needs=("choose_precision",),
    ),
    "test_amp_step": Check(
        "amp_step on problems drawn for this grading: float32 a plain training step, bfloat16 and float16 with a "
        f"GradScaler within {TOLERANCE} of float32's 30-step loss curve, autocast on only for low precision, float32 "
        "master weights and gradients, the loss a detached float32 0-dim tensor",
        _probe_amp_step,
        _decide_amp_step,
        needs=("amp_step",),
    ),
    "test_overflow": Check(
        "float16 amp_step with a GradScaler on batches with inf or nan at drawn places: those steps skipped (the "
        "parameters and optimizer state untouched, the scale halved), the clean steps trained as the course's",
        _probe_overflow,
        _decide_overflow,
        needs=("amp_step",),
    ),
    "test_clipping": Check(
        "amp_step's max_grad_norm at a drawn fraction of the true gradient norm: float32's update as the course's, "
        "float16 with a GradScaler clipping the unscaled gradients, and nothing clipped without max_grad_norm",
        _probe_clipping,
        _decide_clipping,
        needs=("amp_step",),
    ),
}
