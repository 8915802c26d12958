import math

import pytest
import torch
from perflab.datasheet import DATASHEET_PEAKS, datasheet_peak
from perflab.roofline import measure_peaks


def test_each_name_finds_its_own_sheet_and_a_variant_gets_bandwidth_only_where_its_name_says_which():
    assert datasheet_peak("NVIDIA A100-SXM4-80GB").memory_bytes_per_s == 2.039e12
    assert datasheet_peak("NVIDIA A100-PCIE-40GB").memory_bytes_per_s is None, "40 and 80 GB differ: no guess"
    assert datasheet_peak("NVIDIA A100-PCIE-40GB").flops_per_s("tfloat32") == 156e12
    assert datasheet_peak("NVIDIA H100 PCIe").model == "NVIDIA H100 PCIe"
    assert datasheet_peak("NVIDIA H200").model == "NVIDIA H200 SXM"
    for unlisted in ("NVIDIA H200 NVL", "NVIDIA GH200 480GB", "NVIDIA H100 NVL"):
        assert datasheet_peak(unlisted) is None, f"{unlisted} has other peaks: no neighbour's figures"
    assert datasheet_peak("Tesla T4").ridge("bfloat16") is None, "a T4 has no bfloat16 tensor cores"


def test_a_ridge_is_the_peak_over_the_bandwidth_of_the_same_sheet():
    for sheet in DATASHEET_PEAKS:
        for dtype, flops in sheet.peaks:
            if sheet.memory_bytes_per_s is None:
                assert sheet.ridge(dtype) is None
            else:
                assert math.isclose(sheet.ridge(dtype), flops / sheet.memory_bytes_per_s)
        if sheet.memory_bytes_per_s:
            assert sheet.ridge("float32") < sheet.ridge("float16"), f"{sheet.model}: tensor cores move the ridge right"
            assert "TB/s" in repr(sheet)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="TF32 is a CUDA matmul mode: needs a CUDA device")
def test_a_peak_measured_with_tf32_allowed_says_so():
    previous = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("highest")
        assert "TF32" not in measure_peaks("cuda", matmul_size=1024, copy_mib=16, samples=2).matmul
        torch.set_float32_matmul_precision("high")
        assert measure_peaks("cuda", matmul_size=1024, copy_mib=16, samples=2).matmul.endswith("TF32 allowed")
    finally:
        torch.set_float32_matmul_precision(previous)
