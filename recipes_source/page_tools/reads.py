"""What a DCP load read from the checkpoint's files: the keys and the bytes, by rank.

``file_reads(FileSystemReader)`` watches a storage reader's ``read_data(plan, planner)``:
at each call, before anything is read, it records the keys of the plan's items and the
bytes of the file ranges they name (``.metadata``'s storage index: file, offset,
length). A key a load does not read (the optimizer of a model-only load) is not in the
plan, and no byte of it is read. ``read_keys`` and ``read_bytes`` sum the records of
every rank; a load that failed before reading records nothing.

``load_phases(dcp, where)`` profiles the loads it is asked to (cProfile, the calling
thread) and splits each into ``LOAD_PHASES``: ``torch.load`` reading each tensor's bytes
into a tensor it allocates, ``copy_`` into the state dict's tensor, and the rest
(``phases_table``).

``save_phases(dcp, writer_class, where)`` times the saves it is asked to by the clock, on
every thread: planning until the writer's ``write_data``, the writer threads' ``torch.save``
+ write of each item and their ``fsync`` (each a mean per thread), the rest of
``write_data``, ``finish`` (``.metadata``: rank 0 alone calls it), and the rest
(``SAVE_PHASES``).
"""

from __future__ import annotations

import contextlib
import cProfile
import os
import pstats
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from page_tools import figures, observe

# Where a FileSystemReader load spends its time, on the thread that calls dcp.load: each
# phase is the own time (cProfile's tottime) of the functions whose names contain these.
# torch.load reads each tensor's bytes from the file into a tensor it allocates; DCP then
# copies that tensor into the one the state dict holds.
LOAD_PHASES = {
    "torch.load reads the bytes into a new tensor": ("'readinto'",),
    "copy_ into the model's tensor": ("'copy_'",),
}


def _plan_read(call: observe.Call) -> dict[str, Any]:
    reader, plan = call.args[:2]
    items = [
        (item.storage_index.fqn, reader.storage_data[item.storage_index]) for item in plan.items
    ]
    return {
        "keys": sorted({fqn for fqn, _ in items}),
        "bytes": sum(info.length for _, info in items),
        "files": sorted({info.relative_path for _, info in items}),
    }


def phases(profile: cProfile.Profile, named: dict[str, tuple[str, ...]] = LOAD_PHASES) -> dict:
    """Seconds of each phase in ``profile``: the own time of every function whose name
    contains one of the phase's strings."""
    found = dict.fromkeys(named, 0.0)
    for (_, _, function), (_, _, own_s, _, _) in pstats.Stats(profile).stats.items():
        for phase, parts in named.items():
            if any(part in function for part in parts):
                found[phase] += own_s
    return found


@contextlib.contextmanager
def load_phases(dcp: Any, where: Callable[[str], bool]) -> Iterator[observe.Calls]:
    """Profile every ``dcp.load`` whose checkpoint (its ``checkpoint_id``, or its storage
    reader's path: ``observe.checkpoint_id``) ``where`` accepts; per call, by rank:
    ``{"checkpoint_id", "total_s", "phases": {phase: seconds}}`` (``LOAD_PHASES``).
    ``dcp.load`` is restored on exit."""
    with observe.recording() as (put, calls):

        def load(*args: Any, **kwargs: Any) -> Any:
            checkpoint_id = observe.checkpoint_id(observe.Call(args, kwargs)) or ""
            if not where(checkpoint_id):
                return original(*args, **kwargs)
            profile, started = cProfile.Profile(), time.perf_counter()
            result = profile.runcall(original, *args, **kwargs)
            total_s = time.perf_counter() - started
            put({"checkpoint_id": checkpoint_id, "total_s": total_s, "phases": phases(profile)})
            return result

        with observe.replaced(dcp, "load", load) as original:
            yield calls


# Where a FileSystemWriter save spends its time: the first and the last two by the clock on
# the calling thread; the writer threads' own by the clock on each, summed, then divided by
# their number (the threads run side by side).
SAVE_PHASES = (
    "planning, until write_data",
    "torch.save + write, per writer thread",
    "fsync, per writer thread",
    "the rest of write_data",
    "finish: .metadata written, synced",
)


def _save_phases(found: dict[str, float]) -> dict[str, float]:
    threads = max(1, int(found.get("threads", 1)))
    write, sync = found.get("write_item_s", 0.0) / threads, found.get("fsync_s", 0.0) / threads
    seconds = [found.get("planning_s", 0.0), write, sync]
    seconds += [found.get("write_data_s", 0.0) - write - sync, found.get("finish_s", 0.0)]
    return dict(zip(SAVE_PHASES, seconds, strict=True))


