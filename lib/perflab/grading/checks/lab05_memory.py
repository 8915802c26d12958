"""Lab 05 (memory), decided outside the learner's kernel: its functions called on the grader's inputs.

    >>> from perflab.grading.checks.lab05_memory import CHECKS, accumulation_cases, budget_fractions
    >>> sorted(CHECKS)
    ['test_accumulate_gradients', 'test_choose_plan', 'test_forward_checkpointing', 'test_train']
    >>> accumulation_cases(seed=3)  # (model seed, sequences, [(micro-batches, blocks checkpointed)])
    (937, 6, [(2, 0), (4, 0), (4, 2), (5, 4), (6, 1)])
    >>> [round(fraction, 3) for fraction in budget_fractions(seed=3)]  # of the plain loop's peak: 30%, drawn, too small
    [0.3, 0.378, 0.1]

Every draw comes from the grading's seed, so that no answer can be fitted to the inputs. Memory is
counted op by op (``perflab.memory``), the same on every run: the learner's peaks must show what
the lab asks (each checkpointed block needs less) and lie within ``MEMORY_RTOL`` of the course's.

Used by perflab.grading.checks.
"""

from __future__ import annotations

import functools
import random

import torch

from perflab.grading.checked import Check, differences
from perflab.grading.checks.lab05_memory_train import (
    CLOSE,
    decide_train,
    drawn_runs,
    expected_train,
    probe_train,
    train_case,
)

__all__ = ["ANSWERS", "CELLS", "CHECKS", "accumulation_cases", "budget_fractions", "forward_case"]

CELLS = ("colab_setup", "setup", "problem", "forward_checkpointing", "accumulate_gradients", "train", "plan_peak")
CELLS += ("choose_plan",)
ANSWERS = ("forward_checkpointing", "accumulate_gradients", "train", "choose_plan")
GRADIENT_RTOL = 1e-5  # |gradients - the whole batch's| / |the whole batch's|, as the notebook allows
MEMORY_RTOL = 0.1  # a peak within 10% of the course's: the same tensors kept, whatever the code's details
CURVE_TOLERANCE = 1e-4  # the notebook's TOLERANCE: the largest |loss - plain loss| at any step


def forward_case(seed: int) -> tuple[int, int, int]:
    """(model seed, blocks, sequences of 128 tokens) of the model and batch a forward pass is checked on."""
    draw = random.Random(seed)
    return draw.randrange(1000), draw.randint(3, 5), draw.randint(2, 4)


def _gradients(model) -> torch.Tensor:
    return torch.cat([parameter.grad.flatten() for parameter in model.parameters()])


def _loss_facts(loss) -> dict:
    return {"a tensor": isinstance(loss, torch.Tensor), "dims": loss.dim(), "requires grad": loss.requires_grad}


def _autograd_gradients(forward_checkpointing, model, idx, targets, checkpointed) -> torch.Tensor | str:
    """The gradients by torch.autograd.grad (which the reentrant checkpoint refuses), or the name of what it raised."""
    try:
        gradients = torch.autograd.grad(forward_checkpointing(model, idx, targets, checkpointed), [*model.parameters()])
    except Exception as error:  # noqa: BLE001 - which exception is the answer
        return type(error).__name__
    return torch.cat([gradient.flatten() for gradient in gradients])


