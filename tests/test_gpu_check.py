"""tools/gpu_check.py (``make gpu-check``), on CPU: its refusals and its summary format.

There is no GPU here, so the GPU run itself is not tested. What is: without a GPU it
refuses with one line and writes nothing; more ranks than GPUs is refused before any
recipe starts (the GPU count comes from ``--assume-gpus``, a hidden option that only
works with ``--allow-cpu``, and from the pure ``plan_world_size``); and a CPU dry run
(``--allow-cpu``) of one real recipe and three fixture recipes writes the summary format.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
TOOL = ROOT / "tools" / "gpu_check.py"
FIXTURES = Path(__file__).resolve().parent / "gpu_check_fixtures"
FAILING = FIXTURES / "failing_recipe.py"
MISSING = FIXTURES / "missing_module_recipe.py"
HANGING = FIXTURES / "hanging_recipe.py"
STRAY = FIXTURES / "stray_process_recipe.py"
REUSED_STAGER = FIXTURES / "reused_stager_recipe.py"
GPU_PROCESSES = FIXTURES / "gpu_processes_recipe.py"  # writes what the fake nvidia-smi reports
TORCH_2_11_STAGER = FIXTURES / "torch_2_11_stager"  # a sitecustomize: torch 2.11's bug, here

sys.path.insert(0, str(TOOL.parent))
import gpu_check  # noqa: E402


def run_tool(*args: str, timeout: float = 240, **env: str) -> subprocess.CompletedProcess:
    full_env = dict(os.environ, CUDA_VISIBLE_DEVICES="")  # no GPU, even on a GPU machine
    full_env.pop("DCP_RECIPES_WORLD_SIZE", None)
    full_env.update(env)
    return subprocess.run(
        [sys.executable, str(TOOL), *args],
        env=full_env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


# --------------------------------------------------------------------------
# Refusals: nothing runs, nothing is written
# --------------------------------------------------------------------------


def test_without_a_gpu_it_refuses_in_one_line_and_writes_nothing(tmp_path):
    out = tmp_path / "gpu-check"
    result = run_tool("--recipes", "save_load_recipe", "--out", str(out))
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert re.fullmatch(
        rf"gpu-check: no CUDA GPU visible to {re.escape(sys.executable)} "
        rf"\(torch {re.escape(torch.__version__)}\): this is not a GPU check",
        lines[0],
    ), lines[0]
    assert not out.exists(), "a refused run must write nothing (no summary that could pass)"


def test_more_ranks_than_gpus_is_refused_before_any_recipe_starts(tmp_path):
    out = tmp_path / "gpu-check"
    result = run_tool(
        "--allow-cpu",
        "--assume-gpus",
        "1",
        "--recipes",
        "save_load_recipe",
        "--out",
        str(out),
        DCP_RECIPES_WORLD_SIZE="2",
    )
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stdout == "", "no recipe may start"
    assert result.stderr.strip() == (
        "gpu-check: DCP_RECIPES_WORLD_SIZE=2 asks for more ranks than this machine has "
        "GPUs (1): NCCL needs one GPU per rank"
    )
    assert not out.exists()


def test_the_gpu_count_can_be_assumed_only_in_a_cpu_dry_run():
    result = run_tool("--assume-gpus", "4", "--list")
    assert result.returncode == 2
    assert "--assume-gpus is for the tool's tests and needs --allow-cpu" in result.stderr


def test_world_size_rule():
    plan = gpu_check.plan_world_size
    assert plan(1, None) == 1  # one H200: one rank
    assert plan(8, None) == 8  # one rank per GPU
    assert plan(8, "") == 8
    assert plan(8, "2") == 2  # fewer on request
    assert plan(2, "2") == 2
    assert plan(None, None) == 1  # CPU dry run: no GPUs to count
    assert plan(None, "3") == 3
    with pytest.raises(gpu_check.GpuCheckError, match=r"=3 asks for more ranks .* GPUs \(2\)"):
        plan(2, "3")
    for bad in ("0", "-1", "two"):
        with pytest.raises(gpu_check.GpuCheckError, match="must be a positive integer"):
            plan(2, bad)


def test_an_unknown_recipe_is_refused_naming_the_known_ones():
    with pytest.raises(gpu_check.GpuCheckError, match=r"no recipe 'nope' \(known: save_load"):
        gpu_check.select_recipes(gpu_check.all_recipes(), "save_load_recipe,nope")


# --------------------------------------------------------------------------
# Which recipes, in which order
# --------------------------------------------------------------------------


def test_recipe_order_first_then_new_recipes_and_never_the_launcher(tmp_path):
    for name in ("a_recipe.py", "b_recipe.py", "c_benchmark.py", "z_recipe.py", "helper.py"):
        (tmp_path / name).write_text("")
    (tmp_path / "rank_launcher.py").write_text("")
    found = gpu_check.all_recipes(tmp_path, ("b_recipe.py", "gone_recipe.py", "a_recipe.py"))
    assert [p.name for p in found] == [
        "b_recipe.py",
        "gone_recipe.py",  # listed but missing: it is run, and fails as "no such file"
        "a_recipe.py",
        "c_benchmark.py",
        "z_recipe.py",
    ]


def test_the_real_list_starts_with_recipe_order():
    import dcp_site

    names = [p.name for p in gpu_check.all_recipes()]
    assert names[: len(dcp_site.RECIPE_ORDER)] == list(dcp_site.RECIPE_ORDER)
    assert "rank_launcher.py" not in names


# --------------------------------------------------------------------------
# Reading a recipe and its output
# --------------------------------------------------------------------------


def test_missing_modules_are_found_before_running(tmp_path):
    script = tmp_path / "some_recipe.py"
    script.write_text(
        "import os\n"
        "import torch.distributed as dist\n"
        "from rank_launcher import run_on_ranks\n"
        "try:\n    import optional_thing_nobody_has\nexcept ImportError:\n    pass\n"
        "def rank_fn():\n    import torchdata_nobody_has.nodes\n"
    )
    assert gpu_check.missing_modules(script) == ["torchdata_nobody_has"]
    assert gpu_check.missing_modules(MISSING) == ["dcp_recipes_module_nobody_installed"]


def test_a_missing_module_in_a_failed_run_is_a_skip_only_when_its_package_is_absent():
    find = gpu_check.missing_module_in_output
    assert find("ModuleNotFoundError: No module named 'nobody_has_this.sub'") == "nobody_has_this"
    # An installed package without the submodule: an API this torch lacks, a real failure.
    assert find("ModuleNotFoundError: No module named 'torch.distributed.nope'") is None
    assert find("ModuleNotFoundError: No module named 'rank_launcher'") is None
    assert find("RuntimeError: boom") is None


def test_a_recipes_headline_and_claims_come_from_its_results_file(tmp_path):
    (tmp_path / "page.json").write_text(
        json.dumps(
            {
                "claims": {
                    "a": {"held": True},
                    "b": {"held": None},
                    "c": {"held": True},
                },
                "values": {"headline": {"stall ms": 0.8125, "saves": 4}, "other": 1},
            }
        )
    )
    headline, claims = gpu_check.read_results(tmp_path, "page")
    assert headline == {"stall ms": 0.8125, "saves": 4}
    assert claims == {"held": 2, "not measured": 1, "failed": 0}
    assert gpu_check.headline_text(headline) == "stall ms 0.812, saves 4"
    assert gpu_check.read_results(tmp_path, "no_such_page") == (None, {})


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, IndexError):
        return False
    return state != "Z"


def _child_is_stopped(log: str) -> bool:
    child = int(re.search(r"child pid (\d+)", log).group(1))
    deadline = time.monotonic() + 10
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.1)
    return not _alive(child)


def test_a_recipe_past_its_timeout_is_stopped_with_everything_it_started(tmp_path):
    start = time.monotonic()
    # 5 s: time for the recipe to start its child and say so on a loaded machine
    result = gpu_check.run_recipe(sys.executable, HANGING, 1, 5.0, tmp_path, dry_run=True)
    assert time.monotonic() - start < 60
    assert result["status"] == "fail"
    assert result["reason"] == "timed out after 5 s (--timeout)"
    log = (tmp_path / "hanging_recipe.log").read_text()
    assert "gpu-check: timed out after 5 s (--timeout): stopped" in log
    assert _child_is_stopped(log), "the recipe's child process outlived the timeout"


def test_a_recipe_reads_the_folders_beside_it_and_they_are_no_leftovers(tmp_path):
    """The cross-version page reads cross_version_fixture/ by a relative path: on an H200
    machine it found none in its empty working folder, and its claims failed."""
    assert "cross_version_fixture" in [
        p.name for p in gpu_check.recipe_data_dirs(gpu_check.RECIPES_DIR)
    ]
    assert "page_tools" not in [p.name for p in gpu_check.recipe_data_dirs(gpu_check.RECIPES_DIR)]
    recipe = FIXTURES / "reads_its_data_recipe.py"
    result = gpu_check.run_recipe(sys.executable, recipe, 1, 60.0, tmp_path, dry_run=True)
    log = (tmp_path / "reads_its_data_recipe.log").read_text()
    assert result["status"] == "pass", log
    assert "beside the recipe: saved by torch 2.15.0" in log
    assert result["leftovers"] == []


def test_a_process_left_running_after_a_pass_is_reported_and_stopped(tmp_path):
    result = gpu_check.run_recipe(sys.executable, STRAY, 1, 60.0, tmp_path, dry_run=True)
    assert result["status"] == "pass"
    assert result["leftovers"] == ["processes still running after the recipe exited (stopped)"]
    assert _child_is_stopped((tmp_path / "stray_process_recipe.log").read_text())


# --------------------------------------------------------------------------
# A CPU dry run: one real recipe, one that fails, one that needs a missing module
# (the real one is a short page: the tool is under test here, not the recipe)
# --------------------------------------------------------------------------


REAL = "stager_copies_recipe"


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu-check")
    (out / "stale_recipe.log").write_text("from an earlier run")
    recipes = ",".join([REAL, str(FAILING), str(MISSING)])
    result = run_tool("--allow-cpu", "--recipes", recipes, "--timeout", "200", "--out", str(out))
    summary = json.loads((out / "summary.json").read_text())
    return result, summary, out


def test_dry_run_exits_non_zero_because_a_recipe_failed(dry_run):
    result, summary, _ = dry_run
    assert result.returncode == 1, result.stdout + result.stderr
    assert summary["ok"] is False and summary["complete"] is True


def test_dry_run_summary_says_where_it_ran_and_that_it_was_no_gpu_check(dry_run):
    result, summary, _ = dry_run
    assert summary["device"] == "cpu (dry run)"
    assert summary["dry_run"] is True
    assert summary["torch"] == torch.__version__
    assert summary["python"] == sys.executable
    assert summary["world_size"] == 1
    assert summary["timeout_s"] == 200
    assert summary["gpus"] == []
    for key in ("started", "finished", "host", "python_version", "cuda", "gpu_info_from"):
        assert key in summary
    assert summary["torch_backports"] == [], "this torch reuses a DefaultStager: no backport"
    assert "this was NOT a GPU check" in result.stdout


def test_dry_run_records_each_recipe(dry_run):
    _, summary, out = dry_run
    by_name = {r["recipe"]: r for r in summary["recipes"]}
    assert list(by_name) == [REAL, "failing_recipe", "missing_module_recipe"]
    keys = {"recipe", "path", "status", "reason", "exit_status", "seconds", "log", "gpus"}
    assert all(keys | {"headline", "claims", "leftovers"} == set(r) for r in summary["recipes"])
    assert by_name["missing_module_recipe"]["gpus"] is None, "never started: nothing sampled"
    if shutil.which("nvidia-smi") is None:
        assert by_name[REAL]["gpus"] == {
            "measured": False,
            "reason": "not measured (no nvidia-smi)",
        }
    else:  # a GPU machine: the dry run hides the GPUs, so its ranks use none
        assert by_name[REAL]["gpus"]["processes"] == []

    passed = by_name[REAL]
    assert passed["status"] == "pass" and passed["exit_status"] == 0 and passed["reason"] is None
    assert passed["path"] == f"recipes_source/{REAL}.py"
    assert passed["seconds"] > 0
    assert passed["leftovers"] == []
    log = (out / passed["log"]).read_text()  # the full output, in its log
    assert "the second save copied into the first's host buffers, on every rank" in log

    failed = by_name["failing_recipe"]
    assert failed["status"] == "fail" and failed["exit_status"] == 1
    assert failed["reason"] == "exit status 1"
    log = (out / failed["log"]).read_text()
    assert "a line only the log keeps" in log
    assert "RuntimeError: this recipe fails on purpose" in log
    assert failed["headline"] == {"stall_ms": 12.5}, "what it recorded before it failed"
    assert failed["claims"] == {"held": 1, "not measured": 0, "failed": 0}
    assert passed["claims"]["held"] >= 10 and passed["claims"]["failed"] == 0, passed

    skipped = by_name["missing_module_recipe"]
    assert skipped["status"] == "skipped"
    assert skipped["reason"] == "missing module dcp_recipes_module_nobody_installed"
    assert skipped["exit_status"] is None  # never started

    assert summary["totals"]["pass"] == 1
    assert summary["totals"]["fail"] == 1
    assert summary["totals"]["skipped"] == 1
    assert summary["totals"]["seconds"] == pytest.approx(
        sum(r["seconds"] for r in summary["recipes"]), abs=0.05
    )
    assert sorted(p.name for p in out.iterdir()) == sorted(
        ["summary.json", "results"] + [r["log"] for r in summary["recipes"]]
    ), "the earlier run's log must be gone"
    assert sorted(p.name for p in (out / "results").iterdir()) == [
        "failing_recipe.json",
        f"{REAL}.json",
        f"{REAL}.png",  # its figure, saved with its results
    ], "each recipe's results file, and no earlier run's"


def test_dry_run_prints_one_line_per_recipe_and_the_total(dry_run):
    result, _, _ = dry_run
    table = result.stdout[result.stdout.index("\nrecipe ") + 1 :].splitlines()
    assert re.fullmatch(r"recipe +seconds +result", table[0])
    gpus = r"  \| GPUs: (not measured \(no nvidia-smi\)|no process of the recipe seen.*)"
    headline = (
        r"  \| most_rss_growth [^|]+, rss_growth_MB_per_save [^|]+, rss_growth_of_share [^|]+"
    )
    assert re.fullmatch(REAL + r" +\d+\.\d +pass  \| claims: 11 held" + headline + gpus, table[1])
    assert re.fullmatch(
        r"failing_recipe +\d+\.\d +fail \(exit status 1\)"
        r"  \| claims: 1 held  \| stall_ms 12\.5" + gpus,
        table[2],
    )
    assert re.fullmatch(
        r"missing_module_recipe +0\.0 +skipped "
        r"\(missing module dcp_recipes_module_nobody_installed\)",
        table[3],
    )
    assert re.fullmatch(r"total +\d+\.\d +1 passed, 1 failed, 1 skipped", table[4])
    # The failure's output is printed too, so a remote run's console shows why.
    assert "RuntimeError: this recipe fails on purpose" in result.stdout


# --------------------------------------------------------------------------
# make gpu-check: the python given, never the venv
# --------------------------------------------------------------------------


def test_make_gpu_check_runs_the_given_python_and_never_builds_the_venv():
    assert "\ngpu-check:" in (ROOT / "Makefile").read_text()
    env = dict(os.environ, DCP_RECIPES_WORLD_SIZE="1")
    # -n: print, run nothing; -B: everything counts as stale, so a venv step would show.
    dry = subprocess.run(
        ["make", "-n", "-B", "gpu-check", "PY=/opt/elsewhere/bin/python3"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert dry.returncode == 0, dry.stderr
    assert "/opt/elsewhere/bin/python3 tools/gpu_check.py" in dry.stdout
    assert "-m venv" not in dry.stdout and "pip install" not in dry.stdout, dry.stdout


@pytest.mark.long
def test_a_budget_for_the_whole_run_stops_a_recipe_and_runs_no_more(tmp_path):
    out = tmp_path / "gpu-check"
    recipes = f"{HANGING},{FAILING}"
    args = ("--allow-cpu", "--budget", "2", "--recipes", recipes, "--out", str(out))
    result = run_tool(*args)
    assert result.returncode == 1, result.stdout + result.stderr
    hanging, failing = json.loads((out / "summary.json").read_text())["recipes"]
    assert hanging["status"] == "fail"
    assert re.fullmatch(r"timed out after [\d.]+ s \(--budget\)", hanging["reason"])
    assert failing["status"] == "skipped"
    assert failing["reason"] == "not run: the --budget of 2 s is spent"


# --------------------------------------------------------------------------
# The GPU path, with the machine faked (never from the command line)
# --------------------------------------------------------------------------

FAKE_PROBE = {
    "torch": "2.11.0+cu128",
    "cuda": "12.8",
    "gpus": 2,
    "names": ["NVIDIA H200", "NVIDIA H200"],
    "driver": "CUDA driver API 12.8 (from torch)",
    "stager_reuse": "reuse works",
}


def test_gpu_names_and_driver_come_from_nvidia_smi_else_from_torch(monkeypatch):
    monkeypatch.setenv("PATH", str(FIXTURES / "bin"))
    gpus, source = gpu_check.gpu_descriptions(FAKE_PROBE)
    assert source == "nvidia-smi"
    assert gpus == [{"name": "NVIDIA H200", "driver": "570.86.15"}] * 2
    monkeypatch.setenv("PATH", "")
    gpus, source = gpu_check.gpu_descriptions(FAKE_PROBE)
    assert source == "torch"
    assert gpus == [{"name": "NVIDIA H200", "driver": "CUDA driver API 12.8 (from torch)"}] * 2


def test_on_a_gpu_machine_the_summary_names_the_gpus_and_one_rank_each(
    monkeypatch, tmp_path, capsys
):
    monkeypatch.setattr(gpu_check, "probe_torch", lambda python: FAKE_PROBE)
    monkeypatch.setenv("PATH", str(FIXTURES / "bin") + os.pathsep + os.environ["PATH"])
    monkeypatch.delenv("DCP_RECIPES_WORLD_SIZE", raising=False)
    out = tmp_path / "gpu-check"
    monkeypatch.setenv("FAKE_NVIDIA_SMI_APPS", str(tmp_path / "apps"))
    recipes = f"{FAILING},{MISSING},{GPU_PROCESSES}"
    code = gpu_check.main(["--recipes", recipes, "--out", str(out)])
    assert code == 1
    summary = json.loads((out / "summary.json").read_text())
    assert summary["device"] == "2 x NVIDIA H200"
    assert summary["dry_run"] is False
    assert summary["torch"] == "2.11.0+cu128" and summary["cuda"] == "12.8"
    assert summary["gpus"] == [{"name": "NVIDIA H200", "driver": "570.86.15"}] * 2
    assert summary["gpu_info_from"] == "nvidia-smi"
    assert summary["world_size"] == 2
    assert [r["status"] for r in summary["recipes"]] == ["fail", "skipped", "pass"]
    two = re.search(r"children \d+ (\d+)", (out / "gpu_processes_recipe.log").read_text())[1]
    assert [f.split(" (")[0] for f in summary["gpu_flags"]] == [f"gpu_processes_recipe: pid {two}"]
    assert summary["gpu_flags"][0].endswith(" touched GPUs 0, 1"), "2 ranks: GPU 0's 2 are fine"
    printed = capsys.readouterr().out
    assert f"gpu-check: GPU flag: {summary['gpu_flags'][0]}" in printed
    assert "NOT a GPU check" not in printed


# --------------------------------------------------------------------------
# Which GPUs a recipe's processes touched: nvidia-smi sampled while it runs
# --------------------------------------------------------------------------


def test_nvidia_smi_lines_are_parsed_and_junk_is_skipped():
    indices = "0, GPU-aaaa\n1, GPU-bbbb\n\nnot a line\n"
    assert gpu_check.parse_gpu_indices(indices) == {"GPU-aaaa": 0, "GPU-bbbb": 1}
    apps = "101, GPU-aaaa\n 102 , GPU-bbbb \nNo running processes found\n103, [N/A]\n"
    assert gpu_check.parse_compute_apps(apps) == [(101, "GPU-aaaa"), (102, "GPU-bbbb")]
    assert gpu_check.parse_compute_apps("") == []


def test_gpu_usage_flags_two_gpus_in_one_process_and_more_processes_than_ranks():
    seen = {12: {0, 1}, 11: {0}, 13: {1}}
    commands = {11: "python a.py", 12: "python -c spawn", 13: "python b.py"}
    usage = gpu_check.gpu_usage(seen, {0: 2, 1: 1}, 2, samples=5, commands=commands, others=3)
    assert usage["processes"] == [
        {"pid": 11, "gpus": [0], "command": "python a.py"},
        {"pid": 12, "gpus": [0, 1], "command": "python -c spawn"},
        {"pid": 13, "gpus": [1], "command": "python b.py"},
    ]
    assert usage["by_gpu"] == {
        "0": {"processes": 2, "most_at_once": 2},
        "1": {"processes": 2, "most_at_once": 1},
    }
    assert usage["flags"] == ["pid 12 (python -c spawn) touched GPUs 0, 1"], "2 at once: 2 ranks"
    assert usage["samples"] == 5 and usage["other_pids_seen"] == 3
    one_rank = gpu_check.gpu_usage(seen, {0: 2, 1: 1}, 1, samples=5, commands=commands)
    assert one_rank["flags"][1:] == ["GPU 0: 2 processes at once, more than the 1 rank(s)"]
    # Processes one after the other (a recipe launches ranks several times): no flag.
    apart = gpu_check.gpu_usage({1: {0}, 2: {0}, 3: {0}}, {0: 1}, 1, samples=9)
    assert apart["by_gpu"] == {"0": {"processes": 3, "most_at_once": 1}}
    assert apart["flags"] == []


def test_the_table_shows_each_recipes_gpus_and_its_flags():
    text = gpu_check.gpu_text
    assert text(None) == ""
    assert text({"measured": False, "reason": "not measured (no nvidia-smi)"}) == (
        "GPUs: not measured (no nvidia-smi)"
    )
    none = gpu_check.gpu_usage({}, {}, 2, samples=3, others=4)
    assert text(none) == (
        "GPUs: no process of the recipe seen (4 other pid(s) seen: another PID namespace?)"
    )
    two = gpu_check.gpu_usage({7: {0, 1}}, {0: 1, 1: 1}, 1, samples=3, commands={7: "py"})
    assert text(two) == (
        "GPUs: 1 process(es); by GPU 0: 1 (1 at once), 1: 1 (1 at once)"
        "; FLAG pid 7 (py) touched GPUs 0, 1"
    )


def test_a_recipes_processes_and_their_gpus_come_from_nvidia_smi(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(FIXTURES / "bin") + os.pathsep + os.environ["PATH"])
    monkeypatch.setenv("FAKE_NVIDIA_SMI_APPS", str(tmp_path / "apps"))
    result = gpu_check.run_recipe(sys.executable, GPU_PROCESSES, 1, 60.0, tmp_path, dry_run=True)
    assert result["status"] == "pass", (tmp_path / "gpu_processes_recipe.log").read_text()
    log = (tmp_path / "gpu_processes_recipe.log").read_text()
    one, two, outsider = map(int, re.search(r"children (\d+) (\d+); outsider (\d+)", log).groups())
    assert outsider == os.getpid()
    usage = result["gpus"]
    assert usage["measured"] is True and usage["samples"] >= 2 and usage["sample_errors"] == 0
    assert [(p["pid"], p["gpus"]) for p in usage["processes"]] == [(one, [0]), (two, [0, 1])]
    assert all("time.sleep(30)" in p["command"] for p in usage["processes"])
    assert usage["other_pids_seen"] == 1, "gpu-check's own pid is not the recipe's"
    assert usage["by_gpu"] == {
        "0": {"processes": 2, "most_at_once": 2},
        "1": {"processes": 1, "most_at_once": 1},
    }
    assert [flag.split(" (")[0] for flag in usage["flags"]] == [
        f"pid {two}",
        "GPU 0: 2 processes at once, more than the 1 rank(s)",
    ]


def test_without_nvidia_smi_a_recipes_gpus_are_not_measured(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))  # no nvidia-smi there
    result = gpu_check.run_recipe(sys.executable, STRAY, 1, 60.0, tmp_path, dry_run=True)
    assert result["gpus"] == {"measured": False, "reason": "not measured (no nvidia-smi)"}


# --------------------------------------------------------------------------
# A torch that cannot reuse a DefaultStager (2.11): the recipes run with the backport
# --------------------------------------------------------------------------


@pytest.mark.long
def test_a_torch_that_cannot_reuse_a_stager_gets_the_backport_and_says_so(tmp_path):
    # The tool's own probe finds the bug in this torch (the summary quotes its error); the
    # recipe then stages with one DefaultStager three times, which that torch cannot.
    bug = {"PYTHONPATH": str(TORCH_2_11_STAGER)}
    out = tmp_path / "gpu-check"
    result = run_tool("--allow-cpu", "--recipes", str(REUSED_STAGER), "--out", str(out), **bug)
    assert result.returncode == 0, result.stdout + result.stderr
    summary = json.loads((out / "summary.json").read_text())
    expected = (
        "tools/torch_backports: a reused DefaultStager keeps its buffers (torch "
        f"{torch.__version__} frees them after every copy, and its next stage raised "
        "KeyError: <class 'type'>)"
    )
    assert summary["torch_backports"] == [expected]
    assert f"gpu-check: with a backport, {expected}" in result.stdout
    (recipe,) = summary["recipes"]
    assert recipe["status"] == "pass"
    assert recipe["headline"] == {"stages with one DefaultStager": 3}
