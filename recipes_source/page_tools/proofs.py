"""Proofs about state: what a page saved, reassembled from every rank's shards, against what
it loaded, tensor by tensor and bit for bit.

``snapshot(state_dict)`` runs on a rank: a CPU copy of every tensor this rank holds (of a
``DTensor``, its shard and where the shard sits in the global tensor) and of every other
value, by dotted name (``app.model.net1.weight``). ``Stateful`` values are asked for their
``state_dict()``, as DCP asks them. ``assemble`` puts the ranks' snapshots back together
into whole tensors, whatever the number of ranks, so that a checkpoint saved on two ranks
can be compared with one loaded on three, or in one process. ``same_state`` decides the
claim that two states are equal (``results.claim``).

The watches below take the snapshots where DCP sees the state: ``state_given_to(dcp,
"save")`` when a save is called (the state the checkpoint must hold), ``state_after(dcp,
"load")`` when a load returns (the state it filled in), ``value_returned_by(torch, "load",
...)`` for a file read back.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from collections.abc import Callable, Iterator, Mapping
from typing import Any, NamedTuple

import torch
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.tensor import DTensor

from page_tools import observe, results


@dataclasses.dataclass
class Piece:
    """One rank's part of a tensor: where it sits in the whole, and a CPU copy of it."""

    global_shape: tuple[int, ...]
    offset: tuple[int, ...]
    tensor: torch.Tensor


def flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    """Every leaf of a nested state dict (dicts, lists, ``Stateful``) by dotted name."""
    if isinstance(value, Stateful) and not isinstance(value, torch.Tensor):
        value = value.state_dict()
    if isinstance(value, Mapping):
        items = value.items()
    elif isinstance(value, list | tuple):
        items = enumerate(value)
    else:
        return {prefix.rstrip("."): value}
    flat: dict[str, Any] = {}
    for key, item in items:
        flat.update(flatten(item, f"{prefix}{key}."))
    return flat


def _piece(tensor: torch.Tensor) -> Piece:
    if isinstance(tensor, DTensor):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        _, offset = compute_local_shape_and_global_offset(
            tensor.shape, tensor.device_mesh, tensor.placements
        )
        local = tensor.to_local()
        return Piece(tuple(tensor.shape), tuple(offset), local.detach().to("cpu", copy=True))
    return Piece(tuple(tensor.shape), (0,) * tensor.dim(), tensor.detach().to("cpu", copy=True))


def snapshot(state_dict: Any) -> dict[str, Any]:
    """This rank's copy of a state: a ``Piece`` per tensor, a deep copy of other values."""
    return {
        name: _piece(value) if isinstance(value, torch.Tensor) else copy.deepcopy(value)
        for name, value in flatten(state_dict).items()
    }


def assemble(snapshots: list[dict[str, Any]]) -> dict[str, Any]:
    """One whole state from the snapshots of every rank (rank order).

    A tensor that several ranks hold whole (replicated) must be the same on each; a
    value that is not a tensor, too. Raises ``ValueError`` where the ranks disagree or
    a tensor's shards do not cover it.
    """
    whole: dict[str, Any] = {}
    for name in snapshots[0]:
        parts = [snap[name] for snap in snapshots if name in snap]
        if not isinstance(parts[0], Piece):
            if any(part != parts[0] for part in parts[1:]):
                raise ValueError(f"{name}: the ranks hold different values")
            whole[name] = parts[0]
            continue
        first = parts[0]
        tensor = torch.zeros(first.global_shape, dtype=first.tensor.dtype)
        covered = torch.zeros(first.global_shape, dtype=torch.bool)
        for part in parts:
            where = tuple(
                slice(start, start + size)
                for start, size in zip(part.offset, part.tensor.shape, strict=True)
            )
            if covered[where].any() and not torch.equal(tensor[where], part.tensor):
                raise ValueError(f"{name}: two ranks hold different copies of the same elements")
            tensor[where] = part.tensor
            covered[where] = True
        if not covered.all():
            raise ValueError(f"{name}: the ranks' shards do not cover the tensor")
        whole[name] = tensor
    return whole


def whole_state(state: Any) -> dict[str, Any]:
    """A whole state from what a page has: a watch's records (one snapshot per rank, the
    last call of each), a list of snapshots, one snapshot, or a plain state dict."""
    if isinstance(state, observe.Calls):
        state = state.last()
    if isinstance(state, list):
        return assemble(state)
    if any(isinstance(value, Piece) for value in state.values()):
        return assemble([state])  # one snapshot
    return assemble([snapshot(state)])  # a plain state dict


@dataclasses.dataclass
class Comparison:
    """Two states, name by name."""

    tensors: int  # tensors compared
    values: int  # other values compared
    differ: list[str]  # names whose tensors or values are not equal
    missing: list[str]  # names in the expected state only
    unexpected: list[str]  # names in the actual state only

    @property
    def equal(self) -> bool:
        return not (self.differ or self.missing or self.unexpected)


