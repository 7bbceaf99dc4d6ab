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
    code += ", page_tools.faults, page_tools.timing"
    env = dict(os.environ, PYTHONPATH=str(RECIPES))
    subprocess.run([sys.executable, "-c", code], check=True, env=env, cwd="/")


# --------------------------------------------------------------------------
# The staging pitfalls and stager stream pages: faults, timing, checkpoints against saves
# --------------------------------------------------------------------------

import threading  # noqa: E402
import time  # noqa: E402
from concurrent.futures import Future  # noqa: E402

from page_tools import faults, timing  # noqa: E402
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions  # noqa: E402
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
