"""
Asynchronous saving with dcp.async_save
=======================================

``dcp.save`` stops training until the checkpoint is on storage: every rank
serialises its shards and writes them, and the loop waits. ``dcp.async_save``
stops it only for as long as it takes to copy the state to host memory; a
background thread (or process) plans, serialises and writes that copy while
training goes on. This recipe builds a training loop around ``async_save``,
measures what each way of checkpointing costs the loop, proves that the
checkpoint holds the state at the moment of the save, and shows what a torn
checkpoint looks like.

.. grid:: 2

    .. grid-item-card:: :octicon:`mortar-board;1em;` What you will learn
       :class-card: card-prerequisites

       * What blocks a training loop in ``dcp.save``, and which part
         ``async_save`` takes off it, measured phase by phase
       * A training loop that checkpoints every few steps with ``async_save``:
         a process group of its own, one save in flight, the last save awaited
       * Reuse one ``DefaultStager`` for every save, and save from a separate
         checkpoint process (``AsyncCheckpointerType.PROCESS``)
       * On a GPU, what pinned staging buffers cost in host memory and buy in
         copy speed, measured
       * Resume only from a complete checkpoint, check that it equals the state
         at the moment of the save, bit for bit, and recognise a torn one

    .. grid-item-card:: :octicon:`list-unordered;1em;` Prerequisites
       :class-card: card-prerequisites

       * PyTorch 2.9 or later (``DefaultStager``, ``StagingOptions``), but
         not 2.11.0, whose ``DefaultStager`` cannot be reused (:ref:`reused-stager-keyerror`)
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

import os
import re
import shutil
import statistics
import time

import psutil
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from rank_launcher import run_on_one_process, run_on_ranks, shared_tempdir
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.fsdp import fully_shard

WORK_DIR = shared_tempdir("dcp-async-save-")
print(f"torch {torch.__version__}; checkpoints go under {WORK_DIR}")

# sphinx_gallery_start_ignore
# What only this page needs: timers, snapshots for the bit-for-bit checks, and
# the demonstrations of what goes wrong.
import copy
import logging
import multiprocessing
import subprocess
import sys
import textwrap
import threading
import warnings

from torch.distributed.checkpoint.state_dict import StateDictOptions

MEASURED = {}  # what the training runs measured, by checkpoint root
# sphinx_gallery_end_ignore


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


# %%
# The checkpoint has its full size from the first save on, even before any
# training: ``get_state_dict`` finds Adam without state and creates it by
# running one optimizer step with the learning rate set to zero. The moments
# stay zero, but Adam's ``step`` counter becomes 1, in the checkpoint and in
# the live optimizer, so a run that saves before it trains takes its first
# real step as Adam's step 2 (with that step's bias correction).

# sphinx_gallery_start_ignore


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


# sphinx_gallery_end_ignore


def adam_before_training():
    model = ToyModel()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    model_state_dict, optimizer_state_dict = get_state_dict(model, optimizer)
    saved_step = optimizer_state_dict["state"]["layers.0.weight"]["step"]
    live_step = optimizer.state[model.layers[0].weight]["step"]
    print(
        f"Adam's step before any training: {saved_step.item():.0f} in the state dict,"
        f" {live_step.item():.0f} in the live optimizer"
    )
    # sphinx_gallery_start_ignore
    parameters = sum(p.numel() for p in model.parameters())
    checkpoint_mb = (nbytes(model_state_dict) + nbytes(optimizer_state_dict)) / 1e6
    print(f"{parameters / 1e6:.1f} M parameters ({parameters * 4 / 1e6:.1f} MB of fp32 weights)")
    print(f"a checkpoint, with Adam's state: {checkpoint_mb:.1f} MB")
    # sphinx_gallery_end_ignore


run_on_one_process(adam_before_training)


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
# below runs the three phases one statement each, as ``async_save`` does, and
# times them on every rank. It stages with a
# :class:`~torch.distributed.checkpoint.staging.DefaultStager`, the class
# ``async_save`` also uses when you give it no stager (then with every option
# off); this page configures every stager with one function,
# ``staging_options()``.
#
# .. versionadded:: 2.9
#    ``DefaultStager`` and ``StagingOptions``.
#
# The staged copy is the memory cost of ``async_save``: one copy of this
# rank's share of the checkpoint in host memory, per save in flight, until
# its upload completes.


def staging_options(checkpoint_process=False):
    """How every save on this page stages its copy, chosen from the machine."""
    on_gpu = torch.accelerator.is_available()
    return StagingOptions(
        use_pinned_memory=on_gpu,  # page-locked memory only speeds up copies from a device
        use_shared_memory=checkpoint_process,  # only a checkpoint *process* reads it in place
        # Copy in the calling thread, on the current stream, and wait for the copy:
        # nothing races with training. The next recipe overlaps the copy instead.
        use_async_staging=False,
        use_non_blocking_copy=on_gpu,  # queue every copy, then wait once for all of them
    )


def time_save_phases(checkpoint_root):
    model, optimizer = build_sharded_model(seed=0)
    train_step(model, optimizer)
    app_state = AppState(model, optimizer)
    checkpoint_group = dist.new_group(backend="gloo")
    # sphinx_gallery_start_ignore
    seconds = {"collect": [], "stage": [], "write": [], "dcp.save": []}
    # sphinx_gallery_end_ignore
    for attempt in range(3):
        # sphinx_gallery_start_ignore
        start = time.perf_counter()
        # sphinx_gallery_end_ignore
        state_dict = app_state.state_dict()  # 1. collect
        # sphinx_gallery_start_ignore
        collected = time.perf_counter()
        # sphinx_gallery_end_ignore
        stager = DefaultStager(staging_options())
        staged = stager.stage(state_dict)  # 2. stage
        # sphinx_gallery_start_ignore
        staged_at = time.perf_counter()
        # sphinx_gallery_end_ignore
        staged_dir = os.path.join(checkpoint_root, f"staged-{attempt}")
        dcp.save(staged, checkpoint_id=staged_dir, process_group=checkpoint_group)  # 3. write
        # sphinx_gallery_start_ignore
        written = time.perf_counter()
        # sphinx_gallery_end_ignore
        stager.close()
        # The same state with plain dcp.save, for comparison.
        live_dir = os.path.join(checkpoint_root, f"live-{attempt}")
        dcp.save({"app": app_state}, checkpoint_id=live_dir, process_group=checkpoint_group)
        # sphinx_gallery_start_ignore
        seconds["collect"].append(collected - start)
        seconds["stage"].append(staged_at - collected)
        seconds["write"].append(written - staged_at)
        seconds["dcp.save"].append(time.perf_counter() - written)
        # sphinx_gallery_end_ignore
    dist.destroy_process_group(checkpoint_group)
    # sphinx_gallery_start_ignore
    medians = {phase: statistics.median(values) for phase, values in seconds.items()}
    return {"seconds": medians, "staged_bytes": nbytes(staged)}
    # sphinx_gallery_end_ignore


phases = run_on_ranks(time_save_phases, os.path.join(WORK_DIR, "phases"))

# sphinx_gallery_start_ignore


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
# sphinx_gallery_end_ignore


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
#   previous one. Each ``async_save`` call starts an executor of its own, so a
#   second save does not queue behind the first: both uploads run at once,
#   their collectives on the one checkpoint group can match each other's and
#   hang, and each holds its own staged copy in host memory.
# * **Wait for the last save before the group is destroyed.** The upload ends
#   with collectives on that group; rank 0 writes ``.metadata`` only after
#   them. Destroy the group first and the checkpoint is torn: data files
#   without ``.metadata`` (shown at the end of this page).
#
# The loop also saves once right after the first step and waits for that
# save: a storage problem shows up at once, not hours into the run, and
# one-time costs (opening files, starting a checkpoint process) are paid
# before training settles.
#
# With synchronous staging, as everywhere on this page, ``async_save`` returns
# a ``Future`` of the upload. (With ``use_async_staging=True`` it returns an
# ``AsyncSaveResponse`` whose ``upload_completion`` is that future: the
# :ref:`next recipe <sphx_glr_recipes_default_stager_recipe.py>`.)

NUM_STEPS, SAVE_EVERY = 11, 3
LAST_SAVE = NUM_STEPS // SAVE_EVERY * SAVE_EVERY  # steps after it keep training

# sphinx_gallery_start_ignore


def full_state(model, optimizer):
    """A copy of the whole state, unsharded, on CPU, on rank 0: what we compare against."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_state_dict, optimizer_state_dict = get_state_dict(model, optimizer, options=options)
    # Copy: some values are the live tensors (Adam's step counters), which training changes.
    return copy.deepcopy({"model": model_state_dict, "optim": optimizer_state_dict})


