"""What the grader reads is bounded, checked against the other answers, and fails only its own cell.

All of it is decided before anything is measured: no test here trains or times a configuration.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Callable
from dataclasses import asdict, replace

import nbformat
import perflab.grading.capstone_lab as capstone_lab
import pytest
import torch
from perflab.capstone import refusal
from perflab.grading.answers import (
    FIELD_RANGES,
    HAND_IN_MARKER,
    MAX_DEPTH,
    MAX_INT_DIGITS,
    MAX_LINE_BYTES,
    MAX_NAME_CHARS,
    AnswerError,
    handed_in,
    train_config,
)
from perflab.grading.course import REPO
from perflab.grading.verdict import MAX_TEXT_CHARS, NOT_SCORED, Verdict
from perflab.train import NAIVE, OPTIMIZED, TrainConfig

DATA = replace(NAIVE, name="data", pipeline="cached", log_every=100, python_metrics=False)
BATCH = replace(DATA, name="batch", batch_size=64, channels_last=True)
AMP = replace(BATCH, name="amp", amp_dtype="bfloat16")
CKPT = replace(BATCH, name="ckpt", batch_size=128, checkpoint_blocks=True)


def _data(config: TrainConfig) -> dict:
    return {"TrainConfig": asdict(config)}


def _stdout(text: str) -> list[dict]:
    return [{"output_type": "stream", "name": "stdout", "text": text}]


def _refusal_of(config: TrainConfig) -> str:
    with pytest.raises(AnswerError) as refused:
        train_config(_data(config))
    return str(refused.value)


@pytest.fixture
def nothing_measured(monkeypatch):
    """Grading that fails the test's exact checks if it measures anything: every refusal comes first."""

    def measured(*args, **kwargs):
        raise AssertionError("measured")

    for name in ("measure_speeds", "_grade_amp", "_activation_megabytes", "train"):
        monkeypatch.setattr(capstone_lab, name, measured)
    return lambda handed: capstone_lab.grade_capstone_lab(handed, device=torch.device("cpu"), log=measured)


@pytest.mark.parametrize("field, highest", [(name, highest) for name, (_, highest) in FIELD_RANGES.items()])
def test_a_field_at_its_bound_runs_and_one_over_is_refused_with_the_bound(field, highest):
    at_bound = replace(OPTIMIZED, **{field: highest})
    assert train_config(_data(at_bound)) == at_bound and refusal(at_bound) is None
    message = f"{field}={highest + 1} is over the grader's bound of {highest}"
    over = replace(OPTIMIZED, **{field: highest + 1})
    assert _refusal_of(over) == message
    assert refusal(over) == message, "the learner's own check refuses what the grader refuses, in the same words"


def test_the_issues_4096_workers_are_refused_in_the_learners_check_and_by_the_grader():
    forks_a_lot = replace(OPTIMIZED, num_workers=4096)
    assert refusal(forks_a_lot) == _refusal_of(forks_a_lot) == "num_workers=4096 is over the grader's bound of 16"


def test_a_prefetch_factor_the_dataloader_would_refuse_later_is_refused_now():
    assert _refusal_of(replace(OPTIMIZED, prefetch_factor=0)) == "prefetch_factor=0 is under the grader's bound of 1"
    assert refusal(replace(OPTIMIZED, prefetch_factor=None)) is None  # the DataLoader's own default


def test_a_name_of_200_characters_is_kept_and_201_refused():
    assert refusal(replace(OPTIMIZED, name="n" * MAX_NAME_CHARS)) is None
    assert (
        _refusal_of(replace(OPTIMIZED, name="n" * 201)) == "name is 201 characters long, over the grader's bound of 200"
    )


