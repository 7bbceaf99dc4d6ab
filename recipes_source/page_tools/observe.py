"""Watch a function while a page's ranks run: what each rank's calls saw comes back by rank.

A page wraps a launch in a watch::

    with observe.watch(dcp, "save", lambda call: proofs.snapshot(call.args[0])) as saves:
        run_on_ranks(train_and_save, CHECKPOINT_DIR)
    saves.by_rank  # {0: [what rank 0's first call saw, ...], 1: [...]}

The ranks are forked inside the block, so they inherit the wrapped function; under
torchrun, where every rank runs the page's top level, each rank wraps its own. What a
rank records comes back when the block ends: through files when ranks are forked, by
an all-gather under torchrun. The visible recipe code is not touched, and nothing of
torch stays changed: on exit the attribute is exactly what it was (``replaced``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import pickle
import shutil
import tempfile
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch.distributed as dist
from rank_launcher import under_torchrun


@contextlib.contextmanager
def replaced(owner: Any, name: str, replacement: Any) -> Iterator[Any]:
    """``owner.name`` is ``replacement`` inside the block and what it was after it.

    ``owner`` is a module or a class. An attribute the class only inherited is removed
    again on exit, so that the base class's shows through as before. Yields the original.
    """
    own = vars(owner)
    had_own = name in own
    stored = own[name] if had_own else None
    original = getattr(owner, name)
    if isinstance(stored, staticmethod) and not isinstance(replacement, staticmethod):
        replacement = staticmethod(replacement)
    setattr(owner, name, replacement)
    try:
        yield original
    finally:
        if had_own:
            setattr(owner, name, stored)
        else:
            delattr(owner, name)


@dataclasses.dataclass
class Call:
    """One call of a watched function, as the recorder sees it."""

    args: tuple
    kwargs: dict
    result: Any = None  # only after the call

    def argument(self, position: int, keyword: str) -> Any:
        """An argument passed either by position or by keyword."""
        return self.args[position] if len(self.args) > position else self.kwargs[keyword]


@dataclasses.dataclass
class Calls:
    """What a watch recorded: ``by_rank[r]`` lists rank r's records, in call order."""

    by_rank: dict[int, list[Any]] = dataclasses.field(default_factory=dict)

    def last(self) -> list[Any]:
        """The last record of every rank, in rank order."""
        return [records[-1] for _, records in sorted(self.by_rank.items()) if records]

    def nth(self, index: int) -> list[Any]:
        """Record ``index`` (call order) of every rank, in rank order: one save of several."""
        return [records[index] for _, records in sorted(self.by_rank.items())]

    def count(self) -> int:
        return sum(len(records) for records in self.by_rank.values())


class _Spool:
    """Records from every rank: a file per process when ranks are forked, an all-gather
    under torchrun (where the block ends on every rank at once)."""

    def __init__(self) -> None:
        self.torchrun = under_torchrun()
        self.directory = None if self.torchrun else tempfile.mkdtemp(prefix="page-tools-watch-")
        self.local: list[tuple[int, Any]] = []
        self.lock = threading.Lock()  # uploads record from threads of their own

    def put(self, record: Any) -> None:
        rank = dist.get_rank() if dist.is_initialized() else 0
        with self.lock:
            if self.torchrun:
                self.local.append((rank, record))
                return
            with open(Path(self.directory, f"{os.getpid()}.pickle"), "ab") as spool:
                pickle.dump((rank, record), spool)

    def collect(self) -> dict[int, list[Any]]:
        entries: list[tuple[int, Any]] = []
        if self.torchrun:
            if dist.is_initialized():
                gathered: list[Any] = [None] * dist.get_world_size()
                dist.all_gather_object(gathered, self.local)
                entries = [entry for rank_entries in gathered for entry in rank_entries]
            else:
                entries = self.local
        else:
            for path in sorted(Path(self.directory).glob("*.pickle")):
                with open(path, "rb") as spool, contextlib.suppress(EOFError):
                    while True:
                        entries.append(pickle.load(spool))
            shutil.rmtree(self.directory, ignore_errors=True)
        by_rank: dict[int, list[Any]] = {}
        for rank, record in entries:
            by_rank.setdefault(rank, []).append(record)
        return by_rank


