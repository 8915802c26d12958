"""The trusted grader's parts: answers as data, the noise rule, the sandbox and the child it times from outside."""

from __future__ import annotations

import dataclasses
import io
import json
import os
import socket
import subprocess
import sys
import time
from contextlib import redirect_stdout
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import perflab
import psutil
import pytest
import torch
from attacks import LEAK_PROBE
from perflab.bench import Comparison, Timing
from perflab.capstone import measure_submission, refusal
from perflab.grading import hand_in
from perflab.grading.answers import HAND_IN_MARKER, AnswerError, handed_in, train_config
from perflab.grading.child import AnswerProcess, ChildError
from perflab.grading.course import REPO
from perflab.grading.sandbox import (
    RESOURCE_LIMITS,
    bwrap_works,
    granted_paths,
    pristine_perflab,
    sandbox_command,
    trusted_python,
)
from perflab.grading.verdict import INCONCLUSIVE, LoadMeter, Verdict, noise_problems
from perflab.train import NAIVE, OPTIMIZED

needs_bwrap = pytest.mark.skipif(
    not bwrap_works(),
    reason="bubblewrap is missing or cannot create namespaces here (apt-get install bubblewrap; .ci/run installs it)",
)


def _stdout(text: str) -> list[dict]:
    return [{"output_type": "stream", "name": "stdout", "text": text}]


def test_a_config_travels_as_data():
    printed = io.StringIO()
    with redirect_stdout(printed):
        hand_in(final_config=OPTIMIZED, KEEP_AMP=True)
    answers = handed_in(_stdout("some other output\n" + printed.getvalue()))
    assert train_config(answers["final_config"]) == OPTIMIZED and answers["KEEP_AMP"] is True


def test_hand_in_takes_only_data():
    class LyingConfig:
        def __eq__(self, other):
            return True

    with pytest.raises(TypeError, match="final_config must be a TrainConfig"):
        hand_in(final_config=LyingConfig())


@pytest.mark.parametrize(
    "change, message",
    [
        ({"batch_size": True}, "batch_size must be an int"),
        ({"batch_size": 64.0}, "batch_size must be an int"),
        ({"lr": "0.1"}, "lr must be a finite number"),
        ({"pipeline": "gpu"}, "pipeline must be one of"),
        ({"amp_dtype": "float8"}, "amp_dtype"),
        ({"prefetch_factor": 2.5}, "prefetch_factor"),
        ({"channels_last": 1}, "channels_last must be True or False"),
        ({"surprise": 1}, "other fields"),
    ],
)
def test_a_field_of_another_type_is_refused(change, message):
    with pytest.raises(AnswerError, match=message):
        train_config({"TrainConfig": {**dataclasses.asdict(NAIVE), **change}})


@pytest.mark.parametrize(
    "outputs, message",
    [
        ([], "no answer reached the grader"),
        (_stdout(f"{HAND_IN_MARKER}{{}}\n{HAND_IN_MARKER}{{}}\n"), "more than one"),
        (_stdout(HAND_IN_MARKER + '{"lr": NaN}\n'), "NaN is not a number"),
        (_stdout(HAND_IN_MARKER + "[1, 2]\n"), "not a set of named values"),
        ([{"output_type": "stream", "name": "stderr", "text": HAND_IN_MARKER + "{}\n"}], "no answer"),
    ],
)
def test_what_is_not_one_clean_answer_is_refused(outputs, message):
    with pytest.raises(AnswerError, match=message):
        handed_in(outputs)


def test_the_compute_ceiling_is_refused_without_a_measurement():
    ceiling = replace(OPTIMIZED, name="final", pipeline="memory")
    assert refusal(OPTIMIZED) is None and "compute ceiling" in refusal(ceiling)
    start = time.perf_counter()
    result = measure_submission(ceiling)
    assert result.status == "fail" and "compute ceiling" in result.reasons[0] and result.speedup is None
    assert time.perf_counter() - start < 5, "a refusal needs no measurement"


def _comparison(ratios: list[float]) -> Comparison:
    return Comparison(Timing("a", tuple(ratios)), Timing("b", (1.0,) * len(ratios)), confidence=0.9)


def _load(other_cores: float) -> LoadMeter:
    meter = LoadMeter()
    meter.other_cores = other_cores
    return meter


