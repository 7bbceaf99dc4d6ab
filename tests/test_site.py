"""The site as a whole: the executed build in _build/html, its pages, and the build itself."""

from __future__ import annotations

import ast
import builtins
import json
import os
import pickle
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import pytest
import torch
import yaml
from bs4 import BeautifulSoup
from recipe_runner import (
    RECIPE_NAMES,
    RECIPES,
    ROOT,
    SAVE_LOAD_NUMBERS,
    assert_no_traceback,
    assert_prints_what_the_page_shows,
    page_download,
    parsed_html,
)
from sphinx_gallery.py_source_parser import split_code_and_text_blocks

import dcp_site
from dcp_site import (
    ARTIFACTS,
    LAUNCHER_IMPORT,
    NOT_RUN_BLOCK,
    dcp_target,
    imported_modules,
    is_page_statement,
    is_page_wrapper,
    launcher_code,
    module_import,
    notebook_launcher_cell,
    page_header,
    page_metrics,
    page_names,
    recipe_only,
    reread_recipe_pages,
    reread_site_pages,
    site_module_sources,
    standalone_script,
    torch_docs_url,
    write_if_changed,
)

RECIPE_SOURCES = [RECIPES / f"{name}.py" for name in RECIPE_NAMES]
FIXTURES = Path(__file__).parent / "site_fixtures"

# Calls that print when a cell runs them at top level: the launcher prints
# every rank's output under the cell that launched it.
PRINTING_CALLS = {"print", "run_on_ranks", "run_on_one_process"}
TROUBLESHOOTING_SECTIONS = [
    "A CPU backend must be enabled",
    "Training hangs while a save is in flight",
    "The last checkpoint has no",
    "The checkpoint holds weights from after the save",
    "Host memory grows with every save",
    "A checkpoint process runs out of",
    "A stager that is never closed",
    "The checkpoint directory differs between ranks",
    "speed changes from one minute to the next",
    "Training steps on CPU vary in time, with page faults in every step",
    "takes tens of milliseconds to return, for a millisecond of work",
]


def page(site: Path, name: str) -> BeautifulSoup:
    path = site / "recipes" / f"{name}.html"
    assert path.exists(), f"no page for recipe {name}"
    return parsed_html(path)


def cell_prints(code: str) -> bool:
    """True if a code cell itself (not a function it defines) calls print or a launcher."""
    for node in ast.parse(code).body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            continue
        for call in ast.walk(node):
            if isinstance(call, ast.Call) and getattr(call.func, "id", None) in PRINTING_CALLS:
                return True
    return False


def code_cells(source: Path) -> list[str]:
    _, blocks = split_code_and_text_blocks(str(source))[:2]
    return [block.content for block in blocks if block.type == "code" and block.content.strip()]


def blocks_in_order(doc: BeautifulSoup) -> list[tuple[str, str]]:
    """("code" | "out" | "figure", text) for the page's cells, in page order."""
    selector = "div.highlight-Python, div.sphx-glr-script-out, img.sphx-glr-single-img"
    kinds = []
    for element in doc.select(selector):
        classes = element.get("class", [])
        if "highlight-Python" in classes:
            kinds.append(("code", element.get_text()))
        elif "sphx-glr-script-out" in classes:
            kinds.append(("out", element.get_text()))
        else:
            kinds.append(("figure", element.get("src", "")))
    return kinds


def test_every_recipe_has_a_page(site):
    assert RECIPE_NAMES, "no recipes found"
    missing = [name for name in RECIPE_NAMES if not (site / "recipes" / f"{name}.html").is_file()]
    assert missing == [], "recipes without a page"  # (what is on each, the other tests read)
    assert (site / "index.html").exists()
    assert (site / "troubleshooting.html").exists()


@pytest.mark.parametrize("name", RECIPE_NAMES)
def test_each_printing_cell_has_its_output_under_it(site, name):
    cells = code_cells(RECIPES / f"{name}.py")
    blocks = blocks_in_order(page(site, name))
    code_positions = [i for i, (kind, _) in enumerate(blocks) if kind == "code"]
    assert len(code_positions) == len(cells), "every code cell is on the page"
    for cell, position in zip(cells, code_positions, strict=True):
        following = blocks[position + 1 : position + 3]
        outputs = [text for kind, text in following if kind == "out"]
        first_line = cell.strip().splitlines()[0]
        if cell_prints(cell):
            assert outputs and outputs[0].strip(), f"{name}: no output under cell {first_line!r}"


@pytest.mark.parametrize("name", RECIPE_NAMES)
def test_captured_output_shows_no_traceback_or_stray_warning(site, name):
    for out in page(site, name).select("div.sphx-glr-script-out"):
        assert_no_traceback(out.get_text())


def _reread_by(plot_gallery: bool, read_with: dict[str, str]) -> list[str]:
    """The recipe pages a build reads again (``reread_recipe_pages``), for a build that
    executes every recipe or none, after reads with the headers ``read_with``."""
    conf = {"plot_gallery": plot_gallery, "filename_pattern": r"/recipes_source/"}
    config = type("Config", (), {"sphinx_gallery_conf": conf})
    app = type("App", (), {"confdir": str(ROOT), "srcdir": str(ROOT), "config": config})
    env = type("Env", (), {"dcp_recipe_headers": read_with})
    return reread_recipe_pages(app, env, set(), set(), set())


