"""The stager-stream page: on a GPU, a loop that does not synchronise before async_save saves
weights and Adam's moments from before the step; with the synchronisation every checkpoint
is exact; on CPU ranks there is no stream and no race. Decided in the build; the download
alone.

On a CPU build the GPU claim is "not measured here"; a GPU build (``make html`` there, or
``make gpu-check``, which runs the source) decides it.
"""

from __future__ import annotations

import ast

import pytest
from page_tools import proofs
from recipe_runner import (
    assert_no_traceback,
    assert_ok,
    build_results,
    numbers_in,
    page_download,
    page_outputs,
    recipe_path,
)

RECIPE = "stager_stream_recipe"
TENSORS = 16  # 2 weights and 2 biases, their 8 Adam moments and 4 step counters
RACING = 5  # checkpoints from the stager's second save on
HEADLINE = [
    "checkpoints",
    "torn without sync",
    "torn with sync",
    "weights and biases from before",
    "Adam's moments from before",
    "Adam's step counters from before",
]
CHECKPOINTS = r"^\[rank0\] (\w+): (\d+) checkpoints$"


@pytest.fixture(scope="module")
def built():
    return build_results(RECIPE)


@pytest.mark.parametrize(
    "claim", ["stream-race-exact-with-sync", "no-stream-no-race", "torchrun-exact"]
)
def test_with_the_synchronisation_or_without_a_stream_every_checkpoint_is_exact(built, claim):
    outcome = built["claims"][claim]
    assert outcome["held"] is True
    evidence = outcome["evidence"]
    assert evidence["counts"] == [0] * RACING and evidence["tensors"] == TENSORS
    if claim == "no-stream-no-race":
        assert evidence["devices"] == ["cpu"]


def test_the_stream_race_is_torn_in_weights_and_moments_on_a_gpu(built):
    outcome = built["claims"]["stream-race-torn-without-sync"]
    if outcome["held"] is None:  # a CPU build: nothing to race with
        assert "not measured here" in outcome["said"]
        assert built["claims"]["no-stream-no-race"]["held"] is True
        return
    assert outcome["held"] is True and outcome["evidence"]["devices"] == ["cuda"]
    # Some checkpoint caught some of the 12 weights, biases and moments before the step
    # (which and how many, the race decides: all 12 in most), and none a step counter.
    differ = outcome["evidence"]["differ"]
    assert len(differ) == RACING and any(differ) and all(len(names) <= 12 for names in differ)
    racing = proofs.named("weight", "bias", "exp_avg", "exp_avg_sq")
    assert all(racing(name) for names in differ for name in names)


def test_the_torchrun_saves_had_a_writer_that_copies_nothing_ahead(built):
    evidence = built["claims"]["host-writer-copies-nothing-ahead"]["evidence"]
    assert evidence == {"saves": 2 * 6, "copy_ahead": ["0"]}, "6 saves on each of 2 ranks"


def test_the_headline_is_the_stream_race_kind_by_kind(built):
    headline = built["values"]["headline"]
    assert list(headline) == HEADLINE
    assert headline["checkpoints"] == RACING and headline["torn with sync"] == 0
    on_gpu = built["claims"]["stream-race-torn-without-sync"]["held"] is True
    torn, weights, moments, counters = [headline[name] for name in HEADLINE[1:2] + HEADLINE[3:]]
    if on_gpu:  # of 4 weights and biases and 8 moments, those some checkpoint caught
        assert 0 < torn <= RACING and weights + moments > 0 and weights <= 4 and moments <= 8
    else:
        assert torn == weights == moments == 0
    assert counters == 0


def test_the_page_shows_what_the_build_decided():
    shown = "".join(page_outputs(RECIPE))
    for name, claim in build_results(RECIPE)["claims"].items():
        assert claim["said"] in shown, name
    assert all(len(line) <= 90 for line in shown.splitlines()), "a line runs off the column"


@pytest.mark.download
def test_download_runs_alone_on_one_rank(recipe_runner):
    output = assert_ok(recipe_runner.notebook_run(RECIPE, world_size=1))
    shown = "".join(page_outputs(RECIPE))
    assert numbers_in(output, CHECKPOINTS) == numbers_in(shown, CHECKPOINTS) != []
    assert "not measured here" not in output and "checkpoints the saved state" not in output
    assert_no_traceback(output)
    assert recipe_runner.leftovers() == []
    assert recipe_runner.processes_left() == []


@pytest.mark.torchrun
def test_download_under_torchrun(recipe_runner):
    output = assert_ok(recipe_runner.torchrun(RECIPE, nproc=2))
    assert output.count("[rank0] synchronize_before_save: 6 checkpoints") == 2, "main() ran too"
    assert_no_traceback(output)
    assert recipe_runner.leftovers() == []
    assert recipe_runner.processes_left() == []


def test_the_fix_differs_from_the_race_by_the_synchronisation_alone():
    tree = ast.parse(recipe_path(RECIPE).read_text())
    loops = {
        node.name: ast.unparse(node) for node in tree.body if isinstance(node, ast.FunctionDef)
    }
    race, fix = loops["save_without_synchronizing"], loops["synchronize_before_save"]
    assert "synchronize" not in race
    synchronisation = (
        "\n        if torch.accelerator.is_available():\n"
        "            torch.accelerator.current_stream().synchronize()"
    )
    assert synchronisation in fix
    assert (
        fix.replace(synchronisation, "").replace(
            "synchronize_before_save", "save_without_synchronizing"
        )
        == race
    ), "the fix differs from the race by more than the synchronisation"


def test_the_download_changes_nothing_in_torch():
    script = page_download(RECIPE, ".py").read_text()
    for page_only in ("page_tools", "proofs.", "faults.", "_sleep", "register_optimizer"):
        assert page_only not in script, page_only
