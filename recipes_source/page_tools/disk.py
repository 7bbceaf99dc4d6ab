"""Disk and copy limits, and checkpoints checked on disk.

No save can stage a checkpoint faster than the machine copies memory, or make it
durable faster than the disk writes and syncs it. ``copy_and_write_speeds`` measures
both on a rank, for that rank's share of a checkpoint: a copy into a buffer it already
touched (what a reused staging buffer does), a copy into pages new from the kernel (what
fresh staging costs at worst: the kernel must also supply and zero every page), and a
write plus ``fsync`` into the checkpoint directory. With an accelerator the copies go
from the device to host memory (pinned, for the reused buffer). ``slowest`` keeps the
lowest of every rank's: a save waits for its slowest rank.

``checkpoint_on_disk(path)`` says whether a DCP checkpoint is complete: its
``.metadata`` (which DCP writes last) is there, and every byte range it lists is in its
file. ``loads_in_one_process(path)`` reads every tensor back. ``checked_before_removal``
runs both on every checkpoint a page's ranks remove with ``shutil.rmtree``, just before
it goes.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import shutil
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from page_tools import observe


def _best_seconds(action: Callable[[], Any], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        if dist.is_initialized():
            dist.barrier()  # every rank copies or writes at the same time, as they would save
        started = time.perf_counter()
        action()
        if torch.accelerator.is_available():
            torch.accelerator.synchronize()
        times.append(time.perf_counter() - started)
    return min(times)


def copy_into_fresh_pages(source: torch.Tensor) -> None:
    """Copy ``source`` into an anonymous mapping: every page comes new from the kernel (a
    freed tensor's memory may be handed out again by the allocator, already mapped)."""
    buffer = mmap.mmap(-1, source.numel() * source.element_size())
    target = torch.frombuffer(buffer, dtype=source.dtype)
    target.copy_(source)
    del target
    buffer.close()


def write_and_sync(tensor: torch.Tensor, path: str | os.PathLike) -> None:
    """Write a CPU tensor's bytes to ``path`` and ``fsync`` it."""
    view = memoryview(tensor.numpy()).cast("B")
    with open(path, "wb", buffering=0) as file:
        while view:
            view = view[file.write(view) :]
        os.fsync(file.fileno())


def copy_and_write_speeds(
    total_bytes: int, directory: str | os.PathLike, threads: int = 1, repeats: int = 3
) -> dict[str, float]:
    """GB/s of this rank for its share of a checkpoint of ``total_bytes`` (split evenly over
    the ranks): ``copy_reused``, ``copy_fresh``, ``write_fsync``, and the share's ``bytes``.

    The best of ``repeats`` (of 2 for the write). ``threads``: the torch threads the copies
    use (those the training would). Writes one probe file into ``directory`` and removes it.
    """
    torch.set_num_threads(threads)
    nbytes = total_bytes // (dist.get_world_size() if dist.is_initialized() else 1)
    on_gpu = torch.accelerator.is_available()
    device = torch.accelerator.current_accelerator() if on_gpu else torch.device("cpu")
    source = torch.rand(nbytes // 4, device=device)
    reused = torch.empty(nbytes // 4, pin_memory=on_gpu)
    reused.copy_(source)  # touch every page once, as a reused buffer has
    os.makedirs(directory, exist_ok=True)
    rank = dist.get_rank() if dist.is_initialized() else 0
    probe = Path(directory, f"write-probe-rank{rank}.bin")
    try:
        seconds = {
            "copy_reused": _best_seconds(lambda: reused.copy_(source), repeats),
            "copy_fresh": _best_seconds(lambda: copy_into_fresh_pages(source), repeats),
            "write_fsync": _best_seconds(lambda: write_and_sync(reused, probe), min(2, repeats)),
        }
    finally:
        probe.unlink(missing_ok=True)
    return {**{name: nbytes / s / 1e9 for name, s in seconds.items()}, "bytes": nbytes}


def slowest(per_rank: list[dict[str, float]]) -> dict[str, float]:
    """The lowest speed of any rank, by name (``bytes`` aside): a save waits for its slowest."""
    return {name: min(rank[name] for rank in per_rank) for name in per_rank[0] if name != "bytes"}


def checkpoint_on_disk(path: str | os.PathLike) -> dict:
    """Whether a DCP checkpoint directory is complete: ``{"metadata": bool, "entries": n,
    "missing": [what is not there]}``. Complete means its ``.metadata`` is there and
    every byte range it lists is inside its file."""
    from torch.distributed.checkpoint import FileSystemReader

    path = Path(path)
    if not (path / ".metadata").exists():
        return {"metadata": False, "entries": 0, "missing": [".metadata"]}
    metadata = FileSystemReader(str(path)).read_metadata()
    sizes: dict[str, int] = {}
    missing = []
    for index, info in (metadata.storage_data or {}).items():
        name = info.relative_path
        if name not in sizes:
            file = path / name
            sizes[name] = file.stat().st_size if file.exists() else -1
        if sizes[name] < info.offset + info.length:
            missing.append(f"{index.fqn} in {name}")
    return {"metadata": True, "entries": len(metadata.storage_data or {}), "missing": missing}


def loads_in_one_process(path: str | os.PathLike) -> dict:
    """Read every tensor of a DCP checkpoint into one process, from its ``.metadata`` alone:
    ``{"tensors": n, "finite": all values finite}``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = FileSystemReader(str(path)).read_metadata()
    state_dict = {
        key: torch.empty(entry.size, dtype=entry.properties.dtype)
        for key, entry in metadata.state_dict_metadata.items()
        if isinstance(entry, TensorStorageMetadata)
    }
    with warnings.catch_warnings():
        # DCP warns that it assumes a single process even when no_dist=True says so.
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        dcp.load(state_dict, checkpoint_id=str(path), no_dist=True)
    finite = all(
        bool(torch.isfinite(t).all()) for t in state_dict.values() if t.is_floating_point()
    )
    return {"tensors": len(state_dict), "finite": finite}


def check_checkpoints(directory: str | os.PathLike) -> dict:
    """Every checkpoint in ``directory`` (a subdirectory with DCP files), checked on disk;
    the newest one (by its ``.metadata``) read back in one process."""
    directory = Path(directory)
    found = sorted(
        {p.parent for pattern in ("*/.metadata", "*/*.distcp") for p in directory.glob(pattern)}
    )
    checked = {p.name: checkpoint_on_disk(p) for p in found}
    complete = [p for p in found if checked[p.name]["metadata"] and not checked[p.name]["missing"]]
    newest = max(complete, key=lambda p: (p / ".metadata").stat().st_mtime_ns, default=None)
    return {
        "directory": str(directory),
        "checkpoints": checked,
        "newest": newest.name if newest else None,
        "loaded": loads_in_one_process(newest) if newest else None,
    }


@contextlib.contextmanager
def checked_before_removal(under: str | os.PathLike) -> Iterator[observe.Calls]:
    """Check the checkpoints of every directory below ``under`` that ``shutil.rmtree`` is
    asked to remove inside the block, before it goes (``check_checkpoints``); one record
    per removal, by the rank that removed it. ``shutil.rmtree`` is restored on exit."""
    root = os.path.abspath(under)

    def below_root(call: observe.Call) -> bool:
        path = os.path.abspath(os.fspath(call.argument(0, "path")))
        return path.startswith(root + os.sep) and os.path.isdir(path)

    with observe.watch(
        shutil,
        "rmtree",
        lambda call: check_checkpoints(call.argument(0, "path")),
        before=True,
        where=below_root,
    ) as removals:
        yield removals
