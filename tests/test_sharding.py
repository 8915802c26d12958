"""perflab.sharding: the ZeRO estimate per rank, the memory trackers' categories, and collectives read off a profile."""

from __future__ import annotations

import contextlib
import os
import socket
import threading

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from perflab import torch_features
from perflab.memory import peak_memory
from perflab.memory_budget import estimate_training_memory
from perflab.models import GPTConfig
from perflab.sharding import (
    COMPONENTS,
    PEAK_PARTS,
    STAGES,
    Collective,
    SentBytes,
    ShardedStep,
    bus_factor,
    estimate_sharded_step,
    peak_parts,
    profile_collectives,
)
from torch.distributed._tools.fsdp2_mem_tracker import _FSDPRefType
from torch.distributed._tools.mem_tracker import _MemRefType
from torch.profiler import ProfilerActivity, profile, record_function

# torch >= 2.13's names for the same collectives, which older torch calls by the names they replaced
if torch_features.has("c10d_single_collectives"):
    all_gather_single, reduce_scatter_single = dist.all_gather_single, dist.reduce_scatter_single
    functional_all_gather, functional_reduce_scatter = funcol.all_gather_single, funcol.reduce_scatter_single
else:
    all_gather_single, reduce_scatter_single = dist.all_gather_into_tensor, dist.reduce_scatter_tensor
    functional_all_gather, functional_reduce_scatter = funcol.all_gather_tensor, funcol.reduce_scatter_tensor

CONFIG = GPTConfig(vocab_size=64, block_size=32, n_layer=3, n_head=2, n_embd=32)
WORKLOAD = dict(batch_size=2, seq_len=16)


def estimate(stage: str, world_size: int = 4, reshard_after_forward: bool = True) -> ShardedStep:
    return estimate_sharded_step(
        CONFIG, **WORKLOAD, world_size=world_size, stage=stage, reshard_after_forward=reshard_after_forward
    )


def test_each_stage_divides_what_the_zero_paper_says():
    whole = estimate_training_memory(CONFIG, **WORKLOAD)
    divided = {"ddp": set(), "zero1": {"optimizer_state"}, "zero2": {"optimizer_state", "gradients"}}
    divided["zero3"] = set(COMPONENTS)
    for stage in STAGES:
        step = estimate(stage)
        for component in COMPONENTS:
            expected = getattr(whole, component) // (4 if component in divided[stage] else 1)
            assert getattr(step, component) == expected, (stage, component)
        assert step.at_peak["activations"] == whole.activations  # no stage divides the activations


def test_the_peak_adds_the_parts_and_only_zero3_gathers():
    for stage in STAGES:
        step = estimate(stage)
        assert step.peak == sum(step.at_peak.values())
        assert (
            step.peak
            == step.parameters
            + step.gradients
            + step.optimizer_state
            + step.at_peak["activations"]
            + (step.at_peak["gathered"])
        )
        assert (step.at_peak["gathered"] > 0) == (stage == "zero3")
    # Without resharding every block stays gathered: the whole model, more than the root and two blocks.
    assert estimate("zero3", reshard_after_forward=False).at_peak["gathered"] == estimate("ddp").parameters
    assert estimate("zero3").at_peak["gathered"] < estimate("ddp").parameters


def test_more_ranks_never_hold_more_and_the_activations_stay():
    for stage in STAGES:
        peaks = [estimate(stage, world_size=n).peak for n in (1, 2, 4, 8)]
        assert peaks == sorted(peaks, reverse=True)
    # On many ranks ZeRO-3's peak approaches what no rank count divides: activations and gathered blocks.
    many = estimate("zero3", world_size=1 << 20)
    assert many.peak - many.at_peak["activations"] - many.at_peak["gathered"] < 1000


def test_communication_counts_bus_bytes():
    weights = estimate("ddp").parameters
    fraction = 3 / 4  # (N - 1) / N on 4 ranks
    assert estimate("ddp").sent == round(2 * weights * fraction)
    # DDP's all-reduce, then broadcasts, whose root sends the whole payload: bus factor 1, not (N - 1) / N.
    assert estimate("zero1").sent == round(2 * weights * fraction + weights)
    assert estimate("zero2").sent == estimate("ddp").sent  # a reduce-scatter and an all-gather: one all-reduce
    assert estimate("zero3", reshard_after_forward=False).sent == estimate("ddp").sent
    # Resharded, every block is gathered twice; the root once.
    assert estimate("ddp").sent < estimate("zero3").sent < round(3 * weights * fraction)
    assert all(estimate(stage, world_size=1).sent == 0 for stage in STAGES)


