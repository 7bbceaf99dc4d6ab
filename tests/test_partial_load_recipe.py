"""The partial-load page (issue 22, items 1-4 and bad input): what the build proved, and its
download alone.

The build decides every claim and keeps its evidence in the page's results file; these
tests read it. The download (the recipe without the page's proofs) runs alone, as a
notebook (as ``python`` runs its script) and under ``torchrun``, and must print what the
page shows.
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

RECIPE = "partial_load_recipe"
NEW_LAYER = [
    f"model.layers.2.{name}.weight"
    for name in (
        "input_layernorm",
        "mlp.down_proj",
        "mlp.gate_proj",
        "mlp.up_proj",
        "post_attention_layernorm",
        "self_attn.k_proj",
        "self_attn.o_proj",
        "self_attn.q_proj",
        "self_attn.v_proj",
    )
]


@pytest.fixture(scope="module")
def claims():
    return build_results(RECIPE)["claims"]


def test_every_listed_claim_held(claims):
    assert_listed_claims_held(RECIPE, claims)


def test_metadata_and_the_command_line_list_every_tensor(claims):
    evidence = claims["metadata-lists-every-saved-tensor"]["evidence"]
    # 4 weights and biases, Adam's exp_avg, exp_avg_sq and step for each, and loop.step.
    assert evidence["listed"] == evidence["saved"] == 17
    assert claims["command-line-lists-every-key"]["evidence"]["lines"] > 17  # and the bytes


def test_the_model_only_load_read_the_model_keys_alone(claims):
    assert claims["model-only-load"]["evidence"]["tensors"] == 4
    read = claims["model-only-reads-no-optimizer-byte"]["evidence"]
    assert read["keys"] == sorted(
        f"app.model.layers.{i}.{kind}" for i in range(2) for kind in ("weight", "bias")
    )
    tensor_bytes = 2 * (64 * 64 + 64) * 4  # two float32 weights and biases; plus headers
    assert tensor_bytes <= read["bytes"] < 2 * tensor_bytes


def test_the_fine_tune_named_new_and_dropped_keys_and_loaded_the_rest(claims):
    named = claims["missing-and-unexpected-named"]["evidence"]
    assert named["missing"] == [*NEW_LAYER, "score.weight"]
    assert named["unexpected"] == ["lm_head.weight"]
    assert claims["shared-weights-loaded"]["evidence"]["tensors"] == 20
    assert claims["new-keys-kept-their-init"]["evidence"]["tensors"] == 10


def test_the_errors_name_the_key_and_come_before_any_read(claims):
    plain = claims["missing-key-refused-before-reading"]["evidence"]["error"]
    assert plain == f"RuntimeError: Missing key in checkpoint state_dict: {NEW_LAYER[0]}."
    shape = claims["shape-mismatch-refused-before-reading"]["evidence"]["error"]
    assert "torch.Size([128, 32])" in shape and "torch.Size([256, 32])" in shape
    errors = claims["bad-input-refused-before-reading"]["evidence"]["errors"]
    assert "Not a directory: " in errors[0] and "model.pt/.metadata'" in errors[0]
    assert errors[1] == "ValueError: exclude pattern 'layer.1.*' matches no key"


def test_excluded_and_renamed_keys(claims):
    assert claims["excluded-keys-not-read"]["evidence"]["read"] == [
        "app.model.layers.0.bias",
        "app.model.layers.0.weight",
    ]
    assert claims["renamed-keys-load"]["evidence"]["tensors"] == 4


@pytest.mark.download
def test_download_prints_what_the_page_shows(recipe_runner):
    output = assert_ok(recipe_runner.notebook_run(RECIPE, world_size=2))
    shown = "".join(page_outputs(RECIPE))
    for line in (
        "[rank0] unexpected, not read: lm_head.weight",
        "[rank0] module.blocks.0.weight   <- app.model.layers.0.weight",
        "[rank1] not loaded (strict=False): layers.1.weight, layers.1.bias",
        "[rank0] ValueError: exclude pattern 'layer.1.*' matches no key",
    ):
        assert line in output and line in shown, line
    metadata_lines = [line for line in output.splitlines() if line.startswith("app.")]
    assert metadata_lines == [line for line in shown.splitlines() if line.startswith("app.")]
    assert "page_tools" not in output and "differ" not in output, "the proofs are the build's"
    assert_no_traceback(output)
    assert recipe_runner.leftovers() == []
    assert recipe_runner.processes_left() == []


@pytest.mark.torchrun
def test_download_under_torchrun(recipe_runner):
    output = assert_ok(recipe_runner.torchrun(RECIPE, nproc=2))
    assert "[rank1] loaded 4 model tensors, no optimizer" in output
    assert "[rank0] ValueError: 'layers.0.weight' and 'layers.0.bias' both map" in output
    assert_no_traceback(output)
    assert recipe_runner.leftovers() == []
