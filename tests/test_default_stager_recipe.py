"""Recipe 3: fully asynchronous staging with DefaultStager."""

from __future__ import annotations

import ast
import collections
import json
import re

import pytest
from bs4 import BeautifulSoup
from recipe_runner import assert_no_traceback, assert_ok, checkpoint_files_in_repo, recipe_path
from sphinx_gallery import py_source_parser

RECIPE = "default_stager_recipe"
SAVE_STEPS = [3, 6, 9]  # NUM_STEPS, SAVE_EVERY = 10, 3; the step-0 save is awaited at once
TRACE = f"{RECIPE}.trace.json"  # rank 0's profiler trace of the DefaultStager loop

# The contract check: one line per rank and checkpoint, printed by the rank that loaded it.
CONTRACT = re.compile(
    r"\[rank(\d+)\] checkpoint at step (\d+): (\d+) tensors compared with the state at the "
    r"save: (\d+) differ \(from the live state at the end: (\d+) differ\)"
)
# Each rank names the thread that staged and says whether it ran before and after close().
CLOSED = re.compile(
    r"\[rank(\d+)\] staging ran on (\S.*); running before stager\.close\(\): \[(.*)\], "
    r"after: \[(.*)\]"
)
# Each rank: the host buffers of the loop's saves, and whether every save reused them.
REUSED = re.compile(
    r"\[rank(\d+)\] host buffers of the (\d+) saves: (\d+) \(([\d.]+) MB\), "
    r"the same ones at every save: (True|False)"
)
# The measured intervals of each save (rank 0, ms since the async_save call).
N = r"-?[\d.]+"
SAVE = re.compile(
    rf"save after step (?P<step>\d+): async_save returned at (?P<returned>{N}); "
    rf"staging (?P<staging_start>{N})-(?P<staging_end>{N}); "
    rf"step (?P<next>\d+): forward (?P<forward_start>{N})-(?P<forward_end>{N}), "
    rf"backward (?P<backward_start>{N})-(?P<backward_end>{N}), "
    rf"optimizer\.step (?P<step_start>{N})-(?P<step_end>{N}); upload done at (?P<uploaded>{N})"
)
# Rule 5: an int passed to async_save is fixed at the call, a dict passed by reference is not.
VALUES = re.compile(
    r"\[rank0\] passed (\S+): the loop now has step=(\d+), progress=(\{.*\})\n"
    r"\[rank0\]   the checkpoint holds step=(\d+), progress=(\{.*\})"
)
# Buffer reuse: live tensors reuse the stager's host buffers, clones do not.
BUFFERS = re.compile(
    r"\[rank0\] (model\.state_dict\(\)|clones of model\.state_dict\(\)) +the second save copied "
    r"into the first's host buffers: (True|False); still cached once the loop drops its state "
    r"dict: (\d+)"
)
# A staging error: swallowed by staging_completion, raised by upload_completion.
STAGING_SWALLOWED = re.compile(r"\[rank(\d+)\] staging_completion\.result\(\) returned")
UPLOAD_RAISED = re.compile(
    r"\[rank(\d+)\] upload_completion\.result\(\) raised TypeError: "
    r"cannot pickle 'generator' object"
)
DEFAULTS_RAISE = (
    "[rank0] DefaultStager() with the default options: AssertionError: "
    "Non-blocking copy requires that the current accelerator is available."
)
CPU_OPTIONS = (
    "[rank0] this page stages with StagingOptions(use_pinned_memory=False, "
    "use_shared_memory=False, use_async_staging=True, use_non_blocking_copy=False)"
)


def assert_contract_holds(output: str, world_size: int) -> None:
    found = {(int(rank), int(step)): rest for rank, step, *rest in CONTRACT.findall(output)}
    expected = {(rank, step) for rank in range(world_size) for step in SAVE_STEPS}
    assert set(found) == expected, f"contract lines {sorted(found)}\n{output[-4000:]}"
    for (rank, step), (compared, differ, moved_on) in found.items():
        assert int(compared) > 0
        assert int(differ) == 0, f"rank {rank}: checkpoint {step} is not the state at its save"
        # Training changed the live tensors after every save, so the check could have failed.
        assert int(moved_on) > 0


