"""nbgrader's autograde with a sandboxed kernel and the trusted re-measurement of measured cells.

    # nbgrader_config.py
    from perflab.grading.nbgrader import AUTOGRADE_PREPROCESSORS
    c.Autograde.autograde_preprocessors = AUTOGRADE_PREPROCESSORS

nbgrader's own autograde steps, with two changes: ``SandboxedExecute`` runs the submission in a
bubblewrap sandbox (:mod:`perflab.grading.sandbox`), and ``TrustedMeasurement``, after the
kernel has ended and before ``SaveAutoGrades`` reads the outputs, replaces each measured cell's
output with what the trusted grader measured: a pass prints the measurement, a fail or an
inconclusive measurement raises it as an error, which scores zero and shows in the feedback.

When the process that started nbgrader lent it the machine (:mod:`perflab.grading.machine_lock`), each
cell of the learner's kernel runs with a share of the machine's lock, and the trusted grader, which
runs on every core when it times answers, takes the lock itself.

Used by nbgrader_config.py, the course's nbgrader configuration.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.metadata
import json
import os
import platform
import shutil
import stat
import tempfile
import time
from pathlib import Path

import nbformat
from jupyter_client.manager import AsyncKernelManager
from nbclient.exceptions import DeadKernelError
from nbgrader.coursedir import CourseDirectory
from nbgrader.preprocessors import Execute, NbGraderPreprocessor
from traitlets import Bool, Integer

from perflab.grading import DECIDED_OUTSIDE, MEASURED_CELLS
from perflab.grading.answers import AnswerError, handed_in
from perflab.grading.machine_lock import LOCK_VARIABLE, lent_machine, uncapped
from perflab.grading.sandbox import require_sandbox, sandbox_command
from perflab.grading.trusted_process import GraderStopped, TrustedGrader
from perflab.grading.verdict import Verdict

__all__ = ["AUTOGRADE_PREPROCESSORS", "SandboxedExecute", "SandboxedKernelManager", "TrustedMeasurement"]

AUTOGRADE_PREPROCESSORS = [
    "perflab.grading.nbgrader.SandboxedExecute",
    "perflab.grading.nbgrader.TrustedMeasurement",
    "nbgrader.preprocessors.IgnorePattern",
    "nbconvert.preprocessors.ClearMetadataPreprocessor",
    "nbgrader.preprocessors.LimitOutput",
    "nbgrader.preprocessors.SaveAutoGrades",
    "nbgrader.preprocessors.AssignLatePenalties",
    "nbgrader.preprocessors.CheckCellMetadata",
]
_MARKERS = {"### BEGIN SOLUTION", "### END SOLUTION", "### BEGIN HIDDEN TESTS", "### END HIDDEN TESTS"}


class SandboxedKernelManager(AsyncKernelManager):
    """A kernel in the sandbox: it has no network, so it talks over Unix sockets in a folder both sides see."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self._socket_dir = tempfile.mkdtemp(prefix="perflab-kernel-")
        self.transport = "ipc"
        self.ip = os.path.join(self._socket_dir, "kernel")

    async def _async_launch_kernel(self, kernel_cmd: list[str], **kw) -> None:
        # The machine's lock is this process's to take for the kernel, never the learner's to take or hold.
        kw.get("env", {}).pop(LOCK_VARIABLE, None)
        if require_sandbox():
            workdir = os.path.abspath(kw.get("cwd") or os.getcwd())
            kernel_cmd = sandbox_command(
                kernel_cmd,
                workdir=workdir,
                readable=[os.path.abspath(self.connection_file)],
                writable=[self._socket_dir],
            )
        await super()._async_launch_kernel(kernel_cmd, **kw)

    async def _async_cleanup_resources(self, restart: bool = False) -> None:
        await super()._async_cleanup_resources(restart=restart)
        if not restart:
            shutil.rmtree(self._socket_dir, ignore_errors=True)


