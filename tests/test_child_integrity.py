"""The child that runs an answer cannot run while it is frozen, nor leave work for after the clock stops."""

from __future__ import annotations

import json
import time
from pathlib import Path

import psutil
import pytest
from attacks import LAZY_COMPILED_TRAINING_STEP, LAZY_FIXED_BLOCK
from perflab.grading.child import AnswerProcess, IdleWatch
from perflab.grading.code_labs import _interleaved, grade_lab06, measure_until_decided
from perflab.grading.course import REPO
from perflab.grading.nbgrader import _clean as clean_source
from perflab.grading.sandbox import SANDBOX_ENV_VAR, bwrap_works
from perflab.grading.verdict import Verdict

# Three processes that resume one another (SIGCONT) as fast as they can and burn CPU in between: stopped one at a
# time, the ones not yet stopped resume the ones already stopped.
SIGCONT_RING = """
import os
import signal


def _resume_one_another(pids_pipe):
    ring = [int(pid) for pid in os.read(pids_pipe, 30).split()]
    while True:
        for pid in ring:
            os.kill(pid, signal.SIGCONT)
        sum(range(1000))


pids_pipe, pids_writer = os.pipe()
ring = []
for _ in range(3):
    pid = os.fork()
    if pid == 0:
        try:
            _resume_one_another(pids_pipe)
        finally:
            os._exit(0)
    ring.append(pid)
for _ in ring:
    os.write(pids_writer, b"".join(b"%10d" % pid for pid in ring))
"""


def _not_stopped(tree: list[psutil.Process]) -> list[str]:
    """Each thread of ``tree`` that is neither stopped nor exited, as 'pid/tid: state'."""
    found = []
    for process in tree:
        for stat in Path(f"/proc/{process.pid}/task").glob("*/stat"):
            state = stat.read_text().rsplit(")", 1)[1].split()[0]
            if state not in "tTZX":
                found.append(f"{process.pid}/{stat.parent.name}: {state}")
    return found


@pytest.mark.parametrize("sandboxed", [True, False], ids=["bubblewrap", "no sandbox"])
def test_a_ring_of_processes_that_resume_one_another_stays_frozen(sandboxed, monkeypatch):
    if sandboxed and not bwrap_works():
        pytest.skip("bubblewrap is missing or cannot create namespaces here")
    monkeypatch.setenv(SANDBOX_ENV_VAR, "1" if sandboxed else "0")
    child = AnswerProcess([("ring", SIGCONT_RING)], handlers="perflab.grading.verdict")
    try:
        root = psutil.Process(child.process.pid)
        tree = [root, *root.children(recursive=True)]
        assert len(tree) >= 4, f"the answer and its three ring processes: {tree}"
        growth = 0.0
        for _ in range(5):  # thawed, the ring runs; frozen, it must stay still
            child.thaw()
            time.sleep(0.1)
            child.freeze()
            assert not _not_stopped(tree), "a process of the answer runs after freeze()"
            before = child.cpu_seconds()
            time.sleep(0.2)
            growth += child.cpu_seconds() - before
            assert not _not_stopped(tree), "a process of the answer was resumed while frozen"
        assert growth < 0.05, f"the frozen ring took {growth:.2f} CPU-s in 1 s"
    finally:
        child.close()


class _FakeChild:
    """A stand-in for a frozen child: its CPU time is a number the test moves."""

    cpu = 0.0

    def cpu_seconds(self) -> float:
        return self.cpu


def _measure(runs_while_frozen) -> tuple[list[str], list[str]]:
    """Interleaved rounds of two fake children, where ``runs_while_frozen(rounds)`` says whether the learner's gains
    CPU time while the reference is timed in a measurement of that many rounds; returns (failures, problems)."""
    children = (_FakeChild(), _FakeChild())

    def measure_once(rounds: int):
        def run(child, side, seed):
            if side == 0 and runs_while_frozen(rounds):
                children[1].cpu += 0.05
            return "same result", 0.02 / (side + 1)  # the learner's twice as fast, every round

        return _interleaved(children, run, lambda reference, candidate: None, rounds=rounds, labels=("a", "b"))

    _, failures, problems = measure_until_decided(measure_once, 15, threshold=1.5)
    return failures, problems


