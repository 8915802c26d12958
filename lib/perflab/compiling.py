"""What ``torch.compile`` made of a function: its graphs and breaks, its kernels, and whether compiling paid.

    >>> import torch
    >>> import torch.nn.functional as F
    >>> from perflab.compiling import compile_cost, generated_code, graph_breaks
    >>> from perflab.plots import break_even_chart
    >>> def block(x):
    ...     y = F.gelu(x) * 2 + 1
    ...     peak = y.abs().amax().item()              # a Python number: Dynamo stops the graph here
    ...     return y / peak
    >>> x = torch.randn(256, 256)
    >>> graph_breaks(block, x)                       # Dynamo only: traces, generates no code
    GraphBreaks(2 graphs, 1 break, 4 operations)
      1. block, line 3: Unsupported Tensor.item() call with capture_scalar_outputs=False
         peak = y.abs().amax().item()              # a Python number: Dynamo stops the graph here
    >>> def chain(x):
    ...     return F.gelu(x) * 2 + 1
    >>> compiled = torch.compile(chain)
    >>> cost = compile_cost(lambda: chain(x), lambda: compiled(x))   # the first call compiles, then both are timed
    >>> cost
    CompileCost(compiled vs eager: first call ... (1 graph), then ... vs ... per call (...x); ...)
    >>> break_even_chart({"chain": cost}, caption="a GELU chain on 256 x 256")   # perflab.plots: when it pays
    <Figure size ... with 1 Axes>
    >>> generated_code(compiled, x)                  # compiles again and keeps the code Inductor wrote
              runs, in order
    module 1  cpp_fused_add_gelu_mul_0
    1 module written in ...; 1 generated kernel

The first compile of a session takes seconds (Inductor writes and builds C++ on a CPU, Triton
kernels on a GPU); Inductor's on-disk cache makes the same graph quicker to compile next time.

``graph_breaks`` and ``generated_code`` rely on private functions: ``torch._dynamo.explain``,
which PyTorch's troubleshooting documentation uses, and ``torch._inductor.utils.run_and_get_code``,
which its own tests use. Both reset Dynamo first, which drops every compiled function's cached
code (the next call compiles again, helped by Inductor's on-disk cache).

Used in: lecture 06 (compile), lecture 10 (triton), lab 06.
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch

from perflab.bench import NEGLIGIBLE_CHANGE, Comparison, compare, format_seconds, median_confidence_interval, time_call
from perflab.device import pick_device
from perflab.render import Table

__all__ = [
    "CompileCost",
    "GeneratedCode",
    "GraphBreak",
    "GraphBreaks",
    "compile_cost",
    "generated_code",
    "graph_breaks",
]

# Dynamo names the code that resumes after a break "torch_dynamo_resume_in_<function>_at_<line>".
_RESUMED = re.compile(r"torch_dynamo_resume_in_(\w+?)_at_\d+")


@dataclass(frozen=True)
class GraphBreak:
    """One place where Dynamo stopped the graph and ran Python instead."""

    reason: str  # Dynamo's reason, its first line
    function: str  # the user function it happened in
    lineno: int
    line: str  # that line of source

    def __str__(self) -> str:
        return f"{self.function}, line {self.lineno}: {self.reason}\n     {self.line}"


@dataclass(frozen=True)
class GraphBreaks:
    """How Dynamo split one call of a function into graphs, and why."""

    graphs: int
    operations: int  # tensor operations captured in all graphs together
    breaks: tuple[GraphBreak, ...]

    def __repr__(self) -> str:
        lines = [
            f"GraphBreaks({_plural(self.graphs, 'graph')}, {_plural(len(self.breaks), 'break')}, "
            f"{_plural(self.operations, 'operation')})"
        ]
        lines += [f"  {index}. {found}" for index, found in enumerate(self.breaks, 1)]
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        rows = [
            (index, found.function, found.lineno, found.line, found.reason)
            for index, found in enumerate(self.breaks, 1)
        ]
        caption = (
            f"{_plural(self.graphs, 'graph')}, {_plural(len(self.breaks), 'graph break')}, "
            f"{_plural(self.operations, 'operation')} captured"
        )
        return Table(("#", "function", "line", "code", "reason"), rows, caption=caption)._repr_html_()


def _plural(count: int, noun: str) -> str:
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"


def graph_breaks(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> GraphBreaks:
    """Trace ``fn(*args, **kwargs)`` with Dynamo alone (no code is generated) and report its graph breaks."""
    explanation = torch._dynamo.explain(fn)(*args, **kwargs)
    found = []
    for reason in explanation.break_reasons:
        frame = reason.user_stack[-1]
        resumed = _RESUMED.fullmatch(frame.name)
        found.append(
            GraphBreak(
                reason=reason.reason.strip().splitlines()[0],
                function=resumed[1] if resumed else frame.name,
                lineno=frame.lineno,
                line=(frame.line or "").strip(),
            )
        )
    return GraphBreaks(graphs=explanation.graph_count, operations=explanation.op_count, breaks=tuple(found))


def _graphs_compiled() -> int:
    # Dynamo's own tally of the graphs it has handed to a backend in this process.
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


@dataclass(frozen=True)
class CompileCost:
    """A compiled function's first call (which compiles) and its steady state against eager."""

    first_call: float  # seconds: tracing, code generation, compiling the kernels, and one run
    graphs: int  # graphs compiled during the first call
    comparison: Comparison  # eager (baseline) against compiled (candidate), interleaved, after warmup

    @property
    def compile_seconds(self) -> float:
        """What the first call cost beyond an ordinary compiled call."""
        return max(self.first_call - self.comparison.candidate.median, 0.0)

    @property
    def saved_per_call(self) -> float:
        return self.comparison.baseline.median - self.comparison.candidate.median

    @property
    def pays_off(self) -> bool:
        """Compiled is faster beyond the measurement's confidence interval and the machine's noise."""
        low, _ = self.comparison.interval
        return low > 1 and self.comparison.speedup > 1 + NEGLIGIBLE_CHANGE

    @property
    def break_even_calls(self) -> float:
        """Calls after which compiling has saved more than it cost; ``math.inf`` when it saves nothing measurable."""
        return math.ceil(self.compile_seconds / self.saved_per_call) if self.pays_off else math.inf

    def _summary(self) -> str:
        eager, compiled = self.comparison.baseline, self.comparison.candidate
        verdict = (
            f"pays off after {self.break_even_calls:,} calls"
            if self.pays_off
            else "never pays off: no measurable saving per call"
        )
        return (
            f"first call {format_seconds(self.first_call)} ({_plural(self.graphs, 'graph')}), then "
            f"{format_seconds(compiled.median)} vs {format_seconds(eager.median)} per call "
            f"({self.comparison.speedup:.2f}x); {verdict}"
        )

    def __repr__(self) -> str:
        return f"CompileCost({self.comparison.candidate.label} vs {self.comparison.baseline.label}: {self._summary()})"

    def _repr_html_(self) -> str:
        timings = self.comparison._table()
        return replace(timings, caption=f"{timings.caption}\n{self._summary()}")._repr_html_()