class SandboxedExecute(Execute):
    """nbgrader's Execute, with each submission's kernel in the sandbox, and nothing left in its folder that
    nbgrader's later steps (chmod, copying into feedback) would follow out of it."""

    notebook_timeout = Integer(
        3600, help="seconds one submission's kernel may run in all: the cells left then are not run, and score 0"
    ).tag(config=True)

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("kernel_manager_class", SandboxedKernelManager)
        super().__init__(*args, **kwargs)

    def preprocess(self, nb, resources=None, km=None):
        folder = (resources or {}).get("metadata", {}).get("path") or os.getcwd()
        self._remove_what_leads_out(folder)
        self._remove_followed_links(resources, folder)
        # Each cell has its limit (timeout); a notebook of many cells, each just under it, has this one.
        self._deadline = time.monotonic() + self.notebook_timeout
        self.timeout_func = lambda cell: max(1, min(self.timeout, int(self._deadline - time.monotonic())))
        self._kernel_died = False
        try:
            return super().preprocess(nb, resources, km)
        finally:
            self._remove_what_leads_out(folder)

    def preprocess_cell(self, cell, resources, index):
        if cell.cell_type == "code" and time.monotonic() > self._deadline:
            _not_run(cell, "NotebookTimeout", f"the notebook ran past its limit of {self.notebook_timeout} s")
            return cell, resources
        if cell.cell_type == "code" and self._kernel_died:
            _not_run(cell, "DeadKernel", "the notebook's kernel died in an earlier cell")
            return cell, resources
        # Cell by cell, so that a measurement waits for one cell of a kernel, not for its whole notebook.
        with lent_machine().shared() if lent_machine() else contextlib.nullcontext():
            try:
                return super().preprocess_cell(cell, resources, index)
            except DeadKernelError:
                # The cells decided outside the kernel are graded all the same; the others, not run, score 0.
                self._kernel_died = True
                _not_run(cell, "DeadKernel", "the notebook's kernel died in this cell")
                return cell, resources

    def _remove_what_leads_out(self, folder: str) -> None:
        removed = remove_what_leads_out(folder)
        if removed:
            self.log.warning("Removed from %s what nbgrader would follow out of it: %s", folder, "; ".join(removed))

    def _remove_followed_links(self, resources, folder: str) -> None:
        """nbgrader copied the hand-in's files into ``folder`` following its links: a link to the gradebook arrived
        as a copy of the gradebook. Remove what every link, hard link or special file of the hand-in became."""
        names = (resources or {}).get("nbgrader", {})
        if "student" not in names:
            return
        coursedir = CourseDirectory(config=self.config)
        handed_in = coursedir.format_path(coursedir.submitted_directory, names["student"], names["assignment"])
        removed = []
        for relative, what in what_leads_out(handed_in):
            copied = os.path.join(folder, relative)
            if os.path.isfile(copied) and not os.path.islink(copied):
                os.unlink(copied)
                removed.append(f"{relative}: {what}")
        if removed:
            self.log.warning("Removed what nbgrader copied through the hand-in's links: %s", "; ".join(removed))


def _not_run(cell, ename: str, reason: str) -> None:
    """An error in place of ``cell``'s outputs (zero points): why it was not run to its end."""
    message = f"not run: {reason}"
    cell.outputs = [nbformat.v4.new_output("error", ename=ename, evalue=message, traceback=[message])]


def what_leads_out(folder: str) -> list[tuple[str, str]]:
    """Every symlink, hard-linked file, FIFO, socket and device file under ``folder``, relative to it, and what it is.

    >>> import os, tempfile
    >>> folder = tempfile.mkdtemp()
    >>> os.symlink("../../../gradebook.db", os.path.join(folder, "notes.txt"))
    >>> os.mkfifo(os.path.join(folder, "pipe"))
    >>> what_leads_out(folder)
    [('notes.txt', 'a symlink to ../../../gradebook.db'), ('pipe', 'a FIFO')]
    """
    found = []
    for root, folders, files in os.walk(folder):  # never follows a link to a folder: those are listed, not entered
        for name in sorted(folders + files):
            path = os.path.join(root, name)
            info = os.lstat(path)
            what = (
                f"a symlink to {os.readlink(path)}"
                if stat.S_ISLNK(info.st_mode)
                else f"a file with {info.st_nlink} hard links"
                if stat.S_ISREG(info.st_mode) and info.st_nlink > 1
                else None
                if stat.S_ISREG(info.st_mode) or stat.S_ISDIR(info.st_mode)
                else _FILE_KINDS.get(stat.S_IFMT(info.st_mode), "a special file")
            )
            if what:
                found.append((os.path.relpath(path, folder), what))
        folders[:] = [name for name in folders if not os.path.islink(os.path.join(root, name))]
    return found


