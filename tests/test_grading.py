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

import perflab
import psutil
import pytest
from perflab.bench import Comparison, Timing
from perflab.capstone import measure_submission, refusal
from perflab.grading import hand_in
from perflab.grading.answers import HAND_IN_MARKER, AnswerError, handed_in, train_config
from perflab.grading.child import AnswerProcess, ChildError
from perflab.grading.sandbox import bwrap_works, pristine_perflab, sandbox_command, trusted_python
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


def test_a_noisy_measurement_decides_nothing():
    quiet, noisy = LoadMeter(), LoadMeter()
    noisy.other_cores = 1.0
    steady = _comparison([2.9, 3.0, 3.1, 3.0, 3.2])
    assert noise_problems(steady, quiet) == []
    assert "rounds disagree" in noise_problems(_comparison([3.3, 9.8, 27.2, 5.0, 12.0]), quiet)[0]
    assert "cores busy" in noise_problems(steady, noisy)[0]
    verdict = Verdict.decide("9.77x", failures=[], problems=noise_problems(steady, noisy))
    assert verdict.status == "inconclusive" and verdict.reasons[0] == INCONCLUSIVE and not verdict.passed
    assert Verdict.decide("1.2x", failures=["too slow"]).status == "fail"
    assert Verdict.from_dict(verdict.to_dict()) == verdict


def test_the_load_meter_sees_a_busy_neighbour():
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.3)
        this_process = psutil.Process()
        with LoadMeter(ours=lambda: sum(this_process.cpu_times()[:2])) as beside_a_hog:
            time.sleep(1.0)
        with LoadMeter() as counting_it_as_ours:  # the hog is our child: its time is ours
            time.sleep(1.0)
    finally:
        hog.kill()
        hog.wait()
    assert beside_a_hog.other_cores > 0.6
    assert counting_it_as_ours.other_cores < beside_a_hog.other_cores - 0.5


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
def test_the_sandbox_hides_the_course_and_lets_write_only_its_folder(tmp_path):
    course = tmp_path / "course"
    workdir = course / "autograded" / "ada" / "lab10_capstone"
    workdir.mkdir(parents=True)
    (course / "solutions").mkdir()
    (course / "solutions" / "answers.txt").write_text("the reference answers")
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    probe = f"""
import os, socket, sysconfig, subprocess, sys
import perflab
results = {{}}
def attempt(name, action):
    try:
        action()
        results[name] = "done"
    except Exception as error:
        results[name] = type(error).__name__
attempt("read solutions", lambda: open({str(course / "solutions" / "answers.txt")!r}).read())
attempt("append to perflab", lambda: open(os.path.join(os.path.dirname(perflab.__file__), "capstone.py"), "a").write("#"))
attempt("write sitecustomize", lambda: open(os.path.join(sysconfig.get_paths()["purelib"], "sitecustomize.py"), "w"))
attempt("write its folder", lambda: open("answer.txt", "w").write("mine"))
attempt("connect", lambda: socket.create_connection(("127.0.0.1", {server.getsockname()[1]}), timeout=2))
subprocess.Popen([sys.executable, "-c", "import time\\nwhile True:\\n    open('heartbeat', 'a').write('.')\\n    time.sleep(0.05)"],
                 start_new_session=True)
print(results)
"""
    command = sandbox_command([sys.executable, "-c", probe], workdir=str(workdir), hidden=[str(course)])
    run = subprocess.run(command, capture_output=True, text=True, timeout=120)
    server.close()
    assert run.returncode == 0, run.stderr
    results = eval(run.stdout.strip().splitlines()[-1])  # noqa: S307 - our own probe's dict
    assert results == {
        "read solutions": "FileNotFoundError",
        "append to perflab": "OSError",
        "write sitecustomize": "OSError",
        "write its folder": "done",
        "connect": "ConnectionRefusedError",
    }, results  # the host's listener is not there
    assert (workdir / "answer.txt").read_text() == "mine"
    time.sleep(0.3)
    beats = (workdir / "heartbeat").stat().st_size if (workdir / "heartbeat").exists() else 0
    time.sleep(0.5)
    after = (workdir / "heartbeat").stat().st_size if (workdir / "heartbeat").exists() else 0
    assert after == beats, "a process the sandboxed code started in the background outlived it"


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
        "lab": "lab10_capstone",
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
        lambda n: _interleaved(children, run, check, rounds=n, labels=("reference", "yours")), 15
    )
    assert failures == ["the candidate's result differs"] and problems == []
    assert children[1].runs == 3 and len(comparison.ratios) == 3, "no timing after the first wrong result"
    assert "stopped after 3 round(s)" in _ratio_text(comparison, "yours over the reference")
