"""The site's own Sphinx extension: the logic that conf.py only names.

* ``RecipeOrder``: the gallery lists recipes in reading order, not by file name.
* Run stamps: while a recipe executes, the rank launcher writes where it ran
  (torch, device, backend, world size, date) into ``recipes/.run-stamps``;
  this extension puts that stamp at the top of the recipe's page. A stamp is
  deleted right before its recipe runs, so a page never shows a stale one,
  and a recipe selected to run that leaves no stamp fails the build.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # Sphinx is imported by Sphinx; tools that read RECIPE_ORDER run without it
    from sphinx.application import Sphinx

GALLERY_DIR = "recipes"
SOURCE_DIR = "recipes_source"
STAMP_SUBDIR = ".run-stamps"
STAMP_DIR_ENV = "DCP_RECIPES_STAMP_DIR"  # read by recipes_source/rank_launcher.py

# The order a reader should take: basics, async, full overlap, its pitfalls, the numbers.
RECIPE_ORDER = (
    "save_load_recipe.py",
    "async_save_recipe.py",
    "default_stager_recipe.py",
    "staging_pitfalls_recipe.py",
    "checkpoint_stall_benchmark.py",
)


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


def forget_last_run(gallery_conf: dict, fname: str | None, when: str) -> None:
    """Sphinx-Gallery reset hook: drop a recipe's stamp right before it runs."""
    if when == "before" and fname:
        stamp = stamp_dir(gallery_conf["src_dir"]) / f"{Path(fname).stem}.json"
        stamp.unlink(missing_ok=True)


def _selected_to_run(app: Sphinx, stem: str) -> bool:
    conf = app.config.sphinx_gallery_conf
    if not conf.get("plot_gallery", True) or str(conf.get("plot_gallery")) in ("0", "False"):
        return False
    source = Path(app.confdir, SOURCE_DIR, f"{stem}.py")
    return re.search(conf["filename_pattern"], str(source)) is not None


def stamp_block(stamp: dict) -> str:
    """The reST admonition that says where a page was last executed."""
    where = (
        f"torch ``{stamp['torch']}`` · {stamp['device']} · backend ``{stamp['backend']}`` · "
        f"world size {stamp['world_size']} ({stamp['launcher']}) · {stamp['date']}"
    )
    return f".. admonition:: Last executed\n   :class: dcp-run-stamp\n\n   {where}\n"


NOT_RUN_BLOCK = (
    ".. admonition:: Not executed in this build\n"
    "   :class: dcp-run-stamp dcp-not-run\n\n"
    "   This page was rendered without running its code (``make html-noplot`` or a\n"
    "   ``GALLERY_PATTERN`` that leaves it out), so it shows no output. ``make html``\n"
    "   executes it.\n"
)


def insert_run_stamp(app: Sphinx, docname: str, source: list[str]) -> None:
    """``source-read``: put the run stamp under the title of each recipe page."""
    if not docname.startswith(f"{GALLERY_DIR}/") or docname.endswith("/index"):
        return
    stem = docname.split("/", 1)[1]
    if not Path(app.confdir, SOURCE_DIR, f"{stem}.py").exists():
        return
    stamp_path = stamp_dir(app.confdir) / f"{stem}.json"
    if not _selected_to_run(app, stem):
        block = NOT_RUN_BLOCK
    elif stamp_path.exists():
        block = stamp_block(json.loads(stamp_path.read_text()))
    else:
        from sphinx.util import logging

        logging.getLogger(__name__).warning(
            "recipe %s ran but left no run stamp: does it launch its ranks with rank_launcher?",
            stem,
            location=docname,
        )
        return
    source[0] = _after_title(source[0], block)


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


def setup(app: Sphinx) -> dict:
    app.connect("config-inited", _export_stamp_dir)
    app.connect("builder-inited", _add_template_filters)
    app.connect("build-finished", _copy_theme_webfonts)
    app.connect("source-read", insert_run_stamp)
    return {"version": "1.0", "parallel_read_safe": True, "parallel_write_safe": True}