@contextlib.contextmanager
def save_phases(
    dcp: Any, writer_class: type, where: Callable[[str], bool]
) -> Iterator[observe.Calls]:
    """Time every ``dcp.save`` whose checkpoint (``observe.checkpoint_id``) ``where`` accepts
    and whose storage writer is a ``writer_class`` (``FileSystemWriter``); per call, by rank:
    ``{"checkpoint_id", "total_s", "threads", "phases": {phase: seconds}}`` (``SAVE_PHASES``).
    ``dcp.save``, the writer's ``write_data`` and ``finish``, DCP's ``_write_item`` and
    ``os.fsync`` are restored on exit."""
    from torch.distributed.checkpoint import filesystem

    found: dict[str, float] = {}  # the profiled save in flight in this process, if any
    lock = threading.Lock()
    originals = (dcp.save, writer_class.write_data, writer_class.finish)
    originals += (filesystem._write_item, os.fsync)

    def timed(key: str, function: Callable, *args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        try:
            return function(*args, **kwargs)
        finally:
            with lock:
                found[key] = found.get(key, 0.0) + time.perf_counter() - started

    def while_writing(key: str, function: Callable) -> Callable:
        def call(*args: Any, **kwargs: Any) -> Any:
            if not found.get("writing"):
                return function(*args, **kwargs)
            return timed(key, function, *args, **kwargs)

        return call

    def write_data(writer: Any, *args: Any, **kwargs: Any) -> Any:
        if "started" not in found:
            return originals[1](writer, *args, **kwargs)
        found["planning_s"] = time.perf_counter() - found["started"]
        found["threads"], found["writing"] = getattr(writer, "thread_count", 1), True
        try:
            return timed("write_data_s", originals[1], writer, *args, **kwargs)
        finally:
            found["writing"] = False

    def finish(writer: Any, *args: Any, **kwargs: Any) -> Any:
        if "started" not in found:
            return originals[2](writer, *args, **kwargs)
        return timed("finish_s", originals[2], writer, *args, **kwargs)

    with observe.recording() as (put, calls):

        def save(*args: Any, **kwargs: Any) -> Any:
            call = observe.Call(args, kwargs)
            checkpoint_id = observe.checkpoint_id(call) or ""
            mine = isinstance(kwargs.get("storage_writer"), writer_class)
            if not (mine and where(checkpoint_id)):
                return originals[0](*args, **kwargs)
            found.clear()
            found["started"] = time.perf_counter()
            try:
                result = originals[0](*args, **kwargs)
            finally:
                total_s, measured = time.perf_counter() - found["started"], dict(found)
                found.clear()
            put(
                {
                    "checkpoint_id": checkpoint_id,
                    "total_s": total_s,
                    "threads": measured.get("threads", 1),
                    "phases": _save_phases(measured),
                }
            )
            return result

        with (
            observe.replaced(dcp, "save", save),
            observe.replaced(writer_class, "write_data", write_data),
            observe.replaced(writer_class, "finish", finish),
            observe.replaced(
                filesystem, "_write_item", while_writing("write_item_s", originals[3])
            ),
            observe.replaced(os, "fsync", while_writing("fsync_s", originals[4])),
        ):
            yield calls


def median_call(records: list[dict]) -> dict:
    """The call whose ``total_s`` is the median (the lower of the middle two): one real call,
    its phases as they were, where one slow call (a disk's hiccup) would mislead."""
    by_time = sorted(records, key=lambda record: record["total_s"])
    return by_time[(len(by_time) - 1) // 2]


def phases_table(
    calls: observe.Calls,
    total_bytes: int,
    caption: str = "cProfile's own time of the calling thread",
    pick: Callable[[list[dict]], dict] = lambda records: records[0],
) -> figures.Table:
    """Each rank's profiled load (or save) of its share of ``total_bytes``, the one ``pick``
    chooses (by default the first: a cold load): every phase's seconds, its share of the
    call, and the speed the call would have if that phase were all it did; then the rest."""
    rows, share_bytes = [], total_bytes / max(1, len(calls.by_rank))
    for rank, records in sorted(calls.by_rank.items()):
        record = pick(records)
        rest = record["total_s"] - sum(record["phases"].values())
        for phase, seconds in [*record["phases"].items(), ("the rest", rest)]:
            share = seconds / record["total_s"]
            alone = f"{share_bytes / seconds / 1e9:.2f}" if seconds > 0 else "-"
            rows.append([rank, phase, f"{seconds * 1e3:.0f}", f"{share:.0%}", alone])
    columns = ["rank", "phase", "ms", "share", "GB/s if it were all"]
    return figures.Table(columns, rows, caption=caption)


def file_reads(reader_class: type):
    """Watch ``reader_class.read_data``: per call, by rank, ``{"keys", "bytes", "files"}``."""
    return observe.watch(reader_class, "read_data", _plan_read, before=True)


def read_keys(reads: observe.Calls) -> list[str]:
    """Every key any rank read, sorted."""
    return sorted({key for records in reads.by_rank.values() for r in records for key in r["keys"]})


def read_bytes(reads: observe.Calls) -> int:
    """The bytes every rank read, summed (a range read by two ranks counts twice)."""
    return sum(r["bytes"] for records in reads.by_rank.values() for r in records)


def stored_bytes(checkpoint_dir: str, keys: Any = None) -> int:
    """The bytes ``.metadata`` indexes for ``keys`` (all keys if None): what reading them
    once costs."""
    from torch.distributed.checkpoint import FileSystemReader

    metadata = FileSystemReader(checkpoint_dir).read_metadata()
    wanted = None if keys is None else set(keys)
    return sum(
        info.length
        for index, info in metadata.storage_data.items()
        if wanted is None or index.fqn in wanted
    )


def part(state: Any, *names: str) -> dict[str, Any]:
    """The part of a whole state (``proofs.whole_state``: a watch's records, a state dict)
    under the given names: a name ending in ``.`` is a prefix (``"app.model."``), any
    other is one key."""
    from page_tools import proofs

    prefixes = tuple(name for name in names if name.endswith("."))
    exact = {name for name in names if not name.endswith(".")}
    return {
        key: value
        for key, value in proofs.whole_state(state).items()
        if key in exact or key.startswith(prefixes)
    }
