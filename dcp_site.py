"""The site's own Sphinx extension: the logic that conf.py only names.

* ``RecipeOrder``: the gallery lists recipes in reading order, not by file name;
  ``recipe_names()`` is the one list of recipes for the site, its tests and tools.
* The page header: under each recipe's title, the links a reader looks for
  (download the script, download the notebook, view the source) and the run
  stamp. While a recipe executes, the rank launcher writes where it ran
  (torch, device, backend, world size, date) into ``recipes/.run-stamps``. A
  stamp is deleted right before its recipe runs, so a page never shows a stale
  one, and a recipe selected to run that leaves no stamp fails the build.
* Downloads that run alone: the pages import ``rank_launcher`` from the
  repository; the build writes the launcher into each page's ``.py``,
  ``.ipynb`` and ``.zip`` download, so one downloaded file is enough.
* An offline head: the theme's third-party scripts, fonts and trackers removed.
"""

from __future__ import annotations

import ast
import copy
import hashlib
import importlib
import io
import json
import os
import re
import shutil
import sys
import zipfile
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # Sphinx is imported by Sphinx; tools that read RECIPE_ORDER run without it
    from sphinx.application import Sphinx

GALLERY_DIR = "recipes"
SOURCE_DIR = "recipes_source"
STAMP_SUBDIR = ".run-stamps"
STAMP_DIR_ENV = "DCP_RECIPES_STAMP_DIR"  # read by recipes_source/rank_launcher.py
RESULTS_SUBDIR = ".results"
RESULTS_DIR_ENV = "DCP_RECIPES_RESULTS_DIR"  # read by recipes_source/page_tools/results.py
LAUNCHER = "rank_launcher.py"
# Modules beside the recipes that a page imports for code a reader keeps (the launcher
# aside): each download holds the ones its page imports, as it holds the launcher.
SITE_MODULES = ("direct_io",)
PAGE_PACKAGE = "page_tools"  # the pages' measuring and proving code, left out of downloads

# The order a reader should take: basics and export, async, full overlap, resuming, loading
# part of a checkpoint or into a changed model, the pitfalls of overlap, the numbers.
RECIPE_ORDER = (
    "save_load_recipe.py",
    "hf_interop_recipe.py",
    "hf_import_recipe.py",
    "async_save_recipe.py",
    "torn_checkpoints_recipe.py",
    "verify_checkpoint_recipe.py",
    "default_stager_recipe.py",
    "stager_copies_recipe.py",
    "resume_recipe.py",
    "resume_fallback_recipe.py",
    "torchrun_restart_recipe.py",
    "partial_load_recipe.py",
    "change_parallelism_recipe.py",
    "cross_version_recipe.py",
    "staging_pitfalls_recipe.py",
    "stager_stream_recipe.py",
    "checkpoint_stall_benchmark.py",
    "save_load_speed_recipe.py",
    "object_storage_recipe.py",
    "object_storage_async_recipe.py",
    "torch_checkpointing_recipe.py",
)


def recipe_names(confdir: str | os.PathLike = Path(__file__).parent) -> list[str]:
    """Every recipe's file stem, in reading order: RECIPE_ORDER, then any others by name."""
    modules = {LAUNCHER, "__init__.py", *(f"{name}.py" for name in SITE_MODULES)}
    found = {p.name for p in Path(confdir, SOURCE_DIR).glob("*.py")} - modules
    ordered = [name for name in RECIPE_ORDER if name in found]
    return [Path(name).stem for name in ordered + sorted(found - set(ordered))]


class RecipeOrder:
    """Sort key for ``within_subsection_order``: RECIPE_ORDER first, then by name."""

    def __init__(self, src_dir: str):
        self.src_dir = src_dir

    def __call__(self, filename: str) -> tuple[int, str]:
        name = os.path.basename(filename)
        rank = RECIPE_ORDER.index(name) if name in RECIPE_ORDER else len(RECIPE_ORDER)
        return rank, name

    def __repr__(self) -> str:  # Sphinx-Gallery hashes the config through repr
        return f"<{self.__class__.__name__}>"


def stamp_dir(confdir: str | os.PathLike) -> Path:
    return Path(confdir) / GALLERY_DIR / STAMP_SUBDIR


def results_dir(confdir: str | os.PathLike) -> Path:
    """Where each executed page's results file goes (``page_tools.results``)."""
    return Path(confdir) / GALLERY_DIR / RESULTS_SUBDIR


# Files a recipe writes into its working directory for the reader to keep (as a download,
# beside the script; in the gallery, in recipes_source/): after the recipe runs in the build
# they move into the gallery, and its page header links them.
ARTIFACTS = {".trace.json": "Download the profiler trace"}


def reset_recipe_outputs(gallery_conf: dict, fname: str | None, when: str) -> None:
    """Sphinx-Gallery reset hook, before and after each recipe runs.

    Before: drop the recipe's stamp and artifacts of an earlier run, so a page
    never shows stale ones. After: stop any S3 server the page left running (a cell
    failed before its last), and move the artifacts it wrote into the gallery.
    """
    if not fname:
        return
    stem, confdir = Path(fname).stem, Path(gallery_conf["src_dir"])
    gallery = confdir / GALLERY_DIR
    if when == "before":
        (stamp_dir(confdir) / f"{stem}.json").unlink(missing_ok=True)
        (results_dir(confdir) / f"{stem}.json").unlink(missing_ok=True)
        for suffix in ARTIFACTS:
            (gallery / f"{stem}{suffix}").unlink(missing_ok=True)
        return
    object_store = sys.modules.get(f"{PAGE_PACKAGE}.object_store")
    if object_store is not None:  # a page whose cell failed leaves no S3 server running
        object_store.stop_all()
    for suffix in ARTIFACTS:
        written = confdir / SOURCE_DIR / f"{stem}{suffix}"
        if written.exists():
            shutil.move(written, gallery / written.name)


def _selected_to_run(app: Sphinx, stem: str) -> bool:
    conf = app.config.sphinx_gallery_conf
    if not conf.get("plot_gallery", True) or str(conf.get("plot_gallery")) in ("0", "False"):
        return False
    source = Path(app.confdir, SOURCE_DIR, f"{stem}.py")
    return re.search(conf["filename_pattern"], str(source)) is not None


# Pages whose headline is a time, a speed or an amount of memory. Each has a section in
# on_gpus.rst that says which of its conclusions change on GPUs, and why: until a GPU build
# has run the page, its run stamp says its numbers come from CPU ranks, and includes it.
ON_GPUS = "on_gpus.rst"
PERFORMANCE_PAGES = (
    "async_save_recipe",
    "default_stager_recipe",
    "checkpoint_stall_benchmark",
    "save_load_speed_recipe",
    "stager_copies_recipe",
    "object_storage_async_recipe",
    "torch_checkpointing_recipe",
)


def stamp_block(stamp: dict) -> str:
    """The reST admonition that says where a page was last executed: torch, the device,
    the host's memory, the storage its checkpoints went to, the backend and the ranks."""
    host = [f"{stamp['memory_gib']} GiB memory"] if "memory_gib" in stamp else []
    host += [f"checkpoints on {stamp['storage']}"] if "storage" in stamp else []
    where = " · ".join(
        [f"torch ``{stamp['torch']}``", stamp["device"], *host, f"backend ``{stamp['backend']}``"]
        + [f"world size {stamp['world_size']} ({stamp['launcher']})", stamp["date"]]
    )
    if stamp.get("recipe") in PERFORMANCE_PAGES and "nccl" not in stamp["backend"]:
        where += (
            "\n\n   **The numbers on this page come from CPU ranks with gloo**: no GPU build"
            " of it has run. On GPUs (every page: :doc:`/on_gpus`):\n\n"
            f"   .. include:: /{ON_GPUS}\n"
            f"      :start-after: .. {stamp['recipe']}: begin\n"
            f"      :end-before: .. {stamp['recipe']}: end\n"
        )
    return f".. admonition:: Last executed\n   :class: dcp-run-stamp\n\n   {where}\n"


