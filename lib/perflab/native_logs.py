"""The log lines torch prints that tell a learner nothing, where they come from, and filters that drop only them.

    >>> from perflab.native_logs import noise_origin, without_noise
    >>> noise_origin("USDT:2026-11-26 02:15:14 20678:20678 SyncActivityProfilerHandler.cpp:39] profiler_start")
    'Kineto marks each start and stop of torch.profiler for tracing tools (its USDT level)'
    >>> noise_origin("W1126 02:21:41.682000 24620 torch/_dynamo/convert_frame.py:2008] torch._dynamo hit "
    ...              "config.recompile_limit (8)") is None   # a real warning stays
    True
    >>> without_noise("USDT:2026-11-26 02:15:14 1:1 SyncActivityProfilerHandler.cpp:46] profiler_stop\\nreal line\\n")
    'real line\\n'

Three lines come back in every profiled or compiled notebook on a CPU (lecture 02 shows them):

- Kineto, the C++ library under ``torch.profiler``, logs every profiler start and stop at its
  highest level, USDT: ``USDT:... SyncActivityProfilerHandler.cpp:39] profiler_start``. They are
  marks for tracing tools, not warnings.
- On a CUDA build of torch without an NVIDIA driver, Kineto asks CUDA for its devices once per
  process: ``ERROR:... DeviceProperties.cpp:56] gpuGetDeviceCount failed with code 35``. CUDA's
  error 35 is ``cudaErrorInsufficientDriver``: here, no driver at all.
- ``torch.utils.cpp_extension`` (imported by Inductor and ``torch.utils.benchmark``) logs through
  Python's ``logging``, in torch's glog-like format, when it finds a CUDA toolkit but no GPU:
  ``W1126 ... torch/utils/cpp_extension.py:183] No CUDA runtime is found, using CUDA_HOME=...``.

No setting removes only these. ``KINETO_LOG_LEVEL`` (read by Kineto when torch loads) orders
Kineto's levels VERBOSE 0, INFO 1, WARNING 2, STAGE 3, ERROR 4, USDT 5: ``5`` hides the ERROR
line but keeps USDT, ``6`` hides every Kineto line, real errors too. ``TORCH_CPP_LOG_LEVEL``
governs c10's own logging and changes neither. So :func:`install` adds a ``logging.Filter`` that
drops the one ``cpp_extension`` message, and :func:`filter_native_stderr` routes the process's
file descriptor 2 (where C++ writes) through a small filter process that drops the lines of
:data:`NOISE` and passes every other line through unchanged. ``import perflab`` calls
:func:`install` in a Jupyter kernel; :func:`without_noise` cleans recorded outputs the same way.

Used in: lecture 02 (profiling); perflab.record and perflab.site clean recorded outputs with it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import select
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field

__all__ = [
    "NOISE",
    "NativeLog",
    "captured_native_stderr",
    "filter_native_stderr",
    "install",
    "noise_origin",
    "without_noise",
]


@dataclass(frozen=True)
class NoiseLine:
    """A log line that carries no information for a learner: what it looks like and who writes it."""

    pattern: re.Pattern[str]
    origin: str


NOISE = (
    NoiseLine(
        re.compile(r"^USDT:.*\] profiler_(start|stop)\s*$"),
        "Kineto marks each start and stop of torch.profiler for tracing tools (its USDT level)",
    ),
    NoiseLine(
        re.compile(r"^ERROR:.*\] gpuGetDeviceCount failed with code 35\s*$"),
        "Kineto found no NVIDIA driver (CUDA error 35) on a CUDA build of torch",
    ),
    NoiseLine(
        re.compile(r"^W\d{4} .*cpp_extension\.py:\d+\].*No CUDA runtime is found, using CUDA_HOME="),
        "torch.utils.cpp_extension found a CUDA toolkit folder but no GPU",
    ),
)
_CUDA_HOME_MESSAGE = "No CUDA runtime is found"  # the cpp_extension message, as its logging record has it


def noise_origin(line: str) -> str | None:
    """Who writes ``line`` if it is one of :data:`NOISE`, else None."""
    return next((noise.origin for noise in NOISE if noise.pattern.search(line)), None)


def without_noise(text: str) -> str:
    """``text`` without the lines of :data:`NOISE`, every other line kept as it was."""
    return "".join(line for line in text.splitlines(keepends=True) if noise_origin(line.rstrip("\r\n")) is None)


@dataclass(frozen=True)
class NativeLog:
    """What C++ code wrote to file descriptor 2 during a block, line by line."""

    lines: tuple[str, ...] = field(default_factory=tuple)

    @property
    def noise(self) -> list[tuple[str, str]]:
        """(line, who writes it) for every line of :data:`NOISE`."""
        return [(line, origin) for line in self.lines if (origin := noise_origin(line)) is not None]

    @property
    def kept(self) -> list[str]:
        """The lines a filter lets through: everything that is not noise."""
        return [line for line in self.lines if noise_origin(line) is None]

    def __repr__(self) -> str:
        return f"NativeLog({len(self.lines)} lines written to stderr: {len(self.noise)} noise, {len(self.kept)} kept)"


@contextlib.contextmanager
def captured_native_stderr() -> Iterator[NativeLog]:
    """Capture what is written to file descriptor 2 inside the block (C++ output included), and hand it back.

    The lines are gone from the terminal or notebook, noise or not: this is for looking at them.
    """
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as capture:
        os.dup2(capture.fileno(), 2)
        log = NativeLog()
        try:
            yield log
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            capture.seek(0)
            lines = tuple(capture.read().decode(errors="replace").splitlines())
            object.__setattr__(log, "lines", lines)


# The filter process: copies stdin to stdout line by line, leaving out the lines that match argv[1]. A line that ends
# in the marker argv[2] is a flush: what came before it has been written, so it answers with one byte on fd argv[3].
_FILTER = (
    "import os, re, signal, sys\n"
    "signal.signal(signal.SIGINT, signal.SIG_IGN)  # an interrupted kernel keeps its stderr\n"
    "noise, marker, ack = re.compile(sys.argv[1]), sys.argv[2].encode() + b'\\n', int(sys.argv[3])\n"
    "for line in sys.stdin.buffer:\n"
    "    flush = line.endswith(marker)\n"
    "    line = line[: -len(marker)] if flush else line\n"
    "    if line and not noise.search(line.decode(errors='replace').rstrip('\\r\\n')):\n"
    "        os.write(1, line)\n"
    "    if flush:\n"
    "        os.write(ack, b'.')\n"
)
_MARKER = "\x1b[perflab.native_logs flush]"  # never a line of its own: it starts with ESC
# The filter process, the fd its flush answers arrive on, and the pipe (device, inode) that fd 2 is while it filters.
_filter: tuple[subprocess.Popen, int, tuple[int, int]] | None = None


def filter_native_stderr() -> bool:
    """Drop the lines of :data:`NOISE` from everything written to file descriptor 2 from now on.

    File descriptor 2 is pointed at a filter process that writes every other line, unchanged and
    in order, where file descriptor 2 pointed before (in a Jupyter kernel, the pipe that shows
    stderr in the notebook). A separate process, not a thread, so that C++ code writing while it
    holds the GIL can never wait on Python; in a session of its own, so that interrupting the
    kernel does not stop it. It ends when the last process that holds file descriptor 2 does.
    Child processes inherit the filter. Once per process; returns whether the filter is in place.
    In IPython, :func:`flush_native_stderr` runs after every cell, so that a cell's lines show
    under that cell.
    """
    global _filter
    if _filter is not None:
        return _filter[0].poll() is None
    if os.name != "posix":  # file descriptors passed to a child, select() on a pipe: POSIX only
        return False
    pattern = "|".join(f"(?:{noise.pattern.pattern})" for noise in NOISE)
    sys.stderr.flush()
    destination = os.dup(2)
    answers, answer_fd = os.pipe()
    try:
        process = subprocess.Popen(
            [sys.executable, "-I", "-S", "-c", _FILTER, pattern, _MARKER, str(answer_fd)],
            stdin=subprocess.PIPE,
            stdout=destination,
            stderr=destination,
            pass_fds=(answer_fd,),
            start_new_session=True,
        )
    except OSError:
        os.close(answers)
        return False
    finally:  # the filter holds its own copies
        os.close(destination)
        os.close(answer_fd)
    os.dup2(process.stdin.fileno(), 2)
    process.stdin.close()  # fd 2 is now the only way into the filter: it ends when this process and its children do
    pipe = os.fstat(2)
    _filter = (process, answers, (pipe.st_dev, pipe.st_ino))
    try:
        get_ipython().events.register("post_execute", flush_native_stderr)  # noqa: F821 (IPython's builtin)
    except NameError:
        pass
    return True


def flush_native_stderr(timeout: float = 1.0) -> bool:
    """Wait until the filter has passed on everything written to file descriptor 2 so far; False if it did not answer."""
    if _filter is None or _filter[0].poll() is not None:
        return False
    _, answers, pipe = _filter
    now = os.fstat(2)
    if (now.st_dev, now.st_ino) != pipe:  # fd 2 points elsewhere for now (captured): nothing of ours to wait for
        return False
    os.write(2, (_MARKER + "\n").encode())
    ready, _, _ = select.select([answers], [], [], timeout)
    if ready:
        os.read(answers, 1)
    return bool(ready)


class _NoCudaHomeWarning(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.levelno == logging.WARNING and str(record.msg).startswith(_CUDA_HOME_MESSAGE))


def install(*, native: bool = True) -> None:
    """Drop torch's uninformative log lines: the ``cpp_extension`` message always, C++ noise if ``native``."""
    logger = logging.getLogger("torch.utils.cpp_extension")
    if not any(isinstance(existing, _NoCudaHomeWarning) for existing in logger.filters):
        logger.addFilter(_NoCudaHomeWarning())
    if native:
        filter_native_stderr()
