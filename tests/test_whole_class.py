"""A whole class graded on Dask: a real scheduler and two workers on loopback, against serial nbgrader autograde."""

from __future__ import annotations

import concurrent.futures
import json
import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import nbformat
import psutil
import pytest
from attacks import build_attack, leak_probe_outputs
from perflab.distributed import free_port
from perflab.grading.course import NbgraderCourse
from perflab.grading.sandbox import bwrap_works
from perflab.grading.whole_class import MEASURED_RESOURCE, ClassGrading, SubmissionGrading, grade_class
from perflab.grading.working_copy import Graded, _failure_reason, autograde_fields, machine_lock

LAB = "lab01_timing"
DASK = str(Path(sys.executable).parent / "dask")


# How long grading a class of two or three lab 01 learners (and a few odd submissions) on the two workers may take,
# a worker killed or the grading interrupted on the way (half of it for the first grading to end): about a minute for
# four learners on a quiet 2-core EPYC. A machine three times slower, whose cores the round trip's gradings and the
# lectures share (a cgroup at a third of its CPU), took over 600 s for four. A grading stuck past it fails the test
# instead of holding CI. Each test hands in as few learners as it needs: every grading costs a kernel and a trusted
# process, thrice that on such a machine.
CLASS_GRADING_BOUND_S = 1800


@pytest.fixture(scope="module")
def cell_timeout_s() -> int:
    """The per-cell limit the class is graded with: long enough for every cell of a solved lab 01 on this machine,
    short enough that the hanging submission ends soon.

    The slowest cell is the setup cell, which imports perflab (and with it torch): timed here in a fresh Python, then
    given six times that, as three gradings share the 2 cores during the test (1.5x) and with room for the load to
    vary (4x); 15 s at least. The leak probe's cell walks only what the sandbox holds beyond the interpreter's
    folders, a second or so (``tests/attacks.py``)."""
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import perflab\nperflab.pick_device()"], check=True, timeout=600)
    return max(15, round(6 * (time.perf_counter() - start)))


def _grade_id(cell) -> str | None:
    return cell.metadata.get("nbgrader", {}).get("grade_id")


