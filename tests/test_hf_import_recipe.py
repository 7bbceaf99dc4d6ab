"""The Hugging Face import page: what the build proved, at 2 ranks and at 3, and its download.

The build decides every claim of the page (each rank reads only its shards of a Hugging Face
checkpoint; both ways of loading a full state dict give the file's model, and broadcasting
from rank 0 spares the other ranks' host memory; each key mismatch fails where the page says
and its fix loads the checkpoint) and keeps the outcome in its results file; the tests read
it. One run of the source at 3 ranks decides the claims where shards are uneven (2048
embedding rows do not split evenly in three). The download runs alone, under python and
under torchrun, and must compute what the page shows.
"""

from __future__ import annotations

import os
import statistics

import pytest
from page_tools import results as page_results
from recipe_runner import (
    RECIPES,
    assert_no_traceback,
    assert_ok,
    build_results,
    checkpoint_files_in_repo,
    numbers_in,
    page_outputs,
)

RECIPE = "hf_import_recipe"
NUM_TENSORS = 39  # a 4-layer Llama: 9 tensors per layer, embeddings, final norm, lm_head
NUM_PARAMETERS = 8_128_768
MODEL_BYTES = NUM_PARAMETERS * 4  # float32
MISSING = "RuntimeError: Missing key in checkpoint state_dict: {}."
# Every rank's failed loads, in order, and what the fix then loaded.
KEY_MISMATCHES = {
    "compiled-prefix-fails": (["_orig_mod.lm_head.weight"], "compiled-model-loads"),
    "wrapper-keys-fail": (
        ["model.lm_head.weight", "value_head.bias"],
        "wrapper-loads-the-checkpoint-keys",
    ),
    "tied-lm-head-fails": (["lm_head.weight"], "tied-model-loads"),
}
LOSS = r"^\[rank\d\] step \d: loss \d\.\d{4}$"
LISTED = r"^\S+\.(?:safetensors|json) +[\d,]+ bytes$"
PRINTED = r"^\[rank\d\] (?:loaded \d+ tensors.*|holds \d+ tensors.*|  RuntimeError: .*)$"


@pytest.fixture(scope="module")
def built():
    return build_results(RECIPE)


def test_every_listed_claim_held_in_the_build(built):
    listed = page_results.manifest(RECIPE)["claims"]
    assert {name: built["claims"][name]["held"] for name in listed} == dict.fromkeys(listed, True)
    for name in listed:
        evidence = built["claims"][name]["evidence"]
        if "differ" in evidence and "missing" in evidence:  # a bit-for-bit comparison
            assert evidence["differ"] == evidence["missing"] == evidence["unexpected"] == []