def _probe_forward_checkpointing(namespace: dict, seed: int, by_autograd: bool = True) -> list[dict]:
    forward, run_peak, saved_tensors = (
        namespace[name] for name in ("forward_checkpointing", "run_peak", "saved_tensors")
    )
    model_seed, blocks, sequences = forward_case(seed)
    torch.manual_seed(model_seed)
    model = namespace["GPT"](namespace["GPTConfig"](**{**vars(namespace["CONFIG"]), "n_layer": blocks}))
    batch = namespace["get_batch"](namespace["corpus"].train, sequences, 128, torch.Generator().manual_seed(seed))
    runs = []
    for checkpointed in range(blocks + 1):
        with saved_tensors() as saved:
            loss = forward(model, *batch, checkpointed)
        run = {**_loss_facts(loss), "loss": loss.detach(), "kept": saved.bytes}
        del loss
        model.zero_grad(set_to_none=True)
        run["peak"] = run_peak(lambda: forward(model, *batch, checkpointed).backward())  # noqa: B023 - called here
        run["backward"] = _gradients(model)
        if by_autograd:  # compared with the course's gradients by backward
            run["autograd.grad"] = _autograd_gradients(forward, model, *batch, checkpointed)
        runs.append(run)
    return runs


def _falls(values: list) -> bool:
    return all(later < earlier for earlier, later in zip(values, values[1:]))


def _memory_differences(got: list, want: list, what: str) -> list[str]:
    return differences([float(n) for n in got], [float(n) for n in want], what=what, rtol=MEMORY_RTOL)


def _decide_forward_checkpointing(got: list, want: list, seed: int) -> list[str]:
    failures = []
    for checkpointed, (run, expected) in enumerate(zip(got, want)):
        where = f"{checkpointed} of {len(got) - 1} blocks checkpointed"
        if not (run["a tensor"] and run["dims"] == 0 and run["requires grad"]):
            failures.append(f"{where}: return the mean loss as a 0-dim tensor with its graph")
        failures += differences(run["loss"], expected["loss"], what=f"{where}: the loss", **CLOSE)
        failures += differences(run["backward"], expected["backward"], what=f"{where}: the gradients", **CLOSE)
        if isinstance(run["autograd.grad"], str):
            failures.append(f"{where}: torch.autograd.grad raised {run['autograd.grad']} (use_reentrant=False)")
        else:
            what = f"{where}: the gradients by torch.autograd.grad"
            failures += differences(run["autograd.grad"], expected["backward"], what=what, **CLOSE)
    peaks, kept = [run["peak"] for run in got], [run["kept"] for run in got]
    if not (_falls(peaks[:-1]) and peaks[-1] <= peaks[-2] and peaks[-1] < 0.6 * peaks[0]):
        failures.append(f"the peak must fall with each checkpointed block but the last, below 60% at all: {peaks}")
    if not (_falls(kept) and kept[-1] < kept[0] / 3):
        failures.append(f"each checkpointed block must keep less for backward, all of them under a third: {kept}")
    failures += _memory_differences(peaks, [run["peak"] for run in want], "the peaks of forward and backward, bytes")
    return failures + _memory_differences(kept, [run["kept"] for run in want], "the bytes kept for backward")


def accumulation_cases(seed: int) -> tuple[int, int, list[tuple[int, int]]]:
    """(model seed, sequences of 64 tokens, [(micro-batches, blocks checkpointed)]): pieces equal, unequal, of one."""
    draw = random.Random(seed)
    sequences = draw.randint(5, 8)
    uneven = draw.sample([pieces for pieces in range(3, sequences) if sequences % pieces], 2)
    return draw.randrange(1000), sequences, [(2, 0), (uneven[0], 0), (uneven[0], 2), (uneven[1], 4), (sequences, 1)]


def _probe_accumulate_gradients(namespace: dict, seed: int) -> dict:
    accumulate_gradients, run_peak = namespace["accumulate_gradients"], namespace["run_peak"]
    model_seed, sequences, cases = accumulation_cases(seed)
    model, _, batches = namespace["new_run"](model_seed)
    idx, targets = namespace["get_batch"](namespace["corpus"].train, sequences, 64, generator=batches)
    runs = []
    for micro_batches, checkpointed in cases:
        model.zero_grad(set_to_none=True)
        loss = accumulate_gradients(model, idx, targets, micro_batches, checkpointed)
        runs.append({**_loss_facts(loss), "loss": loss.detach(), "gradients": _gradients(model)})
    model.zero_grad(set_to_none=True)
    accumulate_gradients(model, idx, targets, 2)
    accumulate_gradients(model, idx, targets, 2)
    twice, peaks = _gradients(model), []
    for micro_batches in (1, 4):
        model.zero_grad(set_to_none=True)
        peaks.append(run_peak(lambda: accumulate_gradients(model, idx, targets, micro_batches)))  # noqa: B023
    weights = [parameter.detach() for parameter in model.parameters()]
    return {"runs": runs, "twice": twice, "peaks of 1 and 4": peaks, "weights": weights}


