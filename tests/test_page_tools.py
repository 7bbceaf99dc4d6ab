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
