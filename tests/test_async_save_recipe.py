"""Recipe 2 (asynchronous saving with dcp.async_save)."""

from __future__ import annotations

import ast
import builtins
import json
import os
import re
import time

import psutil
import pytest
from recipe_runner import RECIPES, assert_ok, checkpoint_files_in_repo, recipe_path

RECIPE = "async_save_recipe"
# The recipe's three training runs, by the directory each one checkpoints into.
RUNS = ("async-save", "cached", "process")
SAVES_PER_RUN = 4  # steps 1, 3, 6 and 9
RESUMED = re.compile(
    r"\[rank0\] (\S+)/step-(\d+): (\d+) tensors, (\d+) differ from the state at the save call, "
    r"(\d+) from the live model at the end"
)
TABLE_ROWS = (
    "dcp.save (timed above)",
    "async_save",
    "async_save, reused staging buffer",
    "async_save, checkpoint process",
)


def processes_left_by(recipe_runner, grace_s: float = 5.0) -> list[str]:
    """Processes still running that a run started (they carry its private TMPDIR)."""
    deadline = time.monotonic() + grace_s
    while True:
        left = []
        for process in psutil.process_iter(["pid", "cmdline", "status"]):
            try:
                if process.info["status"] == psutil.STATUS_ZOMBIE:
                    continue
                if process.environ().get("TMPDIR") == str(recipe_runner.tmpdir):
                    left.append(f"{process.pid}: {' '.join(process.info['cmdline'] or [])}")
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.2)


def assert_recipe_ran(output: str, ranks: int) -> None:
    # Every save of every run left a complete checkpoint (.metadata written).
    # Under torchrun every rank prints the top-level lines to one stream, so
    # they can interleave: nothing below assumes a line is whole.
    for run in RUNS:
        listings = re.findall(rf"{run}/ +((?:step-\d+ \w+(?:, )?)+)", output)
        assert listings, f"no listing for {run}/\n{output[-4000:]}"
        for listing in listings:
            entries = listing.split(", ")
            assert len(entries) == SAVES_PER_RUN, listing
            assert all(entry.endswith(" complete") for entry in entries), listing
    # The last checkpoint of every run loaded into a fresh model equals the state at
    # the save call, and not the state training reached afterwards.
    resumed = RESUMED.findall(output)
    assert sorted(run for run, *_ in resumed) == sorted(RUNS), output[-4000:]
    for run, step, tensors, differ, moved_on in resumed:
        assert int(step) == 9 and int(tensors) > 0, run
        assert int(differ) == 0, f"{run}: checkpoint differs from the state at the save call"
        assert int(moved_on) > 0, f"{run}: training did not go on after the save"
    # On CPU the writer's pinned cache is refused, and the page says which staging ran.
    assert (
        "FileSystemWriter(cache_staged_state_dict=True): RuntimeError: "
        "Cannot access accelerator device when none is available." in output
    )
    assert "staged with: one DefaultStager, passed to every save" in output
    # Each rank started a checkpoint process, used it and stopped it.
    for rank in range(ranks):
        stopped = re.search(
            rf"\[rank{rank}\] checkpoint process: (\d+) MB resident, (\d+) log lines; "
            r"still running after the stop: 0",
            output,
        )
        assert stopped, f"rank {rank} did not stop its checkpoint process\n{output[-4000:]}"
        assert int(stopped[1]) > 0 and int(stopped[2]) > 0
    # The summary table: a row per strategy.
    assert re.search(r"strategy +stall +upload +in flight +slow-down", output)
    for label in TABLE_ROWS:
        row = rf"{re.escape(label)} +\d+\.\d ms +(-|\d+ ms) +(-|\d+/10) +(-|[+-]\d+%)"
        assert re.search(row, output), f"no table row {label!r}\n{output[-3000:]}"
    assert "Traceback" not in output
    assert re.search(r"removed \S+: True", output)


@pytest.mark.parametrize("world_size", [1, 2])
def test_recipe_with_gallery_launcher(recipe_runner, world_size):
    recipes_before = sorted(os.listdir(RECIPES))
    output = assert_ok(recipe_runner.python(RECIPE, world_size=world_size))
    assert_recipe_ran(output, ranks=world_size)
    assert recipe_runner.leftovers() == []
    assert processes_left_by(recipe_runner) == []
    assert sorted(os.listdir(RECIPES)) == recipes_before
    assert checkpoint_files_in_repo() == []


def test_recipe_under_torchrun(recipe_runner):
    output = assert_ok(recipe_runner.torchrun(RECIPE, nproc=2))
    assert_recipe_ran(output, ranks=2)
    assert recipe_runner.leftovers() == []
    assert processes_left_by(recipe_runner) == []


# --------------------------------------------------------------------------
# A torn checkpoint: the process group goes away before the upload finished
# --------------------------------------------------------------------------


