"""The machine's lock: work shares it, a measurement has it alone, and a grading lent the machine takes it itself."""

from __future__ import annotations

import fcntl
import multiprocessing
import sys
import threading
import time

import nbformat
import pytest
from perflab.grading.machine_lock import LOCK_VARIABLE, MachineLock, lent_machine
from perflab.grading.nbgrader import SandboxedExecute, TrustedMeasurement
from perflab.grading.sandbox import bwrap_works
from perflab.grading.verdict import LoadMeter, Verdict

_FORK = multiprocessing.get_context("fork")  # the children need nothing imported anew


def _take(path, how: str, taken, release) -> None:
    machine = MachineLock(path)
    with machine.alone() if how == "alone" else machine.shared():
        taken.set()
        release.wait(30)


def _start(path, how: str):
    taken, release = _FORK.Event(), _FORK.Event()
    process = _FORK.Process(target=_take, args=(path, how, taken, release))
    process.start()
    return process, taken, release


def test_a_measurement_waits_for_the_work_running_and_work_asked_after_it_waits_for_the_measurement(tmp_path):
    path = tmp_path / "machine.lock"
    kernel, kernel_running, kernel_ends = _start(path, "shared")
    assert kernel_running.wait(30)
    measurement, measuring, measurement_ends = _start(path, "alone")
    assert not measuring.wait(1), "a measurement began beside work that was running"
    later, later_running, later_ends = _start(path, "shared")
    assert not later_running.wait(1), "work asked after a waiting measurement went before it"
    kernel_ends.set()
    assert measuring.wait(30) and not later_running.wait(0.5)
    measurement_ends.set()
    assert later_running.wait(30)
    later_ends.set()
    for process in (kernel, measurement, later):
        process.join(30)


def test_lending_the_machine_drops_this_process_share_and_takes_it_back(tmp_path):
    machine = MachineLock(tmp_path / "machine.lock")
    with machine.shared():
        with machine.lent():
            measurement, measuring, measurement_ends = _start(machine.path, "alone")
            assert measuring.wait(30), "the lent share still kept a measurement out"
            back = threading.Thread(target=lambda: time.sleep(1) or measurement_ends.set())
            back.start()
        assert "shared" in repr(machine), "the share came back when the measurement ended"
        back.join()
        measurement.join(30)
    assert machine.environment() == {LOCK_VARIABLE: str(machine.path)}


def test_a_measurement_has_a_lent_machine_alone_and_gives_it_back(tmp_path, monkeypatch):
    path = tmp_path / "machine.lock"
    monkeypatch.setenv(LOCK_VARIABLE, str(path))
    lent_machine.cache_clear()
    try:
        with lent_machine().shared():
            with LoadMeter():
                other, other_running, other_ends = _start(path, "shared")
                assert not other_running.wait(1), "other work ran beside a measurement"
                assert "alone" in repr(lent_machine())
                with LoadMeter():  # a measurement within it keeps the machine
                    assert not other_running.wait(0.2)
            assert other_running.wait(30) and "shared" in repr(lent_machine())
            other_ends.set()
            other.join(30)
    finally:
        lent_machine.cache_clear()


# The stand-in for the trusted grader: the threads it was given, as a verdict.
_PROBE = """
import json, os
verdict = {verdict!r}
verdict["measured"] = str(os.environ.get("OMP_NUM_THREADS"))
print(json.dumps({{"{cell}": verdict}}))
"""


@pytest.mark.parametrize(
    ("lab", "cell", "threads"), [("lab12_capstone", "test_regrade", "None"), ("lab11_megatron", "test_f_g", "1")]
)
def test_a_lent_grader_that_times_runs_on_every_core(tmp_path, monkeypatch, lab, cell, threads):
    probe = _PROBE.format(verdict=Verdict.refused("probe").to_dict(), cell=cell)
    monkeypatch.setattr("perflab.grading.trusted_process.trusted_python", lambda module: [sys.executable, "-c", probe])
    monkeypatch.setenv(LOCK_VARIABLE, str(tmp_path / "machine.lock"))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    lent_machine.cache_clear()
    try:
        verdict = TrustedMeasurement(timeout=60)._run({"lab": lab, "handed_in": {cell: {}}})[cell]
    finally:
        lent_machine.cache_clear()
    assert verdict.measured == threads


@pytest.mark.slow
@pytest.mark.skipif(not bwrap_works(), reason="the sandbox needs bubblewrap (apt-get install bubblewrap)")
def test_a_lent_grading_shares_the_machine_while_its_kernel_runs_a_cell(tmp_path, monkeypatch):
    path = tmp_path / "machine.lock"
    monkeypatch.setenv(LOCK_VARIABLE, str(path))
    lent_machine.cache_clear()
    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("import time\ntime.sleep(3)")])
    notebook.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    seen = []

    def probe():
        with open(path, "a") as lock:
            while executing.is_alive():
                try:
                    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    fcntl.flock(lock, fcntl.LOCK_UN)
                    seen.append("free")
                except BlockingIOError:
                    seen.append("shared")
                time.sleep(0.1)

    executing = threading.Thread(
        target=SandboxedExecute(timeout=60).preprocess, args=(notebook, {"metadata": {"path": str(tmp_path)}})
    )
    executing.start()
    probe()
    executing.join()
    lent_machine.cache_clear()
    assert "shared" in seen, "the kernel ran a cell without a share of the machine"
    with open(path, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)  # and gave it back once it ended
