"""
Fast saves and loads: the knobs, measured
=========================================

"Why is my save so slow?" has an answer only next to the machine's own limits.
This recipe measures how fast this machine writes, syncs and reads a
checkpoint's raw bytes at the start of each round in which it times
``dcp.save`` and ``dcp.load`` with every
``FileSystemWriter`` and planner knob, in safetensors (with a writer and a reader
of its own that stream each tensor's bytes), and with torch_checkpointing, each as
a fraction of those limits; and it saves a replicated (DDP) model.

.. grid:: 2

    .. grid-item-card:: :octicon:`mortar-board;1em;` What you will learn
       :class-card: card-prerequisites

       * Time ``dcp.save`` and loads from storage and from the page cache
       * What ``thread_count``, ``single_file_per_rank``, ``sync_files``,
         ``enable_plan_caching`` and safetensors buy, against the disk's limits
       * A ``StorageWriter`` that writes each tensor from its own memory, and a
         ``StorageReader`` that reads each straight into the model's tensors
       * Who writes replicated tensors, with ``dedup_save_to_lowest_rank``

    .. grid-item-card:: :octicon:`list-unordered;1em;` Prerequisites
       :class-card: card-prerequisites

       * PyTorch: see :doc:`/versions`
       * CPU (gloo) or one GPU per rank (NCCL, plus gloo for checkpointing)
       * :ref:`sphx_glr_recipes_save_load_recipe.py` and
         :ref:`sphx_glr_recipes_checkpoint_stall_benchmark.py`
"""

# %%
# Setup
# -----
# ``SIZE_MB``: the checkpoint's size, all ranks together (use yours); ``REPEATS``:
# rounds, each variant once in turn (A B C, B C A, C A B ...), after a warm-up round.
# The file runs as it is under ``torchrun`` (``make bench`` runs it so: 256 MB, 6 rounds).

import gc
import json
import os
import shutil
import time
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from page_tools import disk, figures, machine, proofs, reads, results, speeds, stats, timing
from rank_launcher import run_on_ranks, shared_tempdir
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.planner import LoadPlan
from torch.distributed.checkpoint.storage import WriteResult
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel
from torch.utils.serialization import config as serialization_config
from torch_checkpointing import CheckpointManager, SyncCheckpointSaverConfig
from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig

BENCH = os.environ.get("DCP_RECIPES_BENCH") == "1"
SIZE_MB = float(os.environ.get("DCP_RECIPES_SPEED_MB", "256" if BENCH else "32"))
REPEATS = int(os.environ.get("DCP_RECIPES_SPEED_REPEATS", "2"))
if REPEATS < 2:
    raise ValueError(f"DCP_RECIPES_SPEED_REPEATS must be at least 2 (a spread), got {REPEATS}")
WORK_DIR = shared_tempdir("dcp-speed-")
print(f"torch {torch.__version__}; checkpoint {SIZE_MB:g} MB, {REPEATS} repeats; in {WORK_DIR}")

# %%
# The model
# ---------
# The model of every page of this site, sharded with FSDP2 over all ranks: each
# rank saves its own shard of every weight, and only the parameters. Its width
# grows with the checkpoint, so that tensors have realistic sizes.


def model_shape(size_mb):
    """(width, depth) of a stack of square Linear layers of about ``size_mb`` in fp32."""
    width = 2048 if size_mb >= 512 else 1024 if size_mb >= 8 else 256
    return width, max(1, round(size_mb * 1e6 / (4 * (width * width + width))))


WIDTH, DEPTH = model_shape(SIZE_MB)
LR = 1e-2
SECTION_SHAPE = model_shape(min(SIZE_MB, 64))  # for the replicated section: 64 MB at most


class ToyModel(nn.Module):
    def __init__(self, width=WIDTH, depth=DEPTH):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))

    def forward(self, x):
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x


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


MODEL_BYTES = 4 * DEPTH * (WIDTH + 1) * WIDTH  # float32 weights and biases
print(f"{DEPTH} x Linear({WIDTH}, {WIDTH}): {MODEL_BYTES / 1e6:,.0f} MB")