def test_the_course_own_configurations_are_within_the_bounds():
    notebook = nbformat.read(REPO / "solutions" / "lab12_capstone" / "lab12_capstone.ipynb", as_version=4)
    assignments = [
        line
        for cell in notebook.cells
        if cell.cell_type == "code"
        for line in cell.source.splitlines()
        if re.match(r"\w+_config = replace\(", line)
    ]
    solution = {"replace": replace, "NAIVE": NAIVE}
    for line in assignments:
        exec(line, solution)
    configs = [NAIVE, OPTIMIZED, *(solution[name] for name in ("data_config", "batch_config", "final_config"))]
    configs += [solution["amp_config"], solution["ckpt_config"]]
    assert all(refusal(config) is None and train_config(_data(config)) == config for config in configs)


def _line_of(size: int) -> list[dict]:
    """A valid hand-in line of exactly ``size`` bytes after the marker."""
    empty = json.dumps({"padding": ""})
    return _stdout(HAND_IN_MARKER + json.dumps({"padding": "p" * (size - len(empty))}) + "\n")


def test_a_hand_in_line_over_64_kib_is_refused_before_it_is_parsed():
    assert handed_in(_line_of(MAX_LINE_BYTES))["padding"].startswith("p")
    with pytest.raises(AnswerError) as refused:
        handed_in(_line_of(MAX_LINE_BYTES + 1))
    assert str(refused.value) == "the answer is 65,537 bytes long, over the grader's bound of 65,536 bytes"
    with pytest.raises(AnswerError, match="bytes long, over the grader's bound"):  # not "not valid JSON"
        handed_in(_stdout(HAND_IN_MARKER + "{" * (MAX_LINE_BYTES + 1)))


def test_the_bound_counts_bytes_not_characters():
    line = json.dumps({"name": "é" * 40_000}, ensure_ascii=False)  # 40,012 characters, 80,012 bytes
    with pytest.raises(AnswerError) as refused:
        handed_in(_stdout(HAND_IN_MARKER + line))
    assert str(refused.value) == "the answer is 80,012 bytes long, over the grader's bound of 65,536 bytes"


def _nested(depth: int) -> str:
    """A hand-in ``depth`` containers deep: the answers' dict around lists."""
    return '{"a": ' + "[" * (depth - 1) + "1" + "]" * (depth - 1) + "}"


def test_nesting_deeper_than_8_levels_is_refused():
    assert handed_in(_stdout(HAND_IN_MARKER + _nested(MAX_DEPTH)))["a"] == [[[[[[[1]]]]]]]
    for depth in (MAX_DEPTH + 1, 30_000):  # the second would exhaust the JSON parser's recursion
        with pytest.raises(AnswerError) as refused:
            handed_in(_stdout(HAND_IN_MARKER + _nested(depth)))
        assert str(refused.value) == "the answer is nested deeper than 8 levels"


def test_huge_integers_are_refused_by_their_digits():
    assert handed_in(_stdout(HAND_IN_MARKER + '{"n": ' + "9" * MAX_INT_DIGITS + "}"))["n"] == 10**MAX_INT_DIGITS - 1
    for digits in (MAX_INT_DIGITS + 1, 5_000):  # past 4,300 digits Python itself refuses to convert
        with pytest.raises(AnswerError) as refused:
            handed_in(_stdout(HAND_IN_MARKER + '{"n": -' + "9" * digits + "}"))
        assert str(refused.value) == f"an integer of {digits:,} digits is over the grader's bound of 20 digits"


@pytest.mark.parametrize(
    "change, message",
    [
        ({"lr": 10**400}, "lr must be a finite number, not 1000"),  # past the largest float
        ({"lr": 1e309}, "lr must be a finite number, not inf"),
        ({"batch_size": 10**5000}, "batch_size=<int too large to print> is over the grader's bound of 4096"),
        ({"num_workers": True}, "num_workers must be an int, not True"),
        ({"name": ["x" * 10**6]}, "name must be a string, not ['xxxxxxxxxx"),
        ({1: 2}, "a TrainConfig with other fields (unknown: [1], missing: [])"),
    ],
)
def test_values_past_any_float_or_print_limit_are_refused_in_a_short_message(change, message):
    """Fields handed to train_config directly, not through a hand-in line and its bounds."""
    with pytest.raises(AnswerError) as refused:
        train_config({"TrainConfig": {**asdict(NAIVE), **change}})
    assert str(refused.value).startswith(message) and len(str(refused.value)) < 300