# sphinx_gallery_end_ignore


def train(checkpoint_root, **async_save_options):
    """Train NUM_STEPS steps and checkpoint every SAVE_EVERY, one save in flight."""
    model, optimizer = build_sharded_model(seed=0)
    state_dict = {"app": AppState(model, optimizer)}
    checkpoint_group = dist.new_group(backend="gloo")
    upload = None  # the save in flight, if any
    # sphinx_gallery_start_ignore
    steps, saves, expected = [], [], None
    # sphinx_gallery_end_ignore

    for step in range(1, NUM_STEPS + 1):
        # sphinx_gallery_start_ignore
        in_flight = upload is not None and not upload.done()
        start = time.perf_counter()
        # sphinx_gallery_end_ignore
        train_step(model, optimizer)
        # sphinx_gallery_start_ignore
        steps.append({"seconds": time.perf_counter() - start, "in_flight": in_flight})
        # sphinx_gallery_end_ignore
        if step != 1 and step % SAVE_EVERY != 0:
            continue

        # sphinx_gallery_start_ignore
        start = time.perf_counter()
        # sphinx_gallery_end_ignore
        if upload is not None:
            upload.result()  # at most one save in flight
        # sphinx_gallery_start_ignore
        waited = time.perf_counter() - start
        # sphinx_gallery_end_ignore
        upload = dcp.async_save(
            state_dict,
            checkpoint_id=os.path.join(checkpoint_root, f"step-{step}"),
            process_group=checkpoint_group,
            **async_save_options,
        )
        if step == 1:
            upload.result()  # the first save: check the storage, pay one-time costs
        # sphinx_gallery_start_ignore
        save = {"step": step, "blocked": time.perf_counter() - start, "waited": waited}
        saves.append(save)
        upload.add_done_callback(
            lambda _, save=save, start=start: save.update(done=time.perf_counter() - start)
        )
        if step == LAST_SAVE:
            expected = full_state(model, optimizer)  # the state at the save call
        # sphinx_gallery_end_ignore

    upload.result()  # the last save, before its group goes away
    dist.destroy_process_group(checkpoint_group)
    # sphinx_gallery_start_ignore
    final = full_state(model, optimizer)
    MEASURED[checkpoint_root] = {"steps": steps, "saves": saves, "expected": expected}
    MEASURED[checkpoint_root]["final"] = final
    return MEASURED[checkpoint_root]
    # sphinx_gallery_end_ignore


