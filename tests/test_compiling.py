"""perflab.compiling: graph-break reports, compile cost and break-even, and the code Inductor writes.

Nothing here runs Inductor (each compilation would take seconds): Dynamo traces with the "eager"
backend, and the generated-code parser reads modules laid out as Inductor writes them.
"""

import inspect
import math

import matplotlib
import pytest
import torch
from perflab.bench import Comparison, Timing
from perflab.compiling import CompileCost, GeneratedCode, compile_cost, graph_breaks
from perflab.plots import break_even_chart

matplotlib.use("Agg")


def two_breaks(x):
    peak = x.abs().amax().item()
    y = x / peak
    if y.sum() > 0:
        return y - 1
    return y + 1


def no_break(x):
    return torch.tanh(x) * 2 + 1


def line_of(function, text):
    lines, first = inspect.getsourcelines(function)
    return next(first + index for index, line in enumerate(lines) if text in line)


def test_graph_breaks_names_each_break_with_its_line_of_code():
    report = graph_breaks(two_breaks, torch.randn(4, 8))
    assert report.graphs == 3 and len(report.breaks) == 2
    item, branch = report.breaks
    assert item.lineno == line_of(two_breaks, ".item()") and "item()" in item.line and "item()" in item.reason
    # The second break happens in the code Dynamo resumes after the first: it is reported as two_breaks.
    assert branch.lineno == line_of(two_breaks, "if y.sum()") and branch.function == "two_breaks"
    text = repr(report)
    assert text.startswith("GraphBreaks(3 graphs, 2 breaks") and "peak = x.abs().amax().item()" in text
    assert "<table>" in report._repr_html_() and "&gt; 0" in report._repr_html_()


def test_graph_breaks_of_a_clean_function():
    report = graph_breaks(no_break, torch.randn(4, 8))
    assert (report.graphs, report.breaks) == (1, ())
    assert report.operations == 3
    assert repr(report) == "GraphBreaks(1 graph, 0 breaks, 3 operations)"


def cost(first_call, eager_s, compiled_s, rounds=9):
    comparison = Comparison(Timing("eager", (eager_s,) * rounds), Timing("compiled", (compiled_s,) * rounds))
    return CompileCost(first_call=first_call, graphs=1, comparison=comparison)


def test_break_even_is_compile_time_over_the_saving_per_call():
    paying = cost(first_call=2.01, eager_s=0.03, compiled_s=0.01)
    assert paying.pays_off
    assert paying.compile_seconds == pytest.approx(2.0)
    assert paying.break_even_calls == 100
    assert "pays off after 100 calls" in repr(paying) and "3.00x" in repr(paying)


def test_no_measurable_saving_never_breaks_even():
    for eager_s in (0.010, 0.0101, 0.009):  # the same, within the 2% noise floor, slower
        flat = cost(first_call=1.0, eager_s=eager_s, compiled_s=0.010)
        assert not flat.pays_off and flat.break_even_calls == math.inf
        assert "never pays off" in repr(flat)


def test_compile_cost_times_the_first_call_and_rejects_one_that_compiled_nothing():
    torch.compiler.reset()
    x = torch.randn(64, 64)
    compiled = torch.compile(no_break, backend="eager")  # Dynamo only: quick, and no faster than eager
    with pytest.raises(ValueError, match="too few"):
        compile_cost(lambda: no_break(x), lambda: compiled(x), rounds=3)
    measured = compile_cost(lambda: no_break(x), lambda: compiled(x), rounds=7, warmup=1)
    assert measured.graphs == 1 and measured.first_call > 0
    assert measured.comparison.baseline.label == "eager" and len(measured.comparison.ratios) == 7
    with pytest.raises(ValueError, match="compiled nothing"):
        compile_cost(lambda: no_break(x), lambda: compiled(x), rounds=7)


# A module as Inductor writes it for a CPU (C++ kernels, a runner class whose `call` method runs them)
# and one as it writes it for a GPU (Triton kernels launched with .run, a module-level `call`).
CPU_MODULE = """
cpp_fused_add_gelu_0 = async_compile.cpp_pybinding(['const float*', 'float*'], r'''
#include <torch/csrc/inductor/cpp_prefix.h>
extern "C"  void  kernel(const float* in_ptr0, float* out_ptr0)
{
    out_ptr0[0] = in_ptr0[0] + 1;
}
''')


async_compile.wait(globals())
del async_compile

class Runner:
    def __init__(self, partitions):
        self.partitions = partitions

    def call(self, args):
        arg0_1, arg1_1 = args
        args.clear()
        assert_size_stride(arg0_1, (64, 256), (256, 1), 'input')
        buf0 = empty_strided_cpu((64, 1024), (1024, 1), torch.float32)
        extern_kernels.addmm(arg1_1, arg0_1, arg1_1, alpha=1, beta=1, out=buf0)
        buf1 = empty_strided_cpu((64, 1024), (1024, 1), torch.float32)
        cpp_fused_add_gelu_0(buf0, buf1)
        return (buf1, )

runner = Runner(partitions=[])
call = runner.call
"""

