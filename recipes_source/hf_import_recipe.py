"""
Hugging Face checkpoints: import into sharded training
=======================================================

Fine-tuning often starts from a model published for Hugging Face
``transformers``: a folder of safetensors files. ``HuggingFaceStorageReader``
makes ``dcp.load`` read such a folder straight into an FSDP2-sharded model,
each rank reading only the slices of the tensors that make up its own shards,
so no rank ever holds the whole model. When a process must hold it (a tool
that takes a plain state dict), rank 0 gathers it, or reads it and hands each
rank its shards.

.. grid:: 2

    .. grid-item-card:: :octicon:`mortar-board;1em;` What you will learn
       :class-card: card-prerequisites

       * Start sharded training from a Hugging Face checkpoint, each rank
         reading only its shards
       * Gather a full state dict on rank 0, and load one that only rank 0
         read from disk, and what each costs in host memory
       * Fix the key mismatches that stop a load: a ``_orig_mod.`` or
         ``model.`` prefix, an extra parameter, tied embeddings
       * Run the same start as a training script under ``torchrun``

    .. grid-item-card:: :octicon:`list-unordered;1em;` Prerequisites
       :class-card: card-prerequisites

       * PyTorch: see :doc:`/versions`
       * ``transformers`` 5 and ``safetensors``
       * CPU (gloo) or one GPU per rank (NCCL)
       * :ref:`sphx_glr_recipes_hf_interop_recipe.py`

The model is a real ``transformers`` Llama, built from a small config with
random weights: nothing is downloaded.
"""

# %%
# Setup
# -----
# Nothing on this page comes from the Hugging Face Hub. With the hub set to
# offline mode before ``transformers`` is imported, a model name that is not a
# local folder fails at once instead of waiting on the network.

import os

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"  # no loading bars in the output

import json
import shutil

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
import transformers
from page_tools import figures, memory, observe, proofs, ranks, results, stats
from rank_launcher import run_as_torchrun, run_on_one_process, run_on_ranks, shared_tempdir
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint import HuggingFaceStorageReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)
from torch.distributed.fsdp import fully_shard
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig

WORK_DIR = shared_tempdir("dcp-hf-import-")
print(f"torch {torch.__version__}, transformers {transformers.__version__}")
print(f"files go to {WORK_DIR}")

# %%
# A tiny Llama, sharded with FSDP2
# --------------------------------
# The model of :ref:`sphx_glr_recipes_hf_interop_recipe.py`: ``from_config``
# builds the architecture with random weights, exactly as a real Llama is
# built, only smaller. Each decoder layer becomes its own FSDP2 unit, then
# the root takes the embeddings, the final norm and ``lm_head``.

CONFIG = LlamaConfig(
    vocab_size=2048,
    hidden_size=256,
    intermediate_size=2048,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)


def device_for_this_rank():
    # The launcher (or your own set-up code) has already picked this rank's GPU.
    if torch.accelerator.is_available():
        return torch.accelerator.current_accelerator()
    return torch.device("cpu")


def shard(model):
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    return model


def build_sharded_llama(seed, config=CONFIG):
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).to(device_for_this_rank())
    return shard(model)


print(f"Llama: {CONFIG.num_hidden_layers} layers, hidden size {CONFIG.hidden_size}")

# %%
# A Hugging Face checkpoint
# -------------------------
# A folder of safetensors files, as ``save_pretrained`` writes it or the hub
# serves it: here a plain process saves one, split into several files, with
# the ``model.safetensors.index.json`` that says which file holds which
# tensor.

HUB_DIR = os.path.join(WORK_DIR, "from-the-hub")


def list_files(folder):
    for root, _, files in sorted(os.walk(folder)):
        for name in sorted(files):
            path = os.path.join(root, name)
            print(f"{os.path.relpath(path, folder):<55} {os.path.getsize(path):>12,} bytes")


def save_pretrained_model(folder):
    torch.manual_seed(1234)
    AutoModelForCausalLM.from_config(CONFIG).save_pretrained(folder, max_shard_size="12MB")
    list_files(folder)


run_on_one_process(save_pretrained_model, HUB_DIR)

# %%
# Start sharded training from it
# ------------------------------
# Build the sharded model as for training (its random weights are about to be
# replaced), ask it for its state dict, and let ``dcp.load`` fill it from the
# folder with ``HuggingFaceStorageReader``. The reader finds every tensor from
# the files' headers; each rank then reads, through a memory map, only the
# slices of the tensors that make up its own shards.


