"""
Resume after a crash
====================

Checkpoints exist so that a job that dies can go on. This recipe builds a
training loop that saves everything a resume needs with ``dcp.async_save`` and
a ``DefaultStager``, keeps the newest K checkpoints, and counts a step as saved
only when its ``.metadata`` exists. Then it kills a rank for real (``SIGKILL``
in the middle of an upload, during staging, and between saves), restarts the
job (a second launch here, and ``torchrun --max-restarts=1``), and proves that
the resumed run gives the same loss at every step and the same final model and
optimizer state, bit for bit, as a run that never crashed. Last, it resumes on
a different number of ranks and shows what that does to the data position.

.. grid:: 2

    .. grid-item-card:: :octicon:`mortar-board;1em;` What you will learn
       :class-card: card-prerequisites

       * What a checkpoint must hold for a resume to continue the loss curve:
         model, optimizer, LR scheduler, step, every rank's RNG and data
         position
       * One directory per save, "complete" meaning ``.metadata`` exists, and
         keep-latest-K clean-up that never deletes the last good checkpoint
       * Recognise and remove torn checkpoints that a crash leaves behind
       * Restart under ``torchrun --max-restarts=1`` with a process group that
         survives the restart
       * Resume on more or fewer ranks without seeing a sample twice

    .. grid-item-card:: :octicon:`list-unordered;1em;` Prerequisites
       :class-card: card-prerequisites

       * PyTorch 2.9 or later, torchdata 0.11 (``StatefulDataLoader``); not
         torch 2.11.0, whose ``DefaultStager`` cannot be reused
         (:ref:`reused-stager-keyerror`)
       * CPU (gloo) or one GPU per rank (NCCL, plus gloo for checkpointing)
       * :ref:`sphx_glr_recipes_default_stager_recipe.py`: the rules of an
         overlapped save

As on every page of this site, code that runs on every rank is launched by
``run_on_ranks``, which starts the ranks (or uses the ones ``torchrun`` made)
and prints what each rank printed, labelled ``[rankN]``. The functions it runs
are plain DCP code for a training script started with ``torchrun``. Every
crash below really happens when this page is built: a rank process is killed
with ``SIGKILL``, at the same point every time.
"""

# %%
# The rules, to paste into your loop
# ----------------------------------
#
# .. code-block:: python
#
#    # Resuming after a crash:
#    # 1. Save everything the next step depends on: model and optimizer
#    #    (get_state_dict), LR scheduler, step, every RNG the loop draws from on
#    #    each rank, each rank's data position, and a global sample index.
#    # 2. Per-rank values go under a per-rank key (f"rank{rank}"): DCP saves a
#    #    value that every rank puts under the same key once.
#    # 3. One directory per save (step-00000040/). A step is saved only when its
#    #    .metadata exists: DCP writes it last, after every rank's data.
#    # 4. Delete an older checkpoint only after a newer one is complete
#    #    (upload_completion.result() returned), keep the newest K >= 1, and
#    #    never touch the directory of the save in flight.
#    #    Delete .metadata first: a deletion cut short by a crash then leaves a
#    #    torn directory, never one that looks complete with files missing.
#    # 5. On start, rank 0 picks the newest directory with .metadata, removes
#    #    the torn ones (no .metadata), and broadcasts its choice.
#    # 6. Restore the RNG states last, after building the data iterator
#    #    (creating one draws a seed from torch's RNG).
#    # 7. Under torchrun restarts, create the process group on a store prefixed
#    #    by TORCHELASTIC_RESTART_COUNT: the agent's store outlives the workers.
#    # 8. On another number of ranks, per-rank data positions do not fit:
#    #    continue the data order from the global sample index.
#    # 9. Test the resume: kill a rank (SIGKILL) in the middle of a save and
#    #    compare with an uninterrupted run, bit for bit.
#
# The rules of an overlapped save (wait for ``staging_completion`` before
# ``optimizer.step()``, for ``upload_completion`` before the next save) come
# from :ref:`sphx_glr_recipes_default_stager_recipe.py` and hold here too.

# %%
# Setup
# -----

# sphinx_gallery_start_ignore
import os

# Page-only: the restart probe's worker. The page runs this file under torchrun
# with this variable set, to count failed restarts; it needs nothing below.
PROBE_ENV = "RESUME_RECIPE_RESTART_PROBE"


def restart_probe_worker(mode):
    import datetime
    import signal
    import sys

    import torch.distributed as dist

    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    last = int(os.environ["TORCHELASTIC_MAX_RESTARTS"])
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    timeout = datetime.timedelta(seconds=5)  # a failed restart fails fast
    if mode == "plain":
        dist.init_process_group("gloo", timeout=timeout)
    else:
        store = dist.TCPStore(
            os.environ["MASTER_ADDR"],
            int(os.environ["MASTER_PORT"]),
            is_master=False,
            timeout=timeout,
        )
        store = dist.PrefixStore(f"attempt-{attempt}", store)
        dist.init_process_group(
            "gloo", store=store, rank=rank, world_size=world_size, timeout=timeout
        )
    dist.barrier()
    if rank == 0:
        print(f"probe attempt {attempt}: the group formed", flush=True)
    if attempt < last and rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    dist.barrier()
    dist.destroy_process_group()
    sys.exit(0)


if __name__ == "__main__" and os.environ.get(PROBE_ENV):
    restart_probe_worker(os.environ[PROBE_ENV])
# sphinx_gallery_end_ignore

import datetime
import os
import pickle
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
import torch.nn.functional as F
from rank_launcher import RankFailedError, run_on_ranks, shared_tempdir, under_torchrun
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.fsdp import fully_shard
from torch.utils.data import Sampler, TensorDataset
from torchdata.stateful_dataloader import StatefulDataLoader

print(f"torch {torch.__version__}")
# sphinx_gallery_start_ignore
import logging  # page-only: the crashes and the checks

