"""
Checkpoints across PyTorch versions
===================================

A checkpoint often outlives the torch that wrote it: a model trained on one
release is evaluated, fine-tuned or served on another. A DCP checkpoint is the
ranks' data files plus ``.metadata``, a pickle of DCP's own classes, and every
load starts by unpickling it. A release that adds a field to those classes
writes checkpoints that an older release cannot read. This page saves and loads
three kinds of checkpoint on the torch it was built with, shows what was
measured for every pair of seven releases (2.9.1 to 2.15.0), loads a checkpoint
that torch 2.15.0 saved, and shows the way through that works.

.. grid:: 2

    .. grid-item-card:: :octicon:`mortar-board;1em;` What you will learn
       :class-card: card-prerequisites

       * Which checkpoints load on which release, measured for every pair of
         seven: a model and optimizer, an FSDP2-sharded one on 2 ranks, and a
         Hugging Face safetensors export
       * The error an older torch raises on a newer torch's checkpoint, and
         where it comes from
       * The way through: ``dcp_to_torch_save`` with the newer torch,
         ``torch.load`` with the older
       * Which torch to save with

    .. grid-item-card:: :octicon:`list-unordered;1em;` Prerequisites
       :class-card: card-prerequisites

       * PyTorch: see :doc:`/versions`
       * ``safetensors``
       * CPU (gloo) or one GPU per rank (NCCL)
       * :ref:`sphx_glr_recipes_save_load_recipe.py`
"""

# %%
# Setup
# -----
# The three kinds below are the ones the version matrix measures
# (``make versions CROSS=1``), here on this page's torch alone.

import logging
import os
import shutil
import textwrap
import traceback
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from page_tools import proofs, versions_matrix
from rank_launcher import run_as_torchrun, run_on_one_process, run_on_ranks, shared_tempdir
from torch.distributed.checkpoint import (
    FileSystemReader,
    HuggingFaceStorageReader,
    HuggingFaceStorageWriter,
)
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.fsdp import fully_shard

# DCP warns that it assumes one process when there is no process group: here, on purpose.
warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
WORK_DIR = shared_tempdir("dcp-cross-version-")
print(f"torch {torch.__version__}; checkpoints go to {WORK_DIR}")

# %%
# The model and the application state
# -----------------------------------
# The same few definitions as on every page of this site.

WIDTH, DEPTH, BATCH, LR = 16, 2, 8, 1e-2


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


def train(model, optimizer, steps=2):
    device = next(model.parameters()).device
    for _ in range(steps):
        optimizer.zero_grad()
        model(torch.rand(BATCH, WIDTH, device=device)).pow(2).mean().backward()
        optimizer.step()


# %%
# Kind 1: a model and its optimizer, in one process
# -------------------------------------------------
# The plainest checkpoint: ``dcp.save`` of a model's and an optimizer's state
# in one process, loaded into a freshly built pair. ``no_dist=True`` says that
# no other rank takes part, even in a job that has a process group.


def save_and_load_in_one_process(checkpoint_dir):
    torch.manual_seed(0)
    model = ToyModel()
    optimizer = torch.optim.Adam(model.parameters(), lr=LR)
    train(model, optimizer)
    app_state = {"app": AppState(model, optimizer)}
    dcp.save(app_state, checkpoint_id=checkpoint_dir, no_dist=True)  # no process group
    torch.manual_seed(1)  # other values, the same structure
    fresh = ToyModel()
    fresh_optimizer = torch.optim.Adam(fresh.parameters(), lr=LR)
    dcp.load({"app": AppState(fresh, fresh_optimizer)}, checkpoint_id=checkpoint_dir, no_dist=True)
    print(f"one process: saved and loaded {sorted(os.listdir(checkpoint_dir))}")


# %%

with (
    proofs.state_given_to(dcp, "save") as plain_saved,
    proofs.state_after(dcp, "load") as plain_loaded,
):
    run_on_one_process(save_and_load_in_one_process, os.path.join(WORK_DIR, "plain"))
proofs.same_state("plain-loads-back", plain_saved, plain_loaded, "one process: loaded vs saved")

