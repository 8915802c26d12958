"""How Triton runs here, and what its compiler says a kernel needs on a GPU that is not here.

    >>> from perflab.triton_runtime import compile_for_gpu, scale_kernel, triton_mode
    >>> triton_mode()            # compiled (a GPU), interpreted (TRITON_INTERPRET=1) or unavailable, and why
    TritonMode(...: ...)
    >>> report = compile_for_gpu(scale_kernel, {"x_ptr": "*fp32", "out_ptr": "*fp32", "n": 10_000, "scale": 2.0},
    ...                          {"BLOCK": 1024})   # no GPU needed: compiled for sm_90, as the JIT would for this launch
    >>> report                   # shared memory, registers, spills and the PTX's instructions, as the compiler says
    scale_kernel for sm_90 (BLOCK=1024; 4 warps, 3 stages)
    ...
    >>> report.specialized       # 10,000 is a multiple of 16: the JIT tells the compiler so
    {'n': 'a multiple of 16'}
    >>> report.shared_bytes, report.spilled_bytes, report.count("ld.global") > 0, report.out_of_resources()
    (0, 0, True, None)

Under ``TRITON_INTERPRET=1`` (read when a kernel is decorated, so set it first) ``@triton.jit``
returns an ``InterpretedFunction``: each program of the grid runs one after the other on the CPU,
every ``tl`` operation as NumPy on the whole block (``triton/runtime/interpreter.py``). It checks
what a kernel computes and where it reads; it says nothing about speed, shared memory, occupancy,
bank conflicts or register spills, which only the compiler and the GPU decide. The fixes the course's
kernels need of it are :mod:`perflab.triton_interpreter`'s.

The compiler runs without a GPU: ``triton.compile`` lowers a kernel to Triton IR, TritonGPU IR,
LLVM IR, PTX and, with the ``ptxas`` shipped in Triton's wheel, a cubin for an NVIDIA target
(``triton/compiler/compiler.py``). :func:`compile_for_gpu` does that for compute capability 9.0
(an H100 or H200) unless told otherwise, even while the interpreter is on, and runs ``ptxas -v`` on
the PTX for the registers and spills it reports.

Used in: lecture 10 (triton).
"""

from __future__ import annotations

import ast
import inspect
import json
import os
import re
import subprocess
import sys
import tempfile
import textwrap
import time
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from perflab.render import Table

try:  # the example kernel below names tl; triton ships with torch's Linux wheels, but not everywhere
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised where triton is missing
    tl = None

__all__ = [
    "GpuCompileReport",
    "H100_SHARED_MEMORY_PER_BLOCK",
    "H100_SHARED_MEMORY_PER_SM",
    "TritonMode",
    "compile_for_gpu",
    "course_triton_mode",
    "scale_kernel",
    "triton_mode",
]

# The most shared memory one thread block may use on compute capability 9.0 (H100, H200): 228 KB per SM,
# of which CUDA reserves 1 KB per block. NVIDIA Hopper Tuning Guide, "Increased Memory Capacity"
# (https://docs.nvidia.com/cuda/hopper-tuning-guide/index.html); CUDA C++ Programming Guide, "Technical
# Specifications per Compute Capability". On a GPU, torch.cuda.get_device_properties(...)
# .shared_memory_per_block_optin reads the device's own figure.
H100_SHARED_MEMORY_PER_BLOCK = 227 * 1024
H100_SHARED_MEMORY_PER_SM = 228 * 1024
_SHARED_MEMORY_RESERVED_PER_BLOCK = 1024

# The PTX instruction families a reader of a kernel looks for first.
_FAMILIES = (
    "ld.global",
    "st.global",
    "cp.async",
    "ld.shared",
    "st.shared",
    "ldmatrix",
    "mma",
    "wgmma",
    "ex2",
    "shfl",
    "bar",
)


@dataclass(frozen=True)
class TritonMode:
    """``mode`` is "compiled" (kernels are compiled for a GPU here), "interpreted" or "unavailable"."""

    mode: str
    reason: str

    def __repr__(self) -> str:
        return f"TritonMode({self.mode}: {self.reason})"


