"""The version matrix (``make versions``): its committed results, and the site rendering them.

Nothing here runs the matrix: the tests read ``_versions/results.json`` and the built site.
Every recipe on the site is either in the results for a release or shown as "not yet
measured" for it, with the command that measures it, on its page, its card and the page
"PyTorch versions".
"""

from __future__ import annotations

import json
import re
import sys

import pytest
import yaml
from recipe_runner import RECIPE_NAMES, RECIPES, ROOT, parsed_html

import dcp_site
from dcp_site import (
    CARD_MARKER,
    CHECKPOINT_KINDS,
    RUNS_ON_MARKER,
    TORCH_VERSIONS,
    VERSION_RESULTS,
    WORKAROUNDS,
    card_text,
    known_failure,
    load_version_results,
    recipe_versions,
    runs_on_text,
)

sys.path.insert(0, str(ROOT / "tools"))
import versions as matrix  # noqa: E402

RESULTS = load_version_results(ROOT)


def test_results_file_is_consistent():
    """Releases of TORCH_VERSIONS, recipes of the site, an outcome each, as the tool writes."""
    assert (ROOT / VERSION_RESULTS).exists(), "no results: make versions TORCH=2.13.0"
    assert RESULTS["command"] == dcp_site.VERSIONS_COMMAND
    for version, entry in RESULTS["versions"].items():
        assert version in TORCH_VERSIONS, version
        assert entry["torch"].split("+")[0] == version, entry["torch"]
        for key in ("date", "machine", "venv_gb", "setup_seconds", "recipes", "workarounds"):
            assert key in entry, (version, key)
        assert set(entry["recipes"]) <= set(RECIPE_NAMES), "a recipe the site no longer has"
        assert set(entry["workarounds"]) <= set(WORKAROUNDS)
        for name, outcome in {**entry["recipes"], **entry["workarounds"]}.items():
            assert outcome["status"] in ("passed", "failed"), (version, name)
            assert outcome["seconds"] >= 0, (version, name)
            if outcome["status"] == "failed":
                assert outcome["error"], (version, name, "a failure names its first line")


def test_a_known_failure_has_its_workaround_passing_on_that_release():
    """Where a recipe failed for a known reason, the workaround ran on that release and passed."""
    for version, entry in RESULTS["versions"].items():
        for name, outcome in entry["recipes"].items():
            known = known_failure(outcome.get("error", ""))
            if outcome["status"] != "failed" or known is None:
                continue
            fixes = [w for w, spec in WORKAROUNDS.items() if spec["fixes"] == known[0]]
            assert fixes, f"{version} {name}: {known[0]} has no workaround in the matrix"
            for workaround in fixes:
                ran = entry["workarounds"].get(workaround)
                assert ran and ran["status"] == "passed", (version, name, workaround, ran)


def test_no_page_states_its_torch_versions_by_hand():
    """Each recipe's Prerequisites card and landing-page card is written from the results."""
    for name in RECIPE_NAMES:
        docstring = (RECIPES / f"{name}.py").read_text().split('"""')[1]
        assert RUNS_ON_MARKER in docstring, f"{name}: its Prerequisites card needs the marker"
        assert not re.search(r"PyTorch 2\.\d+ or later|torch ≥", docstring), name
    index = (ROOT / "index.rst").read_text()
    assert "torch ≥" not in index
    for name in RECIPE_NAMES:
        card = re.search(
            rf":link: sphx_glr_recipes_{name}\.py.*?(?=grid-item-card::|\Z)", index, re.S
        )
        assert card and CARD_MARKER in card.group(0), f"{name}: its card's footer needs the marker"