# The rounds on a slow machine: a 3.20x median whose 90% interval, 2.85x-4.14x, is wide but wholly over 2x.
WIDE_ABOVE = [2.85, 3.0, 3.2, 3.5, 4.14]


def test_a_wide_interval_wholly_past_the_threshold_decides_and_reports_the_figure():
    rounds = _comparison(WIDE_ABOVE)
    assert rounds.interval == (2.85, 4.14) and rounds.interval[1] / rounds.interval[0] > 1.3
    assert noise_problems(rounds, _load(0.0), threshold=2.0) == []
    verdict = Verdict.decide("3.20x median (90% CI 2.85x-4.14x)", failures=[], problems=[])
    assert verdict.status == "pass" and "PASS\n3.20x median (90% CI 2.85x-4.14x)" in verdict.text()
    below = _comparison([1.2, 1.4, 1.5, 1.7, 1.9])  # as wide, wholly under 2x: a decided fail
    assert noise_problems(below, _load(0.0), threshold=2.0) == []


def test_an_interval_that_straddles_the_threshold_leaves_the_verdict_open():
    straddling = _comparison([1.8, 1.9, 2.1, 2.2, 2.3])
    problems = noise_problems(straddling, _load(0.0), threshold=2.0)
    assert problems == ["the rounds leave pass or fail open: their 90% CI 1.80x-2.30x straddles the 2x threshold"]
    verdict = Verdict.decide("2.10x", failures=[], problems=problems)
    assert verdict.status == "inconclusive" and verdict.reasons[0] == INCONCLUSIVE and not verdict.passed
    # At its ends: an interval that starts at the threshold decides (every median in it reaches it), one that ends there
    # does not (its median may fall short).
    assert noise_problems(_comparison([2.0, 2.1, 2.2, 2.3, 2.4]), _load(0.0), threshold=2.0) == []
    assert noise_problems(_comparison([1.6, 1.7, 1.8, 1.9, 2.0]), _load(0.0), threshold=2.0) != []


def test_interference_leaves_the_verdict_open_whatever_the_interval():
    steady = _comparison([2.9, 3.0, 3.1, 3.0, 3.2])
    problems = noise_problems(steady, _load(1.0), threshold=2.0)
    assert len(problems) == 1 and "cores busy" in problems[0]
    verdict = Verdict.decide("3.00x", failures=[], problems=problems)
    assert verdict.status == "inconclusive" and verdict.reasons[0] == INCONCLUSIVE
    assert Verdict.decide("1.2x", failures=["too slow"]).status == "fail"
    assert Verdict.from_dict(verdict.to_dict()) == verdict


def _measure_once(ratios_by_rounds: dict[int, list[float]], other_cores: float = 0.0):
    """A stand-in for one measurement of ``rounds`` interleaved rounds, with its calls recorded."""
    calls = []

    def measure_once(rounds: int):
        calls.append(rounds)
        return _comparison(ratios_by_rounds[rounds]), [], _load(other_cores), 0

    return measure_once, calls


def test_a_decided_first_measurement_is_not_measured_again_and_an_open_one_stops_at_its_bound():
    from perflab.grading.code_labs import measure_until_decided

    measure_once, calls = _measure_once({5: WIDE_ABOVE})
    comparison, failures, problems = measure_until_decided(measure_once, 5, threshold=2.0)
    assert calls == [5] and failures == problems == [] and comparison.speedup == 3.2

    open_ratios = {5: [1.8, 1.9, 2.1, 2.2, 2.3], 10: [1.7, 1.8, 1.9, 2.0, 2.0, 2.1, 2.1, 2.2, 2.3, 2.4]}
    measure_once, calls = _measure_once(open_ratios)
    _, failures, problems = measure_until_decided(measure_once, 5, threshold=2.0)
    assert calls == [5, 10], "measured once more with twice the rounds, and no more"
    assert failures == [] and "straddles the 2x threshold" in problems[0]

    measure_once, calls = _measure_once({5: WIDE_ABOVE, 10: WIDE_ABOVE * 2}, other_cores=1.0)
    _, _, problems = measure_until_decided(measure_once, 5, threshold=2.0)
    assert calls == [5, 10] and "cores busy" in problems[0]


def _epochs(ratios: list[float]) -> list[list[SimpleNamespace]]:
    """One-epoch trials of the baseline and a candidate, ``ratios[i]`` times faster in round i."""
    environment = SimpleNamespace(device="cpu", threads=2)
    sides = [[10.0 * ratio for ratio in ratios], [10.0] * len(ratios)]
    return [
        [
            SimpleNamespace(
                train_s=seconds, samples=5000, samples_per_s=5000 / seconds, model_parameters=1, environment=environment
            )
            for seconds in side
        ]
        for side in sides
    ]


