"""The checkpoint-stall benchmark at its smallest size: complete numbers, complete checkpoints.

No timing is asserted (the machine is shared and noisy). What is asserted: every strategy and
metric is in the results file, every derived number is recomputed here from the raw per-rank
measurements in that file, every checkpoint the benchmark wrote is complete (``.metadata``
present, every tensor loads), and the run leaves no file and no process behind.
"""

from __future__ import annotations

import json
import os
import statistics
import time
import warnings
from pathlib import Path

import psutil
import pytest
import torch
import torch.distributed.checkpoint as dcp
from recipe_runner import assert_ok
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

RECIPE = "checkpoint_stall_benchmark"
SMALLEST_GB = "0.02"  # one 1024x1024 layer: about 13 MB of checkpoint
STRATEGIES = [
    "no checkpoint",
    "dcp.save",
    "async_save",
    "async_save, cached buffer",
    "DefaultStager overlap",
    "process writer",
]
BACKGROUND = STRATEGIES[2:]  # strategies whose writes overlap training steps
METRICS = [
    "stall_per_checkpoint_s",
    "overlapped_step_slowdown",
    "wall_over_baseline_s",
    "time_until_durable_s",
    "peak_host_memory_mb",
    "first_checkpoint_s",
    "wall_s",
]


def processes_started_by(tmpdir: Path) -> list[psutil.Process]:
    """Processes (other than this one) whose environment has the run's private TMPDIR."""
    found = []
    for process in psutil.process_iter():
        if process.pid == os.getpid():
            continue
        try:
            if process.environ().get("TMPDIR") == str(tmpdir):
                found.append(process)
        except (psutil.Error, OSError):
            continue
    return found


def wait_for_no_processes(tmpdir: Path, deadline_s: float = 20.0) -> list[str]:
    """Leftover processes of the run; exiting ones get ``deadline_s`` to finish exiting."""
    deadline = time.monotonic() + deadline_s
    while True:
        left = [p for p in processes_started_by(tmpdir) if p.is_running()]
        left = [p for p in left if p.status() != psutil.STATUS_ZOMBIE]
        if not left or time.monotonic() > deadline:
            return [f"{p.pid}: {' '.join(p.cmdline())}" for p in left]
        time.sleep(0.2)


def load_every_tensor(path: Path) -> int:
    """Load a checkpoint in this process from its metadata alone; returns the entries loaded."""
    metadata = FileSystemReader(str(path)).read_metadata()
    state_dict = {}
    for key, entry in metadata.state_dict_metadata.items():
        if isinstance(entry, TensorStorageMetadata):
            state_dict[key] = torch.empty(entry.size, dtype=entry.properties.dtype)
        else:
            assert isinstance(entry, BytesStorageMetadata), (key, entry)
    # Flattened keys ("model.0.weight") load as they are stored.
    with warnings.catch_warnings():
        # DCP warns that it assumes a single process even when no_dist=True says so.
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        dcp.load(state_dict, checkpoint_id=str(path), no_dist=True)
    for key, tensor in state_dict.items():
        assert torch.isfinite(tensor).all(), f"{path}: {key} holds non-finite values"
    return len(state_dict)


def metrics_recomputed(per_rank: list[dict], baseline: list[dict]) -> dict:
    """The recipe's per-run metrics, recomputed from its raw per-rank numbers."""
    checkpoints = len(per_rank[0]["stalls"])
    base_step = statistics.median(t for r in baseline for t, _ in r["steps"])
    overlapped = [t for r in per_rank for t, over in r["steps"] if over]
    stalls = [max(r["stalls"][i] for r in per_rank) for i in range(checkpoints)]
    durable = [max(r["durable"][i] for r in per_rank) for i in range(checkpoints)]
    firsts = [r["first_checkpoint"] for r in per_rank if r["first_checkpoint"] is not None]
    wall = max(r["wall"] for r in per_rank)
    return {
        "stall_per_checkpoint_s": statistics.median(stalls) if stalls else None,
        "overlapped_step_slowdown": statistics.median(overlapped) / base_step
        if overlapped
        else None,
        "wall_over_baseline_s": wall - max(r["wall"] for r in baseline),
        "time_until_durable_s": statistics.median(durable) if durable else None,
        "peak_host_memory_mb": max(r["peak_memory_mb"] for r in per_rank),
        "first_checkpoint_s": max(firsts) if firsts else None,
        "wall_s": wall,
    }


