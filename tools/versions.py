"""``make versions``: every recipe's download, run as a reader runs it, on each torch release.

For each torch version (``VERSIONS``, or ``--torch 2.15.0`` / ``make versions TORCH=2.15.0``
for one), a virtual environment outside the repository (``~/.cache/dcp-recipes/torch-X``, or
``$DCP_RECIPES_VERSIONS_CACHE``), made once and kept: that torch, and the recipes' other
packages at requirements.txt's pins. Then every page's script download
(``_build/html/_downloads/*/<recipe>.py``, which ``make html-noplot`` writes) runs alone in an
empty directory, ``python <recipe>.py`` (2 ranks on CPU), at low priority (``nice -n 19``),
and so does ``tools/version_checks/fresh_stager_per_save.py``, the workaround for the
stager reuse that fails on 2.11 and 2.12. Each run's outcome goes into
``_versions/results.json`` (committed): passed, or the first error line and where it came
from (the deepest frame of its traceback, and the recipe's own line), and its duration.
The site renders the cards' "runs on" lines and the page "PyTorch versions" from that file.

This machine's pip caps torch through a global constraints file (PIP_CONSTRAINT in pip's
configuration): each venv's pip calls get a constraints file of their own instead
(``PIP_CONSTRAINT=<venv>/constraints.txt``, which pins that torch), the global file stays.
On CI, ``PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu`` gives CPU wheels
(``X+cpu`` sorts above ``X`` and satisfies ``torch==X``).

It needs only python3: no Sphinx, no repository venv.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from dcp_site import (  # noqa: E402
    CHECKPOINT_KINDS,
    TORCH_VERSIONS,
    VERSION_RESULTS,
    VERSIONS_COMMAND,
    WORKAROUNDS,
    recipe_names,
)

DOWNLOADS = ROOT / "_build" / "html" / "_downloads"
CACHE = Path(os.environ.get("DCP_RECIPES_VERSIONS_CACHE", "~/.cache/dcp-recipes")).expanduser()
# The recipes' packages besides torch, at requirements.txt's pins; numpy has no line there
# (torch and transformers pull it in): the version .venv resolves to.
RUNTIME = ("torchdata", "transformers", "safetensors", "psutil", "torch-checkpointing")
# A pin that needs a newer torch than some releases is left out of their venvs: a page that
# imports it fails there, as it does for a reader on that release.
MIN_TORCH = {"torch-checkpointing": (2, 11)}  # its own Requires-Dist: torch>=2.11.0
EXTRA_PINS = {"numpy": "2.4.6"}
FREE_GB_NEEDED = 8  # a CUDA build of torch and its libraries take 5-6 GB
RECIPE_TIMEOUT = 900  # seconds, one recipe's whole run (its launches have 300 s each)
FORCE = False  # --force: measure the checkpoint pairs already in the results again


def pins(version: str | None = None) -> list[str]:
    """requirements.txt's pins of the packages the recipes import at run time, for the venv
    of torch ``version`` (None: every pin)."""
    release = tuple(int(part) for part in version.split(".")[:2]) if version else None
    found = {}
    for line in (ROOT / "requirements.txt").read_text().splitlines():
        match = re.match(r"^([A-Za-z0-9_.-]+)==(\S+)", line.strip())
        if match and match.group(1).lower() in RUNTIME:
            found[match.group(1).lower()] = match.group(2)
    missing = set(RUNTIME) - set(found)
    if missing:
        raise SystemExit(f"versions: requirements.txt pins none of {sorted(missing)}")
    if release is not None:
        found = {name: pin for name, pin in found.items() if release >= MIN_TORCH.get(name, ())}
    return [f"{name}=={pin}" for name, pin in {**found, **EXTRA_PINS}.items()]


def gigabytes(path: Path) -> float:
    total = sum(p.lstat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())
    return round(total / 1e9, 2)


def venv_for(version: str) -> tuple[Path, dict]:
    """The venv of one torch version, made if it is not there yet; with what it took."""
    venv = CACHE / f"torch-{version}"
    ready = venv / "dcp-recipes-ready.json"
    wanted = [f"torch=={version}"] + pins(version)
    if ready.exists():
        made = json.loads(ready.read_text())
        if made.get("requirements") == wanted:
            return venv, made
    free = shutil.disk_usage(CACHE.parent if not CACHE.exists() else CACHE).free / 1e9
    if free < FREE_GB_NEEDED:
        raise SystemExit(f"versions: {free:.1f} GB free, torch {version} needs ~6: not made")
    print(f"versions: making {venv} (torch {version}; {free:.0f} GB free)", flush=True)
    start = time.monotonic()
    venv.parent.mkdir(parents=True, exist_ok=True)
    if not (venv / "bin" / "python").exists():  # else pip completes what an earlier run began
        shutil.rmtree(venv, ignore_errors=True)
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    constraints = venv / "constraints.txt"
    constraints.write_text(f"torch=={version}\n")
    # This venv's pip calls only: its own constraints in place of the machine's global cap.
    env = dict(os.environ, PIP_CONSTRAINT=str(constraints), PIP_NO_CACHE_DIR="1")
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    subprocess.run(
        ["nice", "-n", "19", str(venv / "bin" / "python"), "-m", "pip", "install", "-q"] + wanted,
        check=True,
        env=env,
    )
    probe = subprocess.run(
        [str(venv / "bin" / "python"), "-c", "import torch; print(torch.__version__)"],
        capture_output=True,
        text=True,
        check=True,
    )
    made = {
        "requirements": wanted,
        "torch": probe.stdout.strip(),
        "setup_seconds": round(time.monotonic() - start),
        "venv_gb": gigabytes(venv),
    }
    ready.write_text(json.dumps(made, indent=1) + "\n")
    return venv, made


def download(stem: str) -> Path:
    found = sorted(DOWNLOADS.glob(f"*/{stem}.py"))
    if not found:
        raise SystemExit(f"versions: no download of {stem} in {DOWNLOADS}: make html-noplot")
    return found[0]


_FRAME = re.compile(r'^\s*File "([^"]+)", line (\d+), in (\S+)')
_LABEL = re.compile(r"^\[rank\d+\]:? ?")  # the launcher's and torch's own rank labels


def _short_path(path: str, script: str) -> str:
    if os.path.basename(path) == script:
        return script
    return path.split("site-packages/", 1)[-1]


def tracebacks(output: str, script: str) -> list[tuple[str, list[str], str]]:
    """(exception line, frames, the recipe's last frame) of every traceback in the output."""
    lines = [_LABEL.sub("", line) for line in output.splitlines()]
    found = []
    for i, line in enumerate(lines):
        if "Traceback (most recent call last):" not in line:
            continue
        frames, recipe_frame = [], ""
        for following in lines[i + 1 :]:
            frame = _FRAME.match(following)
            if frame:
                where = f"{_short_path(frame[1], script)}:{frame[2]} in {frame[3]}"
                frames.append(where)
                if where.startswith(script):
                    recipe_frame = where
            elif frames and following.strip() and not following[0].isspace():
                found.append((following.strip()[:300], frames, recipe_frame))
                break
    return found


# Exceptions that carry another one's traceback in their message: the launcher's, and DCP's
# CheckpointException (each failing rank's traceback follows it, "(RANK 0)").
WRAPPERS = ("RankFailedError", "CheckpointException")


def first_error(output: str, script: str) -> tuple[str, str, str]:
    """(first error line, where it came from, the recipe's line) of a failed run's output:
    the exception line that ends its first traceback, that traceback's deepest frame, and
    its last frame in the recipe itself. The launcher's own ``RankFailedError`` carries the
    failing rank's traceback in its message: that one comes first where there is one."""
    found = tracebacks(output, script)
    ranks = [t for t in found if not t[0].split(":")[0].endswith(WRAPPERS)]
    if ranks or found:
        error, frames, recipe_frame = (ranks or found)[0]
        return error, frames[-1], recipe_frame
    tail = [line.strip() for line in output.splitlines() if line.strip()]
    return (tail[-1][:300] if tail else "no output"), "", ""


def snapshot_downloads(recipes: list[str], into: Path) -> dict[str, Path]:
    """Copies of the downloads, taken once: a build running meanwhile rewrites them (Sphinx
    copies the gallery's file, then dcp_site writes the launcher in)."""
    copies = {}
    for stem in recipes:
        text = download(stem).read_text()
        if re.search(r"^\s*(from|import) page_tools", text, re.M):
            raise SystemExit(f"versions: {stem}'s download is not a finished one: make html-noplot")
        copies[stem] = into / f"{stem}.py"
        copies[stem].write_text(text)
    return copies


LOGS = ROOT / "_build" / "versions"  # each run's whole output, torch-X/<recipe>.log


def run_in_session(command: list[str], timeout: int, **popen: Any) -> tuple:
    """Run ``command`` in a session of its own; at ``timeout`` its whole process group (a
    script's ranks too) is killed. Returns (returncode, stdout, stderr, timed out)."""
    popen.setdefault("stderr", subprocess.PIPE)
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, text=True, start_new_session=True, **popen
    )
    try:
        stdout, stderr = process.communicate(timeout=timeout)
        timed_out = False
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        stdout, stderr = process.communicate()
        timed_out = True
    return process.returncode, stdout, stderr or "", timed_out


