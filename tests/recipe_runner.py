"""Run a recipe the ways a reader would: its download under python, torchrun, two torchrun agents.

A reader downloads a page's script and runs it alone, so the tests do too: the
runner copies the file behind the page's "Download script" link, from the built
site, into an empty directory and runs it there, with no PYTHONPATH. That file
must be the recipe as it is now (the build wrote the launcher into it); a stale
build is an error that says how to rebuild.
"""

from __future__ import annotations

import ast
import functools
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import nbformat
import psutil
from bs4 import BeautifulSoup
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError
from page_tools.ports import free_port

from dcp_site import recipe_names, standalone_script

ROOT = Path(__file__).resolve().parents[1]
RECIPES = ROOT / "recipes_source"
HTML = ROOT / "_build" / "html"
# A hang inside a launch is reported by the launcher (with every rank's output) at its
# deadline, well before the test gives up on the whole run.
LAUNCH_DEADLINE_S = "240"
RECIPE_TIMEOUT_S = 600
CHECKPOINT_FILE = re.compile(r"\.distcp$|^\.metadata$|\.pt$")
TORCH_OWN_TMP_DIRS = ("torchelastic_", "torchinductor_")
# What an unintended problem looks like in a run's output.
TRACEBACK = "Traceback (most recent call last)"
# tqdm's warning in a kernel without ipywidgets (the Hugging Face pages import tqdm), and the
# source line Python prints under it: the kernel's environment, not the recipe's.
KERNEL_ONLY_WARNING = re.compile(
    r"^\S+/tqdm/auto\.py:\d+: TqdmWarning: IProgress not found\..*\n.*\n", re.M
)
WARNING_LINE = re.compile(r"\S+\.py:\d+: \w*Warning: ")

RECIPE_NAMES = recipe_names(ROOT)
RESULTS = ROOT / "recipes" / ".results"  # what each page measured and proved in the build


def build_results(name: str) -> dict:
    """The page's results file from the executed build (``page_tools.results``)."""
    path = RESULTS / f"{name}.json"
    assert path.exists(), f"no results of {name} from an executed build: run `make html` first"
    return json.loads(path.read_text())


def assert_listed_claims_held(name: str, claims: dict) -> None:
    """The build decided exactly the claims the page's manifest lists, and every one held."""
    from page_tools import results

    listed = results.manifest(name)["claims"]
    assert set(claims) == set(listed), sorted(set(claims) ^ set(listed))
    assert all(claims[claim]["held"] is True for claim in listed), claims


def parsed_html(path: Path) -> BeautifulSoup:
    """A built page, parsed once per test process while the file stays as it is: html.parser
    takes about 0.4 s for a recipe page here, and the tests read each page about ten times.
    The tests only read what it returns."""
    return _parsed_html(path.resolve(), path.stat().st_mtime_ns)


@functools.cache
def _parsed_html(path: Path, mtime_ns: int) -> BeautifulSoup:
    return BeautifulSoup(path.read_text(), "html.parser")


def page_outputs(name: str) -> list[str]:
    """The text of every output block on the built page, in order."""
    page = HTML / "recipes" / f"{name}.html"
    assert page.exists(), f"no built page for {name}: run `make html` first"
    doc = parsed_html(page)
    return [block.get_text() for block in doc.select("div.sphx-glr-script-out pre")]


def numbers_in(lines: str, pattern: str) -> list[str]:
    """Every match of ``pattern`` in ``lines``: the numbers a page and a run both print."""
    return re.findall(pattern, lines, re.M)


# What the getting-started page prints that a run of its code must print alike: every loss, and
# the size of each rank's checkpoint file.
SAVE_LOAD_NUMBERS = (r"^\[rank\d\] step \d: loss \d\.\d{4}$", r"^__\d_0\.distcp +[\d,]+ bytes$")


