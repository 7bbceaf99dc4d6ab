"""
Getting started: save and load with Distributed Checkpoint
==========================================================

Distributed Checkpoint (DCP) saves a model that is sharded across many ranks
without gathering it anywhere: every rank writes its own shards, in parallel,
into one checkpoint directory, and a small ``.metadata`` file records where
each piece of every tensor lives. Because of that index, a checkpoint saved on
N ranks loads on M ranks, or into a plain model in a single process.

.. grid:: 2

    .. grid-item-card:: :octicon:`mortar-board;1em;` What you will learn
       :class-card: card-prerequisites

       * Wrap model and optimizer in an application state that follows the
         ``Stateful`` protocol
       * Save an FSDP2-sharded model with ``dcp.save`` and load it back with
         ``dcp.load``, bit for bit
       * Load the same checkpoint into an unsharded model in one process
       * Convert between DCP and ``torch.save`` files, in code and on the
         command line
       * Run the same code as a training script under ``torchrun``

    .. grid-item-card:: :octicon:`list-unordered;1em;` Prerequisites
       :class-card: card-prerequisites

       * PyTorch: see :doc:`/versions`
       * CPU (gloo) or one GPU per rank (NCCL)
       * `FSDP2 <https://docs.pytorch.org/docs/stable/distributed.fsdp.fully_shard.html>`__
         basics
"""

# %%
# Setup
# -----
# All ranks must pass the *same* checkpoint directory to DCP: each rank writes
# its own file into it, and rank 0 writes the ``.metadata`` index. On several
# machines that means a shared file system. Here it is a temporary directory.

import logging
import os
import subprocess
import sys
import textwrap
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from page_tools import proofs, ranks, results
from rank_launcher import run_as_torchrun, run_on_one_process, run_on_ranks, shared_tempdir
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save, torch_save_to_dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.fsdp import fully_shard

WORK_DIR = shared_tempdir("dcp-getting-started-")
CHECKPOINT_DIR = os.path.join(WORK_DIR, "step-3")
print(f"torch {torch.__version__}; checkpoints go to {CHECKPOINT_DIR}")


# %%
# The model and the application state
# -----------------------------------
# DCP calls ``state_dict()`` on every value that follows the
# :class:`~torch.distributed.checkpoint.stateful.Stateful` protocol when it
# saves, and ``load_state_dict()`` when it loads. Putting model and optimizer
# behind one ``AppState`` means ``dcp.save`` and ``dcp.load`` take care of
# both, and you can add more state (a data loader position, a step counter)
# in one place.
#
# :func:`~torch.distributed.checkpoint.state_dict.get_state_dict` and
# :func:`~torch.distributed.checkpoint.state_dict.set_state_dict` turn a
# sharded model and its optimizer into state dicts keyed by parameter name
# (FQN) with sharded ``DTensor`` values, and back. That is what lets DCP
# reshard: the names and shapes do not depend on how many ranks there are.
#
# (Every page of this site uses these same few definitions; only the sizes change.)

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


print(ToyModel())


# %%
# Train a few steps, then save
# ----------------------------
# ``dcp.save`` is a collective: every rank calls it with the same checkpoint
# directory. Each rank writes only the shards it owns; there is no gather onto
# rank 0 and no full copy of the model anywhere.


def train_and_save(checkpoint_dir):
    model, optimizer = build_sharded_model(seed=0)
    device = device_for_this_rank()
    torch.manual_seed(100 + dist.get_rank())  # each rank trains on its own data
    for step in range(1, 4):
        optimizer.zero_grad()
        loss = model(torch.rand(BATCH, WIDTH, device=device)).pow(2).mean()
        loss.backward()
        optimizer.step()
        print(f"step {step}: loss {loss.item():.4f}")

    dcp.save({"app": AppState(model, optimizer)}, checkpoint_id=checkpoint_dir)
    weight = model.layers[0].weight
    print(f"saved layers.0.weight {tuple(weight.shape)}, of which this rank holds", end=" ")
    print(tuple(weight.to_local().shape))


# %%
# The page keeps a copy of what each rank gave ``dcp.save``, to compare every
# load below with:

with proofs.state_given_to(dcp, "save") as saved:
    run_on_ranks(train_and_save, CHECKPOINT_DIR)


# %%
# What DCP wrote
# --------------
# One ``.distcp`` file per rank holds that rank's shards; ``.metadata`` maps
# every tensor's pieces to files and offsets. A checkpoint without
# ``.metadata`` is incomplete: DCP writes it last, after every rank's data.


def describe_checkpoint(checkpoint_dir):
    for name in sorted(os.listdir(checkpoint_dir)):
        size = os.path.getsize(os.path.join(checkpoint_dir, name))
        print(f"{name:<16} {size:>8,} bytes")


describe_checkpoint(CHECKPOINT_DIR)