def run_script(python: Path, script: Path, timeout: int, log: Path | None = None) -> dict:
    """Run one download alone in an empty directory; passed, or its first error."""
    with tempfile.TemporaryDirectory(prefix="dcp-versions-") as scratch:
        local = Path(scratch, script.name)
        shutil.copyfile(script, local)
        env = {k: v for k, v in os.environ.items() if not k.startswith("DCP_RECIPES_")}
        env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", TMPDIR=scratch)
        env.pop("PYTHONPATH", None)
        start = time.monotonic()
        command = ["nice", "-n", "19", str(python), local.name]
        returncode, output, _, timed_out = run_in_session(
            command, timeout, cwd=scratch, env=env, stderr=subprocess.STDOUT
        )
        seconds = round(time.monotonic() - start, 1)
    if log is not None:
        log.parent.mkdir(parents=True, exist_ok=True)
        log.write_text(output)
    result = {"status": "passed" if returncode == 0 else "failed", "seconds": seconds}
    if timed_out:
        result.update(status="failed", error=f"timed out after {timeout} s", where="")
    elif returncode != 0:
        error, where, recipe_line = first_error(output, script.name)
        result.update(error=error, where=where, recipe_line=recipe_line)
        result["exit_code"] = returncode
    printed = [line for line in output.splitlines() if line.strip()]
    result["last_lines"] = printed[-3:]
    return result


