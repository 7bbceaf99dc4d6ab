"""Recipe: resume after a crash (kill points, keep-latest-K, torchrun restarts, resharding).

Cost: three runs of the recipe. The 2-rank run does everything the page shows (three
crashes and restarts with the gallery launcher, one under ``torchrun --max-restarts=1``,
the restart-count measurement, resharding 2 -> 3 -> 1, bad input); the 1-rank run (what
``make gpu-check`` runs on a machine with one GPU: the rank killed is rank 0) and the
torchrun run skip the restart measurement. Most tests read the 2-rank run's output.
"""

from __future__ import annotations

import os
import re

import pytest
from recipe_runner import RECIPES, RecipeRunner, assert_ok, checkpoint_files_in_repo

RECIPE = "resume_recipe"
KEEP, SAVE_EVERY, NUM_STEPS = 2, 10, 60
R = r"(?:\[rank\d+\] )?"  # under torchrun single-rank lines carry a label too

RESUME_CHECK = re.compile(
    r"(?P<what>[\w =-]+): resumed from step (?P<start>\d+); loss at steps (?P<first>\d+)-"
    r"(?P<last>\d+): (?P<lossdiff>\d+) of (?P<steps>\d+) differ from the uninterrupted run; "
    r"final model and optimizer: (?P<tensors>\d+) tensors compared, (?P<differ>\d+) differ"
)
SAVE_LINE = re.compile(
    rf"{R}step (\d+): loss [\d.]+; saving step \1, kept \[([\d, ]*)\], removed \[([\d, ]*)\]"
)
DONE_LINE = re.compile(rf"{R}done at step (\d+); kept \[([\d, ]*)\]")
LISTING = re.compile(r"^step-(\d{8}): (complete|TORN): ", re.MULTILINE)
RESUMING = re.compile(r"(?:removed \[([\d, ]*)\]; )?resuming from step (\d+)")
KILL_POINTS = {
    "crash in upload": ("killed with SIGKILL after 65,536 bytes of its upload", 30),
    "crash in staging": ("killed with SIGKILL during staging, after copying 3 tensors", 30),
    "crash between saves": ("killed with SIGKILL at step 45, between two saves", 40),
}


def steps_in(text: str) -> list[int]:
    return [int(s) for s in text.split(",") if s.strip()]


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    runner = RecipeRunner(tmp_path_factory.mktemp("two-ranks"))
    recipes_before = sorted(os.listdir(RECIPES))
    output = assert_ok(runner.python(RECIPE, world_size=2))
    return output, runner, recipes_before


def test_every_kill_point_resumes_bit_exact(two_ranks):
    output, _, _ = two_ranks
    checks = {m["what"].strip(): m for m in RESUME_CHECK.finditer(output)}
    expected = {**KILL_POINTS, "torchrun --max-restarts=1": (None, 30)}
    assert set(checks) == set(expected), output[-4000:]
    for what, (kill_line, start) in expected.items():
        check = checks[what]
        assert int(check["start"]) == start, what
        assert int(check["first"]) == start + 1 and int(check["last"]) == NUM_STEPS
        assert int(check["lossdiff"]) == 0 and int(check["steps"]) == NUM_STEPS - start
        assert int(check["tensors"]) > 0 and int(check["differ"]) == 0, what
        if kill_line:
            assert kill_line in output, f"{what}: the rank was not killed where planned"
    # The launches with a crash failed, as a job with a killed rank does.
    assert output.count("the job failed: ") == 3


def test_torchrun_restarted_the_workers(two_ranks):
    output, _, _ = two_ranks
    for attempt in (0, 1):
        for rank in (0, 1):
            assert f"[rank{rank}] attempt {attempt}" in output
    assert "[rank0] attempt 1 resumed from step 30" in output
    assert "torchrun exited with 0" in output


def test_keep_latest_k_after_every_save(two_ranks):
    output, _, _ = two_ranks
    saves = SAVE_LINE.findall(output)
    # Uninterrupted, three crashed runs and their restarts, torchrun's two attempts, resharding.
    assert len(saves) >= 30, output[-4000:]
    for step, kept, removed in saves:
        kept = steps_in(kept)
        assert len(kept) <= KEEP, f"step {step}: more than {KEEP} complete checkpoints: {kept}"
        if int(step) > SAVE_EVERY:  # from the second save of a run on, the last one is complete
            assert len(kept) >= 1, f"step {step}: no complete checkpoint left"
            assert max(kept) == int(step) - SAVE_EVERY, "the newest complete one was deleted"
        assert int(step) not in steps_in(removed), "clean-up removed the save in flight"
    for _, kept in DONE_LINE.findall(output):
        assert 1 <= len(steps_in(kept)) <= KEEP


