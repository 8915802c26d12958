"""Grade a whole class in parallel on Dask: every submission of a lab, merged into the course's one gradebook.

    $ python -m perflab grade lab01_timing --workers 2                  # a Dask cluster on this machine
    $ python -m perflab grade lab12_capstone --scheduler tcp://grader-0:8786   # an existing cluster
    >>> from perflab.grading.whole_class import grade_class
    >>> grade_class("/no/such/course", "lab01_timing")
    Traceback (most recent call last):
    ...
    FileNotFoundError: no nbgrader_config.py in /no/such/course: run this from the course's folder (or pass it)

Each submission is graded by the real ``nbgrader autograde`` in a course of its own on a Dask
worker (:mod:`perflab.grading.working_copy`); this process, the only one that writes the
course, merges each result as it arrives: the autograded folder, and the gradebook fields that
autograde writes (auto scores, needs-manual-grade flags, auto comments, late penalties,
timestamps). So formgrader, ``nbgrader generate_feedback`` and ``nbgrader export`` see what a
serial ``nbgrader autograde`` would have left.

- **Measured labs** (``MEASURED_CELLS``) ask for the worker resource ``perflab-measured``, and
  each grading takes its machine's lock alone: one measured grading per machine at a time,
  never beside another grading. A measurement the grader calls inconclusive is graded again
  (elsewhere, where another worker has the resource), never scored. Labs whose cells are only
  checked outside the kernel (``CHECKED_CELLS``: results, no clock) grade anywhere.
- **Faults**: Dask reruns the grading of a worker that dies on another worker (and where the course
  sent to the workers died with it, it is sent again and the grading retried); one broken or
  hanging submission (``cell_timeout_s`` per cell, ``timeout_s`` per grading) fails alone, with
  nbgrader's reason, as a serial autograde fails it. A grading whose trusted grader failed (it
  crashed, ran past its limit, was killed for memory) is "grading failed, not scored", and graded
  again like an inconclusive one; its zero is merged, its autograded folder is not, so the next
  run grades it again.
- **Resumable**: a submission counts as graded once its autograded folder is written (the last
  step of a merge), and is skipped the next time, as ``nbgrader autograde`` skips it, unless
  ``force`` or a newer hand-in.

Every attempt is also appended to ``.perflab-grading/grading-log.jsonl`` in the course: who,
where, when it started and ended, and how it went.

Used by perflab.__main__ (``python -m perflab grade``) and perflab.grading.bench.
"""

from __future__ import annotations

import glob
import json
import multiprocessing
import shutil
import sqlite3
import tempfile
import time
import uuid
import warnings
from concurrent.futures import CancelledError
from dataclasses import asdict, dataclass
from pathlib import Path

import dask

from perflab.grading import MEASURED_CELLS
from perflab.grading.working_copy import (
    CourseBundle,
    Graded,
    Submission,
    grade_in_working_copy,
    read_folder,
    write_folder,
)
from perflab.render import Table

__all__ = ["MEASURED_RESOURCE", "ClassGrading", "SubmissionGrading", "grade_class"]

MEASURED_RESOURCE = "perflab-measured"  # a Dask worker resource: `dask worker ... --resources perflab-measured=1`
_LOG_NAME = "grading-log.jsonl"


@dataclass(frozen=True)
class SubmissionGrading:
    """How one learner's submission went: graded, failed, inconclusive or skipped (graded before)."""

    student: str
    status: str
    score: float | None = None
    max_score: float | None = None
    attempts: int = 0
    seconds: float = 0.0
    started: float = 0.0
    ended: float = 0.0
    host: str = ""
    worker: str = ""
    reason: str = ""

    def row(self) -> tuple:
        points = f"{self.score:g} / {self.max_score:g}" if self.score is not None else ""
        seconds = f"{self.seconds:.0f}" if self.attempts else ""
        return (self.student, self.status, points, self.attempts or "", seconds, self.host, self.reason)