# %%
# The limits: write, sync and read the checkpoint's bytes
# -------------------------------------------------------
# ``FileSystemWriter(thread_count=N)`` splits a rank's tensors into N buckets,
# one file and one ``fsync`` per thread. The page's probe (``page_tools.disk``)
# writes the same buckets as raw bytes, then reads them back from storage and
# from the page cache: an upper bound (DCP also runs ``torch.save`` on each
# tensor, which the probe times apart in the warm-up round, with ``torch.load``).
# It runs at the start of every round below, in the minute of the saves and loads
# it bounds: a disk's speed drifts. A limit is the best thread count's median, the
# same statistic as the rows it bounds (the best of N rounds rises as N grows). Its
# table follows the rounds, in "The limits, from the probe's rounds".

# %%
# ``dcp.save`` and ``dcp.load`` with every knob
# ---------------------------------------------
# Each row changes one thing from the defaults (``thread_count=1``,
# ``single_file_per_rank=True``, ``sync_files=True``, no plan caching): ``thread_count``
# writer threads per rank, one file each; ``single_file_per_rank=False``, one file per
# tensor; ``sync_files=False``, no ``fsync`` (after a crash of the machine the checkpoint
# can *look* complete with data missing: it shows what ``fsync`` costs); and
# ``DefaultSavePlanner(enable_plan_caching=True)``: a save whose state dict has the previous
# save's structure reuses its global plan; ``compute_crc32=False``: ``torch.save`` skips
# each record's CRC-32, which ``torch.load`` never checks (the row after it adds 4 threads).
# The last three rows change the format (below).

SAVE_OPTIONS = {
    "defaults": {},
    "thread_count=2": {"thread_count": 2},
    "thread_count=4": {"thread_count": 4},
    "single_file_per_rank=False": {"single_file_per_rank": False},
    "sync_files=False": {"sync_files": False},
    "enable_plan_caching=True": {"enable_plan_caching": True},
    "compute_crc32=False": {"compute_crc32": False},
    "thread_count=4, compute_crc32=False": {"thread_count": 4, "compute_crc32": False},
    "safetensors": {"format": "safetensors"},
    "safetensors, streamed": {"format": "safetensors", "streamed": True},
    "torch_checkpointing": {"format": "torch_checkpointing"},
}
NO_FSYNC = "sync_files=False"  # not durable: never the fastest save


def save(
    model,
    checkpoint_dir,
    enable_plan_caching=False,
    format="torch.save",
    compute_crc32=True,
    streamed=False,
    **options,
):
    if format == "torch_checkpointing":
        return save_with_torch_checkpointing(model, checkpoint_dir)
    if streamed:  # the pair below: 4 threads, a file each
        writer = StreamingSafetensorsWriter(checkpoint_dir, thread_count=4)
    elif format == "safetensors":  # each rank writes its own shards, then fsync
        writer = dcp.HuggingFaceStorageWriter(checkpoint_dir, save_distributed=True)
    else:
        writer = FileSystemWriter(checkpoint_dir, **options)
    planner = DefaultSavePlanner(enable_plan_caching=enable_plan_caching)
    with serialization_config.patch({"save.compute_crc32": compute_crc32}):  # then as it was
        dcp.save({"model": model.state_dict()}, storage_writer=writer, planner=planner)


def load(model, checkpoint_dir, format="torch.save", streamed=False, **save_options):
    if format == "torch_checkpointing":
        return load_with_torch_checkpointing(model, checkpoint_dir)
    reader = {"safetensors": dcp.HuggingFaceStorageReader, "torch.save": dcp.FileSystemReader}
    reader = InPlaceSafetensorsReader if streamed else reader[format]
    state_dict = {"model": model.state_dict()}
    dcp.load(state_dict, storage_reader=reader(checkpoint_dir))  # into the model's shards
    model.load_state_dict(state_dict["model"])


