"""Launch a script on several processes with torchrun from a notebook, and see what each rank did.

    >>> import tempfile
    >>> from pathlib import Path
    >>> from perflab.distributed import launch, run_as_one_rank
    >>> work = tempfile.TemporaryDirectory()
    >>> script = Path(work.name) / "hello.py"
    >>> _ = script.write_text('import os; print("rank", os.environ["RANK"], "of", os.environ["WORLD_SIZE"])')
    >>> run = launch(script, nproc=2, timeout_s=60)    # a few seconds: torchrun starts, then each rank
    >>> run
    Launch(hello.py on 2 ranks: succeeded in ... s)
    >>> print(run.output(rank=1))       # everything rank 1 printed, stdout and stderr
    rank 1 of 2
    <BLANKLINE>
    >>> run.check() is run              # a failed launch raises LaunchFailed naming the rank that failed first
    True
    >>> run_as_one_rank(script)         # the same script in this process, as the only rank of a world of one
    rank 0 of 1
    >>> work.cleanup()

``launch`` runs ``python -m torch.distributed.run --standalone`` (``torchrun``): ``--standalone``
picks a free port, so launches beside each other do not collide. Each rank runs the script through
:mod:`perflab.rank_process`, as ``python script.py`` would, except that the process ends without
interpreter teardown, where gloo's threads can crash a rank that finished its work. Every launch has a wall-clock
limit: a job that hangs (a rank stuck in a collective, a deadlock) is killed with all its
processes when the limit passes, and the result says so, rather than blocking the notebook.
Each rank's output goes to its own log file (``--log-dir``, ``--tee``), and a script whose
``main`` is decorated with ``torch.distributed.elastic.multiprocessing.errors.record`` leaves
its exception in an error file, which the result reads back.

``run_as_one_rank(script, *args)`` runs the same script inside this process as the only rank of
a world of one: a failure shows its traceback in the notebook at once, without starting a job.

Used in: lecture 07 (ddp), lecture 09 (sharding), lecture 11 (tensor pipeline parallel), labs 07, 09 and 11.
"""

from __future__ import annotations

import html
import json
import os
import re
import runpy
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import torch.distributed as dist

from perflab.render import Markup, Table

__all__ = ["Launch", "LaunchFailed", "RankFailure", "free_port", "launch", "run_as_one_rank", "torchrun_command"]

# torchrun's summary of a failed job lists each failed rank with its exit code.
_FAILURE = re.compile(r"^\s*rank\s*:\s*(\d+) \(local_rank: \d+\)\s*\n\s*exitcode\s*:\s*(-?\d+)", re.M)
_KILL_GRACE_S = 5.0  # after SIGTERM, how long torchrun gets to stop its workers before everything is killed


class LaunchFailed(RuntimeError):
    """A torchrun job ended without success; the message names the failing rank and its error."""


@dataclass(frozen=True)
class RankFailure:
    """A rank that failed: its exit code (negative: killed by that signal), its error, and when."""

    rank: int
    exitcode: int
    error: str  # the exception the rank raised, from its error file; empty when it left none
    failed_at: float | None  # when it wrote its error file (seconds since the epoch); None when it left none

    def __str__(self) -> str:
        status = (
            f"signal {signal.Signals(-self.exitcode).name}"
            if -self.exitcode in signal.valid_signals()
            else f"exit code {self.exitcode}"
        )
        return f"rank {self.rank} ({status})" + (f": {self.error}" if self.error else "")


