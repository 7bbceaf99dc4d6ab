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

Faults on cue: a stager's copy, or a checkpoint's writes, held until the loop waits for
them; a GPU kept behind the host. Each is a context manager that restores what it changed.

A loop that overlaps a checkpoint with training races with it: whether a checkpoint is
torn depends on which thread gets there first, the stager copying a tensor or the loop
changing it. A page that shows a bug only sometimes proves nothing, so a page decides the
race, and always the same way: the latest moment the loop allows.

* ``copies_held_until_waited(dcp)``: a ``DefaultStager`` that stages in the background
  starts its copy only when the loop waits for that save's ``staging_completion`` (or its
  ``upload_completion``). Everything the loop does before that wait has happened when the
  copy starts (on a GPU the device is synchronised first): a loop that changes the state
  before it waits saves the changed state, a loop that waits first saves the right one.
* ``writes_held_until_waited(dcp)``: a checkpoint's upload writes nothing until the loop
  waits for that save's ``upload_completion``: meanwhile the loop may save again.
* ``device_behind_before_steps(cycles)``: on a GPU, spin work ahead of every optimizer step,
  as a large model's queued kernels keep a GPU behind the host.

The copy, its thread, its buffers, the upload and the futures are DCP's own: the faults
only choose when they start. The ranks, forked inside the block, inherit the wrappers;
on exit everything is restored and whatever is still held is let go.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import os
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.staging import DefaultStager
from torch.optim.optimizer import register_optimizer_step_pre_hook

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


def _stages_in_background(stager: Any) -> bool:
    options = getattr(stager, "_config", None)  # DefaultStager's StagingOptions
    return bool(getattr(options, "use_async_staging", False))


class _Cues:
    """Gates that open when the loop first waits for a future that an ``async_save`` call
    returned: its ``staging_completion`` or its ``upload_completion`` (``on_staging=False``:
    only the latter)."""

    def __init__(self, on_staging: bool = True) -> None:
        self.on_staging = on_staging
        self.local = threading.local()  # the async_save call this thread is in, if any
        self.waited_for: dict[Future, list[threading.Event]] = {}
        self.gates: list[threading.Event] = []

    def new_gate(self) -> threading.Event | None:
        """A gate of the async_save call this thread is in (None outside of one)."""
        made = getattr(self.local, "made", None)
        if made is None:
            return None
        gate = threading.Event()
        self.gates.append(gate)
        made.append(gate)
        return gate

    @contextlib.contextmanager
    def installed(self, dcp_module: Any, on_call=None) -> Iterator[_Cues]:
        """``dcp_module.async_save`` and ``Future.result`` wrapped for the block; ``on_call
        (kwargs)`` runs inside each call, before DCP's. Every gate is let go on exit."""

        def async_save(*args: Any, **kwargs: Any) -> Any:
            self.local.made = []
            try:
                if on_call is not None:
                    on_call(kwargs)
                response = original_save(*args, **kwargs)
                made = self.local.made
            finally:
                self.local.made = None
            futures = (
                getattr(response, "staging_completion", None) if self.on_staging else None,
                getattr(response, "upload_completion", response),
            )
            for future in futures:
                if isinstance(future, Future) and made:
                    self.waited_for[future] = made
            return response

        def result(future: Future, timeout: float | None = None) -> Any:
            gates = self.waited_for.get(future, ())
            if any(not gate.is_set() for gate in gates):
                if torch.accelerator.is_available():
                    torch.accelerator.synchronize()  # what the loop queued before it waits has run
                for gate in gates:
                    gate.set()
            return original_result(future, timeout)

        with (
            observe.replaced(dcp_module, "async_save", async_save) as original_save,
            observe.replaced(Future, "result", result) as original_result,
        ):
            try:
                yield self
            finally:
                for gate in self.gates:
                    gate.set()


@contextlib.contextmanager
def copies_held_until_waited(dcp_module: Any) -> Iterator[list[threading.Event]]:
    """Inside the block, a ``DefaultStager`` with ``use_async_staging`` starts the copy of a
    save only when the loop waits for that save's ``staging_completion`` (or its
    ``upload_completion``).

    ``stage`` returns a future at once, as async staging does; a thread of the page's waits
    for the cue and then calls ``DefaultStager.stage`` itself: DCP's own copy, on its own
    thread and stream, into its own cached buffers. Yields the cues, one event per save.
    """
    cues = _Cues()

    def held_stage(stager: DefaultStager, state_dict: Any, **kwargs: Any) -> Any:
        gate = cues.new_gate() if _stages_in_background(stager) else None
        if gate is None:
            return original_stage(stager, state_dict, **kwargs)
        staged: Future = Future()

        def copy_when_let() -> None:
            gate.wait()
            try:
                copied = original_stage(stager, state_dict, **kwargs)
                staged.set_result(copied.result() if isinstance(copied, Future) else copied)
            except BaseException as error:  # handed on to the save, as DCP's own future would
                staged.set_exception(error)

        threading.Thread(target=copy_when_let, name="page-tools-held-copy", daemon=True).start()
        return staged

    with (
        cues.installed(dcp_module),
        observe.replaced(DefaultStager, "stage", held_stage) as original_stage,
    ):
        yield cues.gates


@contextlib.contextmanager
def writes_held_until_waited(dcp_module: Any) -> Iterator[list[threading.Event]]:
    """Inside the block, the upload of an ``async_save`` writes nothing
    (``FileSystemWriter.write_data`` waits) until the loop waits for that save's
    ``upload_completion``: as when writing a checkpoint takes longer than the steps between
    two saves. Yields the cues, one event per save."""
    cues = _Cues(on_staging=False)
    by_checkpoint: dict[str, threading.Event] = {}

    def on_call(kwargs: dict) -> None:
        checkpoint = kwargs.get("checkpoint_id")
        gate = cues.new_gate()
        if checkpoint is not None and gate is not None:
            by_checkpoint[os.path.abspath(os.fspath(checkpoint))] = gate

    def write_data(writer: FileSystemWriter, plan: Any, planner: Any) -> Any:
        gate = by_checkpoint.get(os.path.abspath(os.fspath(writer.path)))
        if gate is not None:
            gate.wait()
        return original_write(writer, plan, planner)

    with (
        cues.installed(dcp_module, on_call),
        observe.replaced(FileSystemWriter, "write_data", write_data) as original_write,
    ):
        yield cues.gates


@contextlib.contextmanager
def device_behind_before_steps(cycles: int) -> Iterator[dict]:
    """Inside the block, on a GPU, ``cycles`` clock cycles of spin work (``torch.cuda._sleep``)
    are queued on the current stream before every optimizer step, once a ``DefaultStager``
    has staged in the process: the step's kernels then run that much later while the host
    runs on, as when a large model's queued kernels keep a GPU behind the host.

    A stager's first stage registers its host memory with CUDA, which waits for the device;
    from its second save on, a save waits for nothing. Without CUDA nothing is queued.
    Yields ``{"cycles": cycles}``. The hook (``register_optimizer_step_pre_hook``) is
    removed on exit.
    """
    staged = threading.Event()

    def stage(stager: DefaultStager, *args: Any, **kwargs: Any) -> Any:
        staged.set()
        return original_stage(stager, *args, **kwargs)

    def before_step(optimizer: Any, args: Any, kwargs: Any) -> None:
        if staged.is_set() and torch.cuda.is_available():
            torch.cuda._sleep(cycles)

    handle = register_optimizer_step_pre_hook(before_step)
    try:
        with observe.replaced(DefaultStager, "stage", stage) as original_stage:
            yield {"cycles": cycles}
    finally:
        handle.remove()