# %%
# Three rows change the format. ``HuggingFaceStorageWriter`` writes safetensors,
# raw bytes after a JSON header (``torch.save`` wraps each tensor in a record that
# ``torch.load`` reads into a new tensor, then copied into yours), but builds each
# file in memory first, in one thread; its reader copies each tensor once from a
# mapped file. The pair below, the row "safetensors, streamed", writes from each
# tensor's own memory with 4 threads, a file and an ``fsync`` each (as the
# ``thread_count=4`` row's writer), and reads each tensor straight into its target,
# a thread per file.

SAFETENSORS_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
SAFETENSORS_NAMES = {dtype: name for name, dtype in SAFETENSORS_DTYPES.items()}


class StreamingSafetensorsWriter(dcp.HuggingFaceStorageWriter):
    def __init__(self, path, thread_count=4):
        super().__init__(path, thread_count=thread_count, save_distributed=True)

    def write_data(self, plan, planner):  # tensors only, as safetensors holds
        if not plan.items:
            return super().write_data(plan, planner)
        items = sorted(plan.items, key=lambda item: item.tensor_storage_size(), reverse=True)
        shard, n = plan.storage_data["shard_index"], min(self.thread_count, len(plan.items))
        with ThreadPoolExecutor(n) as pool:  # bucket i: items i, i + n, ...: alike in size
            files = [pool.submit(self.write_file, shard, i, items[i::n], planner) for i in range(n)]
            future = torch.futures.Future()
            future.set_result([result for file in files for result in file.result()])
        return future

    def write_file(self, shard, i, items, planner):
        tensors = [planner.resolve_data(item).detach() for item in items]
        header, end = {}, 0
        for item, tensor in zip(items, tensors, strict=True):
            start, end = end, end + tensor.nbytes
            dtype, shape = SAFETENSORS_NAMES[tensor.dtype], list(tensor.shape)
            header[item.index.fqn] = {"dtype": dtype, "shape": shape, "data_offsets": [start, end]}
        shards = {
            it.index.fqn: {"saved_offsets": list(it.tensor_data.chunk.offsets)} for it in items
        }
        header["__metadata__"] = {"DCP_SHARDING_INFO": json.dumps(shards)}  # what the reader reads
        encoded = json.dumps(header).encode()
        encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned
        name = f"shard-{shard}-{i}.safetensors"  # shard_index: 1 for rank 0, 2 for rank 1, ...
        with open(os.path.join(self.path, name), "wb", buffering=0) as file:
            file.write(len(encoded).to_bytes(8, "little") + encoded)
            for tensor in tensors:  # to the host one at a time (from a GPU: a copy each)
                host = tensor.cpu().contiguous()  # on the CPU: the tensor itself
                data = memoryview(host.reshape(-1).view(torch.uint8).numpy())  # no copy
                while data:  # a write may take fewer bytes than it was given
                    data = data[file.write(data) :]
            os.fsync(file.fileno())
        spans = [header[item.index.fqn]["data_offsets"] for item in items]
        where = [_StorageInfo(name, 8 + len(encoded) + a, b - a) for a, b in spans]
        return [WriteResult(it.index, w.length, w) for it, w in zip(items, where, strict=True)]


class InPlaceSafetensorsReader(dcp.HuggingFaceStorageReader):
    def read_data(self, plan, planner):  # a thread per file, as the writer wrote them
        by_file = {}
        for item in plan.items:
            by_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        with ThreadPoolExecutor(max(1, len(by_file))) as pool:
            files = [pool.submit(self.read_file, p, items, planner) for p, items in by_file.items()]
            rest = [item for file in files for item in file.result()]
        return super().read_data(LoadPlan(rest), planner)  # what could not go in place

    def read_file(self, path, items, planner):
        rest = []
        with open(path, "rb", buffering=0) as file:
            header_bytes = int.from_bytes(file.read(8), "little")
            header = json.loads(file.read(header_bytes))
            items.sort(key=lambda item: header[item.storage_index.fqn]["data_offsets"])
            for item in items:  # in the file's order: the kernel reads ahead
                entry = header[item.storage_index.fqn]
                target = planner.resolve_tensor(item).detach()
                whole = list(item.lengths) == entry["shape"] == list(target.shape)
                if not (whole and fits(target, SAFETENSORS_DTYPES.get(entry["dtype"]))):
                    rest.append(item)
                    continue
                file.seek(8 + header_bytes + entry["data_offsets"][0])
                buffer = memoryview(target.reshape(-1).view(torch.uint8).numpy())
                while buffer:  # a read may return fewer bytes than asked for
                    buffer = buffer[file.readinto(buffer) :]
                planner.commit_tensor(item, target)
        return rest


