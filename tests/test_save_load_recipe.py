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
