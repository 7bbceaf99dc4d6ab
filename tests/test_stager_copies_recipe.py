"""The page on what DefaultStager copies, and when: what the build proved, and its download.

The build decides every claim (the page holds each race to one outcome, with
``page_tools.faults``, so that it is the same on every build) and keeps the evidence in
its results file; the tests read it. The download runs the same code without the holds,
as a reader runs it: what is not a race must come out as on the page.
"""

from __future__ import annotations

import statistics

import pytest
from recipe_runner import (
    RESULTS,
    assert_no_traceback,
    assert_ok,
    build_results,
    numbers_in,
    page_outputs,
)

RECIPE = "stager_copies_recipe"
STRATEGIES = ["dcp.save", "async_save", "async_save + reused DefaultStager"]
SAVES = 20
RSS_LINE = r"^\[rank\d\] (.+): RSS above the start, MB$"
# What is the same whoever wins the race: the int and the copy of the dict.
FIXED_AT_THE_CALL = (
    r"^\[rank0\] passed dict\(progress\): the loop now has step=4, progress=\{.*\}\n"
    r"\[rank0\]   the checkpoint holds step=3, progress=\{'samples_seen': 300\}$"
)
UPLOAD_RAISED = (
    r"^\[rank(\d)\] upload_completion\.result\(\) raised TypeError: "
    r"cannot pickle 'generator' object$"
)


@pytest.fixture(scope="module")
def claims():
    return build_results(RECIPE)["claims"]


def test_values_are_fixed_at_the_call_and_containers_later(claims):
    assert claims["int-fixed-at-the-call"]["evidence"]["value"] == 3
    assert claims["dict-by-reference-copied-later"]["evidence"]["value"] == 400
    assert claims["copy-of-the-dict-fixed-at-the-call"]["evidence"]["value"] == 300
    # The page's hold let each copy go at the loop's next wait, one copy at a time.
    assert claims["int-fixed-at-the-call"]["evidence"]["released"] == {"0": [1, 1], "1": [1, 1]}


def test_live_tensors_reuse_the_host_buffers_and_clones_do_not(claims):
    assert claims["live-tensors-reuse-host-buffers"]["evidence"]["reused"] == [True, True]
    assert claims["clones-get-new-host-buffers"]["evidence"]["reused"] == [False, False]
    # A weight and a bias: the first clones' two entries went with them.
    assert claims["freed-clones-leave-the-cache"]["evidence"]["cached"] == [2, 2]


def test_the_reuse_saves_had_a_writer_that_copies_nothing_ahead(claims):
    # 2 runs (live weights, clones) of 2 saves on each of 2 ranks, each given its stager.
    evidence = claims["host-writer-copies-nothing-ahead"]["evidence"]
    assert evidence == {"saves": 8, "copy_ahead": ["0"]}


def test_a_staging_error_is_raised_by_upload_completion(claims):
    waits = claims["upload-completion-raises-the-staging-error"]["evidence"]["waits"]
    assert set(waits) == {"0", "1"}
    for wait in waits.values():
        assert wait["wait for staging"] is None, "staging_completion reported success"
        assert wait["wait for upload"] == "TypeError: cannot pickle 'generator' object"


def test_the_default_options_need_an_accelerator(claims):
    outcome = claims["default-options-need-an-accelerator"]
    assert outcome["held"] is True
    raised = outcome["evidence"]["raised"]
    assert raised == [None] or raised[0].startswith("AssertionError: Non-blocking copy")


@pytest.fixture(scope="module")
def values():
    return build_results(RECIPE)["values"]


def test_memory_growth_and_its_verdict_follow_from_the_raw_rss(values):
    for strategy in STRATEGIES:
        runs, summary = values["memory_runs"][strategy], values["memory"][strategy]
        assert all(len(run["rss"]) == SAVES and run["rss_before"] > 0 for run in runs)
        growth = []
        for run in runs:  # saves 6-10 against saves 16-20, medians, per save between them
            early, late = run["rss"][5:10], run["rss"][15:]
            effect = statistics.median(late) - statistics.median(early)
            noise = max(max(early) - min(early), max(late) - min(late))
            growth.append((effect / 10, noise / 10))
        rank = max(range(len(runs)), key=lambda r: growth[r][0])
        assert summary["rank"] == rank
        assert (summary["per_save"], summary["noise_per_save"]) == pytest.approx(growth[rank])
        within = abs(growth[rank][0]) <= growth[rank][1]
        assert summary["verdict"] == (
            "within noise" if within else "grows" if growth[rank][0] > 0 else "shrinks"
        )
        assert summary["held"] == runs[rank]["rss"][-1] - runs[rank]["rss_before"]
        assert len(summary["heap"]) == SAVES, "glibc's counters at every RSS reading"


def test_the_memory_headline_is_the_strategy_that_grew_most(claims, values):
    memory = values["memory"]
    grew_most = max(memory, key=lambda name: memory[name]["per_save"])
    assert values["headline"] == pytest.approx(
        {
            "most_rss_growth": grew_most,
            "rss_growth_MB_per_save": memory[grew_most]["per_save"] / 1e6,
            "rss_growth_of_share": memory[grew_most]["per_save"] / memory[grew_most]["share"],
        }
    )
    ranks = len(values["memory_runs"]["dcp.save"])
    evidence = claims["memory-checkpoints-load-back"]["evidence"]
    assert (evidence["checkpoints"], evidence["loads"]) == (
        len(STRATEGIES),
        len(STRATEGIES) * ranks,
    )
    assert (RESULTS / f"{RECIPE}.png").read_bytes().startswith(b"\x89PNG"), "the RSS figure"


@pytest.mark.download
def test_download_computes_what_the_page_shows(recipe_runner):
    """Without the page's holds the dict passed by reference is a race; the rest is not."""
    output = assert_ok(recipe_runner.notebook_run(RECIPE, world_size=2))
    shown = "".join(page_outputs(RECIPE))
    assert numbers_in(output, FIXED_AT_THE_CALL) == numbers_in(shown, FIXED_AT_THE_CALL) != []
    assert sorted(numbers_in(output, UPLOAD_RAISED)) == ["0", "1"]
    assert "saved clones of the weights twice: ['save-0', 'save-1']" in output
    assert sorted(numbers_in(output, RSS_LINE)) == sorted(numbers_in(shown, RSS_LINE)) != []
    # In the recipe's cell and in main(), run as torchrun would run it.
    assert output.count("[rank0] saved the live weights twice: ['save-0', 'save-1']") == 2
    assert "page_tools" not in output and "differ" not in output, "the proofs are the build's"
    assert_no_traceback(output)
    assert recipe_runner.leftovers() == []
    assert recipe_runner.processes_left() == []


@pytest.mark.torchrun
def test_download_under_torchrun(recipe_runner):
    output = assert_ok(recipe_runner.torchrun(RECIPE, nproc=2))
    # Once in the recipe's cell, once in main(): both under torchrun's ranks.
    assert len(numbers_in(output, FIXED_AT_THE_CALL)) == 2
    assert output.count("[rank0] saved the live weights twice: ['save-0', 'save-1']") == 2
    assert sorted(numbers_in(output, UPLOAD_RAISED)) == ["0", "1"]
    assert sorted(set(numbers_in(output, RSS_LINE))) == sorted(STRATEGIES)
    assert_no_traceback(output)
    assert recipe_runner.leftovers() == []
