"""Faults on cue: a rank killed with ``SIGKILL`` at a byte of a file it writes, at a tensor
of a staging, or at an optimizer step; every one a context manager that restores what it
changed.

A page wraps the launch of its recipe in one, and decides afterwards that the crash
happened where it was planned::

    with faults.kill_in_write(after_bytes=65536, path=r"step-00000040/.*\\.distcp$") as kill:
        failure = run_until_it_fails(train, root)
    faults.crashed_as_planned("upload-crash", kill, failure, root, torn=[40], complete=[30])

The ranks are forked inside the block and inherit what it armed. The rank chosen (``rank``;
-1 is the last one, whatever the number of ranks) kills itself when it gets there, and
leaves a record first (which rank, where, how far), which comes back to the page when the
block ends: ``kill.fired``. A kill that did not fire leaves ``kill.fired`` empty, and
``crashed_as_planned`` fails the build: a comparison with a run that never crashed proves
nothing unless the crash happened.

``new_processes=True`` also arms the Python processes started inside the block (the
workers of a ``torchrun`` that the page starts, of restart attempt ``attempt`` only),
through a ``sitecustomize`` module put on ``PYTHONPATH`` for the block. On exit, the
environment and every class and hook of torch are what they were.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import re
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch.distributed as dist
from rank_launcher import under_torchrun

from page_tools import observe, results

PLAN_ENV = "PAGE_TOOLS_KILL_PLAN"  # read by the sitecustomize below, in new processes only
RECORDS = "fired.jsonl"
KILLED = r"killed by SIGKILL|exitcode: -9\)"  # the launcher's words, and torchrun's
SITECUSTOMIZE = '''\
"""Written by page_tools.faults for one block of a page: arms its kill in new processes."""
import os

if "{env}" in os.environ and "RANK" in os.environ:  # a torchrun worker, not the agent
    from page_tools import faults

    faults.arm_from_environment()
'''


@dataclasses.dataclass
class Kill:
    """A kill armed for one block: what and where, and the records of the ranks it killed."""

    kind: str  # "write", "staging" or "step"
    plan: dict
    fired: list[dict] = dataclasses.field(default_factory=list)

    @property
    def happened(self) -> bool:
        return bool(self.fired)


# --------------------------------------------------------------------------
# In the rank: when to die, and the record it leaves
# --------------------------------------------------------------------------


def _rank_and_size() -> tuple[int, int]:
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


def _chosen(plan: dict) -> bool:
    """This process is the rank the plan kills (-1: the last), in the attempt it names."""
    rank, size = _rank_and_size()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
    return rank == plan["rank"] % size and attempt == plan.get("attempt", attempt)


def _die(plan: dict, **where: Any) -> None:
    """Leave the record, then SIGKILL this process (no clean-up, no exit handlers)."""
    rank, size = _rank_and_size()
    record = {
        "kind": plan["kind"],
        "rank": rank,
        "world_size": size,
        "pid": os.getpid(),
        "attempt": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)),
        **where,
    }
    with open(Path(plan["directory"], RECORDS), "a") as records:
        records.write(json.dumps(record) + "\n")
    sys.stdout.flush()
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)


class _DyingStream:
    """A file stream that writes ``after_bytes`` bytes to disk, then kills the process."""

    def __init__(self, stream: Any, path: str, plan: dict):
        self._stream, self._path, self._plan, self._written = stream, path, plan, 0

    def write(self, data: Any) -> int:
        room = self._plan["after_bytes"] - self._written
        size = memoryview(data).nbytes
        if size >= room:
            self._stream.write(bytes(memoryview(data).cast("B")[:room]))
            self._stream.flush()
            os.fsync(self._stream.fileno())
            _die(self._plan, path=self._path, bytes=self._plan["after_bytes"])
        self._written += size
        return self._stream.write(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


class _DyingStreamContext:
    def __init__(self, context: Any, path: str, plan: dict):
        self._context, self._path, self._plan = context, path, plan

    def __enter__(self) -> _DyingStream:
        return _DyingStream(self._context.__enter__(), self._path, self._plan)

    def __exit__(self, *exc: Any) -> Any:
        return self._context.__exit__(*exc)


def _arm_write(plan: dict) -> contextlib.AbstractContextManager:
    from torch.distributed.checkpoint.filesystem import FileSystem

    original = FileSystem.create_stream
    pattern = re.compile(plan["path"])

    def create_stream(self: Any, path: Any, mode: str) -> Any:
        context = original(self, path, mode)
        if "w" in mode and pattern.search(str(path)) and _chosen(plan):
            return _DyingStreamContext(context, str(path), plan)
        return context

    return observe.replaced(FileSystem, "create_stream", create_stream)


def _arm_staging(plan: dict) -> contextlib.AbstractContextManager:
    from torch.distributed.checkpoint._state_dict_stager import StateDictStager

    counts = {"stagings": 0, "tensors": 0}  # this process's, from the block's start
    original_stage, original_offload = StateDictStager.stage, StateDictStager._offload_tensor

    def stage(self: Any, *args: Any, **kwargs: Any) -> Any:
        counts["stagings"] += 1
        counts["tensors"] = 0
        return original_stage(self, *args, **kwargs)

    def offload(self: Any, *args: Any, **kwargs: Any) -> Any:
        if counts["stagings"] == plan["staging"] and _chosen(plan):
            if counts["tensors"] >= plan["after_tensors"]:
                _die(plan, staging=counts["stagings"], tensors=counts["tensors"])
            counts["tensors"] += 1
        return original_offload(self, *args, **kwargs)

    stack = contextlib.ExitStack()
    stack.enter_context(observe.replaced(StateDictStager, "stage", stage))
    stack.enter_context(observe.replaced(StateDictStager, "_offload_tensor", offload))
    return stack


def _arm_step(plan: dict) -> contextlib.AbstractContextManager:
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    calls = [0]  # this process's optimizer steps, from the block's start

    def before_step(optimizer: Any, args: Any, kwargs: Any) -> None:
        calls[0] += 1
        if calls[0] != plan["step"] or not _chosen(plan):
            return
        waited = plan.get("once_exists")
        deadline = time.monotonic() + plan.get("wait_s", 60.0)
        while waited and not os.path.exists(waited) and time.monotonic() < deadline:
            time.sleep(0.01)
        _die(
            plan, step=calls[0], waited_for=waited, existed=bool(waited and os.path.exists(waited))
        )

    handle = register_optimizer_step_pre_hook(before_step)
    stack = contextlib.ExitStack()
    stack.callback(handle.remove)
    return stack


_ARMING = {"write": _arm_write, "staging": _arm_staging, "step": _arm_step}


def arm_from_environment() -> None:
    """In a new process started inside a ``new_processes=True`` block: arm its kill for good
    (the process is a throwaway worker; the page's own process is restored on exit)."""
    plan = json.loads(os.environ[PLAN_ENV])
    armed = _ARMING[plan["kind"]](plan)
    armed.__enter__()
    _ARMED_FOR_GOOD.append(armed)  # a context manager collected would restore on its way out


_ARMED_FOR_GOOD: list = []


# --------------------------------------------------------------------------
# In the page: the blocks
# --------------------------------------------------------------------------


@contextlib.contextmanager
def _environment(**values: str) -> Iterator[None]:
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@contextlib.contextmanager
def _quiet_launch_errors() -> Iterator[None]:
    """torch.multiprocessing logs a warning for every rank the launch stops after the kill."""
    logger = logging.getLogger("torch.multiprocessing.spawn")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


@contextlib.contextmanager
def _kill(kind: str, new_processes: bool, **plan: Any) -> Iterator[Kill]:
    if under_torchrun():
        raise RuntimeError(
            "a page's kills need ranks it forks: run the page with python (under torchrun, "
            "run its download, which kills nothing)"
        )
    directory = tempfile.mkdtemp(prefix="page-tools-kill-")
    plan = {"kind": kind, "directory": directory, **plan}
    kill = Kill(kind, {k: v for k, v in plan.items() if k != "directory"})
    stack = contextlib.ExitStack()
    try:
        stack.enter_context(_quiet_launch_errors())
        stack.enter_context(_ARMING[kind](plan))
        if new_processes:
            Path(directory, "sitecustomize.py").write_text(SITECUSTOMIZE.format(env=PLAN_ENV))
            path = [directory, str(Path(__file__).resolve().parents[1])]
            path += [os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else []
            stack.enter_context(
                _environment(**{PLAN_ENV: json.dumps(plan), "PYTHONPATH": os.pathsep.join(path)})
            )
        with stack:
            yield kill
    finally:
        records = Path(directory, RECORDS)
        if records.exists():
            kill.fired = [json.loads(line) for line in records.read_text().splitlines() if line]
        shutil.rmtree(directory, ignore_errors=True)


def kill_in_write(
    after_bytes: int, path: str, rank: int = -1, new_processes: bool = False, attempt: int = 0
):
    """Rank ``rank`` is killed once it has written ``after_bytes`` bytes of a file whose path
    matches the regular expression ``path`` (through DCP's ``FileSystem``): the bytes before
    the kill are on disk (fsynced), the rest of the file is not."""
    plan = {"after_bytes": after_bytes, "path": path, "rank": rank}
    return _kill("write", new_processes, **plan, **({"attempt": attempt} if new_processes else {}))


def kill_in_staging(staging: int, after_tensors: int, rank: int = -1):
    """Rank ``rank`` is killed in its ``staging``-th staging of a ``DefaultStager`` (counted in
    its process from the block's start: the 4th save of a run), once ``after_tensors`` tensors
    of the state were copied to host memory."""
    return _kill("staging", False, staging=staging, after_tensors=after_tensors, rank=rank)


def kill_at_step(
    step: int,
    rank: int = -1,
    once_exists: str | None = None,
    wait_s: float = 60.0,
    new_processes: bool = False,
    attempt: int = 0,
):
    """Rank ``rank`` is killed right before its ``step``-th optimizer step (counted in its
    process from the block's start: step ``step`` of a run from step 1), once the file
    ``once_exists`` exists, if given (the ``.metadata`` of a save that must be complete),
    waiting at most ``wait_s`` seconds for it."""
    plan = {"step": step, "rank": rank, "once_exists": once_exists, "wait_s": wait_s}
    return _kill("step", new_processes, **plan, **({"attempt": attempt} if new_processes else {}))


# --------------------------------------------------------------------------
# The claim: it crashed where it was planned
# --------------------------------------------------------------------------


def _step_dir(root: str, step: int) -> str:
    return os.path.join(root, f"step-{step:08d}")


def crashed_as_planned(
    claim: str,
    kill: Kill,
    failure: Any,
    root: str,
    torn: list[int] = (),
    complete: list[int] = (),
) -> dict:
    """Decide that the kill fired on the planned rank, exactly once, that the launch failed
    naming that rank as killed by SIGKILL (``failure``: the launcher's ``RankFailedError``,
    or what a torchrun job printed), and that the checkpoint directories under ``root`` are
    what the crash must leave: step directories ``torn`` without ``.metadata``, ``complete``
    ones with it, and a file cut at the byte of the kill where the kill was in a write."""
    fired = kill.fired
    record = fired[0] if len(fired) == 1 else {}
    text = str(failure or "")
    rank = record.get("rank")
    named = f"rank {rank} failed: killed by SIGKILL" in text or bool(
        re.search(rf"exitcode: -9\) local_rank: {rank} ", text)  # what torchrun logs
    )
    planned_rank = bool(record) and rank == kill.plan["rank"] % record["world_size"]
    torn_ok = all(not os.path.exists(os.path.join(_step_dir(root, s), ".metadata")) for s in torn)
    complete_ok = all(
        os.path.exists(os.path.join(_step_dir(root, s), ".metadata")) for s in complete
    )
    cut = None
    if "path" in record:
        cut = os.path.getsize(record["path"]) if os.path.exists(record["path"]) else None
    cut_ok = "path" not in record or cut == record["bytes"]
    waited_ok = not record.get("waited_for") or record.get("existed", False)
    where = {
        "write": lambda: f"after {record['bytes']:,} bytes of {_short(record['path'], root)}",
        "staging": lambda: (
            f"in its staging {record['staging']}, after copying {record['tensors']} tensors"
        ),
        "step": lambda: f"at its step {record['step']}",
    }[kill.kind]
    said = (
        f"rank {rank} was killed (SIGKILL) {where()},\nand the job failed with it"
        if record
        else f"the {kill.kind} kill did not fire ({len(fired)} records)"
    )
    for word, steps in (("torn", torn), ("complete", complete)):
        if steps:
            said += f"; {word}: step{'s' * (len(steps) > 1)} {', '.join(map(str, steps))}"
    results.claim(
        claim,
        planned_rank and named and torn_ok and complete_ok and cut_ok and waited_ok,
        said,
        fired=fired,
        named_in_failure=named,
        torn_without_metadata=torn_ok,
        complete_with_metadata=complete_ok,
        file_cut_at=cut,
        failure=next((ln for ln in text.splitlines() if re.search(KILLED, ln)), None),
    )
    return record


def _short(path: str, root: str) -> str:
    return os.path.relpath(path, root) if path.startswith(root) else os.path.basename(path)