def compile_cost(
    eager: Callable[[], object],
    compiled: Callable[[], object],
    *,
    labels: tuple[str, str] = ("eager", "compiled"),
    device: str | torch.device | None = None,
    rounds: int = 11,
    warmup: int = 2,
) -> CompileCost:
    """Time ``compiled()``'s first call, which must compile, then compare it with ``eager()``, interleaved.

    ``compiled`` calls a ``torch.compile``d function that has not run on these shapes yet; the
    first call here is what a training run pays before its first step.
    """
    median_confidence_interval([1.0] * rounds)  # too few rounds: fail now, not after compiling
    device = pick_device(device)
    before = _graphs_compiled()
    first_call = time_call(compiled, device)
    graphs = _graphs_compiled() - before
    if graphs == 0:
        raise ValueError(
            "the first call compiled nothing: the compiled function had already run on these shapes "
            "(call torch.compiler.reset() to start afresh)"
        )
    comparison = compare(eager, compiled, labels=labels, device=device, rounds=rounds, warmup=warmup)
    return CompileCost(first_call=first_call, graphs=graphs, comparison=comparison)


# Inductor defines each kernel as "<name> = async_compile.<kind>(..., '''<source>''' ...)":
# C++ on a CPU, Triton on a GPU.
_KERNEL = re.compile(r"^(\w+) = async_compile\.\w+\(.*?'''\n?(.*?)'''", re.DOTALL | re.MULTILINE)
# What ``call`` runs, one per line: a generated kernel or a library call (``extern_kernels.addmm(...)``,
# ``cpp_fused_0(...)``, ``triton_poi_0.run(...)``), or an operator Inductor left to eager's own kernel
# (a fallback: ``buf0 = torch.ops.aten.mean.dim(...)``).
_LAUNCH = re.compile(
    r"^\s+(?:(?P<fallback>(?:\w+ = )?torch\.ops\.(?P<operator>\w+\.\w+\.\w+))|(?P<name>extern_kernels\.\w+|\w+))"
    r"(?:\.run)?\(",
    re.MULTILINE,
)


