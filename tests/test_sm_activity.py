"""DCGM's dmon output is read field by field, percent and ratios alike, and a missing dcgmi is said plainly."""

from __future__ import annotations

import shutil

import pytest
from perflab.sm_activity import parse_dmon, watch_sm_activity

DMON = """#Entity   GPUTL  SMACT  TENSO
ID
GPU 0     100    0.500  0.250
GPU 1     50     0.100  0.000
GPU 0     N/A    0.300  0.150
GPU 0     100    0.100
"""


def test_dmon_rows_of_one_gpu_are_averaged_and_unreadable_values_left_out():
    activity = parse_dmon(DMON, fields=(203, 1002, 1004), gpu=0)
    assert activity.samples == {203: [1.0], 1002: [0.5, 0.3], 1004: [0.25, 0.15]}
    assert activity.mean(1002) == pytest.approx(0.4)
    assert parse_dmon(DMON, fields=(203, 1002, 1004), gpu=1).samples[203] == [0.5]
    assert repr(parse_dmon("", fields=(1002,))) == "SmActivity(no readings; 0 samples)"


@pytest.mark.skipif(shutil.which("dcgmi") is not None, reason="DCGM is installed here")
def test_without_dcgm_the_watcher_says_so():
    with pytest.raises(FileNotFoundError, match="dcgmi"):
        with watch_sm_activity():
            pass