@dataclass(frozen=True)
class ClassGrading:
    """Every submission of one lab and how its grading went, with the whole run's wall time."""

    lab: str
    gradings: tuple[SubmissionGrading, ...]
    wall_s: float
    workers: int

    def count(self, status: str) -> int:
        return sum(grading.status == status for grading in self.gradings)

    @property
    def complete(self) -> bool:
        """Whether every submission ended graded (now or before): nothing failed, nothing left inconclusive."""
        return all(grading.status in ("graded", "skipped") for grading in self.gradings)

    def _table(self) -> Table:
        counts = ", ".join(
            f"{self.count(status)} {status}" for status in ("graded", "skipped", "failed", "inconclusive")
        )
        return Table(
            ("student", "status", "points", "attempts", "seconds", "machine", "reason"),
            [grading.row() for grading in self.gradings],
            caption=f"{self.lab}: {counts}; {self.wall_s:.0f} s on {self.workers} workers",
            numeric=("points", "attempts", "seconds"),
        )

    def __repr__(self) -> str:
        return str(self._table())

    def _repr_html_(self) -> str:
        return self._table()._repr_html_()


def _course_directory(course: Path):
    """nbgrader's view of the course in ``course``, with its own nbgrader_config.py."""
    from nbgrader.coursedir import CourseDirectory
    from traitlets.config.loader import PyFileConfigLoader

    if not (course / "nbgrader_config.py").is_file():
        raise FileNotFoundError(f"no nbgrader_config.py in {course}: run this from the course's folder (or pass it)")
    config = PyFileConfigLoader("nbgrader_config.py", path=str(course)).load_config()
    coursedir = CourseDirectory(config=config)
    coursedir.root = str(course)
    return coursedir


def _gradebook_copy(db_url: str) -> bytes:
    """A consistent copy of the SQLite gradebook, taken with SQLite's backup."""
    if not db_url.startswith("sqlite:///"):
        raise ValueError(f"only an SQLite gradebook can be copied to the workers, not {db_url}")
    with sqlite3.connect(db_url.removeprefix("sqlite:///")) as source, sqlite3.connect(":memory:") as copy:
        source.backup(copy)
        return copy.serialize()


def _already_graded(coursedir, lab: str, student: str) -> bool:
    """As ``nbgrader autograde`` decides it: an autograded folder exists, and nothing newer was handed in since."""
    graded = Path(coursedir.format_path(coursedir.autograded_directory, student, lab))
    if not graded.is_dir():
        return False
    handed_in = coursedir.get_existing_timestamp(coursedir.format_path(coursedir.submitted_directory, student, lab))
    graded_at = coursedir.get_existing_timestamp(str(graded))
    return not (handed_in is not None and graded_at is not None and handed_in > graded_at)


def _merge(coursedir, lab: str, graded: Graded) -> tuple[float | None, float | None]:
    """Write what a grading produced into the course: gradebook fields first, the autograded folder last.
    Returns the submission's score and maximum, as the gradebook now holds them (none when it was not written)."""
    from nbgrader.api import Gradebook

    score = None, None
    if graded.gradebook is not None:
        # nbgrader's own update_or_create_submission warns that SQLAlchemy's autoflush skipped an object it adds next.
        with Gradebook(coursedir.db_url, coursedir.course_id) as gradebook, warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Object of type", module="nbgrader")
            gradebook.update_or_create_student(graded.student)
            submission = gradebook.update_or_create_submission(
                lab, graded.student, timestamp=graded.gradebook["timestamp"]
            )
            for notebook in submission.notebooks:
                fields = graded.gradebook["notebooks"][notebook.name]
                notebook.late_submission_penalty = fields["late_submission_penalty"]
                for grade in notebook.grades:
                    grade.auto_score, grade.needs_manual_grade = fields["grades"][grade.name]
                for comment in notebook.comments:
                    comment.auto_comment = fields["comments"][comment.name]
            gradebook.db.commit()
            score = submission.score, submission.max_score
    destination = Path(coursedir.format_path(coursedir.autograded_directory, graded.student, lab))
    if graded.status != "graded":  # as nbgrader leaves a failed submission: no autograded folder
        shutil.rmtree(destination, ignore_errors=True)
        return score
    destination.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{lab}-", dir=destination.parent))
    write_folder(staging, graded.files)
    shutil.rmtree(destination, ignore_errors=True)
    staging.rename(destination)
    return score