def test_every_build_reads_every_recipe_page_again_unless_its_header_stays(site):
    """Its run stamp is this build's, also after a ``make html-noplot`` of an unchanged recipe
    (Sphinx would keep the doctree, and its "Not executed" stamp, of an unchanged page); a
    build that executes nothing reads again only pages last read with another header."""
    every_page = [f"recipes/{name}" for name in RECIPE_NAMES]
    not_run = {page: page_header(ROOT, page.split("/")[1], NOT_RUN_BLOCK) for page in every_page}
    assert _reread_by(True, not_run) == every_page
    assert _reread_by(False, {}) == every_page
    assert _reread_by(False, not_run) == []
    executed_once = {**not_run, every_page[0]: "Last executed ..."}
    assert _reread_by(False, executed_once) == every_page[:1]


def test_the_landing_page_is_read_again_to_show_the_quick_start_and_versions_for_a_new_recipe():
    """Not on every build: a warm ``make html-noplot`` reads no page again."""
    env = type("Env", (), {"found_docs": {"index", "versions", "recipes/save_load_recipe"}})
    idle = type("App", (), {"_quick_start": None})
    running = type("App", (), {"_quick_start": ("process", "scratch")})
    assert reread_site_pages(idle, env, set(), {"recipes/save_load_recipe"}, set()) == []
    assert reread_site_pages(running, env, set(), set(), set()) == ["index"]
    assert reread_site_pages(idle, env, {"recipes/new_recipe"}, set(), set()) == ["versions"]
    assert reread_site_pages(idle, env, set(), set(), {"recipes/old_recipe"}) == ["versions"]


def test_write_if_changed_leaves_an_unchanged_file_and_its_mtime_alone(tmp_path):
    path = tmp_path / "out" / "page_tools.zip"
    assert write_if_changed(path, b"zip bytes") is True
    os.utime(path, (1, 1))
    assert write_if_changed(path, "zip bytes") is False and path.stat().st_mtime == 1
    assert write_if_changed(path, "other bytes") is True and path.read_text() == "other bytes"


@pytest.mark.parametrize("name", RECIPE_NAMES)
def test_page_says_where_it_was_last_executed(site, name):
    stamp = page(site, name).select_one("div.dcp-run-stamp")
    assert stamp is not None, f"{name}: no run stamp"
    text = stamp.get_text(" ", strip=True)
    assert text.startswith("Last executed"), f"{name} was not executed: {text}"
    assert f"torch {torch.__version__}" in text
    assert re.search(r"backend (gloo|cpu:gloo,cuda:nccl)", text)
    assert re.search(r"world size \d+", text)
    assert re.search(r"\d{4}-\d{2}-\d{2} \d{2}:\d{2} UTC", text)
    assert "(CPU)" in text or "(GPU)" in text
    assert re.search(r"· [\d.]+ GiB memory · checkpoints on \S+ \(", text), text


def on_gpus_section(name: str) -> str:
    """The page's part of on_gpus.rst: what changes on GPUs, as plain text."""
    source = (ROOT / dcp_site.ON_GPUS).read_text()
    begin, end = f".. {name}: begin\n", f".. {name}: end\n"
    assert source.count(begin) == 1 and source.count(end) == 1, f"{name}: no section"
    return letters(source.split(begin)[1].split(end)[0])


def letters(text: str) -> str:
    """Only the letters and digits of ``text``: rendered HTML spaces inline code and curls
    quotes, its source does not."""
    return re.sub(r"[^a-z0-9]", "", text.lower())


@pytest.mark.parametrize("name", RECIPE_NAMES)
def test_a_performance_page_says_its_numbers_come_from_cpu_ranks(site, name):
    """Until a GPU build has run it, a page whose headline is a time, a speed or memory
    says at its top that its numbers come from CPU ranks, and what changes on GPUs."""
    stamp = page(site, name).select_one("div.dcp-run-stamp").get_text(" ", strip=True)
    on_cpu = "backend gloo" in stamp
    says = "come from CPU ranks with gloo" in stamp
    assert says == (name in dcp_site.PERFORMANCE_PAGES and on_cpu), stamp
    if says:
        assert on_gpus_section(name) in letters(stamp), stamp


def test_the_gpu_page_has_a_section_for_every_performance_page(site):
    doc = parsed_html(site / "on_gpus.html")
    text = letters(doc.get_text(" "))
    for name in dcp_site.PERFORMANCE_PAGES:
        assert on_gpus_section(name) in text, name
    assert set(dcp_site.PERFORMANCE_PAGES) <= set(RECIPE_NAMES)


