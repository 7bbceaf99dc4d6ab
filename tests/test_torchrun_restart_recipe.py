"""The torchrun-restart page: what the build proved about restarts and resharding, and its
download alone.

The build kills the last worker of a ``torchrun --max-restarts=1`` job at step 45 (attempt 0
only), decides that the kill happened and that every worker of attempt 1 resumed from step
40, compares the job's last checkpoint with an uninterrupted run's, counts how often
restarted workers form their group (plain ``init_process_group`` against the prefixed
store), and resumes on 2, 3 and 1 ranks. The tests read its results file; the download runs
alone (its torchrun job is not killed, and its launches all use the same ranks) and must
compute the losses the page shows.

Cost: the download under python (it starts torchrun itself) and under torchrun.
"""

from __future__ import annotations

import os

import pytest
from recipe_runner import (
    RECIPES,
    assert_listed_claims_held,
    assert_no_traceback,
    assert_ok,
    build_results,
    checkpoint_files_in_repo,
    numbers_in,
    page_outputs,
)

RECIPE = "torchrun_restart_recipe"
NUM_SAMPLES = 720
# 2 weights and 2 biases; Adam's exp_avg, exp_avg_sq and step for each.
TENSORS = 4 + 12
LOSS = r"^\[rank0\] step (\d+): loss (\d\.\d{4}); saved$"


@pytest.fixture(scope="module")
def results():
    return build_results(RECIPE)


@pytest.fixture(scope="module")
def claims(results):
    return results["claims"]


def test_every_listed_claim_held(claims):
    assert_listed_claims_held(RECIPE, claims)


def test_the_worker_was_killed_in_attempt_0_and_torchrun_restarted_all(claims):
    evidence = claims["torchrun-crash"]["evidence"]
    (kill,) = evidence["fired"]
    assert (kill["attempt"], kill["step"]) == (0, 45)
    assert kill["rank"] == kill["world_size"] - 1 and kill["existed"], "step 40 was complete"
    assert "exitcode: -9" in evidence["failure"]
    resumed = claims["torchrun-restart"]["evidence"]["resumed"]
    assert sorted(resumed) == [[str(rank), "40"] for rank in range(kill["world_size"])]


@pytest.mark.parametrize("claim", ["torchrun-same-state", "reshard-2-to-3", "reshard-3-to-1"])
def test_every_resume_is_bit_for_bit(claims, claim):
    evidence = claims[claim]["evidence"]
    assert evidence["tensors"] == TENSORS and evidence["values"] > 0
    assert evidence["differ"] == evidence["missing"] == evidence["unexpected"] == []


def test_the_resharded_job_sees_every_sample_once(claims):
    assert claims["every-sample-once"]["evidence"]["ranks"] == [2, 3, 1]


def test_torchdata_fast_forwards_by_samples_yielded(claims):
    """Rank 0 of 2 saved 180 samples yielded (30 batches of 6); as rank 0 of 3 it skips 180
    of its share: global position 540, rank 1 541, and rank 2 (no state) from 2."""
    evidence = claims["global-index-repeats-nothing"]["evidence"]
    assert evidence["samples_yielded"] == 180
    assert evidence["starts"] == [540, 541, 2]
    assert evidence["again"] == 40, "rank 2's 40 samples were trained on before"


def test_a_world_size_that_does_not_divide_the_batch_is_refused(claims):
    evidence = claims["uneven-world-size-refused"]["evidence"]
    assert evidence["error"] == "8 ranks cannot share a global batch of 12 evenly"


def test_the_restart_probe_counts_each_job(results):
    counts = results["values"]["restart-probe"]
    assert set(counts) == {"plain", "own-store", "own-store-2-agents"}
    for mode, count in counts.items():
        assert count["restarts"] == 3
        assert 0 <= count["formed_after_restart"] <= count["restarts"], mode
        assert count["seconds"] < 150, "the probe is bounded"
    assert [counts[mode]["agents"] for mode in counts] == [1, 1, 2]
    for mode in ("own-store", "own-store-2-agents"):
        assert counts[mode]["formed_after_restart"] == 3 and counts[mode]["exit"] == 0, mode
        assert counts[mode]["connect_failed"] == counts[mode]["hung"] == 0, mode
    assert counts["own-store"]["restart_counts"] == [3]
    # node 0's agent restarted its healthy worker without counting: a prefix of the count
    # would differ across the two agents
    assert counts["own-store-2-agents"]["restart_counts"] == [0, 3]


@pytest.mark.download
def test_download_computes_what_the_page_shows(recipe_runner):
    """Not killed, the download's torchrun job and its other launches train as the page's
    uninterrupted run does: the same loss at every save. The script, not the notebook: its
    job is this file under torchrun, and a kernel has no file."""
    recipes_before = sorted(os.listdir(RECIPES))
    output = assert_ok(recipe_runner.python(RECIPE, world_size=2))
    shown = "".join(page_outputs(RECIPE))
    page_losses = numbers_in(shown, LOSS)
    assert numbers_in(output, LOSS)[:6] == page_losses[:6] != []
    assert "[rank0] attempt 0 resumed from step None" in output, "the job ran under torchrun"
    assert "torchrun exited with 0" in output and "attempt 1" not in output
    assert "page_tools" not in output
    assert_no_traceback(output)
    assert sorted(os.listdir(RECIPES)) == recipes_before
    assert checkpoint_files_in_repo() == []
    assert recipe_runner.leftovers() == []
    assert recipe_runner.processes_left() == []


@pytest.mark.download
def test_notebook_runs_alone_and_says_where_the_job_runs(recipe_runner):
    """In a kernel the page's launches run; its torchrun job, which needs the file, says so."""
    output = assert_ok(recipe_runner.notebook_run(RECIPE, world_size=2))
    shown = "".join(page_outputs(RECIPE))
    assert numbers_in(output, LOSS)[:6] == numbers_in(shown, LOSS)[:6] != []
    assert "skipped: run the recipe's .py file (not under torchrun)" in output
    assert_no_traceback(output)
    assert recipe_runner.leftovers() == []
    assert recipe_runner.processes_left() == []


@pytest.mark.torchrun
def test_download_under_torchrun(recipe_runner):
    output = assert_ok(recipe_runner.torchrun(RECIPE, nproc=2))
    assert "skipped: run the recipe's .py file (not under torchrun)" in output
    assert "[rank0] resuming from step 30, saved on 2 ranks, now 2" in output
    assert_no_traceback(output)
    assert recipe_runner.leftovers() == []