def remove_what_leads_out(folder: str) -> list[str]:
    """Remove what :func:`what_leads_out` finds under ``folder``; say what each was.

    >>> import os, tempfile
    >>> folder = tempfile.mkdtemp()
    >>> os.symlink("../../../gradebook.db", os.path.join(folder, "notes.txt"))
    >>> os.mkfifo(os.path.join(folder, "pipe"))
    >>> remove_what_leads_out(folder), os.listdir(folder)
    (['notes.txt: a symlink to ../../../gradebook.db', 'pipe: a FIFO'], [])
    """
    found = what_leads_out(folder)
    for relative, _ in found:
        os.unlink(os.path.join(folder, relative))
    return [f"{relative}: {what}" for relative, what in found]


_FILE_KINDS = {stat.S_IFIFO: "a FIFO", stat.S_IFSOCK: "a socket", stat.S_IFCHR: "a device", stat.S_IFBLK: "a device"}


def _clean(source: str) -> str:
    return "\n".join(line for line in source.splitlines() if line.strip() not in _MARKERS)


def _grade_id(cell) -> str | None:
    return cell.metadata.get("nbgrader", {}).get("grade_id")


def _verdict_outputs(verdict: Verdict) -> list:
    """A pass as printed text (full points); anything else as an error (zero), with what was measured."""
    if verdict.passed:
        return [nbformat.v4.new_output("stream", name="stdout", text=verdict.text() + "\n")]
    return [
        nbformat.v4.new_output(
            "error",
            ename=f"Grader{verdict.status.capitalize()}",
            evalue="; ".join(verdict.reasons),
            traceback=verdict.text().splitlines(),
        )
    ]


def _without_names(answer):
    """Handed-in answers with every configuration's ``name`` left out: a renamed configuration is the same answer."""
    if isinstance(answer, dict):
        return {key: _without_names(value) for key, value in answer.items() if key != "name"}
    return answer


def _gpus() -> list[str]:
    """The NVIDIA GPUs' models and the driver, as the driver reports them (no CUDA context is made for it)."""
    driver = Path("/proc/driver/nvidia/version")
    models = [
        next((line for line in path.read_text().splitlines() if line.startswith("Model:")), "")
        for path in sorted(Path("/proc/driver/nvidia/gpus").glob("*/information"))
    ]
    return [*models, driver.read_text().splitlines()[0]] if driver.exists() else models


@functools.cache
def _machine() -> list:
    """This machine (CPU and GPUs), its software and the grading code (every source file of perflab), as a cache key."""
    cpu = platform.processor()
    if Path("/proc/cpuinfo").exists():
        cpu = next(
            (line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("model name")), cpu
        )
    code = hashlib.sha256(b"".join(path.read_bytes() for path in sorted(Path(__file__).parents[1].rglob("*.py"))))
    return [
        cpu,
        os.cpu_count(),
        _gpus(),
        os.environ.get("PERFLAB_DEVICE", ""),
        os.environ.get("CUDA_VISIBLE_DEVICES", ""),
        importlib.metadata.version("torch"),
        code.hexdigest(),
    ]


def _verdict_key(job: dict, grade_id: str) -> str:
    """The same answer to the same cell of the same lab, graded by the same code and software on the same machine."""
    handed = job["lab"] == "lab12_capstone" and grade_id in MEASURED_CELLS["lab12_capstone"]
    answer = _without_names(job["handed_in"][grade_id]) if handed else job["cells"]["learner"]
    return hashlib.sha256(
        json.dumps([job["lab"], grade_id, answer, job["cells"]["course"], _machine()], sort_keys=True).encode()
    ).hexdigest()[:24]


