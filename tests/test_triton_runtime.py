"""perflab.triton_runtime: how Triton runs here, and what its compiler says about a kernel for a GPU not here; and
perflab.triton_interpreter: the interpreter's fixes, each given only where a kernel run shows it missing."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("triton")

import triton.language as tl  # noqa: E402
from perflab import triton_runtime  # noqa: E402
from perflab.triton_runtime import (  # noqa: E402 (after the skip: nothing here works without triton)
    compile_for_gpu,
    course_triton_mode,
    scale_kernel,
    triton_mode,
)

SCALE_TYPES = {"x_ptr": "*fp32", "out_ptr": "*fp32", "n": "i32", "scale": "fp32"}


def _mode_in_child(interpret: str | None) -> str:
    environment = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    if interpret is not None:
        environment["TRITON_INTERPRET"] = interpret
    code = "from perflab.triton_runtime import triton_mode; print(triton_mode().mode)"
    completed = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=environment)
    assert completed.returncode == 0, completed.stderr
    return completed.stdout.strip()


def test_the_mode_follows_triton_interpret_and_the_device():
    assert _mode_in_child("1") == "interpreted"
    assert _mode_in_child(None) == ("compiled" if torch.cuda.is_available() else "unavailable")


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU the chapter compiles its kernels")
def test_the_course_runs_kernels_interpreted_only_once_one_has_run_so(monkeypatch):
    assert course_triton_mode().mode == "interpreted"
    monkeypatch.setattr(triton_runtime, "_INTERPRETER_CHILD", "import sys; sys.exit('the interpreter is broken')")
    broken = course_triton_mode()
    assert broken.mode == "unavailable" and "the interpreter is broken" in broken.reason, broken


# A kernel that walks a row in blocks up to a runtime length, as the course's softmax, matmul and attention do, run
# under TRITON_INTERPRET=1 in a fresh process: before patch_interpreter, then after it (twice).
LOOP_TO_RUNTIME_BOUND = """
import json, os
os.environ["TRITON_INTERPRET"] = "1"
import torch, triton
import triton.language as tl
from perflab import torch_features
from perflab.triton_interpreter import patch_interpreter


