"""
Load part of a checkpoint, change the model
===========================================

A DCP checkpoint is an index (``.metadata``) and the data it points to, key by
key. ``dcp.load`` reads exactly the keys of the state dict you give it, into
the tensors you give it. That is all it takes to see what a checkpoint holds,
load only the model, start fine-tuning from a pretraining checkpoint, and
skip or rename keys. This page does each, on CPU ranks with gloo (or one GPU
per rank), and shows what torch 2.13 does when the input is wrong. The next
page, :ref:`sphx_glr_recipes_change_parallelism_recipe.py`, saves LoRA
adapters alone, changes the mesh and the dtype.

.. grid:: 2

    .. grid-item-card:: :octicon:`mortar-board;1em;` What you will learn
       :class-card: card-prerequisites

       * Read what a checkpoint holds from ``.metadata`` alone, in code and on
         the command line
       * Load the model without the optimizer, and without reading its bytes
       * Load shared weights into a changed model, with the missing and
         unexpected keys named and allowed explicitly
       * Skip keys by pattern, and load through renamed keys
       * What DCP says to a file that is not a checkpoint

    .. grid-item-card:: :octicon:`list-unordered;1em;` Prerequisites
       :class-card: card-prerequisites

       * PyTorch: see :doc:`/versions`
       * ``transformers`` 5 for the fine-tuning part
       * CPU (gloo) or one GPU per rank (NCCL)
       * :ref:`sphx_glr_recipes_save_load_recipe.py`
"""

# %%
# Setup
# -----
# Nothing is downloaded: the language model is built from a small config.

import os

os.environ["HF_HUB_OFFLINE"] = "1"  # a model name that is not a folder fails at once

import collections
import fnmatch
import logging
import subprocess
import sys
import textwrap

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
import transformers
from page_tools import proofs, reads, results
from rank_launcher import run_on_ranks, shared_tempdir
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel
from transformers import LlamaConfig, LlamaForCausalLM, LlamaForSequenceClassification

WORK_DIR = shared_tempdir("dcp-partial-load-")
CHECKPOINT_DIR = os.path.join(WORK_DIR, "step-3")
print(f"torch {torch.__version__}, transformers {transformers.__version__}")

# %%
# The model, the application state, and a checkpoint to work with
# -----------------------------------------------------------------
# The same pieces as on every page: a small model sharded with FSDP2, and
# ``AppState`` for model and optimizer. The checkpoint also holds a ``loop``
# entry (the step), as the resume pages' checkpoints do.

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


def train(model, optimizer, steps):
    torch.manual_seed(100 + dist.get_rank())  # each rank trains on its own data
    for _ in range(steps):
        optimizer.zero_grad()
        model(torch.rand(BATCH, WIDTH, device=device_for_this_rank())).pow(2).mean().backward()
        optimizer.step()


def train_and_save(checkpoint_dir):
    model, optimizer = build_sharded_model(seed=0)
    train(model, optimizer, steps=3)
    loop = {"step": torch.tensor(3)}
    dcp.save({"app": AppState(model, optimizer), "loop": loop}, checkpoint_id=checkpoint_dir)


# %%

with proofs.state_given_to(dcp, "save") as saved:
    run_on_ranks(train_and_save, CHECKPOINT_DIR)

# %%
# 1. What is in a checkpoint
# --------------------------
# ``FileSystemReader(path).read_metadata()`` reads ``.metadata`` and nothing
# else: every key with its global shape and dtype, the chunks each rank wrote
# (offset and size in the whole tensor), and where each chunk lies (file,
# offset, length). Below, each chunk is shown as its file and its offset:
# ``__1_0[32, 0]`` is rank 1's file, rows 32 on. Values that are not tensors
# (the optimizer's hyper-parameters) are pickled bytes. No process group is
# needed.


