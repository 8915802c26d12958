"""One machine, shared by the work that runs on it and taken alone by a measurement.

    >>> import tempfile
    >>> from pathlib import Path
    >>> machine = MachineLock(Path(tempfile.mkdtemp()) / "machine.lock")
    >>> with machine.shared():      # a kernel runs, a test runs: other work may run beside it
    ...     pass
    >>> with machine.alone():       # a measurement: waits for the work running now, and new work waits for it
    ...     pass

A readers-writer lock on two files (``flock``): work holds the lock shared while it runs; ``alone()``
passes a turnstile first, so a measurement waiting there goes before any work that asks after it. The
operating system releases a process's locks when it ends.

A process that starts gradings can hand them the machine (``lent``): it drops its own share, and each
``nbgrader autograde`` it starts with :func:`MachineLock.environment` in its environment takes the lock
itself (:func:`lent_machine`): shared while a cell of a learner's kernel runs
(:mod:`perflab.grading.nbgrader`) and while the trusted grader runs (:mod:`perflab.grading.session`),
alone only while the grader times answers (:class:`perflab.grading.verdict.LoadMeter`). A measured
grading then leaves the machine to other work while the learner's kernel runs, which needs no quiet
machine, and a grading that times nothing never waits for it.

Used by perflab.grading.nbgrader, perflab.grading.working_copy and the test suite (conftest.py).
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import os
from collections.abc import Iterator
from pathlib import Path

__all__ = ["LOCK_VARIABLE", "THREAD_CAPS", "MachineLock", "lent_machine", "uncapped"]

# Names the lock file to the gradings a process lent the machine to.
LOCK_VARIABLE = "PERFLAB_MACHINE_LOCK"
# The variables that cap a process's threads (OpenMP's, MKL's, OpenBLAS's), as Dask's nanny sets them: work that
# shares the machine runs on its share of the cores; a measurement, alone, runs on every core.
THREAD_CAPS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")


class MachineLock:
    """The machine's lock in file ``path`` (and its turnstile beside it): see the module's docstring."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self._lock = open(self.path, "a")  # noqa: SIM115 - held as long as this object
        self._turnstile = open(self.path.with_name(self.path.name + ".turnstile"), "a")  # noqa: SIM115
        self._shared = self._alone = False

    def __repr__(self) -> str:
        held = ", alone" if self._alone else ", shared" if self._shared else ""
        return f"MachineLock({str(self.path)!r}{held})"

    def environment(self) -> dict[str, str]:
        """What to add to the environment of a grading that takes this lock itself (see ``lent``)."""
        return {LOCK_VARIABLE: str(self.path)}

    def _take_a_share(self) -> None:
        # Through the turnstile first: a measurement waiting there goes before any work that comes after it.
        fcntl.flock(self._turnstile, fcntl.LOCK_EX)
        fcntl.flock(self._turnstile, fcntl.LOCK_UN)
        fcntl.flock(self._lock, fcntl.LOCK_SH)
        self._shared = True

    def _give_the_share_back(self) -> None:
        self._shared = False
        fcntl.flock(self._lock, fcntl.LOCK_UN)

    @contextlib.contextmanager
    def shared(self) -> Iterator[None]:
        self._take_a_share()
        try:
            yield
        finally:
            self._give_the_share_back()

    @contextlib.contextmanager
    def alone(self) -> Iterator[None]:
        if self._alone:  # a measurement within a measurement: the machine is this process's already
            yield
            return
        with self.lent():  # this process's own share would keep it waiting
            fcntl.flock(self._turnstile, fcntl.LOCK_EX)
            try:
                fcntl.flock(self._lock, fcntl.LOCK_EX)
                self._alone = True
                try:
                    yield
                finally:
                    self._alone = False
                    fcntl.flock(self._lock, fcntl.LOCK_UN)
            finally:
                fcntl.flock(self._turnstile, fcntl.LOCK_UN)

    @contextlib.contextmanager
    def lent(self) -> Iterator[None]:
        """Within the block this process holds no share: what it starts takes the machine itself."""
        was_shared = self._shared
        if was_shared:
            self._give_the_share_back()
        try:
            yield
        finally:
            if was_shared:
                self._take_a_share()


@functools.cache
def lent_machine() -> MachineLock | None:
    """The machine's lock, one per process, if the process that started this one lent it the machine (by
    :meth:`MachineLock.environment`); None otherwise: a grading started by hand takes no lock."""
    path = os.environ.get(LOCK_VARIABLE)
    return MachineLock(Path(path)) if path else None


def uncapped(environ) -> dict[str, str]:
    """``environ`` without :data:`THREAD_CAPS`: for a process that measures alone, on every core.

    >>> uncapped({"OMP_NUM_THREADS": "1", "HOME": "/home/ada"})
    {'HOME': '/home/ada'}
    """
    return {name: value for name, value in environ.items() if name not in THREAD_CAPS}