def listed_checkpoints(runs: dict, config: dict) -> set[str]:
    """Checkpoint paths the runs report; checks each rank reports the same, all complete."""
    listed = set()
    for name, repeats in runs.items():
        for run in repeats:
            paths = run[0]["checkpoints"]
            assert all(rank["checkpoints"] == paths for rank in run)
            assert all(rank["complete"] == len(paths) for rank in run), name
            expected = 0 if name == "no checkpoint" else config["checkpoints"] + 1
            assert len(paths) == expected, (name, paths)
            listed.update(paths)
    return listed


def check_checkpoints_on_disk(listed: set[str], checkpoint_root: Path) -> None:
    """Every checkpoint the benchmark wrote is complete, and nothing else is there."""
    on_disk = {
        str(p.parent.relative_to(checkpoint_root)) for p in checkpoint_root.rglob(".metadata")
    }
    assert on_disk == listed
    shards = {p.parent for p in checkpoint_root.rglob("*.distcp")}
    assert {checkpoint_root / p for p in listed} == shards  # no directory without .metadata
    entries = {load_every_tensor(checkpoint_root / p) for p in sorted(listed)}
    assert len(entries) == 1 and entries.pop() > 0  # every checkpoint holds the same tensors


def check_results(results: dict, ranks: int) -> None:
    assert results["torch"] == torch.__version__
    assert results["world_size"] == ranks
    assert results["machine"]["cores"] == os.cpu_count()
    config = results["config"]
    repeats = config["repeats"]
    assert list(results["strategies"]) == STRATEGIES
    assert list(results["runs"]) == STRATEGIES

    # Every strategy has every metric, as min, median and one value per repetition,
    # and each value is what the raw measurements give.
    for name in STRATEGIES:
        runs = results["runs"][name]
        assert len(runs) == repeats and all(len(run) == ranks for run in runs)
        for metric in METRICS:
            entry = results["strategies"][name][metric]
            assert set(entry) == {"min", "median", "values"}, (name, metric)
            assert len(entry["values"]) == repeats
            known = [v for v in entry["values"] if v is not None]
            assert entry["min"] == (min(known) if known else None)
            assert entry["median"] == (statistics.median(known) if known else None)
        for repeat, run in enumerate(runs):
            expected = metrics_recomputed(run, results["runs"]["no checkpoint"][repeat])
            for metric in METRICS:
                assert results["strategies"][name][metric]["values"][repeat] == pytest.approx(
                    expected[metric]
                ), (name, metric, repeat)

    # What must be measured for which strategy.
    baseline = results["strategies"]["no checkpoint"]
    assert baseline["wall_over_baseline_s"]["values"] == [0.0] * repeats
    assert baseline["stall_per_checkpoint_s"]["median"] is None
    for name in STRATEGIES[1:]:
        entry = results["strategies"][name]
        for metric in ("stall_per_checkpoint_s", "time_until_durable_s", "first_checkpoint_s"):
            assert all(v is not None and v > 0 for v in entry[metric]["values"]), (name, metric)
    assert results["strategies"]["dcp.save"]["overlapped_step_slowdown"]["median"] is None
    for name in BACKGROUND:  # the step right after an async save always overlaps its write
        slowdown = results["strategies"][name]["overlapped_step_slowdown"]["values"]
        assert all(v is not None and v > 0 for v in slowdown), name

    # Limits and ratios, recomputed.
    limits = results["limits_GBps"]
    assert set(limits) == {"copy_reused", "copy_fresh", "write_fsync"}
    for name, value in limits.items():
        per_rank = [rank[name] for rank in results["limits_GBps_per_rank"]]
        assert len(per_rank) == ranks and value == min(per_rank) and value > 0
    bytes_per_rank = results["checkpoint_bytes"] // ranks
    assert results["checkpoint_bytes_per_rank"] == bytes_per_rank
    copy_seconds = bytes_per_rank / (limits["copy_reused"] * 1e9)
    assert results["copy_seconds_per_checkpoint"] == pytest.approx(copy_seconds)
    sync_stall = results["strategies"]["dcp.save"]["stall_per_checkpoint_s"]["median"]
    assert list(results["ratios"]) == STRATEGIES[1:]
    for name, ratio in results["ratios"].items():
        stall = results["strategies"][name]["stall_per_checkpoint_s"]["median"]
        assert ratio["stall_vs_copy_time"] == pytest.approx(stall / copy_seconds)
        assert ratio["stall_vs_dcp_save"] == pytest.approx(stall / sync_stall)

    swings = [max(r["memory_swing_mb"] for r in run) for run in results["runs"]["no checkpoint"]]
    assert results["training_memory_swing_mb"] == pytest.approx(statistics.median(swings))

    # One sentence per strategy, written from its own median numbers.
    assert list(results["advice"]) == STRATEGIES[1:]
    for name, sentence in results["advice"].items():
        stall = results["strategies"][name]["stall_per_checkpoint_s"]["median"]
        total = results["strategies"][name]["wall_over_baseline_s"]["median"]
        assert name in sentence and f"{stall:.3g} s" in sentence and f"{total:+.2f} s" in sentence


