"""Lab 11 (Megatron by hand), decided outside the learner's kernel: its layers run on ranks the course starts.

    grade_lab11(cells)   # cells: {"course": {grade_id: source}, "learner": {grade_id: source}}
    # {'test_f_g': Verdict(pass: ...), ..., 'test_memory': Verdict(pass: ...)}

The learner's answer cell (``megatron``, its ``%%writefile`` line dropped) runs after the lab's
``problem`` cell in each of 4 rank processes that the grader starts once, in one sandbox
(:mod:`perflab.grading.rank_group`). Ranks 0 and 1 form a world of 2, then all 4 a world of 4,
and in each, on inputs and weights drawn from seeds chosen here, they run f and g, each layer
alone, the MLP forward and backward, and a few SGD steps of a replicated layer followed by the MLP.
Course code in the ranks sends the results back as bytes; here they are compared with one process
running the full layers (``reference_mlp``): outputs, input gradients, the block of the full
weight each rank holds and its gradient, the weights after the steps. Two checks are read from
outside the ranks, while the MLP of ``TRAFFIC[world]`` runs one forward and one backward request:
the bytes sent through the sandbox's own loopback and those each rank wrote, against one ring
all-reduce of the MLP's output in each (Megatron's g forward, f backward), and, on 2 ranks, each
rank's peak resident memory from before it builds the MLP to after the backward, against its shards.

    >>> ring_all_reduce_bytes(payload=1000, world=4)     # (each rank, all ranks): each sends 2 (N-1)/N of it
    (1500, 6000)

Nothing here is timed: a lab 11 grading needs no quiet machine. The lab's own checks take their sizes
and bounds from here (``TRAFFIC``, ``SENT_BOUNDS``, ``memory_limit``), so that both say the same.

Used in: lab 11.
"""

from __future__ import annotations

import os

import torch

from perflab.grading.child import ChildError
from perflab.grading.code_labs import grader_seeds, run_cells
from perflab.grading.megatron_lab_ranks import LAYER_NAMES, SHARD_NAMES, STEPS, backward, train
from perflab.grading.rank_group import RankGroup
from perflab.grading.triton_lab_backward import tensors_as_bytes, tensors_from_bytes
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

CELLS = ("test_f_g", "test_layers", "test_mlp", "test_communication", "test_memory")
WORLDS = (2, 4)  # the world sizes, formed in turn by the same 4 processes
# (tokens, hidden, ffn) of the MLP whose traffic (and, on 2 ranks, memory) is read from outside: one all-reduce of
# its tokens x hidden float32 output is 256 KiB, and a whole hidden x ffn weight, 16 MiB, stands out in a rank's peak.
TRAFFIC = {2: (64, 1024, 4096), 4: (64, 1024, 512)}
F_G_SHAPE = (8, 16)
LAYERS = (6, (24, 32), (32, 24))  # tokens, (in, out) of the column-parallel layer, (in, out) of the row-parallel one
MLP = (8, 32, 64)  # tokens, hidden, ffn: every size divides by 4
# Bytes sent over the formula's: never fewer, and TCP's headers and acknowledgements add 1% to 7% on the loopback, a
# rank's prints a little to what it wrote; one all-reduce too many doubles them.
SENT_BOUNDS = (0.95, 1.25)
SENT_SLACK = 64 << 10
RTOL, ATOL = 1e-4, 1e-5  # float32 sums in another order: a few ulps apart; a missing all-reduce is off by O(1)
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


def ring_all_reduce_bytes(payload: int, world: int) -> tuple[int, int]:
    """Bytes one rank, and all ranks together, send in a ring all-reduce of ``payload`` bytes: a reduce-scatter and an
    all-gather, each rank sending (N-1)/N of the payload in each. The ring is gloo's algorithm when none is asked for
    (``gloo/allreduce.cc`` in github.com/pytorch/gloo), and torch's gloo process group asks for none."""
    each = 2 * (world - 1) * payload // world
    return each, each * world


