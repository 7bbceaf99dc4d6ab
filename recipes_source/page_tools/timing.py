"""Clocks and timelines: when each watched call ran, on which thread, on every rank.

``timed(owner, name, what)`` wraps a function for the length of a ``with`` block, as
``observe.watch`` does, and records a ``Span`` for each call: its label, the thread it
ran on, when it started and ended (``time.perf_counter``, one clock for every process of
the machine), the error it raised, if any. Each call also runs in a
``torch.profiler.record_function`` range of that label, so that a profiler trace shows
the same phases. ``checkpoint_loop(ToyModel)`` watches everything a checkpointing loop
does (forward, backward, ``optimizer.step``, ``dcp.async_save``, the waits on what it
returned, the stager's copy, the upload) and gives back a ``CheckpointLoop``: the
timeline of each rank, its saves, and what each save blocked. ``profiled`` runs
``torch.profiler`` on each rank between two calls of the recipe and writes rank 0's
Chrome trace; ``trace_summary`` reads one back.

None of it is in a recipe's functions: the watches find the recipe's calls from outside,
and nothing of torch stays changed after the block.

Clocks and timelines: when each save was called, returned, staged and uploaded.

``save_timeline(dcp)`` watches ``dcp.async_save`` on every rank: when each call began and
returned, and when the futures it returned resolved (``staging_completion``: the copy is
done; ``upload_completion``: the checkpoint is written). A future's time is taken in the
thread that resolves it, before anything waiting on it wakes, so no wait in the loop can
see a save finish before its time is recorded. ``durations`` turns a rank's timeline into
the milliseconds a page reports.

Clocks and timelines: when each rank's calls of a torch function started, and how long
one phase of a call lasted (from the call until a function it calls first ran).

A page times what its recipe does with the recipe's own clock (the reader keeps that
code); the phases inside a call are the page's::

    with timing.until_first(dcp, "save", FileSystemWriter, "write_data") as planning:
        run_on_ranks(save_every_way, CHECKPOINT_ROOT)
    timing.slowest(planning, [path])  # the slowest rank's seconds from dcp.save to write_data

Stamps are ``time.perf_counter()``, the system's monotonic clock, so that stamps taken
in different processes of one machine compare. Like every watch, nothing of torch stays
changed after the block.

Clocks and timelines: when each checkpoint was asked for, handed back, and durable.

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

Clocks and timelines: how long the calls a page watches took, on every rank.

``spans(owner, name)`` times every call of ``owner.name`` made inside the block, on the
rank (and the thread) that made it, and brings the ``CallSpan`` records back by rank, as
``observe.watch`` does. A span knows which other timed calls it ran inside (``within``:
``AppState.state_dict`` called by ``dcp.save`` is not the page's own collect phase), and,
with ``completes=True``, when the ``Future`` the call returned completed (an upload).

``async_save_loop(step)`` times a whole training loop that saves with ``dcp.async_save``:
its steps, its saves, and its waits for a previous save (``Future.result``), and works out
per save how long the loop was blocked, and per step whether an upload was in flight.

``copy_to_host_seconds`` measures copies from a GPU into pageable and pinned host memory;
it runs on a machine with a GPU, in a process of its own.
"""

from __future__ import annotations

import bisect
import collections
import concurrent.futures
import contextlib
import dataclasses
import functools
import itertools
import json
import os
import statistics
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import state_dict_saver
from torch.distributed.checkpoint.staging import DefaultStager

from page_tools import figures, observe, results, stats


def now() -> float:
    """Seconds on the clock every span uses (monotonic, shared by the machine's processes)."""
    return time.perf_counter()


def on_main_thread(call: observe.Call | None = None) -> bool:
    """For ``where=``: a call made on the process's main thread (a training loop's)."""
    return threading.current_thread() is threading.main_thread()


def off_main_thread(call: observe.Call | None = None) -> bool:
    """For ``where=``: a call made on another thread (a stager's copy, an upload)."""
    return not on_main_thread(call)


@dataclasses.dataclass
class Span:
    """One call of a timed function: what it was, where and when it ran."""

    what: str
    thread: str
    main: bool  # on the process's main thread
    start: float
    end: float
    error: str | None = None  # "TypeError: ..." if the call raised
    detail: dict = dataclasses.field(default_factory=dict)

    @property
    def seconds(self) -> float:
        return self.end - self.start


def _synchronize() -> None:
    if torch.accelerator.is_available():
        # This stream only: a stager's copies on a stream of their own keep running.
        torch.accelerator.current_stream().synchronize()


@contextlib.contextmanager
def timed(
    owner: Any,
    name: str,
    what: str | Callable[[observe.Call], str | None],
    *,
    where: Callable[[observe.Call], bool] | None = None,
    detail: Callable[[observe.Call], dict] | None = None,
    synchronize: bool = False,
) -> Iterator[observe.Calls]:
    """Record a ``Span`` for every call of ``owner.name`` made inside the block.

    ``what`` is the label, or a function of the call that returns it (``None``: not
    recorded). ``where`` keeps only the calls it accepts, ``detail`` adds what the call
    returned (it runs after a call that did not raise). With ``synchronize`` the span
    ends when the accelerator's current stream has done the work the call queued (its
    GPU time, not only the launch). The records come back by rank when the block ends;
    on exit ``owner.name`` is exactly what it was.
    """
    spool, calls = observe._Spool(), observe.Calls()
    original = getattr(owner, name)

    @functools.wraps(original)  # keeps its attributes (an optimizer's ``hooked`` step)
    def timed_call(*args: Any, **kwargs: Any) -> Any:
        call = observe.Call(args, kwargs)
        label = what(call) if callable(what) else what
        if label is None or (where is not None and not where(call)):
            return inner(*args, **kwargs)
        start, error = now(), None
        try:
            with torch.profiler.record_function(label):
                call.result = inner(*args, **kwargs)
                if synchronize:
                    _synchronize()
            return call.result
        except BaseException as exc:
            error = f"{type(exc).__name__}: {exc}"
            raise
        finally:
            end = now()
            extra = detail(call) if detail is not None and error is None else {}
            thread = threading.current_thread()
            main = thread is threading.main_thread()
            spool.put(Span(label, thread.name, main, start, end, error, extra))

    with observe.replaced(owner, name, timed_call) as inner:
        try:
            yield calls
        finally:
            calls.by_rank = spool.collect()