def describe_checkpoint(checkpoint_dir):
    metadata = FileSystemReader(checkpoint_dir).read_metadata()  # only .metadata is read
    where = {(i.fqn, tuple(i.offset or ())): info for i, info in metadata.storage_data.items()}
    in_file = collections.Counter(info.relative_path for info in where.values())
    for key, entry in metadata.state_dict_metadata.items():
        if not isinstance(entry, TensorStorageMetadata):
            continue
        shape = "x".join(map(str, entry.size)) or "()"
        chunks = [
            f"{where[key, tuple(c.offsets)].relative_path[:5]}{list(c.offsets)}"
            for c in entry.chunks
        ]
        dtype = str(entry.properties.dtype).removeprefix("torch.")
        print(f"{key:<42}{shape:>6} {dtype:<8} {' '.join(chunks)}")
    others = [k for k, e in metadata.state_dict_metadata.items() if not hasattr(e, "chunks")]
    print(f"and {len(others)} values stored as pickled bytes, such as {others[0]}")
    for name in sorted(os.listdir(checkpoint_dir)):
        size = os.path.getsize(os.path.join(checkpoint_dir, name))
        print(f"{name:<14}{size:>8,} bytes, {in_file[name]:>2} entries")
    return metadata


metadata = describe_checkpoint(CHECKPOINT_DIR)

# %%

saved_tensors = {k: v.shape for k, v in proofs.whole_state(saved).items() if torch.is_tensor(v)}
results.claim(
    "metadata-lists-every-saved-tensor",
    {k: e.size for k, e in metadata.state_dict_metadata.items() if hasattr(e, "chunks")}
    == saved_tensors,
    f".metadata lists all {len(saved_tensors)} tensors saved, with their global shapes",
    listed=sum(hasattr(e, "chunks") for e in metadata.state_dict_metadata.values()),
    saved=len(saved_tensors),
)

# %%
# The same from the command line. torch 2.13 ships one command-line tool for
# DCP, ``python -m torch.distributed.checkpoint.format_utils``, and it only
# converts (``dcp_to_torch``, ``torch_to_dcp``); nothing in
# ``torch.distributed.checkpoint`` prints ``.metadata``. Five lines do:

LIST_SCRIPT = """\
import sys
from torch.distributed.checkpoint import FileSystemReader

for key, entry in FileSystemReader(sys.argv[1]).read_metadata().state_dict_metadata.items():
    print(key, *([list(entry.size), entry.properties.dtype] if hasattr(entry, "size") else []))
"""


def list_on_command_line(checkpoint_dir, script_path):
    with open(script_path, "w") as script:
        script.write(LIST_SCRIPT)
    listing = subprocess.run(
        [sys.executable, script_path, checkpoint_dir], capture_output=True, text=True, check=True
    ).stdout.splitlines()
    print(f"$ python {os.path.basename(script_path)} step-3   # {len(listing)} lines, first 3:")
    print("\n".join(listing[:3]))
    return listing


listing = list_on_command_line(CHECKPOINT_DIR, os.path.join(WORK_DIR, "dcp_ls.py"))

# %%

results.claim(
    "command-line-lists-every-key",
    [line.split()[0] for line in listing] == list(metadata.state_dict_metadata),
    f"the script lists the {len(listing)} keys of .metadata, in its order",
    lines=len(listing),
)

# %%
# 2. Load only the model
# ----------------------
# ``dcp.load`` plans reads for the keys of the state dict it is given, and
# nothing else: give it the model's keys alone, nested as at the save
# (``app`` / ``model``), and the optimizer and ``loop`` stay on disk, unread.


def load_model_only(checkpoint_dir):
    model = ToyModel().to(device_for_this_rank())
    fully_shard(model)
    state_dict = {"app": {"model": get_model_state_dict(model)}}  # no "optim", no "loop"
    dcp.load(state_dict, checkpoint_id=checkpoint_dir)
    set_model_state_dict(model, state_dict["app"]["model"])
    print(f"loaded {len(state_dict['app']['model'])} model tensors, no optimizer")


# %%
# The page counts the bytes each rank's reader was asked to read:

with reads.file_reads(FileSystemReader) as model_reads, proofs.state_after(dcp, "load") as model:
    run_on_ranks(load_model_only, CHECKPOINT_DIR)

# %%

proofs.same_state("model-only-load", reads.part(saved, "app.model."), model, "model vs saved")
model_keys = list(reads.part(saved, "app.model."))
results.claim(
    "model-only-reads-no-optimizer-byte",
    reads.read_keys(model_reads) == sorted(model_keys)
    and reads.read_bytes(model_reads) == reads.stored_bytes(CHECKPOINT_DIR, model_keys),
    f"read {reads.read_bytes(model_reads):,} of the files' "
    f"{reads.stored_bytes(CHECKPOINT_DIR):,} bytes: the {len(model_keys)} model keys only",
    keys=reads.read_keys(model_reads),
    bytes=reads.read_bytes(model_reads),
)

