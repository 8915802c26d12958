"""What a GPU's vendor says it can do: the dense peak FLOP/s of its datasheet, per dtype, with the datasheet cited.

    >>> from perflab.datasheet import datasheet_peak
    >>> peak = datasheet_peak("NVIDIA H100 80GB HBM3")
    >>> peak
    DatasheetPeak(NVIDIA H100 SXM: float32 67 TFLOP/s, tfloat32 494.5 TFLOP/s, bfloat16 989.5 TFLOP/s, ...)
    >>> peak.flops_per_s("bfloat16") / 1e12
    989.5
    >>> peak.flops_per_s("float8") is None, datasheet_peak("Tesla T4").flops_per_s("bfloat16") is None
    (True, True)
    >>> datasheet_peak("AMD EPYC 7B13") is None, datasheet_peak("NVIDIA L40S") is None   # not listed: measure
    (True, True)
    >>> peak.memory_bytes_per_s / 1e12, round(peak.ridge("bfloat16"))   # HBM3 bandwidth; FLOP per byte
    (3.35, 295)

PaLM's MFU (Chowdhery et al., 2022, appendix B, https://arxiv.org/abs/2204.02311) divides by this
figure; ``perflab.roofline.measure_peaks`` gives what a large matmul really reaches, which is lower.
Name the two apart: a share of the datasheet is MFU as papers report it, a share of the measured
peak says how far the run is from what PyTorch's best kernel does on the same chip.

Datasheets quote tensor-core rates "with sparsity" (2:4 structured sparsity doubles them); the
figures here are the dense ones, half of those. A dtype a chip's tensor cores lack (bfloat16 on a
T4) has no entry: PyTorch emulates it there, far below any tensor-core figure. The memory bandwidth
is the same sheet's; a model whose variants differ in it (the A100's 40 and 80 GB) has it only where
the name says which.

Used in: lecture 01 (gpu basics), lecture 04 (mixed precision), lecture 11 (tensor pipeline parallel), and by perflab.training_mfu: ``python -m perflab bench mfu``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["DatasheetPeak", "DATASHEET_PEAKS", "datasheet_peak"]

_T = 1e12


@dataclass(frozen=True)
class DatasheetPeak:
    """A GPU model's dense peak FLOP/s by dtype, as its datasheet gives them."""

    model: str
    names: tuple[str, ...]  # regular expressions, searched in torch.cuda.get_device_name()
    peaks: tuple[tuple[str, float], ...]  # (dtype, dense FLOP/s); tfloat32 is TF32 on tensor cores
    source: str
    memory_bytes_per_s: float | None = None  # the memory bandwidth on the same sheet

    def flops_per_s(self, dtype: str) -> float | None:
        """The dense peak for ``dtype`` ("float32", "tfloat32", "bfloat16", "float16"), or None if none is quoted."""
        return dict(self.peaks).get(dtype)

    def ridge(self, dtype: str) -> float | None:
        """The roofline's ridge for ``dtype``: its peak FLOP/s over the memory bandwidth, FLOP per byte."""
        flops = self.flops_per_s(dtype)
        return flops / self.memory_bytes_per_s if flops and self.memory_bytes_per_s else None

    def __repr__(self) -> str:
        rates = ", ".join(f"{dtype} {value / _T:g} TFLOP/s" for dtype, value in self.peaks)
        memory = f", memory {self.memory_bytes_per_s / _T:g} TB/s" if self.memory_bytes_per_s else ""
        return f"DatasheetPeak({self.model}: {rates}{memory}; {self.source})"


# A model not listed (an H100 NVL, an H200 NVL, a GH200, say) gets None, not a neighbour's figures.
DATASHEET_PEAKS = (
    DatasheetPeak(
        "NVIDIA H200 SXM",
        (r"\bH200\b(?! NVL)",),
        (("float32", 67 * _T), ("tfloat32", 494.5 * _T), ("bfloat16", 989.5 * _T), ("float16", 989.5 * _T)),
        "https://www.nvidia.com/en-us/data-center/h200/ (TF32 989, BF16/FP16 1,979 TFLOPS with sparsity; 4.8 TB/s)",
        4.8 * _T,
    ),
    DatasheetPeak(
        "NVIDIA H100 PCIe",
        (r"H100 PCIe",),
        (("float32", 51 * _T), ("tfloat32", 378 * _T), ("bfloat16", 756.5 * _T), ("float16", 756.5 * _T)),
        "https://www.nvidia.com/en-us/data-center/h100/ (PCIe: TF32 756, BF16/FP16 1,513 TFLOPS with sparsity; 2 TB/s)",
        2 * _T,
    ),
    DatasheetPeak(
        "NVIDIA H100 SXM",
        (r"H100 80GB HBM3", r"H100 SXM"),
        (("float32", 67 * _T), ("tfloat32", 494.5 * _T), ("bfloat16", 989.5 * _T), ("float16", 989.5 * _T)),
        "https://www.nvidia.com/en-us/data-center/h100/ (SXM: TF32 989, BF16/FP16 1,979 TFLOPS with sparsity; 3.35 TB/s)",
        3.35 * _T,
    ),
    DatasheetPeak(
        "NVIDIA A100 SXM4 80GB",
        (r"A100-SXM4-80GB",),
        (("float32", 19.5 * _T), ("tfloat32", 156 * _T), ("bfloat16", 312 * _T), ("float16", 312 * _T)),
        "https://www.nvidia.com/en-us/data-center/a100/ (TF32 156, BF16/FP16 312 TFLOPS dense; 80GB SXM 2,039 GB/s)",
        2039e9,
    ),
    DatasheetPeak(
        "NVIDIA A100",
        (r"A100",),
        (("float32", 19.5 * _T), ("tfloat32", 156 * _T), ("bfloat16", 312 * _T), ("float16", 312 * _T)),
        "https://www.nvidia.com/en-us/data-center/a100/ (TF32 156, BF16/FP16 312 TFLOPS dense)",
    ),
    DatasheetPeak(
        "NVIDIA L4",
        (r"\bL4\b",),
        (("float32", 30.3 * _T), ("tfloat32", 60 * _T), ("bfloat16", 121 * _T), ("float16", 121 * _T)),
        "https://www.nvidia.com/en-us/data-center/l4/ (TF32 120, BF16/FP16 242 TFLOPS with sparsity; 300 GB/s)",
        300e9,
    ),
    DatasheetPeak(
        "NVIDIA T4",
        (r"\bT4\b",),
        (("float32", 8.1 * _T), ("float16", 65 * _T)),  # Turing: float16 tensor cores only, no bfloat16, no TF32
        "https://www.nvidia.com/en-us/data-center/tesla-t4/ (FP32 8.1, mixed FP16/FP32 65 TFLOPS; 320 GB/s)",
        320e9,
    ),
)


def datasheet_peak(device_name: str) -> DatasheetPeak | None:
    """The datasheet's peaks for a device named as ``torch.cuda.get_device_name()`` names it; None if not listed."""
    return next((peak for peak in DATASHEET_PEAKS if any(re.search(name, device_name) for name in peak.names)), None)
