"""The getting-started page (save and load): what the build proved, and its download alone.

The build decides every claim of the page and keeps the outcome in its results file;
the tests read it. The download (the recipe without the page's proofs) runs alone, as a
reader runs it, and must compute the numbers the page shows.
"""

from __future__ import annotations

import os

import pytest
from recipe_runner import (
    RECIPES,
    SAVE_LOAD_NUMBERS,
    assert_no_traceback,
    assert_ok,
    assert_prints_what_the_page_shows,
    build_results,
    checkpoint_files_in_repo,
)

RECIPE = "save_load_recipe"
LOADS = [
    "sharded-load",
    "unsharded-load",
    "torch-save-file",
    "command-line-file",
    "round-trip-load",
]
# 4 weights and biases, and Adam's exp_avg, exp_avg_sq and step for each of them.
TENSORS = 16


@pytest.fixture(scope="module")
def claims():
    return build_results(RECIPE)["claims"]


@pytest.mark.parametrize("claim", LOADS)
def test_every_load_gave_back_the_saved_state_bit_for_bit(claims, claim):
    outcome = claims[claim]
    assert outcome["held"] is True
    evidence = outcome["evidence"]
    assert evidence["tensors"] == TENSORS and evidence["values"] > 0
    assert evidence["differ"] == evidence["missing"] == evidence["unexpected"] == []


def test_ranks_that_disagree_on_the_directory_fail_at_load(claims):
    outcomes = claims["disagreeing-directories-fail-at-load"]["evidence"]["outcomes"]
    at_rank0 = outcomes.index("every rank loads rank 0's directory: CheckpointException")
    at_own = outcomes.index("every rank loads its own directory: CheckpointException")
    rank0_dir, own_dir = outcomes[at_rank0 + 1 : at_own], outcomes[at_own + 1 :]
    # Every rank loads rank 0's directory: rank 1's shards are not there.
    assert [line.split(":")[:2] for line in rank0_dir] == [
        ["rank 0", " FileNotFoundError"],
        ["rank 1", " FileNotFoundError"],
    ]
    assert all(line.endswith("rank0-only/__1_0.distcp'") for line in rank0_dir)
    # Each loads its own: rank 1 finds no .metadata (rank 0 finds its own).
    assert len(own_dir) == 1 and own_dir[0].startswith("rank 1: AssertionError: metadata is None")


@pytest.mark.download
def test_download_computes_what_the_page_shows(recipe_runner):
    """The page's proofs watch the recipe, they do not change it: same losses, same files."""
    output = assert_ok(recipe_runner.notebook_run(RECIPE, world_size=2))
    assert_prints_what_the_page_shows(output, RECIPE, SAVE_LOAD_NUMBERS)
    assert "page_tools" not in output and "differ" not in output, "the proofs are the build's"
    assert_no_traceback(output)
    assert recipe_runner.leftovers() == []
    assert recipe_runner.processes_left() == []


@pytest.mark.ranks
def test_claims_hold_on_three_ranks_with_uneven_shards(recipe_runner):
    """64 rows do not split evenly in three: the checkpoint reshards to 1 process and back."""
    recipes_before = sorted(os.listdir(RECIPES))
    run, results = recipe_runner.source(RECIPE, world_size=3)
    assert_ok(run)
    assert all(results["claims"][claim]["held"] for claim in LOADS), results["claims"]
    assert sorted(os.listdir(RECIPES)) == recipes_before
    assert checkpoint_files_in_repo() == []
    assert recipe_runner.leftovers() == []


@pytest.mark.torchrun
def test_download_under_torchrun(recipe_runner):
    output = assert_ok(recipe_runner.torchrun(RECIPE, nproc=2))
    assert "[rank1] step 3: loss" in output
    assert "[rank1] loaded step-3: layers.0.weight[0, :3]" in output, "main() ran under torchrun"
    assert_no_traceback(output)
    assert recipe_runner.leftovers() == []


@pytest.mark.torchrun
def test_download_under_two_torchrun_agents(recipe_runner):
    node0, node1 = recipe_runner.torchrun_two_nodes(RECIPE)
    output0, output1 = assert_ok(node0), assert_ok(node1)
    assert "[rank0] loaded step-3" in output0 and "[rank1] step 3: loss" in output1
    assert recipe_runner.leftovers() == []
