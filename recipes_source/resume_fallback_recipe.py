"""
Resume: a checkpoint that fails to load, and bad input
======================================================

The loop of :ref:`sphx_glr_recipes_resume_recipe.py` (the same code), on a
newest checkpoint that passes ``verify_checkpoint`` and still fails to load
(set aside: the run resumes from the one before, and a restart does not pick
it again), on input that is wrong from the start (it fails at once with its
cause), and as a training script for ``torchrun``.

.. grid:: 2

    .. grid-item-card:: :octicon:`mortar-board;1em;` What you will learn
       :class-card: card-prerequisites

       * Fall back to the previous complete checkpoint when the newest fails
         to load, and set the bad one aside
       * Fail at once, on every rank, on a missing or unwritable root, a bad
         ``keep`` and another model's checkpoint
       * Run the loop as a training script for ``torchrun``

    .. grid-item-card:: :octicon:`list-unordered;1em;` Prerequisites
       :class-card: card-prerequisites

       * PyTorch: see :doc:`/versions`
       * torchdata 0.11 (``StatefulDataLoader``)
       * CPU (gloo) or one GPU per rank (NCCL, plus gloo for checkpointing)
       * :ref:`sphx_glr_recipes_resume_recipe.py`: the loop, its kills and restarts
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
# The rules of :ref:`sphx_glr_recipes_default_stager_recipe.py` hold here too.

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
from page_tools import proofs, results
from rank_launcher import run_as_torchrun, run_on_one_process, run_on_ranks, shared_tempdir
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DistributedSampler, TensorDataset
from torchdata.stateful_dataloader import StatefulDataLoader

WORK_DIR = shared_tempdir("dcp-resume-fallback-")
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
# The resume recipe's run: 60 steps, a save every 10, keeping the newest 2.


def new_root(name):
    path = os.path.join(WORK_DIR, name)
    os.makedirs(path, exist_ok=True)  # under torchrun every rank runs this
    return path


uninterrupted_root = new_root("uninterrupted")

# %%

with proofs.state_given_to(dcp, "async_save") as uninterrupted_saves:
    uninterrupted = run_on_ranks(train, uninterrupted_root)

# %%
# A checkpoint that fails to load
# -------------------------------
# A file of the newest checkpoint, step 60, overwritten with zeros (its size
# unchanged, so ``verify_checkpoint`` passes it): ``dcp.load`` fails on it, on
# every rank. The next start sets it aside and resumes from step 50; without
# that, every restart would pick it again and fail the same way (a file that
# cannot be read at all, or is cut short, ``verify_checkpoint`` catches first).


def zero_a_file(checkpoint_dir, name="__0_0.distcp"):
    path = os.path.join(checkpoint_dir, name)
    with open(path, "r+b") as file:
        file.write(bytes(os.path.getsize(path)))


run_on_one_process(zero_a_file, step_dir(uninterrupted_root, 60))

# %%
# The page compares the state at the new step-60 save with the uninterrupted run's:

with proofs.state_given_to(dcp, "async_save") as fallback_saves:
    after_fallback = run_on_ranks(train, uninterrupted_root)
proofs.same_state("fallback-state", uninterrupted_saves, fallback_saves, "step 60 again")
results.claim(
    "unreadable-checkpoint-set-aside",
    os.path.isdir(f"{step_dir(uninterrupted_root, 60)}.unreadable")
    and min(after_fallback[0]) == 51,
    "step 60 failed to load and was set aside; the run resumed from step 50",
    steps=sorted(after_fallback[0]),
)

# %%
# Bad input
# ---------
# A root that does not exist, one nobody can write to (``/proc`` on Linux,
# where even root cannot create files), ``keep`` below 1, and a step directory
# saved by another model: each fails at once, on every rank, with its cause.


def try_bad_input(work_dir):
    other_model_root = os.path.join(work_dir, "other-model")
    other_model = {"app": {"model": nn.Linear(4, 4).state_dict()}}
    dcp.save(other_model, checkpoint_id=step_dir(other_model_root, 10))
    errors = []
    cases = [(f"{work_dir}/no-such-dir", 2), ("/proc", 2), (work_dir, 0), (other_model_root, 2)]
    for root, keep in cases:
        try:
            train(root, keep=keep)
        except (ValueError, OSError, RuntimeError) as err:
            errors.append((type(err).__name__, str(err).replace(work_dir, "...")))
    if dist.get_rank() == 0:
        for kind, message in errors:
            print(textwrap.fill(f"{kind}: {message}", 80, subsequent_indent="    "))
    return errors


bad_input_errors = run_on_ranks(try_bad_input, new_root("bad-input"))

# %%

results.claim(
    "bad-input-fails-at-once",
    all(
        [kind for kind, _ in errors]
        == ["FileNotFoundError", "PermissionError", "ValueError", "RuntimeError"]
        for errors in bad_input_errors
    ),
    f"each of {len(bad_input_errors)} ranks raised {', '.join(k for k, _ in bad_input_errors[0])}",
    raised=[[kind for kind, _ in errors] for errors in bad_input_errors],
)

# %%
# The same, as a training script for ``torchrun``
# -----------------------------------------------
# In your own job ``torchrun`` starts the ranks, and ``main()`` does what
# ``run_on_ranks`` did above: set this rank's device, create the process group,
# train, destroy the group. The checkpoint root is a path every rank sees
# (``shared_tempdir`` made one here; on several machines, a shared file
# system). Save it as ``train.py`` with the functions above, and:
#
# .. code-block:: bash
#
#    torchrun --nproc-per-node=2 train.py
#
# The cell runs ``main()`` as ``torchrun`` would, on ranks with torchrun's
# environment and no process group yet. For ``torchrun --max-restarts``, which
# starts the workers again after a crash, start torchrun with
# ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` on every node:
# :ref:`sphx_glr_recipes_torchrun_restart_recipe.py`. ``torchrun`` stops all
# workers before it starts new ones; a scheduler may relaunch a job while old
# ranks still write. There, name the directories with the job or attempt id
# (a root per launch), so that start-up clean-up and saves touch only this
# launch's own, and read older launches' checkpoints only to resume.


def main(checkpoint_root):
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo")
    try:
        train(checkpoint_root)
        dist.barrier()  # no rank tears gloo down while another one still sends
    finally:
        dist.destroy_process_group()


# %%

with proofs.state_given_to(dcp, "async_save") as main_saves:
    run_as_torchrun(main, new_root("torchrun"))
proofs.same_state("main-under-torchrun", uninterrupted_saves, main_saves, "main(), step 60")

# %%
# Clean up
# --------

shutil.rmtree(WORK_DIR, ignore_errors=True)
print(f"removed {WORK_DIR}: {not os.path.exists(WORK_DIR)}")


# %%
# What to read next
# -----------------
# * :ref:`sphx_glr_recipes_verify_checkpoint_recipe.py`: what ``verify_checkpoint``
#   checks, and the checkpoint it is there for.
# * :ref:`sphx_glr_recipes_torchrun_restart_recipe.py`: the same resume when
#   ``torchrun`` restarts the job, and on another number of ranks.
# * :doc:`/troubleshooting`: symptoms and fixes for the usual DCP failures.
