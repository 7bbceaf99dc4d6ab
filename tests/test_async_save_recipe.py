"""Recipe 2 (asynchronous saving with dcp.async_save).

One run under the gallery launcher and one under torchrun, each with 2 ranks;
every check reads what the page printed (its hidden code proves each claim).
"""

from __future__ import annotations

import os
import re

from recipe_runner import RECIPES, assert_ok, checkpoint_files_in_repo

RECIPE = "async_save_recipe"
RANKS = 2
# The recipe's three training runs, by the directory each one checkpoints into.
RUNS = ("async-save", "one-stager", "process")
SAVES_PER_RUN = 4  # steps 1, 3, 6 and 9
RESUMED = re.compile(
    r"\[rank0\] (\S+)/step-(\d+): (\d+) tensors, (\d+) differ from the state at the save call, "
    r"(\d+) from the live model at the end"
)
TABLE_ROWS = (
    "dcp.save (timed above)",
    "async_save",
    "async_save, one reused DefaultStager",
    "async_save, checkpoint process",
)
ALL_RANKS = re.escape(str(list(range(RANKS))))


def found(pattern: str, output: str) -> re.Match:
    match = re.search(pattern, output)
    assert match, f"{pattern!r} not in the output\n{output[-4000:]}"
    return match


def assert_training_runs(output: str) -> None:
    # Every save of every run left a complete checkpoint (.metadata written).
    # Under torchrun every rank prints the top-level lines to one stream, so
    # they can interleave: nothing below assumes a top-level line is whole.
    for run in RUNS:
        listings = re.findall(rf"{run}/ +((?:step-\d+ \w+(?:, )?)+)", output)
        assert listings, f"no listing for {run}/\n{output[-4000:]}"
        for listing in listings:
            entries = listing.split(", ")
            assert len(entries) == SAVES_PER_RUN, listing
            assert all(entry.endswith(" complete") for entry in entries), listing
    # The last checkpoint of every run, loaded into a fresh model, equals the state
    # at the save call bit for bit, and not the state training reached afterwards.
    resumed = RESUMED.findall(output)
    assert sorted(run for run, *_ in resumed) == sorted(RUNS), output[-4000:]
    for run, step, tensors, differ, moved_on in resumed:
        assert int(step) == 9 and int(tensors) > 0, run
        assert int(differ) == 0, f"{run}: checkpoint differs from the state at the save call"
        assert int(moved_on) > 0, f"{run}: training did not go on after the save"
    # The summary table: a row per strategy.
    found(r"strategy +stall +upload +in flight +slow-down", output)
    for label in TABLE_ROWS:
        found(rf"{re.escape(label)} +\d+\.\d ms +(-|\d+ ms) +(-|\d+/10) +(-|[+-]\d+%)", output)


def assert_zero_lr_step(output: str) -> None:
    # get_state_dict creates Adam's state with a zero-lr step: step is 1 before training.
    found(r"Adam's step before any training: 1 in the state dict, 1 in the live optimizer", output)


def assert_checkpoint_process(output: str) -> None:
    for rank in range(RANKS):
        # Each rank's checkpoint process ran, and logged its requests to the stderr
        # it inherited (4 saves of the loop, 1 of the shared-memory demonstration).
        running = found(rf"\[rank{rank}\] checkpoint process: 1 running, (\d+) MB resident", output)
        assert int(running[1]) > 0
        logged = found(rf"\[rank{rank}\] its log: (\d+) lines, (\d+) requests received", output)
        assert int(logged[2]) == SAVES_PER_RUN + 1 and int(logged[1]) > int(logged[2])
        found(
            rf"\[rank{rank}\]   \[{rank}\] .* - INFO - Received async checkpoint request "
            r"with id=<run>/step-1",
            output,
        )
        # Staged without shared memory, the tensors are in shared memory after the handover.
        found(
            rf"\[rank{rank}\] staged with use_shared_memory=False: in shared memory after "
            r"staging: False, after the handover: True",
            output,
        )


