"""perflab.profiling and the pictures drawn from measurements: the trace timeline and the curves."""

from __future__ import annotations

import importlib
import inspect
import json
import re
import sys
from dataclasses import replace
from pathlib import Path

import nbformat
import pytest
import torch
import torch.autograd.profiler_util
import torch.profiler.profiler
from perflab.__main__ import main
from perflab.plots import throughput_curve, trace_timeline
from perflab.profiling import ProfiledRun, Span, profile_training
from perflab.train import NAIVE, OPTIMIZED, Workload, train
from perflab.train_result import PHASES

REPO = Path(__file__).resolve().parents[1]
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


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="sorts by the GPU's clock: needs a CUDA device")
def test_a_gpu_profile_sorts_by_the_device_clock_without_deprecated_names():
    run = profile_training(NAIVE, TINY, steps=2, device="cuda")  # pyproject.toml: a FutureWarning here fails
    rows = run.profiler.key_averages()
    slowest = max(rows, key=lambda row: row.self_device_time_total)
    assert slowest.self_device_time_total > 0
    table = run.table(row_limit=5)
    assert "Self CUDA" in table.splitlines()[1] and f" {slowest.key} " in f" {table.splitlines()[3]} "


def _deprecated_profiler_names() -> set[str]:
    """The profiler attributes torch itself marks deprecated (``@deprecated``: a FutureWarning when used)."""
    names = set()
    for module in (torch.autograd.profiler_util, torch.profiler.profiler):
        for _, cls in inspect.getmembers(module, inspect.isclass):
            for name, value in vars(cls).items():
                function = value.fget if isinstance(value, property) else value
                if getattr(function, "__deprecated__", None):
                    names.add(name)
    return names


def _course_code() -> list[tuple[str, str]]:
    """(where, code) for perflab's modules and every code cell of the lectures and labs' sources."""
    code = [(str(path.relative_to(REPO)), path.read_text()) for path in sorted((REPO / "lib/perflab").rglob("*.py"))]
    for path in sorted([*REPO.glob("lectures/*.ipynb"), *REPO.glob("solutions/*/*.ipynb")]):
        notebook = nbformat.read(path, as_version=4)
        code += [
            (f"{path.relative_to(REPO)}, cell {index}", cell.source)
            for index, cell in enumerate(notebook.cells)
            if cell.cell_type == "code"
        ]
    return code


def test_no_deprecated_profiler_name_in_the_course_code_a_cpu_never_runs():
    # The suite turns a FutureWarning into an error, but only on the code it runs: the GPU branches
    # (self_cuda_time_total and friends, or sort_by="cuda_time_total") never run on a CPU.
    deprecated = _deprecated_profiler_names()
    assert {"self_cuda_time_total", "cuda_time_total", "self_cuda_memory_usage"} <= deprecated  # the scan can see
    pattern = re.compile(r"\b(" + "|".join(sorted(deprecated)) + r")\b")
    found = [f"{where}: {match.group(0)}" for where, code in _course_code() for match in pattern.finditer(code)]
    assert not found, "deprecated torch.profiler names (use the device spellings):\n" + "\n".join(found)
    assert pattern.search('table(sort_by="self_cuda_time_total")') and not pattern.search("self_device_time_total")


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
