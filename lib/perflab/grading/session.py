"""The trusted grading process: one notebook's measured cells in, one verdict per cell out (JSON).

    $ python -I -S -c '...' perflab.grading.session < job.json     # started by TrustedMeasurement

The job names the lab and holds the course's cells (from the instructor's source notebook), the
learner's answer cells (as nbgrader stored them) and the answers the hidden test cells handed
in. Progress goes to stderr as ``grader: ...`` lines; the verdicts are the last line of stdout. On a
machine lent to the grading (:mod:`perflab.grading.machine_lock`) it holds a share of the machine's
lock while it runs, and has the machine alone while it times answers (``LoadMeter``).

Used by perflab.grading.nbgrader, which starts it as the trusted grading process.
"""

from __future__ import annotations

import contextlib
import json
import sys

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


def main() -> None:
    job = json.loads(sys.stdin.read())
    with lent_machine().shared() if lent_machine() else contextlib.nullcontext():
        verdicts = _grade_job(job, log=lambda line: print(f"grader: {line}", file=sys.stderr, flush=True))
    print(json.dumps({cell: verdict.to_dict() for cell, verdict in verdicts.items()}))


if __name__ == "__main__":
    main()
