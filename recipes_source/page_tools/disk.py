"""Disk limits: how fast this machine writes + fsyncs, and reads, a checkpoint's bytes, the
way DCP's ``FileSystemWriter`` and ``FileSystemReader`` do, and nothing else.

``probe_round`` runs on every rank with the rank's own shards, at the start of each of a
page's own rounds (``probed_each_round``): each limit is measured in the minute of the
saves and loads it bounds. For 1, 2, 4 threads it splits the shards as
``FileSystemWriter(thread_count=N)`` does (largest tensor first, into the emptiest
bucket), and each thread writes one file straight from the tensors' memory (a
``memoryview``, no copy: ``tensor.numpy().tobytes()`` would copy every tensor first, and a
"limit" measured that way can be slower than DCP itself), then ``fsync``s it. It reads the
files back into buffers it already touched, twice: after dropping them from the page
cache (``evict``: from storage), and right after (from the page cache). All ranks write
and read at the same time, as they do in a save; the first round warms up and is not
kept. The first round also times what DCP does to every tensor besides the disk
(``serialization_seconds``): ``torch.save`` of each (no disk: into ``/dev/null``), with
and without the CRC-32 of each record (``torch.load`` never checks it), and
``torch.load`` + copy (from memory).

``bandwidths`` turns every rank's seconds into GB/s, all bytes over the slowest rank's
time, and the limit of each kind: the best thread count's median. A median, as every
save and load it bounds is one: the best single repeat would grow with the number of
repeats, and this machine's reads can vary twofold from one repeat to the next.

No save can stage a checkpoint faster than the machine copies memory, or make it durable
faster than the disk writes and syncs it. ``copy_and_write_speeds`` measures both on a
rank (the best of a few repeats: the least time each takes here, what the stall pages
measure their stalls in), for that rank's share of a checkpoint: a copy into a buffer it
already touched (what a reused staging buffer does), a copy into pages new from the
kernel (what fresh staging costs at worst: the kernel must also supply and zero every
page), and a write plus ``fsync`` into the checkpoint directory. With an accelerator the
copies go from the device to host memory (pinned, for the reused buffer). ``slowest``
keeps the lowest of every rank's: a save waits for its slowest rank.

``checkpoint_on_disk(path)`` says whether a DCP checkpoint is complete: its
``.metadata`` (which DCP writes last) is there, and every byte range it lists is in its
file. ``loads_in_one_process(path)`` reads every tensor back. ``checked_before_removal``
runs both on every checkpoint a page's ranks remove with ``shutil.rmtree``, just before
it goes. A torch_checkpointing checkpoint (``<item>_<rank>.pt`` files, no index) is
complete when its directory has its final name (the library writes under ``tmp_<name>``
and renames it once every rank is done) and no file is empty; its files are read back
with ``torch.load``.
"""

from __future__ import annotations

import contextlib
import io
import mmap
import os
import shutil
import threading
import time
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from page_tools import figures, observe, proofs, stats

KINDS = {
    "write_fsync": "write + fsync",
    "read_storage": "read from storage",
    "read_cache": "read from page cache",
}
WRITE_PHASES = ("write", "fsync")  # a probe thread's, by the clock: as a save's are timed
SERIALIZATION = {
    "torch_save": "torch.save, no disk",
    "torch_save_no_crc32": "torch.save, no CRC-32",
    "torch_load": "torch.load + copy",
}


def evict(paths: Iterable[str]) -> int:
    """Drop files (or every file of a directory) from the page cache, after ``fsync``: dirty
    pages cannot be dropped. The next read goes to storage. Returns how many files."""
    files = []
    for path in paths:
        if os.path.isdir(path):
            files += [os.path.join(path, name) for name in sorted(os.listdir(path))]
        else:
            files.append(path)
    for path in files:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return len(files)


