"""What a neighbor, a process working on another core, costs a training step on this machine.

A background save does its work beside training: it copies the state once (staging), then
writes that copy and syncs it (the upload). ``step_costs`` times the page's own training
step alone, then beside one helper process at a time, in rounds: one that spins (CPU
time, no memory traffic), one that copies memory, one that writes a file and syncs it.
Each helper counts the bytes it moved while the step ran. A helper works through the
whole step, so the step's seconds lost per second beside it are ``(beside - alone) /
beside``. Where spinning costs the step about as much as copying, what slows training is
a busy neighbor core, whatever it does (on a virtual machine, two virtual cores may share
one physical core), more than the bytes it moves: a background save then costs the steps
about what a spinning neighbor costs per second, for as long as it runs beside them
(``busy_core_cost``, ``against_goal``), and a shorter save costs less.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import multiprocessing
import os
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

from page_tools import stats

HELPERS = {
    "spin": "spins (CPU, no memory traffic)",
    "copy": "copies memory, as staging does",
    "write": "writes and syncs a file, as an upload",
}
BUFFER = 64 << 20  # a helper's source (and copy target): far beyond the caches
CHUNK = 4 << 20  # what it moves between two looks at its switch (and counts)
FILE_BYTES = 256 << 20  # the writer's file: rewritten in place, synced once per pass
WAIT_S = 120  # a helper that does not answer in this time has failed
WINDOW_S = 0.25  # the least a timing lasts: a short step repeats (a helper moves a chunk)


def _helper(kind: str, path: str, switch, working, resting, moved, stop) -> None:
    """Do ``kind``'s work while ``switch`` is set; sync and rest while it is not."""
    source, target = bytearray(os.urandom(1 << 20)) * (BUFFER >> 20), bytearray(BUFFER)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600) if kind == "write" else None
    source, target, offset, spins = memoryview(source), memoryview(target), 0, 0
    resting.set()
    while not stop.is_set():
        if not switch.wait(0.005):
            continue
        resting.clear()
        working.set()
        while switch.is_set():
            if kind == "spin":
                spins += sum(range(20_000)) & 1  # no memory traffic beyond the core's own
                continue
            piece = slice(offset % BUFFER, offset % BUFFER + CHUNK)
            if kind == "copy":
                target[piece] = source[piece]
            else:
                os.pwrite(fd, source[piece], offset)
            offset = (offset + CHUNK) % FILE_BYTES
            if fd is not None and offset == 0:
                os.fsync(fd)  # the disk's part of an upload, beside the step too
            with moved.get_lock():
                moved.value += CHUNK
        if fd is not None:
            os.fsync(fd)  # the upload is durable before the step alone runs
        working.clear()
        resting.set()
    if fd is not None:
        os.close(fd)


@dataclasses.dataclass
class _Neighbor:
    kind: str
    process: multiprocessing.process.BaseProcess
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
            if not self.process.is_alive():
                raise RuntimeError(f"{helper} exited with code {self.process.exitcode}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{helper} did not answer in {WAIT_S} s")


def _started(context: Any, kind: str, directory: str) -> _Neighbor:
    switch, working, resting, stop = (context.Event() for _ in range(4))
    moved = context.Value("q", 0)
    path = os.path.join(directory, f"neighbor-{kind}-{os.getpid()}.bin")
    args = (kind, path, switch, working, resting, moved, stop)
    process = context.Process(target=_helper, args=args, daemon=True)
    process.start()
    return _Neighbor(kind, process, switch, working, resting, stop, moved, path)


def _timed(step: Callable[[], object]) -> tuple[float, int]:
    """Seconds per ``step`` over as many steps as last ``WINDOW_S`` (one, at full size),
    and how many: a step shorter than one of a helper's chunks would see it move nothing."""
    began, steps = time.perf_counter(), 0
    while steps == 0 or time.perf_counter() - began < WINDOW_S:
        step()
        steps += 1
    return (time.perf_counter() - began) / steps, steps


