"""One rank of a torchrun job: run a script as ``python script.py`` would, then end without interpreter teardown.

    python -m perflab.rank_process train_ddp.py --epochs 2    # what launch() has torchrun start, once per rank

Why it exists: DistributedDataParallel keeps its process group alive after
``dist.destroy_process_group()`` (its reducer still holds it), so gloo's worker threads outlive the
script. When one of them releases a Python object while the interpreter is shutting down, CPython
ends that thread from inside C++ code that may not unwind, and the rank aborts with "terminate
called without an active exception" (SIGABRT) after finishing its work: a rare race, more likely on
a busy machine (pytorch/pytorch#179291 describes it). A course that grades DDP scripts cannot let a
correct script fail by chance, so this runs the script, waits for its non-daemon threads and runs
its ``atexit`` handlers (as ``python`` does at exit), flushes the output, and ends the process with
``os._exit``: no interpreter shutdown is left to race with. The
exit status is what ``python script.py`` would return: 0, the code of ``SystemExit``, or 1 after
printing the traceback of an exception.

Used by perflab.distributed (its launch: lecture 07, labs 07 and 09).
"""

from __future__ import annotations

import atexit
import os
import runpy
import sys
import threading
import traceback

__all__ = ["run_script"]


def run_script(script: str, *args: str) -> int:
    """Run ``script`` as ``__main__`` with ``args`` in ``sys.argv``; return the exit status ``python`` would."""
    sys.argv = [script, *args]
    sys.path[0] = os.path.dirname(os.path.abspath(script))  # as `python script.py` sets it
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as stop:
        if stop.code is None or isinstance(stop.code, int):
            return stop.code or 0
        print(stop.code, file=sys.stderr)
        return 1
    except BaseException:
        traceback.print_exc()
        return 1
    return 0


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit("usage: python -m perflab.rank_process SCRIPT [ARGS...]")
    status = run_script(sys.argv[1], *sys.argv[2:])
    for thread in threading.enumerate():
        if thread is not threading.main_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(status)
