"""One submission graded by the real ``nbgrader autograde``, in a course of its own, on whichever machine runs it.

    >>> from perflab.grading.working_copy import Submission
    >>> Submission("ada", "lab01_timing", {"lab01_timing.ipynb": (b"{}", 0o644), "timestamp.txt": (b"2026-11-24", 0o644)})
    Submission(ada / lab01_timing: 2 files)

``grade_in_working_copy(bundle, submission)`` is what a Dask worker runs for each submission
(:mod:`perflab.grading.whole_class` hands them out). It lays out a throwaway course in a fresh
folder: the course's ``nbgrader_config.py``, the lab's source, a copy of the course's gradebook,
and the one submission, as ``nbgrader collect`` lays it out. There it runs ``nbgrader autograde``
(every preprocessor of the course: the sandboxed kernel, the trusted re-measurement), then hands
back, as data, the autograded files and the gradebook fields that autograde wrote for this
submission. Nothing is shared between gradings but the files handed over, so the machines need
not share a file system, and a grading that dies leaves nothing half-written in the course.

Gradings take a lock on the machine: a measured lab's grading takes it alone, others share it,
so a measured grading never runs beside any other grading on its machine, whatever number of
Dask workers the machine runs. The operating system releases it when its process ends.

Used by perflab.grading.whole_class, whose Dask workers run it.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import multiprocessing
import os
import re
import signal
import socket
import stat
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import nbformat

from perflab.grading.machine_lock import MachineLock, uncapped

__all__ = [
    "CourseBundle",
    "Graded",
    "Submission",
    "autograde_fields",
    "grade_in_working_copy",
    "machine_lock",
    "nbgrader_environment",
    "read_folder",
    "write_folder",
]

_LOCK_FILE = Path(tempfile.gettempdir()) / f"perflab-grading-{os.getuid()}.lock"
_INCONCLUSIVE_ERROR = "GraderInconclusive"  # the error perflab.grading.nbgrader writes into an inconclusive cell
_GRADER_ERROR = "GraderError"  # ... and into a cell whose grading failed (a crash, a timeout): not scored
_TIMEOUT_ERROR = "CellTimeoutError"  # the error nbgrader's Execute writes into a cell that ran past its timeout
_EXCEPTION_LINE = re.compile(r"^\s*((?:[A-Za-z_]\w*\.)*[A-Za-z_]\w*(?:Error|Exception|Interrupt|Exit)\b.*)$", re.M)


@dataclass(frozen=True)
class CourseBundle:
    """What every grading of one lab needs from the course: its configuration, the lab's source, the gradebook."""

    lab: str
    measured: bool
    config: str  # the text of nbgrader_config.py
    source_directory: str  # the name of the sources' folder, from the course's configuration
    source_files: dict[str, tuple[bytes, int]]  # the lab's source folder, as read_folder reads it
    gradebook: bytes  # a consistent copy of the course's SQLite gradebook
    cache_dir: str  # where the trusted grader keeps what it measured once (the course's, when the worker sees it)

    def __repr__(self) -> str:
        kind = "measured" if self.measured else "unmeasured"
        return f"CourseBundle({self.lab}, {kind}, {len(self.source_files)} source files)"


@dataclass(frozen=True)
class Submission:
    """One learner's handed-in folder of one lab, as files."""

    student: str
    lab: str
    files: dict[str, tuple[bytes, int]]  # the handed-in folder as read_folder reads it, timestamp.txt included

    def __repr__(self) -> str:
        return f"Submission({self.student} / {self.lab}: {len(self.files)} files)"


@dataclass
class Graded:
    """What one grading produced, handed back to the machine that keeps the course."""

    student: str
    status: str  # graded, failed or inconclusive
    reason: str = ""
    not_scored: bool = False  # a cell's grading failed (the grader crashed, ran too long): nothing decided
    files: dict[str, tuple[bytes, int]] = field(default_factory=dict)  # autograded folder: path -> (content, mode)
    gradebook: dict | None = None  # what autograde wrote into the gradebook for this submission
    started: float = 0.0  # wall clock (time.time()) once the grading had its machine lock
    ended: float = 0.0
    waited_s: float = 0.0  # time spent waiting for the machine lock
    host: str = field(default_factory=socket.gethostname)
    worker: str = ""
    log_tail: str = ""

    @property
    def again(self) -> bool:
        """Whether grading it again may end otherwise: a noisy measurement, a grader that failed."""
        return self.status == "inconclusive" or self.not_scored


