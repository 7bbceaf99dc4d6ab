"""The staging pitfalls recipe: every hazard torn every time, every fix bit-exact every time."""

from __future__ import annotations

import ast
import re

from recipe_runner import assert_ok, recipe_path
from sphinx_gallery.py_source_parser import remove_ignore_blocks, split_code_and_text_blocks

RECIPE = "staging_pitfalls_recipe"
MIN_TRIALS = 5

# Each line the recipe prints for a demonstration, on rank 0:
# "[rank0] <case>   [c1, c2, ...] of <n> entries (<t> tensors) differ: <verdict>"
RESULT = re.compile(
    r"^\[rank0\] (\w+) +\[([\d, ]+)\] of (\d+) entries \((\d+) tensors\) differ: (.+)$",
    re.MULTILINE,
)

FIXES = [
    "wait_before_step",
    "synchronize_before_save",
    "wait_before_forward",
    "stage_buffers_at_save_call",
    "wait_for_upload_before_next_save",
    "progress_copied_at_save_call",
]
# Each deterministic hazard, and exactly which entries it must corrupt.
BUFFERS = ["model.0.running_mean", "model.0.running_var", "model.0.num_batches_tracked"]
HAZARDS = {
    "step_before_staging": "every tensor",  # weights, Adam moments and step counters
    "wait_before_step_with_batch_norm": BUFFERS,  # the same loop as the first fix
    "next_save_before_upload": "every tensor",  # the first checkpoint holds the second state
    "progress_updated_after_save": ["progress.samples_seen"],
}
# Torn only where a stream can race the stager's (the GPU check runs it there, and the
# page asserts it); on CPU there are no streams and the page shows it exact.
GPU_ONLY_HAZARD = "save_without_synchronizing"


def results(output: str) -> dict[str, tuple[list[int], int, int, str]]:
    found = {}
    for name, counts, entries, tensors, verdict in RESULT.findall(output):
        assert name not in found, f"{name} reported twice"
        found[name] = ([int(c) for c in counts.split(",")], int(entries), int(tensors), verdict)
    return found


def example_line(output: str, case: str) -> str:
    match = re.search(rf"^\[rank0\] {case} .*\n\[rank0\] +e\.g\. (.+)$", output, re.MULTILINE)
    assert match, f"no example names printed for {case}"
    return match.group(1)


def assert_fixes_and_hazards(output: str) -> None:
    found = results(output)
    assert sorted(found) == sorted([*FIXES, *HAZARDS, GPU_ONLY_HAZARD]), sorted(found)
    for fix in [*FIXES, GPU_ONLY_HAZARD]:
        counts, _, _, verdict = found[fix]
        assert len(counts) >= MIN_TRIALS, (fix, counts)
        assert counts == [0] * len(counts), f"{fix} is not bit-exact: {counts}"
        assert verdict == "bit-exact every time"
    for hazard, expected in HAZARDS.items():
        counts, _, tensors, verdict = found[hazard]
        assert len(counts) >= MIN_TRIALS, (hazard, counts)
        assert all(c > 0 for c in counts), f"{hazard} produced a bit-exact checkpoint: {counts}"
        assert verdict == "not the saved state, every time"
        if expected == "every tensor":
            assert counts == [tensors] * len(counts), (hazard, counts, tensors)
        else:
            assert counts == [len(expected)] * len(counts), (hazard, counts)
            assert example_line(output, hazard) == ", ".join(expected)


def assert_stream_race_explained(output: str) -> None:
    assert re.search(
        r"^\[rank0\] without the synchronisation, on cpu: 0 of 5 checkpoints torn "
        r"\(no stream to race with\)\n\[rank0\]   from before the step: 0 of 4 weights and "
        r"biases, 0 of 8 Adam's moments, 0 of 4 Adam's step counters$",
        output,
        re.MULTILINE,
    ), "the stream race's outcome on this machine is not printed"
    assert re.search(
        r"^staging_pitfalls_recipe: stream race on cpu: 0 of 5 checkpoints torn without the "
        r"synchronisation, 0 of 5 with it; from before the step: 0 of 4 weights and biases, "
        r"0 of 8 Adam's moments, 0 of 4 Adam's step counters$",
        output,
        re.MULTILINE,
    ), "no summary line for make gpu-check"