@contextlib.contextmanager
def watch(
    owner: Any,
    name: str,
    record: Callable[[Call], Any],
    *,
    before: bool = False,
    where: Callable[[Call], bool] | None = None,
) -> Iterator[Calls]:
    """Record ``record(call)`` at every call of ``owner.name`` made inside the block.

    ``before=True`` records when the call starts (the state a save is given), else when
    it returns (``call.result`` is set: the state a load filled in). ``where`` keeps only
    the calls it accepts. The records come back, by rank, when the block ends.
    """
    with records() as (calls, put):

        def watched(*args: Any, **kwargs: Any) -> Any:
            call = Call(args, kwargs)
            wanted = where is None or where(call)
            if wanted and before:
                put(record(call))
            call.result = original(*args, **kwargs)
            if wanted and not before:
                put(record(call))
            return call.result

        with replaced(owner, name, watched) as original:
            yield calls


@contextlib.contextmanager
def records() -> Iterator[tuple[Calls, Callable[[Any], None]]]:
    """What ``put(record)`` is given inside the block, on any rank and from any thread, comes
    back by rank when the block ends: the spool under ``watch``, for a recorder of its own
    (one that records when a future resolves, say). Yields ``(calls, put)``."""
    spool, calls = _Spool(), Calls()
    try:
        yield calls, spool.put
    finally:
        calls.by_rank = spool.collect()


def page_module() -> Any:
    """The module a page's code runs in: Sphinx-Gallery's ``__main__`` while it runs a cell, a
    script's own under python and torchrun. Watch a function the page defines on it."""
    import sys

    return sys.modules["__main__"]


@contextlib.contextmanager
def around(
    owner: Any, name: str, body: Callable[[Callable[..., Any], Call, Callable[[Any], None]], Any]
) -> Iterator[Calls]:
    """Run ``body(original, call, keep)`` in place of every call of ``owner.name`` made inside
    the block: it calls ``original`` as it needs (once, several times, in a ``try``) and
    returns what the call returns; ``keep(record)`` records. Records come back by rank."""
    spool, calls = _Spool(), Calls()

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        return body(original, Call(args, kwargs), spool.put)

    with replaced(owner, name, wrapped) as original:
        try:
            yield calls
        finally:
            calls.by_rank = spool.collect()


def last_line(error: BaseException) -> str:
    """The last line of an error's text (a ``CheckpointException`` holds every rank's
    traceback; its last line is the cause)."""
    lines = str(error).strip().splitlines()
    return lines[-1] if lines else type(error).__name__


def raised_by(owner: Any, name: str):
    """Watch ``owner.name``: every call that raises records the error's type and the last line
    of its text (``last_line``), and the error goes on as before. Calls that return record
    nothing."""

    def body(original: Callable[..., Any], call: Call, keep: Callable[[Any], None]) -> Any:
        try:
            return original(*call.args, **call.kwargs)
        except BaseException as error:
            keep({"error": type(error).__name__, "last_line": last_line(error)})
            raise

    return around(owner, name, body)


def checkpoint_id(call: Call) -> str | None:
    """The checkpoint a DCP call (``save``, ``async_save``, ``load``) is about: its
    ``checkpoint_id``, or the path of the ``storage_writer`` or ``storage_reader`` it was given."""
    given = call.kwargs.get("checkpoint_id")
    for storage in ("storage_writer", "storage_reader"):
        if given is None and call.kwargs.get(storage) is not None:
            given = getattr(call.kwargs[storage], "path", None)
    return None if given is None else os.fspath(given)


@contextlib.contextmanager
def recording() -> Iterator[tuple[Callable[[Any], None], Calls]]:
    """``(put, calls)``: what a page's own wrapper ``put``s, from any thread of any rank,
    comes back in ``calls.by_rank`` when the block ends (as with ``watch``).

    For records that a watch cannot take when a call returns: a wrapper may ``put`` later,
    from a callback (when a checkpoint becomes durable, say). The ranks must be forked
    inside the block, as for ``watch``.
    """
    spool, calls = _Spool(), Calls()
    try:
        yield spool.put, calls
    finally:
        calls.by_rank = spool.collect()