NOT_RUN_BLOCK = (
    ".. admonition:: Not executed in this build\n"
    "   :class: dcp-run-stamp dcp-not-run\n\n"
    "   This build did not run this page's code (``make html-noplot``, or a\n"
    "   ``GALLERY_PATTERN`` that leaves it out): any output below is an earlier build's,\n"
    "   on the machine and at the size that build used. ``make html`` executes it.\n"
)


def page_links(stem: str, gallery: Path) -> str:
    """The links at the top of a recipe page, as on pytorch.org's tutorials."""
    links = [
        f":download:`Download script <{stem}.py>`",
        f":download:`Download notebook <{stem}.ipynb>`",
        f"`View source <../_sources/{SOURCE_DIR}/{stem}.py.txt>`__",
    ]
    links += [
        f":download:`{label} <{stem}{suffix}>`"
        for suffix, label in ARTIFACTS.items()
        if (gallery / f"{stem}{suffix}").exists()
    ]
    links.append(":doc:`How the ranks start </launcher>`")
    links.append(":doc:`How these pages measure and prove </measuring>`")
    return ".. container:: dcp-page-links\n\n   " + " · ".join(links) + "\n"


# The one note about the site's scaffolding on every recipe page (the pages themselves
# talk about DCP only).
PAGE_NOTE = """\
.. note::
   :class: dcp-page-note

   ``run_on_ranks(fn, ...)`` runs ``fn`` on every rank (:doc:`/launcher`): the functions
   it runs are what you would run under ``torchrun``, and each rank's output is printed
   under the cell, labelled ``[rankN]``. Cells that call ``page_tools`` are this page's
   proofs and measurements (:doc:`/measuring`); the downloads leave them out.
"""


def page_tool(confdir: str | os.PathLike, name: str):
    """The module ``page_tools.<name>`` beside the recipes, for the build's own use."""
    source = str(Path(confdir, SOURCE_DIR))
    if source not in sys.path:
        sys.path.insert(0, source)
    return importlib.import_module(f"{PAGE_PACKAGE}.{name}")


def results_problems(confdir: str | os.PathLike, stem: str) -> list[str]:
    """What is wrong with an executed page's results file, against its list of claims."""
    path = results_dir(confdir) / f"{stem}.json"
    results = page_tool(confdir, "results")

    listed = results.manifest(stem)
    if not listed and not path.exists():
        return []  # a page that proves nothing with page_tools yet
    if not path.exists():
        return [f"it wrote no results file ({path.name}) but claims/{stem}.toml lists claims"]
    stamp_path = stamp_dir(confdir) / f"{stem}.json"
    stamp = json.loads(stamp_path.read_text()) if stamp_path.exists() else {}
    return results.problems(stem, results.read(path), on_gpu="nccl" in stamp.get("backend", ""))


# Sphinx-Gallery's "Go to the end to download the full example code" note: the header has the links.
_GO_TO_THE_END = re.compile(
    r"\.\. note::\n\s+:class: sphx-glr-download-link-note\n.*?full example code\.\n", re.S
)


def insert_page_header(app: Sphinx, docname: str, source: list[str]) -> None:
    """``source-read``: put the links and the run stamp under the title of each recipe page."""
    if not docname.startswith(f"{GALLERY_DIR}/") or docname.endswith("/index"):
        return
    stem = docname.split("/", 1)[1]
    if not Path(app.confdir, SOURCE_DIR, f"{stem}.py").exists():
        return
    stamp_path = stamp_dir(app.confdir) / f"{stem}.json"
    if not _selected_to_run(app, stem):
        stamp = NOT_RUN_BLOCK
    elif stamp_path.exists():
        stamp = stamp_block(json.loads(stamp_path.read_text()))
        for problem in results_problems(app.confdir, stem):
            from sphinx.util import logging

            logging.getLogger(__name__).warning("recipe %s: %s", stem, problem, location=docname)
    else:
        from sphinx.util import logging

        logging.getLogger(__name__).warning(
            "recipe %s ran but left no run stamp: does it launch its ranks with rank_launcher?",
            stem,
            location=docname,
        )
        return
    text = _GO_TO_THE_END.sub("", source[0], count=1)
    header = page_header(app.confdir, stem, stamp)
    headers_read(app.env)[docname] = header
    source[0] = _after_title(text, header)


def page_header(confdir: str | os.PathLike, stem: str, stamp: str) -> str:
    """What goes under a recipe page's title: its links, its run stamp, the page note."""
    return page_links(stem, Path(confdir, GALLERY_DIR)) + "\n" + stamp + "\n" + PAGE_NOTE


def headers_read(env) -> dict[str, str]:
    """The header each recipe page was last read with (kept in Sphinx's saved environment)."""
    if not hasattr(env, "dcp_recipe_headers"):
        env.dcp_recipe_headers = {}
    return env.dcp_recipe_headers


def merge_headers_read(app: Sphinx, env, docnames: set[str], other) -> None:
    """``env-merge-info``: keep the headers the processes of a parallel read (``-j``)
    recorded; without them, every build read every recipe page again (a warm
    ``make html-noplot`` took 18 s instead of 5)."""
    read = headers_read(other)
    headers_read(env).update({docname: read[docname] for docname in docnames if docname in read})


def forget_header_read(app: Sphinx, env, docname: str) -> None:
    """``env-purge-doc``: a page read again (or removed) has no header until it is read."""
    headers_read(env).pop(docname, None)


def _after_title(text: str, block: str) -> str:
    """Insert ``block`` right after the page's first section title."""
    lines = text.split("\n")
    for i in range(1, len(lines)):
        underline = lines[i]
        if underline and set(underline) == {"="} and len(underline) >= len(lines[i - 1].rstrip()):
            return "\n".join(lines[: i + 1] + ["", block] + lines[i + 1 :])
    return block + "\n" + text


def _export_stamp_dir(app: Sphinx, config) -> None:
    os.environ[STAMP_DIR_ENV] = str(stamp_dir(app.confdir))
    os.environ[RESULTS_DIR_ENV] = str(results_dir(app.confdir))


def write_if_changed(path: Path, content: str | bytes) -> bool:
    """Write ``content`` unless ``path`` holds it already; True if it wrote. A page that
    includes or links a file Sphinx reads again whenever the file's mtime moves."""
    data = content.encode() if isinstance(content, str) else content
    if path.exists() and path.read_bytes() == data:
        return False
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return True


def write_page_package_zip(confdir: str | os.PathLike) -> Path:
    """``recipes/page_tools.zip``: the page package, for code copied block by block from a
    page (the measuring page offers it, as the launcher page offers rank_launcher.py).
    The same sources make the same bytes (each entry carries its file's mtime), and an
    unchanged zip is not written again: the measuring page is read again only when it moved."""
    target = Path(confdir, GALLERY_DIR, f"{PAGE_PACKAGE}.zip")
    package = Path(confdir, SOURCE_DIR, PAGE_PACKAGE)
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
        for path in sorted(package.rglob("*")):
            if path.is_file() and "__pycache__" not in path.parts:
                archive.write(path, path.relative_to(package.parent))
    write_if_changed(target, buffer.getvalue())
    return target


def _write_page_package_zip(app: Sphinx, config) -> None:
    write_page_package_zip(app.confdir)


# --------------------------------------------------------------------------
# The quick start on the landing page: a whole torchrun script, run twice per build
# --------------------------------------------------------------------------

QUICK_START = Path(SOURCE_DIR, "quick_start", "train.py")
QUICK_START_OUTPUT = Path(GALLERY_DIR, "quick_start.out.txt")
QUICK_START_NOT_RUN = "(not run in this build: `make html` runs it, twice, under torchrun)\n"


def quick_start_command(confdir: str | os.PathLike, checkpoint_root: str) -> str:
    """The quick start as the landing page shows it: run, then run again (it resumes)."""
    import shlex
    import sys

    torchrun = f"{shlex.quote(sys.executable)} -m torch.distributed.run"
    run = f"{torchrun} --standalone --nproc-per-node=2 {QUICK_START} {checkpoint_root}"
    return f"{run} && echo '--- the same command again ---' && {run}"


