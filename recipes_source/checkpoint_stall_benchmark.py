"""
How much does checkpointing stall training?
===========================================

A checkpoint costs a training job in three ways: the time the training loop
waits for it (the *stall*), the speed the steps lose while a checkpoint is
written in the background, and the host memory that holds a copy of the state.
This recipe trains the same model with a checkpoint every few steps, once per
saving strategy, and measures all of it next to the physical limits of the
machine that built this page: how fast it copies memory and how fast it writes
to disk. Every number is a median over rounds in which the strategies take
turns, shown with its spread; a difference smaller than its spread is reported
as noise, never as advice.

.. grid:: 2

    .. grid-item-card:: :octicon:`mortar-board;1em;` What you will learn
       :class-card: card-prerequisites

       * Five ways of saving from one training loop: ``dcp.save``,
         ``async_save``, ``async_save`` with a reused stager, ``DefaultStager``
         overlap and the checkpoint process
       * Measure each one's stall per checkpoint, the slow-down of the steps
         that overlap a save, the total cost and the peak host memory, with
         a warm-up run and the strategies interleaved
       * Tell an effect from noise: the median next to its spread
       * Budget CPU threads between training and the background writer
       * Run the same benchmark at full size with ``make bench``

    .. grid-item-card:: :octicon:`list-unordered;1em;` Prerequisites
       :class-card: card-prerequisites

       * PyTorch 2.9 or later (``DefaultStager``, ``StagingOptions``), but
         not 2.11.0, whose ``DefaultStager`` cannot be reused (:ref:`reused-stager-keyerror`)
       * CPU (gloo) or one GPU per rank (NCCL)
       * :ref:`sphx_glr_recipes_async_save_recipe.py` and
         :ref:`sphx_glr_recipes_default_stager_recipe.py`

Every cell below runs when this page is built. ``run_on_ranks`` starts the
ranks (or uses the ones ``torchrun`` made) and prints what each rank printed,
labelled ``[rankN]``. The training loop and the save calls are the code you
would put in a training script; the timers around them run in the build and
are in the downloadable ``.py``, but not on the page.
"""

# %%
# Setup
# -----
# The page trains a small model so that it builds in seconds. ``make bench``
# runs this same file under ``torchrun`` with ``DCP_RECIPES_BENCH=1``: a
# checkpoint of about 1 GB (``DCP_RECIPES_BENCH_GB`` sets the size, and
# ``DCP_RECIPES_BENCH_REPEATS`` the number of measured rounds, 2 by default),
# and it writes
# ``_build/bench/checkpoint_stall_benchmark.json`` and a ``.png`` figure next
# to it. ``DCP_RECIPES_BENCH_JSON`` writes them from any run, and
# ``DCP_RECIPES_BENCH_CHECKPOINTS`` keeps every checkpoint in that directory.

import os
import shutil
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from rank_launcher import run_on_ranks, shared_tempdir, under_torchrun
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
from torch.distributed.fsdp import fully_shard

# sphinx_gallery_start_ignore
# isort: split
import contextlib
import ctypes
import gc
import json
import mmap
import platform
import statistics
import sys
import threading
import time
from dataclasses import asdict
from pathlib import Path

import matplotlib.pyplot as plt
import psutil

# sphinx_gallery_end_ignore

BENCH = os.environ.get("DCP_RECIPES_BENCH") == "1"


def training_threads():
    """Threads each rank trains with: every core it has but one, which the writer gets."""
    if not under_torchrun():
        return 1  # ranks forked by this page keep the one thread they start with
    cores = (os.cpu_count() or 1) // int(os.environ["LOCAL_WORLD_SIZE"])
    return max(1, cores - 1)


@dataclass
class Config:
    checkpoint_gb: float  # all ranks together: parameters plus Adam's two moments
    checkpoint_every: int  # training steps from one checkpoint to the next
    checkpoints: int  # checkpoints per run
    training_threads: int
    batch: int = 16


CONFIG = Config(
    checkpoint_gb=float(os.environ.get("DCP_RECIPES_BENCH_GB", "1.0" if BENCH else "0.06")),
    checkpoint_every=4 if BENCH else 2,
    checkpoints=2 if BENCH else 1,
    training_threads=training_threads(),
)
WORK_DIR = shared_tempdir("dcp-stall-benchmark-")
CHECKPOINT_ROOT = os.environ.get("DCP_RECIPES_BENCH_CHECKPOINTS") or os.path.join(
    WORK_DIR, "checkpoints"
)
# sphinx_gallery_start_ignore
REPEATS = int(os.environ.get("DCP_RECIPES_BENCH_REPEATS", "2"))
if REPEATS < 2:
    raise ValueError(
        f"DCP_RECIPES_BENCH_REPEATS={REPEATS}: at least 2 rounds are needed to show a spread"
    )
KEEP_CHECKPOINTS = bool(os.environ.get("DCP_RECIPES_BENCH_CHECKPOINTS"))
if BENCH:
    RESULTS_JSON = os.environ.get(
        "DCP_RECIPES_BENCH_JSON", "_build/bench/checkpoint_stall_benchmark.json"
    )
else:
    RESULTS_JSON = os.environ.get("DCP_RECIPES_BENCH_JSON")
# sphinx_gallery_end_ignore
print(f"torch {torch.__version__}; {CONFIG}")


# %%
# The model and the state a checkpoint holds
# ------------------------------------------
# A stack of square ``Linear`` layers, sharded with FSDP2 over all ranks and
# trained with Adam. A checkpoint holds the parameters and Adam's two moments:
# 12 bytes per parameter, so the size of the model follows from the size of the
# checkpoint. Each rank saves only its own shards.


