"""
How much does checkpointing stall training?
===========================================

A checkpoint costs a training job the time the loop waits for it (the *stall*), the speed
steps lose while it is written in the background, and the host memory that holds a copy.
This recipe trains one model with each saving strategy, at intervals of half to 2.5 times
an upload's time, next to the machine's limits. Every number is a median over rounds where
the strategies take turns, with its spread; an effect most rounds did not show is noise.

.. grid:: 2

    .. grid-item-card:: :octicon:`mortar-board;1em;` What you will learn
       :class-card: card-prerequisites

       * Six ways of saving from one loop: ``dcp.save``, ``async_save``, ``DefaultStager``
         overlap, DCP's checkpoint process, direct I/O, torch_checkpointing
       * Time the stall in the loop itself, in rounds where strategies take turns
       * Pick the checkpoint interval from two measured numbers
       * Tell an effect from noise; see why a background save slows training

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
# A small model, to build in seconds. The file runs as it is under ``torchrun``:
# ``make bench`` runs it so, with ``DCP_RECIPES_BENCH=1`` (1 GB).

import ctypes.util
import functools
import gc
import math
import os
import shutil
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from direct_io import AlignedStager, async_save_in_place
from page_tools import disk, figures, machine, memory, neighbors, processes, results, stalls, timing
from rank_launcher import run_on_ranks, shared_tempdir, under_torchrun
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.fsdp import fully_shard
from torch_checkpointing import AsyncCheckpointSaverConfig, CheckpointManager
from torch_checkpointing.staging import CheckpointStagerConfig
from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig

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
# Square ``Linear`` layers, sharded with FSDP2, trained with Adam on batches of 128: a
# forward and backward pass long enough for staging to hide in, as on a GPU. A checkpoint
# holds weights and Adam's two moments (12 bytes per parameter), and sizes the model.

PARAMETERS = CHECKPOINT_GB * 1e9 / 12
WIDTH = 1024 if PARAMETERS < 50e6 else 2048
DEPTH, BATCH, LR = max(1, round(PARAMETERS / (WIDTH * WIDTH + WIDTH))), 128, 1e-4


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
# What every page of this site shares: state, device, sharded model, optimizer.


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
# Six ways to save
# ----------------
# * ``dcp.save`` writes from the training tensors, and returns once they are on
#   disk. ``async_save`` copies the state into host memory allocated per save, then writes
#   that copy in a thread (a reused stager: :ref:`sphx_glr_recipes_async_save_recipe.py`).
# * ``DefaultStager overlap`` copies during the next forward and backward pass, and the
#   loop waits for it before ``optimizer.step()`` (safe: this forward pass changes no tensor
#   of the state: :ref:`sphx_glr_recipes_staging_pitfalls_recipe.py`).
# * ``process writer`` (``AsyncCheckpointerType.PROCESS``) writes in DCP's own process,
#   free of this one's GIL, from the shared memory the stager fills.
# * ``direct I/O overlap``: the same overlap, no copy: DCP's thread writes the training
#   tensors with ``O_DIRECT`` where they lie (``direct_io.py``; ``THP_MEM_ALLOC_ENABLE=1``).
# * ``torch_checkpointing``'s ``CheckpointManager`` stages into shared memory in the
#   background and writes in its own process; ``lock()`` holds ``optimizer.step()`` until
#   staged. CPU settings from its guide (no direct I/O: ext4 fails it); a thread here fsyncs.
#
# .. versionadded:: 2.9
#    ``DefaultStager``, ``StagingOptions`` and the ``AsyncSaveResponse`` of a background stage.

STRATEGIES = ("no checkpoint", "dcp.save", "async_save", "DefaultStager overlap")
STRATEGIES += ("process writer", "direct I/O overlap", "torch_checkpointing")


def staging_options(use_async_staging, checkpoint_process=False):
    """How every save on this page stages its copy, chosen from the machine."""
    on_gpu = torch.accelerator.is_available()
    return StagingOptions(
        use_pinned_memory=on_gpu,  # page-locked memory only speeds up copies from a device
        use_shared_memory=checkpoint_process,  # only a checkpoint *process* reads it in place
        use_async_staging=use_async_staging,
        use_non_blocking_copy=on_gpu,
    )


class DurableCheckpointManager(CheckpointManager):
    """torch_checkpointing's manager, whose saves are done once their files are on disk."""

    def __init__(self, config):
        super().__init__(config)
        self.syncing = ThreadPoolExecutor(max_workers=1)

    def save(self, checkpoint_id, checkpoint):
        return self.syncing.submit(synced, super().save(checkpoint_id, checkpoint), checkpoint_id)

    def result(self):  # the loop waits for its staging as for a future: until the lock is free
        with self.lock():
            pass


