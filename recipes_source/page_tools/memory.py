"""Host memory: the peak a process (with the helper processes it started) reaches.

``PeakSampler`` samples a process's resident memory every few milliseconds, plus the
private memory of its child processes (DCP's checkpoint process: the staged copy it
shares with its parent is counted once), and keeps the peak above where it started.
Before it starts it hands memory that the process freed back to the system
(``give_back_freed_memory``), so that what a measured run allocates cannot hide in
memory an earlier run freed.

``peak_between(start, stop)`` measures each stretch of a page's ranks from a call of
one torch function to a call of another (a run of a loop, from the process group it
creates to the one it destroys): one record per stretch comes back by rank.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import os
import threading
from collections.abc import Iterator
from typing import Any

import psutil

from page_tools import observe


def give_back_freed_memory() -> None:
    """Collect garbage, and have the C allocator return the memory it keeps (glibc)."""
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def resident_bytes(process: psutil.Process, children: list[psutil.Process]) -> int:
    """``process``'s resident memory plus its ``children``'s private (resident, not shared)."""
    total = process.memory_info().rss
    for child in children:
        with contextlib.suppress(psutil.Error):
            info = child.memory_info()
            total += info.rss - info.shared  # what it shares with us is counted once
    return total


class PeakSampler:
    """The peak resident memory of a process and its children, from ``start()`` to ``stop()``."""

    def __init__(self, interval_s: float = 0.01, pid: int | None = None):
        self.interval_s = interval_s
        self.process = psutil.Process(pid)
        self.children: list[psutil.Process] = []
        self.baseline = self.peak = 0
        self.samples = 0
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> PeakSampler:
        give_back_freed_memory()
        self.children = self.process.children(recursive=True)
        self.baseline = self.peak = resident_bytes(self.process, self.children)
        self._thread = threading.Thread(target=self._sample, daemon=True, name="peak-sampler")
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stopped.is_set():
            if self.samples % 20 == 0:  # a helper process may have started
                with contextlib.suppress(psutil.Error):
                    self.children = self.process.children(recursive=True)
            with contextlib.suppress(psutil.Error):
                self.peak = max(self.peak, resident_bytes(self.process, self.children))
            self.samples += 1
            self._stopped.wait(self.interval_s)

    def stop(self) -> dict:
        """Stop sampling: the peak above the start, and where it started, in MB."""
        self._stopped.set()
        if self._thread is not None:
            self._thread.join()
        self.peak = max(self.peak, resident_bytes(self.process, self.children))
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
