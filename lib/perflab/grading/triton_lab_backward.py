"""Lab 10's backward pass, decided outside the learner's kernel: gradients as data, memory and CPU time read from outside.

    backward_verdicts(cells)   # cells: {"course": {grade_id: source}, "learner": {grade_id: source}}
    # {'test_backward': Verdict(pass: ...), 'test_backward_memory': Verdict(...), 'test_backward_skip': Verdict(...)}

The learner's ``attention_backward`` runs in a sandboxed child that runs the lab's setup and that
cell, nothing of the kernel's. Inputs drawn from seeds chosen here go to it as bytes; its
gradients come back as bytes and are compared here with FlashAttention-2's backward (Algorithm 2)
computed in float64 from the same inputs. Half the cases hand it an ``o`` and ``lse`` that are not
the forward's: Algorithm 2 computes from the ones it is given, while anything that recomputes the
attention from q, k and v (autograd through SDPA, whose CPU backward is tiled too) gets other
gradients. Its peak memory at ``WORK_SHAPE`` is read from outside: ``VmHWM`` of the child's
Python, reset just before the call through ``/proc/<pid>/clear_refs``, which the child cannot write
(its ``/proc`` is read-only), against the lab's rule (``memory_limit``: the peak may grow by at most
that). So is its CPU time, on one thread, causal against not: skipping the key tiles after each
query tile halves the work. Both need the gradients right at ``WORK_SHAPE`` too, from an ``o`` and
``lse`` of the grader's.

    >>> memory_limit(WORK_SHAPE) / 2**20   # MiB: the gradients' 0.75 and 32 tiles of 128 x 128 float32
    2.75
    >>> q, k, v, d_o = draw_inputs(seed=0, shape=(1, 1, 5, 4), count=4)
    >>> out, lse = exact_attention(q, k, v, causal=True)
    >>> [tuple(t.shape) for t in algorithm2(q, k, v, out, lse, d_o, causal=True)]
    [(1, 1, 5, 4), (1, 1, 5, 4), (1, 1, 5, 4)]
    >>> [tuple(t.shape) for t in tensors_from_bytes(tensors_as_bytes([out, lse]), [(1, 1, 5, 4), (1, 1, 5)])]
    [(1, 1, 5, 4), (1, 1, 5)]

Used in: lab 10. Used by perflab.grading.triton_lab.
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
    "SKIP_LIMIT",
    "TILE",
    "TILES_AT_ONCE",
    "WORK_SHAPE",
    "algorithm2",
    "backward_verdicts",
    "child_lab10_backward",
    "child_lab10_backward_inputs",
    "draw_inputs",
    "exact_attention",
    "memory_limit",
    "tensors_as_bytes",
    "tensors_from_bytes",
    "timeout_verdict",
]

BACKWARD_CASES = ((1, 2, 100, 16, True), (2, 1, 37, 32, False), (1, 1, 130, 64, True))
WORK_SHAPE = (1, 1, 4096, 16)  # one head of T = 4096: its T x T scores would be 64 MiB of float32
# The lab's rule, the one the grader enforces: the backward's peak may grow its process by at most its three float32
# gradients and TILES_AT_ONCE tiles of TILE x TILE float32 numbers per head (a step of the course's holds about 6
# tiles, and vectors of one number per row): a T x T tensor, a mask included, does not fit.
TILE, TILES_AT_ONCE = 128, 32
SKIP_LIMIT = 0.8  # causal CPU time over non-causal, at most: skipping the tiles above the diagonal gives about 0.5
# Runs of each work case, interleaved: CPU time, counted in hundredths of a second, is the least of a case's (a causal
# run takes about 0.08 s), memory the most.
REPEATS = 5
CHILD_TIMEOUT_S = 120  # a request far longer than the reference's few seconds: the answer loops, and fails
_MACHINERY = ["colab_setup", "setup"]
_ROWS = 512  # query rows at a time in the grader's own float64 attention, so that T = 4096 needs no T x T matrix


def memory_limit(shape: tuple) -> int:
    """Bytes a backward of ``shape`` may add to its process at most, by the lab's rule: its three float32 gradients,
    and ``TILES_AT_ONCE`` tiles of ``TILE`` x ``TILE`` float32 numbers per head."""
    batch, heads, length, dim = shape
    return 4 * batch * heads * (3 * length * dim + TILES_AT_ONCE * TILE * TILE)


def draw_inputs(seed: int, shape: tuple, scale: float = 1.0, count: int = 3) -> list[torch.Tensor]:
    """``count`` float32 tensors of ``shape`` drawn from ``seed``, the same on both sides of the pipe; ``scale``
    multiplies q and k, and so the scores by ``scale**2``, not the values that the outputs average."""
    generator = torch.Generator().manual_seed(seed)
    q, k, *rest = torch.randn(count, *shape, generator=generator).unbind(0)
    return [q * scale, k * scale, *rest]


def _score_rows(q, k, causal: bool):
    """The scaled (and masked) scores, ``_ROWS`` query rows at a time, in float64: (start, end, scores)."""
    keys = torch.arange(k.size(-2))
    for start in range(0, q.size(-2), _ROWS):
        end = min(start + _ROWS, q.size(-2))
        scores = q[..., start:end, :].double() @ k.double().transpose(-2, -1) / math.sqrt(q.size(-1))
        if causal:
            scores = scores.masked_fill(keys > torch.arange(start, end).unsqueeze(-1), float("-inf"))
        yield start, end, scores


def _log_sum_exp(q, k, causal: bool):
    return torch.cat([torch.logsumexp(scores, -1) for _, _, scores in _score_rows(q, k, causal)], -1)


def exact_attention(q, k, v, causal: bool):
    """The attention's output (SDPA's, as ``tests/test_triton_lab.py`` checks) and the rows' log-sum-exp, in float64."""
    rows = [(torch.softmax(s, -1) @ v.double(), torch.logsumexp(s, -1)) for _, _, s in _score_rows(q, k, causal)]
    return torch.cat([o for o, _ in rows], -2), torch.cat([lse for _, lse in rows], -1)


