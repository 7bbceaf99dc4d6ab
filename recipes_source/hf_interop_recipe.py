"""
Hugging Face checkpoints: export and import
===========================================

Training with FSDP2 and DCP usually ends with a model that someone serves or
publishes with Hugging Face ``transformers``, and often starts from one. DCP
reads and writes Hugging Face's format, safetensors, itself:
``HuggingFaceStorageWriter`` makes ``dcp.save`` write the
``model-0000k-of-0000n.safetensors`` files and the
``model.safetensors.index.json`` that ``from_pretrained`` opens, and
``HuggingFaceStorageReader`` makes ``dcp.load`` read such a folder into a
sharded model, each rank only its own shards. No rank ever holds the whole
model.

.. grid:: 2

    .. grid-item-card:: :octicon:`mortar-board;1em;` What you will learn
       :class-card: card-prerequisites

       * Export an FSDP2-sharded model to a folder that
         ``AutoModelForCausalLM.from_pretrained`` opens, in float32 or bfloat16
       * Start sharded training from a Hugging Face checkpoint, each rank
         reading only its shards
       * Gather a full state dict on rank 0, and load one that only rank 0
         read from disk
       * Fix the key mismatches that stop a load: a ``_orig_mod.`` or
         ``model.`` prefix, an extra parameter, tied embeddings

    .. grid-item-card:: :octicon:`list-unordered;1em;` Prerequisites
       :class-card: card-prerequisites

       * PyTorch 2.9 or later (the Hugging Face reader and writer first
         shipped in 2.8; consolidation as used here is what ``transformers``
         itself requires 2.9 for), ``transformers`` 5 and ``safetensors``
       * CPU (gloo) or one GPU per rank (NCCL)
       * :ref:`sphx_glr_recipes_save_load_recipe.py`

The model is a real ``transformers`` Llama, built from a small config with
random weights: nothing is downloaded. Code that runs on every rank is
launched by ``run_on_ranks``, which prints what each rank printed, labelled
``[rankN]``; ``run_on_one_process`` runs a step once, in a plain process.
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

import copy
import json
import shutil

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
import transformers
from rank_launcher import run_on_one_process, run_on_ranks, shared_tempdir
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint import HuggingFaceStorageReader, HuggingFaceStorageWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)
from torch.distributed.fsdp import fully_shard
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig

WORK_DIR = shared_tempdir("dcp-hf-")
print(f"torch {torch.__version__}, transformers {transformers.__version__}")
print(f"files go to {WORK_DIR}")

# sphinx_gallery_start_ignore
# Page-only helpers: progress bars off, bit-for-bit checks, peak memory. None of
# this is needed to export or import a checkpoint.
import ctypes
import sys

transformers.utils.logging.disable_progress_bar()
PROOF_DIR = os.path.join(WORK_DIR, "proof")  # what ranks keep for the checks below
os.makedirs(PROOF_DIR, exist_ok=True)


def keep_for_checks(name, value):
    """Rank 0 keeps a value (logits, a full state dict) for a check in another cell."""
    if not dist.is_initialized() or dist.get_rank() == 0:
        torch.save(value, os.path.join(PROOF_DIR, f"{name}.pt"))


def kept(name):
    return torch.load(os.path.join(PROOF_DIR, f"{name}.pt"), weights_only=True)


def differing(expected, actual):
    """(tensors compared, names whose values, dtypes or presence differ)."""
    names = sorted(set(expected) | set(actual))
    differ = [
        n
        for n in names
        if n not in expected
        or n not in actual
        or expected[n].dtype != actual[n].dtype
        or not torch.equal(expected[n].cpu(), actual[n].cpu())
    ]
    return len(names), differ


def full_state_on_rank0(model):
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_model_state_dict(model, options=options)


def safetensors_folder(path):
    tensors = {}
    for name in sorted(os.listdir(path)):
        if name.endswith(".safetensors"):
            tensors.update(load_file(os.path.join(path, name)))
    return tensors


def on_gpu():
    return torch.accelerator.is_available()


class PeakHostMemory:
    """Growth of this process's peak resident memory (VmHWM) over a block of code.

    Linux resets the peak to the current size when "5" is written to
    /proc/self/clear_refs; the peak read afterwards is the exact high-water
    mark of the block, not a sample. Freed heap memory is returned to the OS
    first (malloc_trim), so memory that earlier steps freed cannot hide growth.
    """

    def start(self):
        with_libc = ctypes.CDLL("libc.so.6") if sys.platform == "linux" else None
        if with_libc is not None:
            with_libc.malloc_trim(0)
        self.start_mib = self._status_mib("VmRSS")
        try:
            with open("/proc/self/clear_refs", "w") as clear_refs:
                clear_refs.write("5")
            self.measurable = True
        except OSError:
            self.measurable = False
        return self

    def stop(self):
        """MiB the peak grew by since start(), or None where Linux's counters are missing."""
        return self._status_mib("VmHWM") - self.start_mib if self.measurable else None

    @staticmethod
    def _status_mib(field):
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith(field):
                    return int(line.split()[1]) / 1024
        return 0.0


