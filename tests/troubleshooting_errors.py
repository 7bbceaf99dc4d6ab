"""Trigger, on 2 ranks, every failure that troubleshooting.md quotes, and print what DCP raises.

Run by tests/test_troubleshooting_page.py through the launcher
(``recipe_runner.script(path, world_size=2)``). Each failure is printed as
Python prints an uncaught exception's last lines, between ``=== <name>`` and
``=== end``, so the test can match the page's quoted text against it. Facts
that are not messages are printed as ``fact <name>: <value>`` lines.
"""

import contextlib
import logging
import os
import sys
import threading
import traceback
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "recipes_source"))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
from rank_launcher import run_on_ranks, shared_tempdir  # noqa: E402
from torch.distributed.checkpoint import FileSystemWriter  # noqa: E402
from torch.distributed.checkpoint.api import CheckpointException  # noqa: E402
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions  # noqa: E402

WORK_DIR = shared_tempdir("dcp-troubleshooting-")


def quote(name, error):
    print(f"=== {name}")
    print("".join(traceback.format_exception_only(type(error), error)).rstrip())
    print("=== end")


def fact(name, value):
    print(f"fact {name}: {value}")


def state(rank):
    # Each rank owns one tensor, as with sharded parameters: every rank writes a file.
    return {f"weight_of_rank{rank}": torch.full((64,), float(rank)), "step": torch.tensor(7)}


class PausingWriter(FileSystemWriter):
    """A FileSystemWriter that stops after writing its data, before DCP gathers the results."""

    def __init__(self, path, written, may_finish):
        super().__init__(path)
        self.written, self.may_finish = written, may_finish

    def write_data(self, plan, planner):
        result = super().write_data(plan, planner)
        self.written.set()
        self.may_finish.wait()
        return result


def save_interrupted_by_destroyed_group(path, rank):
    """async_save on a group of its own, destroyed while the upload runs: a torn checkpoint."""
    group = dist.new_group(backend="gloo")
    written, may_finish = threading.Event(), threading.Event()
    writer = PausingWriter(path, written, may_finish)
    upload = dcp.async_save(state(rank), storage_writer=writer, process_group=group)
    written.wait()
    dist.barrier()  # every rank has written its data; no .metadata yet
    dist.destroy_process_group(group)
    may_finish.set()
    return upload


def cpu_backend_missing():
    group = dist.new_group(backend="cuda:gloo")  # a group with no CPU backend
    try:
        dcp.async_save(
            {"x": torch.zeros(2)},
            checkpoint_id=os.path.join(WORK_DIR, "no-cpu"),
            process_group=group,
        )
    except AssertionError as error:
        quote("no-cpu-backend", error)


def default_stager_on_cpu():
    rank = dist.get_rank()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "pinned memory needs CUDA": the error is the point
        try:
            DefaultStager()
        except AssertionError as error:
            quote("default-stager-on-cpu", error)
        writer = FileSystemWriter(
            os.path.join(WORK_DIR, "cached-stager"), cache_staged_state_dict=True
        )
        try:
            dcp.async_save(state(rank), storage_writer=writer).result()
        except RuntimeError as error:
            quote("cached-stager-on-cpu", error)


def torn_checkpoint():
    rank = dist.get_rank()
    path = os.path.join(WORK_DIR, "torn")
    upload = save_interrupted_by_destroyed_group(path, rank)
    try:
        upload.result()
    except ValueError as error:
        quote("upload-after-destroy", error)
    dist.barrier()
    fact(f"torn files rank{rank}", sorted(os.listdir(path)))
    try:
        try:
            dcp.load(state(rank), checkpoint_id=path)
        except Exception:  # noqa: BLE001 - the point: this does not catch it
            fact("except Exception caught it", True)
    except CheckpointException as error:
        fact("except Exception caught it", False)
        quote("load-torn", error)


def reused_directory():
    """A torn save into a directory that already holds a checkpoint still has a .metadata."""
    rank = dist.get_rank()
    path = os.path.join(WORK_DIR, "reused")
    dcp.save(state(rank), checkpoint_id=path)
    newer = {key: value + 100 for key, value in state(rank).items()}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        group = dist.new_group(backend="gloo")
        written, may_finish = threading.Event(), threading.Event()
        writer = PausingWriter(path, written, may_finish)
        upload = dcp.async_save(newer, storage_writer=writer, process_group=group)
        written.wait()
    dist.barrier()
    dist.destroy_process_group(group)
    may_finish.set()
    with contextlib.suppress(ValueError):
        upload.result()  # the torn save fails, as in torn_checkpoint()
    dist.barrier()
    for warning in caught:
        if "existing checkpoint" in str(warning.message):
            quote("overwrite-warning", warning.category(str(warning.message)))
            break
    fact(f"reused has .metadata rank{rank}", os.path.exists(os.path.join(path, ".metadata")))
    loaded = {key: torch.zeros_like(value) for key, value in newer.items()}
    dcp.load(loaded, checkpoint_id=path)  # no error: the old index, the new data
    own = f"weight_of_rank{rank}"
    fact(f"reused loads the torn save rank{rank}", torch.equal(loaded[own], newer[own]))


