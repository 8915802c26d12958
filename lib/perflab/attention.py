"""Attention, measured: which SDPA backends run here, and how memory and time grow with sequence length.

    >>> import torch
    >>> from perflab.attention import attention_curves, largest_new_tensor, sdpa_backends
    >>> from perflab.models.gpt import naive_attention, sdpa_attention
    >>> q = k = v = torch.randn(1, 4, 512, 32)
    >>> backends = sdpa_backends(q, k, v, is_causal=True)   # each backend alone: does it run, which kernel, or why not
    >>> backends.working                           # for these CPU tensors; CUDA ones have more
    ['MATH', 'FLASH_ATTENTION']
    >>> backends["MATH"].kernel                    # the formula, op by op
    'unfused: ... ops, including bmm, _safe_softmax'
    >>> curves = attention_curves({"naive": naive_attention, "sdpa": sdpa_attention}, lengths=(256, 512, 1024))
    >>> curves.growth("naive"), curves.growth("sdpa")   # peak memory ratio from one length to the next
    ((3.8..., 3.9...), (2.0, 2.0))
    >>> curves.figure()                            # peak memory and time against T, log-log
    <Figure size ... with 2 Axes>
    >>> with largest_new_tensor() as largest:
    ...     out = naive_attention(q, k, v)
    >>> largest.shape                              # the T x T scores of the 4 heads
    (4, 512, 512)

``sdpa_backends`` runs ``F.scaled_dot_product_attention`` once with every backend of
``torch.nn.attention.SDPBackend`` enabled alone (``sdpa_kernel``) and once unrestricted, and
records the fused kernel each call dispatched to, or the error and the warnings PyTorch gives
for a backend that cannot take these inputs. Nothing is assumed from a list: the answer depends
on the device, the dtype, the head dimension, the mask and dropout, and on the torch version.

Used in: lecture 08 (flash attention), lab 08.
"""

from __future__ import annotations

import contextlib
import re
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import matplotlib.pyplot as plt
import torch
import torch.nn.functional as F
from matplotlib.figure import Figure
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils._python_dispatch import TorchDispatchMode

from perflab.bench import Timing, benchmark, format_seconds
from perflab.device import pick_device
from perflab.memory import new_tensors, peak_memory
from perflab.render import Environment, Table, add_footer

__all__ = [
    "AttentionCurves",
    "BackendTrial",
    "LargestTensor",
    "SdpaBackends",
    "attention_curves",
    "largest_new_tensor",
    "sdpa_backends",
]

_BACKENDS = tuple(backend for backend in SDPBackend.__members__.values() if backend != SDPBackend.ERROR)
_TRIGGERED_AT = re.compile(r"\s*\(Triggered internally at .*\)\s*$", re.DOTALL)


