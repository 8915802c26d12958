"""perflab.amp: what autocast does to each operation, read off real outputs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from perflab.amp import DEFAULT_OPS, autocast_dtypes, dtype_trace, grad_scaler_device


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


def _traced_step(dtype):
    torch.manual_seed(0)
    block = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.LayerNorm(16))
    with torch.autocast("cpu", dtype=dtype), dtype_trace() as trace:
        out = block(torch.randn(4, 8))
        loss = F.cross_entropy(out, torch.zeros(4, dtype=torch.long))
    return trace, out, loss


def test_dtype_trace_sees_the_casts_autocast_inserts():
    trace, out, loss = _traced_step(torch.bfloat16)
    assert trace.output_dtypes("addmm") == {torch.bfloat16}
    # Three casts down (input, weight, bias), read from float32; the only float32 op results are the loss's.
    assert trace.calls[("_to_copy", (torch.float32,), torch.bfloat16)] == 3
    assert trace.output_dtypes("_log_softmax") == trace.output_dtypes("nll_loss_forward") == {torch.float32}
    # On the CPU layer_norm is on neither list: a bfloat16 input gives a bfloat16 output.
    assert trace.output_dtypes("native_layer_norm") == {out.dtype} == {torch.bfloat16}
    assert trace.ops_in(torch.bfloat16)[:2] == ["_to_copy", "addmm"] and loss.dtype == torch.float32
    assert trace.output_dtypes("flash_attention") == set()


def test_dtype_trace_leaves_out_views_and_counts_repeats():
    with dtype_trace() as trace:
        x = torch.randn(4, 4)
        for _ in range(3):
            x.t().unsqueeze(0)[0].exp()
    assert [name for name, _, _ in trace.calls] == ["randn", "exp"]
    assert trace.calls[("exp", (torch.float32,), torch.float32)] == 3
    text, html = repr(trace), trace._repr_html_()
    assert text.splitlines()[0].split() == ["op", "reads", "writes", "calls"] and "randn" in text
    assert html.count("<tr") == 3 and torch.__version__ in html


def test_dtype_trace_without_autocast_is_all_float32():
    trace, out, loss = _traced_step(torch.bfloat16)
    with dtype_trace() as plain:
        torch.nn.Linear(8, 16)(torch.randn(4, 8))
    assert plain.ops_in(torch.bfloat16) == [] and plain.output_dtypes("addmm") == {torch.float32}
    assert not torch.is_autocast_enabled("cpu")


@pytest.mark.parametrize(
    ("device", "expected"), [("cpu", "cpu"), ("cuda", "cuda"), ("cuda:1", "cuda:1"), ("mps", "mps"), ("xpu", "cpu")]
)
def test_scaler_device_keeps_devices_with_gradscaler_kernels(device, expected):
    assert grad_scaler_device(device) == torch.device(expected)


def test_gradscaler_runs_on_the_scaler_device():
    # GradScaler really works where grad_scaler_device sends it: a step with an inf is skipped, the scale halves.
    device = grad_scaler_device()
    parameter = torch.nn.Parameter(torch.ones(2, device=device))
    optimizer = torch.optim.SGD([parameter], lr=1.0)
    scaler = torch.amp.GradScaler(device.type, init_scale=4.0)
    scaler.scale((parameter * torch.tensor([1.0, float("inf")], device=device)).sum()).backward()
    scaler.step(optimizer)
    scaler.update()
    assert torch.equal(parameter.detach().cpu(), torch.ones(2)) and scaler.get_scale() == 2.0