def model_shape(config):
    """(layers, width) of a model whose checkpoint is about ``config.checkpoint_gb``."""
    parameters = config.checkpoint_gb * 1e9 / 12
    width = 1024 if parameters < 50e6 else 2048
    return max(1, round(parameters / (width * width + width))), width


def device_for_this_rank():
    # The launcher (or your own set-up code) has already picked this rank's GPU.
    if torch.accelerator.is_available():
        return torch.accelerator.current_accelerator()
    return torch.device("cpu")


def build_model(config):
    layers, width = model_shape(config)
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])
    fully_shard(model.to(device_for_this_rank()))
    return model, torch.optim.Adam(model.parameters(), lr=1e-4)


def checkpoint_state(model, optimizer):
    # Sharded state dicts keyed by parameter name; no tensor is copied here.
    model_state_dict, optimizer_state_dict = get_state_dict(model, optimizer)
    return {"model": model_state_dict, "optim": optimizer_state_dict}


def train_step(model, batch):
    loss = model(batch).pow(2).mean()
    loss.backward()
    return loss


print(f"{model_shape(CONFIG)[0]} layers of width {model_shape(CONFIG)[1]}")


# %%
# Five ways to save
# -----------------
# ``start_checkpoint`` starts one checkpoint and returns what is still *in
# flight*: a future for the copy to host memory (*staging*) and one for the
# write (*upload*), or ``None`` where nothing runs in the background.
#
# * ``dcp.save`` copies nothing: it writes straight from the training tensors
#   and returns when the checkpoint is on disk.
# * ``async_save`` copies the state into fresh host memory before it returns,
#   then writes that copy in a thread.
# * ``async_save, cached buffer`` passes a ``DefaultStager`` that the loop
#   reuses for every save, so every copy goes into the same host buffer.
# * ``DefaultStager overlap`` makes the copy itself run in the background,
#   during the next forward and backward pass. The loop must wait for the
#   staging future before ``optimizer.step()`` changes the weights. (That is
#   safe for this model: its forward pass changes no tensor of the state dict;
#   see :ref:`sphx_glr_recipes_staging_pitfalls_recipe.py`.)
# * ``process writer`` (``AsyncCheckpointerType.PROCESS``) writes in a separate
#   process that DCP starts on the first save, so the write does not hold this
#   process's GIL. It stages into shared memory, which that process maps. That
#   process logs every request at INFO level to the standard error it
#   inherits: start it with standard error pointing at a log of its own if your
#   training log must stay quiet (this page's build does).
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


def staging_options(*, in_background, for_process=False):
    on_gpu = torch.accelerator.is_available()
    return StagingOptions(
        use_pinned_memory=on_gpu,  # page-locked memory only speeds up copies from a device
        use_shared_memory=for_process,  # only a checkpoint *process* reads shared memory in place
        use_async_staging=in_background,
        use_non_blocking_copy=on_gpu,
    )


def new_stager(strategy):
    """The stager a strategy reuses for every save (it keeps the host buffer), or None."""
    if strategy == "async_save, cached buffer":
        return DefaultStager(staging_options(in_background=False))
    if strategy == "DefaultStager overlap":
        return DefaultStager(staging_options(in_background=True))
    if strategy == "process writer":
        return DefaultStager(staging_options(in_background=True, for_process=True))
    return None


def start_checkpoint(strategy, state_dict, path, group, stager):
    """Start one checkpoint; returns (staging, upload) futures, None where nothing is left."""
    if strategy == "dcp.save":
        dcp.save(state_dict, checkpoint_id=path, process_group=group)
        return None, None
    if strategy in ("async_save", "async_save, cached buffer"):
        upload = dcp.async_save(
            state_dict, checkpoint_id=path, process_group=group, async_stager=stager
        )
        return None, upload
    writer = AsyncCheckpointerType.THREAD
    if strategy == "process writer":
        writer = AsyncCheckpointerType.PROCESS
    response = dcp.async_save(
        state_dict,
        checkpoint_id=path,
        process_group=group,
        async_stager=stager,
        async_checkpointer_type=writer,
    )
    return response.staging_completion, response.upload_completion


# %%
# The training loop with checkpoints
# ----------------------------------
# The loop a training script would have: a checkpoint every
# ``checkpoint_every`` steps, at most one checkpoint in flight, and a wait for
# staging before ``optimizer.step()``. Checkpoints go through a gloo group of
# their own, so background writes never share a group with training
# collectives. One run trains ``(checkpoints + 1) * checkpoint_every`` steps, so
# the last checkpoint overlaps as many steps as the others.
#
# In the build, timers run around these statements (they are in the
# downloadable ``.py``, not on the page). Before the loop, each run takes one
# step (Adam creates its state on its first step, and every checkpoint must hold
# the same tensors) and one untimed first checkpoint, which starts what a
# strategy starts once (its host buffer, the writer process); its time until
# durable is kept as ``first checkpoint``. What the timers measure:
#
# * *stall*: the time the loop waits for checkpoints: the save call, the wait
#   for staging before ``optimizer.step()``, and the waits for the upload before
#   the next save and at the end;
# * *step time*: forward, backward and optimizer step, without those waits; a
#   step *overlaps* a save if the last checkpoint was not yet durable when the
#   step began;
# * *wall*: the whole loop, the last wait for durability included;
# * *peak host memory*: a thread samples the rank's resident memory (and the
#   private memory of the writer process) every 10 ms, above what it was when
#   the run began; memory that earlier runs freed is handed back to the system
#   first, so that a run cannot reuse it unseen.
#
# After the run every checkpoint is checked: its ``.metadata`` (which DCP
# writes last) exists, and ``dcp.load`` reads the last one back.