def algorithm2(q, k, v, o, lse, d_o, causal: bool):
    """FlashAttention-2's backward (Dao 2023, Algorithm 2) in float64, from the ``o`` and ``lse`` given, whether or not
    they are the forward's: ``P = exp(S - L)``, ``D = rowsum(dO * O)``, ``dS = P * (dO V^T - D)``."""
    o, lse, d_o, v = (t.double() for t in (o, lse, d_o, v))
    scale = 1 / math.sqrt(q.size(-1))
    delta = (d_o * o).sum(-1, keepdim=True)
    dq, dk, dv = torch.zeros_like(o), torch.zeros_like(o), torch.zeros_like(o)
    for start, end, scores in _score_rows(q, k, causal):
        probabilities = torch.exp(scores - lse[..., start:end, None])
        dv += probabilities.transpose(-2, -1) @ d_o[..., start:end, :]
        d_scores = probabilities * (d_o[..., start:end, :] @ v.transpose(-2, -1) - delta[..., start:end, :]) * scale
        dq[..., start:end, :] = d_scores @ k.double()
        dk += d_scores.transpose(-2, -1) @ q[..., start:end, :].double()
    return dq, dk, dv


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
    # CPU time is compared causal against not: threads that spin while their neighbours wait for a busy machine's
    # cores would count several times over, as much as the work itself.
    torch.set_num_threads(1)
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


class _Case:
    """One case's inputs, as the grader draws them, and the gradients Algorithm 2 computes from them."""

    def __init__(self, shape: tuple, causal: bool, forward_statistics: bool):
        seed = grader_seeds.randrange(2**31)
        self.shape, self.causal = shape, causal
        q, k, v, d_o = draw_inputs(seed, shape, count=4)
        if forward_statistics:
            o, lse = exact_attention(q, k, v, causal)
        else:  # an o and lse of the grader's: only a backward that uses them gets Algorithm 2's gradients
            generator = torch.Generator().manual_seed(seed + 1)
            o = torch.randn(shape, generator=generator)
            lse = _log_sum_exp(q, k, causal) + 2 * torch.rand(shape[:-1], generator=generator) - 1
        self.inputs = [t.float() for t in (q, k, v, o, lse, d_o)]  # as the child receives them
        self.exact = algorithm2(*self.inputs, causal)
        self.name = f"{shape} causal={causal}" + ("" if forward_statistics else " with o and lse of the grader's")

    def run(self, child: AnswerProcess, before_run=lambda: None) -> tuple[list[str], float]:
        """What differs from Algorithm 2 in the learner's gradients, and the CPU seconds the child took for them."""
        child.call("lab10_backward_inputs", tensors_as_bytes(self.inputs), shape=list(self.shape))
        before_run()
        cpu_before = child.cpu_seconds()
        _, reply, _ = child.call("lab10_backward", causal=self.causal, timeout_s=CHILD_TIMEOUT_S)
        cpu_seconds = child.cpu_seconds() - cpu_before
        got = tensors_from_bytes(reply, [self.shape] * 3)
        return [
            f"{self.name}: d{which} differs from Algorithm 2's by {(g.double() - e).abs().max().item():.2e}"
            for which, g, e in zip("qkv", got, self.exact)
            if not torch.allclose(g.double(), e, rtol=1e-3, atol=1e-4)
        ], cpu_seconds


