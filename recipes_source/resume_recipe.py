"""
Resume after a crash
====================

Checkpoints exist so that a job that dies can go on. This recipe builds a
training loop that saves everything a resume needs with ``dcp.async_save`` and
a ``DefaultStager``, keeps the newest K checkpoints, and counts a step as saved
only when ``verify_checkpoint`` passes it. Then it kills a rank for real (``SIGKILL``,
in the middle of an upload and during staging), launches the job again, and
shows that it goes on with the same loss at every step and the same state, bit
for bit, as a run that never crashed. A checkpoint that fails to load, bad
input and the loop as a ``torchrun`` script:
:ref:`sphx_glr_recipes_resume_fallback_recipe.py`; restarts by ``torchrun``
itself: :ref:`sphx_glr_recipes_torchrun_restart_recipe.py`.

.. grid:: 2

    .. grid-item-card:: :octicon:`mortar-board;1em;` What you will learn
       :class-card: card-prerequisites

       * What a checkpoint must hold for a resume to continue the loss curve:
         model, optimizer, LR scheduler, step, each rank's RNG and data position
       * One directory per save, "complete" meaning ``verify_checkpoint``
         passes, and keep-latest-K clean-up that never deletes the last good one
       * Recognise and remove torn checkpoints that a crash leaves behind

    .. grid-item-card:: :octicon:`list-unordered;1em;` Prerequisites
       :class-card: card-prerequisites

       * PyTorch: see :doc:`/versions`
       * torchdata 0.11 (``StatefulDataLoader``)
       * CPU (gloo) or one GPU per rank (NCCL, plus gloo for checkpointing)
       * :ref:`sphx_glr_recipes_default_stager_recipe.py`: an overlapped save
"""

# %%
# The rules, to paste into your loop
# ----------------------------------
#
# .. code-block:: python
#
#    # Resuming after a crash:
#    # 1. Save all the next step depends on: model and optimizer (get_state_dict),
#    #    LR scheduler, step, each rank's RNG states and data position.
#    # 2. Per-rank values go under a per-rank key (f"rank{rank}"): DCP saves a
#    #    value that every rank puts under the same key once.
#    # 3. One directory per save (step-00000040/); it is complete only when its
#    #    .metadata exists and verify_checkpoint() passes: every tensor whole,
#    #    every file with its bytes.
#    # 4. Delete an older checkpoint only once a newer one is complete, keep the
#    #    newest K >= 1, never the save in flight, and delete .metadata first.
#    # 5. On start, rank 0 removes torn directories, picks the newest complete
#    #    one, and broadcasts its choice; one that fails to load is set aside.
#    # 6. Restore the RNG states last, after building the data iterator.
#    # 7. Test it: kill a rank (SIGKILL) in a save, compare with a run that
#    #    never crashed, bit for bit.
#
# The rules of an overlapped save (``staging_completion`` before ``optimizer.step()``,
# ``upload_completion`` before the next save) hold here too.

# %%
# Setup
# -----

import concurrent.futures
import itertools
import math
import os
import pickle
import re
import shutil
import tempfile
import textwrap
import warnings

import fsspec
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
import torch.nn.functional as F
from page_tools import faults, figures, observe, proofs
from rank_launcher import RankFailedError, run_on_ranks, shared_tempdir
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DistributedSampler, TensorDataset
from torchdata.stateful_dataloader import StatefulDataLoader

WORK_DIR = shared_tempdir("dcp-resume-")
print(f"torch {torch.__version__}; checkpoints go under {WORK_DIR}")


# %%
# Staging options from what the machine has
# -----------------------------------------
# As on every page of this site: pinned memory and non-blocking copies only
# with an accelerator, shared memory only for a checkpoint process.
#
# .. versionadded:: 2.9
#    ``DefaultStager`` and ``StagingOptions``.


def staging_options(use_async_staging, checkpoint_process=False):
    """How every save on this page stages its copy, chosen from the machine."""
    on_gpu = torch.accelerator.is_available()
    return StagingOptions(
        use_pinned_memory=on_gpu,  # page-locked memory only speeds up copies from a device
        use_shared_memory=checkpoint_process,  # only a checkpoint *process* reads it in place
        use_async_staging=use_async_staging,
        use_non_blocking_copy=on_gpu,
    )


print(textwrap.fill(str(staging_options(use_async_staging=True)), 80, subsequent_indent="    "))


