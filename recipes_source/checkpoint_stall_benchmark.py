"""
How much does checkpointing stall training?
===========================================

A checkpoint costs a training job in three ways: the time the training loop
waits for it (the *stall*), the speed the steps lose while a checkpoint is
written in the background, and the host memory that holds a copy of the state.
This recipe trains the same model with a checkpoint every few steps, once per
saving strategy, side by side in one run, and measures all of it next to the
physical limits of the machine that built this page: how fast it copies memory
and how fast it writes to disk. The advice at the end is generated from the
numbers on this page, so it is only as general as this machine.

.. grid:: 2

    .. grid-item-card:: :octicon:`mortar-board;1em;` What you will learn
       :class-card: card-prerequisites

       * Measure, for six ways of saving, the stall per checkpoint, the
         slow-down of the steps that overlap a save, the total cost, the time
         until a checkpoint is durable and the peak host memory
       * Compare each stall with the time a plain memory copy of the
         checkpoint takes on the same machine
       * Budget CPU threads between training and the background writer
       * Run the same benchmark at full size with ``make bench``

    .. grid-item-card:: :octicon:`list-unordered;1em;` Prerequisites
       :class-card: card-prerequisites

       * PyTorch 2.9 or later (``DefaultStager``)
       * CPU (gloo) or one GPU per rank (NCCL)
       * :ref:`sphx_glr_recipes_async_save_recipe.py` and
         :ref:`sphx_glr_recipes_default_stager_recipe.py`

Every cell below runs when this page is built. ``run_on_ranks`` starts the
ranks (or uses the ones ``torchrun`` made) and prints what each rank printed,
labelled ``[rankN]``; the functions it runs are the code you would put in a
training script.
"""

# %%
# Setup
# -----
# The page trains a small model so that it builds in seconds. ``make bench``
# runs this same file with ``DCP_RECIPES_BENCH=1``: a checkpoint of about 1 GB
# (``DCP_RECIPES_BENCH_GB`` sets it), more repetitions, and it writes
# ``_build/bench/results.json`` and ``_build/bench/stall.png``.
# ``DCP_RECIPES_BENCH_JSON`` writes the JSON file (and the figure next to it)
# from any run; ``DCP_RECIPES_BENCH_CHECKPOINTS`` keeps every checkpoint in
# that directory, for inspection, instead of deleting it after its check.

import contextlib
import gc
import importlib.machinery
import json
import mmap
import multiprocessing
import multiprocessing.util
import os
import platform
import shutil
import statistics
import sys
import threading
import time
from concurrent.futures import Future
from dataclasses import asdict, dataclass
from multiprocessing import resource_sharer
from pathlib import Path

import matplotlib.pyplot as plt
import psutil
import torch
import torch._dynamo  # noqa: F401  (fully_shard imports it on first use: once here, not per rank)
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from rank_launcher import run_on_ranks, shared_tempdir, under_torchrun
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
from torch.distributed.fsdp import fully_shard

BENCH = os.environ.get("DCP_RECIPES_BENCH") == "1"


@dataclass
class BenchConfig:
    checkpoint_gb: float  # all ranks together: parameters plus Adam's two moments
    checkpoints: int  # timed checkpoints per run, after one untimed first checkpoint
    steps_between: int  # training steps from one checkpoint to the next
    repeats: int  # runs per strategy; the tables show the median
    batch: int = 16
    training_threads: int = 1  # torch.set_num_threads for the training loop


CONFIG = BenchConfig(
    checkpoint_gb=float(os.environ.get("DCP_RECIPES_BENCH_GB", "1.0" if BENCH else "0.06")),
    checkpoints=2,
    steps_between=4 if BENCH else 3,
    repeats=int(os.environ.get("DCP_RECIPES_BENCH_REPEATS", "2" if BENCH else "1")),
)
# Training threads per rank: see "Thread budget" below.
CORES_PER_RANK = max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
if under_torchrun():
    CONFIG.training_threads = max(1, CORES_PER_RANK - 1)  # one core left to the writer
if BENCH:
    RESULTS_JSON = os.environ.get("DCP_RECIPES_BENCH_JSON", "_build/bench/results.json")
else:
    RESULTS_JSON = os.environ.get("DCP_RECIPES_BENCH_JSON")
KEEP_CHECKPOINTS = os.environ.get("DCP_RECIPES_BENCH_CHECKPOINTS")

WORK_DIR = shared_tempdir("dcp-stall-benchmark-")
CHECKPOINT_ROOT = KEEP_CHECKPOINTS or os.path.join(WORK_DIR, "checkpoints")
print(f"torch {torch.__version__}; {CONFIG}")
print(f"checkpoints go to {CHECKPOINT_ROOT}")


# %%
# The model and the state a checkpoint holds
# ------------------------------------------
# A stack of square ``Linear`` layers, sharded with FSDP2 over all ranks and
# trained with Adam. A checkpoint holds the parameters and Adam's two moments:
# 12 bytes per parameter, so the size of the model follows from the size of the
# checkpoint we want. Each rank saves only its own shards.


