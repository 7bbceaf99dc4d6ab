"""Fixtures shared by the recipe tests and the site tests."""

from __future__ import annotations

import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from page_tools import object_store
from recipe_runner import HTML, ROOT, RecipeRunner


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Tests that launch recipes or a browser (tens of seconds each) start first: the run
    then ends on short tests on every worker, not on one long test while the others idle."""

    def launches(item: pytest.Item) -> bool:
        return "recipe_runner" in item.fixturenames or item.get_closest_marker("browser")

    items.sort(key=lambda item: not launches(item))


@pytest.fixture
def recipe_runner(tmp_path: Path) -> Iterator[RecipeRunner]:
    """Runs recipes with a private TMPDIR; ``recipe_runner.leftovers()`` lists what stayed."""
    with tempfile.TemporaryDirectory(prefix="dcp-", dir="/tmp") as short:
        yield RecipeRunner(tmp_path, Path(short))


@pytest.fixture(scope="session")
def site() -> Path:
    """The executed build; `make test` builds it before pytest runs."""
    if not (HTML / "index.html").exists():
        subprocess.run(["make", "html"], cwd=ROOT, check=True)
    return HTML


@pytest.fixture(scope="module")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[object_store.Store]:
    """A SeaweedFS server with the S3 pages' bucket, for a module's download runs (it takes
    seconds to start); ``AWS_*`` point at it while it runs, and nothing of it is left."""
    store = object_store.start(tmp_path_factory.mktemp("s3"), bucket="dcp-recipes")
    try:
        yield store
    finally:
        object_store.stop(store)
    assert not store.running() and store.bound_ports() == []
