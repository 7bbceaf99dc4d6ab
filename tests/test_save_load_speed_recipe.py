"""The save/load speed recipe at its smallest size: complete numbers, verified checkpoints.

No speed is asserted (the machine is shared and noisy; the goals are printed, met or not). What
is asserted: every checkpoint the recipe wrote was loaded back and compared (the counts it
prints), the results file holds every knob, limit and raw measurement, every fraction and
growth it prints is what the raw measurements in that file give, replicated tensors are
written once, and the run leaves nothing behind.
"""

from __future__ import annotations

import json
import re
import statistics
from pathlib import Path

import pytest
from recipe_runner import assert_ok, checkpoint_files_in_repo

RECIPE = "save_load_speed_recipe"
SMALLEST = {"DCP_RECIPES_SPEED_MB": "8", "DCP_RECIPES_SPEED_REPEATS": "2"}
KNOBS = {
    "defaults (thread_count=1)": {},
    "thread_count=2": {"thread_count": 2},
    "thread_count=4": {"thread_count": 4},
    "single_file_per_rank=False": {"single_file_per_rank": False},
    "sync_files=False": {"sync_files": False},
    "enable_plan_caching=True": {"enable_plan_caching": True},
}
KINDS = ("write_fsync", "read_storage", "read_cache")
THREADS = ("1", "2", "4")  # JSON keys
STRATEGIES = ["dcp.save", "async_save", "async_save + reused DefaultStager"]
SAVES = 20
SUMMARY_LINE = re.compile(
    r"^save_load_speed_recipe: best save (\S+) GB/s = (\S+) of the write\+fsync limit, "
    r"best load (\S+) GB/s = (\S+) of the read limit, RSS growth (\S+) MB/save "
    r"\((\S+)% of the checkpoint\)$",
    re.MULTILINE,
)


def gbps(total_bytes, seconds_per_rank):
    return total_bytes / max(seconds_per_rank) / 1e9


def check_verified_counts(output: str, results: dict, ranks: int) -> None:
    """Every checkpoint was loaded back and compared, on every rank."""
    rounds = results["config"]["repeats"] + 1  # the warm-up round's checkpoints are checked too
    knob_checks = re.findall(
        r"^\[rank(\d+)\] checkpoints verified: (\d+) of (\d+), (\d+) tensors: 0 differ$",
        output,
        re.MULTILINE,
    )
    by_count = sorted((int(n), int(rank)) for rank, n, of, _ in knob_checks if n == of)
    assert len(knob_checks) == len(by_count) == 2 * ranks, knob_checks
    expected = [(len(KNOBS) * rounds, r) for r in range(ranks)]  # every knob, every round
    expected += [(2 * rounds, r) for r in range(ranks)]  # replicated: two planners a round
    assert by_count == sorted(expected)
    for strategy in STRATEGIES:
        lines = re.findall(
            rf"^\[rank(\d+)\] {re.escape(strategy)}: checkpoints verified: "
            rf"{SAVES} of {SAVES}, (\d+) tensors: 0 differ$",
            output,
            re.MULTILINE,
        )
        assert sorted(int(rank) for rank, _ in lines) == list(range(ranks)), strategy
        assert all(int(tensors) > 0 for _, tensors in lines)
    assert "differ from what was saved" not in output


def recomputed_limits(limits: dict) -> dict:
    """kind -> (threads -> GB/s per repeat), and the limit: the best of them all."""
    total = sum(limits["bytes_per_rank"])
    per_kind = {}
    for kind in KINDS:
        per_kind[kind] = {}
        for threads in THREADS:
            per_rank = [rank[kind][threads] for rank in limits["seconds_per_rank"]]
            per_kind[kind][threads] = [gbps(total, s) for s in zip(*per_rank, strict=True)]
    best = {kind: max(max(v) for v in per_kind[kind].values()) for kind in KINDS}
    return {"GBps": per_kind, "limit": best, "total": total}