def assert_honest_trials_reported(output: str) -> None:
    # Not anchored to line starts: under torchrun every rank prints these lines at once, and
    # print() writes a line and its newline separately, so two ranks' lines can share one.
    honest = re.compile(rf"({'|'.join(HAZARDS)}) +not the saved state in +(\d+) of (\d+) trials")
    rows = {name: (int(hit), int(of)) for name, hit, of in honest.findall(output)}
    assert sorted(rows) == sorted(HAZARDS), rows
    for hit, of in rows.values():
        assert of >= MIN_TRIALS and 0 <= hit <= of
    assert re.search(
        r"over \d+ saves: a training step [\d.]+ ms; the copy was still running", output
    )


def assert_clean(output: str, recipe_runner) -> None:
    assert "Traceback (most recent call last)" not in output
    assert not re.search(r"\S+\.py:\d+: \w*Warning: ", output), "a stray warning"
    assert re.search(r"removed \S+dcp-staging-pitfalls-\S+: True", output)
    assert recipe_runner.leftovers() == []


# The site build runs the recipe with the gallery launcher on 2 ranks (and the recipe
# asserts its own outcomes there); these runs cover 1 rank, and 2 ranks under torchrun.
def test_recipe_on_one_rank(recipe_runner):
    output = assert_ok(recipe_runner.python(RECIPE, world_size=1))
    assert_fixes_and_hazards(output)
    assert_stream_race_explained(output)
    assert_honest_trials_reported(output)
    assert_clean(output, recipe_runner)
    assert "[rank0] staging with StagingOptions(" in output


def test_recipe_under_torchrun(recipe_runner):
    output = assert_ok(recipe_runner.torchrun(RECIPE, nproc=2))
    assert_fixes_and_hazards(output)
    assert_honest_trials_reported(output)
    assert_clean(output, recipe_runner)


def visible_code() -> str:
    """The code the page shows and the notebook holds: code cells, ignore blocks removed."""
    _, blocks = split_code_and_text_blocks(str(recipe_path(RECIPE)))[:2]
    return "\n".join(remove_ignore_blocks(content) for kind, content, _ in blocks if kind == "code")


def test_every_visible_loop_synchronises_right_before_async_save():
    tree = ast.parse(visible_code())
    loops = {}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and "dcp.async_save(" in ast.unparse(node):
            loops[node.name] = node
    assert len(loops) == 10, sorted(loops)
    # The GPU-only hazard is the loop without it, and only that line is missing.
    unsynchronised = ast.unparse(loops.pop(GPU_ONLY_HAZARD))
    assert "synchronize" not in unsynchronised
    fixed = ast.unparse(loops["synchronize_before_save"])
    assert (
        fixed.replace(
            "\n        if torch.accelerator.is_available():\n"
            "            torch.accelerator.current_stream().synchronize()",
            "",
        ).replace("synchronize_before_save", GPU_ONLY_HAZARD)
        == unsynchronised
    ), "the fix differs from the hazard by more than the synchronisation"
    checked = set()
    for name, function in loops.items():
        for body in (n.body for n in ast.walk(function) if isinstance(n, ast.For)):
            for before, statement in zip(body, body[1:], strict=False):
                if "dcp.async_save(" in ast.unparse(statement):
                    assert ast.unparse(before) == (
                        "if torch.accelerator.is_available():\n"
                        "    torch.accelerator.current_stream().synchronize()"
                    ), f"{name}: no device synchronisation right before async_save"
                    checked.add(name)
    assert checked == set(loops), "every loop calls async_save in its for loop"
    # The clone fix synchronises after cloning: the stager's stream does not wait for the clones.
    clones = ast.unparse(loops["stage_buffers_at_save_call"])
    assert clones.index("buffer.clone()") < clones.index("synchronize()")


def test_visible_code_has_no_page_machinery_and_one_staging_rule():
    code = visible_code()
    for page_only in ("snapshot", "let_copy_start", "let_writes_start", "HeldStager", "# demo"):
        assert page_only not in code, page_only
    assert code.count("StagingOptions(") == 1
    assert "use_shared_memory=False" in code and "use_pinned_memory=on_gpu" in code
    # That the visible code alone runs is tested where the notebook (exactly this code) runs:
    # tests/test_site.py::test_downloaded_notebook_runs_alone.
