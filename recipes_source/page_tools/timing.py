"""Clocks and timelines: when each save was called, returned, staged and uploaded.

``save_timeline(dcp)`` watches ``dcp.async_save`` on every rank: when each call began and
returned, and when the futures it returned resolved (``staging_completion``: the copy is
done; ``upload_completion``: the checkpoint is written). A future's time is taken in the
thread that resolves it, before anything waiting on it wakes, so no wait in the loop can
see a save finish before its time is recorded. ``durations`` turns a rank's timeline into
the milliseconds a page reports.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
from collections.abc import Iterator
from concurrent.futures import Future
from typing import Any

from page_tools import observe


@dataclasses.dataclass
class SaveTimes:
    """One save on one rank (``time.perf_counter`` seconds); ``staged`` and ``uploaded`` are
    None if the future did not resolve with a result inside the block."""

    checkpoint: str
    called: float
    returned: float
    staged: float | None = None
    uploaded: float | None = None


class Timeline:
    """What ``save_timeline`` recorded: ``saves(rank)`` once the block has ended."""

    def __init__(self, calls: observe.Calls):
        self.calls = calls

    def saves(self, rank: int = 0, under: str | os.PathLike | None = None) -> list[SaveTimes]:
        """Rank ``rank``'s saves in call order (those whose checkpoint is under ``under``)."""
        by_checkpoint: dict[str, SaveTimes] = {}
        for what, checkpoint, at in self.calls.by_rank.get(rank, []):
            if what == "called":
                by_checkpoint[checkpoint] = SaveTimes(checkpoint, at, at)
            else:
                setattr(by_checkpoint[checkpoint], what, at)
        saves = sorted(by_checkpoint.values(), key=lambda save: save.called)
        if under is not None:
            prefix = os.path.join(os.path.abspath(under), "")
            saves = [s for s in saves if os.path.abspath(s.checkpoint).startswith(prefix)]
        return saves


@contextlib.contextmanager
def save_timeline(dcp_module: Any, name: str = "async_save") -> Iterator[Timeline]:
    """Watch ``dcp_module.async_save`` (and ``Future.set_result``, for the futures it
    returned): every rank's ``SaveTimes``, by checkpoint."""
    pending: dict[Future, tuple[str, str]] = {}  # future -> (what it marks, checkpoint)

    with observe.records() as (calls, put):

        def async_save(*args: Any, **kwargs: Any) -> Any:
            checkpoint = os.fspath(kwargs["checkpoint_id"])
            put(("called", checkpoint, time.perf_counter()))
            response = original_save(*args, **kwargs)
            returned = time.perf_counter()
            put(("returned", checkpoint, returned))
            marks = [
                ("staged", getattr(response, "staging_completion", None)),
                ("uploaded", getattr(response, "upload_completion", response)),
            ]
            for what, future in marks:
                if isinstance(future, Future):
                    pending[future] = (what, checkpoint)
                    # Resolved before the call returned: it did not outlast the call.
                    if future.done() and pending.pop(future, None) and not future.exception():
                        put((what, checkpoint, returned))
            return response

        def set_result(future: Future, result: Any) -> None:
            mark = pending.pop(future, None)
            if mark is not None:
                put((*mark, time.perf_counter()))
            original_set_result(future, result)

        with (
            observe.replaced(dcp_module, name, async_save) as original_save,
            observe.replaced(Future, "set_result", set_result) as original_set_result,
        ):
            yield Timeline(calls)


def durations(saves: list[SaveTimes]) -> dict[str, list[float]]:
    """Milliseconds, save by save: how long the copy still ran after the call returned
    (``copy_after_return``: 0 if it was done by then), the whole save from the call until
    its checkpoint was written (``save``), and the time from one call to the next
    (``between_calls``: one fewer)."""
    return {
        "copy_after_return": [
            1e3 * max(0.0, s.staged - s.returned) for s in saves if s.staged is not None
        ],
        "save": [1e3 * (s.uploaded - s.called) for s in saves if s.uploaded is not None],
        "between_calls": [
            1e3 * (b.called - a.called) for a, b in zip(saves, saves[1:], strict=False)
        ],
    }


def torn_and_timed(
    saves: observe.Calls,
    timeline: Timeline,
    folders: list[str],
    but_last: tuple[str, ...] = (),
    rank: int = 0,
) -> dict[str, dict]:
    """For each folder of checkpoints (a loop's, named by its last part): how many are not
    the state at their save call (``torn``) of those ``checked`` (``but_last``: folders
    whose last checkpoint is left out), and ``durations`` of rank ``rank``'s saves."""
    from page_tools import proofs

    found = {}
    for folder in folders:
        name = os.path.basename(os.path.normpath(folder))
        checked = proofs.checkpoints_against_saves(
            proofs.saves_into(saves, folder), but_last=name in but_last
        )
        found[name] = {
            "torn": proofs.torn(checked),
            "checked": len(checked),
            **durations(timeline.saves(rank, under=folder)),
        }
    return found
