"""The course's two workloads, each a whole model in one readable file, and two ways to size them.

    >>> import torch
    >>> from perflab.models import GPT, GPTConfig, ResNet, ResNetConfig, count_flops, count_parameters
    >>> model = GPT(GPTConfig(n_layer=2, attention="naive"))
    >>> count_parameters(model)
    445952
    >>> idx = torch.randint(0, 256, (2, 64))
    >>> count_flops(model, idx, idx)         # forward + backward FLOPs of one training step
    352321536
    >>> count_flops(ResNet(ResNetConfig()), torch.randn(8, 3, 32, 32), backward=False)
    50014208

``resnet`` is a small CIFAR-style convolutional network, ``gpt`` a small decoder-only
transformer with three interchangeable attention implementations.

Used in: lectures 01-09, labs 03, 05, 08 and 12.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from perflab.models.gpt import GPT, GPTConfig, naive_attention, sdpa_attention, tiled_attention
from perflab.models.resnet import ResNet, ResNetConfig


def count_parameters(model: nn.Module) -> int:
    """How many numbers the model learns; a tensor shared by two layers (tied weights) counts once."""
    return sum(parameter.numel() for parameter in model.parameters())


def count_flops(model: Callable[..., Any], *inputs: torch.Tensor, backward: bool = True) -> int:
    """Floating-point operations of ``model(*inputs)``, and of its backward pass when ``backward``.

    ``model`` is usually an ``nn.Module``, but any function of tensors will do, for example
    ``count_flops(tiled_attention, q, k, v)``. When it returns ``(logits, loss)`` the backward
    pass starts from ``loss``, when it returns one tensor from that tensor's ``.sum()``.

    ``torch.utils.flop_counter.FlopCounterMode`` counts matrix multiplications, convolutions
    and fused attention (a multiply-add counts as 2 FLOPs); elementwise work such as
    activations and normalization is not counted, and neither is any operator it has no
    formula for: in torch 2.14 that includes ``F.scaled_dot_product_attention`` on the CPU,
    so there ``attention="sdpa"`` looks cheaper than ``"naive"`` though it is not.
    Every ``.grad`` is left as it was; only a training-mode forward's side effects remain
    (BatchNorm's running statistics move).
    """
    # backward() fills .grad; remember what was there so counting leaves no trace in training.
    # (torch.autograd.grad would not touch .grad, but FlopCounterMode's module hooks reject it.)
    parameters = list(model.parameters()) if isinstance(model, nn.Module) else []
    leaves = parameters + [x for x in inputs if isinstance(x, torch.Tensor) and x.requires_grad]
    grads_before = [leaf.grad for leaf in leaves]
    counter = FlopCounterMode(display=False)
    try:
        with counter:
            output = model(*inputs)
            if backward:
                if isinstance(output, tuple):
                    logits, loss = output
                    output = loss if loss is not None else logits.sum()
                else:
                    output = output.sum()
                output.backward()
    finally:
        for leaf, grad in zip(leaves, grads_before):
            leaf.grad = grad
    return counter.get_total_flops()


__all__ = [
    "GPT",
    "GPTConfig",
    "ResNet",
    "ResNetConfig",
    "count_flops",
    "count_parameters",
    "naive_attention",
    "sdpa_attention",
    "tiled_attention",
]
