"""
Hugging Face checkpoints: export for ``transformers``
=====================================================

Training with FSDP2 and DCP usually ends with a model that someone serves or
publishes with Hugging Face ``transformers``. DCP writes Hugging Face's
format, safetensors, itself: ``HuggingFaceStorageWriter`` makes ``dcp.save``
write the ``model-0000k-of-0000n.safetensors`` files and the
``model.safetensors.index.json`` that ``from_pretrained`` opens, every rank
writing only its own shards. No rank ever holds the whole model.

.. grid:: 2

    .. grid-item-card:: :octicon:`mortar-board;1em;` What you will learn
       :class-card: card-prerequisites

       * Export an FSDP2-sharded model to a folder that
         ``AutoModelForCausalLM.from_pretrained`` opens, in float32 or bfloat16
       * What consolidation writes, and what a folder without it holds
       * Check an export against the trained model: tensors and logits
       * Run the same export as a training script under ``torchrun``

    .. grid-item-card:: :octicon:`list-unordered;1em;` Prerequisites
       :class-card: card-prerequisites

       * PyTorch: see :doc:`/versions`
       * ``transformers`` 5.20 or newer, and ``safetensors``
       * CPU (gloo) or one GPU per rank (NCCL)
       * :ref:`sphx_glr_recipes_save_load_recipe.py`

The model is a real ``transformers`` Llama, built from a small config with
random weights: nothing is downloaded. The other direction, a Hugging Face
checkpoint into sharded training, is :ref:`sphx_glr_recipes_hf_import_recipe.py`.
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

import copy
import json
import shutil

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import transformers
from page_tools import proofs, results
from rank_launcher import run_as_torchrun, run_on_one_process, run_on_ranks, shared_tempdir
from safetensors.torch import load_file
from torch.distributed.checkpoint import HuggingFaceStorageWriter
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torch.distributed.fsdp import fully_shard
from transformers import AutoModelForCausalLM, LlamaConfig

WORK_DIR = shared_tempdir("dcp-hf-export-")
print(f"torch {torch.__version__}, transformers {transformers.__version__}")
print(f"files go to {WORK_DIR}")

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


def build_sharded_llama(seed, config=CONFIG):
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
#   Rank 0 plans for every rank and hands each its own mapping, so it must name
#   every tensor of every rank: build it from all names, the same on each rank.
#
# DCP writes no ``config.json``: rank 0 writes it with the config's
# ``save_pretrained``. A bfloat16 export is a cast of each sharded tensor, so
# every rank casts only its own shard.

LAYERS_PER_FILE = 2
NUM_FILES = CONFIG.num_hidden_layers // LAYERS_PER_FILE + 1


def file_index(name):
    """File 1: embeddings and layers 0-1, file 2: layers 2-3, last file: norm and lm_head."""
    if ".layers." in name:
        layer = int(name.split(".layers.")[1].split(".")[0])
        return layer // LAYERS_PER_FILE + 1
    return 1 if "embed_tokens" in name else NUM_FILES


def export_for_transformers(model, export_dir, dtype=None, consolidate=True):
    state_dict = get_model_state_dict(model)  # sharded DTensors, keyed by Hugging Face names
    if dtype is not None:
        state_dict = {name: tensor.to(dtype) for name, tensor in state_dict.items()}
    writer = HuggingFaceStorageWriter(
        export_dir,
        fqn_to_index_mapping={name: file_index(name) for name in state_dict},
        save_distributed=True,
        enable_consolidation=consolidate,
    )
    dcp.save(state_dict, storage_writer=writer)
    if dist.get_rank() == 0:
        config = copy.deepcopy(model.config)
        if dtype is not None:
            config.dtype = dtype  # from_pretrained loads the weights in this dtype
        config.save_pretrained(export_dir)
    return list(state_dict)


# %%
# Each rank trains on its own data, then the model is exported three times:
# in float32, in bfloat16, and once without consolidation, to see what that
# leaves. The function returns the model's logits on ``FIXED_BATCH``, which
# every export must reproduce.


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


def train_and_export(export_dir, bf16_export_dir, unconsolidated_dir):
    model = build_sharded_llama(seed=0)
    train(model)
    names = export_for_transformers(model, export_dir)
    export_for_transformers(model, bf16_export_dir, dtype=torch.bfloat16)
    export_for_transformers(model, unconsolidated_dir, consolidate=False)
    print(f"exported {len(names)} tensors, from {names[0]!r} to {names[-1]!r}")
    with torch.no_grad():
        return model(FIXED_BATCH.to(device_for_this_rank())).logits.cpu()


EXPORT_DIR = os.path.join(WORK_DIR, "export-float32")
BF16_EXPORT_DIR = os.path.join(WORK_DIR, "export-bfloat16")
UNCONSOLIDATED_DIR = os.path.join(WORK_DIR, "export-unconsolidated")

# %%
# The page keeps a copy of the state each rank gives ``dcp.save``, to compare
# every file below with:

with proofs.state_given_to(dcp, "save") as saved:
    sharded_logits = run_on_ranks(
        train_and_export, EXPORT_DIR, BF16_EXPORT_DIR, UNCONSOLIDATED_DIR
    )[0]

# %%
# What the writer wrote
# ---------------------
# The consolidated files and the index are what ``from_pretrained``, the hub
# and serving engines read. ``sharded/`` still holds each rank's pieces
# (``shard-0000s-model-0000k-of-0000n.safetensors``, ``s`` counted from 1:
# rank 0 writes ``shard-00001-...``): the same bytes again, so delete it
# before you publish the folder.


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

# %%

results.record("parameters", parameter_count)
results.record("world-size", len(saved.by_rank))
trained = proofs.whole_state(saved.nth(0))  # the first save: the float32 export
results.claim(
    "index-names-every-tensor",
    set(weight_map) == set(trained) and len(set(weight_map.values())) == NUM_FILES,
    f"the index names all {len(trained)} tensors of the model, in {NUM_FILES} files",
    tensors=len(weight_map),
    files=sorted(set(weight_map.values())),
)
export_files = proofs.safetensors_state(EXPORT_DIR)
proofs.same_state(
    "float32-files-hold-the-trained-tensors",
    trained,
    export_files,
    "the files vs the trained model",
)

# %%
# Without ``enable_consolidation`` only the pieces are written, and no index:
# each file holds one rank's slices of the tensors, so a tool that reads
# safetensors files directly gets part of an embedding matrix.

run_on_one_process(list_files, UNCONSOLIDATED_DIR)
pieces = sorted(name for name in os.listdir(UNCONSOLIDATED_DIR) if name.startswith("shard-"))
first_piece = pieces[0]
embedding = load_file(os.path.join(UNCONSOLIDATED_DIR, first_piece))["model.embed_tokens.weight"]
print(f"{first_piece}: model.embed_tokens.weight {tuple(embedding.shape)}")

# %%

results.claim(
    "unconsolidated-folder-has-no-index",
    all(n == "config.json" or n.startswith("shard-") for n in os.listdir(UNCONSOLIDATED_DIR)),
    "without consolidation: config.json and the ranks' pieces, no index, no whole tensors",
    files=sorted(os.listdir(UNCONSOLIDATED_DIR)),
)
results.claim(
    "unconsolidated-file-holds-one-ranks-rows",
    embedding.shape[0] == -(-CONFIG.vocab_size // len(saved.by_rank)),
    f"the first piece holds {embedding.shape[0]} of the embedding's {CONFIG.vocab_size} rows: "
    f"rank 0's share of {len(saved.by_rank)}",
    rows=embedding.shape[0],
)

# %%
# Open it with ``from_pretrained``
# --------------------------------
# A plain process, with no process group and no DCP: the way the model is
# used after training. Its logits on the fixed batch are the sharded model's:
# bit for bit on CPU with the same thread count (one, in the ranks and here);
# from GPU ranks to this CPU process, within 1e-4 (other float32 kernels).


def open_with_transformers(folder):
    model = AutoModelForCausalLM.from_pretrained(folder)
    with torch.no_grad():
        logits = model(FIXED_BATCH).logits
    print(
        f"{os.path.basename(folder)}: {type(model).__name__}, {model.dtype}, "
        f"logits {tuple(logits.shape)}"
    )
    return logits


# %%

with proofs.value_returned_by(AutoModelForCausalLM, "from_pretrained") as opened:
    float32_logits = run_on_one_process(open_with_transformers, EXPORT_DIR)
proofs.same_state(
    "from-pretrained-builds-the-trained-model", trained, opened, "its weights vs the trained model"
)
tolerance = results.record("logits-tolerance", 1e-4 if torch.cuda.is_available() else 0.0)
proofs.same_values(
    "float32-logits-equal",
    sharded_logits,
    float32_logits,
    "logits vs the sharded model's",
    tolerance,
)

# %%
# ``transformers`` 5.20 and newer recognise the ``shard-`` names of an
# unconsolidated folder and read it through DCP itself (5.19 and older look
# for ``model.safetensors`` and raise). With a process group that load is a
# collective, so every rank calls ``from_pretrained``, and every rank reads
# the whole model:

unconsolidated_logits = run_on_ranks(open_with_transformers, UNCONSOLIDATED_DIR)[0]

# %%

proofs.same_values(
    "unconsolidated-opens-through-dcp",
    sharded_logits,
    unconsolidated_logits,
    "logits vs the sharded model's",
    tolerance,
)

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
bf16_logits = run_on_one_process(open_with_transformers, BF16_EXPORT_DIR)

# %%

rounded = proofs.cast(trained, torch.bfloat16)
bf16_files = proofs.safetensors_state(BF16_EXPORT_DIR)
proofs.same_state(
    "bf16-files-are-the-float32-rounded", rounded, bf16_files, "the files vs float32 rounded"
)
results.claim(
    "bf16-export-opens-in-bfloat16",
    bf16_logits.dtype == torch.bfloat16,
    f"from_pretrained built a {bf16_logits.dtype} model",
    dtype=str(bf16_logits.dtype),
)
proofs.same_values(
    "bf16-logits-close",
    sharded_logits,
    bf16_logits,
    "bfloat16 logits vs float32",
    tolerance=0.05 * sharded_logits.abs().max().item(),  # 8 significant bits: ~3 digits
)

# %%
# The same, as a training script for ``torchrun``
# -----------------------------------------------
# In your own job ``torchrun`` starts the ranks, and ``main()`` does what
# ``run_on_ranks`` did above: set this rank's device, create the process
# group, train, export, and destroy the group. The export folder is a path
# that every rank sees (``shared_tempdir`` made one here; on several
# machines, a shared file system, since rank 0 reads every rank's pieces).
# Save it as ``export.py`` with the functions above, and:
#
# .. code-block:: bash
#
#    torchrun --nproc-per-node=2 export.py
#
# The cell runs ``main()`` the way ``torchrun`` would, on ranks that have
# torchrun's environment and no process group yet.


def main(export_dir):
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo")
    try:
        model = build_sharded_llama(seed=0)
        train(model)
        export_for_transformers(model, export_dir)
        dist.barrier()  # no rank tears gloo down while another one still sends
    finally:
        dist.destroy_process_group()


# %%

with proofs.state_given_to(dcp, "save") as exported:
    run_as_torchrun(main, os.path.join(WORK_DIR, "torchrun", "export-float32"))

# %%

proofs.same_state(
    "torchrun-export-holds-its-model",
    exported,
    proofs.safetensors_state(os.path.join(WORK_DIR, "torchrun", "export-float32")),
    "the torchrun job's files vs its model",
)

# %%
# Clean up
# --------

shutil.rmtree(WORK_DIR, ignore_errors=True)
print(f"removed {WORK_DIR}: {not os.path.exists(WORK_DIR)}")

# %%
# What to read next
# -----------------
# * :ref:`sphx_glr_recipes_hf_import_recipe.py`: the other direction, a
#   Hugging Face checkpoint into sharded training, and the key mismatches
#   that stop such a load.
# * :ref:`sphx_glr_recipes_resume_recipe.py`: the checkpoint you resume from
#   is not this export (which holds no optimizer state and, in bfloat16,
#   rounded weights) but a full DCP checkpoint of model, optimizer, data
#   position and RNG.
# * :ref:`sphx_glr_recipes_async_save_recipe.py`: keep training while a
#   checkpoint is written; the same writers work with ``dcp.async_save``.
# * :doc:`/troubleshooting`: symptoms and fixes for the usual DCP failures.