def _start_quick_start(app: Sphinx) -> None:
    """Run the quick start in the background while the gallery executes (``make html``)."""
    import subprocess
    import tempfile

    if not _selected_to_run(app, "quick_start"):  # make html-noplot, or a GALLERY_PATTERN
        # Unchanged, not rewritten: a warm make html-noplot does not read the landing page.
        write_if_changed(Path(app.confdir, QUICK_START_OUTPUT), QUICK_START_NOT_RUN)
        app._quick_start = None
        return
    scratch = tempfile.mkdtemp(prefix="dcp-quick-start-")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    for name in (STAMP_DIR_ENV, RESULTS_DIR_ENV):
        env.pop(name, None)
    app._quick_start = (
        subprocess.Popen(
            quick_start_command(app.confdir, os.path.join(scratch, "checkpoints")),
            shell=True,
            cwd=app.confdir,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        ),
        scratch,
    )


def _finish_quick_start(app: Sphinx, docname: str, source: list[str]) -> None:
    """``source-read`` of the landing page: wait for the quick start and keep its output."""
    running = getattr(app, "_quick_start", None)
    if docname != "index" or running is None:
        return
    process, scratch = running
    app._quick_start = None
    try:
        printed, _ = process.communicate(timeout=300)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    if process.returncode != 0:
        raise RuntimeError(f"the quick start failed (exit {process.returncode}):\n{printed}")
    # torchrun's own notice about OMP_NUM_THREADS is not the script's output.
    kept = [line for line in printed.splitlines() if not line.startswith("*" * 10)]
    write_if_changed(Path(app.confdir, QUICK_START_OUTPUT), "\n".join(kept).strip() + "\n")


# --------------------------------------------------------------------------
# Downloads that run alone
# --------------------------------------------------------------------------

LAUNCHER_IMPORT = re.compile(r"^from rank_launcher import [^\n]+\n", re.M)
LAUNCHER_HEADER = """\
# %%
# How this file starts its ranks
# ------------------------------
# This cell is the site's rank launcher (rank_launcher.py), which every page
# imports; the build wrote it into this download so that the file runs on its
# own. As a plain script it forks DCP_RECIPES_WORLD_SIZE ranks (default: 2 on
# CPU, one per GPU); under torchrun it uses torchrun's ranks. Your own training
# script does not need it: run the recipe's functions on the ranks torchrun
# starts. The recipe continues after "End of the rank launcher".
"""
LAUNCHER_NOTE = (
    "## How this notebook starts its ranks\n"
    "The next cell is the site's rank launcher (`rank_launcher.py`), which every page imports; "
    "the build wrote it into this notebook so that it runs on its own. It forks "
    "`DCP_RECIPES_WORLD_SIZE` ranks (default: 2 on CPU, one per GPU) for each cell that calls "
    "`run_on_ranks`. Your own training script does not need it."
)


_HIDDEN_BLOCK = re.compile(
    r"^[ \t]*# sphinx_gallery_start_ignore\n.*?^[ \t]*# sphinx_gallery_end_ignore\n", re.M | re.S
)


class PageNames(set):
    """The page's names (``page_names``); ``package``: those bound to the package itself."""

    package: frozenset[str] = frozenset()


def page_names(code: str) -> PageNames:
    """The names that belong to the page's own work: those a recipe binds to the page
    package (``from page_tools import proofs``), then, in order, every name a page
    statement binds at its top (``with proofs.state_after(...) as loaded``,
    ``table = figures...``), until recipe code binds it again: a statement that uses one of
    them is page work too, and leaves the downloads."""
    tree = ast.parse(code)
    names = {PAGE_PACKAGE}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == PAGE_PACKAGE:
            names |= {alias.asname or alias.name for alias in node.names}
        elif isinstance(node, ast.Import):
            names |= {
                (alias.asname or alias.name).split(".")[0]
                for alias in node.names
                if alias.name.split(".")[0] == PAGE_PACKAGE
            }
    names = PageNames(names)
    names.package = frozenset(names)
    for node in tree.body:
        if is_page_wrapper(node, names):
            names |= _bound(*(item.optional_vars for item in node.items if item.optional_vars))
            names -= _bound(*node.body) - names.package  # the recipe code it wraps
        elif is_page_statement(node, names):
            names |= _bound(node) if not _is_page_import(node) else set()
        else:
            names -= _bound(node) - names.package  # recipe code binds the name again
    return names


def _bound(*nodes: ast.AST) -> set[str]:
    """The names a statement binds in the module's scope: not those of its comprehensions,
    lambdas, functions or classes, which have scopes of their own."""
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            found.add(node.id)
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            found.add(node.name)
            return
        if isinstance(node, ast.Lambda | ast.comprehension | ast.ListComp | ast.SetComp):
            return
        if isinstance(node, ast.DictComp | ast.GeneratorExp):
            return
        for child in ast.iter_child_nodes(node):
            visit(child)

    for node in nodes:
        visit(node)
    return found


def _uses(node: ast.AST, names: set[str]) -> bool:
    """Whether ``node`` reads one of ``names`` that it does not bind itself."""
    loaded = {
        sub.id
        for sub in ast.walk(node)
        if isinstance(sub, ast.Name) and isinstance(sub.ctx, ast.Load) and sub.id in names
    }
    # Most statements read none of them: only those that do need their own bindings walked.
    return bool(loaded) and bool(loaded - (_bound(node) - getattr(names, "package", set())))


def _is_page_import(node: ast.stmt) -> bool:
    if isinstance(node, ast.ImportFrom):
        return (node.module or "").split(".")[0] == PAGE_PACKAGE
    if isinstance(node, ast.Import):
        return any(alias.name.split(".")[0] == PAGE_PACKAGE for alias in node.names)
    return False


def is_page_statement(node: ast.stmt, names: set[str]) -> bool:
    """A statement that is the page's work: it imports or uses the page package (or a name
    the page's work bound; a function or class has names of its own: only the package's)."""
    if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
        return _uses(node, getattr(names, "package", names))
    return _is_page_import(node) or _uses(node, names)


def is_page_wrapper(node: ast.stmt, names: set[str]) -> bool:
    """``with <page_tools context>: <recipe code>``: the page watches the recipe it runs."""
    return (
        isinstance(node, ast.With)
        and all(_uses(item.context_expr, names) for item in node.items)
        and not any(_uses(stmt, names) for stmt in node.body)
    )


def recipe_only(code: str, names: set[str] | None = None) -> str:
    """A page's code as the reader keeps it: without the page's own work.

    Hidden blocks (``sphinx_gallery_start_ignore``) go, and so does every top-level
    statement that imports or uses the page package, except that a ``with`` of it keeps
    its body (the recipe code it watches), one indentation level out. Cells left empty
    go too. Comments stay. ``names``: the page package's names, for one cell of a page
    (default: those that ``code`` imports).
    """
    code = _HIDDEN_BLOCK.sub("", code)
    tree = ast.parse(code)
    names = page_names(code) if names is None else names
    lines = code.splitlines(keepends=True)
    keep = [True] * len(lines)
    dedent: dict[int, int] = {}
    for node in tree.body:
        first = (
            node.decorator_list[0].lineno if getattr(node, "decorator_list", None) else node.lineno
        ) - 1
        if is_page_wrapper(node, names):
            body_start = node.body[0].lineno - 1
            for i in range(first, body_start):
                keep[i] = False
            indent = node.body[0].col_offset - node.col_offset
            for i in range(body_start, node.end_lineno):
                dedent[i] = indent
        elif is_page_statement(node, names):
            for i in range(first, node.end_lineno):
                keep[i] = False
    out = []
    for i, line in enumerate(lines):
        if keep[i]:
            out.append(line[dedent[i] :] if i in dedent and line.strip() else line)
    return _without_empty_cells("".join(out))