# %%
# Load into a freshly built model
# -------------------------------
# To resume, build the model and optimizer exactly as for training (a
# different seed here, so nothing matches by accident), wrap them in the same
# ``AppState`` and call ``dcp.load``. DCP loads *in place*: it reads into the
# tensors the state dict already has, each rank only its own shards, then
# ``load_state_dict`` hands them to model and optimizer.


def load_checkpoint(checkpoint_dir):
    model, optimizer = build_sharded_model(seed=1)
    dcp.load({"app": AppState(model, optimizer)}, checkpoint_id=checkpoint_dir)
    first_row = [round(x, 4) for x in model.layers[0].weight.full_tensor()[0, :3].tolist()]
    print(f"loaded {os.path.basename(checkpoint_dir)}: layers.0.weight[0, :3] = {first_row}")


# %%

with proofs.state_after(dcp, "load") as loaded:
    run_on_ranks(load_checkpoint, CHECKPOINT_DIR)
proofs.same_state("sharded-load", saved, loaded, "loaded on every rank vs saved")


# %%
# Reshard: load into a plain model in one process
# -----------------------------------------------
# The checkpoint knows only parameter names and global shapes, so any number
# of ranks can load it, including one process with an ordinary, unsharded
# model, for evaluation or export. ``no_dist=True`` tells DCP not to use a
# process group (it is the default when none is initialised).


def load_unsharded(checkpoint_dir):
    model = ToyModel()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    with warnings.catch_warnings():
        # DCP warns that it assumes a single process even when no_dist=True says so.
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        dcp.load({"app": AppState(model, optimizer)}, checkpoint_id=checkpoint_dir, no_dist=True)
    print(f"unsharded model: layers.0.weight {tuple(model.layers[0].weight.shape)}")


# %%

with proofs.state_after(dcp, "load") as unsharded:
    run_on_one_process(load_unsharded, CHECKPOINT_DIR)
proofs.same_state("unsharded-load", saved, unsharded, "loaded in one process vs saved")


# %%
# Convert to a single ``torch.save`` file
# ---------------------------------------
# For tools that expect one file, ``dcp_to_torch_save`` reads the whole
# checkpoint in one process and writes it with ``torch.save``. The nesting of
# the state dict is kept: ``app`` / ``model`` / ``layers.0.weight``. Load it with
# ``weights_only=True``: it contains only tensors and plain containers.

TORCH_SAVE_PATH = os.path.join(WORK_DIR, "checkpoint.pt")


def convert_to_torch_save(checkpoint_dir, torch_save_path):
    dcp_to_torch_save(checkpoint_dir, torch_save_path)
    converted = torch.load(torch_save_path, weights_only=True)
    size = os.path.getsize(torch_save_path)
    print(f"{os.path.basename(torch_save_path)}: {size:,} bytes, keys {list(converted['app'])}")


# %%

with proofs.value_returned_by(torch, "load", where=proofs.reads_file(".pt")) as converted:
    run_on_one_process(convert_to_torch_save, CHECKPOINT_DIR, TORCH_SAVE_PATH)
proofs.same_state("torch-save-file", saved, converted, "checkpoint.pt vs saved")


# %%
# The same conversion from the command line:
#
# .. code-block:: bash
#
#    python -m torch.distributed.checkpoint.format_utils dcp_to_torch CHECKPOINT_DIR OUT.pt
#
# The cell below runs exactly that command and reads its output file.

CLI_OUTPUT_PATH = os.path.join(WORK_DIR, "checkpoint-cli.pt")


def convert_on_command_line(checkpoint_dir, output_path):
    command = [sys.executable, "-m", "torch.distributed.checkpoint.format_utils"]
    subprocess.run(
        [*command, "dcp_to_torch", checkpoint_dir, output_path], check=True, capture_output=True
    )
    converted = torch.load(output_path, weights_only=True)
    print(f"$ python -m ...format_utils dcp_to_torch ... {os.path.basename(output_path)}")
    print(f"keys {list(converted['app'])}")


# %%

with proofs.value_returned_by(torch, "load", where=proofs.reads_file(".pt")) as from_cli:
    run_on_one_process(convert_on_command_line, CHECKPOINT_DIR, CLI_OUTPUT_PATH)
proofs.same_state("command-line-file", saved, from_cli, "checkpoint-cli.pt vs saved")


# %%
# ... and back: ``torch.save`` to DCP
# -----------------------------------
# ``torch_save_to_dcp`` goes the other way, for example to start sharded
# training from weights that were saved with ``torch.save``. The result is an
# ordinary DCP checkpoint that any number of ranks can load.

ROUND_TRIP_DIR = os.path.join(WORK_DIR, "from-torch-save")


def convert_back_to_dcp(torch_save_path, dcp_dir):
    torch_save_to_dcp(torch_save_path, dcp_dir)
    print(f"wrote {sorted(os.listdir(dcp_dir))}")