def load_results() -> dict:
    path = ROOT / VERSION_RESULTS
    return json.loads(path.read_text()) if path.exists() else {"versions": {}}


def save_results(key: str, version: str | None, value: dict) -> None:
    """Write one release's entry (or the checkpoints table) into the file as it is now:
    another ``make versions`` may have written other entries meanwhile."""
    path = ROOT / VERSION_RESULTS
    results = load_results()
    if version is None:
        results[key] = value
    else:
        results.setdefault(key, {})[version] = value
    results["command"] = VERSIONS_COMMAND
    for name in ("versions", *(about["key"] for about in CHECKPOINT_KINDS.values())):
        if name in results:
            order = sorted(results[name].items(), key=lambda kv: TORCH_VERSIONS.index(kv[0]))
            results[name] = dict(order)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=1) + "\n")


def machine() -> str:
    return f"{platform.machine()} CPU, {os.cpu_count()} cores, {platform.system()}, no GPU used"


def measure(version: str, downloads: dict[str, Path], timeout: int) -> None:
    venv, made = venv_for(version)
    python = venv / "bin" / "python"
    entry = load_results().get("versions", {}).get(version, {})
    entry.update(
        torch=made["torch"],
        python=platform.python_version(),
        machine=machine(),
        date=datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        venv_gb=made["venv_gb"],
        setup_seconds=made["setup_seconds"],
    )
    entry.setdefault("recipes", {})
    entry.setdefault("workarounds", {})
    start = time.monotonic()
    for stem, script in downloads.items():
        outcome = run_script(python, script, timeout, LOGS / f"torch-{version}" / f"{stem}.log")
        entry["recipes"][stem] = outcome
        said = outcome.get("error", "")
        print(
            f"versions: torch {version} {stem}: {outcome['status']} {outcome['seconds']} s {said}"
        )
        save_results("versions", version, entry)
    for name, script in WORKAROUNDS.items():
        log = LOGS / f"torch-{version}" / f"{name}.log"
        outcome = run_script(python, ROOT / script["script"], timeout, log)
        entry["workarounds"][name] = outcome
        print(f"versions: torch {version} workaround {name}: {outcome['status']}")
    entry["run_seconds"] = round(time.monotonic() - start)
    save_results("versions", version, entry)


def reparse() -> None:
    """Each recorded failure's first line and place, read again from its run's log (after a
    change to ``first_error``), without running anything."""
    results = load_results()
    for version, entry in results.get("versions", {}).items():
        for kind in ("recipes", "workarounds"):
            for name, outcome in entry.get(kind, {}).items():
                log = LOGS / f"torch-{version}" / f"{name}.log"
                if (
                    outcome["status"] == "failed"
                    and log.exists()
                    and "timed out" not in outcome["error"]
                ):
                    script = (
                        f"{name}.py"
                        if kind == "recipes"
                        else Path(WORKAROUNDS[name]["script"]).name
                    )
                    error, where, recipe_line = first_error(log.read_text(), script)
                    outcome.update(error=error, where=where, recipe_line=recipe_line)
        save_results("versions", version, entry)
    for kind, about in CHECKPOINT_KINDS.items():
        table = results.get(about["key"], {})
        for by, row in table.items():
            for field, label in (("loaded_by", "loaded-by"), (about["via"], "via-loaded-by")):
                for version, outcome in row.get(field, {}).items():
                    log = LOGS / "checkpoints" / cross_log(kind, f"{by}-{label}-{version}")
                    if outcome["status"] == "failed" and log.exists():
                        error, where, _ = first_error(log.read_text(), CROSS_SCRIPT.name)
                        outcome.update(error=error, where=where)
        save_results(about["key"], None, table)


