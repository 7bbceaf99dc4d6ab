"""Clocks and timelines: how long the calls a page watches took, on every rank.

``spans(owner, name)`` times every call of ``owner.name`` made inside the block, on the
rank (and the thread) that made it, and brings the ``Span`` records back by rank, as
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

import concurrent.futures
import contextlib
import dataclasses
import itertools
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from page_tools import figures, observe


@dataclasses.dataclass
class Span:
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
    """Time every call of ``owner.name`` made inside the block: ``Span`` records, by rank.

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
        span = Span(
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
                    if isinstance(record, Span):
                        record.done = done.get(record.key)
            calls.by_rank = {
                rank: [r for r in records if isinstance(r, Span)]
                for rank, records in collected.items()
            }


def spans_of(function: Callable[..., Any], **options: Any):
    """``spans`` of a function the page defines (its training step), where the page's other
    functions look it up: in the module that defines it."""
    return spans(sys.modules[function.__module__], function.__name__, **options)


def slowest(calls: observe.Calls, where: Callable[[Span], bool] | None = None) -> list[float]:
    """Seconds of each kept call on the slowest rank: the i-th value is the longest i-th
    call of any rank (collectives make every rank wait for the slowest)."""
    kept = [
        [span.seconds for span in records if where is None or where(span)]
        for _, records in sorted(calls.by_rank.items())
    ]
    return [max(column) for column in zip(*kept, strict=True)] if kept else []


def label_has(text: str) -> Callable[[Span], bool]:
    """For ``slowest``'s ``where``: the spans whose label (a path, say) contains ``text``."""
    return lambda span: text in str(span.label)


# --------------------------------------------------------------------------
# A training loop that saves with dcp.async_save
# --------------------------------------------------------------------------


@dataclasses.dataclass
class Save:
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


def _loop_on_one_rank(saves: list[Span], waits: list[Span], steps: list[Span]) -> dict:
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
            Save(
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

    def saves(self) -> list[Save]:
        """Each save on the slowest rank (the others wait for it at the next collective)."""
        columns = zip(*(r["saves"] for _, r in sorted(self.by_rank.items())), strict=True)
        return [
            Save(
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