def memory_limit(hidden: int, ffn: int, world: int) -> tuple[int, int]:
    """(the bytes of one rank's blocks of both layers of an MLP and their gradients, the most its peak may grow by
    while it builds the MLP and runs one forward and backward): the blocks, their gradients and 3/4 of one whole
    weight for the activations and the allocator, less than the whole weights kept for the backward would need.

    >>> [round(n / 2**20, 1) for n in memory_limit(1024, 4096, world=2)]     # MiB
    [32.0, 44.0]
    """
    blocks = 2 * (2 * hidden * ffn // world + ffn // world + hidden) * 4
    return blocks, blocks + 3 * hidden * ffn * 4 // 4


def answer_source(cell: str) -> str:
    """A cell as the Python it writes: its ``%%writefile`` line dropped.

    >>> answer_source("%%writefile {work / 'megatron.py'}\\nimport torch")
    'import torch'
    """
    lines = cell.splitlines()
    return "\n".join(lines[1:] if lines and lines[0].startswith("%%writefile") else lines)


class _Findings:
    """What the checks measured and what failed, cell by cell."""

    def __init__(self):
        self.notes = {cell: [] for cell in CELLS}
        self.failures = {cell: [] for cell in CELLS}

    def verdicts(self) -> dict[str, Verdict]:
        return {
            cell: Verdict.decide("; ".join([_DESCRIPTIONS[cell], *self.notes[cell]]), self.failures[cell][:4])
            for cell in CELLS
        }


_DESCRIPTIONS = {
    "test_f_g": "f and g on 2 and 4 ranks, on fresh tensors: outputs and input gradients",
    "test_layers": "ColumnParallelLinear and RowParallelLinear alone on 2 and 4 ranks, from fresh weights: each "
    "rank's block of the weight and bias, its outputs and gradients, against one process's whole layer",
    "test_mlp": f"TensorParallelMLP on 2 and 4 ranks: output, gradients, and weights after {STEPS} SGD steps of a "
    "replicated layer and the MLP, against one process",
    "test_communication": "bytes sent in one forward and one backward of the MLP, read from outside the ranks",
    "test_memory": "each rank's peak resident memory while it built the MLP and ran it, read from outside",
}


def _draw(*shapes) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(grader_seeds.randrange(2**31))
    return [torch.randn(*shape, generator=generator) for shape in shapes]


def _seeds(count: int) -> list[int]:
    return [grader_seeds.randrange(2**20) for _ in range(count)]


def _received(replies, expected: list[list[torch.Tensor]], names, world: int) -> list[list[torch.Tensor]]:
    """Each rank's tensors, once each has the shape of the one expected; ChildError naming the first that has not."""
    received = []
    for rank, ((shapes, payload), wanted) in enumerate(zip(replies, expected)):
        if not (type(shapes) is list and all(type(s) is list and all(type(n) is int for n in s) for s in shapes)):
            raise ChildError(f"rank {rank} of {world} sent shapes that are not lists of sizes: {str(shapes)[:200]}")
        for name, shape, want in zip(names, shapes, wanted):
            if tuple(shape) != tuple(want.shape):
                raise ChildError(f"rank {rank} of {world}: {name} has shape {tuple(shape)}, not {tuple(want.shape)}")
        received.append(tensors_from_bytes(payload, [tuple(want.shape) for want in wanted]))
    return received


def _compare(replies, expected: list[list[torch.Tensor]], names, world: int) -> list[str]:
    """What differs between each rank's tensors and one process's."""
    found = []
    for rank, (got_tensors, want_tensors) in enumerate(zip(_received(replies, expected, names, world), expected)):
        for name, got, want in zip(names, got_tensors, want_tensors):
            want = want.detach()
            if not torch.allclose(got, want, rtol=RTOL, atol=ATOL):
                gap = (got - want).abs().max().item()
                found.append(f"rank {rank} of {world}: {name} differs from one process's by up to {gap:.2e}")
    return found


def _check_f_g(group: RankGroup, world: int, reference: dict, findings: _Findings) -> None:
    tensors = [_draw(F_G_SHAPE, F_G_SHAPE, F_G_SHAPE) for _ in range(world)]
    replies = group.call("lab11_f_g", world, [tensors_as_bytes(t) for t in tensors], shape=list(F_G_SHAPE))
    total_x, total_grad_f = sum(t[0] for t in tensors), sum(t[1] for t in tensors)
    expected = [[x, total_grad_f, total_x, grad_g] for x, _, grad_g in tensors]
    names = ["f(x)", "f's input gradient", "g(x)", "g's input gradient"]
    findings.failures["test_f_g"] += _compare(replies, expected, names, world)


def _whole_layer(reference: dict, seed: int, features_in: int, features_out: int, x, dy) -> list[torch.Tensor]:
    layer = reference["LayerInit"](seed, features_in, features_out).full_linear()
    x = x.clone().requires_grad_()
    output = layer(x)
    backward(output, dy)
    return [layer.weight, layer.bias, output, x.grad, layer.weight.grad, layer.bias.grad]


def _check_layers(group: RankGroup, world: int, reference: dict, findings: _Findings) -> None:
    tokens, (column_in, column_out), (row_in, row_out) = LAYERS
    seeds = _seeds(2)
    inputs = _draw((tokens, column_in), (tokens, column_out), (tokens, row_in), (tokens, row_out))
    replies = group.call(
        "lab11_layers", world, [tensors_as_bytes(inputs)] * world, tokens=tokens,
        column=[column_in, column_out], row=[row_in, row_out], seeds=seeds,
    )  # fmt: skip
    column = _whole_layer(reference, seeds[0], column_in, column_out, *inputs[:2])
    weight, bias, output, input_grad, weight_grad, bias_grad = _whole_layer(
        reference, seeds[1], row_in, row_out, *inputs[2:]
    )
    expected = []
    for rank in range(world):
        rows = slice(rank * column_out // world, (rank + 1) * column_out // world)
        cols = slice(rank * row_in // world, (rank + 1) * row_in // world)
        # The column-parallel layer's rows (output features) but its whole input's gradient; the row-parallel
        # layer's columns (input features) but its whole output and bias.
        mine = [column[0][rows], column[1][rows], column[2][:, rows], column[3], column[4][rows], column[5][rows]]
        mine += [weight[:, cols], bias, output, input_grad[:, cols], weight_grad[:, cols], bias_grad]
        expected.append(mine)
    names = [f"{layer}'s {name}" for layer in ("ColumnParallelLinear", "RowParallelLinear") for name in LAYER_NAMES]
    findings.failures["test_layers"] += _compare(replies, expected, names, world)


def _blocks(tensors: list[torch.Tensor], rank: int, world: int) -> list[torch.Tensor]:
    """Rank ``rank``'s blocks of the MLP's up weight, up bias, down weight and down bias."""
    ffn = tensors[1].shape[0]
    rows = slice(rank * ffn // world, (rank + 1) * ffn // world)
    return [tensors[0][rows], tensors[1][rows], tensors[2][:, rows], tensors[3]]


def _reference_mlp(reference: dict, hidden: int, ffn: int, seeds: list[int]):
    LayerInit = reference["LayerInit"]
    return reference["reference_mlp"](LayerInit(seeds[0], hidden, ffn), LayerInit(seeds[1], ffn, hidden))


def _mlp_parameters(mlp) -> list[torch.Tensor]:
    return [mlp[0].weight, mlp[0].bias, mlp[2].weight, mlp[2].bias]


def _check_mlp(group: RankGroup, world: int, reference: dict, findings: _Findings) -> None:
    tokens, hidden, ffn = MLP
    seeds = _seeds(3)
    inputs = _draw(*[(tokens, hidden)] * (2 + 2 * STEPS))
    replies = group.call(
        "lab11_mlp", world, [tensors_as_bytes(inputs)] * world, tokens=tokens, hidden=hidden, ffn=ffn, seeds=seeds
    )
    mlp = _reference_mlp(reference, hidden, ffn, seeds)
    x = inputs[0].clone().requires_grad_()
    output = mlp(x)
    backward(output, inputs[1])
    before = reference["LayerInit"](seeds[2], hidden, hidden).full_linear()
    trained = _reference_mlp(reference, hidden, ffn, seeds)
    parameters = [before.weight, before.bias, *_mlp_parameters(trained)]
    train(lambda batch: trained(torch.tanh(before(batch))), parameters, inputs[2:])
    gradients = [parameter.grad for parameter in _mlp_parameters(mlp)]
    expected = [
        [output, x.grad, *_blocks(gradients, rank, world), before.weight, before.bias,
         *_blocks(_mlp_parameters(trained), rank, world)]
        for rank in range(world)
    ]  # fmt: skip
    names = ["the MLP's output", "its input gradient", *(f"{name}'s gradient" for name in SHARD_NAMES)]
    names += [
        f"after {STEPS} SGD steps, {name}" for name in ("the replicated layer's weight", "its bias", *SHARD_NAMES)
    ]
    findings.failures["test_mlp"] += _compare(replies, expected, names, world)


def _check_traffic(group: RankGroup, world: int, reference: dict, findings: _Findings) -> None:
    """The MLP of TRAFFIC[world], built, then one forward and one backward, read from outside: what the ranks sent
    and, on 2 ranks, how much each one's resident memory grew. Only a right answer's traffic counts."""
    tokens, hidden, ffn = TRAFFIC[world]
    seeds = _seeds(2)
    x, dz = _draw((tokens, hidden), (tokens, hidden))
    group.reset_peaks()
    resident = group.resident()[:world]
    group.call("lab11_build", world, hidden=hidden, ffn=ffn, seeds=seeds)
    sent = {}
    for name, tensor in (("forward", x), ("backward", dz)):
        before = group.readings()
        group.call(f"lab11_{name}", world, [tensors_as_bytes([tensor])] * world, tokens=tokens, hidden=hidden)
        sent[name] = group.readings() - before
    growth = [peak - start for peak, start in zip(group.peaks()[:world], resident)]
    strangers = group.strangers()
    mlp = _reference_mlp(reference, hidden, ffn, seeds)
    x = x.clone().requires_grad_()
    output = mlp(x)
    backward(output, dz)
    replies = group.call("lab11_outputs", world)
    wrong = _compare(replies, [[output, x.grad]] * world, ["the MLP's output", "its input gradient"], world)
    each, together = ring_all_reduce_bytes(tokens * hidden * 4, world)
    low, high = SENT_BOUNDS
    communication = findings.failures["test_communication"]
    communication += wrong
    if group.own_network:
        loopback = (
            f"through the loopback: forward {sent['forward'].loopback:,} B, backward {sent['backward'].loopback:,} B "
            f"(one all-reduce of the {tokens} x {hidden} output: {together:,} B)"
        )
    else:  # the host's loopback carries every other process's traffic too: each rank's writes alone decide
        loopback = "the loopback not read (no sandbox: the ranks share the machine's network)"
    findings.notes["test_communication"].append(
        f"on {world} ranks, {loopback}; written by each rank: forward {_listed(sent['forward'].written[:world])} B, "
        f"backward {_listed(sent['backward'].written[:world])} B (one all-reduce: {each:,} B)"
    )
    for name, readings in sent.items():
        if readings.loopback is not None and not low * together <= readings.loopback <= high * together + SENT_SLACK:
            communication.append(
                f"{world} ranks sent {readings.loopback:,} bytes in one {name}, not one all-reduce's {together:,}"
            )
        written = readings.written[:world]
        short = [rank for rank, count in enumerate(written) if count < low * each]
        if short:
            communication.append(f"in one {name}, ranks {short} wrote less than one all-reduce's {each:,} bytes")
        over = [rank for rank, count in enumerate(written) if count > high * each + SENT_SLACK]
        if over:
            communication.append(f"in one {name}, ranks {over} wrote more than one all-reduce's {each:,} bytes")
    if world == 2:
        _memory_findings(findings, growth, strangers, hidden, ffn, world, [w for w in wrong if "the MLP's output" in w])


def _listed(numbers) -> str:
    return " / ".join(f"{number:,}" for number in numbers)


def _memory_findings(findings, growth, strangers, hidden: int, ffn: int, world: int, wrong: list[str]) -> None:
    blocks, limit = memory_limit(hidden, ffn, world)
    grown = ", ".join(f"+{g / 2**20:.1f}" for g in growth)
    findings.notes["test_memory"].append(
        f"{world} ranks, MLP {hidden} x {ffn}: peaks grew by {grown} MiB (its blocks and their gradients "
        f"{blocks / 2**20:.1f} MiB, at most {limit / 2**20:.0f} MiB allowed, one whole weight {hidden * ffn * 4 / 2**20:.0f} MiB)"
    )
    failures = findings.failures["test_memory"]
    failures += wrong  # a layer that makes nothing uses no memory
    failures += [
        f"rank {rank} grew by {g / 2**20:.1f} MiB: more than its blocks and gradients ({blocks / 2**20:.1f} MiB) and "
        f"3/4 of a whole weight: hold your block only, never the whole weight"
        for rank, g in enumerate(growth)
        if g > limit
    ]
    if strangers:
        failures.append(f"the answer started processes of its own: {'; '.join(strangers)}")


# Each check, and the cells it decides: a check that fails on the ranks fails its cells.
_CHECKS = (
    (_check_f_g, ("test_f_g",)),
    (_check_layers, ("test_layers",)),
    (_check_mlp, ("test_mlp",)),
    (_check_traffic, ("test_communication", "test_memory")),
)


def grade_lab11(cells: dict) -> dict[str, Verdict]:
    """Every graded cell of lab 11 (see the module's docstring)."""
    if "megatron" not in cells["learner"]:
        return dict.fromkeys(CELLS, Verdict.refused("the answer cell megatron is missing from the notebook"))
    problem = answer_source(cells["course"]["problem"])
    reference = run_cells({"problem": problem}, ["problem"])
    rank_cells = [
        ("rank_setup", _RANK_SETUP.format(source=problem)),
        ("megatron", answer_source(cells["learner"]["megatron"])),
    ]
    try:
        group = RankGroup(max(WORLDS), rank_cells, handlers=HANDLERS, timeout_s=REQUEST_TIMEOUT_S)
    except ChildError as error:  # the cell raised, ended its process or never finished: the answer's doing
        return dict.fromkeys(CELLS, Verdict.refused(f"your cell, run on the ranks: {error}"))
    findings, worlds = _Findings(), 0
    try:
        for world in WORLDS:
            joined = False
            for check, decides in _CHECKS:
                try:
                    if not joined:
                        worlds += 1
                        # In the grading's own folder: unsandboxed, /tmp is the machine's, where another grading's
                        # rendezvous file of the same name would join these ranks to a world that is gone.
                        store = os.path.join(group.workdir, f"world-{worlds}")
                        group.call("lab11_world", world, store=store)
                        joined = True
                    check(group, world, reference, findings)
                except ChildError as error:  # a rank that raised, ended or hung: the answer's doing
                    for cell in decides:
                        findings.failures[cell].append(f"on {world} ranks: {error}")
                    joined = False  # ranks may still wait in a collective of that world: the next check forms another
    finally:
        group.close()
    return findings.verdicts()
