"""The resume-fallback page: what the build proved, the loop it shares with the resume
page, and its download alone (issue 20).

The page runs the resume page's loop (the same code, compared below), zeroes the data
file of its newest checkpoint (step 60, size unchanged: ``verify_checkpoint`` passes it),
and starts again: ``dcp.load`` fails on every rank, rank 0 renames the directory
``.unreadable`` and the run resumes from step 50, to the uninterrupted run's state at
step 60. Then the bad input (each error on every rank) and ``main()`` under torchrun's
environment, moved here from the resume page, which would have passed 600 lines.
"""

from __future__ import annotations

import ast

import pytest
from recipe_runner import (
    assert_listed_claims_held,
    assert_no_traceback,
    assert_ok,
    build_results,
    recipe_path,
)

RECIPE = "resume_fallback_recipe"
TENSORS = 6 + 18 + 2  # as on the resume page: model, Adam, two RNG states


@pytest.fixture(scope="module")
def claims():
    return build_results(RECIPE)["claims"]


def test_every_listed_claim_held(claims):
    assert_listed_claims_held(RECIPE, claims)


def test_the_fallback_resumed_from_the_checkpoint_before(claims):
    steps = claims["unreadable-checkpoint-set-aside"]["evidence"]["steps"]
    assert steps == list(range(51, 61))
    state = claims["fallback-state"]["evidence"]
    assert state["tensors"] == TENSORS and state["differ"] == state["missing"] == []


def test_bad_input_is_a_clear_error_on_every_rank(claims):
    raised = claims["bad-input-fails-at-once"]["evidence"]["raised"]
    assert raised and all(
        kinds == ["FileNotFoundError", "PermissionError", "ValueError", "RuntimeError"]
        for kinds in raised
    )


def test_main_under_torchruns_environment_computes_the_same_state(claims):
    evidence = claims["main-under-torchrun"]["evidence"]
    assert evidence["tensors"] == TENSORS and evidence["differ"] == []


def _definitions(name: str) -> dict[str, str]:
    tree = ast.parse(recipe_path(name).read_text())
    return {
        node.name: ast.dump(node)
        for node in tree.body
        if isinstance(node, ast.FunctionDef | ast.ClassDef)
    }


def test_the_loop_is_the_resume_pages_own_code():
    here, there = _definitions(RECIPE), _definitions("resume_recipe")
    shared = set(here) & set(there)
    assert {"train", "resume_from_newest", "clean_up", "verify_checkpoint"} <= shared
    assert [name for name in sorted(shared) if here[name] != there[name]] == []


@pytest.mark.download
def test_download_runs_alone(recipe_runner):
    output = assert_ok(recipe_runner.python(RECIPE, world_size=2))
    assert "step 60: CheckpointException on load; renamed step-00000060.unreadable" in output
    assert "[rank0] resuming from step 50" in output
    assert "page_tools" not in output
    assert_no_traceback(output)
    assert recipe_runner.leftovers() == []
    assert recipe_runner.processes_left() == []
