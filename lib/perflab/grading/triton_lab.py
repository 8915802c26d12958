"""Lab 10 (FlashAttention-2 in Triton), decided outside the learner's kernel: the kernel as data, run by the course.

    grade_lab10(cells)   # cells: {"course": {grade_id: source}, "learner": {grade_id: source}}
    # {'test_forward': Verdict(pass: ...), ..., 'test_backward_memory': Verdict(pass: ...)}

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
target, for every head dimension and causal flag graded (Triton refuses anything that is not
Triton, a call to torch included; no GPU is needed), then, if it accepts them, a child that runs
them under Triton's interpreter (``TRITON_INTERPRET=1``) through the course's own launcher, on
inputs drawn from seeds chosen here, and counts the tiles they compute (``tl.dot`` calls). Outputs
and log-sum-exps come back as raw bytes and are compared here with SDPA and ``torch.logsumexp``
in float64. The learner's backward runs in a third child, which runs the learner's backward cell
and nothing of the kernel's; its gradients come back as bytes and are compared with autograd
through SDPA, and its peak memory is read from outside (``VmHWM``, reset before the call through
``/proc/<pid>/clear_refs``, which the child cannot write: its ``/proc`` is read-only). None of
these checks times anything: a lab 10 grading needs no quiet machine.

Used by perflab.grading.session.
"""

from __future__ import annotations

import ast
import json
import linecache
import math
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from concurrent.futures import ThreadPoolExecutor

import psutil
import torch

from perflab.grading.child import AnswerProcess, ChildError, ChildLost, verdict_of
from perflab.grading.code_labs import grader_seeds
from perflab.grading.sandbox import require_sandbox, sandbox_command
from perflab.grading.verdict import Verdict

__all__ = [
    "BACKWARD_CASES",
    "FORWARD_CASES",
    "KernelRefused",
    "MEMORY_CASE",
    "SKIP_LENGTH",
    "child_lab10_backward",
    "child_lab10_backward_inputs",
    "child_lab10_forward",
    "grade_lab10",
    "kernel_definitions",
]

KERNEL = "flash_forward_kernel"
# (batch, heads, sequence length, head dim, causal, scale of q and k): lengths that are not multiples of the
# course's blocks, a single token, and scores in the hundreds, where exp overflows without the running maximum.
FORWARD_CASES = (
    (1, 2, 100, 16, False, 1.0),
    (2, 1, 37, 64, True, 1.0),
    (1, 1, 1, 32, True, 1.0),
    (1, 2, 130, 32, True, 1.0),
    (1, 1, 130, 64, False, 1.0),
    (1, 2, 64, 16, True, 6.0),
)
SKIP_LENGTH = 256  # causal against non-causal at one head of this length: 36 of 64 tiles of 32 (0.5625)
SKIP_RATIO = (0.4, 0.65)
BACKWARD_CASES = ((1, 2, 100, 16, True), (2, 1, 37, 32, False), (1, 1, 130, 64, True))
# One head of T = 4096: its T x T scores are 64 MiB in float32; the backward may grow the process by an eighth of it.
MEMORY_CASE = (1, 1, 4096, 16, False)
MEMORY_LIMIT_FRACTION = 1 / 8
CHILD_TIMEOUT_S = 120  # a request far longer than the reference's few seconds: the answer loops, and fails
_MACHINERY = ["colab_setup", "setup"]


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


_PRELUDE = "import triton\nimport triton.language as tl\n\n\n"
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
            file.write(_PRELUDE + definitions)
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


def _launcher_constants(launcher: str) -> dict:
    """The course's launcher's constants (``BLOCK_M = 32``), read as data."""
    return {
        node.targets[0].id: ast.literal_eval(node.value)
        for node in ast.parse(launcher).body
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)
    }