class _OpRecorder(TorchDispatchMode):
    """Records the name of every operator that runs below autograd, and each output that is new memory."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []
        self.largest: torch.Size | None = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.ops.append(func.overloadpacket.__name__)
        for tensor in new_tensors(args, kwargs, out):
            if self.largest is None or tensor.numel() > self.largest.numel():
                self.largest = tensor.shape
        return out


@dataclass
class LargestTensor:
    """The shape of the largest tensor an operator made inside a block (views of inputs excluded)."""

    shape: tuple[int, ...] | None = None

    @property
    def numel(self) -> int:
        return 0 if self.shape is None else int(torch.Size(self.shape).numel())

    def __repr__(self) -> str:
        return f"LargestTensor({'nothing made' if self.shape is None else tuple(self.shape)}, {self.numel:,} elements)"


@contextlib.contextmanager
def largest_new_tensor() -> Iterator[LargestTensor]:
    """Find the largest tensor the operators inside the block create: does anything hold T x T numbers?"""
    result, recorder = LargestTensor(), _OpRecorder()
    with recorder:
        yield result
    result.shape = None if recorder.largest is None else tuple(recorder.largest)


@dataclass(frozen=True)
class BackendTrial:
    """One call of SDPA with only ``backend`` enabled ("default": all of them, PyTorch's own choice)."""

    backend: str
    runs: bool
    kernel: str  # the fused operator it dispatched to, "unfused: ..." for the math path, "" when refused
    reasons: tuple[str, ...] = ()  # PyTorch's error and warnings when it refused

    def _cells(self) -> tuple[str, str, str]:
        return self.backend, self.kernel if self.runs else "refused", " ".join(self.reasons)


def _kernel(ops: Sequence[str]) -> str:
    fused = [op for op in ops if op.startswith("_scaled_dot_product")]
    if fused:
        return fused[0]
    # The math path runs the formula op by op: name its matmuls and softmax, the ops that hold T x T scores.
    telling = [op for op in dict.fromkeys(ops) if "mm" in op or "softmax" in op]
    return f"unfused: {len(ops)} ops, including {', '.join(telling)}"


def _try(backends: Sequence[SDPBackend] | None, q, k, v, kwargs) -> tuple[bool, str, tuple[str, ...]]:
    recorder = _OpRecorder()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            with sdpa_kernel(backends) if backends is not None else contextlib.nullcontext(), recorder:
                F.scaled_dot_product_attention(q, k, v, **kwargs)
            error = None
        except RuntimeError as raised:
            error = str(raised).strip()
    reasons = tuple(_TRIGGERED_AT.sub("", str(w.message)) for w in caught)
    if error is not None:
        return False, "", (error, *reasons)
    return True, _kernel(recorder.ops), ()


@dataclass(frozen=True)
class SdpaBackends:
    """Which backends of ``F.scaled_dot_product_attention`` took these inputs on this device."""

    device: str
    inputs: str  # shape, dtype and options, for the caption
    trials: tuple[BackendTrial, ...]

    def __getitem__(self, backend: str) -> BackendTrial:
        for trial in self.trials:
            if trial.backend == backend:
                return trial
        raise KeyError(f"{backend!r} was not tried; tried: {', '.join(t.backend for t in self.trials)}")

    @property
    def working(self) -> list[str]:
        """The backends that ran when enabled alone."""
        return [t.backend for t in self.trials if t.runs and t.backend != "default"]

    def _table(self) -> Table:
        return Table(
            ("backend", "kernel", "why not"),
            [t._cells() for t in self.trials],
            caption=f"SDPA on {self.device}, {self.inputs}; torch {torch.__version__}",
            row_colours=["#b8e2b0" if t.runs else "#f4a3a3" for t in self.trials],
        )

    def __repr__(self) -> str:
        return str(self._table())

    def _repr_html_(self) -> str:
        return self._table()._repr_html_()


def sdpa_backends(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **sdpa_kwargs) -> SdpaBackends:
    """Call SDPA on ``q, k, v`` (and ``attn_mask``, ``dropout_p``, ``is_causal``...) with each backend alone."""
    trials = [BackendTrial("default", *_try(None, q, k, v, sdpa_kwargs))]
    trials += [BackendTrial(backend.name, *_try([backend], q, k, v, sdpa_kwargs)) for backend in _BACKENDS]
    options = ", ".join(
        f"{name}={'<tensor>' if isinstance(value, torch.Tensor) else value}" for name, value in sdpa_kwargs.items()
    )
    inputs = f"q {tuple(q.shape)} {str(q.dtype).removeprefix('torch.')}" + (f", {options}" if options else "")
    return SdpaBackends(str(q.device), inputs, tuple(trials))


@dataclass(frozen=True)
class AttentionCurves:
    """Peak memory and time of attention implementations at each sequence length T.

    ``peak_bytes`` is what the forward pass's tensors held at once (``perflab.memory.peak_memory``,
    under ``torch.no_grad()``): a fused kernel's internal workspace is invisible to it, and on CUDA
    ``allocator_bytes`` (the caching allocator's peak) sees that too.
    """

    lengths: tuple[int, ...]
    peak_bytes: Mapping[str, tuple[int, ...]]
    times: Mapping[str, tuple[Timing, ...]] = field(default_factory=dict)
    allocator_bytes: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    caption: str = ""

    @property
    def names(self) -> list[str]:
        return list(self.peak_bytes)

    def growth(self, name: str, of: str = "memory") -> tuple[float, ...]:
        """How many times larger each length's peak memory (or median time, ``of="time"``) is than the previous one's."""
        if of not in ("memory", "time"):
            raise ValueError(f"growth of 'memory' or 'time', got {of!r}")
        if of == "time" and name not in self.times:
            raise ValueError(f"no times were measured for {name!r}: pass samples to attention_curves")
        values = self.peak_bytes[name] if of == "memory" else [t.median for t in self.times[name]]
        return tuple(after / before for before, after in zip(values, values[1:]))

    def _table(self) -> Table:
        header, rows = ["T"], []
        for name in self.names:
            header += [f"{name} peak"] + ([f"{name} time"] if name in self.times else [])
        for index, length in enumerate(self.lengths):
            row = [length]
            for name in self.names:
                row.append(f"{self.peak_bytes[name][index] / 1e6:.2f} MB")
                if name in self.times:
                    row.append(format_seconds(self.times[name][index].median))
            rows.append(row)
        growth = "; ".join(f"{name} x{', x'.join(f'{g:.2f}' for g in self.growth(name))}" for name in self.names)
        caption = f"{self.caption}\npeak memory growth from one length to the next: {growth}"
        return Table(header, rows, caption=caption, numeric=range(len(header)))

    def __repr__(self) -> str:
        return str(self._table())

    def _repr_html_(self) -> str:
        return self._table()._repr_html_()

    def figure(self, title: str = "Attention against sequence length") -> Figure:
        """Peak memory (and time, when measured) against T, log-log: a slope of 2 is quadratic, 1 linear."""
        panels = 2 if self.times else 1
        figure, axes = plt.subplots(1, panels, figsize=(5.5 * panels, 4), squeeze=False)
        memory_ax = axes[0][0]
        for name in self.names:
            memory_ax.plot(self.lengths, [b / 1e6 for b in self.peak_bytes[name]], marker="o", label=name)
        memory_ax.set_ylabel("peak memory of the forward pass (MB)")
        memory_ax.set_title("Peak memory")
        if self.times:
            time_ax = axes[0][1]
            for name, timings in self.times.items():
                time_ax.plot(self.lengths, [t.median * 1e3 for t in timings], marker="o", label=name)
            time_ax.set_ylabel("time per call, median (ms)")
            time_ax.set_title("Time")
        for ax in axes[0]:
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xticks(self.lengths, [str(length) for length in self.lengths])
            ax.set_xlabel("sequence length T (tokens)")
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=8)
        figure.suptitle(title)
        add_footer(figure, self.caption)
        return figure