# sphinx_gallery_start_ignore
RUN_LABEL = {"label": "run"}  # set before each run: its checkpoints go under it


class PeakHostMemory:
    """Samples this process's resident memory, and its children's private memory."""

    def __init__(self, interval=0.01):
        self.process = psutil.Process()
        # Earlier runs of this process freed memory that the C allocator may keep
        # and hand out again without the resident size growing: give it back first.
        gc.collect()
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        self.children = self.process.children(recursive=True)
        self.baseline = self.peak = self.resident()
        self.interval = interval
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()

    def resident(self):
        total = self.process.memory_info().rss
        for child in self.children:  # the writer process, once started
            with contextlib.suppress(psutil.Error):
                info = child.memory_info()
                total += info.rss - info.shared  # the staged copy is shared: count it once
        return total

    def _sample(self):
        samples = 0
        while not self.stopped.is_set():
            if samples % 20 == 0:
                self.children = self.process.children(recursive=True)
            self.peak = max(self.peak, self.resident())
            samples += 1
            self.stopped.wait(self.interval)

    def stop_mb(self):
        self.stopped.set()
        self.thread.join()
        return (self.peak - self.baseline) / 1e6


@contextlib.contextmanager
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


def complete_checkpoints(paths, state_dict, group):
    """How many of ``paths`` have their ``.metadata``; the last one must also load."""
    complete = sum(os.path.exists(os.path.join(path, ".metadata")) for path in paths)
    if paths:
        dcp.load(state_dict, checkpoint_id=paths[-1], process_group=group)
    return complete


class RunTimer:
    """What one rank measures in one run of ``train_with_checkpoints``."""

    def __init__(self, strategy, model, optimizer, batch, group, stager, directory):
        self.strategy, self.group = strategy, group
        self.directory = directory
        self.stall, self.steps, self.durable, self.paths = 0.0, [], [], []
        self.first_checkpoint = None
        self.started_at = time.time()  # when the run began: the order of the runs
        train_step(model, batch)  # one step: Adam creates its state
        optimizer.step()
        optimizer.zero_grad()
        self.memory = PeakHostMemory()
        if strategy != "no checkpoint":
            # The untimed first checkpoint. The writer process logs every request at
            # INFO level to the standard error it inherits: give it a log of its own.
            path = os.path.join(directory, "step-0")
            log = os.path.join(WORK_DIR, f"writer-rank{dist.get_rank()}.log")
            started = time.perf_counter()
            with standard_error_to(log):
                staging, upload = start_checkpoint(
                    strategy, checkpoint_state(model, optimizer), path, group, stager
                )
                for future in (staging, upload):
                    if future is not None:
                        future.result()
            self.first_checkpoint = time.perf_counter() - started
            self.paths.append(path)
        dist.barrier(group)
        self.started = self.step_done = time.perf_counter()

    def step_begins(self, upload):
        now = time.perf_counter()
        self.stall += now - self.step_done  # the checkpoint part of the last iteration
        self.overlapped = upload is not None and not upload.done()
        self.step_started = now

    def forward_backward_done(self):
        self.forward_backward_at = time.perf_counter()

    def staging_waited(self):
        self.staging_wait = time.perf_counter() - self.forward_backward_at
        self.stall += self.staging_wait

    def step_ends(self):
        if torch.accelerator.is_available():
            torch.accelerator.synchronize()  # include the work queued on the GPU
        self.step_done = time.perf_counter()
        step_time = self.step_done - self.step_started - self.staging_wait
        self.steps.append([step_time, self.overlapped])

    def save_begins(self):
        self.save_started = time.perf_counter()

    def saved(self, path, upload):
        self.paths.append(path)
        self.durable.append(None)
        index, started = len(self.durable) - 1, self.save_started

        def durable(_future=None):
            self.durable[index] = time.perf_counter() - started

        if upload is None:
            durable()  # a blocking save is durable when it returns
        else:
            upload.add_done_callback(durable)

    def finished(self):
        now = time.perf_counter()
        self.stall += now - self.step_done  # the wait for the last upload
        self.wall = now - self.started

    def results(self, model, optimizer):
        while None in self.durable:  # the done-callback runs right after the future resolves
            time.sleep(0.0001)
        peak_memory_mb = self.memory.stop_mb()
        complete = complete_checkpoints(self.paths, checkpoint_state(model, optimizer), self.group)
        dist.barrier(self.group)
        if dist.get_rank() == 0 and not KEEP_CHECKPOINTS:
            shutil.rmtree(self.directory, ignore_errors=True)
        return {
            "started_at": self.started_at,
            "training_threads": torch.get_num_threads(),
            "stall": self.stall,
            "timed_checkpoints": len(self.durable),
            "durable": self.durable,
            "steps": self.steps,
            "wall": self.wall,
            "first_checkpoint": self.first_checkpoint,
            "peak_memory_mb": peak_memory_mb,
            "paths": [os.path.relpath(p, CHECKPOINT_ROOT) for p in self.paths],
            "complete": complete,
        }


# sphinx_gallery_end_ignore


