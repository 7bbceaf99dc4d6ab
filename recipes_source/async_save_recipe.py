"""
Asynchronous saving with dcp.async_save
=======================================

``dcp.save`` stops training until the checkpoint is on storage; ``dcp.async_save``
only while it copies the state to host memory, and a background thread (or
process) writes that copy while training goes on. This recipe builds a loop
around ``async_save``, measures what each way of checkpointing costs the loop,
and proves that the checkpoint holds the state at the moment of the save.

.. grid:: 2

    .. grid-item-card:: :octicon:`mortar-board;1em;` What you will learn
       :class-card: card-prerequisites

       * What blocks a loop in ``dcp.save``, and what ``async_save`` takes off it
       * A loop that checkpoints with ``async_save``: a process group of its
         own, one save in flight, the last save awaited
       * Reuse one ``DefaultStager``; save from a checkpoint process; on a GPU,
         what pinned staging buffers cost and buy, measured
       * Resume from the newest complete checkpoint, bit for bit the saved state

    .. grid-item-card:: :octicon:`list-unordered;1em;` Prerequisites
       :class-card: card-prerequisites

       * PyTorch: see :doc:`/versions`
       * CPU (gloo) or one GPU per rank (NCCL, plus gloo for checkpointing)
       * :ref:`sphx_glr_recipes_save_load_recipe.py`: ``dcp.save``,
         ``dcp.load`` and the ``AppState`` wrapper
"""

# %%
# Setup
# -----

import os
import re
import shutil

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from page_tools import figures, memory, observe, processes, proofs, results, stats, timing
from rank_launcher import run_as_torchrun, run_on_one_process, run_on_ranks, shared_tempdir
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.fsdp import fully_shard

WORK_DIR = shared_tempdir("dcp-async-save-")
print(f"torch {torch.__version__}; checkpoints go under {WORK_DIR}")


# %%
# A model with a checkpoint worth waiting for
# -------------------------------------------
# A few wide linear layers, sharded with FSDP2, trained with Adam: little
# compute, but a checkpoint three times the weights (weighed below).
# (Every page uses these same few definitions; only the sizes change.)

WIDTH, DEPTH, BATCH, LR = 1024, 3, 8, 1e-3


class ToyModel(nn.Module):
    def __init__(self, width=WIDTH, depth=DEPTH):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))

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
        # Handles FSDP's FQNs and fills in optimizer state keyed by FQN.
        model_state_dict, optimizer_state_dict = get_state_dict(self.model, self.optimizer)
        if torch.accelerator.is_available():
            # A stager copying on its own stream would not wait for kernels launched here.
            torch.accelerator.current_stream().synchronize()
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
    for module in (*model.layers, model):  # each layer, then the rest, as FSDP2 intends:
        fully_shard(module)  # parameters become DTensors; one all-gather per layer as it runs
    optimizer = torch.optim.Adam(model.parameters(), lr=LR)
    return model, optimizer


def train_step(model, optimizer):
    optimizer.zero_grad()
    loss = model(torch.rand(BATCH, WIDTH, device=device_for_this_rank())).pow(2).mean()
    loss.backward()
    optimizer.step()
    return loss.item()  # waits for the GPU, as logging the loss does


# %%
# The checkpoint has its full size from the first save on: ``get_state_dict``
# finds Adam without state and creates it with one step of zero gradients at
# learning rate zero. The moments stay zero (not with L2 ``weight_decay``,
# which Adam adds to the gradient), but Adam's ``step`` becomes 1, saved and
# live: a run that saves before it trains takes its first step as step 2.


def adam_before_training():
    model = ToyModel()
    optimizer = torch.optim.Adam(model.parameters(), lr=LR)
    state_dict = AppState(model, optimizer).state_dict()
    saved_step = state_dict["optim"]["state"]["layers.0.weight"]["step"].item()
    live_step = optimizer.state[model.layers[0].weight]["step"].item()
    print(f"Adam's step before any training: {saved_step:.0f} saved, {live_step:.0f} live")
    parameters = sum(p.numel() for p in model.parameters())
    print(f"{parameters / 1e6:.1f} M parameters ({parameters * 4 / 1e6:.1f} MB of fp32 weights)")
    return saved_step, live_step, parameters


# %%
# The page weighs what ``AppState.state_dict()`` returned (Adam's two moments):