@triton.jit
def row_sum(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    total = tl.zeros((BLOCK,), tl.float32)
    for start in range(0, n, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        total += tl.load(x_ptr + cols, mask=cols < n, other=0.0)
    tl.store(out_ptr, tl.sum(total, axis=0))


def run():
    out = torch.zeros(1)
    try:
        row_sum[(1,)](torch.arange(100.0), out, 100, BLOCK=32)
    except Exception as error:
        return type(error).__name__
    return out.item()


shipped = run()
has_feature = torch_features.has("interpreter_runtime_loop_bounds")
print(json.dumps([has_feature, shipped, patch_interpreter(), run(), patch_interpreter()]))
"""


def test_the_interpreter_loops_to_a_runtime_bound_patched_only_where_its_triton_cannot(tmp_path):
    script = tmp_path / "loop.py"  # a file: the interpreter reads a kernel's source
    script.write_text(LOOP_TO_RUNTIME_BOUND)
    child = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert child.returncode == 0, child.stderr[-2000:]
    has_feature, shipped, patched, after, again = json.loads(child.stdout.strip().splitlines()[-1])
    assert has_feature is (shipped == 4950.0), f"the feature says {has_feature}, the interpreter as shipped: {shipped}"
    assert ("runtime loop bounds" in patched) is not has_feature, "patched where, and only where, it lacked the fix"
    assert after == 4950.0, f"after patch_interpreter the kernel gave {after}"
    assert again == [], f"each fix is given once, not again: {again}"


# A bfloat16 tl.dot and a cast to bfloat16 under TRITON_INTERPRET=1, in a fresh process, against torch's float32 product
# of the bfloat16 values and its rounding to nearest even: as shipped; beside a tl.dot fixed as Triton's pull request
# 11585 would have it (a Triton that fixed one fault, not the other); with the shipped tl.dot back.
BFLOAT16_KERNEL = """
import json, os
os.environ["TRITON_INTERPRET"] = "1"
import numpy as np, torch, triton
import triton.language as tl
from triton.runtime import interpreter
from perflab.triton_interpreter import interpreter_computes_bfloat16, patch_interpreter


@triton.jit
def dot_and_round(a_ptr, b_ptr, product_ptr, rounded_ptr, N: tl.constexpr):
    rows = tl.arange(0, N)
    square = rows[:, None] * N + rows[None, :]
    tl.store(product_ptr + square, tl.dot(tl.load(a_ptr + square), tl.load(b_ptr + square)))
    tl.store(rounded_ptr + square, tl.load(product_ptr + square).to(tl.bfloat16))


def errors():
    a, b = torch.randn(2, 16, 16, generator=torch.Generator().manual_seed(0)).bfloat16()
    product, rounded = torch.empty(16, 16), torch.empty(16, 16, dtype=torch.bfloat16)
    dot_and_round[(1,)](a, b, product, rounded, N=16)
    exact = a.double() @ b.double()
    return [(product.double() - exact).abs().max().item(), torch.equal(rounded, product.bfloat16())]


def bfloat16_fixes():
    return [fix for fix in patch_interpreter() if fix.startswith("bfloat16")]


def values(handle):  # a bfloat16 operand's bits made its float32 value, as pull request 11585 did
    if handle.data.dtype != np.uint16:
        return handle
    return interpreter.TensorHandle((handle.data.astype(np.uint32) << 16).view(np.float32), tl.float32)


builder = interpreter.InterpreterBuilder
shipped_dot = builder.create_dot
shipped = [interpreter_computes_bfloat16(), *errors()]
builder.create_dot = triton_fixed = lambda self, a, b, *rest: shipped_dot(self, values(a), values(b), *rest)
partial = [bfloat16_fixes(), builder.create_dot is triton_fixed, *errors()]
builder.create_dot = shipped_dot
fixed = [bfloat16_fixes(), interpreter_computes_bfloat16(), *errors(), bfloat16_fixes()]
# A bfloat16 held as the value of a 16-bit float, not as the uint16 of its bits, goes to tl.dot as it is.
as_value = interpreter.TensorHandle(np.full((16, 16), 1.5, np.float16), tl.bfloat16)
zero = interpreter.TensorHandle(np.zeros((16, 16), np.float32), tl.float32)
held = builder.create_dot(interpreter.interpreter_builder, as_value, as_value, zero, None, 0).data[0, 0].item()
print(json.dumps([shipped, partial, fixed, held]))
"""


def test_the_interpreter_multiplies_bfloat16_values_and_rounds_to_nearest_each_fixed_only_where_wrong(tmp_path):
    script = tmp_path / "bfloat16.py"
    script.write_text(BFLOAT16_KERNEL)
    child = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert child.returncode == 0, child.stderr[-2000:]
    shipped, partial, fixed, held = json.loads(child.stdout.strip().splitlines()[-1])
    computed_shipped, error_shipped, rounds_shipped = shipped
    dot_right = error_shipped < 1e-4
    assert computed_shipped is (dot_right and rounds_shipped), shipped
    # Beside a Triton's own tl.dot fix: only the rounding is given (where it is wrong), and Triton's tl.dot is kept.
    given, kept, error, rounds = partial
    assert given == ([] if rounds_shipped else ["bfloat16 rounding"]) and kept, partial
    assert error < 1e-5 and rounds, partial
    # The shipped tl.dot back: its fix is given where it is wrong, once. 16 products of bfloat16 numbers, each exact in
    # float32, summed in float32; rounded as torch rounds.
    given, computes, error, rounds, again = fixed
    assert given == ([] if dot_right else ["bfloat16 tl.dot"]) and again == [], fixed
    assert computes and error < 1e-5 and rounds, fixed
    assert held == 16 * 1.5 * 1.5, "a bfloat16 held as its value was taken for bits"


def test_the_mode_says_why():
    mode = triton_mode()
    assert mode.mode in {"compiled", "interpreted", "unavailable"} and mode.reason
    assert mode.mode in repr(mode) and mode.reason in repr(mode)


def test_a_report_reads_the_compilers_own_figures():
    report = compile_for_gpu(scale_kernel, SCALE_TYPES, {"BLOCK": 1024}, num_warps=4)
    assert report.target == "sm_90" and report.num_warps == 4
    assert report.shared_bytes == 0, "an elementwise kernel stages nothing in shared memory"
    assert report.registers > 0 and report.spilled_bytes == 0
    assert report.count("ld.global") > 0 and report.count("st.global") > 0 and report.count("mma") == 0
    assert report.excerpt("st.global", lines=1).count("\n") == 0 and "st.global" in report.excerpt("st.global")
    assert report.out_of_resources() is None and report.resident_by_shared_memory(per_sm=10 * 1024) == 10
    assert "out of resource: shared memory, Required: 0, Hardware limit: -1" in str(report.out_of_resources(-1))
    assert "scale_kernel for sm_90 (BLOCK=1024" in repr(report) and "<table>" in report._repr_html_()


def test_the_block_size_changes_what_the_compiler_makes():
    small = compile_for_gpu(scale_kernel, SCALE_TYPES, {"BLOCK": 128}, num_warps=4)
    large = compile_for_gpu(scale_kernel, SCALE_TYPES, {"BLOCK": 4096}, num_warps=4)
    assert large.count("ld.global") > small.count("ld.global"), "each thread loads more elements of a larger block"


def test_a_length_the_jit_knows_is_a_multiple_of_16_lets_the_compiler_vectorize():
    any_length = compile_for_gpu(scale_kernel, SCALE_TYPES, {"BLOCK": 1024})
    odd = compile_for_gpu(scale_kernel, {**SCALE_TYPES, "n": 10_001, "scale": 2.0}, {"BLOCK": 1024})
    multiple = compile_for_gpu(scale_kernel, {**SCALE_TYPES, "n": 10_000, "scale": 2.0}, {"BLOCK": 1024})
    assert any_length.specialized == odd.specialized == {} and multiple.specialized == {"n": "a multiple of 16"}
    assert any_length.count("ld.global.v4") == odd.count("ld.global.v4") == 0 < multiple.count("ld.global.v4")
    with pytest.raises(ValueError, match="no argument m"):
        compile_for_gpu(scale_kernel, {**SCALE_TYPES, "m": 16}, {"BLOCK": 1024})


def _tile_matmul(a_ptr, b_ptr, c_ptr, K, stride_am, stride_ak, stride_bk, stride_bn, BLOCK: tl.constexpr):  # noqa: N803
    """One BLOCK x BLOCK tile of ``C = A @ B``, walking ``K``: the strides as a launch passes them."""
    rows, inner = tl.arange(0, BLOCK), tl.arange(0, BLOCK)
    accumulator = tl.zeros((BLOCK, BLOCK), dtype=tl.float32)
    for k in range(0, K, BLOCK):
        a = tl.load(a_ptr + rows[:, None] * stride_am + (k + inner)[None, :] * stride_ak)
        b = tl.load(b_ptr + (k + inner)[:, None] * stride_bk + rows[None, :] * stride_bn)
        accumulator += tl.dot(a, b)
    tl.store(c_ptr + rows[:, None] * BLOCK + rows[None, :], accumulator)


def test_a_stride_of_1_becomes_a_constant_and_the_tiles_are_pipelined_through_shared_memory():
    pointers = {"a_ptr": "*fp16", "b_ptr": "*fp16", "c_ptr": "*fp32"}
    contiguous = {**pointers, "K": 256, "stride_am": 256, "stride_ak": 1, "stride_bk": 256, "stride_bn": 1}
    as_launched = compile_for_gpu(_tile_matmul, contiguous, {"BLOCK": 32}, num_stages=3)
    unspecialized = compile_for_gpu(
        _tile_matmul,
        {**pointers, **dict.fromkeys(contiguous.keys() - pointers.keys(), "i32")},
        {"BLOCK": 32},
        num_stages=3,
    )
    assert as_launched.specialized["stride_ak"] == as_launched.specialized["stride_bn"] == "= 1, a constant"
    assert as_launched.specialized["stride_am"] == "a multiple of 16" and unspecialized.specialized == {}
    # A 32 x 32 float16 tile of each operand is 4 KiB. Known to be contiguous, they are loaded ahead (cp.async) into
    # a ring of num_stages - 1 of them (tiles this small use mma.sync, not wgmma); not known, into one, in step.
    assert as_launched.count("wgmma") == 0 and as_launched.shared_bytes == (3 - 1) * 4096 > unspecialized.shared_bytes
    assert as_launched.count("cp.async") > 0 == unspecialized.count("cp.async")


def test_a_missing_argument_type_is_refused_before_compiling():
    with pytest.raises(ValueError, match="scale"):
        compile_for_gpu(scale_kernel, {"x_ptr": "*fp32", "out_ptr": "*fp32", "n": "i32"}, {"BLOCK": 1024})


def test_a_kernel_the_compiler_rejects_raises_with_its_message():
    with pytest.raises(RuntimeError, match="could not compile"):
        compile_for_gpu(scale_kernel, SCALE_TYPES, {"BLOCK": 1000})  # tl.arange needs a power of two
