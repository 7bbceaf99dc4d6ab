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
# async_save and torn_checkpoints pages: timing, memory, processes, faults, and the
# proofs, statistics and figures they added
# --------------------------------------------------------------------------

import concurrent.futures  # noqa: E402
import multiprocessing  # noqa: E402
import multiprocessing.process  # noqa: E402
import time  # noqa: E402
import types  # noqa: E402

import torch.distributed as dist  # noqa: E402
from page_tools import faults, memory, processes, timing  # noqa: E402
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions  # noqa: E402


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
    fake async_save whose upload takes 50 ms: the timeline must see exactly that."""
    pool = concurrent.futures.ThreadPoolExecutor(1)
    owner = types.SimpleNamespace(async_save=lambda: pool.submit(time.sleep, 0.05))
    with timing.async_save_loop(fake_step, owner=owner) as loop:
        upload = None
        for step in range(1, 7):
            fake_step()
            if step in (1, 3, 5):
                if upload is not None:
                    upload.result()
                upload = owner.async_save()
                if step == 1:
                    upload.result()
        upload.result()
    pool.shutdown()
    saves = loop.saves()
    assert [save.step for save in saves] == [1, 3, 5]
    assert saves[0].awaited and saves[0].blocked >= 0.05, "the first save is waited for"
    assert not saves[1].awaited and saves[1].blocked < 0.05
    assert saves[2].waited > 0.02, "step 5 waited for step 3's upload (50 ms > 2 steps)"
    assert all(0.05 <= save.upload < 1 for save in saves)
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
        return timing.Span("f", 0.0, seconds, True, label=label)

    calls = observe.Calls({0: [span("a/x", 1.0), span("b", 5.0)], 1: [span("a/y", 2.0)]})
    assert timing.slowest(calls, timing.label_has("a/")) == [2.0]
    with pytest.raises(ValueError):
        timing.slowest(calls), "ranks with different numbers of calls do not line up"


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_tensor_bytes_storages_and_staged_copies_in_shared_memory(tmp_path):
    state = {"a": torch.zeros(4, dtype=torch.float64), "b": {"c": torch.zeros(2, 3)}, "n": 1}
    assert memory.tensor_bytes(state) == 4 * 8 + 6 * 4
    assert memory.storages(state) == [
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
    assert numbers["writer pinned x state"] == 1.8 and numbers["stager pinned x state"] == 1.01
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


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_copies_from_the_gpu_are_timed_into_each_kind_of_memory():
    seconds = timing.copy_to_host_seconds(nbytes=2**20, repeats=2)
    assert set(seconds) == {"new pageable memory", "reused pageable memory", "reused pinned memory"}
    assert all(len(values) == 2 and min(values) > 0 for values in seconds.values())


def test_pinning_is_measured_only_on_a_gpu(tmp_path, monkeypatch):
    monkeypatch.setenv(results.RESULTS_DIR_ENV, str(tmp_path))
    monkeypatch.setenv(results.RECIPE_ENV, "page")
    if torch.cuda.is_available():
        pytest.skip("measures for real on a GPU: the page's build checks it")
    assert memory.pinning_on_gpu(str(tmp_path / "pinned")) is None
    assert json.loads((tmp_path / "page.json").read_text())["values"] == {"pinning": None}


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
        proofs.saves_into("step-2"), save=(owner, "save"), end=(owner, "end")
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
    assert proofs.saves_into("step-", anywhere=True)(into) and not proofs.saves_into("step-1")(into)


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
    stats.claim_less_paired("paired", series, "a", "b", "s")
    said = capsys.readouterr().out
    assert "a took less than b in each attempt (1 < 1.5, 3 < 3.2 s)" in said
    assert "within noise" in said
    with pytest.raises(results.ClaimFailed):
        stats.claim_less_paired("paired", {"a": [1.0, 3.3], "b": [1.5, 3.2]}, "a", "b", "s")
    said = stats.say("a", [1.0, 3.0], "b", [2.0, 2.5], "s")
    assert said["within_noise"] and "within noise" in capsys.readouterr().out


def test_wrapped_lines_fit_and_medians_tables():
    text = figures.wrapped("word " * 40 + "\nsecond paragraph", width=30)
    assert all(len(line) <= 30 for line in text.splitlines())
    assert text.splitlines()[1].startswith("  ") and text.splitlines()[-1] == "second paragraph"
    table = figures.medians(["phase", "ms"], {"stage": [0.001, 0.003, 0.002]}, 1e3)
    assert table.rows == [["stage", 2.0]]