def split_like_dcp(tensors: Sequence[torch.Tensor], buckets: int) -> list[list[torch.Tensor]]:
    """``FileSystemWriter``'s buckets: largest tensor first, into the emptiest bucket."""
    split: list[list[torch.Tensor]] = [[] for _ in range(buckets)]
    sizes = [0] * buckets
    for tensor in sorted(tensors, key=lambda t: t.nbytes, reverse=True):
        emptiest = sizes.index(min(sizes))
        split[emptiest].append(tensor)
        sizes[emptiest] += tensor.nbytes
    return split


def _bytes_of(tensor: torch.Tensor) -> memoryview:
    return memoryview(tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy())


def write_and_sync(path: str, tensors: Sequence[torch.Tensor], phases: list | None = None) -> None:
    """One writer thread's file: the tensors' own memory, then ``fsync``; where ``phases``
    is given, appends the seconds of each, ``(write, fsync)``."""
    with open(path, "wb") as file:  # FileSystemWriter opens its files the same way
        started = time.perf_counter()
        for tensor in tensors:
            file.write(_bytes_of(tensor))
        file.flush()
        written = time.perf_counter()
        os.fsync(file.fileno())
        if phases is not None:
            phases.append((written - started, time.perf_counter() - written))


def read_into(path: str, buffer: torch.Tensor) -> None:
    """Read a whole file into a byte tensor that is already allocated and touched."""
    view = _bytes_of(buffer)
    with open(path, "rb", buffering=0) as file:
        while view:
            view = view[file.readinto(view) :]


def _in_threads(work: Callable[..., None], argument_tuples: Iterable[tuple]) -> None:
    threads = [threading.Thread(target=work, args=args) for args in argument_tuples]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _timed(work: Callable[..., Any], *args: Any) -> float:
    """Seconds of ``work(*args)`` on this rank, every rank started together."""
    _barrier()
    started = time.perf_counter()
    work(*args)
    return time.perf_counter() - started


def host_shards(model: torch.nn.Module) -> list[torch.Tensor]:
    """This rank's part of every parameter, in host memory (as DCP writes it: a device
    tensor is copied to the host first; a CPU shard is the tensor's own memory)."""
    shards = []
    for parameter in model.parameters():
        tensor = parameter.detach()
        tensor = tensor.to_local() if hasattr(tensor, "to_local") else tensor
        shards.append(tensor.cpu())
    return shards


def probe_round(tensors: Sequence[torch.Tensor], directory: str, threads: Sequence[int]) -> dict:
    """One round of the probe on this rank: for each thread count, seconds of write + fsync,
    of a read from storage and of a read from the page cache (``{kind: {threads: s}}``),
    the write's two phases per thread (``write_phases``: ``{threads: {"write", "fsync"}}``,
    each thread's seconds summed, over their number), the rank's ``bytes``, and whether
    every file read back held the bytes written.
    Rank 0 removes each thread count's folder once every rank is done with it."""
    seconds: dict[str, dict[int, float]] = {kind: {} for kind in KINDS}
    write_phases: dict[int, dict[str, float]] = {}
    read_back_equal = True
    for count in threads:
        path = os.path.join(directory, f"probe-{count}")
        os.makedirs(path, exist_ok=True)
        buckets = split_like_dcp(tensors, count)
        files = [os.path.join(path, f"__{_rank()}_{i}.distcp") for i in range(count)]
        phases: list[tuple[float, float]] = []  # each thread's (write, fsync)
        writes = [(file, bucket, phases) for file, bucket in zip(files, buckets, strict=True)]
        write_s = _timed(_in_threads, write_and_sync, writes)
        write_phases[count] = {phase: sum(p[i] for p in phases) / count for i, phase in
                               enumerate(WRITE_PHASES)}  # fmt: skip
        buffers = [torch.zeros(sum(t.nbytes for t in b), dtype=torch.uint8) for b in buckets]
        reads = list(zip(files, buffers, strict=True))
        evict(files)
        storage_s = _timed(_in_threads, read_into, reads)  # from storage
        cache_s = _timed(_in_threads, read_into, reads)  # from the page cache
        for bucket, buffer in zip(buckets, buffers, strict=True):
            written = torch.cat([t.reshape(-1).view(torch.uint8) for t in bucket])
            read_back_equal = read_back_equal and torch.equal(written, buffer)
        _barrier()
        if _rank() == 0:
            shutil.rmtree(path)
        for kind, value in zip(KINDS, (write_s, storage_s, cache_s), strict=True):
            seconds[kind][count] = value
    return {"bytes": sum(t.nbytes for t in tensors), "seconds": seconds,
            "write_phases": write_phases, "read_back_equal": read_back_equal}  # fmt: skip