def fits(target, dtype):  # whether the file's bytes can go straight into target's memory
    return target.device.type == "cpu" and target.is_contiguous() and target.dtype == dtype


# %%
# torch_checkpointing writes a ``torch.save`` file per item and rank and never
# calls ``fsync``: rank 0, whose save returns after the rename, syncs them here.


def torch_checkpointing_manager():
    storage = LocalFileSystemStorageConfig(use_direct_io=False)  # ext4 fails its writes
    config = CheckpointManager.Config(save=SyncCheckpointSaverConfig(), storage_config=storage)
    return CheckpointManager(config)  # synchronous: it writes in the save call


def save_with_torch_checkpointing(model, checkpoint_dir):
    manager = torch_checkpointing_manager()
    manager.save(checkpoint_dir, {"model": model.state_dict()})
    manager.close()
    if dist.get_rank() == 0:
        sync_files(checkpoint_dir)


def sync_files(directory, drop=False):
    """``fsync`` each file, the directory and its parent; with ``drop``, also drop the files
    from the page cache (once synced: dirty pages cannot be dropped), for a cold read."""
    for name in [*os.listdir(directory), ".", ".."]:
        fd = os.open(os.path.join(directory, name), os.O_RDONLY)
        os.fsync(fd)
        if drop and name not in (".", ".."):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)


def load_with_torch_checkpointing(model, checkpoint_dir):
    manager = torch_checkpointing_manager()
    manager.load(checkpoint_dir, into={"model": model.state_dict()})  # into the model's shards
    manager.close()


# %%
# A save or a load is a collective, done when its slowest rank is: all ranks
# start the clock together, and the slowest rank's time counts. A *cold* load
# reads files dropped from the page cache, a *warm* one reads them again.


def timed(collective, *args, **kwargs):
    """Seconds of a collective call on the slowest rank, all ranks started together."""
    dist.barrier()
    started = time.perf_counter()
    collective(*args, **kwargs)
    if torch.accelerator.is_available():
        torch.accelerator.synchronize()  # a load is done when its copies to the device are
    seconds = torch.tensor(time.perf_counter() - started, dtype=torch.float64)
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
    return seconds.item()


# %%
# Each round saves the model with every knob, loads each checkpoint cold, then warm, into the
# same model, and removes it; it starts one knob later than the round before (its first save
# follows the probe). GB/s: the checkpoint's bytes over the slowest rank's time. Round 0 warms up.


def save_and_load_every_way(checkpoint_root, repeats, knobs=SAVE_OPTIONS):
    model, _ = build_sharded_model(seed=0)
    total_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    measured = []
    if dist.get_rank() == 0:
        print(f"{'round':<7}{'GB/s':<36}" + "".join(f"{h:>11}" for h in ("save", "cold", "warm")))
    for round_number in range(repeats + 1):  # round 0 also fills the plan cache
        gc.collect()  # untimed: a full collection walks every object alive, slowly
        gc.freeze()  # so none does inside a timed save or load: what lives is left alone
        turn = round_number % len(knobs)  # A B C, then B C A, ...
        in_turn = [*knobs.items()][turn:] + [*knobs.items()][:turn]
        for position, (name, options) in enumerate(in_turn):
            folder = name.replace("=", "-").replace(", ", "-").replace(" ", "-")
            path = os.path.join(checkpoint_root, f"round{round_number}", folder)
            seconds = [timed(save, model, path, **options)]
            if dist.get_rank() == 0:
                sync_files(path, drop=True)  # the first load reads from storage
            seconds += [timed(load, model, path, **options) for _ in range(2)]  # cold, then warm
            rates = [total_bytes / s / 1e9 for s in seconds]
            if dist.get_rank() == 0:
                print(f"{round_number:<7}{name:<36}" + "".join(f"{v:>11.2f}" for v in rates))
                shutil.rmtree(path)
            if round_number > 0:
                keys = ("save_GBps", "cold_load_GBps", "warm_load_GBps")
                measured.append(
                    dict(zip(keys, rates, strict=True), option=name, turn=position, path=path)
                )
    gc.unfreeze()
    return measured


