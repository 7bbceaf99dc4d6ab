"""Fixtures shared by the recipe tests and the site tests."""

from __future__ import annotations

import itertools
import os
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from page_tools import object_store
from recipe_runner import HTML, ROOT, RecipeRunner


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The longest tests start first, dealt out over the workers: marked ``long`` (10 s or
    more here), then those that launch recipes or a browser. pytest-xdist gives each worker
    an equal run of the collection, in order, and a worker that runs out takes tests from
    the end of another's run: so the run ends on short tests on every worker, not on one
    long test while the others idle (with them all at the front, one worker got them all)."""

    def rank(item: pytest.Item) -> int:
        if item.get_closest_marker("long"):
            return 0
        launches = "recipe_runner" in item.fixturenames or item.get_closest_marker("browser")
        return 1 if launches else 2

    workers = max(1, int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))
    first = sorted((item for item in items if rank(item) < 2), key=rank)
    rest = iter([item for item in items if rank(item) == 2])
    ordered, left = [], len(items)
    for worker in range(workers):
        size = left // (workers - worker)  # the run xdist's work-stealing gives this worker
        left -= size
        mine = first[worker::workers]
        ordered += mine + list(itertools.islice(rest, max(0, size - len(mine))))
    items[:] = ordered + list(rest)


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
