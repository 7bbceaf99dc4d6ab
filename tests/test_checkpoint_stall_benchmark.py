"""The checkpoint-stall benchmark at its smallest size, with forked ranks and under torchrun.

No timing is asserted (the machine is shared and noisy). What is asserted, from one run per
launcher: the results file holds every strategy, a warm-up round and then the measured runs in
interleaved order (A B C ... A B C ..., also by their start times); every median, minimum and
maximum is what the raw per-rank measurements in the file give; every ratio and verdict the run
printed is recomputed here from those raw numbers; "within noise" is printed exactly where an
effect is smaller than its spread or below zero; every checkpoint the benchmark wrote is complete
and loads; and the run leaves no file and no process behind.
"""

from __future__ import annotations

import json
import os
import re
import statistics
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from recipe_runner import assert_ok, checkpoint_files_in_repo
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

RECIPE = "checkpoint_stall_benchmark"
SMALLEST_GB = "0.02"  # one 1024x1024 layer: about 13 MB of checkpoint
REPEATS = 2
STRATEGIES = [
    "no checkpoint",
    "dcp.save",
    "async_save",
    "async_save, cached buffer",
    "DefaultStager overlap",
    "process writer",
]
KNOB_STRATEGIES = ["no checkpoint", "DefaultStager overlap"]
# metric: (the heading the page prints it under, the value of "no effect" or None)
METRICS = {
    "stall_per_checkpoint_s": ("stall per checkpoint", 0.0),
    "overlapped_step_slowdown": ("slow-down of steps that overlap a save", 1.0),
    "overhead_s": ("total overhead over the run without checkpoints", 0.0),
    "extra_memory_mb": ("extra peak host memory per rank", 0.0),
    "time_until_durable_s": ("time from save call until durable", None),
    "first_checkpoint_s": ("first checkpoint, until durable", None),
    "wall_s": (None, None),
}
CRITERIA = ["stall_per_checkpoint_s", "overhead_s", "extra_memory_mb"]
SUMMARY_LINE = re.compile(
    r"^checkpoint_stall_benchmark: DefaultStager stall (-?[\d.]+) of dcp\.save's, "
    r"total overhead (-?[\d.]+) of dcp\.save's "
    r"\(goal <= 0\.1x: (met|not met)(, dcp\.save's overhead within noise)?\)$",
    re.MULTILINE,
)


# --------------------------------------------------------------------------
# The numbers, recomputed from the raw per-rank measurements
# --------------------------------------------------------------------------


def run_metrics(per_rank: list[dict], baseline: list[dict]) -> dict:
    checkpoints = per_rank[0]["timed_checkpoints"]
    assert all(r["timed_checkpoints"] == checkpoints for r in per_rank)
    base_step = statistics.median(t for r in baseline for t, _ in r["steps"])
    overlapped = [t for r in per_rank for t, over in r["steps"] if over]
    durable = [max(r["durable"][i] for r in per_rank) for i in range(checkpoints)]
    firsts = [r["first_checkpoint"] for r in per_rank if r["first_checkpoint"] is not None]
    wall = max(r["wall"] for r in per_rank)
    return {
        "stall_per_checkpoint_s": max(r["stall"] for r in per_rank) / checkpoints
        if checkpoints
        else None,
        "overlapped_step_slowdown": statistics.median(overlapped) / base_step
        if overlapped
        else None,
        "overhead_s": wall - max(r["wall"] for r in baseline),
        "extra_memory_mb": max(r["peak_memory_mb"] for r in per_rank)
        - max(r["peak_memory_mb"] for r in baseline),
        "time_until_durable_s": statistics.median(durable) if durable else None,
        "first_checkpoint_s": max(firsts) if firsts else None,
        "wall_s": wall,
    }


def recompute(results: dict) -> dict:
    """label -> metric -> (median, min, max, values) from results["runs"] alone."""
    summary = {}
    for label, rounds in results["runs"].items():
        baseline_label = label.replace(label.split(" (")[0], "no checkpoint", 1)
        baseline = results["runs"][baseline_label]
        per_round = [run_metrics(run, baseline[i]) for i, run in enumerate(rounds)]
        summary[label] = {}
        for metric in METRICS:
            values = [m[metric] for m in per_round]
            known = [v for v in values if v is not None]
            summary[label][metric] = {
                "median": statistics.median(known) if known else None,
                "min": min(known) if known else None,
                "max": max(known) if known else None,
                "values": values,
            }
    return summary


