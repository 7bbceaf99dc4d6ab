"""The direct-I/O checkpoint pieces (recipes_source/direct_io.py): what they write, what they
read back, and how the stager copies.

The stall benchmark runs them in its training loop (its tests check every checkpoint it
wrote, read back); these tests check the files, the layout and the edge cases.
"""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from types import SimpleNamespace

import direct_io
import gil_probe
import pytest
import torch
import torch.distributed.checkpoint as dcp
from page_tools import disk
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _failures(error: CheckpointException) -> str:
    """The errors a rank raised inside DCP, as their messages."""
    return " ".join(f"{type(e).__name__}: {e}" for e in error.failures.values())


def _state():
    torch.manual_seed(0)
    return {
        "weight": torch.rand(1000, 37),  # 148,000 bytes: not a whole number of pages
        "half": torch.rand(64, 64).bfloat16(),
        "counts": torch.arange(10, dtype=torch.int64),
        "step": torch.tensor(3.0),  # 0-dim, as Adam's
        "note": "a string: DCP stores it as bytes",
        "optim": {"lr": 0.1, "moments": [torch.rand(5), torch.rand(5)]},
    }


def _empty_like(state):
    if isinstance(state, torch.Tensor):
        return torch.zeros_like(state)
    if isinstance(state, dict):
        return {key: _empty_like(value) for key, value in state.items()}
    if isinstance(state, list):
        return [_empty_like(value) for value in state]
    return None


def _assert_same(loaded, saved):
    if isinstance(saved, torch.Tensor):
        assert torch.equal(loaded, saved)
    elif isinstance(saved, dict):
        for key, value in saved.items():
            _assert_same(loaded[key], value)
    elif isinstance(saved, list):
        for a, b in zip(loaded, saved, strict=True):
            _assert_same(a, b)
    else:
        assert loaded == saved


def test_a_checkpoint_is_one_file_of_page_aligned_items_and_reads_back_the_same(tmp_path):
    state = _state()
    dcp.save(state, storage_writer=direct_io.DirectIOWriter(tmp_path), no_dist=True)
    assert sorted(os.listdir(tmp_path)) == [".metadata", "__0_0.direct"]
    extents = list(dcp.FileSystemReader(tmp_path).read_metadata().storage_data.values())
    assert all(isinstance(e, direct_io.Extent) for e in extents)
    assert all(e.offset % direct_io.ALIGN == 0 for e in extents)
    assert {e.relative_path for e in extents} == {"__0_0.direct"}
    size = (tmp_path / "__0_0.direct").stat().st_size
    assert size % direct_io.ALIGN == 0 and size >= max(e.offset + e.length for e in extents)
    assert disk.checkpoint_on_disk(tmp_path)["missing"] == []

    loaded = _empty_like(state)
    dcp.load(loaded, storage_reader=direct_io.DirectIOReader(tmp_path), no_dist=True)
    _assert_same(loaded, state)
    assert disk.loads_in_one_process(tmp_path) == {"tensors": 6, "finite": True}


def test_raw_bytes_are_not_a_file_system_readers_to_misread(tmp_path):
    dcp.save(_state(), storage_writer=direct_io.DirectIOWriter(tmp_path), no_dist=True)
    with pytest.raises(CheckpointException) as caught:
        dcp.load(_empty_like(_state()), checkpoint_id=tmp_path, no_dist=True)
    assert "'Extent' object has no attribute" in _failures(caught.value)


def test_where_direct_io_is_refused_it_warns_and_writes_through_the_page_cache(
    tmp_path, monkeypatch
):
    real_open = os.open

    def no_direct_io(path, flags, *args):
        if flags & os.O_DIRECT:
            raise OSError(22, "Invalid argument")
        return real_open(path, flags, *args)

    monkeypatch.setattr(direct_io.os, "open", no_direct_io)
    state = _state()
    with pytest.warns(UserWarning, match="no direct I/O here"):
        dcp.save(state, storage_writer=direct_io.DirectIOWriter(tmp_path), no_dist=True)
    monkeypatch.undo()
    loaded = _empty_like(state)
    dcp.load(loaded, storage_reader=direct_io.DirectIOReader(tmp_path), no_dist=True)
    _assert_same(loaded, state)