def attention_curves(
    implementations: Mapping[str, Callable[..., torch.Tensor]],
    lengths: Sequence[int],
    *,
    batch: int = 1,
    heads: int = 4,
    head_dim: int = 32,
    causal: bool = True,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device | None = None,
    samples: int | None = 5,
) -> AttentionCurves:
    """Measure each ``fn(q, k, v, causal=...)`` at each length: peak memory once, time in ``samples`` samples.

    ``samples=None`` measures memory only. Inputs are ``(batch, heads, T, head_dim)``, the same
    for every implementation at a length, so the curves differ only by the algorithm.
    """
    if not implementations:
        raise ValueError("attention_curves needs at least one implementation")
    if not lengths or any(not isinstance(length, int) or length < 1 for length in lengths):
        raise ValueError(f"lengths must be positive ints, got {lengths!r}")
    device = pick_device(device)
    generator = torch.Generator().manual_seed(0)
    peaks: dict[str, list[int]] = {name: [] for name in implementations}
    allocator: dict[str, list[int]] = {name: [] for name in implementations}
    times: dict[str, list[Timing]] = {name: [] for name in implementations}
    for length in lengths:
        q, k, v = torch.randn(3, batch, heads, length, head_dim, generator=generator).to(device, dtype)
        for name, attention in implementations.items():
            with torch.no_grad():
                with peak_memory(device) as peak:
                    attention(q, k, v, causal=causal)
                peaks[name].append(peak.bytes)
                if peak.allocator_peak_bytes is not None:
                    allocator[name].append(peak.allocator_peak_bytes)
                if samples is not None:
                    times[name].append(
                        benchmark(
                            lambda: attention(q, k, v, causal=causal),  # noqa: B023 (timed here, in this iteration)
                            label=f"{name} T={length}",
                            device=device,
                            samples=samples,
                            warmup=1,
                        )
                    )
    caption = (
        f"(batch {batch}, heads {heads}, T, head dim {head_dim}) {str(dtype).removeprefix('torch.')}, "
        f"{'causal' if causal else 'not causal'}, forward only; {Environment.capture(device)}"
    )
    return AttentionCurves(
        lengths=tuple(lengths),
        peak_bytes={name: tuple(values) for name, values in peaks.items()},
        times={name: tuple(values) for name, values in times.items() if values},
        allocator_bytes={name: tuple(values) for name, values in allocator.items() if values},
        caption=caption,
    )
