"""Lab 10's grader: what it keeps of the kernel's cell, what Triton's frontend refuses, where a kernel may read, what
the backward is checked against, a kernel that never ends, and the numbers the lab's text and checks take from it."""

from __future__ import annotations

import nbformat
import numpy as np
import pytest
import torch
from attacks import NO_SKIP_KERNEL, SDPA_KERNEL, UNMASKED_Q_KERNEL, course_cells
from perflab.grading import triton_lab
from perflab.grading.course import REPO
from perflab.grading.triton_lab import (
    COURSE_BLOCKS,
    FORWARD_CASES,
    SKIP_LENGTH,
    SKIP_RATIO,
    KernelRefused,
    kernel_definitions,
)
from perflab.grading.triton_lab_backward import (
    SKIP_LIMIT,
    TILE,
    TILES_AT_ONCE,
    WORK_SHAPE,
    algorithm2,
    draw_inputs,
    exact_attention,
    memory_limit,
)
from perflab.grading.triton_lab_launch import AccessChecker

COURSE = course_cells("lab10_flash_triton")
STUB = COURSE["flash_kernel"]
SIGNATURE = STUB.split("):")[0] + "):\n"  # the decorator and the def line of the course's kernel
HELPER = """
@triton.jit
def _tile_max(scores, AXIS: tl.constexpr):
    return tl.max(scores, AXIS)
"""


def test_only_the_jit_functions_of_the_cell_are_kept():
    definitions = kernel_definitions(SDPA_KERNEL, STUB)
    assert definitions.startswith("@triton.jit\ndef flash_forward_kernel(")
    for dropped in ("import torch", "_sdpa_forward", "flash_forward =", "interpreter."):
        assert dropped not in definitions


def test_helper_kernels_are_kept_with_their_decorators():
    definitions = kernel_definitions(HELPER + "\n" + NO_SKIP_KERNEL + "\nprint('module code')\n", STUB)
    assert definitions.count("@triton.jit") == 2 and "_tile_max" in definitions and "print" not in definitions
    compile(definitions, "<kept>", "exec")  # the kept source stands on its own


@pytest.mark.parametrize(
    ("cell", "reason"),
    [
        (SIGNATURE.replace("seq_len,", "seq_len: tl.constexpr,") + "    pass\n", "signature must be the course's"),
        (SIGNATURE.replace("scale,", "scale, extra,") + "    pass\n", "signature must be the course's"),
        (SIGNATURE.replace("CAUSAL: tl.constexpr", "CAUSAL: tl.constexpr = False") + "    pass\n", "no defaults"),
        (SIGNATURE.replace("scale,", "scale: print('x'),") + "    pass\n", "annotated tl.constexpr"),
        (SIGNATURE.replace("):", ") -> print('x'):") + "    pass\n", "no return annotation"),
        ("@print\n" + SIGNATURE + "    pass\n", "exactly one decorator"),
        ("def flash_forward_kernel(Q):\n    pass\n", "one @triton.jit function flash_forward_kernel, not 0"),
        (SIGNATURE + "    pass\n\n\n" + SIGNATURE + "    pass\n", "not 2"),
        (SIGNATURE + "    pass(\n", "not valid Python"),
    ],
    ids=[
        "seq_len constexpr",
        "extra argument",
        "default",
        "annotation",
        "return",
        "decorator",
        "none",
        "two",
        "syntax",
    ],
)
def test_a_kernel_that_could_run_code_when_defined_or_differs_from_the_course_is_refused(cell, reason):
    with pytest.raises(KernelRefused, match=reason):
        kernel_definitions(cell, STUB)


def test_triton_refuses_torch_in_a_kernel_and_takes_the_course_one():
    cases = [(0, (b, h, t, d), causal, scale, blocks) for b, h, t, d, causal, scale, blocks in FORWARD_CASES]
    configurations = triton_lab._configurations(cases)
    launched = {(c["HEAD_DIM"], c["BLOCK_M"], c["BLOCK_N"], c["CAUSAL"]) for _, c in configurations}
    assert launched >= {(16, 32, 32, True), (64, 32, 32, False), (16, 16, 64, True), (32, 64, 16, True)}
    assert triton_lab._frontend_refusal(kernel_definitions(COURSE["flash_kernel"], STUB), configurations) is None
    refusal = triton_lab._frontend_refusal(kernel_definitions(SDPA_KERNEL, STUB), configurations)
    assert "Triton does not compile it" in refusal and "torch" in refusal