def compare_with_folder(model, folder):
    """Every tensor in the folder's files equals the model's tensor of that name."""
    loaded = full_state_on_rank0(model)
    if dist.get_rank() == 0:
        files = safetensors_folder(folder)
        differ = [n for n in files if n not in loaded or not torch.equal(files[n], loaded[n])]
        print(f"compared {len(files)} tensors with the files: {len(differ)} differ")
        assert not differ, differ


def save_tiny_model(folder):
    """A 1-layer model for warming up the code paths a measured load takes."""
    tiny = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
    model = AutoModelForCausalLM.from_config(tiny)
    os.makedirs(folder, exist_ok=True)
    save_file(model.state_dict(), os.path.join(folder, "model.safetensors"))
    tiny.save_pretrained(folder)


TINY_DIR = os.path.join(PROOF_DIR, "tiny-model")


def check_full_load(model, folder, how, growth_mib):
    """Print the peak memory growth, then prove the model equals the file and the trained model."""
    tensors = get_model_state_dict(model).values()
    model_mib = sum(t.numel() * t.element_size() for t in tensors) / 2**20
    shard_mib = sum(t.to_local().numel() * t.element_size() for t in tensors) / 2**20
    if growth_mib is not None:
        print(
            f"{how}: peak host memory grew by {growth_mib:.0f} MiB "
            f"(the model: {model_mib:.0f} MiB, this rank's shards: {shard_mib:.1f} MiB)"
        )
    else:
        print(f"{how}: peak host memory is not measurable on this system")
    loaded = full_state_on_rank0(model)
    with torch.no_grad():
        logits = model(FIXED_BATCH.to(device_for_this_rank())).logits.cpu()
    if dist.get_rank() == 0:
        compared, differ = differing(safetensors_folder(folder), loaded)
        assert not differ, differ
        sharded_logits = kept("sharded_logits")
        same = torch.equal(logits, sharded_logits)
        assert same or (on_gpu() and torch.allclose(logits, sharded_logits, atol=1e-4))
        print(
            f"{how}: {compared} tensors equal to the file's, logits equal to the trained "
            "model's" + (" within 1e-4" if not same else ", bit for bit")
        )


# sphinx_gallery_end_ignore

# %%
# A tiny Llama, sharded with FSDP2
# --------------------------------
# ``from_config`` builds the architecture with random weights, exactly as a
# real Llama is built, only smaller. Each decoder layer becomes its own FSDP2
# unit, then the root takes the embeddings, the final norm and ``lm_head``.

CONFIG = LlamaConfig(
    vocab_size=2048,
    hidden_size=256,
    intermediate_size=2048,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)
