"""perflab.parallel_layout: every layout of a model on a number of GPUs, and which fit."""

from __future__ import annotations

import pytest
from perflab.models import GPTConfig
from perflab.parallel_layout import layouts_for
from perflab.parallel_step import Layout, estimate_layout

CONFIG = GPTConfig(vocab_size=64, block_size=32, n_layer=4, n_head=4, n_embd=32)
WORKLOAD = dict(batch_size=2, seq_len=16)


def estimate(**layout) -> object:
    return estimate_layout(CONFIG, Layout(**layout), **WORKLOAD)


def test_layouts_that_fit_and_bad_layouts():
    table = layouts_for(CONFIG, gpus=4, memory_per_gpu=1e6, global_batch=4, seq_len=16, precision="float32")
    sent = [e.sent() for e in table.estimates]
    assert sent == sorted(sent) and {e.layout.gpus for e in table.estimates} == {4}
    assert set(table.fitting) <= set(table.estimates) and all(e.peak <= 1e6 for e in table.fitting)
    assert "fits" in repr(table) and "<table>" in table._repr_html_()
    for bad in (dict(zero=1), dict(tp=2, zero=0, dp=0), dict(sequence_parallel=True)):
        with pytest.raises(ValueError):
            Layout(**bad)
    with pytest.raises(ValueError, match="divide"):
        estimate(tp=3)
    with pytest.raises(ValueError, match="sdpa"):
        estimate_layout(GPTConfig(attention="naive"), Layout(), **WORKLOAD)
