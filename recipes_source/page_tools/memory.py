"""Host memory: glibc's heap counters at the moments a recipe reads its resident memory, and
whether resident memory grows over repeated saves, decided against its own noise.

A recipe that follows its memory reads its RSS itself (``psutil.Process().memory_info()``)
after every save; the page watches that call and reads, at the same instant, where glibc's
heap keeps its bytes (``mallinfo2``): in live allocations, freed but kept for later, or in
mapped blocks. That tells a leak (live allocations pile up) from an allocator that keeps
freed staging buffers.

``growth`` decides whether RSS grows: the first saves fill caches and pools, so it
compares a window of later saves with the last window (``stats.difference``): a
difference within the spread of either window is noise, never growth.
"""

from __future__ import annotations

import contextlib
import ctypes
import time
from collections.abc import Callable, Sequence
from typing import Any

from page_tools import observe, stats


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


def malloc_counters() -> dict[str, int] | None:
    """Bytes in live allocations, freed but kept by the allocator, and in mapped blocks
    (glibc 2.33 or later); None elsewhere."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None)
        libc.mallinfo2.restype = MallInfo2
        info = libc.mallinfo2()
        return {"in_use": info.uordblks, "free_kept": info.fordblks, "mmapped": info.hblkhd}
    return None


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
    title = f"{title}: {ranks} rank(s), {share / 1e6:.0f} MB per rank, the highest rank"
    return figures.lines(
        series, "save", "RSS above the start (MB)", title, share / 1e6, "one copy of a rank's share"
    )


def grew_most(summaries: dict[str, dict]) -> str:
    """The strategy (of ``summarize``) whose RSS grew most per save."""
    return max(summaries, key=lambda strategy: summaries[strategy]["per_save"])
