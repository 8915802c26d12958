"""Lab 11's grader: its formulas, the course's helpers the ranks run, and a grading that a hang and a helper process
cannot stretch or fool (the reference and the attacks are graded through nbgrader in tests/test_labs.py)."""

from __future__ import annotations

import time

import pytest
import torch
from attacks import _COPY_TO_PARALLEL, _MEGATRON_HEAD, MEGATRON_LAYERS, SKIPPED_ALL_REDUCE, course_cells
from perflab.grading import megatron_lab, megatron_lab_checks
from perflab.grading.code_labs import run_cells
from perflab.grading.megatron_lab import answer_source, memory_limit, ring_all_reduce_bytes
from perflab.grading.megatron_lab_ranks import LR, backward, train
from perflab.grading.rank_group import Readings
from perflab.grading.sandbox import SANDBOX_ENV_VAR

COURSE = course_cells("lab11_megatron")
PROBLEM = run_cells({"problem": answer_source(COURSE["problem"])}, ["problem"])


def test_a_ring_all_reduce_sends_twice_the_payload_less_a_share():
    assert ring_all_reduce_bytes(262_144, world=2) == (262_144, 524_288)
    assert ring_all_reduce_bytes(262_144, world=4) == (393_216, 1_572_864)
    assert ring_all_reduce_bytes(262_144, world=1) == (0, 0)


def test_the_memory_limit_lies_between_the_blocks_and_the_whole_weights():
    for world in (2, 4):
        blocks, limit = memory_limit(1024, 4096, world)
        whole_weights = 2 * 1024 * 4096 * 4
        assert blocks < limit < blocks + whole_weights


def test_only_the_writefile_line_is_dropped():
    assert answer_source('%%writefile {work / "megatron.py"}\nimport torch\nx = 1') == "import torch\nx = 1"
    assert answer_source("import torch") == "import torch"


@pytest.mark.parametrize(
    ("rows", "cols"), [(slice(None), slice(None)), (slice(30, 97), slice(None)), (slice(None), slice(5, 11))]
)
def test_a_block_of_layer_init_is_the_same_block_of_the_whole_weight(rows, cols):
    init = PROBLEM["LayerInit"](seed=7, in_features=16, out_features=130)  # 130 rows: three draws, the last short
    whole = init.weight()
    assert whole.shape == (130, 16)
    assert torch.equal(init.weight(rows=rows, cols=cols), whole[rows, cols])
    assert torch.equal(init.bias(rows), init.bias()[rows])
    assert not torch.equal(whole, PROBLEM["LayerInit"](seed=8, in_features=16, out_features=130).weight())


@pytest.mark.parametrize(
    ("dim", "held", "beyond"),
    [
        (0, (slice(65, 130), slice(None)), (slice(64, 65), slice(8, 9))),  # rank 1's rows, and one of rank 0's
        (1, (slice(None), slice(8, 16)), (slice(64, 65), slice(7, 8))),  # rank 1's columns, and one of rank 0's
    ],
)
def test_a_rank_block_hands_out_its_own_block_and_raises_beyond_it(dim, held, beyond):
    init = PROBLEM["LayerInit"](seed=7, in_features=16, out_features=130)
    handed = PROBLEM["RankBlock"].of(init, rank=1, world=2, dim=dim)
    assert (handed.in_features, handed.out_features) == (16, 130)
    assert torch.equal(handed.weight(*held), init.weight(*held))
    assert torch.equal(handed.weight(slice(70, 80), slice(8, 12)), init.weight(slice(70, 80), slice(8, 12)))
    assert torch.equal(handed.bias(), init.bias())  # every rank holds the whole bias
    for rows, cols in [(slice(None), slice(None)), beyond]:  # the whole weight, to slice it; one number of another's
        with pytest.raises(ValueError, match=f"not rows {rows.start or 0}:.* ask init for your block only"):
            handed.weight(rows, cols)
    handed.take_back()  # once the layers are built
    with pytest.raises(ValueError, match="while your layers are built, not later"):
        handed.weight(*held)


def test_backward_from_a_gradient_is_autograd_s():
    x = torch.randn(4, 3, requires_grad=True)
    gradient = torch.randn(4, 2)
    weight = torch.randn(2, 3)
    backward(x @ weight.T, gradient)
    assert torch.allclose(x.grad, gradient @ weight)


def test_the_grader_s_sgd_steps_as_torch_s():
    batches = [torch.randn(5, 3), torch.randn(5, 2)] * 3
    models = [torch.nn.Linear(3, 2), torch.nn.Linear(3, 2)]
    models[1].load_state_dict(models[0].state_dict())
    train(models[0], list(models[0].parameters()), batches)
    optimizer = torch.optim.SGD(models[1].parameters(), lr=LR, momentum=0.9)
    for inputs, targets in zip(batches[::2], batches[1::2]):
        torch.nn.functional.mse_loss(models[1](inputs), targets).backward()
        optimizer.step()
        optimizer.zero_grad()
    for ours, torchs in zip(models[0].parameters(), models[1].parameters()):
        assert torch.allclose(ours, torchs, atol=1e-7)


