"""The async_save page: what the build measured and proved, and its download alone.

The build decides every claim of the page and records what it measured; these tests read
that results file (and check that its numbers add up), then run the download as a reader
does, alone, under python and under torchrun, and check that it computes what the page
shows. The torn checkpoints the page used to show are tests/test_torn_checkpoints_recipe.py.

What the page showed before issue 19, and still does (values and claims below): Adam's
step 1 before training, the parameters and the checkpoint's size; the phases of a save and
each rank's staged copy; each save of the three loops (blocked, waiting, complete after);
the strategies (stall, upload, steps in flight, slow-down); the checkpoint process (one per
rank, resident memory, its log and first request, the first upload, the shared-memory
handover, /dev/shm); every run's checkpoints complete; every run's newest checkpoint equal
to the state at its save and not to the end; on a GPU, pinned buffers and copy speeds.
"""

from __future__ import annotations

import os
import statistics

import pytest
from page_tools import results
from recipe_runner import (
    RECIPES,
    assert_no_traceback,
    assert_ok,
    build_results,
    checkpoint_files_in_repo,
    numbers_in,
    page_outputs,
)

RECIPE = "async_save_recipe"
RUNS = {"async_save": "async-save", "one reused DefaultStager": "one-stager"}
RUNS["checkpoint process"] = "process"
SAVED_AT = [1, 3, 6, 9]
PARAMETERS = 3 * (1024 * 1024 + 1024)  # three Linear(1024, 1024)
TENSORS = 24  # 6 weights and biases, and Adam's exp_avg, exp_avg_sq and step for each
LOSS = r"^\[rank\d\] loss (\S+) at step 1, (\S+) at 11; saved at \[1, 3, 6, 9\]$"


@pytest.fixture(scope="module")
def built():
    return build_results(RECIPE)


@pytest.fixture(scope="module")
def values(built):
    return built["values"]


def test_every_listed_claim_held_and_gpu_claims_only_on_a_gpu(built):
    listed = results.manifest(RECIPE)
    claims = built["claims"]
    assert all(claims[name]["held"] is True for name in listed["claims"]), claims
    gpu = {claims[name]["held"] for name in listed["gpu_claims"]}
    assert gpu in ({True}, {None}), "all measured on a GPU, or none of them on CPU"
    assert (built["values"]["pinning"] is None) == (gpu == {None})


def test_the_checkpoint_is_three_times_the_weights(values):
    # Adam's two moments per parameter, and one 4-byte step counter per parameter tensor.
    assert values["checkpoint_bytes"] == 3 * 4 * PARAMETERS + 6 * 4
    ranks = len(values["staged_bytes"])
    assert sum(values["staged_bytes"]) == values["checkpoint_bytes"] + (ranks - 1) * 6 * 4


def test_the_phases_add_up_and_async_save_blocks_for_two_of_them(built, values):
    phases = values["phases_s"]
    collect, stage = phases["1. collect the state dict"], phases["2. stage: copy it to host memory"]
    assert all(len(seconds) == 3 and min(seconds) > 0 for seconds in phases.values())
    assert phases["async_save (1 + 2)"] == pytest.approx(
        [c + s for c, s in zip(collect, stage, strict=True)]
    )
    evidence = built["claims"]["async-save-blocks-less"]["evidence"]
    assert evidence["a"]["values"] == phases["async_save (1 + 2)"]
    assert evidence["b"]["median"] == statistics.median(phases["dcp.save (one call)"])
    pairs = list(zip(evidence["a"]["values"], evidence["b"]["values"], strict=True))
    assert 2 * sum(a < b for a, b in pairs) > len(pairs), "less in most attempts"


