"""
On a GPU: the stager's stream does not wait for yours
=====================================================

With :class:`~torch.distributed.checkpoint.staging.DefaultStager`, async
staging and non-blocking copies (this site's choice on a GPU), the stager
copies the state to host memory on a CUDA stream of its own. Nothing orders
those copies after the kernels your loop has queued on its own stream: a loop
that calls ``dcp.async_save`` right after ``optimizer.step()`` can save weights
that the step has not written yet. This recipe runs that loop with the GPU
behind the host, as a busy GPU is, shows what its checkpoints hold, kind by
kind, and proves the fix, one synchronisation, bit-exact.

.. grid:: 2

    .. grid-item-card:: :octicon:`mortar-board;1em;` What you will learn
       :class-card: card-prerequisites

       * Why a stager with its own stream can copy tensors before the kernels
         that compute them have run
       * What such a checkpoint holds: weights and Adam's moments from before
         the step, Adam's step counters from after it
       * The fix: synchronise the compute stream right before ``async_save``,
         after building the state dict
       * The loop as a training script for ``torchrun``

    .. grid-item-card:: :octicon:`list-unordered;1em;` Prerequisites
       :class-card: card-prerequisites

       * PyTorch: see :doc:`/versions`
       * One GPU per rank (NCCL, plus gloo for checkpointing) for the race; on
         CPU (gloo) there is no stream, and the page shows no race
       * :ref:`sphx_glr_recipes_default_stager_recipe.py`: ``DefaultStager`` and
         ``StagingOptions``
"""

# %%
# Setup
# -----
# The staging options come from the machine, as on every page of this site:
# pinned memory and non-blocking copies only on a GPU, shared memory only for
# a checkpoint *process* (this page uploads from a thread).
#
# .. versionadded:: 2.9
#    ``DefaultStager``, ``StagingOptions`` and ``AsyncSaveResponse``.

import dataclasses
import functools
import os
import shutil

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from page_tools import faults, proofs, ranks, results
from rank_launcher import run_as_torchrun, run_on_ranks, shared_tempdir
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict import get_state_dict

WORK_DIR = shared_tempdir("dcp-stager-stream-")
SAVES = 6  # every loop below saves this many times


def staging_options(use_async_staging, checkpoint_process=False):
    """How every save on this page stages its copy, chosen from the machine."""
    on_gpu = torch.accelerator.is_available()
    return StagingOptions(
        use_pinned_memory=on_gpu,  # page-locked memory only speeds up copies from a device
        use_shared_memory=checkpoint_process,  # only a checkpoint *process* reads it in place
        use_async_staging=use_async_staging,
        use_non_blocking_copy=on_gpu,
    )


print(f"torch {torch.__version__}; checkpoints go under {WORK_DIR}")
for option, value in dataclasses.asdict(staging_options(use_async_staging=True)).items():
    print(f"{option} = {value}")


# %%
# The model, the data and the state
# ---------------------------------
# A small model trained with Adam, so the checkpoint holds weights, Adam's two
# moments and its step counters. Every rank holds the same replica and trains
# on the same batches, so a checkpoint has exactly one right answer. The
# checkpoints go through a gloo group of their own, and a writer that copies
# nothing ahead from a GPU (``host_writer``): the stager's copy is on the host
# already, and a writer that copied ahead would build a stream, so a CUDA
# context, on GPU 0 from the upload thread. ``run_loop`` gives a loop
# a model with one step of training behind it (so that Adam has state), a
# data stream, and one ``DefaultStager`` reused for every save.

WIDTH, CLASSES, BATCH = 256, 8, 32


def device_for_this_rank():
    # The launcher (or your own set-up code) has already picked this rank's GPU.
    if torch.accelerator.is_available():
        return torch.accelerator.current_accelerator()
    return torch.device("cpu")


def make_model():
    return nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.ReLU(), nn.Linear(WIDTH, CLASSES))


def build_model(seed=0):
    torch.manual_seed(seed)
    model = make_model().to(device_for_this_rank())
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def batches(seed=1):
    generator = torch.Generator().manual_seed(seed)
    while True:
        yield torch.randn(BATCH, WIDTH, generator=generator).to(device_for_this_rank())


def train_step(model, optimizer, batch):
    optimizer.zero_grad()
    model(batch).pow(2).mean().backward()
    optimizer.step()


