"""perflab.pipeline_schedule: the bubble, the activations in flight and the sends, from synthetic timelines, torch's
own interleaved order and a real stage."""

from __future__ import annotations

import json
from types import SimpleNamespace

import matplotlib.pyplot as plt
import pytest
import torch
import torch.distributed as dist
from perflab.memory import saved_tensors
from perflab.pipeline_plots import bubble_chart, pipeline_timeline
from perflab.pipeline_schedule import (
    PipelineRun,
    RankTimeline,
    StageWork,
    bubble_fraction,
    median_run,
    microbatches_in_flight,
    point_to_point_sends,
    record_stages,
)
from torch.distributed.pipelining import ScheduleInterleaved1F1B

FORWARD, BACKWARD = 1.0, 2.0  # seconds per microbatch on every stage: backward about twice forward


def gpipe(stages: int, microbatches: int, *, late: float = 0.0) -> PipelineRun:
    """GPipe's ideal timeline in closed form; each stage after the first waits ``late`` more per hop (a slow send)."""
    timelines = []
    for s in range(stages):
        work = [StageWork(s, "forward", i, (s + i) * FORWARD + s * late, (s + i + 1) * FORWARD + s * late)
                for i in range(microbatches)]  # fmt: skip
        last_forward_end = (microbatches + stages - 1) * FORWARD + (stages - 1) * late  # on the last stage
        backwards_start = last_forward_end + (stages - 1 - s) * (BACKWARD + late)
        work += [StageWork(s, "backward", i, backwards_start + i * BACKWARD, backwards_start + (i + 1) * BACKWARD)
                 for i in range(microbatches)]  # fmt: skip
        timelines.append(RankTimeline(rank=s, work=tuple(work)))
    return PipelineRun("GPipe", microbatches, tuple(timelines))


def one_f_one_b_order(stages: int, microbatches: int) -> PipelineRun:
    """Torch's Schedule1F1B order on each stage (start times only give the order), every duration the same."""
    timelines = []
    for s in range(stages):
        warmup = min(microbatches, stages - s)
        order = [("forward", i) for i in range(warmup)]
        for i in range(microbatches):
            order.append(("backward", i))
            if warmup + i < microbatches:
                order.append(("forward", warmup + i))
        timelines.append(in_order(s, [(s, kind, i) for kind, i in order]))
    return PipelineRun("1F1B", microbatches, tuple(timelines))


def in_order(rank: int, order: list[tuple[int, str, int]], stages_per_rank: int = 1) -> RankTimeline:
    """A rank's (stage, kind, microbatch) in this order, one after another (start times give only the order); a
    stage's forward and backward take 1/v of a rank's: the rank's work per microbatch is split over its v stages."""
    work, clock = [], 0.0
    for stage, kind, microbatch in order:
        duration = (FORWARD if kind == "forward" else BACKWARD) / stages_per_rank
        work.append(StageWork(stage, kind, microbatch, clock, clock + duration))
        clock += duration
    return RankTimeline(rank=rank, work=tuple(work))