def test_a_view_that_starts_off_a_page_is_written_through_the_aligned_buffer(tmp_path):
    # 12 MB from the 4th float on: not page-aligned, larger than the buffer, with a tail.
    storage = torch.rand(3 * (direct_io.BOUNCE_BYTES // 8) + 100)
    state = {"view": storage[3:]}
    assert state["view"].data_ptr() % direct_io.ALIGN != 0
    dcp.save(state, storage_writer=direct_io.DirectIOWriter(tmp_path), no_dist=True)
    loaded = {"view": torch.zeros_like(state["view"])}
    dcp.load(loaded, storage_reader=direct_io.DirectIOReader(tmp_path), no_dist=True)
    assert torch.equal(loaded["view"], state["view"])


def test_the_reader_copies_only_the_part_of_a_chunk_a_rank_asks_for(tmp_path):
    weight = torch.arange(6 * 4, dtype=torch.float32).reshape(6, 4)
    dcp.save({"w": weight}, storage_writer=direct_io.DirectIOWriter(tmp_path), no_dist=True)
    reader = direct_io.DirectIOReader(tmp_path)
    reader.set_up_storage_reader(reader.read_metadata(), True)
    target, committed = torch.zeros(3, 2), []
    planner = SimpleNamespace(
        resolve_tensor=lambda item: target, commit_tensor=lambda item, t: committed.append(t)
    )
    index = MetadataIndex("w", torch.Size([0, 0]), 0)
    item = ReadItem(LoadItemType.TENSOR, index, torch.Size([0, 0]), index, (2, 1), (3, 2))
    reader.read_data(LoadPlan([item]), planner).wait()
    assert len(committed) == 1 and committed[0].data_ptr() == target.data_ptr()
    assert torch.equal(target, weight[2:5, 1:3])


def test_a_file_cut_short_is_an_error_that_names_it_and_a_check_sees_it(tmp_path):
    dcp.save(_state(), storage_writer=direct_io.DirectIOWriter(tmp_path), no_dist=True)
    with open(tmp_path / "__0_0.direct", "r+b") as file:
        file.truncate(4096)
    assert disk.checkpoint_on_disk(tmp_path)["missing"], "the check sees missing bytes"
    with pytest.raises(CheckpointException) as caught:
        reader = direct_io.DirectIOReader(tmp_path)
        dcp.load(_empty_like(_state()), storage_reader=reader, no_dist=True)
    assert "__0_0.direct: shorter than" in _failures(caught.value)


def test_a_bytes_item_cut_short_is_an_error_that_names_the_file_and_the_item(tmp_path):
    dcp.save(_state(), storage_writer=direct_io.DirectIOWriter(tmp_path), no_dist=True)
    metadata = direct_io.DirectIOReader(tmp_path).read_metadata()
    (note,) = [e for i, e in metadata.storage_data.items() if i.fqn == "note"]
    with open(tmp_path / note.relative_path, "r+b") as file:
        file.truncate(note.offset + 1)  # the string's first byte, and nothing after it
    with pytest.raises(CheckpointException) as caught:
        reader = direct_io.DirectIOReader(tmp_path)
        dcp.load({"note": ""}, storage_reader=reader, no_dist=True)
    assert "__0_0.direct: shorter than note needs" in _failures(caught.value)


def test_items_larger_than_one_call_moves_are_written_and_read_piece_by_piece(
    tmp_path, monkeypatch
):
    monkeypatch.setattr(direct_io, "IO_PIECE", 4096)  # the 148,000-byte weight: 37 pieces
    state = _state()
    dcp.save(state, storage_writer=direct_io.DirectIOWriter(tmp_path), no_dist=True)
    loaded = _empty_like(state)
    dcp.load(loaded, storage_reader=direct_io.DirectIOReader(tmp_path), no_dist=True)
    _assert_same(loaded["weight"], state["weight"])
    _assert_same(loaded["half"], state["half"])


def test_the_planner_keeps_its_plan_apart_and_every_save_reads_back_its_own_values(tmp_path):
    from torch.distributed.checkpoint.planner import SavePlanner

    saves = [_state(), _state(), {**_state(), "extra": torch.rand(3)}]  # the last: new shape
    saves[1]["weight"] += 1.0
    others = SavePlanner._cached_save_plan.get("DefaultSavePlanner")  # another planner's plan
    for number, state in enumerate(saves):
        writer = direct_io.DirectIOWriter(tmp_path / str(number))
        dcp.save(state, storage_writer=writer, planner=direct_io.DirectIOPlanner(), no_dist=True)
        assert "DirectIOPlanner" in SavePlanner._cached_save_plan, "kept, under its own name"
        assert SavePlanner._cached_save_plan.get("DefaultSavePlanner") is others
    for number, state in enumerate(saves):
        loaded = _empty_like(state)
        reader = direct_io.DirectIOReader(tmp_path / str(number))
        dcp.load(loaded, storage_reader=reader, no_dist=True)
        _assert_same(loaded, state)


def test_the_stager_keeps_a_page_aligned_copy_and_refreshes_it_letting_threads_run():
    state = {"model": {"weight": torch.rand(64 << 20)}, "lr": 0.1}  # 256 MB
    stager = direct_io.AlignedStager()
    try:
        first = stager.stage(state).result()
        kept = first["model"]["weight"]
        assert kept.data_ptr() % direct_io.ALIGN == 0 and kept.is_shared()
        assert torch.equal(kept, state["model"]["weight"])
        state["model"]["weight"].add_(1.0)
        state["lr"] = 0.05
        ticks = gil_probe.ticks_during(lambda: stager.stage(state).result())
        again = stager.stage(state).result()
        assert again["model"]["weight"] is kept, "the same memory, copied into"
        assert torch.equal(kept, state["model"]["weight"]) and again["lr"] == 0.05
        assert ticks > 20, "a Python thread runs while the stager copies"
        state["model"]["weight"] = torch.rand(10)  # a new shape: a new copy
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            third = stager.stage(state).result()
        assert third["model"]["weight"].shape == (10,)
        assert torch.equal(third["model"]["weight"], state["model"]["weight"])
    finally:
        stager.close()


def _writes_recorded(monkeypatch) -> list[tuple[int, int]]:
    """Where each of the writer's direct writes read from: (address, length)."""
    writes, real_write_all = [], direct_io._write_all

    def recorded(fd, data, offset):
        writes.append((data.ctypes.data, data.nbytes))
        real_write_all(fd, data, offset)

    monkeypatch.setattr(direct_io, "_write_all", recorded)
    return writes


def test_a_page_aligned_tensor_is_written_where_it_lies_and_the_rest_through_the_buffer(
    tmp_path, monkeypatch
):
    lying = direct_io._page_aligned(5 * direct_io.ALIGN + 8).view(torch.float32).normal_()
    state = {"lying": lying, "elsewhere": torch.rand(3 * direct_io.ALIGN)[1:]}
    writes = _writes_recorded(monkeypatch)
    dcp.save(state, storage_writer=direct_io.DirectIOWriter(tmp_path), no_dist=True)
    assert (lying.data_ptr(), 5 * direct_io.ALIGN) in writes, "its whole pages, in place"
    elsewhere = range(state["elsewhere"].data_ptr(), state["elsewhere"].data_ptr() + 12288)
    assert not any(address in elsewhere for address, _ in writes), "copied, then written"
    loaded = _empty_like(state)
    dcp.load(loaded, storage_reader=direct_io.DirectIOReader(tmp_path), no_dist=True)
    _assert_same(loaded, state)


def test_a_save_in_place_may_change_the_state_once_staged_and_keeps_what_it_was(tmp_path):
    state = {"weight": direct_io._page_aligned(64 << 20).view(torch.float32).normal_()}
    state["small"] = torch.rand(1000, 37)  # not aligned: through the buffer
    before = {key: value.clone() for key, value in state.items()}
    response = direct_io.async_save_in_place(state, tmp_path)
    response.staging_completion.result(timeout=120)
    for tensor in state.values():
        tensor.add_(1.0)  # as optimizer.step() does, while the file may still be synced
    response.upload_completion.result(timeout=120)
    loaded = _empty_like(state)
    dcp.load(loaded, storage_reader=direct_io.DirectIOReader(tmp_path), no_dist=True)
    _assert_same(loaded, before)


def test_a_save_in_place_that_fails_before_it_writes_ends_the_wait_with_the_error(tmp_path):
    (tmp_path / "a-file").write_text("not a directory")
    response = direct_io.async_save_in_place({"w": torch.rand(10)}, tmp_path / "a-file")
    with pytest.raises(CheckpointException):
        response.staging_completion.result(timeout=120)  # no hang: the upload's error
    with pytest.raises(CheckpointException):
        response.upload_completion.result(timeout=120)


def test_with_thp_mem_alloc_enable_torch_starts_every_big_tensor_at_a_page():
    # The stall page's own check, in a process that reads the variable at its first allocation.
    check = "from page_tools import stalls; print(stalls.big_tensors_start_at_a_page(8))"
    recipes = os.path.dirname(direct_io.__file__)
    for setting, starts_at_a_page in (("1", "True"), ("0", "False")):  # and the check can fail
        env = {**os.environ, "THP_MEM_ALLOC_ENABLE": setting, "PYTHONPATH": recipes}
        ran = subprocess.run(
            [sys.executable, "-c", check], env=env, capture_output=True, text=True, timeout=120
        )
        assert ran.stdout.strip() == starts_at_a_page, (setting, ran.stderr)
