"""Lab 10's backward pass, decided outside the learner's kernel: gradients as data, peak memory read from outside.

    backward_verdicts(cells)   # cells: {"course": {grade_id: source}, "learner": {grade_id: source}}
    # {'test_backward': Verdict(pass: ...), 'test_backward_memory': Verdict(pass: ...)}

The learner's ``attention_backward`` runs in a sandboxed child that runs the lab's setup and that
cell, nothing of the kernel's. Inputs drawn from seeds chosen here go to it as bytes; its
gradients come back as bytes and are compared here with autograd through SDPA, in float64. Its
peak memory at ``MEMORY_CASE`` is read from outside: ``VmHWM`` of the child's Python, reset just
before the call through ``/proc/<pid>/clear_refs``, which the child cannot write (its ``/proc``
is read-only). The helpers that draw the inputs and carry tensors as bytes serve the kernel's
checks too (:mod:`perflab.grading.triton_lab`).

    >>> q, k, v = draw_inputs(seed=0, shape=(1, 1, 5, 4))
    >>> out, lse = exact_attention(q, k, v, causal=True)
    >>> [tuple(t.shape) for t in tensors_from_bytes(tensors_as_bytes([out, lse]), [(1, 1, 5, 4), (1, 1, 5)])]
    [(1, 1, 5, 4), (1, 1, 5)]

Used by perflab.grading.triton_lab.
"""

from __future__ import annotations

import math
import os
import sys

import psutil
import torch

from perflab.grading.child import AnswerProcess, ChildError, ChildLost, verdict_of
from perflab.grading.code_labs import grader_seeds
from perflab.grading.verdict import Verdict

__all__ = [
    "BACKWARD_CASES",
    "CHILD_TIMEOUT_S",
    "MEMORY_CASE",
    "backward_verdicts",
    "child_lab10_backward",
    "child_lab10_backward_inputs",
    "draw_inputs",
    "exact_attention",
    "tensors_as_bytes",
    "tensors_from_bytes",
    "timeout_verdict",
]

BACKWARD_CASES = ((1, 2, 100, 16, True), (2, 1, 37, 32, False), (1, 1, 130, 64, True))
# One head of T = 4096: its T x T scores are 64 MiB in float32; the backward may grow the process by an eighth of it.
MEMORY_CASE = (1, 1, 4096, 16, False)
MEMORY_LIMIT_FRACTION = 1 / 8
CHILD_TIMEOUT_S = 120  # a request far longer than the reference's few seconds: the answer loops, and fails
_MACHINERY = ["colab_setup", "setup"]


def draw_inputs(seed: int, shape: tuple, scale: float = 1.0, count: int = 3) -> list[torch.Tensor]:
    """``count`` float32 tensors of ``shape`` drawn from ``seed``, the same on both sides of the pipe; ``scale``
    multiplies q and k, and so the scores by ``scale**2``, not the values that the outputs average."""
    generator = torch.Generator().manual_seed(seed)
    q, k, *rest = torch.randn(count, *shape, generator=generator).unbind(0)
    return [q * scale, k * scale, *rest]


def exact_attention(q, k, v, causal: bool):
    """SDPA's output and the rows' log-sum-exp, in float64."""
    q, k, v = (t.double() for t in (q, k, v))
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.size(-1))
    if causal:
        scores = scores.masked_fill(torch.ones(q.size(-2), k.size(-2), dtype=torch.bool).triu(1), float("-inf"))
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
    return out, torch.logsumexp(scores, dim=-1)


def tensors_from_bytes(payload: bytes, shapes: list) -> list[torch.Tensor]:
    flat = torch.frombuffer(bytearray(payload), dtype=torch.float32)
    sizes = [math.prod(shape) for shape in shapes]
    if flat.numel() != sum(sizes):
        raise ChildError(f"the child sent {flat.numel()} numbers, not {sum(sizes)}")
    return [part.reshape(shape) for part, shape in zip(flat.split(sizes), shapes)]


def tensors_as_bytes(tensors) -> bytes:
    return b"".join(t.detach().to("cpu", torch.float32).contiguous().numpy().tobytes() for t in tensors)


def child_lab10_backward_inputs(namespace, payload, shape):
    """Keep a case's inputs, so that the request that runs the backward holds nothing else of the grader's."""
    namespace["_backward_inputs"] = tensors_from_bytes(payload, [shape] * 4 + [shape[:-1], shape])
    return None, b""


def child_lab10_backward(namespace, payload, causal):
    q, k, v, out, lse, d_out = namespace.pop("_backward_inputs")
    gradients = namespace["attention_backward"](q, k, v, out, lse, d_out, causal)
    if not (isinstance(gradients, tuple | list) and len(gradients) == 3):
        raise TypeError("attention_backward must return (dq, dk, dv)")
    for gradient in gradients:
        if type(gradient) is not torch.Tensor or gradient.shape != q.shape:
            raise TypeError(f"each gradient must be a torch.Tensor of shape {tuple(q.shape)}")
    return None, tensors_as_bytes(gradients)


def timeout_verdict(error: ChildError, limit_s: float = CHILD_TIMEOUT_S) -> Verdict:
    """A child that did not answer within ``limit_s`` fails (these checks are not timed: only a loop that never ends
    takes that long); any other lost child is the grading's failure."""
    if isinstance(error, ChildLost) and "did not answer in time" in str(error):
        return Verdict.refused(f"the answer did not finish within {limit_s:g} s: {error}")
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
        t.double().requires_grad_() if i < 3 else t.double() for i, t in enumerate(draw_inputs(seed, shape, count=4))
    )
    out, lse = exact_attention(q.detach(), k.detach(), v.detach(), causal)
    exact = torch.autograd.grad(
        torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal), (q, k, v), d_out
    )
    child.call("lab10_backward_inputs", tensors_as_bytes([q, k, v, out, lse, d_out]), shape=list(shape))
    before_run()
    _, reply, _ = child.call("lab10_backward", causal=causal, timeout_s=CHILD_TIMEOUT_S)
    return tensors_from_bytes(reply, [shape] * 3), exact


def _wrong_gradients(got, exact, name: str) -> list[str]:
    return [
        f"{name}: d{which} differs from autograd through SDPA's by {(g.double() - e).abs().max().item():.2e}"
        for which, g, e in zip("qkv", got, exact)
        if not torch.allclose(g.double(), e, rtol=1e-3, atol=1e-4)
    ]


def backward_verdicts(cells: dict) -> dict[str, Verdict]:
    if "attention_backward" not in cells["learner"]:
        refused = Verdict.refused("the answer cell attention_backward is missing from the notebook")
        return {"test_backward": refused, "test_backward_memory": refused}
    learner = [(name, cells["course"][name]) for name in _MACHINERY]
    learner.append(("attention_backward", cells["learner"]["attention_backward"]))
    try:
        child = AnswerProcess(learner, handlers=__name__, read_only_proc=True)
    except ChildError as error:
        verdict = timeout_verdict(error)
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
            gradients = timeout_verdict(error)
        try:
            memory = _memory_verdict(child)
        except ChildError as error:
            memory = timeout_verdict(error)
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