# The same token ids every time: the batch every exported model is checked on.
FIXED_BATCH = (torch.arange(2 * 32).reshape(2, 32) * 31) % CONFIG.vocab_size


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


def build_sharded_model(seed, config=CONFIG):
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).to(device_for_this_rank())
    return shard(model)


with torch.device("meta"):  # shapes only: nothing is allocated
    model_shapes = AutoModelForCausalLM.from_config(CONFIG)
parameter_count = sum(p.numel() for p in model_shapes.parameters())
print(
    f"{type(model_shapes).__name__}: {CONFIG.num_hidden_layers} layers, hidden size "
    f"{CONFIG.hidden_size}, {parameter_count / 1e6:.1f} M parameters "
    f"({parameter_count * 4 / 2**20:.0f} MiB in float32)"
)

# %%
# Train, then export for ``transformers``
# ---------------------------------------
# :func:`~torch.distributed.checkpoint.state_dict.get_model_state_dict` gives
# the sharded parameters under the names ``transformers`` uses
# (``model.layers.0.self_attn.q_proj.weight``, ``lm_head.weight``): FSDP2
# adds no prefix, so the DCP keys already are the Hugging Face names.
#
# ``HuggingFaceStorageWriter`` then does three things:
#
# * ``save_distributed=True``: every rank writes its own shards, as in any
#   ``dcp.save``, into ``sharded/``;
# * ``enable_consolidation=True``: after all ranks have written, the writer's
#   ``finish`` step, which runs on rank 0 only, joins the shards into full
#   tensors in ``model-0000k-of-0000n.safetensors`` and writes
#   ``model.safetensors.index.json``. Rank 0 reads every rank's files, so all
#   ranks must write to one file system that rank 0 can read (on several
#   machines, a shared one);
# * ``fqn_to_index_mapping``: which file each tensor goes to, numbered from 1.
#   It must name every tensor, and be the same on every rank.
#
# DCP writes no ``config.json``: rank 0 writes it with the config's
# ``save_pretrained``. The export below also writes a bfloat16 copy: a cast
# of each sharded tensor, so every rank casts only its own shard.

EXPORT_DIR = os.path.join(WORK_DIR, "export-float32")
BF16_EXPORT_DIR = os.path.join(WORK_DIR, "export-bfloat16")
LAYERS_PER_FILE = 2
NUM_FILES = CONFIG.num_hidden_layers // LAYERS_PER_FILE + 1


def file_index(name):
    """File 1: embeddings and layers 0-1, file 2: layers 2-3, last file: norm and lm_head."""
    if ".layers." in name:
        layer = int(name.split(".layers.")[1].split(".")[0])
        return layer // LAYERS_PER_FILE + 1
    return 1 if "embed_tokens" in name else NUM_FILES


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


def export_for_transformers(model, export_dir, dtype=None):
    state_dict = get_model_state_dict(model)  # sharded DTensors, keyed by Hugging Face names
    if dtype is not None:
        state_dict = {name: tensor.to(dtype) for name, tensor in state_dict.items()}
    writer = HuggingFaceStorageWriter(
        export_dir,
        fqn_to_index_mapping={name: file_index(name) for name in state_dict},
        save_distributed=True,
        enable_consolidation=True,
    )
    dcp.save(state_dict, storage_writer=writer)
    if dist.get_rank() == 0:
        config = copy.deepcopy(model.config)
        if dtype is not None:
            config.dtype = dtype  # from_pretrained loads the weights in this dtype
        config.save_pretrained(export_dir)
    return list(state_dict)