# sphinx_gallery_start_ignore


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


# sphinx_gallery_end_ignore


# %%
# Run it with ``async_save``'s default staging: every save copies the state
# into freshly allocated host memory, which is freed when its upload
# completes. The loop is blocked only for the copy; the upload overlaps the
# next steps.

async_runs = run_on_ranks(train, os.path.join(WORK_DIR, "async-save"))
# sphinx_gallery_start_ignore
print_saves(async_runs)
# sphinx_gallery_end_ignore


# %%
# Reuse one stager for every save
# -------------------------------
# Allocating a fresh host copy for every save costs time: on GPU, copies into
# ordinary (pageable) memory are slower than into page-locked memory (measured
# below), and on any machine new memory has to be faulted in page by page. A
# ``DefaultStager`` created once and passed as ``async_stager`` to every save
# keeps the buffers of its first save and copies into them at every later
# one, at the price of holding them for the whole run. On GPU,
# ``staging_options()`` pins them (page-locked memory is what lets the GPU
# copy at full speed); on CPU nothing is pinned. Create the stager on the
# rank, once its device is chosen, and close it after the last save: that
# frees its buffers (and unpins them).
#
# Use this on GPU too, rather than the older
# ``FileSystemWriter(path, cache_staged_state_dict=True)``: ``async_save``
# stages through a writer only for backward compatibility with old storage
# writers (its source says so); that writer's ``close()`` does nothing, so its
# buffers live as long as the writer; and it pins with ``.pin_memory()``,
# whose caching host allocator rounds every buffer up to a power of two (up to
# about twice the host memory), where ``DefaultStager`` registers exactly the
# bytes of each tensor's storage (also measured below).
#
# What reuse needs is the same state at every save. ``DefaultStager`` finds a
# buffer by the storage of the tensor it copies, so ``state_dict()`` must
# return the same tensors each time (the live parameters and optimizer state
# do; clones or offloaded copies get new buffers at every save). The writer's
# cache is stricter: built from the first state dict it sees, it needs the
# same keys and shapes at every save. Neither needs the first save to come
# after the first optimizer step: with ``get_state_dict``, Adam's state exists
# from the first call on (see above). And waiting for the previous save
# matters twice here: it also keeps the next copy from overwriting a buffer
# that the previous upload is still writing out.


def train_with_one_stager(checkpoint_root):
    stager = DefaultStager(staging_options())
    train(checkpoint_root, async_stager=stager)
    stager.close()  # frees the buffers it kept (and unpins them, on GPU)
    # sphinx_gallery_start_ignore
    return MEASURED[checkpoint_root]
    # sphinx_gallery_end_ignore


one_stager_runs = run_on_ranks(train_with_one_stager, os.path.join(WORK_DIR, "one-stager"))
# sphinx_gallery_start_ignore
print_saves(one_stager_runs)
# sphinx_gallery_end_ignore


# %%
# What pinning buys, measured on a GPU
# ------------------------------------
# The two claims above about pinned memory hold only where there is a device
# to copy from, so a build on a GPU measures them, in a process of its own.
# First the host memory that pinned staging buffers take, for a state shaped
# like GPT-2 small's token embedding and two of its weight matrices: staged
# once through the writer's cache, and once through a ``DefaultStager`` (the
# machine's available memory before and after each, as ``free`` shows it).
# Then a copy of 256 MiB from the GPU into new pageable memory (what
# ``async_save`` does when you give it no stager), into reused pageable
# memory, and into reused pinned memory. On a machine without a GPU the cell
# says so and measures nothing.


def host_memory_taken(stage, state):
    """The staged copy of ``state``, and the bytes of available memory it took."""
    before = psutil.virtual_memory().available
    staged = stage(state)
    return staged, before - psutil.virtual_memory().available