with observe.watch(AppState, "state_dict", lambda call: memory.tensor_bytes(call.result)) as sizes:
    saved_step, live_step, parameters = run_on_one_process(adam_before_training)
checkpoint_bytes = results.record("checkpoint_bytes", sizes.last()[0])
results.claim("adam-has-state-before-training", saved_step == live_step == 1, "Adam's step: 1")
results.claim(
    "checkpoint-is-three-times-the-weights",
    3 <= checkpoint_bytes / (4 * parameters) < 3.001,
    f"a checkpoint: {checkpoint_bytes / 1e6:.1f} MB, "
    f"{checkpoint_bytes / parameters / 4:.4f} times the weights",
)


# %%
# What blocks the loop in ``dcp.save``
# ------------------------------------
# A save goes through three phases:
#
# 1. **collect**: ``AppState.state_dict()`` gathers references to the tensors;
# 2. **stage**: copy them to host memory. ``dcp.save`` copies from a GPU while
#    it writes (on CPU it writes from the live tensors); ``async_save`` must
#    copy first, so that training can change the tensors during the write;
# 3. **plan, serialise, write**: the ranks agree on a plan, each writes and
#    syncs its ``.distcp`` file, and rank 0 writes ``.metadata`` last.
#
# ``dcp.save`` runs all of it while the loop waits; ``async_save`` runs the first two and
# hands phase 3 to a background thread. Below, one statement per phase, staging with a
# :class:`~torch.distributed.checkpoint.staging.DefaultStager` (what ``async_save`` uses,
# every option off, given no stager and no writer that is one: ``FileSystemWriter`` is).
# Every stager on this page copies in the calling thread; the next recipe overlaps it.
#
# .. versionadded:: 2.9
#    ``DefaultStager`` and ``StagingOptions``.


def staging_options(use_async_staging, checkpoint_process=False):
    """How every save on this page stages its copy, chosen from the machine."""
    on_gpu = torch.accelerator.is_available()
    return StagingOptions(
        use_pinned_memory=on_gpu,  # page-locked memory only speeds up copies from a device
        use_shared_memory=checkpoint_process,  # only a checkpoint *process* reads it in place
        use_async_staging=use_async_staging,
        use_non_blocking_copy=on_gpu,
    )


def save_in_three_phases(checkpoint_root, attempts=3):
    model, optimizer = build_sharded_model(seed=0)
    torch.manual_seed(100 + dist.get_rank())  # each rank trains on its own data
    train_step(model, optimizer)
    app_state = AppState(model, optimizer)
    checkpoint_group = dist.new_group(backend="gloo")
    for attempt in range(attempts):
        state_dict = app_state.state_dict()  # 1. collect
        stager = DefaultStager(staging_options(use_async_staging=False))
        staged = stager.stage(state_dict)  # 2. stage
        staged_dir = os.path.join(checkpoint_root, f"staged-{attempt}")
        dcp.save(staged, checkpoint_id=staged_dir, process_group=checkpoint_group)  # 3. write
        stager.close()
        # The same state with plain dcp.save, for comparison: all three phases in one call.
        live_dir = os.path.join(checkpoint_root, f"live-{attempt}")
        dcp.save({"app": app_state}, checkpoint_id=live_dir, process_group=checkpoint_group)
    dist.destroy_process_group(checkpoint_group)
    if dist.get_rank() == 0:
        print(f"staged-{attempt}/ and live-{attempt}/ hold {sorted(os.listdir(live_dir))}")


# %%
# The page times each phase on every rank and weighs each staged copy: what
# ``async_save`` costs in memory, per save in flight, until its upload ends.

with (
    timing.spans(AppState, "state_dict") as collected,
    timing.spans(DefaultStager, "stage") as staged,
    timing.spans(dcp, "save", label=lambda call: call.kwargs["checkpoint_id"]) as saved,
    observe.watch(DefaultStager, "stage", lambda call: memory.tensor_bytes(call.result)) as copy,
):
    run_on_ranks(save_in_three_phases, os.path.join(WORK_DIR, "phases"))
