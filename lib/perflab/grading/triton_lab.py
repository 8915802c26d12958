"""Lab 10 (FlashAttention-2 in Triton), decided outside the learner's kernel: the kernel as data, run by the course.

    grade_lab10(cells)   # cells: {"course": {grade_id: source}, "learner": {grade_id: source}}
    # {'test_forward': Verdict(pass: ...), ..., 'test_backward_skip': Verdict(pass: ...)}

The kernel's answer cell is parsed, never run: only its ``@triton.jit`` definitions are kept, and
only when nothing of them runs when they are defined (no other decorator, no default, no
annotation but ``tl.constexpr``, no return annotation) and the kernel's signature is the course's:

    >>> course = '''
    ... @triton.jit
    ... def kernel(X, n, BLOCK: tl.constexpr):
    ...     pass
    ... '''
    >>> learner = course + '''
    ... import torch
    ... triton.jit = lambda fn: torch.nn.functional.scaled_dot_product_attention
    ... '''
    >>> print(kernel_definitions(learner, course, "kernel"))
    @triton.jit
    def kernel(X, n, BLOCK: tl.constexpr):
        pass
    >>> kernel_definitions(course.replace("n,", "n: tl.constexpr,"), course, "kernel")
    Traceback (most recent call last):
    ...
    perflab.grading.triton_lab.KernelRefused: kernel's signature must be the course's, ...

Those definitions then go, with only ``triton`` and ``triton.language`` beside them, to two
sandboxed processes: a Python that imports only Triton and runs its frontend on them for a CUDA
target, for every head dimension, block sizes and causal flag graded (Triton refuses anything that is not
Triton, a call to torch included; no GPU is needed), then, if it accepts them, a child that runs
them under Triton's interpreter (``TRITON_INTERPRET=1``) through the course's own launcher, with
several block sizes, on inputs drawn from seeds chosen here; it counts the tiles they compute
(``tl.dot`` calls) and every address they read or write outside the launch's tensors
(:mod:`perflab.grading.triton_lab_launch`). Outputs and log-sum-exps come back as raw bytes and
are compared here with SDPA and ``torch.logsumexp`` in float64. The learner's backward is checked
beside them, in a third child (:mod:`perflab.grading.triton_lab_backward`). Nothing here needs a
quiet machine: the one figure read from a clock, the backward's CPU time causal against not, is a ratio
with a wide margin to its bound.

Used in: lab 10. Used by perflab.grading.session.
"""

from __future__ import annotations

import ast
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from concurrent.futures import ThreadPoolExecutor

import torch

from perflab.grading.child import AnswerProcess, ChildError
from perflab.grading.code_labs import grader_seeds
from perflab.grading.sandbox import require_sandbox, sandbox_command
from perflab.grading.triton_lab_backward import (
    CHILD_TIMEOUT_S,
    backward_verdicts,
    draw_inputs,
    exact_attention,
    tensors_from_bytes,
    timeout_verdict,
)
from perflab.grading.triton_lab_launch import PRELUDE
from perflab.grading.verdict import Verdict

__all__ = [
    "COURSE_BLOCKS",
    "FORWARD_CASES",
    "KernelRefused",
    "SKIP_LENGTH",
    "SKIP_RATIO",
    "grade_lab10",
    "kernel_definitions",
]