def step_costs(step: Callable[[], object], directory: str, rounds: int) -> list[dict]:
    """Per round: ``step`` alone, then beside each helper in turn, alone again after each
    (a slow minute hits them all). Returns one record per round and helper: the step's
    seconds beside it, alone (the mean of the steps just before and after), and the GB the
    helper moved per step beside it (each timing: steps for ``WINDOW_S`` at least)."""
    context = multiprocessing.get_context("spawn")  # a clean process: no copy of the model
    neighbors, records = [], []
    try:
        for kind in HELPERS:
            neighbors.append(_started(context, kind, directory))
        for neighbor in neighbors:
            neighbor.awaited(neighbor.resting)
        step()  # a first step (allocations) belongs to no round
        for number in range(rounds):
            before, _ = _timed(step)
            for neighbor in neighbors:
                moved = neighbor.moved.value
                neighbor.switch.set()
                neighbor.awaited(neighbor.working)
                beside, steps = _timed(step)
                gb = (neighbor.moved.value - moved) / 1e9 / steps  # per step
                neighbor.switch.clear()
                neighbor.awaited(neighbor.resting)
                after, _ = _timed(step)  # alone again: the mean of the two takes out a drift
                record = {"round": number, "helper": neighbor.kind, "alone_s": (before + after) / 2}
                records.append({**record, "beside_s": beside, "gb_moved": gb})
                before = after
    finally:
        for neighbor in neighbors:
            neighbor.stop.set()
            neighbor.process.join(WAIT_S)
            if neighbor.process.is_alive():
                neighbor.process.kill()
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
    """Per helper: the step's time beside it over the same round's step alone (an effect
    where it is above 1 in every round), the GB it moved per second, and the seconds the
    step lost per second beside it (medians over rounds); with the rounds' own numbers."""
    found = {}
    for kind, rounds in stats.group(records, "helper").items():
        alone, beside, gb = rounds["alone_s"], rounds["beside_s"], rounds["gb_moved"]
        lost = [(b - a) / b for a, b in zip(alone, beside, strict=True)]
        slowdown = stats.summary([b / a for a, b in zip(alone, beside, strict=True)])
        # Each round's two steps ran seconds apart (a slow minute slows both): the helper
        # slows the step where it did so in every round (the spread does not cross 1).
        slowdown.update(effect=slowdown["median"] - 1, within_noise=slowdown["min"] <= 1)
        found[kind] = {
            "what": HELPERS[kind],
            "slowdown": slowdown,
            "gb_per_s": statistics.median(g / b for g, b in zip(gb, beside, strict=True)),
            "lost_per_s_beside": statistics.median(lost),
            "rounds": {"alone_s": alone, "beside_s": beside, "gb_moved": gb},
        }
    return found


def busy_core_cost(found: dict) -> dict:
    """What a busy neighbor core costs the step here, in seconds lost per second beside it:
    the spinning helper's ``lost_per_s_beside`` (a core kept busy, no memory moved; none
    below 0), and whether its slow-down is within noise."""
    spin = found["spin"]
    return {
        "lost_per_s_beside": max(0.0, spin["lost_per_s_beside"]),
        "within_noise": spin["slowdown"]["within_noise"],
    }


def table(found: dict):
    """Each helper's slow-down of the step, the speed it moved memory at, and the seconds
    the step lost per second beside it."""
    from page_tools import figures

    rows = [
        [
            f"{kind}: {entry['what']}",
            stats.shown_entry(entry["slowdown"], ".3g", "x"),
            round(entry["gb_per_s"], 2),
            round(entry["lost_per_s_beside"], 3),
        ]
        for kind, entry in found.items()
    ]
    columns = ["the helper on another core", "step beside it / alone", "GB/s", "s lost / s"]
    return figures.Table(columns, rows, "medians over rounds [lowest .. highest]")


def against_goal(cost: dict, goal_s: float, summary: dict, strategy: str) -> dict:
    """What ``busy_core_cost`` predicts for ``strategy``'s checkpoint (from its entry in the
    stall page's ``summary``: medians of its stall, its time until durable and its overhead),
    against the overhead goal in seconds: the loop waits for the stall, and the steps lose
    ``cost`` per second of the rest, while the save keeps the other core busy; and how soon
    after its start a save must be on disk to meet the goal (None: its stall alone is above
    it), beside dcp.save's time until durable."""
    per_s, measured = cost["lost_per_s_beside"], summary[strategy]
    blocking_s = summary["dcp.save"]["time_until_durable_s"]["median"]
    stall_s = measured["stall_per_checkpoint_s"]["median"]
    background_s = max(0.0, measured["time_until_durable_s"]["median"] - stall_s)
    expected_s = stall_s + per_s * background_s
    if stall_s >= goal_s:
        durable_within_s, needs = None, "is below its stall alone"
    elif not per_s:
        durable_within_s, needs = math.inf, "is above that, however long the save runs"
    else:
        durable_within_s = stall_s + (goal_s - stall_s) / per_s
        needs = f"needs it on disk {durable_within_s:.3g} s after it starts"
        needs += f" (dcp.save's own: {blocking_s:.3g} s)"
    overhead_s = measured["overhead_s"]["median"]
    noise = " (within noise)" if cost["within_noise"] else ""
    said = (
        f"A busy neighbor core costs a step here {per_s:.3g} s per second beside it{noise}. "
        f"{strategy} stalls {stall_s:.3g} s, then runs {background_s:.3g} s in the "
        f"background: about {expected_s:.3g} s per checkpoint (measured: {overhead_s:.3g} s). "
        f"The overhead goal, {goal_s:.3g} s, {needs}."
    )
    return {"lost_per_s_beside": per_s, "stall_s": stall_s, "background_s": background_s,
            "expected_s": expected_s, "goal_s": goal_s, "durable_within_s": durable_within_s,
            "goal_below_expected": goal_s < expected_s, "strategy": strategy,
            "dcp_save_durable_s": blocking_s,
            "overhead_s": overhead_s, "said": said}  # fmt: skip
