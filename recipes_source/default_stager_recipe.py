"""
Fully asynchronous staging with DefaultStager
=============================================

``dcp.async_save`` writes the checkpoint in the background, but before it
returns it copies the whole state to host memory ("staging"), and the training
loop waits for that copy: it is most of the time a save blocks the loop. A
:class:`~torch.distributed.checkpoint.staging.DefaultStager` with
``use_async_staging=True`` moves the copy to a background thread as well:
``async_save`` returns at once, the copy overlaps the next forward and
backward pass, and the loop waits only if the copy is still running when
``optimizer.step()`` is about to change the weights. This recipe builds that
loop, measures its timeline beside plain ``async_save``, and proves that every
checkpoint holds the state of its step, bit for bit.

.. grid:: 2

    .. grid-item-card:: :octicon:`mortar-board;1em;` What you will learn
       :class-card: card-prerequisites

       * The rules of an overlapped save, short enough to paste into your loop
       * Choose ``StagingOptions`` from what the machine has, and what each
         option does
       * A training loop whose checkpoint copy runs during the next forward
         and backward pass, with ``AsyncSaveResponse``'s two futures
       * Read a measured timeline of that loop, and what it blocks per save
         compared with plain ``async_save``
       * Check that the checkpoint is the state at the save, although the
         optimizer stepped while it was being written
       * Which Python values are safe to change after the call, when the
         stager reuses its host buffers, and where a staging error shows up

    .. grid-item-card:: :octicon:`list-unordered;1em;` Prerequisites
       :class-card: card-prerequisites

       * PyTorch 2.9 or later, but not 2.11.0, whose ``DefaultStager`` cannot be reused
         (:ref:`reused-stager-keyerror`)
       * CPU (gloo) or one GPU per rank (NCCL, plus gloo for checkpointing)
       * :ref:`sphx_glr_recipes_async_save_recipe.py`: ``async_save``, a
         process group for checkpointing, one save in flight

As on every page of this site, code that runs on every rank is launched by
``run_on_ranks``, which starts the ranks (or uses the ones ``torchrun`` made)
and prints what each rank printed, labelled ``[rankN]``. The functions it runs
are plain DCP code for a training script started with ``torchrun``: the loops
below are the loops to paste. The timers, the timeline and the checks that
prove what the page says run too, but they are not shown here and not in the
notebook; they are in the downloadable ``.py``. Every number below was
measured when this page was built, on the machine named at the top of the
page.
"""

# %%
# The rules, to paste into your loop
# ----------------------------------
# Overlapping the copy with training is safe only if nothing changes the
# tensors being copied until the copy is done, and nothing reuses the copy
# until it is written. In the order they come up in a training loop:
#
# .. code-block:: python
#
#    # Checkpointing with DefaultStager(StagingOptions(use_async_staging=True)):
#    # 1. Checkpoint on a gloo group of its own, passed to every async_save:
#    #    checkpoint_group = dist.new_group(backend="gloo").
#    # 2. Create one stager per rank, after torch.cuda.set_device (its copy
#    #    stream is created on the current device), and pass it to every save.
#    # 3. Before each async_save, wait for the previous one:
#    #    response.upload_completion.result(). A reused stager copies into the
#    #    same host buffers that upload is still writing from: skipping the wait
#    #    can corrupt the previous checkpoint, it does not only cost memory.
#    # 4. With async staging and non-blocking copies on an accelerator,
#    #    synchronize right before async_save:
#    #    torch.accelerator.current_stream().synchronize(). The stager copies
#    #    on a stream of its own, which does not wait for yours.
#    #    async_save calls state_dict() after that line: if your state_dict()
#    #    launches device work (clones, CPU offload, full state dicts, the
#    #    zero-lr step get_state_dict runs to create Adam's state), synchronize
#    #    at its end too.
#    # 5. async_save calls state_dict() and copies your top-level dict during
#    #    the call, so a plain int or float (a step counter) is fixed then. A
#    #    dict or list passed or returned by reference is copied later, in the
#    #    stager's thread: hand async_save a copy of a container the loop keeps
#    #    changing (dict(progress)).
#    # 6. If the forward pass changes state-dict tensors in place (BatchNorm
#    #    running stats, buffers updated in forward), wait on
#    #    response.staging_completion before the next forward, or put clones of
#    #    those tensors in the state you save.
#    # 7. Otherwise wait on response.staging_completion right before
#    #    optimizer.step(), the first line that changes the saved tensors.
#    # 8. Always wait on response.upload_completion.result(): it raises a
#    #    staging error that staging_completion can report as success. After
#    #    the last save, wait on it, then stager.close().
#    # 9. Destroy process groups only after that wait (dist.barrier() first for
#    #    the default group): a group destroyed under a running upload leaves a
#    #    checkpoint without .metadata.
#
# This page runs a loop that follows them and measures it, then shows rules
# 5 and 8 and the stager's buffer reuse at work.
# :ref:`sphx_glr_recipes_staging_pitfalls_recipe.py` breaks rules 3, 5, 6
# and 7 on purpose, shows what each break writes into the checkpoint, and
# proves each fix.

# %%
# Setup
# -----

import os
import shutil
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from rank_launcher import run_on_ranks, shared_tempdir
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.fsdp import fully_shard

# sphinx_gallery_start_ignore
# isort: split
# What the page measures and proves with; none of it is needed in a training loop.
import collections
import glob
import json
import statistics
import threading
import time
from concurrent.futures import wait

import matplotlib.pyplot as plt
from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse
from torch.distributed.tensor import DTensor

# sphinx_gallery_end_ignore

WORK_DIR = shared_tempdir("dcp-default-stager-")
print(f"torch {torch.__version__}; checkpoints go under {WORK_DIR}")