KERNEL = "flash_forward_kernel"
# (batch, heads, sequence length, head dim, causal, scale of q and k, (BLOCK_M, BLOCK_N)): lengths that are not
# multiples of the blocks, a single token, scores in the hundreds, where exp overflows without the running maximum,
# and tiles that are not square, where program i's causal keys end at min((i + 1) * BLOCK_M, T), not after key tile
# i, and where, with BLOCK_M > BLOCK_N, the diagonal crosses several key tiles.
COURSE_BLOCKS = (32, 32)
FORWARD_CASES = (
    (1, 2, 100, 16, False, 1.0, COURSE_BLOCKS),
    (2, 1, 37, 64, True, 1.0, COURSE_BLOCKS),
    (1, 1, 1, 32, True, 1.0, COURSE_BLOCKS),
    (1, 2, 130, 32, True, 1.0, COURSE_BLOCKS),
    (1, 1, 130, 64, False, 1.0, COURSE_BLOCKS),
    (1, 2, 64, 16, True, 6.0, COURSE_BLOCKS),
    (1, 2, 100, 16, True, 1.0, (16, 64)),
    (1, 1, 70, 32, False, 1.0, (16, 64)),
    (1, 1, 130, 32, True, 1.0, (64, 16)),
)
SKIP_LENGTH = 256  # causal against non-causal at one head of this length: 36 of 64 tiles of 32 (0.5625)
SKIP_RATIO = (0.4, 0.65)


class KernelRefused(ValueError):
    """The kernel's cell holds no kernel the grader may run: the message says why."""


def _is_triton_jit(node: ast.expr) -> bool:
    return ast.dump(node) == ast.dump(ast.parse("triton.jit", mode="eval").body)


def _signature(function: ast.FunctionDef) -> str:
    return ast.dump(function.args)


def _runs_nothing_when_defined(function: ast.FunctionDef) -> str | None:
    """Why defining ``function`` would run code of its author's, or None: Python evaluates decorators,
    defaults and annotations when it meets a ``def``."""
    if len(function.decorator_list) != 1 or not _is_triton_jit(function.decorator_list[0]):
        return f"{function.name} must have exactly one decorator, @triton.jit"
    arguments = function.args
    if arguments.defaults or any(default is not None for default in arguments.kw_defaults):
        return f"{function.name}'s arguments must have no defaults"
    constexpr = ast.dump(ast.parse("tl.constexpr", mode="eval").body)
    every = [*arguments.posonlyargs, *arguments.args, *arguments.kwonlyargs, arguments.vararg, arguments.kwarg]
    if any(a is not None and a.annotation is not None and ast.dump(a.annotation) != constexpr for a in every):
        return f"{function.name}'s arguments may only be annotated tl.constexpr"
    if function.returns is not None:
        return f"{function.name} must have no return annotation"
    return None


def kernel_definitions(learner_cell: str, course_cell: str, name: str = KERNEL) -> str:
    """The ``@triton.jit`` functions of ``learner_cell`` as source, everything else dropped; raises ``KernelRefused``
    unless kernel ``name`` is among them with the signature it has in ``course_cell``."""
    try:
        tree = ast.parse(learner_cell)
    except SyntaxError as error:
        raise KernelRefused(f"the kernel's cell is not valid Python: {error}") from None
    course = next(n for n in ast.parse(course_cell).body if isinstance(n, ast.FunctionDef) and n.name == name)
    kept = [n for n in tree.body if isinstance(n, ast.FunctionDef) and any(map(_is_triton_jit, n.decorator_list))]
    for function in kept:
        reason = _runs_nothing_when_defined(function)
        if reason:
            raise KernelRefused(reason)
    kernels = [function for function in kept if function.name == name]
    if len(kernels) != 1:
        raise KernelRefused(f"the kernel's cell must define one @triton.jit function {name}, not {len(kernels)}")
    if _signature(kernels[0]) != _signature(course):
        raise KernelRefused(
            f"{name}'s signature must be the course's, {ast.unparse(course.args)}; it is {ast.unparse(kernels[0].args)}"
        )
    lines = learner_cell.splitlines()
    # A def's own line numbers leave its decorators out: each function from its first decorator to its end.
    return "\n\n\n".join(
        "\n".join(lines[function.decorator_list[0].lineno - 1 : function.end_lineno]) for function in kept
    )