from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.state_dict import StateDictOptions
from torch.distributed.tensor import DTensor

# A launch whose rank was killed stops the others; torch logs each as a warning.
logging.getLogger("torch.multiprocessing.spawn").setLevel(logging.ERROR)

# sphinx_gallery_end_ignore


# %%
# Staging options from what the machine has
# -----------------------------------------
# The same rule as on every page of this site: pinned memory and non-blocking
# copies only with an accelerator, shared memory off (the upload runs in a
# thread, not a checkpoint process), staging in the stager's thread.
#
# .. versionadded:: 2.9
#    ``DefaultStager`` and ``StagingOptions``.


def staging_options():
    on_gpu = torch.accelerator.is_available()
    return StagingOptions(
        use_pinned_memory=on_gpu,  # page-locked memory only speeds up copies from a device
        use_shared_memory=False,  # only a checkpoint *process* reads shared memory in place
        use_async_staging=True,
        use_non_blocking_copy=on_gpu,
    )


print(staging_options())


# %%
# The model, the optimizer and the LR scheduler
# ---------------------------------------------
# A small MLP with dropout, so that the loop draws from the RNG at every step:
# a resume that does not restore the RNG state would draw other dropout masks
# and leave the curve. FSDP2 shards it over the ranks; Adam and a cosine LR
# schedule train it. ``AppState`` is the usual ``Stateful`` wrapper for model
# and optimizer.

FEATURES, HIDDEN = 32, 256
MODEL_SEED = 0


class ToyModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(FEATURES, HIDDEN),
            nn.ReLU(),
            nn.Dropout(0.2),
            nn.Linear(HIDDEN, HIDDEN),
            nn.ReLU(),
            nn.Dropout(0.2),
            nn.Linear(HIDDEN, 1),
        )

    def forward(self, x):
        return self.net(x)


class AppState(Stateful):
    """Model and optimizer as one checkpointable object."""

    def __init__(self, model, optimizer):
        self.model = model
        self.optimizer = optimizer

    def state_dict(self):
        model_state_dict, optimizer_state_dict = get_state_dict(self.model, self.optimizer)
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


def build_training(num_steps):
    torch.manual_seed(MODEL_SEED)  # the same initial weights on every rank and every launch
    model = ToyModel().to(device_for_this_rank())
    fully_shard(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=num_steps)
    torch.manual_seed(1000 + dist.get_rank())  # each rank's own dropout masks
    return model, optimizer, scheduler


print(f"{sum(p.numel() for p in ToyModel().parameters()):,} parameters")


# %%
# The data and its position
# -------------------------
# One shuffled pass over a small data set, cut into global batches of
# ``GLOBAL_BATCH`` samples: at every step the ranks together take the next
# ``GLOBAL_BATCH`` samples of one global order, each rank ``GLOBAL_BATCH /
# world_size`` of them. Keeping the global batch fixed keeps the training the
# same on any number of ranks, and it gives the data position a meaning that
# does not depend on the ranks: the *global sample index*, how many samples of
# the order all ranks together have trained on.
#
# ``StatefulDataLoader`` from torchdata is a ``DataLoader`` with
# ``state_dict()`` and ``load_state_dict()``: it records how far each rank's
# loader got (and, with workers, their state), and fast-forwards to there on
# load. torchdata 0.11 calls ``torch.set_vital``, which torch 2.13 deprecates:
# the one warning it raises is silenced where the loader is built.

NUM_SAMPLES, GLOBAL_BATCH = 720, 12
DATA_SEED = 7
NUM_STEPS = NUM_SAMPLES // GLOBAL_BATCH  # one pass: 60 steps


def make_dataset():
    generator = torch.Generator().manual_seed(DATA_SEED)
    inputs = torch.randn(NUM_SAMPLES, FEATURES, generator=generator)
    targets = inputs[:, :4].sum(dim=1, keepdim=True).sin()
    return TensorDataset(inputs, targets, torch.arange(NUM_SAMPLES))  # the index, to count


class GlobalOrderSampler(Sampler):
    """This rank's share of one shuffled global order, from global sample ``start`` on."""

    def __init__(self, num_samples, rank, world_size, start=0):
        generator = torch.Generator().manual_seed(DATA_SEED)
        self.order = torch.randperm(num_samples, generator=generator).tolist()
        self.rank, self.world_size, self.start = rank, world_size, start

    def __iter__(self):
        return iter(self.order[self.start + self.rank :: self.world_size])

    def __len__(self):
        return len(self.order[self.start + self.rank :: self.world_size])


