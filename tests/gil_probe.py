"""Whether work lets other Python threads run: the tests of ``neighbors``' in-process helpers
and of ``direct_io``'s stager count a probe thread's wake-ups while it runs."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable


def ticks_during(work: Callable[[], object]) -> int:
    """How often a Python thread woke up while ``work()`` ran: never, if ``work`` held the GIL."""
    ticks, running, stop = [0], threading.Event(), threading.Event()

    def probe():
        while not stop.is_set():
            time.sleep(0.0002)
            ticks[0] += running.is_set()

    thread = threading.Thread(target=probe)
    thread.start()
    try:
        time.sleep(0.01)
        running.set()
        work()
        running.clear()
    finally:
        stop.set()
        thread.join()
    return ticks[0]