def merged(*recorded: observe.Calls) -> dict[int, list[Span]]:
    """The spans of several ``timed`` watches, by rank, in the order they started."""
    by_rank: dict[int, list[Span]] = {}
    for calls in recorded:
        for rank, spans in calls.by_rank.items():
            by_rank.setdefault(rank, []).extend(spans)
    return {rank: sorted(spans, key=lambda s: s.start) for rank, spans in sorted(by_rank.items())}


# --------------------------------------------------------------------------
# A checkpointing loop's timeline
# --------------------------------------------------------------------------

# What the training thread does, in a loop's order.
PHASES = (
    "forward",
    "backward",
    "wait for staging",
    "optimizer.step",
    "wait for upload",
    "async_save",
)


@dataclasses.dataclass
class Save:
    """One ``async_save`` of a loop, on one rank: times in seconds on the spans' clock."""

    step: int
    response: str  # the type async_save returned
    called: float
    returned: float
    staging: Span | None  # the stager's copy
    upload: Span | None  # the write, on the upload's thread
    waited_before: float  # seconds in the wait for the previous upload, right before it
    waited_for_staging: float  # seconds the next step waited for this copy
    next_step: dict[str, Span]  # the next step's forward, backward and optimizer.step

    @property
    def blocked(self) -> float:
        """Seconds this save kept the training thread from training."""
        return (self.returned - self.called) + self.waited_before + self.waited_for_staging

    @property
    def beside_compute(self) -> float:
        """Seconds the copy ran beside the next step's forward and backward pass."""
        if self.staging is None or "forward" not in self.next_step:
            return 0.0
        begin = max(self.staging.start, self.next_step["forward"].start)
        end = min(self.staging.end, self.next_step["backward"].end)
        return max(0.0, end - begin)


@dataclasses.dataclass
class CheckpointLoop:
    """What ``checkpoint_loop`` recorded: every rank's spans, and readings of them."""

    by_rank: dict[int, list[Span]] = dataclasses.field(default_factory=dict)

    @property
    def ranks(self) -> list[int]:
        return sorted(self.by_rank)

    def training(self, rank: int) -> list[tuple[int, Span]]:
        """(step, span) of the training thread's phases, not those inside another phase.

        A span's step is the number of forward passes begun by then: what runs before the
        first one (the save before training) is step 0.
        """
        main = [s for s in self.by_rank[rank] if s.main and s.what in PHASES]
        outer: list[Span] = []
        for span in main:
            if outer and span.start < outer[-1].end:
                continue  # inside the phase before it (a step inside a state_dict() call)
            outer.append(span)
        steps, step = [], 0
        for span in outer:
            step += span.what == "forward"
            steps.append((step, span))
        return steps

    def phase(self, rank: int, what: str, step: int) -> Span | None:
        return next((s for n, s in self.training(rank) if (s.what, n) == (what, step)), None)

    def saves(self, rank: int) -> list[Save]:
        training = self.training(rank)
        spans = self.by_rank[rank]
        stagings = [s for s in spans if s.what == "staging"]
        uploads = [s for s in spans if s.what == "upload"]
        found = []
        for k, (step, call) in enumerate((n, s) for n, s in training if s.what == "async_save"):
            before = [
                s
                for n, s in training
                if (s.what, n) == ("wait for upload", step) and s.end <= call.start
            ]
            staging_wait = self.phase(rank, "wait for staging", step + 1)
            following = {
                what: span
                for what in ("forward", "backward", "optimizer.step")
                if (span := self.phase(rank, what, step + 1)) is not None
            }
            found.append(
                Save(
                    step=step,
                    response=call.detail.get("response", "?"),
                    called=call.start,
                    returned=call.end,
                    staging=stagings[k] if k < len(stagings) else None,
                    upload=uploads[k] if k < len(uploads) else None,
                    waited_before=before[-1].seconds if before else 0.0,
                    waited_for_staging=staging_wait.seconds if staging_wait else 0.0,
                    next_step=following,
                )
            )
        return found

    def blocked_ms(self, save_steps: list[int]) -> list[float]:
        """For each save step, the ms its save blocked the slowest rank (collectives make
        the others wait for it)."""
        blocked = []
        for step in save_steps:
            per_rank = [
                save.blocked
                for rank in self.ranks
                for save in self.saves(rank)
                if save.step == step
            ]
            blocked.append(1000 * max(per_rank))
        return blocked

    def step_ms(self, rank: int) -> list[float]:
        """Each training step's ms on ``rank``: from its forward pass to the next one's (the
        last: to the end of its optimizer.step), saves included."""
        forwards = [s for n, s in self.training(rank) if s.what == "forward"]
        last = max(
            (s for n, s in self.training(rank) if s.what == "optimizer.step"), key=lambda s: s.end
        )
        ends = [f.start for f in forwards[1:]] + [last.end]
        return [1000 * (end - f.start) for f, end in zip(forwards, ends, strict=True)]

    def counts(self, rank: int) -> dict[str, int]:
        """How many spans of each phase the training thread ran, nested ones too."""
        names = collections.Counter(s.what for s in self.by_rank[rank] if s.main)
        return {what: names[what] for what in PHASES if names[what]}

    def waits(self, rank: int) -> list[Span]:
        """The training thread's waits on what async_save returned, in order."""
        return [s for s in self.by_rank[rank] if s.main and s.what.startswith("wait for ")]

    def bars(self, rank: int, from_step: int = 1) -> tuple[list[tuple], list[tuple]]:
        """``figures.timelines`` bars and marks of one rank, in ms since step ``from_step``
        began: the training thread's phases, each save's copy and its upload."""
        origin = self.phase(rank, "forward", from_step).start
        ms = lambda t: 1000 * (t - origin)  # noqa: E731
        bars = [("training thread", s.what, ms(s.start), ms(s.end)) for _, s in self.training(rank)]
        bars += [
            (s.what, s.what, ms(s.start), ms(s.end))
            for s in self.by_rank[rank]
            if s.what in ("staging", "upload")
        ]
        marks = [(ms(save.called), f"save {save.step}") for save in self.saves(rank) if save.step]
        return bars, marks

    def save_rows(self, rank: int, steps: list[int]) -> list[list]:
        """``SAVE_COLUMNS`` of each save at ``steps`` on ``rank``: ms since its call."""
        rows = []
        for save in self.saves(rank):
            if save.step not in steps:
                continue

            def ms(span: Span | None, zero: float = save.called) -> str:
                if span is None:
                    return "-"
                # A non-breaking hyphen: an interval stays on one line of a table.
                return f"{1000 * (span.start - zero):.1f}\u2011{1000 * (span.end - zero):.1f}"

            nxt = save.next_step
            rows.append(
                [
                    save.step,
                    round(1000 * (save.returned - save.called), 1),
                    ms(save.staging),
                    ms(nxt.get("forward")),
                    ms(nxt.get("backward")),
                    ms(nxt.get("optimizer.step")),
                    round(1000 * (save.upload.end - save.called), 1) if save.upload else "-",
                    round(1000 * save.beside_compute, 1),
                ]
            )
        return rows