def train(model, steps=3):
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    generator = torch.Generator().manual_seed(100 + dist.get_rank())  # each rank its own data
    for step in range(1, steps + 1):
        tokens = torch.randint(0, CONFIG.vocab_size, (4, 32), generator=generator)
        tokens = tokens.to(device_for_this_rank())
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        print(f"step {step}: loss {loss.item():.4f}")
    return loss.item()


def load_hf_checkpoint(model, folder):
    state_dict = get_model_state_dict(model)
    dcp.load(state_dict, storage_reader=HuggingFaceStorageReader(folder))
    set_model_state_dict(model, state_dict)


def start_from_hf(folder):
    model = build_sharded_llama(seed=1)
    load_hf_checkpoint(model, folder)
    train(model, steps=1)


# %%
# The page watches what each rank's load filled in, and how many bytes of
# tensor data each rank asked the reader for:

with (
    proofs.state_after(dcp, "load") as from_hub,
    proofs.tensor_bytes_read(HuggingFaceStorageReader) as read,
):
    run_on_ranks(start_from_hf, HUB_DIR)
hub_files = proofs.safetensors_state(HUB_DIR)
proofs.same_state("hub-checkpoint-loads-sharded", hub_files, from_hub, "the shards vs the files")
bytes_read = results.record("tensor-bytes-read", {r: sum(b) for r, b in read.by_rank.items()})
model_bytes = results.record("model-bytes", proofs.tensor_bytes(hub_files))
results.claim(
    "each-rank-reads-its-shards",
    sum(bytes_read.values()) == model_bytes
    and max(bytes_read.values()) < model_bytes / len(bytes_read) + 2**20,
    f"the ranks read {sum(bytes_read.values()):,} bytes of tensor data: the model once; "
    f"each at most {max(bytes_read.values()):,}",
    by_rank=bytes_read,
)

# %%
# Full state dicts: gather on rank 0
# ----------------------------------
# Sometimes one process must hold the whole model: a tool that takes a plain
# state dict, or a small model written as one ``model.safetensors``.
# ``full_state_dict=True`` all-gathers every parameter, ``cpu_offload=True``
# keeps the result on the CPU and on rank 0 only: the other ranks get an empty
# dict. That costs one full copy of the model in rank 0's host memory, which a
# sharded load or export never needs.

FULL_DIR = os.path.join(WORK_DIR, "full-state-dict")


def gather_and_save(source_folder, full_folder):
    model = build_sharded_llama(seed=1)
    load_hf_checkpoint(model, source_folder)
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    full_state_dict = get_model_state_dict(model, options=options)  # collective
    size = sum(t.numel() * t.element_size() for t in full_state_dict.values())
    print(f"holds {len(full_state_dict)} tensors, {size / 2**20:.1f} MiB on the CPU")
    if dist.get_rank() == 0:
        os.makedirs(full_folder, exist_ok=True)
        save_file(full_state_dict, os.path.join(full_folder, "model.safetensors"))
        model.config.save_pretrained(full_folder)
    return len(full_state_dict)


held = run_on_ranks(gather_and_save, HUB_DIR, FULL_DIR)
run_on_one_process(list_files, FULL_DIR)

# %%

results.claim(
    "full-state-dict-on-rank-0-only",
    held[0] == len(hub_files) and not any(held[1:]),
    f"tensors each rank held: {held}",
    by_rank=held,
)
full_file = proofs.safetensors_state(FULL_DIR)
proofs.same_state("full-state-dict-file-is-the-model", hub_files, full_file, "the file")

# %%
# Load a full state dict: every rank reads it, or rank 0 broadcasts it
# --------------------------------------------------------------------
# The usual first attempt lets every rank read the whole file, here with
# ``from_pretrained``, and shard afterwards: for a moment each rank holds the
# full model, and on a host with eight ranks that is eight copies.


def load_on_every_rank(folder):
    model = AutoModelForCausalLM.from_pretrained(folder).to(device_for_this_rank())
    return shard(model)


# %%
# With ``broadcast_from_rank0=True``, only rank 0 reads the file; the other
# ranks pass an empty dict. Rank 0 broadcasts each *full* tensor, one at a
# time, and every rank keeps its shard of it: the peak is one full tensor per
# rank, plus rank 0's whole dict. That only saves memory if those ranks never build the full model
# either: build it on the ``meta`` device (shapes, no storage) from the
# folder's ``config.json``, shard it, then allocate just the local shards
# with ``to_empty``. Buffers that are computed, not loaded (the rotary
# embedding's frequencies), are computed again.


