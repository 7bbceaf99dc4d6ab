"""
DCP and torch_checkpointing, side by side
=========================================

`torch_checkpointing <https://github.com/meta-pytorch/torch_checkpointing>`__
(Meta, pre-1.0) is the other asynchronous checkpointer a PyTorch job can
use: one ``CheckpointManager`` for save and load, plain ``{name: value}``
payloads, staging into host memory and a background *process* that writes.
This recipe runs the same resume loop with both libraries on the same
FSDP2-sharded model, shows what each one writes to disk, whether one reads
the other's checkpoint, and what each costs the loop on this machine.

.. grid:: 2

    .. grid-item-card:: :octicon:`mortar-board;1em;` What you will learn
       :class-card: card-prerequisites

       * The same save and resume written with ``dcp.async_save`` and with
         ``CheckpointManager``, behind one small interface
       * What a complete checkpoint looks like on disk for each: DCP's
         ``.metadata`` index, torch_checkpointing's renamed directory
       * That neither library reads the other's checkpoint
       * torch_checkpointing 0.1.1 on a CPU host: the staging options its
         troubleshooting guide gives, and direct I/O turned off
       * What each save costs the loop here, median and spread

    .. grid-item-card:: :octicon:`list-unordered;1em;` Prerequisites
       :class-card: card-prerequisites

       * PyTorch: see :doc:`/versions`
       * ``pip install torch_checkpointing==0.1.1`` (it needs torch 2.11 or newer)
       * CPU (gloo) or one GPU per rank (NCCL)
       * :ref:`sphx_glr_recipes_async_save_recipe.py` and
         :ref:`sphx_glr_recipes_resume_recipe.py`
"""

# %%
# Setup
# -----

import logging
import os
import shutil
import statistics
import textwrap
import time
from contextlib import nullcontext

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from page_tools import proofs, results, stats
from rank_launcher import run_as_torchrun, run_on_ranks, shared_tempdir
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.fsdp import fully_shard
from torch_checkpointing import CheckpointManager, ItemSpec, SyncCheckpointSaverConfig
from torch_checkpointing.config import AsyncCheckpointSaverConfig
from torch_checkpointing.default_resharder import DefaultResharder
from torch_checkpointing.staging import CheckpointStagerConfig
from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig
from torch_checkpointing.version import __version__ as torch_checkpointing_version

WORK_DIR = shared_tempdir("dcp-torch-checkpointing-")
print(f"torch {torch.__version__}, torch_checkpointing {torch_checkpointing_version}")


# %%
# The model and its state
# -----------------------
# The pieces every page of this site shares: a stack of ``Linear`` layers,
# sharded with FSDP2 over all ranks and trained with Adam, and the state DCP
# saves and loads.

WIDTH, DEPTH, BATCH, LR = 64, 2, 32, 1e-2


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


# %%
# Two checkpointers, one interface
# --------------------------------
# The loop below calls ``save``, ``load``, ``lock`` and ``close``; each
# library fills them in its own way.
#
# With DCP, ``async_save`` copies the state to host memory before it returns
# and writes in a thread, through a gloo group of its own (it needs a CPU
# backend). ``AppState`` gives DCP the model and optimizer state by name, and
# a plain ``step`` rides along. Staging is done when the call returns, so the
# optimizer step needs no lock.


class DCPCheckpointer:
    def __init__(self):
        self.group = dist.new_group(backend="gloo")  # checkpoints never share training's group
        self.upload = None

    def save(self, path, model, optimizer, step):
        self.wait()  # one checkpoint in flight at a time
        state = {"app": AppState(model, optimizer), "step": step}
        self.upload = dcp.async_save(state, checkpoint_id=path, process_group=self.group)

    def load(self, path, model, optimizer):
        state = {"app": AppState(model, optimizer), "step": 0}
        dcp.load(state, checkpoint_id=path, process_group=self.group)
        return state["step"]

    def lock(self):
        return nullcontext()

    def wait(self):
        if self.upload is not None:
            self.upload.result()
            self.upload = None

    def close(self):
        self.wait()
        dist.destroy_process_group(self.group)

    @staticmethod
    def is_complete(path):
        return os.path.exists(os.path.join(path, ".metadata"))  # written last, by rename


