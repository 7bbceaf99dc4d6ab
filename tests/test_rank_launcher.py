"""The rank launcher (recipes_source/rank_launcher.py): failures, deadlines, world sizes, spawn.

The recipes' own tests run it the ways a reader does (the download under python, torchrun and
two torchrun agents); these tests check what a reader sees when something goes wrong.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import rank_launcher
import torch

SCRIPTS = Path(__file__).parent / "launcher_scripts"


def test_a_raising_rank_fails_the_launch_with_its_traceback(recipe_runner):
    result = recipe_runner.script(SCRIPTS / "raising_rank.py", timeout=120)
    assert result.returncode != 0
    error = result.stderr
    assert "RankFailedError: recipe 'raising_rank': rank 1 failed: rank 1 raised" in error, error
    assert "ValueError: loss is NaN on purpose" in error
    assert "rank 1 reached step 7" in error, "the failing rank's output is in the error"
    assert "timed out" not in error, "a raising rank must not wait for the deadline"
    assert recipe_runner.leftovers() == []
    assert recipe_runner.processes_left() == []


def test_the_rank_that_raised_first_is_the_cause_not_one_stopped_while_it_wrote_that_it_failed(
    tmp_path,
):
    # Rank 1 raised; rank 0's barrier then failed, and the launcher stopped rank 0 while it
    # was writing its record (an empty file): the error names rank 1 and shows its traceback.
    (tmp_path / "rank0.failed").write_text("")
    (tmp_path / "rank1.failed").write_text(repr(1.0e9))
    outputs = ["rank 0 reached step 7\n", "rank 1 reached step 7\nValueError: loss is NaN\n"]
    message = rank_launcher._describe_failure("raising", (0, "exit code 1"), outputs, tmp_path)
    assert message.startswith("recipe 'raising': rank 1 failed: rank 1 raised\n"), message
    assert (
        "----- output and traceback of rank 1 -----\nrank 1 reached step 7\nValueError" in message
    )


@pytest.mark.long
def test_a_hanging_rank_fails_at_the_deadline(recipe_runner):
    # 15 s: time for both ranks to start on a loaded machine before the deadline
    result = recipe_runner.script(
        SCRIPTS / "hanging_rank.py", timeout=120, DCP_RECIPES_TIMEOUT="15"
    )
    assert result.returncode != 0
    assert "recipe 'hanging_rank': rank 0 failed: timed out after 15 s" in result.stderr
    assert "rank 0 started" in result.stderr
    assert recipe_runner.leftovers() == []
    assert recipe_runner.processes_left() == []


def test_a_bad_world_size_is_a_clear_error(recipe_runner):
    result = recipe_runner.script(SCRIPTS / "raising_rank.py", world_size=0)
    assert result.returncode != 0
    assert "DCP_RECIPES_WORLD_SIZE must be a positive integer, got '0'" in result.stderr
    assert "reached step" not in result.stderr, "no rank starts"
    assert recipe_runner.leftovers() == []


def test_more_ranks_than_gpus_is_refused_before_any_rank_starts(recipe_runner):
    result = recipe_runner.script(SCRIPTS / "more_ranks_than_gpus.py", world_size=2)
    assert result.returncode != 0
    assert (
        "DCP_RECIPES_WORLD_SIZE=2 asks for more ranks than this machine has GPUs (1): "
        "NCCL needs one GPU per rank"
    ) in result.stderr
    assert "a rank started" not in result.stdout + result.stderr
    assert recipe_runner.leftovers() == []


@pytest.mark.parametrize(("gpus", "expected"), [(0, 2), (1, 1), (8, 8)])
def test_default_world_size_is_one_rank_per_gpu(monkeypatch, gpus, expected):
    monkeypatch.delenv("DCP_RECIPES_WORLD_SIZE", raising=False)
    for name in ("RANK", "WORLD_SIZE", "MASTER_PORT", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpus > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    assert rank_launcher._world_size() == expected


def test_looking_for_gpus_never_initialises_cuda_in_the_launching_process(monkeypatch):
    """On a CUDA build, the CUDA runtime's device count would break every rank forked after it.

    Simulated here (a CPU build has no CUDA): the runtime's count fails the test, NVML's says 2.
    """

    def cuda_runtime_device_count():
        raise AssertionError("cudaGetDeviceCount ran in the launching process: forks would fail")

    monkeypatch.setattr(torch.cuda, "_is_compiled", lambda: True)
    monkeypatch.setattr(torch.cuda, "_device_count_nvml", lambda: 2)
    monkeypatch.setattr(torch._C, "_cuda_getDeviceCount", cuda_runtime_device_count, raising=False)
    monkeypatch.setattr(torch.cuda, "_cached_device_count", None)
    assert rank_launcher._use_gpus() is True
    assert torch.cuda.is_available() is True, "a recipe's own check, after the launcher's import"


def test_spawned_helper_processes_do_not_run_the_recipe_again(recipe_runner):
    output = recipe_runner.script(SCRIPTS / "spawning_rank.py", timeout=120)
    text = output.stdout + output.stderr
    assert output.returncode == 0, text[-4000:]
    assert text.count("top level of the script ran") == 1, text
    assert "[rank0] child ran" in text and "[rank1] child ran" in text, text
    assert "[rank1] rank 1: spawned child exited with 0" in text, text
    assert recipe_runner.leftovers() == []
    assert recipe_runner.processes_left() == []


def test_a_rank_killed_by_a_signal_is_named_as_the_cause(recipe_runner):
    """Rank 0 raises in its barrier when rank 1 dies, but the cause is rank 1's SIGKILL."""
    result = recipe_runner.script(SCRIPTS / "killed_rank.py", timeout=120)
    assert result.returncode != 0
    assert "recipe 'killed_rank': rank 1 failed: killed by SIGKILL" in result.stderr
    assert "----- output and traceback of rank 1 -----\nrank 1 started" in result.stderr
    assert recipe_runner.leftovers() == []
    assert recipe_runner.processes_left() == []


