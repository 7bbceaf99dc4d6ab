"""
Adapters only, another mesh, another dtype
==========================================

Three more ways a checkpoint and the model that loads it differ. A LoRA
fine-tune trains a few small adapters on a frozen base: its checkpoint needs
only the trainable state, next to the base checkpoint. A run sharded two ways
(FSDP x tensor parallel) resumes on a plain FSDP mesh of another size, or in
one process. And a float32 checkpoint loads into a bfloat16 model. Each is
shown on CPU ranks with gloo (or one GPU per rank), and proved bit for bit.

.. grid:: 2

    .. grid-item-card:: :octicon:`mortar-board;1em;` What you will learn
       :class-card: card-prerequisites

       * Save only the trainable state (``ignore_frozen_params``) of a ``peft``
         LoRA model, and load base and adapters into a fresh model
       * Load a 2-D (FSDP x TP, a 2x2 mesh) checkpoint on 2, 3 and 1 ranks,
         optimizer state included
       * What DCP does when the checkpoint's dtype is not the model's

    .. grid-item-card:: :octicon:`list-unordered;1em;` Prerequisites
       :class-card: card-prerequisites

       * PyTorch: see :doc:`/versions`
       * ``transformers`` 5 and ``peft`` 0.21 for the LoRA part
       * CPU (gloo) or one GPU per rank (NCCL); the 2-D cell needs 4 ranks
       * :ref:`sphx_glr_recipes_partial_load_recipe.py`
"""

# %%
# Setup
# -----

import os

os.environ["HF_HUB_OFFLINE"] = "1"  # a model name that is not a folder fails at once

import warnings

import peft
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
import transformers
from page_tools import proofs, ranks, results
from peft import LoraConfig, get_peft_model
from rank_launcher import run_on_one_process, run_on_ranks, shared_tempdir
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from transformers import LlamaConfig, LlamaForCausalLM

# peft 0.21 asks transformers 5.23 a question it has renamed: a FutureWarning per model.
warnings.filterwarnings("ignore", "`is_gradient_checkpointing` is deprecated", FutureWarning)

WORK_DIR = shared_tempdir("dcp-change-parallelism-")
print(
    f"torch {torch.__version__}, transformers {transformers.__version__}, peft {peft.__version__}"
)

# %%
# Frozen parameters and LoRA adapters
# -----------------------------------
# The adapter library is ``peft``: it works with DCP as it is. Its adapters
# are ordinary parameters of the wrapped model (``...q_proj.lora_A.default``),
# the base's are frozen (``requires_grad=False``), and DCP's
# ``StateDictOptions(ignore_frozen_params=True)`` leaves the frozen ones out of
# both state dicts, model and optimizer. On load, ``set_state_dict`` then
# needs ``strict=False`` (the base's keys are not in the adapter state dict);
# the recipe checks that the keys it reports missing are the frozen ones.
#
# The base is a tiny ``transformers`` Llama built from a config, saved first.

LLAMA = LlamaConfig(
    vocab_size=128,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=2,
)
LORA = LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"])
TRAINABLE_ONLY = StateDictOptions(ignore_frozen_params=True, strict=False)
BASE_DIR, ADAPTER_DIR = os.path.join(WORK_DIR, "base"), os.path.join(WORK_DIR, "adapters")
TOKENS = torch.randint(0, LLAMA.vocab_size, (4, 16), generator=torch.Generator().manual_seed(0))


def save_base(checkpoint_dir, config):
    torch.manual_seed(0)
    state_dict = get_model_state_dict(LlamaForCausalLM(config))
    dcp.save(state_dict, checkpoint_id=checkpoint_dir)
    print(f"base model: {len(state_dict)} tensors saved")


def load_base(checkpoint_dir, config):
    model = LlamaForCausalLM(config)
    state_dict = get_model_state_dict(model)
    dcp.load(state_dict, checkpoint_id=checkpoint_dir)
    set_model_state_dict(model, state_dict)
    return model