GPU_MODULE = """
triton_poi_fused_mul_0 = async_compile.triton('triton_poi_fused_mul_0', '''
import triton
import triton.language as tl

@triton.jit
def triton_poi_fused_mul_0(in_ptr0, out_ptr0, xnumel, XBLOCK : tl.constexpr):
    xindex = tl.program_id(0) * XBLOCK + tl.arange(0, XBLOCK)[:]
    tl.store(out_ptr0 + xindex, tl.load(in_ptr0 + xindex) * 2.0, None)
''', device_str='cuda')


async_compile.wait(globals())
del async_compile

def call(args):
    arg0_1, = args
    args.clear()
    assert_size_stride(arg0_1, (1024, ), (1, ))
    with torch.cuda._DeviceGuard(0):
        torch.cuda.set_device(0)
        buf0 = empty_strided_cuda((1024, ), (1, ), torch.float32)
        stream0 = get_raw_stream(0)
        triton_poi_fused_mul_0.run(arg0_1, buf0, 1024, grid=grid(1024), stream=stream0)
        del arg0_1
    return (buf0, )


def benchmark_compiled_module(times=10, repeat=10):
    fn = lambda: call([arg0_1])
"""


def test_generated_code_finds_the_kernels_and_what_each_module_runs():
    code = GeneratedCode(modules=(CPU_MODULE, GPU_MODULE), seconds=0.5)
    assert list(code.kernels) == ["cpp_fused_add_gelu_0", "triton_poi_fused_mul_0"]
    assert code.kernels["cpp_fused_add_gelu_0"].lstrip().startswith("#include")
    assert "@triton.jit" in code.kernels["triton_poi_fused_mul_0"]
    assert code.launches == [["extern_kernels.addmm", "cpp_fused_add_gelu_0"], ["triton_poi_fused_mul_0"]]
    text = repr(code)
    assert text.splitlines()[-1] == "2 modules written in 500 ms; 2 generated kernels"
    assert "module 2  triton_poi_fused_mul_0" in text


def test_break_even_chart_draws_one_panel_per_cost():
    figure = break_even_chart({"fused": cost(2.01, 0.03, 0.01), "matmul": cost(1.0, 0.01, 0.01)}, caption="test run")
    paying, flat = figure.axes
    assert len(paying.lines) == 3 and paying.lines[2].get_xdata()[0] == 100  # eager, compiled, break-even
    assert len(flat.lines) == 2 and any("never breaks even" in text.get_text() for text in flat.texts)
    assert "total time (s)" in paying.get_ylabel() and paying.get_title() == "fused"
    assert any(text.get_text() == "test run" for text in figure.texts)


# A module as Inductor writes it when it falls back to eager's kernels (mode="lite" does for every operator).
FALLBACK_MODULE = """
class Runner:
    def call(self, args):
        arg0_1, arg1_1 = args
        args.clear()
        buf0 = torch.ops.aten.mul.Tensor(arg0_1, arg1_1)
        assert_tensor_metadata(buf0, (8, 256), (256, 1), torch.float32, 'torch.ops.aten.mul.Tensor')
        buf1 = torch.ops.aten.gelu.default(buf0)
        del buf0
        torch.ops.aten._foreach_add_.Scalar([buf1], 1)
        return (buf1, )

runner = Runner(partitions=[])
call = runner.call
"""


def test_generated_code_lists_fallbacks_to_eager_kernels_in_order():
    code = GeneratedCode(modules=(FALLBACK_MODULE, CPU_MODULE), seconds=0.5)
    assert code.launches == [
        ["aten.mul.Tensor", "aten.gelu.default", "aten._foreach_add_.Scalar"],
        ["extern_kernels.addmm", "cpp_fused_add_gelu_0"],
    ]
    assert code.fallbacks == 3
    assert (
        repr(code).splitlines()[-1] == "2 modules written in 500 ms; 1 generated kernel, 3 fallbacks to eager kernels"
    )
    assert GeneratedCode(modules=(CPU_MODULE,), seconds=0.5).fallbacks == 0
