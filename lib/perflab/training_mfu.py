"""The course GPT's training MFU: how much of the chip a real training step turns into the model's FLOPs.

    >>> from perflab.models import GPTConfig
    >>> from perflab.training_mfu import measure_training_mfu
    >>> run = measure_training_mfu("cpu", config=GPTConfig(n_layer=1, n_embd=32, n_head=2, block_size=32),
    ...                            batch_size=2, compile=False, samples=2, progress=False)
    >>> run
    TrainingMfu(GPT 1 layers x 32 wide, 64 tokens/step, float32, eager on cpu: ... per step, ...;
    MFU ...% of the measured peak (matmul 1024x1024 float32))
    >>> run.mfu_of_datasheet is None             # a CPU has no datasheet table: only the measured peak
    True
    >>> 0 < run.mfu_of_measured_peak
    True

In a terminal, ``python -m perflab bench mfu``: on a GPU, a GPT-2-small-sized model (12 layers, 768 wide,
1,024 tokens) trained with bfloat16 autocast, ``torch.compile`` and SDPA (FlashAttention), fused AdamW.

Two FLOP counts, named apart:

- **model FLOPs** (MFU, PaLM appendix B, https://arxiv.org/abs/2204.02311): ``6 N + 12 L T C`` per token,
  ``N`` the parameters that multiply (all but the position table; the token table is also the output layer),
  ``L`` layers, ``T`` tokens of context, ``C`` the width. PaLM's attention term counts the full ``T x T``
  score matrix, causal or not; Kaplan et al.'s ``6 N`` leaves attention out.
- **counted FLOPs**: ``torch.utils.flop_counter.FlopCounterMode`` on one forward and backward. It too counts
  causal attention as full; the difference from the model FLOPs is the small ops outside the formula.
  Without recomputation (no checkpointing) the hardware does these FLOPs, so their share of the peak is
  the HFU here.

Two peaks: the datasheet's dense figure for the autocast dtype (:mod:`perflab.datasheet`; papers' MFU)
and a large matmul in that dtype measured now (:func:`perflab.roofline.measure_peaks`; what PyTorch's best
kernel reaches on this chip).

Used in: lecture 01 (gpu basics), and by ``python -m perflab bench mfu``.
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from perflab.bench import benchmark, format_seconds
from perflab.datasheet import datasheet_peak
from perflab.device import device_name, pick_device
from perflab.models import GPT, GPTConfig
from perflab.render import Environment
from perflab.roofline import measure_peaks

__all__ = ["TrainingMfu", "measure_training_mfu", "palm_flops_per_token"]

# (model, sequences per step) per device type: GPT-2 small's shape on a GPU (bytes, not BPE: vocabulary 256).
_SIZES = {
    "cuda": (GPTConfig(n_layer=12, n_head=12, n_embd=768, block_size=1024), 32),
    "mps": (GPTConfig(n_layer=6, n_head=8, n_embd=512, block_size=256), 16),
    "cpu": (GPTConfig(n_layer=4, n_head=4, n_embd=128, block_size=128), 8),
}


def palm_flops_per_token(model: GPT) -> float:
    """PaLM's training FLOPs per token: ``6 N + 12 L T C``, ``N`` without the position table (a lookup)."""
    config = model.config
    multiplying = sum(p.numel() for p in model.parameters()) - model.position_embedding.weight.numel()
    return 6 * multiplying + 12 * config.n_layer * config.block_size * config.n_embd


def _low_precision(device: torch.device) -> torch.dtype | None:
    """bfloat16 where the GPU has bfloat16 units, float16 on older GPUs, none on a CPU (no units: slower)."""
    if device.type != "cuda":
        return None
    return torch.bfloat16 if torch.cuda.is_bf16_supported(including_emulation=False) else torch.float16