SAVE_COLUMNS = [
    "save after step",
    "async_save returned",
    "staging",
    "next forward",
    "next backward",
    "next optimizer.step",
    "upload done",
    "copy beside forward and backward",
]
ROWS = ["training thread", "staging", "upload"]  # a loop's timeline, top to bottom
COLORS = {
    "forward": "tab:blue",
    "backward": "tab:cyan",
    "optimizer.step": "tab:green",
    "async_save": "tab:purple",
    "wait for staging": "tab:red",
    "wait for upload": "tab:orange",
    "staging": "tab:pink",
    "upload": "tab:gray",
}


@contextlib.contextmanager
def checkpoint_loop(
    model_class: type | None = None, optimizer_class: type = torch.optim.Adam
) -> Iterator[CheckpointLoop]:
    """Time a checkpointing loop's phases on every rank, from outside its code.

    Watched inside the block: ``model_class.__call__`` if given (the forward pass,
    FSDP's all-gather included), ``torch.Tensor.backward``, ``optimizer_class.step`` (each
    until the GPU has done its work), ``dcp.async_save``, ``Future.result`` on the main
    thread for the futures async_save returned ("wait for staging", "wait for upload"),
    ``DefaultStager._stage`` (the copy to host memory, on whichever thread runs it) and
    the write of each upload (``state_dict_saver.save`` off the main thread).
    """
    roles: dict[int, tuple[str, Future]] = {}  # what each future stands for, kept alive

    def returned(call: observe.Call) -> dict:
        response = call.result
        if hasattr(response, "staging_completion"):
            roles[id(response.staging_completion)] = (
                "wait for staging",
                response.staging_completion,
            )
            roles[id(response.upload_completion)] = ("wait for upload", response.upload_completion)
        elif isinstance(response, Future):
            roles[id(response)] = ("wait for upload", response)
        return {"response": type(response).__name__}

    def waited_on(call: observe.Call) -> str | None:
        role = roles.get(id(call.args[0]))
        return role[0] if role else None

    watches = [
        timed(dcp, "async_save", "async_save", detail=returned),
        timed(torch.Tensor, "backward", "backward", synchronize=True),
        timed(optimizer_class, "step", "optimizer.step", synchronize=True),
        timed(Future, "result", waited_on, where=on_main_thread),
        timed(DefaultStager, "_stage", "staging"),
        timed(state_dict_saver, "save", "upload", where=off_main_thread),
    ]
    if model_class is not None:  # without one: the saves and their waits only
        watches.append(timed(model_class, "__call__", "forward", synchronize=True))
    loop = CheckpointLoop()
    recorded: list[observe.Calls] = []
    try:
        with contextlib.ExitStack() as stack:
            recorded += [stack.enter_context(watch) for watch in watches]
            yield loop
    finally:
        roles.clear()
        loop.by_rank = merged(*recorded)


# --------------------------------------------------------------------------
# The profiler, between two calls of the recipe
# --------------------------------------------------------------------------


@contextlib.contextmanager
def _quiet_stderr() -> Iterator[None]:
    """The profiler's native log lines (``USDT: ... profiler_start``) are not the page's."""
    sys.stderr.flush()
    saved, null = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(null)


@dataclasses.dataclass
class Profile:
    """Where ``profiled`` wrote the trace, and which ranks ran the profiler."""

    path: Path
    ranks: list[int] = dataclasses.field(default_factory=list)

    @property
    def written(self) -> bool:
        return self.path.exists()


@contextlib.contextmanager
def profiled(
    start: tuple[Any, str], stop: tuple[Any, str], trace: str | os.PathLike, rank: int = 0
) -> Iterator[Profile]:
    """Run ``torch.profiler`` on each rank from its first call of ``start`` (owner, name) to
    the return of its next call of ``stop``, every thread and, with CUDA, the GPU's streams;
    ``rank`` writes its Chrome trace to ``trace`` (a path resolved here, where the block is).

    ``stop`` also ends a profile that the block leaves running. Nothing stays changed.
    """
    profile = Profile(Path(trace).resolve())
    spool = observe._Spool()
    state: dict[str, Any] = {"profiler": None, "done": False}

    def begin() -> None:
        if state["profiler"] is not None or state["done"]:
            return
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        every_thread = torch._C._profiler._ExperimentalConfig(profile_all_threads=True)
        profiler = torch.profiler.profile(activities=activities, experimental_config=every_thread)
        with warnings.catch_warnings(), _quiet_stderr():
            warnings.filterwarnings("ignore", "Warning: Profiler clears events")
            profiler.start()
        state["profiler"] = profiler

    def end() -> None:
        profiler = state["profiler"]
        if profiler is None:
            return
        state["profiler"], state["done"] = None, True
        with _quiet_stderr():
            profiler.stop()
        this_rank = dist.get_rank() if dist.is_initialized() else 0
        if this_rank == rank:
            profile.path.parent.mkdir(parents=True, exist_ok=True)
            profiler.export_chrome_trace(str(profile.path))
        spool.put(this_rank)

    start_owner, start_name = start
    stop_owner, stop_name = stop

    def make_start(original: Callable) -> Callable:
        @functools.wraps(original)
        def starting(*args: Any, **kwargs: Any) -> Any:
            begin()
            return original(*args, **kwargs)

        return starting

    def make_stop(original: Callable) -> Callable:
        @functools.wraps(original)
        def stopping(*args: Any, **kwargs: Any) -> Any:
            try:
                return original(*args, **kwargs)
            finally:
                end()

        return stopping

    with (
        observe.replaced(start_owner, start_name, make_start(getattr(start_owner, start_name))),
        observe.replaced(stop_owner, stop_name, make_stop(getattr(stop_owner, stop_name))),
    ):
        try:
            yield profile
        finally:
            end()
            profile.ranks = sorted(spool.collect())