# Run with `python -I -S` in the sandbox, beside the kernel's file: Triton's frontend, for a CUDA target, on each
# configuration. It imports Triton alone (no torch: a tenth of a second), and needs no GPU.
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
for signature, constexprs in json.loads(sys.argv[3]):
    context = ir.context()
    ir.load_dialects(context)
    backend.load_dialects(context)
    source = triton.compiler.ASTSource(fn=kernel, signature=signature, constexprs=constexprs)
    try:
        source.make_ir(target, options, backend.get_codegen_implementation(options), backend.get_module_map(), context)
    except Exception as error:
        print(f"Triton does not compile it with {constexprs}: {type(error).__name__}: {str(error)[-1500:]}")
        sys.exit(1)
"""


def _frontend_refusal(definitions: str, configurations: list) -> str | None:
    """Why Triton's frontend refuses the kernel for one of ``configurations``, or None when it takes them all."""
    folder = tempfile.mkdtemp(prefix="perflab-triton-")
    try:
        with open(os.path.join(folder, "learner_kernel.py"), "w") as file:
            file.write(PRELUDE + definitions)
        paths = [p for p in sys.path if p == sysconfig.get_paths()["stdlib"] or "-packages" in p or "dynload" in p]
        command = [sys.executable, "-I", "-S", "-c", _FRONTEND, json.dumps(paths), KERNEL, json.dumps(configurations)]
        env = {"TRITON_CACHE_DIR": os.path.join(folder, "cache")}
        if require_sandbox():
            command = sandbox_command(command, workdir=folder, env=env)
        try:
            done = subprocess.run(
                command, cwd=folder, capture_output=True, text=True, timeout=CHILD_TIMEOUT_S, env={**os.environ, **env}
            )
        except subprocess.TimeoutExpired:
            return f"Triton's frontend did not finish within {CHILD_TIMEOUT_S} s"
        if done.returncode != 0:
            return (done.stdout.strip() or done.stderr.strip()[-1500:]) or f"it exited with {done.returncode}"
        return None
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _configurations(cases) -> list:
    """Every (signature, constexprs) that ``cases`` launch: each head dimension, block sizes and causal flag."""
    pointers = dict.fromkeys(("Q", "K", "V", "O", "LSE"), "*fp32")
    constexprs = dict.fromkeys(("HEAD_DIM", "BLOCK_M", "BLOCK_N", "CAUSAL"), "constexpr")
    signature = {**pointers, "seq_len": "i32", "scale": "fp32", **constexprs}
    launched = sorted({(shape[3], blocks, causal) for _, shape, causal, _, blocks in cases})
    return [
        (signature, {"HEAD_DIM": dim, "BLOCK_M": block_m, "BLOCK_N": block_n, "CAUSAL": causal})
        for dim, (block_m, block_n), causal in launched
    ]


# What the course's launcher needs, with Triton's interpreter on: the lab's own setup imports instruments it does not.
_KERNEL_SETUP = """
import math
import os

os.environ["TRITON_INTERPRET"] = "1"
import torch
import triton
"""


def _kernel_child(cells: dict) -> AnswerProcess:
    """A child that runs the course's launcher under Triton's interpreter: no cell of the learner's runs in it."""
    return AnswerProcess(
        [("kernel_setup", _KERNEL_SETUP), ("launcher", cells["course"]["launcher"])],
        handlers="perflab.grading.triton_lab_launch",
    )


