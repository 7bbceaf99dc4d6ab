"""What a neighbor, work on another core, costs a training step on this machine.

A background save does its work beside training: it copies the state once (staging), then
writes that copy and syncs it (the upload). ``step_costs`` times the page's own training
step alone, then beside one helper at a time, in rounds, after a warm-up: a step beside each
helper (in each of 8 ``make bench`` runs without it, the writer's first round, into a new
file, moved the fewest bytes per step, 0.31-0.81 of its most). Three helpers are processes
of their own: one that spins (CPU time, no memory traffic), one that copies memory, one that
writes a file and syncs it. Two are threads of the step's own process, which copy memory
as a stager does: with ``Tensor.copy_``, which lets other threads run Python meanwhile,
and with ``UntypedStorage.copy_`` (``DefaultStager``'s copy into its reused buffer), which
holds the GIL for each whole storage: the step waits for it between its operations. Each
helper counts the bytes it moved while the step ran. A helper works through the whole
step, so the step's seconds lost per second beside it are ``(beside - alone) / beside``:
what a second of each kind of work costs training, beside what the page's strategies lost
per second their saves ran in the background.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import multiprocessing
import os
import statistics
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from page_tools import stats

HELPERS = {
    "spin": "spins (CPU, no memory traffic)",
    "copy": "copies memory, as staging does",
    "write": "writes and syncs a file, as an upload",
    "tensor copy": "copies in this process, letting it run (Tensor.copy_)",
    "storage copy": "copies in this process, holding its GIL (DefaultStager)",
}
SIDES = ("before_s", "after_s")  # the steps alone just before and just after the one beside
IN_PROCESS = ("tensor copy", "storage copy")  # threads beside the step: they share its GIL
STORAGE = 16 << 20  # an in-process helper's piece: one 2048 x 2048 float32 weight's storage
BUFFER = 64 << 20  # a helper's source (and copy target): far beyond the caches
CHUNK = 4 << 20  # what it moves between two looks at its switch (and counts)
FILE_BYTES = 256 << 20  # the writer's file: rewritten in place, synced once per pass
WAIT_S = 120  # a helper that does not answer in this time has failed
WINDOW_S = 0.25  # the least a timing lasts: a short step repeats (a helper moves a chunk)
HOLDS_BACK = 2.0  # a step beside the helper, over each alone around it: it lost over half


def _mover(kind: str, path: str) -> tuple[Callable[[int], int], int | None]:
    """``kind``'s work, one piece at a time (``move(offset)`` returns the bytes it moved),
    and the file descriptor it writes to, if any."""
    if kind in IN_PROCESS:
        import torch  # here: the helper processes import this module, and need no torch

        sources = [torch.rand(STORAGE // 4) for _ in range(BUFFER // STORAGE)]
        targets = [torch.empty_like(source) for source in sources]

        def copy(offset: int) -> int:
            source, target = sources[offset // STORAGE], targets[offset // STORAGE]
            if kind == "storage copy":
                target.untyped_storage().copy_(source.untyped_storage())
            else:
                target.copy_(source)
            return STORAGE

        return copy, None
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600) if kind == "write" else None
    source = memoryview(bytearray(os.urandom(1 << 20)) * (BUFFER >> 20))
    target = memoryview(bytearray(BUFFER))

    def move(offset: int) -> int:
        piece = slice(offset % BUFFER, offset % BUFFER + CHUNK)
        if kind == "copy":
            target[piece] = source[piece]
        else:
            os.pwrite(fd, source[piece], offset)
        return CHUNK

    return move, fd


def _helper(kind: str, path: str, switch, working, resting, moved, stop) -> None:
    """Do ``kind``'s work while ``switch`` is set; sync and rest while it is not."""
    move, fd = (None, None) if kind == "spin" else _mover(kind, path)
    offset, spins, wraps_at = 0, 0, BUFFER if kind in IN_PROCESS else FILE_BYTES
    resting.set()
    while not stop.is_set():
        if not switch.wait(0.005):
            continue
        resting.clear()
        working.set()
        while switch.is_set():
            if move is None:
                spins += sum(range(20_000)) & 1  # no memory traffic beyond the core's own
                continue
            piece = move(offset)
            offset = (offset + piece) % wraps_at
            if fd is not None and offset == 0:
                os.fsync(fd)  # the disk's part of an upload, beside the step too
            with moved.get_lock():
                moved.value += piece
        if fd is not None:
            os.fsync(fd)  # the upload is durable before the step alone runs
        working.clear()
        resting.set()
    if fd is not None:
        os.close(fd)