# %%
# The model, the optimizer and the LR scheduler
# ---------------------------------------------
# A small MLP with dropout, so that every step draws from the RNG: a resume that
# does not restore the RNG state would draw other dropout masks and leave the
# curve. FSDP2 shards it; Adam and a cosine LR schedule train it.

FEATURES, HIDDEN, LR = 32, 256, 3e-3


class DropoutMLP(nn.Module):
    def __init__(self, features=FEATURES, hidden=HIDDEN):
        super().__init__()
        layers = [nn.Linear(features, hidden), nn.ReLU(), nn.Dropout(0.2)]
        layers += [nn.Linear(hidden, hidden), nn.ReLU(), nn.Dropout(0.2), nn.Linear(hidden, 1)]
        self.net = nn.Sequential(*layers)

    def forward(self, x):
        return self.net(x)


def build_training(num_steps):
    torch.manual_seed(0)  # the same initial weights on every rank and in every launch
    model = DropoutMLP().to(device_for_this_rank())
    fully_shard(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=LR)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=num_steps)
    torch.manual_seed(1000 + dist.get_rank())  # each rank's own dropout masks
    return model, optimizer, scheduler


print(f"{sum(p.numel() for p in DropoutMLP().parameters()):,} parameters")


# %%
# ``AppState`` is the ``Stateful`` wrapper for model and optimizer that every
# page of this site uses, and ``device_for_this_rank`` the same helper.


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


# %%
# The data and its position
# -------------------------
# One shuffled pass over a small data set, each rank reading its share
# (``DistributedSampler``). torchdata's ``StatefulDataLoader`` is a
# ``DataLoader`` with ``state_dict()``: it records the samples each rank's
# loader yielded, and skips that many on load: right on the same ranks, not on
# another number of them (:ref:`sphx_glr_recipes_torchrun_restart_recipe.py`).

NUM_SAMPLES, GLOBAL_BATCH, DATA_SEED = 720, 12, 7
NUM_STEPS = NUM_SAMPLES // GLOBAL_BATCH  # one pass: 60 steps


def make_dataset():
    generator = torch.Generator().manual_seed(DATA_SEED)
    inputs = torch.randn(NUM_SAMPLES, FEATURES, generator=generator)
    return TensorDataset(inputs, inputs[:, :4].sum(dim=1, keepdim=True).sin())


def build_data_loader(dataset):
    sampler = DistributedSampler(dataset, shuffle=True, seed=DATA_SEED)
    with warnings.catch_warnings():  # torchdata 0.11 calls torch.set_vital, deprecated in 2.13
        warnings.filterwarnings("ignore", message="'set_vital' is deprecated")
        return StatefulDataLoader(
            dataset, batch_size=GLOBAL_BATCH // dist.get_world_size(), sampler=sampler
        )


# %%
# Everything else a resume needs
# ------------------------------
# One more ``Stateful``: the step and the LR scheduler (pickled: DCP keeps bytes
# as they are), the same on every rank, and what each rank has of its own, its
# data loader's position and RNG states, under a key with the rank in it (rule
# 2). On load it restores the loader, builds the data iterator, and only then
# the RNG states (rule 6).


def rng_states():
    states = {"torch": torch.get_rng_state()}  # CPU generator: dropout on CPU, torch.rand, ...
    if torch.accelerator.is_available():
        states["accelerator"] = torch.get_device_module().get_rng_state()
    return states  # add random.getstate() / numpy's if your loop draws from them


class LoopState(Stateful):
    def __init__(self, scheduler, data_loader):
        self.scheduler, self.data_loader = scheduler, data_loader
        self.key, self.step, self.data = f"rank{dist.get_rank()}", 0, None  # data: the iterator

    def state_dict(self):
        own = {"data_loader": pickle.dumps(self.data_loader.state_dict()), "rng": rng_states()}
        scheduler = pickle.dumps(self.scheduler.state_dict())
        return {"step": self.step, "scheduler": scheduler, self.key: own}

    def load_state_dict(self, state_dict):
        self.step, own = state_dict["step"], state_dict[self.key]
        self.scheduler.load_state_dict(pickle.loads(state_dict["scheduler"]))
        self.data_loader.load_state_dict(pickle.loads(own["data_loader"]))
        self.data = iter(self.data_loader)  # draws a base seed from torch's RNG...
        torch.set_rng_state(own["rng"]["torch"])  # ...so the RNG comes back after it
        if "accelerator" in own["rng"]:
            torch.get_device_module().set_rng_state(own["rng"]["accelerator"])