ODD_VALUES = [
    None, True, False, 0, -1, 1e308, -1e308, float("nan"), float("inf"), 10**30, 10**5000, "", "x" * 100_000,
    "\ud800", [], {}, [None], {"": None}, {1: 2}, {None: 1}, {(1, 2): 3}, b"bytes", object(), 2j, (1, 2), {1, 2},
]  # fmt: skip


def _odd_shape(rng: random.Random, depth: int = 0):
    """A random value: an odd leaf, or a list or dict (keys of any type) of more odd shapes."""
    kind = rng.random()
    if depth > 12 or kind < 0.5:
        return rng.choice(ODD_VALUES)
    if kind < 0.75:
        return [_odd_shape(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    keys = [rng.choice(["TrainConfig", "name", "batch_size", 7, None, True]) for _ in range(rng.randint(0, 3))]
    return {key: _odd_shape(rng, depth + 1) for key in keys}


def _json_line(value) -> str | None:
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return None


def _readings_of(shape) -> list[tuple[Callable, object]]:
    """Every way the grader reads answers, with ``shape`` where an answer, or a part of one, goes."""
    fields = asdict(NAIVE)
    readings = [
        (train_config, shape),
        (train_config, {"TrainConfig": shape}),
        *((train_config, {"TrainConfig": {**fields, field: shape}}) for field in fields),
        (handed_in, shape),
        (handed_in, [shape]),
        (handed_in, [{"output_type": "stream", "name": "stdout", "text": shape}]),
    ]
    if (line := _json_line(shape)) is not None:
        readings += [(handed_in, _stdout(HAND_IN_MARKER + line))]
        readings += [(handed_in, _stdout(HAND_IN_MARKER + '{"final_config": ' + line + "}"))]
    return readings


def test_any_shape_of_answer_is_read_or_refused_never_raised():
    rng = random.Random(26)
    for shape in ODD_VALUES + [_odd_shape(rng) for _ in range(400)]:
        for read, answer in _readings_of(shape):
            try:
                read(answer)
            except AnswerError:
                pass  # the learner's failure, in words; anything else fails this test


def test_a_verdict_caps_each_text_whichever_way_it_is_made():
    huge = "r" * 100_000
    for verdict in (Verdict.refused(huge), Verdict("fail", huge, (huge, "short")), Verdict.grading_failed(huge)):
        read_back = Verdict.from_dict(json.loads(json.dumps(verdict.to_dict())))
        assert read_back == verdict
        assert all(len(text) <= MAX_TEXT_CHARS for text in (read_back.measured, *read_back.reasons))
        assert read_back.reasons[0].endswith(" [... 98,040 characters cut]")
    assert Verdict("fail", huge, ("short",)).reasons == ("short",)
    assert len(json.dumps(Verdict("fail", huge, (huge,)).to_dict())) < 2 * MAX_TEXT_CHARS + 100


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"status": "great", "measured": "", "reasons": []}, "a verdict's status is one of pass, fail"),
        ({"status": "pass", "measured": 3.5, "reasons": []}, "a verdict's measured text must be a str, not float"),
        ({"status": "pass", "measured": "", "reasons": "no"}, "a verdict's reasons must be a list, not str"),
        ({"status": "fail", "measured": "", "reasons": [["nested"]]}, "a verdict's reasons must all be str"),
        ({"status": "pass", "measured": ""}, "not a verdict"),
        ({"status": "pass", "measured": "", "reasons": [], "points": 9}, "not a verdict"),
        (["pass", "", []], "not a verdict"),
        (None, "not a verdict"),
    ],
)
def test_from_dict_refuses_what_is_not_a_verdict(fields, message):
    with pytest.raises(ValueError) as refused:
        Verdict.from_dict(fields)
    assert str(refused.value).startswith(message)


