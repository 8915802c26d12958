"""Every graded cell is decided outside the learner's kernel: the check modules, plain data, one grading end to end."""

from __future__ import annotations

import dataclasses
import math

import nbformat
import pytest
import torch
from perflab.grading import CHECKED_CELLS, DECIDED_OUTSIDE
from perflab.grading.checked import GraderFault, check_module, differences, grade_checked_lab
from perflab.grading.course import LAB_NAMES, REPO
from perflab.grading.nbgrader import _clean
from perflab.grading.plain_data import NotPlainData, decode, encode
from perflab.grading.sandbox import bwrap_works

OWN_GRADERS = {"lab10_flash_triton", "lab11_megatron"}  # their graders start ranks or Triton's interpreter themselves


def _source(lab: str) -> nbformat.NotebookNode:
    return nbformat.read(REPO / "solutions" / lab / f"{lab}.ipynb", as_version=4)


def _nbgrader(cell) -> dict:
    return cell.metadata.get("nbgrader", {})


@pytest.mark.parametrize("lab", LAB_NAMES)
def test_every_autograded_cell_is_decided_outside_the_kernel(lab):
    graded = [
        _nbgrader(c)["grade_id"] for c in _source(lab).cells if c.cell_type == "code" and _nbgrader(c).get("grade")
    ]
    assert graded and sorted(graded) == sorted(DECIDED_OUTSIDE[lab])


@pytest.mark.parametrize("lab", sorted(set(CHECKED_CELLS) - OWN_GRADERS))
def test_a_check_module_decides_each_checked_cell_from_the_lab_s_own_cells(lab):
    module = check_module(lab)
    assert module is not None, f"perflab.grading.checks.{lab} is missing"
    assert sorted(module.CHECKS) == sorted(CHECKED_CELLS[lab])
    cells = {_nbgrader(c).get("grade_id"): c for c in _source(lab).cells if c.cell_type == "code"}
    assert set(module.CELLS) <= set(cells), "CELLS names cells the lab does not have"
    answers = {name for name in module.CELLS if _nbgrader(cells[name]).get("solution")}
    assert answers == set(module.ANSWERS), "ANSWERS must be exactly the answer cells among CELLS"
    order = [name for name in cells if name in module.CELLS]
    assert list(module.CELLS) == order, "CELLS run in the notebook's order"
    for name, check in module.CHECKS.items():
        assert set(check.needs) <= set(module.ANSWERS), f"{name} needs a cell that is not an answer"


def test_plain_data_crosses_whole_and_nothing_else_does():
    value = {"weights": [torch.randn(3, 2).bfloat16(), torch.arange(4)], "ok": True, "loss": math.inf, "none": None}
    back = decode(*encode(value))
    assert torch.equal(back["weights"][0], value["weights"][0]) and torch.equal(back["weights"][1], value["weights"][1])
    assert back["ok"] is True and back["loss"] == math.inf and back["none"] is None

    class Equal(str):
        def __eq__(self, other):
            return True

    for refused in (Equal("x"), {1: "a"}, object(), torch.randn(2).to_sparse(), [[[]]] * 1 + [lambda: 0]):
        with pytest.raises(NotPlainData):
            encode(refused)
    header, payload = encode(torch.ones(4))
    for forged in (
        {**header, "bytes": 8},  # fewer bytes than the shape needs
        {**header, "at": len(payload)},  # outside the payload
        {**header, "tensor": "complex64"},
        {"dict": {"a": 1}, "tensor": "float32"},  # a dict disguised
        {"float": "1e999"},
    ):
        with pytest.raises(NotPlainData):
            decode(forged, payload)


def test_differences_compare_types_shapes_and_values():
    assert differences({"a": 1, "b": [1.0, "x"]}, {"a": 1, "b": [1.0 + 1e-9, "x"]}, atol=1e-6) == []
    assert differences(1.0, 1, what="n") == []  # int and float compare as numbers
    assert differences(True, 1, what="flag") == ["flag: a bool, expected a int"]
    assert differences(torch.ones(2, 2), torch.ones(4), what="t")[0].startswith("t: a torch.float32 tensor of shape")
    assert differences(torch.tensor([math.nan]), torch.tensor([math.nan])) == []
    assert differences(torch.tensor([math.inf]), torch.tensor([1.0]), atol=1.0)  # an infinity where a number is due