phases = {  # each attempt on the slowest rank: collectives wait for it
    "1. collect the state dict": timing.longest(collected, lambda span: not span.within),
    "2. stage: copy it to host memory": timing.longest(staged),
    "3. plan, serialise, write, .metadata": timing.longest(saved, timing.label_has("staged-")),
    "dcp.save (one call)": timing.longest(saved, timing.label_has("live-")),
}
phases["async_save (1 + 2)"] = stats.added(*list(phases.values())[:2])
results.record("phases_s", phases)
stats.claim_less_paired(
    "async-save-blocks-less", phases, "async_save (1 + 2)", "dcp.save (one call)", "ms", 1e3
)
results.claim(
    "staged-copies-are-the-checkpoint",
    abs(sum(results.record("staged_bytes", copy.last())) / checkpoint_bytes - 1) < 1e-3,
    f"the ranks' staged copies, {[round(b / 1e6, 1) for b in copy.last()]} MB, are the checkpoint",
)
figures.medians(["phase, and what blocks the loop", "ms (median of 3, slowest rank)"], phases, 1e3)


# %%
# A training loop with ``async_save``
# -----------------------------------
# The loop checkpoints every ``SAVE_EVERY`` steps. Three rules make it safe
# (:doc:`/troubleshooting` has what breaking each one looks like):
#
# * **Checkpointing gets its own gloo process group.** The upload runs
#   collectives from a background thread while the loop runs FSDP's: on one
#   group they can interleave differently on different ranks and deadlock. It
#   also gives ``async_save`` the CPU backend it needs when training uses NCCL.
# * **At most one save in flight.** A second ``async_save`` does not queue:
#   both uploads run, their collectives can match each other's and hang.
# * **Wait for the last save before the group is destroyed**: without it the
#   checkpoint is torn (:ref:`sphx_glr_recipes_torn_checkpoints_recipe.py`), or
#   silently holds one rank's data (:ref:`sphx_glr_recipes_verify_checkpoint_recipe.py`).
#
# It also saves after the first step and waits for it: a storage problem shows up at once,
# one-time costs are paid early, and a checkpoint process (below) exists on every rank.
# ``async_save`` returns the upload's ``Future`` (an ``AsyncSaveResponse`` with asynchronous
# staging: the :ref:`next recipe <sphx_glr_recipes_default_stager_recipe.py>`).

NUM_STEPS, SAVE_EVERY = 11, 3
LAST_SAVE = NUM_STEPS // SAVE_EVERY * SAVE_EVERY  # the steps after it keep training


def train(checkpoint_root, stager=None, **async_save_options):
    """Train NUM_STEPS steps and checkpoint every SAVE_EVERY, one save in flight."""
    model, optimizer = build_sharded_model(seed=0)
    torch.manual_seed(100 + dist.get_rank())  # each rank trains on its own data
    state_dict = {"app": AppState(model, optimizer)}
    checkpoint_group = dist.new_group(backend="gloo")
    upload, saved_at, losses = None, [], []  # the save in flight, if any
    for step in range(1, NUM_STEPS + 1):
        losses.append(train_step(model, optimizer))
        if step != 1 and step % SAVE_EVERY != 0:
            continue
        if upload is not None:
            upload.result()  # at most one save in flight
        path = os.path.join(checkpoint_root, f"step-{step}")
        upload = dcp.async_save(
            state_dict,
            checkpoint_id=path,
            # A stager's copy is on the host: no copy-ahead from a GPU, no CUDA context on GPU 0.
            storage_writer=dcp.FileSystemWriter(path, per_thread_copy_ahead=0) if stager else None,
            process_group=checkpoint_group,
            async_stager=stager,
            **async_save_options,
        )
        if step == 1:
            upload.result()  # the first save: check the storage, pay one-time costs
        saved_at.append(step)
    upload.result()  # the last save, before its group goes away
    dist.destroy_process_group(checkpoint_group)
    print(f"loss {losses[0]:.4e} at step 1, {losses[-1]:.4e} at {NUM_STEPS}; saved at {saved_at}")


# %%
# Run it with ``async_save``'s default staging: every save copies the state
# into new host memory, freed when its upload completes. The page times the
# loop and keeps the state at the last save call and at the end of training.

with (
    timing.async_save_loop(train_step) as plain,
    proofs.state_at_save_and_end(proofs.saving_into(f"step-{LAST_SAVE}")) as plain_state,
):
    run_on_ranks(train, os.path.join(WORK_DIR, "async-save"))