@dataclasses.dataclass
class _Neighbor:
    kind: str
    worker: multiprocessing.process.BaseProcess | threading.Thread  # a process, or a thread
    switch: Any
    working: Any
    resting: Any
    stop: Any
    moved: Any
    path: str

    def awaited(self, event: Any) -> None:
        """Wait for ``event``; a helper that died or does not answer is an error, not a hang."""
        deadline = time.monotonic() + WAIT_S
        helper = f"neighbors: the helper that {HELPERS[self.kind]}"
        while not event.wait(0.05):
            if not self.worker.is_alive():  # a thread has no exit code: its error is printed
                code = getattr(self.worker, "exitcode", None)
                raise RuntimeError(
                    f"{helper} exited" + ("" if code is None else f" with code {code}")
                )
            if time.monotonic() > deadline:
                raise RuntimeError(f"{helper} did not answer in {WAIT_S} s")

    @contextlib.contextmanager
    def switched_on(self) -> Iterator[None]:
        """The helper works while the block runs, and rests (a writer: synced) after it."""
        self.switch.set()
        self.awaited(self.working)
        yield
        self.switch.clear()
        self.awaited(self.resting)


def _started(context: Any, kind: str, directory: str) -> _Neighbor:
    switch, working, resting, stop = (context.Event() for _ in range(4))
    moved = context.Value("q", 0)
    path = os.path.join(directory, f"neighbor-{kind}-{os.getpid()}.bin")
    args = (kind, path, switch, working, resting, moved, stop)
    start = threading.Thread if kind in IN_PROCESS else context.Process
    worker = start(target=_helper, args=args, daemon=True)
    worker.start()
    return _Neighbor(kind, worker, switch, working, resting, stop, moved, path)


def _timed(step: Callable[[], object]) -> tuple[float, int]:
    """Seconds per ``step`` over as many steps as last ``WINDOW_S`` (one, at full size),
    and how many: a step shorter than one of a helper's chunks would see it move nothing."""
    began, steps = time.perf_counter(), 0
    while steps == 0 or time.perf_counter() - began < WINDOW_S:
        step()
        steps += 1
    return (time.perf_counter() - began) / steps, steps


def step_costs(step: Callable[[], object], directory: str, rounds: int) -> list[dict]:
    """After a warm-up (a step beside each helper), per round: ``step`` alone, then beside
    each helper in turn, alone again after each (a slow minute hits them all). Returns one
    record per round and helper: the step's seconds beside it, just before and just after
    it alone, and their mean, and the GB the helper moved per step beside it (each timing:
    steps for ``WINDOW_S`` at least)."""
    context = multiprocessing.get_context("spawn")  # a clean process: no copy of the model
    neighbors, records = [], []
    try:
        for kind in HELPERS:
            neighbors.append(_started(context, kind, directory))
        for neighbor in neighbors:
            neighbor.awaited(neighbor.resting)
        step()  # a first step (allocations) belongs to no round
        for neighbor in neighbors:  # a warm-up: each helper's first pass belongs to none
            with neighbor.switched_on():  # (the writer's: into a new file, at its lowest speed)
                step()
        for number in range(rounds):
            before, _ = _timed(step)
            for neighbor in neighbors:
                moved = neighbor.moved.value
                with neighbor.switched_on():
                    beside, steps = _timed(step)
                    gb = (neighbor.moved.value - moved) / 1e9 / steps  # per step
                after, _ = _timed(step)  # alone again: the mean of the two takes out a drift
                record = {"round": number, "helper": neighbor.kind, "alone_s": (before + after) / 2}
                record.update(before_s=before, after_s=after)
                records.append({**record, "beside_s": beside, "gb_moved": gb})
                before = after
    finally:
        for neighbor in neighbors:
            neighbor.stop.set()
            neighbor.worker.join(WAIT_S)
            if neighbor.worker.is_alive() and hasattr(neighbor.worker, "kill"):
                neighbor.worker.kill()  # a process; a daemon thread ends with its own
            if os.path.exists(neighbor.path):
                os.remove(neighbor.path)
    return records