def _configurations(constants: dict) -> list:
    """Every (signature, constexprs) the graded launches compile: each head dimension, causal and not."""
    blocks = {"BLOCK_M": constants["BLOCK_M"], "BLOCK_N": constants["BLOCK_N"]}
    pointers = dict.fromkeys(("Q", "K", "V", "O", "LSE"), "*fp32")
    signature = {
        **pointers,
        "seq_len": "i32",
        "scale": "fp32",
        **dict.fromkeys(("HEAD_DIM", *blocks, "CAUSAL"), "constexpr"),
    }
    head_dims = sorted({case[3] for case in FORWARD_CASES} | {16})
    return [(signature, {"HEAD_DIM": dim, **blocks, "CAUSAL": causal}) for dim in head_dims for causal in (False, True)]


def _inputs(seed: int, shape: tuple, scale: float = 1.0, count: int = 3) -> list[torch.Tensor]:
    """``count`` float32 tensors of ``shape`` drawn from ``seed``, the same on both sides of the pipe; ``scale``
    multiplies q and k, and so the scores by ``scale**2``, not the values that the outputs average."""
    generator = torch.Generator().manual_seed(seed)
    q, k, *rest = torch.randn(count, *shape, generator=generator).unbind(0)
    return [q * scale, k * scale, *rest]


def _exact_attention(q, k, v, causal: bool):
    """SDPA's output and the rows' log-sum-exp, in float64."""
    q, k, v = (t.double() for t in (q, k, v))
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.size(-1))
    if causal:
        scores = scores.masked_fill(torch.ones(q.size(-2), k.size(-2), dtype=torch.bool).triu(1), float("-inf"))
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
    return out, torch.logsumexp(scores, dim=-1)


def _tensors(payload: bytes, shapes: list) -> list[torch.Tensor]:
    flat = torch.frombuffer(bytearray(payload), dtype=torch.float32)
    sizes = [math.prod(shape) for shape in shapes]
    if flat.numel() != sum(sizes):
        raise ChildError(f"the child sent {flat.numel()} numbers, not {sum(sizes)}")
    return [part.reshape(shape) for part, shape in zip(flat.split(sizes), shapes)]


def _bytes(tensors) -> bytes:
    return b"".join(t.detach().to("cpu", torch.float32).contiguous().numpy().tobytes() for t in tensors)


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
        [("kernel_setup", _KERNEL_SETUP), ("launcher", cells["course"]["launcher"])], handlers=__name__
    )


def child_lab10_forward(namespace, payload, definitions, cases):
    """Define the kernel beside ``triton`` and ``tl`` alone, then run the course's launcher on each case; the outputs,
    log-sum-exps and the number of ``tl.dot`` calls of each."""
    import triton
    import triton.language as tl
    from triton.runtime import interpreter

    filename = "<learner_kernel>"  # Triton reads a kernel's source through linecache
    source = _PRELUDE + definitions
    linecache.cache[filename] = (len(source), None, source.splitlines(keepends=True), filename)
    scope = {"triton": triton, "tl": tl, "__name__": "learner_kernel"}
    exec(compile(source, filename, "exec"), scope)
    namespace[KERNEL] = scope[KERNEL]
    builder, dots = interpreter.interpreter_builder, []
    original_dot = builder.create_dot

    def counted_dot(*args, **kwargs):
        dots[-1] += 1
        return original_dot(*args, **kwargs)

    builder.create_dot = counted_dot
    results, counts = [], []
    try:
        for seed, shape, causal, scale in cases:
            dots.append(0)
            out, lse = namespace["flash_forward"](*_inputs(seed, shape, scale), causal=causal)
            results += [out, lse]
            counts.append(dots[-1])
    finally:
        builder.create_dot = original_dot
    return counts, _bytes(results)


def child_lab10_backward_inputs(namespace, payload, shape):
    """Keep a case's inputs, so that the request that runs the backward holds nothing else of the grader's."""
    namespace["_backward_inputs"] = _tensors(payload, [shape] * 4 + [shape[:-1], shape])
    return None, b""


def child_lab10_backward(namespace, payload, causal):
    q, k, v, out, lse, d_out = namespace.pop("_backward_inputs")
    gradients = namespace["attention_backward"](q, k, v, out, lse, d_out, causal)
    if not (isinstance(gradients, tuple | list) and len(gradients) == 3):
        raise TypeError("attention_backward must return (dq, dk, dv)")
    for gradient in gradients:
        if type(gradient) is not torch.Tensor or gradient.shape != q.shape:
            raise TypeError(f"each gradient must be a torch.Tensor of shape {tuple(q.shape)}")
    return None, _bytes(gradients)


