"""
Asynchronous saving with dcp.async_save
=======================================

``dcp.save`` stops training until the checkpoint is on storage: every rank
serialises its shards and writes them, and the loop waits. ``dcp.async_save``
stops it only for as long as it takes to copy the state to host memory; a
background thread (or process) plans, serialises and writes that copy while
training goes on. This recipe builds a training loop around ``async_save``,
measures what each way of checkpointing costs the loop, and proves that the
checkpoint holds the state at the moment of the save.

.. grid:: 2

    .. grid-item-card:: :octicon:`mortar-board;1em;` What you will learn
       :class-card: card-prerequisites

       * What blocks a training loop in ``dcp.save``, and which part
         ``async_save`` takes off it, measured phase by phase
       * A training loop that checkpoints every few steps with ``async_save``:
         a process group of its own, one save in flight, the last save awaited
       * Reuse one staging buffer for every save, and save from a separate
         checkpoint process (``AsyncCheckpointerType.PROCESS``)
       * Resume only from a complete checkpoint, and check that it equals the
         state at the moment of the save, bit for bit

    .. grid-item-card:: :octicon:`list-unordered;1em;` Prerequisites
       :class-card: card-prerequisites

       * PyTorch 2.9 or later
       * CPU (gloo) or one GPU per rank (NCCL, plus gloo for checkpointing)
       * :ref:`sphx_glr_recipes_save_load_recipe.py`: ``dcp.save``,
         ``dcp.load`` and the ``AppState`` wrapper

As on every page of this site, code that runs on every rank is launched by
``run_on_ranks``, which starts the ranks (or uses the ones ``torchrun`` made)
and prints what each rank printed, labelled ``[rankN]``. The functions it runs
are plain DCP code for a training script started with ``torchrun``. Every
number below was measured when this page was built, on the machine named at
the top of the page.
"""

# %%
# Setup
# -----

import contextlib
import copy
import importlib.machinery
import multiprocessing
import multiprocessing.util
import os
import re
import statistics
import sys
import time

import psutil
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from rank_launcher import run_on_ranks, shared_tempdir
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType, AsyncSaveResponse
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.fsdp import fully_shard

WORK_DIR = shared_tempdir("dcp-async-save-")
print(f"torch {torch.__version__}; checkpoints go under {WORK_DIR}")


# %%
# A model with a checkpoint worth waiting for
# -------------------------------------------
# A few wide linear layers, sharded with FSDP2, trained with Adam. Adam keeps
# two moments per parameter, so the checkpoint is three times the weights. The
# model is kept small in compute (this page builds on two CPU cores), but its
# checkpoint is tens of megabytes: big enough that writing it takes longer
# than a training step.
#
# ``AppState`` is the same ``Stateful`` wrapper as in the getting-started
# recipe; DCP calls its ``state_dict()`` when it saves.

WIDTH, DEPTH, BATCH = 1024, 3, 8


class ToyModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(DEPTH))

    def forward(self, x):
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x


class AppState(Stateful):
    """Model and optimizer as one checkpointable object."""

    def __init__(self, model, optimizer=None):
        self.model = model
        self.optimizer = optimizer

    def state_dict(self):
        model_state_dict, optimizer_state_dict = get_state_dict(self.model, self.optimizer)
        return {"model": model_state_dict, "optim": optimizer_state_dict}

    def load_state_dict(self, state_dict):
        set_state_dict(
            self.model,
            self.optimizer,
            model_state_dict=state_dict["model"],
            optim_state_dict=state_dict["optim"],
        )


def device_for_this_rank():
    # The launcher (or your own set-up code) has already picked this rank's GPU.
    if torch.accelerator.is_available():
        return torch.accelerator.current_accelerator()
    return torch.device("cpu")


