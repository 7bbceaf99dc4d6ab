"""Checkpoints written with direct I/O, straight from the training tensors.

Five pieces, for ``dcp.async_save`` with a thread upload and for ``dcp.load``:

* ``async_save_in_place`` saves with no copy: DCP's upload thread writes the training
  tensors themselves while the next forward and backward pass run (they change none of
  them). Its ``staging_completion`` is done once the writes no longer read them: the loop
  waits for it before ``optimizer.step()``, as for a staged copy. On a GPU, pass a stager.
* ``DirectIOWriter`` writes each rank's items into one file opened with ``O_DIRECT``:
  nothing is copied into the page cache. Direct I/O reads page-aligned memory only: with
  ``THP_MEM_ALLOC_ENABLE=1``, PyTorch puts every tensor of 2 MB or more on a 2 MB
  boundary, and the writer writes it from where it lies; the rest (small items, tails,
  tensors elsewhere or on a GPU) goes through a small aligned buffer. It is a
  ``FileSystemWriter``: ``.metadata`` is written last, and renamed into place.
* ``DirectIOPlanner`` plans each save as ``DefaultSavePlanner`` does, and keeps the plan:
  a save of a state shaped as the last one's reuses it, so the upload thread holds the GIL
  for less of the time training runs.
* ``AlignedStager`` copies the state into page-aligned host memory it keeps between saves
  (a GPU's state must come to the host first), with ``Tensor.copy_``, which lets the
  training thread run Python meanwhile. (``DefaultStager`` copies into a kept buffer with
  ``UntypedStorage.copy_``, which holds the GIL for each whole storage.)
* ``DirectIOReader`` reads such a checkpoint: its files hold raw bytes, not ``torch.save``.

One save in flight at a time: the next one must not start before the last is on disk.
"""

import contextlib
import copy
import dataclasses
import io
import os
import warnings
from concurrent.futures import Future, InvalidStateError, ThreadPoolExecutor

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.planner import LoadItemType
from torch.distributed.checkpoint.staging import AsyncStager, DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType, AsyncSaveResponse
from torch.distributed.checkpoint.storage import WriteResult
from torch.distributed.tensor import DTensor
from torch.futures import Future as TorchFuture

ALIGN = 4096  # the address, file offset and length of every direct write: a page
BOUNCE_BYTES = 8 << 20  # an aligned buffer for what is not aligned (small items, tails)
IO_PIECE = 1 << 30  # the most one read or write call moves (Linux: at most about 2 GB)


class _Changed(Exception):
    """The state no longer has the structure, shapes or dtypes of the kept copy."""


def _local(tensor):
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _copied_into(staged, live):
    """``live``'s values in ``staged``'s structure: tensors copied into ``staged``'s, the
    rest (numbers, strings: a learning rate changes) as ``live`` holds them now."""
    if isinstance(live, torch.Tensor):
        target, source = _local(staged), _local(live)
        if target.shape != source.shape or target.dtype != source.dtype:
            raise _Changed
        target.copy_(source)  # unlike UntypedStorage.copy_, it lets other threads run
        return staged
    if isinstance(live, dict):
        if not isinstance(staged, dict) or staged.keys() != live.keys():
            raise _Changed
        return {key: _copied_into(staged[key], value) for key, value in live.items()}
    if isinstance(live, (list, tuple)):
        if type(staged) is not type(live) or len(staged) != len(live):
            raise _Changed
        return type(live)(_copied_into(s, value) for s, value in zip(staged, live, strict=True))
    return copy.deepcopy(live)


class AlignedStager(AsyncStager):
    """Stages in a thread of its own into page-aligned host memory it keeps: the first save
    with ``DefaultStager`` (shared memory), later ones with ``Tensor.copy_``."""

    _synchronize_after_execute = False  # the caller waits for the future ``stage`` returns

    def __init__(self):
        on_gpu = torch.cuda.is_available()  # page-locked memory needs CUDA
        options = StagingOptions(
            use_pinned_memory=on_gpu,
            use_shared_memory=True,  # page-aligned: each storage is a mapping of its own
            use_async_staging=False,  # this stager's own thread runs it
            use_non_blocking_copy=False,
        )
        self._first = DefaultStager(options)
        self._staged = None
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="aligned-stager")

    def stage(self, state_dict) -> Future:
        return self._executor.submit(self._stage, state_dict)

    def _stage(self, state_dict):
        if self._staged is not None:
            try:
                return _copied_into(self._staged, state_dict)
            except _Changed:  # a new structure: build the copy again
                pass
        self._staged = self._first.stage(state_dict)
        if torch.cuda.is_available():
            torch.cuda.current_stream().synchronize()  # its copies from the GPU are done
        return self._staged

    def synchronize_staging(self) -> None:
        """Nothing: wait for the future ``stage`` returned."""

    def close(self) -> None:
        self._executor.shutdown(wait=True)
        self._first.close()
        self._staged = None