def train_and_export(export_dir, bf16_export_dir):
    model = build_sharded_model(seed=0)
    train(model)
    names = export_for_transformers(model, export_dir)
    export_for_transformers(model, bf16_export_dir, dtype=torch.bfloat16)
    print(f"exported {len(names)} tensors; the first three: {names[:3]}")
    # sphinx_gallery_start_ignore
    with torch.no_grad():
        logits = model(FIXED_BATCH.to(device_for_this_rank())).logits
    keep_for_checks("sharded_logits", logits.cpu())
    keep_for_checks("rank_threads", torch.get_num_threads())
    keep_for_checks("trained_state", full_state_on_rank0(model))
    # The same export without consolidation, checked in the next cells.
    no_consolidation = os.path.join(WORK_DIR, "no-consolidation")
    writer = HuggingFaceStorageWriter(no_consolidation, save_distributed=True)
    dcp.save(get_model_state_dict(model), storage_writer=writer)
    if dist.get_rank() == 0:
        model.config.save_pretrained(no_consolidation)
    # sphinx_gallery_end_ignore


run_on_ranks(train_and_export, EXPORT_DIR, BF16_EXPORT_DIR)

# %%
# What the writer wrote
# ---------------------
# The consolidated files and the index are what ``from_pretrained``, the hub
# and serving engines read. ``sharded/`` still holds each rank's pieces
# (``shard-0000r-model-0000k-of-0000n.safetensors``): the same bytes again,
# so delete it before you publish the folder.
#
# Without ``enable_consolidation`` only such pieces are written, and no
# index: each file holds one rank's slices of the tensors. ``transformers``
# 5 recognises those names and reads them back through DCP itself, but a tool
# that reads safetensors files directly gets half an embedding matrix.


def list_files(folder):
    for root, _, files in sorted(os.walk(folder)):
        for name in sorted(files):
            path = os.path.join(root, name)
            print(f"{os.path.relpath(path, folder):<55} {os.path.getsize(path):>12,} bytes")


run_on_one_process(list_files, EXPORT_DIR)
with open(os.path.join(EXPORT_DIR, "model.safetensors.index.json")) as index_file:
    weight_map = json.load(index_file)["weight_map"]
print(f"the index names {len(weight_map)} tensors in {len(set(weight_map.values()))} files")
run_on_one_process(shutil.rmtree, os.path.join(EXPORT_DIR, "sharded"))

# sphinx_gallery_start_ignore
trained_state = kept("trained_state")
assert set(weight_map) == set(trained_state), "the index names every tensor"
no_consolidation = os.path.join(WORK_DIR, "no-consolidation")
print(
    f"(checked: the index names all {len(trained_state)} tensors. Without "
    f"enable_consolidation the folder holds only {sorted(os.listdir(no_consolidation))}: "
    "no index, no full tensors)"
)
# sphinx_gallery_end_ignore

# %%
# Open it with ``from_pretrained``
# --------------------------------
# A plain process, with no process group and no DCP: the way the model is
# used after training. Its logits on the fixed batch are the sharded model's,
# bit for bit.


def open_with_transformers(folder):
    model = AutoModelForCausalLM.from_pretrained(folder)
    with torch.no_grad():
        logits = model(FIXED_BATCH).logits
    print(
        f"{type(model).__name__}.from_pretrained({os.path.basename(folder)!r}): "
        f"dtype {model.dtype}, logits {tuple(logits.shape)}"
    )
    # sphinx_gallery_start_ignore
    sharded_logits, rank_threads = kept("sharded_logits"), kept("rank_threads")
    if logits.dtype == torch.float32:
        if on_gpu():  # the ranks ran on a GPU, this process on the CPU: other kernels
            assert torch.allclose(logits, sharded_logits, rtol=1e-4, atol=1e-4)
            print("logits equal to the sharded model's within 1e-4 (GPU ranks, CPU here)")
        elif torch.get_num_threads() == rank_threads:
            assert torch.equal(logits, sharded_logits), (logits - sharded_logits).abs().max()
            print("logits equal to the sharded model's, bit for bit")
        else:
            # Another thread count splits the matmuls' sums differently: recompute
            # with the ranks' count for the bit-for-bit check, and show the difference.
            threads = torch.get_num_threads()
            torch.set_num_threads(rank_threads)
            with torch.no_grad():
                same_threads = model(FIXED_BATCH).logits
            torch.set_num_threads(threads)
            assert torch.equal(same_threads, sharded_logits)
            worst = (logits - sharded_logits).abs().max().item()
            print(
                f"logits equal to the sharded model's, bit for bit, with the ranks' "
                f"{rank_threads} CPU thread(s); with this process's {threads} the matmuls add "
                f"in another order: at most {worst:.1e} apart"
            )
    else:
        worst = (logits.float() - sharded_logits).abs().max().item()
        scale = sharded_logits.abs().max().item()
        assert worst < 0.05 * scale, (worst, scale)
        print(
            f"logits differ from the float32 sharded model's by at most {worst:.4f} "
            f"(largest logit {scale:.2f}): bfloat16 keeps 8 significant bits, about 3 digits"
        )
    # sphinx_gallery_end_ignore