# %%
# Staging options from what the machine has
# -----------------------------------------
# :class:`~torch.distributed.checkpoint.staging.StagingOptions` has four
# switches, all on by default:
#
# * ``use_pinned_memory``: stage into page-locked host memory, so that copies
#   from the GPU run at full speed and can be asynchronous. Needs CUDA. (The
#   :ref:`async_save recipe <sphx_glr_recipes_async_save_recipe.py>` measures
#   the difference when it is built on a GPU.)
# * ``use_shared_memory``: allocate the host buffers in shared memory, so that
#   a checkpoint *process* (``AsyncCheckpointerType.PROCESS``) reads them in
#   place instead of receiving another copy. This page uploads from a thread
#   and does not need it.
# * ``use_async_staging``: copy in a background thread of the stager (a thread
#   pool with one worker). ``async_save`` then returns an ``AsyncSaveResponse``
#   before the copy is done. This is the option this page is about, and it
#   needs nothing but a thread.
# * ``use_non_blocking_copy``: issue the device-to-host copies with
#   ``non_blocking=True`` and wait for them at the end of the copy. Needs an
#   accelerator.
#
# With ``use_async_staging`` and ``use_non_blocking_copy`` both on, on an
# accelerator, the stager copies on a stream of its own, which it creates on
# the current device when it is constructed, and at the end it waits for that
# stream only (``DefaultStager._stage`` in ``staging.py``). Nothing orders
# those copies after the kernels still queued on your compute stream: without
# a synchronisation right before ``async_save`` (rule 4) the copy can read
# weights that ``optimizer.step()`` has not finished writing (the
# :ref:`pitfalls recipe <sphx_glr_recipes_staging_pitfalls_recipe.py>` shows
# what such a checkpoint holds, when it is built on a GPU). That is the only
# combination with this race: synchronous staging with non-blocking copies
# ends with ``torch.accelerator.synchronize()``, blocking copies in the
# background thread go on the device's default stream, behind the work queued
# there (where training runs unless you chose another stream), and on CPU
# there are no streams.
#
# Whatever the options, the stager keeps the host copy of each tensor between
# saves and copies into it again at the next one, so only the first save
# allocates, as long as ``state_dict()`` returns the same tensors every time:
# a section below shows when that reuse happens and when it does not.
#
# Without an accelerator the defaults raise (below). The rule this site uses
# on every page, with ``use_async_staging=True`` because this page stages in
# the background:
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


def show_staging_options():
    if dist.get_rank() != 0:
        return
    # Without CUDA the defaults first warn that pinning is ignored; the error is the point.
    warnings.filterwarnings("ignore", message="Ignoring pin_memory flag")
    try:
        DefaultStager().close()
        print("DefaultStager() with the default options: works on this machine")
    except AssertionError as err:
        print(f"DefaultStager() with the default options: AssertionError: {err}")
    print(f"this page stages with {staging_options()}")


# A rank, not this process, tries the defaults: on a GPU machine a stager
# creates a CUDA stream, and the process that starts the ranks must not touch CUDA.
run_on_ranks(show_staging_options)


# %%
# The model
# ---------
# The same small model as in the ``async_save`` recipe: a few wide linear
# layers, sharded with FSDP2 and trained with Adam, so the checkpoint holds
# three tensors per parameter. ``AppState`` is the usual ``Stateful`` wrapper;
# DCP calls its ``state_dict()`` at every save, inside ``async_save`` and after
# the loop's synchronisation (rule 4). The first call launches device work:
# ``get_state_dict`` creates Adam's state with a zero-lr ``optimizer.step()``
# when the optimizer has none yet, as at this page's save before training. So
# on an accelerator ``state_dict()`` waits for its own work before it returns.

WIDTH, DEPTH, BATCH = 1024, 3, 16


class ToyModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(DEPTH))

    def forward(self, x):
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x