def _score(coursedir, lab: str, student: str) -> tuple[float | None, float | None]:
    from nbgrader.api import Gradebook, MissingEntry

    with Gradebook(coursedir.db_url, coursedir.course_id) as gradebook:
        try:
            submission = gradebook.find_submission(lab, student)
        except MissingEntry:
            return None, None
        return submission.score, submission.max_score


def _client(workers: int, scheduler: str | None):
    """A client of the given scheduler, or of a new cluster of ``workers`` one-thread processes on this machine."""
    from distributed import Client, LocalCluster

    if scheduler:
        return Client(scheduler), None
    # Each grading is a process of its worker's: workers must not be daemonic, now or when a nanny restarts one.
    dask.config.set({"distributed.worker.daemon": False})
    cluster = LocalCluster(
        n_workers=workers,
        threads_per_worker=1,
        processes=True,
        dashboard_address=":0",
        resources={MEASURED_RESOURCE: 1},
    )
    return Client(cluster), cluster


def _may_start_processes() -> bool:
    return not multiprocessing.current_process().daemon


def _scatter_to_every_worker(client, bundle: CourseBundle, tries: int = 3):
    """``bundle`` on every worker. A worker that dies during the broadcast (a machine lost) closes the scheduler's
    connection: the broadcast is tried again, to the workers that are left."""
    from distributed.comm.core import CommClosedError

    for attempt in range(1, tries + 1):
        try:
            return client.scatter(bundle, broadcast=True)
        except CommClosedError:
            if attempt == tries:
                raise


def _check_workers(client, measured: bool) -> int:
    """The number of workers, once every one can grade: fail at once, saying how to start them, if one cannot."""
    workers = client.scheduler_info()["workers"]
    if not workers:
        raise RuntimeError("the Dask cluster has no worker: start one on each grading machine (see the README)")
    daemonic = sorted(address for address, may in client.run(_may_start_processes).items() if not may)
    if daemonic:
        raise RuntimeError(
            f"workers {', '.join(daemonic)} may not start processes, and each grading is one: start them with "
            f"DASK_DISTRIBUTED__WORKER__DAEMON=False in their environment"
        )
    if measured and not any(info.get("resources", {}).get(MEASURED_RESOURCE) for info in workers.values()):
        raise RuntimeError(
            f"no worker offers the resource {MEASURED_RESOURCE!r} that measured gradings need: "
            f"start one worker per grading machine with `dask worker SCHEDULER --nworkers 1 "
            f"--resources {MEASURED_RESOURCE}=1`"
        )
    return len(workers)