def compare(expected: dict[str, Any], actual: dict[str, Any]) -> Comparison:
    """Two whole states (``whole_state``): bit for bit for tensors (dtype and shape too)."""
    tensors = values = 0
    differ = []
    for name in expected.keys() & actual.keys():
        left, right = expected[name], actual[name]
        if isinstance(left, torch.Tensor) or isinstance(right, torch.Tensor):
            tensors += 1
            same = isinstance(left, torch.Tensor) and isinstance(right, torch.Tensor)
            same = same and left.dtype == right.dtype and torch.equal(left, right)
        else:
            values += 1
            same = left == right
        if not same:
            differ.append(name)
    return Comparison(
        tensors,
        values,
        sorted(differ),
        sorted(expected.keys() - actual.keys()),
        sorted(actual.keys() - expected.keys()),
    )


def same_state(claim: str, expected: Any, actual: Any, what: str) -> Comparison:
    """Decide that ``actual`` is ``expected``, bit for bit, and say so in one line."""
    comparison = compare(whole_state(expected), whole_state(actual))
    said = (
        f"{what}: {comparison.tensors} tensors and {comparison.values} other values compared, "
        f"{len(comparison.differ)} differ"
    )
    if comparison.missing or comparison.unexpected:
        said += f", {len(comparison.missing)} missing, {len(comparison.unexpected)} unexpected"
    results.claim(
        claim,
        comparison.equal,
        said,
        tensors=comparison.tensors,
        values=comparison.values,
        differ=comparison.differ[:20],
        missing=comparison.missing[:20],
        unexpected=comparison.unexpected[:20],
    )
    return comparison


def differing_state(claim: str, expected: Any, actual: Any, what: str) -> Comparison:
    """Decide that ``actual`` differs from ``expected`` (training went on), and say how."""
    comparison = compare(whole_state(expected), whole_state(actual))
    said = f"{what}: {len(comparison.differ)} of {comparison.tensors} tensors differ"
    results.claim(claim, bool(comparison.differ), said, differ=len(comparison.differ))
    return comparison


def state_given_to(
    owner: Any,
    name: str,
    position: int = 0,
    keyword: str = "state_dict",
    where: Callable[[observe.Call], bool] | None = None,
):
    """Watch ``owner.name``: every rank's snapshot of the state it is given, at the call."""
    return observe.watch(
        owner,
        name,
        lambda call: snapshot(call.argument(position, keyword)),
        before=True,
        where=where,
    )


def state_after(
    owner: Any,
    name: str,
    position: int = 0,
    keyword: str = "state_dict",
    where: Callable[[observe.Call], bool] | None = None,
):
    """Watch ``owner.name``: every rank's snapshot of the state it was given, once it returns
    (what ``dcp.load`` filled in, in place)."""
    return observe.watch(
        owner, name, lambda call: snapshot(call.argument(position, keyword)), where=where
    )


def value_returned_by(owner: Any, name: str, where: Callable[[observe.Call], bool] | None = None):
    """Watch ``owner.name``: every rank's snapshot of what it returned."""
    return observe.watch(owner, name, lambda call: snapshot(call.result), where=where)


def reads_file(suffix: str) -> Callable[[observe.Call], bool]:
    """For ``where=``: a call whose first argument is a path ending in ``suffix`` (``torch.load``
    of a file, not of the bytes DCP reads with it)."""
    return lambda call: str(call.argument(0, "f")).endswith(suffix)


# --------------------------------------------------------------------------
# Fingerprints: checkpoints too large (or too many) to keep a copy of
# --------------------------------------------------------------------------
# A page that saves a gigabyte twenty times cannot keep a copy of each state. It keeps a
# checksum of every tensor instead (a CRC-32 of its bytes on the CPU; on a device, an XOR
# of every element's bits, computed there), and sets the state a load is given to NaN
# first, so that a tensor the load skipped cannot match by accident.

_INTEGER_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def checksum(tensor: torch.Tensor) -> tuple[str, int]:
    """A checksum of this rank's part of ``tensor`` (of a ``DTensor``, its shard), computed
    where the tensor is: no copy on the CPU, no host memory for a device tensor."""
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    flat = local.detach().contiguous().reshape(-1)
    if flat.device.type == "cpu":
        import zlib

        return "crc32", zlib.crc32(memoryview(flat.view(torch.uint8).numpy()))
    try:
        bits = flat.view(_INTEGER_OF_SIZE[flat.element_size()])
        return "xor", int(torch.hash_tensor(bits))
    except (AttributeError, RuntimeError, NotImplementedError):  # no hash_tensor here
        return checksum(flat.cpu())


class TensorSum(NamedTuple):
    """A tensor in a fingerprint: what this rank holds of it, summed up."""

    shape: tuple[int, ...]  # the whole tensor's
    dtype: str
    checksum: tuple[str, int]  # of this rank's part


