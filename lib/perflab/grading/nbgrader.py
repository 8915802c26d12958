"""nbgrader's autograde with a sandboxed kernel and the trusted re-measurement of measured cells.

    # nbgrader_config.py
    from perflab.grading.nbgrader import AUTOGRADE_PREPROCESSORS
    c.Autograde.autograde_preprocessors = AUTOGRADE_PREPROCESSORS

nbgrader's own autograde steps, with two changes: ``SandboxedExecute`` runs the submission in a
bubblewrap sandbox (:mod:`perflab.grading.sandbox`), and ``TrustedMeasurement``, after the
kernel has ended and before ``SaveAutoGrades`` reads the outputs, replaces each measured cell's
output with what the trusted grader measured: a pass prints the measurement, a fail or an
inconclusive measurement raises it as an error, which scores zero and shows in the feedback.

Used by nbgrader_config.py, the course's nbgrader configuration.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import json
import os
import platform
import subprocess
import tempfile
from pathlib import Path

import nbformat
from jupyter_client.manager import AsyncKernelManager
from nbgrader.coursedir import CourseDirectory
from nbgrader.preprocessors import Execute, NbGraderPreprocessor
from traitlets import Bool, Integer

from perflab.grading import MEASURED_CELLS
from perflab.grading.answers import AnswerError, handed_in
from perflab.grading.sandbox import require_sandbox, sandbox_command, trusted_python
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

    hidden_paths: list[str] = []

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self._socket_dir = tempfile.mkdtemp(prefix="perflab-kernel-")
        self.transport = "ipc"
        self.ip = os.path.join(self._socket_dir, "kernel")

    async def _async_launch_kernel(self, kernel_cmd: list[str], **kw) -> None:
        if require_sandbox():
            workdir = os.path.abspath(kw.get("cwd") or os.getcwd())
            kernel_cmd = sandbox_command(
                kernel_cmd,
                workdir=workdir,
                hidden=self.hidden_paths,
                readable=[os.path.abspath(self.connection_file)],
                writable=[self._socket_dir],
            )
        await super()._async_launch_kernel(kernel_cmd, **kw)


class SandboxedExecute(Execute):
    """nbgrader's Execute, with each submission's kernel in the sandbox and the course folder hidden from it."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("kernel_manager_class", SandboxedKernelManager)
        super().__init__(*args, **kwargs)

    def create_kernel_manager(self):
        manager = super().create_kernel_manager()
        manager.hidden_paths = [CourseDirectory(config=self.config).root]
        return manager


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


@functools.cache
def _machine() -> list:
    """This machine, its software and the grading code (every source file of perflab), as a cache key."""
    cpu = platform.processor()
    if Path("/proc/cpuinfo").exists():
        cpu = next(
            (line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("model name")), cpu
        )
    code = hashlib.sha256(b"".join(path.read_bytes() for path in sorted(Path(__file__).parents[1].rglob("*.py"))))
    return [
        cpu,
        os.cpu_count(),
        os.environ.get("PERFLAB_DEVICE", ""),
        importlib.metadata.version("torch"),
        code.hexdigest(),
    ]


def _verdict_key(job: dict, grade_id: str) -> str:
    """The same answer to the same cell of the same lab, graded by the same code and software on the same machine."""
    answer = _without_names(job["handed_in"][grade_id]) if job["lab"] == "lab10_capstone" else job["cells"]["learner"]
    return hashlib.sha256(
        json.dumps([job["lab"], grade_id, answer, job["cells"]["course"], _machine()], sort_keys=True).encode()
    ).hexdigest()[:24]


class TrustedMeasurement(NbGraderPreprocessor):
    """Decide the measured cells of ``MEASURED_CELLS`` outside the learner's kernel (see the module's docstring)."""

    timeout = Integer(1800, help="seconds the trusted grading of one notebook may take").tag(config=True)
    reuse_verdicts = Bool(
        True,
        help="give a cell the verdict measured earlier on this machine for the very same "
        "answer (a pass or a fail, never an inconclusive one)",
    ).tag(config=True)

    def preprocess(self, nb, resources):
        lab = resources["nbgrader"]["assignment"]
        measured = MEASURED_CELLS.get(lab, ())
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
                if verdict.status != "inconclusive" and grade_id in keys:
                    path = Path(job["cache_dir"], "verdicts", f"{keys[grade_id]}.json")
                    path.parent.mkdir(parents=True, exist_ok=True)
                    path.write_text(json.dumps(verdict.to_dict()))
            verdicts.update(measured)
        for grade_id, cell in cells.items():
            verdict = verdicts.get(grade_id) or Verdict.refused("the grader gave no verdict for this cell")
            cell.outputs = _verdict_outputs(verdict)
            if verdict.status == "inconclusive":
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
            self.log.info("the same answer was measured before on this machine: reusing its verdict (%s)", path.name)
            return Verdict.from_dict(json.loads(path.read_text()))
        return None

    def _run(self, job: dict) -> dict[str, Verdict]:
        with tempfile.TemporaryFile("w+") as errors:
            process = subprocess.Popen(
                trusted_python("perflab.grading.session"),
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            process.stdin.write(json.dumps(job))
            process.stdin.close()
            for line in process.stderr:
                if line.startswith("grader: "):
                    self.log.info(line.rstrip())
                else:
                    errors.write(line)
            try:
                process.wait(timeout=self.timeout)
            except subprocess.TimeoutExpired:
                process.kill()
            output = process.stdout.read()
            if process.returncode != 0:
                errors.seek(0)
                failure = f"the grader itself failed (exit {process.returncode}); tell your instructor"
                self.log.error("%s:\n%s", failure, errors.read()[-4000:])
                return {grade_id: Verdict.refused(failure) for grade_id in job["handed_in"]}
        return {cell: Verdict.from_dict(fields) for cell, fields in json.loads(output.strip().splitlines()[-1]).items()}
