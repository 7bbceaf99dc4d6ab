r"""Stagers that wait, or finish, on cue: races that land the same way on every build.

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

Faults on cue: uploads that pause at a known moment, so that a page's mistake happens
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

``uploads_in_rank_order()``: rank r's writes start once rank r-1's upload has finished:
ranks that save into one directory as single processes (their group destroyed) then
overwrite each other's files in rank order, every time.

All restore what they changed on exit.

Faults on cue: a rank killed with ``SIGKILL`` at a byte of a file it writes, at a tensor
of a staging, or at an optimizer step; every one a context manager that restores what it
changed.

A page wraps the launch of its recipe in one, and decides afterwards that the crash
happened where it was planned::

    with faults.kill_in_write(after_bytes=65536, path=r"step-00000040/.*\.distcp$") as kill:
        failure = run_until_it_fails(train, root)
    faults.crashed_as_planned("upload-crash", kill, failure, root, torn=[40], complete=[30])

The ranks are forked inside the block and inherit what it armed. The rank chosen (``rank``;
-1 is the last one, whatever the number of ranks) kills itself when it gets there, and
leaves a record first (which rank, where, how far), which comes back to the page when the
block ends: ``kill.fired``. A kill that did not fire leaves ``kill.fired`` empty, and
``crashed_as_planned`` fails the build: a comparison with a run that never crashed proves
nothing unless the crash happened.

``new_processes=True`` also arms the Python processes started inside the block (the
workers of a ``torchrun`` that the page starts, of restart attempt ``attempt`` only),
through a ``sitecustomize`` module put on ``PYTHONPATH`` for the block. On exit, the
environment and every class and hook of torch are what they were.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import functools
import json
import logging
import os
import re
import shutil
import signal
import sys
import tempfile
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from rank_launcher import under_torchrun
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.staging import DefaultStager
from torch.optim.optimizer import register_optimizer_step_pre_hook

from page_tools import observe, results, timing

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
        checkpoint = observe.checkpoint_id(observe.Call((), kwargs))
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
        hold = _Hold(str(observe.checkpoint_id(observe.Call(args, kwargs))))
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


@contextlib.contextmanager
def uploads_in_rank_order(timeout_s: float = HOLD_TIMEOUT_S) -> Iterator[observe.Calls]:
    """Inside the block, rank r's ``FileSystemWriter.write_data`` starts only once rank
    r-1's ``FileSystemWriter.finish`` has returned (a marker file in a directory of the
    block's own, which forked ranks inherit; the rank is ``RANK``, else the group's).

    Ranks that save as single processes into one directory (their group gone) then
    overwrite each other's files whole, in rank order, never at the same time. Records,
    by rank, each finished upload's directory. Restores both methods on exit.
    """
    directory = tempfile.mkdtemp(prefix="page-tools-order-")
    spool, calls = observe._Spool(), observe.Calls()

    def rank() -> int:
        if "RANK" in os.environ:
            return int(os.environ["RANK"])
        return dist.get_rank() if dist.is_initialized() else 0

    def write_data(self: FileSystemWriter, plan: Any, planner: Any) -> Any:
        self._page_tools_rank = mine = rank()
        turn = os.path.join(directory, f"finished-{mine - 1}")
        deadline = time.monotonic() + timeout_s
        while mine > 0 and not os.path.exists(turn):
            if time.monotonic() > deadline:
                raise TimeoutError(f"rank {mine - 1} never finished its upload")
            time.sleep(0.01)
        return original_write(self, plan, planner)

    def finish(self: FileSystemWriter, *args: Any, **kwargs: Any) -> Any:
        value = original_finish(self, *args, **kwargs)
        mine = getattr(self, "_page_tools_rank", rank())
        spool.put({"rank": mine, "path": str(self.path)})
        Path(directory, f"finished-{mine}").touch()
        return value

    with (
        observe.replaced(FileSystemWriter, "write_data", write_data) as original_write,
        observe.replaced(FileSystemWriter, "finish", finish) as original_finish,
    ):
        try:
            yield calls
        finally:
            calls.by_rank = spool.collect()
            shutil.rmtree(directory, ignore_errors=True)


PLAN_ENV = "PAGE_TOOLS_KILL_PLAN"  # read by the sitecustomize below, in new processes only


RECORDS = "fired.jsonl"


KILLED = r"killed by SIGKILL|exitcode: -9\)"  # the launcher's words, and torchrun's


SITECUSTOMIZE = '''\
"""Written by page_tools.faults for one block of a page: arms its kill in new processes."""
import os

if "{env}" in os.environ and "RANK" in os.environ:  # a torchrun worker, not the agent
    from page_tools import faults

    faults.arm_from_environment()
'''


@dataclasses.dataclass
class Kill:
    """A kill armed for one block: what and where, and the records of the ranks it killed."""

    kind: str  # "write", "staging" or "step"
    plan: dict
    fired: list[dict] = dataclasses.field(default_factory=list)

    @property
    def happened(self) -> bool:
        return bool(self.fired)


# --------------------------------------------------------------------------
# In the rank: when to die, and the record it leaves
# --------------------------------------------------------------------------


def _rank_and_size() -> tuple[int, int]:
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


def _chosen(plan: dict) -> bool:
    """This process is the rank the plan kills (-1: the last), in the attempt it names."""
    rank, size = _rank_and_size()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
    return rank == plan["rank"] % size and attempt == plan.get("attempt", attempt)


def _die(plan: dict, **where: Any) -> None:
    """Leave the record, then SIGKILL this process (no clean-up, no exit handlers)."""
    rank, size = _rank_and_size()
    record = {
        "kind": plan["kind"],
        "rank": rank,
        "world_size": size,
        "pid": os.getpid(),
        "attempt": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)),
        **where,
    }
    with open(Path(plan["directory"], RECORDS), "a") as records:
        records.write(json.dumps(record) + "\n")
    sys.stdout.flush()
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)


class _DyingStream:
    """A file stream that writes ``after_bytes`` bytes to disk, then kills the process."""

    def __init__(self, stream: Any, path: str, plan: dict):
        self._stream, self._path, self._plan, self._written = stream, path, plan, 0

    def write(self, data: Any) -> int:
        room = self._plan["after_bytes"] - self._written
        size = memoryview(data).nbytes
        if size >= room:
            self._stream.write(bytes(memoryview(data).cast("B")[:room]))
            self._stream.flush()
            os.fsync(self._stream.fileno())
            _die(self._plan, path=self._path, bytes=self._plan["after_bytes"])
        self._written += size
        return self._stream.write(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


class _DyingStreamContext:
    def __init__(self, context: Any, path: str, plan: dict):
        self._context, self._path, self._plan = context, path, plan

    def __enter__(self) -> _DyingStream:
        return _DyingStream(self._context.__enter__(), self._path, self._plan)

    def __exit__(self, *exc: Any) -> Any:
        return self._context.__exit__(*exc)


def _arm_write(plan: dict) -> contextlib.AbstractContextManager:
    from torch.distributed.checkpoint.filesystem import FileSystem

    original = FileSystem.create_stream
    pattern = re.compile(plan["path"])

    def create_stream(self: Any, path: Any, mode: str) -> Any:
        context = original(self, path, mode)
        if "w" in mode and pattern.search(str(path)) and _chosen(plan):
            return _DyingStreamContext(context, str(path), plan)
        return context

    return observe.replaced(FileSystem, "create_stream", create_stream)


def _arm_staging(plan: dict) -> contextlib.AbstractContextManager:
    from torch.distributed.checkpoint._state_dict_stager import StateDictStager

    counts = {"stagings": 0, "tensors": 0}  # this process's, from the block's start
    original_stage, original_offload = StateDictStager.stage, StateDictStager._offload_tensor

    def stage(self: Any, *args: Any, **kwargs: Any) -> Any:
        counts["stagings"] += 1
        counts["tensors"] = 0
        return original_stage(self, *args, **kwargs)

    def offload(self: Any, *args: Any, **kwargs: Any) -> Any:
        if counts["stagings"] == plan["staging"] and _chosen(plan):
            if counts["tensors"] >= plan["after_tensors"]:
                _die(plan, staging=counts["stagings"], tensors=counts["tensors"])
            counts["tensors"] += 1
        return original_offload(self, *args, **kwargs)

    stack = contextlib.ExitStack()
    stack.enter_context(observe.replaced(StateDictStager, "stage", stage))
    stack.enter_context(observe.replaced(StateDictStager, "_offload_tensor", offload))
    return stack


def _arm_step(plan: dict) -> contextlib.AbstractContextManager:
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    calls = [0]  # this process's optimizer steps, from the block's start

    def before_step(optimizer: Any, args: Any, kwargs: Any) -> None:
        calls[0] += 1
        if calls[0] != plan["step"] or not _chosen(plan):
            return
        waited = plan.get("once_exists")
        deadline = time.monotonic() + plan.get("wait_s", 60.0)
        while waited and not os.path.exists(waited) and time.monotonic() < deadline:
            time.sleep(0.01)
        _die(
            plan, step=calls[0], waited_for=waited, existed=bool(waited and os.path.exists(waited))
        )

    handle = register_optimizer_step_pre_hook(before_step)
    stack = contextlib.ExitStack()
    stack.callback(handle.remove)
    return stack


_ARMING = {"write": _arm_write, "staging": _arm_staging, "step": _arm_step}


def arm_from_environment() -> None:
    """In a new process started inside a ``new_processes=True`` block: arm its kill for good
    (the process is a throwaway worker; the page's own process is restored on exit)."""
    plan = json.loads(os.environ[PLAN_ENV])
    armed = _ARMING[plan["kind"]](plan)
    armed.__enter__()
    _ARMED_FOR_GOOD.append(armed)  # a context manager collected would restore on its way out


_ARMED_FOR_GOOD: list = []


# --------------------------------------------------------------------------
# In the page: the blocks
# --------------------------------------------------------------------------


@contextlib.contextmanager
def _environment(**values: str) -> Iterator[None]:
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@contextlib.contextmanager
def _quiet_launch_errors() -> Iterator[None]:
    """torch.multiprocessing logs a warning for every rank the launch stops after the kill."""
    logger = logging.getLogger("torch.multiprocessing.spawn")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


@contextlib.contextmanager
def _kill(kind: str, new_processes: bool, **plan: Any) -> Iterator[Kill]:
    if under_torchrun():
        raise RuntimeError(
            "a page's kills need ranks it forks: run the page with python (under torchrun, "
            "run its download, which kills nothing)"
        )
    directory = tempfile.mkdtemp(prefix="page-tools-kill-")
    plan = {"kind": kind, "directory": directory, **plan}
    kill = Kill(kind, {k: v for k, v in plan.items() if k != "directory"})
    stack = contextlib.ExitStack()
    try:
        stack.enter_context(_quiet_launch_errors())
        stack.enter_context(_ARMING[kind](plan))
        if new_processes:
            Path(directory, "sitecustomize.py").write_text(SITECUSTOMIZE.format(env=PLAN_ENV))
            path = [directory, str(Path(__file__).resolve().parents[1])]
            path += [os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else []
            stack.enter_context(
                _environment(**{PLAN_ENV: json.dumps(plan), "PYTHONPATH": os.pathsep.join(path)})
            )
        with stack:
            yield kill
    finally:
        records = Path(directory, RECORDS)
        if records.exists():
            kill.fired = [json.loads(line) for line in records.read_text().splitlines() if line]
        shutil.rmtree(directory, ignore_errors=True)


def kill_in_write(
    after_bytes: int, path: str, rank: int = -1, new_processes: bool = False, attempt: int = 0
):
    """Rank ``rank`` is killed once it has written ``after_bytes`` bytes of a file whose path
    matches the regular expression ``path`` (through DCP's ``FileSystem``): the bytes before
    the kill are on disk (fsynced), the rest of the file is not."""
    plan = {"after_bytes": after_bytes, "path": path, "rank": rank}
    return _kill("write", new_processes, **plan, **({"attempt": attempt} if new_processes else {}))


def kill_in_staging(staging: int, after_tensors: int, rank: int = -1):
    """Rank ``rank`` is killed in its ``staging``-th staging of a ``DefaultStager`` (counted in
    its process from the block's start: the 4th save of a run), once ``after_tensors`` tensors
    of the state were copied to host memory."""
    return _kill("staging", False, staging=staging, after_tensors=after_tensors, rank=rank)


def kill_at_step(
    step: int,
    rank: int = -1,
    once_exists: str | None = None,
    wait_s: float = 60.0,
    new_processes: bool = False,
    attempt: int = 0,
):
    """Rank ``rank`` is killed right before its ``step``-th optimizer step (counted in its
    process from the block's start: step ``step`` of a run from step 1), once the file
    ``once_exists`` exists, if given (the ``.metadata`` of a save that must be complete),
    waiting at most ``wait_s`` seconds for it."""
    plan = {"step": step, "rank": rank, "once_exists": once_exists, "wait_s": wait_s}
    return _kill("step", new_processes, **plan, **({"attempt": attempt} if new_processes else {}))


# --------------------------------------------------------------------------
# The claim: it crashed where it was planned
# --------------------------------------------------------------------------


def _step_dir(root: str, step: int) -> str:
    return os.path.join(root, f"step-{step:08d}")


def crashed_as_planned(
    claim: str,
    kill: Kill,
    failure: Any,
    root: str,
    torn: list[int] = (),
    complete: list[int] = (),
) -> dict:
    """Decide that the kill fired on the planned rank, exactly once, that the launch failed
    naming that rank as killed by SIGKILL (``failure``: the launcher's ``RankFailedError``,
    or what a torchrun job printed), and that the checkpoint directories under ``root`` are
    what the crash must leave: step directories ``torn`` without ``.metadata``, ``complete``
    ones with it, and a file cut at the byte of the kill where the kill was in a write."""
    fired = kill.fired
    record = fired[0] if len(fired) == 1 else {}
    text = str(failure or "")
    rank = record.get("rank")
    named = f"rank {rank} failed: killed by SIGKILL" in text or bool(
        re.search(rf"exitcode: -9\) local_rank: {rank} ", text)  # what torchrun logs
    )
    planned_rank = bool(record) and rank == kill.plan["rank"] % record["world_size"]
    torn_ok = all(not os.path.exists(os.path.join(_step_dir(root, s), ".metadata")) for s in torn)
    complete_ok = all(
        os.path.exists(os.path.join(_step_dir(root, s), ".metadata")) for s in complete
    )
    cut = None
    if "path" in record:
        cut = os.path.getsize(record["path"]) if os.path.exists(record["path"]) else None
    cut_ok = "path" not in record or cut == record["bytes"]
    waited_ok = not record.get("waited_for") or record.get("existed", False)
    where = {
        "write": lambda: f"after {record['bytes']:,} bytes of {_short(record['path'], root)}",
        "staging": lambda: (
            f"in its staging {record['staging']}, after copying {record['tensors']} tensors"
        ),
        "step": lambda: f"at its step {record['step']}",
    }[kill.kind]
    said = (
        f"rank {rank} was killed (SIGKILL) {where()},\nand the job failed with it"
        if record
        else f"the {kill.kind} kill did not fire ({len(fired)} records)"
    )
    for word, steps in (("torn", torn), ("complete", complete)):
        if steps:
            said += f"; {word}: step{'s' * (len(steps) > 1)} {', '.join(map(str, steps))}"
    results.claim(
        claim,
        planned_rank and named and torn_ok and complete_ok and cut_ok and waited_ok,
        said,
        fired=fired,
        named_in_failure=named,
        torn_without_metadata=torn_ok,
        complete_with_metadata=complete_ok,
        file_cut_at=cut,
        failure=next((ln for ln in text.splitlines() if re.search(KILLED, ln)), None),
    )
    return record


def _short(path: str, root: str) -> str:
    return os.path.relpath(path, root) if path.startswith(root) else os.path.basename(path)
