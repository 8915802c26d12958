"""perflab.parallel_layout: every layout of a model on nodes of GPUs, which fit with room to spare, the fastest first."""

from __future__ import annotations

import dataclasses

import pytest
from perflab.models import GPTConfig
from perflab.parallel_layout import MEMORY_HEADROOM, layouts_for
from perflab.parallel_step import Layout, estimate_layout
from perflab.step_time import DGX_H100

CONFIG = GPTConfig(vocab_size=64, block_size=32, n_layer=4, n_head=4, n_embd=32)
WORKLOAD = dict(batch_size=2, seq_len=16)


def estimate(**layout) -> object:
    return estimate_layout(CONFIG, Layout(**layout), **WORKLOAD)


def test_layouts_fastest_first_fitting_with_headroom_tensor_parallelism_within_a_node_and_hsdp_across():
    nodes_of_two = dataclasses.replace(DGX_H100, memory_per_gpu=1e6, gpus_per_node=2)
    table = layouts_for(CONFIG, gpus=4, cluster=nodes_of_two, global_batch=4, seq_len=16, precision="float32")
    seconds = [s.step_s for s in table.steps]
    assert seconds == sorted(seconds) and {s.layout.gpus for s in table.steps} == {4}
    assert max(s.layout.tp for s in table.steps) == 2  # never across nodes
    assert [s.layout.label for s in table.steps if s.layout.replicate > 1] == ["DP 4 (HSDP 2 x 2)"]
    usable = (1 - MEMORY_HEADROOM) * 1e6
    assert table.usable_memory == usable and set(table.fitting) <= set(table.steps)
    assert [s for s in table.steps if s.estimate.peak <= usable] == list(table.fitting)
    tight = dataclasses.replace(nodes_of_two, memory_per_gpu=max(s.estimate.peak for s in table.steps))
    tight_table = layouts_for(CONFIG, gpus=4, cluster=tight, global_batch=4, seq_len=16, precision="float32")
    assert len(tight_table.fitting) < len(tight_table.steps)  # the largest peak fills the memory: no headroom left
    assert "fits in" in repr(table) and "<table>" in table._repr_html_()


def test_bad_layouts():
    for bad in (dict(zero=1), dict(tp=2, zero=0, dp=0), dict(sequence_parallel=True)):
        with pytest.raises(ValueError):
            Layout(**bad)
    with pytest.raises(ValueError, match="divide"):
        estimate(tp=3)
    with pytest.raises(ValueError, match="sdpa"):
        estimate_layout(GPTConfig(attention="naive"), Layout(), **WORKLOAD)
