"""Lab 11's grader: its formulas, the course's helpers the ranks run, and a grading that a hang and a helper process
cannot stretch or fool (the reference and the attacks are graded through nbgrader in tests/test_labs.py)."""

from __future__ import annotations

import time

import pytest
import torch
from attacks import _COPY_TO_PARALLEL, _MEGATRON_HEAD, MEGATRON_LAYERS, SKIPPED_ALL_REDUCE, course_cells
from perflab.grading import megatron_lab
from perflab.grading.code_labs import run_cells
from perflab.grading.megatron_lab import answer_source, memory_limit, ring_all_reduce_bytes
from perflab.grading.megatron_lab_ranks import LR, backward, train
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


# Right layers, but a helper process forked beside every rank, and an MLP that never finishes on 4 ranks.
_STRANGER_AND_HANG = """
import os
import time

if os.fork() == 0:
    time.sleep(3600)
    os._exit(0)


class TensorParallelMLP(TensorParallelMLP):
    def __init__(self, up, down):
        while dist.get_world_size() == 4:
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
        "test_communication": "fail",
        "test_memory": "fail",
    }, verdicts
    assert "did not all answer within 8 s" in verdicts["test_mlp"].reasons[0], verdicts["test_mlp"]
    assert any("processes of its own" in reason for reason in verdicts["test_memory"].reasons), verdicts["test_memory"]


@pytest.mark.slow
def test_without_a_sandbox_the_ranks_writes_alone_decide_the_communication(monkeypatch):
    """Unsandboxed, the ranks share the machine's loopback with every other process: it is not read."""
    monkeypatch.setenv(SANDBOX_ENV_VAR, "0")
    verdicts = megatron_lab.grade_lab11({"course": COURSE, "learner": {"megatron": COURSE["megatron"]}})
    assert all(verdict.passed for verdict in verdicts.values()), verdicts
    assert "the loopback not read" in verdicts["test_communication"].measured, verdicts["test_communication"]
