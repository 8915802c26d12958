"""Grading that no learner code can influence: measured points are decided outside the learner's kernel.

    # nbgrader_config.py (the course's own does this)
    c.Autograde.autograde_preprocessors = perflab.grading.nbgrader.AUTOGRADE_PREPROCESSORS
    # a hidden test cell of a measured criterion only hands the answer over, as data
    hand_in(final_config=final_config)

During ``nbgrader autograde``, each submission's kernel runs in a sandbox
(:mod:`perflab.grading.sandbox`). Then, in the instructor's nbgrader process and before the
scores are saved, :class:`perflab.grading.nbgrader.TrustedMeasurement` re-measures every cell in
``DECIDED_OUTSIDE`` in fresh processes started from a pristine copy of perflab, on the course's
own workload, and writes the verdict and the measurement into that cell's output: the cell
scores its points only if the grader measured a pass. What the kernel did in that cell, or
anywhere else, only ever reaches the grader as data: configurations handed in
(:mod:`perflab.grading.answers`) or the source of the learner's answer cells, run in a sandboxed
child that the grader times from outside (:mod:`perflab.grading.child`).

Used in: lab 12.
"""

from perflab.grading.answers import hand_in

# The graded cells whose points depend on a measured speed, share of the compute ceiling or ratio: their gradings
# need a machine to themselves (perflab.grading.whole_class).
MEASURED_CELLS = {
    "lab02_profiling": ("test_preprocess_speed",),
    "lab03_data_loading": ("test_ceiling",),
    "lab06_compile": ("test_compiled_speed",),
    "lab12_capstone": ("test_data", "test_batch", "test_amp", "test_ckpt", "test_regrade"),
}
# The graded cells decided outside the kernel on results, with no wall clock (lab 10's backward compares its own CPU
# time, causal against not, far from the bound): any machine may grade them, beside other gradings. Lab 10's kernel
# cannot be checked inside a kernel whose Python the learner controls, nor lab 11's layers, whose communication and
# memory are read from outside the ranks the grader starts.
CHECKED_CELLS = {
    "lab10_flash_triton": (
        "test_forward",
        "test_lse",
        "test_causal_skip",
        "test_forward_bf16",
        "test_backward",
        "test_backward_memory",
        "test_backward_skip",
    ),
    "lab11_megatron": ("test_f_g", "test_layers", "test_mlp", "test_communication", "test_memory"),
}
# Every graded cell whose output the trusted grader's verdict replaces.
DECIDED_OUTSIDE = {**MEASURED_CELLS, **CHECKED_CELLS}

__all__ = ["CHECKED_CELLS", "DECIDED_OUTSIDE", "MEASURED_CELLS", "hand_in"]
