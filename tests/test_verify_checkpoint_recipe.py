"""The verify-checkpoint page: what the build proved, the verifier's own tests, and the
download alone (issue 20).

The build destroys the default group after ``async_save`` returned and before its upload
started (``faults.staging_held_until`` holds the copy until the rank's next wait,
``faults.uploads_in_rank_order`` lets the ranks write one after the other): both uploads
succeed, ``.metadata`` lists one chunk, a 2-rank ``dcp.load`` raises nothing and one
rank's shards keep their values. The same with a dedicated group raises ValueError.
``verify_checkpoint`` refuses that checkpoint and damaged copies of a complete one.

The verifier is taken from the page's source (its ``def``, with what it needs) and run
here on checkpoints saved in this process: complete, torn, one rank's data only, a
truncated file, a missing file, and chunks that overlap.
"""

from __future__ import annotations

import os
import pickle

import pytest
import torch
import torch.distributed.checkpoint as dcp
from recipe_runner import (
    assert_listed_claims_held,
    assert_no_traceback,
    assert_ok,
    build_results,
    page_definitions,
)
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex

RECIPE = "verify_checkpoint_recipe"
TENSORS = 4  # the model's two weights and two biases, one shard of each per rank


@pytest.fixture(scope="module")
def claims():
    return build_results(RECIPE)["claims"]


def test_every_listed_claim_held(claims):
    assert_listed_claims_held(RECIPE, claims)


def test_the_early_destroy_loads_one_ranks_data_without_an_error(claims):
    loads = claims["early-destroy-loads-without-an-error"]["evidence"]["loads"]
    assert sorted(map(tuple, loads)) == [(0, TENSORS), (TENSORS, TENSORS)]


def test_a_dedicated_group_raises_on_every_rank(claims):
    errors = claims["early-destroy-of-a-dedicated-group-raises"]["evidence"]["errors"]
    assert len(errors) == 2
    assert all("is not initialized in the world group map" in error for error in errors)


def test_the_page_verifier_refused_each_damaged_checkpoint(claims):
    silent = claims["the-verifier-catches-the-silent-checkpoint"]["evidence"]["verdicts"]
    assert "cover 32,768 of its 65,536 elements" in silent["silent"]
    damaged = claims["the-verifier-catches-damaged-files"]["evidence"]["verdicts"]
    assert damaged["complete"] == "complete"
    assert damaged["no-metadata"].endswith("has no .metadata")


# --------------------------------------------------------------------------
# The verifier itself, from the page's source
# --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def page():
    return page_definitions(RECIPE, "verify_checkpoint", "IncompleteCheckpointError")


@pytest.fixture
def complete(tmp_path):
    path = str(tmp_path / "step-1")
    state = {"w": torch.arange(32.0).reshape(8, 4), "b": torch.ones(8), "note": "bytes"}
    dcp.save(state, checkpoint_id=path, no_dist=True)
    return path


def _refused(page, path) -> str:
    with pytest.raises(page["IncompleteCheckpointError"]) as refused:
        page["verify_checkpoint"](path)
    return str(refused.value)


def _rewrite_chunks(path, fqn, chunks):
    with open(os.path.join(path, ".metadata"), "rb") as file:
        metadata = pickle.load(file)
    (old,) = metadata.state_dict_metadata[fqn].chunks
    info = metadata.storage_data.pop(MetadataIndex(fqn, old.offsets))
    metadata.state_dict_metadata[fqn].chunks = chunks
    for chunk in chunks:
        metadata.storage_data[MetadataIndex(fqn, chunk.offsets)] = info
    with open(os.path.join(path, ".metadata"), "wb") as file:
        pickle.dump(metadata, file)


def test_the_verifier_passes_a_complete_checkpoint(page, complete):
    assert page["verify_checkpoint"](complete) is None


def test_the_verifier_refuses_a_torn_checkpoint(page, complete):
    os.remove(os.path.join(complete, ".metadata"))
    assert _refused(page, complete).endswith("has no .metadata")


def test_the_verifier_refuses_one_ranks_data_only(page, complete):
    half = ChunkStorageMetadata(offsets=torch.Size([4, 0]), sizes=torch.Size([4, 4]))
    _rewrite_chunks(complete, "w", [half])
    assert "the chunks of w cover 16 of its 32 elements" in _refused(page, complete)


def test_the_verifier_refuses_overlapping_chunks(page, complete):
    first = ChunkStorageMetadata(offsets=torch.Size([0, 0]), sizes=torch.Size([6, 4]))
    second = ChunkStorageMetadata(offsets=torch.Size([4, 0]), sizes=torch.Size([2, 4]))
    _rewrite_chunks(complete, "w", [first, second])  # 24 + 8 elements: the volume matches
    assert "overlap: True" in _refused(page, complete)


def test_the_verifier_refuses_a_truncated_file(page, complete):
    (data_file,) = [n for n in os.listdir(complete) if n.endswith(".distcp")]
    os.truncate(os.path.join(complete, data_file), 100)
    assert f"of {data_file}, which has 100" in _refused(page, complete)


def test_the_verifier_refuses_a_missing_file(page, complete):
    (data_file,) = [n for n in os.listdir(complete) if n.endswith(".distcp")]
    os.remove(os.path.join(complete, data_file))
    assert f"of {data_file}, which is missing" in _refused(page, complete)


# --------------------------------------------------------------------------
# The download alone
# --------------------------------------------------------------------------


def assert_reaches_the_same_ends(output: str) -> None:
    """Without the page's holds the early destroy is a race: the upload may run as a single
    process (silently) or on the group (and fail): the verifier's verdicts hold either way."""
    assert "the upload raised" in output
    assert "complete: complete" in output
    assert "no-metadata: " in output and "has no .metadata" in output
    assert "which is missing" in output and "which has " in output
    assert_no_traceback(output)


@pytest.mark.download
def test_download_runs_alone(recipe_runner):
    output = assert_ok(recipe_runner.python(RECIPE, world_size=2))
    assert_reaches_the_same_ends(output)
    assert "page_tools" not in output
    assert recipe_runner.leftovers() == []
    assert recipe_runner.processes_left() == []