def beside_helpers(
    make_model: Callable,
    train_step: Callable,
    batch_shape: Sequence[int],
    threads: int,
    directory: str,
    rounds: int,
) -> list[dict]:
    """``step_costs`` of a page's step, on rank 0 (the others return at once): a fresh
    ``make_model()`` without FSDP (no collective), trained with Adam by
    ``train_step(model, optimizer, batch, None)`` on ``threads`` threads, on a random batch
    of ``batch_shape``."""
    import torch  # here: a helper process imports this module, and needs no torch
    import torch.distributed as dist

    if dist.get_rank() != 0:
        return []
    torch.set_num_threads(threads)
    model = make_model()
    optimizer = torch.optim.Adam(model.parameters())
    step = functools.partial(train_step, model, optimizer, torch.rand(*batch_shape), None)
    return step_costs(step, directory, rounds)


def summarize(records: list[dict]) -> dict:
    """Per helper: the step's time beside it over the same round's step alone (the mean of
    the steps just before and after), the GB it moved per second, and the seconds the step
    lost per second beside it (medians over rounds); with the rounds' own numbers. The
    helper ``holds_back`` the step where, in every round, the step beside it took over
    ``HOLDS_BACK`` (2) times *each* of the two steps alone around it: it lost over half its
    time beside the helper. A smaller factor is shown, not judged (see below)."""
    found = {}
    for kind, rounds in stats.group(records, "helper").items():
        alone, beside, gb = rounds["alone_s"], rounds["beside_s"], rounds["gb_moved"]
        lost = [(b - a) / b for a, b in zip(alone, beside, strict=True)]
        # A round's three steps ran seconds apart (a slow minute slows them alike): both
        # factors, beside over before and beside over after, stay beyond 2 in every round.
        # Smaller factors changed from run to run with the host, not the helper: in 14
        # make bench runs, the copying process's median read 1.03-1.31x, and a rule at
        # 1.1x called it an effect in 6 of them; the spinning one's rounds read up to 1.27x.
        holds_back = all(
            stats.paired_factor(rounds[side], beside, HOLDS_BACK)["change"] == "more"
            for side in SIDES
        )
        found[kind] = {
            "what": HELPERS[kind],
            "slowdown": stats.summary([b / a for a, b in zip(alone, beside, strict=True)]),
            "holds_back": holds_back,
            "gb_per_s": statistics.median(g / b for g, b in zip(gb, beside, strict=True)),
            "lost_per_s_beside": statistics.median(lost),
            "rounds": {key: rounds[key] for key in ("alone_s", *SIDES, "beside_s", "gb_moved")},
        }
    return found


def table(found: dict):
    """Each helper's slow-down of the step, whether it holds the step back, the speed it
    moved memory at, and the seconds the step lost per second beside it."""
    from page_tools import figures

    rows = [
        [
            f"{kind}: {entry['what']}",
            stats.shown_entry(entry["slowdown"], ".3g", "x"),
            "yes" if entry["holds_back"] else "no",
            round(entry["gb_per_s"], 2),
            round(entry["lost_per_s_beside"], 3),
        ]
        for kind, entry in found.items()
    ]
    columns = ["the helper on another core", "step beside it / alone", "holds it back"]
    caption = "medians over rounds [lowest .. highest]; a helper holds the step back where the "
    caption += f"step beside it took over {HOLDS_BACK:g}x each step alone around it, in every "
    caption += "round; a smaller factor reads best beside the spinning helper's: it moves no memory"
    return figures.Table([*columns, "GB/s", "s lost / s"], rows, caption)