def build_data_loader(dataset, samples_seen=0):
    rank, world_size = dist.get_rank(), dist.get_world_size()
    sampler = GlobalOrderSampler(len(dataset), rank, world_size, start=samples_seen)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="'set_vital' is deprecated")
        return StatefulDataLoader(dataset, batch_size=GLOBAL_BATCH // world_size, sampler=sampler)


# %%
# Everything else a resume needs
# ------------------------------
# Two more ``Stateful`` objects. ``Progress`` holds what is the same on every
# rank: the step, the global sample index, the number of ranks that saved, and
# the LR scheduler. ``RankState`` holds what each rank has of its own: its
# data loader's position and its RNG states, under a key with the rank in it
# (rule 2). On load it restores the loader, builds the data iterator, and only
# then the RNG states (rule 6). ``state_dict()`` returns fresh values each
# time: the stager copies them in the background, while the loop goes on.


class Progress(Stateful):
    def __init__(self, scheduler):
        self.scheduler = scheduler
        self.step = 0
        self.samples_seen = 0
        self.world_size = dist.get_world_size()

    def state_dict(self):
        return {
            "step": self.step,
            "samples_seen": self.samples_seen,
            "world_size": dist.get_world_size(),
            "scheduler": pickle.dumps(self.scheduler.state_dict()),
        }

    def load_state_dict(self, state_dict):
        self.step = state_dict["step"]
        self.samples_seen = state_dict["samples_seen"]
        self.world_size = state_dict["world_size"]
        self.scheduler.load_state_dict(pickle.loads(state_dict["scheduler"]))


def rng_states():
    states = {"torch": torch.get_rng_state()}  # CPU generator: dropout on CPU, torch.rand, ...
    if torch.accelerator.is_available():
        states["accelerator"] = torch.get_device_module().get_rng_state()
    return states  # add random.getstate() / numpy's if your loop draws from them


class RankState(Stateful):
    def __init__(self, data_loader):
        self.data_loader = data_loader
        self.data = None  # the iterator, built on load (or by the loop)
        self.key = f"rank{dist.get_rank()}"

    def state_dict(self):
        return {
            self.key: {
                "data_loader": pickle.dumps(self.data_loader.state_dict()),
                "rng": rng_states(),
            }
        }

    def load_state_dict(self, state_dict):
        saved = state_dict[self.key]
        self.data_loader.load_state_dict(pickle.loads(saved["data_loader"]))
        self.data = iter(self.data_loader)  # draws a base seed from torch's RNG...
        torch.set_rng_state(saved["rng"]["torch"])  # ...so the RNG comes back after it
        if "accelerator" in saved["rng"]:
            torch.get_device_module().set_rng_state(saved["rng"]["accelerator"])


# %%
# The checkpoint directory
# ------------------------
# One directory per save, named by its step. DCP writes ``.metadata`` last (to
# a temporary name, renamed when written), after every rank reported its data
# written: a directory with ``.metadata`` is complete, one without is torn (a
# crash or a save still in flight). Only rank 0 lists and deletes, and only
# while no save of its is running in the directories it deletes (rule 4).

STEP_DIR = re.compile(r"^step-(\d{8})$")


def step_dir(checkpoint_root, step):
    return os.path.join(checkpoint_root, f"step-{step:08d}")


def is_complete(path):
    return os.path.exists(os.path.join(path, ".metadata"))


def saved_steps(checkpoint_root):
    """{step: complete?} for every step directory, oldest first."""
    steps = {}
    for name in sorted(os.listdir(checkpoint_root)):
        match = STEP_DIR.match(name)
        if match:
            steps[int(match.group(1))] = is_complete(os.path.join(checkpoint_root, name))
    return steps


def newest_complete_step(checkpoint_root):
    complete = [step for step, done in saved_steps(checkpoint_root).items() if done]
    return max(complete, default=None)


def clean_up(checkpoint_root, keep, in_flight=None):
    """Remove torn directories and all but the newest ``keep`` complete ones."""
    steps = saved_steps(checkpoint_root)
    complete = [step for step, done in steps.items() if done]
    torn = [step for step, done in steps.items() if not done]
    doomed = torn + complete[: max(len(complete) - keep, 0)]
    doomed = [step for step in doomed if step_dir(checkpoint_root, step) != in_flight]
    for step in doomed:
        path = step_dir(checkpoint_root, step)
        if is_complete(path):  # un-commit first: cut short, this leaves a torn directory
            os.remove(os.path.join(path, ".metadata"))
        shutil.rmtree(path)
    return doomed


def check_checkpoint_root(checkpoint_root, keep):
    """Fail at once, with the cause, instead of at the first save."""
    if not isinstance(keep, int) or keep < 1:
        raise ValueError(f"keep={keep!r}: keep at least the newest complete checkpoint (keep >= 1)")
    if not os.path.isdir(checkpoint_root):
        raise FileNotFoundError(f"checkpoint root {checkpoint_root!r} does not exist")
    try:
        with tempfile.TemporaryFile(dir=checkpoint_root):
            pass
    except OSError as err:
        raise PermissionError(
            f"checkpoint root {checkpoint_root!r} is not writable (creating a file there: {err})"
        ) from err


def load_checkpoint(state, path):
    try:
        dcp.load(state, checkpoint_id=path)
    except (Exception, CheckpointException) as err:  # DCP names the keys it misses
        missing = sorted(
            set(re.findall(r"Missing key in checkpoint state_dict: ([\w.]+)\.", str(err)))
        )
        cause = f"missing keys {missing[:3]}" if missing else f"{type(err).__name__}"
        raise RuntimeError(f"{path} is not a checkpoint of this training run: {cause}") from err


# sphinx_gallery_start_ignore
# Page-only: the crashes. CRASH is (where, step, rank): the rank kills itself
# with SIGKILL at that point of that step (rank -1: the last rank, rank 1 of two,
# rank 0 of one). Nothing else changes in the loop.
CRASH = None
CRASH_ENV = "RESUME_RECIPE_CRASH"  # "where:step:rank", read by this file under torchrun
KILL_AFTER_BYTES = 64 * 1024  # the upload dies this far into the rank's .distcp file


def crash_plan():
    if CRASH is not None:
        return CRASH
    raw = os.environ.get(CRASH_ENV)
    if raw and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
        where, step, rank = raw.split(":")
        return where, int(step), int(rank)
    return None


def crashes_here(where, step):
    plan = crash_plan()
    if plan is None or plan[:2] != (where, step):
        return False
    return dist.get_rank() == plan[2] % dist.get_world_size()


def sigkill_me():
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL)


class _DyingStream:
    """A file stream that writes KILL_AFTER_BYTES bytes, then the process dies."""

    def __init__(self, stream):
        self._stream, self._written = stream, 0

    def write(self, data):
        room = KILL_AFTER_BYTES - self._written
        if len(data) >= room:
            self._stream.write(bytes(memoryview(data)[:room]))
            self._stream.flush()
            os.fsync(self._stream.fileno())
            print(f"killed with SIGKILL after {KILL_AFTER_BYTES:,} bytes of its upload")
            sigkill_me()
        self._written += len(data)
        return self._stream.write(data)

    def __getattr__(self, name):
        return getattr(self._stream, name)


