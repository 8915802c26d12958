"""The CPU's clock and what held it back while a block ran: what this machine exposes, read, and what it does not.

    >>> from perflab.cpu_clock import watch_cpu_clock
    >>> with watch_cpu_clock(interval=0.05) as clock:
    ...     total = sum(i * i for i in range(300_000))
    >>> clock.seconds > 0, clock.samples > 0
    (True, True)
    >>> clock                                   # what this machine exposes, and what each reading says
    CpuClock(...)

The CPU's counterpart of ``nvidia-smi``'s clocks and throttle reasons (lecture 02, section 2).
Linux exposes a CPU's state in several places, and a virtual machine fills in only some:

- the clock: ``/sys/devices/system/cpu/cpu*/cpufreq/scaling_cur_freq`` (kHz; with its limits
  ``cpuinfo_min_freq`` and ``cpuinfo_max_freq``) where a cpufreq driver runs. Without one (most
  virtual machines) ``psutil.cpu_freq()`` falls back to ``/proc/cpuinfo``'s ``cpu MHz``, the figure
  the hypervisor reports, which does not follow the real clock: :attr:`CpuClock.exposes_frequency`
  is False then, and the samples are shown only as what they are;
- thermal throttling: ``/sys/devices/system/cpu/cpu*/thermal_throttle/*_throttle_count`` (Intel),
  counted before and after;
- the hypervisor: ``steal`` in ``/proc/stat`` (``psutil.cpu_times().steal``), time this machine's
  virtual CPUs were ready to run but the host ran something else;
- the container: ``nr_throttled`` and ``throttled_usec`` (cgroup v2) or ``throttled_time`` (v1) in
  ``cpu.stat``, periods where the CPU quota ran out; and ``/proc/pressure/cpu``, time some task
  waited for a CPU.

A reading this machine does not expose is None and says so. See the kernel's documentation,
``admin-guide/pm/cpufreq.rst``, ``admin-guide/cgroup-v2.rst`` and ``accounting/psi.rst``.

Used in: lecture 02 (profiling).
"""

from __future__ import annotations

import contextlib
import glob
import statistics
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from perflab.render import Table

__all__ = ["CpuClock", "watch_cpu_clock"]

_CPUFREQ = "/sys/devices/system/cpu/cpu[0-9]*/cpufreq"
_THROTTLE_COUNTS = "/sys/devices/system/cpu/cpu[0-9]*/thermal_throttle/*_throttle_count"
_CGROUP_STATS = ("/sys/fs/cgroup/cpu.stat", "/sys/fs/cgroup/cpu/cpu.stat", "/sys/fs/cgroup/cpu,cpuacct/cpu.stat")
_PRESSURE = "/proc/pressure/cpu"