@pytest.mark.skipif(not bwrap_works(), reason="the sandbox needs bubblewrap (apt-get install bubblewrap)")
def test_a_checked_lab_grades_each_cell_from_what_the_learner_s_code_returns():
    """Lab 01 in one sandboxed child: a right answer passes, a wrong one fails, an answer equal to anything cannot
    cross as data, and a cell that raises fails only the checks that need it."""
    lab = "lab01_timing"
    source = _source(lab)
    course = {_nbgrader(c)["grade_id"]: _clean(c.source) for c in source.cells if "grade_id" in _nbgrader(c)}
    learner = {name: course[name] for name in check_module(lab).ANSWERS}
    learner["summarize"] = "def summarize(times):\n    return {'median': 3.0, 'iqr': 1.0, 'p95': 4.0}\n"
    learner["hidden_syncs"] = (
        "class Anything(set):\n    def __eq__(self, other):\n        return True\nHIDDEN_SYNCS = Anything('fgi')\n"
    )
    learner["train_fixed"] = "raise RuntimeError('not today')"
    verdicts = grade_checked_lab(lab, {"course": course, "learner": learner})
    assert verdicts["test_time_it"].passed, verdicts["test_time_it"]
    assert verdicts["test_summarize"].status == "fail" and "expected" in str(verdicts["test_summarize"])
    assert verdicts["test_hidden_syncs"].status == "fail"
    assert "RuntimeError: not today" in str(verdicts["test_train_fixed"])


def test_a_result_of_another_form_than_the_course_s_fails_its_check_and_the_grading_goes_on(monkeypatch):
    """Lab 01 with a time_it that times nothing: its empty lists fail the check, and a decision that cannot read what
    it was handed (here: one that indexes past the end) fails that check too, never the grading."""
    lab = "lab01_timing"
    source = _source(lab)
    course = {_nbgrader(c)["grade_id"]: _clean(c.source) for c in source.cells if "grade_id" in _nbgrader(c)}
    learner = {name: course[name] for name in check_module(lab).ANSWERS}
    learner["time_it"] = "def time_it(fn, sync, warmup=1, repeats=5):\n    return []\n"
    summarize = check_module(lab).CHECKS["test_summarize"]
    monkeypatch.setitem(
        check_module(lab).CHECKS,
        "test_summarize",
        dataclasses.replace(summarize, decide=lambda got, want, seed: [got["summaries"][99]]),
    )
    verdicts = grade_checked_lab(lab, {"course": course, "learner": learner})
    assert verdicts["test_time_it"].status == "fail" and "leaked" in str(verdicts["test_time_it"])
    assert verdicts["test_summarize"].status == "fail" and "IndexError" in str(verdicts["test_summarize"])
    assert verdicts["test_train_fixed"].passed, verdicts["test_train_fixed"]


def test_a_check_whose_own_side_failed_is_a_failed_grading_not_a_wrong_answer(monkeypatch):
    """A decision that finds the course's side unmeasured raises GraderFault: "grading failed", graded again."""
    lab = "lab01_timing"
    source = _source(lab)
    course = {_nbgrader(c)["grade_id"]: _clean(c.source) for c in source.cells if "grade_id" in _nbgrader(c)}
    learner = {name: course[name] for name in check_module(lab).ANSWERS}
    summarize = check_module(lab).CHECKS["test_summarize"]

    def unmeasured(got, want, seed):
        raise GraderFault("the reference could not be measured")

    monkeypatch.setitem(check_module(lab).CHECKS, "test_summarize", dataclasses.replace(summarize, decide=unmeasured))
    verdicts = grade_checked_lab(lab, {"course": course, "learner": learner})
    assert verdicts["test_summarize"].status == "error", verdicts["test_summarize"]
    assert "the reference could not be measured" in str(verdicts["test_summarize"])
    assert verdicts["test_time_it"].passed, verdicts["test_time_it"]