class DirectIOPlanner(DefaultSavePlanner):
    """``DefaultSavePlanner`` with DCP's plan caching on: where a save's local plan equals
    the last one's, DCP reuses the global plan and metadata it kept, instead of building
    them again. DCP keys that cache by the planner's class name: a class of its own keeps
    these saves' plans apart from those of any other planner in the process."""

    def __init__(self, **options):
        super().__init__(enable_plan_caching=True, **options)


@dataclasses.dataclass(frozen=True)
class Extent:
    """Where an item's bytes are: a file of the checkpoint, an offset, a length."""

    relative_path: str
    offset: int
    length: int


def _bytes_of(data) -> torch.Tensor:
    """An item's bytes, flat: a tensor's where it lies (on its device), a ``BytesIO``'s."""
    if isinstance(data, io.BytesIO):
        return torch.from_numpy(np.frombuffer(data.getbuffer(), dtype=np.uint8))
    return data.detach().contiguous().reshape(-1).view(torch.uint8)


def _page_aligned(nbytes: int) -> torch.Tensor:
    """``nbytes`` of host memory that start at a page (torch aligns its own to 64 bytes)."""
    room = torch.empty(nbytes + ALIGN, dtype=torch.uint8)
    return room[-room.data_ptr() % ALIGN :][:nbytes]


def _settled(future: Future, error: BaseException | None = None) -> None:
    """Complete ``future`` (with ``error``, if any), unless it is already done."""
    with contextlib.suppress(InvalidStateError):  # the writer's, or the upload's: first wins
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(None)