def check_limits(results: dict, repeats: int, ranks: int) -> dict:
    limits = results["limits"]
    assert len(limits["bytes_per_rank"]) == ranks and all(b > 0 for b in limits["bytes_per_rank"])
    assert sum(limits["bytes_per_rank"]) == results["config"]["total_bytes"]
    for rank in limits["seconds_per_rank"]:
        assert set(rank) == {*KINDS, "torch_save", "torch_load"}
        assert len(rank["torch_save"]["1"]) == len(rank["torch_load"]["1"]) == repeats
        for kind in KINDS:
            assert set(rank[kind]) == set(THREADS)
            assert all(len(v) == repeats and min(v) > 0 for v in rank[kind].values())
    again = recomputed_limits(limits)
    for kind in ("torch_save", "torch_load"):  # one thread, no disk: a cost, not a limit
        per_rank = [rank[kind]["1"] for rank in limits["seconds_per_rank"]]
        speeds = [gbps(again["total"], s) for s in zip(*per_rank, strict=True)]
        assert limits["serialization_GBps"][kind]["values"] == pytest.approx(speeds)
    for kind in KINDS:
        assert limits["limit_GBps"][kind] == pytest.approx(again["limit"][kind])
        for threads in THREADS:
            entry = limits["GBps"][kind][threads]
            assert entry["values"] == pytest.approx(again["GBps"][kind][threads])
            assert entry["median"] == pytest.approx(statistics.median(entry["values"]))
            assert entry["min"] == min(entry["values"]) and entry["max"] == max(entry["values"])
    return again


def check_knobs(results: dict, output: str, limits: dict, repeats: int, ranks: int) -> dict:
    knobs = results["knobs"]
    assert knobs["options"] == KNOBS  # every knob, with its exact arguments
    assert knobs["durable"] == [n for n, o in KNOBS.items() if o.get("sync_files", True)]
    medians = {}
    for name in KNOBS:
        per_rank = [rank[name] for rank in knobs["seconds_per_rank"]]
        assert len(per_rank) == ranks and all(len(r) == repeats + 1 for r in per_rank)
        timed = list(zip(*per_rank, strict=True))[1:]  # round 0 is the warm-up
        values = {
            key: [gbps(limits["total"], [rank[f"{key}_s"] for rank in one]) for one in timed]
            for key in ("save", "cold_load", "warm_load")
        }
        summary = knobs["summary"][name]
        for key, got in values.items():
            assert summary[f"{key}_GBps"]["values"] == pytest.approx(got), (name, key)
        medians[name] = {key: statistics.median(v) for key, v in values.items()}
        planning = [max(rank["save_planning_s"] for rank in one) for one in timed]
        assert summary["save_planning_s"]["values"] == pytest.approx(planning)
        assert all(p > 0 for p in planning)

        # The printed rows: the median and its fraction of the limit, recomputed.
        save = medians[name]["save"]
        row = re.search(rf"^{re.escape(name)}\s+(\S+) \(\S+\)\s+(\S+)", output, re.MULTILINE)
        assert row, name
        assert row.groups() == (f"{save:.2f}", f"{save / limits['limit']['write_fsync']:.2f}")
        cold, warm = medians[name]["cold_load"], medians[name]["warm_load"]
        load_row = rf"^{re.escape(name)}\s+(\S+) \(\S+\)\s+(\S+)\s+(\S+) \(\S+\)\s+(\S+)\s"
        rows = re.findall(load_row, output, re.MULTILINE)
        assert (
            f"{cold:.2f}",
            f"{cold / limits['limit']['read_storage']:.2f}",
            f"{warm:.2f}",
            f"{warm / limits['limit']['read_cache']:.2f}",
        ) in rows, (name, rows)
    return medians


def check_replicated(results: dict, ranks: int) -> None:
    replicated = results["replicated"]
    planners = replicated["planners"]
    default = planners["dedup_save_to_lowest_rank=False"]["bytes_written_per_rank"]
    lowest = planners["dedup_save_to_lowest_rank=True"]["bytes_written_per_rank"]
    held = replicated["bytes_held_per_rank"]
    assert len(default) == len(lowest) == len(held) == ranks
    assert len(set(held)) == 1, "every rank holds the whole model"
    # Each replicated tensor is written once: the total is one model either way.
    assert sum(default) == pytest.approx(sum(lowest), rel=0.01)
    assert held[0] <= sum(lowest) < 1.05 * held[0], "a replica was written twice"
    assert lowest[0] == sum(lowest) and all(b == 0 for b in lowest[1:])
    if ranks > 1:
        assert all(b > 0 for b in default), "the default spreads the bytes over the replicas"
    repeats = results["config"]["repeats"]
    for name, entry in planners.items():
        rounds = list(zip(*(rank[name] for rank in replicated["seconds_per_rank"]), strict=True))
        assert len(rounds) == repeats + 1
        speeds = [gbps(held[0], [one["save_s"] for one in r]) for r in rounds[1:]]
        assert entry["save_GBps"]["values"] == pytest.approx(speeds)


