"""The Hugging Face export/import recipe: what it proves, from as few runs as possible.

Each run of the recipe costs about 10 s of CPU, so the module runs it three
times: the gallery launcher with 1 and with 3 ranks (uneven shards: 2048 rows
do not split evenly in three) and torchrun with 2 ranks. Two ranks under the
gallery launcher are what the site build runs.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from recipe_runner import ROOT, assert_ok, checkpoint_files_in_repo

RECIPE = "hf_interop_recipe"
OPEN_EXPORT = Path(__file__).with_name("hf_open_export.py")
R0 = r"(?:\[rank0\] )?"  # single-process steps carry rank 0's label under torchrun
NUM_TENSORS = 39  # a 4-layer Llama: 9 tensors per layer, embeddings, final norm, lm_head
NUM_PARAMETERS = 8_128_768

# Lines the recipe prints only when the check before them passed (the recipe asserts).
ONCE = [
    rf"{R0}the index names {NUM_TENSORS} tensors in 3 files",
    rf"{R0}logits equal to the sharded model's, bit for bit",
    rf"{R0}LlamaForCausalLM.from_pretrained\('export-bfloat16'\): dtype torch.bfloat16",
    rf"{R0}logits differ from the float32 sharded model's by at most 0\.0\d+",
    rf"{R0}\(checked: {NUM_TENSORS} bfloat16 tensors equal the float32 ones rounded, bit for bit\)",
    rf"\[rank0\] compared {NUM_TENSORS} tensors with the Hugging Face files: 0 differ",
    rf"\[rank0\] load_on_every_rank: {NUM_TENSORS} tensors equal to the file's, logits equal",
    rf"\[rank0\] load_from_rank0: {NUM_TENSORS} tensors equal to the file's, logits equal",
    rf"{R0}save_pretrained wrote {NUM_TENSORS - 1} tensors; lm_head.weight among them: False",
    r"CheckpointException is an Exception: False",
]
# Lines every rank prints.
EVERY_RANK = [
    r"dcp.load failed: RuntimeError: Missing key in checkpoint state_dict: "
    r"_orig_mod.lm_head.weight.",
    r"as it is: RuntimeError: Missing key in checkpoint state_dict: model.lm_head.weight.",
    r"renamed:  RuntimeError: Missing key in checkpoint state_dict: value_head.bias.",
    r"loaded 39 tensors; not in the checkpoint: \['value_head.weight', 'value_head.bias'\]",
    r"dcp.load failed: RuntimeError: Missing key in checkpoint state_dict: lm_head.weight.",
    r"loaded 38 tensors; lm_head still tied to the embedding: True",
]


def assert_recipe_checks_passed(output: str, ranks: int, torchrun: bool = False) -> None:
    for pattern in ONCE:
        # Under torchrun every rank runs the page's top-level code, and prints its lines.
        count = len(re.findall(pattern, output))
        assert count == 1 or (torchrun and count >= 1), f"{pattern!r}: {count}\n{output[-5000:]}"
    for pattern in EVERY_RANK:
        for rank in range(ranks):
            assert re.search(rf"\[rank{rank}\] {pattern}", output), f"rank {rank}: {pattern!r}"
    # Three key-mismatch fixes, each compared with the files on rank 0.
    compared = re.findall(r"\[rank0\] compared (\d+) tensors with the files: 0 differ", output)
    assert compared == [str(NUM_TENSORS), str(NUM_TENSORS), str(NUM_TENSORS - 1)], compared
    assert re.search(r"removed \S+: True", output)


def tensor_bytes_read(output: str) -> dict[int, int]:
    found = re.findall(r"\[rank(\d+)\] this rank read ([\d,]+) bytes of tensor data", output)
    return {int(rank): int(count.replace(",", "")) for rank, count in found}


def peak_growth(output: str, how: str) -> dict[int, int]:
    found = re.findall(rf"\[rank(\d+)\] {how}: peak host memory grew by (\d+) MiB", output)
    return {int(rank): int(mib) for rank, mib in found}


@pytest.mark.parametrize("world_size", [1, 3])
def test_recipe_with_gallery_launcher(recipe_runner, tmp_path, world_size):
    export_copy = tmp_path / "export-copy"
    output = assert_ok(
        recipe_runner.python(
            RECIPE, world_size=world_size, DCP_RECIPES_HF_EXPORT_COPY=str(export_copy)
        )
    )
    assert_recipe_checks_passed(output, world_size)
    # Saved without consolidation, a file holds one rank's rows (all of them, at one rank).
    rows = "whole: one rank saved it" if world_size == 1 else "only one rank's rows"
    assert re.search(
        rf"holds model\.embed_tokens\.weight as \(\d+, 256\) of \(\d+, 256\), {rows};", output
    )

    # Each rank asked the reader for its own shards only: together, the model once.
    read = tensor_bytes_read(output)
    assert sorted(read) == list(range(world_size))
    total = NUM_PARAMETERS * 4  # float32 parameters
    assert sum(read.values()) == total
    assert max(read.values()) < total / world_size + 2**20

    # Ranks other than 0 never hold the full model when rank 0 broadcasts.
    every, from_rank0 = (
        peak_growth(output, "load_on_every_rank"),
        peak_growth(output, "load_from_rank0"),
    )
    assert sorted(every) == sorted(from_rank0) == list(range(world_size))
    for rank in range(1, world_size):
        assert from_rank0[rank] < every[rank], (rank, from_rank0, every)

    assert recipe_runner.leftovers() == []
    assert checkpoint_files_in_repo() == []
    if world_size == 3:
        check_export_opens_in_a_fresh_process(export_copy)


def check_export_opens_in_a_fresh_process(folder: Path) -> None:
    """from_pretrained and safetensors read the export, in a process with no process group."""
    result = subprocess.run(
        [sys.executable, str(OPEN_EXPORT), str(folder)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    found = json.loads(result.stdout.strip().splitlines()[-1])
    assert found["process_group"] is False
    assert found["files"] == [f"model-0000{k}-of-00003.safetensors" for k in (1, 2, 3)]
    assert found["index_files"] == found["files"]
    # The index names every tensor, and only tensors that are in the files.
    assert found["index_names"] == found["file_names"] == found["model_names"]
    assert len(found["index_names"]) == NUM_TENSORS
    # Full tensors (consolidated), equal to the model from_pretrained built from them.
    assert found["shapes"] == found["config_shapes"]
    assert found["differ"] == []
    assert found["dtype"] == "torch.float32"
    assert found["logits_finite"]
    assert not (folder / "sharded").exists(), "the recipe deletes the per-rank pieces"


def test_recipe_under_torchrun(recipe_runner):
    output = assert_ok(recipe_runner.torchrun(RECIPE, nproc=2))
    assert_recipe_checks_passed(output, ranks=2, torchrun=True)
    assert sum(tensor_bytes_read(output).values()) == NUM_PARAMETERS * 4
    assert recipe_runner.leftovers() == []
    assert checkpoint_files_in_repo() == []
