"""perflab.step_time: a layout's step on nodes of GPUs, compute, communication on its links and bubble, on paper."""

from __future__ import annotations

import dataclasses

import pytest
from perflab.models import GPT, GPTConfig
from perflab.parallel_step import RECOMPUTE, Layout
from perflab.step_time import DGX_H100, INFINIBAND_NDR, NVLINK_4, Cluster, Link, estimate_step_time
from perflab.training_mfu import palm_flops_per_token

CONFIG = GPTConfig(vocab_size=64, block_size=32, n_layer=4, n_head=4, n_embd=32)
WORKLOAD = dict(global_batch=8, seq_len=32, precision="bfloat16")
PEAK = DGX_H100.gpu.flops_per_s("bfloat16")


def cluster(inside: float = 450e9, across: float = 50e9, gpus_per_node: int = 2) -> Cluster:
    """DGX H100's GPUs in nodes of two, with links of the given bytes per second."""
    return dataclasses.replace(DGX_H100, gpus_per_node=gpus_per_node, inside=Link("inside", inside, ""),
                               across=Link("across", across, ""))  # fmt: skip


def step(layout: Layout, on: Cluster = DGX_H100, **workload):
    return estimate_step_time(CONFIG, layout, on, **{**WORKLOAD, **workload})


def test_each_group_crosses_the_link_of_the_ranks_it_spans_tensor_parallel_ranks_adjacent_then_dp_then_pp():
    def links(layout):
        return {g.group: g.link for g in step(layout, on=dataclasses.replace(DGX_H100, gpus_per_node=4)).groups}

    assert links(Layout(dp=2, tp=2, zero=3, sequence_parallel=True)) == {"tp": NVLINK_4, "dp": NVLINK_4}
    assert links(Layout(dp=4, tp=2, zero=3, sequence_parallel=True)) == {"tp": NVLINK_4, "dp": INFINIBAND_NDR}
    assert links(Layout(dp=2, tp=2, pp=2, zero=1, sequence_parallel=True)) == {
        "tp": NVLINK_4, "dp": NVLINK_4, "pp": INFINIBAND_NDR}  # fmt: skip
    # HSDP: shards within a node, the replicas across
    assert links(Layout(dp=8, zero=3, replicate=2)) == {"dp": NVLINK_4, "replicate": INFINIBAND_NDR}


def test_compute_is_palm_s_flops_at_the_datasheet_peak_full_recomputation_adds_the_blocks_forward_selective_none():
    model, tokens = GPT(CONFIG), WORKLOAD["global_batch"] * WORKLOAD["seq_len"]
    one = step(Layout())
    assert one.compute_s == pytest.approx(palm_flops_per_token(model) * tokens / PEAK)
    blocks = sum(p.numel() for p in model.blocks.parameters())
    again = (2 * blocks + 4 * CONFIG.n_layer * CONFIG.block_size * CONFIG.n_embd) * tokens / PEAK
    assert step(Layout(), recompute="full").compute_s == pytest.approx(one.compute_s + again)
    # Selective recomputation runs again only LayerNorms, GELU, additions and casts: no FLOP PaLM counts
    assert step(Layout(), recompute="selective").compute_s == one.compute_s
    assert step(Layout(dp=2)).compute_s == pytest.approx(one.compute_s / 2)  # spread over the GPUs
    assert one.groups == () and one.step_s == one.compute_s


def test_recomputed_tensor_parallel_collectives_wait_too_selective_s_fewer_than_full_s_under_sequence_parallelism():
    steps = {recompute: step(Layout(tp=2, sequence_parallel=True), recompute=recompute) for recompute in RECOMPUTE}
    waits = [steps[recompute].exposed_s for recompute in ("none", "selective", "full")]
    assert waits == sorted(waits) and len(set(waits)) == 3
    # What each waits for more than none: the recomputed collectives' bus bytes over the link, nothing else
    for recompute in ("selective", "full"):
        (group,) = steps[recompute].groups
        recomputed = steps[recompute].estimate.sent("tp") - steps["none"].estimate.sent("tp")
        assert waits[RECOMPUTE.index(recompute)] - waits[0] == pytest.approx(recomputed / group.link.bytes_per_s)


def test_tensor_parallel_collectives_wait_in_full_data_parallel_traffic_hides_behind_the_compute():
    tp = step(Layout(tp=2, sequence_parallel=True), on=cluster(inside=1e9))
    (group,) = tp.groups
    # Every micro-batch waits for its collectives, but the optimizer step's LayerNorm all-reduces wait too
    assert group.exposed_s == pytest.approx(group.seconds) and tp.step_s == pytest.approx(tp.compute_s + group.seconds)
    for bandwidth in (1e6, 1e16):  # FSDP2's traffic of every micro-batch: what exceeds the compute waits, and
        fsdp = step(Layout(dp=2, zero=3), on=cluster(inside=bandwidth))
        (group,) = fsdp.groups
        # the root's all-gather before the first compute and its reduce-scatter after the last, whatever the link
        edge = sum(t.sent(2) for t in fsdp.estimate.transfers if t.exposed) / bandwidth
        assert group.bus_bytes == fsdp.estimate.sent("dp") and edge > 0
        assert group.exposed_s == pytest.approx(edge + max(0.0, group.seconds - edge - fsdp.compute_s))
    assert fsdp.step_s == pytest.approx(fsdp.compute_s, rel=1e-3)  # on the fast link, next to nothing to wait for


