"""Triton's interpreter made to run the course's kernels as a GPU would: each fix given only where it is missing.

    >>> from perflab.triton_interpreter import interpreter_computes_bfloat16, patch_interpreter
    >>> given = patch_interpreter()   # the fixes this Triton lacked: all three on torch 2.11's triton 3.6
    >>> set(given) <= {"runtime loop bounds", "bfloat16 tl.dot", "bfloat16 rounding"}
    True
    >>> interpreter_loops_to_runtime_bounds(), interpreter_computes_bfloat16()
    (True, True)
    >>> patch_interpreter()           # each fix is given once: nothing is left to give
    ()

Under ``TRITON_INTERPRET=1`` each program of a grid runs in turn on the CPU, every ``tl`` operation as
NumPy on the whole block (``triton/runtime/interpreter.py``). Two faults of that interpreter meet the
course's kernels, and :func:`patch_interpreter` fixes each where a kernel run here shows it:

- a loop to a runtime argument, ``range(0, n, BLOCK)``, fails under NumPy 2.4 with triton 3.6 (torch
  2.11): it makes the 1-element array of a scalar argument a Python int with ``int(array)``, which NumPy
  2.4 refuses; triton 3.7 squeezes the array first (https://github.com/triton-lang/triton/issues/9171);
- bfloat16: Triton's documentation says its interpreter "does not support operations on bfloat16
  numeric types" (``docs/programming-guide/chapter-3/debugging.rst``, Limitations). It holds a bfloat16
  as the ``uint16`` of its bits, so its ``tl.dot`` multiplies bit patterns
  (https://github.com/triton-lang/triton/issues/11584; its fix, pull request 11585, was closed unmerged:
  "No, we just don't support it yet"), and its cast from float32 to bfloat16 truncates where the compiled
  cast rounds to nearest even (``triton/language/semantic.py``, ``cast``: "For fp downcasting default
  rounding mode should be RTNE"). Each of the two is probed and fixed on its own, so a Triton that fixes
  one keeps its own. Other arithmetic on bfloat16 tensors stays unsupported: the course's kernels do
  theirs in float32.

Nothing else of the interpreter changes; a GPU never uses it.

Used in: lecture 10 (triton), lab 10.
"""

from __future__ import annotations

import functools

import numpy as np
import torch

try:  # the probe kernels below name tl; triton ships with torch's Linux wheels, but not everywhere
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised where triton is missing
    tl = None

__all__ = ["interpreter_computes_bfloat16", "interpreter_loops_to_runtime_bounds", "patch_interpreter"]


def _loop_kernel(out_ptr, n):
    """``out[i] = i`` for ``i < n``: a loop to a runtime argument, as every course kernel that walks a row has."""
    for i in range(n):
        tl.store(out_ptr + i, i)


def interpreter_loops_to_runtime_bounds() -> bool:
    """Whether Triton's interpreter here runs a loop to a kernel's runtime argument (``range(0, n, BLOCK)``).

    Runs a kernel through the interpreter in this process, whatever ``TRITON_INTERPRET`` says.
    """
    from triton.runtime.errors import InterpreterError
    from triton.runtime.interpreter import InterpretedFunction

    out = torch.full((3,), -1, dtype=torch.int32)
    try:
        InterpretedFunction(_loop_kernel)[(1,)](out, 3)
    except InterpreterError:
        return False
    return out.tolist() == [0, 1, 2]


def _bfloat16_kernel(a_ptr, product_ptr, x_ptr, rounded_ptr, N: tl.constexpr):  # noqa: N803
    """``product = a @ a`` of bfloat16 ``a`` (N x N, loaded as it is), and ``rounded = x`` (float32) cast to bfloat16:
    each operation on its own, so that a fault of one does not show in the other."""
    rows = tl.arange(0, N)
    square = rows[:, None] * N + rows[None, :]
    a = tl.load(a_ptr + square)
    tl.store(product_ptr + square, tl.dot(a, a))
    tl.store(rounded_ptr + square, tl.load(x_ptr + square).to(tl.bfloat16))


