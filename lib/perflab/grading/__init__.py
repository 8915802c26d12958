"""Grading that no learner code can influence: every autograded point is decided outside the learner's kernel.

    # nbgrader_config.py (the course's own does this)
    c.Autograde.autograde_preprocessors = perflab.grading.nbgrader.AUTOGRADE_PREPROCESSORS
    # a graded cell of a measured criterion only hands the answer over, as data
    hand_in(final_config=final_config)

During ``nbgrader autograde``, each submission's kernel runs in a sandbox
(:mod:`perflab.grading.sandbox`). Then, in the instructor's nbgrader process and before the
scores are saved, :class:`perflab.grading.nbgrader.TrustedMeasurement` decides every cell in
``DECIDED_OUTSIDE`` (every graded cell of every lab) in fresh processes started from a pristine
copy of perflab, and writes the verdict into that cell's output: the cell scores its points only
if the grader found a pass. What the kernel did in that cell, or anywhere else, only ever reaches
the grader as data: configurations handed in (:mod:`perflab.grading.answers`), or the source of
the learner's answer cells, run again in a sandboxed child (:mod:`perflab.grading.child`) that the
grader times from outside or whose results it checks (:mod:`perflab.grading.checked`).

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
# The graded cells decided outside the kernel on results, with no wall clock that decides (lab 10's backward compares its
# own CPU time, causal against not, far from the bound): any machine may grade them, beside other gradings. Labs 10
# and 11 have graders of their own (a Triton kernel checked under the interpreter, layers on ranks the grader starts);
# every other lab's are the checks of its module in perflab.grading.checks, run by perflab.grading.checked.
CHECKED_CELLS = {
    "lab01_timing": ("test_time_it", "test_summarize", "test_hidden_syncs", "test_train_fixed"),
    "lab02_profiling": ("test_slowest_function", "test_slowest_lines", "test_phase_syncs_kind", "test_preprocess_fast"),
    "lab03_data_loading": ("test_decode_once", "test_batch_crop_flip", "test_fast_epoch", "test_seed_worker"),
    "lab04_amp": ("test_choose_precision", "test_amp_step", "test_overflow", "test_clipping"),
    "lab05_memory": ("test_forward_checkpointing", "test_accumulate_gradients", "test_train", "test_choose_plan"),
    "lab06_compile": ("test_graph_break_lines", "test_fixed_block", "test_compiled_step"),
    "lab07_ddp": ("test_equivalence", "test_sampling", "test_no_sync", "test_rank0"),
    "lab08_attention": ("test_streaming_row", "test_noncausal", "test_causal", "test_memory"),
    "lab09_sharding": ("test_equivalence", "test_sharded_state", "test_uneven"),
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
    "lab12_capstone": ("test_bottleneck", "test_break_even", "test_final", "test_flops_per_sample"),
}
# Every graded cell whose output the trusted grader's verdict replaces: every autograded point of the course.
DECIDED_OUTSIDE = {
    lab: MEASURED_CELLS.get(lab, ()) + CHECKED_CELLS.get(lab, ()) for lab in sorted({*MEASURED_CELLS, *CHECKED_CELLS})
}

__all__ = ["CHECKED_CELLS", "DECIDED_OUTSIDE", "MEASURED_CELLS", "hand_in"]
