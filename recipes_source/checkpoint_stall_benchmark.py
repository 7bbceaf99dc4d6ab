"""
How much does checkpointing stall training?
===========================================

A checkpoint costs a training job in three ways: the time the training loop
waits for it (the *stall*), the speed the steps lose while a checkpoint is
written in the background, and the host memory that holds a copy of the state.
This recipe trains the same model with a checkpoint every few steps, once per
saving strategy, and measures all of it next to the physical limits of the
machine that built this page: how fast it copies memory and writes to disk.
Every number is a median over rounds in which the strategies take turns, with
its spread; a difference smaller than its spread is noise, never advice.

.. grid:: 2

    .. grid-item-card:: :octicon:`mortar-board;1em;` What you will learn
       :class-card: card-prerequisites

       * Five ways of saving from one training loop: ``dcp.save``,
         ``async_save``, ``async_save`` with a reused stager, ``DefaultStager``
         overlap and the checkpoint process
       * Time the stall per checkpoint in the loop itself, over a warm-up
         round and rounds in which the strategies take turns
       * Tell an effect from noise: the median next to its spread
       * Budget CPU threads between training and the background writer
       * Run the same benchmark at full size with ``make bench``

    .. grid-item-card:: :octicon:`list-unordered;1em;` Prerequisites
       :class-card: card-prerequisites

       * PyTorch: see :doc:`/versions`
       * CPU (gloo) or one GPU per rank (NCCL)
       * :ref:`sphx_glr_recipes_async_save_recipe.py` and
         :ref:`sphx_glr_recipes_default_stager_recipe.py`
"""

# %%
# Setup
# -----
# The page trains a small model, to build in seconds. ``make bench`` runs this
# file under ``torchrun`` at full size (``BENCH``: a checkpoint of about 1 GB,
# 4 steps between checkpoints) and keeps every number it measured, and the
# figure, in ``_build/bench/``.

import os
import shutil
import sys
import time
from contextlib import contextmanager

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from page_tools import disk, figures, machine, memory, results, stalls, timing
from rank_launcher import run_as_torchrun, run_on_ranks, shared_tempdir, under_torchrun
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.fsdp import fully_shard

BENCH = os.environ.get("DCP_RECIPES_BENCH") == "1"  # make bench: the full size
CHECKPOINT_GB = float(os.environ.get("DCP_RECIPES_BENCH_GB", "1.0" if BENCH else "0.06"))
ROUNDS = int(os.environ.get("DCP_RECIPES_BENCH_REPEATS", "2"))  # measured, after a warm-up
if ROUNDS < 2:
    raise ValueError(f"{ROUNDS} rounds: a spread needs at least 2")
EVERY, CHECKPOINTS = (4, 2) if BENCH else (2, 1)  # steps between checkpoints; timed per run
STEPS = (CHECKPOINTS + 1) * EVERY  # the last checkpoint overlaps as many steps as the others
WORK_DIR = shared_tempdir("dcp-stall-benchmark-")
CHECKPOINT_ROOT = os.path.join(WORK_DIR, "checkpoints")
print(f"torch {torch.__version__}: a {CHECKPOINT_GB} GB checkpoint every {EVERY} steps,")
print(f"{CHECKPOINTS} timed per run of {STEPS} steps, {ROUNDS} rounds after a warm-up")


# %%
# The model and the state a checkpoint holds
# ------------------------------------------
# A stack of square ``Linear`` layers, sharded with FSDP2 over all ranks and
# trained with Adam. A checkpoint holds the parameters and Adam's two moments:
# 12 bytes per parameter, so the size of the model follows from the size of the
# checkpoint. Each rank saves only its own shards.

PARAMETERS = CHECKPOINT_GB * 1e9 / 12
WIDTH = 1024 if PARAMETERS < 50e6 else 2048
DEPTH, BATCH, LR = max(1, round(PARAMETERS / (WIDTH * WIDTH + WIDTH))), 16, 1e-4


