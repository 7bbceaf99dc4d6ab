"""The torn-checkpoints page: what the build proved, and its download alone.

The page makes each tear happen at a known moment (``page_tools.faults`` holds the upload
once its data is written); the build decides every claim and keeps the evidence, which
these tests read. The download has no hold: its uploads fail wherever the race takes them,
and the recipe must still run alone, under python and torchrun, and reach the same ends.

What the page shows (moved from the async_save page, issue 19): the normal exit that
completes an upload in flight; the upload that raises once its group is destroyed and the
torn step-2/ (every rank's data, no .metadata); dcp.load's CheckpointException on it (a
BaseException) and load_checkpoint's IncompleteCheckpointError; a reused directory that
passes the .metadata check while written and after a tear, with torch's warning;
use_collectives=False's per-rank metadata; the resume from step-1, bit for bit; the job
that ends with its last save complete.
"""

from __future__ import annotations

import pytest
from recipe_runner import assert_listed_claims_held, assert_no_traceback, assert_ok, build_results

RECIPE = "torn_checkpoints_recipe"
TENSORS = 16  # 4 weights and biases, and Adam's exp_avg, exp_avg_sq and step for each


@pytest.fixture(scope="module")
def claims():
    return build_results(RECIPE)["claims"]


def test_every_listed_claim_held(claims):
    assert_listed_claims_held(RECIPE, claims)


def test_each_tear_happened_while_the_upload_was_held(claims):
    holds = claims["destroyed-group-fails-the-upload"]["evidence"]["holds"]
    assert len(holds) >= 1
    for records in holds.values():
        released = {r["checkpoint_id"].rsplit("/", 1)[1]: r["released_by"] for r in records}
        assert released == {"step-1": "result", "step-2": "destroy_process_group"}
        assert all(record["written"] for record in records), "held after the data, not before"


def test_dcp_load_wraps_the_missing_metadata_on_every_rank(claims):
    outcomes = claims["torn-load-raises-checkpoint-exception"]["evidence"]["outcomes"]
    for load, refused in outcomes:
        assert load.startswith("CheckpointException wrapping AssertionError: metadata is None")
        assert "step-2/.metadata" in load
        assert refused.startswith("IncompleteCheckpointError: incomplete checkpoint")


def test_resuming_skips_the_torn_checkpoint_bit_for_bit(claims):
    evidence = claims["resume-skips-the-torn-checkpoint"]["evidence"]
    assert evidence["tensors"] == TENSORS and evidence["values"] > 0
    assert evidence["differ"] == evidence["missing"] == evidence["unexpected"] == []


def assert_reaches_the_same_ends(output: str) -> None:
    """What every run shows, held or not: how far a torn upload got is the race's."""
    assert "upload in flight at sys.exit(0):" in output
    assert "after the exit, step-1/ is complete: True" in output
    # The group is gone (ValueError), or a peer's collective timed out: never nothing.
    assert "[rank0] the upload of step-2 raised " in output
    assert "[rank0] the upload of step-2 raised nothing" not in output
    assert "complete: False" in output and "CheckpointException is an Exception: False" in output
    assert "[rank0] load_checkpoint(step-2) raised IncompleteCheckpointError" in output
    assert "[rank0] reused/ passes the .metadata check while writing: True; torn: True" in output
    assert "[rank0] use_collectives=False wrote ['__0.metadata', '__1.metadata']" in output
    assert "[rank0] resumed from step-1\n" in output
    assert "resumed from step-1, saved step-2 to step-4" in output
    assert_no_traceback(output)


@pytest.mark.download
def test_download_runs_alone(recipe_runner):
    output = assert_ok(recipe_runner.notebook_run(RECIPE, world_size=2))
    assert_reaches_the_same_ends(output)
    assert "page_tools" not in output and "differ" not in output, "the proofs are the build's"
    assert recipe_runner.leftovers() == []
    assert recipe_runner.processes_left() == []


@pytest.mark.torchrun
def test_download_under_torchrun(recipe_runner):
    output = assert_ok(recipe_runner.torchrun(RECIPE, nproc=2))
    assert_reaches_the_same_ends(output)
    assert "[rank1] resumed from step-1, saved step-2 to step-4" in output
    assert recipe_runner.leftovers() == []
    assert recipe_runner.processes_left() == []
