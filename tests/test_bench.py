import math
import time

import numpy as np
import pytest
import torch
from perflab.bench import (
    Comparison,
    Timing,
    benchmark,
    compare,
    format_seconds,
    interleaved_rounds,
    median_confidence_interval,
    median_ratio,
)
from torch.utils.benchmark import Compare, Timer


def test_timing_statistics_match_numpy():
    times = tuple(np.random.default_rng(0).lognormal(-6, 0.3, size=37))
    timing = Timing("x", times)
    q25, q50, q75, q95 = np.percentile(times, [25, 50, 75, 95])
    assert math.isclose(timing.median, q50)
    assert math.isclose(timing.iqr, q75 - q25)
    assert math.isclose(timing.p95, q95)


@pytest.mark.parametrize("times", [(), (0.1, -0.1), (float("nan"),), (0.0,)])
def test_timing_rejects_impossible_samples(times):
    with pytest.raises(ValueError):
        Timing("bad", times)


def test_timing_prints_its_summary():
    timing = Timing("matmul", (1e-3, 2e-3, 3e-3), calls_per_sample=4, device="cpu", num_threads=2)
    text = repr(timing)
    assert "matmul on cpu" in text and "median 2 ms" in text and "3 samples x 4 calls" in text
    assert "<table>" in timing._repr_html_()


def test_format_seconds_picks_a_readable_unit():
    assert format_seconds(2.5) == "2.5 s"
    assert format_seconds(0.0123) == "12.3 ms"
    assert format_seconds(4.5e-6) == "4.5 us"
    assert format_seconds(7e-9) == "7 ns"


# The tests that time a known sleep take the machine alone (conftest.py, Machine): on a machine whose CPU time is
# rationed (a cgroup's quota, a shared VM's steal) the other tests' load stalls the wake-up after each sleep.
def test_benchmark_measures_a_known_duration(machine):
    with machine.alone():
        timing = benchmark(lambda: time.sleep(0.01), samples=5, warmup=1, min_sample_s=1e-3)
    assert len(timing.times) == 5 and timing.calls_per_sample == 1
    assert 0.009 < timing.median < 0.05


def test_benchmark_warms_up_and_batches_fast_calls():
    calls = []
    timing = benchmark(lambda: calls.append(1), samples=4, warmup=3, min_sample_s=1e-3)
    assert timing.calls_per_sample > 1, "a call of microseconds is too short to time alone"
    assert len(calls) == 3 + 1 + 4 * timing.calls_per_sample  # warmup, calibration, samples
    assert timing.median < 1e-4


def test_benchmark_runs_at_the_current_thread_count():
    threads = torch.get_num_threads()
    seen = []
    timing = benchmark(lambda: seen.append(torch.get_num_threads()), samples=2, warmup=0)
    assert set(seen) == {threads} and timing.num_threads == threads


def test_timer_timeit_warms_up_before_every_sample_which_is_why_benchmark_takes_its_own():
    calls = []
    Timer(stmt="fn()", globals={"fn": lambda: calls.append(1)}).timeit(1)
    assert len(calls) == 3, "Timer.timeit(1): two untimed calls, then the timed one (bench's docstring says so)"
    calls.clear()
    timing = benchmark(lambda: calls.append(1), samples=3, warmup=1, min_sample_s=1e-12)
    assert timing.calls_per_sample == 1 and len(calls) == 1 + 1 + 3, "warm-up, calibration, then one call per sample"


def test_benchmark_agrees_with_torch_timer_on_a_known_duration(machine):
    def nap():
        time.sleep(0.005)

    with machine.alone():
        timer = Timer(stmt="nap()", globals={"nap": nap}, num_threads=torch.get_num_threads())
        theirs = timer.blocked_autorange(min_run_time=0.05).median
        ours = benchmark(nap, samples=7, warmup=1).median
    assert 0.005 <= theirs < 0.05 and 0.005 <= ours < 0.05, (theirs, ours)
    assert 0.5 < ours / theirs < 2, "the same method on the same call: the same time, within the machine's noise"


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(samples=0), "samples"),
        (dict(warmup=-1), "warmup"),
        (dict(min_sample_s=0), "min_sample_s"),
    ],
)
def test_benchmark_rejects_bad_settings(kwargs, message):
    with pytest.raises(ValueError, match=message):
        benchmark(lambda: None, **kwargs)


def test_benchmark_rejects_something_that_is_not_a_function():
    with pytest.raises(TypeError, match="function"):
        benchmark(torch.ones(3))


def test_median_interval_holds_the_median_and_needs_enough_values():
    values = list(range(1, 21))
    low, high = median_confidence_interval(values, 0.95)
    assert low < 10.5 < high and (low, high) == (6, 15)
    with pytest.raises(ValueError, match="at least 6"):
        median_confidence_interval([1.0] * 5, 0.95)


def test_median_interval_covers_the_true_median_about_as_often_as_promised():
    rng = np.random.default_rng(1)
    covered = sum(
        low <= 0.0 <= high
        for low, high in (median_confidence_interval(list(rng.standard_normal(15)), 0.9) for _ in range(400))
    )
    assert covered / 400 >= 0.87