def assert_stager_closed(output: str, world_size: int) -> None:
    lines = CLOSED.findall(output)
    assert sorted(int(rank) for rank, *_ in lines) == list(range(world_size)), output[-4000:]
    for rank, names, before, after in lines:
        threads = names.split(", ")
        assert all(name.startswith("ThreadPoolExecutor") for name in threads), names
        # The staging thread is found alive before close(): the check can see a running one.
        assert before.split(", ") == ["True"] * len(threads), f"rank {rank}: {before}"
        assert after.split(", ") == ["False"] * len(threads), f"rank {rank}: still running"


def assert_loop_reused_host_buffers(output: str, world_size: int) -> None:
    """Issue 15.11: with every option but async staging off, the saves reuse one set of buffers."""
    lines = REUSED.findall(output)
    assert sorted(int(rank) for rank, *_ in lines) == list(range(world_size)), output[-4000:]
    for rank, saves, buffers, megabytes, same in lines:
        assert int(saves) == 1 + len(SAVE_STEPS)
        # Model and Adam state: at least three storages per parameter of 3 layers x 2.
        assert int(buffers) >= 3 * 6, f"rank {rank}: {buffers} buffers"
        assert float(megabytes) > 0
        assert same == "True", f"rank {rank}: a save allocated new host buffers"


def overlaps(a: tuple[float, float], b: tuple[float, float]) -> bool:
    return a[0] < b[1] and b[0] < a[1]


def assert_staging_overlaps_compute(output: str) -> None:
    saves = [{k: float(v) for k, v in m.groupdict().items()} for m in SAVE.finditer(output)]
    assert [int(save["step"]) for save in saves] == SAVE_STEPS, output[-4000:]
    overlapped = []
    for save in saves:
        step = int(save["step"])
        assert save["next"] == step + 1
        staging = (save["staging_start"], save["staging_end"])
        forward = (save["forward_start"], save["forward_end"])
        backward = (save["backward_start"], save["backward_end"])
        # The optimizer stepped only after the copy, and the upload came after the copy.
        assert staging[1] <= save["step_start"], f"save {step}: optimizer.step() before staging"
        assert save["uploaded"] >= staging[1]
        if overlaps(staging, forward) or overlaps(staging, backward):
            overlapped.append(step)
    said = re.findall(r"the copy ran beside step (\d+)'s forward and backward pass", output)
    assert [int(n) - 1 for n in said] == overlapped, "the page's summary matches the data"
    return overlapped


def assert_values_and_containers(output: str) -> None:
    """Issue 15.10: the int is saved as at the call; the dict by reference as changed after it."""
    found = {passed: rest for passed, *rest in VALUES.findall(output)}
    assert set(found) == {"progress", "dict(progress)"}, output[-4000:]
    for now_step, now_progress, saved_step, _ in found.values():
        assert (now_step, now_progress) == ("4", "{'samples_seen': 400}")
        assert saved_step == "3", "an int changed after async_save reached the checkpoint"
    assert found["progress"][3] == "{'samples_seen': 400}", "the dict was saved as it was changed"
    assert found["dict(progress)"][3] == "{'samples_seen': 300}", "the copy is the state at call"


def assert_buffer_reuse(output: str) -> None:
    """Issue 15.11: reuse is keyed on the source storage: live tensors reuse, clones do not."""
    found = {what: (same, cached) for what, same, cached in BUFFERS.findall(output)}
    assert found == {
        "model.state_dict()": ("True", "2"),
        "clones of model.state_dict()": ("False", "0"),
    }, output[-4000:]


