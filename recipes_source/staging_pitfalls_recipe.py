"""
Pitfalls of overlapped staging
==============================

With :class:`~torch.distributed.checkpoint.staging.DefaultStager` and
``use_async_staging=True``, ``dcp.async_save`` returns before the state has
been copied: a background thread copies ("stages") the live tensors while the
next forward and backward pass run. The contract is that nothing may change
what is being copied until ``staging_completion`` resolves, and the usual
advice, "wait for ``staging_completion`` right before ``optimizer.step()``",
covers only the optimizer. This recipe runs four training loops that break
the contract, shows what each writes into its checkpoints, and proves each
fix bit for bit. (A fifth breaks it only on a GPU:
:ref:`sphx_glr_recipes_stager_stream_recipe.py`.)

.. grid:: 2

    .. grid-item-card:: :octicon:`mortar-board;1em;` What you will learn
       :class-card: card-prerequisites

       * Four hazards of overlapped staging: stepping early, a forward pass
         that updates buffers (BatchNorm), a reused stager's buffer overwritten
         by the next save, and Python values changed after the save call
       * The loop that fixes each one, proven bit-exact at every save
       * How often each race hits when nothing decides it
       * The loop with every fix, as a training script for ``torchrun``

    .. grid-item-card:: :octicon:`list-unordered;1em;` Prerequisites
       :class-card: card-prerequisites

       * PyTorch: see :doc:`/versions`
       * CPU (gloo) or one GPU per rank (NCCL, plus gloo for checkpointing)
       * :ref:`sphx_glr_recipes_default_stager_recipe.py`: ``DefaultStager``,
         ``StagingOptions`` and the loop this page takes apart
"""

# %%
# Setup
# -----
# The staging options come from the machine, as on every page. This page is
# about ``use_async_staging=True``: the copy runs in a background thread.
#
# .. versionadded:: 2.9
#    ``DefaultStager``, ``StagingOptions`` and ``AsyncSaveResponse``.

import dataclasses
import functools
import os
import shutil

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from page_tools import faults, figures, proofs, results, stats, timing
from rank_launcher import run_as_torchrun, run_on_ranks, shared_tempdir
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict import get_state_dict

WORK_DIR = shared_tempdir("dcp-staging-pitfalls-")
SAVES = 6  # every loop below saves this many times


def staging_options(use_async_staging, checkpoint_process=False):
    """How every save on this page stages its copy, chosen from the machine."""
    on_gpu = torch.accelerator.is_available()
    return StagingOptions(
        use_pinned_memory=on_gpu,  # page-locked memory only speeds up copies from a device
        use_shared_memory=checkpoint_process,  # only a checkpoint *process* reads it in place
        use_async_staging=use_async_staging,
        use_non_blocking_copy=on_gpu,
    )


print(f"torch {torch.__version__}; checkpoints go under {WORK_DIR}")
for option, value in dataclasses.asdict(staging_options(use_async_staging=True)).items():
    print(f"{option} = {value}")


# %%
# The model, the data and the state
# ---------------------------------
# A small model trained with Adam, so the checkpoint holds weights, Adam's two
# moments and its step counters; one variant starts with a ``BatchNorm1d``.
# Every rank holds the same replica and trains on the same batches (as
# data-parallel replicas stay equal), so a checkpoint has exactly one right
# answer. The checkpoints go through a gloo group of their own, as they should
# in any loop that overlaps saves with training, through a writer that copies
# nothing ahead from a GPU (``host_writer``): the stager's copy is on the host
# already.

WIDTH, CLASSES, BATCH = 256, 8, 32


def device_for_this_rank():
    # The launcher (or your own set-up code) has already picked this rank's GPU.
    if torch.accelerator.is_available():
        return torch.accelerator.current_accelerator()
    return torch.device("cpu")


def make_model(batch_norm_first=False):
    layers = [nn.BatchNorm1d(WIDTH)] if batch_norm_first else []
    return nn.Sequential(*layers, nn.Linear(WIDTH, WIDTH), nn.ReLU(), nn.Linear(WIDTH, CLASSES))