def nbgrader_environment() -> dict[str, str]:
    """This environment, with this interpreter's folder first on PATH: nbgrader starts `alembic`, and kernels start
    `python`, from PATH."""
    bin_dir = Path(sys.executable).parent
    return dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}")


def machine_lock(exclusive: bool, path: Path = _LOCK_FILE) -> contextlib.AbstractContextManager:
    """A lock on this machine: alone for a measured grading, shared for the others."""
    machine = MachineLock(path)
    return machine.alone() if exclusive else machine.shared()


def write_folder(folder: Path, files: dict[str, tuple[bytes, int]]) -> None:
    """Write ``files`` (relative path -> content and permission bits) under ``folder``."""
    for relative, (content, mode) in files.items():
        path = folder / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content)
        path.chmod(mode)


def read_folder(folder: Path) -> dict[str, tuple[bytes, int]]:
    """Every regular file under ``folder``: relative path -> content and permission bits; empty when there is no
    folder. Links are never followed (a link to the gradebook would hand it over): they, and FIFOs, are skipped."""
    if not folder.is_dir() or folder.is_symlink():
        return {}
    files = {}
    for root, _, names in os.walk(folder):  # os.walk does not descend into links to folders
        for name in names:
            path = Path(root, name)
            info = path.lstat()
            if stat.S_ISREG(info.st_mode):
                files[str(path.relative_to(folder))] = (path.read_bytes(), info.st_mode & 0o777)
    return dict(sorted(files.items()))


def _worker_name() -> str:
    try:
        from distributed import get_worker

        return get_worker().address
    except (ImportError, ValueError):  # not inside a Dask worker: a direct call
        return f"pid {os.getpid()}"


def autograde_fields(db_url: str, lab: str, student: str) -> dict | None:
    """The fields ``nbgrader autograde`` writes for one submission (none of the grader's manual ones)."""
    from nbgrader.api import Gradebook, MissingEntry

    with Gradebook(db_url) as gradebook:
        try:
            submission = gradebook.find_submission(lab, student)
        except MissingEntry:
            return None
        return {
            "timestamp": submission.timestamp,
            "notebooks": {
                notebook.name: {
                    "late_submission_penalty": notebook.late_submission_penalty,
                    "grades": {grade.name: [grade.auto_score, grade.needs_manual_grade] for grade in notebook.grades},
                    "comments": {comment.name: comment.auto_comment for comment in notebook.comments},
                }
                for notebook in submission.notebooks
            },
        }


def _errors_named(files: dict[str, tuple[bytes, int]], ename: str) -> list[str]:
    """The graded cells of the autograded notebooks whose output is the error ``ename``."""
    cells = []
    for relative, (content, _) in files.items():
        if relative.endswith(".ipynb"):
            for cell in nbformat.reads(content.decode(), as_version=4).cells:
                if any(output.get("ename") == ename for output in cell.get("outputs", [])):
                    cells.append(cell.metadata.get("nbgrader", {}).get("grade_id") or f"cell {cell.get('id', '?')}")
    return cells


def _failure_reason(log: str) -> str:
    """nbgrader's own words for why it could not grade a submission: the last exception its log shows."""
    if "CellTimeoutError" in log:
        return "a cell ran past its time limit and nbgrader stopped grading (nbclient's CellTimeoutError)"
    exceptions = _EXCEPTION_LINE.findall(log)
    return exceptions[-1].strip()[:300] if exceptions else "nbgrader failed without naming an exception"


@functools.cache
def _grading_processes():
    """Processes forked from a server that imported nbgrader and the course's grading code once: a new grading
    process for each submission, without the seconds of imports that starting ``nbgrader`` costs each time."""
    context = multiprocessing.get_context("forkserver")
    # What an autograde imports on its way: nbgrader, the course's preprocessors (from nbgrader_config.py), and, as
    # it starts a kernel, the sandbox's data folder (perflab.data, with torchvision) and ipykernel's kernel spec.
    context.set_forkserver_preload(
        ["nbgrader.apps.nbgraderapp", "perflab.grading.nbgrader", "perflab.data.images", "ipykernel.kernelspec"]
    )
    return context


