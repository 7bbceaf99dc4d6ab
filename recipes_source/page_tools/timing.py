"""Clocks and timelines: when each rank's calls of a torch function started, and how long
one phase of a call lasted (from the call until a function it calls first ran).

A page times what its recipe does with the recipe's own clock (the reader keeps that
code); the phases inside a call are the page's::

    with timing.until_first(dcp, "save", FileSystemWriter, "write_data") as planning:
        run_on_ranks(save_every_way, CHECKPOINT_ROOT)
    timing.slowest(planning, [path])  # the slowest rank's seconds from dcp.save to write_data

Stamps are ``time.perf_counter()``, the system's monotonic clock, so that stamps taken
in different processes of one machine compare. Like every watch, nothing of torch stays
changed after the block.
"""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from page_tools import observe


def stamps(
    owner: Any, name: str, where: Callable[[observe.Call], bool] | None = None
) -> contextlib.AbstractContextManager[observe.Calls]:
    """Watch ``owner.name``: for each call, (its checkpoint if it is a DCP call, when it
    started), by rank."""
    return observe.watch(
        owner,
        name,
        lambda call: (observe.checkpoint_id(call), time.perf_counter()),
        before=True,
        where=where,
    )


@dataclasses.dataclass
class Phases:
    """Calls of one function (``starts``) and of a function they call (``thens``), by rank."""

    starts: observe.Calls
    thens: observe.Calls

    def by_rank(self) -> dict[int, list[tuple[str | None, float | None]]]:
        """Per rank, per call in time order: (checkpoint, seconds from the call until the
        first ``then`` that followed it and came before the next call), None if none did."""
        phases: dict[int, list[tuple[str | None, float | None]]] = {}
        for rank, starts in self.starts.by_rank.items():
            starts = sorted(starts, key=lambda start: start[1])
            thens = sorted(when for _, when in self.thens.by_rank.get(rank, []))
            rank_phases = []
            for i, (checkpoint, started) in enumerate(starts):
                ends = starts[i + 1][1] if i + 1 < len(starts) else float("inf")
                first = bisect.bisect_left(thens, started)
                later = thens[first] if first < len(thens) and thens[first] < ends else None
                rank_phases.append((checkpoint, None if later is None else later - started))
            phases[rank] = rank_phases
        return phases


def slowest(phases: Phases, checkpoints: Iterable[str], nth: int = 0) -> list[float | None]:
    """For each checkpoint, the slowest rank's phase of its ``nth`` call about it (a collective
    call's phase ends when it ends on its last rank); None where a rank has no such call."""
    by_rank = phases.by_rank()
    found = []
    for checkpoint in checkpoints:
        seconds = []
        for rank_phases in by_rank.values():
            mine = [s for path, s in rank_phases if path == checkpoint]
            seconds.append(mine[nth] if len(mine) > nth else None)
        found.append(None if not seconds or None in seconds else max(seconds))
    return found


@contextlib.contextmanager
def until_first(owner: Any, name: str, then_owner: Any, then_name: str) -> Iterator[Phases]:
    """Time, at every call of ``owner.name`` inside the block, the phase until it first calls
    ``then_owner.then_name`` (``dcp.save`` until ``FileSystemWriter.write_data``: planning)."""
    with stamps(owner, name) as starts, stamps(then_owner, then_name) as thens:
        yield Phases(starts, thens)