def _relative_gap(got, want: torch.Tensor) -> float:
    if type(got) is not torch.Tensor or got.shape != want.shape:
        return float("inf")
    return ((got.double() - want.double()).norm() / want.double().norm()).item()


def _decide_accumulate_gradients(got: dict, want: dict, seed: int) -> list[str]:
    failures = []
    for (micro_batches, checkpointed), run, expected in zip(accumulation_cases(seed)[2], got["runs"], want["runs"]):
        where = f"{micro_batches} micro-batches, {checkpointed} checkpointed"
        if not (run["a tensor"] and run["dims"] == 0 and not run["requires grad"]):
            failures.append(f"{where}: return the mean loss as a detached 0-dim tensor")
        failures += differences(run["loss"], expected["loss"], what=f"{where}: the whole batch's mean loss", **CLOSE)
        gap = _relative_gap(run["gradients"], expected["gradients"])
        if not gap < GRADIENT_RTOL:
            failures.append(f"{where}: the gradients differ by {gap:.1e}; weight each piece by its share")
    if not _relative_gap(got["twice"], want["twice"]) < GRADIENT_RTOL:
        failures.append("called twice, the gradients must add up in .grad: do not zero them inside")
    one, four = got["peaks of 1 and 4"]
    if not four < 0.5 * one:
        failures.append(f"4 micro-batches must need less than half the memory of one: {one:,} and {four:,} bytes")
    failures += _memory_differences([one, four], want["peaks of 1 and 4"], "the peaks of 1 and 4 micro-batches")
    return failures + differences(got["weights"], want["weights"], what="the weights: do not step the optimizer")


def budget_fractions(seed: int) -> list[float]:
    """The budgets of choose_plan, as shares of the plain loop's peak: the notebook's 30%, one drawn, one too small."""
    return [0.3, random.Random(seed).uniform(0.2, 0.95), 0.1]


def _choices(namespace: dict, seed: int) -> list[dict]:
    """The plan chosen for each budget, and the learner's peaks of it and of the two plans of less work."""
    choose_plan, plan_peak, plan_class = namespace["choose_plan"], namespace["plan_peak"], namespace["Plan"]
    choices = []
    for budget in (int(fraction * namespace["NAIVE_PEAK"]) for fraction in budget_fractions(seed)):
        try:
            chosen = choose_plan(budget)
        except Exception as error:  # noqa: BLE001 - which exception is the answer
            choices.append({"budget": budget, "raised": type(error).__name__})
            continue
        fields = (getattr(chosen, "checkpointed", None), getattr(chosen, "micro_batches", None))
        checkpointed, micro_batches = (value if type(value) is int else repr(value)[:80] for value in fields)
        plan = {"a Plan": type(chosen) is plan_class, "checkpointed": checkpointed, "micro_batches": micro_batches}
        peaks = {"the plan": plan_peak(chosen)}
        if plan["a Plan"] and micro_batches > 1:
            peaks["one micro-batch fewer"] = plan_peak(plan_class(namespace["CONFIG"].n_layer, micro_batches - 1))
        if plan["a Plan"] and checkpointed > 0:
            peaks["one checkpointed block fewer"] = plan_peak(plan_class(checkpointed - 1, micro_batches))
        choices.append({"budget": budget, "raised": None, "plan": plan, "peaks": peaks})
    return choices


