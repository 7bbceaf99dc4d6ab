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

    .. grid-item-card:: :octicon:`list-unordered;1em;` Prerequisites
       :class-card: card-prerequisites

       * PyTorch 2.6 or later
       * CPU (gloo) or one GPU per rank (NCCL)
       * `FSDP2 <https://docs.pytorch.org/docs/stable/distributed.fsdp.fully_shard.html>`__
         basics

Every cell below runs when this page is built. Code that runs on every rank
is launched by a small helper, ``run_on_ranks``, which starts the ranks (or
uses the ones ``torchrun`` made) and prints what each rank printed, labelled
``[rankN]``. Everything inside the functions it runs is plain DCP code that
you can paste into a training script started with ``torchrun``.
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
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from rank_launcher import run_on_one_process, run_on_ranks, shared_tempdir, under_torchrun
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save, torch_save_to_dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)
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


class ToyModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.net1 = nn.Linear(16, 64)
        self.relu = nn.ReLU()
        self.net2 = nn.Linear(64, 8)

    def forward(self, x):
        return self.net2(self.relu(self.net1(x)))


class AppState(Stateful):
    """Model and optimizer as one checkpointable object."""

    def __init__(self, model, optimizer=None):
        self.model = model
        self.optimizer = optimizer

    def state_dict(self):
        # Handles FSDP's FQNs and fills in optimizer state keyed by FQN.
        model_state_dict, optimizer_state_dict = get_state_dict(self.model, self.optimizer)
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
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    return model, optimizer


