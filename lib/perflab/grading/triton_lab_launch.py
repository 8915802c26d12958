"""Lab 10's kernel in the grader's child: launched on tensors the grader placed, every address it touches checked.

    >>> import numpy as np, torch
    >>> q = torch.zeros(4)
    >>> checker = AccessChecker(memory=None)
    >>> checker.allow({"Q": q})
    >>> addresses = np.array([q.data_ptr(), q.data_ptr() + 4 * 4], dtype=np.uint64)   # q[0], and one past the end
    >>> checker.inside(addresses, itemsize=4).tolist()
    [True, False]
    >>> print(checker.describe("read", addresses[1:], itemsize=4))
    read 1 elements outside the launch's tensors, the first just past the end of Q

Under ``TRITON_INTERPRET=1`` the kernel's ``tl.load`` and ``tl.store`` dereference raw addresses
(``triton/runtime/interpreter.py`` calls ``triton._C.libtriton.interpreter``'s ``load``, ``store`` and atomics),
with no bounds check: a read past the end returns whatever lies there, and the result can be right by chance (the
rows past ``T`` are never stored; the scores of keys past ``T`` are masked after the read). On a GPU such a read
returns garbage or faults. So the child replaces the interpreter's memory functions with an ``AccessChecker``, and
each launch goes through ``CheckedKernel``: the launch's tensors are copied into one buffer with a gap around each,
so that none ends where another begins, and every lane a mask leaves on that lies outside them is recorded, never
performed, and reads NaN (a float32 one; a bfloat16 one reads its ``other``, as Triton's interpreter loads bfloat16 as
``uint16``). The child counts each launch's ``tl.dot`` calls and notes their operands' types. The learner's kernel runs
there as Triton only (Triton's frontend has compiled it first): it cannot reach these objects.

Used by perflab.grading.triton_lab.
"""

from __future__ import annotations

import inspect
import linecache

import numpy as np
import torch

from perflab.grading.triton_lab_backward import draw_inputs, tensors_as_bytes

__all__ = ["AccessChecker", "CheckedKernel", "PRELUDE", "child_lab10_forward"]

PRELUDE = "import triton\nimport triton.language as tl\n\n\n"
_GAP = 4096  # bytes between two of a launch's tensors in the grader's buffer: never read, only kept apart


class AccessChecker:
    """Triton's interpreter's memory functions, restricted to the tensors of the launch running now."""

    def __init__(self, memory):
        self._memory = memory  # triton._C.libtriton.interpreter
        self._ranges: list[tuple[int, int, str]] = []  # start, end, name
        self.outside: list[str] = []  # one description per access that left the launch's tensors

    def __getattr__(self, name):  # the enums the interpreter reads (MEM_SEMANTIC, RMW_OP)
        return getattr(self._memory, name)

    def allow(self, tensors: dict[str, torch.Tensor]) -> None:
        self._ranges = sorted(
            (t.data_ptr(), t.data_ptr() + t.numel() * t.element_size(), name) for name, t in tensors.items()
        )

    def inside(self, addresses: np.ndarray, itemsize: int) -> np.ndarray:
        within = np.zeros(addresses.shape, dtype=bool)
        for start, end, _ in self._ranges:
            within |= (addresses >= start) & (addresses + itemsize <= end)
        return within

    def describe(self, action: str, addresses: np.ndarray, itemsize: int) -> str:
        """How many of ``addresses`` there are, and where the first lies, by the nearest edge of the launch's tensors."""
        first = int(addresses.min())
        edges = [(first - end, "past the end of", name) for _, end, name in self._ranges if first >= end]
        edges += [
            (start - first - itemsize, "before the start of", name) for start, _, name in self._ranges if first < start
        ]
        distance, side, name = min(edges)
        where = f"{distance // itemsize} elements {side}" if distance else f"just {side}"
        return f"{action} {addresses.size} elements outside the launch's tensors, the first {where} {name}"

    def _kept(self, action: str, addresses: np.ndarray, mask: np.ndarray, itemsize: int) -> np.ndarray:
        """``mask`` without its lanes outside the launch's tensors, which are recorded."""
        outside = mask & ~self.inside(addresses, itemsize)
        if outside.any():
            self.outside.append(self.describe(action, addresses[outside], itemsize))
        return mask & ~outside

    def load(self, addresses, mask, other, dtype):
        kept = self._kept("read", addresses, mask, np.dtype(dtype).itemsize)
        if np.issubdtype(np.dtype(dtype), np.floating):
            other = np.where(mask & ~kept, np.nan, other).astype(dtype)
        return self._memory.load(addresses, kept, other, dtype)

    def store(self, addresses, value, mask):
        return self._memory.store(addresses, value, self._kept("wrote", addresses, mask, value.dtype.itemsize))

    def atomic_rmw(self, operation, addresses, value, mask, semantic):
        kept = self._kept("updated", addresses, mask, value.dtype.itemsize)
        return self._memory.atomic_rmw(operation, addresses, value, kept, semantic)

    def atomic_cas(self, addresses, compare, value, semantic):
        every_lane = np.ones(addresses.shape, dtype=bool)  # a compare-and-swap has no mask to leave lanes off
        if not self._kept("swapped", addresses, every_lane, value.dtype.itemsize).all():
            raise IndexError(f"the kernel {self.outside[-1]}")
        return self._memory.atomic_cas(addresses, compare, value, semantic)


