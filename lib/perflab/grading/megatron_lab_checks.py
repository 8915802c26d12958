"""Lab 11's checks, each on one world of the grader's ranks: what it sends them, compares, and reads from outside.

Each ``check_*`` function runs on ranks 0 to ``world``-1 of a :class:`perflab.grading.rank_group.RankGroup`
that has joined one world, and writes what it measured and what failed into a :class:`Findings`, cell by
cell. Weights are drawn from ``LayerInit``s whose seeds only this process holds, and each rank is sent
its own block of each whole weight and the whole bias (the lab's ``rank_slices``), nothing more.

    >>> findings = Findings()
    >>> findings.failures["test_memory"].append("rank 0 grew by 60.0 MiB from before your module ran: ...")
    >>> {cell: verdict.status for cell, verdict in findings.verdicts().items()}
    {'test_f_g': 'pass', 'test_layers': 'pass', 'test_mlp': 'pass', 'test_communication': 'pass', 'test_memory': 'fail'}

Used by perflab.grading.megatron_lab.
"""

from __future__ import annotations

import torch

from perflab.grading.child import ChildError
from perflab.grading.code_labs import grader_seeds
from perflab.grading.megatron_lab_bounds import (
    SENT_SLACK,
    TRAFFIC,
    memory_limit,
    ring_all_reduce_bytes,
    sent_failures,
)
from perflab.grading.megatron_lab_ranks import LAYER_NAMES, SHARD_NAMES, STEPS, backward, train
from perflab.grading.rank_group import RankGroup
from perflab.grading.triton_lab_backward import tensors_as_bytes, tensors_from_bytes
from perflab.grading.verdict import Verdict

__all__ = ["CELLS", "MLP", "Findings", "check_f_g", "check_layers", "check_mlp", "check_traffic"]

CELLS = ("test_f_g", "test_layers", "test_mlp", "test_communication", "test_memory")
F_G_SHAPE = (8, 16)
# tokens, (in, out) of the column-parallel layer, (in, out) of the row-parallel one: each whole weight, 1 MiB, far
# above what a layer's one all-reduce of 8 tokens sends (8 KiB per rank on 2), so that a layer that gathers its weight
# stands out in what it sends.
LAYERS = (8, (256, 1024), (1024, 256))
MLP = (8, 32, 64)  # tokens, hidden, ffn: every size divides by 4
RTOL, ATOL = 1e-4, 1e-5  # float32 sums in another order: a few ulps apart; a missing all-reduce is off by O(1)


class Findings:
    """What the checks measured and what failed, cell by cell."""

    def __init__(self):
        self.notes = {cell: [] for cell in CELLS}
        self.failures = {cell: [] for cell in CELLS}
        self.resident_before_answer: list[int] = []  # each rank's, read before the answer's module ran

    def verdicts(self) -> dict[str, Verdict]:
        return {
            cell: Verdict.decide("; ".join([_DESCRIPTIONS[cell], *self.notes[cell]]), self.failures[cell][:4])
            for cell in CELLS
        }


_DESCRIPTIONS = {
    "test_f_g": "f and g on 2 and 4 ranks, on fresh tensors: outputs and input gradients",
    "test_layers": "ColumnParallelLinear and RowParallelLinear alone on 2 and 4 ranks, each handed its block of fresh "
    "weights: its weight and bias, its outputs and gradients, against one process's whole layer, and what both sent",
    "test_mlp": f"TensorParallelMLP on 2 and 4 ranks: output, gradients, and weights after {STEPS} SGD steps of a "
    "replicated layer and the MLP, against one process",
    "test_communication": "bytes sent while the MLP was built (none) and in one forward and one backward of it, read "
    "from outside the ranks",
    "test_memory": "each rank's peak resident memory from before your module ran to after the MLP's backward, read "
    "from outside",
}


def _draw(*shapes) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(grader_seeds.randrange(2**31))
    return [torch.randn(*shape, generator=generator) for shape in shapes]


def _inits(reference: dict, *features: tuple[int, int]) -> list:
    """A LayerInit of each (in, out), from seeds drawn here that only the grader holds. LayerInit draws the bias and
    each group of the weight's rows from a generator of its own, seeded by a hash of the seed, so that the bias every
    rank is sent says nothing of another rank's block; torch's CPU generator keeps 32 bits of a seed, so a group shared
    by two ranks' blocks could be found from one of them only by a search of 2^32 seeds, beyond a request's limit."""
    return [reference["LayerInit"](grader_seeds.randrange(2**62), *pair) for pair in features]