def test_bad_arguments_are_rejected():
    with pytest.raises(ValueError, match="unknown stage"):
        estimate("zero4")
    with pytest.raises(ValueError, match="world_size"):
        estimate("ddp", world_size=0)
    with pytest.raises(ValueError, match="unknown parts"):
        ShardedStep(
            stage="ddp", world_size=2, parameters=1, gradients=1, optimizer_state=1, at_peak={"weights": 1}, sent=0,
            source="measured",
        )  # fmt: skip


def test_a_comparison_reads_estimate_over_measured():
    planned = estimate("zero3", world_size=2)
    measured = ShardedStep(
        stage="zero3", world_size=2, parameters=planned.parameters, gradients=planned.gradients,
        optimizer_state=planned.optimizer_state, at_peak={"parameters": planned.peak // 2}, sent=planned.sent,
        source="measured on rank 0",
    )  # fmt: skip
    ratios = planned.compare(measured).ratios
    assert ratios["parameters"] == ratios["sent"] == 1.0
    assert ratios["peak"] == pytest.approx(2.0, rel=1e-6)
    assert measured.at_peak == dict.fromkeys(PEAK_PARTS, 0) | {"parameters": planned.peak // 2}
    assert "ZeRO-3 on 2 ranks" in repr(planned) and "estimate" in repr(planned)
    assert "ZeRO-3 on 2 ranks" in repr(planned.compare(measured))
    assert "<table>" in planned._repr_html_() and "estimate / measured" in planned.compare(measured)._repr_html_()
    assert estimate("zero3", reshard_after_forward=False).label == "ZeRO-3, no reshard after forward"


def test_every_category_of_pytorchs_memory_trackers_has_a_part():
    # A torch release that adds a category must not let its bytes vanish from the peak.
    for category in [*_MemRefType, *_FSDPRefType]:
        assert sum(peak_parts({category: 7, "Total": 7}).values()) == 7, category
    assert peak_parts({_FSDPRefType.UNSHARDED_PARAM: 5, _FSDPRefType.ALL_GATHER: 3})["gathered"] == 8
    with pytest.raises(ValueError, match="unknown memory tracker category"):
        peak_parts({"Mystery": 1})


@pytest.fixture
def world_of_one():
    """A gloo process group of one rank in this process: its collectives run through gloo like any other."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def profiled_collectives(inside_a_python_mode: bool):
    big, small = torch.ones(300), torch.ones(20)
    gathered, slice_ = torch.empty(20), torch.empty(300)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as profiled:
        dist.all_reduce(small)  # outside the window: not counted
        with record_function("step"), peak_memory() if inside_a_python_mode else contextlib.nullcontext():
            dist.all_reduce(big)
            dist.all_reduce(big.bfloat16())  # two bytes an element
            dist.broadcast(small, src=0)
            all_gather_single(gathered, small)
            reduce_scatter_single(slice_, big)
        dist.barrier()
    return profile_collectives(profiled, "step")


@pytest.fixture(params=["FunctionEvent.input_dtypes", "Kineto events"])
def dtypes_from(request, monkeypatch):
    """Where profile_collectives reads the dtypes: torch >= 2.12's FunctionEvent, or the Kineto events older torch has."""
    if request.param == "Kineto events":
        detected = torch_features._detected
        monkeypatch.setattr(
            torch_features, "_detected", lambda name: name != "profiler_input_dtypes" and detected(name)
        )
    elif not torch_features.has("profiler_input_dtypes"):
        pytest.skip(f"torch {torch.__version__}'s FunctionEvent has no input_dtypes")
    return request.param


@pytest.mark.parametrize("inside_a_python_mode", [False, True])
def test_collectives_are_counted_with_their_sizes_and_what_gloo_ran(world_of_one, dtypes_from, inside_a_python_mode):
    # Inside a TorchDispatchMode (peak_memory's) the profiler records each c10d operator twice, nested.
    found = {collective.kind: collective for collective in profiled_collectives(inside_a_python_mode).collectives}
    assert {kind: (c.count, c.payload, c.ran_as) for kind, c in found.items()} == {
        "all-reduce": (2, 300 * 4 + 300 * 2, "gloo:all_reduce"),
        "broadcast": (1, 20 * 4, "gloo:broadcast"),
        "all-gather": (1, 20 * 4, "gloo:all_gather"),
        "reduce-scatter": (1, 300 * 4, "gloo:all_reduce"),  # gloo has no reduce-scatter of its own
    }
    assert all(c.seconds >= 0 for c in found.values())


def test_bus_bytes_and_what_all_ranks_send():
    def collective(kind):
        return Collective(kind, count=1, payload=1000, seconds=0.0, ran_as="gloo")

    all_reduce, all_gather, broadcast = collective("all-reduce"), collective("all-gather"), collective("broadcast")
    assert [all_reduce.sent(n) for n in (1, 2, 4)] == [0, 1000, 1500]
    assert [all_gather.sent(n) for n in (1, 2, 4)] == [0, 500, 750]
    assert [broadcast.sent(n) for n in (1, 2, 4)] == [0, 1000, 1000]  # the root sends it all
    # All ranks together: each of the other N - 1 ranks receives the payload (twice, in an all-reduce).
    assert [all_reduce.total_sent(n) for n in (1, 2, 4)] == [0, 2000, 6000]
    assert [c.total_sent(4) for c in (all_gather, broadcast, collective("reduce-scatter"))] == [3000] * 3
    with pytest.raises(KeyError):
        bus_factor("all-to-all", 4)


def test_sent_bytes_counts_a_process_writes_and_the_loopback_interface():
    with socket.create_server(("127.0.0.1", 0)) as server:
        sender = socket.create_connection(server.getsockname())
        receiver, _ = server.accept()
        received = []
        reader = threading.Thread(target=lambda: received.append(len(receiver.recv(1 << 20, socket.MSG_WAITALL))))
        reader.start()
        with SentBytes() as sent:
            os.write(sender.fileno(), b"x" * (1 << 20))  # a write call, as gloo's transport makes
            reader.join(timeout=30)
        sender.close(), receiver.close()
    assert received == [1 << 20]
    if sent.process is None:
        pytest.skip("no /proc/self/io on this system")
    assert sent.process >= 1 << 20
    assert sent.loopback >= 1 << 20  # and headers, and whatever else used loopback meanwhile


def test_a_window_must_be_in_the_profile_once(world_of_one):
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as profiled:
        dist.all_reduce(torch.ones(4))
    with pytest.raises(ValueError, match="expected one region named 'step'"):
        profile_collectives(profiled, "step")


def test_dtensors_functional_collectives_are_counted_too(world_of_one, dtypes_from):
    big, small = torch.ones(300), torch.ones(20, dtype=torch.bfloat16)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as profiled:
        with record_function("step"):
            funcol.all_reduce(big, "sum", dist.group.WORLD).wait()
            functional_all_gather(small, 0, dist.group.WORLD).wait()
            functional_reduce_scatter(big, "sum", 0, dist.group.WORLD).wait()
        dist.barrier()
    found = {c.kind: (c.count, c.payload, c.ran_as) for c in profile_collectives(profiled, "step").collectives}
    assert found == {
        "all-reduce": (1, 300 * 4, "gloo:all_reduce"),
        "all-gather": (1, 20 * 2, "gloo:all_gather"),  # the output: the input times the group's size, here 1
        "reduce-scatter": (1, 300 * 4, "gloo:all_reduce"),
    }


def test_both_ways_of_reading_the_dtypes_agree_on_every_event(world_of_one):
    if not torch_features.has("profiler_input_dtypes"):
        pytest.skip(f"torch {torch.__version__}'s FunctionEvent has no input_dtypes to compare with")
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as profiled:
        dist.all_reduce(torch.ones(8, dtype=torch.bfloat16))
        torch.ones(4, dtype=torch.float16).sum()
        dist.barrier()
    recorded = {event.correlation_id(): event.dtypes() for event in profiled.profiler.kineto_results.events()}
    events = profiled.events()
    assert {"gloo:all_reduce", "aten::sum"} <= {event.name for event in events}
    assert all(recorded[event.id] == event.input_dtypes for event in events)