# %%
# ``CheckpointManager`` takes the model's and the optimizer's own
# ``state_dict()``: each rank saves its shards as they are and loads them back
# into the same layout. Its ``save`` stages into host memory in the background
# and hands the copy to a writer process; ``lock()`` holds the optimizer step
# until staging is done. On a CPU host:
#
# * ``use_direct_io=False``, needed: the file system backend opens every file
#   with ``O_DIRECT``; ext4 accepts that open, then fails the unaligned writes of
#   a ``torch.save`` file with ``OSError: [Errno 22] Invalid argument`` (below);
# * pinned memory and non-blocking copies only with CUDA, as its `troubleshooting
#   guide <https://github.com/meta-pytorch/torch_checkpointing/blob/main/docs/troubleshooting.md>`__
#   gives for CPU-only hosts (0.1.1's defaults already do; stated, for any version).


# Its writer process unpickles the state's DTensors where the job's process groups do not
# exist, and torch warns for each one ("pickling/unpickling of the DeviceMesh occurred before
# the PGs were created"), harmless for a writer. TORCH_LOGS, read by each process torch starts
# from here on, keeps torch.distributed's warnings out of their output.
os.environ.setdefault("TORCH_LOGS", "-distributed")


def checkpoint_manager(asynchronous=True, direct_io=False, items=None):
    on_gpu = torch.cuda.is_available()
    staging = CheckpointStagerConfig(use_pinned_memory=on_gpu, use_non_blocking_copy=on_gpu)
    if asynchronous:
        save = AsyncCheckpointSaverConfig(staging_config=staging)
    else:  # it writes in the save call and starts no writer process
        save = SyncCheckpointSaverConfig()
    return CheckpointManager(
        CheckpointManager.Config(
            save=save,
            storage_config=LocalFileSystemStorageConfig(use_direct_io=direct_io),
            items=items or {},
        )
    )


class TorchCheckpointingCheckpointer:
    def __init__(self):
        self.manager = checkpoint_manager()
        self.upload = None

    def save(self, path, model, optimizer, step):
        # The manager waits for the previous write before it stages the next one.
        state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step}
        self.upload = self.manager.save(path, state)

    def load(self, path, model, optimizer):
        into = {"model": model.state_dict(), "optimizer": None, "step": 0}
        restored = self.manager.load(path, into=into)  # model tensors: copied in place
        optimizer.load_state_dict(restored["optimizer"])  # None above: the whole saved state
        return restored["step"]

    def lock(self):
        return self.manager.lock()

    def wait(self):
        if self.upload is not None:
            self.upload.result()

    def close(self):
        self.manager.close()  # waits for the last write, stops the writer process

    @staticmethod
    def is_complete(path):
        return os.path.isdir(path)  # written as tmp_<name>, renamed when every rank is done


CHECKPOINTERS = {"DCP": DCPCheckpointer, "torch_checkpointing": TorchCheckpointingCheckpointer}


# %%
# The resume loop
# ---------------
# One loop for both: start from the newest complete checkpoint if there is
# one, train, save every ``SAVE_EVERY`` steps, and wait for the last save
# before returning. Each step's loss comes back, and what each save stalled
# the loop: the time in the save call, and the next step's wait in ``lock()``
# (after the last save, a wait in ``lock()`` before the loop returns: every
# save's staging counts, as DCP's does in its call).

SAVE_EVERY = 2


def newest_complete(checkpointer, directory):
    steps = [name for name in os.listdir(directory) if name.startswith("step-")]
    complete = [s for s in steps if checkpointer.is_complete(os.path.join(directory, s))]
    return os.path.join(directory, max(complete)) if complete else None