class ToyModel(nn.Module):
    def __init__(self, width=WIDTH, depth=DEPTH):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))

    def forward(self, x):
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x


print(f"ToyModel: {DEPTH} layers of width {WIDTH}")


# %%
# The pieces every page of this site shares: the state DCP saves and loads,
# this rank's device, the sharded model and its optimizer.


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
    fully_shard(model)  # every parameter becomes a DTensor sharded over all ranks
    optimizer = torch.optim.Adam(model.parameters(), lr=LR)
    return model, optimizer


# %%
# Five ways to save
# -----------------
# * ``dcp.save`` copies nothing: it writes straight from the training tensors
#   and returns when the checkpoint is on disk.
# * ``async_save`` copies the state into fresh host memory before it returns,
#   then writes that copy in a thread.
# * ``async_save, cached buffer`` passes a ``DefaultStager`` that the loop
#   reuses for every save, so every copy goes into the same host buffer.
# * ``DefaultStager overlap`` copies in the background, during the next
#   forward and backward pass; the loop waits for it before ``optimizer.step()``
#   changes the weights (safe: this model's forward pass changes no tensor of
#   the state dict; :ref:`sphx_glr_recipes_staging_pitfalls_recipe.py`).
# * ``process writer`` (``AsyncCheckpointerType.PROCESS``) writes in a process
#   DCP starts on the first save, free of this process's GIL, from the shared
#   memory the stager copied into, which that process maps.
#
# .. versionadded:: 2.9
#    ``DefaultStager``, ``StagingOptions`` and the ``AsyncSaveResponse`` that
#    ``async_save`` returns when staging runs in the background.

STRATEGIES = (
    "no checkpoint",
    "dcp.save",
    "async_save",
    "async_save, cached buffer",
    "DefaultStager overlap",
    "process writer",
)


def staging_options(use_async_staging, checkpoint_process=False):
    """How every save on this page stages its copy, chosen from the machine."""
    on_gpu = torch.accelerator.is_available()
    return StagingOptions(
        use_pinned_memory=on_gpu,  # page-locked memory only speeds up copies from a device
        use_shared_memory=checkpoint_process,  # only a checkpoint *process* reads it in place
        use_async_staging=use_async_staging,
        use_non_blocking_copy=on_gpu,
    )


def new_stager(strategy):
    """The stager a strategy reuses for every save (it keeps the host buffer), or None."""
    if strategy == "async_save, cached buffer":
        return DefaultStager(staging_options(use_async_staging=False))
    if strategy == "DefaultStager overlap":
        return DefaultStager(staging_options(use_async_staging=True))
    if strategy == "process writer":
        return DefaultStager(staging_options(use_async_staging=True, checkpoint_process=True))
    return None


# %%
# ``start_checkpoint`` starts one checkpoint and returns what is still *in
# flight*: a future for the copy to host memory (*staging*) and one for the
# write (*upload*), ``None`` where nothing runs in the background.


def start_checkpoint(strategy, state_dict, path, group, stager):
    """Start one checkpoint; returns (staging, upload) futures, None where nothing is left."""
    if strategy == "dcp.save":
        dcp.save(state_dict, checkpoint_id=path, process_group=group)
        return None, None
    if strategy == "async_save":  # it stages, and builds its writer from the path
        return None, dcp.async_save(state_dict, checkpoint_id=path, process_group=group)
    writer = dcp.FileSystemWriter(path, per_thread_copy_ahead=0)  # host copy: no GPU 0 context
    if strategy == "async_save, cached buffer":
        return None, dcp.async_save(
            state_dict, storage_writer=writer, process_group=group, async_stager=stager
        )
    in_process = strategy == "process writer"
    checkpointer = AsyncCheckpointerType.PROCESS if in_process else AsyncCheckpointerType.THREAD
    response = dcp.async_save(
        state_dict,
        storage_writer=writer,
        process_group=group,
        async_stager=stager,
        async_checkpointer_type=checkpointer,
    )
    return response.staging_completion, response.upload_completion


