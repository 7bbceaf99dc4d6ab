"""
When an asynchronous checkpoint is torn
=======================================

A checkpoint is *torn* when its save cannot finish: the ranks' data files are
there, but not ``.metadata``, which rank 0 writes last, after the upload's
final collectives. This recipe makes each way it happens happen at a known
moment, shows what ``dcp.load`` and a resume make of the result, and where the
``.metadata`` check that resume logic relies on is fooled. (The default group
destroyed *before* the upload starts tears nothing and raises nothing: it
leaves a ``.metadata`` over one rank's data,
:ref:`sphx_glr_recipes_verify_checkpoint_recipe.py`.)

.. grid:: 2

    .. grid-item-card:: :octicon:`mortar-board;1em;` What you will learn
       :class-card: card-prerequisites

       * Why a normal exit does not tear a checkpoint, and what does
       * What destroying the process group during an upload leaves behind,
         and what ``dcp.load`` raises on it (a ``BaseException``)
       * Why a reused directory passes the ``.metadata`` check while it is
         written and after a tear, and what ``use_collectives=False`` writes
       * Resume from the newest complete checkpoint, skipping the torn one,
         and end a job so that its last save completes

    .. grid-item-card:: :octicon:`list-unordered;1em;` Prerequisites
       :class-card: card-prerequisites

       * PyTorch: see :doc:`/versions`
       * CPU (gloo) or one GPU per rank (NCCL, plus gloo for checkpointing)
       * :ref:`sphx_glr_recipes_async_save_recipe.py`: a training loop with
         ``async_save`` and resuming from the newest complete checkpoint
"""

# %%
# Setup
# -----

import datetime
import logging
import os
import re
import shutil
import subprocess
import sys
import textwrap
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from page_tools import faults, proofs, results
from rank_launcher import run_as_torchrun, run_on_one_process, run_on_ranks, shared_tempdir
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.fsdp import fully_shard

WORK_DIR = shared_tempdir("dcp-torn-")
print(f"torch {torch.__version__}; checkpoints go under {WORK_DIR}")


# %%
# The model, the application state, and resuming
# -----------------------------------------------
# The same definitions as on every page of this site (smaller here), and the
# async_save recipe's resume logic: a directory without ``.metadata`` is a
# save that did not finish, and ``latest_complete_checkpoint`` skips it.

WIDTH, DEPTH, BATCH, LR = 256, 2, 8, 1e-3


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


def train_step(model, optimizer):
    optimizer.zero_grad()
    loss = model(torch.rand(BATCH, WIDTH, device=device_for_this_rank())).pow(2).mean()
    loss.backward()
    optimizer.step()
    return loss.item()


class IncompleteCheckpointError(RuntimeError):
    pass


def is_complete(checkpoint_dir):
    return os.path.exists(os.path.join(checkpoint_dir, ".metadata"))


def latest_complete_checkpoint(checkpoint_root):
    """The ``step-N`` directory with the highest N that has ``.metadata``, or None."""
    matches = (re.fullmatch(r"step-(\d+)", name) for name in os.listdir(checkpoint_root))
    for step in sorted((int(match[1]) for match in matches if match), reverse=True):
        checkpoint_dir = os.path.join(checkpoint_root, f"step-{step}")
        if is_complete(checkpoint_dir):
            return checkpoint_dir
    return None


def load_checkpoint(checkpoint_dir, app_state):
    if checkpoint_dir is None or not is_complete(checkpoint_dir):
        raise IncompleteCheckpointError(f"incomplete checkpoint: {checkpoint_dir} has no .metadata")
    dcp.load({"app": app_state}, checkpoint_id=checkpoint_dir)


def say(text, root):
    """Print what a rank found, once, in lines that fit, with the work directory shortened."""
    if dist.get_rank() == 0:
        print(textwrap.fill(text.replace(root, "..."), 80, subsequent_indent="  "))


# %%
# A normal exit does not tear a checkpoint
# ----------------------------------------
# Python waits for the upload thread before the interpreter ends: a script
# that calls ``async_save`` and then returns, or calls ``sys.exit(0)``, still
# leaves a complete checkpoint. What tears one is a save that cannot finish:
# the process group destroyed before the upload completed, ``os._exit``, a
# kill or a crash. Here a script saves and exits at once, in a fresh
# interpreter (the page holds its writer until the exit has begun, so that
# the upload is certainly in flight then):

SAVE_AND_EXIT = """
import sys
import torch
import torch.distributed.checkpoint as dcp

state_dict = {"weights": torch.rand(1024, 1024)}
upload = dcp.async_save(state_dict, checkpoint_id=sys.argv[1], no_dist=True)
print("upload in flight at sys.exit(0):", not upload.done())
sys.exit(0)  # no upload.result()
"""


