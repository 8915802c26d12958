"""Lab 10's kernel through Triton's frontend, for a CUDA target, in a sandboxed Python that imports only Triton.

    >>> float32 = (7, (1, 2, 100, 16), True, 1.0, (32, 32), "float32")  # seed, shape, causal, scale, blocks, type
    >>> bfloat16 = (8, (1, 1, 70, 16), True, 6.0, (32, 32), "bfloat16")
    >>> [(signature["Q"], constexprs["HEAD_DIM"]) for signature, constexprs in configurations([float32, bfloat16])]
    [('*bf16', 16), ('*fp32', 16)]

``frontend_refusals(definitions, cases, kernel)`` compiles the kept ``@triton.jit`` definitions to Triton's IR for
every configuration the cases launch (input type, head dimension, block sizes, causal flag): Triton refuses anything
that is not Triton, a call to torch included, and a kernel that cannot take the inputs' type. No GPU is needed.

Used by perflab.grading.triton_lab.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile

from perflab.grading.sandbox import require_sandbox, sandbox_command
from perflab.grading.triton_lab_backward import CHILD_TIMEOUT_S
from perflab.grading.triton_lab_launch import PRELUDE

__all__ = ["configurations", "frontend_refusals"]

# Run with `python -I -S` in the sandbox, beside the kernel's file: Triton's frontend, for a CUDA target, on each
# configuration. It imports Triton alone (no torch: a tenth of a second), and needs no GPU. Its last line: the first
# refusal of each pointer type, as JSON.
_FRONTEND = """
import json, sys
sys.path[:] = json.loads(sys.argv[1])
import importlib.util
import triton
from triton._C.libtriton import ir
from triton.backends.compiler import GPUTarget
from triton.compiler.compiler import make_backend

spec = importlib.util.spec_from_file_location("learner_kernel", "learner_kernel.py")
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
kernel = getattr(module, sys.argv[2])
target = GPUTarget("cuda", 90, 32)
backend = make_backend(target)
options = backend.parse_options({})
refusals = {}
for signature, constexprs in json.loads(sys.argv[3]):
    if signature["Q"] in refusals:
        continue
    context = ir.context()
    ir.load_dialects(context)
    backend.load_dialects(context)
    source = triton.compiler.ASTSource(fn=kernel, signature=signature, constexprs=constexprs)
    try:
        source.make_ir(target, options, backend.get_codegen_implementation(options), backend.get_module_map(), context)
    except Exception as error:
        refusals[signature["Q"]] = (
            f"Triton does not compile it with {signature['Q']} inputs and {constexprs}: "
            f"{type(error).__name__}: {str(error)[-1500:]}"
        )
print(json.dumps(refusals))
"""


def frontend_refusals(definitions: str, cases: list, kernel: str) -> dict[str, str]:
    """Why Triton's frontend refuses ``kernel`` of ``definitions`` for each input type of ``cases`` ("float32",
    "bfloat16"): the first configuration of that type it refuses; a type it takes in every configuration is left out.
    One process for every type: a kernel right in float32 and not in bfloat16 is refused for bfloat16 only."""
    types = {dtype: pointer for dtype, pointer in _POINTERS.items() if any(case[-1] == dtype for case in cases)}
    folder = tempfile.mkdtemp(prefix="perflab-triton-")
    try:
        with open(os.path.join(folder, "learner_kernel.py"), "w") as file:
            file.write(PRELUDE + definitions)
        paths = [p for p in sys.path if p == sysconfig.get_paths()["stdlib"] or "-packages" in p or "dynload" in p]
        arguments = [json.dumps(paths), kernel, json.dumps(configurations(cases))]
        command = [sys.executable, "-I", "-S", "-c", _FRONTEND, *arguments]
        env = {"TRITON_CACHE_DIR": os.path.join(folder, "cache")}
        if require_sandbox():
            command = sandbox_command(command, workdir=folder, env=env)
        try:
            done = subprocess.run(
                command, cwd=folder, capture_output=True, text=True, timeout=CHILD_TIMEOUT_S, env={**os.environ, **env}
            )
        except subprocess.TimeoutExpired:
            return dict.fromkeys(types, f"Triton's frontend did not finish within {CHILD_TIMEOUT_S} s")
        if done.returncode != 0:
            failed = done.stderr.strip()[-1500:] or f"Triton's frontend exited with {done.returncode}"
            return dict.fromkeys(types, failed)
        by_pointer = json.loads(done.stdout.strip().splitlines()[-1])
        return {dtype: by_pointer[pointer] for dtype, pointer in types.items() if pointer in by_pointer}
    finally:
        shutil.rmtree(folder, ignore_errors=True)


_POINTERS = {"float32": "*fp32", "bfloat16": "*bf16"}  # Q, K, V and O, as the launcher allocates them


def configurations(cases) -> list:
    """Every (signature, constexprs) that ``cases`` launch: each input type, head dimension, block sizes and causal
    flag."""
    constexprs = dict.fromkeys(("HEAD_DIM", "BLOCK_M", "BLOCK_N", "CAUSAL"), "constexpr")
    launched = sorted({(dtype, shape[3], tuple(blocks), causal) for _, shape, causal, _, blocks, dtype in cases})
    return [
        (
            {**dict.fromkeys(("Q", "K", "V", "O"), _POINTERS[dtype]), "LSE": "*fp32", "seq_len": "i32", "scale": "fp32"}
            | constexprs,
            {"HEAD_DIM": dim, "BLOCK_M": block_m, "BLOCK_N": block_n, "CAUSAL": causal},
        )
        for dtype, dim, (block_m, block_n), causal in launched
    ]