# %%
# The writer process logs every request at INFO level to the standard error it
# inherits: start it with standard error pointing at a log of its own if your
# training log must stay quiet (the first save of each run does, below).


@contextmanager
def standard_error_to(path):
    """Point file descriptor 2 at ``path``: a writer process started inside logs there."""
    sys.stderr.flush()
    saved = os.dup(2)
    log = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(log, 2)
    os.close(log)
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)


# %%
# Time what the loop waits for
# ----------------------------
# To benchmark your own loop, time the loop itself: ``time.perf_counter()``
# around every call that may wait for a checkpoint (the save call, the wait
# for staging before ``optimizer.step()``, the waits for the upload before the
# next save and at the end) gives the *stall*. A step's time is its forward,
# backward and optimizer step without that wait (on a GPU, up to a
# synchronisation, so that it includes the step's kernels).


def waited(future):
    """Wait for a checkpoint's future, if there is one; returns the seconds the loop waited."""
    started = time.perf_counter()
    if future is not None:
        future.result()
    return time.perf_counter() - started


def train_step(model, optimizer, batch, staging):
    """Forward, backward, optimizer step; returns the loss and the seconds waited for staging."""
    loss = model(batch).pow(2).mean()
    loss.backward()
    staged = waited(staging)  # the copy is complete before the weights change
    optimizer.step()
    optimizer.zero_grad()
    if torch.accelerator.is_available():
        torch.accelerator.synchronize()  # the step's time includes its work on the GPU
    return loss, staged


# %%
# Every run builds its model afresh and takes one step first: Adam creates its
# state on its first step, and every checkpoint must hold the same tensors. The
# first save of a run is not timed with the others: it starts what a strategy
# starts once (its host buffer, the writer process). Every rank waits until it
# is durable (for the writer process, a rule: see
# :ref:`sphx_glr_recipes_async_save_recipe.py`), and keeps it as ``first checkpoint``.


def set_up_run(threads):
    """What every run builds: its thread budget, a group for checkpoints, model and data."""
    torch.set_num_threads(threads)  # see "Thread budget" below
    group = dist.new_group(backend="gloo")  # checkpoints never share training's group
    model, optimizer = build_sharded_model(seed=0)
    torch.manual_seed(100 + dist.get_rank())  # each rank trains on its own data
    batch = torch.rand(BATCH, WIDTH, device=device_for_this_rank())
    train_step(model, optimizer, batch, None)  # Adam creates its state
    return group, model, optimizer, batch


def first_checkpoint(strategy, state_dict, path, group, stager):
    """The first save of a run, waited for until durable; returns its seconds."""
    started = time.perf_counter()
    with standard_error_to(os.path.join(WORK_DIR, f"writer-rank{dist.get_rank()}.log")):
        for future in start_checkpoint(strategy, state_dict, path, group, stager):
            waited(future)
    return time.perf_counter() - started


# %%
# The training loop with checkpoints
# ----------------------------------
# The loop a training script would have: a checkpoint every ``EVERY`` steps, at
# most one checkpoint in flight, and a wait for staging before
# ``optimizer.step()``. Checkpoints go through a gloo group of their own, so
# background writes never share a group with training collectives. A step
# *overlaps* a save if the last checkpoint was not yet durable when it began.