def train(checkpointer, directory, until_step):
    model, optimizer = build_sharded_model(seed=0)
    os.makedirs(directory, exist_ok=True)
    dist.barrier()  # every rank sees the same directory before it looks for a checkpoint
    newest, step, losses, waited = newest_complete(checkpointer, directory), 0, {}, []
    if newest is not None:
        step = checkpointer.load(newest, model, optimizer)
    while step < until_step:
        step += 1
        torch.manual_seed(1000 * step + dist.get_rank())  # this step's data, same on a resume
        inputs, targets = torch.rand(2, BATCH, WIDTH, device=device_for_this_rank())
        loss = (model(inputs) - targets).pow(2).mean()
        loss.backward()
        began = time.perf_counter()
        with checkpointer.lock():  # torch_checkpointing: until the last save's staging is done
            if waited and step % SAVE_EVERY == 1:  # the step after a save: its wait counts too
                waited[-1] += time.perf_counter() - began
            optimizer.step()
        optimizer.zero_grad()
        losses[step] = loss.item()
        if step % SAVE_EVERY == 0:
            began = time.perf_counter()
            checkpointer.save(f"{directory}/step-{step:04d}", model, optimizer, step)
            waited.append(time.perf_counter() - began)
    if waited and step % SAVE_EVERY == 0:  # the last step saved: no next step waits for it
        began = time.perf_counter()
        with checkpointer.lock():
            waited[-1] += time.perf_counter() - began
    checkpointer.wait()
    return {"resumed_from": newest and os.path.basename(newest), "losses": losses, "waited": waited}


# %%
# Stop, start again, compare
# --------------------------
# For each library: a run of 10 steps straight through, then a run that stops
# after step 6 and one started again in the same directory, which resumes
# from step 6. A job that dies for real, killed in the middle of a save, is
# :ref:`sphx_glr_recipes_resume_recipe.py`'s subject; here both stops are
# clean. The first save of a process starts what a library starts once (DCP's
# first-call set-up, torch_checkpointing's writer process), so the runs share
# one checkpointer.


def stop_and_resume(library, root):
    checkpointer = CHECKPOINTERS[library]()
    try:
        straight = train(checkpointer, f"{root}/straight", until_step=10)
        stopped = train(checkpointer, f"{root}/resumed", until_step=6)
        resumed = train(checkpointer, f"{root}/resumed", until_step=10)
    finally:
        checkpointer.close()
    losses = {**stopped["losses"], **resumed["losses"]}
    print(f"{library}: resumed from {resumed['resumed_from']}, loss at step 10 {losses[10]:.6f}")
    waited = straight["waited"][1:] + stopped["waited"] + resumed["waited"]  # not the first
    return {"straight": straight["losses"], "resumed": losses, "waited": waited}


RUNS = {
    library: run_on_ranks(stop_and_resume, library, os.path.join(WORK_DIR, library))
    for library in CHECKPOINTERS
}


# %%
# Every step's loss after the resume is the loss of the run that never
# stopped, bit for bit, on every rank, with each library; and the two
# libraries train alike.


for resumed_library, ranks_runs in RUNS.items():
    proofs.same_numbers(
        f"{resumed_library}-resume-same-losses",
        {step: tuple(r["straight"][step] for r in ranks_runs) for step in range(1, 11)},
        {step: tuple(r["resumed"][step] for r in ranks_runs) for step in range(1, 11)},
        f"{resumed_library}: resumed vs straight through",
    )
proofs.same_numbers(
    "both-libraries-train-alike",
    {step: tuple(r["straight"][step] for r in RUNS["DCP"]) for step in range(1, 11)},
    {
        step: tuple(r["straight"][step] for r in RUNS["torch_checkpointing"])
        for step in range(1, 11)
    },
    "DCP vs torch_checkpointing, every rank,",
)


# %%
# What each one writes
# --------------------
# The step-6 checkpoint of each library, file by file. DCP writes one file per
# rank and a ``.metadata`` index that says where every piece of every tensor
# lives: it loads on any number of ranks. torch_checkpointing writes one
# ``torch.save`` file per item and rank (``model_0.pt``, ``optimizer_1.pt``):
# each rank reads its own files back, into the layout it saved from. It writes
# them under ``tmp_step-0006`` and renames the directory once every rank is
# done, so a directory under its final name is complete.


def files_of(path):
    return {name: os.path.getsize(os.path.join(path, name)) for name in sorted(os.listdir(path))}