class _Memory:
    """Stands for Triton's interpreter's memory functions: each lane it is left on reads 1.0."""

    def __init__(self):
        self.stored = None

    def load(self, addresses, mask, other, dtype):
        return np.where(mask, np.ones(addresses.shape, dtype), other)

    def store(self, addresses, value, mask):
        self.stored = mask


def test_an_access_outside_the_launchs_tensors_is_recorded_never_done_and_reads_nan():
    memory, q, k = _Memory(), torch.zeros(2, 4), torch.zeros(8)
    checker = AccessChecker(memory)
    checker.allow({"Q": q, "K": k})
    addresses = q.data_ptr() + 4 * np.arange(10, dtype=np.uint64)  # q's 8 elements, then the 2 after its end
    mask = np.ones(10, dtype=bool)
    loaded = checker.load(addresses, mask, np.zeros(10, np.float32), np.float32)
    assert loaded[:8].tolist() == [1.0] * 8 and np.isnan(loaded[8:]).all()
    checker.store(addresses, np.zeros(10, np.float32), mask)
    assert memory.stored.tolist() == [True] * 8 + [False] * 2
    assert checker.outside == [
        "read 2 elements outside the launch's tensors, the first just past the end of Q",
        "wrote 2 elements outside the launch's tensors, the first just past the end of Q",
    ]
    masked = checker.load(addresses, np.arange(10) < 8, np.zeros(10, np.float32), np.float32)
    assert masked[8:].tolist() == [0.0, 0.0] and len(checker.outside) == 2  # lanes the mask leaves off: not reads


@pytest.mark.parametrize("causal", [False, True])
def test_the_grader_s_attention_is_sdpa_s_and_its_backward_autograd_s_from_the_forward_s_statistics(causal):
    q, k, v, d_o = (t.double().requires_grad_() for t in draw_inputs(seed=1, shape=(1, 2, 37, 16), count=4))
    out, lse = exact_attention(q.detach(), k.detach(), v.detach(), causal)
    sdpa = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
    torch.testing.assert_close(out, sdpa.detach(), rtol=1e-12, atol=1e-12)
    exact = torch.autograd.grad(sdpa, (q, k, v), d_o.detach())
    for got, want in zip(algorithm2(q.detach(), k.detach(), v.detach(), out, lse, d_o.detach(), causal), exact):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    # With an lse that is not the forward's, Algorithm 2 is not autograd's: what the check of it can tell apart.
    shifted = algorithm2(q.detach(), k.detach(), v.detach(), out, lse + 0.5, d_o.detach(), causal)
    assert not torch.allclose(shifted[2], exact[2], rtol=1e-3, atol=1e-4)


@pytest.mark.slow
def test_a_kernel_that_never_ends_fails_within_the_bound(monkeypatch):
    monkeypatch.setattr(triton_lab, "CHILD_TIMEOUT_S", 10)
    looping = SIGNATURE + "    while seq_len > 0:\n        scale += 1.0\n"
    verdicts = triton_lab._forward_verdicts({"course": COURSE, "learner": {"flash_kernel": looping}})
    for verdict in verdicts.values():
        assert verdict.status == "fail" and "did not finish within 10 s" in verdict.reasons[0], verdict
        # The interpreter's child hit the bound, not Triton's frontend, which has the same one (half a second here).
        assert verdict.reasons[0].startswith("the answer did not finish"), verdict


@pytest.mark.slow
def test_an_unmasked_load_whose_values_come_out_right_fails_where_it_reads():
    verdicts = triton_lab._forward_verdicts({"course": COURSE, "learner": {"flash_kernel": UNMASKED_Q_KERNEL}})
    assert verdicts["test_lse"].status == "pass", verdicts  # the rows past T are never stored: every value is right
    assert verdicts["test_forward"].status == "fail", verdicts
    assert "the first just past the end of Q; mask every tl.load" in verdicts["test_forward"].reasons[0], verdicts