def train_with_checkpoints(strategy, threads, directory):
    group, model, optimizer, batch = set_up_run(threads)
    state_dict, stager = {"app": AppState(model, optimizer)}, new_stager(strategy)
    saving, staging, upload = strategy != "no checkpoint", None, None
    paths = [f"{directory}/step-{s}" for s in range(0, STEPS, EVERY)] if saving else []
    first = first_checkpoint(strategy, state_dict, paths[0], group, stager) if saving else 0.0
    dist.barrier(group)  # every rank starts the timed loop together
    stall, steps, started = 0.0, [], time.perf_counter()
    for step in range(1, STEPS + 1):
        overlapped, began = upload is not None and not upload.done(), time.perf_counter()
        loss, staged = train_step(model, optimizer, batch, staging)
        steps.append([time.perf_counter() - began - staged, overlapped])
        stall, staging = stall + staged, None
        if saving and step % EVERY == 0 and step < STEPS:
            began = time.perf_counter()
            waited(upload)  # one checkpoint at a time: a reused buffer may still be in use
            path = paths[step // EVERY]
            staging, upload = start_checkpoint(strategy, state_dict, path, group, stager)
            stall += time.perf_counter() - began
    stall += waited(upload)  # the last checkpoint is on disk before training ends
    wall = time.perf_counter() - started
    if stager is not None:
        stager.close()
    dist.destroy_process_group(group)
    timings = {"first_checkpoint_s": first, "stall_s": stall, "steps": steps, "wall_s": wall}
    return {"checkpoints": paths, "loss": loss.item(), **timings}


# %%
# Thread budget
# -------------
# A background writer, thread or process, needs CPU time while training runs,
# and on a machine with few cores it takes it from the training steps. The
# knob is ``torch.set_num_threads``: PyTorch uses every core by default; leave
# one per rank to the writer, as ``training_threads()`` does. The ranks this
# page forks train with one thread; under ``torchrun`` (``make bench``) two
# runs also train with every core, in the same rounds.


def cores_per_rank():
    return (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))


def training_threads():
    """Threads each rank trains with: every core it has but one, which the writer gets."""
    return max(1, cores_per_rank() - 1)


THREADS = training_threads() if under_torchrun() else 1  # forked ranks keep their one thread
SCHEDULE = [(strategy, THREADS) for strategy in STRATEGIES]
if under_torchrun() and cores_per_rank() > THREADS:  # the knob: every core for training
    SCHEDULE += [("no checkpoint", cores_per_rank()), ("DefaultStager overlap", cores_per_rank())]
print(f"{len(SCHEDULE)} runs per round; training threads per rank: {THREADS}")


# %%
# The machine's limits
# --------------------
# No strategy can stage a checkpoint faster than the machine copies memory, or
# make it durable faster than the disk writes and syncs it. The page measures
# both on every rank at once, for its share: a copy into a buffer it already
# touched (what a reused staging buffer does), into pages new from the kernel
# (fresh staging at worst: the kernel must also zero every page), and a write
# plus ``fsync``. On GPU the copies go from the device to host memory (pinned
# when reused). A save waits for its slowest rank: the table shows its speeds.

CHECKPOINT_BYTES = stalls.adam_checkpoint_bytes(ToyModel)
SPEEDS = run_on_ranks(disk.copy_and_write_speeds, CHECKPOINT_BYTES, CHECKPOINT_ROOT, THREADS)
LIMITS = results.record("limits", stalls.limits(SPEEDS, CHECKPOINT_BYTES))
print(stalls.share(LIMITS))
stalls.limits_table(LIMITS)


# %%
# Train with every strategy, then let them take turns
# ---------------------------------------------------
# ``benchmark`` runs the loop once per entry of the schedule, on the same
# ranks, round after round. Round 0 is the warm-up (the page cache, the ranks'
# first allocations, DCP's first-call set-up, the writer process): its numbers
# are not used. Then every run once per round, in the same order (A B C ... A
# B C ...), so that a slow minute on a shared machine does not hit one
# strategy only, and each run is compared with the run without checkpoints
# *of its own round*. After each run, rank 0 removes its checkpoints and prints
# its stall per checkpoint and final loss.