run_on_one_process(open_with_transformers, EXPORT_DIR)

# sphinx_gallery_start_ignore
# Without consolidation: transformers 5 recognises the shard-* file names and
# reads them through DCP itself, but each file holds only one rank's slices.
import warnings

if not dist.is_initialized():  # under torchrun transformers would load it collectively
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        unconsolidated = AutoModelForCausalLM.from_pretrained(no_consolidation)
    threads = torch.get_num_threads()
    with torch.no_grad():
        torch.set_num_threads(kept("rank_threads"))  # as above: the ranks' thread count
        unconsolidated_logits = unconsolidated(FIXED_BATCH).logits
        torch.set_num_threads(threads)
    assert on_gpu() or torch.equal(unconsolidated_logits, kept("sharded_logits"))
first_shard = sorted(f for f in os.listdir(no_consolidation) if f.startswith("shard-"))[0]
embedding = load_file(os.path.join(no_consolidation, first_shard))["model.embed_tokens.weight"]
whole = (CONFIG.vocab_size, CONFIG.hidden_size)
rows = "only one rank's rows" if tuple(embedding.shape) != whole else "whole: one rank saved it"
print(
    "(checked: transformers 5 also opens the folder saved without consolidation, through DCP, "
    f"with the same logits; but {first_shard} holds model.embed_tokens.weight as "
    f"{tuple(embedding.shape)} of {whole}, {rows}; with more ranks each file holds one "
    "rank's rows, so any other reader of safetensors files needs the consolidated export)"
)
# sphinx_gallery_end_ignore

# %%
# The bfloat16 export
# -------------------
# Published models usually come in bfloat16: half the bytes. The writer keeps
# each tensor's dtype, so the cast tensors are written as bfloat16, and
# ``config.json`` says ``"dtype": "bfloat16"``, so ``from_pretrained`` builds
# a bfloat16 model. Its weights are the float32 weights rounded to 8
# significant bits, so its logits are close to the sharded model's, not
# equal. Export bfloat16 for inference; keep the float32 DCP checkpoint (and
# optimizer state) to resume training.

run_on_one_process(list_files, BF16_EXPORT_DIR)
run_on_one_process(shutil.rmtree, os.path.join(BF16_EXPORT_DIR, "sharded"))
run_on_one_process(open_with_transformers, BF16_EXPORT_DIR)

# sphinx_gallery_start_ignore
rounded = {name: tensor.to(torch.bfloat16) for name, tensor in trained_state.items()}
compared, differ = differing(rounded, safetensors_folder(BF16_EXPORT_DIR))
assert not differ, differ
print(f"(checked: {compared} bfloat16 tensors equal the float32 ones rounded, bit for bit)")
# sphinx_gallery_end_ignore

# %%
# Import: start sharded training from a Hugging Face checkpoint
# -------------------------------------------------------------
# The other direction: a folder of safetensors files, as ``save_pretrained``
# writes it or the hub serves it. Here a plain process saves one, split into
# several files.

HUB_DIR = os.path.join(WORK_DIR, "from-the-hub")


