import perflab
import pytest
import torch
from perflab.device import DEVICE_ENV_VAR, SyncCounter, available_devices, count_syncs, pick_device, synchronize


def test_pick_device_defaults_to_the_best_available(monkeypatch):
    monkeypatch.delenv(DEVICE_ENV_VAR, raising=False)
    assert pick_device().type == available_devices()[0]
    assert available_devices()[-1] == "cpu"


def test_pick_device_honours_the_environment_variable(monkeypatch):
    monkeypatch.setenv(DEVICE_ENV_VAR, "cpu")
    assert pick_device() == torch.device("cpu")


def test_pick_device_names_what_is_available_when_the_request_is_not(monkeypatch):
    monkeypatch.delenv(DEVICE_ENV_VAR, raising=False)
    missing = next(kind for kind in ("cuda", "mps", "xpu") if kind not in available_devices())
    with pytest.raises(RuntimeError, match="available here: .*cpu"):
        pick_device(missing)


def test_pick_device_rejects_a_name_that_is_not_a_device():
    with pytest.raises(ValueError, match="not a device name"):
        pick_device("gpu please")


def test_synchronize_on_cpu_returns():
    assert synchronize("cpu") is None


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_synchronize_waits_for_queued_cuda_work():
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    x = torch.randn(2048, 2048, device="cuda")
    start.record()
    for _ in range(20):
        x = x @ x / 2048
    end.record()
    synchronize("cuda")
    assert end.query(), "after synchronize every queued kernel has finished"


def test_sync_counter_counts_each_host_request_once():
    x = torch.randn(8)
    with SyncCounter() as syncs:
        x.sum().item()
        f"{x.sum():.3f}"
        bool(x.sum() > 0)
        repr(x)  # repr calls tolist/item inside: still one request
        x.cpu()
        x * 2 + 1  # noqa: B018 (device work only: no request)
    assert syncs.total == 5
    assert syncs.by_method["item"] == 1 and syncs.by_method["__repr__"] == 1
    assert "5 host-device sync points" in repr(syncs)


def test_sync_counter_restores_tensor_methods_even_after_an_error():
    before = {name: torch.Tensor.__dict__.get(name) for name in ("item", "__repr__", "__bool__")}
    with pytest.raises(ZeroDivisionError):
        with SyncCounter():
            raise ZeroDivisionError
    after = {name: torch.Tensor.__dict__.get(name) for name in before}
    assert after == before


def test_sync_counter_cannot_be_entered_twice():
    counter = SyncCounter()
    with counter:
        with pytest.raises(RuntimeError, match="already counting"):
            counter.__enter__()


def test_count_syncs_still_counts_but_warns_it_was_renamed():
    with pytest.warns(DeprecationWarning, match="SyncCounter"):
        counter = perflab.count_syncs()
    assert perflab.count_syncs is count_syncs and isinstance(counter, SyncCounter)
    assert "SyncCounter" in perflab.__all__ and "count_syncs" not in perflab.__all__
    with counter as syncs:
        torch.ones(2).sum().item()
    assert syncs.total == 1