def synced(write, directory):
    """Once the write is done (every rank's files, renamed): fsync files and dirs."""
    write.result()
    if int(os.environ.get("LOCAL_RANK", dist.get_rank())) != 0:  # each machine's first rank
        return
    for name in [*os.listdir(directory), ".", ".."]:  # the files, the directory, its parent
        fd = os.open(os.path.join(directory, name), os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)


@functools.cache  # one per process, as in a job: its writer process starts once
def checkpoint_manager():
    on_gpu = torch.cuda.is_available()  # pinned memory and non-blocking copies need CUDA
    staging = CheckpointStagerConfig(use_pinned_memory=on_gpu, use_non_blocking_copy=on_gpu)
    save = AsyncCheckpointSaverConfig(staging_config=staging)
    storage = LocalFileSystemStorageConfig(use_direct_io=False)
    return DurableCheckpointManager(CheckpointManager.Config(save=save, storage_config=storage))


def new_stager(strategy):
    """The stager a strategy reuses for every save (it keeps the host buffer), or None."""
    if strategy == "torch_checkpointing":
        return checkpoint_manager()
    if strategy in ("DefaultStager overlap", "process writer"):
        return DefaultStager(staging_options(True, checkpoint_process=strategy == "process writer"))
    direct_from_gpu = strategy == "direct I/O overlap" and torch.accelerator.is_available()
    return AlignedStager() if direct_from_gpu else None  # from the CPU: no copy at all


def start_checkpoint(strategy, state_dict, path, group, stager):
    """Start one checkpoint; returns what is in flight (None: nothing): a future for
    *staging* (until then, the state must not change) and one for the write (*upload*)."""
    if strategy == "dcp.save":
        dcp.save(state_dict, checkpoint_id=path, process_group=group)
        return None, None
    if strategy == "async_save":  # it stages, and builds its writer from the path
        return None, dcp.async_save(state_dict, checkpoint_id=path, process_group=group)
    if strategy == "torch_checkpointing":  # staged once its lock is free
        state = {key: value.state_dict() for key, value in state_dict.items()}
        return stager, stager.save(path, state)  # staging: until its lock is free
    if strategy == "direct I/O overlap":  # from the training tensors (on a GPU: a stager's copy)
        response = async_save_in_place(state_dict, path, group, stager)
        return response.staging_completion, response.upload_completion
    writer = dcp.FileSystemWriter(path, per_thread_copy_ahead=0)  # 0: no GPU 0 context
    checkpointer = AsyncCheckpointerType["PROCESS" if strategy == "process writer" else "THREAD"]
    options = dict(storage_writer=writer, process_group=group, async_stager=stager)
    response = dcp.async_save(state_dict, async_checkpointer_type=checkpointer, **options)
    return response.staging_completion, response.upload_completion


# %%
# Time what the loop waits for
# ----------------------------
# ``time.perf_counter()`` around every call that may wait for a checkpoint (the save,
# staging before ``optimizer.step()``, the upload) gives the *stall*; a step's time is
# the rest. A stager allocates its buffer at its first save: each run stages once first.


def waited(future):
    """Wait for a checkpoint's future, if there is one; returns the seconds the loop waited."""
    started = time.perf_counter()
    if future is not None:
        future.result()
    return time.perf_counter() - started


def train_step(model, optimizer, batch, staging):
    """Forward, backward, optimizer step; returns the loss and the seconds waited for staging."""
    loss = (model(batch) - batch.flip(1)).pow(2).mean()  # a target it cannot reach soon
    loss.backward()
    staged = waited(staging)  # staging is done before the weights change
    optimizer.step()
    optimizer.zero_grad()
    if torch.accelerator.is_available():
        torch.accelerator.synchronize()  # the step's time includes its work on the GPU
    return loss, staged


