"""Stagers that wait, or finish, on cue: races that land the same way on every build.

A background copy races with the training loop. A page that shows what one outcome of
that race writes into a checkpoint makes it land the same way every time, without faking
the copy: the stager still copies what it was given, only later, or sooner. Each of these
is a context manager that puts back what it changed when the block ends.

* ``staging_held_until()``: every copy a ``DefaultStager`` is asked for inside the block
  starts only once the training thread next waits on a future (``Future.result`` on the
  main thread: the loop's next wait), or once ``owner.name`` is called;
* ``staging_done_before_returning()``: ``stage()`` returns only once its copy has
  finished, or failed, so that ``async_save`` finds it done.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import threading
from collections.abc import Callable, Iterator
from typing import Any

from torch.distributed.checkpoint.staging import DefaultStager

from page_tools import observe, timing

HOLD_TIMEOUT_S = 60.0  # a hold that is never released lets the copy go, late, not never


@contextlib.contextmanager
def staging_held_until(
    owner: Any = concurrent.futures.Future,
    name: str = "result",
    where: Callable[[observe.Call], bool] | None = timing.on_main_thread,
    stager_class: type = DefaultStager,
    timeout_s: float = HOLD_TIMEOUT_S,
) -> Iterator[observe.Calls]:
    """Copies asked of an asynchronous ``stager_class`` inside the block wait for the next
    call of ``owner.name`` that ``where`` accepts (the call itself is not changed).

    The hold runs on the stager's own worker, ahead of the copy, so the copy itself is
    the stager's, as late as the cue. Records, by rank, how many copies each cue let go
    (a copy its cue never let go starts after ``timeout_s``, and is not counted).
    """
    lock = threading.Lock()
    pending: list[threading.Event] = []
    spool, released = observe._Spool(), observe.Calls()

    def wait(event: threading.Event) -> None:
        event.wait(timeout_s)

    def held_stage(self: Any, *args: Any, **kwargs: Any) -> Any:
        if self._staging_executor is not None:
            event = threading.Event()
            with lock:
                pending.append(event)
            self._staging_executor.submit(wait, event)  # its one worker copies after this
        return stage(self, *args, **kwargs)

    def releasing(*args: Any, **kwargs: Any) -> Any:
        if where is None or where(observe.Call(args, kwargs)):
            with lock:
                if pending:
                    spool.put(len(pending))
                for event in pending:
                    event.set()
                pending.clear()
        return trigger(*args, **kwargs)

    stage_original = stager_class.stage
    trigger_original = getattr(owner, name)
    with (
        observe.replaced(
            stager_class, "stage", functools.wraps(stage_original)(held_stage)
        ) as stage,
        observe.replaced(owner, name, functools.wraps(trigger_original)(releasing)) as trigger,
    ):
        try:
            yield released
        finally:
            with lock:
                for event in pending:
                    event.set()
                pending.clear()
            released.by_rank = spool.collect()


@contextlib.contextmanager
def staging_done_before_returning(stager_class: type = DefaultStager) -> Iterator[None]:
    """``stager_class.stage`` returns only once the copy it started has finished or failed:
    ``async_save`` then finds the staging future done when it looks at it."""

    def finished_stage(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = stage(self, *args, **kwargs)
        if isinstance(result, concurrent.futures.Future):
            concurrent.futures.wait([result])
        return result

    original = stager_class.stage
    with observe.replaced(
        stager_class, "stage", functools.wraps(original)(finished_stage)
    ) as stage:
        yield