def trace_summary(path: str | os.PathLike, training: str = "forward") -> dict:
    """What a Chrome trace from ``profiled`` holds: its size, the ``record_function`` ranges
    by thread (the training thread is the one that ran ``training``), and on a GPU the
    kernels by stream and the device-to-host copies by stream and host memory kind."""
    events = json.loads(Path(path).read_text())["traceEvents"]
    ranges = [e for e in events if e.get("cat") == "user_annotation" and e.get("ph") == "X"]
    training_tid = next((e["tid"] for e in ranges if e["name"] == training), None)
    by_thread: dict[str, collections.Counter] = {"training": collections.Counter()}
    by_thread["other"] = collections.Counter()
    for event in ranges:
        by_thread["training" if event["tid"] == training_tid else "other"][event["name"]] += 1
    kernels = collections.Counter(
        str(e.get("args", {}).get("stream")) for e in events if e.get("cat") == "kernel"
    )
    # "Memcpy DtoH (Device -> Pinned)": a copy to host memory, and the kind of that memory.
    to_host = collections.Counter(
        (str(e.get("args", {}).get("stream")), e["name"].partition("-> ")[2].rstrip(")") or "?")
        for e in events
        if e.get("cat") == "gpu_memcpy" and "DtoH" in e.get("name", "")
    )
    return {
        "megabytes": os.path.getsize(path) / 1e6,
        "events": len(events),
        "training_thread": dict(by_thread["training"]),
        "other_threads": dict(by_thread["other"]),
        "kernels_by_stream": dict(kernels),
        "copies_to_host": [
            {"stream": stream, "memory": memory, "count": count}
            for (stream, memory), count in sorted(to_host.items())
        ],
    }


def gpu_streams(summary: dict) -> dict:
    """From a ``trace_summary``: the compute stream (the one that ran most kernels) and, for
    every stream that copied to host memory, how many copies of which memory it ran."""
    kernels = summary["kernels_by_stream"]
    compute = max(kernels, key=kernels.get) if kernels else None
    return {
        "compute_stream": compute,
        "kernels": sum(kernels.values()),
        "kernels_on_compute": kernels.get(compute, 0),
        "copies_to_host": [
            {
                **copy,
                "compute": copy["stream"] == compute,
                "kernels": kernels.get(copy["stream"], 0),
            }
            for copy in summary["copies_to_host"]
        ],
    }


def errors(calls: observe.Calls, rank: int = 0) -> list[str | None]:
    """What each call a ``timed`` watch recorded on ``rank`` raised (None: it returned)."""
    return [span.error for span in calls.by_rank.get(rank, [])]


def wait_outcomes(loop: CheckpointLoop) -> dict[int, dict[str, str | None]]:
    """By rank: what each wait on a save's futures raised ("wait for upload": "TypeError:
    ..."), None where it returned."""
    return {rank: {wait.what: wait.error for wait in loop.waits(rank)} for rank in loop.ranks}


def wait_outcome(
    claim: str, loop: CheckpointLoop, wait: str, raised: str | None, what: str
) -> None:
    """Decide that on every rank the wait ``wait`` ("wait for upload") on a save's future
    returned (``raised=None``) or raised an error whose text starts with ``raised``."""
    outcomes = wait_outcomes(loop)
    found = [outcome.get(wait, "not waited") for outcome in outcomes.values()]
    if raised is None:
        held, said = all(f is None for f in found), f"{what} returned"
    else:
        held = all(f is not None and f.startswith(raised) for f in found)
        said = f"{what} raised {raised.split(':')[0]}"
    results.claim(
        claim,
        bool(found) and held,
        f"{said}, on {len(found)} of {len(found)} ranks",
        waits=outcomes,
    )


def returned_types(claim: str, loops: dict[str, CheckpointLoop], expected: dict[str, str]) -> None:
    """Decide that each loop's first ``async_save`` returned (on every rank) the type named in
    ``expected`` ("Future", "AsyncSaveResponse")."""
    found = {
        name: sorted({loop.saves(rank)[0].response for rank in loop.ranks})
        for name, loop in loops.items()
    }
    results.claim(
        claim,
        found == {name: [type_name] for name, type_name in expected.items()},
        "async_save returned: " + ", ".join(f"{t} with {n}" for n, t in expected.items()),
        returned=found,
    )


def threads_alive(call: observe.Call | None = None) -> list[str]:
    """For ``observe.watch``: the names of this process's running threads, sorted."""
    return sorted(thread.name for thread in threading.enumerate())


@contextlib.contextmanager
def threads_around(owner: Any, name: str) -> Iterator[dict[str, observe.Calls]]:
    """The threads running on each rank right before and right after each call of
    ``owner.name`` (``stager.close()``): ``{"before": Calls, "after": Calls}``."""
    with (
        observe.watch(owner, name, threads_alive, before=True) as before,
        observe.watch(owner, name, threads_alive) as after,
    ):
        yield {"before": before, "after": after}


# --------------------------------------------------------------------------
# Claims about a checkpointing loop, decided from what checkpoint_loop recorded
# --------------------------------------------------------------------------


def _saves_with_a_next_step(loop: CheckpointLoop) -> list[tuple[int, Save]]:
    return [(r, s) for r in loop.ranks for s in loop.saves(r) if s.step and s.next_step]


def steps_wait_for_staging(claim: str, loop: CheckpointLoop) -> None:
    """Decide that every ``optimizer.step()`` after a save began once that save's copy was
    done, on every rank."""
    saves = _saves_with_a_next_step(loop)
    late = [
        f"rank {r} step {s.step}"
        for r, s in saves
        if s.staging is None or s.staging.end > s.next_step["optimizer.step"].start
    ]
    results.claim(
        claim,
        bool(saves) and not late,
        f"every optimizer.step() after a save began after its copy ended ({len(saves)} saves)",
        saves=len(saves),
        late=late,
    )


def copy_beside_next_step(claim: str, loop: CheckpointLoop) -> None:
    """Decide that the copy of at least one save ran beside the next step's forward and
    backward pass (a loaded machine may finish some copies inside the call)."""
    saves = _saves_with_a_next_step(loop)
    beside = {f"rank {r} step {s.step}": 1000 * s.beside_compute for r, s in saves}
    overlapped = [ms for ms in beside.values() if ms > 0]
    results.claim(
        claim,
        bool(overlapped),
        f"the copy ran beside the next forward and backward at {len(overlapped)} of "
        f"{len(beside)} saves, up to {max(beside.values(), default=0):.1f} ms",
        beside_ms=beside,
    )


