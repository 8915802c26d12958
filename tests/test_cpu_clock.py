"""The CPU clock watcher reads what the machine exposes, and says plainly what it does not."""

from __future__ import annotations

from perflab import cpu_clock
from perflab.cpu_clock import CpuClock, watch_cpu_clock


def test_a_machine_without_cpufreq_says_its_clock_is_not_measured(monkeypatch):
    monkeypatch.setattr(cpu_clock, "_CPUFREQ", "/nonexistent/cpu*/cpufreq")
    with watch_cpu_clock(interval=0.01) as clock:
        sum(i * i for i in range(100_000))
    assert not clock.exposes_frequency
    assert clock.samples >= 1 and clock.seconds > 0
    assert "not a measured clock" in repr(clock)


def test_cgroup_throttling_is_read_from_either_cgroup_version(tmp_path, monkeypatch):
    v2, v1 = tmp_path / "v2.stat", tmp_path / "v1.stat"
    v2.write_text("usage_usec 100\nnr_periods 10\nnr_throttled 3\nthrottled_usec 250000\n")
    v1.write_text("nr_periods 10\nnr_throttled 2\nthrottled_time 500000000\n")
    monkeypatch.setattr(cpu_clock, "_CGROUP_STATS", (str(tmp_path / "missing"), str(v2)))
    assert cpu_clock._cgroup_throttling() == (3, 0.25)
    monkeypatch.setattr(cpu_clock, "_CGROUP_STATS", (str(v1),))
    assert cpu_clock._cgroup_throttling() == (2, 0.5)
    monkeypatch.setattr(cpu_clock, "_CGROUP_STATS", (str(tmp_path / "missing"),))
    assert cpu_clock._cgroup_throttling() is None


def test_every_missing_reading_says_it_is_not_exposed():
    table = str(CpuClock(source="/proc/cpuinfo (no cpufreq driver)", samples_mhz=[[2000.0, 2000.0]], seconds=1.0))
    assert table.count("not exposed here") == 4
    exposed = CpuClock(
        source="cpufreq (sysfs)",
        samples_mhz=[[1500.0, 3000.0]],
        max_mhz=3000.0,
        seconds=1.0,
        thermal_throttle_events=2,
        steal_share=0.1,
        cgroup_throttled=(1, 0.2),
        pressure_share=0.5,
    )
    assert exposed.exposes_frequency and "75% of its 3,000 MHz maximum" in str(exposed)
    assert "not exposed" not in str(exposed)