def recipe_definitions() -> str:
    """The recipe's imports, constants, functions and classes, without its cells' runs."""
    tree = ast.parse(recipe_path(RECIPE).read_text())
    defined = set(dir(builtins))
    launching = {"run_on_ranks", "run_on_one_process", "shared_tempdir"}
    kept = []
    for node in tree.body:
        if isinstance(node, ast.Import | ast.ImportFrom):
            defined |= {(alias.asname or alias.name).split(".")[0] for alias in node.names}
        elif isinstance(node, ast.FunctionDef | ast.ClassDef):
            defined.add(node.name)
        elif isinstance(node, ast.Assign):
            targets = [
                name
                for target in node.targets
                for name in (target.elts if isinstance(target, ast.Tuple) else [target])
            ]
            if not all(isinstance(name, ast.Name) and name.id.isupper() for name in targets):
                continue  # results of cells, not constants
            used = {name.id for name in ast.walk(node.value) if isinstance(name, ast.Name)}
            if not used <= defined or used & launching:
                continue
            defined |= {name.id for name in targets}
        else:
            continue
        kept.append(node)
    return ast.unparse(ast.Module(body=kept, type_ignores=[]))


TORN_SAVE = """
import shutil
import threading

import torch._dynamo  # noqa: F401  fully_shard imports it on first use: once here, not per rank
from rank_launcher import run_on_ranks, shared_tempdir


class HeldWriter(FileSystemWriter):
    # A real FileSystemWriter whose upload, once the data is written, waits until
    # the test releases it: storage that is still busy when the group goes away.
    def __init__(self, path):
        super().__init__(path)
        self.data_written = threading.Event()
        self.release = threading.Event()

    def write_data(self, plan, planner):
        writes = super().write_data(plan, planner)
        writes.wait()
        self.data_written.set()
        assert self.release.wait(60), "never released"
        return writes


def tear_a_save(checkpoint_root):
    model, optimizer = build_sharded_model(seed=0)
    state_dict = {"app": AppState(model, optimizer)}
    checkpoint_group = dist.new_group(backend="gloo")
    train_step(model, optimizer)
    first = dcp.async_save(
        state_dict,
        checkpoint_id=os.path.join(checkpoint_root, "step-1"),
        process_group=checkpoint_group,
    )
    upload_future(first).result()  # awaited, as the recipe does
    saved = full_state(model, optimizer)

    train_step(model, optimizer)
    writer = HeldWriter(os.path.join(checkpoint_root, "step-2"))
    second = dcp.async_save(state_dict, storage_writer=writer, process_group=checkpoint_group)
    assert writer.data_written.wait(60), "the data of step 2 was never written"
    dist.barrier()  # every rank's data is written; nothing is in flight on the group
    # The mistake: the group goes away while the upload of step 2 is still running.
    dist.destroy_process_group(checkpoint_group)
    writer.release.set()
    try:
        upload_future(second).result(timeout=60)
        error = None
    except Exception as err:
        error = f"{type(err).__name__}: {err}"
    return {"error": error, "saved": saved}


def resume(checkpoint_root, expected):
    checkpoint_dir = latest_complete_checkpoint(checkpoint_root)
    model, optimizer = build_sharded_model(seed=1)
    load_checkpoint(checkpoint_dir, AppState(model, optimizer))
    loaded = full_state(model, optimizer)
    if dist.get_rank() == 0:
        compared, differ = count_mismatches(expected, loaded)
        return {"resumed_from": os.path.basename(checkpoint_dir), "compared": compared,
                "differ": differ}


root = shared_tempdir("torn-save-")
results = run_on_ranks(tear_a_save, root)
torn = os.path.join(root, "step-2")
report = {
    "errors": [result["error"] for result in results],
    "files": sorted(os.listdir(torn)),
    "latest_complete": os.path.basename(latest_complete_checkpoint(root)),
    "torn_dir": torn,
}
try:
    load_checkpoint(torn, None)
    report["load"] = "loaded"
except IncompleteCheckpointError as err:
    report["load"] = f"{type(err).__name__}: {err}"
report.update(run_on_ranks(resume, root, results[0]["saved"])[0])
shutil.rmtree(root)
print("REPORT " + json.dumps(report))
"""


def test_a_save_whose_group_is_destroyed_before_its_upload_finishes_is_incomplete(
    recipe_runner, tmp_path
):
    script = tmp_path / "torn_save.py"
    script.write_text(
        f"import json\nimport sys\nsys.path.insert(0, {str(RECIPES)!r})\n"
        + recipe_definitions()
        + "\n"
        + TORN_SAVE
    )
    result = recipe_runner.script(script, timeout=180)
    output = assert_ok(result)
    report = json.loads(re.search(r"^REPORT (.+)$", output, re.MULTILINE)[1])
    # The upload failed on every rank, after every rank had written its data ...
    assert all(report["errors"]), report
    assert report["files"] == ["__0_0.distcp", "__1_0.distcp"], report
    # ... so the directory has no .metadata, and the recipe's loader refuses it.
    assert report["load"] == (
        f"IncompleteCheckpointError: incomplete checkpoint: {report['torn_dir']} has no .metadata"
    )
    # Resuming falls back to the previous, complete checkpoint, and it is exact.
    assert report["latest_complete"] == "step-1"
    assert report["resumed_from"] == "step-1"
    assert report["compared"] > 0 and report["differ"] == []
    assert recipe_runner.leftovers() == []
    assert processes_left_by(recipe_runner) == []
