"""Ranks of a learner's distributed code, started once in one sandbox and driven by the grader, read from outside.

In the trusted grader (starting ranks takes seconds, so this is shown, not run)::

    group = RankGroup(4, cells=[("setup", "import torch")], handlers="perflab.grading.megatron_lab_ranks")
    group.call("lab11_world", ranks=2, store="/tmp/world-1")         # ranks 0 and 1 form a world of 2
    before = group.readings()
    group.call("lab11_forward", ranks=2, payloads=[x_bytes, x_bytes])
    sent = group.readings() - before           # Readings(loopback 524,288 B; written per rank 262,188, 262,188)
    group.close()

Every rank runs :mod:`perflab.grading.child` (the cells, then one ``child_*`` handler per request)
and talks to the grader through pipes the grader made and handed into the sandbox, so nothing in
the sandbox relays a reply. A launcher in the sandbox, which runs no learner code, imports torch
and the handlers once and forks every rank from itself: the ranks share its pages until they write
them, one import for all. All ranks share one bubblewrap sandbox, and so one network namespace:
gloo's connections run over a loopback interface that only they use. The sandbox mounts ``/proc``
read-only. From outside, the grader reads what the learner's code, which runs in the ranks, cannot
change:

- ``loopback``: bytes sent through the sandbox's loopback by all ranks together, from its own
  ``/proc/<pid>/net/dev`` (TCP/IP headers included, files and pipes not);
- ``written``: each rank's ``wchar`` in ``/proc/<pid>/io``: every byte it passed to ``write`` or
  ``writev``, gloo's socket sends included, its prints too;
- each rank's peak resident memory (``VmHWM``), reset with :meth:`RankGroup.reset_peaks` through
  ``/proc/<pid>/clear_refs``, which the ranks cannot write; and any process of the sandbox that is
  not a rank or the launcher (:meth:`RankGroup.strangers`).

    >>> Readings(1000, (400, 600)) - Readings(200, (100, 100))
    Readings(loopback 800 B; written per rank 300, 500)
    >>> Readings(None, (400, 600)) - Readings(None, (100, 100))   # unsandboxed: the host's loopback, not read
    Readings(loopback not read; written per rank 300, 500)

Used by perflab.grading.megatron_lab.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import psutil

from perflab.grading.child import ChildError, ChildLost, read_frame, send_frame
from perflab.grading.sandbox import pristine_perflab, require_sandbox, sandbox_command, trusted_python

__all__ = ["RankGroup", "Readings"]

# Each rank: one thread on two cores, and every large buffer in its own mapping (glibc), so that a rank's resident
# memory follows what it allocates rather than what an earlier free left in its heap.
_RANK_ENVIRONMENT = {"OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": "65536"}


@dataclass(frozen=True)
class Readings:
    """What the ranks sent so far, as the kernel counts it: the sandbox's loopback and each rank's written bytes."""

    loopback: int | None  # None: the ranks have no network of their own (no sandbox), whose loopback others share
    written: tuple[int, ...]

    def __sub__(self, earlier: Readings) -> Readings:
        loopback = None if self.loopback is None or earlier.loopback is None else self.loopback - earlier.loopback
        return Readings(loopback, tuple(a - b for a, b in zip(self.written, earlier.written)))

    def __repr__(self) -> str:
        loopback = "not read" if self.loopback is None else f"{self.loopback:,} B"
        return f"Readings(loopback {loopback}; written per rank {', '.join(f'{w:,}' for w in self.written)})"


class RankGroup:
    """``size`` rank processes in one sandbox, each having run ``cells``; requests go to the first ``ranks``."""

    def __init__(
        self,
        size: int,
        cells: list[tuple[str, str]],
        *,
        handlers: str,
        timeout_s: float = 60,
        setup_timeout_s: float = 120,
    ):
        self.timeout_s = timeout_s
        self.workdir = tempfile.mkdtemp(prefix="perflab-ranks-")
        self.log = tempfile.TemporaryFile()
        pipes = [(os.pipe(), os.pipe()) for _ in range(size)]  # (requests, replies): (read end, write end) each
        inside = [(requests[0], replies[1]) for requests, replies in pipes]
        command = trusted_python(__name__)
        self.own_network = require_sandbox()  # a sandbox is a network namespace of its own: its loopback is theirs
        if self.own_network:
            command = sandbox_command(
                command, workdir=self.workdir, readable=[pristine_perflab()], env=_RANK_ENVIRONMENT, read_only_proc=True
            )
        self.process = subprocess.Popen(
            command,
            cwd=self.workdir,
            pass_fds=[fd for pair in inside for fd in pair],
            env={**os.environ, **_RANK_ENVIRONMENT},
            stdin=subprocess.PIPE,
            stdout=self.log,
            stderr=self.log,
            start_new_session=True,
        )
        for fd in (fd for pair in inside for fd in pair):
            os.close(fd)
        self._requests = [os.fdopen(requests[1], "wb") for requests, _ in pipes]
        self._replies = [os.fdopen(replies[0], "rb") for _, replies in pipes]
        self._inodes = [os.fstat(requests.fileno()).st_ino for requests in self._requests]
        self.pids: list[int] = []
        try:
            with self.process.stdin:
                self.process.stdin.write(json.dumps({"pipes": inside, "handlers": handlers}).encode())
            replies = self._exchange([{"cells": cells, "handlers": handlers}] * size, [b""] * size, setup_timeout_s)
            for rank, (header, _) in enumerate(replies):
                if "error" in header:
                    raise ChildError(f"rank {rank}: {header['error']}")
            self.pids = self._rank_pids()
        except BaseException:
            self.close()
            raise

    @property
    def size(self) -> int:
        return len(self._requests)

    def call(self, name: str, ranks: int, payloads: list[bytes] | None = None, **args):
        """Send request ``name`` to ranks ``0 .. ranks-1`` (each gets ``rank``, ``world`` and ``args``), wait for all
        of them; returns each rank's (result, payload). ``ChildError`` names the first rank whose answer failed;
        ``ChildLost`` when they did not all answer within ``timeout_s`` (the whole group is stopped then)."""
        payloads = payloads or [b""] * ranks
        headers = [{"call": name, "args": {**args, "rank": rank, "world": ranks}} for rank in range(ranks)]
        replies = self._exchange(headers, payloads, self.timeout_s)
        for rank, (header, _) in enumerate(replies):
            if "error" in header:
                raise ChildError(f"rank {rank}: {header['error']}")
        return [(header.get("result"), payload) for header, payload in replies]

    def _exchange(self, headers: list[dict], payloads: list[bytes], timeout_s: float) -> list[tuple[dict, bytes]]:
        if self.process.poll() is not None:
            raise ChildError(f"the ranks' sandbox has ended (exit {self.process.returncode}): {self.output_tail()}")
        timer = threading.Timer(timeout_s, self._stop)
        timer.start()
        try:
            # Every request first: the ranks meet in collectives, so none may wait for the grader to ask another.
            for rank, (header, payload) in enumerate(zip(headers, payloads)):
                send_frame(self._requests[rank], header, payload)
            with ThreadPoolExecutor(max_workers=len(headers)) as pool:
                return list(pool.map(read_frame, self._replies[: len(headers)]))
        except (EOFError, BrokenPipeError) as error:
            if not timer.is_alive():
                raise ChildLost(f"the ranks did not all answer within {timeout_s:g} s: {self.output_tail()}") from None
            raise ChildError(f"a rank's process ended ({error}): {self.output_tail()}") from None
        except (ValueError, UnicodeDecodeError) as error:  # a rank's code wrote to the grader's pipe itself
            raise ChildError(f"a rank's reply is not one the course's code sends: {error}") from None
        finally:
            timer.cancel()

    def _stop(self) -> None:
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass

    def _tree(self) -> list[psutil.Process]:
        try:
            return psutil.Process(self.process.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []

    def _rank_pids(self) -> list[int]:
        """Each rank's process as the host sees it: the one whose stdin is the pipe the grader writes its requests to
        (and not a process it forked, which inherits that stdin)."""
        holders: dict[int, list[psutil.Process]] = {}
        for process in self._tree():
            try:
                holders.setdefault(os.stat(f"/proc/{process.pid}/fd/0").st_ino, []).append(
                    (process.pid, process.ppid())
                )
            except (OSError, psutil.Error):
                continue
        pids = []
        for rank, inode in enumerate(self._inodes):
            found = dict(holders.get(inode, []))
            first = [pid for pid, parent in found.items() if parent not in found]
            if len(first) != 1:
                raise ChildError(f"rank {rank}'s process is not in the sandbox, or not alone on its requests' pipe")
            pids.append(first[0])
        return pids

    def strangers(self) -> list[str]:
        """Processes of the sandbox other than the ranks, their launcher and bubblewrap's own: what the answer started."""
        try:
            launcher = psutil.Process(self.pids[0]).ppid()
        except psutil.Error as error:
            raise ChildError(f"a rank's process has ended: {error}") from None
        bwrap = os.path.realpath(shutil.which("bwrap") or "bwrap")
        found = []
        for process in self._tree():
            try:
                if process.pid in (*self.pids, launcher) or os.path.realpath(process.exe()) == bwrap:
                    continue
                found.append(f"pid {process.pid}: {' '.join(process.cmdline())[:80]}")
            except psutil.Error:
                continue
        return found

    def readings(self) -> Readings:
        loopback = _loopback_sent(self.pids[0]) if self.own_network else None
        return Readings(loopback, tuple(_proc_field(pid, "io", "wchar") for pid in self.pids))

    def reset_peaks(self) -> None:
        """Start every rank's peak resident memory again from its resident memory now."""
        for pid in self.pids:
            try:
                with open(f"/proc/{pid}/clear_refs", "w") as clear_refs:
                    clear_refs.write("5")
            except OSError as error:
                raise ChildError(f"a rank's process has ended: {error}") from None

    def resident(self) -> list[int]:
        return [_proc_field(pid, "status", "VmRSS") * 1024 for pid in self.pids]

    def peaks(self) -> list[int]:
        return [_proc_field(pid, "status", "VmHWM") * 1024 for pid in self.pids]

    def output_tail(self, characters: int = 1500) -> str:
        """The end of the ranks' own output (each rank's log, then the sandbox's)."""
        logs = []
        for rank in range(self.size):
            path = os.path.join(self.workdir, f"rank{rank}.log")
            if os.path.exists(path):
                with open(path, "rb") as log:
                    logs.append(f"[rank {rank}] " + log.read().decode(errors="replace")[-characters:])
        self.log.seek(0)
        logs.append(self.log.read().decode(errors="replace")[-characters:])
        return "\n".join(log for log in logs if log.strip())[-characters:]

    def close(self) -> None:
        self._stop()
        self.process.wait()
        for stream in self._requests + self._replies:
            try:
                stream.close()
            except OSError:
                pass
        self.log.close()
        shutil.rmtree(self.workdir, ignore_errors=True)