def _says_each_release(text: str, name: str, where: str) -> None:
    found = recipe_versions(RESULTS, name)
    text = " ".join(text.split())
    parts = {part.split(":")[0].strip(): part for part in re.split(r"[;·]", text)}
    ran = " ".join(p for p in parts.values() if "ran there" in p or "runs on" in p)
    failed = " ".join(p for p in parts.values() if "fails on" in p)
    unmeasured = " ".join(p for p in parts.values() if "not yet measured" in p)
    for version in found["passed"]:
        assert version in ran, f"{where}: {version} passed but is not said: {text}"
    for version, _ in found["failed"]:
        assert version in failed, f"{where}: {version} failed but is not said: {text}"
    for version in found["unmeasured"]:
        assert version in unmeasured, f"{where}: {version} not said unmeasured: {text}"
    if found["unmeasured"]:
        assert "make versions" in text, f"{where}: no command for what is not measured"


@pytest.mark.parametrize("name", RECIPE_NAMES)
def test_page_says_which_torch_it_ran_on_from_the_results(site, name):
    doc = parsed_html(site / "recipes" / f"{name}.html")
    cards = [c for c in doc.select("div.card-prerequisites") if "Prerequisites" in c.get_text()]
    assert cards, f"{name}: no Prerequisites card"
    (line,) = [li for li in cards[0].select("li") if li.get_text().startswith("PyTorch")]
    _says_each_release(line.get_text(" "), name, f"{name} page")
    links = {a.get("href", "").split("#")[0] for a in line.select("a")}
    assert "../versions.html" in links, f"{name}: the line links the page PyTorch versions"
    for version, outcome in recipe_versions(RESULTS, name)["failed"]:
        known = known_failure(outcome["error"])
        if known:
            assert f"troubleshooting.html#{known[0]}" in str(line), (name, version)


def test_landing_page_cards_say_which_torch_each_recipe_ran_on(site):
    doc = parsed_html(site / "index.html")
    for card in doc.select("div.sd-card"):
        link = card.select_one("a[href^='recipes/']")
        if link is None:
            continue
        name = link["href"].split("/")[1].split(".html")[0]
        footer = card.select_one(".sd-card-footer").get_text(" ")
        _says_each_release(footer, name, f"{name} card")


def test_versions_page_shows_the_whole_matrix(site):
    doc = parsed_html(site / "versions.html")
    releases, matrix_table = doc.select("table")[:2]
    for row in releases.select("tbody tr"):
        cells = [td.get_text(" ", strip=True) for td in row.select("td")]
        if cells[0] not in RESULTS["versions"]:
            assert "not yet measured" in cells[1] and f"TORCH={cells[0]}" in cells[2], cells
    header = [th.get_text(strip=True) for th in matrix_table.select("thead th")]
    assert header == ["recipe", *TORCH_VERSIONS]
    rows = matrix_table.select("tbody tr")
    assert len(rows) == len(RECIPE_NAMES) + len(WORKAROUNDS)
    kinds = [("recipes", name) for name in RECIPE_NAMES] + [("workarounds", w) for w in WORKAROUNDS]
    for (kind, name), row in zip(kinds, rows, strict=True):
        cells = [td.get_text(" ", strip=True) for td in row.select("td")][1:]
        for version, cell in zip(TORCH_VERSIONS, cells, strict=True):
            outcome = RESULTS["versions"].get(version, {}).get(kind, {}).get(name)
            want = "not yet measured" if outcome is None else outcome["status"]
            assert cell.startswith(want), (name, version, cell)
    failures = doc.select_one("section#failures").get_text(" ")
    for version, entry in RESULTS["versions"].items():
        for name, outcome in entry["recipes"].items():
            if outcome["status"] == "failed":
                assert outcome["error"].split()[0] in failures, (version, name)


