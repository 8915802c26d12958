"""The trusted grading process, kept for the next notebook when it is of the same lab.

    grader = TrustedGrader.for_job(job, env=None, log=print)   # the live one for this lab, or a fresh one
    grader.grade(job, timeout=1800, log=print)                 # {grade_id: {...verdict...}}, or raises GraderStopped

Starting the trusted process (``python -I -S``, then torch) costs seconds. One process therefore
grades consecutive notebooks of one lab, as ``nbgrader autograde lab05_memory`` hands them over, one job
after another (:mod:`perflab.grading.session` reads a job per line and writes a line of verdicts
per job); a notebook of another lab, or one that needs another environment, gets a fresh one. It
runs only the course's code: each learner's cells run in sandboxed children of their own, and
what comes back is plain data. After each job the session puts back what the course's cells may
have changed of the process (modules imported from their folders, the environment, torch's
threads, random state and compilation caches).

Its output goes to files, read with offsets of their own, and each job goes to it from a thread:
nothing waits on a pipe without a deadline. A job that runs past its limit, a process that dies
or answers what cannot be read, ends the process (its whole process group is killed): the next
job starts a fresh one.

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
import threading
import time

from perflab.grading.sandbox import trusted_python

__all__ = ["GraderStopped", "TrustedGrader"]


class GraderStopped(Exception):
    """The trusted process gave no verdicts for a job: it failed, answered garbage or ran past its limit."""


def _file_pair() -> tuple:
    """A file for the process to write (its own offset) and one for us to read (ours), with no name left behind."""
    with tempfile.NamedTemporaryFile("w", prefix="perflab-grader-", delete=False) as named:
        path = named.name
    try:
        return open(path, "w"), open(path, errors="replace")  # noqa: SIM115 - as long as the process
    finally:
        os.unlink(path)


class TrustedGrader:
    """One trusted grading process, for the jobs of one lab in one environment (see the module's docstring)."""

    _live: TrustedGrader | None = None  # at most one: a job of another lab closes the one before

    def __init__(self, key: tuple, env: dict[str, str] | None):
        self.key = key
        (out, self._out), (errors, self._errors) = _file_pair(), _file_pair()
        self._pending, self._said, self._closed = "", "", False
        with out, errors:
            self.process = subprocess.Popen(
                trusted_python("perflab.grading.session"),
                stdin=subprocess.PIPE,
                stdout=out,
                stderr=errors,
                text=True,
                start_new_session=True,
                env=env,
            )
        atexit.register(self.close)  # after pristine_perflab's cleanup was registered: so it runs before it

    def __repr__(self) -> str:
        state = "running" if self.process.poll() is None else f"ended ({self.process.returncode})"
        return f"TrustedGrader({self.key[0]!r}, pid {self.process.pid}, {state})"

    @classmethod
    def for_job(cls, job: dict, env: dict[str, str] | None, log=lambda line: None) -> TrustedGrader:
        """The live process for ``job``'s lab and ``env`` (started by the same command), or a fresh one."""
        key = (job.get("lab"), json.dumps(env, sort_keys=True), tuple(trusted_python("perflab.grading.session")))
        live = cls._live
        if live is not None and live.key == key and live.process.poll() is None:
            return live
        if live is not None:
            if live.process.poll() is not None:
                log(f"the trusted grader had ended between notebooks (exit {live.process.returncode}):\n{live.said()}")
            live.close()
        cls._live = cls(key, env)
        return cls._live

    def grade(self, job: dict, *, timeout: float, log) -> dict:
        """The verdicts of ``job`` (as the session wrote them); the process's ``grader:`` lines go to ``log``."""
        threading.Thread(target=self._send, args=(json.dumps(job) + "\n",), daemon=True).start()
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

    def said(self) -> str:
        """The end of what the process wrote to its standard error (until it was closed)."""
        if not self._errors.closed:
            self._errors.seek(0)
            self._said = self._errors.read()[-4000:]
        return self._said

    def _send(self, text: str) -> None:
        with contextlib.suppress(OSError, ValueError):  # it ended (or was closed): its output says why
            self.process.stdin.write(text)
            self.process.stdin.flush()

    def _log_progress(self, log) -> None:
        *lines, self._pending = (self._pending[-10_000:] + self._errors.read()).split("\n")
        for line in lines:
            if line.startswith("grader: "):
                log(line[:500])

    def _next_line(self, deadline: float, log) -> tuple[str | None, int | None]:
        """The job's line of verdicts; or None and the exit status (None: it ran past ``deadline``) if it gave none."""
        answer = ""
        while True:
            returncode = self.process.poll()
            answer += self._out.read()  # first: what it wrote before its verdicts is on stderr by now
            self._log_progress(log)
            if "\n" in answer:
                return answer.partition("\n")[0], None
            if returncode is not None:
                return None, returncode
            if time.monotonic() > deadline:
                return None, None
            time.sleep(0.2)

    def close(self, *, at_once: bool = False) -> None:
        """End the process (its whole group: the children it started): an idle one at the end of its input, within 5 s,
        or ``at_once``; then drop its files."""
        if self._closed:
            return
        self._closed = True
        if self.process.poll() is None and not at_once:
            with contextlib.suppress(OSError):
                self.process.stdin.close()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(timeout=5)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()
        self.said()
        for file in (self.process.stdin, self._out, self._errors):
            with contextlib.suppress(OSError):
                file.close()
        atexit.unregister(self.close)
        if TrustedGrader._live is self:
            TrustedGrader._live = None
