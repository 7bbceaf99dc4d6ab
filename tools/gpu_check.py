"""``make gpu-check``: run every recipe as a plain script on this machine's GPUs.

Each recipe runs as ``python recipes_source/<recipe>.py`` with one rank per GPU
(``DCP_RECIPES_WORLD_SIZE`` to use fewer), with the python that runs this tool:
the one that has torch on this machine (``make gpu-check PY=/usr/bin/python3``).
It needs no Sphinx. It writes ``_build/gpu-check/``: one ``<recipe>.log`` with
each recipe's full output, each recipe's results file (``results/<recipe>.json``:
every claim the page decided, and what it measured) and one ``summary.json``
(each recipe's status, seconds and exit status, its claims by outcome and its
``headline`` numbers, the torch version, the GPUs and their driver), and prints
one line per recipe at the end. It exits non-zero if any recipe failed.

The recipes come from ``dcp_site.RECIPE_ORDER``, then any
``recipes_source/*_recipe.py`` or ``*_benchmark.py`` not in it yet. A recipe
that imports a module this python lacks is skipped and says which module.

Without a GPU it refuses, with a one-line reason: a CPU run is not a GPU check.
``--allow-cpu`` is a CPU dry run for the tool's own tests, marked as such in
the summary. ``--assume-gpus N`` (only with ``--allow-cpu``, hidden) lets those
tests check the world-size rule on a machine without GPUs.

``--recipes a,b`` selects recipes, ``--timeout S`` bounds each (default 300),
``--budget S`` the whole run (recipes after it is spent are reported, not run),
``--fail-on-skip`` fails a recipe skipped for a missing module (CI, where all are installed).

While a recipe runs, nvidia-smi is asked every half second which compute processes use
which GPU; those of the recipe's session (its ranks, DCP's checkpoint processes) are kept:
each recipe's ``gpus`` in the summary lists every process and the GPUs it touched, and the
table and the summary's ``gpu_flags`` flag a process that touched more than one GPU and a
GPU that more processes used at once than there are ranks. Without nvidia-smi, a recipe's
``gpus`` says "not measured (no nvidia-smi)".

Where the torch under test cannot reuse a ``DefaultStager`` (torch 2.11 raises at a
reused stager's second save, a bug 2.13 does not have), the recipes run with the
backport in ``tools/torch_backports/``, and the summary and the first lines say so.

Exit status: 0 every selected recipe passed or was skipped; 1 a recipe failed;
2 nothing ran (no GPU, too many ranks, no torch, an unknown recipe).
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import datetime
import importlib.util
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
import dcp_site  # noqa: E402  (importable without Sphinx: the one list of recipes)

RECIPES_DIR = ROOT / dcp_site.SOURCE_DIR
DEFAULT_OUT = ROOT / "_build" / "gpu-check"
DEFAULT_TIMEOUT_S = 300.0
WORLD_SIZE_ENV = "DCP_RECIPES_WORLD_SIZE"
RECIPE_GLOBS = ("*_recipe.py", "*_benchmark.py")
NOT_RECIPES = frozenset({"rank_launcher.py"})
NOT_RECIPE_DATA = frozenset({"page_tools", "__pycache__"})  # the page package is on PYTHONPATH
SUMMARY_JSON = "summary.json"
RESULTS_SUBDIR = "results"  # each recipe's results file (page_tools.results), by stem
RESULTS_DIR_ENV = dcp_site.RESULTS_DIR_ENV
DRY_RUN_DEVICE = "cpu (dry run)"
# torch's own per-user folders in TMPDIR are not a recipe's leftovers.
TORCH_OWN_TMP_DIRS = ("torchelastic_", "torchinductor_")
FAILED_LOG_LINES = 40
TORCHRUN_ENV = ("TORCHELASTIC_RUN_ID", "RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_PORT")
GPU_SAMPLE_INTERVAL_S = 0.5
NO_NVIDIA_SMI = "not measured (no nvidia-smi)"
COMPUTE_APPS_QUERY = ("--query-compute-apps=pid,gpu_uuid", "--format=csv,noheader")
GPU_INDEX_QUERY = ("--query-gpu=index,uuid", "--format=csv,noheader")

# Asked of the python that runs the recipes, in a child process: this tool never touches CUDA.
_PROBE = r"""
import json, torch
info = {"torch": torch.__version__, "cuda": torch.version.cuda, "gpus": 0, "names": [],
        "driver": None}