# %%
# The checkpoint directory
# ------------------------
# One directory per save, named by its step. DCP writes ``.metadata`` last; a
# directory without it is torn (a crash, or a save in flight). ``.metadata``
# alone can mislead (:ref:`sphx_glr_recipes_verify_checkpoint_recipe.py`), so
# "complete" is what that page's ``verify_checkpoint`` passes; it reads through
# fsspec, so an ``s3://`` root works too. Only rank 0 lists and deletes, never
# the directory of a save in flight (rule 4).

STEP_DIR = re.compile(r"^step-(\d{8})$")


class IncompleteCheckpointError(RuntimeError):
    pass


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


def verified(checkpoint_dir):
    try:
        verify_checkpoint(checkpoint_dir)
        return True
    except IncompleteCheckpointError:
        return False


def step_dir(checkpoint_root, step):
    return os.path.join(checkpoint_root, f"step-{step:08d}")


def saved_steps(checkpoint_root):
    """{step: complete?} for every step directory, oldest first."""
    steps = {}
    for name in sorted(os.listdir(checkpoint_root)):
        if match := STEP_DIR.match(name):
            steps[int(match.group(1))] = verified(os.path.join(checkpoint_root, name))
    return steps


def clean_up(checkpoint_root, keep, in_flight=None):
    """Remove torn directories and all but the newest ``keep`` complete ones."""
    steps = saved_steps(checkpoint_root)
    complete = [step for step, done in steps.items() if done]
    torn = [step for step, done in steps.items() if not done]
    doomed = torn + complete[: max(len(complete) - keep, 0)]
    doomed = [step for step in doomed if step_dir(checkpoint_root, step) != in_flight]
    for step in doomed:
        path = step_dir(checkpoint_root, step)
        if os.path.exists(os.path.join(path, ".metadata")):  # un-commit first: cut short,
            os.remove(os.path.join(path, ".metadata"))  # this leaves a torn directory
        shutil.rmtree(path)
    return doomed


def newest_complete_step(checkpoint_root):
    return max((step for step, done in saved_steps(checkpoint_root).items() if done), default=None)


# %%
# On start, rank 0 removes torn directories and picks the newest complete one
# (rule 5); every rank loads it. One that fails to load on any rank (DCP
# raises on every rank then) is renamed ``.unreadable``, out of the way of the
# next start, and the previous one is tried. Mistakes that would surface at the
# first save, or as a hang, fail at once with their cause.


def resume_from_newest(checkpoint_root, state, keep):
    while True:
        newest = [None]
        if dist.get_rank() == 0:
            removed = clean_up(checkpoint_root, keep)
            newest = [newest_complete_step(checkpoint_root)]
            print(f"removed {removed}; " if removed else "", end="")
            print(f"resuming from step {newest[0]}" if newest[0] else "no checkpoint: from step 1")
        dist.broadcast_object_list(newest, src=0)
        if newest[0] is None:
            return None
        path = step_dir(checkpoint_root, newest[0])
        try:
            dcp.load(state, checkpoint_id=path)
            return newest[0]
        except (Exception, CheckpointException) as err:  # DCP names the keys it misses
            missing = re.findall(r"Missing key in checkpoint state_dict: ([\w.]+)\.", str(err))
            cause = f"missing {sorted(set(missing))[:2]}" if missing else type(err).__name__
            if missing or not isinstance(err, CheckpointException):
                raise RuntimeError(f"{path} is not a checkpoint of this run: {cause}") from err
        dist.barrier()  # every rank is done with it
        if dist.get_rank() == 0:
            os.rename(path, f"{path}.unreadable")
            print(f"step {newest[0]}: {cause} on load; renamed {os.path.basename(path)}.unreadable")


def check_checkpoint_root(checkpoint_root, keep):
    if not isinstance(keep, int) or keep < 1:
        raise ValueError(f"keep={keep!r}: keep at least the newest complete checkpoint (keep >= 1)")
    if not os.path.isdir(checkpoint_root):
        raise FileNotFoundError(f"checkpoint root {checkpoint_root!r} does not exist")
    try:
        with tempfile.TemporaryFile(dir=checkpoint_root):
            pass
    except OSError as err:
        raise PermissionError(f"cannot write in checkpoint root {checkpoint_root!r}") from err


