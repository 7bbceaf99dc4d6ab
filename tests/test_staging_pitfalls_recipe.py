"""The staging pitfalls recipe: every hazard torn every time, every fix bit-exact every time."""

from __future__ import annotations

import re

from recipe_runner import assert_ok

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
    "wait_before_forward",
    "stage_buffers_at_save_call",
    "wait_for_upload_before_next_save",
    "progress_copied_at_save_call",
]
# Each deterministic hazard, and exactly which entries it must corrupt.
BUFFERS = ["model.0.running_mean", "model.0.running_var", "model.0.num_batches_tracked"]
HAZARDS = {
    "step_before_staging": "every tensor",  # weights, Adam moments and step counters
    "wait_before_step_with_batch_norm": BUFFERS,
    "next_save_before_upload": "every tensor",  # the first checkpoint holds the second state
    "progress_updated_after_save": ["progress.samples_seen"],
}


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
    assert sorted(found) == sorted(FIXES + list(HAZARDS)), sorted(found)
    for fix in FIXES:
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
    assert_honest_trials_reported(output)
    assert_clean(output, recipe_runner)
    assert "[rank0] staging with StagingOptions(" in output


def test_recipe_under_torchrun(recipe_runner):
    output = assert_ok(recipe_runner.torchrun(RECIPE, nproc=2))
    assert_fixes_and_hazards(output)
    assert_honest_trials_reported(output)
    assert_clean(output, recipe_runner)