def _proc_field(pid: int, name: str, field: str) -> int:
    try:
        with open(f"/proc/{pid}/{name}") as lines:
            return next(int(line.split(":")[1].split()[0]) for line in lines if line.startswith(field + ":"))
    except OSError as error:
        raise ChildError(f"a rank's process has ended: {error}") from None


def _loopback_sent(pid: int) -> int:
    """Bytes sent through the loopback of ``pid``'s network namespace."""
    try:
        with open(f"/proc/{pid}/net/dev") as counters:
            for line in counters:
                name, _, fields = line.partition(":")
                if name.strip() == "lo":
                    return int(fields.split()[8])  # receive: 8 fields, then transmit: bytes first
    except OSError as error:
        raise ChildError(f"a rank's process has ended: {error}") from None
    raise ChildLost("the ranks' network namespace has no loopback")


def main() -> None:
    """The launcher, in the sandbox: import torch and the handlers once, then fork every rank from this process (they
    share its pages until they write them: one import for all), each on the pipes it was handed; wait for them."""
    spec = json.loads(sys.stdin.read())
    import importlib

    import torch

    from perflab.grading import child

    torch.set_num_threads(1)
    importlib.import_module(spec["handlers"])
    sys.stdout.flush()
    sys.stderr.flush()
    ranks = []
    for rank, (requests, replies) in enumerate(spec["pipes"]):
        pid = os.fork()
        if pid == 0:  # no learner code has run in this process before: it runs in the ranks alone
            log = os.open(f"rank{rank}.log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            for fd, target in ((requests, 0), (replies, 1), (log, 2)):
                os.dup2(fd, target)
            os.closerange(3, 1 << 16)
            sys.stdin = open(0, closefd=False)
            try:
                child.main()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(0)
        ranks.append(pid)
    for pipe in spec["pipes"]:
        for fd in pipe:
            os.close(fd)
    for pid in ranks:
        os.waitpid(pid, 0)


if __name__ == "__main__":
    main()