# %%
# 3. Fine-tune from a pretraining checkpoint
# ------------------------------------------
# A language model (``transformers``' Llama, tiny) is "pretrained" and saved
# with its own keys. The fine-tuning model is a classifier with one more layer:
# ``LlamaForSequenceClassification`` has a new head (``score``) instead of
# ``lm_head``, and ``model.layers.2`` is new.

SIZES = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_attention_heads=2)
LLAMA = LlamaConfig(**SIZES, num_hidden_layers=2, num_key_value_heads=2)
CLASSIFIER = LlamaConfig(**SIZES, num_hidden_layers=3, num_key_value_heads=2, num_labels=3)
BASE_DIR = os.path.join(WORK_DIR, "pretrained")


def save_pretrained(checkpoint_dir, config):
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    dcp.save(get_model_state_dict(model), checkpoint_id=checkpoint_dir)
    print(f"{type(model).__name__}: {len(model.state_dict())} tensors saved")


# %%

with proofs.state_given_to(dcp, "save") as pretrained:
    run_on_ranks(save_pretrained, BASE_DIR, LLAMA)

# %%
# A plain ``dcp.load`` into the new model refuses: the first key the
# checkpoint lacks, and only that one, is in the error (a
# ``CheckpointException``: it derives from ``BaseException``, catch it by
# name). Nothing is read.


logging.disable(logging.WARNING)  # DCP also logs each failed rank, with a traceback


def error_of(attempt, *args):
    """The error ``attempt(*args)`` raises, as one line (printed on rank 0)."""
    try:
        attempt(*args)
    except (CheckpointException, ValueError) as error:
        if isinstance(error, CheckpointException):  # a cause per failed rank: the first
            _, (error, _) = min(error.failures.items())
        message = f"{type(error).__name__}: {error}"
        if dist.get_rank() == 0:
            print(textwrap.fill(message, 78, subsequent_indent="  ", break_on_hyphens=False))
        return message


def plain_load(checkpoint_dir, config):
    model = LlamaForSequenceClassification(config)
    dcp.load(get_model_state_dict(model), checkpoint_id=checkpoint_dir)


# %%

with reads.file_reads(FileSystemReader) as plain_reads:
    plain_error = run_on_ranks(error_of, plain_load, BASE_DIR, CLASSIFIER)[0]
results.claim(
    "missing-key-refused-before-reading",
    plain_error.startswith("RuntimeError: Missing key") and reads.read_bytes(plain_reads) == 0,
    "a plain load names one missing key and reads 0 bytes",
    error=plain_error,
)

# %%
# So name both lists from ``.metadata`` first, check them against what you
# mean to leave out (patterns), and only then load with
# ``DefaultLoadPlanner(allow_partial_load=True)``: it skips the keys the
# checkpoint lacks, which keep their initial values. Keys of the checkpoint
# the model lacks (``lm_head``) are never read: DCP ignores them silently,
# which is why the check is yours to make.


def missing_and_unexpected(state_dict, checkpoint_dir):
    saved = FileSystemReader(checkpoint_dir).read_metadata().state_dict_metadata
    return sorted(state_dict.keys() - saved.keys()), sorted(saved.keys() - state_dict.keys())


def not_matching(keys, patterns):
    return [key for key in keys if not any(fnmatch.fnmatch(key, p) for p in patterns)]


def load_pretrained(model, checkpoint_dir, new_keys, dropped_keys):
    state_dict = get_model_state_dict(model)
    missing, unexpected = missing_and_unexpected(state_dict, checkpoint_dir)
    if not_matching(missing, new_keys) or not_matching(unexpected, dropped_keys):
        raise ValueError(
            f"not allowed: missing {not_matching(missing, new_keys)}, "
            f"unexpected {not_matching(unexpected, dropped_keys)}"
        )
    planner = DefaultLoadPlanner(allow_partial_load=True)  # the missing keys, allowed above
    dcp.load(state_dict, checkpoint_id=checkpoint_dir, planner=planner)
    set_model_state_dict(model, state_dict)
    return missing, unexpected


