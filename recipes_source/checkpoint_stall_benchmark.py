"""
How much does checkpointing stall training?
===========================================

A checkpoint costs a training job the time the loop waits for it (the
*stall*), the speed steps lose while it is written in the background, and the
host memory that holds a copy. This recipe trains one model with each saving
strategy, at checkpoint intervals from half to twice a save's time, next to
the machine's limits: how fast it copies memory and writes to disk. Every
number is a median over rounds in which the strategies take turns, with its
spread; a difference smaller than its spread is noise, never advice.

.. grid:: 2

    .. grid-item-card:: :octicon:`mortar-board;1em;` What you will learn
       :class-card: card-prerequisites

       * Five ways of saving from one training loop: ``dcp.save``,
         ``async_save``, ``async_save`` with a reused stager, ``DefaultStager``
         overlap and the checkpoint process
       * Time the stall per checkpoint in the loop itself, over a warm-up
         round and rounds in which the strategies take turns
       * Pick the checkpoint interval from two measured numbers
       * Tell an effect from noise: the median next to its spread
       * Budget CPU threads between training and the background writer

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
# A small model, to build in seconds; ``make bench`` runs this file under
# ``torchrun`` at 1 GB and keeps its numbers and figures in ``_build/bench/``.

import math
import os
import shutil
import statistics
import time
from concurrent.futures import Future

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from page_tools import disk, figures, machine, memory, processes, results, stalls, timing
from rank_launcher import run_as_torchrun, run_on_ranks, shared_tempdir, under_torchrun
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.fsdp import fully_shard

BENCH = os.environ.get("DCP_RECIPES_BENCH") == "1"  # make bench: the full size
CHECKPOINT_GB = float(os.environ.get("DCP_RECIPES_BENCH_GB", "1.0" if BENCH else "0.06"))
ROUNDS = int(os.environ.get("DCP_RECIPES_BENCH_REPEATS", "3"))  # measured, after a warm-up
if ROUNDS < 2:
    raise ValueError(f"{ROUNDS} rounds: a spread needs at least 2")
WORK_DIR = shared_tempdir("dcp-stall-benchmark-")
CHECKPOINT_ROOT = os.path.join(WORK_DIR, "checkpoints")
print(f"torch {torch.__version__}: {CHECKPOINT_GB} GB, {ROUNDS} rounds after a warm-up")

# %%
# The model and the state a checkpoint holds
# ------------------------------------------
# Square ``Linear`` layers, sharded with FSDP2 over all ranks, trained with
# Adam. A checkpoint holds the parameters and Adam's two moments (12 bytes per
# parameter): the model's size follows from the checkpoint's.

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
# * ``dcp.save`` writes straight from the training tensors, and returns when
#   the checkpoint is on disk. ``async_save`` copies the state into fresh host
#   memory before it returns, then writes that copy in a thread.
# * ``async_save, cached buffer`` passes a ``DefaultStager`` that the loop
#   reuses for every save: every copy goes into the same host buffer.
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

STRATEGIES = ("no checkpoint", "dcp.save", "async_save", "async_save, cached buffer")
STRATEGIES += ("DefaultStager overlap", "process writer")


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
# ``start_checkpoint`` returns what is still *in flight*: a future for the copy
# to host memory (*staging*) and one for the write (*upload*), or ``None``.


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
# Time what the loop waits for
# ----------------------------
# Time the loop itself: ``time.perf_counter()`` around every call that may
# wait for a checkpoint (the save call, staging before ``optimizer.step()``,
# the upload) gives the *stall*; a step's time is the rest of the step (on a
# GPU, up to a synchronisation, so that it includes the step's kernels). A
# stager allocates its host buffer on its first save: each run stages once
# before its loop, so that the buffer exists before the first timed save.


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


def fill_host_buffer(stager, state_dict):
    """Stage once: the stager allocates its host buffer now, not in the first timed save."""
    staged = stager.stage({key: value.state_dict() for key, value in state_dict.items()})
    waited(staged if isinstance(staged, Future) else None)


# %%
# One model, the same start for every run
# ---------------------------------------
# Each rank builds the model once and takes one step (Adam creates its state
# then: every checkpoint holds the same tensors). Every run starts from a copy
# of that state, put back in place, so every run computes the same losses.


def set_up_training():
    """This rank's model, optimizer and batch, after Adam's first step."""
    model, optimizer = build_sharded_model(seed=0)
    torch.manual_seed(100 + dist.get_rank())  # each rank trains on its own data
    batch = torch.rand(BATCH, WIDTH, device=device_for_this_rank())
    train_step(model, optimizer, batch, None)  # Adam creates its state
    return model, optimizer, batch


def starting_point(model, optimizer):
    """Keep a copy of the weights and the optimizer's state; returns what puts it back."""
    tensors = list(model.parameters())
    tensors += [value for state in optimizer.state.values() for value in state.values()]
    saved = [tensor.detach().clone() for tensor in tensors]

    def restore():
        with torch.no_grad():
            for tensor, copy in zip(tensors, saved, strict=True):
                tensor.copy_(copy)

    return restore


