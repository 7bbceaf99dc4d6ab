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
# For the resume and torchrun-restart pages: faults, restarts, and what they added to
# proofs, ranks and figures
# --------------------------------------------------------------------------


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
        "plain": "probe attempt 0: the group formed\nGloo connectFullMesh failed with x\n"
        "Gloo connectFullMesh failed with y\nprobe attempt 2: no group after 15 s\n"
        "probe attempt 3: the group formed\n",
        "prefixed": "".join(f"probe attempt {a}: the group formed\n" for a in range(4)),
    }
    jobs = {}
    for mode, text in logs.items():
        log = tmp_path / f"{mode}.log"
        log.write_text(text)
        code = "import sys; sys.exit(1 if sys.argv[1] == 'plain' else 0)"
        jobs[mode] = (subprocess.Popen([sys.executable, "-c", code, mode]), str(log), 0.0)
    counts = restarts.finish(restarts.Probe(3, jobs, str(tmp_path)), timeout_s=60)
    expected = {"formed_after_restart": 1, "connect_failed": 2, "hung": 1, "exit": 1}
    assert counts["plain"] | expected == counts["plain"]
    assert counts["prefixed"]["formed_after_restart"] == 3 and counts["prefixed"]["exit"] == 0
    assert not tmp_path.exists(), "the probe's logs and folder are removed"


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