run_on_one_process(convert_back_to_dcp, TORCH_SAVE_PATH, ROUND_TRIP_DIR)


# %%
# Load the round-tripped checkpoint on all ranks into a fresh sharded model,
# as before:

with proofs.state_after(dcp, "load") as round_tripped:
    run_on_ranks(load_checkpoint, ROUND_TRIP_DIR)
proofs.same_state("round-trip-load", saved, round_tripped, "round trip vs saved")


# %%
# When ranks disagree on the directory
# ------------------------------------
# Every rank must pass the same ``checkpoint_id``. A path that each rank
# computes for itself (a ``tempfile.mkdtemp()``, a timestamp, the host name)
# breaks that, and nothing fails at save time: each rank writes its shards
# into its own directory, and only rank 0's gets a ``.metadata``. The errors
# come at load time, as a ``CheckpointException`` that lists each failing
# rank's error. It derives from ``BaseException``, so ``except Exception``
# does not catch it: catch it by name. Below, each rank saves into a
# directory of its own, then every rank loads rank 0's directory, then its own.
# The fix is one path for all ranks: derive it from what they agree on (the
# run name and step), or choose it on rank 0 and broadcast it
# (:doc:`/troubleshooting` has the code).


def save_and_load_where_ranks_disagree(work_dir):
    rank = dist.get_rank()
    model, optimizer = build_sharded_model(seed=0)
    state_dict = {"app": AppState(model, optimizer)}
    own_dir = os.path.join(work_dir, f"rank{rank}-only")  # BUG: a path per rank
    dcp.save(state_dict, checkpoint_id=own_dir)
    print(f"saved into {os.path.basename(own_dir)}: {sorted(os.listdir(own_dir))}")
    logging.disable(logging.WARNING)  # DCP also logs each failed read, with a traceback
    outcomes = []
    for what, path in [("rank 0's", os.path.join(work_dir, "rank0-only")), ("its own", own_dir)]:
        try:
            dcp.load(state_dict, checkpoint_id=path)
            outcomes.append(f"every rank loads {what} directory: loaded")
        except CheckpointException as error:  # a BaseException: name it
            failed = [f"rank {r}: {type(e).__name__}: {e}" for r, (e, _) in error.failures.items()]
            outcomes.append(f"every rank loads {what} directory: CheckpointException")
            outcomes += sorted(failed)
    logging.disable(logging.NOTSET)
    if rank == 0:  # every rank sees the same outcome
        for line in outcomes:
            print(textwrap.fill(line.replace(work_dir, "..."), 78, subsequent_indent="    "))
    return outcomes


# %%
# One rank cannot disagree with itself: on a machine that would start one rank,
# the page starts two CPU ranks for this cell.

with ranks.at_least(2):
    outcomes = run_on_ranks(save_and_load_where_ranks_disagree, WORK_DIR)[0]
results.claim(
    "disagreeing-directories-fail-at-load",
    [line for line in outcomes if line.startswith("every rank")]
    == [
        f"every rank loads {what} directory: CheckpointException"
        for what in ("rank 0's", "its own")
    ],
    "both loads raised CheckpointException on every rank",
    outcomes=outcomes,
)


# %%
# The same, as a training script for ``torchrun``
# -----------------------------------------------
# In your own job ``torchrun`` starts the ranks, and ``main()`` does what
# ``run_on_ranks`` did above: set this rank's device, create the process
# group, run, and destroy the group. The checkpoint directory is a path that
# every rank sees (``shared_tempdir`` made one here; on several machines, a
# shared file system). Save it as ``train.py`` with the functions above, and:
#
# .. code-block:: bash
#
#    torchrun --nproc-per-node=2 train.py
#
# The cell runs ``main()`` the way ``torchrun`` would, on ranks that have
# torchrun's environment and no process group yet.


def main(checkpoint_dir):
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo")
    try:
        train_and_save(checkpoint_dir)
        load_checkpoint(checkpoint_dir)
        dist.barrier()  # no rank tears gloo down while another one still sends
    finally:
        dist.destroy_process_group()


run_as_torchrun(main, os.path.join(WORK_DIR, "torchrun", "step-3"))


# %%
# Clean up
# --------

import shutil

shutil.rmtree(WORK_DIR, ignore_errors=True)
print(f"removed {WORK_DIR}: {not os.path.exists(WORK_DIR)}")


# %%
# What to read next
# -----------------
# * :ref:`sphx_glr_recipes_async_save_recipe.py`: keep training while the
#   checkpoint is written.
# * :ref:`sphx_glr_recipes_default_stager_recipe.py`: overlap even the copy
#   to host memory with the next forward and backward pass.
# * :ref:`sphx_glr_recipes_checkpoint_stall_benchmark.py`: what each strategy
#   costs, measured.
# * :doc:`/troubleshooting`: symptoms and fixes for the usual DCP failures.