def assert_staging_error_surfaces(output: str, world_size: int, swallowed: bool) -> None:
    """Issue 15.12: upload_completion raises the staging error on every rank."""
    raised = sorted(int(rank) for rank in UPLOAD_RAISED.findall(output))
    assert raised == list(range(world_size)), output[-4000:]
    if swallowed:
        # The build lets the copy fail before async_save looks: staging_completion says success.
        assert sorted(int(r) for r in STAGING_SWALLOWED.findall(output)) == raised


def assert_profiler_traces(output: str, recipe_runner) -> None:
    """Issue 14.2: the loop's phases are profiler ranges; the stager copies on its own thread.

    The DefaultStager loop's trace is the reader's to keep: it lies beside the script.
    """
    traces = dict(re.findall(r"([\w.]+\.trace\.json): ([\d.]+) MB, \d+ events", output))
    assert set(traces) == {TRACE, "plain_async_save.trace.json"}, output[-3000:]
    assert all(float(size) > 0 for size in traces.values())
    phases = re.findall(r"  on the training thread: (.*)", output)
    assert phases == [
        "forward x10, backward x10, wait for staging x10, optimizer.step x10, "
        "wait for upload x4, async_save x4",
        "forward x10, backward x10, optimizer.step x10, wait for upload x4, async_save x4",
    ], phases
    assert "  DefaultStager: copy to host x4, on a thread of its own" in output
    events = json.loads((recipe_runner.workdir / TRACE).read_text())["traceEvents"]
    ranges = collections.Counter(e["name"] for e in events if e.get("cat") == "user_annotation")
    assert ranges["forward"] == 10 and ranges["DefaultStager: copy to host"] == 4, ranges


def assert_cleaned_up(output: str, recipe_runner, trace: bool = True) -> None:
    assert re.search(r"removed \S+: True", output)
    assert recipe_runner.leftovers() == ([f"beside the script: {TRACE}"] if trace else [])
    assert recipe_runner.processes_left() == []
    assert checkpoint_files_in_repo() == []


def test_recipe_with_gallery_launcher(recipe_runner):
    """The page's download, as a plain script on 2 ranks: every claim the page prints."""
    output = assert_ok(recipe_runner.python(RECIPE, world_size=2))
    assert_no_traceback(output)
    assert_contract_holds(output, world_size=2)
    assert_stager_closed(output, world_size=2)
    assert_loop_reused_host_buffers(output, world_size=2)
    # The copy ran beside the next forward/backward pass. On a loaded machine the training
    # thread can lose the CPU inside async_save long enough for the copy to finish there, so
    # not every save has to show it, but the timeline must.
    assert assert_staging_overlaps_compute(output), "no save's copy overlapped compute"
    assert_values_and_containers(output)
    assert_buffer_reuse(output)
    assert_staging_error_surfaces(output, world_size=2, swallowed=True)
    # On CPU the page shows the error the default options raise, not a traceback.
    assert DEFAULTS_RAISE in output
    assert CPU_OPTIONS in output
    assert (
        "async_save returned a Future here, and an AsyncSaveResponse with DefaultStager" in output
    )
    assert re.search(r"median\s+[\d.]+\s+[\d.]+", output), "the blocked-time table"
    assert_profiler_traces(output, recipe_runner)
    assert_cleaned_up(output, recipe_runner)
    assert_summary_line(output)


def assert_summary_line(output: str) -> None:
    """The line `make gpu-check` puts in its table: the medians the page's table printed."""
    medians = re.search(r"^median\s+([\d.]+)\s+([\d.]+)$", output, re.MULTILINE)
    summary = re.search(
        r"^default_stager_recipe: blocked per save on CPU \(median, slowest rank\): "
        r"async_save ([\d.]+) ms, DefaultStager ([\d.]+) ms; steps 1 to \d+ \(rank 0\): "
        r"[\d.]+ s and [\d.]+ s$",
        output,
        re.MULTILINE,
    )
    assert medians and summary, "no summary line, or no table it summarises"
    assert summary.groups() == medians.groups()