def test_a_side_that_runs_while_frozen_makes_rounds_inconclusive_then_fails():
    failures, problems = _measure(lambda rounds: True)
    again = "and during 30 of 30 measured again: the answer ran while it was frozen"
    assert failures == [f"the idle side ran during 15 of 15 rounds, {again}"] and problems == []
    assert Verdict.decide("2.00x", failures, problems).status == "fail"

    failures, problems = _measure(lambda rounds: rounds == 15)  # once only: the retry decides
    assert failures == [] and not [problem for problem in problems if "idle side" in problem]

    failures, problems = _measure(lambda rounds: False)
    assert failures == [] and not [problem for problem in problems if "idle side" in problem]


def test_a_frozen_child_that_runs_anyway_marks_the_round(monkeypatch):
    if not bwrap_works():
        monkeypatch.setenv(SANDBOX_ENV_VAR, "0")
    burner = "import threading\nthreading.Thread(target=lambda: [None for _ in iter(int, 1)], daemon=True).start()\n"
    child = AnswerProcess([("burner", burner)], handlers="perflab.grading.verdict")
    watch = IdleWatch()
    try:
        with watch.while_frozen(child, 0):
            time.sleep(0.2)
        with watch.while_frozen(child, 1):
            child.thaw()  # as a process outside its tree could: the frozen side runs while the other is timed
            time.sleep(0.2)
            child.freeze()
    finally:
        child.close()
    assert watch.rounds == {1}


# tests/attacks.py's lazy lab 06 answer, with an exact torch.Tensor for a loss: a zero that the pending step fills in
# when it finally runs.
LAZY_TENSOR_TRAINING_STEP = """
def compiled_training_step(model, optimizer):
    eager_step = eager_training_step(model, optimizer)

    def step(inputs, targets):
        loss = torch.zeros((), device=inputs.device)
        FixedBlock.pending.append(lambda: loss.copy_(eager_step(inputs, targets)))
        return loss

    return step
"""


def _lab_cells(lab: str, answers: dict[str, str]) -> dict:
    """The cells as nbgrader hands them to the grader: the course's from the source notebook without the solution
    markers, and the learner's answer cells, here the solution's with ``answers`` in place of some."""
    notebook = json.loads((REPO / "solutions" / lab / f"{lab}.ipynb").read_text())
    code = [cell for cell in notebook["cells"] if cell["cell_type"] == "code"]
    course = {cell["metadata"]["nbgrader"]["grade_id"]: clean_source("".join(cell["source"])) for cell in code}
    learner = {
        cell["metadata"]["nbgrader"]["grade_id"]: "".join(cell["source"])
        for cell in code
        if cell["metadata"]["nbgrader"].get("solution")
    }
    return {"course": course, "learner": {**learner, **answers}}


@pytest.mark.parametrize(
    "training_step, reason",
    [
        (
            LAZY_COMPILED_TRAINING_STEP,
            "the training step returned a LazyLoss: it must return its loss as a torch.Tensor",
        ),
        (LAZY_TENSOR_TRAINING_STEP, "losses or updated weights differ from the eager step's"),
    ],
    ids=["a loss object", "a tensor filled in later"],
)
def test_a_training_step_that_leaves_its_work_for_later_fails_lab06(training_step, reason):
    cells = _lab_cells("lab06_compile", {"fixed_block": LAZY_FIXED_BLOCK, "compiled_training_step": training_step})
    start = time.perf_counter()
    verdict = grade_lab06(cells)["test_compiled_speed"]
    print(f"graded in {time.perf_counter() - start:.1f} s: {verdict}")
    assert verdict.status == "fail" and reason in verdict.reasons[0], verdict