def run_and_check(recipe_runner, tmp_path: Path, launch, ranks: int) -> dict:
    results_path = tmp_path / "results.json"
    checkpoint_root = tmp_path / "checkpoints"
    output = assert_ok(
        launch(
            DCP_RECIPES_BENCH_GB=SMALLEST_GB,
            DCP_RECIPES_BENCH_JSON=str(results_path),
            DCP_RECIPES_BENCH_CHECKPOINTS=str(checkpoint_root),
        )
    )
    assert "Traceback (most recent call last)" not in output, output[-4000:]
    assert "Warning:" not in output, output[-4000:]
    assert " - INFO - " not in output, "the writer process's log reached the output"
    assert "checkpoints complete: 0 of 0" in output  # the baseline writes none
    results = json.loads(results_path.read_text())
    check_results(results, ranks)
    listed = listed_checkpoints(results["runs"], results["config"])
    for knob in results["thread_knob"].values():
        listed |= listed_checkpoints(knob["runs"], results["config"])
    check_checkpoints_on_disk(listed, checkpoint_root)
    assert (tmp_path / "stall.png").read_bytes().startswith(b"\x89PNG")
    # fully_shard under torchrun creates torch's compile cache folder in TMPDIR.
    leftovers = [
        name for name in recipe_runner.leftovers() if not name.startswith("torchinductor_")
    ]
    assert leftovers == []
    assert wait_for_no_processes(recipe_runner.tmpdir) == []
    return results


def test_benchmark_forked_ranks(recipe_runner, tmp_path):
    results = run_and_check(
        recipe_runner,
        tmp_path,
        lambda **env: recipe_runner.python(RECIPE, world_size=2, **env),
        ranks=2,
    )
    assert results["launcher"] == "fork"
    assert results["config"]["training_threads"] == 1
    assert results["thread_knob"] == {}  # forked ranks must keep one thread


def test_benchmark_under_torchrun_runs_the_thread_knob(recipe_runner, tmp_path):
    results = run_and_check(
        recipe_runner,
        tmp_path,
        lambda **env: recipe_runner.torchrun(RECIPE, nproc=1, **env),
        ranks=1,
    )
    assert results["launcher"] == "torchrun"
    cores = os.cpu_count()
    assert results["config"]["training_threads"] == max(1, cores - 1)  # one core left
    knob = results["thread_knob"]
    if cores == 1:
        assert knob == {}  # no core to leave to the writer
        return
    assert list(knob) == [str(cores), str(cores - 1)]
    assert knob[str(cores - 1)]["runs"] == {
        name: results["runs"][name]
        for name in ("no checkpoint", "dcp.save", "DefaultStager overlap")
    }
    for entry in knob.values():
        summary = entry["strategies"]
        assert list(summary) == list(entry["runs"])
        assert list(summary) == ["no checkpoint", "dcp.save", "DefaultStager overlap"]
        for name, metrics in summary.items():
            assert set(metrics) == set(METRICS)
            if name != "no checkpoint":
                assert all(v > 0 for v in metrics["stall_per_checkpoint_s"]["values"])