def arm_crash(step, stager):
    """Called right before async_save of ``step``: kill during its upload or staging."""
    if crashes_here("upload", step):
        original = FileSystem.create_stream

        def create_stream(self, path, mode):
            stream_context = original(self, path, mode)
            if not str(path).endswith(".distcp"):
                return stream_context

            class Dying:
                def __enter__(self):
                    return _DyingStream(stream_context.__enter__())

                def __exit__(self, *exc):
                    return stream_context.__exit__(*exc)

            return Dying()

        FileSystem.create_stream = create_stream
    if crashes_here("staging", step):
        offload = stager._state_dict_stager._offload_tensor
        copied = [0]

        def offload_then_die(*args, **kwargs):
            copied[0] += 1
            if copied[0] > 3:
                print("killed with SIGKILL during staging, after copying 3 tensors")
                sigkill_me()
            return offload(*args, **kwargs)

        stager._state_dict_stager._offload_tensor = offload_then_die


def crash_between_saves(step, response):
    if crashes_here("between saves", step):
        response.upload_completion.result()  # the last save is complete: kill after it
        print(f"killed with SIGKILL at step {step}, between two saves")
        sigkill_me()


def show_crashed_attempt(err):
    """What the ranks of the failed launch printed, tracebacks aside."""
    for line in str(err).splitlines():
        if re.search(r"killed with|saving step|resuming|no checkpoint", line):
            print(f"  {line}")


def local_copy(state_dict, prefix=""):
    """A CPU copy of this rank's part of every tensor in a nested state dict."""
    copies = {}
    for key, value in state_dict.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            copies.update(local_copy(value, f"{name}."))
        elif isinstance(value, torch.Tensor):
            local = value.to_local() if isinstance(value, DTensor) else value
            copies[name] = local.detach().to("cpu", copy=True)
    return copies