def _nbgrader_in_this_process(args: list[str], cwd: str, env: dict, log_path: str) -> None:
    """``nbgrader ARGS`` in a fresh forked process: its own session, killed if its parent dies, output to a file."""
    os.setsid()
    _die_with_parent()
    log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    from nbgrader.apps.nbgraderapp import NbGraderApp

    sys.argv = ["nbgrader", *args]
    NbGraderApp.launch_instance(argv=args)


def _run_nbgrader(args: list[str], cwd: Path, env: dict, timeout_s: float) -> tuple[int | None, str]:
    """``nbgrader ARGS`` in ``cwd``; killed with every process it started if it runs past ``timeout_s``."""
    log_path = cwd / "nbgrader.log"
    process = _grading_processes().Process(target=_nbgrader_in_this_process, args=(args, str(cwd), env, str(log_path)))
    process.start()
    process.join(timeout_s)
    timed_out = process.exitcode is None
    if timed_out:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.join()
    log = log_path.read_text(errors="replace") if log_path.exists() else ""
    return (None if timed_out else process.exitcode), log


def grade_in_working_copy(
    bundle: CourseBundle, submission: Submission, *, cell_timeout_s: int | None = None, timeout_s: float = 3600
) -> Graded:
    """Grade ``submission`` with ``nbgrader autograde`` in a throwaway course (see the module's docstring)."""
    if submission.lab != bundle.lab:
        raise ValueError(f"{submission} is not a submission of {bundle.lab}")
    worker = _worker_name()
    asked = time.time()
    with machine_lock(exclusive=bundle.measured), tempfile.TemporaryDirectory(prefix="perflab-grading-") as folder:
        started = time.time()
        root = Path(folder)
        (root / "nbgrader_config.py").write_text(bundle.config)
        write_folder(root / bundle.source_directory / bundle.lab, bundle.source_files)
        (root / "gradebook.db").write_bytes(bundle.gradebook)
        write_folder(root / "submitted" / submission.student / submission.lab, submission.files)
        cache = Path(bundle.cache_dir)
        if not cache.parent.is_dir():  # another machine: a cache of its own, kept between gradings
            cache = Path.home() / ".cache" / "perflab" / "grading"
        cache.mkdir(parents=True, exist_ok=True)
        (root / ".perflab-grading").symlink_to(cache)
        env = nbgrader_environment()
        if bundle.measured:  # Dask's nanny caps each worker at one thread: right beside others, not alone
            env = uncapped(env)
        db_url = f"sqlite:///{root / 'gradebook.db'}"
        args = ["autograde", bundle.lab, "--student", submission.student, f"--CourseDirectory.db_url={db_url}"]
        if cell_timeout_s is not None:
            args.append(f"--Execute.timeout={cell_timeout_s}")
        returncode, log = _run_nbgrader(args, root, env, timeout_s)
        files = read_folder(root / "autograded" / submission.student / submission.lab)
        graded = Graded(
            submission.student,
            "graded",
            files=files,
            gradebook=autograde_fields(db_url, bundle.lab, submission.student),
            started=started,
            ended=time.time(),
            waited_s=started - asked,
            worker=worker,
            log_tail=log[-4000:],
        )
    if returncode is None:
        graded.status, graded.reason = "failed", f"the grading ran past its limit of {timeout_s:.0f} s and was killed"
    elif returncode != 0 or not files:
        graded.status, graded.reason = "failed", f"nbgrader could not grade it: {_failure_reason(log)}"
    elif not_scored := _errors_named(files, _GRADER_ERROR):
        graded.status, graded.not_scored = "failed", True
        graded.reason = f"grading failed, not scored: {', '.join(not_scored)} (the grader crashed or ran too long)"
    elif inconclusive := _errors_named(files, _INCONCLUSIVE_ERROR):
        graded.status = "inconclusive"
        graded.reason = f"measured too noisily to decide: {', '.join(inconclusive)}"
    elif timed_out := _errors_named(files, _TIMEOUT_ERROR):
        limit = f"{cell_timeout_s} s" if cell_timeout_s is not None else "the course's per-cell timeout"
        graded.reason = f"ran past {limit} in {', '.join(timed_out)} (interrupted, scored as an error)"
    return graded


def _die_with_parent() -> None:
    """Ask Linux to kill this process when the one that started it dies (a Dask worker killed mid-grading)."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG
