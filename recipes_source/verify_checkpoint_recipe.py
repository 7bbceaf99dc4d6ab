"""
A checkpoint that looks complete
================================

A directory with ``.metadata`` is a save that finished; it is not always a
checkpoint of every rank's data. This recipe destroys the default process
group after ``async_save`` returned but before its upload started: nothing
raises, ``.metadata`` is there, and ``dcp.load`` fills one rank's shards and
leaves the other's as they were. Then it builds ``verify_checkpoint``, which
checks what ``.metadata`` promises, and runs it on that checkpoint, on a torn
one, on one with a truncated file and one with a missing file.

.. grid:: 2

    .. grid-item-card:: :octicon:`mortar-board;1em;` What you will learn
       :class-card: card-prerequisites

       * Why a group destroyed before the upload starts makes every rank save
         as a single process, into the same files
       * What a dedicated checkpoint group raises instead
       * How to tell that a checkpoint is complete: ``.metadata``, chunks
         that tile every tensor, files with the bytes they are said to hold

    .. grid-item-card:: :octicon:`list-unordered;1em;` Prerequisites
       :class-card: card-prerequisites

       * PyTorch: see :doc:`/versions`
       * CPU (gloo) or one GPU per rank (NCCL, plus gloo for checkpointing)
       * :ref:`sphx_glr_recipes_torn_checkpoints_recipe.py`: what a save that
         cannot finish leaves behind
"""

# %%
# Setup
# -----

import datetime
import itertools
import logging
import math
import os
import re
import shutil
import textwrap
import warnings

import fsspec
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from page_tools import faults, observe, ranks, results
from rank_launcher import run_as_torchrun, run_on_one_process, run_on_ranks, shared_tempdir
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.fsdp import fully_shard

WORK_DIR = shared_tempdir("dcp-verify-")
print(f"torch {torch.__version__}; checkpoints go under {WORK_DIR}")


# %%
# The model, the application state, and the staging options
# ---------------------------------------------------------
# The same definitions as on every page of this site (smaller here), and the
# ``.metadata`` check of the torn-checkpoints recipe: a directory without it
# is a save that did not finish.

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


# %%
# The default group destroyed before the upload starts
# ----------------------------------------------------
# The same mistake a moment earlier is silent. ``dcp.save``, which the upload
# thread calls once staging is done, saves as a single process when
# ``dist.is_initialized()`` is false: destroy the *default* group after
# ``async_save`` returned but before its upload starts (here: while a
# ``DefaultStager`` still copies) and every rank writes its own data as
# ``__0_0.distcp``, with a ``.metadata`` of its own, into the same directory.
# The last rank to finish wins. Nothing raises, only a warning that the save
# "assumes" a single process. The page holds each copy until the rank's next
# wait, and lets the ranks write in rank order. One rank would save all of
# its data: where the launch would start one, the page starts two CPU ranks
# for this save, for its load and for the complete checkpoint below.


def save_after_the_group_is_gone(checkpoint_dir, dedicated_group):
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=20))
    rank = dist.get_rank()
    model, optimizer = build_sharded_model(seed=0)
    train_step(model, optimizer)
    group = dist.new_group(backend="gloo") if dedicated_group else None
    stager = DefaultStager(staging_options(use_async_staging=True))
    state_dict = {"app": AppState(model, optimizer)}
    with warnings.catch_warnings(record=True) as warned:  # the upload's thread warns
        warnings.simplefilter("always")
        response = dcp.async_save(
            state_dict, checkpoint_id=checkpoint_dir, process_group=group, async_stager=stager
        )
        dist.destroy_process_group(group)  # THE MISTAKE: the save has not started yet
        logging.disable(logging.WARNING)  # the staged DTensors' mesh warns, its group gone
        try:
            response.upload_completion.result()
            error = "nothing"
        except CheckpointException as err:  # without the page's holds the ranks can collide
            error = ", ".join(
                f"{type(e).__name__} on rank {r}" for r, (e, _) in err.failures.items()
            )
        except Exception as err:
            error = re.sub(
                r"<[\w.]+\.(\w+) object at 0x\w+>", r"<\1>", f"{type(err).__name__}: {err}"
            )
        finally:
            logging.disable(logging.NOTSET)
    stager.close()
    if dedicated_group:
        dist.destroy_process_group()
    warning = next(
        (str(w.message).split(", ")[-1] for w in warned if "assuming" in str(w.message)), ""
    )
    print(
        textwrap.fill(
            f"the upload raised {error}" + (f"; warned: {warning}" if warning else ""), 78
        )
    )
    return rank, error