def benchmark(schedule, rounds):
    """Round 0 warms up, then every run of ``schedule`` once per round, in the same order."""
    runs = []
    for number in range(rounds + 1):
        for strategy, threads in schedule:
            name = f"{strategy.replace(' ', '-').replace(',', '')}-{threads}-threads"
            directory = os.path.join(CHECKPOINT_ROOT, f"round-{number}", name)
            run = train_with_checkpoints(strategy, threads, directory)
            dist.barrier()
            if dist.get_rank() == 0:
                shutil.rmtree(directory, ignore_errors=True)  # the disk is the next run's
                stall = run["stall_s"] / CHECKPOINTS if run["checkpoints"] else 0.0
                when = f"round {number}" if number else "warm-up"
                print(
                    f"{when:<8} {strategy:<26} threads {threads}, stall {stall:.3f} s, "
                    f"loss {run['loss']:.6g}"
                )
            runs.append({"round": number, "strategy": strategy, "threads": threads, **run})
    return runs


# %%
# The page watches the runs: when each checkpoint becomes durable (``dcp.save``
# returns, the upload future completes), the peak host memory of each run on
# each rank (with the writer process's private memory, sampled every 10 ms from
# the group a run creates to the one it destroys), and each checkpoint a run
# removes, just before it goes.

with (
    timing.checkpoint_saves(dcp) as saves,
    memory.peak_between((dist, "new_group"), (dist, "destroy_process_group")) as peaks,
    disk.checked_before_removal(CHECKPOINT_ROOT) as removals,
):
    per_rank = run_on_ranks(benchmark, SCHEDULE, ROUNDS)


# %%
# What the runs prove before anything is measured: they took turns; every
# checkpoint was durable, and complete on disk when its run removed it (its
# ``.metadata``, which DCP writes last, and every byte it lists); no strategy
# changed what the loop computes; the loop's timers saw every blocking save.

RUNS = results.record("runs", stalls.collect(per_rank, saves, peaks, removals, THREADS))
stalls.claim_interleaved("rounds-interleaved", RUNS, SCHEDULE, ROUNDS, THREADS)
stalls.claim_complete("every-checkpoint-complete", RUNS)
stalls.claim_same_losses("checkpoints-leave-training-unchanged", RUNS)
stalls.claim_timers_enclose_blocking_saves("loop-timers-see-blocking-saves", RUNS)
results.record("config", stalls.config(CHECKPOINT_GB, SCHEDULE, ROUNDS, STEPS, EVERY, per_rank))
results.record("machine", machine.describe(WORK_DIR))


# %%
# The numbers, with their spread
# ------------------------------
# Per run, a stall is the slowest rank's total wait divided by the number of
# timed checkpoints; the time until durable is the slowest rank's, from the
# save call. Each cell shows the median over the rounds and, in brackets, the
# lowest and highest value. A stall smaller than that spread (highest minus
# lowest) is marked *within noise*: this run cannot tell it from zero.

SUMMARY = results.record("summary", stalls.summarize(RUNS["runs"]))
stalls.summary_table(SUMMARY, STRATEGIES[1:], stalls.TIMES)


# %%
# What the checkpoints cost the whole run: the median step that overlapped a
# save over the median step of the round's run without checkpoints, and the
# run's wall time and peak host memory minus that run's. An effect smaller than
# its spread is *within noise*, and so is every effect below zero: a checkpoint
# does not make training faster, so a negative median measures noise.

stalls.summary_table(SUMMARY, STRATEGIES, stalls.COSTS)


# %%
# DefaultStager against dcp.save
# ------------------------------
# A stall is best read as a multiple of one memory copy of a rank's share
# into a reused buffer: a strategy that stages in the foreground cannot stall
# less than about that, one that stages in the background can. The question
# this benchmark answers: what share of ``dcp.save``'s cost is left with
# ``DefaultStager`` overlap, in the same rounds, with the thread budget above?

RATIOS = results.record("ratios", stalls.ratios(SUMMARY, STRATEGIES[1:], LIMITS["copy_s"]))
stalls.ratios_table(RATIOS, LIMITS["copy_s"])


