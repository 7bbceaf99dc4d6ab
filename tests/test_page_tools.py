"""The pages' measuring and proving package (recipes_source/page_tools), on its own.

What a page proves rests on these functions: they are checked here against cases whose
answer is known, including the ones that must fail.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from page_tools import disk, figures, memory, observe, proofs, ranks, results, stats, timing
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
    assert all(0.02 <= seconds < 1 for _, seconds in (rank_phases[0], rank_phases[2]))
    assert timing.slowest(phases, ["a", "b"]) == [rank_phases[0][1], None]
    assert timing.slowest(phases, ["a"], nth=1) == [rank_phases[2][1]]
    assert timing.slowest(phases, ["a"], nth=2) == [None]


def test_split_like_dcp_puts_the_largest_tensor_first_into_the_emptiest_bucket():
    tensors = [torch.zeros(n) for n in (2, 8, 4, 2, 4)]
    buckets = disk.split_like_dcp(tensors, 2)
    assert [[t.numel() for t in b] for b in buckets] == [[8, 2], [4, 4, 2]]
    assert sum(len(b) for b in disk.split_like_dcp(tensors, 4)) == len(tensors)


def test_measure_limits_reads_back_what_it_wrote_and_bandwidths_take_the_best(tmp_path):
    run = disk.measure_limits(lambda: torch.nn.Linear(256, 256), str(tmp_path), (1, 2), repeats=2)
    assert run["read_back_equal"] is True
    assert run["bytes"] == 4 * (256 * 256 + 256)
    assert set(run["seconds"]) == set(disk.KINDS)
    assert all(
        len(s) == 2 and min(s) > 0 for kind in run["seconds"].values() for s in kind.values()
    )
    assert len(run["torch_save"]) == len(run["torch_load"]) == 2
    assert list(tmp_path.iterdir()) == [], "the probe removes its files"
    limits = disk.bandwidths([run, run])  # two ranks that took the same time
    per_repeat = [2 * run["bytes"] / s / 1e9 for s in run["seconds"]["write_fsync"][2]]
    assert limits["GBps"]["write_fsync"][2]["values"] == pytest.approx(per_repeat)
    best = max(max(limits["GBps"]["read_cache"][n]["values"]) for n in (1, 2))
    assert limits["limit"]["read_cache"] == best
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


def test_group_median_range_and_verdict_cells(capsys):
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
    assert stats.median([1.0, 3.0]) == stats.median(stats.summary([1.0, 3.0])) == 2.0
    assert stats.median_range([0.0012, 0.0010, 0.0015], ".1f", scale=1e3) == "1.2 (1.0-1.5)"
    assert stats.verdict_cells([1.0, 1.1], [2.0, 2.1], "GB/s") == [
        "faster",
        "+1.00 GB/s, noise 0.10",
    ]
    assert stats.verdict_cells([2.0, 2.1], [1.0, 1.1], "GB/s")[0] == "slower"
    assert stats.verdict_cells([1.0, 2.0], [1.5, 1.6], "GB/s")[0] == "within noise"
    assert (
        stats.verdict_cells([0.010, 0.011], [0.020, 0.021], "ms", 1e3, ("longer", "shorter"))[0]
        == "longer"
    )
    stats.tell("a very long name " * 4, [1.0, 1.1], "another long name " * 4, [5.0, 5.1], "GB/s")
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


def test_headline_line_is_what_make_bench_prints(tmp_path, monkeypatch):
    monkeypatch.setenv(results.RESULTS_DIR_ENV, str(tmp_path))
    monkeypatch.setenv(results.RECIPE_ENV, "bench_page")
    results.record("headline", {"best_GBps": 1.23456, "runs": 3})
    path = tmp_path / "bench_page.json"
    assert results.headline_line(path) == "bench_page: best_GBps 1.23, runs 3"
    printed = subprocess.run(
        [sys.executable, "-m", "page_tools.results", str(path)],
        env=dict(os.environ, PYTHONPATH=str(RECIPES)),
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert printed == "bench_page: best_GBps 1.23, runs 3\n"
    results.record("headline", "not a dict")
    with pytest.raises(ValueError, match="no headline"):
        results.headline_line(path)


def test_the_speed_pages_modules_import_without_a_site_build():
    code = "import page_tools.timing, page_tools.disk, page_tools.memory"
    env = dict(os.environ, PYTHONPATH=str(RECIPES))
    subprocess.run([sys.executable, "-c", code], check=True, env=env, cwd="/")
