"""What this machine can do for PyTorch, measured rather than assumed.

    >>> import torch
    >>> from perflab.doctor import doctor
    >>> report = doctor()        # a few seconds: it times matmuls, tries each kernel, compiles a function
    >>> report                   # in a notebook, a table; in a terminal: python -m perflab doctor
    section      check                             result
    machine      device                            ...
    versions     torch                             ...
    versions     torch the course supports         >=2.11,<2.16: ...
    precision    matmul 512x512 fp32               ...
    attention    SDPA math                         works
    compile      C++ compiler                      ...
    compile      Triton kernels                    ...
    distributed  gloo                              ...
    >>> report["torch"] == torch.__version__, report["SDPA math"]
    (True, 'works')

Support is not speed: a CPU "supports" bf16 and still runs it slower than fp32 when it has no
bf16 units, so the report times a matmul in each dtype rather than reading a feature flag.

Used in: lecture 01 (gpu basics), lecture 04 (mixed precision).
"""

from __future__ import annotations

import os
import platform
import shutil
import time
from dataclasses import dataclass

import torch

from perflab.bench import benchmark, format_seconds
from perflab.cpu_quota import usable_cores
from perflab.device import device_name, pick_device
from perflab.render import Table
from perflab.torch_features import FEATURES, SUPPORTED, TESTED, in_supported_range

__all__ = [
    "Check",
    "DoctorReport",
    "compile_checks",
    "distributed_checks",
    "doctor",
    "dtype_speed_checks",
    "feature_checks",
    "machine_checks",
    "sdpa_checks",
    "triton_checks",
    "version_checks",
]


@dataclass(frozen=True)
class Check:
    section: str
    name: str
    result: str


@dataclass(frozen=True)
class DoctorReport:
    checks: tuple[Check, ...]

    def __getitem__(self, name: str) -> str:
        for check in self.checks:
            if check.name == name:
                return check.result
        raise KeyError(name)

    def _table(self) -> Table:
        return Table(("section", "check", "result"), [(c.section, c.name, c.result) for c in self.checks])

    def __repr__(self) -> str:
        return str(self._table())

    def _repr_html_(self) -> str:
        return self._table()._repr_html_()


def _short(error: BaseException) -> str:
    first_line = str(error).strip().splitlines()[0] if str(error).strip() else ""
    return f"{type(error).__name__}: {first_line[:100]}"


def _host_memory_gib() -> float | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError, AttributeError):
        return None


def machine_checks(device: torch.device) -> list[Check]:
    memory = _host_memory_gib()
    checks = [
        Check("machine", "device", str(device)),
        Check("machine", "CPU", f"{device_name('cpu')} ({torch.backends.cpu.get_cpu_capability()})"),
        Check("machine", "CPU cores usable / torch threads", f"{usable_cores()} / {torch.get_num_threads()}"),
        Check("machine", "host memory", f"{memory:.1f} GiB" if memory else "unknown"),
    ]
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        checks += [
            Check("machine", "GPU", f"{props.name} (compute capability {props.major}.{props.minor})"),
            Check("machine", "GPU memory", f"{props.total_memory / 2**30:.1f} GiB"),
        ]
    return checks


def version_checks() -> list[Check]:
    cuda_build = torch.version.cuda or "none (CPU-only build)"
    return [
        Check("versions", "python", platform.python_version()),
        Check("versions", "torch", torch.__version__),
        Check("versions", "torch the course supports", _range_verdict()),
        Check("versions", "CUDA (torch built with)", cuda_build),
        Check("versions", "cuDNN", str(torch.backends.cudnn.version()) if torch.cuda.is_available() else "n/a"),
    ]


def _range_verdict() -> str:
    tested = f"tested on {', '.join(TESTED)}"
    if in_supported_range():
        return f"{SUPPORTED}: yours is in it ({tested})"
    return f"{SUPPORTED}: yours is OUTSIDE it, so cells may fail ({tested})"


def feature_checks() -> list[Check]:
    """One row per API the course uses beyond the oldest supported torch that this torch lacks: the cells it affects."""
    return [
        Check("versions", f"from torch {feature.since}", f"{feature.api}: {feature.used_in}; here {feature.without}")
        for feature in FEATURES
        if not feature.available
    ] or [Check("versions", "newer torch APIs", f"all {len(FEATURES)} the course uses are here")]


