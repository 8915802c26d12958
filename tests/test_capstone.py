"""The capstone's grader re-measures a configuration on the course's workload in its own process."""

from __future__ import annotations

import subprocess
import sys
import time
from dataclasses import replace

import nbformat
import perflab.capstone
import perflab.train
import pytest
import torch
from perflab.capstone import COURSE_WORKLOAD, CapstoneBenchmark, CapstoneGrade, grade
from perflab.grading.answers import handed_in, train_config
from perflab.grading.capstone_lab import grade_capstone_lab
from perflab.grading.course import REPO
from perflab.render import Environment
from perflab.train import NAIVE, OPTIMIZED

ENVIRONMENT = Environment(device="cpu", device_name="test CPU", torch="x", threads=2, python="3", date="d", commit="c")


def test_benchmark_prints_each_figure_and_ends_with_the_speedup():
    result = CapstoneBenchmark(
        names=("naive", "optimized", "optimized ceiling"),
        # per-round ratios 4.0, 4.0, 3.33, 4.1, 4.3: their median, 4.00x, is not the ratio of medians, 4.10x
        samples_per_s=(
            (1000.0, 1100.0, 900.0, 1000.0, 1000.0),
            (4000.0, 4400.0, 3000.0, 4100.0, 4300.0),
            (4200.0,) * 5,
        ),
        accuracies=(0.97, 0.96, None),
        environment=ENVIRONMENT,
    )
    text = str(result)
    assert text.splitlines()[-1] == "speedup 4.00x"
    optimized_row = next(line for line in text.splitlines() if line.startswith("optimized "))
    assert optimized_row.split()[1:3] == ["4,100", "4.00x"]  # the table agrees with the last line
    assert "98% of its compute ceiling" in text and "97.0%" in text and "4,200" in text
    assert '"speedup": 4.0' in result.to_json()


def test_bench_command_offers_the_capstone():
    help_text = subprocess.run(
        [sys.executable, "-m", "perflab", "bench", "--help"], capture_output=True, text=True
    ).stdout
    assert "capstone" in help_text and "--json" in help_text


def test_grader_takes_only_a_config():
    with pytest.raises(TypeError, match="TrainConfig"):
        grade({"name": "final", "batch_size": 128})
    with pytest.raises(TypeError):
        grade(OPTIMIZED, replace(COURSE_WORKLOAD, train_per_class=250))  # the course owns the workload


def test_a_patched_clock_and_grader_here_do_not_reach_the_graders_process(monkeypatch):
    """A clock that runs 5x slow makes the baseline look 5x faster here; the grader's process has its own.

    What the grader measures under such a clock, it measures in lab 12's round trip (attack
    ``clock_patched`` in tests/attacks.py); here, that ``grade()`` decides in a fresh process that
    nothing patched in this one reaches.
    """
    real = time.perf_counter
    start = real()
    slow_clock = lambda: start + (real() - start) / 5  # noqa: E731
    monkeypatch.setattr(time, "perf_counter", slow_clock)
    monkeypatch.setattr(perflab.train.time, "perf_counter", slow_clock)
    real_start = real()
    claimed = perflab.train.train(NAIVE, replace(COURSE_WORKLOAD, epochs=1), progress=False, max_steps=20)
    claimed_seconds = claimed.setup_s + claimed.train_s + claimed.eval_s
    assert claimed_seconds < (real() - real_start) / 3, "the patched clock should fool a measurement in this process"
    fake_pass = CapstoneGrade(
        status="pass", reasons=(), speedup=9.9, interval=(9.8, 10.0), baseline_samples_per_s=1.0,
        candidate_samples_per_s=9.9, baseline_accuracy=1.0, candidate_accuracy=1.0, config={}, environment=ENVIRONMENT,
    )  # fmt: skip
    monkeypatch.setattr(perflab.capstone, "measure_submission", lambda *args, **kwargs: fake_pass)

    result = grade(replace(NAIVE, name="the ceiling", pipeline="memory", batch_size=64))
    assert result.status == "fail" and "compute ceiling" in result.reasons[0], result
    assert result.environment.device_name != ENVIRONMENT.device_name, "the verdict comes from the grader's process"


def test_grading_cell_hands_over_the_config_and_nothing_else(capsys):
    """The lab's hidden grading cell, run on a notebook that types its speedup: only final_config reaches the grader."""
    notebook = nbformat.read(REPO / "solutions" / "lab12_capstone" / "lab12_capstone.ipynb", as_version=4)
    grading_cell = next(
        cell.source for cell in notebook.cells if cell.metadata.get("nbgrader", {}).get("grade_id") == "test_regrade"
    )
    namespace = {
        "final_config": replace(NAIVE, name="final"),
        "workload": replace(COURSE_WORKLOAD, image_size=16),
        "speedup": 3.5,
        "MIN_SPEEDUP": 1.0,
        "samples_per_s": 99_999.0,
    }
    exec(grading_cell, namespace)
    answers = handed_in([{"output_type": "stream", "name": "stdout", "text": capsys.readouterr().out}])
    assert list(answers) == ["final_config"] and train_config(answers["final_config"]) == replace(NAIVE, name="final")
    verdict = grade_capstone_lab({"test_regrade": answers}, device=torch.device("cpu"))["test_regrade"]
    assert verdict.status == "fail" and "naive baseline's own configuration" in verdict.reasons[0]