def copies_stopped_by(claim: str, loop: CheckpointLoop, around: dict[str, observe.Calls]) -> None:
    """Decide that the copies ran off the main thread, on threads running right before the
    stager's ``close()`` (``threads_around``) and stopped right after it, on every rank."""
    threads = {s.thread for r in loop.ranks for s in loop.by_rank[r] if s.what == "staging"}
    stopped = [
        threads <= set(before) and not threads & set(after)
        for before, after in zip(around["before"].last(), around["after"].last(), strict=True)
    ]
    on_main = any(s.main for r in loop.ranks for s in loop.by_rank[r] if s.what == "staging")
    results.claim(
        claim,
        bool(threads) and not on_main and len(stopped) == len(loop.ranks) and all(stopped),
        f"{', '.join(sorted(threads))} ran the copies; stager.close() stopped it "
        f"({sum(stopped)} of {len(loop.ranks)} ranks)",
        threads=sorted(threads),
        stopped=stopped,
    )


@dataclasses.dataclass
class LoopComparison:
    """Two loops' blocked time per save (slowest rank) and step times (rank 0), in ms."""

    names: tuple[str, str]
    save_steps: list[int]
    blocked: dict[str, list[float]]
    steps: dict[str, list[float]]

    def verdicts(self) -> dict[str, tuple[str, dict]]:
        first, second = self.names
        return {
            what: stats.verdict(second, values[second], first, values[first], "ms")
            for what, values in (("blocked", self.blocked), ("steps", self.steps))
        }

    def sentences(self) -> list[str]:
        verdicts = self.verdicts()
        return [
            f"Blocked per save (slowest rank): {verdicts['blocked'][0]}.",
            f"Time per step (rank 0): {verdicts['steps'][0]}.",
        ]

    def median_blocked(self, name: str) -> float:
        return stats.summary(self.blocked[name])["median"]

    def loop_seconds(self, name: str) -> float:
        return sum(self.steps[name]) / 1000

    def record(self) -> dict:
        verdicts = self.verdicts()
        return {
            name: {
                **values,
                "verdict": verdicts[what][0],
                "within_noise": verdicts[what][1]["within_noise"],
            }
            for name, what, values in (
                ("blocked_ms", "blocked", self.blocked),
                ("step_ms", "steps", self.steps),
            )
        }


def compare_loops(loops: dict[str, CheckpointLoop], save_steps: list[int]) -> LoopComparison:
    """Two loops (the baseline first) compared on what their saves blocked and their steps."""
    names = tuple(loops)
    return LoopComparison(
        names,  # type: ignore[arg-type]
        list(save_steps),
        {name: loop.blocked_ms(save_steps) for name, loop in loops.items()},
        {name: loop.step_ms(0) for name, loop in loops.items()},
    )


def comparison_table(comparison: LoopComparison):
    """The two loops side by side: what each save blocked, the medians, the loop's time."""
    from page_tools import figures

    rows: list[list[Any]] = [
        [f"blocked by the save after step {step} (ms)"]
        + [round(comparison.blocked[name][i], 1) for name in comparison.names]
        for i, step in enumerate(comparison.save_steps)
    ]
    rows.append(
        ["median blocked per save (ms)"]
        + [round(comparison.median_blocked(name), 1) for name in comparison.names]
    )
    rows.append(
        ["median step (ms, rank 0)"]
        + [round(stats.summary(comparison.steps[name])["median"], 1) for name in comparison.names]
    )
    rows.append(
        [f"steps 1 to {len(comparison.steps[comparison.names[0]])} (s, rank 0)"]
        + [round(comparison.loop_seconds(name), 2) for name in comparison.names]
    )
    return figures.Table(["", *comparison.names], rows)


# --------------------------------------------------------------------------
# Claims about a profiler trace
# --------------------------------------------------------------------------


def trace_holds_timeline(
    claim: str, traces: dict[str, dict], loops: dict[str, CheckpointLoop], copies_off_main: str
) -> None:
    """Decide that each rank-0 trace (``trace_summary``) holds a range for every phase its
    loop's timeline recorded on the training thread, as many, and the copies ("staging") of
    ``copies_off_main`` on other threads, the others' on the training thread."""
    wrong = []
    for run, summary in traces.items():
        counted = loops[run].counts(0)
        for phase in PHASES:
            if summary["training_thread"].get(phase, 0) != counted.get(phase, 0):
                wrong.append(f"{run}: {phase}")
        copies = sum(s.what == "staging" for s in loops[run].by_rank[0])
        where = "other_threads" if run == copies_off_main else "training_thread"
        if not copies or summary[where].get("staging", 0) != copies:
            wrong.append(f"{run}: staging")
    results.claim(
        claim,
        not wrong,
        f"traces match the timelines; copies off the training thread with {copies_off_main} only",
        wrong=wrong,
        training={run: summary["training_thread"] for run, summary in traces.items()},
    )


def trace_table(traces: dict[str, dict]):
    """The ranges of each trace named after the timeline's phases, by thread."""
    from page_tools import figures

    columns = ["range"]
    for run in traces:
        columns += [f"{run}: training thread", "other threads"]
    rows = [
        [name]
        + [
            traces[run][where].get(name, 0)
            for run in traces
            for where in ("training_thread", "other_threads")
        ]
        for name in (*PHASES, "staging", "upload")
    ]
    return figures.Table(columns, rows)


def copies_off_the_compute_stream(claim: str, summary: dict, on_gpu: bool) -> None:
    """On a GPU, decide that the trace's copies to host memory went into pinned memory on a
    stream other than the compute stream, and print the streams; elsewhere, say that this
    machine cannot tell."""
    if not on_gpu:
        results.not_measured_here(
            claim, "GPU streams: not measured here (no GPU on this machine, no streams)"
        )
        return
    gpu = gpu_streams(summary)
    print(
        f"GPU kernels: {gpu['kernels']}, {gpu['kernels_on_compute']} of them on stream "
        f"{gpu['compute_stream']} (the compute stream)"
    )
    for copy in gpu["copies_to_host"]:
        which = "the compute stream" if copy["compute"] else f"{copy['kernels']} kernels"
        print(
            f"copies to {copy['memory'].lower()} host memory on stream {copy['stream']} "
            f"({which}): {copy['count']}"
        )
    off = [c for c in gpu["copies_to_host"] if not c["compute"]]
    results.claim(
        claim,
        bool(off) and all(c["memory"] == "Pinned" for c in off),
        f"the copies to pinned host memory ran on {len({c['stream'] for c in off})} stream(s) "
        "beside the compute stream",
        **gpu,
    )


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
            checkpoint = observe.checkpoint_id(observe.Call(args, kwargs))
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


def stamps(
    owner: Any, name: str, where: Callable[[observe.Call], bool] | None = None
) -> contextlib.AbstractContextManager[observe.Calls]:
    """Watch ``owner.name``: for each call, (its checkpoint if it is a DCP call, when it
    started), by rank."""
    return observe.watch(
        owner,
        name,
        lambda call: (observe.checkpoint_id(call), time.perf_counter()),
        before=True,
        where=where,
    )