# %%
# How often to checkpoint
# -----------------------
# A background save is free only if the next checkpoint comes after it is on
# disk. Two measured numbers pick the interval: a save's time (``dcp.save``'s,
# nothing else running) and a step's. The warm-up round measures both; the runs
# checkpoint at 0.5, 1 and 2 times a save's time; the headline numbers are
# those at 2, the regime a real job runs in.

MULTIPLES = (0.5, 1, 2)  # checkpoint intervals, in multiples of a save's time
HEADLINE_MULTIPLE = 2
SWEPT = ("DefaultStager overlap", "process writer")  # at every interval; the others at 2x


def steps_between_checkpoints(save_s, step_s, multiple=HEADLINE_MULTIPLE):
    """The fewest steps that take at least ``multiple`` times a save's time."""
    return max(1, math.ceil(multiple * save_s / step_s))


# %%
# The training loop with checkpoints
# ----------------------------------
# A checkpoint, the steps of one interval, at most one checkpoint in flight, a
# wait for staging before ``optimizer.step()``, a gloo group for checkpoints. A
# step *overlaps* a save if the checkpoint was not yet durable when it began.


def train_with_checkpoints(strategy, threads, paths, intervals, training):
    """From the starting point, per interval: a checkpoint, that many steps, and a wait
    until the checkpoint is on disk. Returns what the loop measured."""
    model, optimizer, batch, restore = training
    torch.set_num_threads(threads)  # see "Thread budget" below
    restore()
    group = dist.new_group(backend="gloo")  # checkpoints never share training's group
    state_dict, stager = {"app": AppState(model, optimizer)}, new_stager(strategy)
    if stager is not None:
        fill_host_buffer(stager, state_dict)
    saving, segments, losses = strategy != "no checkpoint", [], []
    dist.barrier(group)  # every rank starts the timed loop together
    for path, steps_between in zip(paths, intervals, strict=True):
        began, staging, upload = time.perf_counter(), None, None
        if saving:
            staging, upload = start_checkpoint(strategy, state_dict, path, group, stager)
        stall, steps = time.perf_counter() - began, []
        for _ in range(steps_between):
            overlapped = upload is not None and not upload.done()
            step_began = time.perf_counter()
            loss, staged = train_step(model, optimizer, batch, staging)
            steps.append([time.perf_counter() - step_began - staged, overlapped])
            stall, staging = stall + staged, None
            losses.append(loss.item())
        stall += waited(upload)  # on disk before the next checkpoint: one in flight at most
        wall = time.perf_counter() - began
        segments.append(dict(steps_between=steps_between, stall_s=stall, steps=steps, wall_s=wall))
    if stager is not None:
        stager.close()
    dist.destroy_process_group(group)
    return {"checkpoints": paths if saving else [], "segments": segments, "losses": losses}


# %%
# Thread budget
# -------------
# A background writer needs CPU time while training runs. The knob is
# ``torch.set_num_threads``: leave a core per rank to the writer (forked ranks
# train with one thread; under ``torchrun`` two runs also use every core).


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
# No strategy stages faster than the machine copies memory, or makes a
# checkpoint durable faster than the disk writes and syncs it. Measured on
# every rank at once, for its share: a copy into a reused buffer, into new
# pages (the kernel zeroes each), and a write plus ``fsync`` (on GPU, copies
# from the device). A save waits for its slowest rank, whose speeds these are.

CHECKPOINT_BYTES = stalls.adam_checkpoint_bytes(ToyModel)
SPEEDS = run_on_ranks(disk.copy_and_write_speeds, CHECKPOINT_BYTES, CHECKPOINT_ROOT, THREADS)
LIMITS = results.record("limits", stalls.limits(SPEEDS, CHECKPOINT_BYTES))
print(stalls.share(LIMITS))
stalls.limits_table(LIMITS)

# %%
# Train with every strategy, then let them take turns
# ---------------------------------------------------
# Round 0 warms up (the page cache, first allocations, first checkpoints) and
# picks the intervals. Then every run once per round, in the same order
# (A B C ... A B C ...): a slow minute on a shared machine does not hit one
# strategy only, and each run is compared with the run without checkpoints *of
# its own round*. Each run prints its stall at the headline interval.


