"""What a DCP load read from the checkpoint's files: the keys and the bytes, by rank.

``file_reads(FileSystemReader)`` watches a storage reader's ``read_data(plan, planner)``:
at each call, before anything is read, it records the keys of the plan's items and the
bytes of the file ranges they name (``.metadata``'s storage index: file, offset,
length). A key a load does not read (the optimizer of a model-only load) is not in the
plan, and no byte of it is read. ``read_keys`` and ``read_bytes`` sum the records of
every rank; a load that failed before reading records nothing.
"""

from __future__ import annotations

from typing import Any

from page_tools import observe


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