def test_the_gpu_page_shows_a_gpu_runs_numbers_recomputed_from_its_raw_rounds(site):
    """Under "Measured once on a GPU": each strategy's stall and total overhead over
    dcp.save's, as the benchmark's own tests recompute them from the kept file's rounds,
    and a link to that file."""
    from test_checkpoint_stall_benchmark import overhead_within_noise, recompute

    kept = "_static/measured/checkpoint_stall_benchmark-h200.json"
    values = json.loads((ROOT / kept).read_text())["values"]
    assert values["config"]["accelerator"] and values["machine"]["gpus"] == 1
    multiple = max(values["config"]["intervals"], key=float)  # the file's own: 4x, then
    assert f"({multiple}x a save" in (site / "on_gpus.html").read_text()
    raw = recompute(values["runs"]["runs"], float(multiple))
    doc = parsed_html(site / "on_gpus.html")
    (table,) = doc.select("table")
    rows = [[td.get_text(" ", strip=True) for td in tr.select("td")] for tr in table.select("tr")]
    shown = {row[0]: row for row in rows if row}
    assert list(shown) == list(values["ratios"])  # every strategy that checkpoints

    def over_dcp_save(name, metric):
        return statistics.median(raw[name][metric]) / statistics.median(raw["dcp.save"][metric])

    for name, row in shown.items():  # shown to 3 significant digits
        stall, overhead = row[2], row[4].split()[0]
        assert float(stall) == pytest.approx(over_dcp_save(name, "stall_per_checkpoint_s"), 5e-3)
        assert float(overhead) == pytest.approx(over_dcp_save(name, "overhead_s"), 5e-3)
        noise = overhead_within_noise(raw[name]) or overhead_within_noise(raw["dcp.save"])
        assert row[4].endswith("(noise)") == noise, name
    links = [a["href"] for a in doc.select("a.download")]
    assert any(href.endswith(Path(kept).name) for href in links), links


def test_a_gpu_file_shows_the_interval_its_headline_names_in_its_unit(tmp_path):
    """A results file whose headline names its interval (a multiple of the upload's time) is
    shown at that interval; one from before, at its longest, of a save's time."""
    kept = "_static/measured/checkpoint_stall_benchmark-h200.json"
    results = json.loads((ROOT / kept).read_text())
    steps = results["values"]["config"]["intervals"]["4"]
    assert f"{steps} steps (4x a save's time)." in dcp_site.gpu_results_rst(ROOT, kept)
    results["values"]["headline"]["interval_multiple"] = 4
    named = tmp_path / "named.json"
    named.write_text(json.dumps(results))
    assert f"{steps} steps (4x the upload's time)." in dcp_site.gpu_results_rst(ROOT, named)


def test_versionadded_renders_where_used(site):
    used = {}
    for source in RECIPE_SOURCES:
        count = source.read_text().count(".. versionadded::")
        if count:
            used[source.stem] = count
    assert "default_stager_recipe" in used, "DefaultStager is new in 2.9: the page says so"
    for name, count in used.items():
        rendered = page(site, name).select("div.versionadded")
        assert len(rendered) == count, f"{name}: {count} versionadded, {len(rendered)} rendered"
        assert "2.9" in rendered[0].get_text()


@pytest.mark.parametrize("name", RECIPE_NAMES)
def test_page_header_links_to_script_notebook_and_source(site, name):
    header = page(site, name).select_one("div.dcp-page-links")
    assert header is not None, f"{name}: no links under the title"
    links = {a.get_text(" ", strip=True): a["href"] for a in header.select("a[href]")}
    assert list(links) == expected_header_links(name), links
    for text, href in links.items():
        target = (site / "recipes" / href.split("#")[0]).resolve()
        assert target.is_file() and target.stat().st_size > 0, f"{name}: {text} -> {href}"
    assert (site / "recipes" / links["View source"]).read_text() == (
        RECIPES / f"{name}.py"
    ).read_text(), "View source shows the recipe as it is in the repository"


def expected_header_links(name: str) -> list[str]:
    """Script, notebook, source, the files the recipe wrote for the reader, the launcher page,
    the page about the pages' proofs."""
    artifacts = [
        label
        for suffix, label in ARTIFACTS.items()
        if (ROOT / "recipes" / f"{name}{suffix}").exists()
    ]
    return [
        "Download script",
        "Download notebook",
        "View source",
        *artifacts,
        "How the ranks start",
        "How these pages measure and prove",
    ]


def unbound_names(tree: ast.Module) -> set[str]:
    """Names a module reads but never binds anywhere (a NameError waiting to happen)."""
    bound = set(dir(builtins)) | {"__file__", "__name__"}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import | ast.ImportFrom):
            bound |= {(alias.asname or alias.name).split(".")[0] for alias in node.names}
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            bound.add(node.id)
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            bound.add(node.name)
        elif isinstance(node, ast.arg):
            bound.add(node.arg)
        elif isinstance(node, ast.ExceptHandler) and node.name:
            bound.add(node.name)
        elif isinstance(node, ast.Global | ast.Nonlocal):
            bound |= set(node.names)
    loaded = {
        n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)
    }
    return loaded - bound


def launcher_source() -> str:
    return (RECIPES / "rank_launcher.py").read_text()