def _solution_cells() -> dict[str, str]:
    """The solution notebook's cells, markdown included: grade_id -> source, runs of white space made one space."""
    notebook = nbformat.read(REPO / "solutions/lab10_flash_triton/lab10_flash_triton.ipynb", as_version=4)
    return {
        cell.metadata["nbgrader"]["grade_id"]: " ".join(cell.source.split())
        for cell in notebook.cells
        if "nbgrader" in cell.metadata
    }


def _mib(size: int) -> str:
    return f"{size / 2**20:g} MiB"


def test_the_lab_s_text_and_visible_checks_state_the_grader_s_numbers():
    cells = _solution_cells()
    # Part 1: the shapes, the block sizes and the tile count of the skip, as the grader draws and bounds them.
    dims, lengths = {case[3] for case in FORWARD_CASES}, {case[2] for case in FORWARD_CASES}
    assert (
        f"head dimensions {min(dims)} to {max(dims)}, lengths from {min(lengths)} to {max(lengths)}" in cells["intro"]
    )
    blocks = list(dict.fromkeys(case[-1] for case in FORWARD_CASES))
    assert blocks[0] == COURSE_BLOCKS and COURSE_BLOCKS[0] == COURSE_BLOCKS[1]
    listed = ", ".join(f"`{b}`" for b in blocks[:-1]) + f" and `{blocks[-1]}`"
    assert f"the grader launches it with `(BLOCK_M, BLOCK_N)` = {listed}" in cells["part1"]
    tiles = SKIP_LENGTH // COURSE_BLOCKS[0]
    computed, every = tiles * (tiles + 1) // 2, tiles * tiles
    assert SKIP_RATIO[0] < computed / every < SKIP_RATIO[1]
    assert (
        f"at `T = {SKIP_LENGTH}` the causal launch must make between {SKIP_RATIO[0]} and {SKIP_RATIO[1]} as many as "
        f"the non-causal one (skipping gives {computed} of {every} tiles, {computed / every:.2f})"
    ) in cells["part1"]
    assert (
        f"BLOCK_M = {COURSE_BLOCKS[0]} " in cells["launcher"] and f"BLOCK_N = {COURSE_BLOCKS[1]} " in cells["launcher"]
    )
    for other in blocks[1:]:
        assert f"blocks={other})" in cells["test_forward"], other
    # Part 2: the memory rule and the skip bound, at the grader's work shape.
    batch, heads, length, dim = WORK_SHAPE
    gradients, room = 4 * 3 * length * dim, 4 * TILES_AT_ONCE * TILE * TILE
    assert batch == heads == 1 and memory_limit(WORK_SHAPE) == gradients + room
    for phrase in (
        f"`tile_size` keys, {TILE} by default",
        f"at `T = {length}`, `D = {dim}`, one head",
        f"The peak may grow by at most the gradients `dq`, `dk`, `dv` ({_mib(gradients)}) plus {TILES_AT_ONCE} "
        f"tiles of `{TILE} x {TILE}` float32 numbers per head ({_mib(room)})",
        f"a `T x T` tensor ({_mib(4 * length * length)} here)",
        f"not {TILE} queries against all {length:,} keys ({_mib(4 * TILE * length)} a tensor",
        f"must take at most {SKIP_LIMIT} of the non-causal one's",
        f"the gradients of those runs at `T = {length}` are right as well",
    ):
        assert phrase in cells["part2"], phrase
    assert f"tile_size={TILE}" in cells["attention_backward"]
    # The visible checks import the grader's constants, and close their bounds as the grader does ("at most").
    assert "allowed = memory_limit(WORK_SHAPE)" in cells["test_backward_memory"]
    assert "assert peak.bytes <= allowed" in cells["test_backward_memory"]
    assert "assert ratio <= SKIP_LIMIT" in cells["test_backward_skip"]
    assert "assert SKIP_RATIO[0] < ratio < SKIP_RATIO[1]" in cells["test_causal_skip"]
    assert "dot_calls(causal, SKIP_LENGTH)" in cells["test_causal_skip"]
    for grade_id in ("test_causal_skip", "test_backward_memory", "test_backward_skip"):
        for typed in ("0.8", "0.65", "256", "4096", "128 * 128", "32 * "):
            code = "\n".join(line.split("#")[0] for line in cells[grade_id].splitlines())
            assert typed not in code, (grade_id, typed)