def full_state(model, optimizer):
    """The whole model and optimizer state, unsharded, on rank 0 (a collective)."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_sd, optim_sd = get_state_dict(model, optimizer, options=options)
    return local_copy({"model": model_sd, "optim": optim_sd}) if dist.get_rank() == 0 else None


def log_loss(checkpoint_root, step, loss):
    if dist.get_rank() == 0:
        with open(checkpoint_root + ".losses", "a") as log:
            log.write(f"{os.getpid()} {step} {loss!r}\n")


# sphinx_gallery_end_ignore


# %%
# The training loop
# -----------------
# On start, rank 0 removes torn directories and picks the newest complete
# checkpoint; every rank loads it. Saved on as many ranks as now, each rank
# gets its own data position and RNG back. Saved on another number of ranks,
# the per-rank positions do not fit (rank 2 of 3 has none; the others' shares
# of the order are cut differently), so the loader starts at the global
# sample index instead (rule 8). Then the loop trains, saving every
# ``SAVE_EVERY`` steps with the rules of the DefaultStager page, and clean-up
# runs right after each new save started, when the one before it is complete.

SAVE_EVERY, KEEP = 10, 2


def train(checkpoint_root, num_steps=NUM_STEPS, keep=KEEP):
    check_checkpoint_root(checkpoint_root, keep)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model, optimizer, scheduler = build_training(NUM_STEPS)
    app_state, progress = AppState(model, optimizer), Progress(scheduler)
    dataset = make_dataset()

    newest = [None]
    if rank == 0:
        removed = clean_up(checkpoint_root, keep)  # rule 5: torn ones go, never chosen
        newest = [newest_complete_step(checkpoint_root)]
        print(f"removed {removed}; " if removed else "", end="")
        print(
            f"resuming from step {newest[0]}" if newest[0] else "no checkpoint: starting at step 1"
        )
    dist.broadcast_object_list(newest, src=0)

    rank_state = RankState(build_data_loader(dataset))
    if newest[0] is not None:
        path = step_dir(checkpoint_root, newest[0])
        load_checkpoint({"app": app_state, "progress": progress}, path)
        if progress.world_size == world_size:
            load_checkpoint({"ranks": rank_state}, path)  # data position, then RNG
        else:
            rank_state = RankState(build_data_loader(dataset, progress.samples_seen))
            torch.manual_seed(1000 * progress.step + rank)  # a fresh RNG stream per rank
            print(
                f"saved on {progress.world_size} ranks, running on {world_size}: data from "
                f"global sample {progress.samples_seen}, new RNG seeds"
            )
    # sphinx_gallery_start_ignore
    loaded_full = full_state(model, optimizer)
    seen = {}
    # sphinx_gallery_end_ignore
    data = rank_state.data if rank_state.data is not None else iter(rank_state.data_loader)

    checkpoint_group = dist.new_group(backend="gloo")  # DCP's own group, as on the stager page
    stager = DefaultStager(staging_options())
    state = {"app": app_state, "progress": progress, "ranks": rank_state}
    device, response, losses = device_for_this_rank(), None, {}

    for step in range(progress.step + 1, num_steps + 1):
        # sphinx_gallery_start_ignore
        crash_between_saves(step, response)
        # sphinx_gallery_end_ignore
        inputs, targets, indices = next(data)  # indices: which samples (counted below)
        loss = F.mse_loss(model(inputs.to(device)), targets.to(device))
        optimizer.zero_grad()
        loss.backward()
        if response is not None:
            response.staging_completion.result()  # the copy is done: the weights may change
        optimizer.step()
        scheduler.step()
        progress.step, progress.samples_seen = step, progress.samples_seen + GLOBAL_BATCH

        global_loss = loss.detach().clone()
        dist.all_reduce(global_loss)
        losses[step] = global_loss.item() / world_size
        # sphinx_gallery_start_ignore
        seen[step] = indices.tolist()
        log_loss(checkpoint_root, step, losses[step])
        # sphinx_gallery_end_ignore

        if step % SAVE_EVERY == 0:
            if response is not None:
                response.upload_completion.result()  # the previous save is complete now
            if torch.accelerator.is_available():
                torch.accelerator.current_stream().synchronize()  # the stager's stream won't wait
            path = step_dir(checkpoint_root, step)
            # sphinx_gallery_start_ignore
            arm_crash(step, stager)
            # sphinx_gallery_end_ignore
            response = dcp.async_save(
                state, checkpoint_id=path, process_group=checkpoint_group, async_stager=stager
            )
            if rank == 0:
                removed = clean_up(checkpoint_root, keep, in_flight=path)
                kept = [s for s, done in saved_steps(checkpoint_root).items() if done and s != step]
                print(
                    f"step {step}: loss {losses[step]:.4f}; saving step {step}, kept {kept}, "
                    f"removed {removed}"
                )

    if response is not None:
        response.upload_completion.result()
    stager.close()
    dist.barrier(group=checkpoint_group)  # no rank tears the group down under another
    dist.destroy_process_group(checkpoint_group)
    if rank == 0:
        clean_up(checkpoint_root, keep)
        print(f"done at step {num_steps}; kept {list(saved_steps(checkpoint_root))}")
    result = {"losses": losses, "resumed_from": newest[0]}
    # sphinx_gallery_start_ignore
    result.update(
        final=local_copy(app_state.state_dict()),
        final_full=full_state(model, optimizer),
        loaded_full=loaded_full,
        seen=seen,
    )
    # sphinx_gallery_end_ignore
    return result


# %%
# The loop as a torchrun script
# -----------------------------
# Under ``torchrun --max-restarts=1``, when a worker dies the agent stops the
# others and starts all of them again, with ``TORCHELASTIC_RESTART_COUNT`` one
# higher. The agent's store (at ``MASTER_ADDR:MASTER_PORT``) outlives the
# workers, and with a plain ``dist.init_process_group("gloo")`` the restarted
# workers find the previous attempt's addresses in it: gloo then fails with
# ``Connection refused`` now and then (counted below). Creating the group on
# the same store under a prefix of the attempt gives every attempt clean keys
# (rule 7; pytorch issue #167288 is the same shape with NCCL).

TIMEOUT = datetime.timedelta(seconds=120)


def init_process_group_for_this_attempt():
    if torch.accelerator.is_available():
        torch.accelerator.set_device_index(int(os.environ["LOCAL_RANK"]))
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=TIMEOUT
    )
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    dist.init_process_group(
        "cpu:gloo,cuda:nccl" if torch.accelerator.is_available() else "gloo",
        store=dist.PrefixStore(f"attempt-{attempt}", store),
        rank=int(os.environ["RANK"]),
        world_size=int(os.environ["WORLD_SIZE"]),
        timeout=TIMEOUT,
    )
    return attempt


def main(checkpoint_root):
    attempt = init_process_group_for_this_attempt()
    print(f"[rank{dist.get_rank()}] attempt {attempt}", flush=True)
    result = train(checkpoint_root)
    print(f"[rank{dist.get_rank()}] attempt {attempt} resumed from step {result['resumed_from']}")
    # sphinx_gallery_start_ignore
    torch.save(result, f"{checkpoint_root}.result-rank{dist.get_rank()}.pt")
    # sphinx_gallery_end_ignore
    dist.barrier()
    dist.destroy_process_group()


# This file is also the training script that torchrun runs further below.
CHECKPOINTS_ENV = "RESUME_RECIPE_CHECKPOINTS"
if __name__ == "__main__" and under_torchrun() and os.environ.get(CHECKPOINTS_ENV):
    main(os.environ[CHECKPOINTS_ENV])
    sys.exit(0)


WORK_DIR = shared_tempdir("dcp-resume-")
print(f"checkpoints go under {WORK_DIR}")

# sphinx_gallery_start_ignore
# Page-only: the restart measurement shown further below runs in the background
# from here on: it mostly waits for gloo's connect timeouts.
RESTART_PROBE_RESTARTS = int(os.environ.get("RESUME_RECIPE_PROBE_RESTARTS", "3"))


def start_restart_probe(restarts=RESTART_PROBE_RESTARTS):
    """One torchrun per way to create the group; rank 1 is killed in all attempts but the last."""
    this_file = sys.argv[0]
    if restarts < 1 or under_torchrun() or not this_file.endswith(".py"):
        return {}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += ["--nproc-per-node=2", f"--max-restarts={restarts}", this_file]
    jobs = {}
    for mode in ("plain", "prefixed"):
        env = dict(os.environ, **{PROBE_ENV: mode}, OMP_NUM_THREADS="1")
        log = os.path.join(WORK_DIR, f"restart-probe-{mode}.log")
        with open(log, "w") as out:
            job = subprocess.Popen(
                command, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )
        jobs[mode] = (job, log)
    return jobs


restart_probe_jobs = start_restart_probe()
# sphinx_gallery_end_ignore


# %%
# An uninterrupted run
# --------------------
# First the run to compare with: 60 steps, a save every 10, keeping the newest
# 2. Each save line lists the complete checkpoints when the save started (the
# one before it has just completed) and what clean-up removed.


def new_root(name):
    path = os.path.join(WORK_DIR, name)
    os.makedirs(path, exist_ok=True)  # under torchrun every rank runs this
    return path


uninterrupted = run_on_ranks(train, new_root("uninterrupted"))
print(f"{len(uninterrupted[0]['losses'])} steps, final loss {uninterrupted[0]['losses'][60]:.4f}")


# %%
# Crash in the middle of an upload
# --------------------------------
# The same run, but the last rank (rank 1 of two) is killed with ``SIGKILL``
# while it writes its file of the checkpoint at step 40: it dies after 64 KiB
# of it, in the middle of the upload, before rank 0 could write ``.metadata``.
# (The page arms the kill in lines it does not show: a ``FileSystem`` whose
# stream kills the process at that byte.) The launch fails, as a job whose
# rank was killed does.

# sphinx_gallery_start_ignore
CRASH = ("upload", 40, -1) if not under_torchrun() else None
# sphinx_gallery_end_ignore
upload_root = new_root("crash-in-upload")
try:
    run_on_ranks(train, upload_root)
except RankFailedError as err:
    print("the job failed:", str(err).splitlines()[0])
    # sphinx_gallery_start_ignore
    show_crashed_attempt(err)
    # sphinx_gallery_end_ignore
# sphinx_gallery_start_ignore
CRASH = None
# sphinx_gallery_end_ignore


# %%
# What the crash left behind: step 40 is torn (the last rank's file cut
# short, no ``.metadata``); steps 20 and 30 are complete. Clean-up removed step 10
# (keep 2) only once step 30 was complete.


def show_checkpoints(checkpoint_root):
    for step, complete in saved_steps(checkpoint_root).items():
        path = step_dir(checkpoint_root, step)
        files = ", ".join(
            f"{n} {os.path.getsize(os.path.join(path, n)):,} B" for n in sorted(os.listdir(path))
        )
        print(
            f"{os.path.basename(path)}: {'complete' if complete else 'TORN'}: {files or 'no files'}"
        )


show_checkpoints(upload_root)


# %%
# The restart: a second launch of the same function. Rank 0 removes the torn
# step 40, every rank loads step 30 and training goes on from step 31.

resumed_after_upload = run_on_ranks(train, upload_root)
print(f"resumed from step {resumed_after_upload[0]['resumed_from']}")

# sphinx_gallery_start_ignore
UNINTERRUPTED_LOSSES = uninterrupted[0]["losses"]


def compare_with_uninterrupted(resumed, what):
    """Same loss at every step after the resume, same final state bit for bit."""
    start = resumed[0]["resumed_from"]
    steps = sorted(resumed[0]["losses"])
    if not steps:  # under torchrun the page kills no rank: the first launch ran to the end
        steps = [NUM_STEPS]
        resumed[0]["losses"] = {NUM_STEPS: UNINTERRUPTED_LOSSES[NUM_STEPS]}
        print(f"{what}: nothing to resume (no rank was killed), comparing the final state")
    different = [s for s in steps if resumed[0]["losses"][s] != UNINTERRUPTED_LOSSES[s]]
    tensors = differ = 0
    for mine, theirs in zip(resumed, uninterrupted, strict=True):
        assert mine["final"].keys() == theirs["final"].keys()
        tensors += len(mine["final"])
        differ += sum(not torch.equal(mine["final"][k], theirs["final"][k]) for k in mine["final"])
    print(
        f"{what}: resumed from step {start}; loss at steps {steps[0]}-{steps[-1]}: "
        f"{len(different)} of {len(steps)} differ from the uninterrupted run; final model and "
        f"optimizer: {tensors} tensors compared, {differ} differ"
    )
    assert not different and not differ, what
    return start


def crashed_losses(checkpoint_root):
    """Rank 0's loss log, split by process: one list per attempt."""
    attempts = {}
    with open(checkpoint_root + ".losses") as log:
        for line in log:
            pid, step, loss = line.split()
            attempts.setdefault(pid, []).append((int(step), float(loss)))
    return list(attempts.values())