@pytest.mark.parametrize("name", RECIPE_NAMES)
def test_downloads_hold_the_recipe_and_the_launcher(site, name):
    script = page_download(name, ".py").read_text()
    assert "from rank_launcher import" not in script, "the download imports nothing of ours"
    tree = ast.parse(script)
    imported = {
        alias.name.split(".")[0]
        for node in ast.walk(tree)
        if isinstance(node, ast.Import | ast.ImportFrom)
        for alias in node.names
    } | {node.module.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert "page_tools" not in imported, "the download imports nothing of the page package"
    assert "sphinx_gallery_start_ignore" not in script
    assert unbound_names(tree) == set(), "names the download reads but never binds"
    defined = {
        n.name for n in ast.parse(script).body if isinstance(n, ast.FunctionDef | ast.ClassDef)
    }
    source = ast.parse((RECIPES / f"{name}.py").read_text()).body
    shown = {n.name for n in source if isinstance(n, ast.FunctionDef | ast.ClassDef)}
    assert shown <= defined, (
        f"functions the page shows, missing from its download: {shown - defined}"
    )
    assert launcher_code(launcher_source()) in script, "the launcher, verbatim, not a copy"
    modules = site_module_sources()
    for module in imported_modules((RECIPES / f"{name}.py").read_text(), modules):
        assert f"from {module} import" not in script
        assert launcher_code(modules[module]) in script, f"{module}.py, verbatim"
    assert script == standalone_script((RECIPES / f"{name}.py").read_text(), launcher_source())
    ast.parse(script)
    notebook = json.loads(page_download(name, ".ipynb").read_text())
    code = ["".join(cell["source"]) for cell in notebook["cells"] if cell["cell_type"] == "code"]
    assert not any("from rank_launcher import" in cell for cell in code)
    assert code[0] == notebook_launcher_cell(launcher_source(), name), "the launcher comes first"
    zipped = next((page_download(name, ".py").parent.parent).glob(f"*/{name}.zip"))
    with zipfile.ZipFile(zipped) as archive:
        assert archive.read(f"{name}.py").decode() == script
        assert json.loads(archive.read(f"{name}.ipynb")) == notebook


def copy_button_texts(doc: BeautifulSoup) -> list[str]:
    """What the copy button copies from each of the page's cells, in order."""
    return [pre.get_text() for pre in doc.select("div.highlight-Python div.highlight pre")]


@pytest.mark.parametrize("name", RECIPE_NAMES)
def test_notebook_holds_exactly_the_code_a_reader_copies(site, name):
    """The notebook's cells are the page's code blocks: running one runs the other."""
    notebook = json.loads(page_download(name, ".ipynb").read_text())
    cells = ["".join(cell["source"]) for cell in notebook["cells"] if cell["cell_type"] == "code"]
    texts = copy_button_texts(page(site, name))
    names = page_names("\n".join(texts))
    copied = [LAUNCHER_IMPORT.sub("", recipe_only(text, names), count=1) for text in texts]
    # After the launcher's cell: a cell for each site module the page imports.
    modules = imported_modules("\n".join(texts), site_module_sources())
    for module in modules:
        copied = [module_import(module).sub("", text, count=1) for text in copied]
    kept = [c.strip() for c in copied if c.strip()]
    assert [c.strip() for c in cells[1 + len(modules) :]] == kept


@pytest.mark.parametrize("name", RECIPE_NAMES)
def test_script_and_notebook_hold_the_same_statements(site, name):
    """Each recipe's test runs the notebook (``notebook_run``) and, with ``torchrun``, the
    script: the two downloads hold the same statements, the launcher's included, so that one
    run in a kernel also stands for ``python <recipe>.py``."""
    script = ast.parse(page_download(name, ".py").read_text())
    notebook = json.loads(page_download(name, ".ipynb").read_text())
    cells = ["".join(cell["source"]) for cell in notebook["cells"] if cell["cell_type"] == "code"]
    naming = f'os.environ.setdefault(RECIPE_ENV, "{name}")\n'
    assert cells[0].endswith(naming), "a kernel has no script name: the first cell gives it"
    cells[0] = cells[0].removesuffix(naming)
    statements = script.body[1:] if ast.get_docstring(script) else script.body
    assert ast.dump(ast.parse("\n".join(cells))) == ast.dump(ast.Module(statements, []))


@pytest.mark.long
def test_code_pasted_from_a_page_runs_beside_the_launcher(site, recipe_runner, tmp_path):
    """The getting-started page's code blocks, copied in order into one file, run as a script
    and compute what the page shows: its losses, and its checkpoint files' sizes."""
    name = "save_load_recipe"
    pasted = tmp_path / "pasted" / "my_checkpointing.py"
    pasted.parent.mkdir()
    pasted.write_text("\n\n".join(copy_button_texts(page(site, name))))
    launcher_link = parsed_html(site / "launcher.html").select_one(
        "a.download[href$='rank_launcher.py']"
    )
    assert launcher_link is not None, "the launcher page offers rank_launcher.py"
    shutil.copyfile((site / launcher_link["href"]).resolve(), pasted.parent / "rank_launcher.py")
    package_link = parsed_html(site / "measuring.html").select_one(
        "a.download[href$='page_tools.zip']"
    )
    assert package_link is not None, "the measuring page offers page_tools.zip"
    with zipfile.ZipFile((site / package_link["href"]).resolve()) as archive:
        archive.extractall(pasted.parent)
    result = subprocess.run(
        [sys.executable, str(pasted)],
        cwd=pasted.parent,
        env=recipe_runner.env(DCP_RECIPES_WORLD_SIZE="2"),
        capture_output=True,
        text=True,
        timeout=300,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    assert output.count(" other values compared, 0 differ") == 5, output
    assert_no_traceback(output)
    assert_prints_what_the_page_shows(output, name, SAVE_LOAD_NUMBERS)


PAGE_FIXTURE = '''\
"""Title
=====
"""

# %%
import os

from page_tools import proofs
from rank_launcher import run_on_ranks


def train(directory):
    print("training")
    # sphinx_gallery_start_ignore
    print("hidden")
    # sphinx_gallery_end_ignore


# %%
# The page watches the save:

with proofs.state_given_to(os, "getcwd") as saved:
    run_on_ranks(train, "x")
    print("inside")

# %%

proofs.same_state("claim", saved, saved, "the same")
ranks_seen = len(saved.by_rank)  # uses only a name the page's own work bound: page work too
print(ranks_seen)
'''

RECIPE_ONLY_FIXTURE = '''\
"""Title
=====
"""

# %%
import os

from rank_launcher import run_on_ranks


def train(directory):
    print("training")


# %%
# The page watches the save:

run_on_ranks(train, "x")
print("inside")
'''


def test_downloads_leave_the_pages_own_work_out():
    assert recipe_only(PAGE_FIXTURE) == RECIPE_ONLY_FIXTURE


def _page_work_problems(source: str) -> list[str]:
    """Where a recipe uses page_tools other than in cells of its own, at top level."""
    tree = ast.parse(source)
    names = page_names(source)
    problems = [
        f"line {node.lineno}: {node.name} uses the page package: visible functions are recipe code"
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef | ast.ClassDef)
        and any(isinstance(sub, ast.Name) and sub.id in names.package for sub in ast.walk(node))
    ]
    for lineno, code in code_blocks_of(source):
        body = ast.parse(code).body
        page = [is_page_statement(n, names) or is_page_wrapper(n, names) for n in body]
        if any(page) and not all(page) and not any(_is_page_import(n) for n in body):
            problems.append(f"the cell at line {lineno} mixes recipe code and page work")
    return problems


def code_blocks_of(source: str) -> list[tuple[int, str]]:
    """(first line, code) of each code block Sphinx-Gallery makes of a recipe's source."""
    with tempfile.NamedTemporaryFile("w", suffix=".py") as file:
        file.write(source)
        file.flush()
        _, blocks = split_code_and_text_blocks(file.name)
    return [(lineno, text) for kind, text, lineno in blocks if kind == "code"]


def _is_page_import(node: ast.stmt) -> bool:
    return isinstance(node, ast.ImportFrom) and (node.module or "").startswith("page_tools")


def test_page_work_check_finds_page_tools_inside_a_recipe_function():
    mixed = PAGE_FIXTURE.replace('    print("training")', '    print("training")\n    proofs.x()')
    assert any("train uses the page package" in p for p in _page_work_problems(mixed))
    assert _page_work_problems(PAGE_FIXTURE) == []


@pytest.mark.parametrize("source", RECIPE_SOURCES, ids=[p.stem for p in RECIPE_SOURCES])
def test_page_work_lives_in_cells_of_its_own(source):
    assert _page_work_problems(source.read_text()) == []


def test_quick_start_ran_twice_in_the_build_and_resumed(site):
    """The landing page's quick start: the script ran under torchrun, then resumed."""
    shown = parsed_html(site / "index.html").get_text()
    first, again = (
        (ROOT / "recipes" / "quick_start.out.txt")
        .read_text()
        .split("--- the same command again ---")
    )
    assert "no checkpoint: starting at step 0" in first and "saved step-20" in first
    assert "resuming from step-20" in again and "saved step-40" in again
    assert "resuming from step-20" in shown, "the landing page shows this build's output"


# The set-up every page needs: visible and self-contained on each page, and the same code on
# every page that has it (only the sizes, WIDTH, DEPTH, BATCH and LR, differ).
SHARED_PIECES = ("ToyModel", "AppState", "device_for_this_rank", "build_sharded_model")
SHARED_PIECES += (
    "staging_options",
    "host_writer",
    "verify_checkpoint",
    "IncompleteCheckpointError",
)


def test_shared_pieces_are_the_same_code_on_every_page():
    versions: dict[str, dict[str, list[str]]] = {}
    for source in RECIPE_SOURCES:
        for node in ast.parse(source.read_text()).body:
            if isinstance(node, ast.FunctionDef | ast.ClassDef) and node.name in SHARED_PIECES:
                pages = versions.setdefault(node.name, {}).setdefault(ast.dump(node), [])
                pages.append(source.stem)
    assert set(versions) >= {"ToyModel", "AppState", "build_sharded_model"}
    differing = {
        name: list(by_code.values()) for name, by_code in versions.items() if len(by_code) > 1
    }
    assert differing == {}, "pages that define a shared piece differently, grouped by version"


@pytest.mark.parametrize("source", RECIPE_SOURCES, ids=[p.stem for p in RECIPE_SOURCES])
def test_a_page_is_a_recipe_not_a_test_harness(source):
    """At most 600 lines; hidden code (with its markers) at most 10% of the code lines."""
    metrics = page_metrics(source.read_text())
    assert metrics["lines"] <= 600, metrics
    assert metrics["hidden_lines"] <= 0.1 * metrics["code_lines"], metrics


def test_site_chrome_is_this_sites_own(site):
    """No cookie banner or consent script, no other organisation's copyright, our footer."""
    for path in [site / "index.html", site / "launcher.html"] + [
        site / "recipes" / f"{name}.html" for name in RECIPE_NAMES
    ]:
        html = path.read_text()
        assert "cookie" not in html.lower(), f"{path.name}: a cookie banner or script"
        for foreign in ("Meta Platforms", "Linux Foundation", "osano", "fbq(", "googletagmanager"):
            assert foreign not in html, f"{path.name}: {foreign}"
        footer = parsed_html(path).select_one("footer.dcp-footer")
        assert footer is not None and "DCP Recipes contributors" in footer.get_text(), path.name
        brand = parsed_html(path).select_one("a.navbar-brand")
        assert brand is not None and brand.get_text(strip=True) == "DCP Recipes", path.name
        assert brand.select_one("span.logo__title") and not brand.select("img"), path.name


# What the docs page of the torch the site is built with documents, by the names the pages use.
DOCS_LINKS = {
    "dcp.async_save": "torch.distributed.checkpoint.state_dict_saver.async_save",
    "DefaultStager": "torch.distributed.checkpoint.staging.DefaultStager",
    "StagingOptions": "torch.distributed.checkpoint.staging.StagingOptions",
    "FileSystemWriter": "torch.distributed.checkpoint.FileSystemWriter",
    "dcp.save": "torch.distributed.checkpoint.state_dict_saver.save",
    "dcp.load": "torch.distributed.checkpoint.state_dict_loader.load",
}


def docs_links(doc: BeautifulSoup) -> tuple[set, set]:
    """(text, anchor) of the links to PyTorch's docs in the page's code, and in its prose."""
    base = torch_docs_url() + "distributed.checkpoint.html#"
    code, prose = set(), set()
    for link in doc.select(f'a[href^="{base}"]'):
        found = (link.get_text(), link["href"][len(base) :])
        (code if link.find_parent("pre") else prose).add(found)
    return code, prose


def test_dcp_names_link_to_the_docs_of_the_torch_the_site_runs(site):
    """Code (Sphinx-Gallery's links) and prose link DCP's names to the docs, by intersphinx
    from the inventory in _inventories/ (the build reads no network); make html-noplot too."""
    assert torch_docs_url() == "https://docs.pytorch.org/docs/{}.{}/".format(
        *torch.__version__.split(".")[:2]
    ), "the inventory is not of the torch the site runs: tools/torch_inventory.py"
    code, prose = set(), set()
    for name in RECIPE_NAMES:
        page_code, page_prose = docs_links(page(site, name))
        code |= page_code
        prose |= page_prose
    for short, anchor in DOCS_LINKS.items():
        texts = {text.rsplit(".", 1)[-1] for text, found in code if found == anchor}
        assert short.rsplit(".", 1)[-1] in texts, f"code: {short} does not link to #{anchor}"
        assert any(found == anchor for _, found in prose), f"prose: no link to #{anchor}"
    conf = (ROOT / "conf.py").read_text()
    assert "sphinx.ext.intersphinx" in conf and "intersphinx_mapping" in conf


def test_the_docs_inventory_is_kept_and_current():
    """The repository's inventory holds the issue's names and matches the installed torch."""
    sys.path.insert(0, str(ROOT / "tools"))
    import torch_inventory

    (location,) = [loc for _, loc in dcp_site.intersphinx_mapping(ROOT).values()]
    assert Path(location).is_file(), "intersphinx reads a file of the repository, no URL"
    names = {name: uri for items in torch_inventory.read().values() for name, uri in items.items()}
    for name in DOCS_LINKS.values():
        assert names.get(name) == f"distributed.checkpoint.html#{name}", name
    assert names["torch.distributed.checkpoint.async_save"].endswith("state_dict_saver.async_save")
    checked = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "torch_inventory.py"), "--check"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr


