"""How busy a GPU's SMs and tensor cores were, from DCGM's profiling fields, beside ``utilization.gpu``.

    >>> from perflab.sm_activity import parse_dmon
    >>> readings = parse_dmon('''#Entity   GPUTL  SMACT  TENSO
    ... ID
    ... GPU 0     100    0.031  0.000
    ... GPU 0     100    0.029  N/A
    ... ''', fields=(203, 1002, 1004))
    >>> readings
    SmActivity(GPU utilization 100%, SM active 3%, tensor active 0%; 2 samples)

NVML's ``utilization.gpu`` (what ``nvidia-smi`` shows; DCGM field 203, ``DCGM_FI_DEV_GPU_UTIL``)
is the share of time *any* kernel ran: one tiny kernel at a time reads 100%. DCGM's profiling
fields count the hardware instead, as ratios of cycles (their definitions in ``dcgm_fields.h``,
NVIDIA/DCGM, the source of these numbers):

- 1002, ``DCGM_FI_PROF_SM_ACTIVE``: "the ratio of cycles an SM has at least 1 warp assigned",
  averaged over every SM;
- 1003, ``DCGM_FI_PROF_SM_OCCUPANCY``: resident warps against the most an SM can hold;
- 1004, ``DCGM_FI_PROF_PIPE_TENSOR_ACTIVE``: the ratio of cycles the tensor pipes are active.

:func:`watch_sm_activity` runs ``dcgmi dmon -e <fields> -d <ms>`` (DCGM's command line; it needs
the ``nv-hostengine`` daemon) around a block and averages what it printed. DCGM 4 renamed the
fields (``DCGM_FI_PROF_SM_UTIL_RATIO``...), keeping the numbers. On Hopper and newer GPUs DCGM
reads them from NVML's GPU Performance Monitoring (``nvmlGpmMetricId_t``: ``NVML_GPM_METRIC_SM_UTIL``,
``NVML_GPM_METRIC_ANY_TENSOR_UTIL``). Profiling fields share hardware counters with Nsight
Compute and Nsight Systems' GPU metrics: ``dcgmi profile --pause`` frees them.

Used in: lecture 02 (profiling).
"""

from __future__ import annotations

import contextlib
import shutil
import statistics
import subprocess
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

__all__ = ["FIELDS", "SmActivity", "parse_dmon", "watch_sm_activity"]

FIELDS = {203: "GPU utilization", 1002: "SM active", 1003: "SM occupancy", 1004: "tensor active"}
_PERCENT_FIELDS = {203}  # reported in percent; the profiling fields are ratios from 0 to 1


@dataclass
class SmActivity:
    """Samples of DCGM fields for one GPU (each as a share from 0 to 1), by field ID."""

    samples: dict[int, list[float]] = field(default_factory=dict)

    def mean(self, field_id: int) -> float | None:
        values = self.samples.get(field_id, [])
        return statistics.fmean(values) if values else None

    def __repr__(self) -> str:
        parts = [
            f"{FIELDS.get(fid, f'field {fid}')} {mean:.0%}"
            for fid in self.samples
            if (mean := self.mean(fid)) is not None
        ]
        count = max((len(values) for values in self.samples.values()), default=0)
        return f"SmActivity({', '.join(parts) or 'no readings'}; {count} samples)"


def parse_dmon(text: str, fields: Sequence[int], gpu: int = 0) -> SmActivity:
    """The rows ``dcgmi dmon -e <fields>`` printed for ``gpu``; a value it could not read (N/A) is left out."""
    activity = SmActivity({fid: [] for fid in fields})
    for line in text.splitlines():
        words = line.split()
        if len(words) != len(fields) + 2 or words[0] != "GPU" or words[1] != str(gpu):
            continue
        for fid, word in zip(fields, words[2:]):
            try:
                value = float(word)
            except ValueError:
                continue
            activity.samples[fid].append(value / 100 if fid in _PERCENT_FIELDS else value)
    return activity


@contextlib.contextmanager
def watch_sm_activity(
    gpu: int = 0, fields: Sequence[int] = (203, 1002, 1004), interval_ms: int = 100
) -> Iterator[SmActivity]:
    """Sample ``fields`` of ``gpu`` (DCGM's GPU ID) with ``dcgmi dmon`` while the block runs."""
    if shutil.which("dcgmi") is None:
        raise FileNotFoundError("dcgmi is not on the PATH: DCGM is not installed here")
    command = ["dcgmi", "dmon", "-i", str(gpu), "-e", ",".join(map(str, fields)), "-d", str(interval_ms)]
    activity = SmActivity()
    monitor = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        yield activity
    finally:
        monitor.terminate()
        output, _ = monitor.communicate(timeout=10)
        activity.samples = parse_dmon(output, fields, gpu).samples
        if not any(activity.samples.values()):
            raise RuntimeError(f"dcgmi dmon printed no readings (is nv-hostengine running?):\n{output[-500:]}")
