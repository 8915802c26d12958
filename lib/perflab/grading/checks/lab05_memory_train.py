"""Lab 05's training check: the learner's ``train`` run, stopped and resumed, crashed in an optimizer step and
halfway through a save, and handed a checkpoint holding code, on runs drawn for each grading.

    >>> from perflab.grading.checks.lab05_memory_train import train_case
    >>> train_case(seed=3)  # (run seed, sequences a batch, the plan, of 4 steps: the one that crashes, the save that does)
    (243, 6, 3, 2, 2, 3)

A crash is an exception (:class:`Crash`) raised where the process would die: as the drawn optimizer
step starts (before it changes a weight), or after half of the drawn save's bytes are written. The run resumed from its checkpoint must
end where the uninterrupted run ends, step for step.

Used by perflab.grading.checks.lab05_memory.
"""

from __future__ import annotations

import contextlib
import io
import random
import tempfile
import unittest.mock
from pathlib import Path

import torch

from perflab.grading.checked import differences, raised

__all__ = ["CLOSE", "Crash", "decide_train", "drawn_runs", "expected_train", "probe_train", "train_case"]

CLOSE = {"atol": 1e-6, "rtol": 1e-5}  # the notebook's torch.allclose(..., atol=1e-6)
CODE_RAN = "CODE FROM THE CHECKPOINT RAN"


@contextlib.contextmanager
def drawn_runs(namespace: dict, seed: int, sequences: int):
    """Every ``new_run`` (the lab's runs, the plain loop's) seeded ``seed`` further on, its batches ``sequences``."""
    new_run, batch = namespace["new_run"], namespace["BATCH"]
    namespace["new_run"], namespace["BATCH"] = lambda run_seed=0: new_run(run_seed + seed), sequences
    try:
        yield
    finally:
        namespace["new_run"], namespace["BATCH"] = new_run, batch


def train_case(seed: int) -> tuple[int, int, int, int, int, int]:
    """(run seed, sequences a batch, the plan's blocks checkpointed and micro-batches, of 4 steps the one whose
    optimizer step crashes, the one whose save does)."""
    draw = random.Random(seed)
    return draw.randrange(1000), draw.randint(4, 6), draw.randint(1, 3), draw.randint(2, 4), *draw.choices((2, 3), k=2)


class Crash(Exception):
    """The process dying, in the grader's crash tests."""