def save_pretrained_model(folder):
    torch.manual_seed(1234)
    AutoModelForCausalLM.from_config(CONFIG).save_pretrained(folder, max_shard_size="12MB")
    list_files(folder)


run_on_one_process(save_pretrained_model, HUB_DIR)

# %%
# Build the sharded model as for training (its random weights are about to be
# replaced), ask it for its state dict, and let ``dcp.load`` fill it from the
# folder with ``HuggingFaceStorageReader``. The reader finds every tensor from
# the files' headers; each rank then reads, through a memory map, only the
# slices of the tensors that make up its own shards.


def load_hf_checkpoint(model, folder):
    state_dict = get_model_state_dict(model)
    dcp.load(state_dict, storage_reader=HuggingFaceStorageReader(folder))
    set_model_state_dict(model, state_dict)


def start_from_hf(folder):
    model = build_sharded_model(seed=1)
    # sphinx_gallery_start_ignore
    # Count the bytes this rank asks the reader for.
    read_bytes = [0]
    process_read_request = HuggingFaceStorageReader._process_read_request

    def counting(reader, file, request, planner):
        target = planner.resolve_tensor(request)
        read_bytes[0] += target.numel() * target.element_size()
        return process_read_request(reader, file, request, planner)

    HuggingFaceStorageReader._process_read_request = counting
    # sphinx_gallery_end_ignore
    load_hf_checkpoint(model, folder)
    # sphinx_gallery_start_ignore
    HuggingFaceStorageReader._process_read_request = process_read_request
    total = sum(os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder))
    print(f"this rank read {read_bytes[0]:,} bytes of tensor data (the folder: {total:,} bytes)")
    loaded = full_state_on_rank0(model)
    if dist.get_rank() == 0:
        compared, differ = differing(safetensors_folder(folder), loaded)
        print(f"compared {compared} tensors with the Hugging Face files: {len(differ)} differ")
        assert not differ, differ
    # sphinx_gallery_end_ignore
    train(model, steps=1)


run_on_ranks(start_from_hf, HUB_DIR)

# %%
# Full state dicts: gather on rank 0
# ----------------------------------
# Sometimes one process must hold the whole model: a tool that takes a plain
# state dict, or a small model written as one ``model.safetensors``.
# ``full_state_dict=True`` all-gathers every parameter, ``cpu_offload=True``
# keeps the result on the CPU and on rank 0 only: the other ranks get an empty
# dict. That costs one full copy of the model in rank 0's host memory, which
# the sharded export above never needs.

FULL_DIR = os.path.join(WORK_DIR, "full-state-dict")


def gather_and_save(source_folder, full_folder):
    model = build_sharded_model(seed=1)
    load_hf_checkpoint(model, source_folder)
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    full_state_dict = get_model_state_dict(model, options=options)  # collective
    size = sum(t.numel() * t.element_size() for t in full_state_dict.values())
    print(f"holds {len(full_state_dict)} tensors, {size / 2**20:.1f} MiB on the CPU")
    if dist.get_rank() == 0:
        os.makedirs(full_folder, exist_ok=True)
        save_file(full_state_dict, os.path.join(full_folder, "model.safetensors"))
        model.config.save_pretrained(full_folder)


run_on_ranks(gather_and_save, EXPORT_DIR, FULL_DIR)
# sphinx_gallery_start_ignore
run_on_one_process(save_tiny_model, TINY_DIR)
# sphinx_gallery_end_ignore
run_on_one_process(list_files, FULL_DIR)

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
# ranks pass an empty dict and receive their shards from rank 0, one tensor at
# a time. That only saves memory if those ranks never build the full model
# either: build it on the ``meta`` device (shapes, no storage) from the
# folder's ``config.json``, shard it, then allocate just the local shards
# with ``to_empty``. Buffers that are computed, not loaded (the rotary
# embedding's frequencies), are computed again.