def device_for_this_rank():
    # The launcher (or your own set-up code) has already picked this rank's GPU.
    if torch.accelerator.is_available():
        return torch.accelerator.current_accelerator()
    return torch.device("cpu")


def synchronize():
    # Step times must include the work queued on the GPU, not only its launch.
    if torch.accelerator.is_available():
        torch.accelerator.synchronize()


def model_shape(config):
    """(layers, width) of a model whose checkpoint is about ``config.checkpoint_gb``."""
    parameters = config.checkpoint_gb * 1e9 / 12
    width = 1024 if parameters < 50e6 else 2048
    return max(1, round(parameters / (width * width + width))), width


def build_model(config):
    layers, width = model_shape(config)
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])
    model = model.to(device_for_this_rank())
    fully_shard(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    return model, optimizer


def checkpoint_state(model, optimizer):
    # Sharded state dicts keyed by parameter name; no tensor is copied here.
    model_state_dict, optimizer_state_dict = get_state_dict(model, optimizer)
    return {"model": model_state_dict, "optim": optimizer_state_dict}


def train_step(model, optimizer, batch):
    loss = model(batch).pow(2).mean()
    loss.backward()
    return loss


# %%
# Six ways to save
# ----------------
# Each strategy is one small class with the two calls a training loop needs:
# ``save`` starts a checkpoint and returns what is still *in flight* (the copy
# to host memory, called staging, and the write, called upload), and ``close``
# releases what the strategy holds. Every checkpoint goes through a gloo group
# of its own, so background writes never share a group with training
# collectives.
#
# * ``dcp.save`` copies nothing: it writes straight from the training tensors
#   and returns when the checkpoint is on disk.
# * ``async_save`` copies the state into fresh host memory before it returns,
#   then writes that copy in a thread.
# * ``async_save`` with a cached buffer copies into the same host buffer every
#   time. On CPU a ``DefaultStager`` that is reused for every save keeps that
#   buffer; on GPU ``FileSystemWriter(cache_staged_state_dict=True)`` keeps a
#   pinned one.
# * ``DefaultStager`` overlap also makes the copy itself run in the background,
#   while the next forward and backward pass run. The loop must wait for
#   ``staging_completion`` before ``optimizer.step()`` changes the weights.
#   (That is safe for this model: its forward pass changes no tensor of the
#   state dict. See :ref:`sphx_glr_recipes_staging_pitfalls_recipe.py`.)
# * The process writer (``AsyncCheckpointerType.PROCESS``) writes in a separate
#   process that DCP starts on the first save, so the write does not hold this
#   process's GIL. It stages into shared memory, which that process maps.
#
# .. versionadded:: 2.9
#    ``DefaultStager``, ``StagingOptions`` and the ``AsyncSaveResponse`` that
#    ``async_save`` returns when staging runs in the background.
#
# ``InFlight`` holds what a started checkpoint still does in the background.
# Before the next save the loop always waits until the previous one is written
# (``wait_until_durable``): a cached buffer must not be overwritten while it is
# still being written.


@dataclass
class InFlight:
    """What a started checkpoint still does in the background."""

    started: float
    staging: Future | None = None  # resolves when the copy to host memory is done
    upload: Future | None = None  # resolves when the checkpoint is on disk
    durable_at: float | None = None

    def __post_init__(self):
        if self.upload is None:
            self.durable_at = time.perf_counter()  # a blocking save is durable on return
        else:
            self.upload.add_done_callback(self._mark_durable)

    def _mark_durable(self, _future):
        self.durable_at = time.perf_counter()

    def is_durable(self):
        return self.upload is None or self.upload.done()

    def wait_until_staged(self):
        if self.staging is not None:
            self.staging.result()
            self.staging = None

    def wait_until_durable(self):
        self.wait_until_staged()
        if self.upload is not None:
            self.upload.result()  # raises if the write failed
            while self.durable_at is None:  # the callback runs right after
                time.sleep(0.0001)


# %%
# The strategies. ``DefaultStager``'s default options need an accelerator
# (pinned memory, non-blocking copies): ``staging_options`` picks what this
# machine has.


def staging_options(background, shared_memory):
    on_accelerator = torch.accelerator.is_available()
    return StagingOptions(
        use_pinned_memory=on_accelerator,  # pinning needs an accelerator
        use_shared_memory=shared_memory,  # only a writer *process* needs it
        use_async_staging=background,
        use_non_blocking_copy=on_accelerator,  # needs an accelerator too
    )


class Saver:
    """A way to save: ``save`` starts a checkpoint, ``close`` releases what it holds."""

    name = ""

    def __init__(self, group, work_dir):
        self.group = group
        self.work_dir = work_dir

    def save(self, state_dict, path):
        raise NotImplementedError

    def close(self):
        pass


class NoCheckpoint(Saver):
    name = "no checkpoint"  # the baseline: never saves


class BlockingSave(Saver):
    name = "dcp.save"

    def save(self, state_dict, path):
        started = time.perf_counter()
        dcp.save(state_dict, checkpoint_id=path, process_group=self.group)
        return InFlight(started)


class AsyncSave(Saver):
    name = "async_save"

    def save(self, state_dict, path):
        started = time.perf_counter()
        upload = dcp.async_save(state_dict, checkpoint_id=path, process_group=self.group)
        return InFlight(started, upload=upload)


class AsyncSaveCachedBuffer(Saver):
    name = "async_save, cached buffer"

    def __init__(self, group, work_dir):
        super().__init__(group, work_dir)
        self.stager = self.writer = None
        if not torch.accelerator.is_available():
            self.stager = DefaultStager(StagingOptions(False, False, False, False))

    def save(self, state_dict, path):
        started = time.perf_counter()
        if self.stager is None and self.writer is None:  # on GPU: one writer for every save
            self.writer = FileSystemWriter(path, cache_staged_state_dict=True)
        upload = dcp.async_save(
            state_dict,
            checkpoint_id=path,
            storage_writer=self.writer,
            async_stager=self.stager,
            process_group=self.group,
        )
        return InFlight(started, upload=upload)

    def close(self):
        if self.stager is not None:
            self.stager.close()


class DefaultStagerOverlap(Saver):
    name = "DefaultStager overlap"
    shared_memory = False
    writer_type = AsyncCheckpointerType.THREAD

    def __init__(self, group, work_dir):
        super().__init__(group, work_dir)
        self.stager = DefaultStager(
            staging_options(background=True, shared_memory=self.shared_memory)
        )

    def save(self, state_dict, path):
        started = time.perf_counter()
        response = dcp.async_save(
            state_dict,
            checkpoint_id=path,
            process_group=self.group,
            async_stager=self.stager,
            async_checkpointer_type=self.writer_type,
        )
        return InFlight(started, response.staging_completion, response.upload_completion)

    def close(self):
        self.stager.close()


# %%
# The process writer needs three things more. The first two concern any
# training script, the third only this page:
#
# * DCP starts the writer with ``multiprocessing``'s *spawn*, which imports the
#   ``__main__`` script again in the new process. A training script keeps its
#   entry point under ``if __name__ == "__main__":`` and needs nothing else. This
#   page runs top to bottom, so it does what Sphinx-Gallery does for the pages it
#   runs: it gives ``__main__`` a module spec named ``__main__``, which spawn does
#   not import again.
# * The writer logs every request at INFO level to the standard error it
#   inherits, the training log. Start it with standard error pointing at a log
#   file of its own.
# * It is a daemon: ``multiprocessing`` stops it, and removes its temporary
#   files, when the training process exits normally. The ranks this page forks
#   leave with ``os._exit``, which skips that, so ``close`` does it. (Under
#   ``torchrun`` the process exits normally; DCP reuses one writer for every
#   save of the process.)


@contextlib.contextmanager
def standard_error_to(path):
    """Point file descriptor 2 at ``path``: processes started inside inherit it."""
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


class ProcessWriter(DefaultStagerOverlap):
    name = "process writer"
    shared_memory = True  # the writer process maps the staged copy
    writer_type = AsyncCheckpointerType.PROCESS

    def __init__(self, group, work_dir):
        super().__init__(group, work_dir)
        main = sys.modules["__main__"]
        if getattr(main, "__spec__", None) is None:  # a script run as `python file.py`
            main.__spec__ = importlib.machinery.ModuleSpec("__main__", None)
        self.saves = 0

    def save(self, state_dict, path):
        self.saves += 1
        if self.saves > 1:
            return super().save(state_dict, path)
        # The first save starts the writer process: wait for it to be written.
        log = os.path.join(self.work_dir, f"writer-rank{dist.get_rank()}.log")
        with standard_error_to(log):
            in_flight = super().save(state_dict, path)
            in_flight.wait_until_durable()
        return in_flight

    def close(self):
        super().close()
        if not under_torchrun():
            # What a normal exit of this process would do for multiprocessing:
            for process in multiprocessing.active_children():
                process.terminate()  # the writer process
                process.join()
            resource_sharer.stop()  # served the shared-memory handles to the writer
            # The launcher runs multiprocessing's exit handling when the rank
            # leaves, which removes its temporary directory.


STRATEGIES = {
    cls.name: cls
    for cls in (
        NoCheckpoint,
        BlockingSave,
        AsyncSave,
        AsyncSaveCachedBuffer,
        DefaultStagerOverlap,
        ProcessWriter,
    )
}
print("\n".join(STRATEGIES))


# %%
# Measuring host memory
# ---------------------
# A thread samples this process's resident memory every few milliseconds, plus
# the private memory of its child processes (the writer process), so the peak
# includes every staging copy while it exists. Memory the writer process shares
# with this one (the staged copy) is counted once. The training loop also marks
# the end of every step: how much one step's peak differs from another's in
# the run without checkpoints tells how large a difference is noise.


class PeakHostMemory:
    def __init__(self, interval=0.01):
        self.process = psutil.Process()
        self.baseline = self.process.memory_info().rss
        self.peak = self.step_peak = self.baseline
        self.step_peaks = []
        self.interval = interval
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()

    def _sample(self):
        children, samples = [], 0
        while not self.stopped.is_set():
            if samples % 20 == 0:
                children = self.process.children(recursive=True)
            total = self.process.memory_info().rss
            for child in children:
                with contextlib.suppress(psutil.Error):
                    info = child.memory_info()
                    total += info.rss - info.shared
            self.peak = max(self.peak, total)
            self.step_peak = max(self.step_peak, total)
            samples += 1
            self.stopped.wait(self.interval)

    def end_of_step(self):
        self.step_peaks.append(self.step_peak)
        self.step_peak = 0

    def stop_mb(self):
        """Stop sampling. In MB: the peak above the start; the spread of the steps' peaks."""
        self.stopped.set()
        self.thread.join()
        spread = max(self.step_peaks) - min(self.step_peaks) if self.step_peaks else 0
        return (self.peak - self.baseline) / 1e6, spread / 1e6


# %%
# The training loop with checkpoints
# ----------------------------------
# One run trains for ``(checkpoints + 1) * steps_between`` steps and saves after
# every ``steps_between`` steps but the last, so the last save overlaps as many
# steps as the others. A first, untimed checkpoint before step 1 starts what a
# strategy starts once (buffers, the writer process); its time until durable is
# kept as ``first checkpoint``. What the loop measures:
#
# * *stall*: the time the loop waits for a checkpoint: the ``save`` call, the
#   wait for staging before ``optimizer.step()``, and the wait for the upload
#   before the next save (or before the job may exit);
# * *step time*: forward, backward and optimizer step, without those waits;
#   a step *overlaps* a save if the previous checkpoint was not yet durable when
#   it began;
# * *wall*: the whole loop, including the last wait for durability.
#
# Every checkpoint is then checked: its ``.metadata`` exists and ``dcp.load``
# reads every tensor back.


def checkpoint_is_complete(state_dict, path, group):
    if not os.path.exists(os.path.join(path, ".metadata")):
        return False
    dcp.load(state_dict, checkpoint_id=path, process_group=group)
    return True


def run_one(strategy, config, trial_name):
    # A forked rank inherits every Python object of its parent: here the
    # documentation build's, hundreds of thousands. Freeze them, or every full
    # garbage collection scans them all and slows whatever runs then (dcp.save's
    # planning, mostly), which a training process of its own would not pay.
    gc.freeze()
    rank = dist.get_rank()
    torch.set_num_threads(config.training_threads)
    group = dist.new_group(backend="gloo")
    model, optimizer = build_model(config)
    device = device_for_this_rank()
    width = model[0].in_features
    torch.manual_seed(100 + rank)  # each rank trains on its own data
    batch = torch.randn(config.batch, width, device=device)
    directory = os.path.join(CHECKPOINT_ROOT, trial_name)
    paths = []
    # One step first: Adam creates its state on the first step, and every
    # checkpoint, the first included, must hold the same tensors.
    train_step(model, optimizer, batch)
    optimizer.step()
    optimizer.zero_grad()

    memory = PeakHostMemory()
    saver = STRATEGIES[strategy](group, WORK_DIR)
    checkpointing = strategy != NoCheckpoint.name
    first_checkpoint_s = None
    if checkpointing:
        paths.append(os.path.join(directory, "step-0"))
        first = saver.save(checkpoint_state(model, optimizer), paths[-1])
        first.wait_until_durable()
        first_checkpoint_s = first.durable_at - first.started

    dist.barrier(group)
    total_steps = (config.checkpoints + 1) * config.steps_between
    stalls, durable, steps = [], [], []
    in_flight = None
    started = time.perf_counter()
    for step in range(1, total_steps + 1):
        overlapped = in_flight is not None and not in_flight.is_durable()
        step_started = time.perf_counter()
        train_step(model, optimizer, batch)
        waited = 0.0
        if in_flight is not None and in_flight.staging is not None:
            # The copy must be complete before the step changes the weights.
            wait_started = time.perf_counter()
            in_flight.wait_until_staged()
            waited = time.perf_counter() - wait_started
            stalls[-1] += waited
        optimizer.step()
        optimizer.zero_grad()
        synchronize()
        steps.append((time.perf_counter() - step_started - waited, overlapped))
        memory.end_of_step()

        last = step == total_steps
        if checkpointing and (step % config.steps_between == 0 or last):
            wait_started = time.perf_counter()
            if in_flight is not None:
                # Never two saves at once: a cached buffer is still being written.
                in_flight.wait_until_durable()
                stalls[-1] += time.perf_counter() - wait_started
                durable.append(in_flight.durable_at - in_flight.started)
                in_flight = None
            if not last:
                paths.append(os.path.join(directory, f"step-{step}"))
                save_started = time.perf_counter()
                in_flight = saver.save(checkpoint_state(model, optimizer), paths[-1])
                stalls.append(time.perf_counter() - save_started)
    wall = time.perf_counter() - started

    saver.close()
    peak_memory_mb, memory_swing_mb = memory.stop_mb()
    complete = sum(
        checkpoint_is_complete(checkpoint_state(model, optimizer), p, group) for p in paths
    )
    dist.barrier(group)
    if rank == 0 and KEEP_CHECKPOINTS is None and checkpointing:
        shutil.rmtree(directory, ignore_errors=True)
    dist.destroy_process_group(group)
    return {
        "stalls": stalls,
        "durable": durable,
        "steps": steps,
        "wall": wall,
        "first_checkpoint": first_checkpoint_s,
        "peak_memory_mb": peak_memory_mb,
        "memory_swing_mb": memory_swing_mb,
        "checkpoints": [os.path.relpath(p, CHECKPOINT_ROOT) for p in paths],
        "complete": complete,
    }


# %%
# The machine's limits
# --------------------
# No strategy can stage a checkpoint faster than the machine copies memory, or
# make it durable faster than the disk writes and syncs it. Each rank measures,
# at the same time as the others (as they would save): a copy of its share of
# the checkpoint into a buffer it already touched (what a cached staging buffer
# does), into pages new from the kernel (what fresh staging costs at worst: the
# kernel must also supply and zero every page), and a write plus ``fsync`` into
# the checkpoint directory. On GPU the copies go from the device to host memory
# (pinned when reused).


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
        synchronize()
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
    on_accelerator = torch.accelerator.is_available()
    source = torch.rand(nbytes // 4, device=device_for_this_rank())
    reused = torch.empty(nbytes // 4, pin_memory=on_accelerator)
    reused.copy_(source)  # touch every page once, as a cached buffer has
    probe = os.path.join(WORK_DIR, f"write-probe-rank{dist.get_rank()}.bin")
    os.makedirs(CHECKPOINT_ROOT, exist_ok=True)
    seconds = {
        "copy_reused": best_seconds(lambda: reused.copy_(source)),
        "copy_fresh": best_seconds(lambda: copy_into_fresh_pages(source)),
        "write_fsync": best_seconds(lambda: write_and_sync(reused, probe), repeats=2),
    }
    os.remove(probe)
    return {name: nbytes / s / 1e9 for name, s in seconds.items()}


TOTAL_BYTES = checkpoint_bytes(CONFIG)
per_rank_limits = run_on_ranks(measure_limits, TOTAL_BYTES, CONFIG)
# A save waits for its slowest rank: keep the lowest bandwidth of any rank.
LIMITS_GBPS = {name: min(rank[name] for rank in per_rank_limits) for name in per_rank_limits[0]}
RANKS = len(per_rank_limits)
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


# %%
# Run every strategy
# ------------------
# On this page every run forks fresh ranks, so no strategy inherits another's
# buffers, threads or writer process (under ``torchrun`` the runs share the
# rank processes). With more than one repetition the strategies take turns, so
# that a slow minute on a shared machine does not hit one strategy only. Each
# line shows the longest single stall of the run and how many of the
# checkpoints it wrote passed the check.


def slug(name):
    return name.replace(" ", "-").replace(",", "")


def run_and_report(name, config, trial):
    per_rank = run_on_ranks(run_one, name, config, trial)
    stall = max((max(r["stalls"]) for r in per_rank if r["stalls"]), default=0.0)
    wall = max(r["wall"] for r in per_rank)
    complete = min(r["complete"] for r in per_rank)
    written = len(per_rank[0]["checkpoints"])
    threads = "" if config == CONFIG else f" ({config.training_threads} threads)"
    print(
        f"{name + threads:<34} wall {wall:6.2f} s, longest stall {stall:6.3f} s, "
        f"checkpoints complete: {complete} of {written}"
    )
    return per_rank


# For the thread budget below (under torchrun only): three strategies again,
# with every core for training.
KNOB_STRATEGIES = (NoCheckpoint.name, BlockingSave.name, DefaultStagerOverlap.name)
EVERY_CORE = None
if under_torchrun() and CONFIG.training_threads < CORES_PER_RANK:
    EVERY_CORE = BenchConfig(**{**asdict(CONFIG), "training_threads": CORES_PER_RANK})

runs = {name: [] for name in STRATEGIES}
every_core_runs = {name: [] for name in KNOB_STRATEGIES}
for repeat in range(CONFIG.repeats):
    for name in STRATEGIES:
        runs[name].append(run_and_report(name, CONFIG, f"{slug(name)}-{repeat}"))
    for name in KNOB_STRATEGIES if EVERY_CORE else ():
        trial = f"threads-{CORES_PER_RANK}-{slug(name)}-{repeat}"
        every_core_runs[name].append(run_and_report(name, EVERY_CORE, trial))


# %%
# The numbers
# -----------
# For every strategy and metric: the median over repetitions (the minimum is in
# the JSON file). Per run, a checkpoint's stall and its time until durable are
# those of the slowest rank; the slow-down compares the median step that
# overlapped a save with the median step of the run without checkpoints. The
# memory of the run without checkpoints is training's own (FSDP's unsharded
# parameters and gradients, and how the allocator reuses them): read every
# other row against it, and against how much it swings.

# metric: (column, format, meaning); the wall time of each run is kept in the JSON only
METRICS = {
    "stall_per_checkpoint_s": ("stall s", ".3f", "the loop waited, per checkpoint"),
    "overlapped_step_slowdown": ("slow-down", ".2f", "overlapped step / step without saves"),
    "wall_over_baseline_s": ("+total s", ".2f", "run time minus the no-checkpoint run's"),
    "time_until_durable_s": ("durable s", ".3f", "from save call to checkpoint on disk"),
    "peak_host_memory_mb": ("memory MB", ".0f", "peak host memory per rank above the start"),
    "first_checkpoint_s": ("first s", ".2f", "the first save, until durable"),
    "wall_s": None,
}


def median_or_none(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def metrics_of_run(per_rank, baseline):
    """One run's metrics from every rank's measurements (``baseline``: same repetition)."""
    wall = max(r["wall"] for r in per_rank)
    base_wall = max(r["wall"] for r in baseline)
    base_step = statistics.median(t for r in baseline for t, _ in r["steps"])
    overlapped = [t for r in per_rank for t, over in r["steps"] if over]
    checkpoints = len(per_rank[0]["stalls"])
    firsts = [r["first_checkpoint"] for r in per_rank if r["first_checkpoint"] is not None]
    return {
        "stall_per_checkpoint_s": median_or_none(
            [max(r["stalls"][i] for r in per_rank) for i in range(checkpoints)]
        ),
        "overlapped_step_slowdown": median_or_none(overlapped) / base_step if overlapped else None,
        "wall_over_baseline_s": wall - base_wall,
        "time_until_durable_s": median_or_none(
            [max(r["durable"][i] for r in per_rank) for i in range(checkpoints)]
        ),
        "peak_host_memory_mb": max(r["peak_memory_mb"] for r in per_rank),
        "first_checkpoint_s": max(firsts) if firsts else None,
        "wall_s": wall,
    }


def summarize(runs):
    summary = {}
    for name, repeats in runs.items():
        per_run = [metrics_of_run(run, runs[NoCheckpoint.name][i]) for i, run in enumerate(repeats)]
        summary[name] = {}
        for metric in METRICS:
            values = [m[metric] for m in per_run]
            known = [v for v in values if v is not None]
            summary[name][metric] = {
                "min": min(known) if known else None,
                "median": statistics.median(known) if known else None,
                "values": values,
            }
    return summary


def median(summary, name, metric):
    return summary[name][metric]["median"]


def fmt(value, spec):
    return "-" if value is None else format(value, spec)


SUMMARY = summarize(runs)
COLUMNS = {metric: column for metric, column in METRICS.items() if column}
print(f"{'':<26}" + "".join(f"{label:>10}" for label, _, _ in COLUMNS.values()))
for name in STRATEGIES:
    cells = "".join(
        f"{fmt(median(SUMMARY, name, m), spec):>10}" for m, (_, spec, _) in COLUMNS.items()
    )
    print(f"{name:<26}{cells}")
print()
for label, _, meaning in COLUMNS.values():
    print(f"{label:>10}: {meaning}")


def memory_swing_mb(runs):
    """How much one step's memory peak differed from another's, without checkpoints."""
    return statistics.median(max(r["memory_swing_mb"] for r in run) for run in runs)


SWING_MB = memory_swing_mb(runs[NoCheckpoint.name])
print(
    f"\nWithout checkpoints, the memory peaks of single steps differed by up to "
    f"{SWING_MB:.0f} MB per rank: smaller memory differences are noise."
)


# %%
# Each stall next to the limits
# -----------------------------
# A stall is best read as a multiple of the time one memory copy of the
# checkpoint takes on this machine (``checkpoint bytes / memcpy bandwidth``
# into a reused buffer): a strategy that stages in the foreground cannot stall
# less than about that, and one that stages in the background can. The goal
# set for this benchmark: ``DefaultStager``'s stall at most 0.02x that of
# ``dcp.save`` with ``make bench`` (1 GB, one rank). Small checkpoints leave
# ``DefaultStager`` with its fixed costs (the state dict, the planning), so the
# ratio on this page, at its size, says less.


def stall_ratios(summary, copy_seconds):
    base = median(summary, BlockingSave.name, "stall_per_checkpoint_s")
    ratios = {}
    for name in STRATEGIES:
        stall = median(summary, name, "stall_per_checkpoint_s")
        if stall is None:
            continue
        ratios[name] = {
            "stall_vs_copy_time": stall / copy_seconds,
            "stall_vs_dcp_save": stall / base,
        }
    return ratios


RATIOS = stall_ratios(SUMMARY, COPY_SECONDS)
print(f"one copy of this rank's share into a reused buffer: {COPY_SECONDS * 1e3:.1f} ms")
for name, ratio in RATIOS.items():
    print(
        f"{name:<26} stall = {ratio['stall_vs_copy_time']:7.1f}x the copy "
        f"= {ratio['stall_vs_dcp_save']:6.3f}x dcp.save"
    )
goal = RATIOS[DefaultStagerOverlap.name]["stall_vs_dcp_save"]
verdict = "met" if goal <= 0.02 else "not met"
print(f"DefaultStager's stall is {goal:.3f}x dcp.save's: goal (<= 0.02x) {verdict} at this size")


# %%
# The figure
# ----------
# Left: what the training loop waits per checkpoint (log scale), with the time
# of one memory copy of a rank's share for reference. Right: what the whole run
# cost over the run without checkpoints, stalls and slower steps together.


def draw(summary, copy_seconds):
    names = [n for n in STRATEGIES if n != NoCheckpoint.name]
    stalls = [median(summary, n, "stall_per_checkpoint_s") for n in names]
    totals = [median(summary, n, "wall_over_baseline_s") for n in names]
    figure, (left, right) = plt.subplots(1, 2, figsize=(10, 3.6), sharey=True)
    bars = left.barh(names, stalls, color="tab:blue")
    left.bar_label(bars, [f"{s:.3g} s" for s in stalls], padding=3, fontsize="small")
    left.axvline(copy_seconds, color="black", linestyle="--", label="one memcpy of a rank's share")
    left.set_xscale("log")
    left.set_xlim(right=max(stalls) * 8)  # room for the labels
    left.set_xlabel("stall per checkpoint (s, log scale)")
    left.legend(loc="lower right", fontsize="small")
    left.invert_yaxis()
    bars = right.barh(names, totals, color="tab:orange")
    right.bar_label(bars, [f"{t:+.2f} s" for t in totals], padding=3, fontsize="small")
    right.margins(x=0.25)
    right.axvline(0, color="black", linewidth=0.8)
    right.set_xlabel("total time over no checkpoint (s)")
    figure.suptitle(
        f"torch {torch.__version__}, {os.cpu_count()} cores: checkpoint "
        f"{TOTAL_BYTES / 1e9:.2f} GB, {RANKS} rank(s), "
        f"{CONFIG.checkpoints} checkpoints every {CONFIG.steps_between} steps"
    )
    figure.tight_layout()
    return figure


FIGURE = draw(SUMMARY, COPY_SECONDS)
plt.show()


# %%
# Thread budget
# -------------
# A background writer, thread or process, needs CPU time while training runs,
# and on a machine with few cores it takes it from the training steps (the
# slow-down column above). The knob is the number of threads training uses,
# ``torch.set_num_threads``: by default PyTorch uses every core; leave one to
# the writer. ``run_one`` takes it as ``config.training_threads``.
#
# The knob needs a process that may raise its thread count. The ranks this
# page forks keep one thread each: PyTorch's CPU build uses GNU OpenMP, which
# does not survive ``fork``. A process forked after its parent ran
# OpenMP-parallel code hangs in its first parallel region if it uses more than
# one thread, and this page's parent, the documentation build, has run other
# recipes before. Ranks that ``torchrun`` starts are fresh processes: under
# ``torchrun`` the tables above leave one core per rank to the writer, and
# three strategies also ran with every core for training: this cell compares
# them. ``make bench`` runs under ``torchrun`` with one rank.

KNOB = {}
if EVERY_CORE:
    # With one core left to the writer: the runs of the tables above.
    one_left_runs = {name: runs[name] for name in KNOB_STRATEGIES}
    for config, knob_runs in ((EVERY_CORE, every_core_runs), (CONFIG, one_left_runs)):
        KNOB[config.training_threads] = {"strategies": summarize(knob_runs), "runs": knob_runs}
    header = "".join(f"{label:>10}" for label in ("+total s", "slow-down", "stall s"))
    print(f"{'training threads':<18}{'strategy':<24}{header}")
    for threads, knob in KNOB.items():
        summary = knob["strategies"]
        for name in KNOB_STRATEGIES[1:]:
            cells = [
                fmt(median(summary, name, "wall_over_baseline_s"), ".2f"),
                fmt(median(summary, name, "overlapped_step_slowdown"), ".2f"),
                fmt(median(summary, name, "stall_per_checkpoint_s"), ".3f"),
            ]
            print(f"{threads:<18}{name:<24}" + "".join(f"{c:>10}" for c in cells))
else:
    threads = CONFIG.training_threads
    left = max(0, os.cpu_count() - RANKS * threads)
    print(
        f"{os.cpu_count()} cores; {RANKS} ranks train with {threads} thread(s) each: "
        f"{left} core(s) left to the writers"
    )
    if under_torchrun():
        print("thread knob: not run (each rank has one core, none to spare)")
    else:
        print("thread knob: not run here (forked ranks keep 1 thread); make bench runs it")


# %%
# When to choose which
# --------------------
# These sentences are written by the code below from the medians above, so
# they say what this run measured, on this machine, at this size. Rerun the
# page, or ``make bench``, on your own hardware before you choose.


def advice(summary, swing_mb):
    names = [n for n in STRATEGIES if n != NoCheckpoint.name]

    def m(name, metric):
        return median(summary, name, metric)

    def lowest(metric):
        return min(names, key=lambda n: m(n, metric))

    # (what it leads on, when that is what to choose it for, the leader)
    leads = [
        ("pause", "the pause per checkpoint matters most", lowest("stall_per_checkpoint_s")),
        ("total time", "the total training time matters most", lowest("wall_over_baseline_s")),
    ]
    by_memory = sorted(names, key=lambda n: m(n, "peak_host_memory_mb"))
    gap = m(by_memory[1], "peak_host_memory_mb") - m(by_memory[0], "peak_host_memory_mb")
    if gap > swing_mb:  # a lead smaller than training's own variation is no lead
        leads.append(("memory", "host memory is tight", by_memory[0]))
    else:
        print(f"No strategy leads on memory by more than the noise ({swing_mb:.0f} MB).")
    sync_stall = m(BlockingSave.name, "stall_per_checkpoint_s")
    base_memory = m(NoCheckpoint.name, "peak_host_memory_mb")
    sentences = {}
    for name in names:
        stall = m(name, "stall_per_checkpoint_s")
        facts = f"it stalls {stall:.3g} s per checkpoint"
        if name != BlockingSave.name:
            facts += f" ({stall / sync_stall:.2g}x dcp.save)"
        extra = m(name, "peak_host_memory_mb") - base_memory
        facts += (
            f", its run took {m(name, 'wall_over_baseline_s'):+.2f} s longer than without "
            f"checkpoints, and its host memory peaked {extra:+.0f} MB per rank against the "
            "run without checkpoints"
        )
        if abs(extra) <= swing_mb:
            facts += f" (within the {swing_mb:.0f} MB that training's own peaks vary by)"
        slowdown = m(name, "overlapped_step_slowdown")
        if slowdown is not None:
            facts += f"; steps that overlapped its saves took {slowdown:.2f}x as long"
        when = [condition for _, condition, leader in leads if leader == name]
        if when:
            sentences[name] = f"Choose {name} when {' or '.join(when)}: {facts}."
        else:
            by_leader = {}
            for what, _, leader in leads:
                by_leader.setdefault(leader, []).append(what)
            others = "; ".join(f"{leader} on {' and '.join(w)}" for leader, w in by_leader.items())
            sentences[name] = f"{name} led on nothing here ({others}): {facts}."
    return sentences


ADVICE = advice(SUMMARY, SWING_MB)
for sentence in ADVICE.values():
    print(sentence)


# %%
# The results file
# ----------------
# ``make bench`` (or ``DCP_RECIPES_BENCH_JSON=path``) writes every number:
# per strategy and metric the minimum, the median and each repetition's value,
# the per-rank measurements they come from, the limits, the machine and the
# torch version. The figure goes next to it.


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
        "accelerator": torch.cuda.is_available(),
        "world_size": RANKS,
        "launcher": "torchrun" if under_torchrun() else "fork",
        "config": asdict(CONFIG),
        "checkpoint_bytes": TOTAL_BYTES,
        "checkpoint_bytes_per_rank": BYTES_PER_RANK,
        "limits_GBps": LIMITS_GBPS,
        "limits_GBps_per_rank": per_rank_limits,
        "copy_seconds_per_checkpoint": COPY_SECONDS,
        "training_memory_swing_mb": SWING_MB,
        "strategies": SUMMARY,
        "ratios": RATIOS,
        "advice": ADVICE,
        "thread_knob": {str(threads): knob for threads, knob in KNOB.items()},
        "checkpoints_kept_in": KEEP_CHECKPOINTS,
        "runs": runs,
    }


writes_here = not dist.is_initialized() or dist.get_rank() == 0  # torchrun: rank 0 writes
if not RESULTS_JSON:
    print("no results file requested (set DCP_RECIPES_BENCH_JSON, or run make bench)")
elif writes_here:
    path = Path(RESULTS_JSON)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results(), indent=1) + "\n")
    FIGURE.savefig(path.with_name("stall.png"), dpi=120)
    print(f"wrote {path} and {path.with_name('stall.png')}")


# %%
# Clean up
# --------

shutil.rmtree(WORK_DIR, ignore_errors=True)
print(f"removed {WORK_DIR}: {not os.path.exists(WORK_DIR)}")


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
