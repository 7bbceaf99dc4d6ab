"""Recipe 1 (save and load), run from its download as a reader runs it."""

from __future__ import annotations

import os
import re

import pytest
from recipe_runner import RECIPES, assert_no_traceback, assert_ok, checkpoint_files_in_repo

RECIPE = "save_load_recipe"

# Every equality check the recipe makes, with the line it prints when it passes.
# Under torchrun, single-process steps run on rank 0, so their lines carry its label.
R0 = r"(?:\[rank0\] )?"
SHARDED_CHECK = re.compile(r"\[rank0\] compared (\d+) tensors with what was saved: 0 differ")
SINGLE_PROCESS_CHECKS = [
    re.compile(rf"{R0}unsharded model: net1.weight \(64, 16\), compared (\d+) tensors: 0 differ"),
    re.compile(
        rf"{R0}checkpoint.pt: [\d,]+ bytes, keys \['model', 'optim'\]\n{R0}"
        r"compared (\d+) tensors: 0 differ"
    ),
    re.compile(rf"dcp_to_torch \.\.\. checkpoint-cli.pt\n{R0}compared (\d+) tensors: 0 differ"),
]


def assert_recipe_checks_passed(output: str, checks_per_line: int = 1) -> None:
    # The recipe asserts its own equality checks; here we make sure they ran.
    sharded = SHARDED_CHECK.findall(output)
    assert len(sharded) == 2 * checks_per_line, output[-4000:]
    assert all(int(n) > 0 for n in sharded)
    for check in SINGLE_PROCESS_CHECKS:
        found = check.findall(output)
        assert len(found) == checks_per_line, f"{check.pattern} not in\n{output[-4000:]}"
        assert int(found[0]) == int(sharded[0])
    assert "removed " in output and ": True" in output


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_recipe_with_gallery_launcher(recipe_runner, world_size):
    recipes_before = sorted(os.listdir(RECIPES))
    output = assert_ok(recipe_runner.python(RECIPE, world_size=world_size))
    assert_recipe_checks_passed(output)
    shards = re.findall(r"^__(\d+)_0\.distcp", output, re.MULTILINE)
    assert len(shards) == world_size, "one .distcp file per rank"
    if world_size <= 2:  # one rank cannot disagree with itself: the page uses two CPU ranks
        assert_disagreeing_directories_fail_as_shown(output)
    assert f"[rank{world_size - 1}] step 3: loss" in output
    assert_no_traceback(output)
    assert recipe_runner.leftovers() == []
    assert recipe_runner.processes_left() == []
    assert sorted(os.listdir(RECIPES)) == recipes_before
    assert checkpoint_files_in_repo() == []


def test_recipe_under_torchrun(recipe_runner):
    output = assert_ok(recipe_runner.torchrun(RECIPE, nproc=2))
    # Single-process steps run once (on rank 0); the rest on both ranks.
    assert_recipe_checks_passed(output)
    assert "[rank1] step 3: loss" in output
    assert_no_traceback(output)
    assert recipe_runner.leftovers() == []


def test_recipe_under_two_torchrun_agents(recipe_runner):
    node0, node1 = recipe_runner.torchrun_two_nodes(RECIPE)
    output0, output1 = assert_ok(node0), assert_ok(node1)
    assert_recipe_checks_passed(output0)
    assert "[rank1] step 3: loss" in output1
    assert recipe_runner.leftovers() == []


def assert_disagreeing_directories_fail_as_shown(output: str) -> None:
    """The page's "When ranks disagree on the directory": the real errors, on 2 ranks."""
    # Nothing fails at save time; only rank 0's directory has the index.
    assert "[rank0] saved into rank0-only: ['.metadata', '__0_0.distcp']" in output
    assert "[rank1] saved into rank1-only: ['__1_0.distcp']" in output
    # All ranks load rank 0's path: rank 1's shards are not there.
    assert re.search(
        r"\[rank0\] every rank loads rank 0's directory: CheckpointException\n"
        r"\[rank0\]   rank 0: FileNotFoundError: \[Errno 2\] No such file or directory: "
        r"'\.\.\./rank0-only/__1_0\.distcp'\n"
        r"\[rank0\]   rank 1: FileNotFoundError: .*'\.\.\./rank0-only/__1_0\.distcp'\n",
        output,
    ), output[-3000:]
    # Each rank loads its own path: rank 0 finds its .metadata, rank 1 finds none.
    assert re.search(
        r"\[rank0\] every rank loads its own directory: CheckpointException\n"
        r"\[rank0\]   rank 1: AssertionError: metadata is None; global metadata read failed: "
        r".*'\.\.\./rank1-only/\.metadata'.*\n\[rank(?!0\]   rank)",
        output,
    ), output[-3000:]
    assert "Traceback" not in output and "Global metadata is not found" not in output
