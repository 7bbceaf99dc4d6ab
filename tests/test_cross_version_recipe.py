"""The cross-version page (issue 21, item 3): what the build proved, the committed matrix it
renders, the committed torch 2.15.0 checkpoint it loads, and its download alone.

The build decides every claim and keeps its evidence in the page's results file; these
tests read it, and compare the page's tables with ``_versions/results.json``. The fixture
(``recipes_source/cross_version_fixture``, ``python3 tools/versions.py --fixture``) is
read again here, on the test's torch. The download runs alone, where the fixture is not:
it says so in one line and does everything else.
"""

from __future__ import annotations

import json
import re

import pytest
import torch
from page_tools import versions_matrix
from recipe_runner import (
    HTML,
    RECIPES,
    assert_listed_claims_held,
    assert_no_traceback,
    assert_ok,
    build_results,
    page_outputs,
    parsed_html,
)

from dcp_site import CHECKPOINT_KINDS, TORCH_VERSIONS, load_version_results

RECIPE = "cross_version_recipe"
FIXTURE = RECIPES / "cross_version_fixture"
NEWER = "2.15.0"
HERE = torch.__version__.split("+")[0]
MATRIX = versions_matrix.committed()
SKIPPED = (
    "no cross_version_fixture/saved-by-torch-2.15.0{} here (it is in the site's repository): "
    "skipped"
)


@pytest.fixture(scope="module")
def built():
    return build_results(RECIPE)


def test_every_listed_claim_held(built):
    assert_listed_claims_held(RECIPE, built["claims"])


def test_the_page_counted_the_committed_pairs(built):
    """The build read the file as it is committed: the pairs measured and failed, per kind."""
    results = load_version_results()
    measured, failed = {}, []
    for kind, about in CHECKPOINT_KINDS.items():
        table = results.get(about["key"], {})
        measured[kind] = sum(len(row.get("loaded_by", {})) for row in table.values())
        for saved_by in TORCH_VERSIONS:
            for loaded_by, outcome in table.get(saved_by, {}).get("loaded_by", {}).items():
                if outcome["status"] != "passed":
                    failed.append(f"{kind}: {saved_by} -> {loaded_by}")
    assert built["values"]["pairs-measured"] == measured
    assert sorted(built["values"]["pairs-failed"]) == sorted(failed)
    assert all(n <= len(TORCH_VERSIONS) ** 2 for n in measured.values())


def _page_tables():
    doc = parsed_html(HTML / "recipes" / f"{RECIPE}.html")
    return {t.caption.get_text(): t for t in doc.select("table.dcp-results") if t.caption}


@pytest.mark.parametrize("kind", list(CHECKPOINT_KINDS))
def test_the_page_table_is_the_committed_matrix(kind):
    table = _page_tables()[CHECKPOINT_KINDS[kind]["title"]]
    header = [th.get_text() for th in table.select("thead th")]
    assert header == ["saved by \\ loaded by", *TORCH_VERSIONS]
    rows = [[td.get_text() for td in tr.select("td")] for tr in table.select("tbody tr")]
    assert [row[0] for row in rows] == list(TORCH_VERSIONS)
    for row in rows:
        for loaded_by, cell in zip(TORCH_VERSIONS, row[1:], strict=True):
            found = versions_matrix.outcome(MATRIX, kind, row[0], loaded_by)
            want = {None: "not measured", "passed": "loads"}.get(found and found["status"], "fails")
            assert cell.startswith(want), (kind, row[0], loaded_by, cell)
            if want == "fails" and found["via"] is not None:
                assert cell.endswith(
                    "way through " + ("loads" if found["via"]["status"] == "passed" else "fails")
                )


def test_every_failure_is_listed_with_its_first_line():
    table = _page_tables()["Every load that failed"]
    listed = {tr.select("td")[1].get_text() for tr in table.select("tbody tr")}
    for kind in CHECKPOINT_KINDS:
        for _, _, found in versions_matrix.pairs(MATRIX, kind):
            if found is not None and found["status"] != "passed":
                assert found["error"] in listed, (kind, found["error"])