def assert_prints_what_the_page_shows(output: str, name: str, patterns: tuple[str, ...]) -> None:
    """A run of page ``name``'s code printed, for each pattern, the lines its built page shows
    (and at least one)."""
    shown = "".join(page_outputs(name))
    for pattern in patterns:
        assert numbers_in(output, pattern) == numbers_in(shown, pattern) != [], pattern


def recipe_path(name: str) -> Path:
    path = RECIPES / f"{name}.py"
    assert path.exists(), f"no recipe {path}"
    return path


def page_definitions(name: str, *wanted: str) -> dict:
    """Recipe ``name``'s imports (not of the site's own modules) and the ``wanted``
    definitions (functions, classes, constants), executed: their namespace."""
    body = [
        node
        for node in ast.parse(recipe_path(name).read_text()).body
        if isinstance(node, ast.Import | ast.ImportFrom)
        and getattr(node, "module", None) not in ("page_tools", "rank_launcher")
        or getattr(node, "name", None) in wanted
        or isinstance(node, ast.Assign)
        and any(getattr(t, "id", None) in wanted for t in node.targets)
    ]
    namespace: dict = {}
    exec(compile(ast.Module(body=body, type_ignores=[]), name, "exec"), namespace)
    return namespace


def page_download(name: str, suffix: str) -> Path:
    """The file behind a recipe page's download link (``.py`` or ``.ipynb``) in the built site."""
    page = HTML / "recipes" / f"{name}.html"
    assert page.exists(), f"no built page for {name}: run `make html-noplot` (or `make html`) first"
    links = parsed_html(page).select("div.dcp-page-links a[href]")
    hrefs = [a["href"] for a in links if a["href"].endswith(f"{name}{suffix}")]
    assert hrefs, f"{name}: the page has no {suffix} download link"
    return (page.parent / hrefs[0]).resolve()


def current_download(name: str) -> Path:
    """The page's script download, checked to be the recipe as it is now."""
    download = page_download(name, ".py")
    launcher = (RECIPES / "rank_launcher.py").read_text()
    expected = standalone_script(recipe_path(name).read_text(), launcher)
    assert download.read_text() == expected, (
        f"the site's download of {name}.py is older than recipes_source/{name}.py "
        "(or the launcher): run `make html-noplot` (or `make html`) first"
    )
    return download