@dataclass(frozen=True)
class Launch:
    """What one torchrun job did: its exit status, how long it took, and each rank's output."""

    script: str
    nproc: int
    command: tuple[str, ...]
    returncode: int | None  # None when the job ran past its time limit and was killed
    seconds: float
    ended_at: float  # when the job ended, in seconds since the epoch (time.time())
    timeout_s: float
    console: str  # torchrun's own output, each rank's lines prefixed with its rank
    rank_outputs: dict[int, str] = field(default_factory=dict)
    failures: tuple[RankFailure, ...] = ()  # the ranks that failed, the first to fail first

    @property
    def root_cause(self) -> RankFailure | None:
        return self.failures[0] if self.failures else None

    @property
    def timed_out(self) -> bool:
        return self.returncode is None

    @property
    def ok(self) -> bool:
        return self.returncode == 0

    @property
    def seconds_after_first_failure(self) -> float | None:
        """How long the job went on after its first rank failed; None when no rank left an error file."""
        if self.root_cause is None or self.root_cause.failed_at is None:
            return None
        return self.ended_at - self.root_cause.failed_at

    def output(self, rank: int) -> str:
        """Everything one rank printed, stdout then stderr."""
        if rank not in self.rank_outputs:
            raise KeyError(f"no output from rank {rank}; this job had ranks {sorted(self.rank_outputs)}")
        return self.rank_outputs[rank]

    @property
    def status(self) -> str:
        if self.timed_out:
            return f"killed after its {self.timeout_s:g} s limit (a hang?)"
        if self.ok:
            return f"succeeded in {self.seconds:.1f} s"
        cause = f"; first to fail: {self.root_cause}" if self.root_cause else ""
        return f"failed with exit code {self.returncode} after {self.seconds:.1f} s{cause}"

    def check(self) -> Launch:
        """Return this launch if it succeeded; otherwise raise LaunchFailed with the cause and the last output."""
        if not self.ok:
            failed_rank = self.root_cause.rank if self.root_cause else None
            rank_output = (
                f"--- last lines of rank {failed_rank}'s output ---\n{_tail(self.rank_outputs[failed_rank], 15)}\n"
                if failed_rank in self.rank_outputs
                else ""
            )
            raise LaunchFailed(
                f"{Path(self.script).name} on {self.nproc} ranks {self.status}\n{rank_output}"
                f"--- last lines of torchrun's output ---\n{_tail(self.console, 30)}"
            )
        return self

    def __repr__(self) -> str:
        return f"Launch({Path(self.script).name} on {self.nproc} ranks: {self.status})"

    def _repr_html_(self) -> str:
        # A <pre> keeps the output's line breaks, which an HTML cell would run together.
        tails = {rank: _tail(text, 6) for rank, text in sorted(self.rank_outputs.items())}
        rows = [
            (rank, Markup(tail, f"<pre style='margin:0'>{html.escape(tail)}</pre>")) for rank, tail in tails.items()
        ]
        caption = f"{Path(self.script).name} on {self.nproc} ranks: {self.status}"
        return Table(("rank", "last lines of its output"), rows, caption=caption)._repr_html_()


def _tail(text: str, lines: int) -> str:
    return "\n".join(text.rstrip().splitlines()[-lines:])


def torchrun_command(script: str | os.PathLike, args: tuple[str, ...], *, nproc: int, log_dir: Path) -> list[str]:
    """The torchrun command line: one machine, ``nproc`` ranks, each rank's output teed into ``log_dir``.

    Each rank runs the script through :mod:`perflab.rank_process`, which ends the process without the
    interpreter teardown that gloo's leftover threads can crash (see its docstring).
    """
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(nproc),
        "--log-dir",
        str(log_dir),
        "--tee",
        "3",
        "--module",
        "perflab.rank_process",
        str(script),
        *map(str, args),
    ]