def fine_tune_from(checkpoint_dir, config):
    model = LlamaForSequenceClassification(config)
    missing, unexpected = load_pretrained(
        model, checkpoint_dir, new_keys=["score.*", "model.layers.2.*"], dropped_keys=["lm_head.*"]
    )
    if dist.get_rank() == 0:
        print(textwrap.fill("missing, kept as initialised: " + ", ".join(missing), 78))
        print(f"unexpected, not read: {', '.join(unexpected)}")
    return missing, unexpected


# %%

with (
    proofs.state_given_to(dcp, "load") as before_fine_tune,
    proofs.state_after(dcp, "load") as fine_tuned,
):
    missing, unexpected = run_on_ranks(fine_tune_from, BASE_DIR, CLASSIFIER)[0]

# %%

base, tuned = proofs.whole_state(pretrained), proofs.whole_state(fine_tuned)
shared = sorted(base.keys() & tuned.keys())
proofs.same_state(
    "shared-weights-loaded",
    reads.part(base, *shared),
    reads.part(tuned, *shared),
    "the shared weights vs pretrained",
)
proofs.same_state(
    "new-keys-kept-their-init",
    reads.part(before_fine_tune, *missing),
    reads.part(fine_tuned, *missing),
    "new keys vs their init",
)
results.claim(
    "missing-and-unexpected-named",
    missing == sorted(tuned.keys() - base.keys())
    and unexpected == sorted(base.keys() - tuned.keys()),
    f"named: {len(missing)} missing, {len(unexpected)} unexpected; {len(shared)} shared loaded",
    missing=missing,
    unexpected=unexpected,
)

# %%
# A kept key whose shape changed (a larger vocabulary here) is a clear error,
# raised while DCP plans the reads, so again nothing is read:

BIG_VOCAB = LlamaConfig(**{**SIZES, "vocab_size": 256}, num_hidden_layers=3, num_labels=3)


# %%

with reads.file_reads(FileSystemReader) as shape_reads:
    shape_error = run_on_ranks(error_of, fine_tune_from, BASE_DIR, BIG_VOCAB)[0]
results.claim(
    "shape-mismatch-refused-before-reading",
    "Size mismatch" in shape_error
    and "embed_tokens" in shape_error
    and reads.read_bytes(shape_reads) == 0,
    "the changed shape is refused, naming the key and both shapes; 0 bytes read",
    error=shape_error,
)

# %%
# 4. Exclude keys, rename keys
# ----------------------------
# To re-initialise part of a model, leave its keys out of the state dict you
# load into (fnmatch patterns here, as torchtitan's ``exclude_from_loading``),
# and say so to ``set_model_state_dict`` with ``strict=False``: the keys it
# reports missing must be exactly the ones you left out. A pattern that
# matches no key is a typo, and an error.


def without(state_dict, patterns):
    for pattern in patterns:
        if not fnmatch.filter(state_dict, pattern):
            raise ValueError(f"exclude pattern {pattern!r} matches no key")
    return {k: v for k, v in state_dict.items() if not_matching([k], patterns)}


def load_except(checkpoint_dir, patterns):
    model = ToyModel().to(device_for_this_rank())
    fully_shard(model)
    kept = without(get_model_state_dict(model), patterns)
    dcp.load({"app": {"model": kept}}, checkpoint_id=checkpoint_dir)
    loaded = set_model_state_dict(model, kept, options=StateDictOptions(strict=False))
    if sorted(loaded.missing_keys) != sorted(set(get_model_state_dict(model)) - set(kept)):
        raise RuntimeError(f"unexpectedly missing: {loaded.missing_keys}")
    print(f"not loaded (strict=False): {', '.join(loaded.missing_keys)}")
    return loaded.missing_keys


# %%

with reads.file_reads(FileSystemReader) as except_reads:
    excluded = run_on_ranks(load_except, CHECKPOINT_DIR, ["layers.1.*"])[0]
results.claim(
    "excluded-keys-not-read",
    excluded == ["layers.1.weight", "layers.1.bias"]
    and reads.read_keys(except_reads) == ["app.model.layers.0.bias", "app.model.layers.0.weight"],
    "the excluded keys were reported missing by strict=False, and not read",
    read=reads.read_keys(except_reads),
)

