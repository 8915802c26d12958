"""perflab.profiling and the pictures drawn from measurements: the trace timeline and the curves."""

from __future__ import annotations

import importlib
import json
import sys
from dataclasses import replace

import pytest
from perflab.__main__ import main
from perflab.plots import throughput_curve, trace_timeline
from perflab.profiling import ProfiledRun, Span, profile_training
from perflab.train import NAIVE, OPTIMIZED, Workload, train
from perflab.train_result import PHASES

TINY = Workload(num_classes=3, train_per_class=24, val_per_class=8, image_size=32, epochs=1)
pytestmark = pytest.mark.usefixtures("private_data_cache")  # conftest.py


@pytest.fixture(scope="module")
def profiled():
    return profile_training(NAIVE, TINY, steps=3)


def test_profile_covers_the_steps_asked_for_with_every_phase(profiled):
    assert len(profiled.result.steps) == 3
    host = [span for span in profiled.phase_spans() if span.row == "host"]
    assert len(host) == 3 * len(PHASES)
    assert {span.name for span in host} == set(PHASES)
    starts = [span.start_s for span in host]
    assert starts == sorted(starts) and starts[0] == 0
    assert "aten::" in profiled.table(row_limit=5)


def test_a_memory_profile_sorts_operators_by_what_they_allocate():
    run = profile_training(NAIVE, TINY, steps=2, profile_memory=True)
    largest = max(run.profiler.key_averages(), key=lambda row: row.self_cpu_memory_usage)
    assert largest.self_cpu_memory_usage > 0
    table = run.table(sort_by="self_cpu_memory_usage", row_limit=5)
    header, first_row = table.splitlines()[1], table.splitlines()[3]
    assert "Self CPU Mem" in header and f" {largest.key} " in f" {first_row} "


def test_trace_exports_for_perfetto(profiled, tmp_path):
    profiled.export(tmp_path / "trace.json")
    events = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    assert {"data_wait", "fwd", "bwd"} <= {event.get("name") for event in events}


def test_trace_timeline_draws_the_trace_and_says_what_a_cpu_lacks(profiled):
    figure = trace_timeline(profiled)
    ax = figure.axes[0]
    assert "naive" in ax.get_title() and "(ms)" in ax.get_xlabel()
    assert [label.get_text() for label in ax.get_yticklabels()][0] == "host (CPU)"
    caption = " ".join(text.get_text() for text in figure.texts)
    assert "measured on" in caption
    if profiled.result.environment.device == "cpu":
        assert "no separate device row" in caption
    assert len(ax.collections) == len(profiled.phase_spans())  # one bar per span


def test_max_steps_stops_early_and_counts_what_ran():
    config = replace(OPTIMIZED, batch_size=16)  # 5 steps an epoch
    result = train(config, replace(TINY, epochs=2), progress=False, max_steps=7)  # stops in the second epoch
    assert len(result.steps) == 7 and result.samples == 4 * 16 + 8 + 2 * 16


def test_throughput_curve_has_one_point_per_run():
    results = [train(replace(OPTIMIZED, batch_size=size), TINY, progress=False) for size in (8, 24)]
    figure = throughput_curve([8, 24], results, knob="batch size")
    ax = figure.axes[0]
    assert ax.get_xlabel() == "batch size" and "samples/s" in ax.get_ylabel() and ax.get_title()
    assert list(ax.lines[0].get_ydata()) == [r.samples_per_s for r in results]


def test_data_command_prepares_the_course_data(monkeypatch, capsys):
    import perflab.data

    calls = []

    def small():
        return perflab.data.images.make_image_folder(
            num_classes=2, train_per_class=2, val_per_class=1, image_size=32, progress=False
        )

    monkeypatch.setattr(perflab.data, "make_image_folder", lambda: calls.append(1) or small())
    assert main(["data"]) == 0
    assert calls == [1] and "ImageFolderSplit" in capsys.readouterr().out


def test_the_old_module_name_still_imports_but_warns(monkeypatch):
    monkeypatch.delitem(sys.modules, "perflab.profile", raising=False)  # a cached module would not warn again
    with pytest.warns(DeprecationWarning, match="perflab.profiling"):
        old = importlib.import_module("perflab.profile")
    assert (old.Span, old.ProfiledRun, old.profile_training) == (Span, ProfiledRun, profile_training)