def build_sharded_model_without_weights(config):
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    shard(model)
    model.to_empty(device=device_for_this_rank())
    rotary = type(model.model.rotary_emb)(config)  # not in any checkpoint
    model.model.rotary_emb = rotary.to(device_for_this_rank())
    return model


def load_from_rank0(folder):
    model = build_sharded_model_without_weights(AutoConfig.from_pretrained(folder))
    full_state_dict = {}
    if dist.get_rank() == 0:
        full_state_dict = load_file(os.path.join(folder, "model.safetensors"))
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_model_state_dict(model, full_state_dict, options=options)
    return model


def load_and_train(load, folder):
    # sphinx_gallery_start_ignore
    load(TINY_DIR)  # warm-up: code paths run once, so the peak below is the load's own
    peak = PeakHostMemory().start()
    # sphinx_gallery_end_ignore
    model = load(folder)
    # sphinx_gallery_start_ignore
    check_full_load(model, folder, load.__name__, peak.stop())
    # sphinx_gallery_end_ignore
    train(model, steps=1)


# %%
# Each way runs in freshly started ranks, and each rank prints how much its
# peak resident host memory grew while it loaded: Linux's ``VmHWM``, reset
# right before the load, so it is the exact high-water mark, not a sample. It
# also counts the file's pages that safetensors maps while it reads. (Hidden
# from this page: a load of a tiny model first, so that one-time costs do not
# count.) Both ways end with the same sharded model, bit for bit.

run_on_ranks(load_and_train, load_on_every_rank, FULL_DIR)

# %%
# Rank 0 still reads the whole file, but every other rank now holds only its
# own shards and one tensor in flight:

run_on_ranks(load_and_train, load_from_rank0, FULL_DIR)

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


def last_line(error):
    return str(error).strip().splitlines()[-1]


print(f"CheckpointException is an Exception: {issubclass(CheckpointException, Exception)}")

# %%
# **A prefix from torch.compile.** ``torch.compile`` wraps the model, and the
# wrapper's ``state_dict()`` puts ``_orig_mod.`` in front of every name.
# ``get_model_state_dict`` removes it (and the prefixes of FSDP's and
# activation checkpointing's wrappers), and ``set_model_state_dict`` puts it
# back.


def load_into_compiled_model(folder):
    model = torch.compile(build_sharded_model(seed=1))
    state_dict = model.state_dict()
    print(f"model.state_dict(): {next(iter(state_dict))!r}, ...")
    try:
        dcp.load(state_dict, storage_reader=HuggingFaceStorageReader(folder))
    except CheckpointException as error:
        print(f"dcp.load failed: {last_line(error)}")

    state_dict = get_model_state_dict(model)
    print(f"get_model_state_dict(model): {next(iter(state_dict))!r}, ...")
    dcp.load(state_dict, storage_reader=HuggingFaceStorageReader(folder))
    set_model_state_dict(model, state_dict)
    print(f"loaded {len(state_dict)} tensors")
    # sphinx_gallery_start_ignore
    compare_with_folder(model, folder)
    # sphinx_gallery_end_ignore


# sphinx_gallery_start_ignore
torch.compile(nn.Linear(1, 1))  # the modules torch.compile imports: once here, not on every rank
# sphinx_gallery_end_ignore
run_on_ranks(load_into_compiled_model, EXPORT_DIR)