def grade_class(
    course: str | Path,
    lab: str,
    *,
    students: list[str] | None = None,
    workers: int = 2,
    scheduler: str | None = None,
    force: bool = False,
    cell_timeout_s: int | None = None,
    timeout_s: float = 3600,
    attempts: int = 3,
    progress: bool = True,
) -> ClassGrading:
    """Autograde every submission of ``lab`` in ``course`` on Dask and merge them (see the module's docstring).

    ``attempts`` bounds the gradings of one submission whose measurement stays inconclusive, or whose grader fails.
    """
    from distributed import as_completed
    from tqdm.auto import tqdm

    start = time.perf_counter()
    course = Path(course).resolve()
    coursedir = _course_directory(course)
    pattern = coursedir.format_path(coursedir.submitted_directory, "*", lab)
    submitted = sorted(Path(folder).parent.name for folder in glob.glob(pattern) if Path(folder).is_dir())
    if students:
        unknown = sorted(set(students) - set(submitted))
        if unknown:
            raise ValueError(f"no submission of {lab} from {', '.join(unknown)}")
        submitted = [student for student in submitted if student in students]
    skipped = [s for s in submitted if not force and _already_graded(coursedir, lab, s)]
    to_grade = [s for s in submitted if s not in skipped]
    source = Path(coursedir.format_path(coursedir.source_directory, ".", lab))
    if not source.is_dir():
        raise FileNotFoundError(f"no source of {lab} in {source}")
    bundle = CourseBundle(
        lab=lab,
        measured=lab in MEASURED_CELLS,
        config=(course / "nbgrader_config.py").read_text(),
        source_directory=coursedir.source_directory,
        source_files=read_folder(source),
        gradebook=_gradebook_copy(coursedir.db_url),
        cache_dir=str(course / ".perflab-grading"),
    )
    log_path = course / ".perflab-grading" / _LOG_NAME
    log_path.parent.mkdir(exist_ok=True)
    results = {s: SubmissionGrading(s, "skipped", *_score(coursedir, lab, s), reason="graded before") for s in skipped}
    if not to_grade:
        return ClassGrading(lab, tuple(results[s] for s in submitted), time.perf_counter() - start, 0)

    client, cluster = _client(workers, scheduler)
    futures, run = {}, uuid.uuid4().hex[:8]
    try:
        n_workers = _check_workers(client, bundle.measured)
        scattered = _scatter_to_every_worker(client, bundle)
        resources = {MEASURED_RESOURCE: 1} if bundle.measured else None

        def submit(student: str, attempt: int, avoid: str = ""):
            nonlocal scattered
            if scattered.cancelled():  # lost with a worker that died (dask/distributed#3149): send it again
                scattered = _scatter_to_every_worker(client, bundle)
            folder = Path(coursedir.format_path(coursedir.submitted_directory, student, lab))
            others = [address for address in client.scheduler_info()["workers"] if address != avoid] if avoid else []
            elsewhere = {"workers": others, "allow_other_workers": True} if others else {}
            future = client.submit(
                grade_in_working_copy,
                scattered,
                Submission(student, lab, read_folder(folder)),
                cell_timeout_s=cell_timeout_s,
                timeout_s=timeout_s,
                key=f"grade-{lab}-{student}-{attempt}-{run}",  # a later run never meets this run's tasks
                resources=resources,
                **elsewhere,
                pure=False,
            )
            futures[future] = (student, attempt)
            return future

        queue = as_completed([submit(student, 1) for student in to_grade])
        bar = tqdm(total=len(to_grade), desc=f"grading {lab}", unit="submission", disable=not progress)
        say = bar.write if progress else lambda line: None
        with bar, log_path.open("a") as log:
            for future in queue:
                student, attempt = futures.pop(future)
                try:
                    graded = future.result()
                except CancelledError:  # the course it was sent was lost with a worker: grade it again
                    graded = Graded(
                        student, "failed", reason="the course sent to the workers was lost", not_scored=True
                    )
                except Exception as error:  # the worker died too often (KilledWorker), or the task could not run
                    graded = Graded(student, "failed", reason=f"{type(error).__name__}: {error}"[:300])
                score = None, None
                if graded.status != "inconclusive":  # an inconclusive measurement is never scored
                    score = _merge(coursedir, lab, graded)
                again = graded.again and attempt < attempts
                if again:
                    say(f"  again    {student}: {graded.reason}; attempt {attempt + 1} of {attempts}")
                    queue.add(submit(student, attempt + 1, avoid=graded.worker))
                seconds = graded.ended - graded.started
                record = SubmissionGrading(
                    student,
                    graded.status,
                    *score,
                    attempts=attempt,
                    seconds=seconds,
                    started=graded.started,
                    ended=graded.ended,
                    host=graded.host,
                    worker=graded.worker,
                    reason=graded.reason,
                )
                log.write(json.dumps({"lab": lab, **asdict(record)}) + "\n")
                log.flush()
                if again:
                    continue
                results[student] = record
                points = f"{record.score:g}/{record.max_score:g} points" if record.score is not None else "no points"
                say(f"  {graded.status:<8} {student}: {points}, {seconds:.0f} s on {graded.host} {graded.reason}")
                bar.update()
                bar.set_postfix(failed=sum(r.status == "failed" for r in results.values()))
    finally:
        for future in futures:
            future.cancel()
        client.close()
        if cluster is not None:
            cluster.close()
    return ClassGrading(lab, tuple(results[s] for s in submitted), time.perf_counter() - start, n_workers)