def pinned_staging_memory():
    state = {  # GPT-2 small: vocabulary x width, width x 4 widths, width x width (fp32)
        "wte.weight": torch.rand(50257, 768, device="cuda"),
        "mlp.c_fc.weight": torch.rand(768, 3072, device="cuda"),
        "attn.c_proj.weight": torch.rand(768, 768, device="cuda"),
    }
    state_bytes = sum(tensor.nbytes for tensor in state.values())
    writer = FileSystemWriter(os.path.join(WORK_DIR, "pinned"), cache_staged_state_dict=True)
    stager = DefaultStager(staging_options())  # pinned, as everywhere on this page on a GPU
    writer_copy, by_writer = host_memory_taken(writer.stage, state)
    stager_copy, by_stager = host_memory_taken(stager.stage, state)  # both copies still alive
    print(f"pinned staging buffers for a {state_bytes / 1e6:.1f} MB state take:")
    print(f"  FileSystemWriter(cache_staged_state_dict=True) {by_writer / 1e6:7.1f} MB")
    print(f"  DefaultStager(use_pinned_memory=True)          {by_stager / 1e6:7.1f} MB")
    stager.close()
    # sphinx_gallery_start_ignore
    for name, taken in (("writer", by_writer), ("stager", by_stager)):
        assert taken > 0.9 * state_bytes, f"the {name}'s buffers were not measured: {taken} B"
    ratios = f"{by_writer / state_bytes:.2f}x and {by_stager / state_bytes:.2f}x the state"
    print(f"  that is {ratios}")
    with open(os.path.join(WORK_DIR, "pinning.txt"), "a") as summary:  # for the last cell
        summary.write(f"; pinned buffers of the writer's cache and of DefaultStager: {ratios}")
    # sphinx_gallery_end_ignore


def copy_to_host_gbps(source, into=None, repeats=5):
    """GB/s of copying ``source`` from the GPU into ``into``, or into new memory."""
    seconds = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        if into is None:
            source.to("cpu")
        else:
            into.copy_(source, non_blocking=into.is_pinned())
        torch.cuda.synchronize()
        seconds.append(time.perf_counter() - start)
    return source.nbytes / statistics.median(seconds) / 1e9


def copy_speeds():
    source = torch.rand(64 * 2**20, device="cuda")  # 256 MiB
    targets = {
        "new pageable memory": None,
        "reused pageable memory": torch.empty(source.shape),
        "reused pinned memory": torch.empty(source.shape, pin_memory=True),
    }
    speeds = {memory: copy_to_host_gbps(source, into) for memory, into in targets.items()}
    print(f"a copy of {source.nbytes / 2**20:.0f} MiB from the GPU, median of 5, into")
    for memory, gbps in speeds.items():
        print(f"  {memory:<22} {gbps:6.1f} GB/s")
    # sphinx_gallery_start_ignore
    with open(os.path.join(WORK_DIR, "pinning.txt"), "a") as summary:  # for the last cell
        listed = ", ".join(f"{memory} {gbps:.1f} GB/s" for memory, gbps in speeds.items())
        summary.write(f"; GPU to {listed}")
    # sphinx_gallery_end_ignore


if torch.cuda.is_available():
    run_on_one_process(pinned_staging_memory)
    run_on_one_process(copy_speeds)
else:
    print("no GPU on this machine: no copy from a device and no pinned memory to measure")


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
#   memory, started by the first save and kept until the trainer exits. On a
#   GPU machine it starts CUDA too (``FileSystemWriter`` asks for a stream
#   when CUDA is available): its resident memory, printed below, then
#   includes a CUDA context. It is
#   spawned, so a training script keeps its top-level code under
#   ``if __name__ == "__main__":``. The first upload takes seconds longer.
# * **Its own process group.** The checkpoint processes build a gloo world of
#   their own on the first call: ``async_save`` uses the ``process_group``
#   you pass only then, for this rank's rank and the world size, and to agree
#   on a port; it does not forward it to the save (torch 2.13).
# * **Shared memory.** The staged copy reaches the checkpoint process through
#   shared memory, ``/dev/shm``. Staged there directly
#   (``staging_options(checkpoint_process=True)``), it is read in place.
#   Turning the stager's shared memory off does not avoid ``/dev/shm``:
#   handing the staged tensors to the process moves their storage into
#   shared memory anyway, one more copy per save (shown below). ``/dev/shm`` is
#   one tmpfs per machine or container, shared by every rank on it: it must
#   hold the staged copies of all local ranks together, plus headroom (in
#   Docker the default is only 64 MB: raise it with ``--shm-size``).
# * **Its log.** The checkpoint process logs every request at INFO level to
#   the standard error it inherits (torch configures that process's logging
#   itself, with no switch): in a training job those lines go to the job's
#   log. Here they go to a file, of which the page prints a sample.
#
# Under the cell, after this run's saves, all the ways of saving side by side.
# *Stall*: how long the loop was blocked at a save (median over the saves
# after the first, slowest rank). *Upload*: from the call until the checkpoint
# was complete (same median). *Slow-down*: median time of the steps that
# started while an upload was in flight, against the steps that started with
# none (rank 0, first step left out). These are a handful of steps on a
# shared machine: read the slow-down as rough. Built on CPU, the background
# work competes with training for the same few cores; built on a GPU, the
# steps run on the GPU, and the slow-down is what the upload's work on the
# host still costs them.