def test_prose_literals_link_only_names_dcp_documents():
    names = {
        "torch.distributed.checkpoint.async_save": "py:function",
        "torch.distributed.checkpoint.staging.DefaultStager": "py:class",
    }
    short = {"DefaultStager": "torch.distributed.checkpoint.staging.DefaultStager"}
    assert dcp_target("dcp.async_save()", names, short) == "torch.distributed.checkpoint.async_save"
    assert dcp_target("DefaultStager", names, short) == short["DefaultStager"]
    for other in ("dcp.save_everything", "stager.close()", "load_state_dict()", "x = 1", "save"):
        assert dcp_target(other, names, short) is None, other


def test_landing_page_has_a_card_per_recipe(site):
    doc = parsed_html(site / "index.html")
    cards = doc.select("div.sd-card")
    linked = {a["href"].split("#")[0] for card in cards for a in card.select("a[href]")}
    for name in RECIPE_NAMES:
        assert f"recipes/{name}.html" in linked, f"no card for {name}"
    for card in cards:
        assert card.select_one(".sd-card-footer"), "each card says what the recipe needs"


def test_troubleshooting_page_covers_every_known_failure(site):
    doc = parsed_html(site / "troubleshooting.html")
    headings = [h.get_text(" ", strip=True) for h in doc.select("section h2")]
    for expected in TROUBLESHOOTING_SECTIONS:
        assert any(expected in h for h in headings), f"missing section {expected!r}: {headings}"
    text = doc.get_text()
    assert text.count("Symptom.") >= len(TROUBLESHOOTING_SECTIONS)
    assert text.count("Fix.") >= len(TROUBLESHOOTING_SECTIONS)


