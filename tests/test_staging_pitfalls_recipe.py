"""The staging pitfalls page: every hazard torn at every save, every fix bit-exact at every
save, decided in the build; the races left to chance counted and timed; its download alone.

The build decides each claim, with the page holding DCP's copy until the loop waits for
``staging_completion`` and an upload's writes until it waits for ``upload_completion``,
and keeps the evidence in its results file; the tests read it.
"""

from __future__ import annotations

import ast

import pytest
from recipe_runner import (
    assert_no_traceback,
    assert_ok,
    build_results,
    numbers_in,
    page_download,
    page_outputs,
    recipe_path,
)

RECIPE = "staging_pitfalls_recipe"
MIN_CHECKPOINTS = 5
PLAIN, WITH_BATCH_NORM = 16, 27  # tensors: weights, Adam's moments and step counters (+ buffers)
FIXES = {  # claim: tensors in each checkpoint
    "wait-before-step-exact": PLAIN,
    "wait-before-forward-exact": WITH_BATCH_NORM,
    "stage-buffers-exact": WITH_BATCH_NORM,
    "wait-for-upload-exact": PLAIN,
    "progress-copied-exact": PLAIN,
    "every-rule-kept-exact": WITH_BATCH_NORM,
}
BUFFERS = ["model.0.num_batches_tracked", "model.0.running_mean", "model.0.running_var"]
HAZARDS = {  # claim: what each of its checkpoints holds that is not the saved state
    "step-before-staging-torn": "every tensor",  # weights, Adam's moments, step counters
    "batch-norm-forward-torn": BUFFERS,  # the same loop as the first fix, a BatchNorm model
    "next-save-torn": "every tensor",  # every checkpoint holds the last save's state
    "progress-torn": ["progress.samples_seen"],
}
WRITER = "host-writer-copies-nothing-ahead"  # every save: FileSystemWriter(per_thread_copy_ahead=0)
LEFT_TO_CHANCE = {  # loop: checkpoints compared (the last of the upload race has no next save)
    "step_before_staging": 8,
    "wait_before_step-with-batch-norm": 8,
    "next_save_before_upload": 8,
    "progress_updated_after_save": 8,
}
# Every proof and number the page showed before it was split (executed page of Dec 2026),
# and where it is now: a claim or value of this page, or of the stager-stream page.
SHOWN_BEFORE = {
    "wait_before_step [0, 0, 0, 0, 0]: bit-exact every time": "wait-before-step-exact",
    "save_without_synchronizing / synchronize_before_save, and the stream race's torn count "
    "and entries from before the step, by kind": "stager_stream_recipe",
    "step_before_staging [16, ...]: not the saved state, every time": "step-before-staging-torn",
    "wait_before_step_with_batch_norm [3, ...], e.g. the three buffers": "batch-norm-forward-torn",
    "wait_before_forward [0, ...]": "wait-before-forward-exact",
    "stage_buffers_at_save_call [0, ...]": "stage-buffers-exact",
    "next_save_before_upload [16, ...]": "next-save-torn",
    "wait_for_upload_before_next_save [0, ...]": "wait-for-upload-exact",
    "progress_updated_after_save [1, ...], e.g. progress.samples_seen": "progress-torn",
    "progress_copied_at_save_call [0, ...]": "progress-copied-exact",
    "each broken loop left to chance: not the saved state in N of 8 trials": "left_to_chance",
    "the copy still running after async_save returned (median, at most); a save took (median); "
    "a training step (now: a loop step, one save call to the next)": "left_to_chance",
    "the one-line summary for make gpu-check (the stream race by kind)": "stager_stream_recipe",
}
STATE_LINE = r"^(?:\[rank\d\] )?(\d\.\w+) +torch\.(\w+) +(\(.*\))$"
CHECKPOINTS = r"^\[rank0\] ([\w-]+): (\d+) checkpoints$"  # what run_loop says on rank 0


@pytest.fixture(scope="module")
def built():
    return build_results(RECIPE)


def test_everything_the_page_showed_before_is_still_decided_or_recorded(built):
    decided = {**built["claims"], **built["values"]}
    for before, now in SHOWN_BEFORE.items():
        if now == "stager_stream_recipe":
            assert build_results(now)["values"]["headline"], before
        else:
            assert now in decided, before


def test_every_claim_of_the_page_held(built):
    assert {name: c["held"] for name, c in built["claims"].items()} == {
        name: True for name in [*FIXES, *HAZARDS, WRITER]
    }


def test_every_save_of_the_torchrun_run_had_a_writer_that_copies_nothing_ahead(built):
    evidence = built["claims"][WRITER]["evidence"]
    assert evidence == {"saves": 2 * 6, "copy_ahead": ["0"]}, "6 saves on each of 2 ranks"


@pytest.mark.parametrize("claim", FIXES)
def test_every_fix_is_bit_exact_at_every_save(built, claim):
    evidence = built["claims"][claim]["evidence"]
    assert evidence["checkpoints"] >= MIN_CHECKPOINTS
    assert evidence["counts"] == [0] * evidence["checkpoints"]
    assert evidence["tensors"] == FIXES[claim] and evidence["values"] > 0