def save_and_exit(checkpoint_dir):
    script = [sys.executable, "-c", SAVE_AND_EXIT, checkpoint_dir]
    # It saves a CPU tensor: no GPU (a visible one gets a CUDA context from DCP's writer).
    cpu_only = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    exited = subprocess.run(
        script, capture_output=True, text=True, timeout=120, check=True, env=cpu_only
    )
    print(exited.stdout.strip())
    print(f"after the exit, {os.path.basename(checkpoint_dir)}/ is complete: ", end="")
    print(is_complete(checkpoint_dir))
    return exited.stdout.strip().endswith("True"), is_complete(checkpoint_dir)


# %%

with faults.writes_wait_for_exit():
    in_flight, complete = run_on_one_process(
        save_and_exit, os.path.join(WORK_DIR, "exit", "step-1")
    )
results.claim(
    "normal-exit-completes-the-upload",
    in_flight and complete,
    "the upload was in flight at the exit, and the checkpoint is complete",
)


# %%
# The group destroyed while the upload runs
# -----------------------------------------
# The mistake below is the one a loop makes when it ends without waiting for
# its last save: it destroys the checkpoint group while the upload still
# needs it for its collectives. The upload's future raises, and the directory
# has no ``.metadata``. What else happens is a race: the upload raises at once that
# the group is gone, or, if a peer's upload already waits in a collective on
# it, that collective waits for a peer that never comes, until the group's
# timeout (give a checkpoint group a short one: a hang becomes an error); and
# the data may or may not be written. The page holds each upload once its
# data is written, until the rank's next move, so that here the group goes
# away at that moment, every time.


def destroy_the_group_during_the_upload(root):
    model, optimizer = build_sharded_model(seed=0)
    torch.manual_seed(100 + dist.get_rank())  # each rank trains on its own data
    state_dict = {"app": AppState(model, optimizer)}
    # A collective whose peer has left fails after 20 s instead of hanging.
    checkpoint_group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=20))
    train_step(model, optimizer)
    step_1 = os.path.join(root, "step-1")
    dcp.async_save(state_dict, checkpoint_id=step_1, process_group=checkpoint_group).result()
    train_step(model, optimizer)
    step_2 = os.path.join(root, "step-2")
    upload = dcp.async_save(state_dict, checkpoint_id=step_2, process_group=checkpoint_group)
    dist.destroy_process_group(checkpoint_group)  # THE MISTAKE: step-2's upload still runs
    try:
        upload.result()
        error = "nothing"
    except Exception as err:
        error = re.sub(r" at 0x[0-9a-f]+", "", f"{type(err).__name__}: {err}")  # per rank
    files = sorted(os.listdir(step_2)) if os.path.isdir(step_2) else []
    say(f"the upload of step-2 raised {error}", root)
    say(f"step-2/ holds {files}; complete: {is_complete(step_2)}", root)
    return error, files


# %%
# The page keeps the state that step-1 was given, to compare a resume with:

with (
    faults.uploads_held_after_writing() as holds,
    proofs.state_given_to(dcp, "async_save", where=proofs.saving_into("step-1")) as step_1,
):
    torn = run_on_ranks(destroy_the_group_during_the_upload, os.path.join(WORK_DIR, "torn"))
results.claim(
    "destroyed-group-fails-the-upload",
    all(error.startswith("ValueError") and "not initialized" in error for error, _ in torn)
    and all(hold["released_by"] == "destroy_process_group" for hold in holds.last()),
    "the upload of step-2, held until the group was destroyed, raised on every rank",
    holds=holds.by_rank,
)
results.claim(
    "torn-checkpoint-has-no-metadata",
    all(files == [f"__{rank}_0.distcp" for rank in range(len(torn))] for _, files in torn),
    "step-2/ holds every rank's data file and no .metadata",
)


# %%
# ``dcp.load`` on a torn checkpoint
# ---------------------------------
# ``dcp.load`` on that directory raises ``CheckpointException``, wrapping the
# missing-metadata error of each rank. It derives from ``BaseException``, not
# ``Exception`` (like ``KeyboardInterrupt``): ``except Exception`` does not
# catch a failed ``dcp.load`` or ``dcp.save``. Catch it by name:

print(f"CheckpointException is an Exception: {issubclass(CheckpointException, Exception)}")