if torch.cuda.is_available():
    info["gpus"] = torch.cuda.device_count()
    info["names"] = [torch.cuda.get_device_name(i) for i in range(info["gpus"])]
    try:
        v = torch._C._cuda_getDriverVersion()
        info["driver"] = f"CUDA driver API {v // 1000}.{v % 1000 // 10} (from torch)"
    except Exception:
        pass
"""


# Whether a DefaultStager can be reused, as every recipe's loop does (CPU only, no CUDA).
_STAGER_REUSE = r"""
def stager_reuse():
    try:  # inside the probe too: an error here is the answer, not a probe that failed
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
        stager = DefaultStager(StagingOptions(False, False, False, False))
        for _ in range(2):
            stager.stage({"t": torch.zeros(1), "step": 1})
        stager.close()
        return "reuse works"
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
"""
_STAGER_REUSE_PROBE = "import torch\n" + _STAGER_REUSE + "print(stager_reuse())\n"
# The probe asks it too: one child, one `import torch` (seconds) fewer per run.
_PROBE += _STAGER_REUSE + 'info["stager_reuse"] = stager_reuse()\nprint(json.dumps(info))\n'
BACKPORTS_DIR = ROOT / "tools" / "torch_backports"


class GpuCheckError(Exception):
    """Nothing can run: the message is the one-line reason."""


# --------------------------------------------------------------------------
# Which recipes
# --------------------------------------------------------------------------


def all_recipes(recipes_dir: Path = RECIPES_DIR, order=dcp_site.RECIPE_ORDER) -> list[Path]:
    """RECIPE_ORDER first (listed files that are gone included: they fail), then new ones."""
    listed = [recipes_dir / name for name in order]
    new = sorted(
        {p for pattern in RECIPE_GLOBS for p in recipes_dir.glob(pattern)}
        - set(listed)
        - {recipes_dir / name for name in NOT_RECIPES}
    )
    return listed + new


def select_recipes(recipes: list[Path], wanted: str | None) -> list[Path]:
    """``--recipes a,b``: stems or file names of recipes, or paths to scripts (tests)."""
    if not wanted:
        return recipes
    by_name = {p.stem: p for p in recipes} | {p.name: p for p in recipes}
    chosen = []
    for name in (n.strip() for n in wanted.split(",")):
        if not name:
            continue
        if name in by_name:
            chosen.append(by_name[name])
        elif name.endswith(".py") and Path(name).is_file():
            chosen.append(Path(name).resolve())
        else:
            known = ", ".join(p.stem for p in recipes)
            raise GpuCheckError(f"--recipes: no recipe {name!r} (known: {known})")
    return chosen


# --------------------------------------------------------------------------
# The machine
# --------------------------------------------------------------------------


def probe_torch(python: str) -> dict:
    """torch's version and the GPUs it sees, asked of ``python`` in a child process."""
    try:
        done = subprocess.run(
            [python, "-c", _PROBE], capture_output=True, text=True, timeout=180, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise GpuCheckError(f"cannot ask {python} about torch: {exc}") from exc
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise GpuCheckError(
            f"{python} cannot import torch ({last}): run with a python that has torch, "
            "e.g. make gpu-check PY=/usr/bin/python3"
        )
    return json.loads(done.stdout.strip().splitlines()[-1])


def _pythonpath(env: dict, *first: Path) -> str:
    """PYTHONPATH with ``first`` ahead of what ``env`` already has there."""
    return os.pathsep.join(
        [str(p) for p in first] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
    )


def stager_reuse(python: str, pythonpath: tuple[Path, ...] = ()) -> str:
    """``reuse works``, or the error a reused DefaultStager raises at its second stage."""
    env = dict(os.environ, PYTHONPATH=_pythonpath(os.environ, *pythonpath))
    done = subprocess.run(
        [python, "-c", _STAGER_REUSE_PROBE],
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
        env=env,
    )
    lines = (done.stdout.strip() or done.stderr.strip() or "no output").splitlines()
    return lines[-1]


def torch_backports(python: str, torch_version: str, reuse: str | None = None) -> list[str]:
    """The backports the recipes need on this torch: a reused DefaultStager must work.

    torch 2.11 raises ``KeyError: <class 'type'>`` at a reused stager's second stage
    (see ``tools/torch_backports/sitecustomize.py``). Anything else is left to fail.
    ``reuse`` is what the probe found (``stager_reuse``'s answer), asked again if not given.
    """
    broken = reuse if reuse is not None else stager_reuse(python)
    if broken == "reuse works" or not broken.startswith("KeyError"):
        return []
    if stager_reuse(python, (BACKPORTS_DIR,)) != "reuse works":
        raise GpuCheckError(
            f"torch {torch_version}: a reused DefaultStager raises at its second stage "
            f"({broken}), and tools/torch_backports does not fix it on this torch"
        )
    return [
        f"{_shown(BACKPORTS_DIR)}: a reused DefaultStager keeps its buffers (torch "
        f"{torch_version} frees them after every copy, and its next stage raised {broken})"
    ]


def gpu_descriptions(probe: dict) -> tuple[list[dict], str]:
    """Each GPU's name and driver: nvidia-smi's where it is present, else torch's."""
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            done = subprocess.run(
                [smi, "--query-gpu=name,driver_version", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                timeout=60,
                check=True,
            )
            gpus = []
            for line in done.stdout.strip().splitlines():
                name, _, driver = line.rpartition(",")
                gpus.append({"name": name.strip(), "driver": driver.strip()})
            if gpus:
                return gpus, "nvidia-smi"
        except (OSError, subprocess.SubprocessError):
            pass
    return [{"name": n, "driver": probe.get("driver")} for n in probe["names"]], "torch"


def plan_world_size(gpus: int | None, requested: str | None) -> int:
    """Ranks per recipe: one per GPU, or ``DCP_RECIPES_WORLD_SIZE``, never more than the GPUs.

    ``gpus`` is None only in a CPU dry run, where any positive size goes (default 1).
    """
    if requested is None or requested.strip() == "":
        return 1 if gpus is None else gpus
    try:
        size = int(requested)
    except ValueError:
        size = 0
    if size < 1:
        raise GpuCheckError(f"{WORLD_SIZE_ENV} must be a positive integer, got {requested!r}")
    if gpus is not None and size > gpus:
        raise GpuCheckError(
            f"{WORLD_SIZE_ENV}={size} asks for more ranks than this machine has GPUs ({gpus}): "
            "NCCL needs one GPU per rank"
        )
    return size


# --------------------------------------------------------------------------
# Which GPUs a recipe's processes touched (nvidia-smi, sampled while it runs)
# --------------------------------------------------------------------------


def parse_gpu_indices(text: str) -> dict[str, int]:
    """``nvidia-smi --query-gpu=index,uuid --format=csv,noheader``: {uuid: index}."""
    indices = {}
    for line in text.splitlines():
        index, _, uuid = (part.strip() for part in line.partition(","))
        if index.isdigit() and uuid:
            indices[uuid] = int(index)
    return indices


def parse_compute_apps(text: str) -> list[tuple[int, str]]:
    """``nvidia-smi --query-compute-apps=pid,gpu_uuid --format=csv,noheader``: (pid, uuid)
    pairs; lines that name no process ("No running processes found", "[N/A]") are skipped."""
    apps = []
    for line in text.splitlines():
        pid, _, uuid = (part.strip() for part in line.partition(","))
        if pid.isdigit() and uuid and not uuid.startswith("["):
            apps.append((int(pid), uuid))
    return apps


def in_session(pid: int, session: int) -> bool:
    """Whether ``pid`` is in the process group or the session ``session`` leads (a recipe
    runs in a session of its own: its ranks and DCP's checkpoint processes are in it)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return False
    return session in (int(fields[2]), int(fields[3]))


def _command(pid: int) -> str:
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return "?"
    words = [a.decode(errors="replace") for a in argv if a]
    shown = " ".join([Path(words[0]).name, *words[1:]] if words else [])
    return shown if len(shown) <= 60 else shown[:57] + "..."


def gpu_usage(
    seen: dict[int, set[int | str]],
    at_once: dict[int | str, int],
    world_size: int,
    samples: int,
    commands: dict[int, str] | None = None,
    others: int = 0,
    errors: int = 0,
) -> dict:
    """A recipe's ``gpus`` entry: each process and the GPUs it touched, per GPU how many
    processes touched it (and most at one sample), and the flags: a process on more than one
    GPU, a GPU with more processes at once than there are ranks."""
    commands = commands or {}
    processes = [
        {"pid": pid, "gpus": sorted(gpus, key=str), "command": commands.get(pid, "?")}
        for pid, gpus in sorted(seen.items())
    ]
    by_gpu: dict[str, dict] = {}
    for process in processes:
        for gpu in process["gpus"]:
            entry = by_gpu.setdefault(str(gpu), {"processes": 0, "most_at_once": 0})
            entry["processes"] += 1
    for gpu, most in at_once.items():
        by_gpu.setdefault(str(gpu), {"processes": 0, "most_at_once": 0})["most_at_once"] = most
    flags = [
        f"pid {p['pid']} ({p['command']}) touched GPUs {', '.join(map(str, p['gpus']))}"
        for p in processes
        if len(p["gpus"]) > 1
    ]
    flags += [
        f"GPU {gpu}: {entry['most_at_once']} processes at once, more than the {world_size} rank(s)"
        for gpu, entry in sorted(by_gpu.items())
        if entry["most_at_once"] > world_size
    ]
    return {
        "measured": True,
        "samples": samples,
        "sample_errors": errors,
        "processes": processes,
        "by_gpu": dict(sorted(by_gpu.items())),
        "other_pids_seen": others,
        "flags": flags,
    }


def gpu_text(usage: dict | None) -> str:
    """A recipe's ``gpus`` as the table shows it."""
    if usage is None:
        return ""
    if not usage.get("measured"):
        return f"GPUs: {usage['reason']}"
    if not usage["processes"]:
        others = usage["other_pids_seen"]
        return "GPUs: no process of the recipe seen" + (
            f" ({others} other pid(s) seen: another PID namespace?)" if others else ""
        )
    per_gpu = ", ".join(
        f"{gpu}: {entry['processes']} ({entry['most_at_once']} at once)"
        for gpu, entry in usage["by_gpu"].items()
    )
    text = f"GPUs: {len(usage['processes'])} process(es); by GPU {per_gpu}"
    return text + "".join(f"; FLAG {flag}" for flag in usage["flags"])


class GpuSampler:
    """In a background thread, every ``interval`` s while the block runs: which GPUs the
    processes of ``session`` use, from ``nvidia-smi`` (``smi``; None: not measured)."""

    def __init__(self, smi: str | None, session: int, interval: float = GPU_SAMPLE_INTERVAL_S):
        self.smi, self.session, self.interval = smi, session, interval
        self.seen: dict[int, set[int | str]] = {}
        self.at_once: dict[int | str, int] = {}
        self.commands: dict[int, str] = {}
        self.others: set[int] = set()
        self.samples = self.errors = 0
        self.indices: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="gpu-sampler", daemon=True)

    def _query(self, *args: str) -> str | None:
        try:
            done = subprocess.run(
                [self.smi, *args], capture_output=True, text=True, timeout=10, check=False
            )
        except (OSError, subprocess.SubprocessError):
            return None
        return done.stdout if done.returncode == 0 else None

    def _index(self, uuid: str) -> int | str:
        if uuid not in self.indices:
            self.indices.update(parse_gpu_indices(self._query(*GPU_INDEX_QUERY) or ""))
        return self.indices.get(uuid, uuid)

    def sample(self) -> None:
        apps = self._query(*COMPUTE_APPS_QUERY)
        if apps is None:
            self.errors += 1
            return
        self.samples += 1
        now: dict[int | str, set[int]] = {}
        for pid, uuid in parse_compute_apps(apps):
            if not in_session(pid, self.session):
                self.others.add(pid)
                continue
            gpu = self._index(uuid)
            self.seen.setdefault(pid, set()).add(gpu)
            self.commands.setdefault(pid, _command(pid))
            now.setdefault(gpu, set()).add(pid)
        for gpu, pids in now.items():
            self.at_once[gpu] = max(self.at_once.get(gpu, 0), len(pids))

    def _run(self) -> None:
        while True:
            self.sample()
            if self._stop.wait(self.interval):
                return

    def __enter__(self) -> GpuSampler:
        if self.smi:
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=30)

    def usage(self, world_size: int) -> dict:
        if not self.smi:
            return {"measured": False, "reason": NO_NVIDIA_SMI}
        return gpu_usage(
            self.seen,
            self.at_once,
            world_size,
            self.samples,
            self.commands,
            len(self.others),
            self.errors,
        )


