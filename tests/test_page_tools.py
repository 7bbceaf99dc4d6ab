"""The pages' measuring and proving package (recipes_source/page_tools), on its own.

What a page proves rests on these functions: they are checked here against cases whose
answer is known, including the ones that must fail.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from page_tools import figures, observe, proofs, ranks, results, stats
from recipe_runner import RECIPES, assert_ok
from torch.distributed.checkpoint import FileSystemWriter

SCRIPTS = Path(__file__).parent / "page_tools_scripts"


# --------------------------------------------------------------------------
# observe: nothing of torch stays changed
# --------------------------------------------------------------------------


class Base:
    def inherited(self):
        return "base"

    @staticmethod
    def static(x):
        return x + 1


class Child(Base):
    def own(self):
        return "own"


def test_replaced_restores_an_attribute_of_a_module_and_of_a_class():
    original_save, original_write = dcp.save, FileSystemWriter.write_data
    with observe.replaced(dcp, "save", lambda *a, **k: "replaced"):
        assert dcp.save({}) == "replaced"
    with observe.replaced(FileSystemWriter, "write_data", lambda self, *a: "replaced"):
        assert FileSystemWriter("/nowhere").write_data(None, None) == "replaced"
    assert dcp.save is original_save
    assert FileSystemWriter.write_data is original_write


def test_replaced_removes_what_a_class_only_inherited_and_keeps_static_methods_static():
    with observe.replaced(Child, "inherited", lambda self: "replaced"):
        assert Child().inherited() == "replaced"
        assert Base().inherited() == "base"
    assert "inherited" not in vars(Child), "the base class's method shows through again"
    with observe.replaced(Base, "static", lambda x: x + 2):
        assert Base.static(1) == 3 and Base().static(1) == 3
    assert Base.static(1) == 2 and isinstance(vars(Base)["static"], staticmethod)


def test_replaced_restores_when_the_block_raises():
    original = dcp.load
    with pytest.raises(RuntimeError), observe.replaced(dcp, "load", None):
        raise RuntimeError("a cell that fails")
    assert dcp.load is original


def test_watch_records_each_call_in_this_process_as_rank_0():
    with observe.watch(Child, "own", lambda call: ("after", call.result)) as after:
        Child().own()
        Child().own()
    with observe.watch(Child, "own", lambda call: call.result, before=True) as before:
        Child().own()
    assert after.by_rank == {0: [("after", "own"), ("after", "own")]}
    assert before.by_rank == {0: [None]}, "before the call there is no result yet"
    assert Child().own() == "own" and "own" in vars(Child)


def test_watch_where_keeps_only_the_calls_it_accepts():
    with observe.watch(
        Base, "static", lambda call: call.args[0], where=lambda c: c.args[0] > 1
    ) as w:
        Base.static(1)
        Base.static(5)
    assert w.by_rank == {0: [5]}


def test_watch_brings_back_every_forked_ranks_records(recipe_runner):
    """Two forked ranks save a sharded tensor: the page gets both shards and reassembles it."""
    result = recipe_runner.script(SCRIPTS / "watch_forked_ranks.py", world_size=2, timeout=120)
    output = assert_ok(result)
    assert "ranks recorded: [0, 1]" in output, output
    assert "shards: [(0, 0), (2, 0)] of (4, 3)" in output, output
    assert "reassembled equals arange: True" in output, output
    assert "dcp.save restored: True" in output, output
    assert recipe_runner.leftovers() == []


# --------------------------------------------------------------------------
# proofs
# --------------------------------------------------------------------------


def test_assemble_puts_shards_back_and_refuses_gaps_and_disagreement():
    whole = torch.arange(12.0).reshape(4, 3)
    top = {"w": proofs.Piece((4, 3), (0, 0), whole[:2].clone()), "step": 3}
    bottom = {"w": proofs.Piece((4, 3), (2, 0), whole[2:].clone()), "step": 3}
    assert torch.equal(proofs.assemble([top, bottom])["w"], whole)
    with pytest.raises(ValueError, match="do not cover"):
        proofs.assemble([top])
    with pytest.raises(ValueError, match="different values"):
        proofs.assemble([top, {**bottom, "step": 4}])
    other = {"w": proofs.Piece((4, 3), (0, 0), whole.clone() + 1), "step": 3}
    with pytest.raises(ValueError, match="different copies"):
        proofs.assemble([top, bottom, other])


def test_compare_is_bit_for_bit_and_names_what_differs():
    expected = {"a": torch.ones(3), "b": torch.zeros(2), "lr": 0.1}
    same = proofs.compare(
        expected, {k: (v.clone() if torch.is_tensor(v) else v) for k, v in expected.items()}
    )
    assert same.equal and (same.tensors, same.values) == (2, 1)
    nudged = {**expected, "a": torch.ones(3) + 1e-7, "lr": 0.2}
    assert proofs.compare(expected, nudged).differ == ["a", "lr"]
    assert proofs.compare(
        expected, {**expected, "b": torch.zeros(2, dtype=torch.float64)}
    ).differ == ["b"]
    partial = proofs.compare(expected, {"a": expected["a"], "extra": 1})
    assert partial.missing == ["b", "lr"] and partial.unexpected == ["extra"] and not partial.equal


def test_flatten_names_nested_state_as_dcp_does():
    class App:
        def state_dict(self):
            return {"model": {"w": 1}, "optim": {"param_groups": [{"lr": 0.1}]}}

    from torch.distributed.checkpoint.stateful import Stateful

    Stateful.register(App)
    flat = proofs.flatten({"app": App()})
    assert flat == {"app.model.w": 1, "app.optim.param_groups.0.lr": 0.1}


def test_same_state_raises_when_states_differ(capsys):
    proofs.same_state("equal", {"a": torch.ones(2)}, {"a": torch.ones(2)}, "two ones")
    assert "two ones: 1 tensors and 0 other values compared, 0 differ" in capsys.readouterr().out
    with pytest.raises(results.ClaimFailed, match="'unequal' does not hold"):
        proofs.same_state("unequal", {"a": torch.ones(2)}, {"a": torch.zeros(2)}, "ones vs zeros")


# --------------------------------------------------------------------------
# results
# --------------------------------------------------------------------------


def test_claims_and_values_go_to_the_results_file(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(results.RESULTS_DIR_ENV, str(tmp_path))
    monkeypatch.setenv(results.RECIPE_ENV, "some_recipe")
    results.record("stall_ms", {"median": 1.5, "values": torch.tensor([1.0, 2.0])})
    results.claim("held", True, "it held", compared=3)
    with pytest.raises(results.ClaimFailed):
        results.claim("broken", False, "it did not hold", compared=0)
    data = json.loads((tmp_path / "some_recipe.json").read_text())
    assert data["values"]["stall_ms"] == {"median": 1.5, "values": [1.0, 2.0]}
    assert data["claims"]["held"] == {"held": True, "said": "it held", "evidence": {"compared": 3}}
    assert data["claims"]["broken"]["held"] is False, "a failed claim is recorded too"
    assert capsys.readouterr().out == "it held\n", "only a claim that held is said"


def test_only_rank_0_writes_under_torchrun(tmp_path, monkeypatch):
    monkeypatch.setenv(results.RESULTS_DIR_ENV, str(tmp_path))
    monkeypatch.setenv("RANK", "1")
    results.record("x", 1)
    assert list(tmp_path.iterdir()) == []


def test_problems_compare_results_with_the_manifest(tmp_path, monkeypatch):
    monkeypatch.setattr(results, "CLAIMS_DIR", tmp_path)
    (tmp_path / "page.toml").write_text(
        '[claims]\na = "A"\nb = "B"\n[gpu_claims]\ng = "G"\n[values]\nv = "V"\n'
    )
    good = {
        "claims": {
            "a": {"held": True, "said": ""},
            "b": {"held": True, "said": ""},
            "g": {"held": None, "said": "no GPU"},
        },
        "values": {"v": 1},
    }
    assert results.problems("page", good, on_gpu=False) == []
    assert results.problems("page", good, on_gpu=True) == ["claim 'g' was not measured: no GPU"]
    bad = {"claims": {"a": {"held": False, "said": "no"}, "z": {"held": True}}, "values": {}}
    assert results.problems("page", bad, on_gpu=False) == [
        "claim 'a' does not hold: no",
        "claim 'b' was not decided",
        "claim 'g' was not decided",
        "value 'v' was not recorded",
        "'z' is recorded but not listed in claims/page.toml",
    ]


def test_every_page_with_claims_has_a_manifest_that_parses():
    for path in (RECIPES / "page_tools" / "claims").glob("*.toml"):
        listed = results.manifest(path.stem)
        assert listed.get("claims") or listed.get("values"), path
        assert (RECIPES / f"{path.stem}.py").exists(), f"{path.name} lists claims of no recipe"


# --------------------------------------------------------------------------
# stats, figures, ranks
# --------------------------------------------------------------------------


def test_a_difference_smaller_than_the_spread_is_noise():
    diff = stats.difference([10.0, 11.0, 12.0], [11.5, 12.0])
    assert diff["effect"] == pytest.approx(0.75) and diff["noise"] == pytest.approx(2.0)
    assert diff["within_noise"]
    assert not stats.difference([10.0, 10.1], [12.0, 12.1])["within_noise"]


def test_verdict_renders_the_numbers_it_rests_on():
    said, _ = stats.verdict(
        "reused stager", [0.0112, 0.0113], "async_save", [0.0126, 0.0125], "ms", 1e3
    )
    assert said.startswith("reused stager: 1.3 ms less than async_save (medians 11.2 and 12.6 ms")
    said, _ = stats.verdict("a", [1.0, 3.0], "b", [2.0, 2.5], "s")
    assert "a and b are within noise of each other" in said


def test_tables_render_as_html_and_as_aligned_text():
    table = figures.Table(["strategy", "stall ms"], [["dcp.save", 12.5], ["<async>", 1.25]])
    html = table._repr_html_()
    assert "<th>strategy</th>" in html and "&lt;async&gt;" in html
    assert '<td class="dcp-num">12.5</td>' in html
    assert str(table).splitlines() == [
        "strategy  stall ms",
        "dcp.save      12.5",
        "<async>       1.25",
    ]
    with pytest.raises(ValueError):
        figures.Table(["a"], [[1, 2]])


def test_at_least_two_ranks_where_the_launch_would_use_one(monkeypatch):
    monkeypatch.setenv("DCP_RECIPES_WORLD_SIZE", "1")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    for name in ("RANK", "WORLD_SIZE", "MASTER_PORT", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(name, raising=False)
    with ranks.at_least(2) as launched:
        assert launched == 2
        assert (
            os.environ["DCP_RECIPES_WORLD_SIZE"] == "2" and os.environ["CUDA_VISIBLE_DEVICES"] == ""
        )
    assert os.environ["DCP_RECIPES_WORLD_SIZE"] == "1" and "CUDA_VISIBLE_DEVICES" not in os.environ


def test_the_package_imports_without_a_site_build():
    """gpu-check and torchrun run the pages from the repository: the package must import alone."""
    code = "import page_tools.proofs, page_tools.results, page_tools.stats, page_tools.figures"
    env = dict(os.environ, PYTHONPATH=str(RECIPES))
    subprocess.run([sys.executable, "-c", code], check=True, env=env, cwd="/")


# --------------------------------------------------------------------------
# checkpoint_stall_benchmark: observe.recording, timing, memory, disk, stats, stalls, figures
# --------------------------------------------------------------------------

import shutil  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402

from page_tools import disk, memory, stalls, timing  # noqa: E402
from torch.distributed.checkpoint.api import CheckpointException  # noqa: E402


def _single_process_dcp():
    """DCP in this process, without a process group: its warning about that silenced."""
    context = warnings.catch_warnings()
    context.__enter__()
    warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
    return context


def test_recording_brings_back_what_a_thread_put_later():
    with observe.recording() as (put, calls):
        worker = threading.Thread(target=put, args=({"from": "a callback"},))
        worker.start()
        worker.join()
        put("from the caller")
    assert calls.by_rank == {0: [{"from": "a callback"}, "from the caller"]}


def test_checkpoint_saves_times_each_save_until_durable_and_restores_dcp(tmp_path):
    save, async_save = dcp.save, dcp.async_save
    state = {"w": torch.arange(6.0)}
    quiet = _single_process_dcp()
    try:
        with timing.checkpoint_saves(dcp) as saves:
            dcp.save(state, checkpoint_id=str(tmp_path / "blocking"))
            dcp.async_save(state, checkpoint_id=tmp_path / "background").result()
            (tmp_path / "a-file").write_text("not a directory")
            with pytest.raises(CheckpointException):
                dcp.save(state, checkpoint_id=str(tmp_path / "a-file" / "x"))
    finally:
        quiet.__exit__(None, None, None)
    assert dcp.save is save and dcp.async_save is async_save
    recorded = {Path(r["checkpoint_id"]).name: r for r in saves.by_rank[0]}
    blocking, background, failed = (recorded[n] for n in ("blocking", "background", "x"))
    assert blocking["call"] == "save" and blocking["error"] is None
    assert blocking["called"] <= blocking["returned"] == blocking["durable"]
    assert background["call"] == "async_save" and background["error"] is None
    assert background["called"] <= background["returned"] <= background["durable"]
    assert background["checkpoint_id"] == str(tmp_path / "background")
    assert failed["durable"] is None and failed["error"]
    assert (tmp_path / "background" / ".metadata").exists()
    found = timing.by_checkpoint(saves)
    assert found[str(tmp_path / "blocking")][0]["rank"] == 0


def test_peak_sampler_sees_memory_allocated_while_it_runs():
    sampler = memory.PeakSampler(interval_s=0.005).start()
    held = torch.ones(50_000_000, dtype=torch.uint8)  # 50 MB, every page touched
    deadline = time.monotonic() + 2
    while sampler.samples < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    measured = sampler.stop()
    del held
    assert 40 < measured["peak_mb"] < 500, measured
    assert measured["baseline_mb"] > 0 and measured["samples"] >= 3


class _Run:
    def begin(self):
        return "began"

    def end(self):
        return "ended"


def test_peak_between_measures_each_stretch_and_restores_both_functions():
    begin, end = vars(_Run)["begin"], vars(_Run)["end"]
    with memory.peak_between((_Run, "begin"), (_Run, "end"), interval_s=0.005) as peaks:
        run = _Run()
        assert run.begin() == "began"
        held = torch.ones(30_000_000, dtype=torch.uint8)
        time.sleep(0.05)
        assert run.end() == "ended"
        del held
        run.begin()
        run.end()
        run.end()  # a stop without a start measures nothing
    assert vars(_Run)["begin"] is begin and vars(_Run)["end"] is end
    first, second = peaks.by_rank[0]
    assert first["peak_mb"] > 20 > second["peak_mb"], (first, second)


def _saved_checkpoint(path):
    quiet = _single_process_dcp()
    try:
        dcp.save({"w": torch.arange(1000.0), "b": torch.ones(10)}, checkpoint_id=str(path))
    finally:
        quiet.__exit__(None, None, None)
    return path


def test_checkpoint_on_disk_finds_what_is_missing(tmp_path):
    path = _saved_checkpoint(tmp_path / "step-1")
    assert disk.checkpoint_on_disk(path) == {"metadata": True, "entries": 2, "missing": []}
    assert disk.loads_in_one_process(path) == {"tensors": 2, "finite": True}
    shard = next(path.glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:100])  # a writer that stopped half-way
    assert disk.checkpoint_on_disk(path)["missing"], "the truncated tensor is missing"
    (path / ".metadata").unlink()
    assert disk.checkpoint_on_disk(path) == {
        "metadata": False,
        "entries": 0,
        "missing": [".metadata"],
    }


def test_checked_before_removal_checks_only_below_its_root_and_restores_rmtree(tmp_path):
    rmtree = shutil.rmtree
    root, elsewhere = tmp_path / "root", tmp_path / "elsewhere"
    _saved_checkpoint(root / "run" / "step-0")
    time.sleep(0.01)
    _saved_checkpoint(root / "run" / "step-2")
    elsewhere.mkdir()
    with disk.checked_before_removal(root) as removals:
        shutil.rmtree(root / "run")
        shutil.rmtree(elsewhere)
        shutil.rmtree(root / "never-made", ignore_errors=True)
    assert shutil.rmtree is rmtree
    assert not (root / "run").exists() and not elsewhere.exists()
    (removal,) = removals.by_rank[0]
    assert removal["directory"] == str(root / "run")
    assert sorted(removal["checkpoints"]) == ["step-0", "step-2"]
    assert removal["newest"] == "step-2" and removal["loaded"] == {"tensors": 2, "finite": True}


def test_copy_and_write_speeds_in_one_process(tmp_path):
    speeds = disk.copy_and_write_speeds(4_000_000, tmp_path, threads=1, repeats=2)
    assert speeds["bytes"] == 4_000_000
    assert all(speeds[k] > 0 for k in ("copy_reused", "copy_fresh", "write_fsync"))
    assert list(tmp_path.iterdir()) == [], "the probe file is removed"
    ranks = [
        {"copy_reused": 2.0, "write_fsync": 1.0, "bytes": 8},
        {"copy_reused": 3.0, "write_fsync": 0.5, "bytes": 8},
    ]
    assert disk.slowest(ranks) == {"copy_reused": 2.0, "write_fsync": 0.5}


def test_an_effect_below_its_spread_or_below_neutral_is_noise():
    assert not stats.effect([1.0, 1.1], 0.0)["within_noise"]
    assert stats.effect([0.1, 1.0], 0.0)["within_noise"], "a spread wider than the effect"
    negative = stats.effect([-0.30, -0.31], 0.0)
    assert negative["within_noise"] and negative["effect"] == pytest.approx(-0.305)
    assert stats.effect([1.5, 1.6], 1.0)["effect"] == pytest.approx(0.55)
    assert (
        stats.shown(stats.effect([0.1, 1.0]), ".2f", " s") == "0.55 s [0.10 .. 1.00] within noise"
    )
    assert stats.shown(None, ".2f", " s") == "-"


def test_below_goal_is_met_missed_or_undecided():
    assert stats.below_goal([1.0, 1.1], [5.0, 5.0])["met"] is True
    assert stats.below_goal([5.0, 5.1], [1.0, 1.0])["met"] is False
    assert stats.below_goal([1.0, 3.0], [2.0, 2.1])["met"] is None


def _run(stall, wall, steps, peak, checkpoints=2, loss=0.5, threads=1, saves_s=0.1):
    paths = [f"/c/step-{i}" for i in range(checkpoints)]
    return {
        "strategy": "x",
        "threads": threads,
        "round": 1,
        "checkpoints": paths,
        "first_checkpoint_s": 0.3,
        "stall_s": stall,
        "steps": steps,
        "wall_s": wall,
        "loss": loss,
        "peak_memory_mb": peak,
        "saves": [{"called": 0.0, "durable": saves_s, "error": None} for _ in paths],
    }


def test_metrics_of_a_run_against_its_rounds_baseline():
    baseline = [_run(0, 1.0, [[0.1, False]] * 4, 100, checkpoints=0)]
    run = [
        _run(0.2, 1.5, [[0.2, True], [0.1, False]], 150, checkpoints=3, saves_s=0.4),
        _run(0.3, 1.4, [[0.4, True], [0.1, False]], 130, checkpoints=3, saves_s=0.5),
    ]
    found = stalls.metrics(run, baseline)
    assert found["stall_per_checkpoint_s"] == pytest.approx(0.3 / 2)  # the slowest rank, 2 timed
    assert found["overlapped_step_slowdown"] == pytest.approx(0.3 / 0.1)  # median of 0.2, 0.4
    assert found["overhead_s"] == pytest.approx(0.5)
    assert found["extra_memory_mb"] == pytest.approx(50)
    assert found["time_until_durable_s"] == pytest.approx(0.5)
    assert found["first_checkpoint_s"] == pytest.approx(0.3)
    assert stalls.metrics(baseline, baseline)["stall_per_checkpoint_s"] is None


def test_summarize_marks_effects_and_compares_each_run_with_its_own_round():
    runs = {
        "no checkpoint": [
            [_run(0, 1.0, [[0.1, False]], 100, 0)],
            [_run(0, 2.0, [[0.1, False]], 100, 0)],
        ],
        "dcp.save": [[_run(0.2, 1.5, [[0.1, False]], 90)], [_run(0.25, 2.5, [[0.1, False]], 95)]],
    }
    summary = stalls.summarize(runs)
    assert summary["dcp.save"]["overhead_s"]["values"] == pytest.approx([0.5, 0.5])
    assert summary["dcp.save"]["overhead_s"]["within_noise"] is False
    assert summary["dcp.save"]["extra_memory_mb"]["within_noise"] is True, "below zero: noise"
    assert summary["dcp.save"]["overlapped_step_slowdown"] is None, "no step overlapped a save"
    assert "within_noise" not in summary["no checkpoint"]["overhead_s"]
    assert stalls.baseline_of("DefaultStager overlap (2 threads)") == "no checkpoint (2 threads)"
    assert (
        stalls.label("dcp.save", 2, 1) == "dcp.save (2 threads)" and stalls.label("a", 1, 1) == "a"
    )


def test_goals_cannot_be_met_against_a_reference_that_is_noise():
    summary = {
        "dcp.save": {"overhead_s": stats.effect([1.0, 1.1])},
        "fast": {"overhead_s": stats.effect([0.01, 0.02])},
        "slow": {"overhead_s": stats.effect([0.9, 0.95])},
    }
    assert stalls.goals(summary, "fast", {"overhead_s": 0.1})["overhead_s"]["met"] is True
    assert stalls.goals(summary, "slow", {"overhead_s": 0.1})["overhead_s"]["met"] is False
    summary["dcp.save"]["overhead_s"] = stats.effect([-0.2, 1.0])
    undecided = stalls.goals(summary, "fast", {"overhead_s": 0.1})["overhead_s"]
    assert undecided["met"] is None and "within noise" in undecided["said"]


def test_advice_gives_none_where_the_lead_is_noise():
    summary = {
        "a": {"stall_per_checkpoint_s": stats.effect([0.10, 0.11])},
        "b": {"stall_per_checkpoint_s": stats.effect([0.50, 0.52])},
        "c": {"stall_per_checkpoint_s": stats.effect([0.105, 0.2])},
    }
    found = stalls.advice(summary, ["a", "b", "c"], {"stall_per_checkpoint_s": "it matters"})
    assert found["stall_per_checkpoint_s"]["best"] == "a"
    assert found["stall_per_checkpoint_s"]["second"] == "c"
    assert found["stall_per_checkpoint_s"]["choose"] is None
    found = stalls.advice(summary, ["a", "b"], {"stall_per_checkpoint_s": "it matters"})
    assert found["stall_per_checkpoint_s"]["choose"] == "a"


def test_the_benchmarks_checks_fail_where_they_should():
    assert stalls.interleaved([(0, "a"), (0, "b"), (1, "a"), (1, "b")], ["a", "b"], 1)
    assert not stalls.interleaved([(0, "a"), (0, "b"), (1, "b"), (1, "a")], ["a", "b"], 1)
    same = {"warmup": {"a": [_run(0, 1, [], 0)]}, "runs": {"b": [[_run(0, 1, [], 0)]]}}
    assert stalls.same_losses(same)["held"]
    same["runs"]["b"][0][0]["loss"] = 0.5000001
    assert not stalls.same_losses(same)["held"]
    blocking = {"warmup": {}, "runs": {"dcp.save": [[_run(0.2, 1, [], 0, checkpoints=3)]]}}
    assert stalls.timers_enclose_blocking_saves(blocking)["held"]  # 0.2 >= 2 x 0.1
    blocking["runs"]["dcp.save"][0][0]["stall_s"] = 0.15
    assert not stalls.timers_enclose_blocking_saves(blocking)["held"]


def test_complete_checkpoints_needs_every_checkpoint_checked_on_disk():
    run = _run(0.2, 1, [], 0, checkpoints=2)
    good = {"metadata": True, "entries": 2, "missing": []}
    removal = {
        "directory": "/c",
        "checkpoints": {"step-0": good, "step-1": good},
        "newest": "step-1",
        "loaded": {"tensors": 2, "finite": True},
    }
    collected = {"warmup": {}, "runs": {"dcp.save": [[run]]}, "removals": [removal]}
    assert stalls.complete_checkpoints(collected)["held"]
    removal["checkpoints"]["step-1"] = {**good, "missing": ["w in __0_0.distcp"]}
    assert stalls.complete_checkpoints(collected)["incomplete"] == ["/c/step-1"]
    assert not stalls.complete_checkpoints(collected)["held"]
    removal["checkpoints"]["step-1"] = good
    run["saves"][0]["durable"] = None  # a save that never became durable
    assert not stalls.complete_checkpoints(collected)["held"]


def test_collect_refuses_runs_and_watches_that_do_not_match():
    run = {**_run(0.1, 1, [], 0, checkpoints=1), "strategy": "dcp.save", "round": 0}
    run.pop("saves"), run.pop("peak_memory_mb")
    saves = observe.Calls({0: [{"checkpoint_id": "/c/step-0", "called": 0.0, "durable": 1.0}]})
    collected = stalls.collect(
        [[run]], saves, observe.Calls({0: [{"peak_mb": 5.0}]}), observe.Calls(), 1
    )
    assert collected["order"] == [(0, "dcp.save")]
    assert collected["warmup"]["dcp.save"][0]["peak_memory_mb"] == 5.0
    with pytest.raises(ValueError, match="memory peaks"):
        stalls.collect([[run]], saves, observe.Calls({0: []}), observe.Calls(), 1)
    with pytest.raises(ValueError, match="other than once"):
        stalls.collect(
            [[run]], observe.Calls(), observe.Calls({0: [{"peak_mb": 5.0}]}), observe.Calls(), 1
        )


def test_adam_checkpoint_bytes_counts_each_parameter_three_times_without_allocating():
    assert stalls.adam_checkpoint_bytes(lambda: torch.nn.Linear(4, 4)) == 3 * 4 * (16 + 4)
    big = stalls.adam_checkpoint_bytes(lambda: torch.nn.Linear(100_000, 100_000))  # 40 GB
    assert big == 3 * 4 * (100_000**2 + 100_000)


def test_medians_with_whiskers_draws_a_panel_per_quantity_and_saves_beside_results(tmp_path):
    entries = [stats.effect([1.0, 2.0]), stats.effect([0.1, 0.3])]
    figure = figures.medians_with_whiskers(
        ["a", "b"],
        [
            {
                "entries": entries,
                "labels": ["1.5", "0.2"],
                "xlabel": "s",
                "log": True,
                "reference": (0.5, "one copy"),
            },
            {"entries": entries, "labels": ["x", "y"], "xlabel": "s"},
        ],
        "title",
    )
    left, right = figure.axes
    assert left.get_xscale() == "log" and right.get_xscale() == "linear"
    assert [t.get_text() for t in left.get_yticklabels()] == ["a", "b"]
    path = figures.save_beside(figure, tmp_path / "page.json")
    assert path == tmp_path / "page.png" and path.read_bytes().startswith(b"\x89PNG")
    assert figures.save_beside(figure, None) is None


def test_thread_knob_says_why_it_did_not_run_and_compares_budgets_where_it_did():
    summary = {"DefaultStager overlap": {"overhead_s": stats.effect([0.5, 0.6])}}
    forked = stalls.thread_knob(summary, "DefaultStager overlap", 1, 2)
    assert forked == {
        "ran": False,
        "why": "forked ranks train with one thread (make bench runs it)",
    }
    assert stalls.thread_knob(summary, "DefaultStager overlap", 1, 1)["why"] == "no core to spare"
    summary["DefaultStager overlap (4 threads)"] = {"overhead_s": stats.effect([1.5, 1.6])}
    knob = stalls.thread_knob(summary, "DefaultStager overlap", 3, 4)
    assert knob["ran"] and knob["threads"] == {"recommended": 3, "every_core": 4}
    assert knob["said"].startswith("3 training thread(s): 1 s less than 4")


def test_ratios_flag_an_overhead_ratio_that_rests_on_noise():
    summary = {
        "dcp.save": {
            "stall_per_checkpoint_s": stats.effect([1.0, 1.0]),
            "overhead_s": stats.effect([2.0, 2.2]),
        },
        "quiet": {
            "stall_per_checkpoint_s": stats.effect([0.1, 0.1]),
            "overhead_s": stats.effect([-0.1, 0.3]),
        },
    }
    found = stalls.ratios(summary, ["dcp.save", "quiet"], copy_seconds=0.05)
    assert found["quiet"]["stall_vs_copy_time"] == pytest.approx(2.0)
    assert found["quiet"]["stall_vs_dcp_save"] == pytest.approx(0.1)
    assert (
        found["quiet"]["overhead_within_noise"] and not found["dcp.save"]["overhead_within_noise"]
    )
    cells = stalls.ratios_table(found, 0.05).rows
    assert cells[1][3] == "0.05 (noise)" and cells[0][3] == 1.0