def load_the_torn_checkpoint(root):
    model, optimizer = build_sharded_model(seed=1)
    app_state = AppState(model, optimizer)
    torn_dir = os.path.join(root, "step-2")
    logging.disable(logging.WARNING)  # dcp.load logs each missing file with a traceback
    try:
        try:
            dcp.load({"app": app_state}, checkpoint_id=torn_dir)
            outcome = "loaded"
        except Exception:
            outcome = "caught by `except Exception`"
    except CheckpointException as err:  # a BaseException: named, it is caught
        wrapped, _ = err.failures[dist.get_rank()]
        reasons = "; ".join(str(wrapped).split("; ")[:2])  # torch 2.13 says why each read failed
        outcome = f"CheckpointException wrapping {type(wrapped).__name__}: {reasons}"
    finally:
        logging.disable(logging.NOTSET)
    try:
        load_checkpoint(torn_dir, app_state)  # the resume logic's own check comes first
        refused = "loaded"
    except IncompleteCheckpointError as err:
        refused = f"{type(err).__name__}: {err}"
    say(f"dcp.load(step-2) raised {outcome}", root)
    say(f"load_checkpoint(step-2) raised {refused}", root)
    return outcome, refused


# %%

outcomes = run_on_ranks(load_the_torn_checkpoint, os.path.join(WORK_DIR, "torn"))

# %%

results.claim(
    "torn-load-raises-checkpoint-exception",
    not issubclass(CheckpointException, Exception)
    and all(o.startswith("CheckpointException wrapping") and "metadata" in o for o, _ in outcomes),
    "on every rank dcp.load raised CheckpointException, which `except Exception` let through",
    outcomes=outcomes,
)
results.claim(
    "load-checkpoint-refuses-the-torn-one",
    all(refused.startswith("IncompleteCheckpointError") for _, refused in outcomes),
    "load_checkpoint refused step-2 before DCP read anything",
)


# %%
# Two ways the ``.metadata`` check is fooled
# ------------------------------------------
# **A reused directory.** ``FileSystemWriter`` overwrites by default
# (``overwrite=True``) and replaces ``.metadata`` only at the very end: while
# a second save into the same directory is writing, and after it is torn, the
# old ``.metadata`` is still there and the directory looks complete, over new
# data. The only sign is torch's warning. Never reuse a checkpoint directory
# (give every save its step in the name), and pass ``overwrite=False`` to make
# a reused one an error.


def save_twice_into_one_directory(root):
    model, optimizer = build_sharded_model(seed=0)
    torch.manual_seed(100 + dist.get_rank())
    state_dict = {"app": AppState(model, optimizer)}
    checkpoint_group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=20))
    reused = os.path.join(root, "reused")
    dcp.async_save(state_dict, checkpoint_id=reused, process_group=checkpoint_group).result()
    train_step(model, optimizer)
    with warnings.catch_warnings(record=True) as warned:  # the upload's thread warns
        warnings.simplefilter("always")
        upload = dcp.async_save(state_dict, checkpoint_id=reused, process_group=checkpoint_group)
        while_writing = is_complete(reused)
        dist.destroy_process_group(checkpoint_group)  # the same mistake as above
        try:
            upload.result()
            torn = False
        except Exception:
            torn = True
    warning = next((str(w.message).split(" since")[0] for w in warned), "none")
    say(f"the second save warned: {warning}", root)
    checks = f"while writing: {while_writing}; torn: {torn}; after the tear: {is_complete(reused)}"
    say(f"reused/ passes the .metadata check {checks}", root)
    return while_writing, torn, is_complete(reused), warning


# %%

with faults.uploads_held_after_writing() as holds:
    reused = run_on_ranks(save_twice_into_one_directory, os.path.join(WORK_DIR, "torn"))
results.claim(
    "reused-directory-passes-the-check-while-writing",
    all(while_writing and "existing checkpoint" in warning for while_writing, *_, warning in reused)
    and holds.last()[0]["released_by"] == "destroy_process_group",
    "the reused directory had .metadata while its second save was held in flight",
)
results.claim(
    "reused-directory-passes-the-check-after-the-tear",
    all(torn and after for _, torn, after, _ in reused),
    "after the tear it still has .metadata: the old index, over the new data",
)


# %%
# **A save without collectives.** ``use_collectives=False`` writes one
# ``__{rank}.metadata`` per rank and no ``.metadata``, so a check for
# ``.metadata`` rejects every such checkpoint (``dcp.load`` itself falls back
# to those files). Check for the files your save mode writes.


def save_without_collectives(root):
    model, optimizer = build_sharded_model(seed=0)
    checkpoint_dir = os.path.join(root, "no-collectives")
    state_dict = {"app": AppState(model, optimizer)}
    with warnings.catch_warnings():  # a rank may find another's files there first, and warn
        warnings.filterwarnings("ignore", "Detected an existing checkpoint")
        dcp.async_save(state_dict, checkpoint_id=checkpoint_dir, use_collectives=False).result()
    dist.barrier()  # every rank's files are there
    metadata = sorted(name for name in os.listdir(checkpoint_dir) if name.endswith(".metadata"))
    say(f"use_collectives=False wrote {metadata}; complete: {is_complete(checkpoint_dir)}", root)
    return metadata


