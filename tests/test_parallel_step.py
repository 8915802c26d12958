"""perflab.parallel_step: per-GPU memory and communication of the course GPT under DP, ZeRO, TP and PP, on paper."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from perflab.memory import peak_memory
from perflab.memory_budget import estimate_training_memory
from perflab.models import GPT, GPTConfig
from perflab.parallel_step import RECOMPUTE, SELECTIVE_SAVE, Layout, Transfer, estimate_layout
from perflab.sharding import bus_factor, estimate_sharded_step
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

CONFIG = GPTConfig(vocab_size=64, block_size=32, n_layer=4, n_head=4, n_embd=32)
WORKLOAD = dict(batch_size=2, seq_len=16)


def estimate(**layout) -> object:
    return estimate_layout(CONFIG, Layout(**layout), **WORKLOAD)


@pytest.mark.parametrize("precision", ["float32", "bfloat16"])
@pytest.mark.parametrize("shape", [dict(batch_size=2, seq_len=16), dict(batch_size=1, seq_len=32)])
def test_one_gpu_counts_what_the_memory_budget_counts(precision, shape):
    whole = estimate_training_memory(CONFIG, **shape, precision=precision)
    one = estimate_layout(CONFIG, Layout(), **shape, precision=precision)
    assert (one.parameters, one.gradients, one.optimizer_state) == (
        whole.parameters, whole.gradients, whole.optimizer_state)  # fmt: skip
    tokens = shape["batch_size"] * shape["seq_len"]
    logits = tokens * CONFIG.vocab_size * (4 if precision == "float32" else 2)
    # What forward leaves alive: the memory budget's saved tensors, and the logits and the loss it returns.
    assert one.activations == whole.activations + logits + 4
    assert one.transfers == () and one.gathered == 0 and one.bubble == 0


def test_tensor_parallelism_splits_all_but_the_layernorms_the_row_biases_and_the_positions():
    whole = dict(GPT(CONFIG).named_parameters())
    replicated = sum(p.numel() for name, p in whole.items()
                     if ".ln_" in name or "ln_final" in name or "position" in name or name.endswith(("proj.bias", "down.bias")))  # fmt: skip
    total = sum(p.numel() for p in whole.values())
    for tp in (1, 2, 4):
        assert estimate(tp=tp).parameters == ((total - replicated) // tp + replicated) * 4


def test_sequence_parallelism_divides_activations_and_swaps_each_all_reduce_for_a_gather_and_a_scatter():
    plain, sp = estimate(tp=2), estimate(tp=2, sequence_parallel=True)
    assert sp.activations < plain.activations < estimate().activations
    assert plain.count("all-reduce", phase="backward") == 2 * CONFIG.n_layer + 1  # f: qkv's and up's inputs, the head's
    assert sp.count("all-gather") == sp.count("reduce-scatter") + 1
    # An all-gather and a reduce-scatter cost what one all-reduce costs; SP adds one gather, of the embeddings' gradient.
    activation = WORKLOAD["batch_size"] * WORKLOAD["seq_len"] * CONFIG.n_embd * 4
    norms = sum(t.sent(2) for t in sp.transfers if t.phase == "optimizer step")
    assert sp.sent("tp") - norms - plain.sent("tp") == activation * bus_factor("all-gather", 2)


def test_zero_over_data_parallel_ranks_agrees_with_the_sharding_estimate():
    for zero, stage in ((0, "ddp"), (2, "zero2"), (3, "zero3")):
        ours = estimate(dp=4, zero=zero)
        theirs = estimate_sharded_step(CONFIG, **WORKLOAD, world_size=4, stage=stage)
        assert ours.gradients == theirs.gradients
        # AdamW's step counts, a float per tensor, stay whole on every rank (as FSDP2 keeps them); its moments divide
        step_counts, moments = (12 * CONFIG.n_layer + 4) * 4, 2 * estimate().parameters
        assert ours.optimizer_state == (theirs.optimizer_state if zero == 0 else moments // 4 + step_counts)
        assert ours.parameters == theirs.parameters and ours.gathered == theirs.at_peak["gathered"]
        assert abs(ours.sent("dp") - theirs.sent) <= 2  # rounded per transfer
    # The paper's ZeRO-1 sends what ZeRO-2 sends (PyTorch's ZeroRedundancyOptimizer broadcasts instead)
    assert estimate(dp=4, zero=1).sent("dp") == estimate(dp=4, zero=2).sent("dp")


def keep_selective_save(ctx, op, *args, **kwargs):
    """The selective policy estimate_layout counts: keep what SELECTIVE_SAVE names, recompute the rest."""
    return CheckpointPolicy.MUST_SAVE if op.name() in SELECTIVE_SAVE else CheckpointPolicy.PREFER_RECOMPUTE


def measured_per_block(config, batch_size, seq_len, precision, recompute):
    """What one block holds after forward, measured: what a forward leaves held with the blocks, less what it leaves
    without them (the embeddings, the head, the loss), over the blocks."""
    torch.manual_seed(0)
    model = GPT(config)
    idx, targets = torch.randint(config.vocab_size, (2, batch_size, seq_len))
    selective = dict(context_fn=functools.partial(create_selective_checkpoint_contexts, keep_selective_save))
    options = {"full": {}, "selective": selective}.get(recompute)

    def loss(blocks):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bfloat16"):
            x = model.token_embedding(idx) + model.position_embedding(torch.arange(seq_len))
            for block in blocks:
                x = block(x) if options is None else checkpoint(block, x, use_reentrant=False, **options)
            logits = model.lm_head(model.ln_final(x))
            return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())

    held = []
    for blocks in (model.blocks, ()):
        with peak_memory() as meter:
            kept = loss(blocks)  # alive to the end of the block, with what its graph holds
        held.append(meter.held_bytes)
        del kept
    with_blocks, ends = held
    assert (with_blocks - ends) % config.n_layer == 0
    return (with_blocks - ends) // config.n_layer


@pytest.mark.parametrize("precision", ["float32", "bfloat16"])
@pytest.mark.parametrize("recompute", RECOMPUTE)
def test_a_block_holds_what_its_recomputation_keeps_to_the_byte_as_measured_on_the_cpu(recompute, precision):
    shape = dict(batch_size=3, seq_len=24)
    estimate = estimate_layout(CONFIG, Layout(), **shape, precision=precision, recompute=recompute)
    assert estimate.block_activations == measured_per_block(CONFIG, **shape, precision=precision, recompute=recompute)


def test_selective_recomputation_holds_between_none_and_full_and_divides_all_but_the_partial_sums_over_tp():
    def per_block(recompute, **layout):
        return estimate_layout(CONFIG, Layout(**layout), **WORKLOAD, recompute=recompute).block_activations

    for layout in (dict(), dict(tp=2), dict(tp=2, sequence_parallel=True)):
        assert per_block("full", **layout) < per_block("selective", **layout) < per_block("none", **layout)
    activation = WORKLOAD["batch_size"] * WORKLOAD["seq_len"] * CONFIG.n_embd * 4
    # proj's and down's outputs stay whole on every rank (partial sums), whatever the tp: 2 activations from tp 2 on
    for tp in (2, 4):
        assert per_block("selective", tp=tp) - 2 * activation == (per_block("selective") - 2 * activation - activation
                                                                  ) // tp + activation  # fmt: skip
    with pytest.raises(ValueError, match="recompute"):
        estimate_layout(CONFIG, Layout(), **WORKLOAD, recompute="partial")


def test_recomputation_issues_again_the_forward_collectives_up_to_down_s_input_and_selective_keeps_the_scatter():
    L = CONFIG.n_layer
    again = {
        False: {"full": {"all-reduce": L}, "selective": {"all-reduce": L}},  # g after proj, not after down
        True: {"full": {"all-gather": 2 * L, "reduce-scatter": L}, "selective": {"all-gather": 2 * L}},
    }
    for sequence_parallel, by_mode in again.items():
        layout = Layout(tp=2, sequence_parallel=sequence_parallel)
        none = estimate_layout(CONFIG, layout, **WORKLOAD, microbatches=3)
        for recompute, calls in by_mode.items():
            recomputing = estimate_layout(CONFIG, layout, **WORKLOAD, microbatches=3, recompute=recompute)
            for kind in ("all-reduce", "all-gather", "reduce-scatter"):
                assert recomputing.count(kind, phase="forward") == none.count(kind, phase="forward")
                extra = recomputing.count(kind, phase="backward") - none.count(kind, phase="backward")
                assert extra == 3 * calls.get(kind, 0), (sequence_parallel, recompute, kind)  # per micro-batch


def test_pipeline_stages_hold_their_blocks_and_wait_for_the_bubble():
    one, four = estimate(), estimate_layout(CONFIG, Layout(pp=4), **WORKLOAD, microbatches=4)
    assert four.parameters < one.parameters and four.bubble == pytest.approx(3 / 7)
    assert four.count("send") == 2 * 4  # each micro-batch's activations forward, their gradients back
    assert Transfer("pp", "forward", "send", 1, 100).sent(4) == 100


def test_what_each_micro_batch_reduces_grows_with_the_micro_batches_and_what_waits_for_the_step_does_not():
    def per_step(layout, m):
        return estimate_layout(CONFIG, layout, **WORKLOAD, microbatches=m)

    for zero, reduced_per_micro_batch in ((0, False), (1, False), (2, True), (3, True)):
        one, four = (per_step(Layout(dp=2, zero=zero), m) for m in (1, 4))
        scatter = "all-reduce" if zero == 0 else "reduce-scatter"
        # DDP and ZeRO-1 keep whole gradients and sum the micro-batches; ZeRO-2 and 3 keep a shard: each backward reduces
        assert four.count(scatter, phase="backward") == one.count(scatter, phase="backward") * (
            4 if reduced_per_micro_batch else 1
        )
    # Under FSDP2 sequence parallelism's LayerNorm gradients are summed in each micro-batch's backward, never in the step
    one, four = (per_step(Layout(dp=2, tp=2, zero=3, sequence_parallel=True), m) for m in (1, 4))
    assert four.count("all-reduce", group="tp", phase="backward") == 4 * one.count(
        "all-reduce", group="tp", phase="backward"
    )
    assert four.count("all-reduce", group="tp", phase="optimizer step") == 0


def test_hsdp_shards_within_each_replica_and_all_reduces_the_shards_over_the_replicas_once_per_step():
    hsdp, within = estimate(dp=4, zero=3, replicate=2), estimate(dp=2, zero=3)
    assert hsdp.layout.label == "DP 4 (HSDP 2 x 2)" and hsdp.layout.shard == 2
    for part in ("parameters", "gradients", "optimizer_state", "gathered"):
        assert getattr(hsdp, part) == getattr(within, part), part  # what FSDP2 over one replica's 2 ranks keeps
    assert [t for t in hsdp.transfers if t.group == "dp"] == list(within.transfers)
    across = [t for t in hsdp.transfers if t.group == "replicate"]
    assert {(t.kind, t.once_per_step) for t in across} == {("all-reduce", True)}
    assert hsdp.count("all-reduce", group="replicate") == CONFIG.n_layer + 1  # each unit's gradient shard, once
    assert hsdp.payload("all-reduce", group="replicate") == within.payload("reduce-scatter") // 2
    assert [t.count for t in across if t.exposed] == [1]  # the root's, after the last compute of the backward
    assert hsdp.sent("replicate") == sum(t.payload for t in across) * bus_factor("all-reduce", 2)
    for bad in (dict(dp=4, zero=2, replicate=2), dict(dp=4, zero=3, replicate=4), dict(dp=4, zero=3, replicate=3)):
        with pytest.raises(ValueError, match="HSDP"):
            Layout(**bad)


def test_what_is_issued_once_per_step_says_so():
    def once(**layout):
        return {(t.kind, t.phase) for t in estimate_layout(CONFIG, Layout(**layout), **WORKLOAD, microbatches=4).transfers
                if t.once_per_step}  # fmt: skip

    assert once(dp=2) == {("all-reduce", "backward")}  # DDP, under no_sync until the last micro-batch
    assert once(dp=2, zero=1) == {("reduce-scatter", "backward"), ("all-gather", "optimizer step")}
    assert once(dp=2, zero=2) == {("all-gather", "optimizer step")}  # it reduce-scatters every micro-batch
    assert once(dp=2, zero=3) == set() and once(tp=2, pp=2) == set()


def test_what_runs_where_no_compute_is_left_beside_it_says_so_the_root_s_gather_first_the_ends_reduction_last():
    def exposed(**layout):
        return {(t.kind, t.phase, t.once_per_step) for t in estimate_layout(CONFIG, Layout(**layout), **WORKLOAD,
                microbatches=4).transfers if t.exposed}  # fmt: skip

    assert exposed(dp=2) == {("all-reduce", "backward", True)}  # DDP's last bucket, the ends'
    assert exposed(dp=2, zero=1) == {("reduce-scatter", "backward", True)}
    assert exposed(dp=2, zero=2) == {("reduce-scatter", "backward", False)}  # in every micro-batch
    assert exposed(dp=2, zero=3) == {("all-gather", "forward", False), ("reduce-scatter", "backward", False)}
    assert exposed(tp=2, pp=2) == set()
    # Split out, not added: FSDP2 still gathers every unit in forward and reduce-scatters every one, per micro-batch
    fsdp = estimate_layout(CONFIG, Layout(dp=2, zero=3), **WORKLOAD, microbatches=4)
    assert fsdp.count("all-gather", phase="forward") == fsdp.count("reduce-scatter") == 4 * (CONFIG.n_layer + 1)
