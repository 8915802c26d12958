"""perflab.memory: what autograd keeps for backward, measured on any device."""

from __future__ import annotations

import pytest
import torch
from perflab import torch_features
from perflab.memory import saved_tensors
from perflab.models import ResNet, ResNetConfig


def test_saved_tensors_counts_each_storage_once():
    weight = torch.randn(100, 100, requires_grad=True)
    x = torch.randn(10, 100, requires_grad=True)  # both need gradients, so matmul saves both
    with saved_tensors() as saved:
        first = (x @ weight).sum()  # noqa: F841 (alive to the end of the block, so counted)
        second = (x @ weight).sum()  # noqa: F841  # the same two tensors saved again: no new memory
    assert saved.count == 2
    assert saved.bytes == (100 * 100 + 10 * 100) * 4


def test_checkpointing_keeps_less_for_backward():
    images = torch.randn(64, 3, 32, 32)
    kept = {}
    for checkpoint_blocks in (False, True):
        model = ResNet(ResNetConfig(checkpoint_blocks=checkpoint_blocks))
        with saved_tensors() as saved:
            loss = model(images).sum()  # noqa: F841 (alive while measured)
        kept[checkpoint_blocks] = saved
    assert kept[True].bytes < kept[False].bytes / 2
    assert kept[False].count > kept[True].count > 0
    assert "MB" in repr(kept[True])


def test_what_a_discarded_output_saved_is_not_counted():
    weight = torch.randn(100, 100, requires_grad=True)
    x = torch.randn(10, 100)
    with saved_tensors() as saved:
        (x @ weight).sum()  # its graph, and what it saved, are freed at once
        kept = (x * 2 @ weight).sum()  # noqa: F841 (alive while measured)
    assert saved.count == 1  # the scaled input only: the weight is not needed for the gradient of weight
    assert saved.bytes == 10 * 100 * 4


def test_held_now_follows_the_activations_up_in_forward_and_down_in_backward():
    weight = torch.randn(100, 100, requires_grad=True)
    with saved_tensors() as saved:
        first = (torch.randn(10, 100) @ weight).relu().sum()  # keeps its input and relu's output: 4 kB each
        after_one = saved.held_now(excluding=[weight])
        second = (torch.randn(10, 100) @ weight).relu().sum()
        after_two = saved.held_now(excluding=[weight])
        first.backward()  # frees what the first graph saved
        after_backward = saved.held_now(excluding=[weight])
    assert (after_one, after_two, after_backward) == (8000, 16000, 8000)
    assert second.requires_grad and saved.count == 2  # at the end of the block: the second graph's two


def test_peak_memory_counts_what_the_block_held_at_once():
    from perflab.memory import peak_memory

    x = torch.randn(500, 500)  # made before the block: not counted
    with peak_memory() as peak:
        square = x @ x  # 1 MB
        scratch = torch.empty(2_500_000)  # 10 MB, freed below
        del scratch
        flat = square.view(-1)  # a view: no new memory
        square.add_(1)  # in place: no new memory
    assert peak.bytes == 500 * 500 * 4 + 2_500_000 * 4
    assert peak.held_bytes == 500 * 500 * 4
    assert flat.numel() == 500 * 500 and "MB at peak" in repr(peak)


def test_peak_memory_sees_the_attention_score_matrix_grow_quadratically():
    from perflab.memory import peak_memory
    from perflab.models.gpt import naive_attention

    peaks = []
    for seq_len in (256, 512):
        q = k = v = torch.randn(1, 2, seq_len, 16)
        with peak_memory() as peak:
            naive_attention(q, k, v, causal=False)
        peaks.append(peak.bytes)
    score_bytes = 2 * 512 * 512 * 4
    assert peaks[1] >= score_bytes
    assert 3.5 < peaks[1] / peaks[0] < 4.5  # T doubled, the T x T scores dominate


def test_packed_bytes_counts_a_tensor_each_time_it_is_saved():
    weight = torch.randn(100, 100, requires_grad=True)
    x = torch.randn(10, 100, requires_grad=True)
    with saved_tensors() as saved:
        first = (x @ weight).sum()  # noqa: F841 (alive to the end of the block, so counted)
        second = (x @ weight).sum()  # noqa: F841  # saved again: a copying hook (save_on_cpu) copies them again
    assert saved.bytes == (100 * 100 + 10 * 100) * 4
    assert saved.packed_bytes == 2 * saved.bytes
    assert saved.bytes_excluding([weight]) == 10 * 100 * 4  # the activation, without the weight


RESPECT_HOOKS = next(f for f in torch_features.FEATURES if f.name == "checkpoint_respects_saved_tensors_hooks")


@pytest.mark.skipif(not RESPECT_HOOKS.available, reason=RESPECT_HOOKS.message())
def test_what_selective_checkpointing_keeps_is_counted_when_it_respects_the_hooks():
    import functools

    from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

    x = torch.randn(64, 32, requires_grad=True)
    w1, w2 = torch.randn(32, 128, requires_grad=True), torch.randn(128, 32, requires_grad=True)

    def block(x):
        return (x @ w1).sin() @ w2  # two matmuls, and a pointwise op to recompute between them

    save_matmuls = functools.partial(create_selective_checkpoint_contexts, [torch.ops.aten.mm.default])
    kept = {}
    for name, options in {"full": {}, "selective": {"context_fn": save_matmuls}}.items():
        with saved_tensors() as saved:
            loss = checkpoint(block, x, use_reentrant=False, respect_saved_tensors_hooks=True, **options).sum()
        loss.backward()
        kept[name] = saved.bytes
    assert kept["selective"] - kept["full"] == (64 * 128 + 64 * 32) * 4  # the outputs of the two matmuls


def test_allocator_peak_counts_what_the_block_held_at_once_and_what_it_still_holds():
    from perflab.memory import allocator_peak

    with allocator_peak() as allocated:
        first = torch.randn(250_000)  # 1 MB
        second = first * 2  # another 1 MB: 2 MB at once
        del first
    assert allocated.bytes >= 2 * 250_000 * 4
    assert allocated.held_bytes == second.nbytes


@pytest.mark.slow
def test_allocator_peak_sees_compiled_code_where_peak_memory_does_not():
    # Inductor allocates its buffers without calling an operator: only the allocator counts them.
    from perflab.memory import allocator_peak, peak_memory

    def scores_then_softmax(q, k):
        return torch.softmax(q @ k.transpose(-2, -1), dim=-1).sum()

    q = k = torch.randn(4, 256, 32)
    compiled = torch.compile(scores_then_softmax)
    compiled(q, k)
    with allocator_peak() as allocated:
        compiled(q, k)
    with peak_memory() as watched_ops:
        scores_then_softmax(q, k)
    scores = 4 * 256 * 256 * 4
    assert scores <= allocated.bytes < 2 * scores, "the compiled softmax should hold the scores once, fused"
    assert watched_ops.bytes >= 2 * scores, "eager holds the scores and their softmax at once"