upload_resumed_from = compare_with_uninterrupted(resumed_after_upload, "crash in upload")
# sphinx_gallery_end_ignore


# %%
# Crash during staging, and between saves
# ---------------------------------------
# Two more kill points, each followed by a restart. During staging, the last
# rank dies while the stager copies the state of step 40 to host memory: no
# file of step 40 exists yet. Between saves, it dies at step 45, after step 40 was
# complete: the restart goes on from step 40, and steps 41 to 45 run again.
# If the launcher stops rank 0 while it deletes an old checkpoint, that one
# shows up torn as well: clean-up removes ``.metadata`` first, so a deletion
# cut short never leaves a directory that looks complete.

# sphinx_gallery_start_ignore
CRASH = ("staging", 40, -1) if not under_torchrun() else None
# sphinx_gallery_end_ignore
staging_root = new_root("crash-in-staging")
try:
    run_on_ranks(train, staging_root)
except RankFailedError as err:
    print("the job failed:", str(err).splitlines()[0])
    # sphinx_gallery_start_ignore
    show_crashed_attempt(err)
    # sphinx_gallery_end_ignore
# sphinx_gallery_start_ignore
CRASH = None
# sphinx_gallery_end_ignore
show_checkpoints(staging_root)
resumed_after_staging = run_on_ranks(train, staging_root)

# sphinx_gallery_start_ignore
CRASH = ("between saves", 45, -1) if not under_torchrun() else None
# sphinx_gallery_end_ignore
between_root = new_root("crash-between-saves")
try:
    run_on_ranks(train, between_root)
except RankFailedError as err:
    print("the job failed:", str(err).splitlines()[0])
    # sphinx_gallery_start_ignore
    show_crashed_attempt(err)
    # sphinx_gallery_end_ignore
# sphinx_gallery_start_ignore
CRASH = None
# sphinx_gallery_end_ignore
show_checkpoints(between_root)
resumed_between_saves = run_on_ranks(train, between_root)

# sphinx_gallery_start_ignore
compare_with_uninterrupted(resumed_after_staging, "crash in staging")
compare_with_uninterrupted(resumed_between_saves, "crash between saves")
# sphinx_gallery_end_ignore