def cross_log(kind: str, name: str) -> str:
    """A cross-version run's log name: the plain kind's as before, the others prefixed."""
    if kind == "model":
        return f"{name.replace('via-loaded-by', 'torch-save-loaded-by')}.log"
    return f"{kind}-{name}.log"


CROSS_SCRIPT = ROOT / "tools" / "version_checks" / "cross_version.py"


def cross_versions(versions: list[str], timeout: int, kinds: list[str]) -> None:
    """Save a checkpoint of each kind with each release's venv, load each one with every
    release's venv (``CHECKPOINT_KINDS``: a plain model and optimizer, the same sharded on 2
    ranks, a Hugging Face safetensors export).

    The checkpoints stay beside the venvs (``<cache>/checkpoints/[kind/]by-X``), and a pair
    already in the results is not measured again: a release added later costs its own row
    and column only. ``--force`` measures every pair again."""
    ready = [v for v in versions if (CACHE / f"torch-{v}" / "dcp-recipes-ready.json").exists()]
    for kind in kinds:
        cross_kind(kind, ready, timeout)


def cross_kind(kind: str, ready: list[str], timeout: int) -> None:
    about = CHECKPOINT_KINDS[kind]
    key, via = about["key"], about["via"]
    table = load_results().get(key, {})
    store = CACHE / "checkpoints" / ("" if kind == "model" else kind)

    def python(version: str) -> Path:
        return CACHE / f"torch-{version}" / "bin" / "python"

    def checkpoint(version: str) -> Path:
        return store / f"by-{version}"

    def run(version: str, args: list, name: str) -> dict:
        log = LOGS / "checkpoints" / cross_log(kind, name)
        return run_cross(python(version), [f"--kind={kind}", *args], timeout, log)

    def record() -> None:
        save_results(key, None, table)

    for version in ready:
        if table.get(version, {}).get("saved", {}).get("status") == "passed" and (
            checkpoint(version).exists() and not FORCE
        ):
            continue
        shutil.rmtree(checkpoint(version), ignore_errors=True)
        outcome = run(version, ["save", checkpoint(version)], f"save-{version}")
        # The pairs measured before stay: the same script saves the same values each time.
        table.setdefault(version, {})["saved"] = outcome
        print(f"versions: {kind} checkpoint saved by torch {version}: {outcome['status']}")
        record()
    saved = [v for v in ready if table.get(v, {}).get("saved", {}).get("status") == "passed"]
    for by in saved:
        for version in ready:
            if version in table[by].get("loaded_by", {}) and not FORCE:
                continue
            outcome = run(version, ["load", checkpoint(by)], f"{by}-loaded-by-{version}")
            table[by].setdefault("loaded_by", {})[version] = outcome
            said = outcome.get("error", "")
            print(
                f"versions: {kind} saved by {by}, loaded by {version}: {outcome['status']} {said}"
            )
            record()
    # The way through where a load failed (about["way"]): the saving release converts the
    # checkpoint to one torch.save file (dcp_to_torch_save), the other loads that with
    # torch.load; an export's safetensors files are read without DCP.
    for by in saved:
        loads = table[by].get("loaded_by", {})
        failed = [v for v, o in loads.items() if o["status"] != "passed" and v in ready]
        failed = [v for v in failed if v not in table[by].get(via, {}) or FORCE]
        if not failed:
            continue
        source, converting = checkpoint(by), {"status": "passed"}
        if about["convert"]:
            source = store / f"by-{by}.pt"
            converting = run(by, ["convert", checkpoint(by), source], f"convert-{by}")
        for version in failed:
            outcome = converting
            if converting["status"] == "passed":
                outcome = run(version, [about["via_mode"], source], f"{by}-via-loaded-by-{version}")
            table[by].setdefault(via, {})[version] = outcome
            print(
                f"versions: {kind} saved by {by}, {about['way']} by {version}: {outcome['status']}"
            )
            record()