for library in CHECKPOINTERS:
    path = os.path.join(WORK_DIR, library, "resumed", "step-0006")
    print(f"{library}: {path.removeprefix(WORK_DIR + '/')}/")
    for name, size in files_of(path).items():
        print(f"  {name:<16} {size:>7,} bytes")


# %%
# Neither reads the other's checkpoint
# ------------------------------------
# Each library only understands its own layout: DCP looks for ``.metadata``,
# torch_checkpointing for its per-item files. To move a model from one to the
# other, load it with the library that saved it and save it with the other.
# Here each tries the other's step-6 checkpoint from above, on every rank,
# torch_checkpointing with a synchronous manager (it reads without a writer
# process).


def read_the_other(root):
    model, _ = build_sharded_model(seed=0)
    manager, outcomes = checkpoint_manager(asynchronous=False), {}
    logging.disable(logging.WARNING)  # DCP also logs each failed read, with a traceback
    try:
        dcp.load(
            {"model": model.state_dict()}, checkpoint_id=f"{root}/torch_checkpointing/{STEP_6}"
        )
        outcomes["DCP reads torch_checkpointing's"] = "loaded"
    except CheckpointException as error:  # a BaseException: name it
        cause = str(error).strip().splitlines()[-1].split(";")[0]  # its last rank's, in short
        outcomes["DCP reads torch_checkpointing's"] = f"{type(error).__name__}: {cause}"
    try:
        manager.load(f"{root}/DCP/{STEP_6}", into={"model": model.state_dict()})
        outcomes["torch_checkpointing reads DCP's"] = "loaded"
    except FileNotFoundError as error:
        outcomes["torch_checkpointing reads DCP's"] = f"{type(error).__name__}: {error}"
    finally:
        logging.disable(logging.NOTSET)
        manager.close()
    if dist.get_rank() == 0:
        for what, outcome in outcomes.items():
            shown = f"{what}: {outcome.replace(root + '/', '')}"
            print(textwrap.fill(shown, 80, subsequent_indent="  "))
    return outcomes


STEP_6 = "resumed/step-0006"
OTHER = run_on_ranks(read_the_other, WORK_DIR)

# %%

results.claim(
    "neither-reads-the-other",
    all(outcome != "loaded" for on_rank in OTHER for outcome in on_rank.values()),
    "\n".join(f"{what}: {outcome.split(':')[0]}" for what, outcome in OTHER[0].items()),
    by_rank=OTHER,
)


# %%
# Direct I/O on this file system
# ------------------------------
# What ``use_direct_io=True``, the library's default, does here: one save of
# the model into this page's directory (the run stamp at the top names its file
# system) by a synchronous manager: the same file system code as the writer
# process, in the rank itself.


def save_with_direct_io(root):
    model, _ = build_sharded_model(seed=0)
    manager = checkpoint_manager(asynchronous=False, direct_io=True)
    logging.disable(logging.CRITICAL)  # the manager also logs the error, with a traceback
    try:
        manager.save(f"{root}/direct-io", {"model": model.state_dict()})
        outcome = "saved"
    except OSError as error:
        outcome = f"{type(error).__name__}: {error}"
    finally:
        logging.disable(logging.NOTSET)
        manager.close()
    print(f"use_direct_io=True: {outcome}")
    return outcome


DIRECT_IO = run_on_ranks(save_with_direct_io, WORK_DIR)

# %%

results.record("direct_io_outcome", DIRECT_IO)


# %%
# Loading into another layout
# ---------------------------
# DCP's ``.metadata`` lets a checkpoint load on another number of ranks. In
# torch_checkpointing that takes a resharder declared per item, which makes
# each save gather the sharding metadata of every rank first. What that does
# on this machine's ranks:


def save_with_a_resharder(root):
    model, _ = build_sharded_model(seed=0)
    items = {"model": ItemSpec(resharder=DefaultResharder())}
    manager = checkpoint_manager(asynchronous=False, items=items)
    try:
        manager.save(f"{root}/resharder", {"model": model.state_dict()})
        outcome = "saved"
    except (AssertionError, RuntimeError) as error:
        outcome = f"{type(error).__name__}: {error}"
    finally:
        manager.close()
    print(f"a save with DefaultResharder: {outcome}")
    return outcome