def _forward_verdicts(cells: dict) -> dict[str, Verdict]:
    graded_cells = ("test_forward", "test_lse", "test_causal_skip")
    try:
        definitions = kernel_definitions(cells["learner"].get("flash_kernel", ""), cells["course"]["flash_kernel"])
    except KernelRefused as error:
        return dict.fromkeys(graded_cells, Verdict.refused(str(error)))
    graded = [
        (grader_seeds.randrange(2**31), (b, h, t, d), causal, scale, blocks)
        for b, h, t, d, causal, scale, blocks in FORWARD_CASES
    ]
    skip_seed = grader_seeds.randrange(2**31)
    skips = [(skip_seed, (1, 1, SKIP_LENGTH, 16), causal, 1.0, COURSE_BLOCKS) for causal in (False, True)]
    refusal = _frontend_refusal(definitions, _configurations(graded + skips))
    if refusal:
        return dict.fromkeys(graded_cells, Verdict.refused(refusal))
    try:
        child = _kernel_child(cells)
        try:
            reports, payload, _ = child.call(
                "lab10_forward", definitions=definitions, cases=graded + skips, timeout_s=CHILD_TIMEOUT_S
            )
        finally:
            child.close()
        shapes = [s for _, shape, *_ in graded + skips for s in (shape, shape[:-1])]
        results = tensors_from_bytes(payload, shapes)
    except ChildError as error:
        return dict.fromkeys(graded_cells, timeout_verdict(error, CHILD_TIMEOUT_S))
    wrong_out, wrong_lse = [], []
    for index, ((seed, shape, causal, scale, blocks), report) in enumerate(zip(graded + skips, reports)):
        want_out, want_lse = exact_attention(*draw_inputs(seed, shape, scale), causal)
        out, lse = results[2 * index : 2 * index + 2]
        name = f"{shape} causal={causal}" + (f" scores x{scale**2:g}" if scale != 1 else "")
        name += f" (BLOCK_M, BLOCK_N) = {tuple(blocks)}" if tuple(blocks) != COURSE_BLOCKS else ""
        if not torch.allclose(out.double(), want_out, atol=1e-4, rtol=0) or not torch.isfinite(out).all():
            wrong_out.append(f"{name}: O differs from SDPA's by {(out.double() - want_out).abs().max().item():.2e}")
        wrong_out += [
            f"{name}: the kernel {access}; mask every tl.load and tl.store of rows or keys past seq_len"
            for access in report["outside"]
        ]
        if not torch.allclose(lse.double(), want_lse, atol=1e-4, rtol=1e-5):
            wrong_lse.append(
                f"{name}: LSE differs from logsumexp's by {(lse.double() - want_lse).abs().max().item():.2e}"
            )
    cases = (
        f"{len(graded)} shapes (head dims 16-64, T from 1 to 130, causal and not, (BLOCK_M, BLOCK_N) of "
        f"{', '.join(map(str, sorted({tuple(blocks) for *_, blocks in graded})))}) on fresh inputs, every address "
        "read or written checked"
    )
    non_causal, causal = (report["dots"] for report in reports[-2:])
    ratio = causal / non_causal if non_causal else 0.0
    skip_failures = [reason for reason in wrong_out if reason.startswith(f"(1, 1, {SKIP_LENGTH}")]
    if not SKIP_RATIO[0] < ratio < SKIP_RATIO[1]:
        skip_failures.append(
            f"the causal launch made {causal} tl.dot calls, {ratio:.2f} of the non-causal one's {non_causal}: "
            f"between {SKIP_RATIO[0]} and {SKIP_RATIO[1]} expected (skipping the tiles above the diagonal: 0.56)"
        )
    return {
        "test_forward": Verdict.decide(f"O of the kernel under the interpreter against SDPA: {cases}", wrong_out[:3]),
        "test_lse": Verdict.decide(f"LSE against torch.logsumexp of the scores: {cases}", wrong_lse[:3]),
        "test_causal_skip": Verdict.decide(
            f"tl.dot calls at T = {SKIP_LENGTH}: {non_causal} non-causal, {causal} causal ({ratio:.2f})", skip_failures
        ),
    }


def grade_lab10(cells: dict) -> dict[str, Verdict]:
    """Every graded cell of lab 10 (see the module's docstring): the kernel's and the backward's, side by side."""
    with ThreadPoolExecutor(max_workers=1) as pool:
        backward = pool.submit(backward_verdicts, cells)
        return {**_forward_verdicts(cells), **backward.result()}