def as_run(rounds: Sequence[dict]) -> dict:
    """A rank's probe rounds (``probe_round``'s; the first warms up, is not kept, and holds
    the ``serialization_seconds``) in the form ``bandwidths`` takes: every kept round's
    seconds as a list per kind and thread count; each kept round's ``write_phases``, in
    order; ``read_back_equal`` over all rounds."""
    kept = rounds[1:]
    return {
        "bytes": rounds[0]["bytes"],
        "seconds": {
            kind: {n: [r["seconds"][kind][n] for r in kept] for n in rounds[0]["seconds"][kind]}
            for kind in KINDS
        },
        "write_phases": [r["write_phases"] for r in kept],
        **rounds[0]["serialization"],
        "read_back_equal": all(r["read_back_equal"] for r in rounds),
    }


@contextlib.contextmanager
def probed_each_round(
    name: str,
    round_of: Callable[[observe.Call], str],
    model_of: Callable[[observe.Call], torch.nn.Module],
    directory: str,
    threads: Sequence[int] = (1, 2, 4),
    repeats: int = 2,
) -> Iterator[list[dict]]:
    """The probe in a page's own rounds: before the first call of the page's function
    ``name`` in each round (``round_of(call)`` names the round; a new name starts one),
    every rank runs ``probe_round`` on the shards of ``model_of(call)``, the page's own
    model (taken at the first call: no second copy is built; the probe only reads it,
    and serialization's ``torch.load`` + copy writes each tensor's own bytes back), so
    that each limit is measured in the minute of the saves and loads it bounds (this
    machine's disk drifts from one minute to the next). The first round warms up, and
    also times serialization ``repeats`` times (there are as many probe rounds as the
    page's rounds). Yields a list that holds, once the block ends, one ``as_run`` per
    rank, in rank order."""
    tensors: list[torch.Tensor] = []
    seen: list[str] = []

    def probe(call: observe.Call) -> dict:
        if not tensors:
            tensors.extend(host_shards(model_of(call)))
        found = probe_round(tensors, directory, threads)
        if not seen:  # the warm-up round
            found["serialization"] = serialization_seconds(tensors, repeats)
        seen.append(round_of(call))
        return found

    runs: list[dict] = []
    page = observe.page_module()
    with observe.watch(
        page, name, probe, before=True, where=lambda call: round_of(call) not in seen
    ) as rounds:
        yield runs
    runs.extend(as_run(per_rank) for _, per_rank in sorted(rounds.by_rank.items()))


def serialization_seconds(tensors: Sequence[torch.Tensor], repeats: int) -> dict:
    """What FileSystemWriter does to every tensor before its bytes reach a file (``torch.save``,
    a zip record with its CRC-32: here into ``/dev/null``; and the same without the CRC-32),
    and what FileSystemReader does after reading them (``torch.load`` into a new tensor, then
    a copy into the model's): one thread, no disk; ``repeats`` times each."""
    from torch.utils.serialization import config

    def save_all(compute_crc32: bool = True) -> None:
        with config.patch({"save.compute_crc32": compute_crc32}), open(os.devnull, "wb") as sink:
            for tensor in tensors:
                torch.save(tensor, sink)

    blobs = []
    for tensor in tensors:
        blob = io.BytesIO()
        torch.save(tensor, blob)
        blobs.append(blob.getvalue())

    def load_all() -> None:
        for tensor, blob in zip(tensors, blobs, strict=True):
            tensor.copy_(torch.load(io.BytesIO(blob), weights_only=True))

    return {
        "torch_save": [_timed(save_all) for _ in range(repeats)],
        "torch_save_no_crc32": [_timed(save_all, False) for _ in range(repeats)],
        "torch_load": [_timed(load_all) for _ in range(repeats)],
    }


