"""perflab.launches: operators called, operators in all, and kernels, counted by the profiler."""

import pytest
import torch
from perflab.launches import Launches, count_launches


def tensors(count, size=32):
    return [torch.randn(size) for _ in range(count)]


@pytest.mark.parametrize("count", [3, 12])
def test_a_python_loop_calls_one_operator_per_tensor_and_foreach_one_for_the_list(count):
    weights, updates = tensors(count), tensors(count)
    loop = count_launches(lambda: [w.add_(u) for w, u in zip(weights, updates)], device="cpu")
    assert loop.called == {"aten::add_": count} and loop.calls == loop.operators == count
    assert loop.kernels is None  # a CPU has no kernels to count
    foreach = count_launches(lambda: torch._foreach_add_(weights, updates), device="cpu")
    assert foreach.called == {"aten::_foreach_add_": 1}
    # On a CPU the foreach operator runs the single-tensor one per tensor, nested under it.
    assert foreach.operators == count + 1


def test_warmup_calls_are_not_counted():
    calls = []

    def step():
        calls.append(len(calls))
        if len(calls) == 1:  # first call only: sets up state, as an optimizer's first step does
            torch.zeros(4).add_(1)
        torch.ones(4).mul_(2)

    counted = count_launches(step, device="cpu", warmup=1)
    assert len(calls) == 2 and "aten::add_" not in counted.called and counted.called["aten::mul_"] == 1
    with pytest.raises(ValueError, match="warmup"):
        count_launches(step, device="cpu", warmup=-1)


def test_reprs_name_the_most_called_operators():
    launches = Launches(called={"aten::mul_": 8, "aten::add_": 4, "aten::sqrt": 2, "aten::div": 1}, operators=30,
                        kernels=None, device="cpu")  # fmt: skip
    assert repr(launches) == (
        "Launches(15 operators called, 30 in all: aten::mul_ x8, aten::add_ x4, aten::sqrt x2, 1 more)"
    )
    html = launches._repr_html_()
    assert "<table>" in html and "aten::div" in html and "15 operators called, 30 in all" in html
    on_gpu = Launches(called={"aten::_fused_adamw_": 1}, operators=1, kernels=2, device="cuda:0")
    assert repr(on_gpu) == "Launches(1 operator called, 1 in all; 2 kernels on cuda:0: aten::_fused_adamw_ x1)"


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="counts CUDA kernels: needs a CUDA device")
def test_kernels_on_a_gpu():
    weights = [w.cuda() for w in tensors(10)]
    updates = [u.cuda() for u in tensors(10)]
    loop = count_launches(lambda: [w.add_(u) for w, u in zip(weights, updates)], device="cuda")
    foreach = count_launches(lambda: torch._foreach_add_(weights, updates), device="cuda")
    assert loop.kernels == 10
    assert 1 <= foreach.kernels < loop.kernels  # multi-tensor kernels: one launch covers many tensors