def _without_empty_cells(code: str) -> str:
    """Drop ``# %%`` cells that hold nothing but blank lines, and runs of blank lines."""
    cells = re.split(r"(?m)^(?=# %%)", code)
    kept = [cell for cell in cells if cell.strip() not in ("# %%", "")]
    return re.sub(r"\n{4,}", "\n\n\n", "".join(kept)).rstrip("\n") + "\n"


def page_metrics(source: str) -> dict[str, int]:
    """A recipe page's size: its lines, its code lines (not blank, not comments, outside
    the docstring), the hidden ones among them (with their markers) and the page-tool ones."""
    tree = ast.parse(source)
    docstring_end = (
        tree.body[0].end_lineno if tree.body and isinstance(tree.body[0], ast.Expr) else 0
    )
    lines = source.splitlines()
    hidden, inside = set(), False
    for number, line in enumerate(lines, 1):
        marker = line.strip()
        if marker == "# sphinx_gallery_start_ignore":
            inside = True
        if inside:
            hidden.add(number)
        if marker == "# sphinx_gallery_end_ignore":
            inside = False
    code = {
        number
        for number, line in enumerate(lines, 1)
        if number > docstring_end and line.strip() and not line.strip().startswith("#")
    }
    names = page_names(source)
    page_work = set()
    for node in tree.body:
        if is_page_statement(node, names) or is_page_wrapper(node, names):
            body = node.body if is_page_wrapper(node, names) else []
            kept = {n for stmt in body for n in range(stmt.lineno, stmt.end_lineno + 1)}
            page_work |= set(range(node.lineno, node.end_lineno + 1)) - kept
    return {
        "lines": len(lines),
        "code_lines": len(code | hidden),
        "hidden_lines": len(hidden),
        "page_work_lines": len(page_work & code),
    }


def launcher_code(launcher_source: str) -> str:
    """The launcher (or a site module) without its module docstring (a header replaces it)."""
    tree = ast.parse(launcher_source)
    first = tree.body[0]
    lines = launcher_source.splitlines(keepends=True)
    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
        lines = lines[first.end_lineno :]
    return "".join(lines).strip("\n") + "\n"


def module_import(name: str) -> re.Pattern:
    """A page's import of the site module ``name``."""
    return re.compile(rf"^from {name} import [^\n]+\n", re.M)


def module_summary(source: str) -> str:
    """A site module's docstring's first line, without its full stop."""
    return (ast.get_docstring(ast.parse(source)) or "").split("\n", 1)[0].rstrip(".")


def module_header(name: str, source: str) -> str:
    """What a download says above a site module it holds."""
    summary = module_summary(source)
    return (
        f"# %%\n# {summary}\n# {'-' * len(summary)}\n"
        f"# This cell is the site's {name}.py, which this page imports; the build wrote it\n"
        f"# into this download so that the file runs on its own. To use it in your own code,\n"
        f'# save this cell as {name}.py. The recipe continues after "End of {name}.py".\n'
    )


def module_note(name: str, source: str) -> str:
    """What a notebook says above a site module's cell."""
    return (
        f"## {module_summary(source)}\n"
        f"The next cell is the site's `{name}.py`, which this page imports; the build wrote it "
        f"into this notebook so that it runs on its own. To use it in your own code, save that "
        f"cell as `{name}.py`."
    )


def site_module_sources(confdir: str | os.PathLike = Path(__file__).parent) -> dict[str, str]:
    """Each site module's source, by name."""
    return {name: Path(confdir, SOURCE_DIR, f"{name}.py").read_text() for name in SITE_MODULES}


def imported_modules(code: str, modules: dict[str, str]) -> list[str]:
    """The site modules ``code`` imports, in ``SITE_MODULES``' order."""
    return [name for name in modules if module_import(name).search(code)]


def standalone_script(
    script: str, launcher_source: str, modules: dict[str, str] | None = None
) -> str:
    """A recipe script as a download: the recipe only, with the launcher and the site
    ``modules`` it imports (default: this checkout's) written in, after its docstring, in
    place of the imports."""
    script = recipe_only(script)
    modules = site_module_sources() if modules is None else modules
    used = imported_modules(script, modules)
    if not LAUNCHER_IMPORT.search(script):
        return script
    script = LAUNCHER_IMPORT.sub("", script, count=1)
    for name in used:
        script = module_import(name).sub("", script, count=1)
    tree = ast.parse(script)
    has_docstring = tree.body and isinstance(tree.body[0], ast.Expr)
    split = tree.body[0].end_lineno if has_docstring else 0
    lines = script.splitlines(keepends=True)
    launcher = launcher_code(launcher_source)
    written = [f"{LAUNCHER_HEADER}\n{launcher}\n# End of the rank launcher.\n"]
    for name in used:
        code = launcher_code(modules[name])
        written.append(f"{module_header(name, modules[name])}\n{code}\n# End of {name}.py.\n")
    inserted = "\n\n".join(written)
    return "".join(lines[:split]) + "\n\n" + inserted + "\n\n" + "".join(lines[split:])


def _cell(cell_type: str, text: str) -> dict:
    cell = {"cell_type": cell_type, "metadata": {}, "source": text.splitlines(keepends=True)}
    if cell_type == "code":
        cell.update(execution_count=None, outputs=[])
    return cell


def notebook_launcher_cell(launcher_source: str, stem: str) -> str:
    """The launcher as a notebook's cell, naming the recipe: a kernel has no script name."""
    return launcher_code(launcher_source) + f'os.environ.setdefault(RECIPE_ENV, "{stem}")\n'


def standalone_notebook(
    notebook: dict, launcher_source: str, stem: str, modules: dict[str, str] | None = None
) -> dict:
    """A recipe notebook with the launcher in a cell of its own, in place of the import,
    then each site module it imports (``standalone_script``'s ``modules``) in one too."""
    modules = site_module_sources() if modules is None else modules
    notebook = copy.deepcopy(notebook)
    codes = ["".join(cell["source"]) for cell in notebook["cells"] if cell["cell_type"] == "code"]
    names = page_names("\n".join(codes))
    cells = []
    for cell in notebook["cells"]:
        if cell["cell_type"] == "code":
            code = recipe_only("".join(cell["source"]), names)
            if not code.strip():
                continue  # a cell of the page's own work
            cell["source"] = code.rstrip("\n").splitlines(keepends=True)
        cells.append(cell)
    notebook["cells"] = cells
    code_cells = [cell for cell in cells if cell["cell_type"] == "code"]
    kept = ["".join(cell["source"]) for cell in code_cells]  # the recipe's code, cell by cell
    if not any(LAUNCHER_IMPORT.search(code) for code in kept):
        return notebook
    used = imported_modules("\n".join(kept), modules)
    for cell, code in zip(code_cells, kept, strict=True):
        text = LAUNCHER_IMPORT.sub("", code, count=1)
        for name in used:
            text = module_import(name).sub("", text, count=1)
        cell["source"] = text.splitlines(keepends=True)
    # After the title cell: the launcher and the modules are defined before any cell uses them.
    launcher = notebook_launcher_cell(launcher_source, stem)
    written = [_cell("markdown", LAUNCHER_NOTE), _cell("code", launcher)]
    for name in used:
        note = module_note(name, modules[name])
        written += [_cell("markdown", note), _cell("code", launcher_code(modules[name]))]
    cells[1:1] = written
    return notebook