def triton_mode() -> TritonMode:
    """How a ``@triton.jit`` kernel decorated now would run in this process, and why."""
    try:
        import triton
        from triton import knobs
    except ImportError as error:
        return TritonMode("unavailable", f"triton does not import ({error}): torch installs it on Linux only")
    if knobs.runtime.interpret:
        return TritonMode(
            "interpreted",
            f"TRITON_INTERPRET=1 (triton {triton.__version__}): each program runs in turn on the CPU, in NumPy",
        )
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        return TritonMode(
            "compiled",
            f"triton {triton.__version__} compiles for {torch.cuda.get_device_name()} "
            f"(compute capability {major}.{minor})",
        )
    return TritonMode(
        "unavailable", "no GPU, and TRITON_INTERPRET is not 1: set it before decorating kernels to interpret them"
    )


# Run in a fresh process: the interpreter is chosen when a kernel is decorated, so it must be on before triton loads.
_INTERPRETER_CHILD = """
import os
os.environ["TRITON_INTERPRET"] = "1"
import torch, triton
from perflab.triton_interpreter import interpreter_loops_to_runtime_bounds, patch_interpreter
from perflab.triton_runtime import scale_kernel
patch_interpreter()
x = torch.arange(10.0)
out = torch.empty_like(x)
triton.jit(scale_kernel)[(2,)](x, out, 10, 3.0, BLOCK=8)
print(torch.equal(out, x * 3) and interpreter_loops_to_runtime_bounds())
"""