def train_with_checkpoints(strategy, config):
    torch.set_num_threads(config.training_threads)  # see "Thread budget" below
    group = dist.new_group(backend="gloo")  # checkpoints never share training's group
    model, optimizer = build_model(config)
    torch.manual_seed(100 + dist.get_rank())  # each rank trains on its own data
    batch = torch.randn(config.batch, model[0].in_features, device=device_for_this_rank())
    directory = os.path.join(CHECKPOINT_ROOT, strategy.replace(" ", "-").replace(",", ""))
    stager = new_stager(strategy)
    # sphinx_gallery_start_ignore
    directory = os.path.join(CHECKPOINT_ROOT, RUN_LABEL["label"])
    timer = RunTimer(strategy, model, optimizer, batch, group, stager, directory)
    # sphinx_gallery_end_ignore
    staging = upload = None
    saved = []
    steps = (config.checkpoints + 1) * config.checkpoint_every
    for step in range(1, steps + 1):
        # sphinx_gallery_start_ignore
        timer.step_begins(upload)
        # sphinx_gallery_end_ignore
        loss = train_step(model, batch)
        # sphinx_gallery_start_ignore
        timer.forward_backward_done()
        # sphinx_gallery_end_ignore
        if staging is not None:
            staging.result()  # the copy is complete before the weights change
            staging = None
        # sphinx_gallery_start_ignore
        timer.staging_waited()
        # sphinx_gallery_end_ignore
        optimizer.step()
        optimizer.zero_grad()
        # sphinx_gallery_start_ignore
        timer.step_ends()
        # sphinx_gallery_end_ignore
        if strategy != "no checkpoint" and step % config.checkpoint_every == 0 and step < steps:
            if upload is not None:
                upload.result()  # one checkpoint at a time: a reused buffer may be in use
            # sphinx_gallery_start_ignore
            timer.save_begins()
            # sphinx_gallery_end_ignore
            if torch.accelerator.is_available():
                # The stager copies on its own stream, which does not wait for this one.
                torch.accelerator.current_stream().synchronize()
            path = os.path.join(directory, f"step-{step}")
            state_dict = checkpoint_state(model, optimizer)
            staging, upload = start_checkpoint(strategy, state_dict, path, group, stager)
            saved.append(path)
            # sphinx_gallery_start_ignore
            timer.saved(path, upload)
            # sphinx_gallery_end_ignore
    if upload is not None:
        upload.result()  # the last checkpoint is on disk before training ends
    # sphinx_gallery_start_ignore
    timer.finished()
    # sphinx_gallery_end_ignore
    if stager is not None:
        stager.close()
    result = {"checkpoints": saved, "loss": loss.item()}
    # sphinx_gallery_start_ignore
    result.update(timer.results(model, optimizer))
    # sphinx_gallery_end_ignore
    dist.destroy_process_group(group)
    return result


# %%
# The machine's limits
# --------------------
# No strategy can stage a checkpoint faster than the machine copies memory, or
# make it durable faster than the disk writes and syncs it. Each rank measures,
# at the same time as the others (as they would save): a copy of its share of
# the checkpoint into a buffer it already touched (what a reused staging buffer
# does), into pages new from the kernel (what fresh staging costs at worst: the
# kernel must also supply and zero every page), and a write plus ``fsync`` into
# the checkpoint directory. On GPU the copies go from the device to host memory
# (pinned when reused).

# (This cell's code measures and prints; it runs in the build and is in the
# downloadable .py, but not shown here.)
# sphinx_gallery_start_ignore


def checkpoint_bytes(config):
    """Bytes of the whole checkpoint of ``build_model(config)``: 3 fp32 tensors per parameter."""
    layers, width = model_shape(config)
    return 3 * 4 * layers * (width * width + width)


def best_seconds(action, repeats=3):
    times = []
    for _ in range(repeats):
        dist.barrier()
        started = time.perf_counter()
        action()
        if torch.accelerator.is_available():
            torch.accelerator.synchronize()
        times.append(time.perf_counter() - started)
    return min(times)


def copy_into_fresh_pages(source):
    # An anonymous mapping: every page comes new from the kernel. (A freed
    # tensor's memory may be handed out again by the allocator, already mapped.)
    buffer = mmap.mmap(-1, source.numel() * source.element_size())
    target = torch.frombuffer(buffer, dtype=source.dtype)
    target.copy_(source)
    del target
    buffer.close()


def write_and_sync(tensor, path):
    view = memoryview(tensor.numpy()).cast("B")
    with open(path, "wb", buffering=0) as file:
        while view:
            view = view[file.write(view) :]
        os.fsync(file.fileno())