def _write_standalone_downloads(app: Sphinx, exception: Exception | None) -> None:
    """``build-finished``: write the launcher into every recipe's downloads; publish sources."""
    if exception is not None or app.builder.format != "html":
        return
    confdir, outdir = Path(app.confdir), Path(app.outdir)
    launcher_source = (confdir / SOURCE_DIR / LAUNCHER).read_text()
    modules = site_module_sources(confdir)
    sources = outdir / "_sources" / SOURCE_DIR
    sources.mkdir(parents=True, exist_ok=True)
    gallery = confdir / GALLERY_DIR
    made = Path(app.doctreedir, "standalone-downloads")
    made.mkdir(parents=True, exist_ok=True)
    # the launcher, the modules, this code
    made_with = "\0".join([launcher_source, *modules.values(), Path(__file__).read_text()])
    for stem in recipe_names(confdir):
        shutil.copyfile(confdir / SOURCE_DIR / f"{stem}.py", sources / f"{stem}.py.txt")
        # Always from the gallery's own files, so that a rebuild never inlines twice. Sphinx
        # copies those files over the downloads on every build; what they are turned into is
        # kept beside the doctrees, keyed by everything it is made from.
        recipe_script = (gallery / f"{stem}.py").read_text()
        recipe_notebook = (gallery / f"{stem}.ipynb").read_text()
        key = hashlib.sha256(
            "\0".join((recipe_script, recipe_notebook, made_with)).encode()
        ).hexdigest()
        kept = made / f"{stem}.json"
        cached = json.loads(kept.read_text()) if kept.exists() else {}
        if cached.get("key") == key:
            script, notebook_text = cached["script"], cached["notebook"]
        else:
            script = standalone_script(recipe_script, launcher_source, modules)
            recipe = json.loads(recipe_notebook)
            notebook = standalone_notebook(recipe, launcher_source, stem, modules)
            notebook_text = json.dumps(notebook, indent=1)
            kept.write_text(json.dumps({"key": key, "script": script, "notebook": notebook_text}))
        for path in (outdir / "_downloads").glob(f"*/{stem}.py"):
            path.write_text(script)
        for path in (outdir / "_downloads").glob(f"*/{stem}.ipynb"):
            path.write_text(notebook_text + "\n")
        for path in (outdir / "_downloads").glob(f"*/{stem}.zip"):
            with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as archive:
                archive.writestr(f"{stem}.py", script)
                archive.writestr(f"{stem}.ipynb", notebook_text + "\n")


# --------------------------------------------------------------------------
# Site chrome
# --------------------------------------------------------------------------

# The theme's layout loads scripts, fonts and trackers from other hosts; offline
# (and for privacy) they fail with console errors. jQuery is served locally.
_THIRD_PARTY = [
    re.compile(r"<!-- (Google Tag Manager( \(noscript\))?) -->.*?<!-- End \1 -->", re.S),
    re.compile(r"<!-- Facebook Pixel Code -->.*?<!-- End Facebook Pixel Code -->", re.S),
    re.compile(r'<link[^>]*href="https://fonts\.(googleapis|gstatic)\.com[^"]*"[^>]*>'),
    re.compile(r'<link[^>]*href="[^"]*_static/webfonts/all\.min\.css"[^>]*>'),
    re.compile(
        r'<script[^>]*src="https://(cdnjs\.cloudflare\.com|cse\.google\.com)/[^"]*"[^>]*></script>'
    ),
    # The consent manager and the cookie banner's script: this site sets no cookies.
    re.compile(
        r"<script>\s*if \(window\.location\.hostname === 'docs\.pytorch\.org'.*?</script>", re.S
    ),
    re.compile(r"<script>\s*// Cookie banner for non-LF projects.*?</script>", re.S),
]
_CDN_JQUERY = '<script src="https://code.jquery.com/jquery-3.7.1.min.js"></script>'


def offline_head(html: str, local_jquery: str):
    """Template filter: the theme's head without requests to other hosts."""
    from markupsafe import Markup

    html = str(html).replace(_CDN_JQUERY, f'<script src="{local_jquery}"></script>')
    for pattern in _THIRD_PARTY:
        html = pattern.sub("", html)
    return Markup(html)


def _add_template_filters(app: Sphinx) -> None:
    if hasattr(app.builder, "templates"):
        app.builder.templates.environment.filters["offline_head"] = offline_head


def _copy_theme_webfonts(app: Sphinx, exception: Exception | None) -> None:
    """The theme's CSS wants _static/webfonts/; pydata-sphinx-theme ships the files."""
    if exception is not None or app.builder.format != "html":
        return
    static = Path(app.outdir, "_static")
    for vendored in static.glob("vendor/fontawesome/*/webfonts"):
        shutil.copytree(vendored, static / "webfonts", dirs_exist_ok=True)


def reread_recipe_pages(app: Sphinx, env, added, changed, removed) -> list[str]:
    """``env-get-outdated``: read recipe pages again, so that each run stamp is this build's.

    Sphinx keeps a page's doctree while its reST is unchanged, and Sphinx-Gallery leaves an
    unchanged recipe's reST alone: a page last read by ``make html-noplot`` would go on
    saying "Not executed" after a ``make html`` that had no reason to run it again. So a
    page the build executes is always read again (its stamp, and the check of its results
    file, are this build's); one it does not execute only when it was last read with another
    header (after an executed build, say): a warm ``make html-noplot`` reads none again.
    """
    read_with = headers_read(env)
    return [
        f"{GALLERY_DIR}/{stem}"
        for stem in recipe_names(app.confdir)
        if Path(app.srcdir, GALLERY_DIR, f"{stem}.rst").exists()
        and (
            _selected_to_run(app, stem)
            or read_with.get(f"{GALLERY_DIR}/{stem}")
            != page_header(app.confdir, stem, NOT_RUN_BLOCK)
        )
    ]


def forget_pickled_doctrees(app: Sphinx, env, docnames: list[str]) -> None:
    """``env-before-read-docs``: drop the doctrees an earlier build left in the environment.

    Sphinx 7.2 keeps each page it reads one at a time (5 changed pages or fewer, or no
    ``-j``) in memory for its writer, and pickles that cache with the environment. A later
    build that reads its pages in parallel (more than 5 changed, with ``-j``) caches none,
    so its writer took the pickled ones: pages as an older build read them (Sphinx 7.3
    stops pickling the cache). Before this build reads, every cached doctree is an earlier
    build's; the writer then loads each page's doctree from its file, the newest.
    """
    getattr(env, "_write_doc_doctree_cache", {}).clear()


def reread_site_pages(app: Sphinx, env, added, changed, removed) -> list[str]:
    """``env-get-outdated``: a build that runs the quick start reads the landing page again,
    which waits for it (``_finish_quick_start``) and shows its output; "PyTorch versions"
    lists every recipe, so a recipe added or removed reads it again. (The pages that show the
    committed version matrix depend on its file: ``insert_torch_versions``.)"""
    outdated = []
    if getattr(app, "_quick_start", None) is not None:
        outdated.append("index")
    if any(name.startswith(f"{GALLERY_DIR}/") for name in (*added, *removed)):
        outdated.append("versions")
    return [name for name in outdated if name in env.found_docs]


def mark_page_work(app: Sphinx, doctree) -> None:
    """``doctree-read``: give a recipe page's own cells (its proofs, its measurements) the
    class ``dcp-page-work``, so that a reader tells them from the recipe at a glance."""
    docname = app.env.docname
    if not docname.startswith(f"{GALLERY_DIR}/"):
        return
    source = Path(app.confdir, SOURCE_DIR, f"{docname.split('/', 1)[1]}.py")
    if not source.exists():
        return
    from docutils import nodes

    names = page_names(source.read_text())
    for block in list(doctree.findall(nodes.literal_block)):
        code = block.astext()
        if block.get("language", "").lower() != "python" or not _only_page_work(code, names):
            continue
        # A container: Sphinx-Gallery replaces the block itself when it links its names.
        wrapper = nodes.container(classes=["dcp-page-work"])
        block.replace_self(wrapper)
        wrapper += block


def _only_page_work(code: str, names: set[str]) -> bool:
    try:
        tree = ast.parse(code)
    except SyntaxError:
        return False
    body = tree.body
    return bool(body) and all(
        is_page_statement(n, names) or is_page_wrapper(n, names) for n in body
    )


# --------------------------------------------------------------------------
# Which torch each recipe runs on: the version matrix (make versions, tools/versions.py)
# --------------------------------------------------------------------------

