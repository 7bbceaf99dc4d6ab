"""
Fast saves and loads: the knobs, measured
=========================================

"Why is my save so slow?" has an answer only next to the machine's own limits.
This recipe first measures how fast this machine writes, syncs and reads a
checkpoint's bytes the way DCP does, then runs ``dcp.save`` and ``dcp.load``
with every ``FileSystemWriter`` and planner knob side by side in one run, and
reports each as a fraction of those limits. It also saves a replicated (DDP)
model with and without deduplication to the lowest rank, and follows each
rank's host memory over 20 consecutive saves with three saving strategies. The
advice at the end is written from the numbers on this page, so it holds for
this machine at this size: rerun it on yours.

.. grid:: 2

    .. grid-item-card:: :octicon:`mortar-board;1em;` What you will learn
       :class-card: card-prerequisites

       * Measure write + ``fsync`` and read bandwidth the way DCP writes and
         reads, from page cache and from storage
       * What ``thread_count``, ``single_file_per_rank``, ``sync_files`` and
         ``DefaultSavePlanner(enable_plan_caching=True)`` buy, against those limits
       * How DCP deduplicates replicated tensors, and what
         ``dedup_save_to_lowest_rank`` changes in the bytes each rank writes
       * Whether host memory grows with ``dcp.save``, ``async_save`` and a
         reused ``DefaultStager``, over 20 saves

    .. grid-item-card:: :octicon:`list-unordered;1em;` Prerequisites
       :class-card: card-prerequisites

       * PyTorch 2.9 or later (``DefaultStager``, ``StagingOptions``), but
         not 2.11.0, whose ``DefaultStager`` cannot be reused (:ref:`reused-stager-keyerror`)
       * CPU (gloo) or one GPU per rank (NCCL, plus gloo for checkpointing)
       * :ref:`sphx_glr_recipes_save_load_recipe.py` and
         :ref:`sphx_glr_recipes_checkpoint_stall_benchmark.py`

Every cell below runs when this page is built. ``run_on_ranks`` starts the
ranks (or uses the ones ``torchrun`` made) and prints what each rank printed,
labelled ``[rankN]``. The page's checkpoint is small so that it builds in
seconds; ``make bench`` runs this same file with a checkpoint of about 1 GB.
"""

# %%
# Setup
# -----
# ``DCP_RECIPES_SPEED_MB`` sets the size of the checkpoint (all ranks
# together) and ``DCP_RECIPES_SPEED_REPEATS`` how many times every measurement
# is repeated. Each measurement round runs every variant once, in turn
# (A B C ... A B C ...), after one warm-up round that is not counted, so a slow
# moment on a shared machine does not hit one variant only.

import os
import shutil
import threading
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from rank_launcher import run_on_ranks, shared_tempdir, under_torchrun
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

BENCH = os.environ.get("DCP_RECIPES_BENCH") == "1"
SIZE_MB = float(os.environ.get("DCP_RECIPES_SPEED_MB", "1024" if BENCH else "32"))
REPEATS = int(os.environ.get("DCP_RECIPES_SPEED_REPEATS", "2"))
SECTION_MB = min(SIZE_MB, 128.0)  # replicated state and 20 saves: 20 checkpoints stay on disk
WORK_DIR = shared_tempdir("dcp-speed-")
print(f"torch {torch.__version__}; checkpoint {SIZE_MB:g} MB, {REPEATS} repeats; in {WORK_DIR}")

# sphinx_gallery_start_ignore
# The measuring harness: none of it is needed to save or load.
import contextlib
import ctypes
import gc
import io
import json
import platform
import statistics
from pathlib import Path

import matplotlib.pyplot as plt
import psutil
from torch.distributed.checkpoint import FileSystemReader

if REPEATS < 2:
    raise ValueError(f"DCP_RECIPES_SPEED_REPEATS must be at least 2 (a spread), got {REPEATS}")
if SIZE_MB <= 0:
    raise ValueError(f"DCP_RECIPES_SPEED_MB must be positive, got {SIZE_MB}")
if BENCH:
    RESULTS_JSON = os.environ.get(
        "DCP_RECIPES_SPEED_JSON", "_build/bench/save_load_speed_recipe.json"
    )
else:
    RESULTS_JSON = os.environ.get("DCP_RECIPES_SPEED_JSON")
RESULTS = {}  # everything measured, raw and derived: the JSON file


def gbps(total_bytes, seconds_per_rank):
    """A collective operation's bandwidth: all bytes over the slowest rank's time."""
    return total_bytes / max(seconds_per_rank) / 1e9


def spread(values):
    return {
        "median": statistics.median(values),
        "min": min(values),
        "max": max(values),
        "values": values,
    }


def cell(entry, spec=".2f"):
    return f"{entry['median']:{spec}} ({entry['min']:{spec}}-{entry['max']:{spec}})"


def evict(directory):
    """Drop a directory's files from the page cache (after syncing them: dirty pages stay)."""
    for name in os.listdir(directory):
        fd = os.open(os.path.join(directory, name), os.O_RDONLY)
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)


class PhaseClock:
    """When the writer starts writing and the reader starts reading: the end of planning."""

    started = {}
    installed = False

    @classmethod
    def install(cls):
        if cls.installed:
            return
        cls.installed = True
        for klass, method in ((FileSystemWriter, "write_data"), (FileSystemReader, "read_data")):
            original = getattr(klass, method)

            def timed(self, *args, _original=original, _method=method, **kwargs):
                cls.started[_method] = time.perf_counter()
                return _original(self, *args, **kwargs)

            setattr(klass, method, timed)


def local_tensors(model):
    """This rank's own memory of every parameter (its shard, for a sharded model)."""
    tensors = []
    for parameter in model.parameters():
        tensor = parameter.detach()
        tensors.append(tensor.to_local() if hasattr(tensor, "to_local") else tensor)
    return tensors


def snapshot(model):
    return [t.clone() for t in local_tensors(model)]


def scramble(model):
    for tensor in local_tensors(model):
        tensor.fill_(float("nan"))  # a load that skips a tensor leaves NaN: never equal


def differing(model, expected):
    return sum(not torch.equal(a, b) for a, b in zip(local_tensors(model), expected, strict=True))


