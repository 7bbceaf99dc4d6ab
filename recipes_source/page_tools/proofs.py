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

A page about async saves checks every checkpoint a loop wrote against the state at its
save call: ``saves_given_to(dcp, "async_save")`` records, per call, the checkpoint and the
state (without waiting for a device), ``read_checkpoint`` reads a checkpoint back in one
process, and ``every_checkpoint_as_saved`` / ``every_checkpoint_torn`` decide the claims.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import os
import textwrap
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.tensor import DTensor

from page_tools import figures, observe, results


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


def compare(expected: dict[str, Any], actual: dict[str, Any], tolerance: float = 0.0) -> Comparison:
    """Two whole states (``whole_state``): bit for bit for tensors (dtype and shape too), or
    floating-point tensors within ``tolerance``, element by element."""
    tensors = values = 0
    differ = []
    for name in expected.keys() & actual.keys():
        left, right = expected[name], actual[name]
        if isinstance(left, torch.Tensor) or isinstance(right, torch.Tensor):
            tensors += 1
            same = isinstance(left, torch.Tensor) and isinstance(right, torch.Tensor)
            same = same and left.dtype == right.dtype and left.shape == right.shape
            if same and tolerance and left.is_floating_point():
                same = bool(((left.double() - right.double()).abs() <= tolerance).all())
            else:
                same = same and torch.equal(left, right)
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