# %%
# The training loop
# -----------------
# The loop of the DefaultStager page, saving every ``SAVE_EVERY`` steps: each
# save starts once the one before it is complete, into its own directory, and
# rank 0 cleans up right after it started (rule 4), in a thread of its own:
# deleting in the loop would hold the other ranks in the next ``all_reduce``,
# and on a slow file system past the group's timeout (30 minutes by default;
# the torchrun-restart recipe's 120 s is that page's choice). Each save line
# lists the complete checkpoints then, and what the last clean-up removed.

SAVE_EVERY, KEEP = 10, 2


def train(checkpoint_root, num_steps=NUM_STEPS, keep=KEEP):
    check_checkpoint_root(checkpoint_root, keep)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model, optimizer, scheduler = build_training(num_steps)
    loop = LoopState(scheduler, build_data_loader(make_dataset()))
    state = {"app": AppState(model, optimizer), "loop": loop}
    resume_from_newest(checkpoint_root, state, keep)
    data = loop.data if loop.data is not None else iter(loop.data_loader)
    group = dist.new_group(backend="gloo")  # DCP's own group, as on the stager page
    stager = DefaultStager(staging_options(use_async_staging=True))
    device, response, losses, cleaning = device_for_this_rank(), None, {}, None
    deleter = concurrent.futures.ThreadPoolExecutor(1) if rank == 0 else None
    for step in range(loop.step + 1, num_steps + 1):
        inputs, targets = next(data)
        loss = F.mse_loss(model(inputs.to(device)), targets.to(device))
        optimizer.zero_grad()
        loss.backward()
        if response is not None:
            response.staging_completion.result()  # the copy is done: the weights may change
        optimizer.step()
        scheduler.step()
        loop.step = step
        mean_loss = loss.detach().clone()
        dist.all_reduce(mean_loss)
        losses[step] = mean_loss.item() / world_size
        if step % SAVE_EVERY == 0:
            if response is not None:
                response.upload_completion.result()  # the previous save is complete now
            removed = cleaning.result() if cleaning else []  # done long ago, as a rule
            path = step_dir(checkpoint_root, step)
            writer = dcp.FileSystemWriter(path, per_thread_copy_ahead=0)  # the copy is on the host
            response = dcp.async_save(
                state, storage_writer=writer, process_group=group, async_stager=stager
            )
            if rank == 0:
                kept = [s for s, done in saved_steps(checkpoint_root).items() if done]
                cleaning = deleter.submit(clean_up, checkpoint_root, keep, in_flight=path)
                print(f"step {step}: loss {losses[step]:.4f}; complete {kept}, removed {removed}")
    if response is not None:
        response.upload_completion.result()
    if deleter is not None:
        deleter.shutdown()  # waits for the last clean-up
    stager.close()
    dist.barrier(group=group)  # no rank tears the group down under another
    dist.destroy_process_group(group)
    if rank == 0:
        clean_up(checkpoint_root, keep)
        print(f"done at step {num_steps}; kept {list(saved_steps(checkpoint_root))}")
    return losses


# %%
# An uninterrupted run
# --------------------
# First the run to compare with: 60 steps, a save every 10, keeping the newest 2.


def new_root(name):
    path = os.path.join(WORK_DIR, name)
    os.makedirs(path, exist_ok=True)  # under torchrun every rank runs this
    return path


uninterrupted_root = new_root("uninterrupted")

# %%
# The page keeps what each rank gave every ``async_save``, to compare the
# resumed runs with, and checks the directories rank 0 found then:

with (
    proofs.state_given_to(dcp, "async_save") as uninterrupted_saves,
    observe.watch(dcp, "async_save", lambda _: saved_steps(uninterrupted_root), before=True) as at,
):
    uninterrupted = run_on_ranks(train, uninterrupted_root)
proofs.keeps_newest("keep-latest-k", at.by_rank[0], saved_steps(uninterrupted_root), 10, KEEP)

# %%
# Crash in the middle of an upload
# --------------------------------
# The same run, but the last rank (rank 1 of two) is killed with ``SIGKILL``
# after 64 KiB of its file of step 40, before rank 0 could write ``.metadata``.
# The launch fails, as a job whose rank was killed does, and leaves step 40
# torn; steps 20 and 30 are complete: clean-up removed step 10 only once step
# 30 was complete.