# sphinx_gallery_end_ignore


# %%
# The model
# ---------
# A stack of square ``Linear`` layers, sharded with FSDP2 over all ranks: each
# rank holds, and saves, its own shard of every weight. The layer width grows
# with the checkpoint so that tensors have realistic sizes (16 MB weights at
# ``make bench`` size). The checkpoint holds the model's parameters only.


def device_for_this_rank():
    # The launcher (or your own set-up code) has already picked this rank's GPU.
    if torch.accelerator.is_available():
        return torch.accelerator.current_accelerator()
    return torch.device("cpu")


def model_shape(size_mb):
    """(layers, width) of a model whose fp32 parameters take about ``size_mb``."""
    width = 2048 if size_mb >= 512 else 1024 if size_mb >= 8 else 256
    layers = max(1, round(size_mb * 1e6 / (4 * (width * width + width))))
    return layers, width


def build_model(size_mb):
    layers, width = model_shape(size_mb)
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])


def build_sharded_model(size_mb):
    model = build_model(size_mb).to(device_for_this_rank())
    fully_shard(model)  # every parameter becomes a DTensor sharded over all ranks
    return model


LAYERS, WIDTH = model_shape(SIZE_MB)
CHECKPOINT_BYTES = 4 * LAYERS * (WIDTH * WIDTH + WIDTH)
print(f"{LAYERS} x Linear({WIDTH}, {WIDTH}): {CHECKPOINT_BYTES / 1e6:,.0f} MB of parameters")


# %%
# The limits: write, sync and read the way DCP does
# -------------------------------------------------
# ``FileSystemWriter(thread_count=N)`` splits a rank's tensors into N buckets
# of about equal size, largest first, and each of N threads writes one file,
# ``__<rank>_<i>.distcp``, into a fresh directory, straight from the tensors'
# memory, then calls ``fsync`` on it. The probe below does the same with the
# model's own shards, with no copy in between: it writes a ``memoryview`` over
# ``tensor.numpy()``. (``tensor.numpy().tobytes()`` would copy every tensor
# first, and a "limit" measured that way can be slower than DCP itself.) It
# then reads the files back into buffers it already touched, twice: after
# dropping them from the page cache with ``posix_fadvise(POSIX_FADV_DONTNEED)``,
# which reads from storage, and right after that, which reads from the page
# cache. All ranks write and read at the same time, as they do in a save.

THREADS = (1, 2, 4)


def split_like_dcp(tensors, buckets):
    """FileSystemWriter's bucketing: largest tensor first, into the emptiest bucket."""
    split, sizes = [[] for _ in range(buckets)], [0] * buckets
    for tensor in sorted(tensors, key=lambda t: t.nbytes, reverse=True):
        emptiest = sizes.index(min(sizes))
        split[emptiest].append(tensor)
        sizes[emptiest] += tensor.nbytes
    return split


def in_threads(work, argument_tuples):
    threads = [threading.Thread(target=work, args=args) for args in argument_tuples]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def write_and_sync(path, tensors):
    with open(path, "wb") as file:  # FileSystemWriter opens its files the same way
        for tensor in tensors:
            file.write(memoryview(tensor.numpy()).cast("B"))  # the tensor's memory, no copy
        file.flush()
        os.fsync(file.fileno())


def read_into(path, buffer):
    view = memoryview(buffer.numpy()).cast("B")
    with open(path, "rb", buffering=0) as file:
        while view:
            view = view[file.readinto(view) :]