# --------------------------------------------------------------------------
# One recipe
# --------------------------------------------------------------------------


def _optional_imports(tree: ast.AST) -> set[int]:
    """ids of import nodes inside ``try: ... except ImportError`` (or broader): optional."""
    catching = {"ImportError", "ModuleNotFoundError", "Exception", "BaseException"}
    optional: set[int] = set()
    for node in ast.walk(tree):
        if not isinstance(node, ast.Try):
            continue
        names = set()
        for handler in node.handlers:
            kinds = handler.type
            elts = kinds.elts if isinstance(kinds, ast.Tuple) else [kinds]
            names |= {e.id if isinstance(e, ast.Name) else "BaseException" for e in elts if e}
            if kinds is None:
                names.add("BaseException")
        if names & catching:
            for stmt in node.body:
                optional |= {id(n) for n in ast.walk(stmt)}
    return optional


def missing_modules(path: Path) -> list[str]:
    """Top-level modules the script imports that this python cannot find (in source order)."""
    try:
        tree = ast.parse(path.read_text(), filename=str(path))
    except (OSError, SyntaxError):
        return []  # running it reports that
    optional = _optional_imports(tree)
    tops: list[str] = []
    for node in ast.walk(tree):
        if id(node) in optional:
            continue
        if isinstance(node, ast.Import):
            tops += [alias.name.split(".")[0] for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            tops.append(node.module.split(".")[0])
    missing = []
    for top in dict.fromkeys(tops):
        local = any(
            (where / f"{top}.py").exists() or (where / top / "__init__.py").exists()
            for where in (path.parent, RECIPES_DIR)
        )
        if not local and importlib.util.find_spec(top) is None:
            missing.append(top)
    return missing


_NO_MODULE = re.compile(r"ModuleNotFoundError: No module named '([\w.]+)'")


def missing_module_in_output(output: str) -> str | None:
    """The module a failed run could not import, when its whole package is absent here.

    A missing submodule of an installed package (``torch.distributed.foo``) is a
    real failure (an API this torch lacks), not a skip.
    """
    for match in _NO_MODULE.finditer(output):
        top = match.group(1).split(".")[0]
        if (RECIPES_DIR / f"{top}.py").exists():
            continue
        if importlib.util.find_spec(top) is None:
            return top
    return None


def read_results(results_dir: Path, stem: str) -> tuple[dict | None, dict]:
    """A recipe's ``headline`` value and the count of its claims by outcome, from the results
    file it wrote (``page_tools.results``); (None, {}) if it wrote none."""
    path = results_dir / f"{stem}.json"
    if not path.exists():
        return None, {}
    data = json.loads(path.read_text())
    outcomes = {"held": 0, "not measured": 0, "failed": 0}
    for claim in data.get("claims", {}).values():
        key = {True: "held", None: "not measured", False: "failed"}[claim["held"]]
        outcomes[key] += 1
    return data.get("values", {}).get("headline"), outcomes


def headline_text(headline: dict | None) -> str:
    """A headline as the table shows it: ``name value, ...``."""
    if not headline:
        return ""
    if not isinstance(headline, dict):
        return str(headline)
    shown = (f"{v:.3g}" if isinstance(v, float) else str(v) for v in headline.values())
    return ", ".join(f"{name} {value}" for name, value in zip(headline, shown, strict=True))


def _stop_group(proc: subprocess.Popen) -> None:
    """Stop the recipe and everything it started (its ranks, DCP's checkpoint process).

    SIGTERM first, so a recipe still running gets a chance to clean up; then SIGKILL to
    whatever is left of its process group.
    """
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=10)
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=10)