def same_state(
    claim: str, expected: Any, actual: Any, what: str, tolerance: float = 0.0
) -> Comparison:
    """Decide that ``actual`` is ``expected``, bit for bit (or its floating-point tensors
    within ``tolerance``: a state recomputed on another machine), and say so in one line."""
    comparison = compare(whole_state(expected), whole_state(actual), tolerance)
    said = (
        f"{what}: {comparison.tensors} tensors and {comparison.values} other values compared, "
        f"{len(comparison.differ)} differ" + (f" by more than {tolerance:g}" if tolerance else "")
    )
    if comparison.missing or comparison.unexpected:
        said += f", {len(comparison.missing)} missing, {len(comparison.unexpected)} unexpected"
    results.claim(
        claim,
        comparison.equal,
        figures.wrap(said),
        tensors=comparison.tensors,
        values=comparison.values,
        differ=comparison.differ[:20],
        missing=comparison.missing[:20],
        unexpected=comparison.unexpected[:20],
        tolerance=tolerance,
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


def value_is(claim: str, state: Any, name: str, expected: Any, what: str, **evidence: Any) -> Any:
    """Decide that the value ``name`` (a dotted name, ``progress.samples_seen``) of a state
    (as ``same_state`` takes it: a watch's records, snapshots, a state dict) is ``expected``,
    and say what it is."""
    value = whole_state(state).get(name)
    results.claim(claim, value == expected, f"{what}: {name}={value}", value=value, **evidence)
    return value


def safetensors_state(folder: str) -> dict[str, torch.Tensor]:
    """Every tensor in the ``*.safetensors`` files at the top of ``folder`` (not in its
    subfolders), by name: what a reader of the files finds there."""
    import os

    from safetensors.torch import load_file

    state: dict[str, torch.Tensor] = {}
    for name in sorted(os.listdir(folder)):
        if name.endswith(".safetensors"):
            state.update(load_file(os.path.join(folder, name)))
    return state


def cast(state: Any, dtype: torch.dtype) -> dict[str, Any]:
    """A whole state (``whole_state``) with every floating-point tensor cast to ``dtype``."""
    return {
        name: value.to(dtype)
        if isinstance(value, torch.Tensor) and value.is_floating_point()
        else value
        for name, value in whole_state(state).items()
    }


def tensor_bytes(state: Any) -> int:
    """The bytes of all tensors of a whole state (``whole_state``)."""
    return sum(
        value.numel() * value.element_size()
        for value in whole_state(state).values()
        if isinstance(value, torch.Tensor)
    )


def same_values(
    claim: str, expected: torch.Tensor, actual: torch.Tensor, what: str, tolerance: float = 0.0
) -> float:
    """Decide that ``actual`` equals ``expected`` within ``tolerance`` (0: bit for bit), element
    by element, and say the largest difference; returns it. Shapes must match; dtypes may
    differ (a bfloat16 model against a float32 one)."""
    same_shape = tuple(expected.shape) == tuple(actual.shape)
    difference = (actual.double() - expected.double()).abs() if same_shape else None
    worst = float(difference.max()) if difference is not None else float("inf")
    differ = int((difference > 0).sum()) if difference is not None else expected.numel()
    largest = float(expected.double().abs().max())
    results.claim(
        claim,
        same_shape and worst <= tolerance,
        f"{what}: {differ:,} of {expected.numel():,} differ, by at most {worst:.3g} "
        f"(allowed: {tolerance:.3g})",
        shape=list(actual.shape),
        expected_dtype=str(expected.dtype),
        dtype=str(actual.dtype),
        differ=differ,
        largest_difference=worst,
        largest_value=largest,
        tolerance=tolerance,
    )
    return worst


def tensor_bytes_read(reader_class: type):
    """Watch a DCP storage reader (``FileSystemReader``, ``HuggingFaceStorageReader``): the
    bytes of tensor data each of its read requests fills in, one record per request."""

    def requested(call: observe.Call) -> int:
        _, _, request, planner = call.args[:4]
        target = planner.resolve_tensor(request)
        return target.numel() * target.element_size()

    return observe.watch(reader_class, "_process_read_request", requested, before=True)


def raised_on_every_rank(
    claim: str, failed: observe.Calls, expected: list[str], ranks: int, what: str
) -> None:
    """Decide that on each of ``ranks`` ranks the watched calls raised (``observe.raised_by``)
    once per text in ``expected``, in that order, each error's last line containing its text
    (the key a load missed, say)."""
    seen = {
        rank: [record["last_line"] for record in records]
        for rank, records in failed.by_rank.items()
    }
    held = sorted(seen) == list(range(ranks)) and all(
        len(lines) == len(expected)
        and all(e in line for e, line in zip(expected, lines, strict=True))
        for lines in seen.values()
    )
    errors = sorted({record["error"] for records in failed.by_rank.values() for record in records})
    results.claim(
        claim,
        held,
        f"{what}: {', '.join(errors) or 'nothing raised'} on all {ranks} rank(s), "
        f"{len(expected)} time(s), each at its key",
        errors=errors,
        expected=expected,
        by_rank=seen,
    )


# --------------------------------------------------------------------------
# Checkpoints against the save calls that wrote them
# --------------------------------------------------------------------------


@dataclasses.dataclass
class Saved:
    """One save call on one rank: the checkpoint it writes, and this rank's snapshot of the
    state it was given, as it was at the call."""

    checkpoint: str
    state: dict[str, Any]
    device: str  # where the state's tensors live: "cpu", "cuda"


def _taken_at_call(state_dict: Any) -> tuple[dict[str, Any], str]:
    """The state as it is at the call, without waiting for a device: a tensor on a device is
    cloned there (queued behind the work that computes it), anything else is copied now."""
    taken, device = {}, "cpu"
    for name, value in flatten(state_dict).items():
        if isinstance(value, torch.Tensor):
            if value.device.type != "cpu":
                device = value.device.type
            taken[name] = _piece(value) if value.device.type == "cpu" else value.detach().clone()
        else:
            taken[name] = copy.deepcopy(value)
    return taken, device


def _on_cpu(taken: dict[str, Any]) -> dict[str, Any]:
    return {
        name: _piece(value) if isinstance(value, torch.Tensor) else value
        for name, value in taken.items()
    }


@contextlib.contextmanager
def saves_given_to(
    owner: Any, name: str = "async_save", where: Callable[[observe.Call], bool] | None = None
) -> Iterator[observe.Calls]:
    """Watch a save function (``dcp.async_save``): every rank's ``Saved`` for each call, by
    the checkpoint it names (``checkpoint_id``, or its ``storage_writer``'s path); ``where``
    keeps only the calls it accepts (the others run untouched, without a snapshot).

    The snapshot waits for no device, so that the save runs as it would unwatched: tensors
    on a device are cloned there at the call and brought to the CPU once the call has
    returned (a copy to the CPU at the call would wait for the device, and a stager's
    stream would then have nothing left to race with).
    """
    with observe.records() as (calls, put):

        def watched(*args: Any, **kwargs: Any) -> Any:
            call = observe.Call(args, kwargs)
            if where is not None and not where(call):
                return original(*args, **kwargs)
            taken, device = _taken_at_call(call.argument(0, "state_dict"))
            result = original(*args, **kwargs)
            put(Saved(str(observe.checkpoint_id(call)), _on_cpu(taken), device))
            return result

        with observe.replaced(owner, name, watched) as original:
            yield calls


@contextlib.contextmanager
def writers_given_to(owner: Any, name: str = "async_save") -> Iterator[observe.Calls]:
    """Watch a save function: for every call, by rank, ``{"stager": given an async_stager,
    "copy_ahead": its storage_writer's per_thread_copy_ahead}`` (``None``: no writer given;
    ``checkpoint_id`` alone builds one that copies 10 MB ahead from a GPU, on a stream of the
    current device: GPU 0 in an upload thread or a checkpoint process)."""

    def given(call: observe.Call) -> dict[str, Any]:
        writer = call.kwargs.get("storage_writer")
        copy_ahead = getattr(writer, "per_thread_copy_ahead", None)
        return {"stager": call.kwargs.get("async_stager") is not None, "copy_ahead": copy_ahead}

    with observe.watch(owner, name, given, before=True) as calls:
        yield calls


def no_copy_ahead(claim: str, writers: observe.Calls) -> None:
    """Decide that every save ``writers_given_to`` watched that was given a stager was also
    given a writer with ``per_thread_copy_ahead=0``: the stager's copy is on the host, the
    upload copies nothing ahead from a GPU and builds no stream (no CUDA context) on GPU 0."""
    seen = [r["copy_ahead"] for records in writers.by_rank.values() for r in records if r["stager"]]
    said = (
        f"all {len(seen)} saves given a stager ({len(writers.by_rank)} ranks): a writer with "
        "per_thread_copy_ahead=0"
    )
    held = bool(seen) and all(value == 0 for value in seen)
    results.claim(claim, held, said, saves=len(seen), copy_ahead=sorted(set(map(str, seen))))


def saves_into(saves: observe.Calls, directory: str | os.PathLike) -> observe.Calls:
    """The watched saves whose checkpoint lies under ``directory``."""
    prefix = os.path.join(os.path.abspath(directory), "")
    return observe.Calls(
        {
            rank: [s for s in records if os.path.abspath(s.checkpoint).startswith(prefix)]
            for rank, records in saves.by_rank.items()
        }
    )


def is_url(path: str | os.PathLike) -> bool:
    """A checkpoint that fsspec reaches (``s3://bucket/...``), not a local path."""
    return "://" in os.fspath(path)


def read_checkpoint(path: str | os.PathLike) -> dict[str, Any]:
    """The whole state a DCP checkpoint holds, by dotted name, read in this process as
    ``dcp_to_torch_save`` reads it (no process group, no template, onto the CPU), without
    its detour through a ``torch.save`` file. A URL (``s3://...``) is read with
    ``FsspecReader``, which finds its endpoint and credentials in the ``AWS_*`` environment."""
    if is_url(path):
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

        reader: Any = FsspecReader(os.fspath(path))
    else:
        reader = FileSystemReader(path)
    state: dict[str, Any] = {}
    with warnings.catch_warnings():
        # DCP warns that it assumes one process, which is what this read is.
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        _load_state_dict(
            state,
            storage_reader=reader,
            planner=_EmptyStateDictLoadPlanner(),
            no_dist=True,
        )
    return whole_state(state)


def _reading(paths: Sequence[str], fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)``, which reads the checkpoints ``paths``: here, or where one is a URL in
    one forked process (``run_on_one_process``): fsspec's event-loop thread, which s3fs
    starts, must not outlive the read in the page's process, which forks the ranks."""
    if not any(is_url(path) for path in paths):
        return fn(*args)
    from rank_launcher import run_on_one_process

    return run_on_one_process(fn, *args)


def read_checkpoints(paths: Sequence[str]) -> list[dict[str, Any]]:
    """``read_checkpoint`` of each path, in order (in one forked process where one is a URL)."""
    return _reading(paths, _read_each, list(map(os.fspath, paths)))


def _read_each(paths: list[str]) -> list[dict[str, Any]]:
    return [read_checkpoint(path) for path in paths]


@dataclasses.dataclass
class Checked:
    """A checkpoint read back, against the state at its save call."""

    checkpoint: str
    comparison: Comparison
    tensors: list[str]  # the names of the saved state's tensors

    @property
    def torn(self) -> bool:
        """The checkpoint is not the state at its save call."""
        return not self.comparison.equal


def torn(checked: list[Checked]) -> int:
    """How many of the checkpoints are not the state at their save call."""
    return sum(c.torn for c in checked)


def checkpoints_against_saves(
    saves: observe.Calls, but_first: bool = False, but_last: bool = False
) -> list[Checked]:
    """Every checkpoint the watched saves wrote (in call order; ``but_first``, ``but_last``
    leave those out), read back and compared with the state at its call, which is put
    together from every rank's snapshot of that call."""
    ranks = [records for _, records in sorted(saves.by_rank.items())]
    if not ranks or not ranks[0]:
        raise ValueError("no save was watched")
    if any(len(records) != len(ranks[0]) for records in ranks):
        raise ValueError("the ranks made different numbers of saves")
    count = len(ranks[0])
    indices = range(1 if but_first else 0, count - 1 if but_last else count)
    for index in indices:
        if any(records[index].checkpoint != ranks[0][index].checkpoint for records in ranks):
            raise ValueError(f"the ranks' save {index} went to different checkpoints")
    found = read_checkpoints([ranks[0][index].checkpoint for index in indices])
    checked = []
    for index, on_storage in zip(indices, found, strict=True):
        calls = [records[index] for records in ranks]
        expected = assemble([call.state for call in calls])
        comparison = compare(expected, on_storage)
        names = sorted(name for name, value in expected.items() if isinstance(value, torch.Tensor))
        checked.append(Checked(calls[0].checkpoint, comparison, names))
    if not checked:
        raise ValueError(f"of {count} saves, none is left to check")
    return checked


def devices(saves: observe.Calls) -> list[str]:
    """Where the watched saves' tensors lived: ``["cpu"]``, ``["cuda"]``."""
    return sorted({s.device for records in saves.by_rank.values() for s in records})


def _not_here(claim: str, what: str, devices: list[str], only_on: str | None) -> bool:
    """A claim about saves from ``only_on`` ranks (``"cuda"``) where they ran elsewhere: said
    to be not measured here (``results.not_measured_here``)."""
    if only_on is None or devices == [only_on]:
        return False
    ranks = " and ".join(devices) or "no"
    results.not_measured_here(
        claim, f"{what}: not measured here (a claim about {only_on} ranks; these are {ranks})"
    )
    return True


def _folder(checked: list[Checked]) -> str:
    """What a page calls the checkpoints by default: the folder they are in (a loop's name)."""
    folders = {os.path.basename(os.path.dirname(os.path.abspath(c.checkpoint))) for c in checked}
    return ", ".join(sorted(folders))


def _counts(checked: list[Checked]) -> list[int]:
    return [
        len(c.comparison.differ) + len(c.comparison.missing) + len(c.comparison.unexpected)
        for c in checked
    ]


def every_checkpoint_as_saved(
    claim: str,
    saves: observe.Calls,
    what: str | None = None,
    *,
    but_first: bool = False,
    but_last: bool = False,
    only_on: str | None = None,
) -> list[Checked]:
    """Decide that every checkpoint holds the state at its save call, bit for bit.

    ``only_on="cuda"``: a claim about GPU ranks, not measured where the saves ran elsewhere
    (the checkpoints are still compared, and returned, for a page to show).
    """
    checked = checkpoints_against_saves(saves, but_first, but_last)
    what = what or _folder(checked)
    if _not_here(claim, what, devices(saves), only_on):
        return checked
    first = checked[0].comparison
    said = (
        f"{what}: all {len(checked)} checkpoints the saved state, bit for bit\n"
        f"  differing, by checkpoint: {_counts(checked)} "
        f"of {first.tensors} tensors and {first.values} values"
    )
    results.claim(
        claim,
        all(c.comparison.equal for c in checked),
        figures.wrap(said),
        checkpoints=len(checked),
        counts=_counts(checked),
        tensors=first.tensors,
        values=first.values,
        differ=[c.comparison.differ[:20] for c in checked],
        devices=devices(saves),
    )
    return checked


def states_by_checkpoint(saves: observe.Calls) -> dict[str, dict[str, Any]]:
    """The whole state each watched save (``saves_given_to``) was given, by checkpoint: put
    together from every rank's snapshot of that call."""
    by_checkpoint: dict[str, list[dict[str, Any]]] = {}
    for _, records in sorted(saves.by_rank.items()):
        for saved in records:
            by_checkpoint.setdefault(saved.checkpoint, []).append(saved.state)
    return {path: assemble(snapshots) for path, snapshots in by_checkpoint.items()}


def _compare_each(pairs: list[tuple[str, dict[str, Any]]]) -> list[Comparison]:
    return [compare(expected, read_checkpoint(path)) for path, expected in pairs]


def every_checkpoint_as_its_twin(
    claim: str,
    saves: observe.Calls,
    checkpoints: Sequence[str],
    twin: Callable[[str], str],
    what: str,
) -> list[Comparison]:
    """Decide that each of ``checkpoints`` holds, bit for bit, the state that its twin's save
    was given: ``twin(path)`` names a checkpoint the watch ``saves`` saw (the same step of a
    deterministic run that was watched), so that saves timed unwatched are proven too. Read
    and compared in one forked process where a checkpoint is a URL (as ``read_checkpoints``)."""
    given = states_by_checkpoint(saves)
    missing = sorted({twin(path) for path in checkpoints} - set(given))
    if missing or not checkpoints:
        raise ValueError(f"no watched save for the twins {missing[:3]} ({len(checkpoints)} given)")
    pairs = [(os.fspath(path), given[twin(path)]) for path in checkpoints]
    found = _reading(checkpoints, _compare_each, pairs)  # compared where read: no state returns
    counts = [len(c.differ) + len(c.missing) + len(c.unexpected) for c in found]
    said = (
        f"{what}: {counts.count(0)} of {len(found)} checkpoints hold their twin's saved state,"
        f" bit for bit ({found[0].tensors} tensors and {found[0].values} values each)"
    )
    results.claim(
        claim,
        all(count == 0 for count in counts),
        figures.wrap(said),
        checkpoints=len(found),
        differing=[path for (path, _), count in zip(pairs, counts, strict=True) if count][:20],
        tensors=found[0].tensors,
        values=found[0].values,
    )
    return found


def every_tensor(name: str) -> bool:
    """For ``every_checkpoint_torn(differ=...)``: every tensor of the state."""
    return True


def named(*endings: str) -> Callable[[str], bool]:
    """For ``every_checkpoint_torn(differ=...)``: the tensors whose last name is one of these
    (``named("weight", "bias")``)."""
    return lambda name: name.rsplit(".", 1)[-1] in endings


def every_checkpoint_torn(
    claim: str,
    saves: observe.Calls,
    what: str | None = None,
    *,
    differ: Sequence[str] | Callable[[str], bool] = every_tensor,
    but_first: bool = False,
    but_last: bool = False,
    only_on: str | None = None,
    raced: bool = False,
) -> list[Checked]:
    """Decide that no checkpoint holds the state at its save call, and exactly how each
    differs: in exactly the names ``differ`` lists, or, if it is a function, in exactly the
    tensors it accepts (and in no other value). ``only_on`` as for ``every_checkpoint_as_saved``.
    ``raced``: a race decides which of them each checkpoint caught before they changed (on
    an H200, in four runs of 5 checkpoints: all 12 names, 6 of them, or none): at least one
    checkpoint differs, each only in some of them, and none in any other value.
    """
    checked = checkpoints_against_saves(saves, but_first, but_last)
    what = what or _folder(checked)
    if _not_here(claim, what, devices(saves), only_on):
        return checked

    def expected(c: Checked) -> list[str]:
        return sorted(filter(differ, c.tensors) if callable(differ) else differ)

    def differs_as_expected(c: Checked) -> bool:
        if raced:
            return set(c.comparison.differ) <= set(expected(c))
        return c.comparison.differ == expected(c)

    held = all(
        differs_as_expected(c) and not (c.comparison.missing or c.comparison.unexpected)
        for c in checked
    ) and (not raced or torn(checked) > 0)
    first = checked[0].comparison
    example = ", ".join(first.differ[:3]) + (", ..." if len(first.differ) > 3 else "")
    said = (
        f"{what}: {torn(checked)} of {len(checked)} checkpoints are not the saved state\n"
        f"  differing, by checkpoint: {_counts(checked)} "
        f"of {first.tensors} tensors and {first.values} values\n"
        + textwrap.fill(f"e.g. {example}", 88, initial_indent="  ", subsequent_indent="    ")
    )
    results.claim(
        claim,
        bool(checked) and held,
        figures.wrap(said),
        checkpoints=len(checked),
        counts=_counts(checked),
        tensors=first.tensors,
        values=first.values,
        differ=[c.comparison.differ[:40] for c in checked],
        expected=expected(checked[0])[:40],
        devices=devices(saves),
    )
    return checked


# The tensors of a model trained with Adam, by kind: the last names they end in.
ADAM_STATE = {
    "weights and biases": ("weight", "bias"),
    "Adam's moments": ("exp_avg", "exp_avg_sq"),
    "Adam's step counters": ("step",),
}


def by_kind(
    checked: list[Checked], kinds: Mapping[str, Sequence[str]]
) -> dict[str, tuple[int, int]]:
    """For each kind of tensor (``{"Adam's moments": ("exp_avg", "exp_avg_sq")}``: the last
    names it ends in), how many differed in any of the checkpoints, and how many there are."""
    if not checked:
        return {}
    differed = {name for c in checked for name in c.comparison.differ}
    counted = {}
    for kind, endings in kinds.items():
        names = [name for name in checked[0].tensors if named(*endings)(name)]
        counted[kind] = (sum(name in differed for name in names), len(names))
    return counted


def by_kind_table(
    rows: Mapping[str, list[Checked]], kinds: Mapping[str, Sequence[str]], caption: str = ""
) -> figures.Table:
    """A row per list of checkpoints: how many are torn, and ``by_kind`` of each kind."""
    return figures.Table(
        ["checkpoints", "torn", *kinds],
        [
            [row, f"{torn(checked)} of {len(checked)}"]
            + [f"{differed} of {of}" for differed, of in by_kind(checked, kinds).values()]
            for row, checked in rows.items()
        ],
        caption,
    )


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


# async_save and torn checkpoints: the state at a given save, and the state at the end.


def saving_into(suffix: str, anywhere: bool = False) -> Callable[[observe.Call], bool]:
    """For ``where=``: a save whose ``checkpoint_id`` ends in ``suffix`` (``"step-9"``), or
    contains it (``anywhere=True``)."""

    def wanted(call: observe.Call) -> bool:
        checkpoint_id = observe.checkpoint_id(call) or ""
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
