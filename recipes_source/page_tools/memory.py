"""Host memory: what a save keeps in host memory, and how far a process's peak grows.

``host_copies()`` watches ``DefaultStager._stage`` inside a ``with`` block: for every copy
a stager makes on a rank, the host storages it copied into (address and size) and how
many entries the stager's cache holds then. While the block lasts, every copy it saw is
kept alive, so that an address seen at one save cannot be handed to a later copy: the
same address at two saves is the same buffer.

``PeakHostMemory`` reads Linux's own high-water mark of the process (``VmHWM``), reset
right before the code it measures: the exact peak of that code, not a sample. A page
measures a function it runs on its ranks with a watch::

    with memory.peak_growth(observe.page_module(), "load_on_every_rank", repeats=3) as peaks:
        run_on_ranks(load_and_train, load_on_every_rank, FOLDER)
    peaks.by_rank  # {0: [[43.1, 42.9, 43.0]], 1: [...]}: MiB, one list per call

The function is called once more before it is measured (``warm_up``), so that one-time
costs (imports, the allocator's first arenas) do not count, and each measured call
starts with the memory that earlier ones freed given back to the system.

Host memory: glibc's heap counters at the moments a recipe reads its resident memory, and
whether resident memory grows over repeated saves, decided against its own noise.

A recipe that follows its memory reads its RSS itself (``psutil.Process().memory_info()``)
after every save; the page watches that call and reads, at the same instant, where glibc's
heap keeps its bytes (``mallinfo2``): in live allocations, freed but kept for later, or in
mapped blocks. That tells a leak (live allocations pile up) from an allocator that keeps
freed staging buffers.

``growth`` decides whether RSS grows: the first saves fill caches and pools, so it
compares a window of later saves with the last window (``stats.difference``): a
difference within the spread of either window is noise, never growth.

Host memory: the peak a process (with the helper processes it started) reaches.

``PeakSampler`` samples the memory a process holds every few milliseconds: its live heap
allocations (glibc's ``mallinfo2``: in use and mapped) and resident shared memory, plus the
private memory of its child processes (DCP's checkpoint process: the staged copy it shares
with its parent is counted once), and keeps the peak above where it started. A run that
reuses heap an earlier one freed still grows by it, and nothing is handed back to the
system first: a trim (``give_back_freed_memory``) leaves the heap's free pages to be
faulted in again by the steps it times (on CPU, thousands to tens of thousands of faults
in the first two steps of a run). Without glibc's counters, it trims, then reads resident
memory.

``peak_between(start, stop)`` measures each stretch of a page's ranks from a call of
one torch function to a call of another (a run of a loop, from the process group it
creates to the one it destroys): one record per stretch comes back by rank.

Host memory: how big a state is, where its staged copies live, and what pinning costs.

``tensor_bytes`` and ``addresses`` read a (nested) state dict on a rank: the bytes of the
tensors it holds (of a ``DTensor``, this rank's shard), and the storages they live in (a
stager that reuses its buffers returns the same storages at every save).
``staged_copies_shared`` watches a rank's stager and saves: whether each staged copy is in
shared memory right after staging, and again once its upload completed (a checkpoint
process receives it through ``/dev/shm``). ``pinned_staging_bytes`` measures, on a GPU
machine, the host memory that pinned staging buffers take.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import gc
import os
import shutil
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import psutil
import torch
from torch.distributed.checkpoint.staging import DefaultStager
from torch.distributed.tensor import DTensor

from page_tools import figures, observe, proofs, results, stats, timing


def storages(state: Any) -> list[tuple[int, int]]:
    """(address, bytes) of every distinct storage behind the tensors of a state dict (of a
    ``DTensor``, its local shard's), by address."""
    found: dict[int, int] = {}
    for value in proofs.flatten(state).values():
        if isinstance(value, torch.Tensor):
            local = value.to_local() if isinstance(value, DTensor) else value
            storage = local.untyped_storage()
            found[storage.data_ptr()] = storage.nbytes()
    return sorted(found.items())


def cached_entries(stager: DefaultStager) -> int:
    """How many source storages a ``DefaultStager`` keeps a host copy for (its cache holds
    them weakly: an entry goes when its source tensor is freed)."""
    return len(stager._state_dict_stager._cached_storage_mapping)


@contextlib.contextmanager
def host_copies(stager_class: type = DefaultStager) -> Iterator[observe.Calls]:
    """Record, at every copy a ``stager_class`` makes inside the block, ``{"storages":
    [(address, bytes), ...], "cached": entries}`` by rank, in the order of the copies."""
    kept: list[Any] = []  # the copies, alive until the block ends: no address is reused

    def record(call: observe.Call) -> dict:
        kept.append(call.result)
        return {"storages": storages(call.result), "cached": cached_entries(call.args[0])}

    with observe.watch(stager_class, "_stage", record) as copies:
        try:
            yield copies
        finally:
            kept.clear()


def same_buffers(records: list[dict]) -> bool:
    """Every copy went into the storages of the first one (``host_copies`` records)."""
    return all(record["storages"] == records[0]["storages"] for record in records)


def megabytes(record: dict) -> float:
    return sum(size for _, size in record["storages"]) / 1e6


def reused_at_every_save(claim: str, copies: observe.Calls) -> None:
    """Decide that, on every rank, every copy (``host_copies``) went into the host storages
    of the first, and say how many and how large they are."""
    first = copies.by_rank[0][0]
    saves = {rank: len(records) for rank, records in copies.by_rank.items()}
    results.claim(
        claim,
        all(n > 1 for n in saves.values())
        and all(same_buffers(records) for records in copies.by_rank.values()),
        f"{saves[0]} saves, rank 0: {len(first['storages'])} host storages "
        f"({megabytes(first):.1f} MB), the same ones at every save, on every rank",
        saves=saves,
        storages=len(first["storages"]),
        megabytes=megabytes(first),
    )


def save_pairs(copies: observe.Calls) -> list[dict]:
    """Copies recorded in pairs (two saves of the same state, then two of another): for each
    pair, its storages and size (rank 0's first copy), and per rank whether the second copy
    went into the first's storages and how many cache entries there were after it."""
    pairs = []
    for first in range(0, len(copies.by_rank[0]), 2):
        both = [records[first : first + 2] for _, records in sorted(copies.by_rank.items())]
        pairs.append(
            {
                "storages": len(both[0][0]["storages"]),
                "megabytes": megabytes(both[0][0]),
                "reused": [same_buffers(pair) for pair in both],
                "cached": [pair[1]["cached"] for pair in both],
            }
        )
    return pairs


def second_save_reused(claim: str, pair: dict, expected: bool, what: str) -> None:
    """Decide, for a pair of ``save_pairs``, that on every rank the second copy did (or, with
    ``expected=False``, did not) go into the first copy's host storages."""
    where = "the first's host buffers" if expected else "new host buffers"
    results.claim(
        claim,
        pair["reused"] == [expected] * len(pair["reused"]),
        f"{what}: the second save copied into {where}, on every rank",
        reused=pair["reused"],
    )


def cache_holds_one_save(claim: str, pair: dict, what: str) -> None:
    """Decide that after a pair's second copy the stager's cache held one entry per storage
    of one save, on every rank: the first save's entries did not stay."""
    results.claim(
        claim,
        all(n == pair["storages"] for n in pair["cached"]),
        f"{what}: {pair['storages']} cache entries after the second save "
        f"({2 * pair['storages']} if the first save's had stayed)",
        cached=pair["cached"],
    )


def pairs_table(pairs: dict[str, dict]):
    """``save_pairs`` side by side, one row each (rank 0's counts)."""
    from page_tools import figures

    return figures.Table(
        ["state_dict() returns", "host storages", "MB", "2nd save reused them", "cache after it"],
        [
            [what, p["storages"], round(p["megabytes"], 1), all(p["reused"]), p["cached"][0]]
            for what, p in pairs.items()
        ],
    )


def _status_mib(field: str) -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    return 0.0


def give_back_freed_memory() -> None:
    """Collect garbage, then return the heap's free pages to the system (glibc's
    ``malloc_trim``), so that memory freed before a measurement cannot hide growth."""
    gc.collect()
    if sys.platform == "linux":
        ctypes.CDLL("libc.so.6").malloc_trim(0)


class PeakHostMemory:
    """Growth of this process's peak resident memory (``VmHWM``) over a block of code.

    Linux resets the peak to the current size when "5" is written to
    ``/proc/self/clear_refs``; the peak read afterwards is the exact high-water mark of
    the block. Pages of files the block maps (safetensors reads through a memory map)
    count too.
    """

    def __init__(self) -> None:
        self.start_mib = 0.0
        self.measurable = False

    def start(self) -> PeakHostMemory:
        give_back_freed_memory()
        try:
            self.start_mib = _status_mib("VmRSS")
            with open("/proc/self/clear_refs", "w") as clear_refs:
                clear_refs.write("5")
            self.measurable = True
        except OSError:
            self.measurable = False
        return self

    def stop(self) -> float | None:
        """MiB the peak grew by since ``start()``, or None where Linux's counters are missing."""
        return _status_mib("VmHWM") - self.start_mib if self.measurable else None

    def __enter__(self) -> PeakHostMemory:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.growth_mib = self.stop()


def peak_growth(owner: Any, name: str, repeats: int = 3, warm_up: bool = True):
    """Watch ``owner.name``: each call inside the block runs once unmeasured (``warm_up``),
    then ``repeats`` times, each under ``PeakHostMemory``; it records the list of growths
    (MiB) and returns what the last run returned. Every run is a full call: on ranks, each
    rank makes the same calls, so collectives inside still pair up."""

    def body(original: Callable[..., Any], call: observe.Call, keep: Callable[[Any], None]):
        if warm_up:
            original(*call.args, **call.kwargs)
        growths, result = [], None
        for _ in range(repeats):
            result = None  # the previous run's result is freed before the next is measured
            peak = PeakHostMemory().start()
            result = original(*call.args, **call.kwargs)
            growths.append(peak.stop())
        keep(growths)
        return result

    return observe.around(owner, name, body)


def samples(peaks: observe.Calls, ranks: Callable[[int], bool] = lambda rank: True) -> list[float]:
    """Every growth ``peak_growth`` recorded on the ranks that ``ranks`` accepts, as one list
    (``lambda rank: rank > 0``: the ranks that do not read the file)."""
    return [
        growth
        for rank, calls in sorted(peaks.by_rank.items())
        if ranks(rank)
        for growths in calls
        for growth in growths
        if growth is not None
    ]


def growth_table(measured: dict[str, observe.Calls], caption: str = "") -> figures.Table:
    """One row per function and rank: the median peak growth of its measured runs, and the
    lowest and highest, in MiB."""
    rows = []
    for what, peaks in measured.items():
        for rank in sorted(peaks.by_rank):
            values = samples(peaks, lambda r, rank=rank: r == rank)
            if not values:
                rows.append([what, rank, "not measurable", "", ""])
                continue
            summary = stats.summary(values)
            rows.append([what, rank, *(round(summary[key], 1) for key in ("median", "min", "max"))])
    columns = ["load", "rank", "peak growth, MiB (median)", "lowest", "highest"]
    return figures.Table(columns, rows, caption)


class MallInfo2(ctypes.Structure):
    """glibc's ``struct mallinfo2``: where the heap's bytes are."""

    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


@functools.cache
def _mallinfo2() -> Callable[[], MallInfo2] | None:
    """glibc's ``mallinfo2`` (2.33 or later), or None without it."""
    with contextlib.suppress(OSError, AttributeError):
        mallinfo2 = ctypes.CDLL(None).mallinfo2
        mallinfo2.restype = MallInfo2
        return mallinfo2
    return None


def malloc_counters() -> dict[str, int] | None:
    """Bytes in live allocations, freed but kept by the allocator, and in mapped blocks
    (glibc 2.33 or later); None elsewhere."""
    mallinfo2 = _mallinfo2()
    if mallinfo2 is None:
        return None
    info = mallinfo2()
    return {"in_use": info.uordblks, "free_kept": info.fordblks, "mmapped": info.hblkhd}


def heap_at(
    owner: Any, name: str, where: Callable[[observe.Call], bool] | None = None
) -> contextlib.AbstractContextManager[observe.Calls]:
    """Watch ``owner.name`` (``psutil.Process.memory_info``, whose result has ``.rss``): as
    each call returns, (when, the RSS it returned, glibc's counters), by rank."""
    return observe.watch(
        owner,
        name,
        lambda call: (time.perf_counter(), call.result.rss, malloc_counters()),
        where=where,
    )


def heap_at_readings(heap: observe.Calls, readings: Sequence[Sequence[Sequence[int]]]) -> list:
    """glibc's counters at the RSS readings a recipe returned: ``readings[launch][rank]`` is
    the list of RSS values that rank of that launch read, in order; the answer has the same
    shape. Each list is found, in time order, among the watch's records by its values, so
    that readings the recipe does not return (before its first save, say) do not shift it."""
    counters: list[list[list[dict[str, int] | None]]] = []
    position: dict[int, int] = {}
    for launch in readings:
        found = []
        for rank, values in enumerate(launch):
            records = sorted(heap.by_rank.get(rank, []), key=lambda record: record[0])
            rss = [record[1] for record in records]
            start, width = position.get(rank, 0), len(values)
            at = next(
                (
                    i
                    for i in range(start, len(rss) - width + 1)
                    if rss[i : i + width] == list(values)
                ),
                None,
            )
            if at is None:
                raise ValueError(f"rank {rank}: no run of {width} readings matches the recipe's")
            found.append([record[2] for record in records[at : at + width]])
            position[rank] = at + width
        counters.append(found)
    return counters


def change(counters: Sequence[dict[str, int] | None], start: int) -> dict[str, int] | None:
    """How each counter changed from reading ``start`` to the last reading."""
    first, last = counters[start], counters[-1]
    if first is None or last is None:
        return None
    return {key: last[key] - first[key] for key in last}


def growth(rss: Sequence[float], first_few: int = 5, window: int = 5) -> dict:
    """Whether RSS grows over repeated saves: the readings after save ``first_few`` (a
    window of ``window``) against the last ``window``, per save between them, with the
    noise it must beat. ``verdict`` is "grows", "shrinks" or "within noise"."""
    if len(rss) < first_few + 2 * window:
        raise ValueError(f"{len(rss)} readings: too few for two windows of {window}")
    early, late = rss[first_few : first_few + window], rss[-window:]
    diff = stats.difference(early, late)
    saves_between = len(rss) - window - first_few
    return {
        "early": [first_few + 1, first_few + window],  # 1-based save numbers
        "late": [len(rss) - window + 1, len(rss)],
        "saves_between": saves_between,
        "per_save": diff["effect"] / saves_between,
        "noise_per_save": diff["noise"] / saves_between,
        "within_noise": diff["within_noise"],
        "verdict": stats.word(diff, "grows", "shrinks"),
        "swing": max(rss[first_few:]) - min(rss[first_few:]),
    }


def largest_growth(
    rss_by_rank: Sequence[Sequence[float]], first_few: int = 5, window: int = 5
) -> tuple[int, dict]:
    """The rank whose RSS grew most per save (``growth``), and its growth."""
    growths = [growth(rss, first_few, window) for rss in rss_by_rank]
    rank = max(range(len(growths)), key=lambda r: growths[r]["per_save"])
    return rank, growths[rank]


def table(summaries: dict[str, dict], saves: int, first_few: int = 5, window: int = 5):
    """Each strategy's RSS ``growth`` (with ``share``, ``held``, ``freed_by_gc``: bytes) as a
    table: growth per save with its noise, as a fraction of a rank's share, and the verdict."""
    from page_tools import figures

    return figures.Table(
        ["strategy", "MB/save", "of share", "held MB", "swing MB", "gc frees MB", "verdict"],
        [
            [strategy, f"{m['per_save'] / 1e6:+.2f} ± {m['noise_per_save'] / 1e6:.2f}"]
            + [f"{m['per_save'] / m['share']:+.2%}"]
            + [round(m[key] / 1e6, 1) for key in ("held", "swing", "freed_by_gc")]
            + [m["verdict"]]
            for strategy, m in summaries.items()
        ],
        caption=f"the rank that grew most; MB/save ± noise: saves {first_few + 1}-"
        f"{first_few + window} against {saves - window + 1}-{saves}; held: after save {saves};"
        f" swing: max - min over saves {first_few + 1}-{saves}",
    )


def heap_table(changes: dict[str, dict[str, int] | None]):
    """How glibc's counters changed (``change``), per strategy, in MB."""
    from page_tools import figures

    return figures.Table(
        ["strategy", "in use MB", "free kept MB", "mmapped MB"],
        [
            [strategy, *(round(change[k] / 1e6, 1) for k in ("in_use", "free_kept", "mmapped"))]
            if change
            else [strategy, "no glibc counters", "", ""]
            for strategy, change in changes.items()
        ],
    )


def summarize(
    runs: dict[str, Sequence[dict]], heap: observe.Calls, first_few: int = 5, window: int = 5
) -> dict[str, dict]:
    """Per strategy, the ``growth`` of the rank whose RSS grew most, with that rank's share
    of the checkpoint (``share``), RSS held after the last save (``held``), what one
    ``gc.collect()`` freed (``freed_by_gc``) and how glibc's counters changed after save
    ``first_few`` + 1 (``heap_change``). ``runs[strategy][rank]`` is what the recipe's rank
    returned: ``rss`` (one reading per save), ``rss_before``, ``rss_at_end``,
    ``rss_after_gc`` and ``bytes``; ``heap`` is a ``heap_at`` watch of the same launches."""
    counters = heap_at_readings(heap, [[run["rss"] for run in ranks] for ranks in runs.values()])
    summaries = {}
    for (strategy, ranks), heaps in zip(runs.items(), counters, strict=True):
        rank, grew = largest_growth([run["rss"] for run in ranks], first_few, window)
        run = ranks[rank]
        summaries[strategy] = grew | {
            "rank": rank,
            "share": run["bytes"],
            "held": run["rss"][-1] - run["rss_before"],
            "freed_by_gc": run["rss_at_end"] - run["rss_after_gc"],
            "heap_change": change(heaps[rank], first_few),
            "heap": heaps[rank],
        }
    return summaries


def rss_figure(runs: dict[str, Sequence[dict]], title: str):
    """RSS above the start after each save, per strategy, on the rank highest there; the
    dotted level is one copy of a rank's share. ``runs`` as for ``summarize``."""
    from page_tools import figures

    series = {
        strategy: [
            max(run["rss"][i] - run["rss_before"] for run in ranks) / 1e6
            for i in range(len(ranks[0]["rss"]))
        ]
        for strategy, ranks in runs.items()
    }
    share = max(run["bytes"] for ranks in runs.values() for run in ranks)
    ranks = max(len(ranks) for ranks in runs.values())
    title = f"{title}\n{ranks} rank(s), {share / 1e6:.0f} MB per rank, the highest rank"
    return figures.lines(
        series, "save", "RSS above the start (MB)", title, share / 1e6, "one copy of a rank's share"
    )


def grew_most(summaries: dict[str, dict]) -> str:
    """The strategy (of ``summarize``) whose RSS grew most per save."""
    return max(summaries, key=lambda strategy: summaries[strategy]["per_save"])


def headline(summaries: dict[str, dict]) -> dict:
    """The strategy (of ``summarize``) whose RSS grew most per save, and that growth in MB
    and as a fraction of a rank's share of the checkpoint."""
    most = grew_most(summaries)
    per_save = summaries[most]["per_save"]
    return {
        "most_rss_growth": most,
        "rss_growth_MB_per_save": per_save / 1e6,
        "rss_growth_of_share": per_save / summaries[most]["share"],
    }


def held_bytes() -> int | None:
    """What this process holds: its live heap allocations (glibc's ``mallinfo2``: in use
    and mapped, not what the heap keeps free) and its resident shared memory; None
    without glibc 2.33 or later."""
    counters = malloc_counters()
    if counters is None:
        return None
    return counters["in_use"] + counters["mmapped"] + int(_status_mib("RssShmem") * 2**20)


def private_bytes(children: list[psutil.Process]) -> int:
    """The ``children``'s private memory (resident, not shared with their parent)."""
    total = 0
    for child in children:
        with contextlib.suppress(psutil.Error):
            info = child.memory_info()
            total += info.rss - info.shared  # what it shares with us is counted once
    return total


class PeakSampler:
    """The peak memory a process (``held_bytes``) and its children hold, from ``start()`` to
    ``stop()``."""

    def __init__(self, interval_s: float = 0.01, pid: int | None = None):
        self.interval_s = interval_s
        self.process = psutil.Process(pid)
        self.children: list[psutil.Process] = []
        self.baseline = self.peak = 0
        self.samples = 0
        self.heap_counted = False  # held_bytes(), not resident bytes: see the module's notes
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> PeakSampler:
        self.heap_counted = self.process.pid == os.getpid() and malloc_counters() is not None
        if self.heap_counted:
            gc.collect()  # what earlier code left to the collector is freed before, not during
        else:  # resident memory alone: freed memory must go back to the system first
            give_back_freed_memory()
        self.children = self.process.children(recursive=True)
        self.baseline = self.peak = self.held()
        self._thread = threading.Thread(target=self._sample, daemon=True, name="peak-sampler")
        self._thread.start()
        return self

    def held(self) -> int:
        """The bytes held (``held_bytes``, else resident), the children's private ones too."""
        own = held_bytes() if self.heap_counted else self.process.memory_info().rss
        return own + private_bytes(self.children)

    def _sample(self) -> None:
        while not self._stopped.is_set():
            if self.samples % 20 == 0:  # a helper process may have started
                with contextlib.suppress(psutil.Error):
                    self.children = self.process.children(recursive=True)
            with contextlib.suppress(psutil.Error):
                self.peak = max(self.peak, self.held())
            self.samples += 1
            self._stopped.wait(self.interval_s)

    def stop(self) -> dict:
        """Stop sampling: the peak above the start, and where it started, in MB."""
        self._stopped.set()
        if self._thread is not None:
            self._thread.join()
        self.peak = max(self.peak, self.held())
        return {
            "peak_mb": (self.peak - self.baseline) / 1e6,
            "baseline_mb": self.baseline / 1e6,
            "samples": self.samples,
        }


@contextlib.contextmanager
def peak_between(
    start: tuple[Any, str], stop: tuple[Any, str], interval_s: float = 0.01
) -> Iterator[observe.Calls]:
    """Measure the peak host memory of every stretch from a call of ``start`` to a call of
    ``stop`` (each an ``(owner, name)``, e.g. ``(dist, "new_group")``), in each process.

    Sampling starts when ``start`` returns and ends when ``stop`` is called; each stretch
    gives one ``PeakSampler.stop()`` record, in order, by rank. Both functions are
    restored on exit.
    """
    (start_owner, start_name), (stop_owner, stop_name) = start, stop
    began, ends = getattr(start_owner, start_name), getattr(stop_owner, stop_name)
    running: dict[int, PeakSampler] = {}  # by process: the forked ranks each have their own

    with observe.recording() as (put, peaks):

        def starting(*args: Any, **kwargs: Any) -> Any:
            result = began(*args, **kwargs)
            previous = running.pop(os.getpid(), None)
            if previous is not None:  # a start without a stop: that stretch is not measured
                previous.stop()
            running[os.getpid()] = PeakSampler(interval_s).start()
            return result

        def stopping(*args: Any, **kwargs: Any) -> Any:
            sampler = running.pop(os.getpid(), None)
            if sampler is not None:
                put(sampler.stop())
            return ends(*args, **kwargs)

        with (
            observe.replaced(start_owner, start_name, starting),
            observe.replaced(stop_owner, stop_name, stopping),
        ):
            try:
                yield peaks
            finally:
                for sampler in running.values():
                    sampler.stop()
                running.clear()


def _local_tensors(state: Any) -> list[torch.Tensor]:
    tensors = []
    for value in proofs.flatten(state).values():
        if isinstance(value, torch.Tensor):
            tensors.append(value.to_local() if hasattr(value, "to_local") else value)
    return tensors


def tensor_bytes(state: Any) -> int:
    """Bytes of the tensors in a state dict that this rank holds."""
    return sum(t.numel() * t.element_size() for t in _local_tensors(state))


def addresses(state: Any) -> list[int]:
    """The address of the storage of every tensor this rank holds, in the state's order."""
    return [t.untyped_storage().data_ptr() for t in _local_tensors(state)]


def all_shared(state: Any) -> bool:
    """Every tensor of the state is in shared memory."""
    return all(t.is_shared() for t in _local_tensors(state))


@contextlib.contextmanager
def staged_copies_shared(stager_class: Any, owner: Any, name: str = "async_save"):
    """Watch ``stager_class.stage`` (staging in the caller's thread) and ``owner.name``
    (``dcp.async_save``) on every rank: for each save, whether its staged copy was in shared
    memory when staging returned, and when its upload completed. Records by rank, in call
    order: ``{"checkpoint_id", "after_staging", "after_upload"}``. Both are restored on exit.
    """
    local = threading.local()
    spool, calls = observe._Spool(), observe.Calls()

    def stage(self: Any, *args: Any, **kwargs: Any) -> Any:
        local.staged = original_stage(self, *args, **kwargs)
        local.shared = all_shared(local.staged)
        return local.staged

    def save(*args: Any, **kwargs: Any) -> Any:
        local.staged = local.shared = None
        future = original_save(*args, **kwargs)
        staged = local.staged
        checkpoint = str(observe.checkpoint_id(observe.Call(args, kwargs)))
        record = {"checkpoint_id": checkpoint, "after_staging": local.shared}

        def completed(_: Any) -> None:
            spool.put({**record, "after_upload": staged is not None and all_shared(staged)})

        tracked.track(getattr(future, "upload_completion", future), completed)
        return future

    with (
        timing.completions() as tracked,
        observe.replaced(stager_class, "stage", stage) as original_stage,
        observe.replaced(owner, name, save) as original_save,
    ):
        try:
            yield calls
        finally:
            calls.by_rank = spool.collect()


def dev_shm_bytes() -> int | None:
    """The size of ``/dev/shm``, the one tmpfs that every rank on this machine shares."""
    return shutil.disk_usage("/dev/shm").total if os.path.isdir("/dev/shm") else None


def pinned_staging_bytes(shapes: dict[str, tuple[int, ...]], options: Any, directory: str) -> dict:
    """On a GPU: the host memory that pinned staging buffers take, for a state of ``shapes``
    (fp32), staged once through ``FileSystemWriter(cache_staged_state_dict=True)`` and once
    through a ``DefaultStager(options)`` (available memory before and after each, both
    copies alive). Run it in a process of its own: the writer's pinned memory stays cached
    by the process."""
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.staging import DefaultStager

    state = {key: torch.rand(shape, device="cuda") for key, shape in shapes.items()}
    writer = FileSystemWriter(directory, cache_staged_state_dict=True)
    stager = DefaultStager(options)
    taken = {}
    copies = []
    for what, stage in (("writer", writer.stage), ("stager", stager.stage)):
        before = psutil.virtual_memory().available
        copies.append(stage(state))
        taken[what] = before - psutil.virtual_memory().available
    stager.close()
    return {"state": sum(t.nbytes for t in state.values()), **taken}


# Three of GPT-2 small's fp32 weights: the token embedding, an MLP's and an attention's.
GPT2_SMALL = {"wte": (50257, 768), "mlp.c_fc": (768, 3072), "attn.c_proj": (768, 768)}


def pinning_on_gpu(directory: str, repeats: int = 3, shapes: dict | None = None) -> dict | None:
    """On a machine with a GPU: ``pinned_staging_bytes`` ``repeats`` times and
    ``timing.copy_to_host_seconds`` once, each in a process of its own (the launching
    process never starts CUDA), recorded as the value ``pinning``; None without a GPU."""
    from rank_launcher import run_on_one_process
    from torch.distributed.checkpoint.staging import StagingOptions

    from page_tools import results, timing

    if not torch.cuda.is_available():
        return results.record("pinning", None)
    pinned = StagingOptions(True, False, False, True)  # pinned, non-blocking, in the caller
    staging = [
        run_on_one_process(pinned_staging_bytes, shapes or GPT2_SMALL, pinned, directory)
        for _ in range(repeats)
    ]
    copies = run_on_one_process(timing.copy_to_host_seconds)
    return results.record("pinning", {"staging": staging, "copies_s": copies})


def pinning_numbers(pinning: dict | None, nbytes: int = 2**28) -> dict:
    """What ``pinning_on_gpu`` measured, as a few named numbers (medians): {} without a GPU."""
    numbers = {}
    if pinning is None:
        return numbers
    for what in ("writer", "stager"):
        ratios = sorted(p[what] / p["state"] for p in pinning["staging"])
        numbers[f"{what}: pinned MB per MB of state"] = ratios[len(ratios) // 2]
    for into, seconds in pinning["copies_s"].items():
        numbers[f"copy into {into} GB/s"] = nbytes / sorted(seconds)[len(seconds) // 2] / 1e9
    return numbers


def claim_pins_the_state_size(claim: str, pinning: dict | None, tolerance: float = 0.1) -> None:
    """Decide that each ``DefaultStager`` staging of ``pinning_on_gpu`` took the state's own
    size in host memory, within ``tolerance`` (not measured without a GPU)."""
    from page_tools import results

    if pinning is None:
        return results.not_measured_here(claim, f"{claim}: not measured, no GPU here")
    ratios = [p["stager"] / p["state"] for p in pinning["staging"]]
    results.claim(
        claim,
        all(abs(ratio - 1) < tolerance for ratio in ratios),
        "DefaultStager's pinned buffers: " + ", ".join(f"{r:.2f}x" for r in ratios) + " the state",
        ratios=ratios,
    )


def claim_writer_pins_more(claim: str, pinning: dict | None) -> None:
    """Decide that the writer's cache took more host memory than ``DefaultStager``, beyond
    noise (not measured without a GPU)."""
    from page_tools import results, stats

    if pinning is None:
        return results.not_measured_here(claim, f"{claim}: not measured, no GPU here")
    staging = pinning["staging"]
    stats.claim_less(
        claim,
        "DefaultStager's pinned buffers",
        [p["stager"] for p in staging],
        "the writer's cache",
        [p["writer"] for p in staging],
        "MB",
        1e-6,
    )