def build_sharded_llama_without_weights(config):
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    shard(model)
    model.to_empty(device=device_for_this_rank())
    rotary = type(model.model.rotary_emb)(config)  # not in any checkpoint
    model.model.rotary_emb = rotary.to(device_for_this_rank())
    return model


def load_from_rank0(folder):
    model = build_sharded_llama_without_weights(AutoConfig.from_pretrained(folder))
    full_state_dict = {}
    if dist.get_rank() == 0:
        full_state_dict = load_file(os.path.join(folder, "model.safetensors"))
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_model_state_dict(model, full_state_dict, options=options)
    return model


def load_and_train(load, folder):
    model = load(folder)
    return train(model, steps=1)


# %%
# Each way runs in freshly started ranks. The page measures how far each
# rank's peak resident host memory (Linux's ``VmHWM``, with the file's mapped
# pages) grows while it loads: once unmeasured, so that one-time costs do not
# count, then three times. One rank has no rank to broadcast to: where the
# launch would start one, the page starts two CPU ranks for these cells.

with (
    ranks.at_least(2),
    memory.peak_growth(observe.page_module(), "load_on_every_rank") as every_rank_peaks,
    proofs.value_returned_by(observe.page_module(), "load_on_every_rank") as every_rank_loaded,
):
    every_rank_losses = run_on_ranks(load_and_train, load_on_every_rank, FULL_DIR)

# %%
# Rank 0 still reads the whole file, but every other rank now holds only its
# own shards and one tensor in flight:

with (
    ranks.at_least(2),
    memory.peak_growth(observe.page_module(), "load_from_rank0") as rank0_peaks,
    proofs.value_returned_by(observe.page_module(), "load_from_rank0") as rank0_loaded,
):
    rank0_losses = run_on_ranks(load_and_train, load_from_rank0, FULL_DIR)

# %%
# Both ways end with the file's model, bit for bit, and train alike; what
# differs is the memory the ranks other than 0 need on the way:

proofs.same_state("every-rank-load-is-the-model", hub_files, every_rank_loaded, "every rank")
proofs.same_state("rank0-broadcast-load-is-the-model", hub_files, rank0_loaded, "from rank 0")
results.claim(
    "both-loads-train-alike",
    every_rank_losses == rank0_losses,
    f"after one step, both ways: losses {[round(loss, 4) for loss in rank0_losses]}",
    every_rank=every_rank_losses,
    from_rank0=rank0_losses,
)
results.record(
    "peak-growth-mib",
    {"load_on_every_rank": every_rank_peaks.by_rank, "load_from_rank0": rank0_peaks.by_rank},
)
said, difference = stats.verdict(
    "load_from_rank0",
    memory.samples(rank0_peaks, lambda rank: rank > 0),
    "load_on_every_rank",
    memory.samples(every_rank_peaks, lambda rank: rank > 0),
    "MiB",
)
results.claim(
    "broadcast-needs-less-host-memory",
    not difference["within_noise"] and difference["effect"] > 0,
    figures.wrap(f"peak growth on the ranks other than 0: {said}"),
    **difference,
)

# %%

memory.growth_table(
    {"load_on_every_rank": every_rank_peaks, "load_from_rank0": rank0_peaks},
    caption=f"Peak host memory growth while loading. The model: {model_bytes / 2**20:.1f} "
    f"MiB; one rank's shards: about {model_bytes / 2**20 / len(rank0_losses):.1f} MiB",
)

# %%
# Keys that do not match
# ----------------------
# ``dcp.load`` fills the state dict you give it, key by key, from the
# checkpoint: every key must be in the checkpoint, under exactly that name.
# When a key is not, every rank raises
# :class:`~torch.distributed.checkpoint.api.CheckpointException`, whose text
# holds each rank's traceback; its last line says which key. Note that
# ``CheckpointException`` derives from ``BaseException``, not ``Exception``:
# ``except Exception`` does not catch it.


def print_failure(error):
    print(f"dcp.load raised {type(error).__name__}:")
    print(f"  {str(error).strip().splitlines()[-1]}")  # the last line names the key


print(f"CheckpointException is an Exception: {issubclass(CheckpointException, Exception)}")

