"""perflab.widgets: explorers that recompute on every control change and print where widgets cannot render."""

from __future__ import annotations

import pytest
from perflab.floats import compare_formats
from perflab.memory_budget import estimate_training_memory
from perflab.models import GPTConfig
from perflab.train import Workload
from perflab.widgets import data_loading_explorer, float_format_explorer, measure_data_loading, training_memory_explorer

TINY = Workload(num_classes=3, train_per_class=80, val_per_class=8, image_size=32, epochs=1)
pytestmark = pytest.mark.usefixtures("private_data_cache")  # conftest.py


def test_float_explorer_follows_the_typed_number_and_prints_without_widgets():
    explorer = float_format_explorer(0.1)
    assert explorer.text == repr(compare_formats(0.1))
    explorer.controls["number"].value = 65520.0
    assert explorer.text == repr(compare_formats(65520.0))
    assert "inf" in explorer.text  # float16 overflows
    bundle = explorer._repr_mimebundle_()
    assert bundle["text/plain"] == explorer.text  # what nbval and a terminal see
    assert "application/vnd.jupyter.widget-view+json" in bundle


def test_memory_explorer_estimates_on_every_change_and_measures_on_request():
    explorer = training_memory_explorer()
    explorer.controls["batch_size"].value = 4
    explorer.controls["seq_len"].value = 64
    expected = estimate_training_memory(
        GPTConfig(n_layer=2, n_embd=128, n_head=2, block_size=64, attention="naive"), batch_size=4, seq_len=64
    )
    assert explorer.text == repr(expected)
    button, measured = explorer.children[-3], explorer.children[-2]
    button.click()
    assert "estimate / measured" in measured.value and "1.000" in measured.value


def test_memory_explorer_refuses_to_measure_what_would_not_fit():
    explorer = training_memory_explorer(max_share_of_ram=1e-9)
    button, measured = explorer.children[-3], explorer.children[-2]
    button.click()
    assert measured.value.startswith("<p>Not measured")


def test_data_loading_is_measured_over_steady_steps():
    rate, waiting = measure_data_loading(
        pipeline="pil", batch_size=8, num_workers=0, pin_memory=False, workload=TINY, steps=3
    )
    assert rate > 0
    assert 0 < waiting < 1


def test_data_loading_explorer_measures_each_setting_and_keeps_a_history():
    explorer = data_loading_explorer(TINY, steps=3)
    first = explorer.text
    explorer.controls["pipeline"].value = "cached"
    assert explorer.text.startswith("cached, batch 32")
    assert "samples/s" in explorer.text and explorer.text != first
    assert explorer.result.value.count("<tr>") == 2  # both settings tried so far