def build_model(batch_norm_first=False, seed=0):
    torch.manual_seed(seed)
    model = make_model(batch_norm_first).to(device_for_this_rank())
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    return model, optimizer


def batches(seed=1):
    generator = torch.Generator().manual_seed(seed)
    while True:
        yield torch.randn(BATCH, WIDTH, generator=generator).to(device_for_this_rank())


def train_step(model, optimizer, batch):
    optimizer.zero_grad()
    model(batch).pow(2).mean().backward()
    optimizer.step()


def checkpoint_state(model, optimizer):
    """The state dict to save: references to the live tensors, no copy."""
    model_state_dict, optimizer_state_dict = get_state_dict(model, optimizer)
    return {"model": model_state_dict, "optim": optimizer_state_dict}


@functools.cache
def checkpoint_group(index=0):
    # Created on first use, on every rank in the same order (a collective).
    return dist.new_group(backend="gloo")


def host_writer(path):
    """The writer for a state the stager has copied to the host: nothing to copy ahead."""
    return FileSystemWriter(path, per_thread_copy_ahead=0)  # no CUDA context on GPU 0


for name, tensor in make_model(batch_norm_first=True).state_dict().items():
    print(f"{name:<26} {str(tensor.dtype):<14} {tuple(tensor.shape)}")

# %%
# Running a loop
# --------------
# Each loop below trains with a save at every step (a real loop saves every
# few hundred steps; here every step, to have ``SAVES`` checkpoints to check).
# ``run_loop`` gives it a model with one step of training behind it (so that
# Adam has state), a data stream, and one ``DefaultStager`` reused for every
# save, as it should be: the stager keeps its host buffers from one save to
# the next. It says how many checkpoints it wrote, and returns where.


def run_loop(loop, batch_norm_first=False, saves=SAVES, checkpoints_under=WORK_DIR):
    model, optimizer = build_model(batch_norm_first)
    data = batches()
    train_step(model, optimizer, next(data))
    stager = DefaultStager(staging_options(use_async_staging=True))  # after set_device
    name = f"{loop.__name__}-with-batch-norm" if batch_norm_first else loop.__name__
    checkpoint_dir = os.path.join(checkpoints_under, name)  # one new directory per save in it
    try:
        loop(model, optimizer, data, stager, checkpoint_dir, saves)
    finally:
        stager.close()
    if dist.get_rank() == 0:
        print(f"{name}: {len(os.listdir(checkpoint_dir))} checkpoints")
    return checkpoint_dir


# %%
# The page keeps a copy of the state at every ``async_save`` call and compares
# every checkpoint with it, bit for bit. It also decides each race, always the
# same way: DCP's copy starts only when the loop waits for
# ``staging_completion``, an upload writes only when it waits for
# ``upload_completion``, the latest moments any loop allows (as with a large
# model on a busy host). A hazard then always hits, and a fix must hold even
# so. The last section lets the races run free.
#
# The pattern that works, for a model without forward-mutated state
# ------------------------------------------------------------------
# The loop from the DefaultStager recipe: save, run the next forward and
# backward while staging runs, wait for ``staging_completion`` right before
# ``optimizer.step()``, the first line that changes the weights, and for the
# upload at the end of the step (hazard 3 shows why).
#
# On a GPU, every loop synchronises the compute stream right before
# ``async_save``, after building the state dict: the stager's stream does not
# wait for yours (:ref:`sphx_glr_recipes_stager_stream_recipe.py`).


def wait_before_step(model, optimizer, data, stager, checkpoint_dir, saves=SAVES):
    for save in range(saves):
        writer = host_writer(os.path.join(checkpoint_dir, f"save-{save}"))
        state = checkpoint_state(model, optimizer)
        if torch.accelerator.is_available():
            torch.accelerator.current_stream().synchronize()  # the stager does not wait
        response = dcp.async_save(
            state, storage_writer=writer, async_stager=stager, process_group=checkpoint_group()
        )
        optimizer.zero_grad()
        model(next(data)).pow(2).mean().backward()  # overlaps staging
        response.staging_completion.result()
        optimizer.step()
        response.upload_completion.result()