def _probe_choose_plan(namespace: dict, seed: int) -> dict:
    """The plans chosen, and the loss curve of the notebook budget's plan, on runs drawn for this grading."""
    choices, plan = _choices(namespace, seed), namespace["choose_plan"](namespace["BUDGET"])
    with drawn_runs(namespace, *train_case(seed)[:2]):
        return {"choices": choices, "curve": namespace["train"](plan, namespace["STEPS"])[1]}


def _expected_choose_plan(reference: dict, seed: int) -> dict:
    """The course's plans, and the plain loop's loss curve, which the chosen plan's must follow."""
    choices = _choices(reference, seed)
    with drawn_runs(reference, *train_case(seed)[:2]):
        return {"choices": choices, "curve": reference["naive_run"](reference["STEPS"])}


def _decide_choose_plan(got: dict, want: dict, seed: int) -> list[str]:
    failures = []
    for choice, expected in zip(got["choices"], want["choices"]):
        budget = expected["budget"]
        where = f"choose_plan({budget:,} bytes)"
        failures += differences(choice["budget"], budget, what=f"{where}: the budget")
        if expected["raised"] is not None or choice["raised"] is not None:
            if choice["raised"] != expected["raised"]:
                answer, right = (outcome["raised"] or outcome["plan"] for outcome in (choice, expected))
                failures.append(f"{where}: {answer}, expected {right}")
            continue
        plan, peaks = choice["plan"], choice["peaks"]
        if peaks["the plan"] > budget:
            failures.append(f"{where}: {plan} needs {peaks['the plan']:,} bytes, more than the budget")
        failures += [
            f"{where}: {name}, {peak:,} bytes, fits too"
            for name, peak in peaks.items()
            if name != "the plan" and peak <= budget
        ]
        failures += differences(plan, expected["plan"], what=f"{where}: the plan")
        if plan == expected["plan"]:
            what = f"{where}: the peaks of the plan and of the plans of less work"
            failures += _memory_differences(list(peaks.values()), list(expected["peaks"].values()), what)
    what = "the notebook budget's plan: its loss curve, against the plain loop's"
    return failures + differences(got["curve"], want["curve"], what=what, atol=CURVE_TOLERANCE)


CHECKS = {
    "test_forward_checkpointing": Check(
        "forward_checkpointing on a model and batch drawn for this grading (3 to 5 blocks): for every number of "
        "checkpointed blocks, the loss and gradients (by backward and by torch.autograd.grad) against the course's, "
        "and the peak memory and the bytes kept for backward, falling with each block and near the course's",
        _probe_forward_checkpointing,
        _decide_forward_checkpointing,
        needs=("forward_checkpointing",),
        expected=functools.partial(_probe_forward_checkpointing, by_autograd=False),
    ),
    "test_accumulate_gradients": Check(
        "accumulate_gradients on a batch drawn for this grading, in equal and unequal micro-batches, with and without "
        "checkpointing: the loss and gradients against the whole batch's, gradients that add up, no optimizer step, "
        "and the peak memory of 4 micro-batches under half of one's",
        _probe_accumulate_gradients,
        _decide_accumulate_gradients,
        needs=("accumulate_gradients",),
    ),
    "test_train": Check(
        "train on runs drawn for this grading: the plain loop's losses and weights, a stop and resume, a crash in an "
        "optimizer step and one halfway through a save (steps drawn), each resumed to the uninterrupted run's losses "
        "and weights, and a checkpoint holding code refused",
        probe_train,
        decide_train,
        needs=("train",),
        expected=expected_train,
    ),
    "test_choose_plan": Check(
        "choose_plan on the notebook's budget, one drawn for this grading and one that no plan fits: the course's "
        "plan (the fewest micro-batches, then the fewest checkpointed blocks), fitting by your own measurement, and "
        "the loss curve of the notebook budget's plan against the plain loop's",
        _probe_choose_plan,
        _decide_choose_plan,
        needs=("choose_plan",),
        expected=_expected_choose_plan,
    ),
}