def dtype_speed_checks(device: torch.device, size: int = 512) -> list[Check]:
    """Time a square matmul in fp32, bf16 and fp16 and report each low precision's speed vs fp32."""
    timings = {}
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        try:
            a = torch.randn(size, size, device=device, dtype=dtype)
            timings[dtype] = benchmark(lambda a=a: a @ a, device=device, samples=5, warmup=1, min_sample_s=0.01)
        except RuntimeError as error:
            timings[dtype] = error
    fp32 = timings[torch.float32]
    checks = [Check("precision", f"matmul {size}x{size} fp32", f"{format_seconds(fp32.median)}")]
    for dtype, name in ((torch.bfloat16, "bf16"), (torch.float16, "fp16")):
        timing = timings[dtype]
        if isinstance(timing, RuntimeError):
            checks.append(Check("precision", f"matmul {size}x{size} {name}", f"unsupported ({_short(timing)})"))
            continue
        ratio = fp32.median / timing.median
        verdict = "faster" if ratio > 1.1 else "slower" if ratio < 0.9 else "no faster"
        checks.append(
            Check(
                "precision",
                f"matmul {size}x{size} {name}",
                f"{format_seconds(timing.median)}: {ratio:.2f}x fp32's speed, {verdict}",
            )
        )
    if device.type == "cuda":
        major, _ = torch.cuda.get_device_capability(device)
        tf32 = "available" if major >= 8 else "not on this GPU (needs compute capability 8.0+)"
        checks.append(
            Check(
                "precision", "TF32 tensor cores", f"{tf32}; matmul precision '{torch.get_float32_matmul_precision()}'"
            )
        )
    else:
        checks.append(Check("precision", "TF32 tensor cores", "n/a (an NVIDIA Ampere-or-newer feature)"))
    return checks


def sdpa_checks(device: torch.device) -> list[Check]:
    """Which scaled_dot_product_attention kernels actually run here, on a tiny causal input."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    dtype = torch.float16 if device.type == "cuda" else torch.float32
    q = torch.randn(1, 2, 64, 32, device=device, dtype=dtype)
    checks = []
    for backend in (
        SDPBackend.FLASH_ATTENTION,
        SDPBackend.EFFICIENT_ATTENTION,
        SDPBackend.CUDNN_ATTENTION,
        SDPBackend.MATH,
    ):
        try:
            with sdpa_kernel(backend):
                torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
            result = "works"
        except RuntimeError as error:
            result = f"not here ({_short(error)})"
        checks.append(Check("attention", f"SDPA {backend.name.lower()}", result))
    return checks


def compile_checks(device: torch.device) -> list[Check]:
    """Find a C++ compiler (Inductor's CPU backend needs one) and compile a tiny function."""
    compiler = next((path for name in ("g++", "c++", "clang++") if (path := shutil.which(name))), None)
    checks = [Check("compile", "C++ compiler", compiler or "none found: torch.compile cannot build CPU kernels")]
    x = torch.randn(64, device=device)
    try:
        torch._dynamo.reset()
        compiled = torch.compile(lambda t: torch.nn.functional.gelu(t) * 2 + 1)
        start = time.perf_counter()
        compiled(x)
        result = f"works (first call compiled in {time.perf_counter() - start:.1f} s)"
    except Exception as error:  # any backend failure means "does not work here", which is the answer
        result = f"fails ({_short(error)})"
    finally:
        torch._dynamo.reset()
    checks.append(Check("compile", "torch.compile", result))
    return checks


def triton_checks() -> list[Check]:
    """Whether the Triton chapter's kernels run compiled (a GPU), interpreted (TRITON_INTERPRET=1) or not at all."""
    from perflab.triton_runtime import course_triton_mode

    mode = course_triton_mode()
    return [Check("compile", "Triton kernels", f"{mode.mode}: {mode.reason}")]


def distributed_checks() -> list[Check]:
    """Run a one-process all_reduce in each backend that this build has."""
    import torch.distributed as dist

    if not dist.is_available():
        return [Check("distributed", "torch.distributed", "not in this build")]
    checks = []
    for backend, built in (
        ("gloo", dist.is_gloo_available()),
        ("nccl", dist.is_nccl_available()),
        ("mpi", dist.is_mpi_available()),
    ):
        if not built:
            checks.append(Check("distributed", backend, "not in this build"))
        elif backend == "nccl" and not torch.cuda.is_available():
            checks.append(Check("distributed", backend, "built, but needs a CUDA device"))
        elif dist.is_initialized():
            checks.append(Check("distributed", backend, "built (not tried: a process group is already running)"))
        else:
            checks.append(Check("distributed", backend, _try_all_reduce(dist, backend)))
    return checks


def _try_all_reduce(dist, backend: str) -> str:
    device = "cuda" if backend == "nccl" else "cpu"
    try:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
        tensor = torch.ones(4, device=device)
        dist.all_reduce(tensor)
        return "works (1-process all_reduce)"
    except Exception as error:  # same reasoning as compile_checks
        return f"fails ({_short(error)})"
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def doctor(device: str | torch.device | None = None) -> DoctorReport:
    """Measure and report what this machine can do; takes a few seconds (compiling dominates)."""
    device = pick_device(device)
    checks = (
        machine_checks(device)
        + version_checks()
        + feature_checks()
        + dtype_speed_checks(device)
        + sdpa_checks(device)
        + compile_checks(device)
        + triton_checks()
        + distributed_checks()
    )
    return DoctorReport(tuple(checks))
