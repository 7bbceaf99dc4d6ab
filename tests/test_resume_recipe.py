"""The resume page: what the build proved about its kills and resumes, and its download alone.

The build kills a rank in the middle of an upload and during staging, decides that each
crash happened where it was planned (the kill's own record, the launcher's error, the
files on disk) before it compares the restart with the uninterrupted run, and keeps the
outcomes in its results file: the tests read it. The download (the recipe without the
page's kills and proofs) runs alone and must compute the losses the page shows: page work
never changes what the recipe computes. The page before issue 19 showed a loss of 0.7037
at step 10, where the same loop pasted gives 0.6481: its hidden snapshot gave Adam its
state before the first step.

Issue 20: "complete" is what verify_checkpoint passes, and rank 0 cleans up in a thread of
its own; the bad input and main() under torchrun are on the resume-fallback page now
(tests/test_resume_fallback_recipe.py).

Cost: the download under python and under torchrun, and the source on one rank (what
``make gpu-check`` runs on a machine with one GPU: the rank killed is rank 0).
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

RECIPE = "resume_recipe"
KEEP, SAVE_EVERY, NUM_STEPS = 2, 10, 60
CRASHES = {"upload-crash": 30, "staging-crash": 30}  # the step each restart resumes from
# Model: 3 weights and 3 biases; Adam: exp_avg, exp_avg_sq and step of each; 2 RNG states.
TENSORS = 6 + 18 + 2
LOSS = r"^(?:\[rank0\] )?step (\d+): loss (\d\.\d{4});"


@pytest.fixture(scope="module")
def results():
    return build_results(RECIPE)


@pytest.fixture(scope="module")
def claims(results):
    return results["claims"]


def test_every_listed_claim_held(claims):
    assert_listed_claims_held(RECIPE, claims)


def test_the_upload_crash_happened_where_it_was_planned(claims):
    evidence = claims["upload-crash"]["evidence"]
    (kill,) = evidence["fired"]
    assert kill["rank"] == kill["world_size"] - 1, "the last rank was killed"
    assert kill["bytes"] == 64 * 1024 == evidence["file_cut_at"], "its file ends at the kill"
    assert kill["path"].endswith(f"step-00000040/__{kill['rank']}_0.distcp")
    assert evidence["failure"].endswith(f"rank {kill['rank']} failed: killed by SIGKILL")
    assert evidence["torn_without_metadata"] and evidence["complete_with_metadata"]


def test_the_staging_crash_happened_where_it_was_planned(claims):
    evidence = claims["staging-crash"]["evidence"]
    (kill,) = evidence["fired"]
    assert (kill["staging"], kill["tensors"]) == (4, 3), "the 4th save, after 3 tensors"
    assert kill["rank"] == kill["world_size"] - 1
    assert evidence["named_in_failure"] and evidence["file_cut_at"] is None


@pytest.mark.parametrize("crash", sorted(CRASHES))
def test_each_restart_goes_on_bit_for_bit(claims, crash):
    start = CRASHES[crash]
    losses = claims[f"{crash}-losses"]["evidence"]
    assert losses["keys"] == losses["actual_keys"] == [start + 1, NUM_STEPS]
    assert losses["compared"] == NUM_STEPS - start and losses["differ"] == []
    state = claims[f"{crash}-state"]["evidence"]
    assert state["tensors"] == TENSORS and state["values"] > 0
    assert state["differ"] == state["missing"] == state["unexpected"] == []


def test_clean_up_keeps_the_newest_k_and_never_the_one_in_flight(claims):
    evidence = claims["keep-latest-k"]["evidence"]
    saves = range(SAVE_EVERY, NUM_STEPS + 1, SAVE_EVERY)
    for step, complete in zip(saves, evidence["complete_at_each_save"], strict=True):
        assert step not in complete, "a save starts into a directory of its own"
        if step > SAVE_EVERY:  # the previous save was awaited: the newest complete one
            assert max(complete) == step - SAVE_EVERY
        assert len(complete) <= KEEP + 1, f"step {step}: clean-up kept too many: {complete}"
    assert evidence["left"] == list(saves)[-KEEP:]


@pytest.mark.download
def test_download_computes_what_the_page_shows(recipe_runner):
    """The page's kills and watches do not change the recipe: every launch of the download
    (none of them killed) prints the losses of the page's uninterrupted run."""
    recipes_before = sorted(os.listdir(RECIPES))
    output = assert_ok(recipe_runner.notebook_run(RECIPE, world_size=2))
    shown = "".join(page_outputs(RECIPE))
    page_losses = numbers_in(shown, LOSS)
    assert len(page_losses) > NUM_STEPS // SAVE_EVERY
    assert numbers_in(output, LOSS)[: NUM_STEPS // SAVE_EVERY] == page_losses[:6]
    assert set(numbers_in(output, LOSS)) == set(page_losses), "the same loss at every save"
    assert ("10", "0.6481") in page_losses, "what the loop gives, pasted (issue 19)"
    assert "page_tools" not in output and "the job failed" not in output
    assert_no_traceback(output)
    assert sorted(os.listdir(RECIPES)) == recipes_before
    assert checkpoint_files_in_repo() == []
    assert recipe_runner.leftovers() == []
    assert recipe_runner.processes_left() == []


@pytest.mark.torchrun
def test_download_under_torchrun(recipe_runner):
    """torchrun's two ranks train as the page's two did: the same loss at every save."""
    output = assert_ok(recipe_runner.torchrun(RECIPE, nproc=2))
    assert set(numbers_in(output, LOSS)) == set(numbers_in("".join(page_outputs(RECIPE)), LOSS))
    assert output.count("[rank0] done at step 60; kept [50, 60]") >= 4, output[-3000:]
    assert_no_traceback(output)
    assert recipe_runner.leftovers() == []


@pytest.mark.ranks
def test_claims_hold_on_one_rank(recipe_runner):
    """One rank (a machine with one GPU): the rank killed is rank 0, the only one."""
    run, results = recipe_runner.source(RECIPE, world_size=1)
    assert_ok(run)
    claims = results["claims"]
    assert all(outcome["held"] for outcome in claims.values()), claims
    for crash in CRASHES:
        (kill,) = claims[crash]["evidence"]["fired"]
        assert (kill["rank"], kill["world_size"]) == (0, 1)
    assert recipe_runner.leftovers() == []
    assert recipe_runner.processes_left() == []
