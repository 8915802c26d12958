"""A small CIFAR-style ResNet, the convolutional workload of the course, in one file.

    >>> import torch
    >>> from perflab.models import ResNet, ResNetConfig
    >>> model = ResNet(ResNetConfig(num_classes=10))
    >>> images = torch.randn(16, 3, 32, 32)
    >>> model(images).shape
    torch.Size([16, 10])
    >>> model = model.to(memory_format=torch.channels_last)            # NHWC convolutions
    >>> with torch.autocast(device_type="cpu", dtype=torch.bfloat16):  # mixed precision
    ...     logits = model(images.to(memory_format=torch.channels_last))
    >>> logits.dtype
    torch.bfloat16

The layout follows He et al., "Deep Residual Learning for Image Recognition" (2015), section
4.2: a 3x3 stem, then stages of basic blocks, each stage halving the resolution and widening
the channels, then global average pooling and one linear layer. One change by default: the
stem has stride 2 (``stem_stride``), which keeps a CPU training step in the tens of ms.

Every block runs inside ``torch.profiler.record_function("resnet.block{i}")`` so a profiler
trace shows where each block's time went (in eager mode: ``torch.compile`` drops these
regions from the graphs it builds), and can be recomputed in the backward pass instead of
storing its activations (``checkpoint_blocks=True``).

Used in: lectures 01, 02, 03, 05 and 06, lab 03.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.profiler import record_function
from torch.utils.checkpoint import checkpoint

__all__ = ["BasicBlock", "ResNet", "ResNetConfig"]


@dataclass(frozen=True)
class ResNetConfig:
    """Sizes of a ResNet; change one with ``dataclasses.replace(config, widths=(32, 64, 128))``.

    The defaults give a 78k-parameter ResNet-8 for 32x32 images: big enough to learn a
    10-class image problem, small enough that one training step at batch 128 takes tens of
    milliseconds on a 2-core CPU.
    """

    num_classes: int = 10
    in_channels: int = 3
    widths: tuple[int, ...] = (16, 32, 64)  # channels of each stage; each stage after the first halves the resolution
    blocks_per_stage: int = 1
    # 2 halves the resolution before the first block, which makes every block 4x cheaper;
    # 1 is the original CIFAR ResNet, more accurate and about 4x slower.
    stem_stride: int = 2
    checkpoint_blocks: bool = False  # recompute each block's activations in backward instead of storing them

    def __post_init__(self) -> None:
        object.__setattr__(self, "widths", tuple(self.widths))  # a list would make the config unhashable
        if len(self.widths) == 0 or not all(isinstance(w, int) and w > 0 for w in self.widths):
            raise ValueError(f"widths must be a non-empty sequence of positive ints, got {self.widths!r}")
        for name in ("num_classes", "in_channels", "blocks_per_stage", "stem_stride"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")


@contextlib.contextmanager
def _running_statistics_frozen(module: nn.Module) -> Iterator[None]:
    """Within this block, BatchNorm layers leave their running mean and variance as they are.

    Activation checkpointing runs a block's forward twice, the second time during backward
    to recompute what it did not store. BatchNorm is not a pure function: in training each
    forward also updates its running statistics, which would then move twice per step and
    drift from an unchecked model's. A momentum of 0 makes the update a no-op while the
    operation, and so what autograd saves, stays the same as in the first forward.
    """
    norms = [m for m in module.modules() if isinstance(m, nn.BatchNorm2d) and m.track_running_stats]
    saved = [(norm.momentum, norm.num_batches_tracked.clone()) for norm in norms]
    for norm in norms:
        norm.momentum = 0.0
    try:
        yield
    finally:
        for norm, (momentum, num_batches_tracked) in zip(norms, saved):
            norm.momentum = momentum
            norm.num_batches_tracked.copy_(num_batches_tracked)


def _checkpoint_keeping_statistics(block: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``block(x)``, storing only ``x`` for backward, with running statistics updated once."""
    if torch.compiler.is_compiling():
        # torch.compile traces the recomputation into the backward graph, where buffers are
        # not updated again, and it accepts no custom context_fn.
        return checkpoint(block, x, use_reentrant=False)
    return checkpoint(
        block, x, use_reentrant=False, context_fn=lambda: (contextlib.nullcontext(), _running_statistics_frozen(block))
    )


class BasicBlock(nn.Module):
    """conv3x3-BN-ReLU-conv3x3-BN, plus the input, then ReLU.

    When the block changes the shape (stride 2 or more channels) the shortcut is a strided
    1x1 convolution with BN, so the sum is well defined.
    """

    def __init__(self, in_channels: int, out_channels: int, stride: int = 1) -> None:
        super().__init__()
        # No conv bias: the BatchNorm that follows subtracts the mean, which would cancel it.
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(out_channels)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_channels)
        self.shortcut = nn.Identity()
        if stride != 1 or in_channels != out_channels:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_channels, out_channels, 1, stride=stride, bias=False),
                nn.BatchNorm2d(out_channels),
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class ResNet(nn.Module):
    """Image classifier: ``(N, in_channels, H, W)`` images -> ``(N, num_classes)`` logits."""

    def __init__(self, config: ResNetConfig | None = None) -> None:
        super().__init__()
        self.config = config if config is not None else ResNetConfig()
        widths = self.config.widths
        self.stem = nn.Sequential(
            nn.Conv2d(self.config.in_channels, widths[0], 3, stride=self.config.stem_stride, padding=1, bias=False),
            nn.BatchNorm2d(widths[0]),
            nn.ReLU(inplace=True),
        )
        blocks = []
        in_channels = widths[0]
        for stage, width in enumerate(widths):
            for index in range(self.config.blocks_per_stage):
                stride = 2 if stage > 0 and index == 0 else 1
                blocks.append(BasicBlock(in_channels, width, stride))
                in_channels = width
        # One flat list, so block i is the i-th region in a profile whatever the stage layout.
        self.blocks = nn.ModuleList(blocks)
        self.head = nn.Linear(widths[-1], self.config.num_classes)
        self._init_weights()

    def _init_weights(self) -> None:
        for module in self.modules():
            if isinstance(module, nn.Conv2d):
                nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")
        # Zero the last BN of each residual branch so every block starts as its shortcut alone:
        # Goyal et al. (2017) found this trains faster and tolerates larger learning rates.
        for block in self.blocks:
            nn.init.zeros_(block.bn2.weight)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.stem(images)
        for i, block in enumerate(self.blocks):
            with record_function(f"resnet.block{i}"):
                if self.config.checkpoint_blocks and self.training:
                    x = _checkpoint_keeping_statistics(block, x)
                else:
                    x = block(x)
        x = torch.flatten(F.adaptive_avg_pool2d(x, 1), 1)
        return self.head(x)
