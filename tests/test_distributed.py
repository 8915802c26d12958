"""perflab.distributed: torchrun jobs from a notebook, their failures, their time limit, and one-rank runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import perflab.distributed
import psutil
import pytest
import torch.distributed as dist
from perflab.distributed import LaunchFailed, launch, run_as_one_rank

# Rank 1 crashes, but its process lingers (a slow teardown: LINGER_S), so rank 0, failing right after it as a rank
# does when its peer is gone, is the first process torchrun sees exit. The error files' times say who failed first.
LINGER_S = 60
CRASHING = textwrap.dedent("""
    import json, os, sys, threading, time
    from pathlib import Path
    from torch.distributed.elastic.multiprocessing.errors import record

    @record
    def main():
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        print(f"rank {rank} of {world}, arguments {sys.argv[1:]}", flush=True)
        if rank == 1:
            threading.Thread(target=time.sleep, args=(LINGER_S,)).start()  # keeps the process alive after the error
            raise ValueError("rank 1 broke")
        peer_error = Path(os.environ["TORCHELASTIC_ERROR_FILE"]).parent.parent / "1" / "error.json"
        while not written(peer_error):  # whole: a file that exists may still be written after ours
            time.sleep(0.01)
        raise ConnectionError("peer gone")

    def written(path):
        try:
            return bool(json.loads(path.read_text()))
        except (OSError, ValueError):
            return False

    main()
""").replace("LINGER_S", str(LINGER_S))


@pytest.fixture(scope="module")
def crashed(tmp_path_factory):
    script = tmp_path_factory.mktemp("crash") / "crash.py"
    script.write_text(CRASHING)
    return launch(script, "--flag", "value", nproc=2, timeout_s=120)


def test_a_crashing_rank_fails_the_job_and_is_named_first(crashed):
    assert not crashed.ok and not crashed.timed_out and crashed.returncode != 0
    # Timed from the first failure, not from the start: how long the ranks take to import torch is not the question.
    assert 0 < crashed.seconds_after_first_failure < LINGER_S / 2, "torchrun waited for the lingering rank"
    assert [failure.rank for failure in crashed.failures] == [1, 0]
    assert crashed.root_cause.error == "ValueError: rank 1 broke"
    assert crashed.root_cause.exitcode == -15, "rank 1 was still running when torchrun stopped it (SIGTERM)"
    assert crashed.failures[1].exitcode == 1 and crashed.failures[1].error == "ConnectionError: peer gone"
    assert "first to fail: rank 1 (signal SIGTERM): ValueError: rank 1 broke" in repr(crashed)
    assert "rank 1" in crashed._repr_html_() and "failed" in crashed._repr_html_()


def test_each_rank_output_is_kept_apart(crashed):
    assert "rank 0 of 2, arguments ['--flag', 'value']" in crashed.output(0)
    assert "rank 1 of 2" in crashed.output(1) and "rank 1 of 2" not in crashed.output(0)
    assert "ValueError: rank 1 broke" in crashed.output(1)
    with pytest.raises(KeyError, match="ranks \\[0, 1\\]"):
        crashed.output(2)


def test_check_raises_with_the_failing_rank_and_its_error(crashed):
    with pytest.raises(LaunchFailed, match="first to fail: rank 1 .*ValueError: rank 1 broke"):
        crashed.check()


def test_a_hung_job_is_killed_with_all_its_processes(tmp_path, monkeypatch):
    # A stand-in for torchrun that, like it, starts its worker in a session of its own, and then both hang.
    pid_file = tmp_path / "worker.pid"
    hanging_launcher = tmp_path / "launcher.py"
    hanging_launcher.write_text(
        textwrap.dedent(f"""
        import subprocess, sys, time
        worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
        open({str(pid_file)!r}, "w").write(str(worker.pid))
        print("worker started", flush=True)
        time.sleep(600)
    """)
    )
    script = tmp_path / "script.py"
    script.write_text("")
    monkeypatch.setattr(
        perflab.distributed,
        "torchrun_command",
        lambda script, args, nproc, log_dir: [sys.executable, str(hanging_launcher)],
    )
    run = launch(script, nproc=2, timeout_s=2)
    assert run.timed_out and not run.ok and run.returncode is None
    assert 2 <= run.seconds < 2 + 5 + 3, "killed when the limit passed, after at most the grace period"
    assert "worker started" in run.console and "limit" in repr(run)
    worker = int(pid_file.read_text())
    assert not psutil.pid_exists(worker) or psutil.Process(worker).status() == psutil.STATUS_ZOMBIE
    with pytest.raises(LaunchFailed, match="killed after its 2 s limit"):
        run.check()


# Rank 1 aborts (SIGABRT, as a crash in C++ does) without an error file; rank 0 waits until torchrun stops it.
ABORTING = textwrap.dedent("""
    import os, time
    if os.environ["RANK"] == "1":
        print("rank 1 about to abort", flush=True)
        os.abort()
    time.sleep(60)
