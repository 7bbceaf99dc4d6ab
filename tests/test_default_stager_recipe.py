"""The DefaultStager page: what the build proved and measured, and its download alone.

The build decides every claim of the page and keeps the outcome and the measured
timeline in its results file; the tests read it. The download (the loop without the
page's watches) runs alone, as a reader runs it, and must compute what the page shows.
"""

from __future__ import annotations

import ast
import json
import statistics

import pytest
from recipe_runner import (
    assert_no_traceback,
    assert_ok,
    build_results,
    checkpoint_files_in_repo,
    numbers_in,
    page_outputs,
    parsed_html,
    recipe_path,
)

from dcp_site import recipe_only

RECIPE = "default_stager_recipe"
SAVE_STEPS = [0, 3, 6, 9]  # NUM_STEPS, SAVE_EVERY = 10, 3
NUM_STEPS = 10
# 3 layers' weights and biases, and Adam's exp_avg, exp_avg_sq and step for each.
TENSORS = 24
TRACE = f"{RECIPE}.trace.json"  # rank 0's profiler trace of the DefaultStager loop
WEIGHTS = r"^\[rank\d\] (?:after step \d+|loaded step-\d): layers\.0\.weight\[0, :3\] = \[.*\]$"

# Every proof, figure and number the page showed before issue 19, and where it is now:
# the copy's thread and stager.close() (close-stops-the-staging-thread); the host buffers
# of the loop's saves (loop-reuses-host-buffers); Future against AsyncSaveResponse
# (async-save-returns-a-response); the timeline figure (test_page_shows_the_figure...);
# the per-save timeline of rank 0 (values "saves"); the blocked-time table, its median and
# the loop times (values "blocked_ms", "step_ms", "headline"); both traces described, with
# GPU streams on a GPU (values "traces", trace-holds-the-timeline, the GPU claim); every
# checkpoint bit for bit (checkpoint-step-N) and the live state moved on
# (training-changed-the-state). The default options, rule 5, buffer reuse and staging
# errors moved to stager_copies_recipe, which proves them.


@pytest.fixture(scope="module")
def built():
    return build_results(RECIPE)


def test_every_checkpoint_is_the_state_given_to_its_save(built):
    claims = built["claims"]
    for step in SAVE_STEPS:
        evidence = claims[f"checkpoint-step-{step}"]["evidence"]
        assert claims[f"checkpoint-step-{step}"]["held"] is True
        assert evidence["tensors"] == TENSORS and evidence["values"] > 0
        assert evidence["differ"] == evidence["missing"] == evidence["unexpected"] == []
    # Training changed every tensor between two saves: the checks above could have failed.
    assert claims["training-changed-the-state"]["evidence"]["differ"] == TENSORS
    assert claims["same-training-in-both-loops"]["evidence"]["differ"] == []


def test_the_copy_ran_on_the_stagers_thread_into_the_same_buffers(built):
    claims = built["claims"]
    stopped = claims["close-stops-the-staging-thread"]["evidence"]
    assert stopped["stopped"] == [True, True]
    assert all(t.startswith("ThreadPoolExecutor") for t in stopped["threads"])
    buffers = claims["loop-reuses-host-buffers"]["evidence"]
    assert buffers["saves"] == {"0": len(SAVE_STEPS), "1": len(SAVE_STEPS)}
    assert buffers["storages"] >= TENSORS and buffers["megabytes"] > 0
    assert claims["async-save-returns-a-response"]["evidence"]["returned"] == {
        "plain async_save": ["Future"],
        "DefaultStager": ["AsyncSaveResponse"],
    }


def interval(cell: str) -> tuple[float, float]:
    start, end = cell.split("\u2011")
    return float(start), float(end)


def test_each_optimizer_step_began_after_its_copy_ended(built):
    """Rank 0's saves after the first, in ms since each call: the table the page shows."""
    rows = built["values"]["saves"]
    assert [row[0] for row in rows] == SAVE_STEPS[1:]
    for step, returned, staging, forward, backward, optimizer_step, uploaded, beside in rows:
        staging, forward, backward = interval(staging), interval(forward), interval(backward)
        assert staging[0] >= 0, "the copy is asked for inside the call"
        assert forward[0] >= returned, "the next step begins once async_save has returned"
        assert staging[1] <= interval(optimizer_step)[0], f"save {step}: stepped before the copy"
        assert uploaded >= staging[1], "the upload writes the staged copy"
        overlap = min(staging[1], backward[1]) - max(staging[0], forward[0])
        assert beside == pytest.approx(max(0.0, overlap), abs=0.11)
    evidence = built["claims"]["optimizer-step-waits-for-staging"]["evidence"]
    assert evidence["late"] == [] and evidence["saves"] == 2 * len(rows)
    beside_ms = built["claims"]["copy-runs-beside-the-next-step"]["evidence"]["beside_ms"]
    assert any(ms > 0 for ms in beside_ms.values())