# %%
# The restart under torchrun
# --------------------------
# The same crash in the middle of the upload, now with the engine jobs run
# on: this file as a training script under ``torchrun --max-restarts=1``,
# started here as a subprocess. Attempt 0 dies at step 40; the agent restarts
# both workers (attempt 1), which resume from step 30. A notebook has no file
# to hand to torchrun: run this cell from the recipe's ``.py`` file.

torchrun_root = new_root("torchrun")
script = sys.argv[0]  # this file, under Sphinx-Gallery, python and torchrun
if under_torchrun() or not script.endswith(".py") or "ipykernel" in script:
    print("skipped: run the recipe's .py file (not under torchrun) to start torchrun from it")
    torchrun_output = ""
else:
    env = dict(os.environ, **{CHECKPOINTS_ENV: torchrun_root}, OMP_NUM_THREADS="1")
    # sphinx_gallery_start_ignore
    env[CRASH_ENV] = "upload:40:-1"
    # sphinx_gallery_end_ignore
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += [f"--nproc-per-node={len(uninterrupted)}", "--max-restarts=1", script]
    log_path = os.path.join(WORK_DIR, "torchrun.log")
    with open(log_path, "w") as log:  # a new session: on a timeout, stop torchrun's workers too
        job = subprocess.Popen(command, env=env, stdout=log, stderr=log, start_new_session=True)
    try:
        job.wait(timeout=150)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
    with open(log_path) as log:
        torchrun_output = log.read()
    interesting = re.compile(r"attempt|killed|resuming|removed|done at|newest|Restarting|exitcode")
    for line in torchrun_output.splitlines():
        if interesting.search(line):
            print(line.split("] ", 1)[-1].split(" (pid")[0] if "torch/" in line else line)
    print(f"torchrun exited with {job.returncode}")

# sphinx_gallery_start_ignore
if torchrun_output:
    torchrun_results = [
        torch.load(f"{torchrun_root}.result-rank{r}.pt", weights_only=False)
        for r in range(len(uninterrupted))
    ]
    compare_with_uninterrupted(torchrun_results, "torchrun --max-restarts=1")
    assert torchrun_results[0]["resumed_from"] == 30, torchrun_output[-3000:]
    assert job.returncode == 0, torchrun_output[-3000:]
# sphinx_gallery_end_ignore


# %%
# Plain ``init_process_group`` against the prefixed store
# -------------------------------------------------------
# How often does a restart fail? While the cells above ran, this build ran a
# minimal job under ``torchrun --max-restarts=3``, twice: two ranks create the
# group, rank 1 is killed after the first barrier of every attempt but the
# last, and every restart has to form the group again. One job creates it with
# a plain ``dist.init_process_group("gloo")``, the other on the prefixed store
# of ``init_process_group_for_this_attempt()``. The counts are what this build
# measured; they vary from build to build (it is a race).

# The two ways to create the group, side by side:
#   dist.init_process_group("gloo")        # env://: the agent's store, keys of every attempt
#   init_process_group_for_this_attempt()  # the same store, under "attempt-N/"


# sphinx_gallery_start_ignore
def restart_probe_results(jobs):
    """Wait for the measurement started at the top of the page and print its counts."""
    if not jobs:
        print("skipped: the measurement runs torchrun on this file")
        return
    labels = {
        "plain": 'dist.init_process_group("gloo")',
        "prefixed": "PrefixStore(attempt-N, store)",
    }
    for mode, (job, log) in jobs.items():
        try:
            job.wait(timeout=150)
        finally:
            if job.poll() is None:
                os.killpg(job.pid, signal.SIGKILL)
        with open(log) as out:
            output = out.read()
        formed = re.findall(r"probe attempt (\d+): the group formed", output)
        restarted = sum(int(attempt) >= 1 for attempt in formed)
        refused = output.count("Gloo connectFullMesh failed")
        print(
            f"{labels[mode]:<32} restarted workers formed the group in {restarted} of "
            f"{RESTART_PROBE_RESTARTS} restarts; connectFullMesh failed: {refused} times"
        )


restart_probe_results(restart_probe_jobs)
# sphinx_gallery_end_ignore


# %%
# The loss curves
# ---------------
# The uninterrupted run and the crashed one, as rank 0 logged them: the first
# attempt up to the kill, the restart from the checkpoint it resumed from. The
# resumed curve lies on the uninterrupted one, step for step (checked above:
# the same float, not a close one).

# The figure is drawn from rank 0's loss log of each run.

# sphinx_gallery_start_ignore
import matplotlib.pyplot as plt  # here, not at the top: torchrun's workers need no plotting

figure, axis = plt.subplots(figsize=(9, 3.8))
steps = sorted(UNINTERRUPTED_LOSSES)
axis.plot(
    steps,
    [UNINTERRUPTED_LOSSES[s] for s in steps],
    color="tab:gray",
    lw=5,
    alpha=0.4,
    label="uninterrupted",
)
attempts = crashed_losses(upload_root)
styles = [
    ("o-", "tab:red", 2, "crashed run, attempt 0"),
    ("s-", "tab:blue", 4, "after the restart"),
]
for attempt, (marker, color, size, label) in reversed(list(zip(attempts, styles, strict=False))):
    axis.plot(*zip(*attempt, strict=True), marker, ms=size, lw=1, color=color, label=label)
axis.axvline(40, color="tab:red", ls="--")
axis.annotate(
    "last rank killed in\nthe upload of step 40",
    (40, 0.95),
    xycoords=("data", "axes fraction"),
    ha="right",
    va="top",
    fontsize=8,
    xytext=(-4, 0),
    textcoords="offset points",
)
axis.axvline(upload_resumed_from, color="tab:blue", ls=":")
axis.annotate(
    f"resumed from\nstep {upload_resumed_from}",
    (upload_resumed_from, 0.7),
    xycoords=("data", "axes fraction"),
    ha="right",
    va="top",
    fontsize=8,
    xytext=(-4, 0),
    textcoords="offset points",
)
axis.set_xlabel("step")
axis.set_ylabel("loss (mean over ranks)")
axis.set_yscale("log")
axis.legend(fontsize=8)
figure.tight_layout()
# sphinx_gallery_end_ignore