# %%
# **A prefix from torch.compile.** ``torch.compile`` wraps the model, and the
# wrapper's ``state_dict()`` puts ``_orig_mod.`` in front of every name.
# ``get_model_state_dict`` removes it (and the prefixes of FSDP's and
# activation checkpointing's wrappers), and ``set_model_state_dict`` puts it
# back.


def load_into_compiled_model(folder):
    model = torch.compile(build_sharded_llama(seed=1))
    state_dict = model.state_dict()
    print(f"model.state_dict(): {next(iter(state_dict))!r}, ...")
    try:
        dcp.load(state_dict, storage_reader=HuggingFaceStorageReader(folder))
    except CheckpointException as error:
        print_failure(error)

    state_dict = get_model_state_dict(model)
    print(f"get_model_state_dict(model): {next(iter(state_dict))!r}, ...")
    dcp.load(state_dict, storage_reader=HuggingFaceStorageReader(folder))
    set_model_state_dict(model, state_dict)
    print(f"loaded {len(state_dict)} tensors")


# %%

with observe.raised_by(dcp, "load") as failed, proofs.state_after(dcp, "load") as loaded:
    run_on_ranks(load_into_compiled_model, HUB_DIR)
proofs.raised_on_every_rank(
    "compiled-prefix-fails",
    failed,
    ["Missing key in checkpoint state_dict: _orig_mod.lm_head.weight."],
    len(loaded.by_rank),
    "model.state_dict()",
)
results.claim(
    "checkpoint-exception-is-not-an-exception",
    not issubclass(CheckpointException, Exception),
    "CheckpointException derives from BaseException, not from Exception",
)
proofs.same_state("compiled-model-loads", hub_files, loaded, "get_model_state_dict vs the files")

# %%
# **A prefix from your own wrapper, and a key the checkpoint lacks.** A
# module that holds the Llama as ``self.model`` and adds a value head (as in
# RL fine-tuning) names its parameters ``model.model.layers...``, and
# ``value_head.weight`` is in no Hugging Face checkpoint. Rename to the
# checkpoint's names, load only the keys the checkpoint has (its index lists
# them), and rename back. ``set_model_state_dict`` with ``strict=False``
# reports what it did not load: the value head keeps its initial weights.