def test_copy_buttons_copy_code_not_output(site):
    conf = (ROOT / "conf.py").read_text()
    assert 'copybutton_selector = "div:not(.sphx-glr-script-out) > div.highlight pre"' in conf
    assert (site / "_static" / "copybutton.js").exists()


def test_workflows_parse_and_run_make_test():
    workflows = sorted((ROOT / ".github" / "workflows").glob("*.y*ml"))
    assert workflows, "no GitHub workflow"
    commands = []
    for path in workflows:
        workflow = yaml.safe_load(path.read_text())
        assert workflow.get("jobs"), f"{path.name}: no jobs"
        for job in workflow["jobs"].values():
            assert job.get("runs-on") and job.get("steps"), path.name
            commands += [step.get("run", "") for step in job["steps"]]
    assert any("make test" in c for c in commands), "CI runs make test"
    assert any("make reruns" in c for c in commands), "CI runs what make test leaves out"
    assert any("make html" in c for c in commands), "a job builds the site"
    assert any("make gpu-check" in c for c in commands), "the GPU job runs make gpu-check"


def download_runs(test_module: Path) -> dict[str, list[str]]:
    """The tests of ``test_module`` that run the page's download alone to its end
    (``assert_ok(recipe_runner.notebook_run(...))`` or ``...python(...)``; a run that must
    fail on bad input is not one): test name -> the names of its pytest markers."""
    runs = {}
    for node in ast.parse(test_module.read_text()).body:
        if not isinstance(node, ast.FunctionDef) or not node.name.startswith("test_"):
            continue
        calls = {
            ast.unparse(call.args[0].func)
            for call in ast.walk(node)
            if isinstance(call, ast.Call)
            and ast.unparse(call.func) == "assert_ok"
            and call.args
            and isinstance(call.args[0], ast.Call)
        }
        if calls & {"recipe_runner.notebook_run", "recipe_runner.python"}:
            runs[node.name] = [ast.unparse(marker).split(".")[-1] for marker in node.decorator_list]
    return runs


