"""A learner's answer, run in a sandboxed child process that the trusted grader times from outside.

In the grader, with the lab's cells and the learner's as nbgrader stored them (a child that runs a
lab's cells takes seconds to start, so this is shown, not run)::

    child = AnswerProcess([("setup", lab_source), ("answer", learner_source)], handlers="perflab.grading.code_labs")
    reply, payload, seconds = child.call("lab02_run", steps=4, seed=123)   # the parent's clock, not the child's
    child.close()

The child runs the cells (the lab's own and the learner's), then answers requests: one
``handlers`` function each, called with the cells' namespace. The parent thaws the child before a
request and stops it (SIGSTOP, its whole process tree) as soon as the reply is in, until every
thread of the tree is seen stopped at one moment, so nothing the learner's code starts in the
background can run while the other side is measured; an ``IdleWatch`` tells the rounds in which a
frozen child gained CPU time all the same. Messages are length-prefixed frames of JSON plus raw
bytes: nothing from the child is ever unpickled.

    >>> import io
    >>> from perflab.grading.child import read_frame, send_frame
    >>> pipe = io.BytesIO()
    >>> send_frame(pipe, {"call": "lab02_run", "args": {"steps": 4, "seed": 123}}, b"raw bytes")
    >>> _ = pipe.seek(0)
    >>> read_frame(pipe)
    ({'call': 'lab02_run', 'args': {'steps': 4, 'seed': 123}}, b'raw bytes')

Used by perflab.grading.code_labs and perflab.grading.data_lab.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import linecache
import os
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time
import traceback

import psutil

from perflab.grading.sandbox import pristine_perflab, require_sandbox, sandbox_command, trusted_python
from perflab.grading.verdict import Verdict, tree_cpu_seconds

__all__ = [
    "FREEZE_LIMIT_S",
    "IDLE_CPU_EPSILON_S",
    "AnswerProcess",
    "ChildError",
    "ChildLost",
    "IdleWatch",
    "main",
    "remember_source",
    "read_frame",
    "send_frame",
    "verdict_of",
]

_LENGTHS = struct.Struct("<II")
_MAX_HEADER = 1 << 20
_MAX_PAYLOAD = 256 << 20
FREEZE_LIMIT_S = 3.0
IDLE_CPU_EPSILON_S = 0.005  # a frozen tree gains no CPU time at all; /proc counts it in 10 ms ticks


class ChildError(RuntimeError):
    """The child failed to run a cell or to answer a request; the message says what the learner's code raised."""


class ChildLost(ChildError):
    """The grading lost the child: it did not answer in time, was killed by a signal (out of memory, say), or could
    not be frozen. No verdict on the answer: that grading failed, and is not scored."""


def verdict_of(error: ChildError) -> Verdict:
    """What a child's error decides: a lost child is the grading's failure (not scored), any other the answer's."""
    return Verdict.grading_failed(str(error)) if isinstance(error, ChildLost) else Verdict.refused(str(error))


def send_frame(stream, header: dict, payload: bytes = b"") -> None:
    body = json.dumps(header).encode()
    stream.write(_LENGTHS.pack(len(body), len(payload)) + body + payload)
    stream.flush()


def read_frame(stream) -> tuple[dict, bytes]:
    lengths = stream.read(_LENGTHS.size)
    if len(lengths) < _LENGTHS.size:
        raise EOFError("the other side closed the pipe")
    header_length, payload_length = _LENGTHS.unpack(lengths)
    if header_length > _MAX_HEADER or payload_length > _MAX_PAYLOAD:
        raise ChildError(f"a message of {header_length + payload_length:,} bytes is over the limit")
    header = json.loads(stream.read(header_length))
    if not isinstance(header, dict):
        raise ChildError("a message that is not a JSON object")
    return header, stream.read(payload_length)