def _group_alive(pgid: int) -> bool:
    """Whether a process of the group still runs (exited ones awaiting their reaper don't)."""
    proc = Path("/proc")
    if not proc.is_dir():  # not Linux: any member, even one that has exited
        try:
            os.killpg(pgid, 0)
        except (ProcessLookupError, PermissionError):
            return False
        return True
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False


def _exit_reason(code: int) -> str:
    if code < 0:
        with_name = signal.Signals(-code).name if -code in signal.valid_signals() else -code
        return f"killed by signal {with_name}"
    return f"exit status {code}"


def recipe_data_dirs(recipes_dir: Path) -> list[Path]:
    """The folders beside the recipes that a page reads by a relative path (the cross-version
    page's checkpoint saved by torch 2.15.0): Sphinx-Gallery runs a page in the gallery's
    folder, and each recipe here runs in an empty one, with these linked into it."""
    return sorted(p for p in recipes_dir.iterdir() if p.is_dir() and p.name not in NOT_RECIPE_DATA)


def run_recipe(
    python: str,
    path: Path,
    world_size: int,
    timeout: float,
    out_dir: Path,
    dry_run: bool,
    timeout_flag: str = "--timeout",
    backports: bool = False,
) -> dict:
    """Run one recipe as a plain script; its output goes to ``out_dir/<stem>.log``.

    ``timeout_flag`` names the option that set ``timeout`` (``--budget`` when the
    run's total was what cut it short), for the reason a stopped recipe fails with.
    """
    stem = path.stem
    log_path = out_dir / f"{stem}.log"
    result = _new_result(path, out_dir)
    if not path.is_file():
        log_path.write_text(f"gpu-check: no such file {path}\n")
        result["reason"] = "no such file (listed in dcp_site.RECIPE_ORDER?)"
        return result
    missing = missing_modules(path)
    if missing:
        log_path.write_text(f"gpu-check: not run: {python} has no module {', '.join(missing)}\n")
        result.update(status="skipped", reason=f"missing module {', '.join(missing)}")
        return result

    scratch = Path(tempfile.mkdtemp(prefix=f"gpu-check-{stem}-"))
    tmp, cwd = scratch / "tmp", scratch / "cwd"
    tmp.mkdir()
    cwd.mkdir()
    linked = set()
    for folder in recipe_data_dirs(path.parent):  # read by a relative path, as in the gallery
        (cwd / folder.name).symlink_to(folder, target_is_directory=True)
        linked.add(folder.name)
    env = dict(os.environ)
    env.pop(dcp_site.STAMP_DIR_ENV, None)  # no run stamps: this is not the site build
    for name in TORCHRUN_ENV:  # a plain script: the launcher must not think torchrun started it
        env.pop(name, None)
    env.update(
        {
            WORLD_SIZE_ENV: str(world_size),
            "PYTHONUNBUFFERED": "1",
            "MPLBACKEND": "Agg",
            "TMPDIR": str(tmp),
            "PYTHONPATH": _pythonpath(env, *([BACKPORTS_DIR] if backports else []), RECIPES_DIR),
            RESULTS_DIR_ENV: str(out_dir / RESULTS_SUBDIR),
        }
    )
    if dry_run:
        env["CUDA_VISIBLE_DEVICES"] = ""
    start = time.monotonic()
    try:
        with open(log_path, "w") as log:
            proc = subprocess.Popen(
                [python, str(path)],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                cwd=cwd,
                start_new_session=True,  # its own process group: stopped as a whole
            )
            with GpuSampler(shutil.which("nvidia-smi"), proc.pid) as sampler:
                try:
                    code = proc.wait(timeout=timeout)
                    timed_out = False
                except subprocess.TimeoutExpired:
                    timed_out, code = True, None
                except BaseException:  # Ctrl-C, SIGTERM: its own session gets neither
                    _stop_group(proc)
                    raise
            result["gpus"] = sampler.usage(world_size)
            result["seconds"] = round(time.monotonic() - start, 2)
            stray = not timed_out and _group_alive(proc.pid)
            _stop_group(proc)
            if timed_out:
                code = proc.returncode
        output = log_path.read_text(errors="replace")
        result["exit_status"] = code
        result["headline"], result["claims"] = read_results(out_dir / RESULTS_SUBDIR, stem)
        result["leftovers"] = sorted(
            [f"TMPDIR/{p.name}" for p in tmp.iterdir() if not p.name.startswith(TORCH_OWN_TMP_DIRS)]
            + [f"cwd/{p.name}" for p in cwd.iterdir() if p.name not in linked]
            + (["processes still running after the recipe exited (stopped)"] if stray else [])
        )
        if timed_out:
            result["reason"] = f"timed out after {timeout:g} s ({timeout_flag})"
            with open(log_path, "a") as log:
                log.write(f"\ngpu-check: {result['reason']}: stopped\n")
        elif code == 0:
            result["status"] = "pass"
        elif module := missing_module_in_output(output):
            result.update(status="skipped", reason=f"missing module {module}")
        else:
            result["reason"] = _exit_reason(code)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return result