@dataclass(frozen=True)
class TrainingMfu:
    """One measured training configuration of the course GPT, and its share of two peaks."""

    config: dict
    batch_size: int
    dtype: str
    compiled: bool
    step_s: float  # median seconds per optimizer step
    model_flops_per_step: float
    counted_flops_per_step: float
    measured_peak_flops_per_s: float
    measured_peak: str  # what gave it
    datasheet_flops_per_s: float | None
    datasheet: str | None
    environment: Environment

    @property
    def tokens_per_s(self) -> float:
        return self.batch_size * self.config["block_size"] / self.step_s

    @property
    def model_flops_per_s(self) -> float:
        return self.model_flops_per_step / self.step_s

    @property
    def mfu_of_datasheet(self) -> float | None:
        """MFU as papers report it: model FLOP/s over the datasheet's dense peak."""
        return self.model_flops_per_s / self.datasheet_flops_per_s if self.datasheet_flops_per_s else None

    @property
    def mfu_of_measured_peak(self) -> float:
        return self.model_flops_per_s / self.measured_peak_flops_per_s

    @property
    def hfu_of_datasheet(self) -> float | None:
        """Counted FLOP/s over the datasheet's peak: the FLOPs the hardware did (no recomputation here)."""
        if not self.datasheet_flops_per_s:
            return None
        return self.counted_flops_per_step / self.step_s / self.datasheet_flops_per_s

    def __str__(self) -> str:
        c = self.config
        how = f"{self.dtype}, {'compiled' if self.compiled else 'eager'} on {self.environment.device}"
        shares = f"MFU {self.mfu_of_measured_peak:.1%} of the measured peak ({self.measured_peak})"
        if self.datasheet_flops_per_s:
            shares = (
                f"MFU {self.mfu_of_datasheet:.1%} of the datasheet's {self.datasheet_flops_per_s / 1e12:g} TFLOP/s "
                f"(HFU {self.hfu_of_datasheet:.1%}), {shares}"
            )
        return (
            f"GPT {c['n_layer']} layers x {c['n_embd']} wide, {self.batch_size * c['block_size']:,} tokens/step, "
            f"{how}: {format_seconds(self.step_s)} per step, {self.tokens_per_s:,.0f} tokens/s, "
            f"{self.model_flops_per_s / 1e12:.3g} model TFLOP/s; {shares}"
        )

    def __repr__(self) -> str:
        return f"TrainingMfu({self})"

    def to_json(self) -> str:
        return json.dumps(
            {
                **asdict(self),
                "environment": self.environment.to_dict(),
                "mfu_of_datasheet": self.mfu_of_datasheet,
                "mfu_of_measured_peak": self.mfu_of_measured_peak,
                "hfu_of_datasheet": self.hfu_of_datasheet,
                "tokens_per_s": self.tokens_per_s,
            }
        )


def measure_training_mfu(
    device: str | torch.device | None = None,
    *,
    config: GPTConfig | None = None,
    batch_size: int | None = None,
    compile: bool = True,
    samples: int = 10,
    progress: bool = True,
) -> TrainingMfu:
    """Train the course GPT a few steps (autocast in the device's low-precision dtype, SDPA, fused AdamW on a GPU,
    ``torch.compile`` unless ``compile=False``) and divide its model FLOP/s by the two peaks."""
    device = pick_device(device)
    default_config, default_batch = _SIZES[device.type]
    config, batch_size = config or default_config, batch_size or default_batch
    dtype = _low_precision(device)
    torch.manual_seed(0)
    model = GPT(config).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=device.type == "cuda")
    step_model = torch.compile(model) if compile else model
    tokens = torch.randint(0, config.vocab_size, (batch_size, config.block_size + 1), device=device)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    autocast = torch.autocast(device.type, dtype=dtype) if dtype else contextlib.nullcontext()

    def forward_backward(module: torch.nn.Module) -> None:
        with autocast:
            logits, _ = module(inputs)
            loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
        loss.backward()

    def step() -> None:
        forward_backward(step_model)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    with FlopCounterMode(display=False) as counter:
        forward_backward(model)  # eager: the counter sees every operator
    optimizer.zero_grad(set_to_none=True)
    if progress:
        print(f"timing {samples} samples of training steps{' (compiling first)' if compile else ''} ...", flush=True)
    timing = benchmark(step, device=device, samples=samples, warmup=3)
    peaks = measure_peaks(device, dtype=dtype or torch.float32)
    datasheet = datasheet_peak(device_name(device)) if device.type == "cuda" else None
    dtype_name = str(dtype or torch.float32).removeprefix("torch.")
    return TrainingMfu(
        config=asdict(config),
        batch_size=batch_size,
        dtype=dtype_name,
        compiled=compile,
        step_s=timing.median,
        model_flops_per_step=palm_flops_per_token(model) * batch_size * config.block_size,
        counted_flops_per_step=float(counter.get_total_flops()),
        measured_peak_flops_per_s=peaks.flops_per_s,
        measured_peak=peaks.matmul,
        datasheet_flops_per_s=datasheet.flops_per_s(dtype_name) if datasheet else None,
        datasheet=datasheet.source if datasheet else None,
        environment=Environment.capture(device),
    )