def _handed(reference: dict, layers: list[tuple], world: int) -> list[list[torch.Tensor]]:
    """What each rank is sent of each (LayerInit, dim): its block of the whole weight split along ``dim`` (the lab's
    ``rank_slices``) and the whole bias, all that its layers are built from."""
    sent = [[] for _ in range(world)]
    for init, dim in layers:
        weight, bias = init.weight(), init.bias()
        for rank in range(world):
            rows, cols = reference["rank_slices"](init.in_features, init.out_features, rank, world, dim)
            sent[rank] += [weight[rows, cols], bias]
    return sent


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


def check_f_g(group: RankGroup, world: int, reference: dict, findings: Findings) -> None:
    tensors = [_draw(F_G_SHAPE, F_G_SHAPE, F_G_SHAPE) for _ in range(world)]
    replies = group.call("lab11_f_g", world, [tensors_as_bytes(t) for t in tensors], shape=list(F_G_SHAPE))
    total_x, total_grad_f = sum(t[0] for t in tensors), sum(t[1] for t in tensors)
    expected = [[x, total_grad_f, total_x, grad_g] for x, _, grad_g in tensors]
    names = ["f(x)", "f's input gradient", "g(x)", "g's input gradient"]
    findings.failures["test_f_g"] += _compare(replies, expected, names, world)


def _whole_layer(init, x, dy) -> list[torch.Tensor]:
    layer = init.full_linear()
    x = x.clone().requires_grad_()
    output = layer(x)
    backward(output, dy)
    return [layer.weight, layer.bias, output, x.grad, layer.weight.grad, layer.bias.grad]


def check_layers(group: RankGroup, world: int, reference: dict, findings: Findings) -> None:
    tokens, (column_in, column_out), (row_in, row_out) = LAYERS
    column_init, row_init = _inits(reference, (column_in, column_out), (row_in, row_out))
    inputs = _draw((tokens, column_in), (tokens, column_out), (tokens, row_in), (tokens, row_out))
    payloads = [
        tensors_as_bytes(inputs + mine) for mine in _handed(reference, [(column_init, 0), (row_init, 1)], world)
    ]
    before = group.readings()
    group.call("lab11_layers", world, payloads, tokens=tokens, column=[column_in, column_out], row=[row_in, row_out])
    sent = group.readings() - before
    replies = group.call("lab11_results", world)
    column = _whole_layer(column_init, *inputs[:2])
    weight, bias, output, input_grad, weight_grad, bias_grad = _whole_layer(row_init, *inputs[2:])
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
    failures = findings.failures["test_layers"]
    failures += _compare(replies, expected, names, world)
    # f's all-reduce of the column-parallel layer's input gradient, g's of the row-parallel layer's output.
    each = sum(ring_all_reduce_bytes(tokens * features * 4, world)[0] for features in (column_in, row_out))
    findings.notes["test_layers"].append(
        f"on {world} ranks, {_sent_note(sent, world)} (their two all-reduces: {each:,} B a rank)"
    )
    failures += [
        f"{failure}: a layer computes with its own block, and f and g are all it sends"
        for failure in sent_failures(sent, each, world, "both layers' forward and backward", fewest=False)
    ]