def _call_body(module: str) -> str:
    """The body of the module's ``call`` function (a method of its runner class, or a plain function)."""
    lines = module.splitlines()
    start = next((i for i, line in enumerate(lines) if re.match(r"\s*def call\(", line)), None)
    if start is None:
        return ""
    indent = len(lines[start]) - len(lines[start].lstrip())
    body = []
    for line in lines[start + 1 :]:
        if line.strip() and len(line) - len(line.lstrip()) <= indent:
            break
        body.append(line)
    return "\n".join(body)


@dataclass(frozen=True)
class GeneratedCode:
    """The Python modules Inductor wrote for one call: one per graph (a training step adds a backward one)."""

    modules: tuple[str, ...]
    seconds: float  # the call that wrote them

    @property
    def kernels(self) -> dict[str, str]:
        """Generated kernel name -> its source (C++ on a CPU, Triton on a GPU).

        A name that two modules share keeps the last module's source.
        """
        return {name: source for module in self.modules for name, source in _KERNEL.findall(module)}

    @property
    def launches(self) -> list[list[str]]:
        """For each module, what its ``call`` runs, in order: generated kernels, library calls, and
        fallbacks to eager's kernels (named as ATen names them: ``aten.mean.dim``)."""
        kernels = self.kernels
        runs = []
        for module in self.modules:
            found = [
                match["operator"] or match["name"]
                for match in _LAUNCH.finditer(_call_body(module))
                if match["operator"] or match["name"] in kernels or match["name"].startswith("extern_kernels.")
            ]
            runs.append(found)
        return runs

    @property
    def fallbacks(self) -> int:
        """How many operators the modules run with eager's own kernels rather than generated code."""
        return sum(1 for names in self.launches for name in names if name.startswith("aten."))

    def __repr__(self) -> str:
        rows = [(f"module {index}", ", ".join(names) or "(nothing)") for index, names in enumerate(self.launches, 1)]
        caption = (
            f"{_plural(len(self.modules), 'module')} written in {format_seconds(self.seconds)}; "
            f"{_plural(len(self.kernels), 'generated kernel')}"
            + (f", {_plural(self.fallbacks, 'fallback')} to eager kernels" if self.fallbacks else "")
        )
        return str(Table(("", "runs, in order"), rows, caption=caption))


def generated_code(compiled: Callable[..., Any], *args: Any, **kwargs: Any) -> GeneratedCode:
    """Reset Dynamo, call ``compiled(*args, **kwargs)`` once, and keep the code Inductor wrote for it."""
    # Imported here: importing Inductor takes seconds, and nothing else in this module needs it.
    from torch._inductor.utils import run_and_get_code

    start = time.perf_counter()
    _, modules = run_and_get_code(compiled, *args, **kwargs)
    return GeneratedCode(modules=tuple(modules), seconds=time.perf_counter() - start)