def course_triton_mode() -> TritonMode:
    """How the course's Triton chapter runs its kernels here: compiled on a GPU; elsewhere interpreted, as lecture 10
    and lab 10 turn the interpreter on themselves, once a kernel has been seen to run under it in a fresh process."""
    mode = triton_mode()
    if mode.mode == "compiled" or (mode.mode == "unavailable" and "does not import" in mode.reason):
        return mode
    try:
        child = subprocess.run([sys.executable, "-c", _INTERPRETER_CHILD], capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        return TritonMode("unavailable", "a kernel under TRITON_INTERPRET=1 did not finish in 120 s")
    if child.stdout.strip() != "True":
        return TritonMode("unavailable", f"a kernel under TRITON_INTERPRET=1 failed: {child.stderr.strip()[-300:]}")
    return TritonMode(
        "interpreted",
        "no GPU: the Triton chapter sets TRITON_INTERPRET=1 and runs each program in turn on the CPU, in NumPy "
        "(a kernel ran so here)",
    )


def scale_kernel(x_ptr, out_ptr, n, scale, BLOCK: tl.constexpr):  # noqa: N803 (Triton names constexprs in capitals)
    """``out = x * scale``, one block of ``BLOCK`` elements per program: the doctest's kernel (undecorated)."""
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    tl.store(out_ptr + offsets, tl.load(x_ptr + offsets, mask=mask) * scale, mask=mask)


@dataclass(frozen=True)
class GpuCompileReport:
    """What ``triton.compile`` made of a kernel for one GPU target: resources, and the PTX itself."""

    kernel: str
    target: str
    constexprs: Mapping[str, object]
    num_warps: int
    num_stages: int
    specialized: Mapping[str, str]  # each integer argument the JIT specializes, and how
    shared_bytes: int  # shared memory per program (thread block), as the compiler's metadata says
    registers: int  # per thread, from ptxas -v
    spilled_bytes: int  # per thread: the spill stores ptxas -v reports
    compile_s: float
    ptx: str = field(repr=False)
    opcodes: Mapping[str, int] = field(repr=False, default_factory=dict)

    def count(self, family: str) -> int:
        """Instructions whose opcode is ``family`` or starts with ``family.`` (``"ld.global"`` counts ``ld.global.v4.b32``)."""
        return sum(n for opcode, n in self.opcodes.items() if opcode == family or opcode.startswith(family + "."))

    def excerpt(self, family: str, lines: int = 3) -> str:
        """The first ``lines`` PTX instructions of a family, as the compiler wrote them."""
        found = [line.strip() for line in self.ptx.splitlines() if _opcode(line) and _in_family(_opcode(line), family)]
        return "\n".join(found[:lines])

    def out_of_resources(self, shared_limit: int = H100_SHARED_MEMORY_PER_BLOCK):
        """Triton's own ``OutOfResources``, which its launch raises when a program needs more shared memory than a
        block may have (``CompiledKernel._init_handles`` in ``triton/compiler/compiler.py``); None when it fits."""
        from triton.runtime.errors import OutOfResources

        return (
            OutOfResources(self.shared_bytes, shared_limit, "shared memory")
            if self.shared_bytes > shared_limit
            else None
        )

    def resident_by_shared_memory(self, per_sm: int = H100_SHARED_MEMORY_PER_SM) -> int:
        """How many of these programs one SM holds at once by shared memory alone (registers and warps may cap it
        lower): each takes its shared memory and the 1 KiB CUDA reserves per block."""
        return per_sm // (self.shared_bytes + _SHARED_MEMORY_RESERVED_PER_BLOCK)

    def _table(self) -> Table:
        constants = ", ".join(f"{name}={value}" for name, value in self.constexprs.items())
        counts = ", ".join(f"{family} {self.count(family)}" for family in _FAMILIES if self.count(family))
        limit = H100_SHARED_MEMORY_PER_BLOCK
        rows = [
            ("shared memory per program", f"{self.shared_bytes:,} bytes ({self.shared_bytes / limit:.0%} of an H100 block's {limit // 1024} KiB)"),
            ("registers per thread", f"{self.registers} ({self.spilled_bytes} bytes spilled)"),
            ("specialized as the JIT does", ", ".join(f"{name}: {how}" for name, how in self.specialized.items()) or "nothing"),
            ("PTX instructions", f"{sum(self.opcodes.values())}: {counts}"),
            ("compiled in", f"{self.compile_s:.2f} s"),
        ]  # fmt: skip
        caption = f"{self.kernel} for {self.target} ({constants}; {self.num_warps} warps, {self.num_stages} stages)"
        return Table(("", ""), rows, caption=caption)

    def __repr__(self) -> str:
        table = self._table()
        return "\n".join([table.caption, str(Table((), table.rows))])

    def _repr_html_(self) -> str:
        return self._table()._repr_html_()


_PTX_LINE = re.compile(r"^\s*(?:@!?%\w+\s+)?([a-z][\w.]*)")


def _opcode(line: str) -> str | None:
    stripped = line.strip()
    if not stripped or stripped.startswith(("//", ".", "$", "{", "}", ")", "(")) or stripped.endswith(":"):
        return None
    match = _PTX_LINE.match(stripped)
    return match.group(1) if match else None


def _in_family(opcode: str, family: str) -> bool:
    return opcode == family or opcode.startswith(family + ".")


# Run in a child process without TRITON_INTERPRET: under the interpreter, triton.language's own helpers
# (tl.max, tl.sum, tl.cdiv, ...) were decorated as interpreted functions, which the compiler cannot call.
_COMPILE_CHILD = """
import importlib.util, json, re, subprocess, sys
import triton
from triton._C.libtriton import native_specialize_impl  # how the JIT specializes a launch's arguments
from triton.backends.compiler import BaseBackend, GPUTarget
from triton.backends.nvidia.compiler import get_ptxas, sm_arch_from_capability
from triton.compiler import ASTSource

path, name, request = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
spec = importlib.util.spec_from_file_location("kernel_source", path)
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
signature, constexprs, attrs, specialized = {}, dict(request["constexprs"]), {}, {}
for index, argument in enumerate(request["names"]):
    value = request["arguments"].get(argument)
    if argument in constexprs:
        signature[argument] = "constexpr"
    elif isinstance(value, str):  # a type: a pointer (16-byte aligned, as PyTorch allocates), or any value
        signature[argument] = value
        if value.startswith("*"):
            attrs[(index,)] = [["tt.divisibility", 16]]
    else:  # a value, specialized by the JIT's own rule
        kind, attribute = native_specialize_impl(BaseBackend, value, False, True, True)[:2]
        if kind == "constexpr":
            signature[argument], constexprs[argument] = "constexpr", attribute
            specialized[argument] = f"= {attribute}, a constant"
        else:
            signature[argument] = kind
            if attribute == "D":
                attrs[(index,)] = [["tt.divisibility", 16]]
                specialized[argument] = "a multiple of 16"
source = ASTSource(fn=getattr(module, name), signature=signature, constexprs=constexprs, attrs=attrs)
capability = request["capability"]
compiled = triton.compile(source, target=GPUTarget("cuda", capability, 32),
                          options={"num_warps": request["num_warps"], "num_stages": request["num_stages"]})
ptx = compiled.asm["ptx"]
with open(path + ".ptx", "w") as file:
    file.write(ptx)
arch = sm_arch_from_capability(capability)
log = subprocess.run([get_ptxas(capability).path, "-v", f"--gpu-name={arch}", path + ".ptx", "-o", path + ".cubin"],
                     capture_output=True, text=True, check=True).stderr
json.dump({"shared": compiled.metadata.shared, "num_warps": compiled.metadata.num_warps,
           "num_stages": compiled.metadata.num_stages, "specialized": specialized, "ptx": ptx, "ptxas": log},
          sys.stdout)
"""


def _kernel_source(function) -> str:
    """The kernel's source as a module of its own: decorators dropped, ``@triton.jit`` put back."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
    definition = tree.body[0]
    definition.decorator_list = []
    return f"import triton\nimport triton.language as tl\n\n\n@triton.jit\n{ast.unparse(definition)}\n"


def _resources(ptxas_log: str) -> tuple[int, int]:
    """(registers per thread, bytes of registers spilled per thread) from ``ptxas -v``'s report."""
    registers = re.search(r"Used (\d+) registers", ptxas_log)
    spills = re.search(r"(\d+) bytes spill stores", ptxas_log)
    return int(registers.group(1)) if registers else 0, int(spills.group(1)) if spills else 0


def compile_for_gpu(
    kernel,
    arguments: Mapping[str, str | int | float],
    constexprs: Mapping[str, object],
    *,
    capability: int = 90,
    num_warps: int = 4,
    num_stages: int = 3,
) -> GpuCompileReport:
    """Compile ``kernel`` (decorated, interpreted or a plain function) for an NVIDIA GPU of ``capability``, as
    Triton's JIT compiles it for one launch.

    ``arguments`` gives each runtime argument as a launch passes it: a tensor as its pointer type (``"*fp16"``,
    taken as 16-byte aligned, as every tensor PyTorch allocates is), an integer or a float as its value. The
    JIT compiles a kernel for the values of each launch: an integer equal to 1 becomes a constant, one that is a
    multiple of 16 is marked so (what lets the compiler vectorize loads and pipeline them), floats are not
    specialized; this asks Triton's own rule (``native_specialize_impl``, which ``triton/runtime/jit.py`` calls for each argument). A type string
    instead of an integer's value (``"i32"``) compiles for any value, as ``do_not_specialize`` does.
    ``constexprs`` gives the compile-time constants. No GPU is needed, and the interpreter may be on: the
    compiler runs in a child process. The kernel must use only ``triton`` and ``tl`` (its source is compiled on its
    own).
    """
    function = getattr(kernel, "fn", kernel)  # a JITFunction and an InterpretedFunction both keep the Python function
    names = list(inspect.signature(function).parameters)
    missing = [name for name in names if name not in arguments and name not in constexprs]
    if missing:
        raise ValueError(f"give a type, a value or a constexpr for {', '.join(missing)}")
    unknown = set(arguments) - set(names)
    if unknown:
        raise ValueError(f"{function.__name__} has no argument {', '.join(sorted(unknown))}")
    request = {
        "names": names,
        "arguments": {name: arguments[name] for name in names if name not in constexprs},
        "constexprs": dict(constexprs),
        "capability": capability,
        "num_warps": num_warps,
        "num_stages": num_stages,
    }
    environment = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "kernel_source.py")
        with open(path, "w") as file:
            file.write(_kernel_source(function))
        child = subprocess.run(
            [sys.executable, "-c", _COMPILE_CHILD, path, function.__name__, json.dumps(request)],
            capture_output=True, text=True, env=environment, timeout=600,
        )  # fmt: skip
    if child.returncode != 0:
        raise RuntimeError(f"triton could not compile {function.__name__} for sm_{capability}:\n{child.stderr[-3000:]}")
    result = json.loads(child.stdout)
    registers, spilled = _resources(result["ptxas"])
    opcodes = Counter(opcode for line in result["ptx"].splitlines() if (opcode := _opcode(line)))
    return GpuCompileReport(
        kernel=function.__name__,
        target=f"sm_{capability}",
        constexprs=dict(constexprs),
        num_warps=result["num_warps"],
        num_stages=result["num_stages"],
        specialized=result["specialized"],
        shared_bytes=result["shared"],
        registers=registers,
        spilled_bytes=spilled,
        compile_s=time.perf_counter() - start,
        ptx=result["ptx"],
        opcodes=dict(opcodes),
    )