""")


def test_a_rank_that_crashed_is_named_before_the_rank_torchrun_stopped(tmp_path, monkeypatch):
    (tmp_path / "abort.py").write_text(ABORTING)
    monkeypatch.chdir(tmp_path)
    run = launch("abort.py", nproc=2, timeout_s=60)  # a relative path: the ranks start in the script's folder
    assert [(failure.rank, failure.exitcode) for failure in run.failures] == [(1, -6), (0, -15)]
    with pytest.raises(
        LaunchFailed, match=r"(?s)first to fail: rank 1 \(signal SIGABRT\).*rank 1's output.*about to abort"
    ):
        run.check()


def test_an_error_file_cut_short_keeps_its_time_but_no_message(tmp_path):
    # torchrun stops the other ranks as soon as one fails: one may be stopped halfway through writing its file.
    attempt = tmp_path / "run_id" / "attempt_0"
    for rank, error_json in ((0, ""), (1, json.dumps({"message": {"message": "ValueError: broke"}}))):
        (attempt / str(rank)).mkdir(parents=True)
        (attempt / str(rank) / "error.json").write_text(error_json)
    outputs, errors = perflab.distributed._read_rank_logs(tmp_path)
    assert outputs == {0: "", 1: ""}
    assert errors[0][1] == "" and errors[1][1] == "ValueError: broke"
    assert errors[0][0] > 0


def _run_rank_process(script, *args):
    return subprocess.run(
        [sys.executable, "-m", "perflab.rank_process", str(script), *args], capture_output=True, text=True, timeout=60
    )


@pytest.mark.parametrize(
    "body, status, stderr",
    [
        ("import sys; sys.exit(3)", 3, ""),
        ("import sys; sys.exit('stopped: bad input')", 1, "stopped: bad input"),
        ("raise ValueError('broken')", 1, "ValueError: broken"),
        ("pass", 0, ""),
    ],
)
def test_a_rank_process_exits_as_python_would(tmp_path, body, status, stderr):
    script = tmp_path / "script.py"
    script.write_text(body)
    finished = _run_rank_process(script)
    assert finished.returncode == status and stderr in finished.stderr


def test_a_rank_process_runs_the_script_as_main_and_waits_for_its_threads_and_exit_handlers(tmp_path):
    (tmp_path / "helper.py").write_text("VALUE = 42")
    script = tmp_path / "script.py"
    script.write_text(
        textwrap.dedent("""
        import atexit, sys, threading, time
        from helper import VALUE   # beside the script, as with `python script.py`
        atexit.register(lambda: print("exit handler ran"))
        threading.Thread(target=lambda: (time.sleep(0.5), print("thread finished"))).start()
        print(__name__, VALUE, sys.argv[1:], end=" ")   # no newline: the output is flushed all the same
    """)
    )
    finished = _run_rank_process(script, "--flag", "value")
    assert finished.returncode == 0, finished.stderr
    assert finished.stdout == "__main__ 42 ['--flag', 'value'] thread finished\nexit handler ran\n"


@pytest.mark.parametrize("arguments", [dict(nproc=0), dict(nproc=1.5), dict(timeout_s=0)])
def test_launch_rejects_bad_arguments(tmp_path, arguments):
    script = tmp_path / "script.py"
    script.write_text("")
    with pytest.raises(ValueError):
        launch(script, **arguments)


def test_launch_needs_a_script(tmp_path):
    with pytest.raises(FileNotFoundError, match="missing.py"):
        launch(tmp_path / "missing.py")


ONE_RANK = textwrap.dedent("""
    import json, os, sys
    import torch, torch.distributed as dist
    dist.init_process_group("gloo")
    total = torch.tensor([3.0])
    dist.all_reduce(total)
    record = {"rank": dist.get_rank(), "world": dist.get_world_size(), "total": total.item(), "argv": sys.argv[1:],
              "local_rank": os.environ["LOCAL_RANK"], "first_path": sys.path[0]}
    if "--fail" in sys.argv:
        raise ValueError("failed inside the rank")
    dist.destroy_process_group()
    open(sys.argv[1], "w").write(json.dumps(record))
""")


def test_run_as_one_rank_runs_the_script_here_as_a_world_of_one(tmp_path, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    script = tmp_path / "one.py"
    script.write_text(ONE_RANK)
    argv, path = list(sys.argv), list(sys.path)
    run_as_one_rank(script, tmp_path / "out.json")
    record = json.loads((tmp_path / "out.json").read_text())
    assert record == {
        "rank": 0,
        "world": 1,
        "total": 3.0,
        "argv": [str(tmp_path / "out.json")],
        "local_rank": "0",
        "first_path": str(tmp_path),
    }
    assert "RANK" not in os.environ and sys.argv == argv and sys.path == path


def test_run_as_one_rank_raises_the_script_error_and_cleans_up(tmp_path):
    script = tmp_path / "one.py"
    script.write_text(ONE_RANK)
    environment = dict(os.environ)
    with pytest.raises(ValueError, match="failed inside the rank"):
        run_as_one_rank(script, tmp_path / "out.json", "--fail")
    assert not dist.is_initialized(), "the process group the script left behind is destroyed"
    assert dict(os.environ) == environment
    with pytest.raises(FileNotFoundError):
        run_as_one_rank(tmp_path / "missing.py")