def test_a_one_process_step_leaves_no_thread_behind_in_the_launching_process(recipe_runner):
    result = recipe_runner.script(SCRIPTS / "one_process_step.py", timeout=120)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    assert "one-process step: threads running here: 2" in output, "unlabelled, printed once"
    assert "the step ran in another process: True" in output
    assert "threads in the launching process: ['MainThread']" in output
    assert "[rank1] rank 1: threads ['MainThread']" in output
    assert recipe_runner.leftovers() == []


@pytest.mark.parametrize(
    ("kind", "named"),
    [
        ("python", "Python thread 'left-running' (runs Event.wait)"),
        # The store the launcher itself used to host: its server runs on a thread of its own.
        ("tcp-store", "native thread 'pt_tcpstore_uv'"),
        # A thread of a library the launcher knows nothing of.
        ("native:libfoo_worker", "native thread 'libfoo_worker'"),
    ],
)
def test_the_launcher_refuses_to_fork_beside_a_running_thread(recipe_runner, kind, named):
    result = recipe_runner.script(
        SCRIPTS / "thread_left_running.py", 2, 120, THREAD_LEFT_RUNNING=kind
    )
    output = result.stdout + result.stderr
    assert result.returncode == 3, output[-4000:]
    assert "refused: recipe 'thread_left_running': will not fork 2 rank(s)" in output
    assert named in output, output
    assert "a rank started" not in output, "no rank starts"
    assert recipe_runner.leftovers() == []


def test_a_launch_forks_from_a_process_without_threads_of_its_own(recipe_runner):
    """No refusal where the only threads are those that stop at a fork (numpy's OpenBLAS)."""
    result = recipe_runner.script(
        SCRIPTS / "thread_left_running.py", 2, 120, THREAD_LEFT_RUNNING="none"
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    assert "threads before the launch: 2" in output, "OpenBLAS's pool runs beside the main thread"
    assert "[rank0] a rank started" in output and "[rank1] a rank started" in output


@pytest.mark.parametrize("name", ["cuda00001800007", "jemalloc_bg_thd"])
def test_a_launch_forks_beside_the_threads_nvml_and_jemalloc_start(recipe_runner, name):
    """NVML's thread (started by a GPU count on an H200 machine) and jemalloc's purging
    thread are known to be safe: ranks start beside them, still running."""
    result = recipe_runner.script(
        SCRIPTS / "thread_left_running.py", 2, 120, THREAD_LEFT_RUNNING=f"native:{name}"
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    assert f"'{name}'" in output.split("threads before the launch:")[1].splitlines()[0]
    assert "[rank0] a rank started" in output and "[rank1] a rank started" in output


def test_a_pages_run_stamp_names_its_first_launch(recipe_runner, tmp_path):
    """A later launch on other ranks (a page shows something on two CPU ranks, say) does not
    rename the machine the page ran on; only a launch on GPUs would."""
    stamps = tmp_path / "stamps"
    result = recipe_runner.script(
        SCRIPTS / "two_launches.py", 2, 120, DCP_RECIPES_STAMP_DIR=str(stamps)
    )
    assert result.returncode == 0, result.stdout + result.stderr
    stamp = json.loads((stamps / "two_launches.json").read_text())
    assert stamp["world_size"] == 2 and stamp["backend"] == "gloo", stamp
    # The host: its memory, and the storage of the temporary directory (shared_tempdir's).
    facts = rank_launcher.machine_facts(recipe_runner.env()["TMPDIR"])
    assert (stamp["memory_gib"], stamp["storage"]) == (facts["memory_gib"], facts["storage"])
