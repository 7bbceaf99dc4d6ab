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

import copy
import dataclasses
from collections.abc import Callable, Mapping
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
    names = dict.fromkeys(name for snap in snapshots for name in snap)  # a rank's own keys too
    for name in names:
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


def same_numbers(
    claim: str, expected: Mapping, actual: Mapping, what: str, keys: Any = None
) -> list:
    """Decide that every number of ``actual`` (step -> loss, say) is the one ``expected`` has
    under the same key, the same float, and that ``actual`` has exactly ``keys`` (if given)."""
    keys = list(actual) if keys is None else list(keys)
    differ = [key for key in keys if key not in actual or actual[key] != expected.get(key)]
    has_keys = sorted(actual) == sorted(keys) and bool(keys)
    span = f"{keys[0]}-{keys[-1]}" if keys else "none"
    results.claim(
        claim,
        has_keys and not differ,
        f"{what} at steps {span}: {len(differ)} of {len(keys)} differ",
        keys=[keys[0], keys[-1]] if keys else [],
        compared=len(keys),
        differ=differ[:20],
        actual_keys=[min(actual), max(actual)] if actual else [],
    )
    return differ


def keeps_newest(claim: str, at_saves: list, left: dict, every: int, keep: int) -> None:
    """Decide that a keep-the-newest-``keep`` clean-up did its job in a run that saves every
    ``every`` steps from step ``every`` on. ``at_saves``: the step directories before each
    save, ``{step: complete?}``; ``left``: the same at the end. Before each save, the complete
    ones must be the save before it (awaited) and at most ``keep`` older ones; at the end,
    the newest ``keep``, all complete."""
    complete = [sorted(step for step, done in steps.items() if done) for steps in at_saves]
    saves = [every * (i + 1) for i in range(len(at_saves))]
    expected = [list(range(max(s - (keep + 1) * every, every), s, every)) for s in saves]
    held = bool(saves) and complete == expected and left == dict.fromkeys(saves[-keep:], True)
    said = f"complete at the saves: {' '.join(map(str, complete))}\nleft at the end: {list(left)}"
    results.claim(claim, held, said, complete_at_each_save=complete, left=list(left))


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


def checkpoint_state(path: str) -> dict[str, Any]:
    """A whole DCP checkpoint as it is on disk: one snapshot of every value in it, by dotted
    name, read in a process of its own (the page's process starts no reader threads), for
    ``same_state`` with another checkpoint or with a watch's records."""
    from rank_launcher import run_on_one_process

    return run_on_one_process(_read_checkpoint, str(path))


def _read_checkpoint(path: str) -> dict[str, Any]:
    import os
    import tempfile

    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory() as directory:
        target = os.path.join(directory, "checkpoint.pt")
        dcp_to_torch_save(path, target)
        return snapshot(torch.load(target, weights_only=False))


def reads_file(suffix: str) -> Callable[[observe.Call], bool]:
    """For ``where=``: a call whose first argument is a path ending in ``suffix`` (``torch.load``
    of a file, not of the bytes DCP reads with it)."""
    return lambda call: str(call.argument(0, "f")).endswith(suffix)