def _forward_verdicts(cells: dict) -> dict[str, Verdict]:
    try:
        definitions = kernel_definitions(cells["learner"].get("flash_kernel", ""), cells["course"]["flash_kernel"])
    except KernelRefused as error:
        refused = Verdict.refused(str(error))
        return dict.fromkeys(("test_forward", "test_lse", "test_causal_skip"), refused)
    refusal = _frontend_refusal(definitions, _configurations(_launcher_constants(cells["course"]["launcher"])))
    if refusal:
        refused = Verdict.refused(refusal)
        return dict.fromkeys(("test_forward", "test_lse", "test_causal_skip"), refused)
    graded = [
        (grader_seeds.randrange(2**31), (b, h, t, d), causal, scale) for b, h, t, d, causal, scale in FORWARD_CASES
    ]
    skip_seed = grader_seeds.randrange(2**31)
    skips = [(skip_seed, (1, 1, SKIP_LENGTH, 16), causal, 1.0) for causal in (False, True)]
    try:
        child = _kernel_child(cells)
        try:
            counts, payload, _ = child.call(
                "lab10_forward", definitions=definitions, cases=graded + skips, timeout_s=CHILD_TIMEOUT_S
            )
        finally:
            child.close()
        shapes = [s for _, shape, _, _ in graded + skips for s in (shape, shape[:-1])]
        results = _tensors(payload, shapes)
    except ChildError as error:
        verdict = _timeout_fails(error)
        return dict.fromkeys(("test_forward", "test_lse", "test_causal_skip"), verdict)
    wrong_out, wrong_lse = [], []
    for index, (seed, shape, causal, scale) in enumerate(graded + skips):
        want_out, want_lse = _exact_attention(*_inputs(seed, shape, scale), causal)
        out, lse = results[2 * index : 2 * index + 2]
        name = f"{shape} causal={causal}" + (f" scores x{scale**2:g}" if scale != 1 else "")
        if not torch.allclose(out.double(), want_out, atol=1e-4, rtol=0) or not torch.isfinite(out).all():
            wrong_out.append(f"{name}: O differs from SDPA's by {(out.double() - want_out).abs().max().item():.2e}")
        if not torch.allclose(lse.double(), want_lse, atol=1e-4, rtol=1e-5):
            wrong_lse.append(
                f"{name}: LSE differs from logsumexp's by {(lse.double() - want_lse).abs().max().item():.2e}"
            )
    cases = f"{len(graded)} shapes (head dims 16-64, T from 1 to 130, causal and not) on fresh inputs"
    non_causal, causal = counts[-2:]
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


def _timeout_fails(error: ChildError) -> Verdict:
    """A child that did not answer within ``CHILD_TIMEOUT_S`` fails (these checks are not timed: only a loop that
    never ends takes that long); any other lost child is the grading's failure."""
    if isinstance(error, ChildLost) and "did not answer in time" in str(error):
        return Verdict.refused(f"the answer did not finish within {CHILD_TIMEOUT_S} s: {error}")
    return verdict_of(error)


def _answering_process(child: AnswerProcess) -> psutil.Process:
    """The child's Python, inside the sandbox's process tree."""
    root = psutil.Process(child.process.pid)
    # bwrap's own processes carry the same command line: the Python is the one that runs the interpreter.
    for process in [root, *root.children(recursive=True)]:
        if os.path.realpath(process.exe()) == os.path.realpath(sys.executable):
            return process
    raise ChildLost("the answer's Python is not in its process tree")