run_on_ranks(save_base, BASE_DIR, LLAMA)

# %%
# Train the adapters on the loaded base, and save only what was trained:


def adapters_and_optimizer(model):
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    return model, optimizer


def train_adapters(base_dir, adapter_dir, config, lora, tokens):
    model, optimizer = adapters_and_optimizer(get_peft_model(load_base(base_dir, config), lora))
    for _ in range(3):
        optimizer.zero_grad()
        model(input_ids=tokens, labels=tokens).loss.backward()
        optimizer.step()
    model_state_dict, optim_state_dict = get_state_dict(model, optimizer, options=TRAINABLE_ONLY)
    dcp.save({"model": model_state_dict, "optim": optim_state_dict}, checkpoint_id=adapter_dir)
    with torch.no_grad():
        return model(input_ids=tokens).logits


def describe_size(checkpoint_dir):
    metadata = FileSystemReader(checkpoint_dir).read_metadata()
    tensors = [e for e in metadata.state_dict_metadata.values() if hasattr(e, "chunks")]
    tensor_bytes = sum(e.size.numel() * e.properties.dtype.itemsize for e in tensors)
    files = sum(
        os.path.getsize(os.path.join(checkpoint_dir, f)) for f in os.listdir(checkpoint_dir)
    )
    name = os.path.basename(checkpoint_dir)
    print(f"{name:<9} {len(tensors):>3} tensors, {tensor_bytes:>7,} bytes; files {files:>7,} bytes")
    return tensor_bytes


# %%

with proofs.state_given_to(dcp, "save") as adapters_saved:
    trained_logits = run_on_ranks(train_adapters, BASE_DIR, ADAPTER_DIR, LLAMA, LORA, TOKENS)[0]

# %%

sizes = {os.path.basename(d): describe_size(d) for d in (BASE_DIR, ADAPTER_DIR)}

# %%
# Both checkpoints carry a fixed overhead in their files (``.metadata``, and
# a pickled entry per optimizer hyper-parameter), but the adapter
# checkpoint's tensors are a few percent of the base's. Now fresh ranks build
# the base from its checkpoint, wrap it in the same LoRA config, and load the
# adapters and their optimizer state:


def load_base_and_adapters(base_dir, adapter_dir, config, lora, tokens):
    model, optimizer = adapters_and_optimizer(get_peft_model(load_base(base_dir, config), lora))
    model_state_dict, optim_state_dict = get_state_dict(model, optimizer, options=TRAINABLE_ONLY)
    state_dict = {"model": model_state_dict, "optim": optim_state_dict}
    dcp.load(state_dict, checkpoint_id=adapter_dir)
    loaded = set_state_dict(
        model,
        optimizer,
        model_state_dict=model_state_dict,
        optim_state_dict=optim_state_dict,
        options=TRAINABLE_ONLY,
    )
    frozen = [name for name, p in model.named_parameters() if not p.requires_grad]
    if sorted(loaded.missing_keys) != sorted(frozen):
        raise RuntimeError(f"not loaded, and not frozen: {set(loaded.missing_keys) ^ set(frozen)}")
    print(f"{len(model_state_dict)} adapter tensors loaded; {len(frozen)} frozen from the base")
    with torch.no_grad():
        return model(input_ids=tokens).logits


# %%

with proofs.state_after(dcp, "load", where=proofs.checkpoint_matches("adapters")) as adapters:
    logits = run_on_ranks(load_base_and_adapters, BASE_DIR, ADAPTER_DIR, LLAMA, LORA, TOKENS)[0]

# %%