class CheckedKernel:
    """``kernel[grid](...)`` as the course's launcher writes it, run on copies of its tensors that the checker
    watches, each with a gap around it; what the kernel wrote is copied back."""

    def __init__(self, kernel, checker: AccessChecker):
        self.kernel, self.checker = kernel, checker
        self.names = list(inspect.signature(kernel.fn).parameters)

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            places = [i for i, arg in enumerate(args) if isinstance(arg, torch.Tensor)]
            # Bytes, rounded up to 16 so that each copy starts aligned, whatever the types of those before it.
            sizes = [-(-args[i].numel() * args[i].element_size() // 16) * 16 for i in places]
            buffer = torch.empty(sum(sizes) + _GAP * (len(sizes) + 1), dtype=torch.uint8)
            copies, start = list(args), _GAP
            for i, size in zip(places, sizes):
                copy = buffer[start : start + size].view(args[i].dtype)[: args[i].numel()]
                copies[i] = copy.view(args[i].shape).copy_(args[i])
                start += size + _GAP
            self.checker.allow({self.names[i]: copies[i] for i in places})
            self.kernel[grid](*copies, **kwargs)
            for i in places:
                args[i].copy_(copies[i])

        return launch


def child_lab10_forward(namespace, payload, definitions, cases):
    """Define the kernel beside ``triton`` and ``tl`` alone, then run the course's launcher on each case, checked, on
    inputs of the case's type; the outputs and log-sum-exps, and for each case its ``tl.dot`` calls, the types of
    their operands and its first accesses outside its tensors."""
    import triton
    import triton.language as tl
    from triton.runtime import interpreter

    from perflab.triton_interpreter import patch_interpreter

    patch_interpreter()  # a loop to seq_len (triton 3.6 under NumPy 2.4), and bfloat16's tl.dot and rounding
    filename = "<learner_kernel>"  # Triton reads a kernel's source through linecache
    source = PRELUDE + definitions
    linecache.cache[filename] = (len(source), None, source.splitlines(keepends=True), filename)
    scope = {"triton": triton, "tl": tl, "__name__": "learner_kernel"}
    exec(compile(source, filename, "exec"), scope)
    checker = AccessChecker(interpreter._interpreter)
    interpreter._interpreter = checker
    namespace["flash_forward_kernel"] = CheckedKernel(scope["flash_forward_kernel"], checker)
    builder, dots = interpreter.interpreter_builder, []  # each case's tl.dot calls: the types of their operands
    original_dot = builder.create_dot

    def counted_dot(a, b, *args, **kwargs):
        dots[-1].append(f"{a.dtype} x {b.dtype}")
        return original_dot(a, b, *args, **kwargs)

    builder.create_dot = counted_dot
    results, reports = [], []
    try:
        for seed, shape, causal, scale, blocks, dtype in cases:
            dots.append([])
            checker.outside.clear()
            inputs = [t.to(getattr(torch, dtype)) for t in draw_inputs(seed, shape, scale)]
            out, lse = namespace["flash_forward"](*inputs, causal=causal, blocks=tuple(blocks))
            results += [out, lse]
            reports.append(
                {
                    "dots": len(dots[-1]),
                    "operands": sorted(set(dots[-1])),
                    "outside": checker.outside[:1],
                }
            )
    finally:
        builder.create_dot = original_dot
        interpreter._interpreter = checker._memory
    return reports, tensors_as_bytes(results)
