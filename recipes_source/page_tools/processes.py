"""The processes that torch starts for a page's ranks: DCP's checkpoint process, its log.

``stderr_of_started_processes(directory)`` gives every process that ``multiprocessing``
spawns inside the block (DCP's checkpoint process is one) a file of its own as standard
error, named after the rank that started it, instead of the rank's output: such a
process logs every request it serves, and the page shows a summary rather than the
lines. ``helpers()`` lists the helper processes a rank runs, with their resident memory;
``logs(directory)`` reads the files back, by rank.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import multiprocessing.process
import os
import re
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import torch.distributed as dist

from page_tools import observe

_REDIRECT = threading.Lock()  # file descriptor 2 is the process's, not a thread's


@contextlib.contextmanager
def stderr_of_started_processes(directory: str, start_method: str = "spawn") -> Iterator[str]:
    """Processes started inside the block with ``start_method`` write their standard error
    to ``directory/stderr-rank<N>.log`` (N: the rank that started them, 0 outside a group).

    Only the start itself is redirected (the child inherits file descriptor 2 when it is
    created): the rank's own output is unchanged before and after. Restored on exit.
    """
    os.makedirs(directory, exist_ok=True)

    def start(self: multiprocessing.process.BaseProcess) -> None:
        if getattr(self, "_start_method", None) != start_method:
            return original(self)
        rank = dist.get_rank() if dist.is_initialized() else 0
        path = Path(directory, f"stderr-rank{rank}.log")
        with _REDIRECT:
            log = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            saved = os.dup(2)
            try:
                os.dup2(log, 2)
                return original(self)
            finally:
                os.dup2(saved, 2)
                os.close(saved)
                os.close(log)

    with observe.replaced(multiprocessing.process.BaseProcess, "start", start) as original:
        yield directory


def helpers() -> list[dict[str, Any]]:
    """This process's running helper processes (daemonic ``multiprocessing`` children, such
    as DCP's checkpoint process): pid and resident bytes."""
    found = []
    for child in multiprocessing.active_children():
        if child.daemon:
            with contextlib.suppress(psutil.Error):
                found.append({"pid": child.pid, "rss": psutil.Process(child.pid).memory_info().rss})
    return found


def logs(directory: str) -> dict[int, list[str]]:
    """The lines each rank's started processes wrote to standard error, by rank."""
    found = {}
    for path in sorted(Path(directory).glob("stderr-rank*.log")):
        rank = int(re.fullmatch(r"stderr-rank(\d+)\.log", path.name)[1])
        found[rank] = path.read_text(errors="replace").splitlines()
    return found


def requests_logged(
    lines: list[str], marker: str = "Received async checkpoint request"
) -> list[str]:
    """The requests a checkpoint process's log records, without the logger's prefix."""
    return [re.sub(r"^.* - INFO - ", "", line) for line in lines if marker in line]


def helpers_table(helpers: observe.Calls, logs: dict[int, list[str]], hide: str = "") -> Any:
    """Per rank: the helper processes ``helpers`` saw last (``observe.watch`` of ``helpers()``),
    their resident memory, and the log of the processes it started (``hide``: a path to
    leave out of the lines shown)."""
    from page_tools import figures

    rows = []
    for rank, seen in sorted(helpers.by_rank.items()):
        lines = logs.get(rank, [])
        first = (requests_logged(lines) or ["-"])[0]
        first = first.replace(hide, "...") if hide else first
        rows.append(
            [rank, len(seen[-1]), round(sum(p["rss"] for p in seen[-1]) / 1e6), len(lines), first]
        )
    columns = ["rank", "helper processes", "resident MB", "log lines", "first request logged"]
    return figures.Table(columns, rows)


def claim_one_per_rank(claim: str, helpers: observe.Calls, directory: str, requests: int) -> None:
    """Decide that each rank ran exactly one helper process (the last record of ``helpers``)
    and that its log (in ``directory``) records ``requests`` requests."""
    from page_tools import results

    logged = results.record(f"{claim}-logs", logs(directory))
    running = {rank: len(seen[-1]) for rank, seen in sorted(helpers.by_rank.items())}
    served = {rank: len(requests_logged(lines)) for rank, lines in sorted(logged.items())}
    results.claim(
        claim,
        set(running.values()) == {1}
        and set(served.values()) == {requests}
        and sorted(served) == sorted(running),
        f"each rank ran one checkpoint process, which logged each of its {requests} saves",
        running=running,
        served=served,
    )