# %%
# When the model's keys differ from the checkpoint's (a module renamed, a
# wrapper's prefix: DDP's ``module.``, ``torch.compile``'s ``_orig_mod.``),
# rename the keys of the state dict you pass in, not the tensors: DCP loads
# in place, into the same tensors, under the checkpoint's names. Two keys that
# map onto one name would load one tensor twice: an error, before any read.
# Below, a model whose ``layers`` are called ``blocks``, wrapped in
# ``DistributedDataParallel``, loads the ``ToyModel`` checkpoint.


class Blocks(nn.Module):
    def __init__(self, width=WIDTH, depth=DEPTH):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))


def renamed(state_dict, rename):
    out, came_from = {}, {}
    for key, value in state_dict.items():
        new_key = rename(key)
        if new_key in out:
            raise ValueError(f"{came_from[new_key]!r} and {key!r} both map to {new_key!r}")
        out[new_key], came_from[new_key] = value, key
    return out


def checkpoint_name(key):
    return "app.model." + key.removeprefix("module.").replace("blocks.", "layers.")


def load_renamed(checkpoint_dir):
    model = DistributedDataParallel(Blocks().to(device_for_this_rank()))
    state_dict = model.state_dict()  # module.blocks.0.weight, ...
    dcp.load(renamed(state_dict, checkpoint_name), checkpoint_id=checkpoint_dir)
    if dist.get_rank() == 0:
        print("\n".join(f"{key:<24} <- {checkpoint_name(key)}" for key in state_dict))
    return model.module.blocks[0].weight.detach().cpu()


# %%

with proofs.state_after(dcp, "load") as renamed_load:
    renamed_weight = run_on_ranks(load_renamed, CHECKPOINT_DIR)[0]
proofs.same_state(
    "renamed-keys-load", reads.part(saved, "app.model."), renamed_load, "renamed load vs saved"
)
results.claim(
    "renamed-load-fills-the-models-tensors",
    torch.equal(renamed_weight, proofs.whole_state(saved)["app.model.layers.0.weight"]),
    "the model's own blocks.0.weight holds the saved layers.0.weight",
)

# %%
# Bad input, refused before any tensor is read
# --------------------------------------------
# A file that is not a DCP checkpoint (a ``torch.save`` file), an exclude
# pattern with a typo, and a mapping that sends two keys onto one name. DCP
# itself answers the first: in torch 2.13 with a ``CheckpointException``
# whose cause is an ``AssertionError`` ("metadata is None"); the other two
# are this page's checks above.

TORCH_SAVE_FILE = os.path.join(WORK_DIR, "model.pt")
torch.save(ToyModel().state_dict(), TORCH_SAVE_FILE)


def try_bad_inputs(torch_save_file):
    state_dict = ToyModel().to(device_for_this_rank()).state_dict()
    return [
        error_of(lambda: dcp.load(state_dict, checkpoint_id=torch_save_file)),
        error_of(without, state_dict, ["layer.1.*"]),  # a typo: the keys are "layers..."
        error_of(renamed, state_dict, lambda key: key.replace("bias", "weight")),
    ]


# %%

with reads.file_reads(FileSystemReader) as bad_reads:
    errors = run_on_ranks(try_bad_inputs, TORCH_SAVE_FILE)[0]
results.claim(
    "bad-input-refused-before-reading",
    errors[0].startswith("AssertionError: metadata is None")
    and errors[1].startswith("ValueError: exclude pattern")
    and errors[2].startswith("ValueError: 'layers.0.weight' and 'layers.0.bias'")
    and reads.read_bytes(bad_reads) == 0,
    f"{len(errors)} bad inputs, {len(errors)} errors, 0 bytes read",
    errors=errors,
)

# %%
# Clean up
# --------

import shutil

logging.disable(logging.NOTSET)
shutil.rmtree(WORK_DIR, ignore_errors=True)
print(f"removed {WORK_DIR}: {not os.path.exists(WORK_DIR)}")

# %%
# What to read next
# -----------------
# * :ref:`sphx_glr_recipes_change_parallelism_recipe.py`: save only the LoRA
#   adapters, load a 2-D checkpoint on another mesh, change the dtype.
# * :ref:`sphx_glr_recipes_resume_recipe.py`: resume training exactly.
# * :doc:`/troubleshooting`: symptoms and fixes for the usual DCP failures.
