"""Host memory: how far a process's peak resident memory grows while a function runs.

``PeakHostMemory`` reads Linux's own high-water mark of the process (``VmHWM``), reset
right before the code it measures: the exact peak of that code, not a sample. A page
measures a function it runs on its ranks with a watch::

    with memory.peak_growth(observe.page_module(), "load_on_every_rank", repeats=3) as peaks:
        run_on_ranks(load_and_train, load_on_every_rank, FOLDER)
    peaks.by_rank  # {0: [[43.1, 42.9, 43.0]], 1: [...]}: MiB, one list per call

The function is called once more before it is measured (``warm_up``), so that one-time
costs (imports, the allocator's first arenas) do not count, and each measured call
starts with the memory that earlier ones freed given back to the system.
"""

from __future__ import annotations

import ctypes
import gc
import sys
from collections.abc import Callable
from typing import Any

from page_tools import figures, observe, stats


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