def test_a_torn_directory_is_never_loaded(two_ranks):
    output, _, _ = two_ranks
    # Each listing after a crash is followed by the restart's choice.
    blocks = re.split(r"the job failed: ", output)[1:]
    assert len(blocks) == 3
    for block in blocks:
        listing = dict(LISTING.findall(block))
        torn = {int(s) for s, state in listing.items() if state == "TORN"}
        complete = {int(s) for s, state in listing.items() if state == "complete"}
        assert complete, "a crash left no complete checkpoint"
        removed, start = RESUMING.search(block).groups()
        assert int(start) in complete and int(start) == max(complete)
        assert torn <= set(steps_in(removed or "")), "a torn directory was left behind"
    assert "step-00000040: TORN: __0_0.distcp" in output  # the upload crash: files, no .metadata


def test_resharding_is_bit_exact_and_sees_every_sample_once(two_ranks):
    output, _, _ = two_ranks
    for before, after in ((2, 3), (3, 1)):
        found = re.search(
            rf"saved on {before}, loaded on {after}: (\d+) tensors of model and optimizer "
            r"compared, unsharded, (\d+) differ",
            output,
        )
        assert found and int(found[1]) > 0 and int(found[2]) == 0, output[-4000:]
    assert "[rank2] saved on 2 ranks, running on 3: data from global sample 360" in output
    assert "the 2 -> 3 -> 1 rank job trained on 720 samples: 720 distinct" in output
    assert "each exactly once: True" in output
    assert "per-rank positions: 120 samples in steps 31-40, 40 of them trained on before" in output
    assert "global sample index: 120 samples in steps 31-40, 0 of them trained on before" in output


def test_bad_input_is_a_clear_error(two_ranks):
    output, _, _ = two_ranks
    assert re.search(r"FileNotFoundError: checkpoint root '.*no-such-dir' does not exist", output)
    assert "PermissionError: checkpoint root '/proc' is not writable" in output
    assert "ValueError: keep=0: keep at least the newest complete checkpoint" in output
    assert re.search(
        r"RuntimeError: .*other-model/step-00000010 is not a checkpoint of this training run: "
        r"missing keys \['app\.model\.net\.0\.weight'",
        output,
    )


def test_restart_counts_are_shown(two_ranks):
    output, _, _ = two_ranks
    # Measured when the page runs: shown, not asserted (it is a race).
    for label in ('dist.init_process_group("gloo")', "PrefixStore(attempt-N, store)"):
        assert re.search(
            re.escape(label) + r"\s+restarted workers formed the group in \d+ of 3 restarts", output
        ), output[-3000:]


def test_two_ranks_leave_nothing_behind(two_ranks):
    output, runner, recipes_before = two_ranks
    assert re.search(r"removed \S+dcp-resume-\S+: True", output)
    assert runner.leftovers() == []
    assert sorted(os.listdir(RECIPES)) == recipes_before
    assert checkpoint_files_in_repo() == []


def test_recipe_on_one_rank(recipe_runner):
    result = recipe_runner.python(RECIPE, world_size=1, RESUME_RECIPE_PROBE_RESTARTS="0")
    output = assert_ok(result)
    checks = {m["what"].strip(): m for m in RESUME_CHECK.finditer(output)}
    expected = {**KILL_POINTS, "torchrun --max-restarts=1": (None, 30)}
    assert set(checks) == set(expected), output[-4000:]
    for what, (kill_line, start) in expected.items():
        assert int(checks[what]["start"]) == start, what
        assert int(checks[what]["differ"]) == 0 and int(checks[what]["lossdiff"]) == 0, what
        if kill_line:
            assert kill_line in output, f"{what}: rank 0, the last rank, was not killed"
    assert "[rank0] attempt 1 resumed from step 30" in output
    assert "[rank2] saved on 2 ranks, running on 3" in output  # the cell sets its own sizes
    assert "saved on 3, loaded on 1" in output and "each exactly once: True" in output
    assert recipe_runner.leftovers() == []


def test_recipe_under_torchrun(recipe_runner):
    output = assert_ok(recipe_runner.torchrun(RECIPE, nproc=2))
    # torchrun without restarts: the page kills no rank, and says so.
    assert "nothing to resume (no rank was killed)" in output
    assert "skipped: run the recipe's .py file (not under torchrun)" in output
    checks = list(RESUME_CHECK.finditer(output))  # printed by every rank under torchrun
    assert {m["what"].strip() for m in checks} == set(KILL_POINTS)
    assert all(int(m["differ"]) == 0 for m in checks)
    assert "each exactly once: True" in output
    assert recipe_runner.leftovers() == []