def train_in_checkpoint_process(checkpoint_root):
    stager = DefaultStager(staging_options(checkpoint_process=True))
    # sphinx_gallery_start_ignore
    os.makedirs(checkpoint_root, exist_ok=True)
    log_path = os.path.join(checkpoint_root, f"checkpoint-process-rank{dist.get_rank()}.log")
    log_fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    sys.stderr.flush()
    stderr_fd = os.dup(2)
    os.dup2(log_fd, 2)  # the checkpoint process inherits this standard error
    # sphinx_gallery_end_ignore
    train(
        checkpoint_root,
        async_stager=stager,
        async_checkpointer_type=AsyncCheckpointerType.PROCESS,
    )
    stager.close()
    # sphinx_gallery_start_ignore
    handover = hand_over_unshared_tensors(checkpoint_root)
    sys.stderr.flush()
    os.dup2(stderr_fd, 2)
    os.close(stderr_fd)
    os.close(log_fd)
    children = [child for child in multiprocessing.active_children() if child.daemon]
    resident_mb = sum(psutil.Process(child.pid).memory_info().rss for child in children) / 1e6
    with open(log_path) as log:
        lines = log.read().splitlines()
    received = [line for line in lines if "Received async checkpoint request" in line]
    print(f"checkpoint process: {len(children)} running, {resident_mb:.0f} MB resident")
    print(f"its log: {len(lines)} lines, {len(received)} requests received; the first:")
    print("  " + received[0].replace(checkpoint_root, "<run>"))
    print(
        "staged with use_shared_memory=False: in shared memory after staging: "
        f"{handover['after_staging']}, after the handover: {handover['after_handover']}"
    )
    return MEASURED[checkpoint_root]
    # sphinx_gallery_end_ignore


# sphinx_gallery_start_ignore


class RecordingStager(DefaultStager):
    """A DefaultStager that keeps its last staged state dict, to look at."""

    def stage(self, state_dict, **kwargs):
        self.staged = super().stage(state_dict, **kwargs)
        return self.staged


def tensors_of(state_dict):
    for value in state_dict.values():
        if isinstance(value, dict):
            yield from tensors_of(value)
        elif isinstance(value, torch.Tensor):
            yield value.to_local() if hasattr(value, "to_local") else value


def hand_over_unshared_tensors(checkpoint_root):
    """Save once more through the checkpoint process, staged without shared memory."""
    # Every option off: the point is shared memory. (Pinned, the handover would move the
    # storage and free the registered buffer without unregistering it.)
    options = StagingOptions(False, False, False, False)
    stager = RecordingStager(options)
    state_dict = {"weights": torch.rand(256, 1024)}
    upload = dcp.async_save(
        state_dict,
        checkpoint_id=os.path.join(checkpoint_root, "unshared"),
        async_checkpointer_type=AsyncCheckpointerType.PROCESS,
        async_stager=stager,
    )
    # The page asks right after async_save returns: the handover may have begun.
    upload.result()
    after = all(t.is_shared() for t in tensors_of(stager.staged))
    # A fresh staging of the same tensors, not handed over, for the "before" answer.
    fresh = DefaultStager(options).stage(state_dict)
    before = all(t.is_shared() for t in tensors_of(fresh))
    stager.close()
    shutil.rmtree(os.path.join(checkpoint_root, "unshared"), ignore_errors=True)
    return {"after_staging": before, "after_handover": after}


# sphinx_gallery_end_ignore

process_runs = run_on_ranks(train_in_checkpoint_process, os.path.join(WORK_DIR, "process"))
# sphinx_gallery_start_ignore
print_saves(process_runs)
shm = shutil.disk_usage("/dev/shm") if os.path.isdir("/dev/shm") else None
if shm is not None:
    print(f"/dev/shm on this machine: {shm.total / 2**30:.1f} GiB, shared by all local ranks")
print()


def median_ms(runs, key):
    """Median over the saves after the first of the slowest rank's milliseconds."""
    later_saves = range(1, len(runs[0]["saves"]))
    return statistics.median(1000 * max(r["saves"][i][key] for r in runs) for i in later_saves)