class TrustedMeasurement(NbGraderPreprocessor):
    """Decide the cells of ``DECIDED_OUTSIDE`` outside the learner's kernel (see the module's docstring)."""

    timeout = Integer(1800, help="seconds the trusted grading of one notebook may take").tag(config=True)
    reuse_verdicts = Bool(
        True,
        help="give a cell the verdict measured earlier on this machine for the very same "
        "answer (a pass or a fail; never an inconclusive one, never a grading that failed)",
    ).tag(config=True)

    def preprocess(self, nb, resources):
        lab = resources["nbgrader"]["assignment"]
        measured = DECIDED_OUTSIDE.get(lab, ())
        cells = {_grade_id(cell): cell for cell in nb.cells if _grade_id(cell) in measured}
        if not cells:
            return nb, resources
        coursedir = CourseDirectory(config=self.config)
        source_path = os.path.join(
            coursedir.format_path(coursedir.source_directory, ".", lab), f"{resources['nbgrader']['notebook']}.ipynb"
        )
        source = nbformat.read(source_path, as_version=4)
        job = {
            "lab": lab,
            "cells": {
                "course": {
                    _grade_id(c): _clean(c.source) for c in source.cells if c.cell_type == "code" and _grade_id(c)
                },
                "learner": {
                    _grade_id(c): c.source
                    for c in nb.cells
                    if c.cell_type == "code" and _grade_id(c) and c.metadata["nbgrader"].get("solution")
                },
            },
            "handed_in": {},
            "cache_dir": os.path.join(coursedir.root, ".perflab-grading"),
        }
        for grade_id, cell in cells.items():
            try:
                job["handed_in"][grade_id] = handed_in(cell.get("outputs", []))
            except AnswerError as error:
                job["handed_in"][grade_id] = {"error": str(error)}
        student = resources["nbgrader"]["student"]
        keys = {grade_id: _verdict_key(job, grade_id) for grade_id in cells}
        verdicts = {grade_id: self._cached(job, key) for grade_id, key in keys.items()}
        verdicts = {grade_id: verdict for grade_id, verdict in verdicts.items() if verdict}
        to_measure = [grade_id for grade_id in cells if grade_id not in verdicts]
        if to_measure:
            self.log.info("Re-measuring %s of %s outside the kernel: %s", lab, student, ", ".join(to_measure))
            job["handed_in"] = {grade_id: job["handed_in"][grade_id] for grade_id in to_measure}
            measured = self._run(job)
            for grade_id, verdict in measured.items():
                if verdict.status in ("pass", "fail") and grade_id in keys:
                    path = Path(job["cache_dir"], "verdicts", f"{keys[grade_id]}.json")
                    path.parent.mkdir(parents=True, exist_ok=True)
                    path.write_text(json.dumps(verdict.to_dict()))
            verdicts.update(measured)
        for grade_id, cell in cells.items():
            verdict = verdicts.get(grade_id) or Verdict.refused("the grader gave no verdict for this cell")
            cell.outputs = _verdict_outputs(verdict)
            if verdict.status == "error":
                self.log.error(
                    "GRADING FAILED: %s / %s / %s not scored: grade it again (%s)",
                    student,
                    lab,
                    grade_id,
                    "; ".join(verdict.reasons),
                )
            elif verdict.status == "inconclusive":
                self.log.warning(
                    "INCONCLUSIVE: %s / %s / %s scored 0: re-grade it on a quiet machine (%s)",
                    student,
                    lab,
                    grade_id,
                    "; ".join(verdict.reasons[1:]),
                )
            else:
                self.log.info("%s / %s: %s", grade_id, verdict.status, verdict.measured)
        return nb, resources

    def _cached(self, job: dict, key: str) -> Verdict | None:
        path = Path(job["cache_dir"], "verdicts", f"{key}.json")
        if self.reuse_verdicts and path.exists():
            try:
                verdict = Verdict.from_dict(json.loads(path.read_text()))
            except ValueError:  # a file cut short (a full disk) or written by other code: measure again
                return None
            self.log.info("the same answer was measured before on this machine: reusing its verdict (%s)", path.name)
            return verdict
        return None

    def _run(self, job: dict) -> dict[str, Verdict]:
        """The verdicts of the trusted grading process (:mod:`perflab.grading.trusted_process`, kept for consecutive
        notebooks of a lab); "grading failed" for every cell if it fails or runs too long. On a machine lent to this
        grading, a grader that times answers runs on every core: it has the machine alone while it times."""
        env = None
        if lent_machine() and set(job["handed_in"]) & set(MEASURED_CELLS.get(job.get("lab"), ())):
            env = uncapped(os.environ)
        grader = TrustedGrader.for_job(job, env, log=self.log.warning)
        try:
            verdicts = grader.grade(job, timeout=self.timeout, log=self.log.info)
            return {cell: Verdict.from_dict(fields) for cell, fields in verdicts.items()}
        except GraderStopped as stopped:
            failure = str(stopped)
        except (ValueError, KeyError, TypeError, AttributeError) as error:
            grader.close(at_once=True)
            failure = f"the grader's verdicts could not be read ({type(error).__name__})"
        self.log.error("%s:\n%s", failure, grader.said())
        return {grade_id: Verdict.grading_failed(f"{failure}; tell your instructor") for grade_id in job["handed_in"]}
