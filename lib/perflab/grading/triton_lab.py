"""Lab 10 (FlashAttention-2 in Triton), decided outside the learner's kernel: the kernel as data, run by the course.

    grade_lab10(cells)   # cells: {"course": {grade_id: source}, "learner": {grade_id: source}}
    # {'test_forward': Verdict(pass: ...), ..., 'test_forward_bf16': Verdict(pass: ...), ...}

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
target, for every input type, head dimension, block sizes and causal flag graded (Triton refuses anything that is
not Triton, a call to torch included; no GPU is needed: :mod:`perflab.grading.triton_lab_frontend`), then, if it
accepts them, a child that runs
them under Triton's interpreter (``TRITON_INTERPRET=1``) through the course's own launcher, with
several block sizes, on float32 inputs drawn from seeds chosen here, then on bfloat16 ones; it counts the tiles
they compute (``tl.dot`` calls), notes their operands' types, and records every address they read or write outside
the launch's tensors (:mod:`perflab.grading.triton_lab_launch`). Outputs and log-sum-exps come back as raw bytes and
are compared here with SDPA and ``torch.logsumexp`` in float64, on the inputs the kernel had (rounded to bfloat16
for the bfloat16 cases), to ``output_tolerance``. The bfloat16 cases decide one cell of their own: a kernel
right in float32 only loses that one when it does not take bfloat16. The learner's backward is checked
beside them, in a third child (:mod:`perflab.grading.triton_lab_backward`). Nothing here needs a
quiet machine: the one figure read from a clock, the backward's CPU time causal against not, is a ratio
with a wide margin to its bound.

Used in: lab 10. Used by perflab.grading.session.
"""

from __future__ import annotations

import ast
from concurrent.futures import ThreadPoolExecutor

import torch

from perflab.grading.child import AnswerProcess, ChildError
from perflab.grading.code_labs import grader_seeds
from perflab.grading.triton_lab_backward import (
    CHILD_TIMEOUT_S,
    backward_verdicts,
    draw_inputs,
    exact_attention,
    tensors_from_bytes,
    timeout_verdict,
)
from perflab.grading.triton_lab_frontend import frontend_refusals
from perflab.grading.verdict import Verdict

