"""perflab: the shared library of the perflab course on PyTorch performance engineering.

    >>> import torch
    >>> import perflab
    >>> device = perflab.pick_device()                  # cuda if present, else mps, else cpu
    >>> x = torch.randn(256, 256, device=device)
    >>> perflab.benchmark(lambda: x @ x, device=device, label="matmul 256")
    Timing(matmul 256 on ...: median ..., IQR ..., p95 ...; 20 samples x ... calls, ... threads)
    >>> with perflab.SyncCounter() as syncs:
    ...     total = (x @ x).sum().item()                 # .item(): the host waits for the device
    >>> syncs.total
    1

``perflab.doctor()`` (in a terminal, ``python -m perflab doctor``) measures what this machine can
do in a few seconds: see :mod:`perflab.doctor`.

Instruments live in small modules, one concept each: ``device``, ``bench``, ``doctor``,
``profiling``, ``diagnose``, ``planted``, ``cpu_clock``, ``sm_activity``, ``annotation_cost`` (what a
profiler's marks cost), ``native_logs`` (torch's log lines a learner need not read), ``cpu_quota`` (the cores a container's quota serves), ``memory``,
``memory_budget``, ``tradeoff``, ``floats``,
``roofline`` (FLOPs, bytes, MFU), ``amp``, ``training_state``, ``compiling``, ``launches``, ``distributed`` (its ranks run through ``rank_process``), ``sharding``, ``pipeline_schedule`` (drawn by ``pipeline_plots``), ``attention``; the course's workloads in
``data``, ``models``, ``pipeline`` and ``train``; the input pipeline's instruments in ``ceiling``,
``prefetch`` and ``allocator``; pictures in ``plots`` and ``report``; explorers in ``widgets``; the
capstone's benchmark and grader in ``capstone``; grading outside the learner's kernel in ``grading``. The most used
instruments are re-exported here; import the rest from their modules
(``from perflab.train import train, NAIVE``).

Used in: every notebook, lectures 01-11 and labs 01-12.
"""

import os as _os
import sys as _sys

from perflab import cpu_quota as _cpu_quota
from perflab import native_logs as _native_logs
from perflab import torch_features as _torch_features
from perflab.bench import Comparison, Timing, benchmark, compare
from perflab.device import SyncCounter, pick_device, synchronize
from perflab.device import count_syncs as count_syncs  # deprecated name, importable for one more release
from perflab.doctor import doctor

__version__ = "0.1.0"
__all__ = ["Comparison", "SyncCounter", "Timing", "benchmark", "compare", "doctor", "pick_device", "synchronize"]

# Under a container's CPU quota, torch's threads as many as the quota serves (perflab.cpu_quota says why).
_cpu_quota.fit_threads_to_quota()

# torch's uninformative log lines out of what a learner reads (perflab.native_logs says which and why); in a
# Jupyter kernel also the C++ ones. PERFLAB_NATIVE_LOGS=keep leaves fd 2 untouched, to see them all.
_in_kernel = type(_sys.stderr).__module__.startswith("ipykernel")  # stderr shown in a notebook
_native_logs.install(native=_in_kernel and _os.environ.get("PERFLAB_NATIVE_LOGS") != "keep")

# A learner whose torch came with the machine (Colab, a cluster's module, a container) hears at once if the course
# was never tested on it; `python -m perflab doctor` lists the cells that need a newer one.
if not _torch_features.in_supported_range():
    import warnings as _warnings

    import torch as _torch

    _warnings.warn(
        f"perflab supports torch {_torch_features.SUPPORTED}; this is torch {_torch.__version__}, on which cells may "
        "fail: python -m perflab doctor says what your torch lacks",
        UserWarning,
        stacklevel=2,
    )
