"""Recipe 1 (save and load) and the rank launcher it runs on."""

from __future__ import annotations

import os
import re
import textwrap

import pytest
from recipe_runner import RECIPES, assert_ok, checkpoint_files_in_repo

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
    assert recipe_runner.leftovers() == []
    assert sorted(os.listdir(RECIPES)) == recipes_before
    assert checkpoint_files_in_repo() == []


def test_recipe_under_torchrun(recipe_runner):
    output = assert_ok(recipe_runner.torchrun(RECIPE, nproc=2))
    # Single-process steps run once (on rank 0); the rest on both ranks.
    assert_recipe_checks_passed(output)
    assert "[rank1] step 3: loss" in output
    assert recipe_runner.leftovers() == []


def test_recipe_under_two_torchrun_agents(recipe_runner):
    node0, node1 = recipe_runner.torchrun_two_nodes(RECIPE)
    output0, output1 = assert_ok(node0), assert_ok(node1)
    assert_recipe_checks_passed(output0)
    assert "[rank1] step 3: loss" in output1
    assert recipe_runner.leftovers() == []


def write_script(tmp_path, body: str):
    script = tmp_path / "broken_recipe.py"
    script.write_text(
        "import sys\n"
        f"sys.path.insert(0, {str(RECIPES)!r})\n"
        "import torch.distributed as dist\n"
        "from rank_launcher import run_on_ranks\n" + textwrap.dedent(body)
    )
    return script


def test_a_raising_rank_fails_the_launch_with_its_traceback(recipe_runner, tmp_path):
    script = write_script(
        tmp_path,
        """
        def train(step):
            print(f"rank {dist.get_rank()} reached step {step}")
            if dist.get_rank() == 1:
                raise ValueError("loss is NaN on purpose")
            dist.barrier()  # rank 0 waits here for a peer that is gone

        run_on_ranks(train, 7)
        """,
    )
    result = recipe_runner.script(script, timeout=120)
    assert result.returncode != 0
    error = result.stderr
    assert "RankFailedError: recipe 'broken_recipe': rank 1 failed: rank 1 raised" in error
    assert "ValueError: loss is NaN on purpose" in error
    assert "rank 1 reached step 7" in error, "the failing rank's output is in the error"
    assert "timed out" not in error, "a raising rank must not wait for the deadline"
    assert recipe_runner.leftovers() == []


def test_a_hanging_rank_fails_at_the_deadline(recipe_runner, tmp_path):
    script = write_script(
        tmp_path,
        """
        import time

        def train():
            print("rank", dist.get_rank(), "started")
            if dist.get_rank() == 0:
                time.sleep(600)

        run_on_ranks(train)
        """,
    )
    result = recipe_runner.script(script, timeout=120, DCP_RECIPES_TIMEOUT="8")
    assert result.returncode != 0
    assert "rank 0 failed: timed out after 8 s" in result.stderr
    assert "rank 0 started" in result.stderr
    assert recipe_runner.leftovers() == []


def test_a_bad_world_size_is_a_clear_error(recipe_runner):
    result = recipe_runner.python(RECIPE, world_size=0)
    assert result.returncode != 0
    assert "DCP_RECIPES_WORLD_SIZE must be a positive integer, got '0'" in result.stderr
    assert recipe_runner.leftovers() == []


def test_ranks_that_disagree_on_the_directory_get_the_real_errors(recipe_runner):
    output = assert_ok(recipe_runner.python(RECIPE, world_size=2))
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