@pytest.mark.parametrize("run", list(RUNS))
def test_each_loop_saved_at_1_3_6_9_and_its_numbers_add_up(values, run):
    summary = values["strategies"][run]
    saves = summary["saves"]
    assert [save["step"] for save in saves] == SAVED_AT
    assert [save["awaited"] for save in saves] == [True, False, False, False]
    assert all(save["blocked"] >= save["waited"] >= 0 and save["upload"] > 0 for save in saves)
    stalls = [save["blocked"] for save in saves[1:]]
    assert summary["stalls_s"] == stalls
    assert summary["stall_ms"] == pytest.approx(statistics.median(stalls) * 1e3)
    uploads = [save["upload"] for save in saves[1:]]
    assert summary["upload_ms"] == pytest.approx(statistics.median(uploads) * 1e3)
    busy, idle = summary["steps_busy_s"], summary["steps_idle_s"]
    assert summary["steps"] == len(busy) + len(idle) == 10, "11 steps, the first left out"
    assert summary["steps_in_flight"] == len(busy) > 0
    if busy and idle:
        slower = statistics.median(busy) / statistics.median(idle) - 1
        assert summary["slow_down"] == pytest.approx(slower)


def test_the_first_upload_through_a_process_includes_starting_it(values):
    saves = values["strategies"]["checkpoint process"]["saves"]
    assert saves[0]["upload"] > max(save["upload"] for save in saves[1:])


def test_the_headline_is_the_tables_stalls(values):
    headline = values["headline"]
    dcp_save = statistics.median(values["phases_s"]["dcp.save (one call)"]) * 1e3
    assert headline["dcp.save stall ms"] == pytest.approx(dcp_save)
    for run, summary in values["strategies"].items():
        assert headline[f"{run} stall ms"] == summary["stall_ms"]
    pinned = {key for key in headline if "pinned" in key or "GB/s" in key}
    assert bool(pinned) == (values["pinning"] is not None), "GPU numbers only from a GPU"


def test_each_rank_had_one_checkpoint_process_that_logged_every_save(built, values):
    evidence = built["claims"]["one-checkpoint-process-per-rank"]["evidence"]
    ranks = [str(rank) for rank in range(len(values["staged_bytes"]))]
    assert evidence == {"running": dict.fromkeys(ranks, 1), "served": dict.fromkeys(ranks, 5)}
    for rank, lines in values["one-checkpoint-process-per-rank-logs"].items():
        received = [line for line in lines if "Received async checkpoint request" in line]
        assert received[0].endswith("/process/step-1"), f"rank {rank}: {received[0]}"
        assert f"[{rank}]" in received[0], "the checkpoint process names its rank"
    assert values["dev_shm_bytes"] > 0


@pytest.mark.parametrize("run", list(RUNS.values()))
def test_each_runs_checkpoint_is_the_state_at_its_save_not_at_the_end(built, run):
    at_save = built["claims"][f"{run}-is-the-state-at-the-save"]["evidence"]
    assert at_save["tensors"] == TENSORS and at_save["values"] > 0
    assert at_save["differ"] == at_save["missing"] == at_save["unexpected"] == []
    assert built["claims"][f"{run}-is-not-the-state-after"]["evidence"]["differ"] == TENSORS


@pytest.mark.download
def test_download_computes_what_the_page_shows(recipe_runner):
    """The page's watches time and snapshot the recipe, they do not change it."""
    recipes_before = sorted(os.listdir(RECIPES))
    output = assert_ok(recipe_runner.notebook_run(RECIPE, world_size=2))
    shown = "".join(page_outputs(RECIPE))
    assert numbers_in(output, LOSS) == numbers_in(shown, LOSS) != []
    assert len(numbers_in(output, LOSS)) == 2 * (len(RUNS) + 1), "three runs and main()"
    for run in RUNS.values():
        assert f"{run}/ complete: {{'step-1': True, 'step-3': True," in output
        assert f"[rank0] resumed from {run}/step-9" in output
    assert "page_tools" not in output and "differ" not in output, "the proofs are the build's"
    assert_no_traceback(output)
    assert recipe_runner.leftovers() == []
    assert recipe_runner.processes_left() == []
    assert sorted(os.listdir(RECIPES)) == recipes_before
    assert checkpoint_files_in_repo() == []


@pytest.mark.torchrun
def test_download_under_torchrun(recipe_runner):
    output = assert_ok(recipe_runner.torchrun(RECIPE, nproc=2))
    assert len(numbers_in(output, LOSS)) == 2 * (len(RUNS) + 1)
    assert "[rank0] resumed from torchrun/step-9" in output, "main() ran under torchrun"
    assert_no_traceback(output)
    assert recipe_runner.leftovers() == []
    assert recipe_runner.processes_left() == []