def checkpoint_state(model, optimizer):
    """The state dict to save: references to the live tensors, no copy."""
    model_state_dict, optimizer_state_dict = get_state_dict(model, optimizer)
    return {"model": model_state_dict, "optim": optimizer_state_dict}


@functools.cache
def checkpoint_group():
    # Created on first use, on every rank in the same order (a collective).
    return dist.new_group(backend="gloo")


def host_writer(path):
    """The writer for a state the stager has copied to the host: nothing to copy ahead."""
    return FileSystemWriter(path, per_thread_copy_ahead=0)  # no CUDA context on GPU 0


def run_loop(loop, saves=SAVES, checkpoints_under=WORK_DIR):
    model, optimizer = build_model()
    data = batches()
    train_step(model, optimizer, next(data))
    stager = DefaultStager(staging_options(use_async_staging=True))  # after set_device
    checkpoint_dir = os.path.join(checkpoints_under, loop.__name__)  # a directory per save in it
    try:
        loop(model, optimizer, data, stager, checkpoint_dir, saves)
    finally:
        stager.close()
    if dist.get_rank() == 0:
        print(f"{loop.__name__}: {len(os.listdir(checkpoint_dir))} checkpoints")
    return checkpoint_dir


for name, tensor in make_model().state_dict().items():
    print(f"{name:<10} {str(tensor.dtype):<14} {tuple(tensor.shape)}")


# %%
# The race, and the fix
# ---------------------
# ``optimizer.step()`` only queues its kernels on your stream and returns.
# With async staging and non-blocking copies, the stager queues its copies on
# a stream of its own, and nothing orders them after yours. Whether a copy
# overtakes the step depends on how far the GPU is behind the host; in a real
# job it is often far behind, which is what keeps it busy. The race needs both
# options: blocking copies in the stager's thread go on the device's default
# stream, behind the work queued there (where training runs unless you chose
# another stream), and synchronous staging waits for the whole device. On CPU
# there are no streams. The second loop is the fix: one line.


def save_without_synchronizing(model, optimizer, data, stager, checkpoint_dir, saves=SAVES):
    for save in range(saves):
        writer = host_writer(os.path.join(checkpoint_dir, f"save-{save}"))
        batch = next(data)
        train_step(model, optimizer, batch)  # queues the step's kernels and returns
        state = checkpoint_state(model, optimizer)
        # BUG: nothing orders the stager's copies after the step's kernels.
        response = dcp.async_save(
            state, storage_writer=writer, async_stager=stager, process_group=checkpoint_group()
        )
        response.staging_completion.result()
        response.upload_completion.result()


def synchronize_before_save(model, optimizer, data, stager, checkpoint_dir, saves=SAVES):
    for save in range(saves):
        writer = host_writer(os.path.join(checkpoint_dir, f"save-{save}"))
        batch = next(data)
        train_step(model, optimizer, batch)
        state = checkpoint_state(model, optimizer)
        if torch.accelerator.is_available():
            torch.accelerator.current_stream().synchronize()  # the stager does not wait
        response = dcp.async_save(
            state, storage_writer=writer, async_stager=stager, process_group=checkpoint_group()
        )
        response.staging_completion.result()
        response.upload_completion.result()


# %%
# First on CPU ranks, where there is no stream to race with: the loop without
# the synchronisation saves exactly there. The page keeps a copy of the state
# at every ``async_save`` call and compares every checkpoint with it, bit for
# bit, from the stager's second save on (on a machine without a GPU, these
# ranks are the ones below as well).

with proofs.saves_given_to(dcp, "async_save") as on_cpu, ranks.cpu_only():
    run_on_ranks(run_loop, save_without_synchronizing, SAVES, os.path.join(WORK_DIR, "cpu"))
cpu_ranks = proofs.every_checkpoint_as_saved(
    "no-stream-no-race", on_cpu, "CPU ranks, no sync", but_first=True, only_on="cpu"
)

# %%
# Then both loops on this machine's ranks, with the GPU kept half a second
# behind the host before each step from the stager's second save on: the
# stager's first save registers its host buffers with CUDA, which waits for
# the device, as at the first save of any run; from then on a save waits for
# nothing. It is a race all the same: in 4 runs on an H200 (torch 2.11), two
# had a checkpoint that caught part of the state before the step, or none.

