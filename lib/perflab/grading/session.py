"""The trusted grading process: a job per line in (one notebook's cells decided outside the kernel), a line of verdicts
out per job (JSON), until its input ends.

    $ python -I -S -c '...' perflab.grading.session < jobs.jsonl     # started by perflab.grading.trusted_process

A job names the lab and holds the course's cells (from the instructor's source notebook), the
learner's answer cells (as nbgrader stored them) and the answers the hidden test cells handed
in. Progress goes to stderr as ``grader: ...`` lines, and so does anything else written to the
standard output: the verdicts have the original one to themselves. A job that raises ends the
process (its traceback on stderr). After each job, what the course's cells may have changed of the process is put
back as it was before the first (``_FreshState``). On a machine lent to the grading
(:mod:`perflab.grading.machine_lock`) it holds a share of the machine's lock while it grades a job,
and has the machine alone while it times answers (``LoadMeter``).

Used by perflab.grading.trusted_process, which starts it for TrustedMeasurement.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import json
import os
import sys
import warnings

from perflab.grading import MEASURED_CELLS
from perflab.grading.answers import AnswerError
from perflab.grading.machine_lock import lent_machine
from perflab.grading.verdict import Verdict

__all__ = ["main"]


def _measured(job: dict, log) -> dict[str, Verdict]:
    """The verdicts of the lab's own grader: the measured cells, and every cell of labs 10 and 11."""
    lab = job["lab"]
    if lab == "lab12_capstone":
        from perflab.device import pick_device
        from perflab.grading.capstone_lab import grade_capstone_lab

        handed = {
            cell: AnswerError(answers["error"]) if "error" in answers else answers
            for cell, answers in job["handed_in"].items()
            if cell in MEASURED_CELLS[lab]
        }
        return grade_capstone_lab(handed, device=pick_device(), log=log, cache_dir=job.get("cache_dir"))
    if lab == "lab02_profiling":
        from perflab.grading.code_labs import grade_lab02 as grade_lab
    elif lab == "lab03_data_loading":
        from perflab.grading.data_lab import grade_lab03 as grade_lab
    elif lab == "lab06_compile":
        from perflab.grading.code_labs import grade_lab06 as grade_lab
    elif lab == "lab10_flash_triton":
        from perflab.grading.triton_lab import grade_lab10 as grade_lab
    elif lab == "lab11_megatron":
        from perflab.grading.megatron_lab import grade_lab11 as grade_lab
    else:
        return {}
    return grade_lab(job["cells"])


def _grade_job(job: dict, log) -> dict[str, Verdict]:
    """Every verdict of the job's lab: its check module's (:mod:`perflab.grading.checked`), then its own grader's."""
    from perflab.grading.checked import check_module, grade_checked_lab

    lab, asked = job["lab"], set(job["handed_in"])  # the cells whose verdicts were not found in the cache
    module = check_module(lab)
    checked = set(module.CHECKS) if module else set()
    verdicts = grade_checked_lab(lab, job["cells"], log=log) if asked & checked else {}
    if asked - checked:
        verdicts.update(_measured(job, log))
    if not verdicts:
        raise ValueError(f"no criteria decided outside the kernel for {lab!r}")
    return verdicts


class _FreshState:
    """What a job may change of this process, kept as it was before the first job and put back after each: the modules
    imported from outside the ``trusted`` folders (a lab's ``problem.py`` in a job's working folder) are dropped; the
    folder, import path, environment variables and warning filters, and torch's threads, random states, grad mode,
    default dtype, float32 matmul precision and compilation caches are restored. What torch and perflab loaded stays
    loaded. A job's other changes (a replaced attribute of a module kept, a module made in memory, a thread left
    running) would stay: the course's cells make none of them."""

    def __init__(self):
        import torch  # every job's lab needs it: loaded once, before the first job

        self.trusted = tuple(os.path.realpath(folder) + os.sep for folder in sys.path if folder)
        self.modules, self.folder, self.path = set(sys.modules), os.getcwd(), list(sys.path)
        self.environ, self.warnings = dict(os.environ), list(warnings.filters)
        self.threads, self.rng, self.grad = (
            torch.get_num_threads(),
            torch.random.get_rng_state(),
            torch.is_grad_enabled(),
        )
        self.dtype, self.precision = torch.get_default_dtype(), torch.get_float32_matmul_precision()
        self.seed = torch.initial_seed()

    def _from_a_job(self, module) -> bool:
        """Whether a module imported during a job was loaded from outside the trusted folders (a file, or a namespace
        package's folders); one made in memory (torch makes some) is kept, as a fresh import would not make it again."""
        places = [module.__file__] if getattr(module, "__file__", None) else list(getattr(module, "__path__", []) or [])
        return any(not os.path.realpath(place).startswith(self.trusted) for place in places)

    def restore(self) -> None:
        import torch

        for name in set(sys.modules) - self.modules:
            if self._from_a_job(sys.modules[name]):
                del sys.modules[name]
        importlib.invalidate_caches()
        os.chdir(self.folder)
        sys.path[:] = self.path
        for name in set(os.environ) - set(self.environ):
            del os.environ[name]
        for name, value in self.environ.items():
            if os.environ.get(name) != value:
                os.environ[name] = value
        warnings.filters[:] = self.warnings
        torch.set_num_threads(self.threads)
        torch.random.set_rng_state(self.rng)
        torch.set_grad_enabled(self.grad)
        torch.set_default_dtype(self.dtype)
        torch.set_float32_matmul_precision(self.precision)
        if "torch._dynamo" in sys.modules:  # a learner's compiled configuration must not find another's recompilations
            torch._dynamo.reset()
        if torch.cuda.is_initialized():
            torch.cuda.manual_seed_all(self.seed)
            torch.cuda.empty_cache()
        gc.collect()


def main() -> None:
    verdicts_out = os.fdopen(os.dup(sys.stdout.fileno()), "w")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # whatever else writes to the standard output: to stderr
    fresh = _FreshState()
    for line in sys.stdin:
        job = json.loads(line)
        with lent_machine().shared() if lent_machine() else contextlib.nullcontext():
            verdicts = _grade_job(job, log=lambda text: print(f"grader: {text}", file=sys.stderr, flush=True))
        verdicts_out.write(json.dumps({cell: verdict.to_dict() for cell, verdict in verdicts.items()}) + "\n")
        verdicts_out.flush()
        fresh.restore()


if __name__ == "__main__":
    main()
