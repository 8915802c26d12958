"""perflab.allocator: page faults counted, and freed memory kept in the process where glibc allows it."""

from __future__ import annotations

import subprocess
import sys

import perflab.allocator as allocator
import pytest
from perflab.allocator import keep_freed_memory, page_faults

# In a fresh interpreter, without importing perflab (and torch): glibc's thresholds start at their defaults.
CHURN = """
import importlib.util, sys
spec = importlib.util.spec_from_file_location("allocator", sys.argv[1])
allocator = sys.modules["allocator"] = importlib.util.module_from_spec(spec)
spec.loader.exec_module(allocator)

def churn():
    with allocator.page_faults() as faults:
        for _ in range(10):
            blocks = [bytearray(8 << 20) for _ in range(6)]  # 48 MiB, touched, then all freed: a step's activations
            del blocks
    return faults.count

churn()
before = churn()
kept = allocator.keep_freed_memory()
churn()
print(before, kept, churn())
"""


@pytest.mark.skipif(
    not sys.platform.startswith("linux") or allocator.resource is None, reason="glibc's mallopt: Linux only"
)
def test_kept_memory_is_reused_instead_of_faulted_in_again():
    completed = subprocess.run(
        [sys.executable, "-c", CHURN, allocator.__file__], capture_output=True, text=True, timeout=60, check=True
    )
    before, kept, after = completed.stdout.split()
    if kept != "True":
        pytest.skip("this C library has no mallopt (not glibc)")
    pages_touched = 10 * 48 * 256
    assert int(before) > pages_touched / 2, "glibc's defaults give the freed blocks back: every page faults again"
    assert int(after) < int(before) / 10


def test_page_faults_are_counted_where_the_system_counts_them():
    with page_faults() as faults:
        block = bytearray(4 << 20)
    assert faults.count is None if allocator.resource is None else faults.count >= 0
    assert len(block) == 4 << 20


def test_other_systems_are_left_alone(monkeypatch):
    monkeypatch.setattr(sys, "platform", "darwin")
    assert keep_freed_memory() is False