# %%
# The page checks the warm-up round's DCP checkpoints (each rank's shards as the save got
# them against what each load filled in, into a model set to NaN), times each save's and
# load's planning (from the call to the first byte), profiles the warm-up round's
# ``enable_plan_caching=True`` loads (cold, then warm) and the saves with 4 threads, no
# CRC-32, runs the probe of the limits before each round's first save, and before each
# measured save writes, then frees, twice the checkpoint's size of memory (untimed), so
# that each save starts on memory freed a moment before (below: why that matters).

with (
    reads.load_phases(dcp, where=lambda path: "round0/enable_plan_caching" in path) as profiled,
    reads.save_phases(
        dcp,
        FileSystemWriter,
        lambda path: "round0" not in path and path.endswith("thread_count-4-compute_crc32-False"),
    ) as saved,
    proofs.checkpoints_checked(dcp, where=proofs.checkpoint_matches("/round0/")) as checked,
    timing.until_first(dcp, "save", FileSystemWriter, "write_data") as save_planning,
    timing.until_first(dcp, "load", dcp.FileSystemReader, "read_data") as load_planning,
    disk.probed_each_round(
        "timed",  # before a round's first timed save: the round's folder is new
        lambda call: os.path.dirname(call.args[2]),  # timed(save, model, path, ...)
        lambda call: call.args[1],  # the model the rounds save: its shards, as raw bytes
        f"{WORK_DIR}/limits",
        repeats=REPEATS,  # serialization timings, in the warm-up round
    ) as limit_runs,
    machine.memory_in_use_before(
        "timed",
        2 * MODEL_BYTES,
        lambda call: call.args[0] is save and "/round0/" not in call.args[2],
    ) as used,
):
    knob_runs = run_on_ranks(save_and_load_every_way, f"{WORK_DIR}/knobs", REPEATS)
proofs.loads_match_saves("knob-checkpoints-load-back", checked, "warm-up round, cold and warm")

# %%
# The limits, from the probe's rounds (its warm-up round dropped, as the knobs'
# is). Where one thread's reads from storage are within noise of its reads from
# the page cache, the host probably caches the disk:

LIMITS = results.record("limits", disk.bandwidths(limit_runs))
results.claim(
    "probe-reads-back-what-it-wrote",
    all(run["read_back_equal"] for run in limit_runs),
    f"every file the probe read back held the bytes it wrote, on {len(limit_runs)} rank(s)",
)
disk.storage_against_cache(LIMITS)
disk.table(LIMITS)

# %%
# The saves, against the write + ``fsync`` limit:

KNOBS = stats.group(knob_runs[0], "option", order=SAVE_OPTIONS)
for knob in KNOBS.values():  # the page's planning times, joined to the recipe's rounds
    knob["save_planning_s"] = timing.slowest(save_planning, knob["path"])
    knob["load_planning_s"] = timing.slowest(load_planning, knob["path"], nth=1)  # warm loads
results.record("knobs", KNOBS)
IN_USE = results.record("memory_in_use", used.by_rank)
CACHE_FILLED = timing.slowest(save_planning, [f"{WORK_DIR}/knobs/round0/enable_plan_caching-True"])
figures.measured(
    "dcp.save with",
    KNOBS,
    [
        figures.Column("save GB/s", "save_GBps"),
        figures.Column("of limit", "save_GBps", of=LIMITS["limit"]["write_fsync"]),
        figures.Column("planning ms", "save_planning_s", ".1f", 1e3),
    ],
    caption=f"median (lowest-highest) of {REPEATS}; planning: from the call until the first "
    f"byte; plan caching's first save (round 0: fills the cache): {CACHE_FILLED[0] * 1e3:.1f} ms"
    f"; before each measured save, {machine.in_use_shown(IN_USE)}",
)