def build_sharded_model(seed):
    torch.manual_seed(seed)
    model = ToyModel().to(device_for_this_rank())
    fully_shard(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    torch.manual_seed(100 + dist.get_rank())  # each rank trains on its own data
    return model, optimizer


def train_step(model, optimizer):
    optimizer.zero_grad()
    loss = model(torch.rand(BATCH, WIDTH, device=device_for_this_rank())).pow(2).mean()
    loss.backward()
    optimizer.step()
    return loss.item()  # waits for the GPU, as logging the loss does


def full_state(model, optimizer):
    """A copy of the whole state, unsharded, on CPU, on rank 0: what we compare against."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_state_dict, optimizer_state_dict = get_state_dict(model, optimizer, options=options)
    # Copy: some values are the live tensors (Adam's step counters), which training changes.
    return copy.deepcopy({"model": model_state_dict, "optim": optimizer_state_dict})


def nbytes(state_dict):
    """Bytes of the tensors in a (nested) state dict; of a sharded tensor, this rank's shard."""
    total = 0
    for value in state_dict.values():
        if isinstance(value, dict):
            total += nbytes(value)
        elif isinstance(value, torch.Tensor):
            local = value.to_local() if hasattr(value, "to_local") else value
            total += local.numel() * local.element_size()
    return total


def checkpoint_bytes():
    """Size of a full checkpoint: the weights, and Adam's state after one step."""
    model = ToyModel()
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.rand(BATCH, WIDTH)).pow(2).mean().backward()
    optimizer.step()  # Adam creates its state (two moments per parameter) here
    return nbytes(model.state_dict()) + nbytes(optimizer.state_dict())


parameters = sum(p.numel() for p in ToyModel().parameters())
print(f"{parameters / 1e6:.1f} M parameters ({parameters * 4 / 1e6:.1f} MB of fp32 weights)")
print(f"a checkpoint, with Adam's state: {checkpoint_bytes() / 1e6:.1f} MB")


# %%
# What blocks the loop in ``dcp.save``
# ------------------------------------
# A save goes through three phases:
#
# 1. **collect**: ``AppState.state_dict()`` gathers references to the model's
#    and optimizer's tensors (no copy);
# 2. **stage**: copy those tensors to host memory. ``dcp.save`` copies from
#    the GPU while it writes (on CPU it writes straight from the live tensors);
#    ``async_save`` must copy first, so that training can change the live
#    tensors while the copy is being written;
# 3. **plan, serialise, write**: the ranks agree on a plan (collectives),
#    every rank serialises its shards into a ``.distcp`` file and syncs it to
#    storage, and rank 0 writes ``.metadata`` once every rank is done.
#
# ``dcp.save`` runs all of it while the loop waits. ``async_save`` runs the
# first two in the caller and hands phase 3 to a background thread. The cell
# below times each phase on every rank. It stages with
# :class:`~torch.distributed.checkpoint.staging.DefaultStager`, which is what
# ``async_save`` uses when you give it no stager.
#
# .. versionadded:: 2.9
#    ``DefaultStager`` and ``StagingOptions``.
#
# The staged copy is the memory cost of ``async_save``: one copy of this
# rank's share of the checkpoint in host memory, per save in flight, until
# its upload completes.


# What async_save uses when you pass no stager: plain host memory, staged in
# the calling thread.
DEFAULT_STAGING = StagingOptions(
    use_pinned_memory=False,
    use_shared_memory=False,
    use_async_staging=False,
    use_non_blocking_copy=False,
)