def run_cross(python: Path, args: list, timeout: int, log: Path) -> dict:
    """One cross_version.py run (its 2 ranks too), killed with its process group at timeout."""
    start = time.monotonic()
    returncode, stdout, stderr, timed_out = run_in_session(
        ["nice", "-n", "19", str(python), str(CROSS_SCRIPT), *map(str, args)],
        timeout,
        env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
    )
    output = stdout + stderr
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text(output)
    outcome = {
        "status": "passed" if returncode == 0 and not timed_out else "failed",
        "seconds": round(time.monotonic() - start, 1),
    }
    if timed_out:
        outcome.update(error=f"timed out after {timeout} s", where="")
    elif returncode != 0:
        error, where, _ = first_error(output, CROSS_SCRIPT.name)
        outcome.update(error=error, where=where)
    outcome["last_lines"] = [line for line in stdout.splitlines() if line.strip()][-1:]
    return outcome


FIXTURE = ROOT / "recipes_source" / "cross_version_fixture"  # the page's, committed
FIXTURE_TORCH = "2.15.0"


def make_fixture(timeout: int) -> None:
    """The cross-version page's fixture: the plain kind's checkpoint as torch 2.15.0 saves it
    (``cross_version.py save``) and its ``dcp_to_torch_save`` file written by 2.15.0
    (``convert``), a few KB, which the page loads on the torch it is built with."""
    venv, made = venv_for(FIXTURE_TORCH)
    python = venv / "bin" / "python"
    saved = FIXTURE / f"saved-by-torch-{FIXTURE_TORCH}"
    converted = FIXTURE / f"saved-by-torch-{FIXTURE_TORCH}.pt"
    shutil.rmtree(saved, ignore_errors=True)
    converted.unlink(missing_ok=True)
    for args in (["save", saved], ["convert", saved, converted]):
        log = LOGS / "checkpoints" / f"fixture-{args[0]}.log"
        outcome = run_cross(python, args, timeout, log)
        if outcome["status"] != "passed":
            raise SystemExit(f"versions: fixture {args[0]} failed: {outcome['error']}")
        print(f"versions: fixture {args[0]}: {outcome['last_lines']}")
    about = {
        "torch": made["torch"],
        "made_by": "python3 tools/versions.py --fixture (tools/version_checks/cross_version.py)",
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "files": {
            str(p.relative_to(FIXTURE)): p.stat().st_size
            for p in sorted(FIXTURE.rglob("*"))
            if p.is_file() and p.name != "made.json"
        },
    }
    (FIXTURE / "made.json").write_text(json.dumps(about, indent=1) + "\n")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--torch", help="one version (default: all of them)")
    parser.add_argument("--recipes", help="comma-separated recipe names (default: all)")
    parser.add_argument("--timeout", type=int, default=RECIPE_TIMEOUT)
    parser.add_argument("--setup-only", action="store_true", help="make the venvs, run nothing")
    parser.add_argument(
        "--cross", action="store_true", help="only checkpoints across the releases with a venv"
    )
    parser.add_argument("--force", action="store_true", help="--cross: every pair again")
    parser.add_argument(
        "--kinds",
        default=",".join(CHECKPOINT_KINDS),
        help=f"--cross: comma-separated, of {','.join(CHECKPOINT_KINDS)} (default: all)",
    )
    parser.add_argument(
        "--reparse", action="store_true", help="read each failure's first error from its log again"
    )
    parser.add_argument(
        "--fixture", action="store_true", help=f"the page's checkpoint saved by {FIXTURE_TORCH}"
    )
    args = parser.parse_args()
    if args.fixture:
        make_fixture(args.timeout)
        return 0
    versions = [args.torch] if args.torch else list(TORCH_VERSIONS)
    unknown = set(versions) - set(TORCH_VERSIONS)
    if unknown:
        raise SystemExit(f"versions: {sorted(unknown)} not in {TORCH_VERSIONS} (dcp_site.py)")
    if args.reparse:
        reparse()
        return 0
    if args.cross:
        global FORCE
        FORCE = args.force
        kinds = args.kinds.split(",")
        unknown = set(kinds) - set(CHECKPOINT_KINDS)
        if unknown:
            raise SystemExit(f"versions: no checkpoint kind {sorted(unknown)}: {CHECKPOINT_KINDS}")
        cross_versions(versions, args.timeout, kinds)
        return 0
    recipes = args.recipes.split(",") if args.recipes else recipe_names(ROOT)
    with tempfile.TemporaryDirectory(prefix="dcp-versions-downloads-") as scratch:
        downloads = snapshot_downloads(recipes, Path(scratch))
        for version in versions:
            if args.setup_only:
                print(venv_for(version))
                continue
            measure(version, downloads, args.timeout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