@pytest.mark.parametrize("name", RECIPE_NAMES)
def test_every_pages_download_runs_alone_in_make_reruns(name):
    """Each page's test module runs its download alone, marked ``download`` (`make reruns`,
    CI on every change): `make test` reads the build, and runs one page's code again, the
    getting-started page's, pasted from its copy buttons (test_code_pasted_from_a_page...)."""
    runs = download_runs(ROOT / "tests" / f"test_{name}.py")
    assert runs, f"no test runs {name}'s download alone"
    in_make_test = [test for test, markers in runs.items() if "download" not in markers]
    assert in_make_test == [], "make test reads the build; the reruns are make reruns'"


def copy_site(tmp_path: Path) -> Path:
    """The site's sources, without build output, in a temporary folder."""
    copy = tmp_path / "site"
    ignore = shutil.ignore_patterns(
        ".venv", "_build", "recipes", "tests", ".git", "__pycache__", ".*cache"
    )
    shutil.copytree(ROOT, copy, ignore=ignore)
    return copy


def sphinx_build(source: Path, *options: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "sphinx", "-b", "html", "-W", "--keep-going", *options]
        + [str(source), str(source / "_build" / "html")],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=600,
    )


@pytest.mark.long
def test_a_raising_recipe_fails_the_build_with_its_rank_traceback(tmp_path):
    copy = copy_site(tmp_path)
    shutil.copyfile(FIXTURES / "broken_recipe.py", copy / "recipes_source" / "broken_recipe.py")
    # Sphinx-Gallery prints a failing recipe's error the same way whether the build then goes
    # on (make html) or stops there; stopping spares the test rendering every other page
    # (8 s here instead of 36 s).
    result = sphinx_build(
        copy,
        "-D",
        "abort_on_example_error=1",
        GALLERY_PATTERN=r"broken_recipe\.py",
        TMPDIR=str(tmp_path),
    )
    log = result.stdout + result.stderr
    assert result.returncode != 0, log[-3000:]
    assert "broken_recipe" in log
    assert "recipe 'broken_recipe': rank 1 failed: rank 1 raised" in log
    assert "RuntimeError: checkpoint directory vanished" in log
    assert "about to fail on rank 1" in log, "the failing rank's output is in the error"


@pytest.mark.long
def test_a_pattern_build_runs_its_recipes_again_though_their_source_is_unchanged(tmp_path):
    # Their output depends on page_tools too, which the gallery's MD5 check does not read.
    copy, results = copy_site(tmp_path), []
    written = copy / "recipes" / ".results" / "verify_checkpoint_recipe.json"
    for _ in range(2):
        result = sphinx_build(copy, GALLERY_PATTERN=r"verify_checkpoint_recipe\.py")
        assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
        results.append((written.stat().st_mtime_ns, json.loads(written.read_text())))
    (first_written, first), (second_written, second) = results
    assert second_written > first_written, "the second build ran the recipe again"
    held = [{name: claim["held"] for name, claim in r["claims"].items()} for r in (first, second)]
    assert held[0] and held[1] == held[0], "the same claims, decided again"


@pytest.mark.long
def test_noplot_build_renders_every_page_without_running_it(tmp_path):
    copy = copy_site(tmp_path)
    # As make html-noplot builds: its pages read and written by several processes (-j).
    noplot = ("-D", "plot_gallery=0", "-j", "2")
    result = sphinx_build(copy, *noplot)
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    for name in RECIPE_NAMES:
        doc = parsed_html(copy / "_build" / "html" / "recipes" / f"{name}.html")
        assert doc.select("div.highlight-Python"), f"{name}: no code rendered"
        assert not doc.select("div.sphx-glr-script-out"), f"{name}: output without running"
        stamp = doc.select_one("div.dcp-run-stamp").get_text(" ", strip=True)
        assert stamp.startswith("Not executed in this build")

    # Warm, the same build reads no page again (make html-noplot in seconds) and leaves the
    # downloads as the first wrote them: standalone, not the gallery's files Sphinx copies.
    downloads = copy / "_build" / "html" / "_downloads"
    first = {path: path.read_bytes() for path in downloads.glob("*/*") if path.suffix != ".zip"}
    again = sphinx_build(copy, *noplot)
    assert again.returncode == 0, (again.stdout + again.stderr)[-3000:]
    assert "0 added, 0 changed, 0 removed" in again.stdout, again.stdout
    assert not re.search(r"(reading sources|writing output)\.\.\. \[", again.stdout), again.stdout
    assert {path: path.read_bytes() for path in first} == first
    assert all(b"def run_on_ranks" in first[p] for p in first if p.stem in RECIPE_NAMES)
    # The pages that show the committed version matrix are read again when it changes.
    doctrees = copy / "_build" / "html" / ".doctrees"
    environment = pickle.loads((doctrees / "environment.pickle").read_bytes())
    matrix = str((copy / dcp_site.VERSION_RESULTS).resolve())
    for docname in ("index", "versions", f"recipes/{RECIPE_NAMES[0]}"):
        assert matrix in {str(Path(copy, d).resolve()) for d in environment.dependencies[docname]}