def _new_result(path: Path, out_dir: Path) -> dict:
    """A recipe's entry in summary.json, before it has passed."""
    return {
        "recipe": path.stem,
        "path": _shown(path),
        "status": "fail",
        "reason": None,
        "exit_status": None,
        "seconds": 0.0,
        "log": f"{path.stem}.log",
        "headline": None,
        "claims": {},
        "leftovers": [],
        "gpus": None,  # which GPUs its processes touched (GpuSampler); None: never started
    }


def _not_run(path: Path, out_dir: Path, reason: str) -> dict:
    (out_dir / f"{path.stem}.log").write_text(f"gpu-check: {reason}\n")
    return _new_result(path, out_dir) | {"status": "skipped", "reason": reason}


def _shown(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(ROOT))
    except ValueError:
        return str(path)


# --------------------------------------------------------------------------
# The run
# --------------------------------------------------------------------------


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def _clear_previous(out_dir: Path) -> None:
    """Remove the files an earlier run wrote (only those): no stale log passes for a new one."""
    out_dir.mkdir(parents=True, exist_ok=True)
    for old in [*out_dir.glob("*.log"), out_dir / SUMMARY_JSON]:
        old.unlink(missing_ok=True)
    shutil.rmtree(out_dir / RESULTS_SUBDIR, ignore_errors=True)