# %%

with proofs.saves_given_to(dcp, "async_save") as saved, faults.copies_held_until_waited(dcp):
    run_on_ranks(run_loop, wait_before_step)
proofs.every_checkpoint_as_saved("wait-before-step-exact", saved)

# %%
# Hazard 1: ``optimizer.step()`` before ``staging_completion``
# ------------------------------------------------------------
# Forget the wait, or put it after the step, and the optimizer updates the
# weights, Adam's moments and its step counters in place while (or before)
# they are copied: every tensor is from the step after the save (left to
# chance, a mix of both). The fix is the pattern above.


def step_before_staging(model, optimizer, data, stager, checkpoint_dir, saves=SAVES):
    for save in range(saves):
        writer = host_writer(os.path.join(checkpoint_dir, f"save-{save}"))
        state = checkpoint_state(model, optimizer)
        if torch.accelerator.is_available():
            torch.accelerator.current_stream().synchronize()  # the stager does not wait
        response = dcp.async_save(
            state, storage_writer=writer, async_stager=stager, process_group=checkpoint_group()
        )
        optimizer.zero_grad()
        model(next(data)).pow(2).mean().backward()
        optimizer.step()  # BUG: staging may still be copying these tensors
        response.staging_completion.result()
        response.upload_completion.result()


# %%

with proofs.saves_given_to(dcp, "async_save") as saved, faults.copies_held_until_waited(dcp):
    run_on_ranks(run_loop, step_before_staging)
proofs.every_checkpoint_torn("step-before-staging-torn", saved)

# %%
# Hazard 2: a forward pass that changes the state
# -----------------------------------------------
# In training mode ``BatchNorm`` updates ``running_mean``, ``running_var`` and
# ``num_batches_tracked`` in place, in the forward pass, and they are in the
# state dict. The pattern above overlaps staging with the next forward, so the
# very same loop races with them, although it waits before ``optimizer.step()``;
# so does any module that updates a buffer in ``forward`` (a running statistic,
# an EMA kept as a buffer). The same loop, the BatchNorm model:

with proofs.saves_given_to(dcp, "async_save") as saved, faults.copies_held_until_waited(dcp):
    run_on_ranks(run_loop, wait_before_step, True)
BUFFERS = proofs.named("running_mean", "running_var", "num_batches_tracked")
proofs.every_checkpoint_torn("batch-norm-forward-torn", saved, differ=BUFFERS)

# %%
# Two fixes. The simple one: in the step after a save, wait for staging before
# the forward pass. Staging then overlaps nothing on this step's training
# thread but what runs before the forward (data loading, logging); it still
# overlaps the upload, which is most of a save.


def wait_before_forward(model, optimizer, data, stager, checkpoint_dir, saves=SAVES):
    for save in range(saves):
        writer = host_writer(os.path.join(checkpoint_dir, f"save-{save}"))
        state = checkpoint_state(model, optimizer)
        if torch.accelerator.is_available():
            torch.accelerator.current_stream().synchronize()  # the stager does not wait
        response = dcp.async_save(
            state, storage_writer=writer, async_stager=stager, process_group=checkpoint_group()
        )
        batch = next(data)  # overlaps staging
        response.staging_completion.result()  # before anything changes the state
        train_step(model, optimizer, batch)
        response.upload_completion.result()


# %%

with proofs.saves_given_to(dcp, "async_save") as saved, faults.copies_held_until_waited(dcp):
    run_on_ranks(run_loop, wait_before_forward, True)
proofs.every_checkpoint_as_saved("wait-before-forward-exact", saved)

# %%
# The other keeps the overlap: clone the few tensors the forward pass changes
# at the save call (buffers are small), and hand the stager the clones. On a
# GPU the synchronisation before ``async_save`` must come after the cloning:
# it is what makes the clones complete before the stager copies them. (A third
# way: leave such buffers out of the checkpoint and recompute them after
# loading, for BatchNorm with a few forward passes in training mode.)