@dataclasses.dataclass
class Phases:
    """Calls of one function (``starts``) and of a function they call (``thens``), by rank."""

    starts: observe.Calls
    thens: observe.Calls

    def by_rank(self) -> dict[int, list[tuple[str | None, float | None]]]:
        """Per rank, per call in time order: (checkpoint, seconds from the call until the
        first ``then`` that followed it and came before the next call), None if none did."""
        phases: dict[int, list[tuple[str | None, float | None]]] = {}
        for rank, starts in self.starts.by_rank.items():
            starts = sorted(starts, key=lambda start: start[1])
            thens = sorted(when for _, when in self.thens.by_rank.get(rank, []))
            rank_phases = []
            for i, (checkpoint, started) in enumerate(starts):
                ends = starts[i + 1][1] if i + 1 < len(starts) else float("inf")
                first = bisect.bisect_left(thens, started)
                later = thens[first] if first < len(thens) and thens[first] < ends else None
                rank_phases.append((checkpoint, None if later is None else later - started))
            phases[rank] = rank_phases
        return phases


def slowest(phases: Phases, checkpoints: Iterable[str], nth: int = 0) -> list[float | None]:
    """For each checkpoint, the slowest rank's phase of its ``nth`` call about it (a collective
    call's phase ends when it ends on its last rank); None where a rank has no such call."""
    by_rank = phases.by_rank()
    found = []
    for checkpoint in checkpoints:
        seconds = []
        for rank_phases in by_rank.values():
            mine = [s for path, s in rank_phases if path == checkpoint]
            seconds.append(mine[nth] if len(mine) > nth else None)
        found.append(None if not seconds or None in seconds else max(seconds))
    return found


@contextlib.contextmanager
def until_first(owner: Any, name: str, then_owner: Any, then_name: str) -> Iterator[Phases]:
    """Time, at every call of ``owner.name`` inside the block, the phase until it first calls
    ``then_owner.then_name`` (``dcp.save`` until ``FileSystemWriter.write_data``: planning)."""
    with stamps(owner, name) as starts, stamps(then_owner, then_name) as thens:
        yield Phases(starts, thens)


def _checkpoint_id(kwargs: dict) -> str | None:
    return observe.checkpoint_id(observe.Call((), kwargs))


@contextlib.contextmanager
def checkpoint_saves(dcp: Any, manager_class: Any = None) -> Iterator[observe.Calls]:
    """Record every ``dcp.save`` and ``dcp.async_save`` made inside the block, by rank, and
    every ``save(checkpoint_id, payload)`` of ``manager_class`` (torch_checkpointing's
    ``CheckpointManager``: it returns the write's future, or None where it wrote already).

    Each record: ``{"call", "checkpoint_id", "called", "returned", "durable", "error"}``
    (seconds of ``time.perf_counter``; ``error`` is the exception a failed save raised, as
    text, else None). A record comes back once its checkpoint is durable (or failed): for
    the manager, once the future its save returned is done (torch_checkpointing 0.1.1's own
    is done once the bytes are written: it never calls ``fsync``).
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
            when_durable(getattr(response, "upload_completion", response), record)
            return response

        def when_durable(upload: Any, record: dict) -> None:
            def durable(future: Any) -> None:
                error = future.exception()
                now = None if error is not None else time.perf_counter()
                put({**record, "durable": now, "error": None if error is None else repr(error)})

            upload.add_done_callback(durable)

        def timed_manager_save(manager: Any, checkpoint_id: Any, *args: Any, **kwargs: Any) -> Any:
            record = {"call": "manager.save", "checkpoint_id": os.fspath(checkpoint_id)}
            record["called"] = time.perf_counter()
            write = manager_save(manager, checkpoint_id, *args, **kwargs)
            record["returned"] = time.perf_counter()
            if write is None:  # a synchronous manager: written before it returned
                put({**record, "durable": record["returned"], "error": None})
            else:
                when_durable(write, record)
            return write

        with contextlib.ExitStack() as watches:
            watches.enter_context(observe.replaced(dcp, "save", timed_save))
            watches.enter_context(observe.replaced(dcp, "async_save", timed_async_save))
            if manager_class is not None:
                manager_save = watches.enter_context(
                    observe.replaced(manager_class, "save", timed_manager_save)
                )
            yield saves


def by_checkpoint(saves: observe.Calls) -> dict[str, list[dict]]:
    """The records of a ``checkpoint_saves`` watch by checkpoint path: one per rank."""
    found: dict[str, list[dict]] = {}
    for rank, records in sorted(saves.by_rank.items()):
        for record in records:
            found.setdefault(record["checkpoint_id"], []).append({**record, "rank": rank})
    return found


@dataclasses.dataclass
class CallSpan:
    """One timed call: ``time.perf_counter()`` at its start and end, on the rank that made it."""

    name: str  # what was called, "owner.name"
    start: float
    end: float
    main_thread: bool  # made by the rank's main thread (the training loop), not a helper
    within: tuple[str, ...] = ()  # the timed calls it ran inside, outermost first
    label: Any = None  # label(call), if the watch was given one
    done: float | None = None  # completes=True: when the Future it returned completed
    key: tuple[int, int] = (0, 0)  # (process, number): matches a completion to its span

    @property
    def seconds(self) -> float:
        return self.end - self.start


@dataclasses.dataclass
class _Done:
    key: tuple[int, int]
    at: float


_ACTIVE = threading.local()  # the timed calls in progress in this thread, outermost first


_NUMBERS = itertools.count()


def _owner_name(owner: Any) -> str:
    return getattr(owner, "__name__", type(owner).__name__).rsplit(".", 1)[-1]


class Completions:
    """Futures to call back on right before they complete: before a thread that waits in
    ``result()`` wakes up (a done callback runs after that, when the rank may be gone)."""

    def __init__(self) -> None:
        self._tracked: dict[int, tuple[concurrent.futures.Future, list[Callable]]] = {}
        self._lock = threading.Lock()

    def track(self, future: concurrent.futures.Future, callback: Callable[[Any], None]) -> None:
        with self._lock:
            if not future.done():
                self._tracked.setdefault(id(future), (future, []))[1].append(callback)
                return
        callback(future)  # already complete

    def _completing(self, future: concurrent.futures.Future) -> None:
        with self._lock:
            entry = self._tracked.pop(id(future), None)
        if entry is not None and entry[0] is future:
            for callback in entry[1]:
                callback(future)


@contextlib.contextmanager
def completions() -> Iterator[Completions]:
    """``Future.set_result`` and ``set_exception`` call back on the tracked futures first,
    for the length of the block; on exit they are what they were."""
    tracked = Completions()
    originals: dict[str, Callable] = {}

    def hook(method: str) -> Callable:
        def completing(self: concurrent.futures.Future, *args: Any, **kwargs: Any) -> Any:
            tracked._completing(self)
            return originals[method](self, *args, **kwargs)

        return completing

    Future = concurrent.futures.Future
    with (
        observe.replaced(Future, "set_result", hook("set_result")) as originals["set_result"],
        observe.replaced(Future, "set_exception", hook("set_exception")) as originals[
            "set_exception"
        ],
    ):
        yield tracked


@contextlib.contextmanager
def spans(
    owner: Any,
    name: str,
    *,
    label: Callable[[observe.Call], Any] | None = None,
    completes: bool = False,
    where: Callable[[observe.Call], bool] | None = None,
) -> Iterator[observe.Calls]:
    """Time every call of ``owner.name`` made inside the block: ``CallSpan`` records, by rank.

    ``label(call)`` (after the call) names a span, for example by the future it returned;
    ``where(call)`` (before it) keeps only the calls it accepts.
    ``completes=True``: the call returns a ``concurrent.futures.Future`` (or an object with
    ``upload_completion``), and its span also says when that future completed. On exit
    ``owner.name`` is what it was.
    """
    spool, calls = observe._Spool(), observe.Calls()
    title = f"{_owner_name(owner)}.{name}"

    def timed(*args: Any, **kwargs: Any) -> Any:
        stack = _ACTIVE.__dict__.setdefault("stack", [])
        call = observe.Call(args, kwargs)
        if where is not None and not where(call):
            return original(*args, **kwargs)
        span = CallSpan(
            title,
            time.perf_counter(),
            0.0,
            threading.current_thread() is threading.main_thread(),
            within=tuple(stack),
            key=(os.getpid(), next(_NUMBERS)),
        )
        stack.append(title)
        try:
            call.result = original(*args, **kwargs)
        finally:
            stack.pop()
            span.end = time.perf_counter()
        span.label = label(call) if label is not None else None
        spool.put(span)
        future = getattr(call.result, "upload_completion", call.result)
        if completes and isinstance(future, concurrent.futures.Future):
            tracked.track(
                future, lambda _, key=span.key: spool.put(_Done(key, time.perf_counter()))
            )
        return call.result

    with (
        completions() if completes else contextlib.nullcontext() as tracked,
        observe.replaced(owner, name, timed) as original,
    ):
        try:
            yield calls
        finally:
            collected = spool.collect()
            for records in collected.values():
                done = {r.key: r.at for r in records if isinstance(r, _Done)}
                for record in records:
                    if isinstance(record, CallSpan):
                        record.done = done.get(record.key)
            calls.by_rank = {
                rank: [r for r in records if isinstance(r, CallSpan)]
                for rank, records in collected.items()
            }


def spans_of(function: Callable[..., Any], **options: Any):
    """``spans`` of a function the page defines (its training step), where the page's other
    functions look it up: in the module that defines it."""
    return spans(sys.modules[function.__module__], function.__name__, **options)


def longest(calls: observe.Calls, where: Callable[[CallSpan], bool] | None = None) -> list[float]:
    """Seconds of each kept call on the slowest rank: the i-th value is the longest i-th
    call of any rank (collectives make every rank wait for the slowest)."""
    kept = [
        [span.seconds for span in records if where is None or where(span)]
        for _, records in sorted(calls.by_rank.items())
    ]
    return [max(column) for column in zip(*kept, strict=True)] if kept else []


def label_has(text: str) -> Callable[[CallSpan], bool]:
    """For ``longest``'s ``where``: the spans whose label (a path, say) contains ``text``."""
    return lambda span: text in str(span.label)