def run_until_it_fails(fn, *args):
    try:
        run_on_ranks(fn, *args)
    except RankFailedError as err:  # names the rank that failed, with what each rank printed
        print("the job failed:", str(err).split("Traceback")[0].rstrip())  # peers' errors aside
        return err


def show_checkpoints(checkpoint_root):
    for step, complete in saved_steps(checkpoint_root).items():
        path = step_dir(checkpoint_root, step)
        files = [f"{n} {os.path.getsize(os.path.join(path, n)):,} B" for n in os.listdir(path)]
        state = "complete" if complete else "TORN"
        print(f"step {step}: {state}: {', '.join(sorted(files)) or 'no files'}")


upload_root, staging_root = new_root("crash-in-upload"), new_root("crash-in-staging")

# %%
# When the site is built, the page kills the rank (a ``FileSystem`` stream that
# dies at that byte), keeps rank 0's loss at every step for the figure below,
# and checks the crash:

with (
    faults.kill_in_write(after_bytes=64 * 1024, path=r"step-00000040/.*\.distcp$") as upload_kill,
    observe.watch(dist, "all_reduce", lambda call: call.args[0].item()) as sums,
):
    upload_failure = run_until_it_fails(train, upload_root)
    show_checkpoints(upload_root)
faults.crashed_as_planned(
    "upload-crash", upload_kill, upload_failure, upload_root, torn=[40], complete=[20, 30]
)

# %%
# The restart: a second launch of the same function. Rank 0 removes the torn
# step 40, every rank loads step 30 and training goes on from step 31, to the
# same loss at every step and the same state at the last save (model,
# optimizer, scheduler, step, every rank's RNG and data position):

with proofs.state_given_to(dcp, "async_save") as upload_resumed_saves:
    after_upload = run_on_ranks(train, upload_root)
proofs.same_numbers("upload-crash-losses", uninterrupted[0], after_upload[0], "loss", range(31, 61))
proofs.same_state("upload-crash-state", uninterrupted_saves, upload_resumed_saves, "step 60")

# %%
# Crash during staging
# --------------------
# The last rank dies while the stager copies the state of step 40 to host
# memory, after three tensors: no file of step 40 exists yet. (Were rank 0
# stopped while it deletes an old checkpoint, that one would show up torn as
# well: clean-up removes ``.metadata`` first, so it never looks complete.)

with faults.kill_in_staging(staging=4, after_tensors=3) as staging_kill:
    staging_failure = run_until_it_fails(train, staging_root)
    show_checkpoints(staging_root)
faults.crashed_as_planned(
    "staging-crash", staging_kill, staging_failure, staging_root, torn=[40], complete=[20, 30]
)

# %%
# The restart, against the uninterrupted run:

with proofs.state_given_to(dcp, "async_save") as staging_resumed_saves:
    after_staging = run_on_ranks(train, staging_root)
proofs.same_numbers(
    "staging-crash-losses", uninterrupted[0], after_staging[0], "loss", range(31, 61)
)
proofs.same_state("staging-crash-state", uninterrupted_saves, staging_resumed_saves, "step 60")

# %%
# The loss curves
# ---------------
# The uninterrupted run, the run that crashed in the upload up to the kill,
# and its restart from step 30: the resumed curve lies on the uninterrupted
# one, step for step (checked above: the same float, not a close one).

figure = figures.loss_curves(
    {
        "uninterrupted": uninterrupted[0],
        "crashed run": {s + 1: x / len(uninterrupted) for s, x in enumerate(sums.by_rank[0])},
        "after the restart": after_upload[0],
    },
    {30: "resumed from\nstep 30", 40: "last rank killed in\nthe upload of step 40"},
)

# %%
# Clean up
# --------

shutil.rmtree(WORK_DIR, ignore_errors=True)
print(f"removed {WORK_DIR}: {not os.path.exists(WORK_DIR)}")


# %%
# What to read next
# -----------------
# * :ref:`sphx_glr_recipes_resume_fallback_recipe.py`: the same loop when its
#   newest checkpoint fails to load, on bad input, and as a ``torchrun`` script.
# * :ref:`sphx_glr_recipes_torchrun_restart_recipe.py`: the same resume when
#   ``torchrun`` restarts the job, and on another number of ranks.
# * :ref:`sphx_glr_recipes_staging_pitfalls_recipe.py`: what a save writes
#   when the rules of the overlapped save are broken.
# * :doc:`/troubleshooting`: symptoms and fixes for the usual DCP failures.