SILENT_DIR = os.path.join(WORK_DIR, "silent", "step-1")

# %%

with (
    ranks.at_least(2),
    faults.staging_held_until(),
    faults.uploads_in_rank_order() as order,
    observe.watch(
        observe.page_module(), "save_after_the_group_is_gone", lambda call: call.result
    ) as silent,
):
    run_as_torchrun(save_after_the_group_is_gone, SILENT_DIR, False)

# %%
# The directory looks complete. Its ``.metadata`` describes the full global
# shape of each tensor, and the one chunk that the last rank saved:


def saved_chunks(checkpoint_dir, fqn="app.model.layers.0.weight"):
    if not is_complete(checkpoint_dir):  # without the page's holds the race can end otherwise
        files = sorted(os.listdir(checkpoint_dir)) if os.path.isdir(checkpoint_dir) else "none"
        print(f"files: {files}: no .metadata this time")
        return []
    metadata = FileSystemReader(checkpoint_dir).read_metadata()
    tensor = metadata.state_dict_metadata[fqn]
    print(f"files: {sorted(os.listdir(checkpoint_dir))}; complete: {is_complete(checkpoint_dir)}")
    print(f"{fqn}: global size {list(tensor.size)}, saved chunks:")
    for chunk in tensor.chunks:
        print(f"    at offset {list(chunk.offsets)}, size {list(chunk.sizes)}")
    return [list(chunk.offsets) for chunk in tensor.chunks]


silent_chunks = saved_chunks(SILENT_DIR)

# %%
# ``dcp.load`` on two ranks raises nothing: each rank reads the chunks that
# overlap its shard, and for the rank whose shard has none there is nothing
# to read. Its parameters keep the values they had before the load:


def load_and_count_unchanged(checkpoint_dir):
    model, optimizer = build_sharded_model(seed=1)  # other weights than the saved ones
    before = {name: param.to_local().clone() for name, param in model.named_parameters()}
    dcp.load({"app": AppState(model, optimizer)}, checkpoint_id=checkpoint_dir)
    unchanged = [n for n, p in model.named_parameters() if torch.equal(p.to_local(), before[n])]
    print(f"dcp.load raised nothing; {len(unchanged)} of {len(before)} shards unchanged")
    return len(unchanged), len(before)


# %%

with ranks.at_least(2):
    silent_loads = run_on_ranks(load_and_count_unchanged, SILENT_DIR) if silent_chunks else []

# %%

results.claim(
    "early-destroy-saves-one-rank-silently",
    [error for _, error in silent.by_rank[0]] == ["nothing"] * len(silent_loads)
    and sorted(r["rank"] for r in order.by_rank.get(0, [])) == list(range(len(silent_loads)))
    and is_complete(SILENT_DIR)
    and len(silent_chunks) == 1,
    f"both uploads raised nothing; .metadata exists and lists {len(silent_chunks)} chunk",
)
results.claim(
    "early-destroy-loads-without-an-error",
    sorted(unchanged == total for unchanged, total in silent_loads) == [False, True]
    and all(unchanged == 0 for unchanged, total in silent_loads if unchanged != total),
    "a 2-rank dcp.load raised nothing; one rank's shards all kept their values",
    loads=silent_loads,
)

# %%
# With a dedicated checkpoint group (``process_group=``), as on every page of
# this site, the same early destroy raises instead: the default group is
# still there, so ``save`` uses the destroyed group, and the first call that
# looks it up fails. Before the save (here) and mid-save (the torn-checkpoints
# recipe) it is ``... is not initialized in the world group map`` in torch
# 2.13 (``save`` looks the group up first for its log record); where the
# group is looked up first by ``dist.get_rank(group)`` it reads
# ``Group ... is not registered, please create group with ... new_group API``.

with (
    faults.staging_held_until(),
    observe.watch(
        observe.page_module(), "save_after_the_group_is_gone", lambda call: call.result
    ) as dedicated,
):
    run_as_torchrun(
        save_after_the_group_is_gone, os.path.join(WORK_DIR, "dedicated", "step-1"), True
    )