def gbps(total_bytes: float, seconds_per_rank: Sequence[float]) -> float:
    """A collective operation's bandwidth: all ranks' bytes over the slowest rank's time."""
    return total_bytes / max(seconds_per_rank) / 1e9


def bandwidths(runs: Sequence[dict]) -> dict:
    """Every rank's ``as_run`` as GB/s: per kind and thread count, the ``stats.summary``
    of its repeats; the limit of each kind (the highest median of any thread count, and
    which count that is: ``limit_threads``); the serialization costs; and the raw seconds,
    with the write phases of each kept round, by rank."""
    total = sum(run["bytes"] for run in runs)

    def per_repeat(per_rank: list[list[float]]) -> dict:
        return stats.summary([gbps(total, s) for s in zip(*per_rank, strict=True)])

    kinds = {
        kind: {
            n: per_repeat([run["seconds"][kind][n] for run in runs])
            for n in runs[0]["seconds"][kind]
        }
        for kind in KINDS
    }
    best = {kind: max(kinds[kind], key=lambda n: kinds[kind][n]["median"]) for kind in KINDS}
    return {
        "ranks": len(runs),
        "bytes_per_rank": [run["bytes"] for run in runs],
        "total_bytes": total,
        "GBps": kinds,
        "limit": {kind: kinds[kind][best[kind]]["median"] for kind in KINDS},
        "limit_threads": best,
        "serialization_GBps": {
            kind: per_repeat([run[kind] for run in runs]) for kind in SERIALIZATION
        },
        "seconds_per_rank": [
            {
                "seconds": run["seconds"],
                "write_phases": run["write_phases"],
                **{kind: run[kind] for kind in SERIALIZATION},
            }
            for run in runs
        ],
    }


def one_thread(limits: dict, cost: str, kind: str) -> float:
    """The most GB/s one thread reaches when, for every byte, it does ``cost`` (``torch_save``)
    and then ``kind`` (``write_fsync``), each at its median speed with one thread:
    1 / (1 / cost + 1 / kind)."""
    first = stats.median(limits["serialization_GBps"][cost])
    second = stats.median(limits["GBps"][kind][min(limits["GBps"][kind])])
    return 1 / (1 / first + 1 / second)


def storage_against_cache(limits: dict) -> dict:
    """Print whether one thread's reads from storage and from the page cache differ beyond
    noise (``stats.say``): where they do not, the host probably caches the disk."""
    one = min(limits["GBps"]["read_storage"])
    return stats.say(
        "one thread's read from storage",
        limits["GBps"]["read_storage"][one]["values"],
        "from the page cache",
        limits["GBps"]["read_cache"][one]["values"],
        "GB/s",
    )


def table(limits: dict) -> figures.Table:
    """The limits as the page shows them: GB/s, median (lowest-highest), and the limit (the
    highest median)."""
    threads = list(next(iter(limits["GBps"].values())))
    rows = [
        [label, *(stats.median_range(limits["GBps"][kind][n]) for n in threads)]
        + [round(limits["limit"][kind], 2)]
        for kind, label in KINDS.items()
    ]
    rows += [
        [label, stats.median_range(limits["serialization_GBps"][kind]), *[""] * len(threads)]
        for kind, label in SERIALIZATION.items()
    ]
    return figures.Table(
        ["GB/s", *(f"{n} thread{'s' if n > 1 else ''}" for n in threads), "limit"],
        rows,
        caption=(
            f"{limits['total_bytes'] / 1e6:,.0f} MB on {limits['ranks']} rank(s), median "
            f"(lowest-highest) of {len(limits['GBps']['write_fsync'][threads[0]]['values'])}; "
            "limit: the highest median; torch.save and torch.load: one thread, no disk"
        ),
    )


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
            "write_fsync": _best_seconds(lambda: write_and_sync(probe, [reused]), min(2, repeats)),
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
    """Read every tensor of a DCP checkpoint into one process, from its ``.metadata`` alone
    (``direct_io``'s reader where its writer wrote it): ``{"tensors": n, "finite": all
    values finite}``."""
    import direct_io  # a module beside the recipes: the stall page writes with it
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = FileSystemReader(str(path)).read_metadata()
    direct = any(isinstance(e, direct_io.Extent) for e in (metadata.storage_data or {}).values())
    reader = (direct_io.DirectIOReader if direct else FileSystemReader)(str(path))
    state_dict = {
        key: torch.empty(entry.size, dtype=entry.properties.dtype)
        for key, entry in metadata.state_dict_metadata.items()
        if isinstance(entry, TensorStorageMetadata)
    }
    with warnings.catch_warnings():
        # DCP warns that it assumes a single process even when no_dist=True says so.
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        dcp.load(state_dict, storage_reader=reader, no_dist=True)
    finite = all(
        bool(torch.isfinite(t).all()) for t in state_dict.values() if t.is_floating_point()
    )
    return {"tensors": len(state_dict), "finite": finite}