def _bfloat16_faults() -> tuple[str, ...]:
    """Which of "bfloat16 tl.dot" and "bfloat16 rounding" the interpreter here gets wrong: a ``tl.dot`` of bfloat16
    operands against the float32 product of their values, a cast to bfloat16 against rounding to nearest even."""
    from triton.runtime.interpreter import InterpretedFunction

    x = torch.full((16, 16), 1 + 3 * 2**-9)  # between the bfloat16 numbers 1 and 1 + 2**-7, nearer the second
    a = x.bfloat16()  # torch rounds to nearest even, as a GPU does
    product, rounded = torch.empty_like(x), torch.empty_like(a)
    InterpretedFunction(_bfloat16_kernel)[(1,)](a, product, x, rounded, N=16)
    faults = {
        "bfloat16 tl.dot": not torch.allclose(product, a.float() @ a.float()),
        "bfloat16 rounding": not torch.equal(rounded, a),
    }
    return tuple(name for name, wrong in faults.items() if wrong)


def interpreter_computes_bfloat16() -> bool:
    """Whether Triton's interpreter here gives a ``tl.dot`` of bfloat16 operands and a cast to bfloat16 the values a
    GPU gives: the float32 product of the bfloat16 values, and rounding to nearest even.

    Runs a kernel through the interpreter in this process, whatever ``TRITON_INTERPRET`` says.
    """
    return not _bfloat16_faults()


def _fix_loop_bounds(interpreter) -> bool:
    """``__index__`` of an interpreted scalar squeezes its 1-element array before ``int()``, as triton 3.7 does; False
    where this process has that fix already."""
    shipped = interpreter._patch_lang_tensor  # called on every launch: patches tl.tensor for the run, then restores
    if hasattr(shipped, "__wrapped__"):
        return False

    @functools.wraps(shipped)
    def patch_lang_tensor(tensor, scope):
        shipped(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    interpreter._patch_lang_tensor = patch_lang_tensor
    return True


def _fix_bfloat16_dot(interpreter) -> None:
    """``tl.dot`` multiplies the values of bfloat16 operands held as the ``uint16`` of their bits, exactly in float32 (a
    product of two bfloat16 numbers has at most 16 significant bits), and sums in float32, as a GPU's tensor cores
    accumulate (in an order of their own): the fix triton's pull request 11585 proposed. Operands held any other
    way go to the shipped ``tl.dot`` as they are."""
    builder = interpreter.InterpreterBuilder
    shipped = builder.create_dot

    def values(handle):
        if handle.dtype.scalar != tl.bfloat16 or handle.data.dtype != np.uint16:
            return handle
        return interpreter.TensorHandle((handle.data.astype(np.uint32) << 16).view(np.float32), tl.float32)

    @functools.wraps(shipped)
    def create_dot(self, a, b, *rest):
        return shipped(self, values(a), values(b), *rest)

    builder.create_dot = create_dot


def _fix_bfloat16_rounding(interpreter) -> None:
    """A float cast to bfloat16 rounds to nearest even, as torch rounds, where the shipped cast holds its result as the
    ``uint16`` of its bits; any other result of the shipped cast is left as it is."""
    builder = interpreter.InterpreterBuilder
    shipped = builder.create_fp_trunc

    @functools.wraps(shipped)
    def create_fp_trunc(self, source, destination):
        truncated = shipped(self, source, destination)
        if destination.scalar != tl.bfloat16 or truncated.data.dtype != np.uint16:
            return truncated
        rounded = torch.from_numpy(np.ascontiguousarray(source.data)).to(torch.bfloat16)
        return interpreter.TensorHandle(rounded.view(torch.int16).numpy().view(np.uint16), truncated.dtype)

    builder.create_fp_trunc = create_fp_trunc


_BFLOAT16_FIXES = {"bfloat16 tl.dot": _fix_bfloat16_dot, "bfloat16 rounding": _fix_bfloat16_rounding}


def patch_interpreter() -> tuple[str, ...]:
    """Give this process's Triton interpreter each fix the course's kernels need that it lacks; returns the names of
    those given in this call (so a second call returns ``()``).

    "runtime loop bounds" where ``perflab.torch_features``' "interpreter_runtime_loop_bounds" is missing (triton 3.6);
    "bfloat16 tl.dot" and "bfloat16 rounding" each where a kernel run now gets that operation wrong (triton 3.6 to
    3.9, torch 2.11 to 2.15, get both wrong).
    """
    from perflab import torch_features

    if tl is None:
        return ()
    from triton.runtime import interpreter

    given = []
    # The feature is found before the fix is given, and kept (torch_features caches it): it says what Triton ships.
    if not torch_features.has("interpreter_runtime_loop_bounds") and _fix_loop_bounds(interpreter):
        given.append("runtime loop bounds")
    for fault in _bfloat16_faults():
        _BFLOAT16_FIXES[fault](interpreter)
        given.append(fault)
    return tuple(given)