@pytest.mark.parametrize("kind", list(CHECKPOINT_KINDS))
def test_checkpoints_across_versions_are_consistent_and_shown(site, kind):
    """Saved by one release, loaded by another, per kind: the file's table, and the page's."""
    about = CHECKPOINT_KINDS[kind]
    table = RESULTS.get(about["key"], {})
    for saved_by, row in table.items():
        assert saved_by in TORCH_VERSIONS and row["saved"]["status"] in ("passed", "failed")
        assert set(row) <= {"saved", "loaded_by", about["via"]}, (kind, saved_by, set(row))
        for loaded_by, outcome in row.get("loaded_by", {}).items():
            assert loaded_by in TORCH_VERSIONS
            assert outcome["status"] == "passed" or outcome["error"], (saved_by, loaded_by)
        for loaded_by in row.get(about["via"], {}):
            assert row["loaded_by"][loaded_by]["status"] == "failed", "a way through a failure"
    doc = parsed_html(site / "versions.html")
    section = doc.select_one("section#checkpoints-across-versions")
    assert section is not None
    (sub,) = [s for s in section.select("section") if s.h3.get_text().startswith(about["title"])]
    if not table:
        assert "make versions CROSS=1" in sub.get_text()
        return
    rows = sub.select("table tbody tr")
    assert [r.select("td")[0].get_text(strip=True) for r in rows] == list(TORCH_VERSIONS)
    for row in rows:
        cells = [td.get_text(" ", strip=True) for td in row.select("td")]
        for loaded_by, cell in zip(TORCH_VERSIONS, cells[1:], strict=True):
            outcome = table.get(cells[0], {}).get("loaded_by", {}).get(loaded_by)
            want = {None: "not yet measured", "passed": "loads"}.get(
                outcome and outcome["status"], "fails"
            )
            assert cell.startswith(want), (cells[0], loaded_by, cell)


def test_the_new_kinds_ran_on_two_ranks_and_compared_every_value():
    """The DTensor kind's loads print each of the 2 ranks' comparison; the export's files
    are the consolidated ones, the ranks' pieces removed."""
    for kind in ("dtensor", "hf"):
        table = RESULTS.get(CHECKPOINT_KINDS[kind]["key"], {})
        for row in table.values():
            if kind == "hf" and row["saved"]["status"] == "passed":
                said = row["saved"]["last_lines"][0]
                assert (
                    "['model-00001-of-00001.safetensors', 'model.safetensors.index.json']" in said
                )
            for outcome in row.get("loaded_by", {}).values():
                if outcome["status"] == "passed":
                    (line,) = outcome["last_lines"]
                    assert re.search(r"rank [01] loaded .*: \d+ values equal$", line), line


# --------------------------------------------------------------------------
# The renderer and the tool, on made-up results (no run, no build)
# --------------------------------------------------------------------------

MADE_UP = {
    "versions": {
        "2.11.0": {
            "recipes": {
                "x": {
                    "status": "failed",
                    "seconds": 3.0,
                    "error": "KeyError: <class 'type'>",
                    "where": "torch/distributed/checkpoint/_state_dict_stager.py:1 in f",
                }
            }
        },
        "2.13.0": {"recipes": {"x": {"status": "passed", "seconds": 2.0}}},
    }
}


def test_runs_on_text_says_passed_failed_and_unmeasured():
    text = runs_on_text(MADE_UP, "x")
    assert text.startswith("PyTorch 2.13.0: ran there"), text
    assert "fails on 2.11.0: ``KeyError: <class 'type'>``" in text
    assert ":ref:`reused-stager-keyerror`: use a fresh ``DefaultStager`` per save" in text
    assert "not yet measured on 2.9.1, 2.10.0, 2.12.1, 2.14.1, 2.15.0" in text
    assert "``make versions TORCH=2.9.1``" in text
    assert card_text(MADE_UP, "x").startswith("runs on torch 2.13.0 · fails on 2.11.0")
    nothing = runs_on_text({"versions": {}}, "x")
    assert nothing.startswith("PyTorch not yet measured on 2.9.1"), nothing


