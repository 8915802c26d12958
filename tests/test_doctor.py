import subprocess
import sys

import torch
from perflab.doctor import DoctorReport, distributed_checks, dtype_speed_checks, sdpa_checks, triton_checks


def test_python_m_perflab_doctor_prints_the_whole_table():
    completed = subprocess.run([sys.executable, "-m", "perflab", "doctor"], capture_output=True, text=True, timeout=600)
    assert completed.returncode == 0, completed.stderr
    table = completed.stdout
    assert table.splitlines()[0].split() == ["section", "check", "result"]
    for expected in (
        "torch",
        "CPU cores usable",
        "matmul 512x512 bf16",
        "SDPA math",
        "torch.compile",
        "Triton kernels",
        "gloo",
    ):
        assert expected in table, f"{expected!r} missing from:\n{table}"
    assert "fails" not in table.split("torch.compile", 1)[1].splitlines()[0], (
        "torch.compile should work on the course machines"
    )


def test_precision_rows_report_a_measured_speed_ratio():
    checks = {check.name: check.result for check in dtype_speed_checks(torch.device("cpu"), size=128)}
    assert checks["matmul 128x128 fp32"].endswith("s")
    for dtype in ("bf16", "fp16"):
        result = checks[f"matmul 128x128 {dtype}"]
        assert "x fp32's speed" in result or result.startswith("unsupported")
        assert any(word in result for word in ("faster", "slower", "no faster", "unsupported"))


def test_sdpa_math_backend_always_works():
    results = {check.name: check.result for check in sdpa_checks(torch.device("cpu"))}
    assert results["SDPA math"] == "works"
    assert set(results) == {"SDPA flash_attention", "SDPA efficient_attention", "SDPA cudnn_attention", "SDPA math"}


def test_gloo_all_reduce_runs_in_one_process():
    results = {check.name: check.result for check in distributed_checks()}
    assert results["gloo"].startswith("works")


def test_report_looks_up_results_by_name_and_renders_html():
    report = DoctorReport(tuple(sdpa_checks(torch.device("cpu"))))
    assert report["SDPA math"] == "works"
    assert "<table>" in report._repr_html_() and "SDPA math" in str(report)


def test_the_triton_row_says_how_kernels_run_here_and_why():
    (check,) = triton_checks()
    mode, _, reason = check.result.partition(": ")
    assert check.name == "Triton kernels" and reason
    # triton ships with torch's Linux wheels, whose interpreter runs on any CPU: the chapter runs here either way.
    assert mode == ("compiled" if torch.cuda.is_available() else "interpreted"), check.result