# %%
# Reuse one stager for every save
# -------------------------------
# New host memory for every save must be allocated and faulted in (and on a GPU, pageable
# memory may copy slower than page-locked: measured below). A ``DefaultStager`` passed as
# ``async_stager`` to every save keeps the buffers of its first save and copies into them at
# every later one, holding them for the whole run; close it after the last save to free (and
# unpin) them. It finds a buffer by the storage of the tensor it copies, so ``state_dict()``
# must return the live tensors, not clones; and waiting for the previous save keeps the next
# copy from overwriting a buffer that upload still writes out.
#
# Prefer it to ``FileSystemWriter(path, cache_staged_state_dict=True)``:
# ``async_save`` stages through a writer only for backward compatibility; that
# writer's ``close()`` does nothing, so its buffers live as long as it; and its
# ``.pin_memory()`` rounds every buffer up to a power of two, where
# ``DefaultStager`` pins each storage's own bytes (measured below, on a GPU).


def train_with_one_stager(checkpoint_root):
    stager = DefaultStager(staging_options(use_async_staging=False))
    train(checkpoint_root, stager)
    stager.close()  # frees the buffers it kept (and unpins them, on GPU)


# %%
# The page notes where each staged copy lives. Whether reuse shortened the
# stall here is for the numbers to say:

with (
    timing.async_save_loop(train_step) as one_stager,
    proofs.state_at_save_and_end(proofs.saving_into(f"step-{LAST_SAVE}")) as one_state,
    observe.watch(DefaultStager, "stage", lambda call: memory.addresses(call.result)) as buffers,
):
    run_on_ranks(train_with_one_stager, os.path.join(WORK_DIR, "one-stager"))
results.claim(
    "one-stager-reuses-its-buffers",
    all(len({tuple(storages) for storages in s}) == 1 for s in buffers.by_rank.values()),
    f"each of {buffers.count()} saves copied into the storages of its rank's first",
)
stats.say("a reused stager's stall", one_stager.stalls(), "async_save's", plain.stalls(), "ms", 1e3)


# %%
# What pinning buys, measured on a GPU
# ------------------------------------
# Pinned memory matters only where there is a device to copy from: a build on
# a GPU measures, in processes of its own, the host memory that pinned staging
# buffers take for three of GPT-2 small's weights (the writer's cache against
# ``DefaultStager``), and the speed of a 256 MiB copy from the GPU into new
# pageable, reused pageable and reused pinned memory.

pinning = memory.pinning_on_gpu(os.path.join(WORK_DIR, "pinned"))  # None without a GPU
memory.claim_pins_the_state_size("stager-pins-the-state-size", pinning)
memory.claim_writer_pins_more("writer-cache-pins-more", pinning)
timing.claim_pinned_copy_is_faster("pinned-copy-beats-new-pageable-memory", pinning)
pinning_numbers = memory.pinning_numbers(pinning)  # {} without a GPU
figures.Table(["on the GPU", ""], list(pinning_numbers.items())) if pinning else None


# %%
# Save from a checkpoint process
# ------------------------------
# With ``async_checkpointer_type=AsyncCheckpointerType.PROCESS`` the upload
# runs in a checkpoint process (one per rank) instead of a trainer's thread.
#
# * **What it buys**: planning and serialising are Python; in a thread they
#   hold the GIL that the trainer's loop needs, a process has its own.
# * **What it costs**: a process per rank with its own torch (and, on a GPU
#   machine, a CUDA context), started by the first save, whose upload takes
#   longer (measured below). It is spawned: keep a script's top level under
#   ``if __name__ == "__main__":``. **Await that first save on every rank**
#   before the next one: a save that finds no process yet broadcasts the new
#   group's address, and a rank whose process already exists skips that
#   broadcast; the ranks then hang (a rule for correctness, not a cost).
# * **Its own process group**, a gloo world that the processes build on the
#   first call from the ``process_group`` you pass, which is not forwarded
#   to the save (torch 2.13).
# * **Shared memory.** The staged copy reaches the process through
#   ``/dev/shm``, one tmpfs per machine or container: it must hold the copies
#   of all local ranks (Docker's default is 64 MB: ``--shm-size``). Staged
#   there (``checkpoint_process=True``), it is read in place; staged without,
#   its storage is moved there anyway, one more copy (one more save shows it).
# * **Its log**: every request, at INFO level, on the standard error it
#   inherits (no switch turns it off).


