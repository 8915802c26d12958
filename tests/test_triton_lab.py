"""Lab 10's grader: what it keeps of the kernel's cell, what Triton's frontend refuses, and a kernel that never ends."""

from __future__ import annotations

import pytest
from attacks import NO_SKIP_KERNEL, SDPA_KERNEL, course_cells
from perflab.grading import triton_lab
from perflab.grading.triton_lab import KernelRefused, kernel_definitions

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


def test_the_launcher_constants_are_read_as_data():
    constants = triton_lab._launcher_constants(COURSE["launcher"])
    assert constants["BLOCK_M"] == 32 and constants["BLOCK_N"] == 32


def test_triton_refuses_torch_in_a_kernel_and_takes_the_course_one():
    configurations = triton_lab._configurations(triton_lab._launcher_constants(COURSE["launcher"]))
    assert {(c["HEAD_DIM"], c["CAUSAL"]) for _, c in configurations} >= {(16, True), (64, False)}
    assert triton_lab._frontend_refusal(kernel_definitions(COURSE["flash_kernel"], STUB), configurations) is None
    refusal = triton_lab._frontend_refusal(kernel_definitions(SDPA_KERNEL, STUB), configurations)
    assert "Triton does not compile it" in refusal and "torch" in refusal


@pytest.mark.slow
def test_a_kernel_that_never_ends_fails_within_the_bound(monkeypatch):
    monkeypatch.setattr(triton_lab, "CHILD_TIMEOUT_S", 10)
    looping = SIGNATURE + "    while seq_len > 0:\n        scale += 1.0\n"
    verdicts = triton_lab._forward_verdicts({"course": COURSE, "learner": {"flash_kernel": looping}})
    for verdict in verdicts.values():
        assert verdict.status == "fail" and "did not finish within 10 s" in verdict.reasons[0], verdict
        # The interpreter's child hit the bound, not Triton's frontend, which has the same one (half a second here).
        assert verdict.reasons[0].startswith("the answer did not finish"), verdict