# %%
# Kind 2: sharded with FSDP2, on 2 ranks
# --------------------------------------
# Every parameter and optimizer state is a ``DTensor``; each rank writes its
# own shards, and ``.metadata`` records where each piece of every tensor lives.


def save_and_load_sharded(checkpoint_dir):
    model, optimizer = build_sharded_model(seed=0)
    torch.manual_seed(100 + dist.get_rank())  # each rank trains on its own data
    train(model, optimizer)
    dcp.save({"app": AppState(model, optimizer)}, checkpoint_id=checkpoint_dir)
    fresh, fresh_optimizer = build_sharded_model(seed=1)
    dcp.load({"app": AppState(fresh, fresh_optimizer)}, checkpoint_id=checkpoint_dir)
    shard = tuple(fresh.layers[0].weight.to_local().shape)
    print(f"{dist.get_world_size()} ranks: layers.0.weight loaded, this rank's shard {shard}")


# %%

with (
    proofs.state_given_to(dcp, "save") as sharded_saved,
    proofs.state_after(dcp, "load") as sharded_loaded,
):
    run_on_ranks(save_and_load_sharded, os.path.join(WORK_DIR, "sharded"))
proofs.same_state("sharded-loads-back", sharded_saved, sharded_loaded, "2 ranks: loaded vs saved")

# %%
# Kind 3: a Hugging Face safetensors export
# -----------------------------------------
# As :ref:`sphx_glr_recipes_hf_interop_recipe.py` exports a model and
# :ref:`sphx_glr_recipes_hf_import_recipe.py` reads one: the ranks write
# their pieces, rank 0 joins them into whole tensors
# (``enable_consolidation``), and the pieces are removed before publishing.


def export_and_import(export_dir):
    model, _ = build_sharded_model(seed=0)
    state_dict = get_model_state_dict(model)
    writer = HuggingFaceStorageWriter(
        export_dir,
        fqn_to_index_mapping={name: 1 for name in state_dict},  # one file
        save_distributed=True,
        enable_consolidation=True,
    )
    dcp.save(state_dict, storage_writer=writer)
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(os.path.join(export_dir, "sharded"))
        print(f"exported {sorted(os.listdir(export_dir))}")
    dist.barrier()
    fresh, _ = build_sharded_model(seed=1)
    fresh_state = get_model_state_dict(fresh)
    dcp.load(fresh_state, storage_reader=HuggingFaceStorageReader(export_dir))
    print(f"imported {len(fresh_state)} tensors into the sharded model")


# %%

with (
    proofs.state_given_to(dcp, "save") as exported,
    proofs.state_after(dcp, "load") as imported,
):
    run_on_ranks(export_and_import, os.path.join(WORK_DIR, "export"))
proofs.same_state("export-imports-back", exported, imported, "export: imported vs exported")
proofs.same_state(
    "export-files-hold-the-model",
    exported,
    proofs.safetensors_state(os.path.join(WORK_DIR, "export")),
    "the safetensors file vs the export",
)

# %%
# Measured: every pair of seven releases
# --------------------------------------
# ``make versions CROSS=1`` ran the same three kinds with each release's own
# venv (``tools/version_checks/cross_version.py``: a small model after one
# Adam step; the export, its initial weights), the 2-rank kinds on 2 gloo
# ranks: saved by the row's release, loaded by the column's, every tensor
# compared. The tables are this site's committed results
# (``_versions/results.json``), on CPU; "not measured" is a pair the matrix
# has not run yet. Where a load failed, the way through was measured too:
# for DCP checkpoints, ``dcp_to_torch_save`` by the release that saved it,
# then ``torch.load`` by the other; for the export, ``safetensors`` alone.

MATRIX = versions_matrix.committed()
versions_matrix.grid(MATRIX, "model")

# %%

versions_matrix.grid(MATRIX, "dtensor")

# %%
# The export has no pickled ``.metadata``: ``HuggingFaceStorageReader`` builds
# its metadata from the safetensors files' own headers, so every release
# reads every other's, older or newer.

