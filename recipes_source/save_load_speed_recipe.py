"""
Fast saves and loads: the knobs, measured
=========================================

"Why is my save so slow?" has an answer only next to the machine's own limits.
This recipe measures how fast this machine writes, syncs and reads a
checkpoint's raw bytes, then times ``dcp.save`` and ``dcp.load`` with every
``FileSystemWriter`` and planner knob, each as a fraction of those limits; it
saves a replicated (DDP) model with and without deduplication to the lowest
rank, and follows host memory over 20 saves with three strategies.

.. grid:: 2

    .. grid-item-card:: :octicon:`mortar-board;1em;` What you will learn
       :class-card: card-prerequisites

       * Time ``dcp.save`` and loads from storage and from the page cache
       * What ``thread_count``, ``single_file_per_rank``, ``sync_files`` and
         ``enable_plan_caching`` buy, against write + ``fsync`` and read limits
       * Who writes replicated tensors, with ``dedup_save_to_lowest_rank``
       * Whether host memory grows over 20 saves, with three strategies

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
# ``SIZE_MB`` is the checkpoint's size (all ranks together), small here so
# that the page runs in seconds (use your own checkpoint's), and ``REPEATS``
# how often each measurement is repeated. Each round runs every variant once,
# in turn (A B C ... A B C ...), after a warm-up round that is not counted.

import gc
import os
import shutil
import time

import psutil
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from page_tools import disk, figures, machine, memory, proofs, reads, results, stats, timing
from rank_launcher import run_as_torchrun, run_on_ranks, shared_tempdir
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

BENCH = os.environ.get("DCP_RECIPES_BENCH") == "1"
SIZE_MB = float(os.environ.get("DCP_RECIPES_SPEED_MB", "512" if BENCH else "32"))
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
SECTION_SHAPE = model_shape(min(SIZE_MB, 128))  # for replicas and 20 saves: 128 MB at most


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
    fully_shard(model)  # every parameter becomes a DTensor sharded over all ranks
    optimizer = torch.optim.Adam(model.parameters(), lr=LR)
    return model, optimizer


print(f"{DEPTH} x Linear({WIDTH}, {WIDTH}): {4 * DEPTH * (WIDTH + 1) * WIDTH / 1e6:,.0f} MB")

# %%
# The limits: write, sync and read the checkpoint's bytes
# -------------------------------------------------------
# ``FileSystemWriter(thread_count=N)`` splits a rank's tensors into N buckets,
# one file and one ``fsync`` per thread. The page's probe (``page_tools.disk``)
# writes the same buckets as raw bytes, then reads them back from storage and
# from the page cache: an upper bound (DCP also runs ``torch.save`` on each
# tensor, which the probe times apart, with ``torch.load``). A limit is the best
# repeat; reads from storage within noise of the cache's mean a caching host.

limit_runs = run_on_ranks(
    disk.measure_limits, lambda: build_sharded_model(0)[0], f"{WORK_DIR}/limits", (1, 2, 4), REPEATS
)
LIMITS = results.record("limits", disk.bandwidths(limit_runs))
results.claim(
    "probe-reads-back-what-it-wrote",
    all(run["read_back_equal"] for run in limit_runs),
    f"every file the probe read back held the bytes it wrote, on {len(limit_runs)} rank(s)",
)
disk.storage_against_cache(LIMITS)
disk.table(LIMITS)

# %%
# ``dcp.save`` and ``dcp.load`` with every knob
# ---------------------------------------------
# Each row changes one thing from the defaults (``thread_count=1``,
# ``single_file_per_rank=True``, ``sync_files=True``, no plan caching):
# ``thread_count`` writer threads per rank, one file each;
# ``single_file_per_rank=False``, one file per tensor; ``sync_files=False``,
# no ``fsync``: the save returns once the bytes are in the page cache, and
# after a crash of the machine the checkpoint can *look* complete (its
# ``.metadata`` on disk) with data missing (it shows what ``fsync`` costs);
# ``DefaultSavePlanner(enable_plan_caching=True)``: when the
# state dict has the structure it had at the previous save, ranks skip sending
# their plans and the coordinator reuses the global plan (cached on the class).

SAVE_OPTIONS = {
    "defaults": {},
    "thread_count=2": {"thread_count": 2},
    "thread_count=4": {"thread_count": 4},
    "single_file_per_rank=False": {"single_file_per_rank": False},
    "sync_files=False": {"sync_files": False},
    "enable_plan_caching=True": {"enable_plan_caching": True},
}
NO_FSYNC = "sync_files=False"  # not durable: never the fastest save


def save(model, checkpoint_dir, enable_plan_caching=False, **writer_options):
    writer = FileSystemWriter(checkpoint_dir, **writer_options)
    planner = DefaultSavePlanner(enable_plan_caching=enable_plan_caching)
    dcp.save({"model": model.state_dict()}, storage_writer=writer, planner=planner)


def load(model, checkpoint_dir):
    state_dict = {"model": model.state_dict()}
    dcp.load(state_dict, checkpoint_id=checkpoint_dir)  # in place, into the model's shards
    model.load_state_dict(state_dict["model"])


# %%
# A save or a load is a collective, done when its slowest rank is: all ranks
# start the clock together, and the slowest rank's time counts. A *cold* load
# reads files dropped from the page cache (``fsync`` first: dirty pages cannot
# be dropped); a *warm* load reads them again, from the page cache.


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


def drop_from_page_cache(checkpoint_dir):
    for name in os.listdir(checkpoint_dir):
        fd = os.open(os.path.join(checkpoint_dir, name), os.O_RDONLY)
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # the next read goes to storage
        os.close(fd)


# %%
# Each round saves the model with every knob, loads each checkpoint cold, then
# warm, into the same model, and removes it. GB/s: all of the checkpoint's
# bytes over the slowest rank's time. Round 0 warms up and is not kept.


def save_and_load_every_way(checkpoint_root, repeats, knobs=SAVE_OPTIONS):
    model, _ = build_sharded_model(seed=0)
    total_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    measured = []
    if dist.get_rank() == 0:
        print(f"{'round':<7}{'GB/s':<27}" + "".join(f"{h:>11}" for h in ("save", "cold", "warm")))
    for round_number in range(repeats + 1):  # round 0 also fills the plan cache
        for name, options in knobs.items():
            path = os.path.join(checkpoint_root, f"round{round_number}", name.replace("=", "-"))
            seconds = [timed(save, model, path, **options)]
            if dist.get_rank() == 0:
                drop_from_page_cache(path)
            seconds += [timed(load, model, path), timed(load, model, path)]  # cold, then warm
            speeds = [total_bytes / s / 1e9 for s in seconds]
            if dist.get_rank() == 0:
                print(f"{round_number:<7}{name:<27}" + "".join(f"{v:>11.2f}" for v in speeds))
                shutil.rmtree(path)
            if round_number > 0:
                keys = ("save_GBps", "cold_load_GBps", "warm_load_GBps")
                measured.append(
                    {"option": name, "path": path, **dict(zip(keys, speeds, strict=True))}
                )
    return measured


# %%
# The page checks the warm-up round's checkpoints (each rank's shards as the
# save got them against what each load filled in, into a model set to NaN),
# times each save's and load's planning (from the call to the first byte) and
# profiles the warm-up round's last two loads.

with (
    reads.load_phases(dcp, where=lambda path: "round0/enable_plan_caching" in path) as profiled,
    proofs.checkpoints_checked(dcp, where=proofs.checkpoint_matches("/round0/")) as checked,
    timing.until_first(dcp, "save", FileSystemWriter, "write_data") as save_planning,
    timing.until_first(dcp, "load", dcp.FileSystemReader, "read_data") as load_planning,
):
    knob_runs = run_on_ranks(save_and_load_every_way, f"{WORK_DIR}/knobs", REPEATS)
proofs.loads_match_saves("knob-checkpoints-load-back", checked, "warm-up round, cold and warm")

# %%
# The saves, against the write + ``fsync`` limit:

KNOBS = stats.group(knob_runs[0], "option")
for knob in KNOBS.values():  # the page's planning times, joined to the recipe's rounds
    knob["save_planning_s"] = timing.slowest(save_planning, knob["path"])
    knob["load_planning_s"] = timing.slowest(load_planning, knob["path"], nth=1)  # warm loads
results.record("knobs", KNOBS)
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
    f"byte; plan caching's first save (round 0: fills the cache): {CACHE_FILLED[0] * 1e3:.1f} ms",
)

# %%
# The loads: cold against the read-from-storage limit, warm against the
# read-from-page-cache limit. A limit is a limit only if nothing beats it:

results.claim(
    "no-save-or-load-beats-its-limit",
    all(
        stats.median(knob["cold_load_GBps"]) <= LIMITS["limit"]["read_storage"]
        and stats.median(knob["warm_load_GBps"]) <= LIMITS["limit"]["read_cache"]
        and (stats.median(knob["save_GBps"]) <= LIMITS["limit"]["write_fsync"] or name == NO_FSYNC)
        for name, knob in KNOBS.items()
    ),
    "no durable save beat write + fsync, and no load the read it does",
)
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
# Where the cold load's time goes, per rank (cProfile): ``torch.load`` reading
# the bytes into new tensors, ``copy_`` into the model's, the rest (planning,
# unpickling). Reading straight into the model's tensors would skip the copy.

results.record("load_phases", profiled.by_rank)
reads.phases_table(profiled, 4 * DEPTH * (WIDTH + 1) * WIDTH)

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

REPLICATED = results.record(
    "replicated",
    {
        "bytes_held": replicated_runs[0]["bytes_held"],
        "written": {b: [run["bytes_written"][b] for run in replicated_runs] for b in (False, True)},
        "timed": stats.group(replicated_runs[0]["measured"], "lowest"),
    },
)
results.claim(
    "replicated-tensors-written-once-split-as-said",
    all(
        REPLICATED["bytes_held"] <= sum(written) < 1.05 * REPLICATED["bytes_held"]
        for written in REPLICATED["written"].values()
    )
    and all(REPLICATED["written"][False])
    and REPLICATED["written"][True][0] > 0
    and not any(REPLICATED["written"][True][1:]),
    "one copy of the model either way; by default every rank wrote, with lowest rank 0 only",
)
figures.Table(
    ["DefaultSavePlanner(...)", *(f"rank {r} MB" for r in range(len(replicated_runs))), "GB/s"],
    [
        [f"dedup_save_to_lowest_rank={lowest}", *(round(b / 1e6, 1) for b in written)]
        + [stats.median_range(REPLICATED["timed"][lowest]["save_GBps"])]
        for lowest, written in REPLICATED["written"].items()
    ],
    caption=f"MB each rank wrote, of the {REPLICATED['bytes_held'] / 1e6:.1f} MB that every rank "
    f"holds; save GB/s: median (lowest-highest) of {REPEATS}",
)

# %%
# Host memory over 20 saves
# -------------------------
# Reports of "host memory grows with every async save" are common. Each rank
# saves a model (128 MB at most) 20 times with each of three strategies, in
# fresh ranks (under ``torchrun``, the same ones), and reads its resident
# memory (RSS) once each save is on disk: ``dcp.save`` writes from the model's
# tensors; ``dcp.async_save`` copies the state into new host memory every time;
# one reused ``DefaultStager`` copies into the same buffers every time.
#
# .. versionadded:: 2.9
#    ``DefaultStager`` and ``StagingOptions``.

STRATEGIES = ("dcp.save", "async_save", "async_save + reused DefaultStager")
SAVES = 20


def staging_options(use_async_staging, checkpoint_process=False):
    """How every save on this page stages its copy, chosen from the machine."""
    on_gpu = torch.accelerator.is_available()
    return StagingOptions(
        use_pinned_memory=on_gpu,  # page-locked memory only speeds up copies from a device
        use_shared_memory=checkpoint_process,  # only a checkpoint *process* reads it in place
        use_async_staging=use_async_staging,
        use_non_blocking_copy=on_gpu,
    )


# %%


def save_twenty_times(strategy, checkpoint_root):
    torch.manual_seed(0)
    model = ToyModel(*SECTION_SHAPE).to(device_for_this_rank())
    fully_shard(model)
    group = dist.new_group(backend="gloo")  # background saves: a group of their own
    reuse = "DefaultStager" in strategy
    stager = DefaultStager(staging_options(use_async_staging=True)) if reuse else None
    process = psutil.Process()
    rss_before, rss, previous = process.memory_info().rss, [], None
    for save_number in range(1, SAVES + 1):
        path = os.path.join(checkpoint_root, strategy.replace(" ", "-"), f"save-{save_number}")
        state_dict = {"model": model.state_dict()}
        if strategy == "dcp.save":
            dcp.save(state_dict, checkpoint_id=path, process_group=group)
        elif stager is None:
            dcp.async_save(state_dict, checkpoint_id=path, process_group=group).result()
        else:
            if torch.accelerator.is_available():
                torch.accelerator.current_stream().synchronize()  # the stager does not wait
            writer = FileSystemWriter(path, per_thread_copy_ahead=0)  # host copy: no GPU 0 context
            response = dcp.async_save(
                state_dict, storage_writer=writer, process_group=group, async_stager=stager
            )
            response.upload_completion.result()  # a training loop would train meanwhile
        rss.append(process.memory_info().rss)
        if previous is not None and dist.get_rank() == 0:
            shutil.rmtree(previous)  # keep the latest checkpoint only
        previous = path
    if stager is not None:
        stager.close()
    dist.destroy_process_group(group)
    rss_at_end = process.memory_info().rss
    gc.collect()
    rss_after_gc = process.memory_info().rss
    load(model, previous)  # resume from the latest checkpoint
    shown = {f"save {n}": rss[n - 1] for n in (1, SAVES // 2, SAVES)} | {"gc": rss_after_gc}
    print(f"{strategy}: RSS above the start, MB")
    print("  after " + ", ".join(f"{at} {(r - rss_before) / 1e6:+.1f}" for at, r in shown.items()))
    shard_bytes = sum(p.to_local().nbytes for p in model.parameters())
    rss_at = {"rss_before": rss_before, "rss": rss, "rss_at_end": rss_at_end}
    return {"bytes": shard_bytes, **rss_at, "rss_after_gc": rss_after_gc}


# %%
# The page reads glibc's heap counters whenever the recipe reads its RSS:

with (
    memory.heap_at(psutil.Process, "memory_info") as heap,
    proofs.checkpoints_checked(dcp, where=proofs.checkpoint_matches(f"/save-{SAVES}$")) as checked,
):
    memory_runs = {s: run_on_ranks(save_twenty_times, s, f"{WORK_DIR}/rss") for s in STRATEGIES}
proofs.loads_match_saves("memory-checkpoints-load-back", checked, f"save {SAVES}, resumed")

# %%
# Does RSS grow? The first saves fill caches and pools, so the page compares
# saves 6-10 with 16-20: a difference within the spread of either window is
# noise, never growth. Holding one copy of a rank's share after the save is no
# leak: the reused stager keeps its buffers on purpose; plain ``async_save``
# leaves its last copy, or glibc keeps the memory (``gc.collect()`` tells).

MEMORY = results.record("memory", memory.summarize(memory_runs, heap))
results.record("memory_runs", memory_runs)
memory.table(MEMORY, SAVES)

# %%
# Where glibc's heap changed from save 6 to save 20, on that rank. Growth *in
# use* means something keeps each staged copy alive (a list of futures or
# responses: drop them, or reuse one ``DefaultStager``); *free kept*, that
# glibc keeps freed staging buffers: reuse one ``DefaultStager``, or start the
# job with ``MALLOC_MMAP_THRESHOLD_=1048576`` so that they go back when freed.

memory.heap_table({strategy: m["heap_change"] for strategy, m in MEMORY.items()})

# %%
# RSS above the start after each save, on the rank that is highest there:

figures.save_with_results(memory.rss_figure(memory_runs, machine.title(WORK_DIR)))

# %%
# The advice for this machine
# ---------------------------
# The best save and load against their limits, and the largest growth of host
# memory. One writer thread serializes each tensor, then writes it: at most
# 1 / (1 / serialize + 1 / write) GB/s; more threads help only where cores are
# free. ``FileSystemReader`` reads with one thread per rank.

BEST_SAVE = max(set(KNOBS) - {NO_FSYNC}, key=lambda name: stats.median(KNOBS[name]["save_GBps"]))
BEST_LOAD = max(KNOBS, key=lambda name: stats.median(KNOBS[name]["cold_load_GBps"]))
GREW_MOST = memory.grew_most(MEMORY)
MACHINE = results.record(
    "machine",
    machine.describe(WORK_DIR) | dict(repeats=REPEATS, shapes=[(WIDTH, DEPTH), SECTION_SHAPE]),
)
HEADLINE = results.record(
    "headline",
    {
        "best_save_GBps": stats.median(KNOBS[BEST_SAVE]["save_GBps"]),
        "best_save_of_limit": stats.median(KNOBS[BEST_SAVE]["save_GBps"])
        / LIMITS["limit"]["write_fsync"],
        "best_load_GBps": stats.median(KNOBS[BEST_LOAD]["cold_load_GBps"]),
        "best_load_of_limit": stats.median(KNOBS[BEST_LOAD]["cold_load_GBps"])
        / LIMITS["limit"]["read_storage"],
        "rss_growth_MB_per_save": MEMORY[GREW_MOST]["per_save"] / 1e6,
        "rss_growth_of_share": MEMORY[GREW_MOST]["per_save"] / MEMORY[GREW_MOST]["share"],
    },
)
figures.Table(
    ["", "with", "measured", ""],
    [
        ["best save", BEST_SAVE, f"{HEADLINE['best_save_GBps']:.2f} GB/s"]
        + [f"{HEADLINE['best_save_of_limit']:.2f} of write + fsync"],
        ["best cold load", f"checkpoint of {BEST_LOAD}", f"{HEADLINE['best_load_GBps']:.2f} GB/s"]
        + [f"{HEADLINE['best_load_of_limit']:.2f} of read from storage"],
        ["one writer thread", "serializes, then writes"]
        + [f"at most {disk.one_thread(LIMITS, 'torch_save', 'write_fsync'):.2f} GB/s", ""],
        ["one reader thread", "reads, then deserializes"]
        + [f"at most {disk.one_thread(LIMITS, 'torch_load', 'read_storage'):.2f} GB/s", ""],
        ["most RSS growth", GREW_MOST, f"{HEADLINE['rss_growth_MB_per_save']:+.2f} MB/save"]
        + [f"{HEADLINE['rss_growth_of_share']:+.2%} of a share: {MEMORY[GREW_MOST]['verdict']}"],
    ],
    caption=f"{SIZE_MB:g} MB on {MACHINE['cores']} cores, torch {torch.__version__}",
)

# %%
# Each knob against the defaults: a knob bought something only where the
# difference is larger than the spread (max - min) of either row's repeats.

ADVICE = results.record(
    "advice",
    [
        [name, *stats.verdict_cells(KNOBS["defaults"]["save_GBps"], knob["save_GBps"], "GB/s")]
        for name, knob in list(KNOBS.items())[1:]
    ]
    + [
        ["planning, with plan caching"]
        + stats.verdict_cells(
            *(KNOBS[n]["save_planning_s"] for n in ("defaults", "enable_plan_caching=True")),
            "ms",
            scale=1e3,
            words=("longer", "shorter"),
        ),
        ["dedup_save_to_lowest_rank=True"]
        + stats.verdict_cells(
            *(REPLICATED["timed"][b]["save_GBps"] for b in (False, True)), "GB/s"
        ),
    ],
)
figures.Table(["save GB/s, against the defaults", "verdict", "difference"], ADVICE)

# %%
# The same, as a script for ``torchrun``
# --------------------------------------
# ``torchrun`` starts the ranks and ``main()`` does what ``run_on_ranks`` did
# (set the device, create the group, run the knobs' loop, destroy the group);
# the root is a path every rank sees (a shared file system on several
# machines). Save it as ``speed.py`` with the functions above, and:
#
# .. code-block:: bash
#
#    torchrun --nproc-per-node=2 speed.py
#
# The cell runs ``main()`` as ``torchrun`` would (torchrun's environment, no
# group yet), with the defaults' warm-up round only: give yours some repeats.


def main(checkpoint_root, repeats, knobs=SAVE_OPTIONS):
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo")
    try:
        save_and_load_every_way(checkpoint_root, repeats, knobs)
        dist.barrier()  # no rank tears gloo down while another one still sends
    finally:
        dist.destroy_process_group()


run_as_torchrun(main, os.path.join(WORK_DIR, "torchrun"), 0, {"defaults": {}})

# %%
# Clean up
# --------

shutil.rmtree(WORK_DIR, ignore_errors=True)
print(f"removed {WORK_DIR}: {not os.path.exists(WORK_DIR)}")

# %%
# What to read next
# -----------------
# * :ref:`sphx_glr_recipes_checkpoint_stall_benchmark.py`: what each strategy costs a loop.
# * :doc:`/troubleshooting`: symptoms and fixes, host memory that grows too.