def test_the_skipping_attack_differs_from_the_reference_only_in_f_s_backward():
    assert SKIPPED_ALL_REDUCE != _COPY_TO_PARALLEL and "all_reduce" not in SKIPPED_ALL_REDUCE


# Right layers, but a helper process forked beside every rank, and an MLP that never finishes on 4 ranks when it is
# as small as the MLP check's (its MLP's traffic, checked first, is right).
_STRANGER_AND_HANG = f"""
import os
import time

if os.fork() == 0:
    time.sleep(3600)
    os._exit(0)


class TensorParallelMLP(TensorParallelMLP):
    def __init__(self, up, down):
        while dist.get_world_size() == 4 and up.out_features == {megatron_lab_checks.MLP[2]}:
            time.sleep(1)
        super().__init__(up, down)
"""


@pytest.mark.slow
def test_a_helper_process_loses_the_memory_points_and_a_hang_ends_within_the_bound(monkeypatch):
    monkeypatch.setattr(megatron_lab, "REQUEST_TIMEOUT_S", 8)
    learner = _MEGATRON_HEAD + _COPY_TO_PARALLEL + MEGATRON_LAYERS + _STRANGER_AND_HANG
    start = time.monotonic()
    verdicts = megatron_lab.grade_lab11({"course": COURSE, "learner": {"megatron": learner}})
    took = time.monotonic() - start
    assert took < 60, f"the grading took {took:.0f} s"
    assert {cell: verdict.status for cell, verdict in verdicts.items()} == {
        "test_f_g": "pass",
        "test_layers": "pass",
        "test_mlp": "fail",
        "test_communication": "pass",
        "test_memory": "fail",
    }, verdicts
    assert "did not all answer within 8 s" in verdicts["test_mlp"].reasons[0], verdicts["test_mlp"]
    assert verdicts["test_memory"].reasons[0].startswith("the answer started processes of its own"), verdicts[
        "test_memory"
    ]


@pytest.mark.slow
def test_without_a_sandbox_the_ranks_writes_alone_decide_the_communication(monkeypatch):
    """Unsandboxed, the ranks share the machine's loopback with every other process: it is not read."""
    monkeypatch.setenv(SANDBOX_ENV_VAR, "0")
    verdicts = megatron_lab.grade_lab11({"course": COURSE, "learner": {"megatron": COURSE["megatron"]}})
    assert all(verdict.passed for verdict in verdicts.values()), verdicts
    assert "the loopback not read" in verdicts["test_communication"].measured, verdicts["test_communication"]


def test_bytes_sent_while_the_layers_are_built_fail_the_communication_beyond_the_slack():
    """An MLP that all-gathers the other ranks' blocks in ``__init__`` and then computes the whole output with a dummy
    all-reduce sends one all-reduce a pass: only the build's bytes show it."""
    slack = megatron_lab_checks.SENT_SLACK
    assert megatron_lab_checks._build_failures(Readings(slack, (slack, 200)), world=2) == []
    gathered = megatron_lab_checks._build_failures(Readings(8 << 20, (4 << 20, 4 << 20, 9 << 20)), world=2)
    assert gathered == [
        "your layers sent 8,388,608 bytes while they were built: a block needs no communication",
        "rank 0's layers wrote 4,194,304 bytes while they were built: a block needs no communication",
        "rank 1's layers wrote 4,194,304 bytes while they were built: a block needs no communication",
    ]
    assert megatron_lab_checks._build_failures(Readings(None, (0, slack + 1)), world=2) == [
        f"rank 1's layers wrote {slack + 1:,} bytes while they were built: a block needs no communication"
    ]


def test_a_layer_s_bias_and_its_weight_s_rows_come_from_unrelated_generators():
    """The bias every rank is sent is drawn from a generator seeded by a hash of the seed, not by the seed's
    arithmetic: the grader's seeds are 62-bit, and no seed of the bias's leads to a block of the weight's."""
    init = PROBLEM["LayerInit"](seed=2**62 - 1, in_features=16, out_features=130)  # within manual_seed's range
    rows = [init._generator(f"rows {group}").initial_seed() for group in range(3)]
    bias = init._generator("bias").initial_seed()
    assert len({bias, *rows}) == 4 and all(0 <= seed < 2**63 for seed in [bias, *rows])
    assert sorted(abs(a - b) for a, b in zip(rows, rows[1:])) != [1, 1]  # not consecutive, as seed * k + group was