def within_noise(entry: dict, neutral: float) -> bool:
    """The page's rule: an effect smaller than its spread (max - min), or below zero, is noise."""
    return entry["median"] - neutral < entry["max"] - entry["min"]


def printed_effects(output: str) -> dict[tuple[str, str], str]:
    """(strategy, metric) -> the line the page printed for it under the metric's heading."""
    headings = {heading + ":": metric for metric, (heading, _) in METRICS.items() if heading}
    lines, metric = {}, None
    for line in output.splitlines():
        if line in headings:
            metric = headings[line]
        elif metric and line.startswith("  "):
            name = line[2:28].strip()
            assert (name, metric) not in lines, f"{name}, {metric} printed twice"
            lines[(name, metric)] = line
        else:
            metric = None
    return lines


def assert_close_to_printed(printed: str, exact: float) -> None:
    """``printed`` is ``exact`` rounded to as many decimals as it shows."""
    decimals = len(printed.split(".")[1]) if "." in printed else 0
    assert abs(float(printed) - exact) <= 0.5 * 10**-decimals + 1e-9, (printed, exact)


# --------------------------------------------------------------------------
# Checks
# --------------------------------------------------------------------------


def check_results_file(results: dict, ranks: int, labels: list[str]) -> dict:
    assert results["torch"] == torch.__version__
    assert results["world_size"] == ranks
    assert results["machine"]["cores"] == os.cpu_count()
    assert results["repeats"] == REPEATS
    assert results["strategies"] == STRATEGIES

    # The warm-up round: every strategy once, not part of any summary.
    assert results["warmup"]["order"] == STRATEGIES
    assert list(results["warmup"]["runs"]) == STRATEGIES
    # Then the measured rounds, interleaved: A B C ... A B C ..., in that order in time.
    assert results["order"] == labels * REPEATS
    assert list(results["runs"]) == labels
    started = [
        results["runs"][label][i // len(labels)][0]["started_at"]
        for i, label in enumerate(results["order"])
    ]
    warmup_started = [results["warmup"]["runs"][n][0]["started_at"] for n in STRATEGIES]
    assert warmup_started + started == sorted(warmup_started + started)
    for label, rounds in results["runs"].items():
        assert len(rounds) == REPEATS and all(len(run) == ranks for run in rounds), label

    # Every median, min and max is what the raw measurements give.
    summary = recompute(results)
    assert list(results["summary"]) == labels
    for label in labels:
        for metric, (_, neutral) in METRICS.items():
            entry, expected = results["summary"][label][metric], summary[label][metric]
            for key in ("median", "min", "max"):
                assert entry[key] == pytest.approx(expected[key]), (label, metric, key)
            assert entry["values"] == pytest.approx(expected["values"]), (label, metric)
            checkpointing = not label.startswith("no checkpoint")
            if expected["median"] is not None and neutral is not None and checkpointing:
                assert entry["within_noise"] == within_noise(expected, neutral), (label, metric)

    # What must be measured for which strategy.
    assert summary["no checkpoint"]["overhead_s"]["values"] == [0.0] * REPEATS
    assert summary["no checkpoint"]["stall_per_checkpoint_s"]["median"] is None
    assert summary["dcp.save"]["overlapped_step_slowdown"]["median"] is None
    for name in STRATEGIES[1:]:
        for metric in ("stall_per_checkpoint_s", "time_until_durable_s", "first_checkpoint_s"):
            assert all(v > 0 for v in summary[name][metric]["values"]), (name, metric)
    for name in STRATEGIES[2:]:  # the step right after an async save overlaps its write
        assert all(v > 0 for v in summary[name]["overlapped_step_slowdown"]["values"]), name

    # Limits.
    limits = results["limits_GBps"]
    assert set(limits) == {"copy_reused", "copy_fresh", "write_fsync"}
    for name, value in limits.items():
        per_rank = [rank[name] for rank in results["limits_GBps_per_rank"]]
        assert len(per_rank) == ranks and value == min(per_rank) and value > 0
    assert results["checkpoint_bytes_per_rank"] == results["checkpoint_bytes"] // ranks
    return summary


def check_printed(output: str, results: dict, summary: dict) -> None:
    def med(name, metric):
        return summary[name][metric]["median"]

    # "within noise" exactly where an effect is smaller than its spread.
    effects = printed_effects(output)
    for name in STRATEGIES[1:]:
        for metric, (heading, neutral) in METRICS.items():
            if heading is None:
                continue
            line = effects[(name, metric)]
            entry = summary[name][metric]
            if entry["median"] is None:
                assert line.endswith(" -"), line
                continue
            noise = neutral is not None and within_noise(entry, neutral)
            assert line.endswith("  within noise") == noise, (line, entry)
    assert len(effects) == len(STRATEGIES[1:]) * 6

    # The advice: a lead smaller than the larger spread is "within noise", never advice.
    advice = [line for line in output.splitlines() if line.startswith(("Choose ", "No advice"))]
    assert len(advice) == len(CRITERIA)
    for line, metric in zip(advice, CRITERIA, strict=True):
        ranked = sorted(STRATEGIES[1:], key=lambda n: med(n, metric))
        best, second = (summary[n][metric] for n in ranked[:2])
        lead = second["median"] - best["median"]
        noise = max(best["max"] - best["min"], second["max"] - second["min"])
        if lead < noise:
            heading = METRICS[metric][0]
            assert line.startswith(f"No advice on {heading}: {ranked[0]} leads"), line
            assert "within noise" in line
        else:
            assert line.startswith(f"Choose {ranked[0]} when "), line
            assert "within noise" not in line

    # The ratios and the verdict, recomputed from the raw numbers.
    stall_ratio = med("DefaultStager overlap", "stall_per_checkpoint_s") / med(
        "dcp.save", "stall_per_checkpoint_s"
    )
    overhead_ratio = med("DefaultStager overlap", "overhead_s") / med("dcp.save", "overhead_s")
    found = SUMMARY_LINE.findall(output)
    assert len(found) == 1, output[-3000:]  # one summary line ...
    assert SUMMARY_LINE.search(output.rstrip().splitlines()[-1])  # ... and it is the last
    printed_stall, printed_overhead, verdict, noise_note = found[0]
    assert_close_to_printed(printed_stall, stall_ratio)
    assert_close_to_printed(printed_overhead, overhead_ratio)
    # A ratio to a dcp.save overhead that is itself noise cannot meet the goal.
    dcp_save_noise = within_noise(summary["dcp.save"]["overhead_s"], 0.0)
    met = not dcp_save_noise and overhead_ratio <= 0.1
    assert verdict == ("met" if met else "not met")
    assert bool(noise_note) == dcp_save_noise
    headline = results["headline"]
    assert headline["stall_vs_dcp_save"] == pytest.approx(stall_ratio)
    assert headline["overhead_vs_dcp_save"] == pytest.approx(overhead_ratio)
    assert headline["met"] == met
    copy_seconds = results["checkpoint_bytes_per_rank"] / (
        results["limits_GBps"]["copy_reused"] * 1e9
    )
    for name, ratio in results["ratios"].items():
        assert ratio["stall_vs_copy_time"] == pytest.approx(
            med(name, "stall_per_checkpoint_s") / copy_seconds
        )
        assert ratio["overhead_vs_dcp_save"] == pytest.approx(
            med(name, "overhead_s") / med("dcp.save", "overhead_s")
        )


def load_every_tensor(path: Path) -> int:
    """Load a checkpoint in this process from its metadata alone; returns the entries loaded."""
    metadata = FileSystemReader(str(path)).read_metadata()
    state_dict = {}
    for key, entry in metadata.state_dict_metadata.items():
        if isinstance(entry, TensorStorageMetadata):
            state_dict[key] = torch.empty(entry.size, dtype=entry.properties.dtype)
        else:
            assert isinstance(entry, BytesStorageMetadata), (key, entry)
    with warnings.catch_warnings():
        # DCP warns that it assumes a single process even when no_dist=True says so.
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        dcp.load(state_dict, checkpoint_id=str(path), no_dist=True)
    for key, tensor in state_dict.items():
        assert torch.isfinite(tensor).all(), f"{path}: {key} holds non-finite values"
    return len(state_dict)


def check_checkpoints(results: dict, checkpoint_root: Path) -> None:
    """Every checkpoint a run reports is complete on disk, and nothing else is there."""
    expected_count = results["config"]["checkpoints"] + 1  # the untimed first one, too
    runs = [(n, run) for n, run in results["warmup"]["runs"].items()]
    runs += [(label, run) for label, rounds in results["runs"].items() for run in rounds]
    listed = set()
    for label, run in runs:
        paths = run[0]["paths"]
        assert all(rank["paths"] == paths for rank in run), label
        assert all(rank["complete"] == len(paths) for rank in run), label
        checkpointing = not label.startswith("no checkpoint")
        assert len(paths) == (expected_count if checkpointing else 0), (label, paths)
        assert not listed & set(paths), f"{label} wrote over another run's checkpoint"
        listed |= set(paths)
    on_disk = {
        str(p.parent.relative_to(checkpoint_root)) for p in checkpoint_root.rglob(".metadata")
    }
    assert on_disk == listed
    shards = {p.parent for p in checkpoint_root.rglob("*.distcp")}
    assert {checkpoint_root / p for p in listed} == shards  # no directory without .metadata
    entries = {load_every_tensor(checkpoint_root / p) for p in sorted(listed)}
    assert len(entries) == 1 and entries.pop() > 0  # every checkpoint holds the same tensors


def run_and_check(recipe_runner, tmp_path: Path, launch, ranks: int, labels: list[str]) -> dict:
    results_path = tmp_path / "bench" / f"{RECIPE}.json"
    checkpoint_root = tmp_path / "checkpoints"
    output = assert_ok(
        launch(
            DCP_RECIPES_BENCH_GB=SMALLEST_GB,
            DCP_RECIPES_BENCH_REPEATS=str(REPEATS),
            DCP_RECIPES_BENCH_JSON=str(results_path),
            DCP_RECIPES_BENCH_CHECKPOINTS=str(checkpoint_root),
        )
    )
    assert "Traceback (most recent call last)" not in output, output[-4000:]
    assert "Warning:" not in output, output[-4000:]
    assert " - INFO - " not in output, "the writer process's log reached the output"
    results = json.loads(results_path.read_text())
    summary = check_results_file(results, ranks, labels)
    check_printed(output, results, summary)
    check_checkpoints(results, checkpoint_root)
    assert results_path.with_suffix(".png").read_bytes().startswith(b"\x89PNG")
    assert sorted(p.name for p in results_path.parent.iterdir()) == [
        f"{RECIPE}.json",
        f"{RECIPE}.png",
    ]
    assert recipe_runner.leftovers() == []
    assert recipe_runner.processes_left(grace_s=20.0) == []
    assert checkpoint_files_in_repo() == []
    return results


def test_benchmark_forked_ranks(recipe_runner, tmp_path):
    results = run_and_check(
        recipe_runner,
        tmp_path,
        lambda **env: recipe_runner.python(RECIPE, world_size=2, **env),
        ranks=2,
        labels=STRATEGIES,
    )
    assert results["launcher"] == "fork"
    assert results["config"]["training_threads"] == 1
    assert results["thread_knob"] == {}  # forked ranks train with one thread


def test_benchmark_under_torchrun_runs_the_thread_knob(recipe_runner, tmp_path):
    cores = os.cpu_count()
    knob = [f"{name} ({cores} threads)" for name in KNOB_STRATEGIES] if cores > 1 else []
    results = run_and_check(
        recipe_runner,
        tmp_path,
        lambda **env: recipe_runner.torchrun(RECIPE, nproc=1, **env),
        ranks=1,
        labels=STRATEGIES + knob,
    )
    assert results["launcher"] == "torchrun"
    assert results["config"]["training_threads"] == max(1, cores - 1)  # one core left
    if cores == 1:
        assert results["thread_knob"] == {}  # no core to leave to the writer
        return
    assert results["thread_knob"]["threads"] == {"recommended": cores - 1, "every_core": cores}
    for label, rounds in results["runs"].items():
        threads = cores if label in knob else cores - 1
        assert all(run[0]["training_threads"] == threads for run in rounds), label
