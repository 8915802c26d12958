"""Lab 11 (Megatron by hand), decided outside the learner's kernel: its layers run on ranks the course starts.

    grade_lab11(cells)   # cells: {"course": {grade_id: source}, "learner": {grade_id: source}}
    # {'test_f_g': Verdict(pass: ...), ..., 'test_memory': Verdict(pass: ...)}

The grader starts 4 rank processes once, in one sandbox (:mod:`perflab.grading.rank_group`), which
run the lab's ``problem`` cell. Ranks 0 and 1 form a world of 2 and run one pass of course code at the
size of the MLP whose memory is read (what a first pass starts once in a process: gloo's buffers,
autograd's); the grader reads each rank's resident memory, and only then do the ranks run the
learner's answer cell (``megatron``, its ``%%writefile`` line dropped). In that world, then in a world
of all 4, the checks of :mod:`perflab.grading.megatron_lab_checks` run, on inputs and weights drawn
here: the MLP's traffic, f and g, each layer alone, the MLP forward and backward and a few SGD steps
of a replicated layer followed by the MLP. Each rank's layers are handed that rank's block of each
whole weight and nothing else (the lab's ``RankBlock``, which raises when asked for more): no rank
can make another's block, so a right output proves that what it needed of theirs travelled. Course
code in the ranks sends the results back as bytes; here they are compared with one process running
the full layers (``reference_mlp``): outputs, input gradients, the block of the full weight each rank
holds and its gradient, the weights after the steps. What the ranks send is read from outside them,
through the sandbox's own loopback and each rank's written bytes: each layer alone sends at most its
one all-reduce each way (f in the column-parallel layer's backward, g in the row-parallel layer's
forward), and the MLP of ``TRAFFIC[world]`` one all-reduce of its output in one forward and one in
one backward. On 2 ranks, each rank's peak resident memory, from before the answer's module ran to
after that backward, is held to its blocks: a module that touched memory when it was imported has it
counted, and nothing the answer does can lower what its use is measured from.

    >>> ring_all_reduce_bytes(payload=1000, world=4)     # (each rank, all ranks): each sends 2 (N-1)/N of it
    (1500, 6000)

Nothing here is timed: a lab 11 grading needs no quiet machine. The lab's own checks take their sizes
and bounds from here (``TRAFFIC``, ``SENT_BOUNDS``, ``memory_limit``, from
:mod:`perflab.grading.megatron_lab_bounds`), so that both say the same.

Used in: lab 11.
"""

from __future__ import annotations

import os

from perflab.grading.child import ChildError
from perflab.grading.code_labs import run_cells
from perflab.grading.megatron_lab_bounds import SENT_BOUNDS, SENT_SLACK, TRAFFIC, memory_limit, ring_all_reduce_bytes
from perflab.grading.megatron_lab_checks import CELLS, Findings, check_f_g, check_layers, check_mlp, check_traffic
from perflab.grading.rank_group import RankGroup
from perflab.grading.verdict import Verdict

__all__ = [
    "CELLS",
    "SENT_BOUNDS",
    "SENT_SLACK",
    "TRAFFIC",
    "WORLDS",
    "answer_source",
    "grade_lab11",
    "memory_limit",
    "ring_all_reduce_bytes",
]

WORLDS = (2, 4)  # the world sizes, formed in turn by the same 4 processes
HANDLERS = "perflab.grading.megatron_lab_ranks"
REQUEST_TIMEOUT_S = 60  # far beyond a request's fraction of a second: a rank that takes this long hangs
_RANK_SETUP = """
import sys
import types

import torch

torch.set_num_threads(1)
problem = types.ModuleType("problem")  # what a learner's `import problem` finds, as in the notebook
exec(compile({source!r}, "problem.py", "exec"), problem.__dict__)
sys.modules["problem"] = problem
LayerInit = problem.LayerInit
"""


def answer_source(cell: str) -> str:
    """A cell as the Python it writes: its ``%%writefile`` line dropped.

    >>> answer_source("%%writefile {work / 'megatron.py'}\\nimport torch")
    'import torch'
    """
    lines = cell.splitlines()
    return "\n".join(lines[1:] if lines and lines[0].startswith("%%writefile") else lines)


# Each check, and the cells it decides: a check that fails on the ranks fails its cells. The MLP's traffic comes first,
# so that on 2 ranks, where memory is read, nothing of the answer's but its import has run before it.
_CHECKS = (
    (check_traffic, ("test_communication", "test_memory")),
    (check_f_g, ("test_f_g",)),
    (check_layers, ("test_layers",)),
    (check_mlp, ("test_mlp",)),
)


def _join(group: RankGroup, world: int, count: int) -> None:
    """Ranks 0 to world-1 form world number ``count``, its rendezvous file in the grading's own folder: unsandboxed,
    /tmp is the machine's, where another grading's file of the same name would join these ranks to a world that is
    gone."""
    group.call("lab11_world", world, store=os.path.join(group.workdir, f"world-{count}"))


def grade_lab11(cells: dict) -> dict[str, Verdict]:
    """Every graded cell of lab 11 (see the module's docstring)."""
    if "megatron" not in cells["learner"]:
        return dict.fromkeys(CELLS, Verdict.refused("the answer cell megatron is missing from the notebook"))
    problem = answer_source(cells["course"]["problem"])
    reference = run_cells({"problem": problem}, ["problem"])
    setup = [("rank_setup", _RANK_SETUP.format(source=problem))]
    group = RankGroup(max(WORLDS), setup, handlers=HANDLERS, timeout_s=REQUEST_TIMEOUT_S)  # the course's code only
    findings, worlds = Findings(), 1
    try:
        # The first world formed and one pass of course code at the measured MLP's size (what a first pass starts once
        # in a process), then each rank's memory read, and only then the answer run: nothing it does from its import
        # on can lower what its use is measured from.
        _join(group, WORLDS[0], worlds)
        tokens, hidden, ffn = TRAFFIC[WORLDS[0]]
        group.call("lab11_warm_up", WORLDS[0], tokens=tokens, hidden=hidden, ffn=ffn)
        group.reset_peaks()
        findings.resident_before_answer = group.resident()
        try:
            group.call("lab11_answer", group.size, source=answer_source(cells["learner"]["megatron"]))
        except ChildError as error:  # the cell raised, ended its process or never finished: the answer's doing
            return dict.fromkeys(CELLS, Verdict.refused(f"your cell, run on the ranks: {error}"))
        joined = True
        for world in WORLDS:
            for check, decides in _CHECKS:
                try:
                    if not joined:
                        worlds += 1
                        _join(group, world, worlds)
                        joined = True
                    check(group, world, reference, findings)
                except ChildError as error:  # a rank that raised, ended or hung: the answer's doing
                    for cell in decides:
                        findings.failures[cell].append(f"on {world} ranks: {error}")
                    joined = False  # ranks may still wait in a collective of that world: the next check forms another
            joined = False
    finally:
        group.close()
    return findings.verdicts()
