"""The suite's own use of the cores (conftest.py): each pytest-xdist worker, and what it starts, runs torch on its
share of them; a measurement that has the machine alone runs on every core."""

import os
import subprocess
import sys

import pytest
import torch
from perflab.cpu_quota import usable_cores

CORES = usable_cores()  # the cores a measurement alone runs on: the affinity's, or fewer under a CPU quota


@pytest.fixture
def share(pytestconfig) -> int:
    """The threads this worker was given, or a skip saying why there is no share to check."""
    workers = getattr(pytestconfig, "workerinput", {}).get("workercount")
    if not workers:
        pytest.skip("one pytest process has every core: the share is an xdist worker's (make check, make test)")
    if CORES // workers >= CORES:
        pytest.skip(f"{workers} worker on {CORES} cores: its share is every core")
    if pytestconfig._perflab_threads_preset:
        pytest.skip(f"{', '.join(pytestconfig._perflab_threads_preset)} set before pytest started: the caps stay")
    return max(1, CORES // workers)


def _threads_of_a_process_started_here() -> int:
    started = subprocess.run(
        [sys.executable, "-c", "import torch; print(torch.get_num_threads())"],
        capture_output=True,
        text=True,
        check=True,
    )
    return int(started.stdout)


def test_a_worker_and_the_processes_it_starts_run_torch_on_its_share(share):
    assert torch.get_num_threads() == share
    assert _threads_of_a_process_started_here() == share


def test_a_measurement_alone_runs_on_every_core_then_gives_the_share_back(share, machine):
    with machine.alone():
        assert torch.get_num_threads() == CORES
        assert _threads_of_a_process_started_here() == CORES
    assert torch.get_num_threads() == share
    assert os.environ["OMP_NUM_THREADS"] == str(share)