# %%
# The loads: cold against the read-from-storage limit, warm against the
# read-from-page-cache limit. A limit is one only if nothing beats it beyond noise:

speeds.claim_within_limits("no-save-or-load-beats-its-limit", KNOBS, LIMITS, [NO_FSYNC])
figures.measured(
    "checkpoint of",
    KNOBS,
    [
        figures.Column("cold GB/s", "cold_load_GBps"),
        figures.Column("of limit", "cold_load_GBps", of=LIMITS["limit"]["read_storage"]),
        figures.Column("warm GB/s", "warm_load_GBps"),
        figures.Column("of limit", "warm_load_GBps", of=LIMITS["limit"]["read_cache"]),
        figures.Column("planning ms", "load_planning_s", ".1f", 1e3),
    ],
    caption="planning: warm loads",
)

# %%
# Where the cold load's time goes in the warm-up round's ``enable_plan_caching=True`` row,
# per rank (cProfile): ``torch.load`` reading the bytes into new tensors, ``copy_`` into the
# model's, the rest (planning, unpickling). The in-place reader (the loads of the row
# "safetensors, streamed") reads straight into the model's tensors, and skips the copy
# (what that buys: its warm loads against the defaults', at the end).

results.record("load_phases", profiled.by_rank)
reads.phases_table(profiled, MODEL_BYTES)

# %%
# Where a save's time goes, with 4 threads and no CRC-32 (the median round), by the clock:
# planning; each writer thread's ``torch.save`` + write, and ``fsync``; the
# ``.metadata`` (rank 0 writes it); the rest. The write fills the page cache (how fast
# depends on the moment: below), and ``fsync`` waits for the disk.

results.record("save_phases", saved.by_rank)
reads.phases_table(saved, MODEL_BYTES, "by the clock", reads.median_call)

# %%
# Why one save is fast and the same save slow a minute later
# ----------------------------------------------------------
# Each round's profiled save beside its round's probe (the same bytes, as many threads,
# raw writes, then ``fsync``), per writer thread: which of the two did it lose time in?

BESIDE_PROBE = results.record("save_beside_probe", speeds.save_beside_probe(saved.by_rank, LIMITS))
speeds.save_beside_probe_table(BESIDE_PROBE)

# %%
# A write fills the page cache; ``fsync`` sends it to the disk. A virtual machine whose
# kernel hands free memory back to its host (*free page reporting*) gets it back at the
# host's pace: a write into memory freed a moment before (the last checkpoint's pages,
# just removed) fills fast, one into memory that stayed free, slowly, and a limit or a
# save measured just after the other kind of moment is off by that much. Each rank
# fills a file of its share of page cache, or more (the table gives the size: a small
# file may find none of its memory taken back), both ways, in turns; no byte reaches disk.
# What removes it is the machine's, not DCP's: a VM that keeps its freed memory.

FILL_RUNS = run_on_ranks(
    machine.page_cache_fills, f"{WORK_DIR}/fills", max(LIMITS["bytes_per_rank"]), REPEATS
)
FILLS = results.record("fills", machine.fills(FILL_RUNS))
machine.fills_table(FILLS)

# %%
# Replicated state: deduplication to the lowest rank
# --------------------------------------------------
# With DDP every rank holds the whole model, and every rank's plan lists every
# tensor. DCP never writes a replicated tensor twice (``DefaultSavePlanner``'s
# ``dedup_replicated_tensors`` is deprecated and does nothing): you choose *who*
# writes. By default each tensor goes to the rank with the smallest plan so
# far, which spreads the bytes over the replicas, to write in parallel;
# ``dedup_save_to_lowest_rank=True`` gives each to the lowest rank that holds
# it: rank 0 writes the whole model, the others nothing (HSDP is deduplicated
# the same way). Every rank then loads the whole model back.