# --------------------------------------------------------------------------
# A training loop that saves with dcp.async_save
# --------------------------------------------------------------------------


@dataclasses.dataclass
class LoopSave:
    """One save of the loop, on one rank (seconds)."""

    step: int  # the training steps done before it
    blocked: float  # the loop waited: for the previous save, in async_save, for this one
    waited: float  # of which for the previous save (at most one in flight)
    upload: float  # from the start of ``blocked`` until the save was complete
    awaited: bool  # the loop waited for this save right away (the first one)


@dataclasses.dataclass
class Step:
    seconds: float
    in_flight: bool  # an upload was running when the step started


def _loop_on_one_rank(saves: list[CallSpan], waits: list[CallSpan], steps: list[CallSpan]) -> dict:
    saves = sorted((s for s in saves if s.main_thread), key=lambda s: s.start)
    waits = sorted((w for w in waits if w.main_thread and not w.within), key=lambda w: w.start)
    steps = sorted((s for s in steps if s.main_thread), key=lambda s: s.start)
    found = []
    for index, save in enumerate(saves):
        last_step = max((s.end for s in steps if s.end <= save.start), default=float("-inf"))
        before = [
            w
            for w in waits
            if index and w.label == saves[index - 1].label
            if last_step <= w.start and w.end <= save.start
        ]
        next_step = min((s.start for s in steps if s.start >= save.end), default=float("inf"))
        after = [w for w in waits if w.label == save.label and save.end <= w.start < next_step]
        began = min([w.start for w in before] + [save.start])
        found.append(
            LoopSave(
                step=sum(1 for s in steps if s.end <= save.start),
                blocked=sum(w.seconds for w in before + after) + save.seconds,
                waited=sum(w.seconds for w in before),
                upload=(save.done if save.done is not None else float("nan")) - began,
                awaited=bool(after),
            )
        )
    uploads = [(s.end, s.done if s.done is not None else float("inf")) for s in saves]
    timed_steps = [
        Step(s.seconds, any(end <= s.start < done for end, done in uploads)) for s in steps
    ]
    return {"saves": found, "steps": timed_steps}