def launch(
    script: str | os.PathLike, *args, nproc: int = 2, timeout_s: float = 120, threads_per_rank: int = 1
) -> Launch:
    """Run ``torchrun script args`` on ``nproc`` local ranks and wait at most ``timeout_s`` seconds.

    Each rank runs PyTorch on ``threads_per_rank`` CPU threads (``OMP_NUM_THREADS``): ranks that
    together ask for more threads than the machine has cores stall each other.
    """
    script = Path(script).resolve()  # the ranks start in the script's folder
    if not script.is_file():
        raise FileNotFoundError(f"no script at {script}")
    if not isinstance(nproc, int) or nproc < 1:
        raise ValueError(f"nproc must be a positive integer, got {nproc!r}")
    if not timeout_s > 0:
        raise ValueError(f"timeout_s must be positive, got {timeout_s!r}")
    env = dict(os.environ, OMP_NUM_THREADS=str(threads_per_rank), PYTHONUNBUFFERED="1")
    # The ranks import the perflab this process imported (in a grader's sandbox, its pristine copy), wherever the
    # virtualenv's own path to perflab leads.
    env["PYTHONPATH"] = os.pathsep.join(filter(None, (str(Path(__file__).parents[1]), env.get("PYTHONPATH"))))
    with tempfile.TemporaryDirectory(prefix="torchrun-logs-") as log_dir:
        command = torchrun_command(script, tuple(args), nproc=nproc, log_dir=Path(log_dir))
        start = time.perf_counter()
        process = subprocess.Popen(
            command,
            cwd=script.parent,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        try:
            console, _ = process.communicate(timeout=timeout_s)
            returncode = process.returncode
        except subprocess.TimeoutExpired:
            console = _stop(process)
            returncode = None
        seconds, ended_at = time.perf_counter() - start, time.time()
        rank_outputs, errors = _read_rank_logs(Path(log_dir))
    return Launch(
        script=str(script),
        nproc=nproc,
        command=tuple(command),
        returncode=returncode,
        seconds=seconds,
        ended_at=ended_at,
        timeout_s=timeout_s,
        console=console,
        rank_outputs=rank_outputs,
        failures=_failures(console, errors) if returncode not in (0, None) else (),
    )


def _stop(process: subprocess.Popen) -> str:
    """Stop a job that ran past its limit: SIGTERM to torchrun, which stops its workers; then SIGKILL all."""
    # torchrun starts each worker in a session of its own: find them now, while torchrun still knows them.
    workers = psutil.Process(process.pid).children(recursive=True)
    process.terminate()
    try:
        process.wait(timeout=_KILL_GRACE_S)
    except subprocess.TimeoutExpired:
        process.kill()
    for worker in workers:
        try:
            worker.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(workers, timeout=_KILL_GRACE_S)  # SIGKILL is delivered later, on a busy machine noticeably
    try:
        console, _ = process.communicate(timeout=_KILL_GRACE_S)
    except subprocess.TimeoutExpired:  # a process we could not find still holds the output open: stop reading
        process.stdout.close()
        console = ""
    return console


def _read_rank_logs(log_dir: Path) -> tuple[dict[int, str], dict[int, tuple[int, str]]]:
    """Each rank's output and, where it left an error file, when the file was written (ns) and its error."""
    outputs, errors = {}, {}
    attempts = sorted(log_dir.glob("*/attempt_*"))
    if not attempts:
        return outputs, errors
    for rank_dir in sorted(attempts[-1].iterdir(), key=lambda path: int(path.name)):
        rank = int(rank_dir.name)
        outputs[rank] = "".join(
            (rank_dir / name).read_text(errors="replace")
            for name in ("stdout.log", "stderr.log")
            if (rank_dir / name).is_file()
        )
        error_file = rank_dir / "error.json"
        if error_file.is_file():
            errors[rank] = (error_file.stat().st_mtime_ns, _error_message(error_file.read_text()))
    return outputs, errors


def _error_message(error_json: str) -> str:
    """The error a rank recorded; empty when torchrun stopped the rank while it was still writing the file."""
    try:
        return json.loads(error_json)["message"]["message"]
    except (json.JSONDecodeError, KeyError, TypeError):
        return ""


def _failures(console: str, errors: dict[int, tuple[int, str]]) -> tuple[RankFailure, ...]:
    """The failed ranks from torchrun's summary, ordered by when each wrote its error file.

    torchrun's own "Root Cause" compares whole seconds, so a rank that crashed and the rank that
    failed a moment later because its peer was gone can tie, and then torchrun names whichever it
    saw exit first. The error files' modification times tell them apart. Ranks that left none come
    last: first those that died on their own (an exit code, a crash such as SIGABRT or SIGSEGV), then
    those that torchrun stopped (SIGTERM, SIGKILL) because another rank had failed.
    """
    exitcodes = {int(rank): int(code) for rank, code in _FAILURE.findall(console)}
    never = float("inf")
    stopped_by_torchrun = (-signal.SIGTERM, -signal.SIGKILL)
    order = sorted(
        exitcodes, key=lambda rank: (errors.get(rank, (never, ""))[0], exitcodes[rank] in stopped_by_torchrun, rank)
    )
    return tuple(
        RankFailure(
            rank=rank,
            exitcode=exitcodes[rank],
            error=errors[rank][1] if rank in errors else "",
            failed_at=errors[rank][0] / 1e9 if rank in errors else None,
        )
        for rank in order
    )


def free_port() -> int:
    """A TCP port on the loopback interface that nothing listens on now."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def run_as_one_rank(script: str | os.PathLike, *args) -> None:
    """Run ``script args`` in this process as rank 0 of a world of one, as torchrun would start it.

    The quickest test of a distributed script: collectives over one rank return their input, so
    the script must work unchanged, and any exception surfaces here with its traceback. The
    environment, ``sys.argv`` and the default process group are restored afterwards.
    """
    script = Path(script)
    if not script.is_file():
        raise FileNotFoundError(f"no script at {script}")
    if dist.is_initialized():
        raise RuntimeError("this process already has a default process group; destroy it first")
    torchrun_env = {
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
    }
    saved_env = {name: os.environ.get(name) for name in torchrun_env}
    saved_argv, saved_path = sys.argv, list(sys.path)
    os.environ.update(torchrun_env)
    sys.argv = [str(script), *map(str, args)]
    sys.path.insert(0, str(script.parent))  # as `python script.py` does: the script's folder comes first
    try:
        runpy.run_path(str(script), run_name="__main__")
    finally:
        sys.argv, sys.path[:] = saved_argv, saved_path
        for name, value in saved_env.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        if dist.is_initialized():  # the script failed before its own destroy_process_group()
            dist.destroy_process_group()
