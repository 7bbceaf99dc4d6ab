"""The Hugging Face export page: what the build proved, at 2 ranks and at 3, and its download.

The build decides every claim of the page (the export is the trained model, bit for bit;
from_pretrained reproduces its logits; bfloat16 is float32 rounded) and keeps the outcome in
its results file; the tests read it. One run of the source at 3 ranks decides the claims
where shards are uneven (2048 embedding rows do not split evenly in three). The download
runs alone, under python and under torchrun, and must compute what the page shows.
"""

from __future__ import annotations

import os

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

RECIPE = "hf_interop_recipe"
NUM_TENSORS = 39  # a 4-layer Llama: 9 tensors per layer, embeddings, final norm, lm_head
NUM_PARAMETERS = 8_128_768
FILES = [f"model-0000{k}-of-00003.safetensors" for k in (1, 2, 3)]
BIT_FOR_BIT = [
    "float32-files-hold-the-trained-tensors",
    "from-pretrained-builds-the-trained-model",
    "bf16-files-are-the-float32-rounded",
    "torchrun-export-holds-its-model",
]
# What the recipe prints that the page's work must not change.
LOSS = r"^\[rank\d\] step \d: loss \d\.\d{4}$"
LISTED = r"^\S+\.safetensors +[\d,]+ bytes$"
OPENED = r"^(?:\[rank\d\] )?export-\S+: LlamaForCausalLM, torch\.\w+, logits \(2, 32, 2048\)$"


@pytest.fixture(scope="module")
def built():
    return build_results(RECIPE)


def test_every_listed_claim_held_in_the_build(built):
    listed = page_results.manifest(RECIPE)["claims"]
    assert {name: built["claims"][name]["held"] for name in listed} == dict.fromkeys(listed, True)
    assert built["values"]["parameters"] == NUM_PARAMETERS
    assert built["values"]["world-size"] == 2


def test_the_index_names_every_tensor_in_three_files(built):
    evidence = built["claims"]["index-names-every-tensor"]["evidence"]
    assert evidence == {"tensors": NUM_TENSORS, "files": FILES}


@pytest.mark.parametrize("claim", BIT_FOR_BIT)
def test_files_and_models_are_the_trained_tensors_bit_for_bit(built, claim):
    evidence = built["claims"][claim]["evidence"]
    assert evidence["tensors"] == NUM_TENSORS
    assert evidence["differ"] == evidence["missing"] == evidence["unexpected"] == []


def test_logits_of_the_exports(built):
    claims = built["claims"]
    for name in ("float32-logits-equal", "unconsolidated-opens-through-dcp"):
        evidence = claims[name]["evidence"]
        assert evidence["shape"] == [2, 32, 2048] and evidence["dtype"] == "torch.float32"
        assert evidence["tolerance"] == built["values"]["logits-tolerance"] == 0.0, "CPU ranks"
        assert evidence["largest_difference"] == 0.0 and evidence["differ"] == 0, "bit for bit"
    bf16 = claims["bf16-logits-close"]["evidence"]
    assert bf16["dtype"] == "torch.bfloat16" and bf16["expected_dtype"] == "torch.float32"
    assert bf16["tolerance"] == pytest.approx(0.05 * bf16["largest_value"])
    assert 0 < bf16["largest_difference"] < bf16["tolerance"], "rounded: close, not equal"
    assert claims["bf16-export-opens-in-bfloat16"]["evidence"]["dtype"] == "torch.bfloat16"


def test_without_consolidation_each_file_holds_one_ranks_slices(built):
    files = built["claims"]["unconsolidated-folder-has-no-index"]["evidence"]["files"]
    pieces = [
        f"shard-0000{r}-model-0000{k}-of-00003.safetensors" for r in (1, 2) for k in (1, 2, 3)
    ]
    assert files == ["config.json", *pieces]
    assert built["claims"]["unconsolidated-file-holds-one-ranks-rows"]["evidence"]["rows"] == 1024


@pytest.mark.download
def test_download_computes_what_the_page_shows(recipe_runner):
    """The page's proofs watch the recipe, they do not change it: same losses, same files."""
    output = assert_ok(recipe_runner.notebook_run(RECIPE, world_size=2))
    shown = "".join(page_outputs(RECIPE))
    for pattern in (LOSS, LISTED, OPENED):
        assert numbers_in(output, pattern) == numbers_in(shown, pattern) != [], pattern
    assert "page_tools" not in output and "differ" not in output, "the proofs are the build's"
    assert_no_traceback(output)
    assert recipe_runner.leftovers() == []
    assert recipe_runner.processes_left() == []


@pytest.mark.ranks
def test_claims_hold_on_three_ranks_with_uneven_shards(recipe_runner):
    """2048 embedding rows in three: 683, 683, 682; the export and its files are the same."""
    recipes_before = sorted(os.listdir(RECIPES))
    run, results = recipe_runner.source(RECIPE, world_size=3)
    assert_ok(run)
    held = {name: outcome["held"] for name, outcome in results["claims"].items()}
    assert held == dict.fromkeys(page_results.manifest(RECIPE)["claims"], True), held
    assert results["values"]["world-size"] == 3
    assert results["claims"]["unconsolidated-file-holds-one-ranks-rows"]["evidence"]["rows"] == 683
    files = results["claims"]["unconsolidated-folder-has-no-index"]["evidence"]["files"]
    assert sum(name.startswith("shard-00003-") for name in files) == 3, files
    assert sorted(os.listdir(RECIPES)) == recipes_before
    assert checkpoint_files_in_repo() == []
    assert recipe_runner.leftovers() == []


@pytest.mark.torchrun
def test_download_under_torchrun(recipe_runner):
    output = assert_ok(recipe_runner.torchrun(RECIPE, nproc=2))
    assert "[rank1] step 3: loss" in output
    assert "[rank0] export-bfloat16: LlamaForCausalLM, torch.bfloat16" in output
    assert "[rank1] export-unconsolidated: LlamaForCausalLM, torch.float32" in output
    # torchrun's ranks print as they go: the same losses as the page, in another order.
    losses = sorted(numbers_in(output, LOSS))
    assert losses == sorted(numbers_in("".join(page_outputs(RECIPE)), LOSS)) != []
    assert len(losses) == 2 * 2 * 3, "train_and_export, then main(), on each rank"
    assert_no_traceback(output)
    assert recipe_runner.leftovers() == []
    assert checkpoint_files_in_repo() == []