results.claim(
    "early-destroy-of-a-dedicated-group-raises",
    all(e.startswith("ValueError") and "not initialized" in e for _, e in dedicated.by_rank[0]),
    "with a dedicated checkpoint group, both uploads raised ValueError",
    errors=[error for _, error in dedicated.by_rank[0]],
)


# %%
# A checkpoint verifier
# ---------------------
# ``.metadata`` alone says that a save finished, not that it holds what the
# job needs. ``verify_checkpoint`` reads it and checks that every tensor's
# saved chunks tile its global shape (no gap, no overlap, nothing outside it)
# and that every file it names exists with the bytes it is said to hold. It
# raises on the silent checkpoint above, on a torn one, on a truncated or a
# missing file; the resume recipe uses it to pick its checkpoint. (A reused
# directory it cannot tell: its old index matches the new files' sizes.)


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


# %%
# On the silent checkpoint:


def verdict(checkpoint_dir):
    try:
        verify_checkpoint(checkpoint_dir)
        return "complete"
    except IncompleteCheckpointError as err:
        return str(err).replace(WORK_DIR, "...")


verdicts = {"silent": verdict(SILENT_DIR)}
print(textwrap.fill(f"silent: {verdicts['silent']}", 84, subsequent_indent="    "))

# %%

results.claim(
    "the-verifier-catches-the-silent-checkpoint",
    "cover 32,768 of its 65,536 elements" in verdicts["silent"],
    "verify_checkpoint refused the checkpoint of one rank's data",
    verdicts=verdicts,
)


# %%
# Truncated and missing files
# ---------------------------
# Two more ways a directory with ``.metadata`` is not a checkpoint: a data
# file cut short (a disk that filled up, a copy interrupted) and one that is
# gone. A complete checkpoint, saved here on two ranks, and three copies of it:


def save_a_complete_checkpoint(checkpoint_dir):
    model, optimizer = build_sharded_model(seed=0)
    train_step(model, optimizer)
    dcp.save({"app": AppState(model, optimizer)}, checkpoint_id=checkpoint_dir)
    if dist.get_rank() == 0:
        print("saved:", ", ".join(sorted(os.listdir(checkpoint_dir))))


def damaged_copies(checkpoint_dir):
    copies = {}
    for damage in ("truncated", "missing", "no-metadata"):
        copies[damage] = shutil.copytree(checkpoint_dir, f"{checkpoint_dir}-{damage}")
    data_file = os.path.join(copies["truncated"], "__1_0.distcp")
    os.truncate(data_file, os.path.getsize(data_file) // 2)
    os.remove(os.path.join(copies["missing"], "__0_0.distcp"))
    os.remove(os.path.join(copies["no-metadata"], ".metadata"))
    return copies


COMPLETE_DIR = os.path.join(WORK_DIR, "complete", "step-1")

# %%

with ranks.at_least(2):
    run_on_ranks(save_a_complete_checkpoint, COMPLETE_DIR)

# %%

checkpoints = {"complete": COMPLETE_DIR, **run_on_one_process(damaged_copies, COMPLETE_DIR)}

# %%

for name, checkpoint_dir in checkpoints.items():
    verdicts[name] = verdict(checkpoint_dir)
    print(textwrap.fill(f"{name}: {verdicts[name]}", 84, subsequent_indent="    "))

# %%

results.claim(
    "the-verifier-catches-damaged-files",
    verdicts["complete"] == "complete"
    and "__1_0.distcp, which has" in verdicts["truncated"]
    and "__0_0.distcp, which is missing" in verdicts["missing"]
    and "has no .metadata" in verdicts["no-metadata"],
    "it passed the complete checkpoint and refused the truncated, missing and torn copies",
    verdicts=verdicts,
)


# %%
# Clean up
# --------

shutil.rmtree(WORK_DIR, ignore_errors=True)
print(f"removed {WORK_DIR}: {not os.path.exists(WORK_DIR)}")


# %%
# What to read next
# -----------------
# * :ref:`sphx_glr_recipes_resume_recipe.py`: a resume that picks its
#   checkpoint with ``verify_checkpoint``, and falls back when one fails to load.
# * :doc:`/troubleshooting`: symptoms and fixes for the usual DCP failures.