def fingerprint(state_dict: Any) -> dict[str, Any]:
    """This rank's fingerprint of a state: a ``TensorSum`` per tensor, by dotted name;
    other values as they are."""
    return {
        name: TensorSum(tuple(value.shape), str(value.dtype), checksum(value))
        if isinstance(value, torch.Tensor)
        else copy.deepcopy(value)
        for name, value in flatten(state_dict).items()
    }


def poison(state_dict: Any) -> int:
    """Fill every tensor of a state (this rank's shards) with NaN (integers with -1), in
    place; returns how many tensors. A load that skips one leaves it so."""
    tensors = 0
    with torch.no_grad():
        for value in flatten(state_dict).values():
            if isinstance(value, torch.Tensor):
                local = value.to_local() if isinstance(value, DTensor) else value
                floating = local.is_floating_point() or local.is_complex()
                local.fill_(float("nan") if floating else -1)
                tensors += 1
    return tensors


@contextlib.contextmanager
def poisoned(
    owner: Any,
    name: str,
    position: int = 0,
    keyword: str = "state_dict",
    where: Callable[[observe.Call], bool] | None = None,
) -> Iterator[None]:
    """Inside the block, every call of ``owner.name`` (``dcp.load``) that ``where`` accepts
    is given its state filled with NaN first (``poison``); on exit it is what it was."""
    original = getattr(owner, name)

    def poisoning(*args: Any, **kwargs: Any) -> Any:
        call = observe.Call(args, kwargs)
        if where is None or where(call):
            poison(call.argument(position, keyword))
        return original(*args, **kwargs)

    with observe.replaced(owner, name, poisoning):
        yield


def checkpoint_matches(pattern: str) -> Callable[[observe.Call], bool]:
    """For ``where=``: a DCP call whose checkpoint path matches the regular expression."""
    import re

    compiled = re.compile(pattern)
    return lambda call: bool(compiled.search(observe.checkpoint_id(call) or ""))


@dataclasses.dataclass
class CheckedCheckpoints:
    """What ``checkpoints_checked`` saw: (checkpoint, fingerprint) records, by rank."""

    saved: list[observe.Calls]  # dcp.save's and dcp.async_save's, at the call
    loaded: observe.Calls  # dcp.load's, once it returned


@contextlib.contextmanager
def checkpoints_checked(
    dcp_module: Any, where: Callable[[observe.Call], bool] | None = None
) -> Iterator[CheckedCheckpoints]:
    """Fingerprint the state given to every ``save`` and ``async_save`` of ``dcp_module``,
    poison the state given to every ``load``, and fingerprint what the load filled in.

    ``where`` picks the calls (``checkpoint_matches``): the others run untouched, so a
    page keeps this work out of the saves and loads it times. ``loads_match_saves``
    decides the claim. Nothing of DCP stays changed after the block.
    """

    def record(call: observe.Call) -> tuple[str | None, dict[str, Any]]:
        return observe.checkpoint_id(call), fingerprint(call.argument(0, "state_dict"))

    with contextlib.ExitStack() as stack:
        saved = [
            stack.enter_context(observe.watch(dcp_module, name, record, before=True, where=where))
            for name in ("save", "async_save")
        ]
        stack.enter_context(poisoned(dcp_module, "load", where=where))
        loaded = stack.enter_context(observe.watch(dcp_module, "load", record, where=where))
        yield CheckedCheckpoints(saved, loaded)


def loads_match_saves(claim: str, checked: CheckedCheckpoints, what: str) -> dict[str, Any]:
    """Decide that every load filled in, on every rank, the fingerprint that rank's save of
    the same checkpoint was given (and that there were loads to check)."""
    saves: dict[tuple[int, str | None], dict[str, Any]] = {}
    for calls in checked.saved:
        for rank, records in calls.by_rank.items():
            for path, fingerprints in records:
                saves[(rank, path)] = fingerprints
    loads = [
        (rank, path, fingerprints)
        for rank, records in sorted(checked.loaded.by_rank.items())
        for path, fingerprints in records
    ]
    unpaired, differ, tensors = [], [], 0
    for rank, path, fingerprints in loads:
        expected = saves.get((rank, path))
        if expected is None:
            unpaired.append(f"rank {rank}: {path}")
            continue
        tensors += sum(isinstance(v, TensorSum) for v in expected.values())
        names = sorted(expected.keys() | fingerprints.keys())
        differ += [
            f"rank {rank}: {path}: {n}" for n in names if expected.get(n) != fingerprints.get(n)
        ]
    checkpoints = len({path for _, path, _ in loads})
    ranks = len({rank for rank, _, _ in loads})
    said = (
        f"{what}: {checkpoints} checkpoints, {len(loads)} loads on {ranks} rank(s), "
        f"{tensors} shards: {len(differ)} differ"
    )
    evidence = {
        "checkpoints": checkpoints,
        "loads": len(loads),
        "ranks": ranks,
        "tensors": tensors,
        "differ": differ[:20],
        "unpaired": unpaired[:20],
    }
    results.claim(claim, bool(loads) and not unpaired and not differ, said, **evidence)
    return evidence