@pytest.mark.parametrize("claim", HAZARDS)
def test_every_hazard_tears_every_checkpoint_in_exactly_what_it_changes(built, claim):
    evidence = built["claims"][claim]["evidence"]
    assert evidence["checkpoints"] >= MIN_CHECKPOINTS
    expected = HAZARDS[claim]
    if expected == "every tensor":
        assert evidence["counts"] == [PLAIN] * evidence["checkpoints"]
        assert len(evidence["expected"]) == PLAIN
    else:
        assert evidence["differ"] == [expected] * evidence["checkpoints"]


def test_the_races_left_to_chance_are_counted_and_timed(built):
    measured = built["values"]["left_to_chance"]
    assert sorted(measured) == sorted(LEFT_TO_CHANCE)
    for loop, checked in LEFT_TO_CHANCE.items():
        m = measured[loop]
        assert m["checked"] == checked and 0 <= m["torn"] <= checked, (loop, m)
        saves = checked + (loop == "next_save_before_upload")
        assert len(m["save"]) == saves and len(m["between_calls"]) == saves - 1
        assert len(m["copy_after_return"]) == saves
        assert all(v >= 0 for key in ("save", "between_calls", "copy_after_return") for v in m[key])


def test_the_page_shows_what_the_build_decided():
    """Each claim's sentence is on the page, under its cell (the one wording check)."""
    shown = "".join(page_outputs(RECIPE))
    for name, claim in build_results(RECIPE)["claims"].items():
        assert claim["said"] in shown, name
    assert all(len(line) <= 90 for line in shown.splitlines()), "a line runs off the column"


@pytest.mark.download
def test_download_runs_alone_on_one_rank(recipe_runner):
    """One rank, where the build ran two: the recipe alone prints what the page shows."""
    output = assert_ok(recipe_runner.notebook_run(RECIPE, world_size=1))
    shown = "".join(page_outputs(RECIPE))
    assert numbers_in(output, STATE_LINE) == numbers_in(shown, STATE_LINE) != []
    assert numbers_in(output, CHECKPOINTS) == numbers_in(shown, CHECKPOINTS) != []
    assert "use_async_staging = True" in output
    assert "differ" not in output and "checkpoints the saved state" not in output
    assert_no_traceback(output)
    assert recipe_runner.leftovers() == []
    assert recipe_runner.processes_left() == []


@pytest.mark.torchrun
def test_download_under_torchrun(recipe_runner):
    output = assert_ok(recipe_runner.torchrun(RECIPE, nproc=2))
    shown = "".join(page_outputs(RECIPE))
    assert numbers_in(output, CHECKPOINTS) == numbers_in(shown, CHECKPOINTS) != []
    assert "[rank0] every_rule_kept-with-batch-norm: 6 checkpoints" in output, "main() ran"
    assert_no_traceback(output)
    assert recipe_runner.leftovers() == []
    assert recipe_runner.processes_left() == []


@pytest.mark.ranks
def test_claims_hold_on_one_rank(recipe_runner):
    """The source with its page work on one rank (what make gpu-check runs on one GPU)."""
    run, results = recipe_runner.source(RECIPE, world_size=1)
    assert_ok(run)
    assert all(claim["held"] for claim in results["claims"].values()), results["claims"]
    assert sorted(results["claims"]) == sorted([*FIXES, *HAZARDS, WRITER])
    assert recipe_runner.leftovers() == []


def loops_in(code: str) -> dict[str, ast.FunctionDef]:
    tree = ast.parse(code)
    return {
        node.name: node
        for node in tree.body
        if isinstance(node, ast.FunctionDef) and "dcp.async_save(" in ast.unparse(node)
    }


SYNCHRONISE = (
    "if torch.accelerator.is_available():\n    torch.accelerator.current_stream().synchronize()"
)


def test_every_loop_synchronises_right_before_async_save():
    loops = loops_in(recipe_path(RECIPE).read_text())
    assert len(loops) == 9, sorted(loops)
    for name, function in loops.items():
        checked = 0
        for body in (n.body for n in ast.walk(function) if isinstance(n, ast.For)):
            for i in [i for i, s in enumerate(body) if "dcp.async_save(" in ast.unparse(s)]:
                assert ast.unparse(body[i - 1]) == SYNCHRONISE, f"{name}: no synchronisation"
                checked += 1
        assert checked == 1, f"{name} calls async_save once, in its loop"
    # The clone fix synchronises after cloning: the stager's stream does not wait for clones.
    for name in ("stage_buffers_at_save_call", "every_rule_kept"):
        code = ast.unparse(loops[name])
        assert code.index("buffer.clone()") < code.index("synchronize()")


def test_the_download_changes_nothing_in_torch():
    script = page_download(RECIPE, ".py").read_text()
    for page_only in ("page_tools", "proofs.", "faults.", "write_data", "_sleep", "Future"):
        assert page_only not in script, page_only
    assert script.count("StagingOptions(") == 1