class RecipeRunner:
    """Runs a recipe's download in an empty directory, with its own TMPDIR so leftovers show."""

    def __init__(self, tmp_path: Path, tmpdir: Path | None = None):
        # A unix socket's path holds at most 107 bytes, and multiprocessing puts its
        # listeners under TMPDIR: pytest's tmp_path (longer still under xdist) does not fit.
        self.tmpdir = tmpdir if tmpdir is not None else tmp_path / "tmp"
        self.tmpdir.mkdir(exist_ok=True)
        self.workdir = tmp_path / "download"  # where the downloaded script runs, alone
        self.results_dir = tmp_path / "results"  # a source run's results file
        self.workdir.mkdir()

    def env(self, **extra: str) -> dict[str, str]:
        env = dict(os.environ)
        for name in ("DCP_RECIPES_STAMP_DIR", "PYTHONPATH"):
            env.pop(name, None)
        env.update(TMPDIR=str(self.tmpdir), PYTHONUNBUFFERED="1")
        env.setdefault("DCP_RECIPES_TIMEOUT", LAUNCH_DEADLINE_S)
        env.update(extra)
        return env

    def downloaded(self, name: str) -> Path:
        """The page's script download, copied into the run's otherwise empty directory."""
        target = self.workdir / f"{name}.py"
        shutil.copyfile(current_download(name), target)
        return target

    def python(self, name: str, world_size: int = 2, timeout: float = RECIPE_TIMEOUT_S, **env: str):
        """``python <recipe>.py``: the download, alone in a directory, with the gallery launcher."""
        return self._run(
            [sys.executable, str(self.downloaded(name))],
            self.env(DCP_RECIPES_WORLD_SIZE=str(world_size), **env),
            timeout,
        )

    def torchrun(self, name: str, nproc: int = 2, timeout: float = RECIPE_TIMEOUT_S, **env: str):
        """``torchrun --standalone --nproc-per-node=N <recipe>.py``, on the download."""
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        cmd += [f"--nproc-per-node={nproc}", str(self.downloaded(name))]
        return self._run(cmd, self.env(**env), timeout)

    def torchrun_two_nodes(self, name: str, timeout: float = RECIPE_TIMEOUT_S, **env: str):
        """Two torchrun agents (``--nnodes=2``), one rank each, c10d rendezvous on 127.0.0.1."""
        port = free_port()
        script = self.downloaded(name)
        procs = []
        for node in range(2):
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2"]
            cmd += [
                "--nproc-per-node=1",
                "--rdzv-backend=c10d",
                f"--rdzv-endpoint=127.0.0.1:{port}",
            ]
            cmd += [f"--rdzv-id=test-{port}", f"--node-rank={node}", str(script)]
            procs.append(
                subprocess.Popen(
                    cmd,
                    env=self.env(**env),
                    cwd=self.workdir,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                )
            )
        results = []
        for proc in procs:
            try:
                out, _ = proc.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                for p in procs:
                    p.kill()
                raise
            results.append(subprocess.CompletedProcess(proc.args, proc.returncode, out, ""))
        return results

    def source(self, name: str, world_size: int = 2, timeout: float = RECIPE_TIMEOUT_S):
        """``python recipes_source/<recipe>.py``, with its page work, deciding its claims at
        ``world_size`` ranks (a size the build does not run); returns (run, results)."""
        results_dir = self.results_dir
        run = self._run(
            [sys.executable, str(recipe_path(name))],
            self.env(
                DCP_RECIPES_WORLD_SIZE=str(world_size),
                PYTHONPATH=str(RECIPES),
                DCP_RECIPES_RESULTS_DIR=str(results_dir),
            ),
            timeout,
        )
        path = results_dir / f"{name}.json"
        return run, (json.loads(path.read_text()) if path.exists() else {})

    def script(self, path, world_size: int = 2, timeout: float = RECIPE_TIMEOUT_S, **env: str):
        """``python <path>``: a test's own script; it imports the launcher from the repository."""
        return self._run(
            [sys.executable, str(path)],
            self.env(DCP_RECIPES_WORLD_SIZE=str(world_size), PYTHONPATH=str(RECIPES), **env),
            timeout,
        )

    def notebook(
        self, name: str, world_size: int = 2, timeout: float = RECIPE_TIMEOUT_S, **env: str
    ):
        """The page's notebook, alone in an empty directory, top to bottom in a Jupyter kernel.

        Returns the executed notebook; a failing cell raises ``CellExecutionError`` with the
        cell and its traceback. A hang in a launch is reported by the launcher, with each
        rank's output, at its deadline: before the cell's own timeout. ``env``: variables
        the kernel gets beyond the runner's own (an S3 endpoint, say).
        """
        notebook_path = self.workdir / f"{name}.ipynb"
        shutil.copyfile(page_download(name, ".ipynb"), notebook_path)
        notebook = nbformat.read(notebook_path, as_version=4)
        saved = dict(os.environ)
        os.environ.clear()
        os.environ.update(self.env(DCP_RECIPES_WORLD_SIZE=str(world_size), **env))  # the kernel's
        try:
            client = NotebookClient(
                notebook,
                timeout=timeout,
                kernel_name="python3",
                resources={"metadata": {"path": self.workdir}},
            )
            client.execute()
        finally:
            os.environ.clear()
            os.environ.update(saved)
        return notebook

    def notebook_run(
        self, name: str, world_size: int = 2, timeout: float = RECIPE_TIMEOUT_S, **env: str
    ):
        """The page's notebook run as ``python`` runs its script: what it printed, and its status.

        The script download and the notebook hold the same code (a site test says so), and
        both start their ranks through the same launcher: this run stands for both. The
        tests that call it are marked ``download`` (``make reruns``), but the getting-started
        page's; the script's other path, ``torchrun``, is each recipe module's test marked
        ``torchrun``.
        """
        args = [f"{name}.ipynb"]
        try:
            printed = KERNEL_ONLY_WARNING.sub(
                "", notebook_output(self.notebook(name, world_size, timeout, **env))
            )
        except CellExecutionError as error:
            return subprocess.CompletedProcess(args, 1, stdout=str(error), stderr="")
        return subprocess.CompletedProcess(args, 0, stdout=printed, stderr="")

    def _run(self, cmd: list[str], env: dict[str, str], timeout: float):
        return subprocess.run(
            cmd, env=env, cwd=self.workdir, capture_output=True, text=True, timeout=timeout
        )

    def leftovers(self) -> list[str]:
        """Files a run left in its TMPDIR or beside the script it ran.

        torch's own per-user folders are not ours: torchrun's logs
        (``torchelastic_*``) and the compile cache that importing torch._dynamo
        creates (``torchinductor_<user>``).
        """
        left = [p.name for p in self.tmpdir.iterdir() if not p.name.startswith(TORCH_OWN_TMP_DIRS)]
        left += [
            f"beside the script: {p.name}"
            for p in self.workdir.iterdir()
            if p.suffix not in (".py", ".ipynb")
        ]
        return sorted(left)

    def processes_left(self, grace_s: float = 5.0) -> list[str]:
        """Processes still running that a run started (they carry its private TMPDIR).

        Exiting ones get ``grace_s`` to finish exiting.
        """
        deadline = time.monotonic() + grace_s
        while True:
            left = []
            for process in psutil.process_iter(["pid", "cmdline", "status"]):
                try:
                    if process.pid == os.getpid() or process.info["status"] == psutil.STATUS_ZOMBIE:
                        continue
                    if process.environ().get("TMPDIR") == str(self.tmpdir):
                        left.append(f"{process.pid}: {' '.join(process.info['cmdline'] or [])}")
                except (psutil.Error, OSError):
                    continue
            if not left or time.monotonic() > deadline:
                return left
            time.sleep(0.2)


