"""Recipe 3: fully asynchronous staging with DefaultStager."""

from __future__ import annotations

import ast
import re
import textwrap

import pytest
from recipe_runner import RECIPES, assert_ok, recipe_path

RECIPE = "default_stager_recipe"
SAVE_STEPS = [3, 6, 9]  # NUM_STEPS, SAVE_EVERY = 10, 3; the step-0 save is awaited at once

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
# The measured intervals of each save (rank 0, ms since the async_save call).
N = r"-?[\d.]+"
SAVE = re.compile(
    rf"save after step (?P<step>\d+): async_save returned at (?P<returned>{N}); "
    rf"staging (?P<staging_start>{N})-(?P<staging_end>{N}); "
    rf"step (?P<next>\d+): forward (?P<forward_start>{N})-(?P<forward_end>{N}), "
    rf"backward (?P<backward_start>{N})-(?P<backward_end>{N}), "
    rf"optimizer\.step (?P<step_start>{N})-(?P<step_end>{N}); upload done at (?P<uploaded>{N})"
)
GATE_MESSAGE = "This recipe needs PyTorch 2.9 or later; this is torch 2.8.0."


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
    # The copy ran beside the next forward/backward pass. On a loaded machine the training
    # thread can lose the CPU inside async_save long enough for the copy to finish there, so
    # not every save has to show it, but the timeline must.
    assert overlapped, f"no save's copy overlapped compute: {saves}"
    said = re.findall(r"the copy ran beside step (\d+)'s forward and backward pass", output)
    assert [int(n) - 1 for n in said] == overlapped, "the page's summary matches the data"


def test_recipe_with_two_ranks_draws_the_timeline(recipe_runner, tmp_path):
    """Run the recipe as Sphinx-Gallery does (in one interpreter) and inspect its figure."""
    figure_path = tmp_path / "timeline.png"
    driver = tmp_path / "run_recipe.py"
    driver.write_text(
        textwrap.dedent(
            f"""
            import runpy, sys
            import matplotlib.pyplot as plt
            from matplotlib.collections import PolyCollection

            path = {str(recipe_path(RECIPE))!r}
            sys.path.insert(0, {str(RECIPES)!r})
            sys.argv = [path]
            runpy.run_path(path, run_name="__main__")
            figures = [plt.figure(n) for n in plt.get_fignums()]
            print("figures:", len(figures))
            for axis in figures[0].axes:
                bars = sum(len(c.get_paths()) for c in axis.collections
                           if isinstance(c, PolyCollection))
                print(f"axis {{axis.get_title(loc='left')!r}}: {{bars}} bars")
            figures[0].savefig({str(figure_path)!r})
            """
        )
    )
    result = recipe_runner.script(driver)
    output = assert_ok(result)
    assert "Traceback" not in output
    assert_contract_holds(output, world_size=2)
    assert_stager_closed(output, world_size=2)
    assert_staging_overlaps_compute(output)
    # On CPU the page shows the error the default options raise, not a traceback.
    assert (
        "[rank0] DefaultStager() with the default options: AssertionError: "
        "Non-blocking copy requires that the current accelerator is available." in output
    )
    assert "use_async_staging=True" in output
    # The figure: one, two timelines, each with the training thread's blocks and the saves.
    assert "figures: 1" in output
    bars = dict(re.findall(r"axis '([^']+)': (\d+) bars", output))
    assert set(bars) == {"DefaultStager(use_async_staging=True)", "plain async_save"}, output
    steps_and_saves = 10 * 3 + 4  # forward, backward and step per step; a call per save
    assert all(int(n) > steps_and_saves for n in bars.values()), bars
    assert figure_path.stat().st_size > 10_000
    assert re.search(r"median\s+[\d.]+\s+[\d.]+", output), "the blocked-time table"
    assert "removed " in output and ": True" in output
    assert recipe_runner.leftovers() == []


def test_recipe_with_one_rank(recipe_runner):
    output = assert_ok(recipe_runner.python(RECIPE, world_size=1))
    assert_contract_holds(output, world_size=1)
    assert_stager_closed(output, world_size=1)
    assert_staging_overlaps_compute(output)
    assert recipe_runner.leftovers() == []


def test_recipe_under_torchrun(recipe_runner):
    output = assert_ok(recipe_runner.torchrun(RECIPE, nproc=2))
    assert_contract_holds(output, world_size=2)
    assert_stager_closed(output, world_size=2)
    assert recipe_runner.leftovers() == []


# --------------------------------------------------------------------------
# The version gate
# --------------------------------------------------------------------------


def gate_function():
    """The recipe's own ``torch_is_at_least``, taken from its source without running it."""
    source = recipe_path(RECIPE).read_text()
    for node in ast.parse(source).body:
        if isinstance(node, ast.FunctionDef) and node.name == "torch_is_at_least":
            namespace: dict = {}
            exec(compile(ast.Module([node], []), RECIPE, "exec"), namespace)
            return namespace["torch_is_at_least"]
    raise AssertionError("no torch_is_at_least in the recipe")


@pytest.mark.parametrize(
    ("version", "recent_enough"),
    [
        ("1.13.1", False),
        ("2.8.0", False),
        ("2.8.1+cu128", False),
        ("2.9.0", True),
        ("2.9.0a0+git1a2b3c4", True),
        ("2.10.0.dev20250901+cpu", True),
        ("2.13.0+cpu", True),
        ("3.0.0", True),
    ],
)
def test_version_gate_reads_versions(version, recent_enough):
    assert gate_function()(version) is recent_enough


def test_recipe_stops_plainly_on_an_older_torch(recipe_runner, tmp_path):
    """torch claims to be 2.8.0, and the 2.9 APIs cannot be imported."""
    driver = tmp_path / "old_torch.py"
    driver.write_text(
        textwrap.dedent(
            f"""
            import runpy, sys
            import torch

            class No29Apis:
                def find_spec(self, name, path=None, target=None):
                    if name == "torch.distributed.checkpoint.staging":
                        raise ImportError(f"No module named {{name!r}} (torch 2.8)")

            torch.__version__ = "2.8.0"
            sys.meta_path.insert(0, No29Apis())
            path = {str(recipe_path(RECIPE))!r}
            sys.path.insert(0, {str(RECIPES)!r})
            sys.argv = [path]
            runpy.run_path(path, run_name="__main__")
            print("the recipe went on past the gate")
            """
        )
    )
    result = recipe_runner.script(driver, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == GATE_MESSAGE
    assert result.stderr == ""
    assert recipe_runner.leftovers() == []
