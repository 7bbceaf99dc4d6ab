"""The committed version matrix on a page: checkpoints saved by one torch release and loaded
by another (``_versions/results.json``, written by ``make versions CROSS=1``), as tables,
and the claims a page makes from it.

``committed(root)`` reads the file with the site's own definitions (``dcp_site``: the
releases, the kinds of checkpoint); ``grid`` and ``failures`` are ``figures.Table`` s;
``outcome`` is one pair's; ``cross_version_script`` is the matrix's own script, imported
from ``tools/version_checks``, so that a page recomputes exactly the values a release saved.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

from page_tools import figures, results

ROOT = Path(__file__).resolve().parents[2]  # the repository: recipes_source/page_tools/..


@dataclasses.dataclass
class Matrix:
    results: dict  # the results file
    versions: tuple[str, ...]  # dcp_site.TORCH_VERSIONS, oldest first
    kinds: dict  # dcp_site.CHECKPOINT_KINDS


def committed(root: Path = ROOT) -> Matrix:
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    import dcp_site

    return Matrix(
        dcp_site.load_version_results(root), dcp_site.TORCH_VERSIONS, dcp_site.CHECKPOINT_KINDS
    )


def outcome(matrix: Matrix, kind: str, saved_by: str, loaded_by: str) -> dict | None:
    """One pair's outcome (``status``, ``error``, ``where``, and the way through's as ``via``),
    or None where it was not measured."""
    about = matrix.kinds[kind]
    row = matrix.results.get(about["key"], {}).get(saved_by, {})
    found = row.get("loaded_by", {}).get(loaded_by)
    if found is None:
        return None
    return {**found, "via": row.get(about["via"], {}).get(loaded_by)}


def pairs(matrix: Matrix, kind: str) -> list[tuple[str, str, dict | None]]:
    return [
        (saved_by, loaded_by, outcome(matrix, kind, saved_by, loaded_by))
        for saved_by in matrix.versions
        for loaded_by in matrix.versions
    ]


def _errors(matrix: Matrix) -> dict[tuple[str, str], int]:
    """Each distinct (first error line, where) of a failed load, numbered E1, E2, ..."""
    numbers: dict[tuple[str, str], int] = {}
    for kind in matrix.kinds:
        for _, _, found in pairs(matrix, kind):
            if found is not None and found["status"] != "passed":
                numbers.setdefault(
                    (found.get("error", ""), found.get("where", "")), len(numbers) + 1
                )
    return numbers


def _cell(found: dict | None, numbers: dict) -> str:
    if found is None:
        return "not measured"
    if found["status"] == "passed":
        return "loads"
    said = f"fails (E{numbers[(found.get('error', ''), found.get('where', ''))]})"
    via = found.get("via")
    if via is None:
        return said
    return said + ("; way through loads" if via["status"] == "passed" else "; way through fails")


def grid(matrix: Matrix, kind: str) -> figures.Table:
    """Saved by (rows), loaded by (columns): loads, or fails (its error's number)."""
    numbers = _errors(matrix)
    rows = [
        [saved_by] + [_cell(outcome(matrix, kind, saved_by, v), numbers) for v in matrix.versions]
        for saved_by in matrix.versions
    ]
    title = matrix.kinds[kind]["title"]
    return figures.Table(["saved by \\ loaded by", *matrix.versions], rows, caption=title)


def failures(matrix: Matrix) -> figures.Table:
    """Every distinct first error line: where it was raised, the pairs, the way through."""
    rows = []
    for (error, where), number in _errors(matrix).items():
        seen, through = [], set()
        for kind in matrix.kinds:
            for saved_by, loaded_by, found in pairs(matrix, kind):
                if (
                    found
                    and found["status"] != "passed"
                    and (found.get("error"), found.get("where")) == (error, where)
                ):
                    seen.append(f"{kind}: {saved_by} -> {loaded_by}")
                    via = found.get("via")
                    through.add("not measured" if via is None else via["status"])
        rows.append([f"E{number}", error, where, "; ".join(seen), ", ".join(sorted(through))])
    columns = ["", "first error line", "raised at", "kind: saved by -> loaded by", "way through"]
    return figures.Table(columns, rows, caption="Every load that failed")


def newer_to_older_only(claim: str, matrix: Matrix) -> dict:
    """Decide that every failed load is of a checkpoint saved by a newer release than the one
    loading it, and that the way through loaded each; record how many pairs were measured."""
    order = {version: i for i, version in enumerate(matrix.versions)}
    measured, failed, older_reads_newer, through = {}, [], [], []
    for kind in matrix.kinds:
        found = [pair for pair in pairs(matrix, kind) if pair[2] is not None]
        measured[kind] = len(found)
        for saved_by, loaded_by, o in found:
            if o["status"] != "passed":
                failed.append(f"{kind}: {saved_by} -> {loaded_by}")
                older_reads_newer.append(order[saved_by] > order[loaded_by])
                through.append(o.get("via") is not None and o["via"]["status"] == "passed")
    results.record("pairs-measured", measured)
    results.record("pairs-failed", failed)
    savers = sorted({pair.split(": ")[1].split(" ->")[0] for pair in failed}, key=order.get)
    results.claim(
        claim,
        all(older_reads_newer) and all(through),
        figures.wrap(
            f"{sum(measured.values())} pairs measured "
            f"({', '.join(f'{kind} {count}' for kind, count in measured.items())}): "
            f"{len(failed)} loads failed, every one an older torch reading a checkpoint saved "
            f"by {', '.join(savers) or 'none'}, and the way through loaded each"
        ),
        measured=measured,
        failed=failed,
    )
    return measured


def every_pair_loads(claim: str, matrix: Matrix, kind: str) -> int:
    """Decide that every measured pair of one kind loaded, whichever release saved it."""
    found = [(s, v, o) for s, v, o in pairs(matrix, kind) if o is not None]
    failed = [f"{s} -> {v}" for s, v, o in found if o["status"] != "passed"]
    results.claim(
        claim,
        bool(found) and not failed,
        f"{matrix.kinds[kind]['title']}: {len(found)} pairs measured, {len(failed)} failed",
        measured=len(found),
        failed=failed,
    )
    return len(found)


def cross_version_script(root: Path = ROOT) -> ModuleType:
    """``tools/version_checks/cross_version.py``, the script every release of the matrix ran."""
    path = root / "tools" / "version_checks" / "cross_version.py"
    spec = importlib.util.spec_from_file_location("cross_version", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def saved_by_the_matrix_script(seed: int = 0) -> dict:
    """The state ``cross_version.py`` saves (one Adam step of its model), recomputed here.
    It trains: run it in a process of its own, not in a page's launching process, which
    must stay free of threads to fork beside (autograd's first backward pass starts one
    per GPU, ``pt_autograd_0``)."""
    script = cross_version_script()
    return script.state(*script.model_and_optimizer(seed=seed))


def error_line(error: BaseException) -> str:
    """An exception as the matrix records a first error line: ``Type: message`` (its first
    line), or ``Type`` alone where the message is empty (``tools/versions.first_error``)."""
    message = str(error).splitlines()[0] if str(error) else ""
    return f"{type(error).__name__}: {message}" if message else type(error).__name__


def the_matrix_says(
    claim: str,
    matrix: Matrix,
    kind: str,
    saved_by: str,
    loaded_by: str,
    status: str | None,
    errors: list[BaseException | str | None],
) -> None:
    """Decide that what a page just saw is what the matrix measured for that pair: the same
    status, and where it failed, the matrix's first error line among the errors the page saw
    (exceptions, or their ``error_line``): ``dcp.load``'s own and its cause. The matrix's is
    the first traceback its run printed: the cause, which DCP logs from 2.12 on, or DCP's
    own ``AssertionError`` on 2.9 to 2.11, which drop the cause. Not decided where the
    matrix has no such release, nor where the page had no such checkpoint to load
    (``status`` None: its download run elsewhere)."""
    if status is None:
        results.not_measured_here(claim, f"no {kind} checkpoint saved by {saved_by} here")
        return
    found = outcome(matrix, kind, saved_by, loaded_by)
    if found is None:
        results.not_measured_here(claim, f"the matrix has no {kind} pair {saved_by} -> {loaded_by}")
        return
    seen = [error if isinstance(error, str) else error_line(error) for error in errors if error]
    held = found["status"] == status and (status == "passed" or found.get("error") in seen)
    matching = found.get("error") if found.get("error") in seen else (seen or [None])[0]
    results.claim(
        claim,
        held,
        figures.wrap(
            f"here, as in the matrix: saved by {saved_by}, loaded by {loaded_by}: {status}"
            + (f", {matching}" if status != "passed" else "")
        ),
        seen={"status": status, "errors": seen},
        matrix={"status": found["status"], "error": found.get("error")},
    )