def time_save_phases(checkpoint_root, repeats=3):
    model, optimizer = build_sharded_model(seed=0)
    train_step(model, optimizer)  # creates Adam's state: the checkpoint has its full size
    app_state = AppState(model, optimizer)
    checkpoint_group = dist.new_group(backend="gloo")
    seconds = {"collect": [], "stage": [], "write": [], "dcp.save": []}
    for attempt in range(repeats):
        start = time.perf_counter()
        state_dict = app_state.state_dict()
        collected = time.perf_counter()
        stager = DefaultStager(DEFAULT_STAGING)
        staged = stager.stage(state_dict)
        staged_at = time.perf_counter()
        dcp.save(
            staged,
            checkpoint_id=os.path.join(checkpoint_root, f"staged-{attempt}"),
            process_group=checkpoint_group,
        )
        written = time.perf_counter()
        stager.close()
        dcp.save(
            {"app": app_state},
            checkpoint_id=os.path.join(checkpoint_root, f"live-{attempt}"),
            process_group=checkpoint_group,
        )
        seconds["collect"].append(collected - start)
        seconds["stage"].append(staged_at - collected)
        seconds["write"].append(written - staged_at)
        seconds["dcp.save"].append(time.perf_counter() - written)
    dist.destroy_process_group(checkpoint_group)
    medians = {phase: statistics.median(values) for phase, values in seconds.items()}
    return {"seconds": medians, "staged_bytes": nbytes(staged)}


phases = run_on_ranks(time_save_phases, os.path.join(WORK_DIR, "phases"))


def phase_ms(name):
    """Median milliseconds of a phase on the slowest rank: collectives wait for it."""
    return 1000 * max(rank["seconds"][name] for rank in phases)


print("phase of a save                              ms (median of 3, slowest rank)")
print(f"1. collect the state dict             {phase_ms('collect'):8.1f}")
print(f"2. stage: copy it to host memory      {phase_ms('stage'):8.1f}")
print(f"3. plan, serialise, write, .metadata  {phase_ms('write'):8.1f}")
print(f"dcp.save blocks the loop for          {phase_ms('dcp.save'):8.1f}")
print(f"async_save blocks it for 1 and 2      {phase_ms('collect') + phase_ms('stage'):8.1f}")
staged_mb = ", ".join(f"{rank['staged_bytes'] / 1e6:.1f} MB" for rank in phases)
print(f"staged copy per rank, held until its upload completes: {staged_mb}")


# %%
# A training loop with ``async_save``
# -----------------------------------
# The loop below checkpoints every ``SAVE_EVERY`` steps. Three rules make it
# safe; breaking each one is a failure people hit (see
# :doc:`/troubleshooting`):
#
# * **Checkpointing gets its own gloo process group.** The upload runs
#   collectives (planning, gathering every rank's results) from a background
#   thread while the loop runs its own (FSDP's all-gathers). On one shared
#   group the two streams of collectives can interleave in a different order on
#   different ranks, match the wrong partner and deadlock. A group of its own
#   also gives ``async_save`` the CPU backend it needs when training uses NCCL.
# * **At most one save in flight.** Before the next save, wait for the
#   previous one. Each save in flight holds a staged copy in host memory, and
#   saves that pile up behind slow storage would pile up copies too.
# * **Wait for the last save before the group is destroyed.** The upload ends
#   with collectives on that group; rank 0 writes ``.metadata`` only after
#   them. Destroy the group (or exit) first and the checkpoint is torn: data
#   files without ``.metadata``.
#
# The loop also saves once right after the first step and waits for that
# save: a storage problem shows up at once, not hours into the run, and
# one-time costs (opening files, starting a checkpoint process) are paid
# before training settles.
#
# ``async_save`` returns a ``Future`` with the stagers used on this page; with
# an asynchronous stager (the :ref:`next recipe
# <sphx_glr_recipes_default_stager_recipe.py>`) it returns an
# ``AsyncSaveResponse`` whose ``upload_completion`` is that future.
# ``upload_future`` accepts both. The timing code records, per save, how long
# the loop was blocked, and per step whether a save was in flight.

NUM_STEPS, SAVE_EVERY = 11, 3
LAST_SAVE = NUM_STEPS // SAVE_EVERY * SAVE_EVERY  # steps after it keep training


def upload_future(response):
    if isinstance(response, AsyncSaveResponse):
        return response.upload_completion
    return response