def _blocks(tensors: list[torch.Tensor], rank: int, world: int) -> list[torch.Tensor]:
    """Rank ``rank``'s blocks of the MLP's up weight, up bias, down weight and down bias."""
    ffn = tensors[1].shape[0]
    rows = slice(rank * ffn // world, (rank + 1) * ffn // world)
    return [tensors[0][rows], tensors[1][rows], tensors[2][:, rows], tensors[3]]


def _mlp_parameters(mlp) -> list[torch.Tensor]:
    return [mlp[0].weight, mlp[0].bias, mlp[2].weight, mlp[2].bias]


def check_mlp(group: RankGroup, world: int, reference: dict, findings: Findings) -> None:
    tokens, hidden, ffn = MLP
    up, down, replicated = _inits(reference, (hidden, ffn), (ffn, hidden), (hidden, hidden))
    inputs = _draw(*[(tokens, hidden)] * (2 + 2 * STEPS))
    payloads = [tensors_as_bytes(inputs + mine) for mine in _handed(reference, [(up, 0), (down, 1)], world)]
    replies = group.call("lab11_mlp", world, payloads, tokens=tokens, hidden=hidden, ffn=ffn, seed=replicated.seed)
    mlp = reference["reference_mlp"](up, down)
    x = inputs[0].clone().requires_grad_()
    output = mlp(x)
    backward(output, inputs[1])
    before = replicated.full_linear()
    trained = reference["reference_mlp"](up, down)
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


def check_traffic(group: RankGroup, world: int, reference: dict, findings: Findings) -> None:
    """The MLP of TRAFFIC[world], built, then one forward and one backward, read from outside: what the ranks sent
    while it was built (at most SENT_SLACK each), in each pass and, on 2 ranks, how much each one's peak resident memory grew from before the answer ran. Only a right answer's
    traffic counts."""
    tokens, hidden, ffn = TRAFFIC[world]
    up, down = _inits(reference, (hidden, ffn), (ffn, hidden))
    x, dz = _draw((tokens, hidden), (tokens, hidden))
    payloads = [tensors_as_bytes(mine) for mine in _handed(reference, [(up, 0), (down, 1)], world)]
    group.call("lab11_hold", world, payloads, hidden=hidden, ffn=ffn)
    before = group.readings()
    group.call("lab11_build", world, hidden=hidden, ffn=ffn)
    built = group.readings() - before
    sent = {}
    for name, tensor in (("forward", x), ("backward", dz)):
        before = group.readings()
        group.call(f"lab11_{name}", world, [tensors_as_bytes([tensor])] * world, tokens=tokens, hidden=hidden)
        sent[name] = group.readings() - before
    growth = [peak - start for peak, start in zip(group.peaks()[:world], findings.resident_before_answer)]
    strangers = group.strangers()
    mlp = reference["reference_mlp"](up, down)
    x = x.clone().requires_grad_()
    output = mlp(x)
    backward(output, dz)
    replies = group.call("lab11_results", world)
    wrong = _compare(replies, [[output, x.grad]] * world, ["the MLP's output", "its input gradient"], world)
    each, _ = ring_all_reduce_bytes(tokens * hidden * 4, world)
    findings.notes["test_communication"].append(
        f"on {world} ranks, built: {_sent_note(built, world)}; forward: {_sent_note(sent['forward'], world)}; backward: "
        f"{_sent_note(sent['backward'], world)} (one all-reduce of the {tokens} x {hidden} output: {each:,} B a rank)"
    )
    communication = findings.failures["test_communication"]
    communication += wrong
    communication += _build_failures(built, world)
    for name, readings in sent.items():
        communication += sent_failures(readings, each, world, f"one {name}", fewest=True)
    if world == 2:
        _memory_findings(findings, growth, strangers, hidden, ffn, world, [w for w in wrong if "the MLP's output" in w])


def _build_failures(built, world: int) -> list[str]:
    """What the ranks sent while the MLP was built, beyond SENT_SLACK: building a block needs no communication."""
    found = []
    if built.loopback is not None and built.loopback > SENT_SLACK * world:  # every rank's bytes: SENT_SLACK a rank
        found.append(f"your layers sent {built.loopback:,} bytes while they were built: a block needs no communication")
    found += [
        f"rank {rank}'s layers wrote {count:,} bytes while they were built: a block needs no communication"
        for rank, count in enumerate(built.written[:world])
        if count > SENT_SLACK
    ]
    return found


def _sent_note(readings, world: int) -> str:
    written = " / ".join(f"{count:,}" for count in readings.written[:world])
    if readings.loopback is None:  # the host's loopback carries every other process's traffic too: writes alone decide
        return f"written by each rank {written} B (the loopback not read: no sandbox, the machine's network)"
    return f"through the loopback {readings.loopback:,} B, written by each rank {written} B"


def _memory_findings(findings, growth, strangers, hidden: int, ffn: int, world: int, wrong: list[str]) -> None:
    blocks, limit = memory_limit(hidden, ffn, world)
    grown = ", ".join(f"+{g / 2**20:.1f}" for g in growth)
    findings.notes["test_memory"].append(
        f"{world} ranks, MLP {hidden} x {ffn}: peaks grew by {grown} MiB from before your module ran (its blocks and "
        f"their gradients {blocks / 2**20:.1f} MiB, at most {limit / 2**20:.0f} MiB allowed, one whole weight "
        f"{hidden * ffn * 4 / 2**20:.0f} MiB)"
    )
    failures = findings.failures["test_memory"]
    failures += wrong  # a layer that makes nothing uses no memory
    failures += [
        f"rank {rank} grew by {g / 2**20:.1f} MiB from before your module ran: more than its blocks and gradients "
        f"({blocks / 2**20:.1f} MiB) and 3/4 of a whole weight: hold your block only, never the whole weight, and "
        "allocate nothing large when your module is imported"
        for rank, g in enumerate(growth)
        if g > limit
    ]
    if strangers:
        failures.append(f"the answer started processes of its own: {'; '.join(strangers)}")