# %%

written = run_on_ranks(save_without_collectives, os.path.join(WORK_DIR, "torn"))

# %%

results.claim(
    "no-collectives-writes-metadata-per-rank",
    written[0] == [f"__{rank}.metadata" for rank in range(len(written))],
    "one metadata file per rank, and none that the .metadata check knows",
)


# %%
# Resume skips the torn checkpoint
# --------------------------------
# ``latest_complete_checkpoint`` passes over ``step-2`` (no ``.metadata``)
# and the directories that are not ``step-N``, and loads ``step-1``:


def resume_after_the_tear(root):
    model, optimizer = build_sharded_model(seed=1)  # other weights: nothing matches by luck
    checkpoint_dir = latest_complete_checkpoint(root)
    load_checkpoint(checkpoint_dir, AppState(model, optimizer))
    say(f"resumed from {os.path.basename(checkpoint_dir)}", root)
    return os.path.basename(checkpoint_dir)


# %%
# The page compares what it loaded with the state that step-1 was given:

with proofs.state_after(dcp, "load") as resumed:
    run_on_ranks(resume_after_the_tear, os.path.join(WORK_DIR, "torn"))
proofs.same_state("resume-skips-the-torn-checkpoint", step_1, resumed, "resumed vs step-1's save")


# %%
# End a job so that its last save completes
# -----------------------------------------
# The fix, as a training script for ``torchrun``: ``main()`` sets the device,
# creates its groups, resumes from the newest complete checkpoint if there is
# one, trains with one save in flight, and, however the loop ends, waits for
# the last save and meets the other ranks at a barrier before it destroys the
# groups. In your own job ``torchrun`` replaces ``run_as_torchrun``, and the
# checkpoint root is a path every rank sees (a shared file system across
# machines; ``shared_tempdir`` here):
#
# .. code-block:: bash
#
#    torchrun --nproc-per-node=2 train.py
#
# Below, the job's directory starts with a copy of ``step-1``, as if an
# earlier run of the job had saved it.


def main(checkpoint_root, steps=3):
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo")
    checkpoint_group = dist.new_group(backend="gloo")
    model, optimizer = build_sharded_model(seed=0)
    torch.manual_seed(100 + dist.get_rank())
    state_dict = {"app": AppState(model, optimizer)}
    newest = latest_complete_checkpoint(checkpoint_root)
    start = 0 if newest is None else int(newest.rsplit("-", 1)[1])
    if newest is not None:
        load_checkpoint(newest, state_dict["app"])
    upload = None
    try:
        for step in range(start + 1, start + steps + 1):
            train_step(model, optimizer)
            if upload is not None:
                upload.result()  # at most one save in flight
            step_dir = os.path.join(checkpoint_root, f"step-{step}")
            upload = dcp.async_save(
                state_dict, checkpoint_id=step_dir, process_group=checkpoint_group
            )
    finally:
        if upload is not None:
            upload.result()  # the last save completes before its group goes away
        dist.barrier()  # and no rank leaves while another one still sends
        dist.destroy_process_group(checkpoint_group)
        dist.destroy_process_group()
    print(f"resumed from step-{start}, saved step-{start + 1} to step-{step}")


JOB_DIR = os.path.join(WORK_DIR, "job")
run_on_one_process(shutil.copytree, f"{WORK_DIR}/torn/step-1", f"{JOB_DIR}/step-1")
run_as_torchrun(main, JOB_DIR)

# %%

results.claim(
    "the-job-ends-with-its-last-save-complete",
    all(is_complete(os.path.join(JOB_DIR, f"step-{step}")) for step in (2, 3, 4)),
    "the job saved step-2 to step-4, each complete",
)


# %%
# Clean up
# --------

shutil.rmtree(WORK_DIR, ignore_errors=True)
print(f"removed {WORK_DIR}: {not os.path.exists(WORK_DIR)}")


# %%
# What to read next
# -----------------
# * :ref:`sphx_glr_recipes_resume_recipe.py`: a rank killed in the middle of
#   a save, and a restart that goes on bit for bit.
# * :ref:`sphx_glr_recipes_verify_checkpoint_recipe.py`: a checkpoint with
#   ``.metadata`` that holds one rank's data, and a verifier that refuses it.
# * :doc:`/troubleshooting`: symptoms and fixes for the usual DCP failures.