def measure_limits(total_bytes, config):
    torch.set_num_threads(config.training_threads)
    nbytes = total_bytes // dist.get_world_size()
    on_gpu = torch.accelerator.is_available()
    source = torch.rand(nbytes // 4, device=device_for_this_rank())
    reused = torch.empty(nbytes // 4, pin_memory=on_gpu)
    reused.copy_(source)  # touch every page once, as a reused buffer has
    os.makedirs(CHECKPOINT_ROOT, exist_ok=True)
    probe = os.path.join(CHECKPOINT_ROOT, f"write-probe-rank{dist.get_rank()}.bin")
    seconds = {
        "copy_reused": best_seconds(lambda: reused.copy_(source)),
        "copy_fresh": best_seconds(lambda: copy_into_fresh_pages(source)),
        "write_fsync": best_seconds(lambda: write_and_sync(reused, probe), repeats=2),
    }
    os.remove(probe)
    return {name: nbytes / s / 1e9 for name, s in seconds.items()}


TOTAL_BYTES = checkpoint_bytes(CONFIG)
PER_RANK_LIMITS = run_on_ranks(measure_limits, TOTAL_BYTES, CONFIG)
# A save waits for its slowest rank: keep the lowest bandwidth of any rank.
LIMITS_GBPS = {name: min(rank[name] for rank in PER_RANK_LIMITS) for name in PER_RANK_LIMITS[0]}
RANKS = len(PER_RANK_LIMITS)
BYTES_PER_RANK = TOTAL_BYTES // RANKS
COPY_SECONDS = BYTES_PER_RANK / (LIMITS_GBPS["copy_reused"] * 1e9)
print(f"checkpoint: {TOTAL_BYTES / 1e6:,.0f} MB in all, {BYTES_PER_RANK / 1e6:,.0f} MB per rank")
for name, label in [
    ("copy_reused", "copy into a reused buffer"),
    ("copy_fresh", "copy into new pages"),
    ("write_fsync", "write + fsync"),
]:
    seconds = BYTES_PER_RANK / (LIMITS_GBPS[name] * 1e9)
    print(f"{label:<26} {LIMITS_GBPS[name]:6.2f} GB/s per rank: {seconds:.3f} s per checkpoint")
# sphinx_gallery_end_ignore


# %%
# Train with every strategy, then let them take turns
# ---------------------------------------------------
# ``train_with_every_strategy`` runs the loop once per strategy, on the same
# ranks. In the build this first round is the warm-up: it touches the
# checkpoint directory and the page cache, makes the ranks' first allocations,
# runs DCP's first-call set-up and starts the writer process, and its numbers
# are not used. Then come the measured rounds, in the same ranks: every
# strategy once per round, in the same order (A B C ... A B C ...), so that a
# slow minute on a shared machine, or a disk that fills its cache, does not hit
# one strategy only, and each run is compared with the run without checkpoints
# *of its own round*. Under ``torchrun`` with a core to spare, the run without
# checkpoints and ``DefaultStager`` overlap also run with every core for
# training, in the same rounds (see "Thread budget"). Each round's line shows
# a run's wall time, its stall per checkpoint and how many of the checkpoints it
# wrote passed the check.

# sphinx_gallery_start_ignore
KNOB_STRATEGIES = ("no checkpoint", "DefaultStager overlap")
CORES_PER_RANK = max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
EVERY_CORE = None
if under_torchrun() and CONFIG.training_threads < CORES_PER_RANK:
    EVERY_CORE = Config(**{**asdict(CONFIG), "training_threads": CORES_PER_RANK})
SCHEDULE = [(name, name, CONFIG) for name in STRATEGIES]  # (label, strategy, config)
if EVERY_CORE:
    SCHEDULE += [
        (f"{name} ({CORES_PER_RANK} threads)", name, EVERY_CORE) for name in KNOB_STRATEGIES
    ]


def slug(name):
    return name.replace(" ", "-").replace(",", "").replace("(", "").replace(")", "")


def measured_rounds():
    """On every rank: REPEATS rounds of SCHEDULE, interleaved. Returns (order, runs)."""
    order, runs = [], {label: [] for label, _, _ in SCHEDULE}
    for repeat in range(REPEATS):
        for label, strategy, config in SCHEDULE:
            RUN_LABEL["label"] = f"round-{repeat + 1}-{slug(label)}"
            runs[label].append(train_with_checkpoints(strategy, config))
            order.append(label)
    return order, runs


# sphinx_gallery_end_ignore


def train_with_every_strategy(config):
    results = {}
    for strategy in STRATEGIES:
        # sphinx_gallery_start_ignore
        RUN_LABEL["label"] = f"warm-up-{slug(strategy)}"
        # sphinx_gallery_end_ignore
        results[strategy] = train_with_checkpoints(strategy, config)
        checkpoints, loss = len(results[strategy]["checkpoints"]), results[strategy]["loss"]
        if dist.get_rank() == 0:
            print(f"{strategy:<26} {checkpoints} checkpoints, final loss {loss:.4g}")
    # sphinx_gallery_start_ignore
    results = {"warmup": results, "measured": measured_rounds()}
    # sphinx_gallery_end_ignore
    return results


per_rank = run_on_ranks(train_with_every_strategy, CONFIG)

# sphinx_gallery_start_ignore
WARMUP = {name: [rank["warmup"][name] for rank in per_rank] for name in STRATEGIES}
ORDER = per_rank[0]["measured"][0]
assert all(rank["measured"][0] == ORDER for rank in per_rank)
RUNS = {
    label: [[rank["measured"][1][label][i] for rank in per_rank] for i in range(REPEATS)]
    for label, _, _ in SCHEDULE
}
for index, label in enumerate(ORDER):
    round_number = index // len(SCHEDULE)
    run = RUNS[label][round_number]
    wall = max(r["wall"] for r in run)
    checkpoints = run[0]["timed_checkpoints"]
    stall = max(r["stall"] for r in run) / checkpoints if checkpoints else 0.0
    print(
        f"round {round_number + 1} {label:<34} wall {wall:6.2f} s, stall {stall:6.3f} s per "
        f"checkpoint, checkpoints complete: {min(r['complete'] for r in run)} of "
        f"{len(run[0]['paths'])}"
    )
# sphinx_gallery_end_ignore


# %%
# The numbers, with their spread
# ------------------------------
# Per run, a stall is the slowest rank's total wait divided by the number of
# checkpoints; the slow-down compares the median step that overlapped a save
# with the median step of the round's run without checkpoints; the total
# overhead and the extra memory are the run's wall time and peak host memory
# minus those of the round's run without checkpoints. Each line shows the
# median over the rounds and, in brackets, the lowest and highest value. An
# effect (a stall, a slow-down above 1.00x, an overhead, extra memory) that is
# smaller than that spread (highest minus lowest) is marked *within noise*: this
# run cannot tell it from zero. So is every effect below zero: a checkpoint does
# not make training faster or use less memory, so a negative median measures
# how noisy the machine was, nothing else.

# (This cell's code measures and prints; it runs in the build and is in the
# downloadable .py, but not shown here.)
# sphinx_gallery_start_ignore
# metric: (heading, format, unit, the value of "no effect"; None: not an effect)
METRICS = {
    "stall_per_checkpoint_s": ("stall per checkpoint", ".3f", " s", 0.0),
    "overlapped_step_slowdown": ("slow-down of steps that overlap a save", ".2f", "x", 1.0),
    "overhead_s": ("total overhead over the run without checkpoints", "+.2f", " s", 0.0),
    "extra_memory_mb": ("extra peak host memory per rank", "+.0f", " MB", 0.0),
    "time_until_durable_s": ("time from save call until durable", ".3f", " s", None),
    "first_checkpoint_s": ("first checkpoint, until durable", ".2f", " s", None),
    "wall_s": None,  # in the JSON only
}


def median_or_none(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def run_metrics(per_rank, baseline):
    """One run's metrics from every rank's measurements; ``baseline``: the same round's."""
    checkpoints = per_rank[0]["timed_checkpoints"]
    base_step = statistics.median(t for r in baseline for t, _ in r["steps"])
    overlapped = [t for r in per_rank for t, over in r["steps"] if over]
    wall = max(r["wall"] for r in per_rank)
    firsts = [r["first_checkpoint"] for r in per_rank if r["first_checkpoint"] is not None]
    return {
        "stall_per_checkpoint_s": (
            max(r["stall"] for r in per_rank) / checkpoints if checkpoints else None
        ),
        "overlapped_step_slowdown": (
            statistics.median(overlapped) / base_step if overlapped else None
        ),
        "overhead_s": wall - max(r["wall"] for r in baseline),
        "extra_memory_mb": (
            max(r["peak_memory_mb"] for r in per_rank) - max(r["peak_memory_mb"] for r in baseline)
        ),
        "time_until_durable_s": median_or_none(
            [max(r["durable"][i] for r in per_rank) for i in range(checkpoints)]
        ),
        "first_checkpoint_s": max(firsts) if firsts else None,
        "wall_s": wall,
    }


def baseline_of(label):
    return label.replace(label.split(" (")[0], "no checkpoint", 1)


def summarize(runs):
    """Per run label and metric: median, min, max, each round's value; effects vs. noise."""
    summary = {}
    for label, rounds in runs.items():
        baseline = runs[baseline_of(label)]
        per_round = [run_metrics(run, baseline[i]) for i, run in enumerate(rounds)]
        summary[label] = {}
        for metric, spec in METRICS.items():
            values = [m[metric] for m in per_round]
            known = [v for v in values if v is not None]
            entry = {
                "median": statistics.median(known) if known else None,
                "min": min(known) if known else None,
                "max": max(known) if known else None,
                "values": values,
            }
            neutral = spec[3] if spec else None
            if neutral is not None and known and not label.startswith("no checkpoint"):
                entry["effect"] = entry["median"] - neutral
                entry["spread"] = entry["max"] - entry["min"]
                # An effect below zero (faster, or less memory, than without
                # checkpoints) cannot be real: it is noise, whatever its spread.
                entry["within_noise"] = entry["effect"] < entry["spread"]
            summary[label][metric] = entry
    return summary


def fmt(value, spec):
    return "-" if value is None else format(value, spec)


def show(entry, spec, unit):
    if entry["median"] is None:
        return "-"
    low, high = fmt(entry["min"], spec), fmt(entry["max"], spec)
    text = f"{fmt(entry['median'], spec)}{unit} [{low} .. {high}]"
    return text + ("  within noise" if entry.get("within_noise") else "")


SUMMARY = summarize(RUNS)
print(f"medians over {REPEATS} rounds [lowest .. highest]")
for metric, spec in METRICS.items():
    if spec is None:
        continue
    heading, number, unit, _ = spec
    print(f"\n{heading}:")
    for name in STRATEGIES[1:]:
        print(f"  {name:<26} {show(SUMMARY[name][metric], number, unit)}")
baseline_wall = SUMMARY["no checkpoint"]["wall_s"]
print(f"\nthe run without checkpoints took {show(baseline_wall, '.2f', ' s')}")
# sphinx_gallery_end_ignore


# %%
# DefaultStager against dcp.save
# ------------------------------
# A stall is best read as a multiple of the time one memory copy of the
# checkpoint takes on this machine (``checkpoint bytes / memcpy bandwidth``
# into a reused buffer): a strategy that stages in the foreground cannot stall
# less than about that, and one that stages in the background can. The
# question this benchmark answers: what share of ``dcp.save``'s cost is left
# with ``DefaultStager`` overlap, in the same rounds, with the thread budget
# below (one core per rank left to the writer)? The goal: a total overhead of at
# most 0.1x ``dcp.save``'s at ``make bench`` size (1 GB, one rank). Small
# checkpoints leave ``DefaultStager`` with its fixed costs (the state dict, the
# planning), so the ratios at this page's size say less.

# (This cell's code measures and prints; it runs in the build and is in the
# downloadable .py, but not shown here.)
# sphinx_gallery_start_ignore
OVERHEAD_GOAL = 0.1


def ratios(summary, copy_seconds):
    def med(name, metric):
        return summary[name][metric]["median"]

    per_strategy = {}
    for name in STRATEGIES[1:]:
        stall = med(name, "stall_per_checkpoint_s")
        per_strategy[name] = {
            "stall_vs_copy_time": stall / copy_seconds,
            "stall_vs_dcp_save": stall / med("dcp.save", "stall_per_checkpoint_s"),
            "overhead_vs_dcp_save": med(name, "overhead_s") / med("dcp.save", "overhead_s"),
        }
    overhead = per_strategy["DefaultStager overlap"]["overhead_vs_dcp_save"]
    # A ratio to an overhead that is itself noise says nothing: then the goal is not met.
    measurable = not summary["dcp.save"]["overhead_s"]["within_noise"]
    headline = {
        "stall_vs_dcp_save": per_strategy["DefaultStager overlap"]["stall_vs_dcp_save"],
        "overhead_vs_dcp_save": overhead,
        "goal": OVERHEAD_GOAL,
        "dcp_save_overhead_within_noise": not measurable,
        "met": measurable and overhead <= OVERHEAD_GOAL,
        "training_threads": CONFIG.training_threads,
    }
    return per_strategy, headline


RATIOS, HEADLINE = ratios(SUMMARY, COPY_SECONDS)
print(f"one copy of a rank's share into a reused buffer: {COPY_SECONDS * 1e3:.1f} ms")
print(f"{'':<26} {'stall / copy':>12} {'stall / dcp.save':>17} {'overhead / dcp.save':>20}")
for name, ratio in RATIOS.items():
    print(
        f"{name:<26} {ratio['stall_vs_copy_time']:11.1f}x {ratio['stall_vs_dcp_save']:16.3f}x "
        f"{ratio['overhead_vs_dcp_save']:19.2f}x"
    )
for name in ("dcp.save", "DefaultStager overlap"):
    if SUMMARY[name]["overhead_s"]["within_noise"]:
        print(f"{name}'s total overhead is within noise: the overhead ratio says little")
verdict = "met" if HEADLINE["met"] else "not met"
if HEADLINE["dcp_save_overhead_within_noise"]:
    verdict += ", dcp.save's overhead within noise"
print(
    f"DefaultStager's total overhead is {HEADLINE['overhead_vs_dcp_save']:.2f}x dcp.save's "
    f"with {CONFIG.training_threads} training thread(s) per rank: goal (<= {OVERHEAD_GOAL}x) "
    f"{verdict}, at this size"
)
# sphinx_gallery_end_ignore


# %%
# The figure
# ----------
# Left: what the training loop waits per checkpoint (log scale), with the time
# of one memory copy of a rank's share for reference. Right: what the whole run
# cost over the run without checkpoints of its round, stalls and slower steps
# together. The bars are medians, the whiskers the lowest and highest round.

# (This cell's code measures and prints; it runs in the build and is in the
# downloadable .py, but not shown here.)
# sphinx_gallery_start_ignore


def whiskers(entries):
    return [[e["median"] - e["min"] for e in entries], [e["max"] - e["median"] for e in entries]]


def draw(summary, copy_seconds):
    names = list(STRATEGIES[1:])
    stalls = [summary[n]["stall_per_checkpoint_s"] for n in names]
    totals = [summary[n]["overhead_s"] for n in names]
    figure, (left, right) = plt.subplots(1, 2, figsize=(10, 3.6), sharey=True)
    values = [e["median"] for e in stalls]
    bars = left.barh(names, values, xerr=whiskers(stalls), color="tab:blue", capsize=3)
    left.bar_label(bars, [f"{s:.3g} s" for s in values], padding=8, fontsize="small")
    left.axvline(copy_seconds, color="black", linestyle="--", label="one memcpy of a rank's share")
    left.set_xscale("log")
    left.set_xlim(right=max(e["max"] for e in stalls) * 8)  # room for the labels
    left.set_xlabel("stall per checkpoint (s, log scale)")
    left.legend(loc="lower right", fontsize="small")
    left.invert_yaxis()
    values = [e["median"] for e in totals]
    labels = [
        f"{t:+.2f} s" + (" (noise)" if e["within_noise"] else "")
        for t, e in zip(values, totals, strict=True)
    ]
    bars = right.barh(names, values, xerr=whiskers(totals), color="tab:orange", capsize=3)
    right.bar_label(bars, labels, padding=8, fontsize="small")
    right.margins(x=0.35)
    right.axvline(0, color="black", linewidth=0.8)
    right.set_xlabel("total overhead over no checkpoint (s)")
    figure.suptitle(
        f"torch {torch.__version__}, {os.cpu_count()} cores: checkpoint "
        f"{TOTAL_BYTES / 1e9:.2f} GB, {RANKS} rank(s), {CONFIG.checkpoints} checkpoints "
        f"every {CONFIG.checkpoint_every} steps, {REPEATS} rounds"
    )
    figure.tight_layout()
    return figure


FIGURE = draw(SUMMARY, COPY_SECONDS)
plt.show()
# sphinx_gallery_end_ignore


# %%
# Thread budget
# -------------
# A background writer, thread or process, needs CPU time while training runs,
# and on a machine with few cores it takes it from the training steps (the
# slow-down above). The knob is the number of threads training uses,
# ``torch.set_num_threads``: by default PyTorch uses every core; leave one per
# rank to the writer, as ``training_threads()`` does. The ranks this page forks
# train with one thread; under ``torchrun`` (``make bench``) the run without
# checkpoints and ``DefaultStager`` overlap also ran with every core for
# training, in the same rounds, and this cell compares ``DefaultStager``'s
# overhead with both budgets.

# (This cell's code measures and prints; it runs in the build and is in the
# downloadable .py, but not shown here.)
# sphinx_gallery_start_ignore
KNOB = {}
if EVERY_CORE:
    KNOB = {
        "threads": {"recommended": CONFIG.training_threads, "every_core": CORES_PER_RANK},
        "labels": {name: f"{name} ({CORES_PER_RANK} threads)" for name in KNOB_STRATEGIES},
    }
    for threads, labels in (
        (CONFIG.training_threads, {name: name for name in KNOB_STRATEGIES}),
        (CORES_PER_RANK, KNOB["labels"]),
    ):
        for name in KNOB_STRATEGIES[1:]:
            entry = SUMMARY[labels[name]]
            overhead = show(entry["overhead_s"], "+.2f", " s")
            stall = show(entry["stall_per_checkpoint_s"], ".3f", " s")
            print(f"{name}, {threads} training thread(s): total overhead {overhead}; stall {stall}")
else:
    left = max(0, os.cpu_count() - RANKS * CONFIG.training_threads)
    print(
        f"{os.cpu_count()} cores; {RANKS} ranks train with {CONFIG.training_threads} thread(s) "
        f"each: {left} core(s) left to the writers"
    )
    if under_torchrun():
        print("thread knob: not run (each rank has one core, none to spare)")
    else:
        print("thread knob: not run here (forked ranks train with one thread); make bench runs it")
# sphinx_gallery_end_ignore


# %%
# When to choose which
# --------------------
# These sentences are written by the code below from the numbers above, so
# they say what this run measured, on this machine, at this size. A strategy
# leads on a criterion only if its median beats the next best by more than the
# larger of the two spreads; a smaller lead is noise and gives no advice. Rerun
# the page, or ``make bench``, on your own hardware before you choose.

# (This cell's code measures and prints; it runs in the build and is in the
# downloadable .py, but not shown here.)
# sphinx_gallery_start_ignore
CRITERIA = {
    "stall_per_checkpoint_s": "the pause per checkpoint matters most",
    "overhead_s": "the total training time matters most",
    "extra_memory_mb": "host memory is tight",
}


def advice(summary):
    names = list(STRATEGIES[1:])
    sentences = {}
    for metric, when in CRITERIA.items():
        heading, number, unit, _ = METRICS[metric]
        best, second = sorted(names, key=lambda n: summary[n][metric]["median"])[:2]
        a, b = summary[best][metric], summary[second][metric]
        lead = b["median"] - a["median"]
        noise = max(a["max"] - a["min"], b["max"] - b["min"])
        numbers = (
            f"{best} {fmt(a['median'], number)}{unit}, {second} {fmt(b['median'], number)}{unit}"
        )
        if lead < noise:
            sentences[metric] = (
                f"No advice on {heading}: {best} leads {second} by {lead:.3g}{unit}, "
                f"within noise (spread {noise:.3g}{unit}; {numbers})."
            )
        else:
            sentences[metric] = f"Choose {best} when {when}: {numbers}."
    return sentences


ADVICE = advice(SUMMARY)
for sentence in ADVICE.values():
    print(sentence)
# sphinx_gallery_end_ignore


# %%
# The results file
# ----------------
# ``make bench`` (or ``DCP_RECIPES_BENCH_JSON=path``) writes every number: the
# order the runs ran in, per run and metric the median, the lowest and highest
# round and each round's value, the per-rank measurements they come from (the
# warm-up round's too), the limits, the machine and the torch version. The
# figure goes next to it.

# (This cell's code measures and prints; it runs in the build and is in the
# downloadable .py, but not shown here.)
# sphinx_gallery_start_ignore


def machine():
    memory_gb = psutil.virtual_memory().total / 2**30
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    return {"cpu": cpu, "cores": os.cpu_count(), "memory_gb": round(memory_gb, 1)}


def results():
    return {
        "torch": torch.__version__,
        "machine": machine(),
        "accelerator": torch.accelerator.is_available(),
        "world_size": RANKS,
        "launcher": "torchrun" if under_torchrun() else "fork",
        "config": asdict(CONFIG),
        "repeats": REPEATS,
        "checkpoint_bytes": TOTAL_BYTES,
        "checkpoint_bytes_per_rank": BYTES_PER_RANK,
        "limits_GBps": LIMITS_GBPS,
        "limits_GBps_per_rank": PER_RANK_LIMITS,
        "copy_seconds_per_checkpoint": COPY_SECONDS,
        "strategies": list(STRATEGIES),
        "warmup": {"order": list(WARMUP), "runs": WARMUP},
        "order": ORDER,
        "summary": SUMMARY,
        "ratios": RATIOS,
        "headline": HEADLINE,
        "advice": ADVICE,
        "thread_knob": KNOB,
        "checkpoints_kept_in": CHECKPOINT_ROOT if KEEP_CHECKPOINTS else None,
        "runs": RUNS,
    }


WRITES_HERE = not dist.is_initialized() or dist.get_rank() == 0  # torchrun: rank 0 writes
if not RESULTS_JSON:
    print("no results file requested (set DCP_RECIPES_BENCH_JSON, or run make bench)")
elif WRITES_HERE:
    json_path = Path(RESULTS_JSON)
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(results(), indent=1) + "\n")
    FIGURE.savefig(json_path.with_suffix(".png"), dpi=120)
    print(f"wrote {json_path} and {json_path.with_suffix('.png')}")
# sphinx_gallery_end_ignore


# %%
# Clean up
# --------

shutil.rmtree(WORK_DIR, ignore_errors=True)
print(f"removed {WORK_DIR}: {not os.path.exists(WORK_DIR)}")
# sphinx_gallery_start_ignore
if WRITES_HERE:
    print(
        f"checkpoint_stall_benchmark: DefaultStager stall {HEADLINE['stall_vs_dcp_save']:.3f} of "
        f"dcp.save's, total overhead {HEADLINE['overhead_vs_dcp_save']:.2f} of dcp.save's "
        f"(goal <= {OVERHEAD_GOAL}x: {verdict})"
    )
# sphinx_gallery_end_ignore


# %%
# What to read next
# -----------------
# * :ref:`sphx_glr_recipes_async_save_recipe.py`: the asynchronous save this
#   page measures, step by step.
# * :ref:`sphx_glr_recipes_default_stager_recipe.py`: overlapping the copy to
#   host memory with the next forward and backward pass, and its rules.
# * :ref:`sphx_glr_recipes_staging_pitfalls_recipe.py`: what goes wrong when
#   the training loop does not wait for staging.
# * :doc:`/troubleshooting`: symptoms and fixes for the usual DCP failures.
