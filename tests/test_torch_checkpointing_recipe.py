"""The page that sets torch_checkpointing beside DCP (issue 24, item 5): what the build proved
and measured, and its download alone.

The build decides every claim and keeps its evidence and measurements in the page's results
file; these tests read it, and recompute the page's noise verdict from the measured stalls.
The download runs alone as a notebook and under ``torchrun`` (``make reruns``).
"""

from __future__ import annotations

import pytest
import torch
from page_tools import stats
from recipe_runner import (
    assert_listed_claims_held,
    assert_no_traceback,
    assert_ok,
    build_results,
    numbers_in,
    page_outputs,
)

RECIPE = "torch_checkpointing_recipe"
LIBRARIES = ("DCP", "torch_checkpointing")
RESUMED = r"^\[rank(\d)\] (DCP|torch_checkpointing): resumed from step-0006, loss at step 10 (\S+)$"
# Per rank: a straight run saves at steps 2-10 (its first save is not timed), the stopped run
# at 2, 4 and 6, the resumed one at 8 and 10.
TIMED_SAVES_PER_RANK = 4 + 3 + 2


@pytest.fixture(scope="module")
def built():
    return build_results(RECIPE)


def test_every_listed_claim_held(built):
    assert_listed_claims_held(RECIPE, built["claims"])


@pytest.mark.parametrize("library", LIBRARIES)
def test_a_resume_trains_as_the_run_straight_through(built, library):
    evidence = built["claims"][f"{library}-resume-same-losses"]["evidence"]
    assert evidence["compared"] == 10 and evidence["keys"] == [1, 10]
    assert evidence["differ"] == []


def test_neither_library_reads_the_others_checkpoint(built):
    by_rank = built["claims"]["neither-reads-the-other"]["evidence"]["by_rank"]
    assert len(by_rank) == 2
    for rank, outcomes in enumerate(by_rank):
        assert outcomes["DCP reads torch_checkpointing's"].startswith("CheckpointException: ")
        assert "metadata is None" in outcomes["DCP reads torch_checkpointing's"]
        other = outcomes["torch_checkpointing reads DCP's"]
        assert other.startswith("FileNotFoundError: Missing file") and f"model_{rank}.pt" in other


def test_every_timed_save_was_measured_and_the_verdict_follows_from_them(built):
    waited = built["values"]["waited_s"]
    for library in LIBRARIES:
        assert len(waited[library]) == 2 * TIMED_SAVES_PER_RANK, library
        assert all(seconds > 0 for seconds in waited[library]), library
    recorded = built["values"]["verdict"]
    again = stats.difference(waited["torch_checkpointing"], waited["DCP"])
    assert recorded["within_noise"] == again["within_noise"]
    assert recorded["effect"] == pytest.approx(again["effect"])
    assert ("within noise" in recorded["said"]) == again["within_noise"]


def test_the_page_shows_what_direct_io_did(built):
    shown = "".join(page_outputs(RECIPE))
    for rank, outcome in enumerate(built["values"]["direct_io_outcome"]):
        assert outcome == "saved" or outcome.startswith("OSError: [Errno"), outcome
        assert f"[rank{rank}] use_direct_io=True: {outcome}" in shown


def test_the_page_shows_what_a_resharder_did(built):
    """0.1.1 gathers the sharding metadata with CUDA tensors: on CPU ranks the save raises."""
    shown = "".join(page_outputs(RECIPE))
    on_cpu = not torch.cuda.is_available()  # make test reads a build of this machine
    for rank, outcome in enumerate(built["values"]["resharder_outcome"]):
        assert outcome == "saved" or "CUDA" in outcome, outcome
        assert f"[rank{rank}] a save with DefaultResharder: {outcome}" in shown
        if on_cpu:
            assert outcome != "saved", "the CPU build saved with a resharder: update the page"


@pytest.mark.download
def test_download_computes_what_the_page_shows(recipe_runner):
    output = assert_ok(recipe_runner.notebook_run(RECIPE, world_size=2))
    shown = "".join(page_outputs(RECIPE))
    resumed = numbers_in(output, RESUMED)
    assert len(resumed) == 4 and resumed == numbers_in(shown, RESUMED)
    assert "DCP reads torch_checkpointing's: CheckpointException" in output
    assert "[rank1] torch_checkpointing: resumed from None" in output  # main(), under torchrun
    assert "page_tools" not in output and "differ" not in output, "the proofs are the build's"
    assert_no_traceback(output)
    assert recipe_runner.leftovers() == []
    assert recipe_runner.processes_left() == []


@pytest.mark.torchrun
def test_download_under_torchrun(recipe_runner):
    output = assert_ok(recipe_runner.torchrun(RECIPE, nproc=2))
    assert len(numbers_in(output, RESUMED)) == 4
    assert "torch_checkpointing reads DCP's: FileNotFoundError" in output
    assert_no_traceback(output)
    assert recipe_runner.leftovers() == []