def train_in_checkpoint_process(checkpoint_root):
    stager = DefaultStager(staging_options(use_async_staging=False, checkpoint_process=True))
    process = AsyncCheckpointerType.PROCESS
    train(checkpoint_root, stager, async_checkpointer_type=process)
    stager.close()
    # One more save, staged without shared memory (unpinned too: the handover would move
    # the storage and free the page-locked buffer without unregistering it).
    unshared = DefaultStager(StagingOptions(False, False, False, False))
    state_dict = {"weights": torch.rand(256, 1024)}
    checkpoint_dir = os.path.join(checkpoint_root, "unshared")
    dcp.async_save(
        state_dict,
        storage_writer=dcp.FileSystemWriter(checkpoint_dir, per_thread_copy_ahead=0),
        async_checkpointer_type=process,
        async_stager=unshared,
    ).result()
    unshared.close()


# %%
# The page sends each checkpoint process's log to a file, lists each rank's
# helper processes when a stager is closed, and looks at each staged copy:

with (
    timing.async_save_loop(
        train_step, where=proofs.saving_into("step-", anywhere=True)
    ) as in_process,
    proofs.state_at_save_and_end(proofs.saving_into(f"step-{LAST_SAVE}")) as in_state,
    processes.stderr_of_started_processes(os.path.join(WORK_DIR, "logs")) as log_dir,
    observe.watch(DefaultStager, "close", lambda call: processes.helpers(), before=True) as helpers,
    memory.staged_copies_shared(DefaultStager, dcp) as shared,
):
    run_on_ranks(train_in_checkpoint_process, os.path.join(WORK_DIR, "process"))
processes.claim_one_per_rank("one-checkpoint-process-per-rank", helpers, log_dir, requests=5)
results.claim(
    "first-process-upload-starts-the-process",
    in_process.saves()[0].upload > max(in_process.uploads()),
    f"the first upload, which starts the process, took {in_process.saves()[0].upload:.1f} s",
)
results.claim(
    "handover-moves-an-unshared-copy-into-shared-memory",
    all(not save["after_staging"] and save["after_upload"] for save in shared.last()),
    "staged without shared memory, in it after staging: {after_staging}, after the handover:"
    " {after_upload}".format(**shared.last()[0]),
)
print(f"/dev/shm: {results.record('dev_shm_bytes', memory.dev_shm_bytes()) / 2**30:.1f} GiB")
processes.helpers_table(helpers, processes.logs(log_dir), hide=os.path.join(WORK_DIR, "process"))


# %%
# Every way of saving, side by side
# ---------------------------------
# *Stall*: how long the loop was blocked at a save; *upload*: until the
# checkpoint was complete (medians of the saves after the first, slowest
# rank). *Slow-down*: the median step that started during an upload against
# one that started without (rank 0): on CPU the upload competes with training
# for the same cores; on a GPU it is what the upload's host work still costs.

runs = timing.summaries(
    {"async_save": plain, "one reused DefaultStager": one_stager, "checkpoint process": in_process}
)
stats.say("a process's stall", in_process.stalls(), "a thread's", plain.stalls(), "ms", 1e3)
results.claim(
    "uploads-overlap-training",
    all(run["steps_in_flight"] > 0 for run in results.record("strategies", runs).values()),
    "steps started during an upload: "
    + ", ".join(f"{run['steps_in_flight']} of {run['steps']}" for run in runs.values()),
)
headline = results.record(
    "headline",
    {
        "dcp.save stall ms": stats.summary(phases["dcp.save (one call)"])["median"] * 1e3,
        **{f"{name} stall ms": run["stall_ms"] for name, run in runs.items()},
        **memory.pinning_numbers(pinning),
    },
)
timing.strategies_table(runs, {"dcp.save (timed above)": headline["dcp.save stall ms"]})

# %%
# Each save of each run, on the slowest rank (the first save is awaited):

timing.saves_table({"async_save": plain, "one stager": one_stager, "process": in_process})


# %%
# Resume from the newest complete checkpoint
# ------------------------------------------
# DCP writes ``.metadata`` last: with a fresh directory for every save, a
# directory without it did not finish (in flight, or torn). Resume from the
# newest one that has it; ``load_checkpoint`` refuses the others. This holds
# only if you never reuse a directory and save with collectives (the default):
# :ref:`sphx_glr_recipes_torn_checkpoints_recipe.py` shows why.