def train(checkpoint_root, **async_save_options):
    """Train NUM_STEPS steps, checkpoint every SAVE_EVERY; return what was measured."""
    model, optimizer = build_sharded_model(seed=0)
    state_dict = {"app": AppState(model, optimizer)}
    checkpoint_group = dist.new_group(backend="gloo")
    upload = None  # the save in flight, if any
    steps, saves, expected = [], [], None

    for step in range(1, NUM_STEPS + 1):
        in_flight = upload is not None and not upload.done()
        start = time.perf_counter()
        train_step(model, optimizer)
        steps.append({"seconds": time.perf_counter() - start, "in_flight": in_flight})
        if step != 1 and step % SAVE_EVERY != 0:
            continue

        checkpoint_id = os.path.join(checkpoint_root, f"step-{step}")
        start = time.perf_counter()
        if upload is not None:
            upload.result()  # at most one save in flight
        waited = time.perf_counter() - start
        response = dcp.async_save(
            state_dict,
            checkpoint_id=checkpoint_id,
            process_group=checkpoint_group,
            **async_save_options,
        )
        upload = upload_future(response)
        if step == 1:
            upload.result()  # the first save: check the storage, pay one-time costs
        save = {"step": step, "blocked": time.perf_counter() - start, "waited": waited}
        saves.append(save)
        # Measurement only: when did this upload complete?
        upload.add_done_callback(
            lambda _, save=save, start=start: save.update(done=time.perf_counter() - start)
        )
        if step == LAST_SAVE:
            expected = full_state(model, optimizer)  # for the check at the end

    upload.result()  # the last save, before its group goes away
    dist.destroy_process_group(checkpoint_group)
    final = full_state(model, optimizer)
    return {"steps": steps, "saves": saves, "expected": expected, "final": final}


def print_saves(results):
    """One line per save, slowest rank: the others wait for it at the next collective."""

    def slowest_ms(index, key):
        return 1000 * max(rank["saves"][index][key] for rank in results)

    print("step  loop blocked  of which waiting for the previous save  upload complete after")
    for index, save in enumerate(results[0]["saves"]):
        print(
            f"{save['step']:>4} {slowest_ms(index, 'blocked'):>10.1f} ms"
            f" {slowest_ms(index, 'waited'):>36.1f} ms {slowest_ms(index, 'done'):>19.1f} ms"
            + ("  (first save, awaited)" if index == 0 else "")
        )


# %%
# Run it with ``async_save``'s default staging: every save copies the state
# into freshly allocated host memory, which is freed when its upload
# completes. The loop is blocked only for the copy; the upload overlaps the
# next steps.

async_runs = run_on_ranks(train, os.path.join(WORK_DIR, "async-save"))
print_saves(async_runs)


# %%
# Reuse the staging buffer
# ------------------------
# Allocating a fresh host copy for every save costs time: on GPU, copies into
# ordinary (pageable) memory are slow, and on any machine new memory has to be
# faulted in page by page. Keeping one buffer and copying into it at every
# save avoids both, at the price of holding that buffer for the whole run.
#
# * **On GPU**: ``FileSystemWriter(path, cache_staged_state_dict=True)``, kept
#   across saves and passed as ``storage_writer``. It stages into *pinned*
#   (page-locked) host memory, allocated at the first save and reused by every
#   later one; pinned memory is what lets the GPU copy at full speed. The
#   cache has the structure of the first state dict it saw, so the first save
#   must come after the first optimizer step (Adam creates its state there).
# * **On CPU**: that writer raises, because pinning asks for an accelerator.
#   A :class:`~torch.distributed.checkpoint.staging.DefaultStager`, created
#   once and passed as ``async_stager`` to every save, caches its buffers in
#   the same way. Nothing is pinned: page-locked memory only speeds up copies
#   from an accelerator. Close the stager after the last save.
#
# With a reused buffer, waiting for the previous save matters twice: it is
# also what keeps the next copy from overwriting a buffer that the previous
# upload is still writing out.
#
# The rank function picks one by what the machine has, and says which ran.