# %%
# The goals, at ``make bench`` size (1 GB, one rank): a stall of at most 0.02x
# ``dcp.save``'s, a total overhead of at most 0.1x. A goal is met where
# ``DefaultStager``'s rounds are below the goal times ``dcp.save``'s by more than
# their spread. Small checkpoints leave ``DefaultStager`` with its fixed costs
# (the state dict, the planning): the ratios at this page's size say less.

GOALS = stalls.goals(
    SUMMARY, "DefaultStager overlap", {"stall_per_checkpoint_s": 0.02, "overhead_s": 0.1}
)
results.record("goals", GOALS)
HEADLINE = stalls.headline(RATIOS, GOALS, "DefaultStager overlap", training_threads=THREADS)
results.record("headline", HEADLINE)
stalls.print_summary_line(BENCH, results.recipe_name(), HEADLINE, GOALS)  # make bench only
stalls.goals_table(GOALS)


# %%
# The figure
# ----------
# Left: what the training loop waits per checkpoint (log scale), with the time
# of one memory copy of a rank's share for reference. Right: what the whole run
# cost over the run without checkpoints of its round, stalls and slower steps
# together. The bars are medians, the whiskers the lowest and highest round.

FIGURE = stalls.figure(
    SUMMARY, STRATEGIES[1:], LIMITS, f"{CHECKPOINTS} timed every {EVERY} steps, {ROUNDS} rounds"
)
figures.save_beside(FIGURE, results.results_path())  # make bench: beside the results file


# %%
# The thread budget, measured
# ---------------------------
# The cores, each rank's training threads and, where the knob ran (``torchrun``
# with a core to spare), ``DefaultStager``'s cost with both budgets.

KNOB = stalls.thread_knob(SUMMARY, "DefaultStager overlap", THREADS, cores_per_rank())
results.record("thread_knob", KNOB)
stalls.thread_budget_table(SUMMARY, KNOB, "DefaultStager overlap", len(per_rank), THREADS)


# %%
# When to choose which
# --------------------
# The page writes these from the numbers above: what this run measured, on
# this machine, at this size. A strategy leads only if its median beats the
# next best by more than the larger of the two spreads; a smaller lead is
# noise, and no advice. Rerun the page, or ``make bench``, on your hardware.

ADVICE = results.record("advice", stalls.advice(SUMMARY, STRATEGIES[1:]))
stalls.advice_table(ADVICE)


# %%
# The same, as a training script for ``torchrun``
# -----------------------------------------------
# In your own job ``torchrun`` starts the ranks, and ``main()`` does what
# ``run_on_ranks`` did above: set this rank's device, create the process
# group, run the loop with the strategy you chose, and destroy the group. The
# checkpoint directory is a path every rank sees (``shared_tempdir`` made one
# here; on several machines, a shared file system). Save it as ``train.py``
# with the functions above, and:
#
# .. code-block:: bash
#
#    torchrun --nproc-per-node=2 train.py
#
# The cell runs ``main()`` the way ``torchrun`` would, on ranks that have
# torchrun's environment and no process group yet.


def main(checkpoint_dir, strategy="DefaultStager overlap"):
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo")
    try:
        run = train_with_checkpoints(strategy, training_threads(), checkpoint_dir)
        stall = run["stall_s"] / CHECKPOINTS
        print(f"{strategy}: stall {stall:.3f} s per checkpoint, loss {run['loss']:.6g}")
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
# * :ref:`sphx_glr_recipes_async_save_recipe.py`: the asynchronous save, step by step.
# * :ref:`sphx_glr_recipes_default_stager_recipe.py`: overlapping the copy to
#   host memory with the next forward and backward pass, and its rules.
# * :ref:`sphx_glr_recipes_staging_pitfalls_recipe.py`: what goes wrong when
#   the training loop does not wait for staging.
# * :doc:`/troubleshooting`: symptoms and fixes for the usual DCP failures.
