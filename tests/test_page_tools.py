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
