"""The cores this process may keep busy: its CPU affinity, capped by a cgroup CPU quota, which torch ignores.

    >>> from perflab.cpu_quota import quota_cores, usable_cores
    >>> usable_cores() >= 1
    True
    >>> quota_cores() is None or quota_cores() > 0          # None where no quota limits this process
    True

A container's CPU limit (Docker's ``--cpus``, a Kubernetes limit, Binder's) is usually a bandwidth quota:
the process may use that many cores' worth of CPU time per period, on any of the host's cores. It leaves the
affinity alone, and torch sizes its thread pool from the cores it sees, not from the quota (two threads here, in a
cgroup allowed two thirds of a core): more threads than the quota serves. The threads of a parallel region then
wait on one another while the scheduler has frozen some of them, and an idle OpenMP thread's spinning is taken from
the quota too.
Measured on a 2-core EPYC in ``.ci/slowed``'s cgroup, two thirds of one core's time in 10 ms periods (torch 2.15,
2026-11-30), grading lab 12's data_config against the naive baseline (``perflab.grading.capstone_lab``, five
interleaved one-epoch rounds each, ``/usr/bin/time``): 307 s and 205 CPU seconds on torch's two threads, 44 s and 29
CPU seconds with ``OMP_NUM_THREADS=1``, 45 s with the threads fitted at import; 22 s without the quota, on two.

:func:`fit_threads_to_quota` (run when perflab is imported) gives torch, and the processes this one starts,
as many threads as the quota (or a narrower affinity) serves, at least one, unless ``OMP_NUM_THREADS`` already
says how many; ``PERFLAB_THREADS_FITTED`` then names the count it set, so that the test suite can tell it from a
count a person set. Projects that run torch in containers make a similar fix (Unity's ML-Agents:
https://github.com/Unity-Technologies/ml-agents/pull/4471).

Used by perflab (at import), perflab.doctor and the test suite (conftest.py).
"""

from __future__ import annotations

import math
import os
from pathlib import Path

__all__ = ["FITTED_VARIABLE", "affinity_cores", "fit_threads_to_quota", "quota_cores", "usable_cores"]

_THREAD_VARIABLE = "OMP_NUM_THREADS"
FITTED_VARIABLE = "PERFLAB_THREADS_FITTED"


def affinity_cores() -> int:
    """The cores this process may run on (its affinity), quota or not."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _quota_in(folder: Path, version: int) -> float | None:
    """Cores' worth of the quota set on the cgroup ``folder`` itself, None if it sets none (or it cannot be read)."""
    try:
        if version == 2:
            quota, period = (folder / "cpu.max").read_text().split()
        else:
            quota, period = ((folder / name).read_text().strip() for name in ("cpu.cfs_quota_us", "cpu.cfs_period_us"))
        if quota in ("max", "-1"):
            return None
        return int(quota) / int(period)
    except (OSError, ValueError):
        return None


def quota_cores(proc_cgroup: str | Path = "/proc/self/cgroup", root: str | Path = "/sys/fs/cgroup") -> float | None:
    """The tightest CPU quota on this process's cgroup and the cgroups above it, in cores (0.5: half a core's time);
    None when none is set or none can be read (no cgroups, another OS, a sandbox without ``/sys``).

    ``proc_cgroup`` and ``root`` are there for tests: a folder laid out like ``/sys/fs/cgroup``.
    """
    root = Path(root)
    try:
        lines = Path(proc_cgroup).read_text().splitlines()
    except OSError:
        return None
    quotas = []
    for line in lines:
        fields = line.split(":", 2)
        if len(fields) != 3:  # not a cgroup line
            continue
        _, controllers, path = fields
        if controllers == "":  # cgroup v2: one hierarchy
            mounts, version = [root, root / "unified"], 2
        elif "cpu" in controllers.split(","):  # cgroup v1: the cpu controller's hierarchy
            mounts, version = [root / controllers, root / "cpu", root / "cpu,cpuacct", root / "cpuacct,cpu"], 1
        else:
            continue
        for mount in dict.fromkeys(mounts):
            folder = mount / path.lstrip("/")
            while True:  # the cgroup, then each one above it: a parent's quota limits its children too
                quota = _quota_in(folder, version)
                if quota is not None:
                    quotas.append(quota)
                if folder == mount:
                    break
                folder = folder.parent
    return min(quotas) if quotas else None


def usable_cores() -> int:
    """The cores' worth of CPU this process may use: its affinity, or fewer under a quota, rounded down (as Go's
    automaxprocs does) and at least one."""
    quota = quota_cores()
    cores = affinity_cores()
    return cores if quota is None else max(1, min(cores, math.floor(quota)))


def fit_threads_to_quota() -> int | None:
    """Where :func:`usable_cores` (a CPU quota, a narrower affinity) is fewer than torch's threads and
    ``OMP_NUM_THREADS`` is unset: set torch's threads, and ``OMP_NUM_THREADS`` for the processes this one starts, to
    it, and :data:`FITTED_VARIABLE` to say so. Returns the threads set, or None where nothing changed."""
    import torch

    if os.environ.get(_THREAD_VARIABLE):
        return None
    cores = usable_cores()
    if cores >= torch.get_num_threads():
        return None
    os.environ[_THREAD_VARIABLE] = os.environ[FITTED_VARIABLE] = str(cores)
    torch.set_num_threads(cores)
    return cores
