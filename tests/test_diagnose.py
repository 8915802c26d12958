"""perflab.diagnose on one planted run of each kind of bottleneck (perflab.planted), each named from its own profile."""

from __future__ import annotations

import html

import pytest
import torch
from perflab.diagnose import KINDS, Diagnosis, diagnose
from perflab.planted import PLANTED_KINDS, planted_run
from perflab.plots import diagnosis_shares
from torch.profiler import profile

pytestmark = pytest.mark.usefixtures("private_data_cache")  # conftest.py


@pytest.fixture(scope="module")
def planted_diagnoses(machine) -> dict[str, Diagnosis]:
    """Each planted run diagnosed once, with the machine alone: a run's shares are timings, and the other tests' load
    (a grading's training loop, a lecture's benchmark) falls on whichever operator was running."""
    with machine.alone():
        return {kind: diagnose(planted_run(kind)) for kind in PLANTED_KINDS}


def test_the_planted_runs_cover_every_kind():
    assert set(PLANTED_KINDS) == set(KINDS.values())
    with pytest.raises(ValueError, match="compute-bound"):
        planted_run("disk-bound")


@pytest.mark.parametrize("kind", PLANTED_KINDS)
def test_each_kind_of_run_is_named_from_its_profile(kind, planted_diagnoses):
    diagnosis = planted_diagnoses[kind]
    assert diagnosis.kind == kind, diagnosis
    assert sum(diagnosis.shares.values()) == pytest.approx(1)
    assert kind in repr(diagnosis) and html.escape(diagnosis.advice) in diagnosis._repr_html_()


def test_a_planted_run_gives_the_thread_count_back():
    threads = torch.get_num_threads()
    planted_run("compute-bound")  # the shortest
    assert torch.get_num_threads() == threads


def test_evidence_names_the_operators_behind_the_shares(planted_diagnoses):
    diagnosis = planted_diagnoses["compute-bound"]
    name, kind, share = diagnosis.operators[0]
    assert "conv" in name and kind == "compute" and 0 < share < diagnosis.shares["compute"] + 1e-9
    assert [s for _, _, s in diagnosis.operators] == sorted((s for _, _, s in diagnosis.operators), reverse=True)


def test_a_profile_without_phases_is_refused_with_what_to_do():
    with profile() as profiler:
        torch.randn(64, 64) @ torch.randn(64, 64)
    with pytest.raises(ValueError, match="record_function"):
        diagnose(profiler)


def test_the_shares_chart_draws_each_run_as_one_labelled_bar(planted_diagnoses):
    diagnoses = {f"planted {kind}": planted_diagnoses[kind] for kind in ("compute-bound", "overhead-bound")}
    figure = diagnosis_shares(diagnoses, caption="measured on a test machine")
    ax = figure.axes[0]
    assert ax.get_title() and "(%)" in ax.get_xlabel()
    labels = [label.get_text() for label in ax.get_yticklabels()]
    assert labels == [f"{name}\ndiagnosed {d.kind}" for name, d in diagnoses.items()]
    bars = [bar for container in ax.containers for bar in container]
    assert len(bars) == 4 * len(diagnoses)  # data, compute, memory, overhead
    for row, diagnosis in enumerate(diagnoses.values()):
        widths = [bar.get_width() for bar in bars if round(bar.get_y() + bar.get_height() / 2) == row]
        assert widths == pytest.approx([100 * share for share in diagnosis.shares.values()])
    assert "measured on a test machine" in " ".join(text.get_text() for text in figure.texts)


def test_the_micro_batches_of_gradient_accumulation_belong_to_the_step_they_end_in():
    from perflab.diagnose import _steps

    accumulating = [
        "data_wait",
        "fwd",
        "bwd",
        "data_wait",
        "fwd",
        "bwd",
        "opt",
        "log",
        "data_wait",
        "fwd",
        "bwd",
        "opt",
    ]
    assert _steps([(i, i, name) for i, name in enumerate(accumulating)]) == [0] * 8 + [1] * 4
    no_update = ["fwd", "bwd", "fwd", "bwd"]  # a profile of forward and backward passes only: each pass a step
    assert _steps([(i, i, name) for i, name in enumerate(no_update)]) == [0, 0, 1, 1]