proofs.same_state(
    "adapters-and-optimizer-reload", adapters_saved, adapters, "adapters + AdamW state vs saved"
)
results.claim(
    "base-plus-adapters-same-outputs",
    torch.equal(logits, trained_logits),
    f"the fresh model's logits {tuple(logits.shape)} equal the trained model's, bit for bit",
)
results.record("checkpoint_tensor_bytes", sizes)
adapter_keys = [k for k, v in proofs.whole_state(adapters_saved).items() if torch.is_tensor(v)]
results.claim(
    "adapter-checkpoint-is-the-trainable-state",
    all("lora_" in key for key in adapter_keys) and sizes["adapters"] < sizes["base"] / 10,
    f"{len(adapter_keys)} tensors, all of LoRA parameters; "
    f"{sizes['adapters'] / sizes['base']:.1%} of the base's tensor bytes",
    keys=adapter_keys[:8],
)

# %%
# Change the parallelism: a 2-D checkpoint on 2, 3 and 1 ranks
# ------------------------------------------------------------
# Four ranks form a 2x2 mesh: tensor parallel within pairs (``layers.0``
# split by output rows, ``layers.1`` by input columns), FSDP across them.
# ``layers.0.weight`` is then sharded twice along its rows. The checkpoint
# stores global shapes and each rank's chunk, so a 1-D FSDP model of any
# size, or a plain model, loads it: DCP reads for each rank the parts of the
# saved chunks that overlap its own shard, the optimizer state included.

WIDTH, DEPTH, BATCH, LR = 64, 2, 32, 1e-2
MESH_DIR = os.path.join(WORK_DIR, "mesh-2x2")


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


# %%
# The 2-D run trains two steps and saves. On fewer than 4 ranks (``torchrun
# --nproc-per-node=2``) it says so, and the loads below say they have
# nothing to load.