def assert_ok(result: subprocess.CompletedProcess) -> str:
    """The run exited 0; returns stdout+stderr for further checks."""
    output = (result.stdout or "") + (result.stderr or "")
    assert result.returncode == 0, f"exit {result.returncode}\n{output[-6000:]}"
    return output


def notebook_output(notebook) -> str:
    """What an executed notebook's code cells printed, in order."""
    code = [cell for cell in notebook.cells if cell.cell_type == "code"]
    assert all(cell.execution_count for cell in code), "every code cell ran"
    return "".join(output.get("text", "") for cell in code for output in cell.get("outputs", []))


def assert_no_traceback(output: str) -> None:
    """No traceback, stray warning or aborted rank in a run's output."""
    assert TRACEBACK not in output, f"a traceback in the output:\n{output[-4000:]}"
    assert not WARNING_LINE.search(output), f"a warning in the output:\n{output[-4000:]}"
    assert "terminate called" not in output, f"a rank aborted:\n{output[-4000:]}"


# Checkpoints the repository keeps on purpose: the cross-version page's, saved by torch 2.15.0
# (python3 tools/versions.py --fixture).
COMMITTED_CHECKPOINTS = RECIPES / "cross_version_fixture"


def checkpoint_files_in_repo() -> list[str]:
    """Checkpoint files anywhere in the working tree (the virtualenv and the committed
    fixture aside)."""
    found = []
    for dirpath, dirnames, filenames in os.walk(ROOT):
        dirnames[:] = [d for d in dirnames if d not in (".venv", ".git")]
        if Path(dirpath) == COMMITTED_CHECKPOINTS.parent:
            dirnames[:] = [d for d in dirnames if d != COMMITTED_CHECKPOINTS.name]
        found += [os.path.join(dirpath, f) for f in filenames if CHECKPOINT_FILE.search(f)]
    return found