def assert_torn_checkpoints(output: str) -> None:
    # A normal interpreter exit waits for the upload: the checkpoint is complete.
    found(r"upload still in flight right before sys\.exit\(0\): True", output)
    found(r"after a normal exit, step-1/ is complete: True", output)
    # Destroying the group before the upload completed: the upload future raises ...
    found(
        rf"\[rank0\] upload of step-2 raised on ranks {ALL_RANKS}: ValueError: Process group "
        r".* is not initialized in the world group map",
        output,
    )
    # ... after every rank wrote its data, so the directory has no .metadata.
    shards = str([f"__{rank}_0.distcp" for rank in range(RANKS)])
    found(rf"\[rank0\] step-2/ holds {re.escape(shards)}; complete: False", output)
    # dcp.load raises CheckpointException (a BaseException, which `except Exception`
    # lets through: the page's inner handler never printed) wrapping the missing file.
    found(r"CheckpointException is an Exception: False", output)
    found(
        rf"\[rank0\] dcp\.load\(step-2\) raised on ranks {ALL_RANKS}: CheckpointException "
        r"wrapping AssertionError:\n\[rank0\]   metadata is None; global metadata read failed: "
        r"\[Errno 2\] No such file or directory: '<work>/torn/step-2/\.metadata'",
        output,
    )
    assert "caught by `except Exception`" not in output
    found(
        r"load_checkpoint\(step-2\): IncompleteCheckpointError: incomplete checkpoint: "
        r"<work>/torn/step-2 has no \.metadata",
        output,
    )
    # A reused directory passes the .metadata check while writing, and after the tear.
    found(
        r"reused/ saved into again: passes the \.metadata check while writing: True; "
        r"torn: True; passes it after the tear: True",
        output,
    )
    # use_collectives=False writes one metadata file per rank and no .metadata.
    per_rank = str([f"__{rank}.metadata" for rank in range(RANKS)])
    found(rf"use_collectives=False wrote {re.escape(per_rank)}; complete: False", output)
    # Resuming skips the torn step-2 and loads step-1 exactly.
    resumed = found(
        r"resumed from step-1: (\d+) tensors, 0 differ from the state at its save", output
    )
    assert int(resumed[1]) > 0


def assert_pinning_measured_only_on_a_gpu(output: str) -> None:
    # On a GPU the page measures pinned against pageable memory (the GPU check runs it);
    # on CPU it says there is nothing to measure, and measures nothing.
    found(r"no GPU on this machine: no copy from a device and no pinned memory to measure", output)
    assert "GB/s" not in output and "pinned staging buffers" not in output


def assert_summary_line(output: str) -> None:
    """The line `make gpu-check` puts in its table: the stalls of the page's table."""
    summary = found(
        r"async_save_recipe: stall on CPU \(median, slowest rank\): dcp\.save ([\d.]+) ms, "
        r"async_save ([\d.]+) ms, one reused DefaultStager ([\d.]+) ms, checkpoint process "
        r"([\d.]+) ms; pinned memory: not measured \(no GPU\)",
        output,
    )
    for label, stall in zip(TABLE_ROWS, summary.groups(), strict=True):
        found(rf"{re.escape(label)} +{re.escape(stall)} ms", output)


def assert_recipe_ran(output: str) -> None:
    assert_zero_lr_step(output)
    assert_training_runs(output)
    assert_pinning_measured_only_on_a_gpu(output)
    assert_summary_line(output)
    assert_checkpoint_process(output)
    assert_torn_checkpoints(output)
    assert "Traceback" not in output
    found(r"removed \S+: True", output)


def test_recipe_with_gallery_launcher(recipe_runner):
    recipes_before = sorted(os.listdir(RECIPES))
    output = assert_ok(recipe_runner.python(RECIPE, world_size=RANKS))
    assert_recipe_ran(output)
    assert recipe_runner.leftovers() == []
    assert recipe_runner.processes_left() == []
    assert sorted(os.listdir(RECIPES)) == recipes_before
    assert checkpoint_files_in_repo() == []


def test_recipe_under_torchrun(recipe_runner):
    output = assert_ok(recipe_runner.torchrun(RECIPE, nproc=RANKS))
    assert_recipe_ran(output)
    assert recipe_runner.leftovers() == []
    assert recipe_runner.processes_left() == []
