"""``make stress``: launch every page many times, the ways a reader does, and count hangs.

A launch that hangs now and then (a rank forked while another thread of the parent held
a lock) passes a test suite most days. This tool runs, from the built site:

* every page's script download at 3 ranks (``python <recipe>.py``, alone in an empty
  directory);
* the Hugging Face pages' downloads at 3 ranks, 30 times each (the page that hung 3 of 9,
  since split in two: the export, and the import into sharded training);
* every page's notebook at 3 ranks, in a Jupyter kernel (which runs threads of its own).

Every run has a deadline: the launcher's (``DCP_RECIPES_TIMEOUT``, 240 s here), then the
tool's own (300 s), after which it stops the run's whole process group. A run that hits
either is counted as hung; one that exits non-zero, as failed, with its first error line.
It prints one line per run and a summary, writes ``_build/stress/summary.json`` and every
run's output, and exits 1 if any run hung or failed. ``--jobs 2`` runs two at a time (more
contention for 2 cores); ``--repeat-hf N`` and ``--only a,b`` narrow or widen it.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]  # the tests' runner: a reader's runs
from recipe_runner import RECIPE_NAMES, RecipeRunner  # noqa: E402

OUT = ROOT / "_build" / "stress"
RANKS = 3
LAUNCH_DEADLINE_S = 240
RUN_DEADLINE_S = 300
HF_RECIPES = ("hf_interop_recipe", "hf_import_recipe")
# Pages whose download reads an S3 endpoint from AWS_*: each run gets a server of its own.
S3_RECIPES = ("object_storage_recipe", "object_storage_async_recipe")
FIRST_ERROR = re.compile(r"^\S*(Error|Exception)\b.*$", re.M)


def _stop_group(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def run_one(kind: str, recipe: str, index: int) -> dict:
    """One run in a subprocess of its own session (so that a hang is stopped as a whole)."""
    log = OUT / f"{recipe}.{kind}.{index}.log"
    command = [sys.executable, __file__, "--one", kind, recipe]
    start = time.monotonic()
    with open(log, "w") as out:
        proc = subprocess.Popen(
            command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, cwd=ROOT
        )
        try:
            code = proc.wait(timeout=RUN_DEADLINE_S)
        except subprocess.TimeoutExpired:
            code = None
        _stop_group(proc)
    seconds = round(time.monotonic() - start, 1)
    text = log.read_text(errors="replace")
    if code is None or "timed out after" in text:
        outcome, why = "hung", "timed out" if code is None else _first_error(text)
    elif code != 0:
        outcome, why = "failed", _first_error(text)
    else:
        outcome, why = "passed", ""
    return {
        "kind": kind,
        "recipe": recipe,
        "index": index,
        "outcome": outcome,
        "seconds": seconds,
        "why": why,
        "log": str(log.relative_to(ROOT)),
    }


def _first_error(text: str) -> str:
    match = FIRST_ERROR.search(text)
    lines = [line for line in text.splitlines() if line.strip()]
    return (match[0] if match else (lines[-1] if lines else "no output"))[:300]


def one(kind: str, recipe: str) -> int:
    """``--one``: the run itself, in this process: a script or a notebook, at 3 ranks."""
    with tempfile.TemporaryDirectory(prefix="dcp-stress-") as scratch, _store_for(recipe, scratch):
        runner = RecipeRunner(Path(scratch))
        os.environ["DCP_RECIPES_TIMEOUT"] = str(LAUNCH_DEADLINE_S)
        if kind == "script":
            result = runner.python(recipe, world_size=RANKS, timeout=RUN_DEADLINE_S)
            sys.stdout.write(result.stdout + result.stderr)
            return result.returncode
        runner.notebook(recipe, world_size=RANKS, timeout=RUN_DEADLINE_S)
        print(f"{recipe}.ipynb: every cell ran")
        return 0


@contextlib.contextmanager
def _store_for(recipe: str, scratch: str):
    """A SeaweedFS server with the page's bucket, ``AWS_*`` pointing at it, for an S3 page."""
    if recipe not in S3_RECIPES:
        yield
        return
    sys.path.insert(0, str(ROOT / "recipes_source"))
    from page_tools import object_store

    store = object_store.start(scratch, bucket="dcp-recipes")
    try:
        yield
    finally:
        object_store.stop(store)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=1)
    parser.add_argument("--repeat-hf", type=int, default=30)
    parser.add_argument("--only", help="comma-separated recipes (default: every page)")
    parser.add_argument("--no-notebooks", action="store_true")
    parser.add_argument("--one", nargs=2, metavar=("KIND", "RECIPE"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:
        return one(*args.one)

    recipes = args.only.split(",") if args.only else RECIPE_NAMES
    plan = [("script", name, 0) for name in recipes]
    for hf_recipe in HF_RECIPES:
        if hf_recipe in recipes:
            plan += [("script", hf_recipe, i) for i in range(1, args.repeat_hf)]
    if not args.no_notebooks:
        plan += [("notebook", name, 0) for name in recipes]
    OUT.mkdir(parents=True, exist_ok=True)
    for old in OUT.glob("*.log"):
        old.unlink()
    print(f"stress: {len(plan)} runs at {RANKS} ranks, {args.jobs} at a time", flush=True)
    start = time.monotonic()
    results = []
    with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
        for result in pool.map(lambda job: run_one(*job), plan):
            results.append(result)
            print(
                f"{result['outcome']:>6}  {result['seconds']:6.1f} s  {result['kind']:<8} "
                f"{result['recipe']} #{result['index']}  {result['why']}",
                flush=True,
            )
    counts = {o: sum(r["outcome"] == o for r in results) for o in ("passed", "failed", "hung")}
    summary = {
        "ranks": RANKS,
        "jobs": args.jobs,
        "runs": len(results),
        **counts,
        "seconds": round(time.monotonic() - start, 1),
        "cpus": os.cpu_count(),
        "results": results,
    }
    (OUT / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(
        f"stress: {summary['runs']} runs, {counts['passed']} passed, {counts['failed']} failed, "
        f"{counts['hung']} hung, in {summary['seconds']:.0f} s on {summary['cpus']} CPUs "
        f"({args.jobs} at a time); {OUT.relative_to(ROOT)}/summary.json"
    )
    return 0 if counts["passed"] == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