def interleaved_order(ranks: int, microbatches: int, stages_per_rank: int) -> PipelineRun:
    """Torch's own ScheduleInterleaved1F1B order for each rank, from the schedule's planner. Building the schedule
    needs a process group of ``ranks`` ranks, so the planner runs on an object with the attributes it reads, set as
    ``__init__`` sets them (torch/distributed/pipelining/schedules.py, the same in torch 2.11 and 2.15)."""
    schedule = ScheduleInterleaved1F1B.__new__(ScheduleInterleaved1F1B)
    schedule.pp_group_size, schedule.n_local_stages, schedule._n_microbatches = ranks, stages_per_rank, microbatches
    schedule.number_of_rounds = max(1, microbatches // ranks)
    schedule.microbatches_per_round = microbatches // schedule.number_of_rounds
    timelines = []
    for rank in range(ranks):
        actions = [a for a in schedule._calculate_single_rank_operations(rank) if a is not None]
        kinds = {"F": "forward", "B": "backward"}
        order = [(a.stage_index, kinds[a.computation_type.value], a.microbatch_index) for a in actions]
        timelines.append(in_order(rank, order, stages_per_rank))
    return PipelineRun("Interleaved1F1B", microbatches, tuple(timelines))


@pytest.mark.parametrize("stages", [2, 3, 4])
@pytest.mark.parametrize("microbatches", [1, 2, 4, 8])
def test_the_ideal_gpipe_timeline_has_the_formulas_bubble_and_holds_every_microbatch(stages, microbatches):
    run = gpipe(stages, microbatches)
    assert run.bubble == pytest.approx(bubble_fraction(stages, microbatches))
    assert run.replayed_bubble == pytest.approx(run.bubble)
    assert run.makespan_s == pytest.approx((microbatches + stages - 1) * (FORWARD + BACKWARD))
    assert [t.max_in_flight for t in run.timelines] == [microbatches] * stages


@pytest.mark.parametrize("stages", [2, 4])
@pytest.mark.parametrize("microbatches", [4, 8])
def test_one_f_one_b_has_gpipes_bubble_and_holds_at_most_p_minus_s(stages, microbatches):
    run = one_f_one_b_order(stages, microbatches)
    assert run.replayed_bubble == pytest.approx(bubble_fraction(stages, microbatches))
    assert [t.max_in_flight for t in run.timelines] == [
        microbatches_in_flight("1F1B", stages, microbatches, s) for s in range(stages)
    ]
    assert [t.max_in_flight for t in run.timelines] == [min(microbatches, stages - s) for s in range(stages)]


@pytest.mark.parametrize("ranks", [2, 3, 4])
@pytest.mark.parametrize("stages_per_rank", [1, 2, 3])
@pytest.mark.parametrize("microbatches", [1, 2, 3, 4, 6, 8, 12])  # each a multiple of max(1, m // p): torch takes it
def test_torchs_interleaved_order_has_the_formulas_bubble_from_p_microbatches_on(ranks, stages_per_rank, microbatches):
    run = interleaved_order(ranks, microbatches, stages_per_rank)
    assert run.stages_per_rank == stages_per_rank
    formula = bubble_fraction(ranks, microbatches, stages_per_rank)
    if microbatches >= ranks or stages_per_rank == 1:  # Narayanan et al. ask for m a multiple of p; m >= p does
        assert run.replayed_bubble == pytest.approx(formula)
    else:  # fewer microbatches than ranks: a microbatch waits to come round to the rank's next stage
        assert run.replayed_bubble > formula + 0.05
    # The warm-up the module counts is the one torch plans, on every rank.
    assert [t.max_in_flight for t in run.timelines] == [
        microbatches_in_flight("Interleaved1F1B", ranks, microbatches, rank, stages_per_rank) for rank in range(ranks)
    ]


def test_interleaving_shrinks_the_bubble_v_fold_and_multiplies_the_sends():
    ranks, microbatches = 4, 8
    plain, interleaved = one_f_one_b_order(ranks, microbatches), interleaved_order(ranks, microbatches, 2)
    assert interleaved.replayed_makespan_s < plain.replayed_makespan_s  # the same work, less fill and drain
    idle = [run.replayed_makespan_s * ranks - run.busy_s for run in (plain, interleaved)]
    assert idle[1] == pytest.approx(idle[0] / 2)  # (p - 1)(t_f + t_b) / v of idle time per rank
    # Each microbatch crosses every stage boundary forward and back; with v stages per rank there are p v - 1.
    boundaries = [
        sum(w.stage < ranks * run.stages_per_rank - 1 if w.kind == "forward" else w.stage > 0
            for t in run.timelines for w in t.work)
        for run in (plain, interleaved)
    ]  # fmt: skip
    assert boundaries == [point_to_point_sends(ranks, microbatches), point_to_point_sends(ranks, microbatches, 2)]
    assert boundaries == [2 * 3 * 8, 2 * 7 * 8]  # (p v - 1) / (p - 1) = 7/3 times as many, about v


def test_held_by_order_weighs_each_stages_forwards_with_its_unit():
    run = interleaved_order(2, 4, 2)
    rank0, rank1 = run.timelines
    assert (rank0.stages, rank1.stages) == ((0, 2), (1, 3))
    assert rank0.held_by_order({0: 1, 2: 1}) == rank0.max_in_flight == 5  # 4 warm-up forwards, then one more
    # torch's order, 0F0 0F1 2F0 2F1 0F2 2B0 0F3 2B1 ...: after 0F3 stage 0 holds 4 microbatches, stage 2 one
    assert rank0.held_by_order({0: 10, 2: 1}) == 41
    assert rank1.held_by_order({1: 1, 3: 100}) == 102  # 1F0 1F1 3F0, then 3B0 before the next forward
    gpipe_run = gpipe(2, 4)
    assert [t.held_by_order({t.stages[0]: 7}) for t in gpipe_run.timelines] == [4 * 7, 4 * 7]


def test_median_per_stage():
    # Stage 2 three times as slow as stage 0: its median is its own, the rank's lies between.
    slow = {0: 1.0, 2: 3.0}
    work, clock = [], 0.0
    for w in interleaved_order(2, 4, 2).timelines[0].work:
        duration = w.duration_s * slow[w.stage]
        work.append(StageWork(w.stage, w.kind, w.microbatch, clock, clock + duration))
        clock += duration
    rank0 = RankTimeline(rank=0, work=tuple(work))
    assert rank0.median_s("forward", stage=0) == pytest.approx(FORWARD / 2)
    assert rank0.median_s("forward", stage=2) == pytest.approx(3 * FORWARD / 2)
    assert rank0.median_s("backward") == pytest.approx((BACKWARD / 2 + 3 * BACKWARD / 2) / 2)


def test_time_lost_sending_counts_in_the_measured_bubble_not_in_the_replay():
    ideal, late = gpipe(2, 4), gpipe(2, 4, late=0.5)
    assert late.bubble > ideal.bubble + 0.05
    assert late.replayed_bubble == pytest.approx(ideal.bubble)
    assert late.replayed_makespan_s == pytest.approx(ideal.makespan_s)


def test_an_order_no_step_could_run_is_refused():
    # Stage 0 runs backward 0 before stage 1 could have sent its gradient: stage 1 runs its forward 0 after
    # waiting for that backward. Nothing can start.
    first = RankTimeline(0, (StageWork(0, "backward", 0, 0, 1), StageWork(0, "forward", 0, 1, 2)))
    last = RankTimeline(1, (StageWork(1, "forward", 0, 0, 1), StageWork(1, "backward", 0, 1, 2)))
    with pytest.raises(ValueError, match="wait on each other"):
        _ = PipelineRun("GPipe", 1, (first, last)).replayed_makespan_s


def test_formulas_and_their_refusals():
    assert bubble_fraction(1, 5) == 0
    assert bubble_fraction(4, 1) == pytest.approx(3 / 4)
    assert bubble_fraction(4, 8, stages_per_rank=2) == pytest.approx(3 / 19)  # the Playbook's (p-1)/(vm): 3/16 idle
    assert microbatches_in_flight("GPipe", 4, 8, 3) == 8
    assert microbatches_in_flight("1F1B", 4, 2, 0) == 2  # never more than there are microbatches
    assert microbatches_in_flight("Interleaved1F1B", 2, 1, 0, stages_per_rank=2) == 2  # every forward, then backwards
    assert point_to_point_sends(1, 8) == 0  # one stage sends nothing
    with pytest.raises(ValueError):
        bubble_fraction(0, 4)
    with pytest.raises(ValueError):
        bubble_fraction(2, 4, stages_per_rank=0)
    with pytest.raises(ValueError, match="unknown schedule"):
        microbatches_in_flight("interleaved", 4, 8, 0)
    with pytest.raises(ValueError, match="one stage per rank"):
        microbatches_in_flight("1F1B", 4, 8, 0, stages_per_rank=2)


def test_a_run_crosses_json_and_renders():
    run = gpipe(2, 4, late=0.1)
    again = PipelineRun(**json.loads(json.dumps(run.to_dict())))
    assert again == run
    assert repr(again).startswith("PipelineRun(GPipe, 2 ranks x 1 stage x 4 microbatches: bubble 0.")
    assert "most forwards in flight" in again._repr_html_()
    interleaved = interleaved_order(2, 4, 2)
    assert PipelineRun(**json.loads(json.dumps(interleaved.to_dict()))) == interleaved
    assert repr(interleaved).startswith("PipelineRun(Interleaved1F1B, 2 ranks x 2 stages x 4 microbatches: bubble 0.")


def test_the_median_run_is_the_one_with_the_median_bubble():
    runs = [gpipe(2, 4, late=late) for late in (0.3, 0.0, 0.6)]
    assert median_run(runs) is runs[0]
    assert median_run(runs[:2]) is runs[1]  # of two, the lower
    with pytest.raises(ValueError):
        median_run([])


def test_the_plots_have_titles_labels_and_a_footer():
    runs = [gpipe(2, m) for m in (1, 2, 4)] + [one_f_one_b_order(2, m) for m in (2, 4)]
    runs += [interleaved_order(2, m, 2) for m in (2, 4)]
    for figure in (pipeline_timeline(runs[2:], caption="synthetic"), bubble_chart(runs, caption="synthetic")):
        assert figure.axes[0].get_title() or figure._suptitle is not None
        assert figure.axes[-1].get_xlabel()
        assert any(text.get_text() == "synthetic" for text in figure.texts)
        plt.close(figure)


@pytest.fixture
def world_of_one():
    """A process group of one rank in this process: enough for a one-stage pipeline."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize(("schedule", "held"), [("GPipe", 3), ("1F1B", 1)])
def test_record_stage_times_a_real_stage_and_counts_the_microbatches_it_holds(world_of_one, schedule, held):
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 16))
    stage = PipelineStage(model, stage_index=0, num_stages=1, device=torch.device("cpu"))
    steps = {"GPipe": ScheduleGPipe, "1F1B": Schedule1F1B}[schedule](
        stage, n_microbatches=3, loss_fn=torch.nn.MSELoss()
    )
    inputs, targets = torch.randn(3 * 8, 16), torch.randn(3 * 8, 16)
    with saved_tensors() as one:  # one microbatch's activations, the unit of what a stage holds
        loss = torch.nn.functional.mse_loss(model(inputs[:8]), targets[:8])
    # The microbatches are views of the batch: what ops save of them holds the whole batch's storage, once.
    unit = one.bytes_excluding([*model.parameters(), inputs, targets])
    with record_stages(stage) as recording:
        steps.step(inputs, target=targets)
    timeline = recording.timeline(rank=0)
    assert timeline.stages == (0,) and timeline.sends == 0  # one stage: no neighbour to send to
    assert [(w.kind, w.microbatch) for w in timeline.work if w.kind == "forward"] == [("forward", i) for i in range(3)]
    assert sum(w.kind == "backward" for w in timeline.work) == 3
    assert all(w.end_s >= w.start_s for w in timeline.work)
    assert timeline.max_in_flight == held
    assert timeline.activation_peak == held * unit + inputs.nbytes + targets.nbytes  # exactly what the schedule says
    assert "forward_one_chunk" not in vars(stage)  # the stage's own methods are back
    assert loss.item() > 0


class StandInStage:
    """What ``record_stages`` reads of a ``PipelineStage``: its index, its module, the two calls that compute and the
    two that hand tensors to isend. torch's interleaved schedule needs a process group of two ranks for two stages
    (torch 2.11's first step posts a send to each neighbouring stage, its own rank's too: ``_initialize_stages``,
    ``_get_init_p2p_neighbors_ops``, which gloo refuses): lecture 11 runs the real one on two ranks."""

    def __init__(self, stage_index: int, width: int = 32):
        self.stage_index, self.submod, self.outputs = stage_index, torch.nn.Linear(width, width), {}

    def forward_one_chunk(self, chunk: int, x: torch.Tensor) -> torch.Tensor:
        self.outputs[chunk] = self.submod(x).tanh()  # saves its input and its output for backward
        return self.outputs[chunk]

    def backward_one_chunk(self, chunk: int, loss=None) -> None:
        self.outputs[chunk].sum().backward()

    def get_fwd_send_ops(self, chunk: int) -> list:
        return [SimpleNamespace(tensor=self.outputs[chunk])]  # what dist.P2POp holds

    def get_bwd_send_ops(self, chunk: int) -> list:
        return []


def test_record_stages_times_every_stage_of_a_rank_under_one_count_of_activations():
    torch.manual_seed(0)
    stages = {0: StandInStage(0), 2: StandInStage(2)}
    inputs = {(stage, chunk): torch.randn(8, 32) for stage in stages for chunk in range(2)}  # one storage each
    with saved_tensors() as one:
        kept = stages[0].submod(inputs[0, 0]).tanh()
    unit = one.bytes_excluding(stages[0].submod.parameters())
    order = [(0, "forward", 0), (0, "forward", 1), (2, "forward", 0), (2, "backward", 0), (2, "forward", 1),
             (0, "backward", 0), (2, "backward", 1), (0, "backward", 1)]  # fmt: skip
    with record_stages(*stages.values()) as recording:
        for stage, kind, chunk in order:
            if kind == "forward":
                stages[stage].forward_one_chunk(chunk, inputs[stage, chunk])
                stages[stage].get_fwd_send_ops(chunk)
            else:
                stages[stage].backward_one_chunk(chunk)
    timeline = recording.timeline(rank=0)
    assert [(w.stage, w.kind, w.microbatch) for w in timeline.work] == order
    assert timeline.stages == (0, 2) and timeline.max_in_flight == 3
    assert timeline.activation_peak == timeline.held_by_order({0: unit, 2: unit}) == 3 * unit
    assert (timeline.sends, timeline.sent_bytes) == (4, 4 * kept.nbytes)
    assert all(
        name not in vars(stage) for stage in stages.values() for name in ("forward_one_chunk", "get_fwd_send_ops")
    )