def stage_buffers_at_save_call(model, optimizer, data, stager, checkpoint_dir, saves=SAVES):
    for save in range(saves):
        writer = host_writer(os.path.join(checkpoint_dir, f"save-{save}"))
        state = checkpoint_state(model, optimizer)
        for name, buffer in model.named_buffers():
            state["model"][name] = buffer.clone()  # the forward pass cannot touch these
        if torch.accelerator.is_available():
            torch.accelerator.current_stream().synchronize()  # the clones are done, too
        response = dcp.async_save(
            state, storage_writer=writer, async_stager=stager, process_group=checkpoint_group()
        )
        optimizer.zero_grad()
        model(next(data)).pow(2).mean().backward()  # overlaps staging again
        response.staging_completion.result()
        optimizer.step()
        response.upload_completion.result()


# %%

with proofs.saves_given_to(dcp, "async_save") as saved, faults.copies_held_until_waited(dcp):
    run_on_ranks(run_loop, stage_buffers_at_save_call, True)
proofs.every_checkpoint_as_saved("stage-buffers-exact", saved)

# %%
# Hazard 3: the next save before ``upload_completion``
# ----------------------------------------------------
# A reused ``DefaultStager`` keeps one host buffer per tensor and copies into
# it again on every save: that is why reusing it is cheap, and why
# ``upload_completion`` matters for correctness, not only for memory. Start
# the next save before the previous upload has written (writing is slower
# than a step: a large model, a slow file system), and the next staging
# overwrites what that upload was about to write. The page checks all but the
# last checkpoint, which no save follows. Uploads in flight together could
# pair up their collectives wrongly on one group: each save has its own.


def next_save_before_upload(model, optimizer, data, stager, checkpoint_dir, saves=SAVES):
    uploads = []
    for save in range(saves):
        writer = host_writer(os.path.join(checkpoint_dir, f"save-{save}"))
        state = checkpoint_state(model, optimizer)
        if torch.accelerator.is_available():
            torch.accelerator.current_stream().synchronize()  # the stager does not wait
        # BUG: the previous upload may still be reading the stager's buffers.
        response = dcp.async_save(
            state, storage_writer=writer, async_stager=stager, process_group=checkpoint_group(save)
        )
        response.staging_completion.result()
        train_step(model, optimizer, next(data))
        uploads.append(response.upload_completion)
    for upload in uploads:
        upload.result()


# %%

with proofs.saves_given_to(dcp, "async_save") as saved, faults.writes_held_until_waited(dcp):
    run_on_ranks(run_loop, next_save_before_upload)
proofs.every_checkpoint_torn("next-save-torn", saved, but_last=True)

# %%
# The fix: wait for the previous upload right before the next save. The
# upload still overlaps training, all the steps between two saves.


def wait_for_upload_before_next_save(model, optimizer, data, stager, checkpoint_dir, saves=SAVES):
    previous = None
    for save in range(saves):
        writer = host_writer(os.path.join(checkpoint_dir, f"save-{save}"))
        state = checkpoint_state(model, optimizer)
        if previous is not None:
            previous.upload_completion.result()  # the stager's buffers are free again
        if torch.accelerator.is_available():
            torch.accelerator.current_stream().synchronize()  # the stager does not wait
        previous = dcp.async_save(
            state, storage_writer=writer, async_stager=stager, process_group=checkpoint_group()
        )
        previous.staging_completion.result()
        train_step(model, optimizer, next(data))
    previous.upload_completion.result()


# %%

with proofs.saves_given_to(dcp, "async_save") as saved, faults.writes_held_until_waited(dcp):
    run_on_ranks(run_loop, wait_for_upload_before_next_save)
proofs.every_checkpoint_as_saved("wait-for-upload-exact", saved, but_last=True)

# %%
# Hazard 4: Python values in the state dict
# -----------------------------------------
# The stager deep-copies the whole state dict in its background thread, not
# only the tensors: a dict of training progress passed by reference is copied
# when the stager reaches it. A loop that updates it in place right after the
# save call (a sample counter advanced when the next batch arrives) saves the
# new value, and a run resumed from it skips data. A plain ``int`` at the top
# level is safe: ``async_save`` copies the top level of the dict in the call.


