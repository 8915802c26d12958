"""perflab.memory: what autograd keeps for backward, measured on any device."""
from __future__ import annotations

import torch

from perflab.memory import saved_tensors
from perflab.models import ResNet, ResNetConfig


def test_saved_tensors_counts_each_storage_once():
    weight = torch.randn(100, 100, requires_grad=True)
    x = torch.randn(10, 100, requires_grad=True)  # both need gradients, so matmul saves both
    with saved_tensors() as saved:
        first = (x @ weight).sum()
        second = (x @ weight).sum()  # the same two tensors saved again: no new memory
    assert saved.count == 2
    assert saved.bytes == (100 * 100 + 10 * 100) * 4


def test_checkpointing_keeps_less_for_backward():
    images = torch.randn(64, 3, 32, 32)
    kept = {}
    for checkpoint_blocks in (False, True):
        model = ResNet(ResNetConfig(checkpoint_blocks=checkpoint_blocks))
        with saved_tensors() as saved:
            loss = model(images).sum()
        kept[checkpoint_blocks] = saved
    assert kept[True].bytes < kept[False].bytes / 2
    assert kept[False].count > kept[True].count > 0
    assert "MB" in repr(kept[True])


def test_what_a_discarded_output_saved_is_not_counted():
    weight = torch.randn(100, 100, requires_grad=True)
    x = torch.randn(10, 100)
    with saved_tensors() as saved:
        (x @ weight).sum()  # its graph, and what it saved, are freed at once
        kept = (x * 2 @ weight).sum()
    assert saved.count == 1  # the scaled input only: the weight is not needed for the gradient of weight
    assert saved.bytes == 10 * 100 * 4
