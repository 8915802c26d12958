"""The trusted grading process, started once and kept for the next notebook of the same lab.

    grader = TrustedGrader.for_job(job, env=None)   # the live one for this lab, or a fresh one
    grader.grade(job, timeout=1800, log=print)      # {grade_id: {...verdict...}}, or raises GraderStopped

``nbgrader autograde`` grades one notebook after another, and starting the trusted process
(``python -I -S``, then torch) costs seconds each time. One process therefore grades every
notebook of a lab, one job after another (:mod:`perflab.grading.session` reads a job per line and
writes a line of verdicts per job). It runs only the course's code: each learner's cells run in
sandboxed children of their own, and what comes back is plain data. Between jobs it drops the
modules that the course's cells imported from their working folders, so each job starts as a
fresh process would, but for what torch and perflab loaded.

Its output goes to files, never to pipes that could fill while nobody reads them. A job that runs
past its limit, a process that dies or answers what cannot be read, ends the process (its whole
process group is killed): the next job starts a fresh one.

Used by perflab.grading.nbgrader (TrustedMeasurement).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import signal
import subprocess
import tempfile
import time

from perflab.grading.sandbox import trusted_python

__all__ = ["GraderStopped", "TrustedGrader"]


class GraderStopped(Exception):
    """The trusted process gave no verdicts for a job: it failed, answered garbage or ran past its limit."""


class TrustedGrader:
    """One trusted grading process, for the jobs of one lab in one environment (see the module's docstring)."""

    _live: TrustedGrader | None = None  # at most one: a job of another lab closes the one before

    def __init__(self, key: tuple, env: dict[str, str] | None):
        self.key = key
        self._out = tempfile.TemporaryFile("w+")  # noqa: SIM115 - as long as the process
        self._errors = tempfile.NamedTemporaryFile("w+", prefix="perflab-grader-")  # noqa: SIM115
        self._errors_reader = open(self._errors.name, errors="replace")  # noqa: SIM115 - an offset of our own
        self._answered, self._said = 0, ""
        self.process = subprocess.Popen(
            trusted_python("perflab.grading.session"),
            stdin=subprocess.PIPE,
            stdout=self._out,
            stderr=self._errors,
            text=True,
            start_new_session=True,
            env=env,
        )

    def __repr__(self) -> str:
        state = "running" if self.process.poll() is None else f"ended ({self.process.returncode})"
        return f"TrustedGrader({self.key[0]!r}, pid {self.process.pid}, {self._answered} jobs, {state})"

    @classmethod
    def for_job(cls, job: dict, env: dict[str, str] | None) -> TrustedGrader:
        """The live process for ``job``'s lab and ``env`` (started by the same command), or a fresh one."""
        key = (job.get("lab"), json.dumps(env, sort_keys=True), tuple(trusted_python("perflab.grading.session")))
        live = cls._live
        if live is not None and live.key == key and live.process.poll() is None:
            return live
        if live is not None:
            live.close()
        cls._live = cls(key, env)
        return cls._live

    def grade(self, job: dict, *, timeout: float, log) -> dict:
        """The verdicts of ``job`` (as the session wrote them); the process's ``grader:`` lines go to ``log``."""
        try:
            self.process.stdin.write(json.dumps(job) + "\n")
            self.process.stdin.flush()
        except OSError:  # it ended before the job reached it: what it wrote says why
            pass
        line, returncode = self._next_line(time.monotonic() + timeout, log)
        if line is None:
            self.close(at_once=True)
            if returncode is None:
                raise GraderStopped(f"the grader ran past its limit of {timeout:g} s and was stopped")
            if returncode != 0:
                raise GraderStopped(f"the grader itself failed (exit {returncode})")
            raise GraderStopped("the grader's verdicts could not be read (it ended without them)")
        try:
            verdicts = json.loads(line)
            if not isinstance(verdicts, dict):
                raise TypeError(type(verdicts).__name__)
        except (ValueError, TypeError) as error:
            self.close(at_once=True)
            raise GraderStopped(f"the grader's verdicts could not be read ({type(error).__name__})") from None
        return verdicts

    def what_it_said(self) -> str:
        """The end of what the process wrote to its standard error (until it was closed)."""
        if not self._errors.closed:
            self._errors.seek(0)
            self._said = self._errors.read()[-4000:]
        return self._said

    def _next_line(self, deadline: float, log) -> tuple[str | None, int | None]:
        """The next whole line of verdicts, and None with the exit status (None: it ran past ``deadline``) if none
        came; ``grader:`` lines are logged as they come."""
        pending = ""
        while True:
            returncode = self.process.poll()
            *lines, pending = (pending[-10_000:] + self._errors_reader.read()).split("\n")
            for line in lines:
                if line.startswith("grader: "):
                    log(line[:500])
            self._out.seek(0)
            answers = self._out.read().split("\n")[:-1]  # whole lines only: the last may still be written
            if len(answers) > self._answered:
                self._answered += 1
                return answers[self._answered - 1], None
            if returncode is not None:
                return None, returncode
            if time.monotonic() > deadline:
                return None, None
            time.sleep(0.2)

    def close(self, *, at_once: bool = False) -> None:
        """End the process (its whole group: the children it started), ``at_once`` or after the job it may be
        finishing, and drop its files."""
        if self.process.poll() is None and not at_once:
            with contextlib.suppress(OSError):
                self.process.stdin.close()  # an idle session ends at the end of its input
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(timeout=5)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()
        with contextlib.suppress(OSError):
            self.process.stdin.close()
        self.what_it_said()
        for file in (self._out, self._errors_reader, self._errors):
            file.close()
        if TrustedGrader._live is self:
            TrustedGrader._live = None


@atexit.register
def _close_live() -> None:
    if TrustedGrader._live is not None:
        TrustedGrader._live.close()