def test_compare_finds_a_real_speedup_and_interleaves(machine):
    order = []
    with machine.alone():
        comparison = compare(
            lambda: (order.append("a"), time.sleep(0.004)),
            lambda: (order.append("b"), time.sleep(0.001)),
            labels=("slow", "fast"),
            rounds=7,
            warmup=0,
            min_sample_s=1e-4,
        )
    assert 2.5 < comparison.speedup < 5
    low, high = comparison.interval
    assert 1 < low <= comparison.speedup <= high
    assert comparison.verdict == "fast is faster"
    timed = "".join(order[2:])  # after one calibration call each
    assert "abbaab" in timed, "rounds alternate their order"
    assert "fast vs slow" in repr(comparison)


def test_compare_says_when_there_is_no_clear_difference(machine):
    def work():
        time.sleep(0.002)

    with machine.alone():
        comparison = compare(work, work, rounds=9, warmup=0)
    assert 0.9 < comparison.speedup < 1.1
    assert comparison.verdict == "no clear difference"


def test_compare_refuses_too_few_rounds_before_timing_anything():
    calls = []
    with pytest.raises(ValueError, match="too few"):
        compare(lambda: calls.append(1), lambda: calls.append(1), rounds=3)
    assert calls == []


def test_compare_names_rounds_in_its_error():
    with pytest.raises(ValueError, match="rounds must be a positive integer"):
        compare(lambda: None, lambda: None, rounds=0)


def _recording_side(name, calls):
    def run(round_index):
        calls.append((name, round_index))
        return f"{name}{round_index}"

    return run


def test_interleaved_rounds_warm_up_each_side_then_alternate_ab_ba():
    calls = []
    results = interleaved_rounds([_recording_side("a", calls), _recording_side("b", calls)], 5)
    assert calls[:2] == [("a", 5), ("b", 5)], "the warm-up runs each side once, in order, with a seed of its own"
    timed = calls[2:]
    assert "".join(name for name, _ in timed) == "ab" + "ba" + "ab" + "ba" + "ab"
    assert [index for _, index in timed] == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4], "each round passes its index"
    assert results == [[f"a{i}" for i in range(5)], [f"b{i}" for i in range(5)]], "one list per side, warm-up left out"


def test_interleaved_rounds_reverse_any_number_of_sides_and_report_each_round():
    calls, seen = [], []
    results = interleaved_rounds(
        [_recording_side(name, calls) for name in "abc"],
        3,
        warmup=False,
        after_round=lambda index, so_far: seen.append((index, [len(side) for side in so_far], len(calls))),
    )
    assert "".join(name for name, _ in calls) == "abc" + "cba" + "abc", "no warm-up when told so"
    assert seen == [(0, [1, 1, 1], 3), (1, [2, 2, 2], 6), (2, [3, 3, 3], 9)], "after_round runs between rounds"
    assert [len(side) for side in results] == [3, 3, 3]


def test_interleaved_rounds_stop_when_after_round_says_so():
    calls = []
    results = interleaved_rounds(
        [_recording_side(name, calls) for name in "ab"], 9, warmup=False, after_round=lambda index, _: index == 1
    )
    assert [len(side) for side in results] == [2, 2] and len(calls) == 4, "no round after the one that said stop"


@pytest.mark.parametrize("rounds", [0, -2, 2.0, True])
def test_interleaved_rounds_refuse_fewer_than_one_round_before_running_anything(rounds):
    calls = []
    with pytest.raises(ValueError, match="rounds must be a positive integer"):
        interleaved_rounds([_recording_side("a", calls)], rounds)
    assert calls == []
    with pytest.raises(ValueError, match="at least one side"):
        interleaved_rounds([], 3)


def test_median_ratio_pairs_values_of_the_same_round():
    assert median_ratio([2.0, 9.0, 4.0], [1.0, 3.0, 1.0]) == 3.0  # ratios 2, 3, 4; the medians' ratio would be 4
    with pytest.raises(ValueError):
        median_ratio([1.0, 2.0], [1.0])


def test_repeats_is_accepted_for_one_release_with_a_warning_naming_the_new_keyword():
    with pytest.warns(DeprecationWarning, match=r"benchmark\(samples=") as caught:
        timing = benchmark(lambda: None, repeats=3, warmup=0, min_sample_s=1e-4)
    assert len(timing.times) == 3 and caught[0].filename == __file__, "the warning points at the caller"
    with pytest.warns(DeprecationWarning, match=r"compare\(rounds="):
        comparison = compare(lambda: None, lambda: None, repeats=7, warmup=0, min_sample_s=1e-4)
    assert len(comparison.ratios) == 7


def test_comparison_needs_paired_samples():
    with pytest.raises(ValueError, match="same number"):
        Comparison(Timing("a", (1.0, 2.0)), Timing("b", (1.0,)))


def test_timings_tabulate_with_torch_benchmark_compare():
    timings = [Timing(label, (1e-3 * scale, 1.1e-3 * scale)) for label, scale in (("small", 1), ("large", 8))]
    compare_table = Compare([t.to_measurement(table="matmul") for t in timings])
    text = str(compare_table)
    assert "small" in text and "large" in text and "matmul" in text
    assert math.isclose(timings[1].to_measurement().median, timings[1].median)
