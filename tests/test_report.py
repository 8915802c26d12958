"""perflab.report and perflab.plots: the capstone report from real (tiny) runs, and its pictures."""

from __future__ import annotations

from dataclasses import replace

import pytest
from perflab.report import OptimizationReport
from perflab.train import NAIVE, OPTIMIZED, Workload, train

TINY = Workload(num_classes=3, train_per_class=24, val_per_class=8, image_size=32, epochs=1)


@pytest.fixture(scope="module")
def runs(private_data_cache):
    return [
        train(config, TINY, progress=False)
        for config in (NAIVE, replace(NAIVE, name="cached", pipeline="cached"), OPTIMIZED)
    ]


def test_report_table_has_every_step_and_the_environment(runs):
    report = OptimizationReport(runs)
    assert report.speedup == pytest.approx(runs[-1].samples_per_s / runs[0].samples_per_s)
    text = repr(report)
    for run in runs:
        assert run.name in text and f"{run.samples_per_s:,.0f}" in text
    assert "1.00x" in text and "measured on" in text and runs[0].environment.torch in text
    html = report._repr_html_()
    assert html.count("<tr>") == 1 + len(runs) and "speedup vs baseline" in html


def test_report_needs_a_baseline_and_a_change(runs):
    with pytest.raises(ValueError, match="two or more"):
        OptimizationReport(runs[:1])
    with pytest.raises(TypeError, match="TrainResult"):
        OptimizationReport([runs[0], {"samples_per_s": 1e9}])


def _texts(figure):
    ax = figure.axes[0]
    return ax.get_title(), ax.get_xlabel(), ax.get_ylabel(), [t.get_text() for t in figure.texts]


def test_waterfall_is_titled_labelled_and_sourced(runs):
    figure = OptimizationReport(runs).waterfall()
    title, _, ylabel, captions = _texts(figure)
    assert title and "samples/s" in ylabel and any("measured on" in caption for caption in captions)
    labels = [label.get_text() for label in figure.axes[0].get_xticklabels()]
    assert labels == ["naive", "cached", "optimized", "total"]


def test_timelines_show_both_runs_on_a_time_axis(runs):
    figure = OptimizationReport(runs).timelines(seconds=0.2)
    title, xlabel, _, captions = _texts(figure)
    assert title and "(ms)" in xlabel and any("measured on" in caption for caption in captions)
    assert len(figure.axes[0].get_yticklabels()) == 2
    assert figure.axes[0].get_xlim() == (0, 200)