def _kib(process: psutil.Process, field: str) -> int:
    with open(f"/proc/{process.pid}/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith(field + ":"))


def _backward_request(child: AnswerProcess, seed: int, shape: tuple, causal: bool, before_run=lambda: None):
    """The learner's gradients for one case, and the exact ones; ``before_run()`` once the child holds the inputs."""
    q, k, v, d_out = (
        t.double().requires_grad_() if i < 3 else t.double() for i, t in enumerate(_inputs(seed, shape, count=4))
    )
    out, lse = _exact_attention(q.detach(), k.detach(), v.detach(), causal)
    exact = torch.autograd.grad(
        torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal), (q, k, v), d_out
    )
    child.call("lab10_backward_inputs", _bytes([q, k, v, out, lse, d_out]), shape=list(shape))
    before_run()
    _, reply, _ = child.call("lab10_backward", causal=causal, timeout_s=CHILD_TIMEOUT_S)
    return _tensors(reply, [shape] * 3), exact


def _wrong_gradients(got, exact, name: str) -> list[str]:
    return [
        f"{name}: d{which} differs from autograd through SDPA's by {(g.double() - e).abs().max().item():.2e}"
        for which, g, e in zip("qkv", got, exact)
        if not torch.allclose(g.double(), e, rtol=1e-3, atol=1e-4)
    ]


def _backward_verdicts(cells: dict) -> dict[str, Verdict]:
    if "attention_backward" not in cells["learner"]:
        refused = Verdict.refused("the answer cell attention_backward is missing from the notebook")
        return {"test_backward": refused, "test_backward_memory": refused}
    learner = [(name, cells["course"][name]) for name in _MACHINERY]
    learner.append(("attention_backward", cells["learner"]["attention_backward"]))
    try:
        child = AnswerProcess(learner, handlers=__name__, read_only_proc=True)
    except ChildError as error:
        verdict = _timeout_fails(error)
        return {"test_backward": verdict, "test_backward_memory": verdict}
    try:
        wrong = []
        try:
            for b, h, t, d, causal in BACKWARD_CASES:
                got, exact = _backward_request(child, grader_seeds.randrange(2**31), (b, h, t, d), causal)
                wrong += _wrong_gradients(got, exact, f"{(b, h, t, d)} causal={causal}")
            gradients = Verdict.decide(
                f"dq, dk, dv against autograd through SDPA: {len(BACKWARD_CASES)} shapes", wrong[:3]
            )
        except ChildError as error:
            gradients = _timeout_fails(error)
        try:
            memory = _memory_verdict(child)
        except ChildError as error:
            memory = _timeout_fails(error)
    finally:
        child.close()
    return {"test_backward": gradients, "test_backward_memory": memory}


def _memory_verdict(child: AnswerProcess) -> Verdict:
    """The learner's backward at ``MEMORY_CASE``: its gradients must be right, and the child's resident memory must grow
    by less than ``MEMORY_LIMIT_FRACTION`` of one head's T x T float32 scores, as read from outside."""
    b, h, t, d, causal = MEMORY_CASE
    python, resident = _answering_process(child), []

    def reset_peak():
        with open(f"/proc/{python.pid}/clear_refs", "w") as clear_refs:
            clear_refs.write("5")  # the peak resident set (VmHWM) starts again from the current one
        resident.append(_kib(python, "VmRSS"))

    got, exact = _backward_request(child, grader_seeds.randrange(2**31), (b, h, t, d), causal, reset_peak)
    growth = (_kib(python, "VmHWM") - resident[0]) * 1024
    limit = MEMORY_LIMIT_FRACTION * t * t * 4
    failures = _wrong_gradients(got, exact, f"{(b, h, t, d)}")
    if growth >= limit:
        failures.append(
            f"the backward grew the process by {growth / 2**20:.1f} MiB at T = {t}: a T x T float32 matrix is "
            f"{t * t * 4 / 2**20:.0f} MiB, and less than {limit / 2**20:.0f} MiB is allowed: work on tiles"
        )
    return Verdict.decide(
        f"peak memory of one backward at T = {t}, read from outside: +{growth / 2**20:.1f} MiB", failures
    )


def grade_lab10(cells: dict) -> dict[str, Verdict]:
    """Every graded cell of lab 10 (see the module's docstring): the kernel's and the backward's, side by side."""
    with ThreadPoolExecutor(max_workers=1) as pool:
        backward = pool.submit(_backward_verdicts, cells)
        return {**_forward_verdicts(cells), **backward.result()}