__all__ = [
    "BF16_CASES",
    "BF16_ROUNDOFF",
    "COURSE_BLOCKS",
    "FLOAT32_TOLERANCE",
    "FORWARD_CASES",
    "KernelRefused",
    "SKIP_LENGTH",
    "SKIP_RATIO",
    "grade_lab10",
    "kernel_definitions",
    "output_tolerance",
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
# The same on bfloat16 inputs, fewer and small: lengths that are not multiples of the blocks, causal and not, tiles
# square and not, and scores in the hundreds, where scores rounded to bfloat16 before the softmax are off by up to
# half a unit (bfloat16's numbers from 128 to 256 are 1 apart).
BF16_CASES = (
    (1, 2, 100, 32, True, 1.0, COURSE_BLOCKS),
    (1, 1, 130, 64, False, 1.0, (64, 16)),
    (1, 2, 70, 16, True, 6.0, COURSE_BLOCKS),
)
SKIP_LENGTH = 256  # causal against non-causal at one head of this length: 36 of 64 tiles of 32 (0.5625)
SKIP_RATIO = (0.4, 0.65)
FLOAT32_TOLERANCE = 1e-4  # the largest |O - exact| allowed on float32 inputs, and |LSE - exact| (beside rtol 1e-5)
BF16_ROUNDOFF = 2.0**-8  # bfloat16 keeps 8 significant bits: rounding to nearest is off by at most 2**-8 relative


def output_tolerance(q, k, v, causal: bool):
    """The largest ``|O - exact|`` allowed, element by element, where ``exact`` is the attention of ``q``, ``k``, ``v``
    (as the kernel had them) in float64.

    Float32 inputs: ``FLOAT32_TOLERANCE``. Bfloat16 inputs, with the scores, the running maximum and sum and the output
    accumulated in float32, add two roundings to bfloat16, each at most ``BF16_ROUNDOFF`` relative: each weight of P
    before ``tl.dot(p, v)``, which moves ``O[i, d] = sum_j P[i, j] V[j, d]`` by at most ``BF16_ROUNDOFF`` times
    ``sum_j P[i, j] |V[j, d]|``, the attention of ``|v|``; and O itself when it is stored, at most ``BF16_ROUNDOFF``
    times ``|O[i, d]|``, which is no larger. The products of ``tl.dot`` on bfloat16 operands are exact in float32.

        >>> q, k, v = torch.randn(3, 1, 1, 5, 4).bfloat16()
        >>> bound = output_tolerance(q, k, v, causal=True)
        >>> bound.shape, bool((bound > FLOAT32_TOLERANCE).all())
        (torch.Size([1, 1, 5, 4]), True)
        >>> output_tolerance(q.float(), k.float(), v.float(), causal=True)
        0.0001
    """
    if q.dtype != torch.bfloat16:
        return FLOAT32_TOLERANCE
    return 2 * BF16_ROUNDOFF * exact_attention(q, k, v.abs(), causal)[0] + FLOAT32_TOLERANCE


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


def _drawn(cases, dtype: str) -> list:
    """Each case with a seed drawn now, as the child runs it: (seed, shape, causal, scale, blocks, dtype)."""
    return [
        (grader_seeds.randrange(2**31), (b, h, t, d), causal, scale, blocks, dtype)
        for b, h, t, d, causal, scale, blocks in cases
    ]


def _run(child: AnswerProcess, definitions: str, cases: list) -> tuple[list, list[torch.Tensor]]:
    """The child's reports on ``cases`` and, for each, its O and LSE."""
    reports, payload, _ = child.call("lab10_forward", definitions=definitions, cases=cases, timeout_s=CHILD_TIMEOUT_S)
    return reports, tensors_from_bytes(payload, [s for _, shape, *_ in cases for s in (shape, shape[:-1])])


def _wrong(cases: list, reports: list, results: list) -> tuple[list[str], list[str]]:
    """What is wrong in each case's O (its values, tl.dot operands and accesses), and in its LSE."""
    wrong_out, wrong_lse = [], []
    for index, ((seed, shape, causal, scale, blocks, dtype), report) in enumerate(zip(cases, reports)):
        q, k, v = (t.to(getattr(torch, dtype)) for t in draw_inputs(seed, shape, scale))
        want_out, want_lse = exact_attention(q, k, v, causal)
        out, lse = results[2 * index : 2 * index + 2]
        name = f"{shape} causal={causal}" + (f" scores x{scale**2:g}" if scale != 1 else "")
        name += f" (BLOCK_M, BLOCK_N) = {tuple(blocks)}" if tuple(blocks) != COURSE_BLOCKS else ""
        error, tolerance = (out.double() - want_out).abs(), output_tolerance(q, k, v, causal)
        if not (error <= tolerance).all():
            wrong_out.append(f"{name}: O differs from SDPA's by {error.max().item():.2e}")
            if dtype == "bfloat16":
                wrong_out[-1] += f", up to {(error / tolerance).max().item():.1f} times the bfloat16 tolerance"
        if dtype == "bfloat16" and report["operands"] != ["bf16 x bf16"]:
            wrong_out.append(
                f"{name}: the kernel's tl.dot calls take {' and '.join(report['operands']) or 'nothing'}: on "
                "bfloat16 inputs both take bfloat16 operands, which tensor cores multiply (cast P with "
                '.to(v.dtype)); float32 operands with input_precision="ieee" use no tensor core'
            )
        wrong_out += [
            f"{name}: the kernel {access}; mask every tl.load and tl.store of rows or keys past seq_len"
            for access in report["outside"]
        ]
        if not torch.allclose(lse.double(), want_lse, atol=FLOAT32_TOLERANCE, rtol=1e-5):
            wrong_lse.append(
                f"{name}: LSE differs from logsumexp's by {(lse.double() - want_lse).abs().max().item():.2e}"
            )
    return wrong_out, wrong_lse


def _bf16_verdict(child: AnswerProcess, definitions: str, cases: list) -> Verdict:
    """The kernel on bfloat16 ``cases``: O to ``output_tolerance``, LSE as in float32, every tl.dot on bfloat16."""
    try:
        wrong_out, wrong_lse = _wrong(cases, *_run(child, definitions, cases))
    except ChildError as error:
        return timeout_verdict(error, CHILD_TIMEOUT_S)
    lengths = sorted({shape[2] for _, shape, *_ in cases})
    return Verdict.decide(
        f"O and LSE of the kernel on bfloat16 inputs under the interpreter against SDPA and torch.logsumexp on the "
        f"same inputs: {len(cases)} shapes (T from {lengths[0]} to {lengths[-1]}, causal and not, scores in the "
        f"hundreds) on fresh inputs; O to 2 x {BF16_ROUNDOFF:g} x the attention of |v| + {FLOAT32_TOLERANCE:g}, "
        "LSE as in float32, both tl.dot calls on bfloat16 operands, every address read or written checked",
        (wrong_out + wrong_lse)[:3],
    )


def _forward_verdicts(cells: dict) -> dict[str, Verdict]:
    graded_cells = ("test_forward", "test_lse", "test_causal_skip", "test_forward_bf16")
    try:
        definitions = kernel_definitions(cells["learner"].get("flash_kernel", ""), cells["course"]["flash_kernel"])
    except KernelRefused as error:
        return dict.fromkeys(graded_cells, Verdict.refused(str(error)))
    graded = _drawn(FORWARD_CASES, "float32")
    skip_seed = grader_seeds.randrange(2**31)
    skips = [(skip_seed, (1, 1, SKIP_LENGTH, 16), causal, 1.0, COURSE_BLOCKS, "float32") for causal in (False, True)]
    bf16_cases = _drawn(BF16_CASES, "bfloat16")
    refusals = frontend_refusals(definitions, graded + skips + bf16_cases, KERNEL)
    if "float32" in refusals:
        return dict.fromkeys(graded_cells, Verdict.refused(refusals["float32"]))
    try:
        child = _kernel_child(cells)
        try:
            reports, results = _run(child, definitions, graded + skips)
            # A kernel right in float32 that Triton refuses on bfloat16 inputs loses this cell only.
            refused = "bfloat16" in refusals
            bf16 = Verdict.refused(refusals["bfloat16"]) if refused else _bf16_verdict(child, definitions, bf16_cases)
        finally:
            child.close()
    except ChildError as error:
        return dict.fromkeys(graded_cells, timeout_verdict(error, CHILD_TIMEOUT_S))
    wrong_out, wrong_lse = _wrong(graded + skips, reports, results)
    cases = (
        f"{len(graded)} shapes (head dims 16-64, T from 1 to 130, causal and not, (BLOCK_M, BLOCK_N) of "
        f"{', '.join(map(str, sorted({tuple(blocks) for *_, blocks, _ in graded})))}) on fresh inputs, every address "
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
        "test_forward_bf16": bf16,
    }


def grade_lab10(cells: dict) -> dict[str, Verdict]:
    """Every graded cell of lab 10 (see the module's docstring): the kernel's and the backward's, side by side."""
    with ThreadPoolExecutor(max_workers=1) as pool:
        backward = pool.submit(backward_verdicts, cells)
        return {**_forward_verdicts(cells), **backward.result()}
