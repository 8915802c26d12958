"""perflab.pipeline_schedule: the bubble and the activations in flight, from synthetic timelines and a real stage."""

from __future__ import annotations

import json

import matplotlib.pyplot as plt
import pytest
import torch
import torch.distributed as dist
from perflab.memory import saved_tensors
from perflab.pipeline_schedule import (
    PipelineRun,
    RankTimeline,
    StageWork,
    bubble_chart,
    bubble_fraction,
    median_run,
    microbatches_in_flight,
    pipeline_timeline,
    record_stage,
)

FORWARD, BACKWARD = 1.0, 2.0  # seconds per microbatch on every stage: backward about twice forward


def gpipe(stages: int, microbatches: int, *, late: float = 0.0) -> PipelineRun:
    """GPipe's ideal timeline in closed form; each stage after the first waits ``late`` more per hop (a slow send)."""
    timelines = []
    for s in range(stages):
        work = [StageWork("forward", i, (s + i) * FORWARD + s * late, (s + i + 1) * FORWARD + s * late)
                for i in range(microbatches)]  # fmt: skip
        last_forward_end = (microbatches + stages - 1) * FORWARD + (stages - 1) * late  # on the last stage
        backwards_start = last_forward_end + (stages - 1 - s) * (BACKWARD + late)
        work += [StageWork("backward", i, backwards_start + i * BACKWARD, backwards_start + (i + 1) * BACKWARD)
                 for i in range(microbatches)]  # fmt: skip
        timelines.append(RankTimeline(rank=s, stage=s, work=tuple(work)))
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
        work = tuple(StageWork(kind, i, float(n), n + (FORWARD if kind == "forward" else BACKWARD))
                     for n, (kind, i) in enumerate(order))  # fmt: skip
        timelines.append(RankTimeline(rank=s, stage=s, work=work))
    return PipelineRun("1F1B", microbatches, tuple(timelines))


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


def test_time_lost_sending_counts_in_the_measured_bubble_not_in_the_replay():
    ideal, late = gpipe(2, 4), gpipe(2, 4, late=0.5)
    assert late.bubble > ideal.bubble + 0.05
    assert late.replayed_bubble == pytest.approx(ideal.bubble)
    assert late.replayed_makespan_s == pytest.approx(ideal.makespan_s)


def test_an_order_no_step_could_run_is_refused():
    # Stage 0 runs backward 0 before stage 1 could have sent its gradient: stage 1 runs its forward 0 after
    # waiting for that backward. Nothing can start.
    first = RankTimeline(0, 0, (StageWork("backward", 0, 0, 1), StageWork("forward", 0, 1, 2)))
    last = RankTimeline(1, 1, (StageWork("forward", 0, 0, 1), StageWork("backward", 0, 1, 2)))
    with pytest.raises(ValueError, match="wait on each other"):
        _ = PipelineRun("GPipe", 1, (first, last)).replayed_makespan_s


def test_formulas_and_their_refusals():
    assert bubble_fraction(1, 5) == 0
    assert bubble_fraction(4, 1) == pytest.approx(3 / 4)
    assert microbatches_in_flight("GPipe", 4, 8, 3) == 8
    assert microbatches_in_flight("1F1B", 4, 2, 0) == 2  # never more than there are microbatches
    with pytest.raises(ValueError):
        bubble_fraction(0, 4)
    with pytest.raises(ValueError, match="unknown schedule"):
        microbatches_in_flight("interleaved", 4, 8, 0)


def test_a_run_crosses_json_and_renders():
    run = gpipe(2, 4, late=0.1)
    again = PipelineRun(**json.loads(json.dumps(run.to_dict())))
    assert again == run
    assert repr(again).startswith("PipelineRun(GPipe, 2 stages x 4 microbatches: bubble 0.")
    assert "most microbatches in flight" in again._repr_html_()


def test_the_median_run_is_the_one_with_the_median_bubble():
    runs = [gpipe(2, 4, late=late) for late in (0.3, 0.0, 0.6)]
    assert median_run(runs) is runs[0]
    assert median_run(runs[:2]) is runs[1]  # of two, the lower
    with pytest.raises(ValueError):
        median_run([])


def test_the_plots_have_titles_labels_and_a_footer():
    runs = [gpipe(2, m) for m in (1, 2, 4)] + [one_f_one_b_order(2, m) for m in (2, 4)]
    for figure in (pipeline_timeline(runs[2:4], caption="synthetic"), bubble_chart(runs, caption="synthetic")):
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
    with record_stage(stage) as recording:
        steps.step(inputs, target=targets)
    timeline = recording.timeline(rank=0)
    assert [(w.kind, w.microbatch) for w in timeline.work if w.kind == "forward"] == [("forward", i) for i in range(3)]
    assert sum(w.kind == "backward" for w in timeline.work) == 3
    assert all(w.end_s >= w.start_s for w in timeline.work)
    assert timeline.max_in_flight == held
    assert timeline.activation_peak == held * unit + inputs.nbytes + targets.nbytes  # exactly what the schedule says
    assert "forward_one_chunk" not in vars(stage)  # the stage's own methods are back
    assert loss.item() > 0