@pytest.fixture(scope="module")
def scheduler(tmp_path_factory):
    """``dask scheduler`` and two ``dask worker`` processes on this machine, as an instructor starts them."""
    from distributed import Client

    folder = tmp_path_factory.mktemp("dask")
    address = f"tcp://127.0.0.1:{free_port()}"
    env = dict(NbgraderCourse.environment(), DASK_DISTRIBUTED__WORKER__DAEMON="False")
    quiet = {"cwd": folder, "env": env, "stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
    processes = [
        subprocess.Popen(
            [DASK, "scheduler", "--host", "127.0.0.1", "--port", address.rsplit(":")[-1], "--no-dashboard"], **quiet
        )
    ]
    for name in ("worker-a", "worker-b"):
        processes.append(
            subprocess.Popen(
                [
                    DASK,
                    "worker",
                    address,
                    "--name",
                    name,
                    "--nworkers",
                    "1",
                    "--nthreads",
                    "1",
                    "--resources",
                    f"{MEASURED_RESOURCE}=1",
                    "--no-dashboard",
                ],
                **quiet,
            )
        )
    with Client(address, timeout=60) as client:
        client.wait_for_workers(2, timeout=120)
    yield address, processes[1:]
    for process in processes:  # nothing of the test's class is left to save: stop at once
        process.kill()
        process.wait()


def _hanging(solution: Path) -> nbformat.NotebookNode:
    notebook = nbformat.read(solution / f"{LAB}.ipynb", as_version=4)
    answer = next(c for c in notebook.cells if c.cell_type == "code" and c.metadata.get("nbgrader", {}).get("solution"))
    answer.source = "import time\ntime.sleep(3600)"
    return notebook


def _class(released_course, tmp_path, solved: int, untouched: int) -> NbgraderCourse:
    course = released_course.copy_to(tmp_path)
    for number in range(solved + untouched):
        source = course.root / "solutions" / LAB if number < solved else course.root / "labs" / LAB
        course.submit(f"learner{number}", LAB, source)
    return course


def _log(course: NbgraderCourse) -> list[dict]:
    path = course.root / ".perflab-grading" / "grading-log.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _fields(course: NbgraderCourse, lab: str, students) -> dict:
    return {s: autograde_fields(f"sqlite:///{course.root / 'gradebook.db'}", lab, s) for s in students}


@pytest.mark.slow
def test_a_class_graded_on_dask_equals_serial_autograde(released_course, scheduler, cell_timeout_s, tmp_path):
    dask_course = _class(released_course, tmp_path / "dask", solved=1, untouched=1)
    broken = dask_course.root / "submitted" / "broken" / LAB
    broken.mkdir(parents=True)
    (broken / f"{LAB}.ipynb").write_text("{ this is not a notebook")
    dask_course.submit_notebook("hanging", LAB, _hanging(dask_course.root / "solutions" / LAB), {})
    if bwrap_works():
        dask_course.submit_notebook("leaky", LAB, *build_attack(LAB, "leak"))
    serial_course = dask_course.copy_to(tmp_path / "serial")
    students = sorted(path.name for path in (dask_course.root / "submitted").iterdir())

    # Lab 01 is unmeasured, so its scores do not depend on the load: the serial reference grades meanwhile, run as
    # `python -m nbgrader` from the course's folder (its folder on sys.path).
    with concurrent.futures.ThreadPoolExecutor(1) as serial:
        serial_run = serial.submit(
            serial_course.run, "autograde", LAB, f"--Execute.timeout={cell_timeout_s}", as_module=True
        )
        result = grade_class(
            dask_course.root, LAB, scheduler=scheduler[0], cell_timeout_s=cell_timeout_s, progress=False
        )
        with pytest.raises(AssertionError, match="error processing assignment 'lab01_timing' for student 'broken'"):
            serial_run.result()

    assert _fields(dask_course, LAB, students) == _fields(serial_course, LAB, students)
    status = {grading.student: grading for grading in result.gradings}
    assert {s: g.status for s, g in status.items()} == {
        "broken": "failed",
        "hanging": "failed",
        **{f"learner{n}": "graded" for n in range(2)},
        **({"leaky": "graded"} if bwrap_works() else {}),
    }
    for course in (dask_course, serial_course) if bwrap_works() else ():  # a worker's working copy, the course root
        graded = course.root / "autograded" / "leaky" / LAB / f"{LAB}.ipynb"
        leaky, printed = graded.read_text(), leak_probe_outputs(graded)
        assert "leak probe found: []" in printed, printed
        assert "/submitted/" not in leaky and "SQLite format" not in leaky
    assert "NotJSONError" in status["broken"].reason
    assert "time limit" in status["hanging"].reason
    assert status["learner0"].score > 0 and status["learner1"].score == 0
    assert not result.complete and "2 failed" in repr(result)
    dask_course.run("generate_feedback", LAB)  # feedback and export work as after a serial autograde
    for course in (serial_course, dask_course):
        course.run("export", "--to", str(course.root / "grades.csv"))
    exported = [sorted((c.root / "grades.csv").read_text().splitlines()) for c in (dask_course, serial_course)]
    assert exported[0] == exported[1]  # the same rows, in the order each gradebook created its submissions
    assert sorted(p.parent.name for p in (dask_course.root / "feedback").glob(f"*/{LAB}")) == [
        *(["leaky"] if bwrap_works() else []),
        *(f"learner{n}" for n in range(2)),
    ]


def _grading_worker(workers: list[subprocess.Popen]) -> psutil.Process | None:
    """The Dask worker process (a child of a `dask worker` nanny) that is running a learner's kernel now."""
    for nanny in workers:
        for worker in psutil.Process(nanny.pid).children():
            try:
                if any("ipykernel" in " ".join(p.cmdline()) for p in worker.children(recursive=True)):
                    return worker
            except psutil.NoSuchProcess:
                pass
    return None


@pytest.mark.slow
def test_a_worker_killed_while_it_grades_loses_nothing(released_course, scheduler, tmp_path):
    address, workers = scheduler
    course = _class(released_course, tmp_path, solved=1, untouched=1)
    results = []
    grading = threading.Thread(
        target=lambda: results.append(grade_class(course.root, LAB, scheduler=address, progress=False))
    )
    grading.start()
    deadline, victim = time.monotonic() + 120, None
    while victim is None and time.monotonic() < deadline and grading.is_alive():
        victim = _grading_worker(workers)
        time.sleep(0.2)
    assert victim is not None, "no worker was seen grading"
    victim.kill()
    grading.join(timeout=CLASS_GRADING_BOUND_S)

    assert results, f"the class was not graded within {CLASS_GRADING_BOUND_S} s of a worker being killed"
    assert [g.status for g in results[0].gradings] == ["graded"] * 2, [g.reason for g in results[0].gradings]
    graded = [record["student"] for record in _log(course) if record["status"] == "graded"]
    assert sorted(graded) == [f"learner{n}" for n in range(2)]  # each once: the killed grading merged nothing


@pytest.mark.slow
def test_an_interrupted_grading_resumes_without_grading_anything_twice(released_course, scheduler, tmp_path):
    course = _class(released_course, tmp_path, solved=2, untouched=1)
    command = [sys.executable, "-m", "perflab", "grade", LAB, "--scheduler", scheduler[0], "--course", str(course.root)]
    first = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    deadline = time.monotonic() + CLASS_GRADING_BOUND_S / 2
    while not any(r["status"] == "graded" for r in _log(course)) and time.monotonic() < deadline:
        time.sleep(0.2)
    first.send_signal(signal.SIGINT)
    output, _ = first.communicate(timeout=120)
    assert first.returncode == 130, output
    assert "run the same command again" in output
    graded_first = {r["student"] for r in _log(course) if r["status"] == "graded"}
    assert 1 <= len(graded_first) < 3, graded_first

    second = subprocess.run(command, capture_output=True, text=True, timeout=CLASS_GRADING_BOUND_S)
    assert second.returncode == 0, second.stdout + second.stderr
    graded = [r["student"] for r in _log(course) if r["status"] == "graded"]
    assert sorted(graded) == [f"learner{n}" for n in range(3)]  # nothing graded twice, nothing lost
    skipped = {line.split()[0] for line in second.stdout.splitlines() if line.split()[1:2] == ["skipped"]}
    assert skipped == graded_first


def _trimmed_release(course: NbgraderCourse, lab: str) -> nbformat.NotebookNode:
    """The untouched release without the read-only cells that train, as a learner may hand it in: quick to grade."""
    notebook = nbformat.read(course.root / "labs" / lab / f"{lab}.ipynb", as_version=4)
    notebook.cells = [
        cell
        for cell in notebook.cells
        if not (
            cell.cell_type == "code"
            and cell.metadata.get("nbgrader", {}).get("locked")
            and not cell.metadata["nbgrader"].get("grade")
            and _grade_id(cell) not in ("colab_setup", "setup")
        )
    ]
    return notebook


@pytest.mark.slow
def test_measured_gradings_never_share_a_machine(released_course, scheduler, tmp_path):
    lab = "lab12_capstone"
    course = released_course.copy_to(tmp_path)
    course.submit_notebook("first", lab, _trimmed_release(course, lab), {})
    # Its answers carry 100,000 characters into the grader's verdicts: its grading ends, and so does the other one.
    course.submit_notebook("second", lab, *build_attack(lab, "unbounded"))
    result = grade_class(course.root, lab, scheduler=scheduler[0], progress=False, timeout_s=900)

    assert [g.status for g in result.gradings] == ["graded", "graded"]
    first, second = result.gradings
    assert first.score == 0 and second.score < second.max_score  # the attack scores only the unmeasured cells
    (a, b) = sorted(result.gradings, key=lambda g: g.started)
    assert a.ended <= b.started, f"two measured gradings overlapped: {a} and {b}"


def test_the_summary_reads_as_a_table():
    result = ClassGrading(
        "lab01_timing",
        (
            SubmissionGrading("ada", "graded", 9, 12, attempts=1, seconds=4.2, host="grader-0"),
            SubmissionGrading("bob", "failed", 0, 12, attempts=1, seconds=0.3, host="grader-1", reason="not JSON"),
            SubmissionGrading("cy", "skipped", 12, 12, reason="graded before"),
        ),
        wall_s=9.6,
        workers=2,
    )
    assert not result.complete
    assert repr(result).splitlines()[0].split() == [
        "student",
        "status",
        "points",
        "attempts",
        "seconds",
        "machine",
        "reason",
    ]
    assert "lab01_timing: 1 graded, 1 skipped, 1 failed, 0 inconclusive; 10 s on 2 workers" in repr(result)
    assert "<td>not JSON</td>" in result._repr_html_()


@pytest.mark.parametrize(
    ("log", "reason"),
    [
        (
            "[AutogradeApp | ERROR] Traceback\n    raise NotJSONError(m)\nnbformat.reader.NotJSONError: not JSON: '{'\n"
            "[AutogradeApp | WARNING] Removing failed assignment",
            "nbformat.reader.NotJSONError: not JSON: '{'",
        ),
        (
            "[AutogradeApp | ERROR] Timeout waiting for execute reply (10s).\nnbclient.exceptions.CellTimeoutError: A "
            "cell timed out",
            "a cell ran past its time limit and nbgrader stopped grading (nbclient's CellTimeoutError)",
        ),
        ("killed", "nbgrader failed without naming an exception"),
    ],
)
def test_a_failed_grading_says_why_in_nbgraders_words(log, reason):
    assert _failure_reason(log) == reason


def _hold(path: str, exclusive: bool, held: multiprocessing.Event, release: multiprocessing.Event) -> None:
    with machine_lock(exclusive, Path(path)):
        held.set()
        release.wait(30)


@pytest.mark.parametrize(
    ("first", "second", "waits"), [(True, False, True), (False, True, True), (False, False, False)]
)
def test_a_measured_grading_has_the_machine_to_itself(tmp_path, first, second, waits):
    lock = str(tmp_path / "machine.lock")
    context = multiprocessing.get_context("fork")  # the child needs nothing imported anew
    held, release, second_held = context.Event(), context.Event(), context.Event()
    holder = context.Process(target=_hold, args=(lock, first, held, release))
    holder.start()
    assert held.wait(30)
    other = context.Process(target=_hold, args=(lock, second, second_held, context.Event()))
    other.start()
    assert second_held.wait(2) is not waits  # an exclusive lock waits for, or keeps out, any other grading
    release.set()
    holder.join(30)
    assert second_held.wait(30)
    other.kill()
    other.join()
    assert os.path.exists(lock)


def _graded_without_a_kernel(submission, now: float) -> Graded:
    """What a grading hands back, made up: an empty autograded notebook."""
    notebook = nbformat.v4.new_notebook()
    return Graded(
        submission.student,
        "graded",
        files={"lab12_capstone.ipynb": (nbformat.writes(notebook).encode(), 0o444)},
        started=now,
        ended=now,
        worker="stub",
    )


@pytest.mark.slow
def test_an_inconclusive_measurement_is_graded_again_and_never_scored(released_course, tmp_path, monkeypatch):
    """Workers in this process (threads), so that a stand-in grading can say "inconclusive" on cue."""
    from distributed import LocalCluster
    from perflab.grading import whole_class

    course = released_course.copy_to(tmp_path)
    for student in ("steady", "noisy", "crashing"):
        course.submit(student, "lab12_capstone", course.root / "labs" / "lab12_capstone")

    def noisy_for_one(bundle, submission, **_):
        now = time.time()
        if submission.student == "noisy":
            return Graded(
                submission.student,
                "inconclusive",
                "measured too noisily to decide: test_regrade",
                started=now,
                ended=now,
                worker="a noisy machine",
            )
        if submission.student == "crashing":
            reason = "grading failed, not scored: test_regrade (the grader crashed or ran too long)"
            return Graded(submission.student, "failed", reason, not_scored=True, started=now, ended=now)
        return _graded_without_a_kernel(submission, now)

    monkeypatch.setattr(whole_class, "grade_in_working_copy", noisy_for_one)
    with LocalCluster(
        n_workers=2, processes=False, dashboard_address=":0", resources={MEASURED_RESOURCE: 1}
    ) as cluster:
        result = grade_class(
            course.root, "lab12_capstone", scheduler=cluster.scheduler_address, attempts=3, progress=False
        )

    assert [r["student"] for r in _log(course)].count("steady") == 1
    status = {g.student: g for g in result.gradings}
    assert status["noisy"].status == "inconclusive" and status["noisy"].attempts == 3
    assert status["noisy"].score is None and status["steady"].status == "graded"
    assert not (course.root / "autograded" / "noisy").exists(), "an inconclusive grading must not be merged"
    assert [r["status"] for r in _log(course) if r["student"] == "noisy"] == ["inconclusive"] * 3
    assert status["crashing"].status == "failed" and status["crashing"].attempts == 3, "a grader's failure: again"
    assert not (course.root / "autograded" / "crashing").exists(), "so that the next run grades it again"
    assert not result.complete
