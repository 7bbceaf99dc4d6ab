"""The asynchronous object-storage page: what the build measured and proved against its S3
server, and its download.

The build times five ways of saving (local disk and S3, thread and process writers, S3 with
four upload threads) side by side, proves every checkpoint, and keeps the numbers in its
results file; the tests read it. The download imports nothing of page_tools, so it reads
its endpoint from the ``AWS_*`` environment: the tests start a server of their own
(``page_tools.object_store``), run the download against it as a reader would, and stop
it, leaving no process or port behind.
"""

from __future__ import annotations

import math

import pytest
from page_tools import stats
from recipe_runner import (
    assert_listed_claims_held,
    assert_no_traceback,
    assert_ok,
    build_results,
    numbers_in,
    page_outputs,
)

RECIPE = "object_storage_async_recipe"
WAYS = [
    "local disk, thread",
    "S3, thread",
    "local disk, process",
    "S3, process",
    "S3, 4 upload threads",
]
RANKS, SAVES, ROUNDS = 2, 4, 3
# 4 weights and biases, and Adam's exp_avg, exp_avg_sq and step for each of them.
TENSORS = 32
LOSS = r"^\[rank0\] round \d (.+?) +waited .* ms; loss (\S+)$"
WAITED = r"^\[rank0\] round \d .+? +waited ((?:\d+\+\d+ ?){4}) ms;"


@pytest.fixture(scope="module")
def results():
    return build_results(RECIPE)


def test_every_claim_held(results):
    assert_listed_claims_held(RECIPE, results["claims"])


def test_every_save_was_durable_and_every_checkpoint_bit_exact(results):
    complete = results["claims"]["every-checkpoint-complete"]["evidence"]
    assert complete["saves"] == complete["durable"] == RANKS * SAVES * len(WAYS) * (ROUNDS + 1)
    assert complete["errors"] == []
    exact = results["claims"]["warm-up-checkpoints-bit-exact"]["evidence"]
    assert exact["checkpoints"] == SAVES * len(WAYS) and set(exact["counts"]) == {0}
    assert exact["tensors"] == TENSORS and exact["values"] > 0
    timed = results["claims"]["timed-checkpoints-bit-exact"]["evidence"]
    assert timed["checkpoints"] == SAVES * len(WAYS) * ROUNDS and timed["differing"] == []
    assert timed["tensors"] == TENSORS


def test_every_way_was_timed_in_every_round(results):
    ways = results["values"]["ways"]
    assert list(ways) == WAYS
    for way, entry in ways.items():
        for metric in ("stall_s", "call_s", "upload_s"):
            values = entry[metric]
            assert len(values) == ROUNDS and all(0 < v < 30 for v in values), (way, metric)
        assert all(c <= s for c, s in zip(entry["call_s"], entry["stall_s"], strict=True)), way
        assert len(entry["losses"]) == ROUNDS + 1 and len(set(entry["losses"])) == 1
        assert all(math.isfinite(loss) for loss in entry["losses"])


def test_requests_per_save_follow_the_objects_each_way_writes(results):
    ways = results["values"]["ways"]
    for way in WAYS:
        sent = ways[way]["requests_per_save"]
        assert (sum(sent.values()) > 0) == way.startswith("S3"), (way, sent)
    # One data object per rank and upload thread, and .metadata.tmp (copied to .metadata).
    assert ways["S3, thread"]["requests_per_save"]["PUT"] == RANKS + 1
    assert ways["S3, process"]["requests_per_save"]["PUT"] == RANKS + 1
    assert ways["S3, 4 upload threads"]["requests_per_save"]["PUT"] == 4 * RANKS + 1
    objects = results["claims"]["four-threads-four-objects-per-rank"]["evidence"]["objects"]
    assert objects == {"S3, thread": 2, "S3, process": 2, "S3, 4 upload threads": 8}


def test_every_verdict_is_rendered_from_the_recorded_numbers(results):
    ways = results["values"]["ways"]
    verdicts = results["values"]["verdicts"]
    assert len(verdicts) == 5
    words = {"stall_s": "stall", "call_s": "stall in the call", "upload_s": "upload"}
    for key, sentence in verdicts.items():
        pair, metric = key.rsplit(": ", 1)
        a, b = pair.split(" vs ")
        expected, _ = stats.verdict(
            f"{words[metric]}, {a}", ways[a][metric], b, ways[b][metric], "ms", 1e3
        )
        assert sentence == expected, key
    shown = "".join(page_outputs(RECIPE)).replace("\n  ", " ")
    assert all(sentence in shown for sentence in verdicts.values()), "the page shows each"


@pytest.mark.download
def test_download_computes_what_the_page_shows(recipe_runner, s3_server):
    """Every way, every round: the losses the page shows; the download leaves nothing."""
    output = assert_ok(recipe_runner.notebook_run(RECIPE, world_size=2, **s3_server.env()))
    shown = "".join(page_outputs(RECIPE))
    assert numbers_in(output, LOSS) == numbers_in(shown, LOSS) != []
    assert {way for way, _ in numbers_in(output, LOSS)} == set(WAYS)
    assert len(numbers_in(output, WAITED)) == len(WAYS) * (ROUNDS + 1)
    assert "page_tools" not in output and "SeaweedFS" not in output, "the server is the test's"
    assert_no_traceback(output)
    assert s3_server.objects() == {}, "the download deleted its run's objects"
    assert recipe_runner.leftovers() == []
    assert recipe_runner.processes_left() == []


@pytest.mark.torchrun
def test_download_under_torchrun(recipe_runner, s3_server):
    output = assert_ok(recipe_runner.torchrun(RECIPE, nproc=2))
    assert "[rank0] saved 4 checkpoints; waited" in output, "main() ran under torchrun"
    assert_no_traceback(output)
    assert s3_server.objects() == {}
    assert recipe_runner.leftovers() == []