def _write_summary(out_dir: Path, summary: dict) -> None:
    path = out_dir / SUMMARY_JSON
    path.with_suffix(".tmp").write_text(json.dumps(summary, indent=1) + "\n")
    path.with_suffix(".tmp").replace(path)


def format_table(results: list[dict]) -> str:
    width = max([len("recipe")] + [len(r["recipe"]) for r in results])
    lines = [f"{'recipe':<{width}}  {'seconds':>8}  result"]
    for r in results:
        verdict = r["status"] + (f" ({r['reason']})" if r["reason"] else "")
        claims = r["claims"]
        extra = f"  | claims: {claims['held']} held" if claims else ""
        if claims.get("not measured"):
            extra += f", {claims['not measured']} not measured here"
        if claims.get("failed"):
            extra += f", {claims['failed']} FAILED"
        if r["headline"]:
            extra += f"  | {headline_text(r['headline'])}"
        if r.get("gpus"):
            extra += f"  | {gpu_text(r['gpus'])}"
        lines.append(f"{r['recipe']:<{width}}  {r['seconds']:8.1f}  {verdict}{extra}")
    total = sum(r["seconds"] for r in results)
    counts = {s: sum(r["status"] == s for r in results) for s in ("pass", "fail", "skipped")}
    lines.append(
        f"{'total':<{width}}  {total:8.1f}  "
        f"{counts['pass']} passed, {counts['fail']} failed, {counts['skipped']} skipped"
    )
    return "\n".join(lines)


