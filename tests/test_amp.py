"""perflab.amp: what autocast does to each operation, read off real outputs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from perflab.amp import DEFAULT_OPS, autocast_dtypes


@pytest.fixture(scope="module")
def cpu_bfloat16():
    return autocast_dtypes("cpu", torch.bfloat16)


def test_matmuls_and_convolutions_are_lowered(cpu_bfloat16):
    for op in ("matmul (x @ x)", "linear", "conv2d"):
        row = cpu_bfloat16[op]
        assert row.effect == "lowered" and row.from_float32 == torch.bfloat16, row
    assert {"matmul (x @ x)", "linear", "conv2d"} <= set(cpu_bfloat16.with_effect("lowered"))


def test_losses_are_raised_to_float32(cpu_bfloat16):
    for op in ("cross_entropy", "mse_loss"):
        row = cpu_bfloat16[op]
        assert row.effect == "raised", row
        assert (row.from_float32, row.from_low, row.without_autocast) == (torch.float32, torch.float32, torch.bfloat16)


def test_other_ops_follow_their_inputs(cpu_bfloat16):
    relu = cpu_bfloat16["relu"]
    assert (relu.from_float32, relu.from_low, relu.without_autocast, relu.effect) == (
        torch.float32,
        torch.bfloat16,
        torch.bfloat16,
        "unchanged",
    )
    # A float32 operand promotes the sum to float32 with or without autocast: type promotion, not autocast.
    add = cpu_bfloat16["add"]
    assert add.from_low == add.without_autocast == torch.float32 and add.effect == "unchanged"


def test_float16_on_the_cpu_lowers_the_same_matmuls():
    table = autocast_dtypes("cpu", torch.float16, ops={name: DEFAULT_OPS[name] for name in ("linear", "cross_entropy")})
    assert table["linear"].from_float32 == torch.float16 and table["cross_entropy"].effect == "raised"
    assert [row.op for row in table.rows] == ["linear", "cross_entropy"]


def test_effects_come_from_the_outputs_not_from_a_list():
    ops = {
        "to float64": lambda x: x.double(),  # autocast never touches float64
        "softmax with dtype=float32": lambda x: torch.softmax(x, dim=-1, dtype=torch.float32),
        "cast to bfloat16": lambda x: x.to(torch.bfloat16),
    }
    table = autocast_dtypes("cpu", torch.bfloat16, ops=ops)
    assert table["to float64"].from_low == torch.float64 and table["to float64"].effect == "unchanged"
    # float32 out of a low input, but plain PyTorch gives float32 too: the explicit dtype did it, not autocast.
    explicit = table["softmax with dtype=float32"]
    assert explicit.from_low == explicit.without_autocast == torch.float32 and explicit.effect == "unchanged"
    assert table["cast to bfloat16"].effect == "lowered"  # whatever makes a float32 input come out low


def test_default_dtype_is_bfloat16_off_cuda():
    table = autocast_dtypes("cpu", ops={"linear": DEFAULT_OPS["linear"]})
    assert table.dtype == torch.bfloat16 and table["linear"].from_float32 == torch.bfloat16


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.int8])
def test_only_low_precisions_are_accepted(dtype):
    with pytest.raises(ValueError, match="bfloat16 or float16"):
        autocast_dtypes("cpu", dtype)


def test_devices_without_autocast_are_refused(monkeypatch):
    monkeypatch.setattr(torch.amp, "is_autocast_available", lambda device_type: False)
    with pytest.raises(ValueError, match="does not support device type 'cpu'"):
        autocast_dtypes("cpu")


def test_unknown_ops_name_what_was_measured(cpu_bfloat16):
    with pytest.raises(KeyError, match="cross_entropy"):
        cpu_bfloat16["flash_attention"]


def test_text_and_html_list_every_row(cpu_bfloat16):
    text = repr(cpu_bfloat16)
    assert text.splitlines()[-1].startswith("torch.autocast(device_type='cpu', dtype=torch.bfloat16)")
    assert torch.__version__ in text and len(text.splitlines()) == 2 + len(DEFAULT_OPS)
    for row in cpu_bfloat16.rows:
        assert row.op in text
    html = cpu_bfloat16._repr_html_()
    assert html.count("<tr") == 1 + len(DEFAULT_OPS) and "<caption>" in html and "raised" in html


def test_autocast_is_off_again_afterwards():
    autocast_dtypes("cpu", ops={"linear": DEFAULT_OPS["linear"]})
    assert not torch.is_autocast_enabled("cpu")
    assert F.linear(torch.ones(2, 2), torch.ones(2, 2)).dtype == torch.float32


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_keeps_log_softmax_and_layer_norm_in_float32():
    # The CUDA float32 list (autocast op reference) is longer than the CPU's.
    table = autocast_dtypes("cuda", torch.float16)
    assert table["linear"].effect == "lowered"
    for op in ("log_softmax", "layer_norm", "exp", "cross_entropy"):
        assert table[op].effect == "raised", table[op]