versions_matrix.grid(MATRIX, "hf")

# %%

versions_matrix.every_pair_loads("export-loads-on-every-release", MATRIX, "hf")

# %%
# Each error's first line, where DCP raised it, and which pairs hit it:

versions_matrix.failures(MATRIX)

# %%

versions_matrix.newer_to_older_only("only-older-reads-newer-fails", MATRIX)

# %%
# What an older torch says
# ------------------------
# This site's repository keeps a checkpoint that torch 2.15.0 saved: kind 1,
# written by ``python3 tools/versions.py --fixture`` with the matrix's 2.15.0
# venv (under 100 KB), in ``recipes_source/cross_version_fixture/``. The page
# runs in ``recipes_source/``, where the path below finds it; a download run
# anywhere else does not have it, and says so in one line.
#
# Torch 2.15.0 pickles a sixth field into each tensor's ``TensorProperties``
# (``strides``); 2.12 to 2.14 unpack exactly five, and 2.9 to 2.11 only
# report that no metadata could be read (the errors above).

NEWER_CHECKPOINT = os.path.join("cross_version_fixture", "saved-by-torch-2.15.0")


def model_and_optimizer_of_the_fixture():
    # What tools/version_checks/cross_version.py saves: one Adam step of this model.
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    return model, torch.optim.Adam(model.parameters(), lr=0.1)


def load_newer_checkpoint(checkpoint_dir):
    if not os.path.isdir(checkpoint_dir):
        print(f"no {checkpoint_dir} here (it is in the site's repository): skipped")
        return None, None
    model, optimizer = model_and_optimizer_of_the_fixture()
    state_dict = {"model": model.state_dict(), "optim": optimizer.state_dict()}
    logging.disable(logging.WARNING)  # DCP also logs each failed metadata read
    try:
        dcp.load(state_dict, checkpoint_id=checkpoint_dir, no_dist=True)
        print(f"torch {torch.__version__} loaded {checkpoint_dir}")
        return "passed", None
    except CheckpointException as error:  # a BaseException: name it
        for rank, (failure, _) in error.failures.items():
            said = f"dcp.load raised CheckpointException; rank {rank}: {failure!r}"
            print(textwrap.fill(said, 78, subsequent_indent="    "))
        return "failed", failure
    finally:
        logging.disable(logging.NOTSET)


newer_status, load_error = run_on_one_process(load_newer_checkpoint, NEWER_CHECKPOINT)

# %%
# DCP wraps the cause, and on 2.9 to 2.11 drops it. Reading ``.metadata``
# alone shows it, and where it was raised:


def why_it_fails(checkpoint_dir):
    if not os.path.isdir(checkpoint_dir):
        return None
    try:
        FileSystemReader(checkpoint_dir).read_metadata()  # unpickles .metadata
    except Exception as cause:
        frame = traceback.extract_tb(cause.__traceback__)[-1]
        where = f"{frame.filename.split('site-packages/')[-1]}:{frame.lineno} in {frame.name}"
        print(f"read_metadata: {type(cause).__name__}: {cause}\n  raised at {where}")
        return cause
    print("read_metadata: read")


newer_cause = run_on_one_process(why_it_fails, NEWER_CHECKPOINT)

# %%
# The matrix measured the same pair with its own venv of this release:

versions_matrix.the_matrix_says(
    "newer-checkpoint-fails-here-as-measured",
    MATRIX,
    "model",
    "2.15.0",
    torch.__version__.split("+")[0],
    newer_status,
    [load_error, newer_cause],
)

# %%
# The way through: convert with the newer torch
# ---------------------------------------------
# The newer release reads its own checkpoint, and ``dcp_to_torch_save``
# writes it as one ``torch.save`` file of plain tensors and containers, which
# every release reads with ``torch.load``. With torch 2.15.0 (the fixture's
# ``.pt`` beside the checkpoint was made so, by the same tool):
#
# .. code-block:: bash
#
#    python -m torch.distributed.checkpoint.format_utils dcp_to_torch \
#        saved-by-torch-2.15.0 saved-by-torch-2.15.0.pt
#
# and with the older torch, into the model and optimizer:


