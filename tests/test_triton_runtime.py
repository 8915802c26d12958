"""perflab.triton_runtime: how Triton runs here, and what its compiler says about a kernel for a GPU not here."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("triton")

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
# under TRITON_INTERPRET=1 in a fresh process: before patch_interpreter, then after it.
LOOP_TO_RUNTIME_BOUND = """
import json, os
os.environ["TRITON_INTERPRET"] = "1"
import torch, triton
import triton.language as tl
from perflab import torch_features
from perflab.triton_runtime import patch_interpreter


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
print(json.dumps([torch_features.has("interpreter_runtime_loop_bounds"), shipped, patch_interpreter(), run()]))
"""


def test_the_interpreter_loops_to_a_runtime_bound_patched_only_where_its_triton_cannot(tmp_path):
    script = tmp_path / "loop.py"  # a file: the interpreter reads a kernel's source
    script.write_text(LOOP_TO_RUNTIME_BOUND)
    child = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert child.returncode == 0, child.stderr[-2000:]
    has_feature, shipped, patched, after = json.loads(child.stdout.strip().splitlines()[-1])
    assert has_feature is (shipped == 4950.0), f"the feature says {has_feature}, the interpreter as shipped: {shipped}"
    assert patched is not has_feature, "patched where, and only where, the interpreter lacked the fix"
    assert after == 4950.0, f"after patch_interpreter the kernel gave {after}"


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
    assert report.fits() and not report.fits(shared_limit=-1)
    assert "scale_kernel for sm_90 (BLOCK=1024" in repr(report) and "<table>" in report._repr_html_()


def test_the_block_size_changes_what_the_compiler_makes():
    small = compile_for_gpu(scale_kernel, SCALE_TYPES, {"BLOCK": 128}, num_warps=4)
    large = compile_for_gpu(scale_kernel, SCALE_TYPES, {"BLOCK": 4096}, num_warps=4)
    assert large.count("ld.global") > small.count("ld.global"), "each thread loads more elements of a larger block"


def test_a_length_known_to_be_a_multiple_of_16_lets_the_compiler_vectorize():
    unknown = compile_for_gpu(scale_kernel, SCALE_TYPES, {"BLOCK": 1024})
    multiple = compile_for_gpu(scale_kernel, SCALE_TYPES, {"BLOCK": 1024}, divisible_by_16=["n"])
    assert unknown.count("ld.global.v4") == 0 and multiple.count("ld.global.v4") > 0
    with pytest.raises(ValueError, match="no argument m"):
        compile_for_gpu(scale_kernel, SCALE_TYPES, {"BLOCK": 1024}, divisible_by_16=["m"])


def test_a_missing_argument_type_is_refused_before_compiling():
    with pytest.raises(ValueError, match="scale"):
        compile_for_gpu(scale_kernel, {"x_ptr": "*fp32", "out_ptr": "*fp32", "n": "i32"}, {"BLOCK": 1024})


def test_a_kernel_the_compiler_rejects_raises_with_its_message():
    with pytest.raises(RuntimeError, match="could not compile"):
        compile_for_gpu(scale_kernel, SCALE_TYPES, {"BLOCK": 1000})  # tl.arange needs a power of two