def without_collectives():
    rank = dist.get_rank()
    path = os.path.join(WORK_DIR, "no-collectives")
    dcp.save(state(rank), checkpoint_id=path, use_collectives=False)
    dist.barrier()
    fact("use_collectives=False files", sorted(os.listdir(path)))


def directory_differs():
    rank = dist.get_rank()
    own_path = os.path.join(WORK_DIR, f"rank{rank}-only")  # BUG: each rank picks its own
    dcp.save(state(rank), checkpoint_id=own_path)
    dist.barrier()
    fact(f"differs files rank{rank}", sorted(os.listdir(own_path)))
    try:
        dcp.load(state(rank), checkpoint_id=os.path.join(WORK_DIR, "rank0-only"))
    except CheckpointException as error:
        quote("differs-load-rank0-path", error)
    try:
        dcp.load(state(rank), checkpoint_id=own_path)
    except CheckpointException as error:
        quote("differs-load-own-path", error)


def replicated_directory_differs():
    """Plain replicated tensors: DCP writes each once; here rank 0 writes all of them."""
    rank = dist.get_rank()
    own_path = os.path.join(WORK_DIR, f"replicated-rank{rank}-only")
    dcp.save({"step": torch.tensor(7)}, checkpoint_id=own_path)
    dist.barrier()
    loaded = {"step": torch.tensor(0)}
    dcp.load(loaded, checkpoint_id=os.path.join(WORK_DIR, "replicated-rank0-only"))
    fact(f"replicated loads from rank 0's path rank{rank}", int(loaded["step"]))


def reused_stager_on_torch_2_11():
    """A DefaultStager reused for a second save, on torch 2.11 (simulated on this torch).

    torch 2.11.0's ``DefaultStager._stage`` differs from 2.13.0's by one line, which closes
    the stager's ``StateDictStager`` after every copy; ``stage_then_close`` adds it back.
    """
    rank = dist.get_rank()
    stage = DefaultStager._stage

    def stage_then_close(self, state_dict, **kwargs):
        staged = stage(self, state_dict, **kwargs)
        self._state_dict_stager.close()  # the line torch 2.11.0 has
        return staged

    DefaultStager._stage = stage_then_close
    try:
        stager = DefaultStager(StagingOptions(False, False, True, False))
        for save in range(2):
            response = dcp.async_save(
                state(rank),
                checkpoint_id=os.path.join(WORK_DIR, f"reused-stager-{save}"),
                async_stager=stager,
            )
            try:
                response.upload_completion.result()
                fact(f"reused stager save {save} rank{rank}", "complete")
            except KeyError as error:
                quote("reused-stager-torch-2.11", error)
        stager.close()
    finally:
        DefaultStager._stage = stage


def missing_key():
    """A state dict with a key the checkpoint does not have: every rank raises at planning."""
    path = os.path.join(WORK_DIR, "missing-key")
    dcp.save({"model.weight": torch.zeros(4)}, checkpoint_id=path)
    wanted = {"model.weight": torch.zeros(4), "model.head.weight": torch.zeros(4)}
    try:
        dcp.load(wanted, checkpoint_id=path)
    except CheckpointException as error:
        quote("missing-key", error)


def newer_torch_checkpoint():
    """The checkpoint torch 2.15.0 saved (the cross-version page's committed fixture), loaded
    by this older torch: every rank fails to unpickle its .metadata."""
    path = Path(__file__).resolve().parents[1] / "recipes_source" / "cross_version_fixture"
    try:
        dcp.load({"weight": torch.zeros(1)}, checkpoint_id=path / "saved-by-torch-2.15.0")
    except CheckpointException as error:
        quote("newer-torch-checkpoint", error)


def every_failure():
    logging.disable(logging.WARNING)  # DCP logs each failed metadata read with its traceback
    cpu_backend_missing()
    default_stager_on_cpu()
    torn_checkpoint()
    reused_directory()
    without_collectives()
    directory_differs()
    replicated_directory_differs()
    reused_stager_on_torch_2_11()
    missing_key()
    newer_torch_checkpoint()


run_on_ranks(every_failure)