def test_page_shows_the_timeline_and_links_the_trace(site):
    """The built page: the measured timeline figure, and the trace as a download."""
    page = BeautifulSoup((site / "recipes" / f"{RECIPE}.html").read_text(), "html.parser")
    assert page.select("img.sphx-glr-single-img"), "the timeline figure"
    links = {a.get_text(" ", strip=True): a["href"] for a in page.select("div.dcp-page-links a")}
    trace = site / "recipes" / links["Download the profiler trace"]
    events = json.loads(trace.read_text())["traceEvents"]
    assert any(e.get("name") == "DefaultStager: copy to host" for e in events)


def test_recipe_under_torchrun(recipe_runner):
    output = assert_ok(recipe_runner.torchrun(RECIPE, nproc=2))
    assert_contract_holds(output, world_size=2)
    assert_stager_closed(output, world_size=2)
    assert_buffer_reuse(output)
    assert_staging_error_surfaces(output, world_size=2, swallowed=True)
    assert_cleaned_up(output, recipe_runner)


# --------------------------------------------------------------------------
# What the page shows (the notebook and the copy button hold the same code)
# --------------------------------------------------------------------------


def visible_code() -> str:
    """The code cells as the page and the notebook show them: ignore blocks removed."""
    _, blocks = py_source_parser.split_code_and_text_blocks(str(recipe_path(RECIPE)))[:2]
    cells = [
        py_source_parser.remove_config_comments(py_source_parser.remove_ignore_blocks(b.content))
        for b in blocks
        if b.type == "code"
    ]
    assert all(cell.strip() for cell in cells), "a code cell shows nothing"
    return "\n\n".join(cells)


def visible_function(name: str) -> str:
    source = visible_code()
    for node in ast.parse(source).body:
        if isinstance(node, ast.FunctionDef) and node.name == name:
            return ast.get_source_segment(source, node)
    raise AssertionError(f"no visible function {name}")


@pytest.mark.parametrize("loop", ["train_with_default_stager", "train_with_plain_async_save"])
def test_visible_loops_are_the_loops_to_paste(loop):
    """No measuring code in the loops as shown; the GPU synchronisation is a real line there."""
    source = visible_function(loop)
    assert "timeline" not in source.lower() and "snapshot" not in source
    called = {
        node.func.id if isinstance(node.func, ast.Name) else node.func.attr
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name | ast.Attribute)
    }
    page_defined = {"local_copy", "page_file", "measured_runs", "host_buffers", "rank"}
    assert not called & page_defined, called & page_defined
    if loop == "train_with_default_stager":
        lines = [line.strip() for line in source.splitlines()]
        save = lines.index("response = dcp.async_save(")
        assert lines[save - 2 : save] == [
            "if torch.accelerator.is_available():",
            "torch.accelerator.current_stream().synchronize()  # rule 4",
        ]
        assert any(line.startswith("stager = DefaultStager(staging_options())") for line in lines)


def test_no_version_gate_and_one_staging_rule():
    source = recipe_path(RECIPE).read_text()
    assert "torch_is_at_least" not in source and "sys.exit" not in source
    assert ".. versionadded:: 2.9" in source and "PyTorch 2.9 or later" in source
    # One place chooses the options, with the four keyword arguments; every stager uses it.
    calls = [node for node in ast.walk(ast.parse(source)) if isinstance(node, ast.Call)]
    options = [call for call in calls if getattr(call.func, "id", None) == "StagingOptions"]
    assert len(options) == 1 and not options[0].args
    assert [k.arg for k in options[0].keywords] == [
        "use_pinned_memory",
        "use_shared_memory",
        "use_async_staging",
        "use_non_blocking_copy",
    ]
    stagers = [call for call in calls if getattr(call.func, "id", None) == "DefaultStager"]
    with_options = [ast.unparse(call) for call in stagers if call.args]
    assert with_options and set(with_options) == {"DefaultStager(staging_options())"}