def train_2d_and_save(checkpoint_dir):
    if dist.get_world_size() != 4:
        print(f"a 2x2 mesh needs 4 ranks, this run has {dist.get_world_size()}: skipped")
        return
    mesh = init_device_mesh(device_for_this_rank().type, (2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    model = ToyModel().to(device_for_this_rank())
    plan = {"layers.0": ColwiseParallel(), "layers.1": RowwiseParallel()}
    parallelize_module(model, mesh["tp"], plan)
    fully_shard(model, mesh=mesh["dp"])
    optimizer = torch.optim.Adam(model.parameters(), lr=LR)
    torch.manual_seed(100 + mesh["dp"].get_local_rank())  # the two ranks of a pair: same data
    for _ in range(2):
        optimizer.zero_grad()
        model(torch.rand(BATCH, WIDTH, device=device_for_this_rank())).pow(2).mean().backward()
        optimizer.step()
    dcp.save({"app": AppState(model, optimizer)}, checkpoint_id=checkpoint_dir)
    weight = model.layers[0].weight
    print(f"layers.0.weight {weight.placements}, local {tuple(weight.to_local().shape)}")


# %%

with ranks.exactly(4), proofs.state_given_to(dcp, "save") as saved_2d:
    run_on_ranks(train_2d_and_save, MESH_DIR)

# %%
# Load it on a 1-D FSDP mesh of all ranks (2 here, then 3), into a model
# built as for training:


def load_1d(checkpoint_dir):
    if not os.path.exists(os.path.join(checkpoint_dir, ".metadata")):
        print(f"no checkpoint at {os.path.basename(checkpoint_dir)}: nothing to load")
        return
    model, optimizer = build_sharded_model(seed=1)
    dcp.load({"app": AppState(model, optimizer)}, checkpoint_id=checkpoint_dir)
    shard = model.layers[0].weight.to_local()
    print(f"rank {dist.get_rank()} of {dist.get_world_size()}: layers.0.weight rows {len(shard)}")


# %%

with ranks.exactly(2), proofs.state_after(dcp, "load") as on_2:
    run_on_ranks(load_1d, MESH_DIR)
with ranks.exactly(3), proofs.state_after(dcp, "load") as on_3:
    run_on_ranks(load_1d, MESH_DIR)

# %%
# And in one process, without a process group, into a plain model:


def load_in_one_process(checkpoint_dir):
    if not os.path.exists(os.path.join(checkpoint_dir, ".metadata")):
        print(f"no checkpoint at {os.path.basename(checkpoint_dir)}: nothing to load")
        return
    model = ToyModel()
    optimizer = torch.optim.Adam(model.parameters(), lr=LR)
    with warnings.catch_warnings():
        # DCP warns that it assumes a single process even when no_dist=True says so.
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        dcp.load({"app": AppState(model, optimizer)}, checkpoint_id=checkpoint_dir, no_dist=True)
    print(f"one process: layers.0.weight {tuple(model.layers[0].weight.shape)}")


# %%

with proofs.state_after(dcp, "load") as on_1:
    run_on_one_process(load_in_one_process, MESH_DIR)

# %%
# Each load is the 2-D state at the save, model and Adam state, bit for bit:

proofs.same_state("2d-to-2-ranks", saved_2d, on_2, "2x2 mesh -> 2 ranks")
proofs.same_state("2d-to-3-ranks", saved_2d, on_3, "2x2 mesh -> 3 ranks")
proofs.same_state("2d-to-1-process", saved_2d, on_1, "2x2 mesh -> 1 process")

# %%
# Another dtype
# -------------
# DCP loads into the tensors you give it, and copies with ``Tensor.copy_``:
# a float32 checkpoint loaded into a bfloat16 model is cast, silently, with
# no warning or error in torch 2.13 (only shapes are checked). Saved again,
# the checkpoint is bfloat16; loaded into a float32 model, it is cast back:
# the values are the bfloat16 ones, exactly.


def to_bfloat16_and_back(work_dir):
    model, _ = build_sharded_model(seed=0)
    source = os.path.join(work_dir, "float32")
    dcp.save({"app": {"model": get_model_state_dict(model)}}, checkpoint_id=source)
    for dtype, target in [(torch.bfloat16, "bfloat16"), (torch.float32, None)]:
        model = ToyModel().to(device_for_this_rank(), dtype)
        fully_shard(model)
        state_dict = {"app": {"model": get_model_state_dict(model)}}
        dcp.load(state_dict, checkpoint_id=source)
        on_disk = FileSystemReader(source).read_metadata().state_dict_metadata
        saved_as = on_disk["app.model.layers.0.weight"].properties.dtype
        print(f"{os.path.basename(source)} checkpoint: {saved_as} on disk -> {dtype} model")
        if target:
            source = os.path.join(work_dir, target)
            dcp.save(state_dict, checkpoint_id=source)


# %%

with (
    proofs.state_given_to(dcp, "save") as dtype_saves,
    proofs.state_after(dcp, "load") as dtype_loads,
):
    run_on_ranks(to_bfloat16_and_back, WORK_DIR)

# %%

bfloat16 = proofs.cast(proofs.nth_call(dtype_saves, 0), torch.bfloat16)
proofs.same_state(
    "float32-to-bfloat16-casts",
    bfloat16,
    proofs.nth_call(dtype_loads, 0),
    "into bfloat16 vs float32 cast",
)
proofs.same_state(
    "bfloat16-to-float32-casts",
    proofs.cast(bfloat16, torch.float32),
    proofs.nth_call(dtype_loads, 1),
    "and back vs the bfloat16 values",
)
results.claim(
    "bfloat16-checkpoint-is-bfloat16",
    {v.dtype for v in proofs.whole_state(proofs.nth_call(dtype_saves, 1)).values()}
    == {torch.bfloat16},
    "the checkpoint saved from the bfloat16 model holds bfloat16 tensors",
)

# %%
# Clean up
# --------

import shutil

shutil.rmtree(WORK_DIR, ignore_errors=True)
print(f"removed {WORK_DIR}: {not os.path.exists(WORK_DIR)}")

# %%
# What to read next
# -----------------
# * :ref:`sphx_glr_recipes_partial_load_recipe.py`: what is in a checkpoint,
#   load only the model, fine-tune with a new head, skip and rename keys.
# * :ref:`sphx_glr_recipes_torchrun_restart_recipe.py`: resume on another
#   number of ranks under ``torchrun``.