@dataclasses.dataclass
class LoopTimeline:
    """What ``async_save_loop`` measured: per rank, the loop's saves and steps."""

    by_rank: dict[int, dict] = dataclasses.field(default_factory=dict)

    def saves(self) -> list[LoopSave]:
        """Each save on the slowest rank (the others wait for it at the next collective)."""
        columns = zip(*(r["saves"] for _, r in sorted(self.by_rank.items())), strict=True)
        return [
            LoopSave(
                step=column[0].step,
                blocked=max(s.blocked for s in column),
                waited=max(s.waited for s in column),
                upload=max(s.upload for s in column),
                awaited=column[0].awaited,
            )
            for column in columns
        ]

    def stalls(self) -> list[float]:
        """Seconds the loop was blocked at each save after the first (slowest rank)."""
        return [save.blocked for save in self.saves()[1:]]

    def uploads(self) -> list[float]:
        """Seconds from each save after the first until it was complete (slowest rank)."""
        return [save.upload for save in self.saves()[1:]]

    def steps(self, in_flight: bool, rank: int = 0) -> list[float]:
        """Seconds of rank ``rank``'s steps after the first that started with an upload in
        flight (``in_flight=True``) or with none."""
        return [s.seconds for s in self.by_rank[rank]["steps"][1:] if s.in_flight == in_flight]

    def summary(self) -> dict:
        """The loop in numbers, for the results file and a table row: median stall and
        upload of the saves after the first (ms, slowest rank), the steps that started
        with an upload in flight, and how much slower they were than the others."""
        busy, idle = self.steps(in_flight=True), self.steps(in_flight=False)
        return {
            "stall_ms": statistics.median(self.stalls()) * 1e3,
            "upload_ms": statistics.median(self.uploads()) * 1e3,
            "steps_in_flight": len(busy),
            "steps": len(busy) + len(idle),
            "slow_down": slow_down(busy, idle),
            "stalls_s": self.stalls(),
            "saves": [dataclasses.asdict(save) for save in self.saves()],
            "steps_busy_s": busy,
            "steps_idle_s": idle,
        }


@contextlib.contextmanager
def async_save_loop(
    step: Callable[..., Any],
    owner: Any = None,
    name: str = "async_save",
    where: Callable[[observe.Call], bool] | None = None,
) -> Iterator[LoopTimeline]:
    """Time a training loop that calls ``step`` once a step and saves with ``owner.name``
    (``dcp.async_save``): yields a ``LoopTimeline``, filled in when the block ends.

    Three watches: the step function, the saves (with when each upload completed), and
    ``Future.result`` (the loop's waits for a save). A save's ``blocked`` time adds the
    wait for the previous save, the call itself, and a wait for this save before the next
    step (the loop's first save, awaited). ``where`` keeps only the saves it accepts
    (the loop's, not a save the rank makes after it).
    """
    if owner is None:
        import torch.distributed.checkpoint as owner
    timeline = LoopTimeline()
    try:
        with (
            spans(owner, name, label=lambda c: id(c.result), completes=True, where=where) as saves,
            spans(concurrent.futures.Future, "result", label=lambda call: id(call.args[0])) as w,
            spans_of(step) as steps,
        ):
            yield timeline
    finally:
        timeline.by_rank = {
            rank: _loop_on_one_rank(
                saves.by_rank.get(rank, []), w.by_rank.get(rank, []), steps.by_rank[rank]
            )
            for rank in sorted(steps.by_rank)
        }


def saves_table(timelines: dict[str, LoopTimeline], caption: str = "") -> figures.Table:
    """One row per save of each loop, on the slowest rank."""
    columns = ["run", "step", "loop blocked (ms)", "of which waiting (ms)", "complete after (ms)"]
    rows = [
        [name, save.step, round(save.blocked * 1e3, 1), round(save.waited * 1e3, 1)]
        + [round(save.upload * 1e3)]
        for name, timeline in timelines.items()
        for save in timeline.saves()
    ]
    return figures.Table(columns, rows, caption)


def summaries(timelines: dict[str, LoopTimeline]) -> dict[str, dict]:
    """``LoopTimeline.summary()`` of each of several loops, by name."""
    return {name: timeline.summary() for name, timeline in timelines.items()}


def strategies_table(summaries: dict[str, dict], stalls_only: dict[str, float]) -> figures.Table:
    """Every way of saving side by side: first the ones measured by their stall alone
    (``stalls_only``, ms), then a row per loop of ``summaries``."""
    columns = ["strategy", "stall (ms)", "upload (ms)", "steps in flight", "slow-down"]
    rows = [[name, round(stall, 1), "-", "-", "-"] for name, stall in stalls_only.items()]
    return figures.Table(columns, rows + [summary_row(n, s) for n, s in summaries.items()])


def summary_row(name: str, summary: dict) -> list:
    """A row of the strategies table from ``LoopTimeline.summary()``."""
    slower = summary["slow_down"]
    return [
        name,
        round(summary["stall_ms"], 1),
        round(summary["upload_ms"]),
        f"{summary['steps_in_flight']}/{summary['steps']}",
        "-" if slower is None else f"{slower:+.0%}",
    ]


def slow_down(busy: list[float], idle: list[float]) -> float | None:
    """How much longer the median busy step was than the median idle one (0.25: 25%)."""
    if not busy or not idle:
        return None
    return statistics.median(busy) / statistics.median(idle) - 1


# --------------------------------------------------------------------------
# Copies from a GPU into host memory (run on a GPU machine, in a process of its own)
# --------------------------------------------------------------------------


def copy_to_host_seconds(nbytes: int = 256 * 2**20, repeats: int = 5) -> dict[str, list[float]]:
    """Seconds of copying ``nbytes`` from the GPU into new pageable memory (what a save
    without a stager does), into reused pageable memory and into reused pinned memory,
    ``repeats`` times each."""
    source = torch.rand(nbytes // 4, device="cuda")
    targets = {
        "new pageable memory": None,
        "reused pageable memory": torch.empty(source.shape),
        "reused pinned memory": torch.empty(source.shape, pin_memory=True),
    }
    seconds: dict[str, list[float]] = {}
    for memory, into in targets.items():
        seconds[memory] = []
        for _ in range(repeats):
            torch.cuda.synchronize()
            start = time.perf_counter()
            if into is None:
                source.to("cpu")
            else:
                into.copy_(source, non_blocking=into.is_pinned())
            torch.cuda.synchronize()
            seconds[memory].append(time.perf_counter() - start)
    return seconds


def claim_pinned_copy_is_faster(claim: str, pinning: dict | None) -> None:
    """Decide that copying from the GPU into reused pinned memory took less time than into
    new pageable memory, beyond noise (``memory.pinning_on_gpu``; not measured without one)."""
    from page_tools import results, stats

    if pinning is None:
        return results.not_measured_here(claim, f"{claim}: not measured, no GPU here")
    copies = pinning["copies_s"]
    stats.claim_less(
        claim,
        "a copy into reused pinned memory",
        copies["reused pinned memory"],
        "into new pageable memory",
        copies["new pageable memory"],
        "ms",
        1e3,
    )
