"""Clocks and timelines: when each checkpoint was asked for, handed back, and durable.

A training loop can time what it waits for (a benchmark page does, in its visible code);
what it cannot see is when a checkpoint that it started in the background is on disk.
``checkpoint_saves(dcp)`` watches ``dcp.save`` and ``dcp.async_save`` while the page's
ranks run and records, for every save, on the loop's clock (``time.perf_counter``, which
on Linux is the same monotonic clock in every process of the machine):

* ``called``: when the loop called the save;
* ``returned``: when the call gave the loop back control;
* ``durable``: when the checkpoint was complete on disk: the return of ``dcp.save``, the
  completion of the future ``async_save`` returned (its ``upload_completion``).

Nothing of DCP stays changed after the block (``observe.replaced``).
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from typing import Any

from page_tools import observe


def _checkpoint_id(kwargs: dict) -> str | None:
    path = kwargs.get("checkpoint_id")
    return os.fspath(path) if path is not None else None


@contextlib.contextmanager
def checkpoint_saves(dcp: Any) -> Iterator[observe.Calls]:
    """Record every ``dcp.save`` and ``dcp.async_save`` made inside the block, by rank.

    Each record: ``{"call", "checkpoint_id", "called", "returned", "durable", "error"}``
    (seconds of ``time.perf_counter``; ``error`` is the exception a failed save raised, as
    text, else None). A record comes back once its checkpoint is durable (or failed).
    """
    save, async_save = dcp.save, dcp.async_save

    with observe.recording() as (put, saves):

        def timed_save(*args: Any, **kwargs: Any) -> Any:
            called = time.perf_counter()
            record = {"call": "save", "checkpoint_id": _checkpoint_id(kwargs), "called": called}
            try:
                result = save(*args, **kwargs)
            except BaseException as error:
                now = time.perf_counter()
                put({**record, "returned": now, "durable": None, "error": repr(error)})
                raise
            now = time.perf_counter()
            put({**record, "returned": now, "durable": now, "error": None})
            return result

        def timed_async_save(*args: Any, **kwargs: Any) -> Any:
            called = time.perf_counter()
            response = async_save(*args, **kwargs)
            record = {
                "call": "async_save",
                "checkpoint_id": _checkpoint_id(kwargs),
                "called": called,
                "returned": time.perf_counter(),
            }
            upload = getattr(response, "upload_completion", response)

            def durable(future: Any) -> None:
                error = future.exception()
                now = None if error is not None else time.perf_counter()
                put({**record, "durable": now, "error": None if error is None else repr(error)})

            upload.add_done_callback(durable)
            return response

        with (
            observe.replaced(dcp, "save", timed_save),
            observe.replaced(dcp, "async_save", timed_async_save),
        ):
            yield saves


def by_checkpoint(saves: observe.Calls) -> dict[str, list[dict]]:
    """The records of a ``checkpoint_saves`` watch by checkpoint path: one per rank."""
    found: dict[str, list[dict]] = {}
    for rank, records in sorted(saves.by_rank.items()):
        for record in records:
            found.setdefault(record["checkpoint_id"], []).append({**record, "rank": rank})
    return found