def test_a_parallel_build_writes_the_pages_it_read_not_those_an_earlier_build_cached(tmp_path):
    # Sphinx 7.2 pickles the doctrees of a build that read its pages one at a time; a later
    # build that reads more than 5 in parallel wrote those instead of what it had just read.
    project = tmp_path / "project"
    project.mkdir()
    (project / "conf.py").write_text(
        f"import sys\nsys.path.insert(0, {str(ROOT)!r})\n"
        "from dcp_site import forget_pickled_doctrees\n\n"
        "def setup(app):\n"
        "    app.connect('env-before-read-docs', forget_pickled_doctrees)\n"
    )
    pages = [f"page{n}" for n in range(7)]
    (project / "index.rst").write_text(
        "Index\n=====\n\n.. toctree::\n\n" + "".join(f"   {p}\n" for p in pages)
    )

    def build(text: str, jobs: str) -> None:
        for name in pages:
            (project / f"{name}.rst").write_text(f"{name}\n=====\n\n{text} of {name}\n")
        result = sphinx_build(project, "-j", jobs)
        assert result.returncode == 0, result.stdout + result.stderr

    build("the first text", "1")
    build("the second text", "2")
    written = [(project / "_build" / "html" / f"{p}.html").read_text() for p in pages]
    assert all(f"the second text of {p}" in html for p, html in zip(pages, written, strict=True))


@pytest.mark.long
@pytest.mark.browser
def test_pages_in_a_browser(site):
    """Headless chromium: every page loads offline, with code, output and copy buttons."""
    from site_browser import check_pages

    pages = ["index.html"] + [f"recipes/{name}.html" for name in RECIPE_NAMES]
    # Every copy button on the landing page and the model page; the first and last elsewhere.
    every_copy_on = {"index.html", f"recipes/{dcp_site.RECIPE_ORDER[0].removesuffix('.py')}.html"}
    reports = check_pages(site, pages, ROOT / "_build" / "screenshots", every_copy_on=every_copy_on)
    for report in reports:
        assert report.status == 200 and report.title and report.h1, report.summary()
        assert not report.errors, report.summary()
        assert report.has_code and report.has_copy_button and report.copies_ok, report.summary()
        assert report.output_blocks_with_copy_button == 0, report.summary()
        assert Path(report.screenshot).exists() or (ROOT / "_build" / report.screenshot).exists()
    for report in reports:
        assert report.cookie_banners == 0 and report.footer_visible, report.summary()
        brand = report.brand
        assert brand["text"] == "DCP Recipes" and brand["visible"], report.summary()
        assert brand["images"] == 0, f"the theme's PyTorch logo in the header: {report.summary()}"
    overflowing = {report.page: report.overflowing for report in reports if report.overflowing}
    assert overflowing == {}, "output wider than the column at 1280 px"
    for report in reports[1:]:
        assert report.has_output, report.summary()
        assert report.run_stamp.startswith("Last executed"), report.summary()
        name = Path(report.page).stem
        texts = [text for text, _, _ in report.header_links]
        assert texts == expected_header_links(name), report.summary()
        assert all(status == 200 for *_, status in report.header_links), report.summary()


@pytest.mark.browser
def test_a_page_that_reaches_outside_is_reported_and_nothing_leaves(tmp_path):
    """A request to another host, by name or by address, is listed and never connects."""
    from site_browser import check_pages

    outside = ["http://192.0.2.1/pixel.png", "https://fonts.example.com/font.css"]
    (tmp_path / "page.html").write_text(
        f'<html><head><title>t</title><link rel="stylesheet" href="{outside[1]}"></head>'
        f'<body><h1>t</h1><img src="{outside[0]}"><img src="local.png"></body></html>'
    )
    (tmp_path / "local.png").write_bytes(b"")
    (report,) = check_pages(tmp_path, ["page.html"], tmp_path / "shots", check_copy=False)
    assert sorted(report.external_requests) == sorted(outside), report.summary()
    blocked = dict(line.rsplit(": ", 1) for line in report.blocked_requests)
    assert sorted(blocked) == sorted(outside), report.blocked_requests
    # Refused at the proxy (Debian's chromium names it so; others may say SOCKS), not by DNS
    # or the network: nothing was sent anywhere but to the closed loopback port.
    proxy_errors = {"net::ERR_PROXY_CONNECTION_FAILED", "net::ERR_SOCKS_CONNECTION_FAILED"}
    assert set(blocked.values()) <= proxy_errors, blocked
    assert report.failed_requests == [], report.summary()