def _killed_at_call(number: int, original, halfway: bool = False):
    """``original``, except that its ``number``-th call (counting from 1) dies: as it starts, or (a ``torch.save``)
    halfway through writing its file."""
    calls = []

    def replacement(*args, **kwargs):
        calls.append(None)
        if len(calls) == number and halfway:
            written = io.BytesIO()
            original(args[0], written)
            file, half = args[1], written.getvalue()[: len(written.getvalue()) // 2]
            Path(file).write_bytes(half) if isinstance(file, (str, Path)) else file.write(half)
        if len(calls) == number:
            raise Crash("the process was killed" + " halfway through writing a checkpoint" * halfway)
        return original(*args, **kwargs)

    return replacement


class _CodeInside:
    def __reduce__(self):  # unpickling this calls print: code that runs when the file is opened
        return (print, (CODE_RAN,))


def _weights(model) -> list[torch.Tensor]:
    return [parameter.detach() for parameter in model.parameters()]


def _crashed_and_resumed(train, plan, crash) -> dict:
    """A run of 4 steps killed by ``crash``, resumed from its checkpoint, then called once more when finished."""
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "run.pt"
        with crash:
            died = raised(lambda: train(plan, 4, path))
        (model, losses), (finished, no_losses) = train(plan, 4, path), train(plan, 4, path)
    return {
        "died of": died,
        "losses": losses,
        "weights": _weights(model),
        "then": no_losses,
        "at last": _weights(finished),
    }


def probe_train(namespace: dict, seed: int) -> dict:
    train, naive = namespace["train"], namespace["NAIVE"]
    run_seed, sequences, checkpointed, micro_batches, dying_step, dying_save = train_case(seed)
    plan = namespace["Plan"](checkpointed=checkpointed, micro_batches=micro_batches)
    with drawn_runs(namespace, run_seed, sequences), tempfile.TemporaryDirectory() as folder:
        model, losses = train(naive, 4)
        path, poisoned = Path(folder) / "run.pt", Path(folder) / "poisoned.pt"
        (_, first), saved, (resumed, rest) = train(naive, 2, path), path.exists(), train(naive, 4, path)
        plan_model, plan_losses = train(plan, 4)
        step, save = torch.optim.AdamW.step, torch.save
        crashes = {
            f"a crash in optimizer step {dying_step}": unittest.mock.patch.object(
                torch.optim.AdamW, "step", _killed_at_call(dying_step, step)
            ),
            f"a crash halfway through save {dying_save}": unittest.mock.patch(
                "torch.save", _killed_at_call(dying_save, save, halfway=True)
            ),
        }
        crashed = {name: _crashed_and_resumed(train, plan, crash) for name, crash in crashes.items()}
        train(naive, 1, poisoned)
        save([torch.load(poisoned, weights_only=True), _CodeInside()], poisoned)
        with contextlib.redirect_stdout(io.StringIO()) as printed:
            refusal = raised(lambda: train(naive, 2, poisoned))
    return {
        "plain": {"losses": losses, "weights": _weights(model), "saved": saved, "first 2": first, "last 2": rest},
        "plain resumed": _weights(resumed),
        "plan": {"losses": plan_losses, "weights": _weights(plan_model)},
        "crashes": crashed,
        "poisoned": {"raised": refusal, "printed": printed.getvalue()[-2000:]},
    }


def expected_train(reference: dict, seed: int) -> dict:
    """The course's plain loop, which train(NAIVE, 4) must be: what the learner's runs are compared with besides
    themselves."""
    with drawn_runs(reference, *train_case(seed)[:2]):
        model, losses = reference["train"](reference["NAIVE"], 4)
    return {"losses": losses, "weights": _weights(model)}


def decide_train(got: dict, want: dict, seed: int) -> list[str]:
    plain, plan = got["plain"], got["plan"]
    failures = differences(plain["losses"], want["losses"], what="train(NAIVE, 4): the losses", **CLOSE)
    failures += differences(plain["weights"], want["weights"], what="train(NAIVE, 4): the weights", **CLOSE)
    if not plain["saved"]:
        failures.append("with a path, save the training state there")
    parts = plain["first 2"], plain["last 2"]
    resumed = torch.cat(parts) if all(type(part) is torch.Tensor for part in parts) else list(parts)
    failures += differences(resumed, plain["losses"], what="stopped after 2 steps and resumed to 4, the losses")
    failures += differences(got["plain resumed"], plain["weights"], what="stopped and resumed, the weights")
    for (name, run), last_good in zip(got["crashes"].items(), (step - 1 for step in train_case(seed)[-2:])):
        if run["died of"] != "Crash":
            failures.append(f"{name}: the run never got there (use new_run's optimizer, and save with torch.save)")
        what = f"after {name}, resumed from the last good checkpoint (step {last_good}): the losses of the steps left"
        failures += differences(run["losses"], plan["losses"][last_good:], what=what)
        failures += differences(run["weights"], plan["weights"], what=f"after {name}, the final weights")
        what = f"after {name}, called again when finished: no step left, so the losses"
        failures += differences(run["then"], torch.empty(0), what=what)
        failures += differences(run["at last"], plan["weights"], what=f"after {name}, finished: the weights")
    if CODE_RAN in got["poisoned"]["printed"]:
        failures.append("load with weights_only=True: the checkpoint ran code")
    if got["poisoned"]["raised"] is None:
        failures.append("a checkpoint holding code must be refused")
    return failures
