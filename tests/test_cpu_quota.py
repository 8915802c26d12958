"""perflab.cpu_quota: the cores a cgroup CPU quota serves, read from folders laid out like /sys/fs/cgroup."""

import os

import pytest
import torch
from perflab import cpu_quota
from perflab.cpu_quota import fit_threads_to_quota, quota_cores


def _write(folder, **files):
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (folder / name.replace("__", ".")).write_text(text)


def _proc(tmp_path, text):
    path = tmp_path / "proc-cgroup"
    path.write_text(text)
    return path


def test_a_cgroup_v2_quota_is_read_in_cores(tmp_path):
    _write(tmp_path / "sys" / "ci" / "job", cpu__max="150000 100000\n")
    assert quota_cores(_proc(tmp_path, "0::/ci/job\n"), tmp_path / "sys") == 1.5


def test_the_tightest_quota_of_the_cgroup_and_its_parents_counts(tmp_path):
    _write(tmp_path / "sys" / "ci", cpu__max="50000 100000\n")
    _write(tmp_path / "sys" / "ci" / "job", cpu__max="max 100000\n")
    assert quota_cores(_proc(tmp_path, "0::/ci/job\n"), tmp_path / "sys") == 0.5


def test_a_cgroup_v1_quota_is_read_from_the_cpu_controllers_hierarchy(tmp_path):
    root = tmp_path / "sys"
    _write(root / "cpu", cpu__cfs_quota_us="-1\n", cpu__cfs_period_us="100000\n")
    _write(root / "cpu" / "slowed", cpu__cfs_quota_us="6666\n", cpu__cfs_period_us="10000\n")
    proc = _proc(tmp_path, "4:memory:/elsewhere\n2:cpuacct:/\n1:cpu:/slowed\n0::/\n")
    assert quota_cores(proc, root) == pytest.approx(0.6666)


@pytest.mark.parametrize(
    "files",
    [{}, {"cpu__max": "max 100000\n"}, {"cpu__max": "not a quota\n"}],
    ids=["no cpu.max", "no limit", "unreadable"],
)
def test_no_quota_where_none_is_set_or_none_can_be_read(tmp_path, files):
    _write(tmp_path / "sys" / "job", **files)
    assert quota_cores(_proc(tmp_path, "not a cgroup line\n0::/job\n"), tmp_path / "sys") is None
    assert quota_cores(tmp_path / "no-such-file", tmp_path / "sys") is None


@pytest.fixture
def torch_threads(monkeypatch):
    """torch's threads, OMP_NUM_THREADS and PERFLAB_THREADS_FITTED put back after the test."""
    threads = torch.get_num_threads()
    for name in ("OMP_NUM_THREADS", "PERFLAB_THREADS_FITTED"):
        monkeypatch.setenv(name, "recorded")  # so that monkeypatch puts back what was there, or nothing
        monkeypatch.delenv(name)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize(("quota", "expected"), [(0.67, 1), (1.9, 1), (2.5, 2), (None, None)])
def test_under_a_quota_torch_gets_the_threads_it_serves(torch_threads, monkeypatch, quota, expected):
    torch.set_num_threads(3)
    monkeypatch.setattr(cpu_quota, "affinity_cores", lambda: 3)
    monkeypatch.setattr(cpu_quota, "quota_cores", lambda: quota)
    assert fit_threads_to_quota() == expected
    assert torch.get_num_threads() == (expected or 3)
    assert (
        os.environ.get("OMP_NUM_THREADS")
        == os.environ.get("PERFLAB_THREADS_FITTED")
        == (str(expected) if expected else None)
    )


def test_threads_the_environment_sets_are_left_alone(torch_threads, monkeypatch):
    torch.set_num_threads(3)
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    monkeypatch.setattr(cpu_quota, "quota_cores", lambda: 1.0)
    assert fit_threads_to_quota() is None
    assert torch.get_num_threads() == 3