def summarise(name, runs):
    steps = runs[0]["steps"][1:]
    idle = [step["seconds"] for step in steps if not step["in_flight"]]
    busy = [step["seconds"] for step in steps if step["in_flight"]]
    slowdown = "-"
    if busy and idle:
        slowdown = f"{statistics.median(busy) / statistics.median(idle) - 1:+.0%}"
    upload = f"{median_ms(runs, 'done'):.0f} ms"
    in_flight = f"{len(busy)}/{len(steps)}"
    stall = median_ms(runs, "blocked")
    return f"{name:<38} {stall:6.1f} ms {upload:>9} {in_flight:>10} {slowdown:>10}"


print(f"{'strategy':<38} {'stall':>9} {'upload':>9} {'in flight':>10} {'slow-down':>10}")
print(f"{'dcp.save (timed above)':<38} {phase_ms('dcp.save'):6.1f} ms {'-':>9} {'-':>10} {'-':>10}")
print(summarise("async_save", async_runs))
print(summarise("async_save, one reused DefaultStager", one_stager_runs))
print(summarise("async_save, checkpoint process", process_runs))
startup = max(rank["saves"][0]["done"] for rank in process_runs)
print(f"first upload with a checkpoint process (includes starting it): {startup:.1f} s")
# sphinx_gallery_end_ignore


# %%
# Resume from the newest complete checkpoint
# ------------------------------------------
# DCP writes ``.metadata`` last, on rank 0, after every rank's data is on
# storage: with a fresh directory for every save, a directory without it is a
# save that did not finish (still in flight, or torn because the job stopped
# or destroyed the process group before the upload completed). Resume logic
# skips it and falls back to the previous checkpoint; ``load_checkpoint``
# refuses it with a plain message.
#
# That check holds only under two conditions:
#
# * **Never reuse a checkpoint directory.** ``FileSystemWriter`` overwrites by
#   default (``overwrite=True``) and replaces ``.metadata`` only at the very
#   end: while a second save into the same directory is writing, and after it
#   is torn, the old ``.metadata`` is still there and the directory looks
#   complete (shown at the end of this page). The only sign is a warning from
#   torch, ``Detected an existing checkpoint in ..., overwriting``.
# * **Save with collectives** (the default). ``use_collectives=False`` writes
#   one ``__{rank}.metadata`` per rank and no ``.metadata``, so this check
#   rejects every such checkpoint (``dcp.load`` itself falls back to those
#   files).


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
    if checkpoint_dir is None or not is_complete(checkpoint_dir):
        raise IncompleteCheckpointError(f"incomplete checkpoint: {checkpoint_dir} has no .metadata")
    dcp.load({"app": app_state}, checkpoint_id=checkpoint_dir)


RUN_NAMES = ("async-save", "one-stager", "process")
# sphinx_gallery_start_ignore
RUNS = dict(zip(RUN_NAMES, (async_runs, one_stager_runs, process_runs), strict=True))
for name in RUN_NAMES:
    checkpoint_root = os.path.join(WORK_DIR, name)
    marks = []
    for step in saved_steps(checkpoint_root):
        checkpoint_dir = os.path.join(checkpoint_root, f"step-{step}")
        marks.append(f"step-{step} {'complete' if is_complete(checkpoint_dir) else 'INCOMPLETE'}")
    print(f"{name + '/':<12} {', '.join(marks)}")
# sphinx_gallery_end_ignore


# %%
# Training went on after the last save was called: the steps after it ran
# while the checkpoint was being written, and changed the very tensors it was
# copied from. Load the newest complete checkpoint of each run into a freshly
# built model, as a restarted job does. The page compares it with the state
# at the moment of the save call, and with the live model at the end of
# training.

# sphinx_gallery_start_ignore
# The state of each run at its last save call, and at its end (rank 0's).
EXPECTATIONS = {name: (runs[0]["expected"], runs[0]["final"]) for name, runs in RUNS.items()}


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


def verify(checkpoint_dir, model, optimizer, expected, final):
    loaded = full_state(model, optimizer)  # collective: every rank calls it
    if dist.get_rank() != 0:
        return
    compared, differ = count_mismatches(expected, loaded)
    _, moved_on = count_mismatches(final, loaded)
    print(
        f"{os.path.relpath(checkpoint_dir, WORK_DIR)}: {compared} tensors, "
        f"{len(differ)} differ from the state at the save call, "
        f"{len(moved_on)} from the live model at the end"
    )
    assert not differ, f"{checkpoint_dir} is not the state at the save call: {differ}"
    assert moved_on, "training did not change the model after the save"


# sphinx_gallery_end_ignore


def resume(checkpoint_root):
    model, optimizer = build_sharded_model(seed=1)  # other weights: nothing matches by luck
    checkpoint_dir = latest_complete_checkpoint(checkpoint_root)
    load_checkpoint(checkpoint_dir, AppState(model, optimizer))
    # sphinx_gallery_start_ignore
    verify(checkpoint_dir, model, optimizer, *EXPECTATIONS[os.path.basename(checkpoint_root)])
    # sphinx_gallery_end_ignore
    return model, optimizer


def resume_every_run(work_dir):
    for name in RUN_NAMES:
        resume(os.path.join(work_dir, name))


run_on_ranks(resume_every_run, WORK_DIR)