def drop_from_page_cache(files):
    for path in files:
        fd = os.open(path, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # the next read goes to storage
        os.close(fd)


def measure_limits(directory, repeats):
    """This rank's seconds for write + fsync, a read from storage, a read from page cache."""
    # This rank's shards. On GPU, DCP too copies each tensor to host memory before writing
    # it; on CPU, .cpu() returns the tensor itself, and the probe writes its own memory.
    tensors = [p.detach().to_local().cpu() for p in build_sharded_model(SIZE_MB).parameters()]
    kinds = ("write_fsync", "read_storage", "read_cache")
    seconds = {kind: {threads: [] for threads in THREADS} for kind in kinds}
    for repeat in range(repeats + 1):  # round 0 warms up and is not kept
        for threads in THREADS:
            path = os.path.join(directory, f"probe-{threads}-{repeat}")
            os.makedirs(path, exist_ok=True)
            buckets = split_like_dcp(tensors, threads)
            files = [os.path.join(path, f"__{dist.get_rank()}_{i}.distcp") for i in range(threads)]
            dist.barrier()
            started = time.perf_counter()
            in_threads(write_and_sync, zip(files, buckets, strict=True))
            write_s = time.perf_counter() - started

            buffers = [torch.zeros(sum(t.numel() for t in bucket)) for bucket in buckets]
            drop_from_page_cache(files)
            dist.barrier()
            started = time.perf_counter()
            in_threads(read_into, zip(files, buffers, strict=True))
            storage_s = time.perf_counter() - started
            dist.barrier()
            started = time.perf_counter()
            in_threads(read_into, zip(files, buffers, strict=True))
            cache_s = time.perf_counter() - started
            # sphinx_gallery_start_ignore
            for bucket, buffer in zip(buckets, buffers, strict=True) if repeat == 0 else ():
                written = torch.cat([t.flatten() for t in bucket])
                assert torch.equal(written, buffer), "the probe read other bytes than it wrote"
            # sphinx_gallery_end_ignore
            dist.barrier()
            if dist.get_rank() == 0:
                shutil.rmtree(path)
            if repeat > 0:
                seconds["write_fsync"][threads].append(write_s)
                seconds["read_storage"][threads].append(storage_s)
                seconds["read_cache"][threads].append(cache_s)
    # sphinx_gallery_start_ignore
    # What FileSystemWriter does to every tensor before its bytes reach the file: torch.save
    # (a zip record, with its CRC-32), here into /dev/null, so no disk is involved.
    seconds["torch_save"] = {1: []}
    for _ in range(repeats):
        dist.barrier()
        started = time.perf_counter()
        with open(os.devnull, "wb") as sink:
            for tensor in tensors:
                torch.save(tensor, sink)
        seconds["torch_save"][1].append(time.perf_counter() - started)
    # What FileSystemReader does to every tensor after reading its bytes: torch.load into a
    # new tensor, then a copy into the model's tensor; here from memory, no disk involved.
    blobs = []
    for tensor in tensors:
        blob = io.BytesIO()
        torch.save(tensor, blob)
        blobs.append(blob.getvalue())
    seconds["torch_load"] = {1: []}
    for _ in range(repeats):
        dist.barrier()
        started = time.perf_counter()
        for tensor, blob in zip(tensors, blobs, strict=True):
            tensor.copy_(torch.load(io.BytesIO(blob), weights_only=True))
        seconds["torch_load"][1].append(time.perf_counter() - started)
    del blobs
    # sphinx_gallery_end_ignore
    return {"bytes": sum(t.nbytes for t in tensors), "seconds": seconds}


limit_runs = run_on_ranks(measure_limits, os.path.join(WORK_DIR, "limits"), REPEATS)

# sphinx_gallery_start_ignore
RANKS = len(limit_runs)
BYTES_PER_RANK = [run["bytes"] for run in limit_runs]
TOTAL_BYTES = sum(BYTES_PER_RANK)
LIMITS = {}  # kind -> threads -> spread of GB/s over the repeats
for kind in ("write_fsync", "read_storage", "read_cache"):
    LIMITS[kind] = {}
    for threads in THREADS:
        per_repeat = zip(*(run["seconds"][kind][threads] for run in limit_runs), strict=True)
        LIMITS[kind][threads] = spread([gbps(TOTAL_BYTES, s) for s in per_repeat])
# The limit is the best the machine did: the highest bandwidth of any repeat and thread count.
LIMIT = {kind: max(v["max"] for v in LIMITS[kind].values()) for kind in LIMITS}
LABELS = {
    "write_fsync": "write + fsync",
    "read_storage": "read from storage",
    "read_cache": "read from page cache",
}
print(f"{TOTAL_BYTES / 1e6:,.0f} MB on {RANKS} rank(s); GB/s, median (min-max) of {REPEATS}:")
print(f"{'':<22}" + "".join(f"{f'{t} thread(s)':>22}" for t in THREADS) + f"{'limit':>8}")
for kind, label in LABELS.items():
    cells = "".join(f"{cell(v):>22}" for v in LIMITS[kind].values())
    print(f"{label:<22}{cells}{LIMIT[kind]:>8.2f}")
SERIALIZE = {}  # torch.save and torch.load of every tensor, in one thread, no disk
for kind in ("torch_save", "torch_load"):
    per_repeat = zip(*(run["seconds"][kind][1] for run in limit_runs), strict=True)
    SERIALIZE[kind] = spread([gbps(TOTAL_BYTES, s) for s in per_repeat])
print(f"{'torch.save, no disk':<22}{cell(SERIALIZE['torch_save']):>22}")
print(f"{'torch.load + copy':<22}{cell(SERIALIZE['torch_load']):>22}")
print(
    "(what FileSystemWriter and FileSystemReader do to every tensor, in the thread that "
    "writes or reads it: no limit of the disk, a cost on top of it)"
)
HOST_CACHES_DISK = LIMIT["read_storage"] >= 0.8 * LIMIT["read_cache"]
if HOST_CACHES_DISK:
    print(
        "Reads after eviction are nearly as fast as reads from the page cache: the VM's host "
        "probably caches this disk, so 'from storage' means from the host's cache here."
    )
else:
    print(
        f"Reads from storage reach {LIMIT['read_storage'] / LIMIT['read_cache']:.2f}x the speed "
        "of reads from the page cache: eviction worked, the two numbers measure different things."
    )
RESULTS["limits"] = {
    "bytes_per_rank": BYTES_PER_RANK,
    "seconds_per_rank": [run["seconds"] for run in limit_runs],
    "GBps": LIMITS,
    "limit_GBps": LIMIT,
    "serialization_GBps": SERIALIZE,
    "host_caches_disk": HOST_CACHES_DISK,
}
# sphinx_gallery_end_ignore


# %%
# ``dcp.save`` and ``dcp.load`` with every knob
# ---------------------------------------------
# Each row changes one thing from ``FileSystemWriter``'s and
# ``DefaultSavePlanner``'s defaults (``thread_count=1``,
# ``single_file_per_rank=True``, ``sync_files=True``, no plan caching):
#
# * ``thread_count``: writer threads per rank, one file each.
# * ``single_file_per_rank=False``: one file per tensor instead.
# * ``sync_files=False``: no ``fsync``. The save returns when the bytes are in
#   the page cache, not on storage: after a crash of the machine the
#   checkpoint may be incomplete. It is measured to show what ``fsync`` costs,
#   never chosen as the fastest.
# * ``DefaultSavePlanner(enable_plan_caching=True)``: when the state dict has
#   the same structure as at the previous save, every rank skips sending its
#   plan and the coordinator reuses the global plan. The cache lives on the
#   planner class, so a new planner each save still uses it.
#
# Every checkpoint is loaded twice, into the same model: first after its
# files were dropped from the page cache (a *cold* load, from storage), then
# again (a *warm* load, from the page cache). Before the cold load the model's
# tensors are set to NaN, and after it they are compared with what was saved.

SAVE_OPTIONS = {
    "defaults (thread_count=1)": {},
    "thread_count=2": {"thread_count": 2},
    "thread_count=4": {"thread_count": 4},
    "single_file_per_rank=False": {"single_file_per_rank": False},
    "sync_files=False": {"sync_files": False},
    "enable_plan_caching=True": {"enable_plan_caching": True},
}


def save(model, checkpoint_dir, enable_plan_caching=False, **writer_options):
    writer = FileSystemWriter(checkpoint_dir, **writer_options)
    planner = DefaultSavePlanner(enable_plan_caching=enable_plan_caching)
    dcp.save({"model": model.state_dict()}, storage_writer=writer, planner=planner)


def load(model, checkpoint_dir):
    state_dict = {"model": model.state_dict()}
    dcp.load(state_dict, checkpoint_id=checkpoint_dir)  # in place, into the model's shards
    model.load_state_dict(state_dict["model"])


def save_and_load_every_way(checkpoint_root, repeats):
    model = build_sharded_model(SIZE_MB)
    # sphinx_gallery_start_ignore
    PhaseClock.install()
    expected = snapshot(model)
    record = {name: [] for name in SAVE_OPTIONS}
    verified = tensors_compared = 0

    def start():
        dist.barrier()
        return time.perf_counter()

    # sphinx_gallery_end_ignore
    for repeat in range(repeats + 1):  # round 0 warms up (and fills the plan cache)
        for name, options in SAVE_OPTIONS.items():
            path = os.path.join(checkpoint_root, f"{name.replace('=', '-')}-{repeat}")
            # sphinx_gallery_start_ignore
            times = {}
            started = start()
            # sphinx_gallery_end_ignore
            save(model, path, **options)
            # sphinx_gallery_start_ignore
            times["save_s"] = time.perf_counter() - started
            times["save_planning_s"] = PhaseClock.started["write_data"] - started
            dist.barrier()
            if dist.get_rank() == 0:
                evict(path)
            scramble(model)
            started = start()
            # sphinx_gallery_end_ignore
            load(model, path)  # cold: its files are not in the page cache
            # sphinx_gallery_start_ignore
            times["cold_load_s"] = time.perf_counter() - started
            times["cold_load_planning_s"] = PhaseClock.started["read_data"] - started
            bad = differing(model, expected)
            assert bad == 0, f"{name}: {bad} tensors differ from what was saved"
            started = start()
            # sphinx_gallery_end_ignore
            load(model, path)  # warm: the first load left them there
            # sphinx_gallery_start_ignore
            times["warm_load_s"] = time.perf_counter() - started
            times["warm_load_planning_s"] = PhaseClock.started["read_data"] - started
            verified += 1
            tensors_compared += len(expected)
            record[name].append(times)
            # sphinx_gallery_end_ignore
            dist.barrier()
            if dist.get_rank() == 0:
                shutil.rmtree(path)
    # sphinx_gallery_start_ignore
    print(f"checkpoints verified: {verified} of {verified}, {tensors_compared} tensors: 0 differ")
    return record
    # sphinx_gallery_end_ignore


knob_runs = run_on_ranks(save_and_load_every_way, os.path.join(WORK_DIR, "knobs"), REPEATS)


# sphinx_gallery_start_ignore
def knob_summary(runs):
    """Per knob: GB/s and planning seconds of every timed repeat, from the slowest rank."""
    summary = {}
    for name in SAVE_OPTIONS:
        rounds = list(zip(*(rank[name] for rank in runs), strict=True))  # per round, per rank
        timed_rounds = rounds[1:]  # round 0 is the warm-up

        def over(key, rounds=timed_rounds):
            return [[rank[key] for rank in one_round] for one_round in rounds]

        summary[name] = {
            "save_GBps": spread([gbps(TOTAL_BYTES, s) for s in over("save_s")]),
            "cold_load_GBps": spread([gbps(TOTAL_BYTES, s) for s in over("cold_load_s")]),
            "warm_load_GBps": spread([gbps(TOTAL_BYTES, s) for s in over("warm_load_s")]),
            "save_planning_s": spread([max(s) for s in over("save_planning_s")]),
            "load_planning_s": spread([max(s) for s in over("warm_load_planning_s")]),
            "warm_up_save_planning_s": max(rank["save_planning_s"] for rank in rounds[0]),
        }
    return summary


KNOBS = knob_summary(knob_runs)
DURABLE = [name for name, options in SAVE_OPTIONS.items() if options.get("sync_files", True)]


print(f"\nGB/s, median (min-max) of {REPEATS}; fraction of the limit for the median")
print(f"{'dcp.save with':<30}{'save GB/s':>18}{'of limit':>9}{'planning ms':>20}")
for name, entry in KNOBS.items():
    fraction = entry["save_GBps"]["median"] / LIMIT["write_fsync"]
    planning = {k: v * 1e3 for k, v in entry["save_planning_s"].items() if k != "values"}
    note = "" if name in DURABLE else "  not durable: no fsync"
    if fraction > 1 and name in DURABLE:
        note = "  above 1: the write + fsync limit is wrong"
    print(
        f"{name:<30}{cell(entry['save_GBps']):>18}{fraction:>9.2f}{cell(planning, '.1f'):>20}{note}"
    )
for name, options in SAVE_OPTIONS.items():
    if options.get("enable_plan_caching"):
        print(
            f"{name}: the first save (warm-up round, fills the cache) planned for "
            f"{KNOBS[name]['warm_up_save_planning_s'] * 1e3:.1f} ms"
        )
print(
    f"\n{'dcp.load of the checkpoint of':<30}{'cold GB/s':>18}{'of storage':>11}"
    f"{'warm GB/s':>18}{'of cache':>9}{'planning ms':>20}"
)
for name, entry in KNOBS.items():
    planning = {k: v * 1e3 for k, v in entry["load_planning_s"].items() if k != "values"}
    cold = entry["cold_load_GBps"]["median"] / LIMIT["read_storage"]
    warm = entry["warm_load_GBps"]["median"] / LIMIT["read_cache"]
    print(
        f"{name:<30}{cell(entry['cold_load_GBps']):>18}{cold:>11.2f}"
        f"{cell(entry['warm_load_GBps']):>18}{warm:>9.2f}{cell(planning, '.1f'):>20}"
    )
above = [
    f"{name} ({KNOBS[name][key]['median'] / LIMIT[limit]:.2f})"
    for name in SAVE_OPTIONS
    for key, limit in (("cold_load_GBps", "read_storage"), ("warm_load_GBps", "read_cache"))
    if KNOBS[name][key]["median"] > LIMIT[limit]
]
if above:
    print(f"load fractions above 1, so the read limit is wrong for: {', '.join(above)}")
print("planning: from the call until the first byte is written (or read), slowest rank")
RESULTS["knobs"] = {
    "options": SAVE_OPTIONS,
    "durable": DURABLE,
    "seconds_per_rank": knob_runs,
    "summary": KNOBS,
}
# sphinx_gallery_end_ignore


# %%
# Replicated state: deduplication to the lowest rank
# --------------------------------------------------
# With DDP every rank holds the whole model, and every rank's plan lists every
# tensor. DCP never writes a replicated tensor twice: its default planner
# always deduplicates (``DefaultSavePlanner``'s ``dedup_replicated_tensors``
# argument is deprecated and does nothing). What you choose is *who* writes:
# by default each tensor goes to the rank with the smallest plan so far, which
# spreads the bytes over the replicas and lets them write in parallel;
# ``dedup_save_to_lowest_rank=True`` gives every replicated tensor to the
# lowest rank that holds it, so rank 0 writes the whole model and the others
# write nothing. (HSDP, ``fully_shard`` on a 2-D mesh, replicates each shard
# over the mesh's first dimension and is deduplicated the same way.)


def save_replicated(checkpoint_root, repeats):
    model = DistributedDataParallel(build_model(SECTION_MB).to(device_for_this_rank()))
    # sphinx_gallery_start_ignore
    expected = snapshot(model)
    record = {f"dedup_save_to_lowest_rank={lowest}": [] for lowest in (False, True)}
    # sphinx_gallery_end_ignore
    for repeat in range(repeats + 1):  # round 0 warms up
        for lowest in (False, True):
            path = os.path.join(checkpoint_root, f"dedup_save_to_lowest_rank-{lowest}-{repeat}")
            planner = DefaultSavePlanner(dedup_save_to_lowest_rank=lowest)
            # sphinx_gallery_start_ignore
            dist.barrier()
            started = time.perf_counter()
            # sphinx_gallery_end_ignore
            dcp.save({"model": model.state_dict()}, checkpoint_id=path, planner=planner)
            # sphinx_gallery_start_ignore
            save_s = time.perf_counter() - started
            mine = [n for n in os.listdir(path) if n.startswith(f"__{dist.get_rank()}_")]
            written = sum(os.path.getsize(os.path.join(path, n)) for n in mine)
            scramble(model)
            load(model, path)
            bad = differing(model, expected)
            assert bad == 0, f"{path}: {bad} tensors differ from what was saved"
            record[f"dedup_save_to_lowest_rank={lowest}"].append(
                {"save_s": save_s, "bytes_written": written}
            )
            # sphinx_gallery_end_ignore
            dist.barrier()
            if dist.get_rank() == 0:
                shutil.rmtree(path)
    # sphinx_gallery_start_ignore
    checked = sum(len(r) for r in record.values())
    print(
        f"checkpoints verified: {checked} of {checked}, {checked * len(expected)} tensors: 0 differ"
    )
    return {"bytes_held": sum(t.nbytes for t in expected), "runs": record}
    # sphinx_gallery_end_ignore


replicated_runs = run_on_ranks(save_replicated, os.path.join(WORK_DIR, "replicated"), REPEATS)

# sphinx_gallery_start_ignore
REPLICATED = {}
print(f"\n{'DefaultSavePlanner(...)':<34}" + "".join(f"{f'rank {r} MB':>11}" for r in range(RANKS)))
held = "".join(f"{r['bytes_held'] / 1e6:>11.1f}" for r in replicated_runs)
print(f"{'each rank holds':<34}{held}   save GB/s, median (min-max)")
for name in replicated_runs[0]["runs"]:
    rounds = list(zip(*(r["runs"][name] for r in replicated_runs), strict=True))
    written = [one["bytes_written"] for one in rounds[0]]  # the same in every round
    model_bytes = replicated_runs[0]["bytes_held"]
    speeds = spread([gbps(model_bytes, [one["save_s"] for one in r]) for r in rounds[1:]])
    REPLICATED[name] = {"bytes_written_per_rank": written, "save_GBps": speeds}
    line = "".join(f"{w / 1e6:>11.1f}" for w in written)
    print(f"{name + ' writes':<34}{line}   {cell(speeds)}")
if RANKS == 1:
    print("One rank: nothing is replicated, so both choices write the same bytes.")
RESULTS["replicated"] = {
    "bytes_held_per_rank": [r["bytes_held"] for r in replicated_runs],
    "seconds_per_rank": [r["runs"] for r in replicated_runs],
    "planners": REPLICATED,
}
# sphinx_gallery_end_ignore


# %%
# Host memory over 20 saves
# -------------------------
# Reports of "host memory grows with every async save" are common. Here each
# rank saves the same model 20 times in a row with each of three strategies,
# each in fresh rank processes (under ``torchrun``: one after the other, in the
# same processes), and records its resident memory (RSS) after every save is on
# disk:
#
# * ``dcp.save`` writes straight from the model's tensors;
# * ``dcp.async_save`` copies the state into new host memory at every save
#   and writes that copy in a thread;
# * ``dcp.async_save`` with one ``DefaultStager`` for all saves copies into
#   the same buffers every time (and can stage in the background).
#
# A training loop would train between the saves; this one waits for each save,
# so that the numbers are memory and nothing else. ``staging_options`` is this
# site's one rule for staging: chosen from the machine, in one place.
#
# .. versionadded:: 2.9
#    ``DefaultStager`` and ``StagingOptions``.


def staging_options():
    on_gpu = torch.accelerator.is_available()
    return StagingOptions(
        use_pinned_memory=on_gpu,  # page-locked memory only speeds up copies from a device
        use_shared_memory=False,  # only a checkpoint *process* reads shared memory in place
        use_async_staging=True,
        use_non_blocking_copy=on_gpu,
    )


STRATEGIES = ("dcp.save", "async_save", "async_save + reused DefaultStager")
SAVES = 20

# sphinx_gallery_start_ignore


class MallocCounters(ctypes.Structure):
    """glibc's ``struct mallinfo2``: where the heap's bytes are."""

    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


def malloc_counters():
    """Bytes in use, freed but kept by the allocator, and in mmapped blocks (glibc only)."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None)
        libc.mallinfo2.restype = MallocCounters
        info = libc.mallinfo2()
        return {"in_use": info.uordblks, "free_kept": info.fordblks, "mmapped": info.hblkhd}
    return None


# sphinx_gallery_end_ignore


def save_twenty_times(strategy, checkpoint_root):
    model = build_sharded_model(SECTION_MB)
    checkpoint_group = dist.new_group(backend="gloo")  # background saves: a group of their own
    stager = DefaultStager(staging_options()) if "DefaultStager" in strategy else None
    # sphinx_gallery_start_ignore
    expected = snapshot(model)
    process = psutil.Process()
    rss_before = process.memory_info().rss
    rss, counters, paths = [], [], []
    # sphinx_gallery_end_ignore
    for save_number in range(1, SAVES + 1):
        path = os.path.join(checkpoint_root, strategy.replace(" ", "-"), f"save-{save_number}")
        state_dict = {"model": model.state_dict()}
        if strategy == "dcp.save":
            dcp.save(state_dict, checkpoint_id=path, process_group=checkpoint_group)
        elif stager is None:
            dcp.async_save(state_dict, checkpoint_id=path, process_group=checkpoint_group).result()
        else:
            if torch.accelerator.is_available():
                # The stager copies on its own stream, which does not wait for the compute stream.
                torch.accelerator.current_stream().synchronize()
            response = dcp.async_save(
                state_dict, checkpoint_id=path, process_group=checkpoint_group, async_stager=stager
            )
            response.upload_completion.result()  # a training loop would train meanwhile
        # sphinx_gallery_start_ignore
        rss.append(process.memory_info().rss)
        counters.append(malloc_counters())
        paths.append(path)
        # sphinx_gallery_end_ignore
    if stager is not None:
        stager.close()
    dist.destroy_process_group(checkpoint_group)
    # sphinx_gallery_start_ignore
    rss_now = process.memory_info().rss
    gc.collect()
    freed_by_gc = rss_now - process.memory_info().rss
    # Every checkpoint, after the memory was measured: it loads and equals what was saved.
    for path in paths:
        scramble(model)
        load(model, path)
        bad = differing(model, expected)
        assert bad == 0, f"{path}: {bad} tensors differ from what was saved"
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(os.path.dirname(paths[0]))
    print(
        f"{strategy}: checkpoints verified: {len(paths)} of {len(paths)}, "
        f"{len(paths) * len(expected)} tensors: 0 differ"
    )
    return {
        "rss_before": rss_before,
        "rss": rss,
        "malloc": counters,
        "freed_by_gc": freed_by_gc,
        "bytes": sum(t.nbytes for t in expected),
    }
    # sphinx_gallery_end_ignore


memory_runs = {}
for strategy in STRATEGIES:
    memory_runs[strategy] = run_on_ranks(save_twenty_times, strategy, os.path.join(WORK_DIR, "rss"))

# sphinx_gallery_start_ignore
FIRST_FEW = 5  # the first saves fill caches and pools: growth is read after them
WINDOW = 5  # saves 6-10 against saves 16-20


def rise(rss):
    """(how much RSS rose from saves 6-10 to saves 16-20, the noise).

    A copy that is alive after one save and freed after the next makes RSS jump up and
    down by its size, which says nothing about growth; a leak raises every value. So the
    rise is the smaller of the rise of the lowest and the rise of the highest RSS of the
    two windows, and the noise is how far RSS moved within saves 6-10.
    """
    early, late = rss[FIRST_FEW : FIRST_FEW + WINDOW], rss[-WINDOW:]
    up = min(min(late) - min(early), max(late) - max(early))
    return up, max(early) - min(early)


SAVES_BETWEEN = SAVES - WINDOW - FIRST_FEW  # from the early window to the late one


def swing(values):
    return max(values) - min(values)


def verdict(entry):
    if entry["growth_fraction_of_checkpoint"] < 0.01:
        return "does not grow"
    if entry["within_noise"]:
        return f"within noise (RSS moved {entry['noise_bytes'] / 1e6:.1f} MB in saves 6-10)"
    return "grows"


MEMORY = {}
for strategy, runs in memory_runs.items():
    rises = [rise(r["rss"]) for r in runs]
    growth = [up / SAVES_BETWEEN for up, _ in rises]
    share = runs[0]["bytes"]
    MEMORY[strategy] = {
        "growth_bytes_per_save_per_rank": growth,
        "growth_bytes_per_save": max(growth),
        "growth_fraction_of_checkpoint": max(growth) / share,
        "within_noise": all(up <= noise for up, noise in rises),
        "noise_bytes": max(noise for _, noise in rises),
        "held_after_last_save_bytes_per_rank": [r["rss"][-1] - r["rss_before"] for r in runs],
        "rss_swing_bytes": max(swing(r["rss"][FIRST_FEW:]) for r in runs),
        "freed_by_gc_bytes": max(r["freed_by_gc"] for r in runs),
    }
SHARE_BYTES = memory_runs[STRATEGIES[0]][0]["bytes"]
print(f"\neach rank's share of the checkpoint: {SHARE_BYTES / 1e6:.1f} MB; MB, largest rank:")
print(
    f"{'strategy':<36}{'growth/save':>12}{'of share':>10}{'held':>8}{'RSS swing':>11}"
    f"{'gc frees':>10}  verdict"
)
for strategy, entry in MEMORY.items():
    held = max(entry["held_after_last_save_bytes_per_rank"])
    print(
        f"{strategy:<36}{entry['growth_bytes_per_save'] / 1e6:>12.2f}"
        f"{entry['growth_fraction_of_checkpoint']:>10.2%}{held / 1e6:>8.1f}"
        f"{entry['rss_swing_bytes'] / 1e6:>11.1f}"
        f"{entry['freed_by_gc_bytes'] / 1e6:>10.1f}  {verdict(entry)}"
    )
print(
    "growth: how much both the lowest and the highest RSS of saves "
    f"{SAVES - WINDOW + 1}-{SAVES} exceed those of saves {FIRST_FEW + 1}-{FIRST_FEW + WINDOW}, "
    f"per save; held: RSS after save {SAVES} above the start; swing: max - min over saves "
    f"{FIRST_FEW + 1}-{SAVES}; gc frees: the RSS one gc.collect() after save {SAVES} released"
)


def malloc_growth(runs):
    """glibc's counters, largest rank: what changed from save 6 to save 20, in bytes."""
    changes = [
        {k: r["malloc"][-1][k] - r["malloc"][FIRST_FEW][k] for k in r["malloc"][-1]}
        for r in runs
        if r["malloc"][-1] is not None
    ]
    return {k: max(c[k] for c in changes) for k in changes[0]} if changes else None


for strategy, entry in MEMORY.items():
    held = max(entry["held_after_last_save_bytes_per_rank"])
    if verdict(entry) == "grows":
        changes = malloc_growth(memory_runs[strategy]) or {}
        grew = max(changes, key=changes.get) if changes else "unknown (no glibc counters)"
        fix = {
            "in_use": "live allocations pile up: something keeps each staged copy alive (a "
            "list of futures or responses?): drop the references, or reuse one DefaultStager",
            "free_kept": "glibc keeps the freed staging buffers in its heap: reuse one "
            "DefaultStager, or start the job with MALLOC_MMAP_THRESHOLD_=1048576 so that large "
            "buffers are mapped and go back to the system when freed",
            "mmapped": "mapped buffers pile up: live copies, as for 'in use'",
        }.get(grew, "look at the malloc counters in the JSON file")
        print(
            f"{strategy} grows by {entry['growth_fraction_of_checkpoint']:.2%} of the share per "
            f"save; what grew most in glibc's heap: {grew} "
            + ", ".join(f"{k} {v / 1e6:+.1f} MB" for k, v in changes.items())
            + f". The fix: {fix}."
        )
    elif held >= 0.5 * SHARE_BYTES:
        owner = (
            "its cached copy, on purpose: every save copies into the same buffers"
            if "DefaultStager" in strategy
            else "the last staged copy, or glibc keeps its memory for the next one (a "
            f"gc.collect() released {entry['freed_by_gc_bytes'] / 1e6:.0f} MB)"
        )
        print(f"{strategy} does not grow, and holds {held / 1e6:.0f} MB after its save: {owner}.")
RESULTS["memory"] = {
    "saves": SAVES,
    "first_few": FIRST_FEW,
    "window": WINDOW,
    "per_rank": memory_runs,
}
RESULTS["memory"]["summary"] = MEMORY


def draw_memory():
    figure, axis = plt.subplots(figsize=(7, 3.6))
    for strategy, runs in memory_runs.items():
        above = [max(r["rss"][i] - r["rss_before"] for r in runs) / 1e6 for i in range(SAVES)]
        axis.plot(range(1, SAVES + 1), above, marker="o", markersize=3, label=strategy)
    axis.axhline(SHARE_BYTES / 1e6, color="gray", linestyle=":", label="one copy of a rank's share")
    axis.set_xlabel("save")
    axis.set_ylabel("RSS above the start (MB)")
    axis.set_xticks(range(1, SAVES + 1, 2))
    axis.set_title(
        f"torch {torch.__version__}: {SHARE_BYTES / 1e6:.0f} MB per rank, {RANKS} rank(s), "
        "largest rank"
    )
    axis.legend(fontsize="small")
    figure.tight_layout()
    return figure


FIGURE = draw_memory()
plt.show()
# sphinx_gallery_end_ignore


# %%
# The advice for this machine
# ---------------------------
# Written by the code below from the medians above. A knob "bought" something
# only where the difference from the defaults is larger than the spread of
# either row's repeats (max - min); anything smaller is within noise and is
# never advice. ``make bench`` (or ``DCP_RECIPES_SPEED_JSON=path``) also writes
# every number, raw and derived, into a JSON file, and the figure next to it.

print(f"For {SIZE_MB:g} MB on {os.cpu_count()} cores, torch {torch.__version__}:")


# sphinx_gallery_start_ignore
def effect(name, key, baseline="defaults (thread_count=1)"):
    """(difference of the medians, the noise it must beat: the larger spread of the two)."""
    a, b = KNOBS[baseline][key], KNOBS[name][key]
    noise = max(a["max"] - a["min"], b["max"] - b["min"])
    return b["median"] - a["median"], noise


def advice():
    sentences = []
    best = max(DURABLE, key=lambda n: KNOBS[n]["save_GBps"]["median"])
    best_gbps = KNOBS[best]["save_GBps"]["median"]
    sentences.append(
        f"Closest to the disk: {best}, {best_gbps:.2f} GB/s = "
        f"{best_gbps / LIMIT['write_fsync']:.2f} of the write + fsync limit "
        f"({LIMIT['write_fsync']:.2f} GB/s)."
    )
    one_thread = LIMITS["write_fsync"][1]["median"]
    serialize = SERIALIZE["torch_save"]["median"]
    sentences.append(
        f"What holds a writer thread back: torch.save alone ran at {serialize:.2f} GB/s here; "
        f"one thread that serializes, then writes at {one_thread:.2f} GB/s, reaches at most "
        f"{1 / (1 / serialize + 1 / one_thread):.2f} GB/s. More threads help only where cores "
        "are free."
    )
    for name in SAVE_OPTIONS:
        if name == "defaults (thread_count=1)":
            continue
        diff, noise = effect(name, "save_GBps")
        if abs(diff) <= noise:
            sentences.append(f"{name}: within noise ({diff:+.2f} GB/s, spread {noise:.2f}).")
        else:
            verb = "bought" if diff > 0 else "cost"
            extra = " (not durable: what fsync costs)" if name not in DURABLE else ""
            sentences.append(f"{name}: {verb} {abs(diff):.2f} GB/s over the defaults{extra}.")
    for name, options in SAVE_OPTIONS.items():
        if options.get("enable_plan_caching"):
            diff, noise = effect(name, "save_planning_s")
            words = "within noise" if abs(diff) <= noise else f"{-diff * 1e3:+.1f} ms saved"
            sentences.append(
                f"{name}: planning {KNOBS[name]['save_planning_s']['median'] * 1e3:.1f} ms vs "
                f"{KNOBS['defaults (thread_count=1)']['save_planning_s']['median'] * 1e3:.1f} ms "
                f"with the defaults: {words} (spread {noise * 1e3:.1f} ms)."
            )
    best_load = max(SAVE_OPTIONS, key=lambda n: KNOBS[n]["cold_load_GBps"]["median"])
    load_gbps = KNOBS[best_load]["cold_load_GBps"]["median"]
    one_reader = LIMITS["read_storage"][1]["median"]
    deserialize = SERIALIZE["torch_load"]["median"]
    sentences.append(
        f"Fastest cold load: the checkpoint written with {best_load}, {load_gbps:.2f} GB/s = "
        f"{load_gbps / LIMIT['read_storage']:.2f} of the read-from-storage limit. "
        "FileSystemReader reads with one thread per rank, whatever the writer used, and "
        f"torch.load + copy ran at {deserialize:.2f} GB/s here: one thread that reads from "
        f"storage at {one_reader:.2f} GB/s, then deserializes, reaches at most "
        f"{1 / (1 / one_reader + 1 / deserialize):.2f} GB/s."
    )
    if RANKS > 1:
        default, lowest = REPLICATED.values()
        a, b = default["save_GBps"], lowest["save_GBps"]
        noise = max(a["max"] - a["min"], b["max"] - b["min"])
        diff = b["median"] - a["median"]
        verdict_words = "within noise" if abs(diff) <= noise else f"{diff:+.2f} GB/s"
        sentences.append(
            "Replicated state: dedup_save_to_lowest_rank=True made rank 0 write "
            f"{lowest['bytes_written_per_rank'][0] / 1e6:.0f} MB alone, at {b['median']:.2f} GB/s; "
            f"the default spread it over the ranks at {a['median']:.2f} GB/s: "
            f"{verdict_words} (spread {noise:.2f})."
        )
    for strategy, entry in MEMORY.items():
        growth = entry["growth_fraction_of_checkpoint"]
        sentences.append(
            f"{strategy}: host memory {verdict(entry)}: "
            f"{entry['growth_bytes_per_save'] / 1e6:+.2f} MB per save ({growth:.2%} of a rank's "
            f"share) after the first {FIRST_FEW} saves."
        )
    return best, best_load, sentences


BEST_SAVE, BEST_LOAD, ADVICE = advice()
for sentence in ADVICE:
    print(sentence)

SUMMARY = {
    "best_save": BEST_SAVE,
    "best_save_GBps": KNOBS[BEST_SAVE]["save_GBps"]["median"],
    "best_save_fraction": KNOBS[BEST_SAVE]["save_GBps"]["median"] / LIMIT["write_fsync"],
    "best_load": BEST_LOAD,
    "best_load_GBps": KNOBS[BEST_LOAD]["cold_load_GBps"]["median"],
    "best_load_fraction": KNOBS[BEST_LOAD]["cold_load_GBps"]["median"] / LIMIT["read_storage"],
    "worst_memory_strategy": max(MEMORY, key=lambda s: MEMORY[s]["growth_bytes_per_save"]),
}
SUMMARY["rss_growth_bytes_per_save"] = MEMORY[SUMMARY["worst_memory_strategy"]][
    "growth_bytes_per_save"
]
SUMMARY["rss_growth_fraction"] = SUMMARY["rss_growth_bytes_per_save"] / SHARE_BYTES
GOALS = {
    "best save >= 0.8 of the write + fsync limit": SUMMARY["best_save_fraction"] >= 0.8,
    "best load >= 0.8 of the read limit": SUMMARY["best_load_fraction"] >= 0.8,
    "RSS growth < 1% of the checkpoint per save": SUMMARY["rss_growth_fraction"] < 0.01,
}
VALUES = [
    f"{SUMMARY['best_save_fraction']:.2f}",
    f"{SUMMARY['best_load_fraction']:.2f}",
    f"{SUMMARY['rss_growth_fraction']:.2%}, {SUMMARY['worst_memory_strategy']}: "
    f"{verdict(MEMORY[SUMMARY['worst_memory_strategy']])}",
]
for (goal, met), value in zip(GOALS.items(), VALUES, strict=True):
    print(f"goal {goal}: {'met' if met else 'not met'} ({value})")


def machine():
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    memory_gb = round(psutil.virtual_memory().total / 2**30, 1)
    return {"cpu": cpu, "cores": os.cpu_count(), "memory_gb": memory_gb}


RESULTS.update(
    {
        "torch": torch.__version__,
        "machine": machine(),
        "accelerator": torch.accelerator.is_available(),
        "world_size": RANKS,
        "launcher": "torchrun" if under_torchrun() else "fork",
        "config": {
            "size_mb": SIZE_MB,
            "section_mb": SECTION_MB,
            "repeats": REPEATS,
            "layers": LAYERS,
            "width": WIDTH,
            "threads": list(THREADS),
            "total_bytes": TOTAL_BYTES,
            "strategies": list(STRATEGIES),
        },
        "advice": ADVICE,
        "summary": SUMMARY,
        "goals": GOALS,
    }
)
writes_here = not dist.is_initialized() or dist.get_rank() == 0  # torchrun: rank 0 writes
if RESULTS_JSON and writes_here:
    results_path = Path(RESULTS_JSON)
    results_path.parent.mkdir(parents=True, exist_ok=True)
    results_path.write_text(json.dumps(RESULTS, indent=1) + "\n")
    FIGURE.savefig(results_path.with_suffix(".png"), dpi=120)
    print(f"wrote {results_path} and {results_path.with_suffix('.png')}")
# sphinx_gallery_end_ignore


# %%
# Clean up
# --------

shutil.rmtree(WORK_DIR, ignore_errors=True)
print(f"removed {WORK_DIR}: {not os.path.exists(WORK_DIR)}")
# sphinx_gallery_start_ignore
print(
    f"save_load_speed_recipe: best save {SUMMARY['best_save_GBps']:.2f} GB/s = "
    f"{SUMMARY['best_save_fraction']:.2f} of the write+fsync limit, best load "
    f"{SUMMARY['best_load_GBps']:.2f} GB/s = {SUMMARY['best_load_fraction']:.2f} of the read "
    f"limit, RSS growth {SUMMARY['rss_growth_bytes_per_save'] / 1e6:.2f} MB/save "
    f"({SUMMARY['rss_growth_fraction']:.2%} of the checkpoint)"
)
# sphinx_gallery_end_ignore


# %%
# What to read next
# -----------------
# * :ref:`sphx_glr_recipes_checkpoint_stall_benchmark.py`: what each saving
#   strategy costs the training loop, measured the same way.
# * :ref:`sphx_glr_recipes_async_save_recipe.py`: ``async_save`` in a training
#   loop, with a cached staging buffer and the process writer.
# * :ref:`sphx_glr_recipes_default_stager_recipe.py`: overlap the copy to host
#   memory with the next forward and backward pass.
# * :doc:`/troubleshooting`: symptoms and fixes, including host memory that
#   grows with every save.