def cached_staging(checkpoint_root):
    """async_save options that stage every save into the same host buffer."""
    if torch.accelerator.is_available():
        writer = FileSystemWriter(checkpoint_root, cache_staged_state_dict=True)
        return {"storage_writer": writer}, "FileSystemWriter(cache_staged_state_dict=True)"
    # The same options async_save uses by default, but one stager for all saves.
    stager = DefaultStager(DEFAULT_STAGING)
    return {"async_stager": stager}, "one DefaultStager, passed to every save"


def train_with_cached_staging(checkpoint_root):
    if not torch.accelerator.is_available() and dist.get_rank() == 0:
        # What the GPU choice does on this machine: staging into pinned memory fails.
        writer = FileSystemWriter(checkpoint_root, cache_staged_state_dict=True)
        try:
            writer.stage({"weight": torch.zeros(4)})  # the call async_save makes to stage
        except RuntimeError as err:
            print(f"FileSystemWriter(cache_staged_state_dict=True): {type(err).__name__}: {err}")
    options, description = cached_staging(checkpoint_root)
    result = train(checkpoint_root, **options)
    if "async_stager" in options:
        options["async_stager"].close()  # frees the cached buffers
    if dist.get_rank() == 0:
        print(f"staged with: {description}")
    return result


cached_runs = run_on_ranks(train_with_cached_staging, os.path.join(WORK_DIR, "cached"))
print_saves(cached_runs)


# %%
# Save from a checkpoint process
# ------------------------------
# With ``async_checkpointer_type=AsyncCheckpointerType.PROCESS`` the upload
# runs in a checkpoint process (one per rank) instead of a thread of the
# trainer.
#
# * **What it buys**: planning and serialising are Python. In a thread they
#   hold the trainer's GIL, so the trainer's own Python (the loop, the
#   optimizer, launching kernels) waits for them; a process has its own
#   interpreter.
# * **What it costs**: a process per rank, with its own copy of torch in
#   memory. The first save starts it (spawned: it imports torch and joins a
#   gloo group of its own), so the first upload takes seconds longer. The
#   staged copy has to reach it too. Staged into shared memory
#   (``use_shared_memory=True``), it is handed over as file descriptors and
#   read in place; staged into ordinary memory, it would be copied into shared
#   memory once more on its way.
#
# Three details that only this page needs:
#
# * The checkpoint process is started with the *spawn* method, which imports
#   the trainer's main script again in the new process. A training script
#   keeps its top-level code under ``if __name__ == "__main__":`` and needs
#   nothing more. This page runs its code at the top level, so it tells spawn
#   that there is no main script to import again.
# * The checkpoint process logs every request at INFO level to the output it
#   inherits. Here that output goes to a file next to the checkpoints.
# * It is a daemon child of the trainer, and torch has no public call to stop
#   it: when the trainer exits, Python's ``multiprocessing`` stops it and
#   removes the temporary directory it used to hand over the staged tensors.
#   The ranks of this page leave with ``os._exit``, which skips that, so each
#   rank runs ``multiprocessing``'s exit handler itself.


def do_not_rerun_this_page_in_spawned_processes():
    main = sys.modules["__main__"]
    if getattr(main, "__spec__", None) is None:
        main.__spec__ = importlib.machinery.ModuleSpec("__main__", None)