# The releases readers run; `make versions` measures each (TORCH=x.y.z for one).
TORCH_VERSIONS = ("2.9.1", "2.10.0", "2.11.0", "2.12.1", "2.13.0", "2.14.1", "2.15.0")
VERSION_RESULTS = Path("_versions", "results.json")  # written by tools/versions.py, committed
VERSIONS_COMMAND = "make versions"
# Scripts the matrix runs beside the recipes: a reader's way through a known failure.
WORKAROUNDS = {
    "fresh_stager_per_save": {
        "script": "tools/version_checks/fresh_stager_per_save.py",
        "title": "Workaround: a fresh DefaultStager per save",
        "fixes": "reused-stager-keyerror",
    },
}
# Checkpoints across versions (make versions CROSS=1, tools/version_checks/cross_version.py):
# each kind's table in the results file ("key"), saved by a row's release, loaded by a
# column's; where a load fails, the way through ("via": its outcomes, "via_mode": the
# script's mode for it, "convert": the saver first writes a dcp_to_torch_save file).
CHECKPOINT_KINDS = {
    "model": {
        "key": "checkpoints",
        "title": "A model and its optimizer (one process)",
        "what": "a model's and its Adam optimizer's state dict, saved with ``dcp.save`` in one "
        "process and loaded with ``dcp.load`` into a fresh model and optimizer",
        "via": "via_torch_save",
        "via_mode": "load-torch-save",
        "convert": True,
        "way": "``dcp_to_torch_save`` by the release that saved it, ``torch.load`` by the other",
    },
    "dtensor": {
        "key": "checkpoints_dtensor",
        "title": "Sharded with FSDP2 (DTensors, 2 ranks)",
        "what": "the same model and optimizer sharded with ``fully_shard`` on 2 ranks (gloo), "
        "``get_state_dict``'s DTensors saved by 2 ranks and loaded by 2 ranks "
        "(``set_state_dict``), every rank's shards compared",
        "via": "via_torch_save",
        "via_mode": "load-torch-save",
        "convert": True,
        "way": "``dcp_to_torch_save`` by the release that saved it, ``torch.load`` by the other",
    },
    "hf": {
        "key": "checkpoints_hf",
        "title": "A Hugging Face safetensors export (2 ranks)",
        "what": "the sharded model exported by 2 ranks with ``HuggingFaceStorageWriter`` "
        "(``save_distributed=True, enable_consolidation=True``, as "
        ":doc:`/recipes/hf_interop_recipe`), read by 2 ranks with ``HuggingFaceStorageReader`` "
        "(as :doc:`/recipes/hf_import_recipe`)",
        "via": "via_safetensors",
        "via_mode": "load-safetensors",
        "convert": False,
        "way": "``safetensors.torch.load_file`` by the other release, no DCP",
    },
}
# A failure's first line -> (troubleshooting label, what to do on that torch).
KNOWN_FAILURES = (
    (
        re.compile(r"KeyError: <class 'type'>"),
        "reused-stager-keyerror",
        "use a fresh ``DefaultStager`` per save (close it once its upload is done)",
    ),
    (
        re.compile(r"too many values to unpack \(expected 5\)"),
        "newer-torch-checkpoint",
        "save with the oldest torch that must read it, or convert with the newer one "
        "(``dcp_to_torch_save``)",
    ),
)


# The line a recipe's Prerequisites card has in place of a hand-written torch version, and
# the landing page's cards in their footers: the build writes what the matrix measured.
RUNS_ON_MARKER = "PyTorch: see :doc:`/versions`"
CARD_MARKER = "|torch-versions|"
MATRIX_MARKER = ".. dcp-version-matrix::"


def load_version_results(confdir: str | os.PathLike = Path(__file__).parent) -> dict:
    path = Path(confdir, VERSION_RESULTS)
    return json.loads(path.read_text()) if path.exists() else {"versions": {}}


def known_failure(error: str) -> tuple[str, str] | None:
    """(troubleshooting label, what to do) for a failure this site knows, else None."""
    for pattern, label, advice in KNOWN_FAILURES:
        if pattern.search(error or ""):
            return label, advice
    return None


def recipe_versions(results: dict, stem: str) -> dict:
    """{"passed": [versions], "failed": [(version, outcome)], "unmeasured": [versions]}."""
    found = {"passed": [], "failed": [], "unmeasured": []}
    for version in TORCH_VERSIONS:
        outcome = results.get("versions", {}).get(version, {}).get("recipes", {}).get(stem)
        if outcome is None:
            found["unmeasured"].append(version)
        elif outcome["status"] == "passed":
            found["passed"].append(version)
        else:
            found["failed"].append((version, outcome))
    return found


def _literal(text: str, limit: int = 140) -> str:
    text = " ".join(text.split()).replace("`", "'")
    return "``" + (text if len(text) <= limit else text[: limit - 1] + "…") + "``"


def _measure_command(versions: list[str]) -> str:
    return f"``{VERSIONS_COMMAND} TORCH={versions[0]}``" + (
        " (one version; ``make versions`` for all)" if len(versions) > 1 else ""
    )


def runs_on_text(results: dict, stem: str) -> str:
    """A recipe's Prerequisites line, from the committed matrix: where it ran, where it
    failed (first line, and what to do where the failure is known), what is not measured."""
    found = recipe_versions(results, stem)
    parts = []
    if found["passed"]:
        parts.append(f"PyTorch {', '.join(found['passed'])}: ran there")
    by_error: dict[str, list[str]] = {}
    for version, outcome in found["failed"]:
        by_error.setdefault(outcome.get("error", ""), []).append(version)
    for error, versions in by_error.items():
        known = known_failure(error)
        said = f"fails on {', '.join(versions)}: {_literal(error)}"
        if known:
            said += f" (:ref:`{known[0]}`: {known[1]})"
        parts.append(said)
    if found["unmeasured"]:
        versions = found["unmeasured"]
        parts.append(f"not yet measured on {', '.join(versions)}: {_measure_command(versions)}")
    text = "; ".join(parts)
    return (text if text.startswith("PyTorch") else "PyTorch " + text) + " (:doc:`/versions`)"


def card_text(results: dict, stem: str) -> str:
    """The landing page card's footer: the same facts, short."""
    found = recipe_versions(results, stem)
    parts = []
    if found["passed"]:
        parts.append(f"runs on torch {', '.join(found['passed'])}")
    if found["failed"]:
        parts.append(f"fails on {', '.join(v for v, _ in found['failed'])}")
    if found["unmeasured"]:
        parts.append(
            f"not yet measured on {', '.join(found['unmeasured'])} (``{VERSIONS_COMMAND}``)"
        )
    return " · ".join(parts)