def check_memory(results: dict, ranks: int) -> dict:
    memory = results["memory"]
    first, window = memory["first_few"], memory["window"]
    growth = {}
    for strategy in STRATEGIES:
        runs = memory["per_rank"][strategy]
        assert len(runs) == ranks
        per_rank = []
        for run in runs:
            assert len(run["rss"]) == SAVES and run["rss_before"] > 0
            rss = run["rss"]
            early, late = rss[first : first + window], rss[-window:]
            rise = min(min(late) - min(early), max(late) - max(early))
            per_rank.append(rise / (SAVES - window - first))
        summary = memory["summary"][strategy]
        assert summary["growth_bytes_per_save_per_rank"] == pytest.approx(per_rank)
        assert summary["growth_fraction_of_checkpoint"] == pytest.approx(
            max(per_rank) / runs[0]["bytes"]
        )
        growth[strategy] = (max(per_rank), runs[0]["bytes"])
    return growth


def check_summary(results: dict, output: str, limits: dict, medians: dict, growth: dict) -> None:
    """The summary line, the last line the run prints, and the goals, from the raw numbers."""
    durable = results["knobs"]["durable"]
    best_save = max(durable, key=lambda n: medians[n]["save"])
    best_load = max(medians, key=lambda n: medians[n]["cold_load"])
    worst = max(growth, key=lambda s: growth[s][0])
    per_save, share = growth[worst]
    expected = (
        f"{medians[best_save]['save']:.2f}",
        f"{medians[best_save]['save'] / limits['limit']['write_fsync']:.2f}",
        f"{medians[best_load]['cold_load']:.2f}",
        f"{medians[best_load]['cold_load'] / limits['limit']['read_storage']:.2f}",
        f"{per_save / 1e6:.2f}",
        f"{per_save / share * 100:.2f}",
    )
    lines = SUMMARY_LINE.findall(output)
    assert lines == [expected], (lines, expected)
    summary = results["summary"]
    assert (summary["best_save"], summary["best_load"]) == (best_save, best_load)
    assert summary["worst_memory_strategy"] == worst
    assert set(results["goals"]) == {
        "best save >= 0.8 of the write + fsync limit",
        "best load >= 0.8 of the read limit",
        "RSS growth < 1% of the checkpoint per save",
    }
    for goal, met in results["goals"].items():
        assert f"goal {goal}: {'met' if met else 'not met'} (" in output


def run_and_check(recipe_runner, tmp_path: Path, launch, ranks: int) -> dict:
    results_path = tmp_path / "speed.json"
    result = launch(DCP_RECIPES_SPEED_JSON=str(results_path), **SMALLEST)
    output = assert_ok(result)
    assert SUMMARY_LINE.match(result.stdout.rstrip().splitlines()[-1]), "the summary line is last"
    assert "Traceback (most recent call last)" not in output, output[-4000:]
    assert not re.search(r"\S+\.py:\d+: \w*Warning: ", output), output[-4000:]
    results = json.loads(results_path.read_text())
    repeats = results["config"]["repeats"]
    assert repeats == int(SMALLEST["DCP_RECIPES_SPEED_REPEATS"])
    assert results["config"]["size_mb"] == float(SMALLEST["DCP_RECIPES_SPEED_MB"])
    assert results["config"]["strategies"] == STRATEGIES
    assert results["world_size"] == ranks
    check_verified_counts(output, results, ranks)
    limits = check_limits(results, repeats, ranks)
    medians = check_knobs(results, output, limits, repeats, ranks)
    check_replicated(results, ranks)
    growth = check_memory(results, ranks)
    check_summary(results, output, limits, medians, growth)
    assert results_path.with_suffix(".png").read_bytes().startswith(b"\x89PNG")
    leftovers = [n for n in recipe_runner.leftovers() if not n.startswith("torchinductor_")]
    assert leftovers == []
    assert checkpoint_files_in_repo() == []
    return results


def test_recipe_on_two_forked_ranks(recipe_runner, tmp_path):
    results = run_and_check(
        recipe_runner, tmp_path, lambda **env: recipe_runner.python(RECIPE, 2, **env), ranks=2
    )
    assert results["launcher"] == "fork"


def test_recipe_on_one_rank_under_torchrun(recipe_runner, tmp_path):
    results = run_and_check(
        recipe_runner, tmp_path, lambda **env: recipe_runner.torchrun(RECIPE, 1, **env), ranks=1
    )
    assert results["launcher"] == "torchrun"


def test_too_few_repeats_is_a_clear_error(recipe_runner):
    result = recipe_runner.python(RECIPE, 1, DCP_RECIPES_SPEED_REPEATS="1")
    assert result.returncode != 0
    assert "DCP_RECIPES_SPEED_REPEATS must be at least 2 (a spread), got 1" in result.stderr
    assert recipe_runner.leftovers() == []