def test_a_grading_failure_is_not_scored_and_says_so():
    failed = Verdict.grading_failed("the grading ran past its limit of 1800 s and was killed")
    assert failed == Verdict("error", NOT_SCORED, ("the grading ran past its limit of 1800 s and was killed",))
    assert not failed.passed and Verdict.from_dict(failed.to_dict()) == failed
    assert (
        failed.text().splitlines()[0]
        == "The course's grader failed on this cell: NOT SCORED, and it will be graded again"
    )


def test_a_batch_config_that_differs_between_cells_refuses_both_before_measuring(nothing_measured):
    other_batch = replace(BATCH, lr=0.2)
    verdicts = nothing_measured(
        {
            "test_batch": {"batch_config": _data(BATCH), "data_config": _data(DATA)},
            "test_amp": {
                "amp_config": _data(replace(other_batch, amp_dtype="bfloat16")),
                "batch_config": _data(other_batch),
                "KEEP_AMP": True,
            },
        }
    )
    reason = (
        "batch_config must be one configuration in every cell that hands it in: test_batch and test_amp differ in lr"
    )
    assert verdicts == {"test_batch": Verdict.refused(reason), "test_amp": Verdict.refused(reason)}


def test_a_batch_config_swapped_for_a_part_that_also_breaks_its_own_rule_refuses_every_cell(nothing_measured):
    """tests/attacks.py's "inconsistent": part 4 hands in another batch_config, and an amp_config that changes more than
    the dtype; part 3's cell, right on its own, is refused too, and nothing is measured."""
    other_batch = replace(BATCH, num_workers=2, log_every=1)
    verdicts = nothing_measured(
        {
            "test_batch": {"batch_config": _data(BATCH), "data_config": _data(DATA)},
            "test_amp": {
                "amp_config": _data(replace(other_batch, amp_dtype="bfloat16", log_every=50)),
                "batch_config": _data(other_batch),
                "KEEP_AMP": False,
            },
        }
    )
    assert set(verdicts) == {"test_batch", "test_amp"}
    assert all("batch_config must be one configuration" in verdict.reasons[0] for verdict in verdicts.values())


def test_a_data_config_that_differs_between_cells_refuses_both(nothing_measured):
    verdicts = nothing_measured(
        {
            "test_data": {"data_config": _data(replace(DATA, log_every=50, num_workers=2))},
            "test_batch": {"batch_config": _data(BATCH), "data_config": _data(DATA)},
        }
    )
    reason = (
        "data_config must be one configuration in every cell that hands it in: "
        "test_data and test_batch differ in num_workers, log_every"
    )
    assert verdicts == {"test_data": Verdict.refused(reason), "test_batch": Verdict.refused(reason)}


def test_an_amp_config_may_change_only_the_dtype(nothing_measured):
    handed = {"amp_config": _data(replace(AMP, num_workers=2)), "batch_config": _data(BATCH), "KEEP_AMP": False}
    assert nothing_measured({"test_amp": handed}) == {
        "test_amp": Verdict.refused(
            "amp_config may differ from batch_config only in amp_dtype, but it also changes num_workers"
        )
    }


def test_a_ckpt_config_may_change_only_checkpointing_and_the_batch(nothing_measured):
    handed = {"ckpt_config": _data(replace(CKPT, lr=0.05)), "batch_config": _data(BATCH)}
    assert nothing_measured({"test_ckpt": handed}) == {
        "test_ckpt": Verdict.refused(
            "ckpt_config may differ from batch_config only in checkpoint_blocks and batch_size, but it also changes lr"
        )
    }


def test_names_may_differ_between_cells(monkeypatch):
    stand_in = Verdict("pass", "measured by a stand-in")
    monkeypatch.setattr(capstone_lab, "_grade_amp", lambda *args: stand_in)
    verdicts = capstone_lab.grade_capstone_lab(
        {
            "test_batch": {"batch_config": _data(DATA), "data_config": _data(replace(DATA, name="also data"))},
            "test_amp": {
                "amp_config": _data(replace(DATA, name="amp", amp_dtype="bfloat16")),
                "batch_config": _data(replace(DATA, name="x")),
                "KEEP_AMP": True,
            },
        },
        device=torch.device("cpu"),
    )
    assert verdicts["test_amp"] == stand_in, "the amp cell agrees with test_batch: only its names differ"
    assert verdicts["test_batch"] == Verdict("fail", "not measured", ("batch_config is data_config: nothing changed",))