# %%
# Each rank builds the model and takes a step: Adam creates its state, so every checkpoint
# holds the same tensors. Each run restores a copy, then takes an untimed step (it is slow).


def set_up_training():
    """This rank's model, optimizer and batch, after Adam's first step."""
    keep_freed_host_memory()  # glibc's malloc: see "Thread budget, and memory a step frees"
    model, optimizer = build_sharded_model(seed=0)
    torch.manual_seed(100 + dist.get_rank())  # each rank trains on its own data
    batch = torch.rand(BATCH, WIDTH, device=device_for_this_rank())
    train_step(model, optimizer, batch, None)  # Adam creates its state
    return model, optimizer, batch


def starting_point(model, optimizer):
    """Keep a copy of the weights and the optimizer's state; returns what puts it back."""
    tensors = [*model.parameters()] + [v for s in optimizer.state.values() for v in s.values()]
    saved = [tensor.detach().clone() for tensor in tensors]

    def restore():
        with torch.no_grad():
            for tensor, copy in zip(tensors, saved, strict=True):
                tensor.copy_(copy)

    return restore


# %%
# How often to checkpoint
# -----------------------
# A background save is free only if the next one starts after it is on disk. The upload's
# time (the warm-up's ``DefaultStager overlap``, call to disk, beside 2 steps) and a step's
# pick the interval: it at 0.5, 1, 1.5, 2.5 times that, others at 2.5 (dcp.save 0.5, none 1.5).

MULTIPLES = (0.5, 1, 1.5, 2.5)  # checkpoint intervals, in multiples of an upload's time
# 2.5: a real job's regime, 2x every strategy's upload or more (at 1 GB, some take 15% longer)
HEADLINE_MULTIPLE, SWEPT = 2.5, ("DefaultStager overlap",)  # SWEPT: at every interval


def steps_between_checkpoints(upload_s, step_s, multiple=HEADLINE_MULTIPLE):
    """The fewest steps that take at least ``multiple`` times an upload's time."""
    return max(1, math.ceil(multiple * upload_s / step_s))


def intervals_of(strategy, threads):
    """The multiples a run checkpoints at (the thread knob's runs: at 1)."""
    if threads != THREADS:
        return (1,)
    fixed = {"no checkpoint": (1.5,), "dcp.save": (MULTIPLES[0],)}  # 1.5: steps for a median
    return fixed.get(strategy, MULTIPLES if strategy in SWEPT else (HEADLINE_MULTIPLE,))


# %%
# The training loop with checkpoints
# ----------------------------------
# A checkpoint, the steps of one interval, at most one checkpoint in flight, a wait for
# staging before ``optimizer.step()``, a gloo group for checkpoints; a step *overlaps* a
# save that was not yet durable when it began. The loop notes when each save is on disk.


def train_with_checkpoints(strategy, threads, paths, intervals, training):
    """Per interval: a checkpoint, that many steps, a wait until it is on disk."""
    model, optimizer, batch, restore = training
    torch.set_num_threads(threads)  # see "Thread budget" below
    restore()
    group = dist.new_group(backend="gloo")  # checkpoints never share training's group
    train_step(model, optimizer, batch, None)  # untimed: see "starting_point"
    gc.collect()  # then freeze what lives: no full collection (0.3 s here) walks it in
    gc.freeze()  # a timed step or save again (torchtitan, too, picks when they run)
    state_dict, stager = {"app": AppState(model, optimizer)}, new_stager(strategy)
    if isinstance(stager, DefaultStager | AlignedStager):  # its host buffer, now (not the manager)
        waited(stager.stage({key: value.state_dict() for key, value in state_dict.items()}))
    saving, segments, losses = strategy != "no checkpoint", [], []
    dist.barrier(group)  # every rank starts the timed loop together
    for path, steps_between in zip(paths, intervals, strict=True):
        began, staging, upload, durable = time.perf_counter(), None, None, []
        if saving:
            turn_s = sys.getswitchinterval()  # Python's default: 0.005
            sys.setswitchinterval(0.0005)  # short GIL turns while the call starts threads
            try:
                staging, upload = start_checkpoint(strategy, state_dict, path, group, stager)
            finally:
                sys.setswitchinterval(turn_s)  # the steps' turns again, even after an error
        if upload is not None:  # when it is on disk: how far apart checkpoints must be
            upload.add_done_callback(lambda _, at=durable: at.append(time.perf_counter()))
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
        on_disk = durable[0] if durable else time.perf_counter()  # its callback may come later
        segments.append(dict(steps_between=steps_between, stall_s=stall, steps=steps, wall_s=wall))
        segments[-1]["upload_s"] = on_disk - began if upload is not None else None  # call to disk
    if isinstance(stager, DefaultStager | AlignedStager):
        stager.close()
    dist.destroy_process_group(group)
    return {"checkpoints": paths if saving else [], "segments": segments, "losses": losses}


