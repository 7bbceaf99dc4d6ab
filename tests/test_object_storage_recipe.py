"""The object-storage page: what the build proved against its S3 server, and its download.

The build decides every claim against the SeaweedFS server the page starts, and keeps
the outcome in its results file; the tests read it. The download imports nothing of
page_tools, so it reads its endpoint from the ``AWS_*`` environment: the tests start a
server of their own (``page_tools.object_store``), run the download against it as a
reader would, and stop it, leaving no process or port behind.
"""

from __future__ import annotations

import pytest
from recipe_runner import (
    assert_no_traceback,
    assert_ok,
    build_results,
    numbers_in,
    page_outputs,
)

RECIPE = "object_storage_recipe"
LOADS = ["load-from-s3", "load-on-one-rank", "load-on-three-ranks", "resumed-bit-exact"]
# 4 weights and biases, and Adam's exp_avg, exp_avg_sq and step for each of them.
TENSORS = 16
LOSS = r"^\[rank0\] step \d+: loss \d\.\d{4}"
OBJECT = r"^__\d_0\.distcp +[\d,]+ bytes$"
ROW = r"layers\.0\.weight\[0, :3\] = \[.*\]$"


@pytest.fixture(scope="module")
def results():
    return build_results(RECIPE)


def test_every_claim_held(results):
    assert {name: c["held"] for name, c in results["claims"].items() if not c["held"]} == {}


@pytest.mark.parametrize("claim", LOADS)
def test_every_load_from_s3_is_the_saved_state_bit_for_bit(results, claim):
    evidence = results["claims"][claim]["evidence"]
    assert evidence["tensors"] == TENSORS and evidence["values"] > 0
    assert evidence["differ"] == evidence["missing"] == evidence["unexpected"] == []


def test_the_kill_left_a_torn_step_and_the_resume_went_back_to_the_last_complete(results):
    claims = results["claims"]
    assert claims["keep-latest-k"]["evidence"]["left"] == {"30": True, "40": True}
    killed = claims["killed-mid-upload-fails-naming-the-endpoint"]["evidence"]
    (path,) = killed["killed"]["0"]
    assert path.endswith("/run/step-00000050/__0_0.distcp")
    causes = [cause for rank in killed["failed"] for cause in rank]
    assert causes and all("Could not connect to the endpoint URL" in c for c in causes), causes
    assert claims["torn-after-the-kill"]["said"] == "torn: {30: True, 40: True, 50: False}"


def test_bad_inputs_fail_with_their_own_errors(results):
    claims = results["claims"].items()
    outcome = {name: c["evidence"]["outcome"] for name, c in claims if name.endswith("-fast")}
    assert len(outcome) == 4
    assert "signature we calculated does not match" in outcome["wrong-secret-fails-fast"]
    assert outcome["save-no-bucket-fails-fast"].startswith("PermissionError")
    assert "bucket does not exist" in outcome["load-no-bucket-fails-fast"]
    assert '"http://127.0.0.1:1/' in outcome["no-server-fails-fast"]


def test_requests_and_bytes_per_save(results):
    local, default, per_tensor, threads = results["values"]["requests-per-save"]
    assert sum(local.values()) == 0, "a local save sends no S3 request"
    # 2 ranks: one data object each and .metadata.tmp, which is copied to .metadata.
    assert (default["PUT"], default["COPY"], default["DELETE"]) == (3, 1, 1)
    assert threads["PUT"] == 5 and per_tensor["PUT"] > 2 * TENSORS
    data = results["values"]["data-bytes"]
    assert len(set(data.values())) == 1, data


@pytest.mark.download
def test_download_computes_what_the_page_shows(recipe_runner, s3_server):
    """No kill in the download: its losses and objects are the page's, it leaves nothing."""
    output = assert_ok(recipe_runner.notebook_run(RECIPE, world_size=2, **s3_server.env()))
    shown = "".join(page_outputs(RECIPE))
    assert sorted(numbers_in(output, LOSS)) == sorted(numbers_in(shown, LOSS)) != []
    assert numbers_in(output, OBJECT) == numbers_in(shown, OBJECT) != []
    assert set(numbers_in(output, ROW)) == set(numbers_in(shown, ROW)) != set()
    assert "page_tools" not in output and "SeaweedFS" not in output, "the server is the test's"
    assert_no_traceback(output)
    assert s3_server.objects() == {}, "the download deleted its run's objects"
    assert recipe_runner.leftovers() == []
    assert recipe_runner.processes_left() == []


@pytest.mark.torchrun
def test_download_under_torchrun(recipe_runner, s3_server):
    output = assert_ok(recipe_runner.torchrun(RECIPE, nproc=2))
    assert "[rank0] done at step 20; complete: [10, 20]" in output, "main() ran under torchrun"
    assert_no_traceback(output)
    assert s3_server.objects() == {}
    assert recipe_runner.leftovers() == []
