"""Lab 10's grader: what it keeps of the kernel's cell, what Triton's frontend refuses, where a kernel may read, what
the backward is checked against, a kernel that never ends, what bfloat16 is held to, and the numbers the lab's text and
checks take from it."""

from __future__ import annotations

import importlib.util
import math
import re

import nbformat
import numpy as np
import pytest
import torch
from attacks import NO_SKIP_KERNEL, SDPA_KERNEL, SQUARE_TILES_KERNEL, UNMASKED_Q_KERNEL, course_cells
from perflab.grading import triton_lab
from perflab.grading.course import REPO
from perflab.grading.triton_lab import (
    BF16_CASES,
    BF16_ROUNDOFF,
    COURSE_BLOCKS,
    FLOAT32_TOLERANCE,
    FORWARD_CASES,
    SKIP_LENGTH,
    SKIP_RATIO,
    KernelRefused,
    kernel_definitions,
    output_tolerance,
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
from perflab.grading.triton_lab_frontend import configurations, frontend_refusals
from perflab.grading.triton_lab_launch import PRELUDE, AccessChecker
from perflab.triton_runtime import compile_for_gpu

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


def _cases(cases, dtype: str) -> list:
    return [(0, (b, h, t, d), causal, scale, blocks, dtype) for b, h, t, d, causal, scale, blocks in cases]


def test_triton_refuses_torch_in_a_kernel_and_takes_the_course_one():
    cases = _cases(FORWARD_CASES, "float32") + _cases(BF16_CASES, "bfloat16")
    launched = {(s["Q"], c["HEAD_DIM"], c["BLOCK_M"], c["BLOCK_N"], c["CAUSAL"]) for s, c in configurations(cases)}
    assert launched >= {("*fp32", 16, 32, 32, True), ("*fp32", 64, 32, 32, False), ("*fp32", 16, 16, 64, True)}
    assert launched >= {("*fp32", 32, 64, 16, True), ("*bf16", 64, 64, 16, False), ("*bf16", 16, 32, 32, True)}
    assert frontend_refusals(kernel_definitions(COURSE["flash_kernel"], STUB), cases, "flash_forward_kernel") == {}
    refusals = frontend_refusals(kernel_definitions(SDPA_KERNEL, STUB), cases, "flash_forward_kernel")
    assert set(refusals) == {"float32", "bfloat16"}
    assert all("Triton does not compile it" in refusal and "torch" in refusal for refusal in refusals.values())


def test_a_kernel_that_multiplies_p_in_float32_by_bfloat16_v_is_refused_for_bfloat16_only():
    mixed = COURSE["flash_kernel"].replace("tl.dot(weights.to(v.dtype), v,", "tl.dot(weights, v,")
    assert mixed != COURSE["flash_kernel"]
    cases = _cases(FORWARD_CASES, "float32") + _cases(BF16_CASES, "bfloat16")
    refusals = frontend_refusals(kernel_definitions(mixed, STUB), cases, "flash_forward_kernel")
    assert set(refusals) == {"bfloat16"} and "Both operands must be same dtype" in refusals["bfloat16"], refusals


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


@pytest.mark.parametrize("causal", [False, True])
def test_the_bfloat16_tolerance_bounds_the_two_roundings_and_the_notebook_s_is_the_grader_s(causal):
    q, k, v = (t.bfloat16() for t in draw_inputs(seed=3, shape=(1, 2, 40, 16), scale=2.0))
    exact = exact_attention(q, k, v, causal)[0]
    p = torch.softmax(_scores(q, k, causal), -1)
    # P, then O, rounded to nearest bfloat16 as a kernel rounds them: within the bound without float32's share.
    rounded = ((p.bfloat16().double() @ v.double()).bfloat16().double() - exact).abs()
    assert (rounded <= output_tolerance(q, k, v, causal) - FLOAT32_TOLERANCE).all()
    launcher = {"BLOCK_M": 32, "BLOCK_N": 32}  # what the checks cell takes from the launcher's cell
    namespace = {"torch": torch, "F": torch.nn.functional, "math": math, "device": torch.device("cpu"), **launcher}
    exec(_solution_cells(joined=False)["checks"], namespace)
    assert namespace["TOLERANCE"] == FLOAT32_TOLERANCE and namespace["BF16_ROUNDOFF"] == BF16_ROUNDOFF == 2**-8
    torch.testing.assert_close(namespace["tolerance"](q, k, v, causal), output_tolerance(q, k, v, causal))
    assert namespace["tolerance"](q.float(), k.float(), v.float(), causal) == FLOAT32_TOLERANCE


def _scores(q, k, causal):
    scores = q.double() @ k.double().transpose(-2, -1) / math.sqrt(q.size(-1))
    future = torch.ones(q.size(-2), q.size(-2), dtype=torch.bool).triu(1)
    return scores.masked_fill(future, float("-inf")) if causal else scores


@pytest.mark.slow
def test_bfloat16_scores_fail_the_tolerance_and_v_cast_up_fails_on_its_operands_only():
    child = triton_lab._kernel_child({"course": COURSE})
    try:
        kernels = {"solution": COURSE["flash_kernel"], "scores": SQUARE_TILES_KERNEL, "v up": NO_SKIP_KERNEL}
        cases = triton_lab._drawn(BF16_CASES, "bfloat16")
        verdicts = {
            name: triton_lab._bf16_verdict(child, kernel_definitions(kernel, STUB), cases)
            for name, kernel in kernels.items()
        }
    finally:
        child.close()
    assert verdicts["solution"].status == "pass", verdicts["solution"]
    scores, v_up = verdicts["scores"], verdicts["v up"]
    assert scores.status == "fail" and "times the bfloat16 tolerance" in scores.reasons[0], scores
    assert not any("tl.dot calls take" in reason for reason in scores.reasons), scores
    assert v_up.status == "fail" and all("tl.dot calls take bf16 x bf16 and fp32 x fp32" in r for r in v_up.reasons)


@pytest.mark.slow
def test_the_bfloat16_kernel_multiplies_on_tensor_cores_and_the_float32_one_does_not(tmp_path):
    source = tmp_path / "solution_kernel.py"  # Triton reads a kernel's source from its file
    source.write_text(PRELUDE + kernel_definitions(COURSE["flash_kernel"], STUB))
    spec = importlib.util.spec_from_file_location("solution_kernel", source)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    kernel, reports = module.flash_forward_kernel, {}
    for pointer, blocks in (("*bf16", 32), ("*bf16", 64), ("*fp32", 32)):
        arguments = dict.fromkeys(("Q", "K", "V", "O"), pointer) | {"LSE": "*fp32", "seq_len": 4096, "scale": 0.125}
        constexprs = {"HEAD_DIM": 64, "BLOCK_M": blocks, "BLOCK_N": blocks, "CAUSAL": True}
        reports[pointer, blocks] = compile_for_gpu(kernel, arguments, constexprs)
    # As the lab says: mma with 32 x 32 tiles, wgmma with 64 x 64, on bfloat16; neither on float32 with "ieee".
    assert reports["*bf16", 32].count("mma") > 0 and reports["*bf16", 64].count("wgmma") > 0
    assert reports["*fp32", 32].count("mma") == reports["*fp32", 32].count("wgmma") == 0


def _solution_cells(joined: bool = True) -> dict[str, str]:
    """The solution notebook's cells, markdown included: grade_id -> source, where ``joined`` runs of white space made
    one space."""
    notebook = nbformat.read(REPO / "solutions/lab10_flash_triton/lab10_flash_triton.ipynb", as_version=4)
    return {
        cell.metadata["nbgrader"]["grade_id"]: " ".join(cell.source.split()) if joined else cell.source
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
    # The bfloat16 tolerance, as the text derives it and the grader applies it.
    assert BF16_ROUNDOFF == 2**-8 and FLOAT32_TOLERANCE == 1e-4
    assert "`|O - exact| <= 2 * 2**-8 * attention(q, k, |v|) + 1e-4`" in cells["part1"]
    assert "from perflab.grading.triton_lab import BF16_ROUNDOFF, FLOAT32_TOLERANCE as TOLERANCE" in cells["checks"]
    # No figure of the grader's typed by hand in the checks' code (comments dropped, line by line).
    code = {
        grade_id: "\n".join(line.split("#")[0] for line in source.splitlines())
        for grade_id, source in _solution_cells(joined=False).items()
    }
    assert "1e-4" not in code["checks"] and "2**-8" not in code["checks"], "the checks take the grader's tolerances"
    for grade_id in ("test_causal_skip", "test_backward_memory", "test_backward_skip"):
        for typed in ("0.8", "0.65", "256", "4096", "128 * 128", "32 * "):
            assert typed not in code[grade_id], (grade_id, typed)


def test_each_part_states_the_points_of_its_graded_cells():
    notebook = nbformat.read(REPO / "solutions/lab10_flash_triton/lab10_flash_triton.ipynb", as_version=4)
    stated, counted, part = {}, {}, None
    for cell in notebook.cells:
        heading = re.match(r"## (Part \d+) .*\((\d+) points", cell.source) if cell.cell_type == "markdown" else None
        if heading:
            part, stated[heading.group(1)] = heading.group(1), int(heading.group(2))
        grading = cell.metadata.get("nbgrader", {})
        if part and grading.get("grade"):
            counted[part] = counted.get(part, 0) + grading["points"]
    assert stated == counted and len(stated) == 3, (stated, counted)