class AnswerProcess:
    """Parent side: start the child, run its cells, then time requests and keep it frozen in between."""

    def __init__(
        self,
        cells: list[tuple[str, str]],
        *,
        handlers: str,
        setup_timeout_s: float = 300,
        read_only_proc: bool = False,
        keep_going: bool = False,
    ):
        """``keep_going``: a cell that raises does not end the setup; ``failed_cells`` says which raised, and what."""
        self.workdir = tempfile.mkdtemp(prefix="perflab-answer-")
        self.log = tempfile.TemporaryFile()
        command = trusted_python("perflab.grading.child")
        if require_sandbox():
            command = sandbox_command(
                command, workdir=self.workdir, readable=[pristine_perflab()], read_only_proc=read_only_proc
            )
        self.process = subprocess.Popen(
            command,
            cwd=self.workdir,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            start_new_session=True,
        )
        try:
            header, _ = self._exchange(
                {"cells": cells, "handlers": handlers, "keep_going": keep_going}, timeout_s=setup_timeout_s
            )
            if "error" in header:
                raise ChildError(header["error"])
            failed = header.get("failed", {})
            self.failed_cells: dict[str, str] = {
                str(name): str(message)[:2000] for name, message in (failed.items() if type(failed) is dict else ())
            }
            self.freeze()
        except BaseException:
            self.close()
            raise

    def _tree(self) -> list[psutil.Process]:
        try:
            root = psutil.Process(self.process.pid)
            return [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return []

    def freeze(self) -> None:
        """Stop every process of the child's tree, until all of them are seen stopped at one moment.

        Stopped one at a time, processes of the tree can resume one another (SIGCONT) before the last
        of them is stopped; so the tree is stopped again until two looks in a row find every thread of
        every process stopped, the same threads, none of which ran in between. Raises ``ChildLost``
        when that does not happen within ``FREEZE_LIMIT_S``.
        """
        deadline = time.monotonic() + FREEZE_LIMIT_S
        previous_look = None
        while True:
            tree = self._tree()
            _signal_all(tree, signal.SIGSTOP)
            look = _stopped_threads(tree)
            if look is not None and look == previous_look:
                return
            if time.monotonic() > deadline:
                raise ChildLost(
                    f"the answer's processes could not be frozen: in {FREEZE_LIMIT_S:.0f} s of stopping them, "
                    "they never were all stopped at once (do they resume one another?)"
                )
            previous_look = look
            time.sleep(0.001)  # a process signalled while it waits for a CPU stops only once it gets one

    def thaw(self) -> None:
        _signal_all(reversed(self._tree()), signal.SIGCONT)

    def cpu_seconds(self) -> float:
        """CPU time of the child's whole tree so far, exited children that were waited for included."""
        try:
            return tree_cpu_seconds(psutil.Process(self.process.pid))
        except psutil.NoSuchProcess:
            return 0.0

    def _exchange(self, header: dict, payload: bytes = b"", timeout_s: float = 300) -> tuple[dict, bytes]:
        if self.process.poll() is not None:
            raise ChildError(f"the answer's process has ended (exit {self.process.returncode}): {self.output_tail()}")
        send_frame(self.process.stdin, header, payload)
        # A watchdog, not the clock that grades: a request that never returns ends the child.
        timer = _Watchdog(self.process, timeout_s)
        try:
            return read_frame(self.process.stdout)
        except EOFError:
            exit_code = self.process.wait()
            reason = "did not answer in time" if timer.fired else f"ended (exit {exit_code})"
            lost = ChildLost if timer.fired or exit_code < 0 else ChildError
            raise lost(f"the answer's process {reason}: {self.output_tail()}") from None
        finally:
            timer.cancel()

    def call(self, name: str, payload: bytes = b"", *, timeout_s: float = 300, **args) -> tuple[dict, bytes, float]:
        """Thaw, send one request, read the reply, freeze; returns (result, payload, seconds by the parent's clock)."""
        self.thaw()
        start = time.perf_counter()
        try:
            header, reply_payload = self._exchange({"call": name, "args": args}, payload, timeout_s)
        finally:
            seconds = time.perf_counter() - start
            if self.process.poll() is None:
                self.freeze()
        if "error" in header:
            raise ChildError(str(header["error"]))
        return header.get("result"), reply_payload, seconds

    def output_tail(self, characters: int = 1500) -> str:
        self.log.seek(0)
        return self.log.read().decode(errors="replace")[-characters:]

    def close(self) -> None:
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.process.wait()
        self.log.close()
        shutil.rmtree(self.workdir, ignore_errors=True)


def _signal_all(processes, signal_number: int) -> None:
    # os.kill, not psutil's send_signal and its checks: the faster the pass, the less time the processes not yet
    # stopped have to resume those that are. The pids were listed a moment ago, far too soon to be reused.
    for process in processes:
        try:
            os.kill(process.pid, signal_number)
        except ProcessLookupError:
            pass


def _stopped_threads(tree: list[psutil.Process]) -> dict[tuple[int, int], tuple[str, str]] | None:
    """Each thread of ``tree`` with its context switch counts, or None when one of them is not stopped.

    A stopped thread that was resumed and stopped again in between has switched at least once more, and
    one resumed that has not run yet reads as running: two equal looks mean none ran between them.
    """
    look = {}
    for process in tree:
        try:
            for thread in os.listdir(f"/proc/{process.pid}/task"):
                with open(f"/proc/{process.pid}/task/{thread}/status") as status:
                    fields = dict(line.split(":", 1) for line in status if ":" in line)
                if fields["State"].strip()[0] not in "tTZX":  # stopped, stopped by a tracer, exited
                    return None
                look[process.pid, int(thread)] = (
                    fields["voluntary_ctxt_switches"],
                    fields["nonvoluntary_ctxt_switches"],
                )
        except (FileNotFoundError, ProcessLookupError):  # it ended while being looked at: look again
            return None
    return look


class IdleWatch:
    """The rounds in which a child that was frozen gained CPU time while the other side was timed.

    Only processes of the answer that resume one another escape a freeze, and their CPU counts as
    the grader's own, so the load rule would not see it slow down the side being timed.
    """

    def __init__(self):
        self.rounds: set[int] = set()

    @contextlib.contextmanager
    def while_frozen(self, child: AnswerProcess, round_index: int):
        before = child.cpu_seconds()
        yield
        if child.cpu_seconds() - before > IDLE_CPU_EPSILON_S:
            self.rounds.add(round_index)


class _Watchdog:
    def __init__(self, process: subprocess.Popen, timeout_s: float):
        import threading

        self.fired = False
        self._timer = threading.Timer(timeout_s, self._fire, args=(process,))
        self._timer.daemon = True
        self._timer.start()

    def _fire(self, process: subprocess.Popen) -> None:
        self.fired = True
        try:
            os.killpg(process.pid, signal.SIGCONT)
            os.killpg(process.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass

    def cancel(self) -> None:
        self._timer.cancel()


def remember_source(source: str, name: str) -> str:
    r"""``source``, registered as cell ``name``'s text, as IPython registers a cell's: ``inspect.getsource`` and
    tracebacks find what ``<cell name>`` holds.

    >>> import inspect
    >>> namespace = {}
    >>> exec(compile(remember_source("def twice(x):\n    return 2 * x\n", "answer"), "<cell answer>", "exec"), namespace)
    >>> inspect.getsource(namespace["twice"])
    'def twice(x):\n    return 2 * x\n'
    """
    linecache.cache[f"<cell {name}>"] = (len(source), None, source.splitlines(True), f"<cell {name}>")
    return source


def _describe(error: BaseException) -> str:
    frames = traceback.extract_tb(error.__traceback__)
    cell_frames = [frame for frame in frames if frame.filename.startswith("<cell ")]
    where = f" (in {cell_frames[-1].filename.strip('<>')}, line {cell_frames[-1].lineno})" if cell_frames else ""
    return f"{type(error).__name__}: {error}{where}"


def main() -> None:
    """Child side: run the cells, then answer requests until the parent closes the pipe."""
    replies = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # whatever the cells print goes to the log, never into the replies
    sys.stdout = sys.stderr
    requests = sys.stdin.buffer
    setup, _ = read_frame(requests)
    namespace: dict = {"__name__": "__main__"}
    failed = {}
    for name, source in setup["cells"]:
        try:
            exec(compile(remember_source(source, name), f"<cell {name}>", "exec"), namespace)
        except BaseException as error:  # noqa: BLE001 - a learner's cell may raise anything
            if not setup.get("keep_going"):
                send_frame(replies, {"error": f"running cell {name!r}: {_describe(error)}"})
                return
            failed[name] = _describe(error)
    handlers = importlib.import_module(setup["handlers"])
    send_frame(replies, {"ready": True, "failed": failed})
    while True:
        try:
            header, payload = read_frame(requests)
        except EOFError:
            return
        try:
            result, data = getattr(handlers, f"child_{header['call']}")(namespace, payload, **header["args"])
            send_frame(replies, {"result": result}, data)
        except BaseException as error:  # noqa: BLE001
            send_frame(replies, {"error": _describe(error)})


if __name__ == "__main__":
    main()