TORCH_CHECKPOINTING_TEMP_PREFIX = "tmp_"  # its directory's name until every rank is done


def torch_checkpointing_on_disk(path: str | os.PathLike) -> dict:
    """Whether a torch_checkpointing checkpoint directory is complete, in the form of
    ``checkpoint_on_disk``'s: ``metadata`` says the directory has its final name."""
    path = Path(path)
    files = sorted(path.glob("*.pt"))
    final = not path.name.startswith(TORCH_CHECKPOINTING_TEMP_PREFIX)
    missing = [f.name for f in files if f.stat().st_size == 0] + ([] if files else ["*.pt"])
    return {
        "metadata": final,
        "entries": len(files),
        "missing": missing,
        "library": "torch_checkpointing",
    }


def torch_checkpointing_loads(path: str | os.PathLike) -> dict:
    """Read every file of a torch_checkpointing checkpoint back with ``torch.load``:
    ``{"tensors": n, "finite": all values finite}`` (as ``loads_in_one_process``)."""
    tensors = []
    with warnings.catch_warnings():
        # Its files hold DTensors; unpickling their mesh outside the job's groups warns.
        warnings.simplefilter("ignore")
        for file in sorted(Path(path).glob("*.pt")):
            leaves = proofs.flatten(torch.load(file, map_location="cpu", weights_only=False))
            tensors += [t for t in leaves.values() if isinstance(t, torch.Tensor)]
    tensors = [t.to_local() if hasattr(t, "to_local") else t for t in tensors]
    finite = all(bool(torch.isfinite(t).all()) for t in tensors if t.is_floating_point())
    return {"tensors": len(tensors), "finite": finite}


def check_checkpoints(directory: str | os.PathLike) -> dict:
    """Every checkpoint in ``directory`` (a subdirectory with DCP files, or with
    torch_checkpointing's ``*.pt`` files), checked on disk; the newest complete one of each
    library (by its newest file) read back in one process (``loaded``; torch_checkpointing's:
    ``loaded_torch_checkpointing``)."""
    directory = Path(directory)
    found = sorted(
        {p.parent for pattern in ("*/.metadata", "*/*.distcp") for p in directory.glob(pattern)}
    )
    others = sorted({p.parent for p in directory.glob("*/*.pt")} - set(found))
    checked = {p.name: checkpoint_on_disk(p) for p in found}
    checked |= {p.name: torch_checkpointing_on_disk(p) for p in others}

    def newest(paths: list[Path]) -> Path | None:
        complete = [
            p for p in paths if checked[p.name]["metadata"] and not checked[p.name]["missing"]
        ]
        return max(
            complete, key=lambda p: max(f.stat().st_mtime_ns for f in p.iterdir()), default=None
        )

    dcp_newest, others_newest = newest(found), newest(others)
    return {
        "directory": str(directory),
        "checkpoints": checked,
        "newest": dcp_newest.name if dcp_newest else None,
        "loaded": loads_in_one_process(dcp_newest) if dcp_newest else None,
        "loaded_torch_checkpointing": torch_checkpointing_loads(others_newest)
        if others_newest
        else None,
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