def save_replicated(checkpoint_root, repeats):
    torch.manual_seed(0)
    model = DistributedDataParallel(ToyModel(*SECTION_SHAPE).to(device_for_this_rank()))
    total_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    measured, bytes_written = [], {}
    for round_number in range(repeats + 1):  # round 0 warms up and is not kept
        for lowest in (False, True):
            path = os.path.join(checkpoint_root, f"round{round_number}", f"lowest-{lowest}")
            planner = DefaultSavePlanner(dedup_save_to_lowest_rank=lowest)
            state_dict = {"model": model.state_dict()}
            seconds = timed(dcp.save, state_dict, checkpoint_id=path, planner=planner)
            mine = [n for n in os.listdir(path) if n.startswith(f"__{dist.get_rank()}_")]
            bytes_written[lowest] = sum(os.path.getsize(os.path.join(path, n)) for n in mine)
            load(model, path)
            if round_number == 0:
                print(f"dedup_save_to_lowest_rank={lowest}: wrote {bytes_written[lowest]:,} bytes")
            else:
                measured.append({"lowest": lowest, "save_GBps": total_bytes / seconds / 1e9})
            dist.barrier()
            if dist.get_rank() == 0:
                shutil.rmtree(path)
    return {"bytes_held": total_bytes, "bytes_written": bytes_written, "measured": measured}


# %%
# The page checks the warm-up round's checkpoints on every rank, as above:

with proofs.checkpoints_checked(dcp, where=proofs.checkpoint_matches("/round0/")) as checked:
    replicated_runs = run_on_ranks(save_replicated, f"{WORK_DIR}/replicated", REPEATS)
proofs.loads_match_saves("replicated-checkpoints-load-back", checked, "warm-up round")

# %%
# What each rank wrote, and how fast (all of the model's bytes over the
# slowest rank's time). Each tensor is written once (the files hold one model,
# and the records ``torch.save`` puts around each tensor), as the planner chose:

REPLICATED = results.record("replicated", speeds.replicated(replicated_runs))
speeds.claim_written_once("replicated-tensors-written-once-split-as-said", REPLICATED)
speeds.replicated_table(REPLICATED, REPEATS)

# %%
# The advice for this machine
# ---------------------------
# The best save and load (the knobs with the highest median), against their limits. A
# ``FileSystemWriter`` thread serializes a tensor, then writes it.

MACHINE = results.record(
    "machine",
    machine.describe(WORK_DIR) | dict(repeats=REPEATS, shapes=[(WIDTH, DEPTH), SECTION_SHAPE]),
)
HEADLINE = results.record("headline", speeds.headline(KNOBS, LIMITS, [NO_FSYNC]))
ON = f"{LIMITS['total_bytes'] / 1e6:,.0f} MB on {MACHINE['cores']} cores, torch {torch.__version__}"
speeds.best_table(HEADLINE, LIMITS, caption=ON)

# %%
# Each knob against the defaults, round by round (saves; the safetensors rows' warm loads:
# a cold load also carries the disk's speed of the moment, above against its limit): it
# bought something only where it beat the defaults by over 10% in most rounds.

ADVICE = speeds.advice(KNOBS, REPLICATED, loads=("safetensors", "safetensors, streamed"))
results.record("advice", ADVICE)
figures.Table(["against the defaults", "verdict", "factor over the defaults"], ADVICE)

# %%
# Clean up
# --------

shutil.rmtree(WORK_DIR, ignore_errors=True)
print(f"removed {WORK_DIR}: {not os.path.exists(WORK_DIR)}")

# %%
# What to read next
# -----------------
# * :ref:`sphx_glr_recipes_checkpoint_stall_benchmark.py`: what each strategy costs a loop.
# * :ref:`sphx_glr_recipes_stager_copies_recipe.py`: host memory over 20 saves, three ways.
# * :doc:`/troubleshooting`: symptoms and fixes for the usual DCP failures.