def full_state(model, optimizer):
    """The whole state, unsharded, on CPU, on rank 0: what we compare against."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_state_dict, optimizer_state_dict = get_state_dict(model, optimizer, options=options)
    return {"model": model_state_dict, "optim": optimizer_state_dict}


print(ToyModel())


# %%
# Train a few steps, then save
# ----------------------------
# ``dcp.save`` is a collective: every rank calls it with the same checkpoint
# directory. Each rank writes only the shards it owns; there is no gather onto
# rank 0 and no full copy of the model anywhere.


def train_and_save(checkpoint_dir):
    rank = dist.get_rank()
    model, optimizer = build_sharded_model(seed=0)
    device = device_for_this_rank()
    torch.manual_seed(100 + rank)  # each rank trains on its own data
    for step in range(1, 4):
        optimizer.zero_grad()
        loss = model(torch.rand(32, 16, device=device)).pow(2).mean()
        loss.backward()
        optimizer.step()
        print(f"step {step}: loss {loss.item():.4f}")

    state_dict = {"app": AppState(model, optimizer)}
    dcp.save(state_dict, checkpoint_id=checkpoint_dir)

    local = model.net1.weight.to_local()
    print(
        f"saved net1.weight: global shape {tuple(model.net1.weight.shape)}, "
        f"this rank holds {tuple(local.shape)}"
    )
    # What the checkpoint must contain, for the checks below.
    return full_state(model, optimizer)


saved_state = run_on_ranks(train_and_save, CHECKPOINT_DIR)[0]


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


def count_mismatches(expected, actual, prefix=""):
    """(tensors compared, names that differ) over two nested state dicts."""
    compared, differ = 0, []
    assert expected.keys() == actual.keys(), f"{prefix}: keys differ"
    for key, value in expected.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            sub_compared, sub_differ = count_mismatches(value, actual[key], f"{name}.")
            compared, differ = compared + sub_compared, differ + sub_differ
        elif isinstance(value, torch.Tensor):
            compared += 1
            if not torch.equal(value, actual[key]):
                differ.append(name)
        elif value != actual[key]:
            differ.append(name)
    return compared, differ


def load_and_verify(checkpoint_dir, expected):
    model, optimizer = build_sharded_model(seed=1)
    state_dict = {"app": AppState(model, optimizer)}
    dcp.load(state_dict, checkpoint_id=checkpoint_dir)

    loaded = full_state(model, optimizer)  # collective: every rank calls it
    if dist.get_rank() == 0:
        compared, differ = count_mismatches(expected, loaded)
        print(f"compared {compared} tensors with what was saved: {len(differ)} differ")
        assert not differ, f"loaded state differs from saved state: {differ}"


run_on_ranks(load_and_verify, CHECKPOINT_DIR, saved_state)


# %%
# Reshard: load into a plain model in one process
# -----------------------------------------------
# The checkpoint knows only parameter names and global shapes, so any number
# of ranks can load it, including one process with an ordinary, unsharded
# model, for evaluation or export. ``no_dist=True`` tells DCP not to use a
# process group (it is the default when none is initialised).


def load_unsharded(checkpoint_dir, expected):
    model = ToyModel()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    state_dict = {"app": AppState(model, optimizer)}
    with warnings.catch_warnings():
        # DCP warns that it assumes a single process even when no_dist=True says so.
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        dcp.load(state_dict, checkpoint_id=checkpoint_dir, no_dist=True)

    loaded = AppState(model, optimizer).state_dict()
    compared, differ = count_mismatches(expected, loaded)
    print(
        f"unsharded model: net1.weight {tuple(model.net1.weight.shape)}, "
        f"compared {compared} tensors: {len(differ)} differ"
    )
    assert not differ, f"unsharded load differs from saved state: {differ}"


run_on_one_process(load_unsharded, CHECKPOINT_DIR, saved_state)


# %%
# Convert to a single ``torch.save`` file
# ---------------------------------------
# For tools that expect one file, ``dcp_to_torch_save`` reads the whole
# checkpoint in one process and writes it with ``torch.save``. The nesting of
# the state dict is kept: ``app`` / ``model`` / ``net1.weight``. Load it with
# ``weights_only=True``: it contains only tensors and plain containers.

TORCH_SAVE_PATH = os.path.join(WORK_DIR, "checkpoint.pt")


def convert_to_torch_save(checkpoint_dir, torch_save_path, expected):
    dcp_to_torch_save(checkpoint_dir, torch_save_path)
    converted = torch.load(torch_save_path, weights_only=True)
    compared, differ = count_mismatches(expected, converted["app"])
    size = os.path.getsize(torch_save_path)
    print(f"{os.path.basename(torch_save_path)}: {size:,} bytes, keys {list(converted['app'])}")
    print(f"compared {compared} tensors: {len(differ)} differ")
    assert not differ, differ


run_on_one_process(convert_to_torch_save, CHECKPOINT_DIR, TORCH_SAVE_PATH, saved_state)


# %%
# The same conversion from the command line:
#
# .. code-block:: bash
#
#    python -m torch.distributed.checkpoint.format_utils dcp_to_torch CHECKPOINT_DIR OUT.pt
#
# The cell below runs exactly that command and checks its output file.

CLI_OUTPUT_PATH = os.path.join(WORK_DIR, "checkpoint-cli.pt")


def convert_on_command_line(checkpoint_dir, output_path, expected):
    command = [sys.executable, "-m", "torch.distributed.checkpoint.format_utils"]
    command += ["dcp_to_torch", checkpoint_dir, output_path]
    subprocess.run(command, check=True, capture_output=True, text=True)
    converted = torch.load(output_path, weights_only=True)
    compared, differ = count_mismatches(expected, converted["app"])
    print(
        f"$ python -m torch.distributed.checkpoint.format_utils dcp_to_torch ... "
        f"{os.path.basename(output_path)}"
    )
    print(f"compared {compared} tensors: {len(differ)} differ")
    assert not differ, differ


run_on_one_process(convert_on_command_line, CHECKPOINT_DIR, CLI_OUTPUT_PATH, saved_state)


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
# with the same check as before:

run_on_ranks(load_and_verify, ROUND_TRIP_DIR, saved_state)


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
    rank0_dir = os.path.join(work_dir, "rank0-only")
    logging.disable(logging.WARNING)  # DCP also logs each failed read, with a traceback
    for what, path in [("rank 0's directory", rank0_dir), ("its own directory", own_dir)]:
        try:
            dcp.load(state_dict, checkpoint_id=path)
            outcome = ["loaded"]
        except CheckpointException as error:  # a BaseException: name it
            outcome = [type(error).__name__] + [
                f"  rank {failed}: {type(exc).__name__}: {exc}"
                for failed, (exc, _) in sorted(error.failures.items())
            ]
        if rank == 0:  # every rank sees the same outcome
            print(f"every rank loads {what}:", "\n".join(outcome).replace(work_dir, "..."))
    logging.disable(logging.NOTSET)


# sphinx_gallery_start_ignore
# One rank cannot disagree with itself: where this launch would have one rank (one GPU,
# or DCP_RECIPES_WORLD_SIZE=1), the page shows the failure on two CPU ranks instead.
world_size_env = "DCP_RECIPES_WORLD_SIZE"
launch_environment = {
    name: os.environ.get(name) for name in (world_size_env, "CUDA_VISIBLE_DEVICES")
}
ranks_here = int(os.environ.get(world_size_env) or torch.cuda.device_count() or 2)
if not under_torchrun() and ranks_here == 1:
    os.environ.update({world_size_env: "2", "CUDA_VISIBLE_DEVICES": ""})
# sphinx_gallery_end_ignore
run_on_ranks(save_and_load_where_ranks_disagree, WORK_DIR)
# sphinx_gallery_start_ignore
for name, value in launch_environment.items():
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value
# sphinx_gallery_end_ignore


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