# %%
# Thread budget, and memory a step frees
# --------------------------------------
# A background writer needs CPU time: training's ``set_num_threads`` leaves it the other
# cores, if any (the table counts them; under ``torchrun``, a knob too). Each rank keeps the
# blocks glibc's ``malloc`` would hand back (FSDP's all-gathers, to fault in every step). A
# save's call waits for the GIL at each thread it starts: turns of 0.5 ms, not 5, meanwhile.


def keep_freed_host_memory(largest_block=32 << 20):
    """glibc: blocks up to ``largest_block`` from the heap, never trimmed (False elsewhere)."""
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    settings = {-3: largest_block, -1: 2**31 - 1}  # M_MMAP_THRESHOLD, M_TRIM_THRESHOLD
    return hasattr(libc, "mallopt") and all(libc.mallopt(*kv) == 1 for kv in settings.items())


CORES_PER_RANK = (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
THREADS = max(1, CORES_PER_RANK - 1) if under_torchrun() else 1  # forked ranks: one thread
SCHEDULE = [(strategy, THREADS) for strategy in STRATEGIES]
if under_torchrun() and CORES_PER_RANK > THREADS:  # the knob: every core for training
    SCHEDULE += [("no checkpoint", CORES_PER_RANK), ("DefaultStager overlap", CORES_PER_RANK)]
print(f"{len(SCHEDULE)} runs per round; training threads per rank: {THREADS}")

# %%
# The machine's limits
# --------------------
# No strategy stages faster than the machine copies memory, or saves faster than
# the disk writes and syncs. Every rank at once, its share: a copy into a reused
# buffer, into new pages, a write plus ``fsync``; the slowest rank's speeds.

CHECKPOINT_BYTES = stalls.adam_checkpoint_bytes(ToyModel)
SPEEDS = run_on_ranks(disk.copy_and_write_speeds, CHECKPOINT_BYTES, CHECKPOINT_ROOT, THREADS)
LIMITS = results.record("limits", stalls.limits(SPEEDS, CHECKPOINT_BYTES))
print(stalls.share(LIMITS))
stalls.limits_table(LIMITS)

# %%
# Train with every strategy, then let them take turns
# ---------------------------------------------------
# Round 0 warms up and picks the intervals. Then every run once per round, in
# the same order (A B C ... A B C ...), each compared with the run without
# checkpoints *of its own round*, from the state after the first step.


def measured_intervals(warm_up):
    """Steps per multiple, from the warm-up's upload and its median step without a save."""
    first = {r["strategy"]: r["segments"][0] for r in warm_up if r["threads"] == THREADS}
    step_s = statistics.median(t for t, _ in first["no checkpoint"]["steps"])
    both = torch.tensor([first[SWEPT[0]]["upload_s"], step_s], dtype=torch.float64)
    dist.all_reduce(both, op=dist.ReduceOp.MAX)  # the slowest rank's
    upload_s, step_s = both.tolist()
    intervals = {m: steps_between_checkpoints(upload_s, step_s, m) for m in MULTIPLES}
    if dist.get_rank() == 0:
        every = ", ".join(f"{m}x {n}" for m, n in intervals.items())  # 88 columns at most
        print(f"upload {upload_s:.3g} s, step {step_s:.3g} s; steps per interval: {every}")
    return intervals


def outcome(run):  # its stall at its last interval and loss; in the warm-up, its first save
    stall, losses = run["segments"][-1]["stall_s"], run["losses"]
    shown = f"stall {stall:.3f} s, loss {losses[-1]:.6g}" if losses else f"first save {stall:.3f} s"
    return f"{run['strategy']:<26} threads {run['threads']}, {shown}"


def benchmark(schedule, rounds):
    """Round 0 warms up, then every run of ``schedule`` once per round, in the same order."""
    model, optimizer, batch = set_up_training()
    training = (model, optimizer, batch, starting_point(model, optimizer))
    runs, intervals = [], {}
    for number in range(rounds + 1):
        directory = os.path.join(CHECKPOINT_ROOT, f"round-{number}")
        for strategy, threads in schedule:
            multiples = intervals_of(strategy, threads) if number else (None,)
            warm_up = {"no checkpoint": 3, SWEPT[0]: 2}.get(strategy, 0)  # steps; 2: the upload's
            between = [intervals.get(multiple, warm_up) for multiple in multiples]
            name = f"{directory}/{strategy.replace(' ', '-').replace('/', '')}-{threads}-threads"
            paths = [f"{name}-{i}" for i in range(len(between))]
            run = train_with_checkpoints(strategy, threads, paths, between, training)
            run.update(round=number, strategy=strategy, threads=threads, multiples=multiples)
            runs.append(run)
            if dist.get_rank() == 0:
                print(f"{f'round {number}' if number else 'warm-up':<8} {outcome(run)}")
        intervals = intervals or measured_intervals(runs)
        dist.barrier()
        if dist.get_rank() == 0:
            shutil.rmtree(directory, ignore_errors=True)  # the disk is the next round's
    checkpoint_manager().close()  # waits for its last write, stops its writer process
    return runs


# %%
# The page watches when each checkpoint becomes durable, each run's peak memory
# (with its writer processes'), and each checkpoint rank 0 removes, before it goes.

with (
    processes.stderr_of_started_processes(os.path.join(WORK_DIR, "logs")),
    timing.checkpoint_saves(dcp, DurableCheckpointManager) as saves,
    memory.peak_between((dist, "new_group"), (dist, "destroy_process_group")) as peaks,
    disk.checked_before_removal(CHECKPOINT_ROOT) as removals,
):
    per_rank = run_on_ranks(benchmark, SCHEDULE, ROUNDS)

# %%
# What the runs prove: turns taken, checkpoints durable and complete, losses
# unchanged, blocking saves timed; then first checkpoints and their memory.

RUNS = stalls.collect(per_rank, saves, peaks, removals, THREADS, memory_kept=STRATEGIES[-1:])
results.record("runs", RUNS)  # torch_checkpointing (the last) keeps its memory between runs
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
# Slowest rank's stall and time until durable at the headline interval, median
# [lowest .. highest]. Stalls compare as factors: highest over lowest is noise.

SUMMARY = results.record("summary", stalls.summarize(RUNS["runs"], HEADLINE_MULTIPLE))
stalls.summary_table(SUMMARY, STRATEGIES[1:], stalls.TIMES)

# %%
# Costs to training, against the run's own steps that overlapped no save (their
# median): the median step that overlapped one over that; the stall plus what those
# steps took beyond it (total overhead), and per second from the stall to durable; peak
# host memory over the run without one's, in whole MB. An effect is noise where most rounds
# showed none, an overhead where most rounds' was a tenth of a step or less (the caption).

stalls.summary_table(SUMMARY, STRATEGIES, stalls.COSTS)

# %%
# Each strategy against dcp.save
# ------------------------------
# A stall reads best as a multiple of one memory copy of a rank's share (foreground
# staging copies it all: one copy is its floor). What share of ``dcp.save``'s cost is left?

RATIOS = results.record("ratios", stalls.ratios(SUMMARY, STRATEGIES[1:], LIMITS["copy_s"]))
stalls.ratios_table(RATIOS, LIMITS["copy_s"])

# %%
# The goals (``make bench``: 1 GB), for the least total overhead of the background stagers:
# stall at most 0.02x dcp.save's median, overhead 0.05x. Met: every round below, by more
# than a round resolves; not met: every round above by more; else undecided.

BEST = min(STRATEGIES[3:], key=lambda name: SUMMARY[name]["overhead_s"]["median"])
GOALS = stalls.goals_of(SUMMARY, [BEST], stall_per_checkpoint_s=0.02, overhead_s=0.05)
results.record("goals", GOALS)
HEADLINE = stalls.headline(RATIOS, GOALS[BEST], BEST, THREADS, HEADLINE_MULTIPLE)
results.record("headline", HEADLINE)
stalls.print_summary_line(BENCH, results.recipe_name(), HEADLINE, GOALS[BEST])  # make bench
stalls.goals_table(GOALS)

# %%
# Why steps slow down beside a save
# ---------------------------------
# Rank 0's step without FSDP, on a quarter of the layers (the same work per layer), alone,
# then beside a helper on another core: a process that spins, copies or writes, or a thread
# copying as a stager does, letting it run or holding its GIL. What a second of each costs it:

QUARTER = (neighbors.beside_helpers, functools.partial(ToyModel, depth=max(1, DEPTH // 4)))
HELPERS_ON_RANK_0 = run_on_ranks(*QUARTER, train_step, (BATCH, WIDTH), THREADS, WORK_DIR, ROUNDS)
HELPED = neighbors.summarize(HELPERS_ON_RANK_0[0])
GOAL_S = GOALS[BEST]["overhead_s"]["goal"] * SUMMARY["dcp.save"]["overhead_s"]["median"]
WHY = stalls.against_goal(SUMMARY, BEST, GOAL_S)
results.record("background_work", {"helpers": HELPED, "against_goal": WHY})
print(figures.wrap(WHY["said"]))
neighbors.table(HELPED)

# %%
# The figure
# ----------
# Left: the stall per checkpoint (log scale), with one memory copy of a rank's
# share. Right: the total overhead. Bars: medians; whiskers: lowest and highest.

FIGURE = stalls.figure(SUMMARY, STRATEGIES[1:], LIMITS, HEADLINE_MULTIPLE, ROUNDS)
figures.save_beside(FIGURE, results.results_path())  # make bench: beside the results file

# %%
# The interval, swept
# -------------------
# ``DefaultStager overlap`` at every interval, over ``dcp.save``'s time and its own upload's
# (under ``torchrun``, with a core to spare, both thread budgets at 1x). Pick yours from two
# times your loop takes, as this one does: ``steps_between_checkpoints(upload_s, step_s)``.

KNOB_RUN = stalls.label("DefaultStager overlap", CORES_PER_RANK, THREADS)  # where it ran
SWEEP = results.record("sweep", stalls.sweep(RUNS["runs"], [*SWEPT, KNOB_RUN]))
SWEEP_FIGURE = stalls.sweep_figure(SWEEP, LIMITS, f"{ROUNDS} rounds")
figures.save_beside(SWEEP_FIGURE, results.results_path(), "sweep")
stalls.sweep_table(SWEEP)

# %%
# Where the knob ran, both thread budgets at 1x an upload's time: more where most rounds were.

AT_1X = stalls.at_interval(SWEEP, 1)
KNOB = stalls.thread_knob(AT_1X, "DefaultStager overlap", THREADS, CORES_PER_RANK)
results.record("thread_knob", KNOB)
stalls.thread_budget_table(AT_1X, KNOB, "DefaultStager overlap", len(per_rank), THREADS)

# %%
# When to choose which
# --------------------
# From the rounds above: a strategy leads only if it is below each other in most rounds
# (a stall: by over a GIL turn, 5 ms). Rerun the page, or ``make bench``, on yours.

ADVICE = results.record("advice", stalls.advice(SUMMARY, STRATEGIES[1:]))
stalls.advice_table(ADVICE)

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
# * :ref:`sphx_glr_recipes_torch_checkpointing_recipe.py`: torch_checkpointing's resume loop.
# * :doc:`/troubleshooting`: symptoms and fixes for the usual DCP failures.
