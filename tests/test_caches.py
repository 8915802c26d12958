import pytest
import torch
from perflab.caches import Cache, _cpu_caches, _cpu_count, device_caches, format_bytes


def _index(root, name, level, kind, size, shared):
    folder = root / name
    folder.mkdir()
    for field, value in (("level", level), ("type", kind), ("size", size), ("shared_cpu_list", shared)):
        (folder / field).write_text(f"{value}\n")


def test_sysfs_caches_are_read_data_only_and_smallest_first(tmp_path):
    _index(tmp_path, "index3", 3, "Unified", "32768K", "0-7,64-71")
    _index(tmp_path, "index0", 1, "Data", "48K", "0,64")
    _index(tmp_path, "index1", 1, "Instruction", "32K", "0,64")
    _index(tmp_path, "index2", 2, "Unified", "1024K", "0")
    caches = _cpu_caches(tmp_path)
    assert caches == (Cache("L1d", 48 * 2**10, 2), Cache("L2", 2**20, 1), Cache("L3", 32 * 2**20, 16))
    assert [cache.label for cache in caches] == ["L1d 48 KiB", "L2 1 MiB", "L3 32 MiB"]
    assert _cpu_caches(tmp_path / "absent") == ()


def test_cpu_lists_count_ranges_and_singletons():
    assert [_cpu_count(text) for text in ("0", "0-1", "0,64", "0-3,8-11\n")] == [1, 2, 2, 8]


def test_a_device_without_reported_caches_has_none():
    assert device_caches("meta") == ()
    assert all(cache.size_bytes > 0 for cache in device_caches("cpu"))


def test_sizes_print_with_binary_prefixes():
    assert [format_bytes(size) for size in (512, 48 * 2**10, 1.5 * 2**20, 2**30)] == [
        "512 B",
        "48 KiB",
        "1.5 MiB",
        "1 GiB",
    ]
    assert repr(Cache("L2", 50 * 2**20, shared_by=None)) == "Cache(L2: 50 MiB, shared by the whole GPU)"
    assert repr(Cache("L2", 2**20)) == "Cache(L2: 1 MiB, private to one CPU)"


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="reads a CUDA GPU's L2: needs a CUDA device")
def test_a_cuda_gpu_reports_its_l2():
    (l2,) = device_caches("cuda")
    assert l2.name == "L2" and l2.size_bytes == torch.cuda.get_device_properties("cuda").L2_cache_size > 0