def versions_page_rst(results: dict, confdir: str | os.PathLike) -> str:
    """The page "PyTorch versions": the versions measured, the matrix, each failure."""
    confdir = Path(confdir)
    measured = results.get("versions", {})
    out = [".. list-table:: The releases and what measuring each took", "   :header-rows: 1", ""]
    out += ["   * - torch", "     - build", "     - measured", "     - venv", "     - time"]
    for version in TORCH_VERSIONS:
        entry = measured.get(version)
        if entry is None:
            out += [
                f"   * - {version}",
                "     - not yet measured",
                f"     - ``{VERSIONS_COMMAND} TORCH={version}``",
                "     -",
                "     -",
            ]
            continue
        setup, run = entry.get("setup_seconds", "?"), entry.get("run_seconds", "?")
        took = f"{setup} s to install, {run} s to run"
        out += [
            f"   * - {version}",
            f"     - ``{entry['torch']}``",
            f"     - {entry['date']}, {entry['machine']}",
            f"     - {entry['venv_gb']} GB",
            f"     - {took}",
        ]
    out += [
        "",
        ".. list-table:: Every recipe's download on every release",
        "   :header-rows: 1",
        "   :class: dcp-version-matrix",
        "",
        "   * - recipe",
    ]
    out += [f"     - {version}" for version in TORCH_VERSIONS]
    failures = []
    rows = [(stem, f":doc:`/{GALLERY_DIR}/{stem}`", "recipes") for stem in recipe_names(confdir)]
    rows += [
        (name, w["title"] + f" (``{w['script']}``)", "workarounds")
        for name, w in WORKAROUNDS.items()
    ]
    # Failures numbered by release, then in reading order.
    for version in TORCH_VERSIONS:
        for stem, title, kind in rows:
            outcome = measured.get(version, {}).get(kind, {}).get(stem)
            if outcome is not None and outcome["status"] != "passed":
                failures.append((version, stem, title, outcome))
    number_of = {(version, stem): n for n, (version, stem, _, _) in enumerate(failures, 1)}
    for stem, title, kind in rows:
        out.append(f"   * - {title}")
        for version in TORCH_VERSIONS:
            outcome = measured.get(version, {}).get(kind, {}).get(stem)
            if outcome is None:
                out.append("     - not yet measured")
            elif outcome["status"] == "passed":
                out.append(f"     - passed, {outcome['seconds']:.0f} s")
            else:
                number = number_of[(version, stem)]
                out.append(f"     - **failed** ({number}), {outcome['seconds']:.0f} s")
    out += ["", "Failures", "--------", ""]
    if not failures:
        out.append("None measured.")
    groups: dict[tuple[str, str, str], list[tuple[int, str, dict]]] = {}
    for number, (version, _stem, title, outcome) in enumerate(failures, 1):
        key = (version, outcome.get("error", ""), outcome.get("where", ""))
        groups.setdefault(key, []).append((number, title, outcome))
    for (version, error, where), failed in groups.items():
        known = known_failure(error)
        numbers = ", ".join(f"({number})" for number, _, _ in failed)
        line = f"* {numbers} torch {version}: {_literal(error, 300)}"
        line += f", raised at ``{where}``" if where else ""
        line += "."
        if known:
            line += f" Known: :ref:`{known[0]}`; on that torch, {known[1]}."
        out += [line, ""]
        for number, title, outcome in failed:
            came = outcome.get("recipe_line", "")
            out += [f"  * ({number}) {title}" + (f", from ``{came}``" if came else ""), ""]
    return "\n".join(out + checkpoints_rst(results)) + "\n"


def checkpoints_rst(results: dict) -> list[str]:
    """The section "Checkpoints across versions": for each kind of ``CHECKPOINT_KINDS``, saved
    by a row's release, loaded by a column's (``make versions CROSS=1``), each failure's first
    line and where it was raised, and the way through where one was measured."""
    out = ["", "Checkpoints across versions", "---------------------------", ""]
    out += [
        "Saved by one release and loaded by another, every tensor compared",
        f"(``tools/version_checks/cross_version.py``; ``{VERSIONS_COMMAND} CROSS=1`` runs it",
        "between every release that has a venv), three kinds; the page",
        ":doc:`/recipes/cross_version_recipe` runs them live and shows the error.",
        "",
    ]
    failures = []
    for kind, about in CHECKPOINT_KINDS.items():
        out += checkpoint_kind_rst(results.get(about["key"], {}), kind, about, failures)
    if failures:
        out += ["Failures", "~~~~~~~~", ""]
    for number, (kind, saved_by, loaded_by, outcome, via) in enumerate(failures, 1):
        about = CHECKPOINT_KINDS[kind]
        line = f"* C{number}. {about['title']}: saved by {saved_by}, loaded by {loaded_by}: "
        line += _literal(outcome.get("error", ""), 300)
        if outcome.get("where"):
            line += f", raised at ``{outcome['where']}``"
        line += "."
        known = known_failure(outcome.get("error", ""))
        if known:
            line += f" Known: :ref:`{known[0]}`."
        if via is not None and via["status"] == "passed":
            line += f" Way through ({about['way']}) by {loaded_by}: equal."
        elif via is not None:
            line += f" Way through: {_literal(via.get('error', ''), 200)}."
        out += [line, ""]
    return out


def checkpoint_kind_rst(table: dict, kind: str, about: dict, failures: list) -> list[str]:
    """One kind's table; its failures are appended to ``failures`` (numbered C1, C2, ...)."""
    title = about["title"]
    out = [title, "~" * len(title), "", f"{about['what'][0].upper()}{about['what'][1:]}.", ""]
    if not table:
        return out + [f"Not yet measured: ``{VERSIONS_COMMAND} CROSS=1``.", ""]
    out += [
        f".. list-table:: {title}: saved by (rows), loaded by (columns)",
        "   :header-rows: 1",
        "   :class: dcp-version-matrix",
        "",
        "   * - saved by",
    ]
    out += [f"     - {version}" for version in TORCH_VERSIONS]
    for saved_by in TORCH_VERSIONS:
        row = table.get(saved_by) or {}
        out.append(f"   * - {saved_by}")
        for loaded_by in TORCH_VERSIONS:
            outcome = row.get("loaded_by", {}).get(loaded_by)
            if outcome is None:
                out.append("     - not yet measured")
            elif outcome["status"] == "passed":
                out.append("     - loads, equal")
            else:
                via = row.get(about["via"], {}).get(loaded_by)
                failures.append((kind, saved_by, loaded_by, outcome, via))
                through = ""
                if via is not None:
                    through = "; way through: " + (
                        "loads" if via["status"] == "passed" else "fails"
                    )
                out.append(f"     - **fails** (C{len(failures)}){through}")
    out += ["", f"Where a load fails, the way through measured: {about['way']}.", ""]
    return out


def insert_torch_versions(app: Sphinx, docname: str, source: list[str]) -> None:
    """``source-read``: the matrix's results into the recipe pages' Prerequisites cards, the
    landing page's cards and the page "PyTorch versions"."""
    results = load_version_results(app.confdir)
    if any(marker in source[0] for marker in (RUNS_ON_MARKER, CARD_MARKER, MATRIX_MARKER)):
        # Read again when the matrix's file changes (make versions), and only then.
        app.env.note_dependency(str(Path(app.confdir, VERSION_RESULTS).resolve()))
    if docname.startswith(f"{GALLERY_DIR}/") and RUNS_ON_MARKER in source[0]:
        stem = docname.split("/", 1)[1]
        source[0] = source[0].replace(RUNS_ON_MARKER, runs_on_text(results, stem))
    elif docname == "index" and CARD_MARKER in source[0]:
        cards = re.split(r"(?m)^(?=\s*\.\. grid-item-card::)", source[0])
        for i, card in enumerate(cards):
            link = re.search(r":link: sphx_glr_recipes_(\w+)\.py", card)
            if link and CARD_MARKER in card:
                cards[i] = card.replace(CARD_MARKER, card_text(results, link.group(1)))
        source[0] = "".join(cards)
    elif docname == "versions":
        source[0] = source[0].replace(MATRIX_MARKER, versions_page_rst(results, app.confdir))


# --------------------------------------------------------------------------
# A benchmark's results from a GPU machine, kept in the repository, on the page on_gpus
# --------------------------------------------------------------------------

GPU_RESULTS_MARKER = ".. dcp-gpu-results::"