def test_what_no_compute_is_left_to_run_beside_waits_whole_in_every_micro_batch_or_once_per_step():
    ends = (CONFIG.vocab_size + CONFIG.block_size + 2) * CONFIG.n_embd * 4  # the root's bytes: embeddings, final LN
    fast = cluster(inside=1e15)  # the rest of the traffic hides behind the compute
    m = WORKLOAD["global_batch"] // 2
    for zero, edges in ((3, {("forward", "all-gather"), ("backward", "reduce-scatter")}),
                        (2, {("backward", "reduce-scatter")})):  # fmt: skip
        sharded = step(Layout(dp=2, zero=zero), on=fast)
        exposed = [t for t in sharded.estimate.transfers if t.exposed]
        assert {(t.phase, t.kind) for t in exposed} == edges  # the root's gather first, the ends' reduction last
        assert all((t.count, t.payload, t.once_per_step) == (m, m * ends, False) for t in exposed)
        after_the_step = sum(t.sent(2) for t in sharded.estimate.transfers if t.phase == "optimizer step")
        (group,) = sharded.groups
        assert group.seconds - sum(t.sent(2) for t in exposed) / 1e15 - after_the_step / 1e15 < sharded.compute_s
        assert group.exposed_s == pytest.approx((sum(t.sent(2) for t in exposed) + after_the_step) / 1e15)
        assert sharded.step_s == pytest.approx(sharded.compute_s + group.exposed_s)
    # Per micro-batch, the root's transfers are in the pipeline's busy time: the bubble grows with them
    piped = step(Layout(dp=2, pp=2, zero=3), on=cluster(inside=1e15, gpus_per_node=4))
    busy = piped.compute_s + sum(g.exposed_s for g in piped.groups)  # ZeRO-3 waits for nothing once per step
    assert piped.bubble_s == pytest.approx(busy * piped.estimate.bubble / (1 - piped.estimate.bubble))


def test_once_per_step_traffic_hides_behind_the_last_micro_batch_s_backward_only():
    ddp = step(Layout(dp=2), on=cluster(inside=1e8))
    (group,) = ddp.groups
    last_backward = ddp.compute_s / ddp.estimate.microbatches * 2 / 3  # PaLM's count: backward is 2/3 of a step
    assert ddp.estimate.microbatches == 4 and group.seconds > last_backward
    assert group.exposed_s == pytest.approx(group.seconds - last_backward)
    # ZeRO-1 reduce-scatters once, in the last backward, the ends' gradients after its last compute, and
    # all-gathers the parameters after the step: no compute left beside those two
    zero1 = step(Layout(dp=2, zero=1), on=cluster(inside=1e15))
    gather = zero1.estimate.payload("all-gather", phase="optimizer step") * 0.5 / 1e15
    (last,) = (t for t in zero1.estimate.transfers if t.exposed)
    assert last.once_per_step and last.kind == "reduce-scatter"
    assert zero1.groups[0].exposed_s == pytest.approx(gather + last.sent(2) / 1e15)
    assert zero1.step_s == pytest.approx(zero1.compute_s + zero1.groups[0].exposed_s)


def test_the_bubble_is_the_pipeline_s_busy_time_times_its_idle_share():
    for global_batch in (2, 8):
        pipeline = step(Layout(pp=2), on=cluster(across=1e9, gpus_per_node=1), global_batch=global_batch)
        (sends,) = pipeline.groups
        busy = pipeline.compute_s + sends.seconds  # a stage waits for its input: the sends are in the critical path
        assert pipeline.bubble_s == pytest.approx(busy * (2 - 1) / global_batch)
        assert pipeline.step_s == pytest.approx(busy * (global_batch + 2 - 1) / global_batch)


def test_hsdp_keeps_the_per_micro_batch_traffic_inside_a_node_and_crosses_nodes_once_per_step():
    fsdp, hsdp = (step(Layout(dp=4, zero=3, replicate=r), on=cluster(), global_batch=32) for r in (1, 2))
    assert fsdp.groups[0].link.name == "across" and fsdp.estimate.sent("replicate") == 0
    across = {g.group: g for g in hsdp.groups if g.link.name == "across"}
    assert list(across) == ["replicate"] and across["replicate"].bus_bytes < fsdp.estimate.sent("dp") / 10
    assert all(t.once_per_step for t in hsdp.estimate.transfers if t.group == "replicate")
    assert "HSDP 2 x 2" in repr(hsdp) and "<table>" in hsdp._repr_html_()
    with pytest.raises(ValueError, match="divide the global batch"):
        step(Layout(dp=3), global_batch=8)
