"""perflab: the shared library of the perflab course on PyTorch performance engineering.

    >>> import perflab
    >>> device = perflab.pick_device()
    >>> perflab.benchmark(lambda: model(batch), device=device)
    >>> perflab.doctor()

Instruments live in small modules, one concept each: ``device``, ``bench``, ``doctor``,
``profile``, ``diagnose``, ``planted``, ``memory``, ``memory_budget``, ``tradeoff``, ``floats``,
``amp``, ``checkpoint``, ``compiling``, ``distributed``, ``attention``; the course's workloads in
``data``, ``models``, ``pipeline`` and ``train``; the input pipeline's instruments in ``ceiling``,
``prefetch`` and ``allocator``; pictures in ``plots`` and ``report``; explorers in ``widgets``; the
capstone's benchmark and grader in ``capstone``; grading outside the learner's kernel in ``grading``. The most used
instruments are re-exported here; import the rest from their modules
(``from perflab.train import train, NAIVE``).
"""

from perflab.bench import Comparison, Timing, benchmark, compare
from perflab.device import count_syncs, pick_device, synchronize
from perflab.doctor import doctor

__version__ = "0.1.0"
__all__ = ["Comparison", "Timing", "benchmark", "compare", "count_syncs", "doctor", "pick_device", "synchronize"]
