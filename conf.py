"""Sphinx configuration for DCP Recipes: configuration only; the logic lives in dcp_site.py."""

import os
import sys

import pytorch_sphinx_theme2

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

project = "DCP Recipes"
author = "DCP Recipes contributors"
copyright = "2026, DCP Recipes contributors"

import dcp_site  # noqa: E402

extensions = [
    "sphinx.ext.intersphinx",
    "sphinx_gallery.gen_gallery",
    "myst_parser",
    "sphinx_design",
    "sphinx_copybutton",
    "dcp_site",
]

# torch.distributed.checkpoint names in code and prose link to the docs of the torch the site
# is built with, from the inventory in _inventories/ (tools/torch_inventory.py): no network.
intersphinx_mapping = dcp_site.intersphinx_mapping()
intersphinx_timeout = 5

source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
root_doc = "index"
exclude_patterns = [
    "_build",
    ".venv",
    "README.md",
    "recipes_source",
    "recipes/*.ipynb",
    "recipes/*.py",
    "recipes/*.zip",
    "recipes/*.md5",
    "tests",
    "_templates",
    "**/sg_execution_times.rst",
    "sg_execution_times.rst",
    ".github",
    ".pytest_cache",
    "_inventories",
]

sphinx_gallery_conf = {
    "examples_dirs": "recipes_source",
    "gallery_dirs": "recipes",
    # Execute every recipe; GALLERY_PATTERN=<regex> narrows it (the rest still render).
    "filename_pattern": os.environ.get("GALLERY_PATTERN", r"/recipes_source/"),
    # A pattern asks for its recipes to run, unchanged ones too: their output also depends
    # on page_tools, which Sphinx-Gallery's MD5 check of the recipe's own source cannot see.
    "run_stale_examples": "GALLERY_PATTERN" in os.environ,
    # The launcher is the gallery's scaffolding, not a recipe.
    "ignore_pattern": r"rank_launcher\.py|direct_io\.py|__init__\.py|/page_tools/",
    "within_subsection_order": "dcp_site.RecipeOrder",
    "reset_modules": ("matplotlib", "dcp_site.reset_recipe_outputs"),
    "reset_modules_order": "both",
    "download_all_examples": False,
    # Cells show what they print; a bare last expression is echoed only as HTML (the
    # tables of page_tools.figures), never as its repr.
    "capture_repr": ("_repr_html_",),
    "remove_config_comments": True,
    "show_memory": False,
    "promote_jupyter_magic": False,
    "default_thumb_file": "_static/dcp-thumb.png",
}

html_theme = "pytorch_sphinx_theme2"
html_theme_path = [pytorch_sphinx_theme2.get_html_theme_path()]
# _templates first: our layout strips the theme's third-party requests (see dcp_site.py).
templates_path = [
    "_templates",
    os.path.join(pytorch_sphinx_theme2.get_html_theme_path(), "templates"),
]
html_favicon = os.path.join(
    pytorch_sphinx_theme2.get_html_theme_path(), "static", "img", "pytorch-logo-flame.png"
)
html_title = "DCP Recipes"
html_static_path = ["_static"]
html_css_files = ["dcp-recipes.css"]
html_theme_options = {
    "navigation_with_keys": False,
    "show_lf_header": False,
    "show_lf_footer": False,
    "show_pytorch_org_link": False,
    "use_edit_page_button": False,
    "secondary_sidebar_items": ["page-toc"],
    # The header names this site, in the theme's own brand style, not PyTorch's logo: the
    # site is not pytorch.org's documentation.
    "logo": {"text": project},
    "article_header_end": [],
    "article_footer_items": [],
    "analytics_id": "",
    # llms.txt lists the pages; a Markdown copy of every page (and llms-full.txt, made of
    # them) would cost each build about 5 s, half of a warm `make html-noplot`.
    "llm_generate_md": "false",
    "llm_generate_full": "false",
}
html_context = {
    "theme_variables": pytorch_sphinx_theme2.get_theme_variables(),
    "default_mode": "light",
}

# Copy only code: prompts and captured output are excluded from the copy button.
copybutton_selector = "div:not(.sphx-glr-script-out) > div.highlight pre"
copybutton_prompt_text = r">>> |\.\.\. |\$ "
copybutton_prompt_is_regexp = True
copybutton_exclude = ".linenos, .gp, .go"

myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 3
