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
"""

from __future__ import annotations

import contextlib
import cProfile
import pstats
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


def phases_table(calls: observe.Calls, total_bytes: int) -> figures.Table:
    """Each rank's first profiled load of its share of ``total_bytes``: every phase's
    seconds, its share of the load, and the speed the load would have if that phase were all
    it did; then the rest."""
    rows, share_bytes = [], total_bytes / max(1, len(calls.by_rank))
    for rank, records in sorted(calls.by_rank.items()):
        record = records[0]  # the first: a cold load
        rest = record["total_s"] - sum(record["phases"].values())
        for phase, seconds in [*record["phases"].items(), ("the rest", rest)]:
            share = seconds / record["total_s"]
            alone = f"{share_bytes / seconds / 1e9:.2f}" if seconds > 0 else "-"
            rows.append([rank, phase, f"{seconds * 1e3:.0f}", f"{share:.0%}", alone])
    columns = ["rank", "phase", "ms", "share", "GB/s if it were all"]
    return figures.Table(columns, rows, caption="cProfile's own time of the calling thread")


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
