"""Fixtures shared by the recipe tests and the site tests."""

from __future__ import annotations

from pathlib import Path

import pytest
from recipe_runner import RecipeRunner


@pytest.fixture
def recipe_runner(tmp_path: Path) -> RecipeRunner:
    """Runs recipes with a private TMPDIR; ``recipe_runner.leftovers()`` lists what stayed."""
    return RecipeRunner(tmp_path)