def _whole_pages(nbytes: int) -> int:
    """``nbytes`` rounded up to whole pages: a direct write's length, an item's room."""
    return -(-nbytes // ALIGN) * ALIGN


def _write_all(fd: int, data: np.ndarray, offset: int) -> None:
    view, done = memoryview(data), 0
    while done < len(view):
        done += os.pwrite(fd, view[done : done + IO_PIECE], offset + done)


def _read_extent(file, extent: Extent, into: memoryview, fqn: str) -> None:
    """Fill ``into`` with ``extent``'s bytes, piece by piece; a file that ends first is an
    error that names the file and the item."""
    done = 0
    while done < extent.length:
        piece = into[done : min(extent.length, done + IO_PIECE)]
        got = os.preadv(file.fileno(), [piece], extent.offset + done)
        if not got:
            raise OSError(f"{file.name}: shorter than {fqn} needs")
        done += got


class DirectIOWriter(FileSystemWriter):
    """A ``FileSystemWriter`` that writes each rank's items into one file with ``O_DIRECT``:
    from the item's memory where it is page-aligned host memory, through a small aligned
    buffer where not; every item starts at a page. Where the file system refuses direct
    I/O, it warns and writes through the page cache; either way the file is synced before
    ``.metadata``. ``items_read`` is done once its writes no longer read any item."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.items_read = Future()

    def prepare_global_plan(self, plans):
        return [dataclasses.replace(plan, storage_data=f"__{i}_") for i, plan in enumerate(plans)]

    def write_data(self, plan, planner) -> TorchFuture:
        name = f"{plan.storage_data}0.direct"
        path = os.path.join(self.path, name)
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
        try:
            fd = os.open(path, flags | os.O_DIRECT, 0o644)
        except OSError:  # tmpfs and some others: no direct I/O
            warnings.warn(
                f"{path}: no direct I/O here; writing through the page cache", stacklevel=2
            )
            fd = os.open(path, flags, 0o644)
        bounce = _page_aligned(BOUNCE_BYTES)
        results, offset = [], 0
        try:
            for item in plan.items:
                data = _bytes_of(planner.resolve_data(item))
                size = data.numel()
                in_place = data.device.type == "cpu" and data.data_ptr() % ALIGN == 0
                direct = size - size % ALIGN if in_place else 0
                if direct:
                    _write_all(fd, data[:direct].numpy(), offset)
                for start in range(direct, size, BOUNCE_BYTES):
                    piece = data[start : start + BOUNCE_BYTES]
                    padded = _whole_pages(piece.numel())
                    bounce[: piece.numel()].copy_(piece)  # lets other threads run; from a GPU too
                    bounce[piece.numel() : padded].zero_()
                    _write_all(fd, bounce[:padded].numpy(), offset + start)
                extent = Extent(name, offset, size)
                results.append(
                    WriteResult(index=item.index, size_in_bytes=size, storage_data=extent)
                )
                offset += _whole_pages(size)
            _settled(self.items_read)  # written (or in the page cache): the state may change
            os.fsync(fd)
        except BaseException as error:
            _settled(self.items_read, error)
            raise
        finally:
            os.close(fd)
        written = TorchFuture()
        written.set_result(results)
        return written


class _InPlace(AsyncStager):
    """Stages nothing: the upload reads the state itself."""

    _synchronize_after_execute = False

    def stage(self, state_dict):
        return state_dict

    def synchronize_staging(self) -> None:
        """Nothing to wait for."""


def async_save_in_place(state_dict, checkpoint_id, process_group=None, stager=None):
    """``dcp.async_save`` with a ``DirectIOWriter``, a ``DirectIOPlanner`` and a thread
    upload, from the state itself: its ``staging_completion`` is done once the writes no
    longer read the state (nothing may change it before), its ``upload_completion`` once
    the checkpoint is on disk. With a ``stager`` (a GPU's state), from the stager's copy."""
    writer = DirectIOWriter(checkpoint_id, per_thread_copy_ahead=0)  # 0: no GPU 0 context
    options = dict(storage_writer=writer, planner=DirectIOPlanner(), process_group=process_group)
    options.update(async_checkpointer_type=AsyncCheckpointerType.THREAD)
    if stager is not None:
        return dcp.async_save(state_dict, async_stager=stager, **options)
    upload = dcp.async_save(state_dict, async_stager=_InPlace(), **options)
    # An upload that fails before it writes (its plan, a collective) ends the wait too.
    upload.add_done_callback(lambda done: _settled(writer.items_read, done.exception()))
    return AsyncSaveResponse(staging_completion=writer.items_read, upload_completion=upload)


class DirectIOReader(FileSystemReader):
    """Reads a ``DirectIOWriter`` checkpoint: each item's raw bytes, from its extent."""

    def set_up_storage_reader(self, metadata, is_coordinator, *args, **kwargs) -> None:
        super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)
        self.metadata = metadata

    def read_data(self, plan, planner) -> TorchFuture:
        files = {}
        with contextlib.ExitStack() as closing:
            for item in plan.items:
                extent = self.storage_data[item.storage_index]
                if extent.relative_path not in files:
                    name = os.path.join(self.path, extent.relative_path)
                    opened = open(name, "rb", buffering=0)  # noqa: SIM115
                    files[extent.relative_path] = closing.enter_context(opened)
                file, fqn = files[extent.relative_path], item.storage_index.fqn
                if item.type == LoadItemType.BYTE_IO:
                    stored = bytearray(extent.length)
                    _read_extent(file, extent, memoryview(stored), fqn)
                    planner.load_bytes(item, io.BytesIO(stored))
                    continue
                entry = self.metadata.state_dict_metadata[fqn]
                offsets = tuple(item.storage_index.offset)
                sizes = next(c.sizes for c in entry.chunks if tuple(c.offsets) == offsets)
                stored = torch.empty(sizes, dtype=entry.properties.dtype)
                _read_extent(file, extent, memoryview(_bytes_of(stored).numpy()), fqn)
                for dim, (start, length) in enumerate(
                    zip(item.storage_offsets, item.lengths, strict=True)
                ):
                    stored = stored.narrow(dim, start, length)  # the part this rank asked for
                target = planner.resolve_tensor(item).detach()
                target.copy_(stored)
                planner.commit_tensor(item, target)
        done = TorchFuture()
        done.set_result(None)
        return done
