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
from typing import Any

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


# async_save and torn checkpoints: the state at a given save, and the state at the end.


def saves_into(suffix: str, anywhere: bool = False) -> Callable[[observe.Call], bool]:
    """For ``where=``: a save whose ``checkpoint_id`` ends in ``suffix`` (``"step-9"``), or
    contains it (``anywhere=True``)."""

    def wanted(call: observe.Call) -> bool:
        checkpoint_id = str(call.kwargs.get("checkpoint_id", ""))
        return suffix in checkpoint_id if anywhere else checkpoint_id.endswith(suffix)

    return wanted


def nth_call(calls: observe.Calls, index: int) -> list[Any]:
    """Every rank's record of its ``index``-th watched call, in rank order: the snapshots of
    one of several loads a rank function made, for ``same_state``."""
    return [records[index] for _, records in sorted(calls.by_rank.items())]


@contextlib.contextmanager
def state_again_at(
    owner: Any,
    name: str,
    given_to: tuple[Any, str],
    where: Callable[[observe.Call], bool] | None = None,
    position: int = 0,
    keyword: str = "state_dict",
) -> Iterator[observe.Calls]:
    """Watch ``owner.name`` (``dist.destroy_process_group``): at each call, every rank's
    snapshot of the state it last gave ``given_to`` (``(dcp, "async_save")``), as that state
    is *then*: the live model and optimizer after the training that followed the save."""
    last: dict[str, Any] = {}  # this rank's, in this process

    def keep(*args: Any, **kwargs: Any) -> Any:
        last["state"] = observe.Call(args, kwargs).argument(position, keyword)
        return original(*args, **kwargs)

    def wanted(call: observe.Call) -> bool:
        return "state" in last and (where is None or where(call))

    with (
        observe.replaced(*given_to, keep) as original,
        observe.watch(
            owner, name, lambda call: snapshot(last["state"]), before=True, where=wanted
        ) as calls,
    ):
        yield calls


@dataclasses.dataclass
class SaveAndAfter:
    """What ``state_at_save_and_end`` watched: the state at the save, and after it."""

    at_save: observe.Calls
    after: observe.Calls


@contextlib.contextmanager
def state_at_save_and_end(
    where: Callable[[observe.Call], bool],
    save: tuple[Any, str] | None = None,
    end: tuple[Any, str] | None = None,
) -> Iterator[SaveAndAfter]:
    """Every rank's snapshot of the state given to ``save`` (default ``dcp.async_save``) at
    the calls ``where`` accepts, and of the same live state again at each call of ``end``
    that names what it ends (default ``dist.destroy_process_group(group)``, the checkpoint
    group's, not the launcher's: training is over)."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    save = save or (dcp, "async_save")
    with (
        state_given_to(*save, where=where) as at_save,
        state_again_at(
            *(end or (dist, "destroy_process_group")),
            given_to=save,
            where=lambda call: bool(call.args or call.kwargs),
        ) as later,
    ):
        yield SaveAndAfter(at_save, later)


def state_at_the_save(prefix: str, watched: SaveAndAfter, loaded: Any, what: str) -> None:
    """Decide two claims about a checkpoint loaded back: it is the state at the save call,
    bit for bit (``<prefix>-is-the-state-at-the-save``), and not the state that training
    reached after it (``<prefix>-is-not-the-state-after``)."""
    same_state(f"{prefix}-is-the-state-at-the-save", watched.at_save, loaded, f"{what} vs the save")
    differing_state(f"{prefix}-is-not-the-state-after", watched.after, loaded, f"{what} vs the end")