RESHARDER = run_on_ranks(save_with_a_resharder, WORK_DIR)

# %%

results.record("resharder_outcome", RESHARDER)


# %%
# What a save costs the loop
# --------------------------
# What each save stalled the loop, every rank, all runs above (the first save
# of each process is left out: it starts the library's once-only work). A DCP
# save stages its copy before it returns; a torch_checkpointing save returns
# at once, and the next ``optimizer.step()`` waits for its staging.

WAITED = {library: [s for r in per_rank for s in r["waited"]] for library, per_rank in RUNS.items()}
for library, waited in WAITED.items():
    low, median, high = min(waited), statistics.median(waited), max(waited)
    shown = f"{median * 1e3:.1f} ms ({low * 1e3:.1f}-{high * 1e3:.1f})"
    print(f"{library}: {shown} stalled per save, {len(waited)} saves")

# %%
# Is the difference more than noise? The page's rule: only where the medians
# differ by more than the larger of the two spreads.

VERDICT = stats.say(
    "torch_checkpointing", WAITED["torch_checkpointing"], "DCP", WAITED["DCP"], "ms", 1e3
)
results.record("waited_s", WAITED)
results.record("verdict", VERDICT)


# %%
# When to choose which
# --------------------
# * **DCP** when a checkpoint must load on another number of ranks or another
#   parallelism, be inspected or converted
#   (:ref:`sphx_glr_recipes_partial_load_recipe.py`,
#   :ref:`sphx_glr_recipes_change_parallelism_recipe.py`), written to object
#   storage, or read by torchtitan and Hugging Face tools: its ``.metadata``
#   makes that possible on any backend, and it ships with PyTorch.
# * **torch_checkpointing** when the job always resumes in the layout it saved
#   from and one object for save, load and the optimizer-step lock is what you
#   want. On GPUs it can also load into another layout and export Hugging Face
#   safetensors (``torch_checkpointing.hf.consolidate_hf_safetensors_checkpoint``):
#   both need the global metadata its resharder gathers, which 0.1.1 gathers in
#   CUDA tensors (above, what a save with it did here).
# * torch_checkpointing 0.1.1 never calls ``fsync``: its save is done once the
#   bytes are in the page cache, and a machine that crashes then loses them.
#   Sync its files yourself (rank 0's save returns after the rename that
#   commits the checkpoint; the other ranks' may return before it).
# * For the stall, the line above is this machine's, at this page's size:
#   :ref:`sphx_glr_recipes_checkpoint_stall_benchmark.py` measures both
#   libraries at 1 GB (stall, overhead, memory, with torch_checkpointing's files
#   synced), and :ref:`sphx_glr_recipes_save_load_speed_recipe.py` their save
#   and load throughput against the disk's limits.


# %%
# The same, as a training script for ``torchrun``
# -----------------------------------------------
# In your own job ``torchrun`` starts the ranks, and ``main()`` does what
# ``run_on_ranks`` did above: set this rank's device, create the process
# group, train with the checkpointer you chose, and destroy the group. A
# second launch in the same directory resumes. Save it as ``train.py`` with
# the functions above and an entry point that only runs as the main script:
# torch_checkpointing starts its writer process with ``spawn``, which imports
# ``train.py`` again.
#
# .. code-block:: python
#
#    if __name__ == "__main__":
#        main(sys.argv[1])  # a directory every rank sees
#
# .. code-block:: bash
#
#    torchrun --nproc-per-node=2 train.py checkpoints


def main(checkpoint_dir, library="torch_checkpointing"):
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo")
    try:
        checkpointer = CHECKPOINTERS[library]()
        try:
            run = train(checkpointer, checkpoint_dir, until_step=4)
        finally:
            checkpointer.close()
        print(f"{library}: resumed from {run['resumed_from']}, loss {run['losses'][4]:.6f}")
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
# * :ref:`sphx_glr_recipes_resume_recipe.py`: a resume that survives a rank
#   killed in the middle of a save.
# * :ref:`sphx_glr_recipes_checkpoint_stall_benchmark.py`: what DCP's saving
#   strategies cost a training loop.
# * :doc:`/troubleshooting`: symptoms and fixes for the usual DCP failures.