class IncompleteCheckpointError(RuntimeError):
    pass


def is_complete(checkpoint_dir):
    return os.path.exists(os.path.join(checkpoint_dir, ".metadata"))


def latest_complete_checkpoint(checkpoint_root):
    """The ``step-N`` directory with the highest N that has ``.metadata``, or None."""
    matches = (re.fullmatch(r"step-(\d+)", name) for name in os.listdir(checkpoint_root))
    for step in sorted((int(match[1]) for match in matches if match), reverse=True):
        checkpoint_dir = os.path.join(checkpoint_root, f"step-{step}")
        if is_complete(checkpoint_dir):
            return checkpoint_dir
    return None


def load_checkpoint(checkpoint_dir, app_state):
    if checkpoint_dir is None or not is_complete(checkpoint_dir):
        raise IncompleteCheckpointError(f"incomplete checkpoint: {checkpoint_dir} has no .metadata")
    dcp.load({"app": app_state}, checkpoint_id=checkpoint_dir)


RUN_NAMES = ("async-save", "one-stager", "process")
for name in RUN_NAMES:
    saves = sorted(d for d in os.listdir(os.path.join(WORK_DIR, name)) if d.startswith("step-"))
    print(f"{name}/ complete:", {d: is_complete(os.path.join(WORK_DIR, name, d)) for d in saves})


# %%
# Training went on after the last save and changed the very tensors it was
# copied from. Load each run's newest complete checkpoint into a new model:


def resume(checkpoint_root):
    model, optimizer = build_sharded_model(seed=1)  # other weights: nothing matches by luck
    checkpoint_dir = latest_complete_checkpoint(checkpoint_root)
    load_checkpoint(checkpoint_dir, AppState(model, optimizer))
    if dist.get_rank() == 0:
        print(f"resumed from {os.path.relpath(checkpoint_dir, os.path.dirname(checkpoint_root))}")
    return model, optimizer


def resume_every_run(work_dir):
    for name in RUN_NAMES:
        resume(os.path.join(work_dir, name))


# %%
# The page compares each load with the state at the save call and at the end:

with proofs.state_after(dcp, "load") as resumed:
    run_on_ranks(resume_every_run, WORK_DIR)
results.claim(
    "every-save-is-complete",
    all(is_complete(f"{WORK_DIR}/{name}/step-{n}") for name in RUN_NAMES for n in (1, 3, 6, 9)),
    "every save of every run left its .metadata",
)
for index, watched in enumerate([plain_state, one_state, in_state]):
    run = RUN_NAMES[index]
    proofs.state_at_the_save(run, watched, proofs.nth_call(resumed, index), f"{run}/step-9")


# %%
# The same, as a training script for ``torchrun``
# -----------------------------------------------
# ``torchrun`` starts the ranks, and ``main()`` does what ``run_on_ranks`` did: set the
# device, create the group, train, resume, destroy the group. The root is a path every
# rank sees (``shared_tempdir`` here; across machines, a shared file system). Save it as
# ``train.py`` with the functions above and ``if __name__ == "__main__": main(sys.argv[1])``:
#
# .. code-block:: bash
#
#    torchrun --nproc-per-node=2 train.py /shared/checkpoints
#
# The cell runs ``main()`` as ``torchrun`` would: torchrun's environment, no group.


def main(checkpoint_root):
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo")
    try:
        train(checkpoint_root)
        resume(checkpoint_root)
        dist.barrier()  # no rank tears gloo down while another one still sends
    finally:
        dist.destroy_process_group()


run_as_torchrun(main, os.path.join(WORK_DIR, "torchrun"))


# %%
# Clean up
# --------

shutil.rmtree(WORK_DIR, ignore_errors=True)
print(f"removed {WORK_DIR}: {not os.path.exists(WORK_DIR)}")


# %%
# What to read next
# -----------------
# * :ref:`sphx_glr_recipes_torn_checkpoints_recipe.py`: a save that cannot finish.
# * :ref:`sphx_glr_recipes_default_stager_recipe.py`: overlap even the copy.
# * :ref:`sphx_glr_recipes_checkpoint_stall_benchmark.py`: each strategy at a larger size.
# * :doc:`/troubleshooting`: symptoms and fixes for the usual DCP failures.