def test_checkpoints_section_names_each_failure():
    made_up = {
        "checkpoints": {
            "2.15.0": {
                "saved": {"status": "passed", "seconds": 1.0},
                "loaded_by": {
                    "2.13.0": {
                        "status": "failed",
                        "seconds": 1.0,
                        "error": "ValueError: too many values to unpack (expected 5)",
                        "where": "torch/distributed/checkpoint/metadata.py:81 in __setstate__",
                    },
                    "2.15.0": {"status": "passed", "seconds": 1.0},
                },
                "via_torch_save": {"2.13.0": {"status": "passed", "seconds": 1.0}},
            }
        }
    }
    made_up["checkpoints_hf"] = {"2.9.1": {"saved": {"status": "passed", "seconds": 1.0}}}
    text = "\n".join(dcp_site.checkpoints_rst(made_up))
    assert "     - **fails** (C1); way through: loads" in text and "     - loads, equal" in text
    assert "``torch.load`` by the other) by 2.13.0: equal" in text
    assert "saved by 2.15.0, loaded by 2.13.0: ``ValueError: too many values" in text
    assert "metadata.py:81 in __setstate__``" in text
    assert "__setstate__``. Known: :ref:`newer-torch-checkpoint`." in text
    for about in CHECKPOINT_KINDS.values():
        assert f"\n{about['title']}\n{'~' * len(about['title'])}\n" in text, about["title"]
    model, dtensor, hf = (
        text.split(f"\n{about['title']}\n")[1].split("\n~~~")[0]
        for about in CHECKPOINT_KINDS.values()
    )
    # no results for the sharded kind: the command that measures it; the others' tables say
    # each pair that is not measured (the plain kind measured 2 of 49, the export none)
    assert "Not yet measured: ``make versions CROSS=1``." in dtensor and "list-table" not in dtensor
    assert model.count("not yet measured") == 47 and hf.count("not yet measured") == 49


TRACEBACK = """\
Traceback (most recent call last):
  File "/tmp/dcp-versions-1/x_recipe.py", line 351, in _run_forked
    raise RankFailedError(_describe_failure(recipe, failure, outputs, workdir))
RankFailedError: recipe 'x': rank 1 failed: rank 1 raised
[rank1]: Traceback (most recent call last):
[rank1]:   File "/tmp/dcp-versions-1/x_recipe.py", line 40, in train
[rank1]:     response = dcp.async_save(state, async_stager=stager)
[rank1]:   File "/v/site-packages/torch/distributed/checkpoint/staging.py", line 9, in _stage
[rank1]:     return self._copy(state_dict)
[rank1]: KeyError: <class 'type'>
"""


def test_first_error_is_the_exception_line_and_where_it_was_raised():
    error, where, recipe_line = matrix.first_error(TRACEBACK, "x_recipe.py")
    assert error == "KeyError: <class 'type'>"
    assert where == "torch/distributed/checkpoint/staging.py:9 in _stage"
    assert recipe_line == "x_recipe.py:40 in train"
    assert matrix.first_error("just this\nlast words\n", "x.py") == ("last words", "", "")


def test_matrix_venvs_take_requirements_pins_and_live_outside_the_repository():
    pins = matrix.pins()
    assert "torchdata==0.11.0" in pins and any(p.startswith("transformers==") for p in pins)
    # torch_checkpointing needs torch 2.11 or newer: older releases' venvs go without it.
    assert "torch-checkpointing==0.1.1" in pins and "torch-checkpointing==0.1.1" in matrix.pins(
        "2.11.0"
    )
    assert not any(p.startswith("torch-checkpointing") for p in matrix.pins("2.10.0"))
    assert not str(matrix.CACHE.resolve()).startswith(str(ROOT.resolve()))
    assert json.loads((ROOT / VERSION_RESULTS).read_text())["versions"] is not None


def test_ci_runs_the_same_command_over_the_same_releases():
    """The workflow's matrix job: make versions TORCH=<each release>, CPU wheels."""
    workflow = yaml.safe_load((ROOT / ".github" / "workflows" / "build.yml").read_text())
    job = workflow["jobs"]["versions"]
    assert job["strategy"]["matrix"]["torch"] == list(TORCH_VERSIONS)
    assert job["env"]["PIP_EXTRA_INDEX_URL"] == "https://download.pytorch.org/whl/cpu"
    commands = [step.get("run", "") for step in job["steps"]]
    assert "make versions TORCH=${{ matrix.torch }}" in commands, commands