def gpu_flags(results: list[dict]) -> list[str]:
    """Every recipe's GPU flags, as ``<recipe>: <flag>``."""
    return [
        f"{r['recipe']}: {flag}" for r in results for flag in (r.get("gpus") or {}).get("flags", [])
    ]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="gpu-check",
        description="Run every recipe as a plain script on this machine's GPUs (make gpu-check).",
    )
    parser.add_argument(
        "--recipes", help="comma-separated recipes to run (stems or file names); default: all"
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=DEFAULT_TIMEOUT_S,
        help=f"seconds each recipe may run before it is stopped (default {DEFAULT_TIMEOUT_S:g})",
    )
    parser.add_argument(
        "--budget",
        type=float,
        help="seconds for the whole run: a recipe gets at most what is left, and recipes "
        "after it is spent are not run (reported as skipped); default: no limit",
    )
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output folder")
    parser.add_argument("--list", action="store_true", help="print the recipes it would run")
    parser.add_argument(
        "--fail-on-skip", action="store_true", help="a recipe skipped for a missing module fails"
    )
    parser.add_argument(
        "--allow-cpu",
        action="store_true",
        help="CPU dry run, for this tool's own tests only: NOT a GPU check",
    )
    # Tests only: pretend this many GPUs for the world-size rule (needs --allow-cpu).
    parser.add_argument("--assume-gpus", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.assume_gpus is not None and not args.allow_cpu:
        parser.error("--assume-gpus is for the tool's tests and needs --allow-cpu")
    if args.timeout <= 0 or (args.budget is not None and args.budget <= 0):
        parser.error("--timeout and --budget must be positive")
    return args


def _exit_on_sigterm(signum: int, frame) -> None:
    # Raised inside the wait for a recipe: it stops the recipe's process group, which
    # (in its own session) gets no signal meant for this tool.
    sys.exit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    python = sys.executable
    try:
        recipes = select_recipes(all_recipes(), args.recipes)
        if args.list:
            print("\n".join(_shown(p) for p in recipes))
            return 0
        requested = os.environ.get(WORLD_SIZE_ENV)
        if args.allow_cpu:  # the GPU count is the tests' (--assume-gpus), or none
            world_size = plan_world_size(args.assume_gpus, requested)
        probe = probe_torch(python)
        if not args.allow_cpu:
            if probe["gpus"] == 0:
                raise GpuCheckError(
                    f"no CUDA GPU visible to {python} (torch {probe['torch']}): "
                    "this is not a GPU check"
                )
            world_size = plan_world_size(probe["gpus"], requested)
        backports = torch_backports(python, probe["torch"], probe.get("stager_reuse"))
    except GpuCheckError as exc:
        print(f"gpu-check: {exc}", file=sys.stderr)
        return 2

    if args.allow_cpu:
        device, gpus, driver_source = DRY_RUN_DEVICE, [], None
    else:
        gpus, driver_source = gpu_descriptions(probe)
        device = f"{probe['gpus']} x {' / '.join(dict.fromkeys(probe['names']))}"
    out_dir = args.out.resolve()
    _clear_previous(out_dir)
    summary = {
        "device": device,
        "dry_run": args.allow_cpu,
        "complete": False,
        "ok": None,
        "started": _now(),
        "finished": None,
        "host": platform.node(),
        "python": python,
        "python_version": platform.python_version(),
        "torch": probe["torch"],
        "torch_backports": backports,
        "cuda": probe["cuda"],
        "gpus": gpus,
        "gpu_info_from": driver_source,
        "world_size": world_size,
        "timeout_s": args.timeout,
        "budget_s": args.budget,
        "summary_pattern": "lines starting with '<recipe stem>: ' (after an optional [rankN])",
        "recipes": [],
        "totals": {},
        "gpu_flags": [],
    }
    print(
        f"gpu-check: {len(recipes)} recipe(s) on {device}, torch {probe['torch']}, "
        f"world size {world_size}, timeout {args.timeout:g} s each"
        + (f", {args.budget:g} s in all" if args.budget else "")
        + f", python {python}; "
        f"output in {_shown(out_dir)}",
        flush=True,
    )
    for backport in backports:
        print(f"gpu-check: with a backport, {backport}", flush=True)
    results = summary["recipes"]
    started = time.monotonic()
    for index, path in enumerate(recipes, 1):
        print(f"gpu-check: [{index}/{len(recipes)}] {path.stem} ...", flush=True)
        left = None if args.budget is None else args.budget - (time.monotonic() - started)
        if left is not None and left < 1:
            result = _not_run(path, out_dir, f"not run: the --budget of {args.budget:g} s is spent")
        else:
            timeout, flag = args.timeout, "--timeout"
            if left is not None and left < timeout:
                timeout, flag = round(left, 1), "--budget"
            result = run_recipe(
                python,
                path,
                world_size,
                timeout,
                out_dir,
                args.allow_cpu,
                timeout_flag=flag,
                backports=bool(backports),
            )
        if args.fail_on_skip and result["status"] == "skipped":
            result["status"] = "fail"
        results.append(result)
        verdict = result["status"] + (f" ({result['reason']})" if result["reason"] else "")
        print(f"gpu-check: [{index}/{len(recipes)}] {path.stem}: {verdict}, {result['seconds']} s")
        if result["status"] == "fail":
            tail = (out_dir / result["log"]).read_text(errors="replace").splitlines()
            print(f"----- last {FAILED_LOG_LINES} lines of {result['log']} -----")
            print("\n".join(tail[-FAILED_LOG_LINES:]))
            print("-----", flush=True)
        _write_summary(out_dir, summary)

    failed = [r["recipe"] for r in results if r["status"] == "fail"]
    summary["totals"] = {
        "pass": sum(r["status"] == "pass" for r in results),
        "fail": len(failed),
        "skipped": sum(r["status"] == "skipped" for r in results),
        "seconds": round(sum(r["seconds"] for r in results), 2),
    }
    summary["gpu_flags"] = gpu_flags(results)
    summary.update(complete=True, ok=not failed, finished=_now())
    _write_summary(out_dir, summary)
    print()
    print(format_table(results))
    for flag in summary["gpu_flags"]:
        print(f"gpu-check: GPU flag: {flag}")
    if args.allow_cpu:
        print("gpu-check: a CPU dry run (--allow-cpu): this was NOT a GPU check")
    return 1 if failed else 0


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    sys.exit(main())