class WithValueHead(nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model
        self.value_head = nn.Linear(model.config.hidden_size, 1)


def load_into_wrapper(folder):
    torch.manual_seed(2)
    value_head_model = WithValueHead(AutoModelForCausalLM.from_config(CONFIG))
    value_head_model.to(device_for_this_rank())
    shard(value_head_model.model)
    fully_shard(value_head_model)
    state_dict = get_model_state_dict(value_head_model)
    renamed = {name.removeprefix("model."): value for name, value in state_dict.items()}
    for attempt in (state_dict, renamed):  # as it is, then renamed
        try:
            dcp.load(attempt, storage_reader=HuggingFaceStorageReader(folder))
        except CheckpointException as error:
            print_failure(error)

    with open(os.path.join(folder, "model.safetensors.index.json")) as index_file:
        in_checkpoint = set(json.load(index_file)["weight_map"])
    to_load = {name: value for name, value in renamed.items() if name in in_checkpoint}
    dcp.load(to_load, storage_reader=HuggingFaceStorageReader(folder))
    loaded = {f"model.{name}": value for name, value in to_load.items()}
    result = set_model_state_dict(value_head_model, loaded, options=StateDictOptions(strict=False))
    print(f"loaded {len(loaded)} tensors; not in the checkpoint: {result.missing_keys}")
    return result.missing_keys


# %%

with observe.raised_by(dcp, "load") as failed, proofs.state_after(dcp, "load") as loaded:
    not_loaded = run_on_ranks(load_into_wrapper, HUB_DIR)
proofs.raised_on_every_rank(
    "wrapper-keys-fail",
    failed,
    [
        "Missing key in checkpoint state_dict: model.lm_head.weight.",
        "Missing key in checkpoint state_dict: value_head.bias.",
    ],
    len(loaded.by_rank),
    "as it is, then renamed",
)
proofs.same_state("wrapper-loads-the-checkpoint-keys", hub_files, loaded, "renamed, filtered")
results.claim(
    "value-head-keeps-its-weights",
    all(keys == ["value_head.weight", "value_head.bias"] for keys in not_loaded),
    f"left as they were, on every rank: {not_loaded[0]}",
    not_loaded=not_loaded,
)

# %%
# **Tied embeddings.** Many small models reuse the input embedding as the
# output layer (``tie_word_embeddings=True``): ``lm_head.weight`` *is*
# ``model.embed_tokens.weight``. ``save_pretrained`` writes the tensor once,
# under the embedding's name, but the model's state dict still lists both, so
# ``dcp.load`` stops at ``lm_head.weight``. Leave that key out: loading the
# embedding fills both, because they are one parameter.

TIED_CONFIG = LlamaConfig(**{**CONFIG.to_dict(), "tie_word_embeddings": True})
TIED_DIR = os.path.join(WORK_DIR, "tied-embeddings")


def save_tied_model(folder):
    torch.manual_seed(3)
    AutoModelForCausalLM.from_config(TIED_CONFIG).save_pretrained(folder)
    names = list(load_file(os.path.join(folder, "model.safetensors")))
    print(
        f"save_pretrained wrote {len(names)} tensors; lm_head.weight: {'lm_head.weight' in names}"
    )
    return names


def load_tied_model(folder):
    model = build_sharded_llama(seed=1, config=TIED_CONFIG)
    state_dict = get_model_state_dict(model)
    try:
        dcp.load(state_dict, storage_reader=HuggingFaceStorageReader(folder))
    except CheckpointException as error:
        print_failure(error)

    if model.config.tie_word_embeddings:
        state_dict.pop("lm_head.weight")  # the same parameter as model.embed_tokens.weight
    dcp.load(state_dict, storage_reader=HuggingFaceStorageReader(folder))
    set_model_state_dict(model, state_dict, options=StateDictOptions(strict=False))
    tied = model.lm_head.weight is model.model.embed_tokens.weight
    print(f"loaded {len(state_dict)} tensors; lm_head still tied to the embedding: {tied}")
    return tied


tied_names = run_on_one_process(save_tied_model, TIED_DIR)

# %%

with observe.raised_by(dcp, "load") as failed, proofs.state_after(dcp, "load") as loaded:
    still_tied = run_on_ranks(load_tied_model, TIED_DIR)
results.claim(
    "save-pretrained-drops-lm-head",
    "lm_head.weight" not in tied_names and len(tied_names) == len(hub_files) - 1,
    f"save_pretrained wrote {len(tied_names)} tensors, without lm_head.weight",
    tensors=len(tied_names),
)
proofs.raised_on_every_rank(
    "tied-lm-head-fails",
    failed,
    ["Missing key in checkpoint state_dict: lm_head.weight."],
    len(loaded.by_rank),
    "with lm_head.weight",
)
tied_files = proofs.safetensors_state(TIED_DIR)
proofs.same_state("tied-model-loads", tied_files, loaded, "without lm_head.weight vs the file")
results.claim("lm-head-stays-tied", all(still_tied), f"tied: {still_tied}", tied=still_tied)

# %%
# The same, as a training script for ``torchrun``
# -----------------------------------------------
# In your own job ``torchrun`` starts the ranks, and ``main()`` does what
# ``run_on_ranks`` did above: set this rank's device, create the process
# group, load the checkpoint into the sharded model, train, and destroy the
# group. The folder is a path that every rank sees (here from
# ``shared_tempdir``; on several machines, a shared file system). Save it as
# ``finetune.py`` with the functions above, and:
#
# .. code-block:: bash
#
#    torchrun --nproc-per-node=2 finetune.py
#
# The cell runs ``main()`` the way ``torchrun`` would, on ranks that have
# torchrun's environment and no process group yet.


def main(hub_dir):
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo")
    try:
        model = build_sharded_llama(seed=1)
        load_hf_checkpoint(model, hub_dir)
        train(model)
        dist.barrier()  # no rank tears gloo down while another one still sends
    finally:
        dist.destroy_process_group()


# %%

with proofs.state_after(dcp, "load") as torchrun_loaded:
    run_as_torchrun(main, HUB_DIR)
proofs.same_state("torchrun-job-loads-the-checkpoint", hub_files, torchrun_loaded, "its shards")

# %%
# Clean up
# --------

shutil.rmtree(WORK_DIR, ignore_errors=True)
print(f"removed {WORK_DIR}: {not os.path.exists(WORK_DIR)}")

# %%
# What to read next
# -----------------
# * :ref:`sphx_glr_recipes_hf_interop_recipe.py`: export the trained model
#   back to a folder that ``from_pretrained`` opens.
# * :ref:`sphx_glr_recipes_resume_recipe.py`: once training runs, checkpoint
#   model, optimizer, data position and RNG, and resume from them.
# * :doc:`/troubleshooting`: symptoms and fixes for the usual DCP failures.