# %%
# When a checkpoint is torn
# -------------------------
# A normal exit does not tear a checkpoint: Python waits for the upload
# thread before the interpreter ends, so a script that calls ``async_save``
# and then returns (or calls ``sys.exit(0)``) still leaves a complete
# checkpoint. What tears one is a save that cannot finish: the process group
# destroyed before the upload completed, ``os._exit``, a kill or a crash.
#
# The page shows each symptom with a writer that pauses once its data is
# written, so that the mistake happens at a known moment:
#
# * destroying the group while the upload runs makes the upload's future
#   raise ``ValueError`` (the group is gone), and the directory has data files
#   but no ``.metadata``;
# * ``dcp.load`` on that directory raises ``CheckpointException`` wrapping the
#   missing-metadata error;
# * a second save into a directory that already holds a checkpoint passes the
#   ``.metadata`` check while it is still writing.
#
# ``CheckpointException`` derives from ``BaseException``, not ``Exception``
# (like ``KeyboardInterrupt``): ``except Exception`` does not catch a failed
# ``dcp.load`` or ``dcp.save``. Catch it by name:

print(f"CheckpointException is an Exception: {issubclass(CheckpointException, Exception)}")

# sphinx_gallery_start_ignore
EXIT_WITHOUT_WAITING = textwrap.dedent(
    """
    import sys, threading, torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    exiting = threading.Event()

    class WriterThatWaitsForTheExit(FileSystemWriter):
        def write_data(self, plan, planner):
            exiting.wait()  # until the main thread is about to exit
            return super().write_data(plan, planner)

    writer = WriterThatWaitsForTheExit(sys.argv[1])
    state_dict = {"weights": torch.rand(1024, 1024)}
    upload = dcp.async_save(state_dict, storage_writer=writer, no_dist=True)
    print("upload still in flight right before sys.exit(0):", not upload.done())
    exiting.set()  # lets the upload go on, in the thread that Python joins at exit
    sys.exit(0)
    """
)