_GIVEN = (
    "compute P = exp(S - L) and D = rowsum(dO * O) from the lse and o it is given, as Algorithm 2 does, "
    "rather than recompute the attention"
)


def _gradients_verdict(child: AnswerProcess) -> Verdict:
    wrong = []
    for b, h, t, d, causal in BACKWARD_CASES:
        for forward_statistics in (True, False):
            wrong += _Case((b, h, t, d), causal, forward_statistics).run(child)[0]
    hint = [f"attention_backward must {_GIVEN}"] if any("of the grader's" in reason for reason in wrong) else []
    cases = f"{len(BACKWARD_CASES)} shapes, each with the forward's o and lse and with others"
    return Verdict.decide(f"dq, dk, dv against FlashAttention-2's Algorithm 2 in float64: {cases}", wrong[:3] + hint)


def _work_verdicts(child: AnswerProcess) -> dict[str, Verdict]:
    """The learner's backward at ``WORK_SHAPE``, causal and not, each ``REPEATS`` times, interleaved: its gradients
    must be right, the child's resident memory must grow by at most ``memory_limit``, and the causal runs must
    take at most ``SKIP_LIMIT`` of the non-causal ones' CPU time (the least of each, read from outside)."""
    python, resident = _answering_process(child), []

    def reset_peak():
        with open(f"/proc/{python.pid}/clear_refs", "w") as clear_refs:
            clear_refs.write("5")  # the peak resident set (VmHWM) starts again from the current one
        resident.append(_kib(python, "VmRSS"))

    cases = {causal: _Case(WORK_SHAPE, causal, forward_statistics=False) for causal in (False, True)}
    wrong, growth, cpu = {False: [], True: []}, {False: 0, True: 0}, {False: math.inf, True: math.inf}
    for _ in range(REPEATS):
        for causal, case in cases.items():
            failures, seconds = case.run(child, reset_peak)
            wrong[causal] = wrong[causal] or failures
            growth[causal] = max(growth[causal], (_kib(python, "VmHWM") - resident[-1]) * 1024)
            cpu[causal] = min(cpu[causal], seconds)
    shape, limit = f"(B, H, T, D) = {WORK_SHAPE}", memory_limit(WORK_SHAPE)
    memory_failures = [
        f"the backward grew its process by {growth[causal] / 2**20:.1f} MiB at {shape}, causal={causal}: its "
        f"gradients and {TILES_AT_ONCE} tiles of {TILE} x {TILE} float32 numbers a head, {limit / 2**20:.2f} MiB, "
        f"are allowed at most: no T x T tensor, a mask included; work on tiles of {TILE} queries by {TILE} keys"
        for causal in (False, True)
        if growth[causal] > limit
    ]
    ratio = cpu[True] / cpu[False] if cpu[False] > 0 else math.inf
    skip_failures = []
    if ratio > SKIP_LIMIT:
        skip_failures.append(
            f"the causal backward took {ratio:.2f} of the non-causal one's CPU time: at most {SKIP_LIMIT} expected "
            f"(skipping the key tiles after each query tile gives about 0.5)"
        )
    most = max(growth.values())
    return {
        "test_backward_memory": Verdict.decide(
            f"peak memory of the backward at {shape}, causal and not, read from outside: +{most / 2**20:.1f} MiB "
            f"(at most {limit / 2**20:.2f} MiB)",
            wrong[False][:1] + wrong[True][:1] + memory_failures,
        ),
        "test_backward_skip": Verdict.decide(
            f"CPU time of the backward at {shape}, read from outside: {cpu[False]:.2f} s non-causal, "
            f"{cpu[True]:.2f} s causal ({ratio:.2f})",
            wrong[False][:1] + wrong[True][:1] + skip_failures,
        ),
    }


def backward_verdicts(cells: dict) -> dict[str, Verdict]:
    graded_cells = ("test_backward", "test_backward_memory", "test_backward_skip")
    if "attention_backward" not in cells["learner"]:
        return dict.fromkeys(graded_cells, Verdict.refused("the answer cell attention_backward is missing"))
    learner = [(name, cells["course"][name]) for name in _MACHINERY]
    learner.append(("attention_backward", cells["learner"]["attention_backward"]))
    try:
        child = AnswerProcess(learner, handlers=__name__, read_only_proc=True)
    except ChildError as error:
        return dict.fromkeys(graded_cells, timeout_verdict(error))
    try:
        try:
            gradients = _gradients_verdict(child)
        except ChildError as error:
            gradients = timeout_verdict(error)
        try:
            work = _work_verdicts(child)
        except ChildError as error:
            work = dict.fromkeys(graded_cells[1:], timeout_verdict(error))
    finally:
        child.close()
    return {"test_backward": gradients, **work}