# %%
# Resume on another number of ranks
# ---------------------------------
# DCP reshards model and optimizer on load: their keys and shapes do not
# depend on the number of ranks. A job stopped after step 30 on 2 ranks goes on
# on 3 ranks to step 40, then on 1 rank to the end. The page's launcher starts
# as many ranks as ``DCP_RECIPES_WORLD_SIZE`` says, read at each launch (under
# torchrun, start torchrun with ``--nproc-per-node`` instead). It starts one
# rank per GPU, so on a machine with fewer than 3 GPUs this cell hides them
# (``CUDA_VISIBLE_DEVICES=""``) and reshards on CPU ranks: resharding is
# DCP's planning, the same on any device.

reshard_root = new_root("reshard")
launches = {}
environment = {
    name: os.environ.get(name) for name in ("DCP_RECIPES_WORLD_SIZE", "CUDA_VISIBLE_DEVICES")
}
if not under_torchrun() and 0 < torch.cuda.device_count() < 3:  # one GPU per rank
    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # fewer than 3 GPUs: reshard on CPU ranks
for ranks, steps in ((2, 30), (3, 40), (1, 60)):
    os.environ["DCP_RECIPES_WORLD_SIZE"] = str(ranks)
    launches[ranks] = run_on_ranks(train, reshard_root, steps)
    print(f"{len(launches[ranks])} rank(s) trained to step {steps}")
for name, value in environment.items():  # back to what it was before this cell
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value

# sphinx_gallery_start_ignore
chain = list(launches.values())


def count_mismatches(expected, actual):
    assert expected.keys() == actual.keys()
    return sum(not torch.equal(expected[k], actual[k]) for k in expected)


for before, after in zip(chain, chain[1:], strict=False):
    saved_on, loaded_on = len(before), len(after)
    mismatches = count_mismatches(before[0]["final_full"], after[0]["loaded_full"])
    print(
        f"saved on {saved_on}, loaded on {loaded_on}: {len(before[0]['final_full'])} tensors of "
        f"model and optimizer compared, unsharded, {mismatches} differ"
    )
    assert mismatches == 0
# sphinx_gallery_end_ignore


# %%
# What happens to the per-rank data position: the checkpoint of step 30 holds
# one loader position per rank that saved it, ``rank0`` and ``rank1``. On 3
# ranks, rank 2 has none and would start from the beginning. Ranks 0 and 1
# would fast-forward 30 batches of their new, smaller share of the order,
# which lands where it should only because this page keeps the global batch
# fixed (with a fixed per-rank batch it would not). The global sample index
# does not depend on the ranks. What each way trains on in steps 31 to 40:


def samples_trained(world_size, start, steps, rank_starts):
    """The global-order positions 3 ranks train on, each from its own start."""
    seen = []
    for rank in range(world_size):
        share = GlobalOrderSampler(NUM_SAMPLES, rank, world_size, rank_starts[rank])
        seen += list(share)[: steps * GLOBAL_BATCH // world_size]
    return seen


done = 30 * GLOBAL_BATCH  # samples trained on by step 30
# restored per rank: ranks 0 and 1 fast-forward 30 batches of their loader, rank 2 starts over
per_rank = samples_trained(3, done, 10, [done, done, 0])
global_index = samples_trained(3, done, 10, [done, done, done])
for name, seen in (("per-rank positions", per_rank), ("global sample index", global_index)):
    again = len(set(GlobalOrderSampler(NUM_SAMPLES, 0, 1).order[:done]) & set(seen))
    print(f"{name}: {len(seen)} samples in steps 31-40, {again} of them trained on before")

# sphinx_gallery_start_ignore
trained = [i for launch in chain for rank in launch for ids in rank["seen"].values() for i in ids]
print(
    f"the 2 -> 3 -> 1 rank job trained on {len(trained)} samples: {len(set(trained))} distinct "
    f"of {NUM_SAMPLES}, each exactly once: {sorted(trained) == list(range(NUM_SAMPLES))}"
)
assert sorted(trained) == list(range(NUM_SAMPLES))
# sphinx_gallery_end_ignore


# %%
# Bad input
# ---------
# Mistakes that would otherwise surface at the first save (or as a hang)
# fail at once, on every rank, with the cause: a root that does not exist, one
# nobody can write to (``/proc`` on Linux, where even root cannot create
# files), ``keep`` below 1, and a step directory saved by another model.

other_model_root = new_root("other-model")


def try_bad_input():
    other = nn.Linear(4, 4)
    dcp.save({"app": {"model": other.state_dict()}}, checkpoint_id=step_dir(other_model_root, 10))
    for root, keep in (
        (os.path.join(WORK_DIR, "no-such-dir"), 2),
        ("/proc", 2),
        (new_root_path, 0),
        (other_model_root, 2),
    ):
        try:
            train(root, keep=keep)
        except (ValueError, OSError, RuntimeError) as err:
            if dist.get_rank() == 0:
                print(f"{type(err).__name__}: {err}")


new_root_path = new_root("keep-zero")
run_on_ranks(try_bad_input)


# %%
# Clean up
# --------

shutil.rmtree(WORK_DIR, ignore_errors=True)
print(f"removed {WORK_DIR}: {not os.path.exists(WORK_DIR)}")


# %%
# What to read next
# -----------------
# * :ref:`sphx_glr_recipes_staging_pitfalls_recipe.py`: what a save writes
#   when the rules of the overlapped save are broken.
# * :ref:`sphx_glr_recipes_default_stager_recipe.py`: the overlapped save this
#   loop uses, measured.
# * :doc:`/troubleshooting`: symptoms and fixes for the usual DCP failures.