def progress_updated_after_save(model, optimizer, data, stager, checkpoint_dir, saves=SAVES):
    progress = {"step": 1, "samples_seen": BATCH}
    for save in range(saves):
        writer = host_writer(os.path.join(checkpoint_dir, f"save-{save}"))
        state = {**checkpoint_state(model, optimizer), "progress": progress}
        if torch.accelerator.is_available():
            torch.accelerator.current_stream().synchronize()  # the stager does not wait
        response = dcp.async_save(
            state, storage_writer=writer, async_stager=stager, process_group=checkpoint_group()
        )
        batch = next(data)
        progress["samples_seen"] += len(batch)  # BUG: the stager may not have copied it yet
        optimizer.zero_grad()
        model(batch).pow(2).mean().backward()
        response.staging_completion.result()
        optimizer.step()
        progress["step"] += 1
        response.upload_completion.result()


# %%

with proofs.saves_given_to(dcp, "async_save") as saved, faults.copies_held_until_waited(dcp):
    run_on_ranks(run_loop, progress_updated_after_save)
proofs.every_checkpoint_torn("progress-torn", saved, differ=["progress.samples_seen"])

# %%
# The fix: a copy of the dict at the save call, ``dict(progress)``.


def progress_copied_at_save_call(model, optimizer, data, stager, checkpoint_dir, saves=SAVES):
    progress = {"step": 1, "samples_seen": BATCH}
    for save in range(saves):
        writer = host_writer(os.path.join(checkpoint_dir, f"save-{save}"))
        state = {**checkpoint_state(model, optimizer), "progress": dict(progress)}
        if torch.accelerator.is_available():
            torch.accelerator.current_stream().synchronize()  # the stager does not wait
        response = dcp.async_save(
            state, storage_writer=writer, async_stager=stager, process_group=checkpoint_group()
        )
        batch = next(data)
        progress["samples_seen"] += len(batch)  # the checkpoint has its own copy
        optimizer.zero_grad()
        model(batch).pow(2).mean().backward()
        response.staging_completion.result()
        optimizer.step()
        progress["step"] += 1
        response.upload_completion.result()


# %%

with proofs.saves_given_to(dcp, "async_save") as saved, faults.copies_held_until_waited(dcp):
    run_on_ranks(run_loop, progress_copied_at_save_call)
proofs.every_checkpoint_as_saved("progress-copied-exact", saved)

# %%
# How often the races hit when nothing decides them
# -------------------------------------------------
# The four broken loops, with nothing held: exactly the code above. What they
# count is luck and timing on the machine that built this page, so the page
# also measures what decides the races. Stepping early, BatchNorm and Python
# values are hit when the copy has not finished by the time the loop gets
# there; the next save, whenever a save takes longer than a loop step.

BROKEN_LOOPS = [  # (loop, with BatchNorm, saves: the last upload has no next save)
    (step_before_staging, False, 8),
    (wait_before_step, True, 8),
    (next_save_before_upload, False, 9),
    (progress_updated_after_save, False, 8),
]


def broken_loops_left_to_chance():
    under = os.path.join(WORK_DIR, "left-to-chance")
    return [run_loop(loop, bn, saves, under) for loop, bn, saves in BROKEN_LOOPS]


# %%

with proofs.saves_given_to(dcp, "async_save") as chance, timing.save_timeline(dcp) as timeline:
    directories = run_on_ranks(broken_loops_left_to_chance)[0]


# %%
# Each loop's checkpoints against their saves, how long the copy still ran
# after ``async_save`` returned and how long a whole save took (rank 0); and,
# for the next save's race, a save against a loop step (from one save call to
# the next):