def measured_intervals(warm_up):
    """Steps between checkpoints per multiple, from the warm-up round's dcp.save and its
    median step without checkpoints, on the slowest rank."""
    run = {r["strategy"]: r for r in warm_up if r["threads"] == THREADS}
    step_s = statistics.median(t for t, _ in run["no checkpoint"]["segments"][0]["steps"])
    both = torch.tensor([run["dcp.save"]["segments"][0]["stall_s"], step_s], dtype=torch.float64)
    dist.all_reduce(both, op=dist.ReduceOp.MAX)
    save_s, step_s = both.tolist()
    intervals = {
        multiple: steps_between_checkpoints(save_s, step_s, multiple) for multiple in MULTIPLES
    }
    if dist.get_rank() == 0:
        every = ", ".join(f"{m}x: {n}" for m, n in intervals.items())
        print(f"a save takes {save_s:.3g} s, a step {step_s:.3g} s; steps per interval, {every}")
    return intervals


def outcome(run):
    """A run's stall at its last interval and its loss; in the warm-up, its first save."""
    stall, losses = run["segments"][-1]["stall_s"], run["losses"]
    return f"stall {stall:.3f} s, loss {losses[-1]:.6g}" if losses else f"first save {stall:.3f} s"


def benchmark(schedule, rounds):
    """Round 0 warms up, then every run of ``schedule`` once per round, in the same order."""
    model, optimizer, batch = set_up_training()
    training = (model, optimizer, batch, starting_point(model, optimizer))
    runs, intervals = [], {}
    for number in range(rounds + 1):
        directory = os.path.join(CHECKPOINT_ROOT, f"round-{number}")
        for strategy, threads in schedule:
            swept = strategy in SWEPT and threads == THREADS
            multiples = MULTIPLES if swept else (HEADLINE_MULTIPLE,)
            between = [intervals.get(multiple) for multiple in multiples]
            if number == 0:  # the warm-up: each first checkpoint, until durable; a few steps
                multiples, between = (None,), [0 if strategy != "no checkpoint" else 3]
            name = f"{strategy.replace(' ', '-').replace(',', '')}-{threads}-threads"
            paths = [f"{directory}/{name}-{i}" for i in range(len(between))]
            run = train_with_checkpoints(strategy, threads, paths, between, training)
            if dist.get_rank() == 0:
                when = f"round {number}" if number else "warm-up"
                print(f"{when:<8} {strategy:<26} threads {threads}, {outcome(run)}")
            run.update(round=number, strategy=strategy, threads=threads, multiples=multiples)
            runs.append(run)
        intervals = intervals or measured_intervals(runs)
        dist.barrier()
        if dist.get_rank() == 0:
            shutil.rmtree(directory, ignore_errors=True)  # the disk is the next round's
    return runs


# %%
# The page watches when each checkpoint becomes durable, each run's peak host
# memory on each rank (with the writer process's, sampled every 10 ms), and
# each checkpoint that rank 0 removes, just before it goes; the writer process
# logs every request to standard error: the page keeps its log in a file.

with (
    processes.stderr_of_started_processes(os.path.join(WORK_DIR, "logs")),
    timing.checkpoint_saves(dcp) as saves,
    memory.peak_between((dist, "new_group"), (dist, "destroy_process_group")) as peaks,
    disk.checked_before_removal(CHECKPOINT_ROOT) as removals,
):
    per_rank = run_on_ranks(benchmark, SCHEDULE, ROUNDS)


# %%
# What the runs prove: they took turns; every checkpoint was durable and
# complete on disk (its ``.metadata`` and every byte it lists); no strategy
# changed what the loop computes; the loop's timers saw every blocking save.
# Then each strategy's first checkpoint (the warm-up round's):

RUNS = results.record("runs", stalls.collect(per_rank, saves, peaks, removals, THREADS))
stalls.claim_interleaved("rounds-interleaved", RUNS, SCHEDULE, ROUNDS, THREADS)
stalls.claim_complete("every-checkpoint-complete", RUNS)
stalls.claim_same_losses("checkpoints-leave-training-unchanged", RUNS)
stalls.claim_timers_enclose_blocking_saves("loop-timers-see-blocking-saves", RUNS)
results.record("config", stalls.config(CHECKPOINT_GB, SCHEDULE, ROUNDS, RUNS, per_rank))
results.record("machine", machine.describe(WORK_DIR))
stalls.first_checkpoints_table(RUNS, STRATEGIES[1:])

# %%
# The numbers, with their spread
# ------------------------------
# At the headline interval, the slowest rank's stall and time until durable:
# the median over the rounds [lowest .. highest]. A stall smaller than that
# spread is *within noise*: this run cannot tell it from zero.