# 10**9 GPU clock cycles of spin work before each step: about half a second.
with proofs.saves_given_to(dcp, "async_save") as unsynced, faults.device_behind_before_steps(10**9):
    run_on_ranks(run_loop, save_without_synchronizing)
with proofs.saves_given_to(dcp, "async_save") as synced, faults.device_behind_before_steps(10**9):
    run_on_ranks(run_loop, synchronize_before_save)
without_sync = proofs.every_checkpoint_torn(
    "stream-race-torn-without-sync",
    unsynced,
    differ=proofs.named("weight", "bias", "exp_avg", "exp_avg_sq"),  # not the step counters
    but_first=True,
    only_on="cuda",
    raced=True,  # which tensors a checkpoint catches before the step: a race
)
with_sync = proofs.every_checkpoint_as_saved("stream-race-exact-with-sync", synced, but_first=True)

# %%
# What the checkpoints hold from before the step, kind by kind:

here = "/".join(proofs.devices(unsynced)) + " ranks"
before = proofs.by_kind(without_sync, proofs.ADAM_STATE)
results.record(
    "headline",
    {
        "checkpoints": len(without_sync),
        "torn without sync": proofs.torn(without_sync),
        "torn with sync": proofs.torn(with_sync),
        **{f"{kind} from before": differed for kind, (differed, _) in before.items()},
    },
)
proofs.by_kind_table(
    {
        f"without the synchronisation, {here}": without_sync,
        f"with it, {here}": with_sync,
        "without it, cpu ranks": cpu_ranks,
    },
    proofs.ADAM_STATE,
    "tensors from before the step, in the checkpoints from the stager's second save on",
)

# %%
# On a GPU, tensors on the device are copied before the step's kernels write
# them, while Adam's step counters live on the CPU, where the step updates
# them at once: a checkpoint with some of each is a state no run ever had.
# Nothing fails; a resumed run just does not continue where it stopped. The
# synchronisation costs the loop the time the GPU needs for the work already
# queued, once per save.
#
# Build the state dict before you synchronise. GPU work that the state dict
# call itself queues (clones, an offload, gathering full tensors) is covered
# only if it comes first, and ``async_save`` calls each ``Stateful``'s
# ``state_dict()`` after your synchronisation, inside the call: a ``Stateful``
# that queues GPU work there must synchronise at the end of its own
# ``state_dict()``.

# %%
# The loop as a training script for ``torchrun``
# ----------------------------------------------
# In your own job ``torchrun`` starts the ranks, and ``main()`` does what
# ``run_on_ranks`` did above: set the device, create the process group, run
# the loop, destroy the groups once every rank's last upload is done. Every
# rank must see the checkpoint directory (``shared_tempdir`` here; on several
# machines, a shared file system). Save it as ``train.py`` with the functions
# above, and:
#
# .. code-block:: bash
#
#    torchrun --nproc-per-node=2 train.py
#
# The cell runs ``main()`` as ``torchrun`` would, with the GPU kept behind as
# above, and the page checks every checkpoint.


def main(checkpoint_dir):
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo")
    checkpoint_group.cache_clear()  # a group made under an earlier default group is gone
    try:
        run_loop(synchronize_before_save, SAVES, checkpoint_dir)
        dist.barrier()  # every rank's last upload is done before the groups go
    finally:
        dist.destroy_process_group()


# %%

with (
    proofs.saves_given_to(dcp, "async_save") as saved,
    faults.device_behind_before_steps(10**9),
    proofs.writers_given_to(dcp) as writers,
):
    run_as_torchrun(main, os.path.join(WORK_DIR, "torchrun"))
proofs.every_checkpoint_as_saved("torchrun-exact", saved, "main(), torchrun", but_first=True)
proofs.no_copy_ahead("host-writer-copies-nothing-ahead", writers)

# %%
# Clean up
# --------

shutil.rmtree(WORK_DIR, ignore_errors=True)
print(f"removed {WORK_DIR}: {not os.path.exists(WORK_DIR)}")


# %%
# What to read next
# -----------------
# * :ref:`sphx_glr_recipes_staging_pitfalls_recipe.py`: four more ways an
#   overlapped save writes the wrong state, and their fixes.
# * :ref:`sphx_glr_recipes_default_stager_recipe.py`: the whole loop and the
#   full list of rules to paste into yours.
# * :doc:`/troubleshooting`: the same failures, starting from the symptoms.