def gpu_results_rst(confdir: str | os.PathLike, relative: str) -> str:
    """A stall benchmark's results file from a GPU machine (``make bench`` there, kept under
    ``_static/measured``), recomputed from its raw runs by this build's ``page_tools``, as
    the page computes its own (the run may predate a change in how a metric is computed):
    where it ran, then per strategy its stall and total overhead at the page's headline
    interval (the one its headline names; in a file from before it did, the longest, in
    multiples of a save's time), over ``dcp.save``'s, and the goals' verdicts for the strategies
    the run set them for (since the page sets them for the one it recommends: that one)."""
    stalls, shown = page_tool(confdir, "stalls"), page_tool(confdir, "stats").shown_entry
    values = json.loads(Path(confdir, relative).read_text())["values"]
    config, machine, headline = values["config"], values["machine"], values["headline"]
    multiple = str(headline.get("interval_multiple", max(config["intervals"], key=float)))
    unit = "the upload's time" if "interval_multiple" in headline else "a save's time"
    summary = stalls.summarize(values["runs"]["runs"], float(multiple))
    names = list(values["ratios"])  # the strategies that checkpoint
    ratios = stalls.ratios(summary, names, values["limits"]["copy_s"])
    goals = stalls.goals_of(
        summary,
        list(values["goals"]),
        stall_per_checkpoint_s=headline["stall_goal"],
        overhead_s=headline["overhead_goal"],
    )
    where = (
        f"{machine['cpu']}, {machine['cores']} cores, {machine['memory_gib']} GiB, "
        f"{machine['gpus']} GPU(s), checkpoints on {machine['storage']}; torch "
        f"``{machine['torch']}``; a {config['checkpoint_gb']} GB checkpoint, "
        f"{config['world_size']} rank(s) under {config['launcher']}, "
        f"{config['rounds']} rounds after a warm-up, a checkpoint every "
        f"{config['intervals'][multiple]} steps ({multiple}x {unit})."
    )
    rows = []
    for name in names:
        entry, ratio, verdicts = summary[name], ratios[name], goals.get(name)
        rows += [
            f"   * - {name}",
            f"     - {shown(entry['stall_per_checkpoint_s'], '.3g', '')}",
            f"     - {ratio['stall_vs_dcp_save']:.3g}",
            f"     - {shown(entry['overhead_s'], '+.3g', '')}",
            f"     - {ratio['overhead_vs_dcp_save']:.3g}"
            + (" (noise)" if ratio["overhead_within_noise"] else ""),
            "     - "
            + (
                f"stall {stalls.GOAL_VERDICTS[verdicts['stall_per_checkpoint_s']['met']]}, "
                f"overhead {stalls.GOAL_VERDICTS[verdicts['overhead_s']['met']]}"
                if verdicts
                else "-"  # the page sets its goals for the strategy it recommends
            ),
        ]
    goal = f"at most {headline['stall_goal']}x, {headline['overhead_goal']}x dcp.save's"
    return "\n".join(
        [
            where,
            "",
            ".. list-table:: Median [lowest .. highest] over the rounds, in seconds",
            "   :header-rows: 1",
            "",
            "   * - strategy",
            "     - stall per checkpoint",
            "     - stall / dcp.save's",
            "     - total overhead",
            "     - overhead / dcp.save's",
            f"     - goals ({goal})",
            *rows,
            "",
        ]
    )


def insert_gpu_results(app: Sphinx, docname: str, source: list[str]) -> None:
    """``source-read`` of on_gpus: each ``GPU_RESULTS_MARKER``'s results file, as a table."""
    if docname != Path(ON_GPUS).stem or GPU_RESULTS_MARKER not in source[0]:
        return

    def table(match: re.Match) -> str:
        app.env.note_dependency(str(Path(app.confdir, match.group(1)).resolve()))
        return gpu_results_rst(app.confdir, match.group(1))

    source[0] = re.sub(rf"(?m)^{re.escape(GPU_RESULTS_MARKER)} (\S+)$", table, source[0])


# --------------------------------------------------------------------------
# API names link to PyTorch's docs (intersphinx, from the inventory the repository keeps)
# --------------------------------------------------------------------------

# Written by tools/torch_inventory.py from the torch the site is built with; read offline.
TORCH_INVENTORY = Path("_inventories", "torch.inv")
DCP_MODULE = "torch.distributed.checkpoint"


def torch_docs_url(confdir: str | os.PathLike = Path(__file__).parent) -> str:
    """PyTorch's docs of the release the inventory was written from (its ``# Version:``)."""
    with open(Path(confdir, TORCH_INVENTORY), "rb") as stream:
        stream.readline(), stream.readline()
        version = stream.readline().decode().split(":", 1)[1].strip()
    major, minor = version.split(".")[:2]
    return f"https://docs.pytorch.org/docs/{major}.{minor}/"


def intersphinx_mapping(confdir: str | os.PathLike = Path(__file__).parent) -> dict:
    """conf.py's ``intersphinx_mapping``: torch's docs, read from the repository's file."""
    return {"torch": (torch_docs_url(confdir), str(Path(confdir, TORCH_INVENTORY)))}


_LITERAL_NAME = re.compile(r"^[A-Za-z_][\w.]*$")
# Bare names the prose uses for something else: ``load_state_dict()`` there is Stateful's or
# nn.Module's method, not DCP's deprecated function of that name.
_NOT_BARE = {"load_state_dict", "save_state_dict", "state_dict"}


def dcp_target(text: str, names: dict[str, str], short: dict[str, str]) -> str | None:
    """The inventory name an inline literal of the prose means, or None.

    ``dcp.async_save`` and ``dcp.async_save()`` mean ``torch.distributed.checkpoint.async_save``;
    a full name is itself; a bare ``DefaultStager`` or ``get_state_dict`` is the one DCP class
    or function of that name (``short``), and a bare ``save`` or a method name is nothing.
    """
    text = text.strip()
    text = text[:-2] if text.endswith("()") else text
    if not _LITERAL_NAME.match(text):
        return None
    if text.startswith("dcp."):
        text = DCP_MODULE + text[3:]
    if text in names:
        return text
    return short.get(text)


def _inventory_names(app: Sphinx) -> tuple[dict[str, str], dict[str, str]]:
    """{full name: role} of the DCP names intersphinx knows, and {bare name: full name} of
    the classes and functions among them whose bare name means one documented object."""
    cached = getattr(app, "_dcp_inventory_names", None)
    if cached is not None:
        return cached
    from sphinx.ext.intersphinx import InventoryAdapter

    names, by_uri = {}, {}
    for role, items in InventoryAdapter(app.env).main_inventory.items():
        for name, item in items.items():
            if role.startswith("py:") and name.startswith(DCP_MODULE):
                names[name] = role
                if role in ("py:class", "py:function"):
                    by_uri.setdefault(name.rsplit(".", 1)[1], {}).setdefault(item[2], name)
    short = {}
    for bare, targets in by_uri.items():
        if len(targets) == 1 and (bare[0].isupper() or "_" in bare) and bare not in _NOT_BARE:
            short[bare] = min(targets.values(), key=len)
    app._dcp_inventory_names = (names, short)
    return names, short


def link_dcp_literals(app: Sphinx, doctree) -> None:
    """``doctree-read``: an inline literal of the prose that names a DCP object
    (````dcp.async_save````, ````DefaultStager````) becomes a ``py:obj`` cross-reference,
    which intersphinx resolves to PyTorch's docs, as a ``:func:`` role would."""
    from docutils import nodes
    from sphinx import addnodes

    names, short = _inventory_names(app)
    for literal in list(doctree.findall(nodes.literal)):
        if isinstance(literal.parent, (nodes.reference, addnodes.pending_xref, nodes.title)):
            continue  # a title stays the page's own heading, not a link off the site
        if isinstance(literal.parent, nodes.literal_block) or "xref" in literal["classes"]:
            continue
        target = dcp_target(literal.astext(), names, short)
        if target is None:
            continue
        xref = addnodes.pending_xref(
            "",
            refdomain="py",
            reftype="obj",
            reftarget=target,
            refexplicit=True,
            refwarn=False,
            refdoc=app.env.docname,
        )
        literal["classes"] += ["xref", "py", "py-obj"]
        literal.replace_self(xref)
        xref += literal


def setup(app: Sphinx) -> dict:
    app.connect("doctree-read", link_dcp_literals)
    app.connect("source-read", insert_torch_versions)
    app.connect("source-read", insert_gpu_results)
    app.connect("config-inited", _export_stamp_dir)
    app.connect("config-inited", _write_page_package_zip)
    app.connect("builder-inited", _start_quick_start, priority=100)
    app.connect("source-read", _finish_quick_start)
    app.connect("env-get-outdated", reread_recipe_pages)
    app.connect("env-get-outdated", reread_site_pages)
    app.connect("env-before-read-docs", forget_pickled_doctrees)
    app.connect("builder-inited", _add_template_filters)
    app.connect("build-finished", _copy_theme_webfonts)
    app.connect("build-finished", _write_standalone_downloads)
    app.connect("source-read", insert_page_header)
    app.connect("env-merge-info", merge_headers_read)
    app.connect("env-purge-doc", forget_header_read)
    app.connect("doctree-read", mark_page_work)
    return {"version": "1.0", "parallel_read_safe": True, "parallel_write_safe": True}