measured = timing.torn_and_timed(chance, timeline, directories, ("next_save_before_upload",))
results.record("left_to_chance", measured)
race = measured["next_save_before_upload"]  # in milliseconds
verdict = stats.verdict("a save", race["save"], "a loop step", race["between_calls"], "s", 1e-3)
print(stats.wrapped(verdict[0]))
figures.Table(
    ["loop", "not the saved state", "copy after async_save returned", "a save"],
    [
        [loop, f"{m['torn']} of {m['checked']}"]
        + [stats.shown(m["copy_after_return"], "ms"), stats.shown(m["save"], "ms")]
        for loop, m in measured.items()
    ],
)

# %%
# The rules, in one loop, as a training script for ``torchrun``
# --------------------------------------------------------------
# * On a GPU, synchronise the compute stream right before every
#   ``async_save``, after building the state dict (clones included).
# * Wait for ``staging_completion`` before the first line that changes any
#   tensor in the saved state: ``optimizer.step()`` for most models, the
#   forward pass for models whose forward updates buffers (or clone those
#   buffers at the save call, as here).
# * Wait for the previous ``upload_completion`` before the next save that uses
#   the same stager: its upload still reads the stager's buffers.
# * Pass copies of Python values the loop keeps updating.


def every_rule_kept(model, optimizer, data, stager, checkpoint_dir, saves=SAVES):
    progress, previous = {"step": 1, "samples_seen": BATCH}, None
    for save in range(saves):
        writer = host_writer(os.path.join(checkpoint_dir, f"save-{save}"))
        state = {**checkpoint_state(model, optimizer), "progress": dict(progress)}
        for name, buffer in model.named_buffers():
            state["model"][name] = buffer.clone()  # the forward pass cannot touch these
        if previous is not None:
            previous.upload_completion.result()  # the stager's buffers are free again
        if torch.accelerator.is_available():
            torch.accelerator.current_stream().synchronize()  # the stager does not wait
        previous = dcp.async_save(
            state, storage_writer=writer, async_stager=stager, process_group=checkpoint_group()
        )
        batch = next(data)
        progress["samples_seen"] += len(batch)
        optimizer.zero_grad()
        model(batch).pow(2).mean().backward()  # overlaps staging
        previous.staging_completion.result()  # before the step changes the saved tensors
        optimizer.step()
        progress["step"] += 1
    previous.upload_completion.result()


# %%
# In your own job ``torchrun`` starts the ranks, and ``main()`` does what
# ``run_on_ranks`` did above: set the device, create the process group, run
# the loop, destroy the groups once every rank's last upload is done. Every
# rank must see the checkpoint directory (``shared_tempdir`` here; on several
# machines, a shared file system). Save it as ``train.py`` with the functions
# above, and:
#
# .. code-block:: bash
#
#    torchrun --nproc-per-node=2 train.py
#
# The cell runs ``main()`` as ``torchrun`` would, and the page holds and
# checks every save as above.


def main(checkpoint_dir):
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo")
    checkpoint_group.cache_clear()  # a group made under an earlier default group is gone
    try:
        run_loop(every_rule_kept, True, SAVES, checkpoint_dir)
        dist.barrier()  # every rank's last upload is done before the groups go
    finally:
        dist.destroy_process_group()


# %%

with (
    proofs.saves_given_to(dcp, "async_save") as saved,
    faults.copies_held_until_waited(dcp),
    faults.writes_held_until_waited(dcp),
    proofs.writers_given_to(dcp) as writers,
):
    run_as_torchrun(main, os.path.join(WORK_DIR, "torchrun"))
proofs.every_checkpoint_as_saved("every-rule-kept-exact", saved)
proofs.no_copy_ahead("host-writer-copies-nothing-ahead", writers)

# %%
# Clean up
# --------

shutil.rmtree(WORK_DIR, ignore_errors=True)
print(f"removed {WORK_DIR}: {not os.path.exists(WORK_DIR)}")

# %%
# What to read next
# -----------------
# * :ref:`sphx_glr_recipes_default_stager_recipe.py`: the whole loop and the
#   full list of rules to paste into yours.
# * :ref:`sphx_glr_recipes_async_save_recipe.py`: ``async_save`` without a
#   stager of your own, and a checkpoint process.
# * :doc:`/troubleshooting`: the same failures, starting from the symptoms.