@pytest.mark.parametrize(
    "ratios, other_cores, status, measurements",
    [
        (WIDE_ABOVE, 0.0, "pass", 1),  # the rounds: decided at the first measurement
        ([1.8, 1.9, 2.1, 2.2, 2.3], 0.0, "inconclusive", 2),
        ([2.9, 3.0, 3.1, 3.0, 3.2], 1.0, "inconclusive", 2),
    ],
)
def test_lab12s_regrade_decides_when_the_interval_lies_past_2x(monkeypatch, ratios, other_cores, status, measurements):
    import perflab.grading.capstone_lab as capstone_lab

    measured = []

    def measure_speeds(configs, *, rounds, device, log=None, max_steps=None):
        measured.append(rounds)
        return _epochs(ratios * (rounds // len(ratios))), _load(other_cores)

    monkeypatch.setattr(capstone_lab, "measure_speeds", measure_speeds)
    monkeypatch.setattr(capstone_lab, "train", lambda *args, **kwargs: SimpleNamespace(val_accuracy=0.5))
    monkeypatch.setattr(capstone_lab, "baseline_accuracy", lambda *args: 0.5)
    handed = {"test_regrade": {"final_config": {"TrainConfig": dataclasses.asdict(OPTIMIZED)}}}
    verdict = capstone_lab.grade_capstone_lab(handed, device=torch.device("cpu"), log=lambda line: None)["test_regrade"]
    assert verdict.status == status and len(measured) == measurements, verdict
    if status == "pass":
        assert verdict.measured.startswith("final_config over the naive baseline: 3.20x median (90% CI 2.85x-4.14x)")


def test_lab12_measures_again_only_the_configurations_of_the_cells_left_open(monkeypatch):
    import perflab.grading.capstone_lab as capstone_lab

    data = replace(NAIVE, name="data", pipeline="cached")
    batch = replace(data, name="batch", batch_size=64)
    seconds = {  # per round: final_config's ratio is decided above 2x, batch_config's straddles 1.2x
        NAIVE.name: [10.0 * ratio for ratio in WIDE_ABOVE],
        OPTIMIZED.name: [10.0] * 5,
        "data": [12.0] * 5,
        "batch": [12.0 / ratio for ratio in (1.14, 1.17, 1.21, 1.25, 1.28)],
    }
    environment, timed = SimpleNamespace(device="cpu", threads=2), []

    def measure_speeds(configs, *, rounds, device, log=None, max_steps=None):
        timed.append([config.name for config in configs])
        trials = [
            [
                SimpleNamespace(train_s=s, samples=5000, samples_per_s=5000 / s, environment=environment)
                for s in (seconds[config.name] * 2)[:rounds]
            ]
            for config in configs
        ]
        return trials, _load(0.0)

    monkeypatch.setattr(capstone_lab, "measure_speeds", measure_speeds)
    monkeypatch.setattr(capstone_lab, "train", lambda *args, **kwargs: SimpleNamespace(val_accuracy=0.5))
    monkeypatch.setattr(capstone_lab, "baseline_accuracy", lambda *args: 0.5)
    handed = {
        "test_batch": {"batch_config": {"TrainConfig": dataclasses.asdict(batch)}},
        "test_regrade": {"final_config": {"TrainConfig": dataclasses.asdict(OPTIMIZED)}},
    }
    handed["test_batch"]["data_config"] = {"TrainConfig": dataclasses.asdict(data)}
    verdicts = capstone_lab.grade_capstone_lab(handed, device=torch.device("cpu"), log=lambda line: None)
    assert timed == [["data", "batch", NAIVE.name, OPTIMIZED.name], ["data", "batch"]]
    assert verdicts["test_regrade"].status == "pass", "decided in the first measurement, kept"
    assert "3.20x median (90% CI 2.85x-4.14x)" in verdicts["test_regrade"].measured
    assert verdicts["test_batch"].status == "inconclusive" and "straddles the 1.2x" in verdicts["test_batch"].reasons[1]


@pytest.mark.parametrize(
    "ratios, other_cores, status", [(WIDE_ABOVE, 0.0, "pass"), ([1.8, 1.9, 2.1, 2.2, 2.3], 0.0, "inconclusive")]
)
def test_the_learners_own_check_decides_by_the_same_rule(monkeypatch, ratios, other_cores, status):
    import perflab.capstone as capstone

    monkeypatch.setattr(
        capstone,
        "measure_speeds",
        lambda configs, *, rounds, device, log=None: (_epochs(ratios * (rounds // len(ratios))), _load(other_cores)),
    )
    monkeypatch.setattr(capstone, "train", lambda *args, **kwargs: SimpleNamespace(val_accuracy=0.5))
    monkeypatch.setattr(capstone, "baseline_accuracy", lambda *args: 0.5)
    grade = measure_submission(OPTIMIZED, device="cpu")
    assert grade.status == status, grade
    if status == "pass":
        assert grade.interval == pytest.approx(
            (2.85, 4.14)
        ) and "PASS: 3.20x median speedup (90% CI 2.85x-4.14x" in repr(grade)


@pytest.mark.parametrize(
    "ratios, keep_amp, status",
    [
        ([1.3, 1.4, 1.5, 1.6, 1.7], False, "fail"),  # wholly over 1.25x, the margin: it should have been kept
        ([0.8, 0.9, 1.1, 1.3, 1.4], True, "pass"),  # wide, but wholly over 0.75x: keeping it is never clearly wrong
        ([1.2, 1.23, 1.25, 1.28, 1.3], False, "inconclusive"),  # narrow, across 1.25x: leaving it out may be wrong
        ([1.0, 1.1, 1.15, 1.2, 1.24], False, "pass"),  # faster, within the margin: either answer counts
        ([0.5, 0.6, 0.7, 0.8, 0.85], False, "pass"),
    ],
)
def test_lab12s_amp_cell_is_open_only_when_its_interval_straddles_the_margin_its_answer_faces(
    monkeypatch, ratios, keep_amp, status
):
    import perflab.grading.capstone_lab as capstone_lab

    def measure_speeds(configs, *, rounds, device, log=None, max_steps=None):
        return _epochs(ratios * (rounds // len(ratios))), _load(0.0)

    monkeypatch.setattr(capstone_lab, "measure_speeds", measure_speeds)
    batch = replace(NAIVE, name="batch", pipeline="cached", batch_size=64)
    configs = {"amp_config": replace(batch, name="amp", amp_dtype="bfloat16"), "batch_config": batch}
    verdict = capstone_lab._grade_amp(configs, keep_amp, torch.device("cpu"), lambda line: None, 5)
    assert verdict.status == status, verdict


def test_the_load_meter_sees_a_busy_neighbour():
    """Two meters over the same second, one counting the hogs as other processes and one as ours: they differ by the
    hogs' CPU time, whatever else the machine runs meanwhile (the suite's other workers).

    Three hogs, not one: in a CPU quota the suite's other worker shares (``.ci/slowed``, two thirds of a core), one
    hog ran 0.18 cores, too little to tell from the meters' noise; three get about three times that share."""
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(3)]
    try:
        time.sleep(0.3)
        this_process, hog_processes = psutil.Process(), [psutil.Process(hog.pid) for hog in hogs]

        def hogs_seconds() -> float:
            return sum(sum(process.cpu_times()[:2]) for process in hog_processes)

        hogs_before = hogs_seconds()
        with LoadMeter(ours=lambda: sum(this_process.cpu_times()[:2])) as beside_hogs:
            with LoadMeter() as counting_them_as_ours:  # the hogs are our children: their time is ours
                time.sleep(1.0)
        hog_cores = (hogs_seconds() - hogs_before) / 1.0
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()
    assert hog_cores > 0.2, f"the hogs ran {hog_cores:.2f} cores: the machine is too busy to tell"
    seen = beside_hogs.other_cores - counting_them_as_ours.other_cores
    assert abs(seen - hog_cores) < 0.15 + 0.1 * hog_cores, (
        f"the meters saw {seen:.2f} cores of hogs; they ran {hog_cores:.2f}"
    )


def test_the_trusted_python_imports_perflab_from_a_pristine_copy(tmp_path):
    """A shadow ``perflab`` in the current folder or on PYTHONPATH is not what the grader imports."""
    (tmp_path / "perflab").mkdir()
    (tmp_path / "perflab" / "__init__.py").write_text("raise SystemExit('the shadow module was imported')\n")
    command = trusted_python("perflab.grading.answers")
    assert command[1:3] == ["-I", "-S"] and repr(pristine_perflab()) in command[-1]
    run = subprocess.run(
        command, cwd=tmp_path, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(tmp_path)}
    )
    assert run.returncode == 0 and "shadow" not in run.stderr, run.stderr
    copy = Path(pristine_perflab(), "perflab", "capstone.py")
    assert copy.read_text() == Path(perflab.__file__).with_name("capstone.py").read_text()
    assert not copy.stat().st_mode & 0o222, "the pristine copy is read-only"


@needs_bwrap
def test_the_sandbox_starts_from_nothing_and_lets_write_only_its_folder(tmp_path, monkeypatch):
    """Nothing of a course is visible, this repository's included (a course with its .venv inside), even from a
    process started in the course with the course on sys.path (`python -m nbgrader` there)."""
    course = tmp_path / "course"
    workdir = course / "autograded" / "ada" / "lab12_capstone"
    workdir.mkdir(parents=True)
    (course / "solutions").mkdir()
    (course / "solutions" / "answers.txt").write_text("the reference answers")
    (course / "gradebook.db").write_text("grades")
    monkeypatch.chdir(course)
    monkeypatch.setattr(sys, "path", ["", str(course), str(REPO), *sys.path])
    assert not [path for path in granted_paths() if Path(path).is_relative_to(course) or Path(path) == REPO]
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    probe = (
        LEAK_PROBE
        + f"""
import os, resource, socket, sysconfig, subprocess, sys
import perflab
results = {{}}
def attempt(name, action):
    try:
        action()
        results[name] = "done"
    except Exception as error:
        results[name] = type(error).__name__
attempt("read solutions", lambda: open({str(course / "solutions" / "answers.txt")!r}).read())
attempt("list the repository", lambda: os.listdir({str(REPO / "solutions")!r}))
attempt("append to perflab", lambda: open(os.path.join(os.path.dirname(perflab.__file__), "capstone.py"), "a").write("#"))
attempt("write sitecustomize", lambda: open(os.path.join(sysconfig.get_paths()["purelib"], "sitecustomize.py"), "w"))
attempt("write its folder", lambda: open("answer.txt", "w").write("mine"))
attempt("write a file over the size limit", lambda: open("big", "wb").truncate({RESOURCE_LIMITS["fsize"] + 1}))
attempt("resolve localhost and this machine", lambda: [socket.gethostbyname(h) for h in ("localhost", socket.gethostname())])
attempt("connect", lambda: socket.create_connection(("127.0.0.1", {server.getsockname()[1]}), timeout=2))
results["open files"] = resource.getrlimit(resource.RLIMIT_NOFILE)
subprocess.Popen([sys.executable, "-c", "import time\\nwhile True:\\n    open('heartbeat', 'a').write('.')\\n    time.sleep(0.05)"],
                 start_new_session=True)
print(results)
"""
    )
    command = sandbox_command([sys.executable, "-c", probe], workdir=str(workdir))
    run = subprocess.run(command, capture_output=True, text=True, timeout=120)
    server.close()
    assert run.returncode == 0, run.stderr
    assert "leak probe found: []" in run.stdout, run.stdout
    results = eval(run.stdout.strip().splitlines()[-1])  # noqa: S307 - our own probe's dict
    assert results == {
        "read solutions": "FileNotFoundError",
        "list the repository": "FileNotFoundError",
        "append to perflab": "PermissionError",
        "write sitecustomize": "OSError",
        "write its folder": "done",
        "write a file over the size limit": "OSError",
        "resolve localhost and this machine": "done",  # torchrun's rendezvous, on the loopback
        "connect": "ConnectionRefusedError",
        "open files": (RESOURCE_LIMITS["nofile"],) * 2,
    }, results  # the host's listener is not there
    assert (workdir / "answer.txt").read_text() == "mine"
    time.sleep(0.3)
    beats = (workdir / "heartbeat").stat().st_size if (workdir / "heartbeat").exists() else 0
    time.sleep(0.5)
    after = (workdir / "heartbeat").stat().st_size if (workdir / "heartbeat").exists() else 0
    assert after == beats, "a process the sandboxed code started in the background outlived it"


@needs_bwrap
def test_the_trusted_grader_starts_sandboxed_children_too():
    """The grader runs `python -I -S`, which knows the virtualenv only by its executable: its children still run."""
    script = (
        "from perflab.grading.child import AnswerProcess\n"
        "child = AnswerProcess([('answer', 'import torch')], handlers='perflab.grading.code_labs')\n"
        "child.close()\nprint('started')\n"
    )
    command = trusted_python("perflab.grading.child")
    command[-1] = command[-1].split("import runpy")[0] + f"exec({script!r})"
    run = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert run.stdout.strip() == "started", run.stderr[-2000:]


LAB02_LIKE = """
import torch
def make_images(count, seed):
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (count, 3, 4, 4), dtype=torch.uint8, generator=generator), None
def preprocess_fast(image, index):
    return image.float() / 255
"""


@needs_bwrap
def test_the_child_answers_with_data_and_names_the_cell_that_failed():
    child = AnswerProcess([("pipeline", LAB02_LIKE)], handlers="perflab.grading.code_labs")
    try:
        result, payload, seconds = child.call("lab02_outputs", seed=3, count=2, transform="preprocess_fast")
        assert result is None and len(payload) == 2 * 3 * 4 * 4 * 4 and 0 < seconds < 30
        with pytest.raises(ChildError, match="KeyError"):
            child.call("lab02_outputs", seed=3, count=2, transform="preprocess")
    finally:
        child.close()
    with pytest.raises(ChildError, match="running cell 'answer': ValueError: not today"):
        AnswerProcess(
            [("pipeline", LAB02_LIKE), ("answer", "raise ValueError('not today')")],
            handlers="perflab.grading.code_labs",
        )


@needs_bwrap
def test_the_child_is_stopped_between_requests_and_ended_when_it_hangs():
    burner = "import threading\nthreading.Thread(target=lambda: [None for _ in iter(int, 1)], daemon=True).start()\n"
    child = AnswerProcess([("pipeline", LAB02_LIKE + burner)], handlers="perflab.grading.code_labs")
    try:
        before = child.cpu_seconds()
        time.sleep(1.0)
        assert child.cpu_seconds() - before < 0.1, "a thread of the child ran while the child should be stopped"
        child.call("lab02_outputs", seed=1, count=1, transform="preprocess_fast")
    finally:
        child.close()
    hanging = AnswerProcess(
        [("pipeline", LAB02_LIKE.replace("return image.float() / 255", "while True: pass"))],
        handlers="perflab.grading.code_labs",
    )
    try:
        with pytest.raises(ChildError, match="did not answer in time"):
            hanging.call("lab02_outputs", seed=1, count=1, transform="preprocess_fast", timeout_s=2)
    finally:
        hanging.close()


def test_the_grader_reports_the_reason_of_a_failing_job(tmp_path):
    """The session's own entry point, with a job whose answer could not be read: a refusal, not a crash."""
    job = {
        "lab": "lab12_capstone",
        "cells": {"course": {}, "learner": {}},
        "cache_dir": str(tmp_path),
        "handed_in": {
            "test_regrade": {"error": "no answer reached the grader"},
            "test_data": {"data_config": {"TrainConfig": {**dataclasses.asdict(NAIVE), "name": "x"}}},
        },
    }
    run = subprocess.run(
        trusted_python("perflab.grading.session"), input=json.dumps(job), capture_output=True, text=True
    )
    verdicts = {cell: Verdict.from_dict(fields) for cell, fields in json.loads(run.stdout.splitlines()[-1]).items()}
    assert verdicts["test_regrade"] == Verdict.refused("no answer reached the grader")
    assert verdicts["test_data"].status == "fail" and "baseline's own configuration" in verdicts["test_data"].reasons[0]


def test_one_trusted_process_grades_the_notebooks_of_a_lab_one_after_another(tmp_path):
    """Two notebooks of lab 12 in one process, each with its own verdicts; a notebook of another lab in a fresh one."""
    from perflab.grading.trusted_process import TrustedGrader

    def job(lab: str, handed: dict) -> dict:
        return {"lab": lab, "cells": {"course": {}, "learner": {}}, "cache_dir": str(tmp_path), "handed_in": handed}

    naive = {"data_config": {"TrainConfig": {**dataclasses.asdict(NAIVE), "name": "x"}}}
    first = TrustedGrader.for_job(job("lab12_capstone", {}), env=None)
    try:
        verdicts = [
            first.grade(job("lab12_capstone", handed), timeout=120, log=lambda line: None)
            for handed in ({"test_regrade": {"error": "no answer reached the grader"}}, {"test_data": naive})
        ]
        assert TrustedGrader.for_job(job("lab12_capstone", {}), env=None) is first
        assert Verdict.from_dict(verdicts[0]["test_regrade"]) == Verdict.refused("no answer reached the grader")
        assert (
            list(verdicts[1]) == ["test_data"]
            and "baseline's own configuration" in verdicts[1]["test_data"]["reasons"][0]
        )
        other = TrustedGrader.for_job(job("lab04_amp", {}), env=None)
        assert other is not first and first.process.poll() == 0, "the lab before ended at the end of its input"
    finally:
        if TrustedGrader._live is not None:
            TrustedGrader._live.close()


def test_after_a_job_the_trusted_process_is_put_back_as_it_was(tmp_path, monkeypatch):
    from perflab.grading.session import _FreshState

    (tmp_path / "problem_of_a_job.py").write_text("ANSWER = 1\n")
    monkeypatch.setattr(sys, "path", [os.path.dirname(os.__file__), *sys.path])  # trusted: the standard library first
    threads = torch.get_num_threads()
    fresh = _FreshState()
    before = torch.rand(3)
    sys.path.insert(0, str(tmp_path))
    monkeypatch.chdir(tmp_path)
    os.environ["PERFLAB_SET_BY_A_JOB"] = "1"
    import colorsys  # noqa: F401 - the standard library's: trusted, stays

    import problem_of_a_job  # noqa: F401

    torch.set_num_threads(1)
    fresh.restore()
    assert "problem_of_a_job" not in sys.modules and "colorsys" in sys.modules
    assert str(tmp_path) not in sys.path and os.getcwd() != str(tmp_path)
    assert "PERFLAB_SET_BY_A_JOB" not in os.environ and torch.get_num_threads() == threads
    assert torch.equal(torch.rand(3), before), "the random state as it was before the job"


def test_a_wrong_result_ends_the_rounds_and_fails_whatever_its_time():
    from perflab.grading.code_labs import _interleaved, _ratio_text, measure_until_decided

    class FakeChild:
        runs = 0

        def cpu_seconds(self):
            return 0.0

    children = (FakeChild(), FakeChild())

    def run(child, side, seed):
        child.runs += 1
        return ("right" if side == 0 or child.runs < 3 else "wrong"), 0.01 * (side + 1)

    def check(reference, candidate):
        return None if candidate == reference else "the candidate's result differs"

    comparison, failures, problems = measure_until_decided(
        lambda n: _interleaved(children, run, check, rounds=n, labels=("reference", "yours")), 15, threshold=1.5
    )
    assert failures == ["the candidate's result differs"] and problems == []
    assert children[1].runs == 3 and len(comparison.ratios) == 3, "no timing after the first wrong result"
    assert "stopped after 3 round(s)" in _ratio_text(comparison, "yours over the reference")


def _stand_in_grader(monkeypatch, script: str) -> None:
    """The trusted grading process replaced by ``script``, to see what the instructor's side makes of it."""
    monkeypatch.setattr("perflab.grading.trusted_process.trusted_python", lambda module: [sys.executable, "-c", script])


def test_a_grader_that_floods_its_pipes_and_hangs_is_stopped_at_its_limit(monkeypatch):
    from perflab.grading.nbgrader import TrustedMeasurement

    _stand_in_grader(
        monkeypatch,
        "import sys, time, subprocess\n"
        "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"  # a grandchild that holds on
        "sys.stdout.write('x' * 200_000); sys.stdout.flush(); sys.stderr.write('grader: ' + 'y' * 200_000)\n"
        "time.sleep(60)\n",
    )
    start = time.perf_counter()
    verdicts = TrustedMeasurement(timeout=2)._run({"handed_in": {"test_regrade": {}}})
    assert time.perf_counter() - start < 10, "the grader ran past its limit"
    assert verdicts["test_regrade"].status == "error" and "limit of 2 s" in verdicts["test_regrade"].reasons[0]


def test_a_verdict_line_far_over_a_pipe_is_read_whole(monkeypatch):
    from perflab.grading.nbgrader import TrustedMeasurement

    verdict = Verdict.refused("ValueError: " + "x" * 100_000)
    _stand_in_grader(
        monkeypatch,
        f"import sys\nsys.stderr.write('noise ' * 50_000)\nprint({json.dumps({'test_regrade': verdict.to_dict()})!r})",
    )
    verdicts = TrustedMeasurement(timeout=60)._run({"handed_in": {"test_regrade": {}}})
    assert verdicts == {"test_regrade": Verdict.from_dict(verdict.to_dict())}
    assert len(verdicts["test_regrade"].reasons[0]) < 2100, "a reason is capped"


@pytest.mark.parametrize(
    "script, status",
    [("raise SystemExit(3)", "error"), ("print('not json')", "error"), ("import os; os.abort()", "error")],
)
def test_a_grader_that_fails_gives_grading_failed_never_a_fail(monkeypatch, script, status):
    from perflab.grading.nbgrader import TrustedMeasurement

    _stand_in_grader(monkeypatch, script)
    verdict = TrustedMeasurement(timeout=60)._run({"handed_in": {"test_data": {}}})["test_data"]
    assert verdict.status == status and not verdict.passed and "grading failed" in verdict.text().lower()


def _measured_notebook(handed: dict):
    """A lab 12 notebook whose test_regrade cell handed in ``handed``, as the kernel left it."""
    import nbformat

    printed = io.StringIO()
    with redirect_stdout(printed):
        hand_in(**handed)
    cell = nbformat.v4.new_code_cell(
        "", outputs=[nbformat.v4.new_output("stream", name="stdout", text=printed.getvalue())]
    )
    cell.metadata["nbgrader"] = {"grade_id": "test_regrade", "grade": True, "solution": False, "locked": True}
    return nbformat.v4.new_notebook(cells=[cell])


@pytest.mark.parametrize("status, cached", [("pass", True), ("fail", True), ("inconclusive", False), ("error", False)])
def test_only_a_measurement_is_kept_for_the_next_grading(tmp_path, monkeypatch, status, cached):
    from perflab.grading import nbgrader as grading
    from traitlets.config import Config

    (tmp_path / "solutions" / "lab12_capstone").mkdir(parents=True)
    source = REPO / "solutions" / "lab12_capstone" / "lab12_capstone.ipynb"
    (tmp_path / "solutions" / "lab12_capstone" / "lab12_capstone.ipynb").write_bytes(source.read_bytes())
    verdict = Verdict(status, "measured", ("why",))
    runs = []
    monkeypatch.setattr(
        grading.TrustedMeasurement, "_run", lambda self, job: runs.append(job) or {"test_regrade": verdict}
    )
    resources = {"nbgrader": {"assignment": "lab12_capstone", "notebook": "lab12_capstone", "student": "ada"}}
    measurement = grading.TrustedMeasurement(
        config=Config({"CourseDirectory": {"root": str(tmp_path), "source_directory": "solutions"}})
    )
    for _ in range(2):
        measurement.preprocess(_measured_notebook({"final_config": OPTIMIZED}), resources)
    assert len(runs) == (1 if cached else 2)
    assert len(list((tmp_path / ".perflab-grading").glob("verdicts/*.json"))) == (1 if cached else 0)


def test_the_verdict_cache_key_names_the_gpus_and_the_grading_code():
    import importlib.metadata

    from perflab.grading.nbgrader import _gpus, _machine

    key = _machine()
    assert _gpus() in key and importlib.metadata.version("torch") in key
    assert any(isinstance(part, str) and len(part) == 64 for part in key), "the grading code's digest"


@pytest.mark.slow
@needs_bwrap
def test_a_notebook_of_cells_each_under_the_cell_limit_still_ends_at_the_notebook_limit(tmp_path):
    import nbformat
    from nbclient.exceptions import CellTimeoutError
    from perflab.grading.nbgrader import SandboxedExecute

    # The notebook's limit counts from before its kernel starts: 20 s leave a slow machine room to start a sandboxed
    # kernel and run the first cell. Its cells, each under the 100 s cell limit, would take 181 s in all.
    cells = ["import time\ntime.sleep(1)\nprint('ran')", "time.sleep(90)", "time.sleep(90)", "print('never')"]
    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(source) for source in cells])
    notebook.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    start = time.perf_counter()
    with pytest.raises(CellTimeoutError):
        SandboxedExecute(timeout=100, notebook_timeout=20).preprocess(notebook, {"metadata": {"path": str(tmp_path)}})
    assert time.perf_counter() - start < 20 + 30, "the notebook ran past its limit"
    assert notebook.cells[0].outputs[0].text == "ran\n" and not notebook.cells[3].outputs