def _read_number(path: str) -> int | None:
    try:
        return int(Path(path).read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _frequencies_mhz() -> tuple[list[float], str]:
    """Each CPU's clock now, and where it was read."""
    sysfs = [_read_number(f"{folder}/scaling_cur_freq") for folder in sorted(glob.glob(_CPUFREQ))]
    if sysfs and all(value is not None for value in sysfs):
        return [value / 1e3 for value in sysfs], "cpufreq (sysfs)"
    readings = psutil.cpu_freq(percpu=True) or []
    return [reading.current for reading in readings], "/proc/cpuinfo (no cpufreq driver)"


def _cgroup_throttling() -> tuple[int, float] | None:
    """(periods throttled, seconds throttled) of this process's CPU cgroup; None where no cpu.stat has them."""
    for path in _CGROUP_STATS:
        try:
            fields = dict(line.split() for line in Path(path).read_text().splitlines() if line.strip())
        except (OSError, ValueError):
            continue
        if "nr_throttled" in fields:
            seconds = (
                int(fields["throttled_usec"]) / 1e6
                if "throttled_usec" in fields
                else int(fields.get("throttled_time", 0)) / 1e9
            )
            return int(fields["nr_throttled"]), seconds
    return None


def _pressure_us() -> int | None:
    """Microseconds some task has waited for a CPU since boot (PSI); None without PSI."""
    try:
        some = Path(_PRESSURE).read_text().splitlines()[0]
        return int(some.rsplit("total=", 1)[1])
    except (OSError, IndexError, ValueError):
        return None


def _throttle_events() -> int | None:
    counts = [_read_number(path) for path in glob.glob(_THROTTLE_COUNTS)]
    return sum(count for count in counts if count is not None) if counts else None


@dataclass
class CpuClock:
    """What :func:`watch_cpu_clock` read: the clock's samples (MHz, one list per CPU) and the throttling counters.

    Every counter is the change over the block; None where this machine does not expose it.
    """

    source: str = ""
    samples_mhz: list[list[float]] = field(default_factory=list)
    max_mhz: float | None = None
    seconds: float = 0.0
    thermal_throttle_events: int | None = None
    steal_share: float | None = None
    cgroup_throttled: tuple[int, float] | None = None
    pressure_share: float | None = None

    @property
    def samples(self) -> int:
        return len(self.samples_mhz[0]) if self.samples_mhz else 0

    @property
    def exposes_frequency(self) -> bool:
        """Whether the samples follow the real clock (a cpufreq driver), not a figure the hypervisor reports."""
        return self.source.startswith("cpufreq")

    def _clock_row(self) -> str:
        values = [value for cpu in self.samples_mhz for value in cpu]
        if not values:
            return "not exposed"
        text = f"{statistics.fmean(values):,.0f} MHz (min {min(values):,.0f}, max {max(values):,.0f})"
        if self.max_mhz:
            text += f", {statistics.fmean(values) / self.max_mhz:.0%} of its {self.max_mhz:,.0f} MHz maximum"
        if not self.exposes_frequency:
            changed = "unchanged" if len(set(values)) == 1 else f"{len(set(values))} distinct values"
            text += f", {changed}: no cpufreq driver, so this is the figure the system reports, not a measured clock"
        return text

    def _table(self) -> Table:
        def missing(what: str) -> str:
            return f"not exposed here ({what})"

        cgroup = (
            missing("no cpu.stat with nr_throttled")
            if self.cgroup_throttled is None
            else f"{self.cgroup_throttled[0]} periods, {self.cgroup_throttled[1]:.3f} s"
        )
        rows = [
            ("clock", self._clock_row(), self.source),
            (
                "thermal throttling",
                missing("no thermal_throttle counters")
                if self.thermal_throttle_events is None
                else f"{self.thermal_throttle_events} events",
                "sysfs thermal_throttle",
            ),
            (
                "stolen by the hypervisor",
                missing("no steal time") if self.steal_share is None else f"{self.steal_share:.1%} of the CPUs' time",
                "/proc/stat steal",
            ),
            ("cgroup CPU quota throttled", cgroup, "cgroup cpu.stat"),
            (
                "waiting for a CPU",
                missing("no PSI")
                if self.pressure_share is None
                else f"{self.pressure_share:.1%} of the time some task waited",
                "/proc/pressure/cpu",
            ),
        ]
        caption = f"{self.samples} samples of {len(self.samples_mhz)} CPUs over {self.seconds:.2f} s"
        return Table(("reading", "while the block ran", "read from"), rows, caption=caption)

    def __repr__(self) -> str:
        clock = self._clock_row()
        return f"CpuClock({clock}; from {self.source}; {self.samples} samples over {self.seconds:.2f} s)"

    def __str__(self) -> str:
        return str(self._table())

    def _repr_html_(self) -> str:
        return self._table()._repr_html_()


@contextlib.contextmanager
def watch_cpu_clock(interval: float = 0.1) -> Iterator[CpuClock]:
    """Sample every CPU's clock every ``interval`` seconds inside the block, and count what throttled it."""
    clock = CpuClock()
    frequencies, clock.source = _frequencies_mhz()
    limits = [_read_number(f"{folder}/cpuinfo_max_freq") for folder in glob.glob(_CPUFREQ)]
    clock.max_mhz = max(limits) / 1e3 if limits and None not in limits else None
    clock.samples_mhz = [[value] for value in frequencies]
    stop = threading.Event()

    def sample() -> None:
        while not stop.wait(interval):
            for cpu, value in zip(clock.samples_mhz, _frequencies_mhz()[0]):
                cpu.append(value)

    throttles, cgroup, pressure = _throttle_events(), _cgroup_throttling(), _pressure_us()
    steal = getattr(psutil.cpu_times(), "steal", None)
    sampler = threading.Thread(target=sample, daemon=True)
    start = time.perf_counter()
    sampler.start()
    try:
        yield clock
    finally:
        stop.set()
        sampler.join()
        clock.seconds = time.perf_counter() - start
        cpus = psutil.cpu_count() or 1
        if throttles is not None and (after := _throttle_events()) is not None:
            clock.thermal_throttle_events = after - throttles
        if steal is not None:
            clock.steal_share = (psutil.cpu_times().steal - steal) / (clock.seconds * cpus)
        if cgroup is not None and (after := _cgroup_throttling()) is not None:
            clock.cgroup_throttled = (after[0] - cgroup[0], after[1] - cgroup[1])
        if pressure is not None and (after := _pressure_us()) is not None:
            clock.pressure_share = (after - pressure) / 1e6 / clock.seconds