@contextlib.contextmanager
def output_to(path):
    """Point stdout and stderr (file descriptors 1 and 2) at a file for a while.

    Processes started meanwhile keep writing there.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with open(path, "ab") as log:
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
    try:
        yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        for fd, original in zip((1, 2), saved, strict=True):
            os.dup2(original, fd)
            os.close(original)


def stop_checkpoint_process():
    """Do now what multiprocessing does when a process exits; return the memory freed."""
    children = [child for child in multiprocessing.active_children() if child.daemon]
    resident_bytes = sum(psutil.Process(child.pid).memory_info().rss for child in children)
    # Terminates daemon children, and removes the temporary directory through
    # which the staged tensors' file descriptors were handed to them.
    multiprocessing.util._exit_function()
    return resident_bytes


def train_in_checkpoint_process(checkpoint_root):
    do_not_rerun_this_page_in_spawned_processes()
    stager = DefaultStager(
        StagingOptions(
            use_pinned_memory=torch.accelerator.is_available(),  # pinned only helps a GPU
            use_shared_memory=True,  # the checkpoint process reads it in place
            use_async_staging=False,
            use_non_blocking_copy=False,
        )
    )
    os.makedirs(checkpoint_root, exist_ok=True)
    log_path = os.path.join(checkpoint_root, f"checkpoint-process-rank{dist.get_rank()}.log")
    with output_to(log_path):
        result = train(
            checkpoint_root,
            async_checkpointer_type=AsyncCheckpointerType.PROCESS,
            async_stager=stager,
        )
    resident_bytes = stop_checkpoint_process()
    stager.close()
    with open(log_path) as log:
        logged = len(log.readlines())
    print(
        f"checkpoint process: {resident_bytes / 1e6:.0f} MB resident, {logged} log lines; "
        f"still running after the stop: {len(multiprocessing.active_children())}"
    )
    return result


process_runs = run_on_ranks(train_in_checkpoint_process, os.path.join(WORK_DIR, "process"))
print_saves(process_runs)


# %%
# Resume from the newest complete checkpoint
# ------------------------------------------
# DCP writes ``.metadata`` last, on rank 0, after every rank's data is on
# storage. A directory without it is a save that did not finish: still in
# flight, or torn because the job stopped (or destroyed the process group)
# before the upload completed. ``dcp.load`` on such a directory fails with a
# missing-file error from deep inside DCP. Resume logic should skip it and
# fall back to the previous checkpoint; ``load_checkpoint`` refuses it with a
# plain message.


class IncompleteCheckpointError(RuntimeError):
    pass


def is_complete(checkpoint_dir):
    return os.path.exists(os.path.join(checkpoint_dir, ".metadata"))


def saved_steps(checkpoint_root):
    """The N of every ``step-N`` directory, in increasing order."""
    matches = (re.fullmatch(r"step-(\d+)", name) for name in os.listdir(checkpoint_root))
    return sorted(int(match[1]) for match in matches if match)


def latest_complete_checkpoint(checkpoint_root):
    """The ``step-N`` directory with the highest N that has ``.metadata``, or None."""
    for step in reversed(saved_steps(checkpoint_root)):
        checkpoint_dir = os.path.join(checkpoint_root, f"step-{step}")
        if is_complete(checkpoint_dir):
            return checkpoint_dir
    return None


def load_checkpoint(checkpoint_dir, app_state):
    if not is_complete(checkpoint_dir):
        raise IncompleteCheckpointError(f"incomplete checkpoint: {checkpoint_dir} has no .metadata")
    dcp.load({"app": app_state}, checkpoint_id=checkpoint_dir)


RUNS = {
    "async-save": async_runs,
    "cached": cached_runs,
    "process": process_runs,
}
for name in RUNS:
    checkpoint_root = os.path.join(WORK_DIR, name)
    marks = []
    for step in saved_steps(checkpoint_root):
        checkpoint_dir = os.path.join(checkpoint_root, f"step-{step}")
        marks.append(f"step-{step} {'complete' if is_complete(checkpoint_dir) else 'INCOMPLETE'}")
    print(f"{name + '/':<12} {', '.join(marks)}")


# %%
# Training went on after the last save was called: the steps after it ran
# while the checkpoint was being written, and changed the very tensors it was
# copied from. Load the newest complete checkpoint of each run into a freshly
# built model and compare it with the state at the moment of the save call,
# and with the live model at the end of training:


def count_mismatches(expected, actual, prefix=""):
    """(tensors compared, names that differ) over two nested state dicts."""
    compared, differ = 0, []
    assert expected.keys() == actual.keys(), f"{prefix}: keys differ"
    for key, value in expected.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            sub_compared, sub_differ = count_mismatches(value, actual[key], f"{name}.")
            compared, differ = compared + sub_compared, differ + sub_differ
        elif isinstance(value, torch.Tensor):
            compared += 1
            if not torch.equal(value, actual[key]):
                differ.append(name)
        elif value != actual[key]:
            differ.append(name)
    return compared, differ


def resume_and_verify(work_dir, expectations):
    for name, (expected, final) in expectations.items():
        checkpoint_dir = latest_complete_checkpoint(os.path.join(work_dir, name))
        model, optimizer = build_sharded_model(seed=1)  # other weights: nothing matches by luck
        load_checkpoint(checkpoint_dir, AppState(model, optimizer))
        loaded = full_state(model, optimizer)  # collective: every rank calls it
        if dist.get_rank() != 0:
            continue
        compared, differ = count_mismatches(expected, loaded)
        _, moved_on = count_mismatches(final, loaded)
        print(
            f"{os.path.relpath(checkpoint_dir, work_dir)}: {compared} tensors, "
            f"{len(differ)} differ from the state at the save call, "
            f"{len(moved_on)} from the live model at the end"
        )
        assert not differ, f"{checkpoint_dir} is not the state at the save call: {differ}"
        assert moved_on, "training did not change the model after the save"


expectations = {name: (runs[0]["expected"], runs[0]["final"]) for name, runs in RUNS.items()}
run_on_ranks(resume_and_verify, WORK_DIR, expectations)


# %%
# What each way of saving cost the loop
# -------------------------------------
# *Stall*: how long the loop was blocked at a save (median over the saves
# after the first, slowest rank). *Upload*: from the call until the checkpoint
# was complete (same median). *Slow-down*: median time of the steps that
# started while an upload was in flight, against the steps that started with
# none (rank 0, first step left out). These are a handful of steps on a
# shared machine: read the slow-down as rough. On this page the background
# work competes with training for the same few CPU cores; on a GPU machine the
# steps run on the GPU and the host has cores to spare.


def summarise(name, runs):
    later_saves = range(1, len(runs[0]["saves"]))

    def median_ms(key):
        values = [1000 * max(r["saves"][i][key] for r in runs) for i in later_saves]
        return statistics.median(values)

    steps = runs[0]["steps"][1:]
    idle = [step["seconds"] for step in steps if not step["in_flight"]]
    busy = [step["seconds"] for step in steps if step["in_flight"]]
    slowdown = "-"
    if busy and idle:
        slowdown = f"{statistics.median(busy) / statistics.median(idle) - 1:+.0%}"
    upload = f"{median_ms('done'):.0f} ms"
    in_flight = f"{len(busy)}/{len(steps)}"
    return f"{name:<34} {median_ms('blocked'):6.1f} ms {upload:>9} {in_flight:>10} {slowdown:>10}"


print(f"{'strategy':<34} {'stall':>9} {'upload':>9} {'in flight':>10} {'slow-down':>10}")
print(f"{'dcp.save (timed above)':<34} {phase_ms('dcp.save'):6.1f} ms {'-':>9} {'-':>10} {'-':>10}")
print(summarise("async_save", async_runs))
print(summarise("async_save, reused staging buffer", cached_runs))
print(summarise("async_save, checkpoint process", process_runs))
startup = max(rank["saves"][0]["done"] for rank in process_runs)
print(f"first upload with a checkpoint process (includes starting it): {startup:.1f} s")


# %%
# Clean up
# --------

import shutil

shutil.rmtree(WORK_DIR, ignore_errors=True)
print(f"removed {WORK_DIR}: {not os.path.exists(WORK_DIR)}")


# %%
# What to read next
# -----------------
# * :ref:`sphx_glr_recipes_default_stager_recipe.py`: overlap even the copy
#   to host memory with the next forward and backward pass.
# * :ref:`sphx_glr_recipes_checkpoint_stall_benchmark.py`: what each strategy
#   costs, measured at a larger size.
# * :doc:`/troubleshooting`: symptoms and fixes for the usual DCP failures.