def test_blocked_time_and_loop_time_are_the_recorded_measurements(built):
    """The medians the page and make gpu-check show are those of the recorded values, and
    each verdict's noise call follows from their spreads."""
    values = built["values"]
    blocked, steps, headline = values["blocked_ms"], values["step_ms"], values["headline"]
    for name, key in (("async_save", "async_save"), ("DefaultStager", "default_stager")):
        assert len(blocked[name]) == len(SAVE_STEPS) - 1 and len(steps[name]) == NUM_STEPS
        assert headline[f"blocked_ms_{key}"] == pytest.approx(statistics.median(blocked[name]))
        assert headline[f"loop_s_{key}"] == pytest.approx(sum(steps[name]) / 1000)
    for measured in (blocked, steps):
        a, b = measured["DefaultStager"], measured["async_save"]
        noise = max(max(a) - min(a), max(b) - min(b))
        effect = abs(statistics.median(a) - statistics.median(b))
        assert measured["within_noise"] == (effect <= noise)
        assert ("within noise" in measured["verdict"]) == measured["within_noise"]


def test_the_traces_hold_the_loops(built):
    traces = built["values"]["traces"]
    stager, plain = traces["DefaultStager"], traces["async_save"]
    for trace in (stager, plain):
        assert trace["events"] > 0 and trace["megabytes"] > 0
        for phase in ("forward", "backward"):
            assert trace["training_thread"][phase] == NUM_STEPS
        # Ten steps and the zero-lr step get_state_dict runs to create Adam's state.
        assert trace["training_thread"]["optimizer.step"] == NUM_STEPS + 1
        assert trace["training_thread"]["async_save"] == len(SAVE_STEPS)
        assert trace["other_threads"]["upload"] == len(SAVE_STEPS)
    assert stager["training_thread"]["wait for staging"] == NUM_STEPS
    assert stager["other_threads"]["staging"] == len(SAVE_STEPS)
    assert plain["training_thread"]["staging"] == len(SAVE_STEPS)
    assert "wait for staging" not in plain["training_thread"]
    gpu = built["claims"]["copies-to-pinned-memory-off-the-compute-stream"]
    assert gpu["held"] is (True if stager["kernels_by_stream"] else None)


def test_page_shows_the_timeline_and_links_the_trace(site):
    page = parsed_html(site / "recipes" / f"{RECIPE}.html")
    assert page.select("img.sphx-glr-single-img"), "the timeline figure"
    assert len(page.select("table.dcp-results")) == 3, "saves, blocked time, trace ranges"
    links = {a.get_text(" ", strip=True): a["href"] for a in page.select("div.dcp-page-links a")}
    trace = site / "recipes" / links["Download the profiler trace"]
    events = json.loads(trace.read_text())["traceEvents"]
    names = {e.get("name") for e in events if e.get("cat") == "user_annotation"}
    assert {"forward", "wait for staging", "staging", "upload"} <= names
    assert not any("USDT" in text for text in page_outputs(RECIPE)), "no profiler log lines"


@pytest.mark.download
def test_download_computes_what_the_page_shows(recipe_runner):
    """The page's watches do not change the loop: the same weights after training, in both
    loops and at every checkpoint, as on the page; and nothing of the page's work."""
    output = assert_ok(recipe_runner.notebook_run(RECIPE, world_size=2))
    shown = "".join(page_outputs(RECIPE))
    weights = numbers_in(output, WEIGHTS)
    assert weights == numbers_in(shown, WEIGHTS) and len(weights) == 2 * (3 + len(SAVE_STEPS))
    assert "page_tools" not in output and "differ" not in output, "the proofs are the build's"
    assert_no_traceback(output)
    assert "removed" in output and recipe_runner.leftovers() == [], "no trace: that is the page's"
    assert recipe_runner.processes_left() == []
    assert checkpoint_files_in_repo() == []


@pytest.mark.torchrun
def test_download_under_torchrun(recipe_runner):
    output = assert_ok(recipe_runner.torchrun(RECIPE, nproc=2))
    for rank in (0, 1):
        assert output.count(f"[rank{rank}] after step {NUM_STEPS}: layers.0.weight") == 3
        assert f"[rank{rank}] loaded step-9: layers.0.weight" in output
    assert_no_traceback(output)
    assert recipe_runner.leftovers() == []
    assert recipe_runner.processes_left() == []


def visible_function(name: str) -> str:
    source = recipe_only(recipe_path(RECIPE).read_text())
    for node in ast.parse(source).body:
        if isinstance(node, ast.FunctionDef) and node.name == name:
            return ast.get_source_segment(source, node)
    raise AssertionError(f"no function {name} in the download")


def test_the_loop_follows_the_rules_it_states():
    """In the loop a reader pastes: wait for staging right before optimizer.step (rule 7),
    for the upload before the next save (rule 3), synchronize right before it (rule 4)."""
    lines = [line.strip() for line in visible_function("train_with_default_stager").splitlines()]
    step = lines.index("optimizer.step()")
    assert lines[step - 1] == "response.staging_completion.result()  # rule 7"
    save = lines.index("response = dcp.async_save(")
    assert lines[save - 3 : save] == [
        "response.upload_completion.result()  # rule 3",
        "if torch.accelerator.is_available():",
        "torch.accelerator.current_stream().synchronize()  # rule 4",
    ]
    assert lines[save + 2] == (
        "storage_writer=dcp.FileSystemWriter(path, per_thread_copy_ahead=0),  # rule 10"
    )
    assert "stager = DefaultStager(staging_options(use_async_staging=True))  # rule 2" in lines
    close = lines.index("stager.close()  # rule 8: stops its thread and drops its buffer cache")
    assert lines[close - 1] == "response.upload_completion.result()  # rule 8"
    assert lines[close + 1] == "dist.destroy_process_group(checkpoint_group)  # rule 9"
    assert ".. versionadded:: 2.9" in recipe_path(RECIPE).read_text()