def test_each_rank_reads_only_its_shards(built):
    assert built["values"]["model-bytes"] == MODEL_BYTES
    assert built["values"]["tensor-bytes-read"] == {"0": MODEL_BYTES // 2, "1": MODEL_BYTES // 2}
    assert built["claims"]["hub-checkpoint-loads-sharded"]["evidence"]["tensors"] == NUM_TENSORS


def test_only_rank_0_holds_the_gathered_state_dict(built):
    assert built["claims"]["full-state-dict-on-rank-0-only"]["evidence"]["by_rank"] == [39, 0]
    assert built["claims"]["full-state-dict-file-is-the-model"]["evidence"]["tensors"] == 39


def medians(peaks: dict) -> dict[int, float]:
    """Each rank's median peak growth, from the raw values the build recorded."""
    return {int(rank): statistics.median(calls[0]) for rank, calls in peaks.items()}


def test_broadcasting_from_rank_0_spares_the_other_ranks_host_memory(built):
    peaks = built["values"]["peak-growth-mib"]
    every_rank, from_rank0 = medians(peaks["load_on_every_rank"]), medians(peaks["load_from_rank0"])
    assert sorted(every_rank) == sorted(from_rank0) == [0, 1]
    assert all(len(calls[0]) == 3 for way in peaks.values() for calls in way.values()), "3 runs"
    # Rank 1 grows less when rank 0 sends it its shards than when it reads the whole file;
    # rank 0, which still reads the file, grows more than rank 1.
    assert from_rank0[1] < every_rank[1] and from_rank0[1] < from_rank0[0]
    # The claim's verdict rests on these numbers: rank 1's, the only rank other than 0.
    verdict = built["claims"]["broadcast-needs-less-host-memory"]["evidence"]
    assert verdict["a"]["median"] == from_rank0[1] and verdict["b"]["median"] == every_rank[1]
    assert verdict["effect"] == pytest.approx(every_rank[1] - from_rank0[1])
    assert not verdict["within_noise"] and verdict["effect"] > verdict["noise"]
    train = built["claims"]["both-loads-train-alike"]["evidence"]
    assert train["every_rank"] == train["from_rank0"] and len(train["every_rank"]) == 2


@pytest.mark.parametrize("claim", sorted(KEY_MISMATCHES))
def test_each_key_mismatch_fails_at_its_key_then_its_fix_loads(built, claim):
    keys, fixed = KEY_MISMATCHES[claim]
    failed = built["claims"][claim]["evidence"]
    assert failed["errors"] == ["CheckpointException"]
    assert failed["by_rank"] == {rank: [MISSING.format(key) for key in keys] for rank in "01"}
    expected_tensors = NUM_TENSORS - 1 if claim.startswith("tied") else NUM_TENSORS
    assert built["claims"][fixed]["evidence"]["tensors"] == expected_tensors


def test_tied_embeddings_and_the_value_head(built):
    claims = built["claims"]
    assert claims["save-pretrained-drops-lm-head"]["evidence"]["tensors"] == NUM_TENSORS - 1
    assert claims["lm-head-stays-tied"]["evidence"]["tied"] == [True, True]
    not_loaded = claims["value-head-keeps-its-weights"]["evidence"]["not_loaded"]
    assert not_loaded == [["value_head.weight", "value_head.bias"]] * 2
    assert claims["checkpoint-exception-is-not-an-exception"]["held"] is True


@pytest.mark.download
def test_download_computes_what_the_page_shows(recipe_runner):
    """The page's proofs watch the recipe, they do not change it: same losses, same files."""
    output = assert_ok(recipe_runner.notebook_run(RECIPE, world_size=2))
    shown = "".join(page_outputs(RECIPE))
    for pattern in (LOSS, LISTED, PRINTED):
        assert numbers_in(output, pattern) == numbers_in(shown, pattern) != [], pattern
    assert "page_tools" not in output and "differ" not in output, "the proofs are the build's"
    assert_no_traceback(output)
    assert recipe_runner.leftovers() == []
    assert recipe_runner.processes_left() == []


@pytest.mark.ranks
def test_claims_hold_on_three_ranks_with_uneven_shards(recipe_runner):
    """2048 embedding rows in three: each rank reads its own 683 or 682, together the model."""
    recipes_before = sorted(os.listdir(RECIPES))
    run, results = recipe_runner.source(RECIPE, world_size=3)
    assert_ok(run)
    held = {name: outcome["held"] for name, outcome in results["claims"].items()}
    assert held == dict.fromkeys(page_results.manifest(RECIPE)["claims"], True), held
    read = {int(rank): count for rank, count in results["values"]["tensor-bytes-read"].items()}
    assert sorted(read) == [0, 1, 2] and sum(read.values()) == MODEL_BYTES
    assert len(set(read.values())) > 1, "uneven shards: the ranks read different amounts"
    assert max(read.values()) < MODEL_BYTES / 3 + 2**20
    assert results["claims"]["full-state-dict-on-rank-0-only"]["evidence"]["by_rank"] == [39, 0, 0]
    peaks = results["values"]["peak-growth-mib"]
    every_rank, from_rank0 = medians(peaks["load_on_every_rank"]), medians(peaks["load_from_rank0"])
    assert all(from_rank0[rank] < min(every_rank[rank], from_rank0[0]) for rank in (1, 2))
    assert sorted(os.listdir(RECIPES)) == recipes_before
    assert checkpoint_files_in_repo() == []
    assert recipe_runner.leftovers() == []


@pytest.mark.torchrun
def test_download_under_torchrun(recipe_runner):
    output = assert_ok(recipe_runner.torchrun(RECIPE, nproc=2))
    assert "[rank1] loaded 38 tensors; lm_head still tied to the embedding: True" in output
    assert "[rank0] holds 39 tensors" in output and "[rank1] holds 0 tensors" in output
    # torchrun's ranks print as they go: the same losses as the page, in another order.
    losses = sorted(numbers_in(output, LOSS))
    assert losses == sorted(numbers_in("".join(page_outputs(RECIPE)), LOSS)) != []
    assert_no_traceback(output)
    assert recipe_runner.leftovers() == []
    assert checkpoint_files_in_repo() == []