def test_the_fixture_is_small_and_saved_by_the_newer_release():
    made = json.loads((FIXTURE / "made.json").read_text())
    assert made["torch"].startswith(NEWER + "+") or made["torch"] == NEWER
    files = {p.relative_to(FIXTURE).as_posix(): p.stat().st_size for p in FIXTURE.rglob("*")}
    files.pop("made.json")
    files.pop(f"saved-by-torch-{NEWER}")  # the directory
    assert files == made["files"], "the committed files are the ones the tool made"
    assert set(files) == {
        f"saved-by-torch-{NEWER}/.metadata",
        f"saved-by-torch-{NEWER}/__0_0.distcp",
        f"saved-by-torch-{NEWER}.pt",
    }
    assert sum(files.values()) < 100_000


@pytest.mark.skipif(HERE == NEWER, reason="this torch is the fixture's own")
def test_the_newer_checkpoint_fails_here_as_the_matrix_and_the_page_say(built):
    """This torch cannot read 2.15.0's .metadata; the error is the matrix's for this release."""
    from torch.distributed.checkpoint import FileSystemReader

    with pytest.raises(Exception) as raised:
        FileSystemReader(str(FIXTURE / f"saved-by-torch-{NEWER}")).read_metadata()
    seen = f"{type(raised.value).__name__}: {raised.value}"
    measured = versions_matrix.outcome(MATRIX, "model", NEWER, HERE)
    if measured is not None:
        assert measured["status"] == "failed" and measured["error"] == seen
    evidence = built["claims"]["newer-checkpoint-fails-here-as-measured"]["evidence"]
    assert evidence["seen"]["status"] == "failed"
    # dcp.load's own error first, then the cause read_metadata raised
    assert len(evidence["seen"]["errors"]) == 2 and evidence["seen"]["errors"][1] == seen
    shown = "".join(page_outputs(RECIPE))
    assert f"read_metadata: {seen}" in shown


def test_the_converted_fixture_loads_here_with_the_saved_values():
    script = versions_matrix.cross_version_script()
    saved = dict(script.flat(script.state(*script.model_and_optimizer(seed=0))))
    loaded = dict(
        script.flat(torch.load(FIXTURE / f"saved-by-torch-{NEWER}.pt", weights_only=True))
    )
    assert saved.keys() == loaded.keys() and len(saved) == 32
    assert all(script.same(saved[k], loaded[k]) for k in saved)


@pytest.mark.download
def test_download_prints_what_the_page_shows(recipe_runner):
    output = assert_ok(recipe_runner.notebook_run(RECIPE, world_size=2))
    shown = "".join(page_outputs(RECIPE))
    for line in (
        "one process: saved and loaded ['.metadata', '__0_0.distcp']",
        "[rank1] 2 ranks: layers.0.weight loaded, this rank's shard (8, 16)",
        "[rank0] exported ['model-00001-of-00001.safetensors', 'model.safetensors.index.json']",
        "[rank1] imported 4 tensors into the sharded model",
        "[rank0] for older torch: step-2.pt",
    ):
        assert line in output and line in shown, line
    # Alone, the download has no fixture: one line each, where the page loads it.
    assert output.count(SKIPPED.format("")) == 1 and output.count(SKIPPED.format(".pt")) == 1
    assert "page_tools" not in output and "differ" not in output, "the proofs are the build's"
    assert_no_traceback(output)
    assert recipe_runner.leftovers() == []
    assert recipe_runner.processes_left() == []


@pytest.mark.torchrun
def test_download_under_torchrun(recipe_runner):
    output = assert_ok(recipe_runner.torchrun(RECIPE, nproc=2))
    assert re.search(r"\[rank1\]:? 2 ranks: layers\.0\.weight loaded", output), output[-3000:]
    assert "imported 4 tensors into the sharded model" in output
    assert "for older torch: step-2.pt" in output
    assert_no_traceback(output)
    assert recipe_runner.leftovers() == []
