"""The change-parallelism page (issue 22, items 5-7): what the build proved, and its
download alone.

The build decides every claim and keeps its evidence in the page's results file; these
tests read it. The download runs alone as a notebook on 4 ranks (the 2-D cell runs) and under
``torchrun --nproc-per-node=2`` (the 2-D cell says it needs 4, and the rest runs).
"""

from __future__ import annotations

import pytest
from recipe_runner import (
    assert_listed_claims_held,
    assert_no_traceback,
    assert_ok,
    build_results,
    page_outputs,
)

RECIPE = "change_parallelism_recipe"
RESHARDS = ["2d-to-2-ranks", "2d-to-3-ranks", "2d-to-1-process"]


@pytest.fixture(scope="module")
def built():
    return build_results(RECIPE)


def test_every_listed_claim_held(built):
    assert_listed_claims_held(RECIPE, built["claims"])


@pytest.mark.parametrize("claim", RESHARDS)
def test_the_2d_checkpoint_reshards_model_and_optimizer_bit_for_bit(built, claim):
    evidence = built["claims"][claim]["evidence"]
    # 2 weights and 2 biases, Adam's exp_avg, exp_avg_sq and step for each.
    assert evidence["tensors"] == 16 and evidence["values"] > 0
    assert evidence["differ"] == evidence["missing"] == evidence["unexpected"] == []


def test_the_adapter_checkpoint_is_small_and_reloads(built):
    sizes = built["values"]["checkpoint_tensor_bytes"]
    assert sizes["adapters"] < sizes["base"] / 10
    reload = built["claims"]["adapters-and-optimizer-reload"]["evidence"]
    assert reload["tensors"] == 32  # 8 LoRA matrices, with AdamW's exp_avg, exp_avg_sq, step
    assert all(
        "lora_" in key
        for key in built["claims"]["adapter-checkpoint-is-the-trainable-state"]["evidence"]["keys"]
    )


def test_dtype_loads_cast(built):
    for claim in ("float32-to-bfloat16-casts", "bfloat16-to-float32-casts"):
        assert built["claims"][claim]["evidence"]["tensors"] == 4


@pytest.mark.download
def test_download_on_four_ranks_runs_the_2d_cell(recipe_runner):
    """The notebook forks 4 ranks (as ``DCP_RECIPES_WORLD_SIZE=4 python`` does): every load
    of the 2-D checkpoint runs on those 4, 1-D."""
    output = assert_ok(recipe_runner.notebook_run(RECIPE, world_size=4))
    assert "[rank3] layers.0.weight (_StridedShard(dim=0, sf=2), Shard(dim=0)), local" in output
    assert "[rank3] rank 3 of 4: layers.0.weight rows 16" in output
    assert "one process: layers.0.weight (64, 64)" in output
    assert "[rank3] 8 adapter tensors loaded; 21 frozen from the base" in output
    dtype = "[rank0] float32 checkpoint: torch.float32 on disk -> torch.bfloat16 model"
    assert dtype in output and dtype in "".join(page_outputs(RECIPE))
    assert "page_tools" not in output and "differ" not in output
    assert_no_traceback(output)
    assert recipe_runner.leftovers() == []
    assert recipe_runner.processes_left() == []


@pytest.mark.torchrun
def test_download_under_torchrun_on_two_ranks_skips_the_2d_cell(recipe_runner):
    output = assert_ok(recipe_runner.torchrun(RECIPE, nproc=2))
    assert "[rank0] a 2x2 mesh needs 4 ranks, this run has 2: skipped" in output
    assert "[rank1] no checkpoint at mesh-2x2: nothing to load" in output
    assert "[rank0] no checkpoint at mesh-2x2: nothing to load" in output  # the 1-process load
    assert "[rank1] bfloat16 checkpoint: torch.bfloat16 on disk -> torch.float32 model" in output
    assert_no_traceback(output)
    assert recipe_runner.leftovers() == []


@pytest.mark.torchrun
def test_download_under_torchrun_on_four_ranks_runs_the_2d_cell(recipe_runner):
    """``torchrun --nproc-per-node=4``: the 2-D cell trains and saves on torchrun's ranks."""
    output = assert_ok(recipe_runner.torchrun(RECIPE, nproc=4))
    assert "[rank3] layers.0.weight (_StridedShard(dim=0, sf=2), Shard(dim=0)), local" in output
    assert "[rank3] rank 3 of 4: layers.0.weight rows 16" in output
    assert "skipped" not in output
    assert_no_traceback(output)
    assert recipe_runner.leftovers() == []