def load_converted(path):
    if not os.path.exists(path):
        print(f"no {path} here (it is in the site's repository): skipped")
        return
    converted = torch.load(path, weights_only=True)
    model, optimizer = model_and_optimizer_of_the_fixture()
    model.load_state_dict(converted["model"])
    optimizer.load_state_dict(converted["optim"])
    steps = [int(s["step"]) for s in optimizer.state_dict()["state"].values()]
    print(f"torch {torch.__version__} loaded {os.path.basename(path)}: Adam steps {steps}")


# %%

with proofs.value_returned_by(torch, "load", where=proofs.reads_file(".pt")) as converted:
    run_on_one_process(load_converted, NEWER_CHECKPOINT + ".pt")
# One training step, in a process of its own (autograd starts a thread per GPU)
saved_by_newer = run_on_one_process(versions_matrix.saved_by_the_matrix_script)
proofs.same_state(
    "converted-file-holds-what-the-newer-saved",
    saved_by_newer,
    converted,
    "2.15.0's .pt here vs what it saved",
    tolerance=1e-6,  # recomputed here: another CPU rounds Adam's step in the last bits
)

# %%
# What to do
# ----------
# * **Save with the oldest torch that must read the checkpoint.** Every
#   release measured here reads what an older one saved, of all three kinds.
# * **Or convert with the newer one** for the older readers: one
#   ``dcp_to_torch_save`` file (the whole state in one process: fine for a
#   model to evaluate; for a model too big for one host, save with the older
#   torch instead). To train on with it sharded, ``torch_save_to_dcp`` turns
#   the file into a DCP checkpoint of the older torch again.
# * A Hugging Face export loads on every release, whichever wrote it (the
#   third table): for weights alone, it is the checkpoint to hand on.
#
# The same, as a training script for ``torchrun``
# -----------------------------------------------
# ``main()`` saves the sharded checkpoint, and rank 0 converts it for readers
# on an older torch. Save it as ``train.py`` with the functions above, and:
#
# .. code-block:: bash
#
#    torchrun --nproc-per-node=2 train.py


def main(checkpoint_dir):
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo")
    try:
        model, optimizer = build_sharded_model(seed=0)
        train(model, optimizer)
        dcp.save({"app": AppState(model, optimizer)}, checkpoint_id=checkpoint_dir)
        dist.barrier()  # every rank's shards and .metadata are written
        if dist.get_rank() == 0:
            dcp_to_torch_save(checkpoint_dir, checkpoint_dir + ".pt")
            print(f"for older torch: {os.path.basename(checkpoint_dir)}.pt")
        dist.barrier()  # no rank tears gloo down while another one still sends
    finally:
        dist.destroy_process_group()


# %%

with proofs.state_given_to(dcp, "save") as torchrun_saved:
    run_as_torchrun(main, os.path.join(WORK_DIR, "torchrun", "step-2"))
proofs.same_state(
    "torchrun-conversion-holds-the-save",
    torchrun_saved,
    torch.load(os.path.join(WORK_DIR, "torchrun", "step-2.pt"), weights_only=True),
    "the torchrun job's .pt vs its save",
)

# %%
# Clean up
# --------

shutil.rmtree(WORK_DIR, ignore_errors=True)
print(f"removed {WORK_DIR}: {not os.path.exists(WORK_DIR)}")

# %%
# What to read next
# -----------------
# * :doc:`/versions`: every recipe of this site on every release, and the
#   same checkpoint tables.
# * :ref:`sphx_glr_recipes_save_load_recipe.py`: ``dcp_to_torch_save`` and
#   ``torch_save_to_dcp`` in both directions, in code and on the command line.
# * :ref:`sphx_glr_recipes_change_parallelism_recipe.py`: load on another
#   number of ranks or another layout.
# * :ref:`newer-torch-checkpoint`: this error, on the troubleshooting page.
# * :doc:`/troubleshooting`: symptoms and fixes for the usual DCP failures.