class AppState(Stateful):
    """Model and optimizer as one checkpointable object."""

    def __init__(self, model, optimizer):
        self.model = model
        self.optimizer = optimizer

    def state_dict(self):
        model_state_dict, optimizer_state_dict = get_state_dict(self.model, self.optimizer)
        if torch.accelerator.is_available():
            # The stager's stream does not wait for kernels launched here (rule 4).
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
    fully_shard(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    torch.manual_seed(100 + dist.get_rank())  # each rank trains on its own data
    return model, optimizer


parameters = sum(p.numel() for p in ToyModel().parameters())
print(f"{parameters / 1e6:.1f} M parameters; checkpoint with Adam: {12 * parameters / 1e6:.0f} MB")


# %%
# The training loop
# -----------------
# One stager for the whole run, created inside the function that runs on each
# rank (after the launcher's ``torch.cuda.set_device``) and passed to every
# ``async_save``: it keeps its host buffers between saves, so only the first
# save pays for allocating them (this loop saves at step 0 and waits for it,
# which also checks the storage before any training). Saves happen every
# ``SAVE_EVERY`` steps, right after ``optimizer.step()``.
#
# With an asynchronous stager ``async_save`` returns an
# :class:`~torch.distributed.checkpoint.state_dict_saver.AsyncSaveResponse`
# with two futures:
#
# * ``staging_completion`` resolves when the copy to host memory is done. Until
#   then the saved tensors must not change: wait on it right before
#   ``optimizer.step()``. Forward and backward read the weights but do not
#   change them, so they run while the copy runs.
# * ``upload_completion`` resolves when the checkpoint is written, with
#   ``.metadata``, and raises if staging or writing failed. Wait on it before
#   the next save and before the end.
#
# .. versionadded:: 2.9
#    ``AsyncSaveResponse``, returned by ``async_save`` when the stager stages
#    asynchronously.
#
# The numbered comments are the rules from the top of the page. This is the
# loop to paste; the page times each of its lines with code it does not show.

NUM_STEPS, SAVE_EVERY = 10, 3  # saves after steps 0, 3, 6 and 9
SAVED_DURING_TRAINING = list(range(SAVE_EVERY, NUM_STEPS + 1, SAVE_EVERY))

# sphinx_gallery_start_ignore
# The page's measuring code. Each rank records what ran when; the background
# work reports itself through callbacks on the two futures. Results, and a
# copy of this rank's state at every save (for the bit-for-bit check), go to
# files under the run's directory, where the cells below read them.


def local_copy(state_dict, prefix=""):
    """A CPU copy of this rank's part of every tensor in a nested state dict, by name."""
    copies = {}
    for key, value in state_dict.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            copies.update(local_copy(value, f"{name}."))
        elif isinstance(value, torch.Tensor):
            local = value.to_local() if isinstance(value, DTensor) else value
            copies[name] = local.detach().to("cpu", copy=True)
    return copies


def page_file(checkpoint_root, what, rank):
    os.makedirs(os.path.join(checkpoint_root, "page"), exist_ok=True)
    return os.path.join(checkpoint_root, "page", f"{what}-rank{rank}.pt")


def host_buffers(stager):
    """The host copies a DefaultStager caches, keyed (weakly) on the source storages."""
    return list(stager._state_dict_stager._cached_storage_mapping.values())


class Timeline:
    """What ran when on this rank, in seconds since the timeline was created.

    Each block of the training thread is also a ``torch.profiler.record_function``
    range, and with ``trace=`` the rank runs under ``torch.profiler`` and writes a
    Chrome trace (Perfetto, chrome://tracing) at the end.
    """

    def __init__(self, checkpoint_root, stager=None, trace=None):
        self.root, self.stager, self.trace = checkpoint_root, stager, trace
        self.origin = time.perf_counter()
        self.open = None  # the block running now: (what, step, start, profiler range)
        self.blocks = []  # (what, step, start, end) on the training thread
        self.saves = []  # one dict per save: when it was called, returned, staged, uploaded
        self.staging_threads = set()
        self.profiler = None
        if trace:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            # Every thread: the stager's copies and the upload run on threads of their own.
            every_thread = torch._C._profiler._ExperimentalConfig(profile_all_threads=True)
            self.profiler = torch.profiler.profile(
                activities=activities, experimental_config=every_thread
            )
            with warnings.catch_warnings():
                # torch 2.11 warns that it clears the events at each cycle's end: one here.
                warnings.filterwarnings("ignore", "Warning: Profiler clears events")
                self.profiler.start()
            if stager is not None:
                stager._stage = in_a_profiler_range("DefaultStager: copy to host", stager._stage)

    def now(self):
        return time.perf_counter() - self.origin

    def begin(self, what, step):
        """A block of the training thread begins now (and the one before it ends)."""
        self.end()
        profiler_range = torch.profiler.record_function(what, f"step {step}")
        profiler_range.__enter__()
        self.open = (what, step, self.now(), profiler_range)

    def end(self):
        if self.open is None:
            return
        if torch.accelerator.is_available():
            # Time the GPU's work, not only its launch; only this stream, so
            # that the stager's copies on its own stream keep running.
            torch.accelerator.current_stream().synchronize()
        what, step, start, profiler_range = self.open
        profiler_range.__exit__(None, None, None)
        self.blocks.append((what, step, start, self.now()))
        self.open = None

    def snapshot(self, app_state, step):
        with torch.profiler.record_function("page: copy of the state for the check"):
            state = local_copy(app_state.state_dict())
        torch.save(state, page_file(self.root, f"step-{step}", rank()))

    def begin_save(self, step):
        self.begin("async_save", step)
        self.saves.append({"step": step, "called": self.open[2]})

    def end_save(self, response):
        self.end()
        save = self.saves[-1]
        save["returned"] = self.blocks[-1][3]
        save["response"] = type(response).__name__
        training_thread = threading.current_thread()

        def staged(_):
            save["staged"] = self.now()
            if threading.current_thread() is not training_thread:
                self.staging_threads.add(threading.current_thread())
            buffers = host_buffers(self.stager)
            save["buffers"] = sorted(buffer.data_ptr() for buffer in buffers)
            save["buffer_bytes"] = sum(buffer.nbytes() for buffer in buffers)

        if isinstance(response, AsyncSaveResponse):
            response.staging_completion.add_done_callback(staged)
            upload = response.upload_completion
        else:  # plain async_save: staged before it returned
            save["staged"] = save["returned"]
            upload = response
        upload.add_done_callback(lambda _: save.update(uploaded=self.now()))

    def before_close(self):
        self.threads = sorted(self.staging_threads, key=lambda thread: thread.name)
        self.running_before = [thread.is_alive() for thread in self.threads]

    def after_close(self, name, app_state=None):
        if self.stager is not None:
            running_after = [thread.is_alive() for thread in self.threads]
            names = ", ".join(thread.name for thread in self.threads)
            print(
                f"staging ran on {names}; running before stager.close(): "
                f"{self.running_before}, after: {running_after}"
            )
            reused = [save["buffers"] == self.saves[0]["buffers"] for save in self.saves]
            print(
                f"host buffers of the {len(self.saves)} saves: {len(self.saves[0]['buffers'])} "
                f"({self.saves[0]['buffer_bytes'] / 1e6:.1f} MB), the same ones at every save: "
                f"{all(reused)}"
            )
        if app_state is not None:
            torch.save(local_copy(app_state.state_dict()), page_file(self.root, "final", rank()))
        report = {"blocks": self.blocks, "saves": self.saves}
        if self.profiler is not None:
            self.profiler.stop()
            if rank() == 0:
                report["trace"] = trace_path(self.root, self.trace)
                self.profiler.export_chrome_trace(report["trace"])
        torch.save(report, page_file(self.root, name, rank()))


def trace_path(checkpoint_root, name):
    """Where rank 0's profiler trace goes.

    The DefaultStager loop's trace is for the reader to keep: it is written beside
    this script (the page links it at the top). The other stays with the checkpoints.
    """
    if name == "default_stager_recipe.trace":
        return os.path.abspath(f"{name}.json")
    folder = os.path.join(checkpoint_root, "page")
    os.makedirs(folder, exist_ok=True)
    return os.path.join(folder, f"{name}.json")


def rank():
    return dist.get_rank()


def in_a_profiler_range(name, function):
    def traced(*args, **kwargs):
        with torch.profiler.record_function(name):
            return function(*args, **kwargs)

    return traced


def measured_runs(checkpoint_root, name):
    paths = sorted(glob.glob(os.path.join(checkpoint_root, "page", f"{name}-rank*.pt")))
    paths.sort(key=lambda path: int(path.rsplit("rank", 1)[1][:-3]))
    return [torch.load(path, weights_only=False) for path in paths]


# sphinx_gallery_end_ignore


def train_with_default_stager(checkpoint_root):
    model, optimizer = build_sharded_model(seed=0)
    app_state = AppState(model, optimizer)
    checkpoint_group = dist.new_group(backend="gloo")  # rule 1
    stager = DefaultStager(staging_options())  # rule 2: after set_device, on this rank's GPU
    device = device_for_this_rank()
    response = None
    # sphinx_gallery_start_ignore
    timeline = Timeline(checkpoint_root, stager, trace="default_stager_recipe.trace")
    # sphinx_gallery_end_ignore

    for step in range(NUM_STEPS + 1):
        if step > 0:
            batch = torch.rand(BATCH, WIDTH, device=device)
            optimizer.zero_grad()
            # sphinx_gallery_start_ignore
            timeline.begin("forward", step)
            # sphinx_gallery_end_ignore
            loss = model(batch).pow(2).mean()  # overlaps the copy of the last save
            # sphinx_gallery_start_ignore
            timeline.begin("backward", step)
            # sphinx_gallery_end_ignore
            loss.backward()  # so does this
            # sphinx_gallery_start_ignore
            timeline.begin("wait for staging", step)
            # sphinx_gallery_end_ignore
            response.staging_completion.result()  # rule 7
            # sphinx_gallery_start_ignore
            timeline.begin("optimizer.step", step)
            # sphinx_gallery_end_ignore
            optimizer.step()
            # sphinx_gallery_start_ignore
            timeline.end()
            # sphinx_gallery_end_ignore

        if step % SAVE_EVERY == 0:
            # sphinx_gallery_start_ignore
            timeline.begin("wait for upload", step)
            # sphinx_gallery_end_ignore
            if response is not None:
                response.upload_completion.result()  # rule 3
            # sphinx_gallery_start_ignore
            timeline.end()
            if step > 0:
                timeline.snapshot(app_state, step)  # the state at this save, for the check
            timeline.begin_save(step)
            # sphinx_gallery_end_ignore
            if torch.accelerator.is_available():
                torch.accelerator.current_stream().synchronize()  # rule 4
            response = dcp.async_save(
                {"app": app_state},
                checkpoint_id=os.path.join(checkpoint_root, f"step-{step}"),
                process_group=checkpoint_group,
                async_stager=stager,
            )
            # sphinx_gallery_start_ignore
            timeline.end_save(response)
            # sphinx_gallery_end_ignore
            if step == 0:
                response.upload_completion.result()  # allocate the buffers, check the storage

    response.upload_completion.result()  # rule 8
    # sphinx_gallery_start_ignore
    timeline.before_close()
    # sphinx_gallery_end_ignore
    stager.close()  # rule 8: stops the staging thread, frees the host buffers
    dist.destroy_process_group(checkpoint_group)  # rule 9
    # sphinx_gallery_start_ignore
    timeline.after_close("default-stager", app_state)
    # sphinx_gallery_end_ignore


run_on_ranks(train_with_default_stager, os.path.join(WORK_DIR, "overlapped"))
# sphinx_gallery_start_ignore
default_stager_runs = measured_runs(os.path.join(WORK_DIR, "overlapped"), "default-stager")
# sphinx_gallery_end_ignore


# %%
# The stager ran its copies on a thread of its own, which ``stager.close()``
# stopped, and it copied every save into the host buffers it allocated at the
# first one.
#
# For comparison, the same loop with plain ``async_save``: its built-in
# stager copies on the training thread, inside the call, and it returns a plain
# ``Future`` for the upload. There is nothing to wait for before the step.


def train_with_plain_async_save(checkpoint_root):
    model, optimizer = build_sharded_model(seed=0)
    app_state = AppState(model, optimizer)
    checkpoint_group = dist.new_group(backend="gloo")
    device = device_for_this_rank()
    upload = None
    # sphinx_gallery_start_ignore
    timeline = Timeline(checkpoint_root, trace="plain_async_save.trace")
    # sphinx_gallery_end_ignore

    for step in range(NUM_STEPS + 1):
        if step > 0:
            batch = torch.rand(BATCH, WIDTH, device=device)
            optimizer.zero_grad()
            # sphinx_gallery_start_ignore
            timeline.begin("forward", step)
            # sphinx_gallery_end_ignore
            loss = model(batch).pow(2).mean()
            # sphinx_gallery_start_ignore
            timeline.begin("backward", step)
            # sphinx_gallery_end_ignore
            loss.backward()
            # sphinx_gallery_start_ignore
            timeline.begin("optimizer.step", step)
            # sphinx_gallery_end_ignore
            optimizer.step()
            # sphinx_gallery_start_ignore
            timeline.end()
            # sphinx_gallery_end_ignore

        if step % SAVE_EVERY == 0:
            # sphinx_gallery_start_ignore
            timeline.begin("wait for upload", step)
            # sphinx_gallery_end_ignore
            if upload is not None:
                upload.result()
            # sphinx_gallery_start_ignore
            timeline.begin_save(step)
            # sphinx_gallery_end_ignore
            upload = dcp.async_save(
                {"app": app_state},
                checkpoint_id=os.path.join(checkpoint_root, f"step-{step}"),
                process_group=checkpoint_group,
            )
            # sphinx_gallery_start_ignore
            timeline.end_save(upload)
            # sphinx_gallery_end_ignore
            if step == 0:
                upload.result()

    upload.result()
    dist.destroy_process_group(checkpoint_group)
    # sphinx_gallery_start_ignore
    timeline.after_close("plain")
    # sphinx_gallery_end_ignore


run_on_ranks(train_with_plain_async_save, os.path.join(WORK_DIR, "plain"))
# sphinx_gallery_start_ignore
# The timeline: rank 0's view of both runs.
plain_runs = measured_runs(os.path.join(WORK_DIR, "plain"), "plain")
returned = [run[0]["saves"][0]["response"] for run in (plain_runs, default_stager_runs)]
print(f"async_save returned a {returned[0]} here, and an {returned[1]} with DefaultStager")

COLORS = {
    "forward": "tab:blue",
    "backward": "tab:cyan",
    "optimizer.step": "tab:green",
    "async_save": "tab:purple",
    "wait for staging": "tab:red",
    "wait for upload": "tab:orange",
    "staging": "tab:pink",
    "upload": "tab:gray",
}


def background(run):
    """(what, save step, start, end) for the background work of every save."""
    spans = []
    for save in run["saves"]:
        if save["staged"] > save["returned"]:  # the copy ran in the stager's thread
            spans.append(("staging", save["step"], save["called"], save["staged"]))
        spans.append(("upload", save["step"], save["staged"], save["uploaded"]))
    return spans


def draw(axis, run, title):
    """One run's timeline, in ms since its step 1 began; returns where it ends."""
    origin = next(start for _, step, start, _ in run["blocks"] if step == 1)
    rows = {"training thread": 0, "staging": 1, "upload": 2}
    spans = [("training thread", what, start, end) for what, _, start, end in run["blocks"]]
    spans += [(what, what, start, end) for what, _, start, end in background(run)]
    for row, what, start, end in spans:
        bar = (1000 * (start - origin), 1000 * (end - start))
        axis.broken_barh([bar], (rows[row] - 0.4, 0.8), color=COLORS[what])
    for save in run["saves"][1:]:
        called = 1000 * (save["called"] - origin)
        axis.annotate(f"save {save['step']}", (called, -0.45), ha="center", va="bottom", fontsize=8)
    axis.set_yticks(list(rows.values()), ["training\nthread", "staging", "upload"])
    axis.set_ylim(2.6, -1.1)  # top to bottom
    axis.set_title(title, loc="left", fontsize=10)
    return max(1000 * (end - origin) for *_, end in spans)


figure, (top, bottom) = plt.subplots(2, 1, figsize=(10, 5), sharex=True)
ends = [
    draw(top, default_stager_runs[0], "DefaultStager(use_async_staging=True)"),
    draw(bottom, plain_runs[0], "plain async_save"),
]
bottom.set_xlim(0, 1.02 * max(ends))
bottom.set_xlabel("ms since step 1 began (rank 0)")
figure.legend(
    handles=[plt.Rectangle((0, 0), 1, 1, color=color) for color in COLORS.values()],
    labels=list(COLORS),
    loc="lower center",
    ncol=4,
    fontsize=8,
    frameon=False,
)
figure.tight_layout(rect=(0, 0.1, 1, 1))


def block(run, what, step):
    return next((start, end) for name, s, start, end in run["blocks"] if (name, s) == (what, step))


def describe_saves(run):
    for save in run["saves"][1:]:
        step, zero = save["step"], save["called"]
        if step == NUM_STEPS:
            continue

        def ms(interval, zero=zero):
            return "-".join(f"{1000 * (t - zero):.1f}" for t in interval)

        following = step + 1
        forward, backward = block(run, "forward", following), block(run, "backward", following)
        beside = min(save["staged"], backward[1]) - max(save["called"], forward[0])
        print(
            f"save after step {step}: async_save returned at {ms([save['returned']])}; "
            f"staging {ms([save['called'], save['staged']])}; "
            f"step {following}: forward {ms(forward)}, backward {ms(backward)}, "
            f"optimizer.step {ms(block(run, 'optimizer.step', following))}; "
            f"upload done at {ms([save['uploaded']])}"
        )
        if beside > 0:
            print(
                f"  the copy ran beside step {following}'s forward and backward pass "
                f"for {1000 * beside:.1f} ms"
            )
        else:
            print(f"  the copy was done before step {following}'s forward pass began")


def blocked_ms(run, save_step):
    waits = [("async_save", save_step), ("wait for upload", save_step)]
    waits.append(("wait for staging", save_step + 1))
    total = 0.0
    for what, step in waits:
        total += sum(
            end - start for name, s, start, end in run["blocks"] if (name, s) == (what, step)
        )
    return 1000 * total


def slowest_rank(runs, save_step):
    return max(blocked_ms(run, save_step) for run in runs)


def loop_seconds(run):
    steps = [(start, end) for _, step, start, end in run["blocks"] if step >= 1]
    return max(end for _, end in steps) - min(start for start, _ in steps)


def describe_trace(path):
    """What rank 0's profiler trace holds: the loop's ranges by thread, and GPU streams."""
    with open(path) as trace_file:
        events = json.load(trace_file)["traceEvents"]
    ranges = [e for e in events if e.get("cat") == "user_annotation" and e.get("ph") == "X"]
    training = next(e["tid"] for e in ranges if e["name"] == "forward")
    phases = ["forward", "backward", "wait for staging", "optimizer.step"]
    phases += ["wait for upload", "async_save"]
    on_training = collections.Counter(e["name"] for e in ranges if e["tid"] == training)
    copies = [e for e in ranges if e["name"] == "DefaultStager: copy to host"]
    where = (
        "a thread of its own" if copies and copies[0]["tid"] != training else "the training thread"
    )
    counts = ", ".join(f"{name} x{on_training[name]}" for name in phases if on_training[name])
    print(f"{os.path.basename(path)}: {os.path.getsize(path) / 1e6:.1f} MB, {len(events)} events")
    print(f"  on the training thread: {counts}")
    if copies:
        print(f"  DefaultStager: copy to host x{len(copies)}, on {where}")
    kernels = collections.Counter(
        e.get("args", {}).get("stream") for e in events if e.get("cat") == "kernel"
    )
    # "Memcpy DtoH (Device -> Pinned)": a copy to host memory, and the kind of that memory.
    to_host = collections.Counter(
        (e.get("args", {}).get("stream"), e["name"].partition("-> ")[2].rstrip(")") or "?")
        for e in events
        if e.get("cat") == "gpu_memcpy" and "DtoH" in e.get("name", "")
    )
    if kernels:  # on a GPU: the streams that ran the kernels and the copies to host memory
        compute = kernels.most_common(1)[0][0]
        print(f"  GPU kernels: {kernels.total()}, {kernels[compute]} of them on stream {compute}")
        for (stream, memory), count in sorted(to_host.items(), key=str):
            which = "the compute stream" if stream == compute else "a stream of its own"
            if stream != compute and kernels[stream]:
                which = f"a stream with {kernels[stream]} kernels"
            print(f"  copies to {memory.lower()} host memory on stream {stream} ({which}): {count}")


print("\nProfiler traces of rank 0 (Chrome trace JSON: https://ui.perfetto.dev, chrome://tracing):")
for run in (default_stager_runs[0], plain_runs[0]):
    describe_trace(run["trace"])

print("\nEach save after the first, rank 0, ms since the async_save call:")
describe_saves(default_stager_runs[0])
measured = [save["step"] for save in default_stager_runs[0]["saves"][1:]]
print(f"\n{'blocked per save (ms, slowest rank)':<38} {'async_save':>10} {'DefaultStager':>14}")
for step in measured:
    plain, overlapped = slowest_rank(plain_runs, step), slowest_rank(default_stager_runs, step)
    print(f"{'save after step ' + str(step):<38} {plain:10.1f} {overlapped:14.1f}")
plain = statistics.median(slowest_rank(plain_runs, step) for step in measured)
overlapped = statistics.median(slowest_rank(default_stager_runs, step) for step in measured)
print(f"{'median':<38} {plain:10.1f} {overlapped:14.1f}")
loop_s = [loop_seconds(runs[0]) for runs in (plain_runs, default_stager_runs)]
print(
    f"steps 1 to {NUM_STEPS}, rank 0: {loop_s[0]:.2f} s with async_save, "
    f"{loop_s[1]:.2f} s with DefaultStager"
)
SUMMARY = (
    f"blocked per save on {'GPU' if torch.cuda.is_available() else 'CPU'} (median, slowest "
    f"rank): async_save {plain:.1f} ms, DefaultStager {overlapped:.1f} ms; steps 1 to "
    f"{NUM_STEPS} (rank 0): {loop_s[0]:.2f} s and {loop_s[1]:.2f} s"
)
# sphinx_gallery_end_ignore


# %%
# Reading the timeline
# --------------------
# The figure is rank 0's timeline of both runs, from the first step to the
# last upload. The top row of each run is the training thread, the rows below
# it the background work of each save. With ``DefaultStager`` the
# ``async_save`` call is short and the copy runs beside the next step's
# forward and backward pass; with plain ``async_save`` the copy is inside the
# call. Both upload in the background for several steps. The short gap before
# each ``DefaultStager`` save is the page's own copy of the state for the
# check below, not part of the loop.
#
# The build also ran both loops under ``torch.profiler``, each phase of the
# loop in a ``torch.profiler.record_function`` range of that name, and the
# stager's copy in one of its own; the lines under the figure say what rank
# 0's two traces hold. The DefaultStager loop's trace is the "Download the
# profiler trace" link at the top of this page (run as a script, the recipe
# writes it beside itself): open it in https://ui.perfetto.dev or
# ``chrome://tracing``. A profile of your own job shows the same picture: the
# copy on a thread of the stager's, and on a GPU the device-to-host copies on
# the stager's stream beside the compute kernels on yours (built on a GPU, the
# lines under the figure count both, stream by stream).
#
# The lines after them give the numbers for each save after the first: times in
# ms since the ``async_save`` call, on rank 0. The copy (``staging``) starts
# inside the call. If it is still running when the call returns, the next
# step's forward and backward pass run beside it; either way that step's
# ``optimizer.step()`` starts only after it is done.
#
# The table is the time a save blocks the training thread: the ``async_save``
# call, plus the wait for the previous upload before it, plus (with
# ``DefaultStager``) the wait for staging before the next ``optimizer.step()``.
# The slowest rank counts, since collectives make the others wait for it.
#
# Read the two numbers together. Taking the copy off the training thread
# shortens what the loop blocks on, but the copy still has to run somewhere.
# On a GPU it is a device-to-host copy into pinned memory on the stager's
# stream, beside the compute kernels on yours (the trace lines above count
# both, when the page is built on a GPU), and the host's cores stay free for
# the upload. On a CPU-only machine the copy, the upload and training share
# the same cores and memory bus, so a step that runs beside a copy runs
# slower, and the whole loop may gain nothing at all: the copy's cost moves
# off the training thread, but it does not go away.


# %%
# The checkpoint is the state at the save
# ---------------------------------------
# In the loop above, ``optimizer.step()`` ran right after ``staging_completion``
# resolved, while the upload was still writing the checkpoint from the staged
# copy. Load each checkpoint saved during training into a freshly built model
# (different weights, so nothing matches by luck), as a run that resumes would.
# The page compares each one, tensor by tensor and bit for bit, with the copy
# of the state it kept at the save, and with the live state at the end of
# training.


def load_each_checkpoint(checkpoint_root):
    for step in SAVED_DURING_TRAINING:
        model, optimizer = build_sharded_model(seed=1)
        app_state = AppState(model, optimizer)
        dcp.load({"app": app_state}, checkpoint_id=os.path.join(checkpoint_root, f"step-{step}"))
        # sphinx_gallery_start_ignore
        expected = torch.load(page_file(checkpoint_root, f"step-{step}", rank()))
        final = torch.load(page_file(checkpoint_root, "final", rank()))
        loaded = local_copy(app_state.state_dict())
        assert expected.keys() == loaded.keys(), "the checkpoint holds other tensors"
        changed = [name for name in expected if not torch.equal(expected[name], loaded[name])]
        moved_on = [name for name in final if not torch.equal(final[name], loaded[name])]
        print(
            f"checkpoint at step {step}: {len(expected)} tensors compared with the state at the "
            f"save: {len(changed)} differ (from the live state at the end: {len(moved_on)} differ)"
        )
        assert not changed, f"step {step}: the checkpoint is not the state at the save: {changed}"
        # sphinx_gallery_end_ignore


run_on_ranks(load_each_checkpoint, os.path.join(WORK_DIR, "overlapped"))


# %%
# Every checkpoint is the state at its save, on every rank, although each
# ``optimizer.step()`` after a save changed those very tensors while the upload
# was still running (the times above). What makes it safe is the order: the
# step waited for ``staging_completion``, and the upload writes from the staged
# copy, never from the live tensors.
#
# What the rules protect against
# ------------------------------
# Take the wait away, or put it after ``optimizer.step()``, and the step
# updates tensors the stager has not copied yet: the checkpoint is a mix of the
# state before and after the step. Nothing fails; only a comparison like the
# one above shows it, or a resumed run that does not continue where it stopped.
# The same happens with a forward pass that updates buffers (rule 6), and a
# save started while the previous upload is still writing from the stager's
# buffers overwrites them (rule 3). Whether a given save is hit is a race
# between two threads, decided by timing and by the order in which the stager
# copies tensors: a broken loop can pass a check like the one above many times
# before it writes a torn checkpoint, so passing it proves nothing about a
# loop that breaks the rules.
# :ref:`sphx_glr_recipes_staging_pitfalls_recipe.py` makes each race land the
# same way every time, without faking the copy, shows what the broken loops
# write, and counts how often the race hits when left alone.


# %%
# Plain values and containers (rule 5)
# ------------------------------------
# Inside the call, ``async_save`` calls every ``Stateful``'s ``state_dict()``
# and builds a new top-level dict from what you passed
# (``_stateful_to_state_dict`` in ``state_dict_saver.py``); the stager copies
# everything below that later, in its thread. So an ``int`` step counter,
# passed in the top-level dict or returned by ``state_dict()``, is fixed at the
# call: changing it afterwards rebinds a name and cannot reach the
# checkpoint. A dict passed or returned by reference is another matter: the
# stager copies whatever it holds when it gets to it. Below, the loop changes
# both right after ``async_save`` returns, then passes ``dict(progress)``
# instead of ``progress``.
#
# When the stager gets to the dict is a race with your loop. This build holds
# the copy back until both changes are made (with lines the page does not
# show), so that it lands the same way on every build.


def save_then_change(checkpoint_dir, pass_a_copy):
    stager = DefaultStager(staging_options())
    step, progress = 3, {"samples_seen": 300}
    # sphinx_gallery_start_ignore
    copy_may_start = threading.Event()
    stager._staging_executor.submit(copy_may_start.wait)  # its one worker copies after this
    # sphinx_gallery_end_ignore
    response = dcp.async_save(
        {"step": step, "progress": dict(progress) if pass_a_copy else progress},
        checkpoint_id=checkpoint_dir,
        async_stager=stager,
    )
    step += 1  # rebinds the name: async_save already holds the int 3
    progress["samples_seen"] += 100  # changes the dict, which the stager may not have copied yet
    # sphinx_gallery_start_ignore
    copy_may_start.set()
    # sphinx_gallery_end_ignore
    response.upload_completion.result()
    stager.close()
    saved = {"step": 0, "progress": {"samples_seen": 0}}
    dcp.load(saved, checkpoint_id=checkpoint_dir)
    if dist.get_rank() == 0:
        passed = "dict(progress)" if pass_a_copy else "progress"
        print(f"passed {passed}: the loop now has step={step}, progress={progress}")
        print(f"  the checkpoint holds step={saved['step']}, progress={saved['progress']}")


def show_values_and_containers(checkpoint_root):
    save_then_change(os.path.join(checkpoint_root, "by-reference"), pass_a_copy=False)
    save_then_change(os.path.join(checkpoint_root, "a-copy"), pass_a_copy=True)


run_on_ranks(show_values_and_containers, os.path.join(WORK_DIR, "values"))


# %%
# The step counter is saved as it was at the call, the dict passed by
# reference as it was after the change, and the copy as it was at the call.
# Tensors are the third kind: the stager copies them in its thread too, which
# is what rules 6 and 7 are about.
#
# When the stager reuses its buffers
# ----------------------------------
# The stager's host copies are not tied to ``use_pinned_memory``: this page's
# CPU build has pinned and shared memory off, and the loop above still copied
# every save into the buffers of the first. The cache is keyed on the source
# tensor's storage, and holds it weakly (``StateDictStager`` in
# ``_state_dict_stager.py``): a ``state_dict()`` that returns the live tensors,
# as ``get_state_dict`` does by default, finds its buffers again at every
# save. One that returns new tensors each time, clones or a CPU offload
# (``StateDictOptions(cpu_offload=True)``), reuses nothing: every save
# allocates and fills a new host copy, and the entry goes when the clone is
# freed. Two saves of the same model each way:


def save_twice(checkpoint_root, fresh_tensors):
    model = nn.Linear(WIDTH, WIDTH, device=device_for_this_rank())
    stager = DefaultStager(staging_options())
    # sphinx_gallery_start_ignore
    buffers = []
    # sphinx_gallery_end_ignore
    for save in range(2):
        state = model.state_dict()
        if fresh_tensors:
            state = {name: tensor.clone() for name, tensor in state.items()}
        if torch.accelerator.is_available():
            torch.accelerator.current_stream().synchronize()  # rule 4: the clones are done
        response = dcp.async_save(
            {"model": state},
            checkpoint_id=os.path.join(checkpoint_root, f"save-{save}"),
            async_stager=stager,
        )
        response.upload_completion.result()
        # sphinx_gallery_start_ignore
        buffers.append(stager._staging_future.result()["model"])  # what this save copied into
        # sphinx_gallery_end_ignore
    # sphinx_gallery_start_ignore
    # Both saves' host copies are alive here: the same addresses mean the same buffers.
    first, second = ([t.data_ptr() for t in staged.values()] for staged in buffers)
    same = first == second
    del state  # the loop's own reference to what it saved
    cached = len(host_buffers(stager))
    # sphinx_gallery_end_ignore
    stager.close()
    # sphinx_gallery_start_ignore
    if dist.get_rank() == 0:
        what = "clones of model.state_dict()" if fresh_tensors else "model.state_dict()"
        print(
            f"{what:<29} the second save copied into the first's host buffers: {same}; "
            f"still cached once the loop drops its state dict: {cached}"
        )
    # sphinx_gallery_end_ignore


def show_buffer_reuse(checkpoint_root):
    save_twice(os.path.join(checkpoint_root, "live"), fresh_tensors=False)
    save_twice(os.path.join(checkpoint_root, "clones"), fresh_tensors=True)


run_on_ranks(show_buffer_reuse, os.path.join(WORK_DIR, "reuse"))


# %%
# So keep the stager and return the live tensors from ``state_dict()``; if it
# must build new ones, the stager's cache cannot help, and each save costs an
# allocation of the whole host copy (with pinned memory, pinning it too). If
# those new tensors are made on the GPU, synchronize at the end of
# ``state_dict()`` (rule 4).
#
# Where a staging error shows up (rule 8)
# ---------------------------------------
# A value the stager cannot copy fails the copy in the stager's thread: here a
# generator (say, a data iterator put into the state by mistake), which cannot
# be pickled. ``async_save`` wraps the stager's future into
# ``staging_completion``, and it looks only once: if staging has already
# failed when it looks, it reports success (``state_dict_saver.py``:
# ``if not staging_future.done(): staging_future.add_done_callback(callback)``
# ``else: return_staging_future.set_result(None)``). A copy that fails at once
# has usually failed by then; this build makes sure of it (with lines it does
# not show). The
# upload starts from the stager's future itself, so ``upload_completion``
# raises the error every time.


def save_something_the_stager_cannot_copy(checkpoint_dir):
    stager = DefaultStager(staging_options())
    # sphinx_gallery_start_ignore
    stage = stager.stage

    def stage_and_let_it_finish(state_dict):
        future = stage(state_dict)
        wait([future])  # the copy has failed before async_save looks at the future
        return future

    stager.stage = stage_and_let_it_finish
    # sphinx_gallery_end_ignore
    state = {"model": nn.Linear(8, 8).state_dict(), "batches": (n for n in range(3))}
    response = dcp.async_save(state, checkpoint_id=checkpoint_dir, async_stager=stager)
    try:
        response.staging_completion.result()
        print("staging_completion.result() returned: staging looks fine")
    except TypeError as err:
        print(f"staging_completion.result() raised TypeError: {err}")
    try:
        response.upload_completion.result()
        print("upload_completion.result() returned")
    except TypeError as err:
        print(f"upload_completion.result() raised TypeError: {err}")
    stager.close()


run_on_ranks(save_something_the_stager_cannot_copy, os.path.join(WORK_DIR, "unstageable"))


# %%
# Wait on ``upload_completion.result()`` after every save, not only on
# ``staging_completion``: it is the one that always raises. Here every rank
# failed the same way before the upload started, so nothing waits. A rank
# that fails alone never joins the save's first collective (its upload stops
# at the stager's future, ``save_wrapper`` in ``_async_thread_executor.py``),
# so the other ranks' uploads would wait there until the group's timeout.


# %%
# Clean up
# --------

shutil.rmtree(WORK_DIR, ignore_errors=True)
print(f"removed {WORK_DIR}: {not os.path.exists(WORK_DIR)}")
# sphinx_gallery_start_ignore
print(f"default_stager_recipe: {SUMMARY}")
# sphinx_gallery_end_ignore


# %%
# What to read next
# -----------------
# * :ref:`sphx_glr_recipes_staging_pitfalls_recipe.py`: rules 3, 5, 6 and 7
#   broken on purpose, what each break writes into the checkpoint, and the fix.
# * :ref:`sphx_glr_recipes_resume_recipe.py`: this loop, checkpointing
#   everything a resume needs, killed in the middle of a save and resumed.
# * :ref:`sphx_glr_recipes_checkpoint_stall_benchmark.py`: what each way of
#   checkpointing costs, measured at a larger size.
# * :doc:`/troubleshooting`: symptoms and fixes for the usual DCP failures.
