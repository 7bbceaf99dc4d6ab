"""Faults on cue: uploads that pause at a known moment, so that a page's mistake happens
while a save is in flight, every time.

``uploads_held_after_writing()``: every ``dcp.async_save`` inside the block returns only
once this rank's data files are written, and its upload then waits, before the
collectives that gather every rank's results and write ``.metadata``, until the rank's
next move: ``result()`` on that upload's future (which releases it), or
``dist.destroy_process_group`` (which first waits at a barrier until every rank's data is
written, destroys the group, then releases the uploads). A page's rank code stays plain
DCP: the hold is in the watch around its launch. Records by rank: what released each
save.

``writes_wait_for_exit()``: in Python interpreters started inside the block (a script
run with ``subprocess``), ``FileSystemWriter.write_data`` waits until the interpreter has
begun to exit before it writes: an upload is then certainly in flight when the script
ends.

Both restore what they changed on exit.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import os
import shutil
import tempfile
import textwrap
import threading
from collections.abc import Iterator
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.filesystem import FileSystemWriter

from page_tools import observe


@dataclasses.dataclass
class _Hold:
    checkpoint_id: str
    written: threading.Event = dataclasses.field(default_factory=threading.Event)
    release: threading.Event = dataclasses.field(default_factory=threading.Event)
    future: Any = None


@contextlib.contextmanager
def uploads_held_after_writing(timeout_s: float = 60.0) -> Iterator[observe.Calls]:
    """Hold every ``dcp.async_save`` upload of the block once its data is written, until
    the rank waits for it or destroys a process group (see the module's docstring).

    Thread-based uploads only (the writer runs in the rank). Yields the records, by rank,
    when the block ends: ``{"checkpoint_id", "released_by", "written"}`` per save.
    """
    spool, calls = observe._Spool(), observe.Calls()
    lock = threading.Lock()
    unclaimed: list[_Hold] = []  # saves whose writer has not started writing yet
    pending: list[_Hold] = []  # saves not released yet

    def release(hold: _Hold, by: str) -> None:
        with lock:
            if hold not in pending:
                return
            pending.remove(hold)
        spool.put(
            {
                "checkpoint_id": hold.checkpoint_id,
                "released_by": by,
                "written": hold.written.is_set(),
            }
        )
        hold.release.set()

    def async_save(*args: Any, **kwargs: Any) -> Any:
        hold = _Hold(str(kwargs.get("checkpoint_id")))
        with lock:
            unclaimed.append(hold)
            pending.append(hold)
        future = original_save(*args, **kwargs)
        hold.future = getattr(future, "upload_completion", future)
        if not hold.written.wait(timeout_s):
            raise TimeoutError(f"the data of {hold.checkpoint_id} was not written in {timeout_s} s")
        return future

    def write_data(self: FileSystemWriter, plan: Any, planner: Any) -> Any:
        with lock:
            hold = unclaimed.pop(0) if unclaimed else None
        writes = original_write(self, plan, planner)
        if hold is None:
            return writes
        writes.wait()
        hold.written.set()
        if not hold.release.wait(timeout_s):
            raise TimeoutError(f"the upload of {hold.checkpoint_id} was never released")
        return writes

    def result(self: concurrent.futures.Future, *args: Any, **kwargs: Any) -> Any:
        for hold in list(pending):
            if hold.future is self:
                release(hold, "result")
        return original_result(self, *args, **kwargs)

    def destroy_process_group(group: Any = None) -> None:
        held = [hold for hold in list(pending) if hold.written.is_set()]
        if held and group is not None:
            dist.barrier()  # every rank's data is written: nothing else is on the group
        original_destroy(group)
        for hold in held:
            release(hold, "destroy_process_group")

    with (
        observe.replaced(dcp, "async_save", async_save) as original_save,
        observe.replaced(FileSystemWriter, "write_data", write_data) as original_write,
        observe.replaced(concurrent.futures.Future, "result", result) as original_result,
        observe.replaced(dist, "destroy_process_group", destroy_process_group) as original_destroy,
    ):
        try:
            yield calls
        finally:
            for hold in list(pending):  # never leave an upload thread waiting
                hold.release.set()
            calls.by_rank = spool.collect()


# What an interpreter started inside ``writes_wait_for_exit`` runs first (``sitecustomize``).
_WAIT_FOR_EXIT = textwrap.dedent(
    '''
    """Written by page_tools.faults.writes_wait_for_exit: FileSystemWriter.write_data waits
    until this interpreter has begun to exit, so that an upload is in flight at the exit."""
    import threading

    from torch.distributed.checkpoint.filesystem import FileSystemWriter

    _write_data = FileSystemWriter.write_data


    def write_data(self, plan, planner):
        exiting = threading.Event()
        try:
            # Called before the interpreter joins the upload's thread (registered after
            # concurrent.futures' own exit hook, it runs before it).
            threading._register_atexit(exiting.set)
        except RuntimeError:  # the interpreter is already exiting
            exiting.set()
        exiting.wait(60)
        return _write_data(self, plan, planner)


    FileSystemWriter.write_data = write_data
    '''
)


@contextlib.contextmanager
def writes_wait_for_exit() -> Iterator[str]:
    """Interpreters started inside the block (they inherit ``PYTHONPATH``) hold every
    ``FileSystemWriter.write_data`` until they begin to exit; ``PYTHONPATH`` is restored,
    and the hook removed, on exit. Yields the hook's directory."""
    directory = tempfile.mkdtemp(prefix="page-tools-exit-")
    with open(os.path.join(directory, "sitecustomize.py"), "w") as hook:
        hook.write(_WAIT_FOR_EXIT)
    saved = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (directory, saved) if p)
    try:
        yield directory
    finally:
        if saved is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = saved
        shutil.rmtree(directory, ignore_errors=True)
