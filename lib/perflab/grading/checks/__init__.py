"""One module per lab whose graded cells :mod:`perflab.grading.checked` decides: its cells and its checks.

    >>> from perflab.grading.checks import CHECK_MODULES
    >>> sorted(CHECK_MODULES["lab01_timing"].CHECKS)
    ['test_hidden_syncs', 'test_summarize', 'test_time_it', 'test_train_fixed']

Each module holds ``CELLS`` (the cells a child runs, in the notebook's order), ``ANSWERS`` (those
of them that are the learner's) and ``CHECKS`` (grade_id -> :class:`perflab.grading.checked.Check`).
A lab module too long to read at once keeps parts in modules named after it, which hold no cells or
checks of their own and are not in ``CHECK_MODULES`` (``lab05_memory_train``, ``lab08_attention_rules``,
``lab08_attention_memory``).
Labs 10 and 11 have graders of their own (:mod:`perflab.grading.triton_lab`,
:mod:`perflab.grading.megatron_lab`).

Used by perflab.grading.checked.
"""

from perflab.grading.checks import (
    lab01_timing,
    lab02_profiling,
    lab03_data_loading,
    lab04_amp,
    lab05_memory,
    lab06_compile,
    lab07_ddp,
    lab08_attention,
    lab09_sharding,
    lab12_capstone,
)

__all__ = ["CHECK_MODULES"]

CHECK_MODULES = {
    module.__name__.rsplit(".", 1)[1]: module
    for module in (
        lab01_timing,
        lab02_profiling,
        lab03_data_loading,
        lab04_amp,
        lab05_memory,
        lab06_compile,
        lab07_ddp,
        lab08_attention,
        lab09_sharding,
        lab12_capstone,
    )
}