def test_one_cells_bad_answer_leaves_the_other_cells_verdicts(nothing_measured):
    verdicts = nothing_measured(
        {
            "test_regrade": {"final_config": _data(replace(OPTIMIZED, num_workers=4096))},
            "test_data": {"data_config": _data(NAIVE)},
            "test_amp": {"amp_config": _data(AMP), "batch_config": _data(BATCH), "KEEP_AMP": "yes"},
            "test_ckpt": {
                "ckpt_config": {"TrainConfig": {**asdict(CKPT), "batch_size": 10**7}},
                "batch_config": _data(BATCH),
            },
        }
    )
    assert verdicts == {
        "test_regrade": Verdict.refused("final_config: num_workers=4096 is over the grader's bound of 16"),
        "test_data": Verdict(
            "fail",
            "not measured",
            ("data_config is the naive baseline's own configuration: 1.00x, nothing to measure",),
        ),
        "test_amp": Verdict.refused("KEEP_AMP must be True or False, not 'yes'"),
        "test_ckpt": Verdict.refused("ckpt_config: batch_size=10000000 is over the grader's bound of 4096"),
    }


def _out_of_memory(*args, **kwargs):
    raise RuntimeError("CUDA out of memory. " + "m" * 100_000)


def test_a_cell_whose_grading_crashes_is_not_scored_and_the_others_keep_their_verdicts(monkeypatch):
    stand_in = Verdict("pass", "measured by a stand-in")
    monkeypatch.setattr(capstone_lab, "_grade_amp", lambda *args: stand_in)
    monkeypatch.setattr(capstone_lab, "_activation_megabytes", _out_of_memory)
    verdicts = capstone_lab.grade_capstone_lab(
        {
            "test_ckpt": {"ckpt_config": _data(CKPT), "batch_config": _data(BATCH)},
            "test_amp": {"amp_config": _data(AMP), "batch_config": _data(BATCH), "KEEP_AMP": True},
            "test_data": {"data_config": _data(NAIVE)},
        },
        device=torch.device("cpu"),
    )
    failed = verdicts["test_ckpt"]
    assert failed.status == "error" and failed.measured == NOT_SCORED and not failed.passed
    assert failed.reasons[0].startswith("RuntimeError: CUDA out of memory. mmm") and len(failed.reasons[0]) <= 2000
    assert verdicts["test_amp"] == stand_in
    assert verdicts["test_data"].reasons == (
        "data_config is the naive baseline's own configuration: 1.00x, nothing to measure",
    )


def test_rounds_that_crash_leave_the_cells_timed_in_them_not_scored_and_no_other(monkeypatch):
    monkeypatch.setattr(capstone_lab, "measure_speeds", _out_of_memory)
    monkeypatch.setattr(capstone_lab, "_activation_megabytes", lambda config, device: 100.0 / config.batch_size)
    verdicts = capstone_lab.grade_capstone_lab(
        {
            "test_regrade": {"final_config": _data(replace(BATCH, name="final"))},
            "test_batch": {"batch_config": _data(BATCH), "data_config": _data(DATA)},
            "test_ckpt": {"ckpt_config": _data(CKPT), "batch_config": _data(BATCH)},
        },
        device=torch.device("cpu"),
        log=lambda line: None,
    )
    assert verdicts["test_regrade"] == verdicts["test_batch"]
    assert verdicts["test_batch"].status == "error" and verdicts["test_batch"].reasons[0].startswith("RuntimeError")
    assert verdicts["test_ckpt"] == Verdict.decide(
        "kept for backward: 0.8 MB checkpointed, 1.6 MB for batch_config", []
    )