def exit_without_waiting(checkpoint_dir):
    """A fresh interpreter that calls async_save and exits at once."""
    result = subprocess.run(
        [sys.executable, "-c", EXIT_WITHOUT_WAITING, checkpoint_dir],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    print(result.stdout.strip())
    print(f"after a normal exit, {os.path.basename(checkpoint_dir)}/ is complete: ", end="")
    print(is_complete(checkpoint_dir))


class HeldWriter(FileSystemWriter):
    """A real FileSystemWriter whose upload, once its data is written, waits to be released."""

    def __init__(self, path):
        super().__init__(path)
        self.data_written = threading.Event()
        self.release = threading.Event()

    def write_data(self, plan, planner):
        writes = super().write_data(plan, planner)
        writes.wait()
        self.data_written.set()
        assert self.release.wait(60), "never released"
        return writes


def held_save(state_dict, checkpoint_dir, group):
    writer = HeldWriter(checkpoint_dir)
    upload = dcp.async_save(state_dict, storage_writer=writer, process_group=group)
    assert writer.data_written.wait(60), f"the data of {checkpoint_dir} was never written"
    dist.barrier()  # every rank's data is written; nothing is in flight on the group
    return writer, upload


def say_once(what, message):
    """Print a message once, with the ranks that had it (a collective); True on rank 0."""
    messages = [None] * dist.get_world_size()
    dist.all_gather_object(messages, message)
    ranks = [rank for rank, other in enumerate(messages) if other == message]
    if dist.get_rank() == 0:
        print(f"{what} {ranks}: {message.replace(WORK_DIR, '<work>')}")
    return dist.get_rank() == 0


def tear_saves(root):
    rank = dist.get_rank()
    model, optimizer = build_sharded_model(seed=0)
    state_dict = {"app": AppState(model, optimizer)}
    checkpoint_group = dist.new_group(backend="gloo")
    train_step(model, optimizer)
    dcp.async_save(
        state_dict, checkpoint_id=f"{root}/step-1", process_group=checkpoint_group
    ).result()
    saved = full_state(model, optimizer)  # the state in step-1, to compare with at the end

    # 1. The group is destroyed while the upload of step 2 still runs.
    train_step(model, optimizer)
    writer, upload = held_save(state_dict, f"{root}/step-2", checkpoint_group)
    dist.destroy_process_group(checkpoint_group)  # the mistake
    writer.release.set()
    try:
        upload.result(timeout=60)
        error = None
    except Exception as err:
        # The group's address differs between ranks: the rest of the message does not.
        error = re.sub(r" at 0x[0-9a-f]+", " at 0x...", f"{type(err).__name__}: {err}")
    if say_once("upload of step-2 raised on ranks", error):
        files = sorted(os.listdir(f"{root}/step-2"))
        print(f"step-2/ holds {files}; complete: {is_complete(f'{root}/step-2')}")

    # 2. dcp.load on the torn directory, and the page's own loader.
    logging.disable(logging.WARNING)  # dcp.load logs each missing file with a traceback
    try:
        try:
            dcp.load(state_dict, checkpoint_id=f"{root}/step-2")
            error = "loaded"
        except Exception:
            error = "caught by `except Exception`"
    except CheckpointException as err:
        wrapped, _ = err.failures[rank]
        # torch 2.13 adds why each read failed (the local one is long); torch 2.11 does not.
        reasons = "; ".join(str(wrapped).split("; ")[:2])
        error = f"CheckpointException wrapping {type(wrapped).__name__}:\n  {reasons}"
    finally:
        logging.disable(logging.NOTSET)
    say_once("dcp.load(step-2) raised on ranks", error)
    if rank == 0:
        try:
            load_checkpoint(f"{root}/step-2", AppState(model, optimizer))
        except IncompleteCheckpointError as err:
            message = str(err).replace(WORK_DIR, "<work>")
            print(f"load_checkpoint(step-2): {type(err).__name__}: {message}")

    # 3. The same mistake in a directory that already holds a checkpoint. (torch
    # warns "Detected an existing checkpoint in ..., overwriting": said in the text.)
    warnings.filterwarnings("ignore", message="Detected an existing checkpoint")
    checkpoint_group = dist.new_group(backend="gloo")
    reused = f"{root}/reused"
    dcp.async_save(state_dict, checkpoint_id=reused, process_group=checkpoint_group).result()
    train_step(model, optimizer)
    writer, upload = held_save(state_dict, reused, checkpoint_group)
    while_writing = is_complete(reused)
    dist.destroy_process_group(checkpoint_group)
    writer.release.set()
    try:
        upload.result(timeout=60)
        torn = False
    except Exception:
        torn = True
    dist.barrier()
    if rank == 0:
        print(
            f"reused/ saved into again: passes the .metadata check while writing: {while_writing}"
            f"; torn: {torn}; passes it after the tear: {is_complete(reused)}"
        )

    # 4. use_collectives=False: one metadata file per rank, none that the check knows.
    checkpoint_group = dist.new_group(backend="gloo")
    no_collectives = f"{root}/no-collectives"
    dcp.async_save(
        state_dict,
        checkpoint_id=no_collectives,
        process_group=checkpoint_group,
        use_collectives=False,
    ).result()
    dist.destroy_process_group(checkpoint_group)
    dist.barrier()
    if rank == 0:
        metadata = sorted(f for f in os.listdir(no_collectives) if f.endswith(".metadata"))
        print(f"use_collectives=False wrote {metadata}; complete: {is_complete(no_collectives)}")
    resume_after_the_tear(root, saved)


def resume_after_the_tear(root, expected):
    model, optimizer = build_sharded_model(seed=1)
    checkpoint_dir = latest_complete_checkpoint(root)
    load_checkpoint(checkpoint_dir, AppState(model, optimizer))
    loaded = full_state(model, optimizer)
    if dist.get_rank() == 0:
        compared, differ = count_mismatches(expected, loaded)
        print(
            f"resumed from {os.path.basename(checkpoint_dir)}: {compared} tensors, "
            f"{len(differ)} differ from the state at its save"
        )
        assert not differ, differ


run_on_one_process(exit_without_waiting, os.path.join(WORK_DIR, "exit", "step-1"))
torn_root = os.path.join(WORK_DIR, "torn")
run_on_ranks(tear_saves, torn_root)
# sphinx_gallery_end_ignore


# %%
# Clean up
# --------

# sphinx_gallery_start_ignore
pinning_file = os.path.join(WORK_DIR, "pinning.txt")
if os.path.exists(pinning_file):
    with open(pinning_file) as summary:
        pinning = summary.read()
else:
    pinning = "; pinned memory: not measured (no GPU)"
# sphinx_gallery_end_ignore
shutil.rmtree(WORK_DIR, ignore_errors=True)
print(f"removed {WORK_DIR}: {not os.path.exists(WORK_DIR)}")
# sphinx_gallery_start_ignore
stalls = {
    "dcp.save": phase_ms("dcp.save"),
    "async_save": median_ms(async_runs, "blocked"),
    "one reused DefaultStager": median_ms(one_stager_runs, "blocked"),
    "checkpoint process": median_ms(process_runs, "blocked"),
}
machine = "GPU" if torch.cuda.is_available() else "CPU"
listed = ", ".join(f"{name} {ms:.1f} ms" for name, ms in stalls.items())
print(f"async_save_recipe: stall on {machine} (median, slowest rank): {listed}{pinning}")
# sphinx_gallery_end_ignore


# %%
# What to read next
# -----------------
# * :ref:`sphx_glr_recipes_default_stager_recipe.py`: overlap even the copy
#   to host memory with the next forward and backward pass.
# * :ref:`sphx_glr_recipes_checkpoint_stall_benchmark.py`: what each strategy
#   costs, measured at a larger size.
# * :doc:`/troubleshooting`: symptoms and fixes for the usual DCP failures.