SUMMARY = results.record("summary", stalls.summarize(RUNS["runs"], HEADLINE_MULTIPLE))
stalls.summary_table(SUMMARY, STRATEGIES[1:], stalls.TIMES)

# %%
# What a checkpoint costs training, against the round's run without one: the
# median step that overlapped a save over its median step; the interval's
# wall time minus as many of its steps; peak host memory minus its. An effect
# below its spread, or below zero, is *within noise*.

stalls.summary_table(SUMMARY, STRATEGIES, stalls.COSTS)

# %%
# DefaultStager against dcp.save
# ------------------------------
# A stall reads best as a multiple of one memory copy of a rank's share: a
# strategy that stages in the foreground cannot stall much less, one that
# stages in the background can. What share of ``dcp.save``'s cost is left?

RATIOS = results.record("ratios", stalls.ratios(SUMMARY, STRATEGIES[1:], LIMITS["copy_s"]))
stalls.ratios_table(RATIOS, LIMITS["copy_s"])

# %%
# The goals, at ``make bench`` size (1 GB): a stall of at most 0.02x
# ``dcp.save``'s, a total overhead of at most 0.1x, met where the rounds are
# below by more than their spread (at this page's size, fixed costs weigh more).

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
# Left: the stall per checkpoint (log scale), with one memory copy of a rank's
# share. Right: the total overhead. Bars: medians; whiskers: lowest and highest.

FIGURE = stalls.figure(SUMMARY, STRATEGIES[1:], LIMITS, f"every 2x a save's time, {ROUNDS} rounds")
figures.save_beside(FIGURE, results.results_path())  # make bench: beside the results file

# %%
# The interval, swept
# -------------------
# The leading strategies at every interval, over ``dcp.save``'s time and over
# their own upload's (longer: it shares the machine with training); shorter
# than the upload, the loop waits for it. Pick yours as the benchmark did: time
# ``dcp.save`` and a step; checkpoint every ``steps_between_checkpoints(...)``.

SWEEP = results.record("sweep", stalls.sweep(RUNS["runs"], SWEPT, MULTIPLES))
SWEEP_FIGURE = stalls.sweep_figure(SWEEP, LIMITS, f"{ROUNDS} rounds")
figures.save_beside(SWEEP_FIGURE, results.results_path(), "sweep")
stalls.sweep_table(SWEEP)

# %%
# The thread budget, measured
# ---------------------------
# Where the knob ran (``torchrun``, a core to spare), both budgets' costs.

KNOB = stalls.thread_knob(SUMMARY, "DefaultStager overlap", THREADS, cores_per_rank())
results.record("thread_knob", KNOB)
stalls.thread_budget_table(SUMMARY, KNOB, "DefaultStager overlap", len(per_rank), THREADS)

# %%
# When to choose which
# --------------------
# Written from the numbers above. A strategy leads only if its median beats
# the next best by more than the larger spread; a smaller lead is no advice.
# Rerun the page, or ``make bench``, on your hardware.

ADVICE = results.record("advice", stalls.advice(SUMMARY, STRATEGIES[1:]))
stalls.advice_table(ADVICE)

# %%
# The same, as a training script for ``torchrun``
# -----------------------------------------------
# In your job ``torchrun`` starts the ranks, and ``main()`` does what
# ``run_on_ranks`` did: set the device, create the group, run the loop, destroy
# the group. The directory is one every rank sees (``shared_tempdir``'s here;
# a shared file system on several machines). Save it as ``train.py`` with the
# functions above, and:
#
# .. code-block:: bash
#
#    torchrun --nproc-per-node=2 train.py
#
# The cell runs ``main()`` as ``torchrun`` would: its environment, no group yet.


def main(checkpoint_dir, strategy="DefaultStager overlap", every=4):
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo")
    try:
        training = (*set_up_training(), lambda: None)  # one run: nothing to restore
        paths = [f"{checkpoint_dir}/checkpoint-{n}" for n in range(2)]
        run = train_with_checkpoints(strategy, training_threads(), paths, [every] * 2, training)
        stall, loss = max(s["stall_s"] for s in run["segments"]), run["losses"][-1]
        print(f"{strategy}: stall {stall:.3f} s per checkpoint at most, loss {loss:.6g}")
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
# * :ref:`sphx_glr_recipes_default_stager_recipe.py`: the overlapped copy, and its rules.
# * :ref:`sphx_glr_recipes_staging_pitfalls_recipe.py`: when the loop does not wait for staging.
# * :doc:`/troubleshooting`: symptoms and fixes for the usual DCP failures.