# %%
# **A prefix from your own wrapper, and a key the checkpoint lacks.** A
# module that holds the Llama as ``self.model`` and adds a value head (as in
# RL fine-tuning) names its parameters ``model.model.layers...``, and
# ``value_head.weight`` is in no Hugging Face checkpoint. Rename to the
# checkpoint's names, load only the keys the checkpoint has, and rename back.
# ``set_model_state_dict`` with ``strict=False`` reports what it did not
# load: the value head keeps its initial weights.


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
    try:
        dcp.load(state_dict, storage_reader=HuggingFaceStorageReader(folder))
    except CheckpointException as error:
        print(f"as it is: {last_line(error)}")

    renamed = {name.removeprefix("model."): value for name, value in state_dict.items()}
    try:
        dcp.load(renamed, storage_reader=HuggingFaceStorageReader(folder))
    except CheckpointException as error:
        print(f"renamed:  {last_line(error)}")

    in_checkpoint = {name: value for name, value in renamed.items() if name in CHECKPOINT_NAMES}
    dcp.load(in_checkpoint, storage_reader=HuggingFaceStorageReader(folder))
    loaded = {f"model.{name}": value for name, value in in_checkpoint.items()}
    result = set_model_state_dict(value_head_model, loaded, options=StateDictOptions(strict=False))
    print(f"loaded {len(loaded)} tensors; not in the checkpoint: {result.missing_keys}")
    # sphinx_gallery_start_ignore
    compare_with_folder(value_head_model.model, folder)
    # sphinx_gallery_end_ignore


# The checkpoint's names, from its index: the keys that can be loaded.
with open(os.path.join(EXPORT_DIR, "model.safetensors.index.json")) as index_file:
    CHECKPOINT_NAMES = set(json.load(index_file)["weight_map"])
run_on_ranks(load_into_wrapper, EXPORT_DIR)

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
        f"save_pretrained wrote {len(names)} tensors; lm_head.weight among them: "
        f"{'lm_head.weight' in names}"
    )


def load_tied_model(folder):
    model = build_sharded_model(seed=1, config=TIED_CONFIG)
    state_dict = get_model_state_dict(model)
    try:
        dcp.load(state_dict, storage_reader=HuggingFaceStorageReader(folder))
    except CheckpointException as error:
        print(f"dcp.load failed: {last_line(error)}")

    if model.config.tie_word_embeddings:
        state_dict.pop("lm_head.weight")  # the same parameter as model.embed_tokens.weight
    dcp.load(state_dict, storage_reader=HuggingFaceStorageReader(folder))
    set_model_state_dict(model, state_dict, options=StateDictOptions(strict=False))
    tied = model.lm_head.weight is model.model.embed_tokens.weight
    print(f"loaded {len(state_dict)} tensors; lm_head still tied to the embedding: {tied}")
    # sphinx_gallery_start_ignore
    compare_with_folder(model, folder)
    # sphinx_gallery_end_ignore


run_on_one_process(save_tied_model, TIED_DIR)
run_on_ranks(load_tied_model, TIED_DIR)

# %%
# Clean up
# --------


# sphinx_gallery_start_ignore
# For the tests: keep a copy of the float32 export where this variable says.
def keep_export_copy(copy_to):
    shutil.copytree(EXPORT_DIR, copy_to, dirs_exist_ok=True)
    print(f"(kept a copy of {os.path.basename(EXPORT_DIR)} in {copy_to})")


if os.environ.get("DCP_RECIPES_HF_EXPORT_COPY"):
    run_on_one_process(keep_export_copy, os.environ["DCP_RECIPES_HF_EXPORT_COPY"])
# sphinx_gallery_end_ignore
shutil.rmtree(WORK_DIR, ignore_errors=True)
print(f"removed {WORK_DIR}: {not os.path.exists(WORK_DIR)}")

# %%
# What to read next
# -----------------
# * :ref:`sphx_glr_recipes_resume_recipe.py`: the checkpoint you resume from
#   is not this export (which holds no optimizer state and, in bfloat16,
#   rounded weights) but a full DCP checkpoint of model, optimizer, data
#   position and RNG.
# * :ref:`sphx_glr_recipes_async_save_recipe.py`: keep training while a
#   checkpoint is written; the same writers work with ``dcp.async_save``.
# * :ref:`sphx_glr_recipes_default_stager_recipe.py`: overlap even the copy
#   to host memory with the next forward and backward pass.
# * :doc:`/troubleshooting`: symptoms and fixes for the usual DCP failures.
