"""Which dtype ``torch.autocast`` gives each operation, read off the outputs of real calls.

    >>> import torch
    >>> from perflab.amp import autocast_dtypes
    >>> table = autocast_dtypes("cpu", torch.bfloat16)
    >>> table["linear"].effect, table["cross_entropy"].effect, table["relu"].effect
    ('lowered', 'raised', 'unchanged')
    >>> table.with_effect("lowered")
    ['matmul (x @ x)', 'linear', 'conv2d']
    >>> table                      # one row per operation: what autocast did to it
    op                        float32 in, autocast  low in, autocast  low in, no autocast  autocast
    matmul (x @ x)            bfloat16              bfloat16          bfloat16             lowered
    linear                    bfloat16              bfloat16          bfloat16             lowered
    conv2d                    bfloat16              bfloat16          bfloat16             lowered
    relu                      float32               bfloat16          bfloat16             unchanged
    gelu                      float32               bfloat16          bfloat16             unchanged
    add (x + float32 tensor)  float32               float32           float32              unchanged
    exp                       float32               bfloat16          bfloat16             unchanged
    sum                       float32               bfloat16          bfloat16             unchanged
    softmax                   float32               bfloat16          bfloat16             unchanged
    log_softmax               float32               bfloat16          bfloat16             unchanged
    layer_norm                float32               bfloat16          bfloat16             unchanged
    mse_loss                  float32               float32           bfloat16             raised
    cross_entropy             float32               float32           bfloat16             raised
    torch.autocast(device_type='cpu', dtype=torch.bfloat16), measured with torch ...
    >>> layer, x = torch.nn.Linear(8, 4), torch.randn(2, 8)
    >>> with torch.autocast("cpu", dtype=torch.bfloat16), dtype_trace() as trace:
    ...     loss = F.cross_entropy(layer(x), torch.tensor([0, 1]))
    >>> trace.ops_in(torch.bfloat16), trace.ops_in(torch.float32)   # what each operator computed in
    (['_to_copy', 'addmm'], ['_to_copy', '_log_softmax', 'nll_loss_forward'])
    >>> grad_scaler_device("mps"), grad_scaler_device("xpu")   # where torch.amp.GradScaler runs
    (device(type='mps'), device(type='cpu'))

Autocast keeps lists of operations per device (the autocast op reference,
https://docs.pytorch.org/docs/stable/amp.html#autocast-op-reference): matmuls and convolutions
run in the low precision, losses, ``exp``, ``log`` and norms in float32, everything else in the
dtype of its inputs (the widest of them, for operations with several). The lists differ between
CUDA and the CPU and between torch versions, so this module measures them instead of copying them.
Each operation runs three times on a small tensor:

- float32 input under autocast: a low-precision output means autocast *lowered* it;
- low-precision input under autocast, and the same without autocast: float32 under autocast
  where plain PyTorch gives low precision means autocast *raised* it;
- otherwise autocast left it *unchanged*: the output follows the inputs as usual.

``dtype_trace`` answers the same question for a whole model: it records every operator that runs
below autocast (views left out), with the dtypes it read and the dtype it wrote, so the casts autocast
inserts show up as ``_to_copy`` rows. ``grad_scaler_device`` says where ``torch.amp.GradScaler`` runs:
its unscale and update kernels exist for CUDA, the CPU and Apple's MPS in torch 2.14 (on MPS,
``unscale_`` computes the inverse scale in float32, as MPS has no float64).

Used in: lecture 04 (mixed precision), lab 04.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from perflab.device import pick_device
from perflab.render import Table

__all__ = [
    "AutocastReport",
    "AutocastRow",
    "DEFAULT_OPS",
    "DtypeTrace",
    "GRAD_SCALER_DEVICE_TYPES",
    "autocast_dtypes",
    "dtype_trace",
    "grad_scaler_device",
]

_LOW_PRECISIONS = (torch.bfloat16, torch.float16)
_SIZE = 16  # operations run on _SIZE x _SIZE tensors: enough for every op, fast even in fallback kernels


def _targets(x: torch.Tensor) -> torch.Tensor:
    return torch.zeros(x.shape[0], dtype=torch.long, device=x.device)


# Representative operations of a training step; each takes one square tensor in the dtype under test.
DEFAULT_OPS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "matmul (x @ x)": lambda x: x @ x,
    "linear": lambda x: F.linear(x, x),
    "conv2d": lambda x: F.conv2d(x[None, None], x[None, None, :3, :3]),
    "relu": F.relu,
    "gelu": F.gelu,
    "add (x + float32 tensor)": lambda x: x + torch.ones(x.shape, device=x.device),
    "exp": torch.exp,
    "sum": torch.sum,
    "softmax": lambda x: torch.softmax(x, dim=-1),
    "log_softmax": lambda x: torch.log_softmax(x, dim=-1),
    "layer_norm": lambda x: F.layer_norm(x, x.shape[-1:]),
    "mse_loss": lambda x: F.mse_loss(x, torch.zeros_like(x)),
    "cross_entropy": lambda x: F.cross_entropy(x, _targets(x)),
}


def _short(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class AutocastRow:
    """The output dtype of one operation, three ways."""

    op: str
    from_float32: torch.dtype  # float32 input, autocast on
    from_low: torch.dtype  # low-precision input, autocast on
    without_autocast: torch.dtype  # low-precision input, autocast off

    @property
    def effect(self) -> str:
        if self.from_float32 in _LOW_PRECISIONS:
            return "lowered"
        if self.from_low == torch.float32 and self.without_autocast != torch.float32:
            return "raised"
        return "unchanged"

    def _cells(self) -> tuple[str, ...]:
        return self.op, _short(self.from_float32), _short(self.from_low), _short(self.without_autocast), self.effect


_HEADER = ("op", "float32 in, autocast", "low in, autocast", "low in, no autocast", "autocast")
_EFFECT_COLOURS = {"lowered": "#b8e2b0", "raised": "#f4a3a3", "unchanged": ""}


@dataclass(frozen=True)
class AutocastReport:
    """What autocast to ``dtype`` did to each operation on ``device``."""

    device: str
    dtype: torch.dtype
    rows: tuple[AutocastRow, ...]

    def __getitem__(self, op: str) -> AutocastRow:
        for row in self.rows:
            if row.op == op or row.op.split(" (")[0] == op:
                return row
        raise KeyError(f"{op!r} was not measured; measured: {', '.join(row.op for row in self.rows)}")

    def with_effect(self, effect: str) -> list[str]:
        """The operations autocast ``"lowered"``, ``"raised"`` or left ``"unchanged"``."""
        return [row.op for row in self.rows if row.effect == effect]

    def _table(self) -> Table:
        autocast = f"torch.autocast(device_type={self.device!r}, dtype={self.dtype})"
        return Table(
            _HEADER,
            [row._cells() for row in self.rows],
            caption=f"{autocast}, measured with torch {torch.__version__}",
            row_colours=[_EFFECT_COLOURS[row.effect] for row in self.rows],
        )

    def __repr__(self) -> str:
        return str(self._table())

    def _repr_html_(self) -> str:
        return self._table()._repr_html_()


def autocast_dtypes(
    device: str | torch.device | None = None,
    dtype: torch.dtype | None = None,
    ops: dict[str, Callable[[torch.Tensor], torch.Tensor]] | None = None,
) -> AutocastReport:
    """Run each op (default: :data:`DEFAULT_OPS`) with and without autocast and report the output dtypes.

    ``dtype`` defaults to float16 on CUDA and bfloat16 elsewhere; pass your own ``ops`` (name ->
    function of one square tensor) to check an operation that the defaults leave out.
    """
    device = pick_device(device)
    if not torch.amp.is_autocast_available(device.type):
        raise ValueError(f"torch.autocast does not support device type {device.type!r}")
    dtype = dtype if dtype is not None else (torch.float16 if device.type == "cuda" else torch.bfloat16)
    if dtype not in _LOW_PRECISIONS:
        raise ValueError(f"autocast lowers to bfloat16 or float16, got {dtype}")
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(_SIZE, _SIZE, generator=generator).to(device)
    rows = []
    for name, op in (ops if ops is not None else DEFAULT_OPS).items():
        with torch.autocast(device_type=device.type, dtype=dtype):
            from_float32, from_low = op(x).dtype, op(x.to(dtype)).dtype
        rows.append(AutocastRow(name, from_float32, from_low, op(x.to(dtype)).dtype))
    return AutocastReport(str(device), dtype, tuple(rows))


def _floating_dtypes(tree) -> tuple[torch.dtype, ...]:
    return tuple(
        leaf.dtype for leaf in tree_leaves(tree) if isinstance(leaf, torch.Tensor) and leaf.is_floating_point()
    )


@dataclass
class DtypeTrace:
    """How many times each operator ran with each (input dtypes, output dtype), in order of first call."""

    calls: Counter = field(default_factory=Counter)  # (op, input dtypes, output dtype) -> calls

    def output_dtypes(self, op: str) -> set[torch.dtype]:
        """The dtypes ``op`` (an aten name such as ``"addmm"``) wrote; empty if it never ran."""
        return {output for name, _, output in self.calls if name == op}

    def ops_in(self, dtype: torch.dtype) -> list[str]:
        """The operators that wrote ``dtype``, in the order they first ran."""
        return list(dict.fromkeys(name for name, _, output in self.calls if output == dtype))

    def _table(self) -> Table:
        rows = [
            (name, ", ".join(_short(dtype) for dtype in inputs) or "-", _short(output), str(count))
            for (name, inputs, output), count in self.calls.items()
        ]
        colours = [_EFFECT_COLOURS["lowered"] if output in _LOW_PRECISIONS else "" for _, _, output in self.calls]
        caption = f"operators that ran (views left out) and their floating-point dtypes, torch {torch.__version__}"
        return Table(("op", "reads", "writes", "calls"), rows, caption=caption, row_colours=colours)

    def __repr__(self) -> str:
        return str(self._table())

    def _repr_html_(self) -> str:
        return self._table()._repr_html_()


class _DtypeRecorder(TorchDispatchMode):
    # A dispatch mode sits below autocast: it sees each operator after autocast has cast its inputs.
    def __init__(self, trace: DtypeTrace) -> None:
        super().__init__()
        self.trace = trace

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        outputs = _floating_dtypes(out)
        if outputs and not func.is_view:
            self.trace.calls[(func.overloadpacket.__name__, _floating_dtypes((args, kwargs)), outputs[0])] += 1
        return out


@contextlib.contextmanager
def dtype_trace() -> Iterator[DtypeTrace]:
    """Record the dtypes every operator in the block reads and writes (the first floating-point output)."""
    trace = DtypeTrace()
    with _DtypeRecorder(trace):
        yield trace


# torch 2.14 has GradScaler's kernels (_amp_foreach_non_finite_check_and_unscale_, _amp_update_scale_)
# for these device types; torch.amp.GradScaler's docstring still names only "cuda" and "cpu".
GRAD_SCALER_DEVICE_TYPES = ("cuda", "cpu", "mps")


def grad_scaler_device(device: str | torch.device | None = None) -> torch.device:
    """``device`` if ``torch.amp.GradScaler`` runs there, else the CPU (where float16 autocast runs too)."""
    device = torch.device(device) if device is not None else pick_device()
    return device if device.type in GRAD_SCALER_DEVICE_TYPES else torch.device("cpu")
