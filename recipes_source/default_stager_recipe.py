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

    .. grid-item-card:: :octicon:`list-unordered;1em;` Prerequisites
       :class-card: card-prerequisites

       * PyTorch 2.9 or later
       * CPU (gloo) or one GPU per rank (NCCL, plus gloo for checkpointing)
       * :ref:`sphx_glr_recipes_async_save_recipe.py`: ``async_save``, a
         process group for checkpointing, one save in flight

As on every page of this site, code that runs on every rank is launched by
``run_on_ranks``, which starts the ranks (or uses the ones ``torchrun`` made)
and prints what each rank printed, labelled ``[rankN]``. The functions it runs
are plain DCP code for a training script started with ``torchrun``. Every
number below was measured when this page was built, on the machine named at
the top of the page.
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
#    # 2. Before each async_save, wait for the previous one:
#    #    response.upload_completion.result(). A reused stager copies into the
#    #    same host buffers that upload is still writing from: skipping the wait
#    #    can corrupt the previous checkpoint, it does not only cost memory.
#    # 3. On GPU, let the optimizer step finish before async_save:
#    #    torch.accelerator.current_stream().synchronize(). The stager copies on
#    #    a stream of its own, which does not wait for yours.
#    # 4. Hand async_save copies of Python values the loop keeps changing (step
#    #    counters, progress dicts): the stager copies them in the background too.
#    # 5. If the forward pass changes state-dict tensors in place (BatchNorm
#    #    running stats, buffers updated in forward), wait on
#    #    response.staging_completion before the next forward, or put clones of
#    #    those tensors in the state you save.
#    # 6. Otherwise wait on response.staging_completion right before
#    #    optimizer.step(), the first line that changes the saved tensors.
#    # 7. After the last save: response.upload_completion.result(), then
#    #    stager.close().
#    # 8. Destroy process groups only after that wait (dist.barrier() first for
#    #    the default group): a group destroyed under a running upload leaves a
#    #    checkpoint without .metadata.
#
# This page runs a loop that follows them and measures it.
# :ref:`sphx_glr_recipes_staging_pitfalls_recipe.py` breaks rules 2, 4, 5
# and 6 on purpose, shows what each break writes into the checkpoint, and
# proves each fix.

# %%
# Setup
# -----
# ``DefaultStager``, ``StagingOptions`` and ``AsyncSaveResponse`` arrived in
# PyTorch 2.9. On an older version the script says so and stops before it
# imports them.

import sys

import torch


def torch_is_at_least(version, minimum=(2, 9)):
    """True if a torch version string is ``minimum`` or later (nightlies of it count)."""
    major, minor = (int(part) for part in version.split(".")[:2])
    return (major, minor) >= minimum


if not torch_is_at_least(torch.__version__):
    print(f"This recipe needs PyTorch 2.9 or later; this is torch {torch.__version__}.")
    sys.exit(0)

import contextlib
import os
import shutil
import statistics
import threading
import time
import warnings

import matplotlib.pyplot as plt
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from rank_launcher import run_on_ranks, shared_tempdir
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

WORK_DIR = shared_tempdir("dcp-default-stager-")
print(f"torch {torch.__version__}; checkpoints go under {WORK_DIR}")


# %%
# Staging options from what the machine has
# -----------------------------------------
# :class:`~torch.distributed.checkpoint.staging.StagingOptions` has four
# switches, all on by default:
#
# * ``use_pinned_memory``: stage into page-locked host memory, so that copies
#   from the GPU run at full speed and can be asynchronous. Needs CUDA. The
#   stager keeps these buffers and reuses them at every save.
# * ``use_shared_memory``: allocate the host buffers in shared memory, so that
#   a checkpoint *process* (``AsyncCheckpointerType.PROCESS``) reads them in
#   place instead of receiving another copy. This page uploads from a thread
#   and does not need it. In containers ``/dev/shm`` is often small (64 MB
#   under Docker's defaults): turn it off there, or make ``/dev/shm`` as large
#   as a rank's share of the checkpoint.
# * ``use_async_staging``: copy in a background thread of the stager (a thread
#   pool with one worker). ``async_save`` then returns an ``AsyncSaveResponse``
#   before the copy is done. This is the option this page is about, and it
#   needs nothing but a thread.
# * ``use_non_blocking_copy``: issue the device-to-host copies with
#   ``non_blocking=True`` on a stream of the stager's own and wait for that
#   stream at the end. Needs an accelerator.
#
# On a GPU machine this page keeps the defaults but shared memory. Without an
# accelerator the defaults raise (below): keep ``use_async_staging`` and turn
# the rest off.
#
# .. versionadded:: 2.9
#    ``DefaultStager`` and ``StagingOptions``.


def staging_options():
    if torch.accelerator.is_available():
        # Pinned memory, async staging, non-blocking copies; no checkpoint process to share with.
        return StagingOptions(use_shared_memory=False)
    return StagingOptions(
        use_pinned_memory=False,
        use_shared_memory=False,
        use_async_staging=True,
        use_non_blocking_copy=False,
    )


def show_staging_options():
    if dist.get_rank() != 0:
        return
    with warnings.catch_warnings():
        # Without CUDA the defaults first warn that pinning is ignored; the error is the point.
        warnings.filterwarnings("ignore", message="Ignoring pin_memory flag")
        try:
            DefaultStager().close()
            print("DefaultStager() with the default options: works on this machine")
        except AssertionError as err:
            print(f"DefaultStager() with the default options: {type(err).__name__}: {err}")
    print(f"this page stages with {staging_options()}")


# A rank, not this process, tries the defaults: on a GPU machine they create a
# CUDA stream, and the process that starts the ranks must not touch CUDA.
run_on_ranks(show_staging_options)


# %%
# The model
# ---------
# The same small model as in the ``async_save`` recipe: a few wide linear
# layers, sharded with FSDP2 and trained with Adam, so the checkpoint holds
# three tensors per parameter. ``AppState`` is the usual ``Stateful`` wrapper;
# DCP calls its ``state_dict()`` at every save.

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
# Measuring the loop
# ------------------
# To draw the loop's timeline, each rank records what ran when. The training
# thread times its own blocks. The background work reports itself: a callback
# on ``staging_completion`` runs in the staging thread the moment the copy is
# done, and one on ``upload_completion`` runs when the checkpoint is written.
# The staging callback also notes which thread did the copy, so that we can
# check at the end that closing the stager stopped it. None of this is needed
# in your loop.


class Timeline:
    """What ran when on this rank, in seconds since the timeline was created."""

    def __init__(self):
        self.origin = time.perf_counter()
        self.blocks = []  # (what, step, start, end) on the training thread
        self.saves = []  # one dict per save: when it was called, returned, staged, uploaded
        self.staging_threads = set()

    def now(self):
        return time.perf_counter() - self.origin

    @contextlib.contextmanager
    def measure(self, what, step):
        start = self.now()
        yield
        if torch.accelerator.is_available():
            # Time the GPU's work, not only its launch; only this stream, so
            # that the stager's copies on its own stream keep running.
            torch.accelerator.current_stream().synchronize()
        self.blocks.append((what, step, start, self.now()))

    @contextlib.contextmanager
    def measure_save(self, step):
        save = {"step": step, "called": self.now()}
        with self.measure("async_save", step):
            yield save
        save["returned"] = self.blocks[-1][3]
        self.saves.append(save)

    def follow(self, save, response):
        """Record when the save's background work completes."""
        training_thread = threading.current_thread()
        save["response"] = type(response).__name__

        def staged(_):
            save["staged"] = self.now()
            if threading.current_thread() is not training_thread:
                self.staging_threads.add(threading.current_thread())

        if isinstance(response, AsyncSaveResponse):
            response.staging_completion.add_done_callback(staged)
            upload = response.upload_completion
        else:  # plain async_save: staged before it returned
            save["staged"] = save["returned"]
            upload = response
        upload.add_done_callback(lambda _: save.update(uploaded=self.now()))

    def report(self):
        return {"blocks": self.blocks, "saves": self.saves}


# %%
# The training loop
# -----------------
# One stager for the whole run, created before the loop and passed to every
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
#   ``.metadata``. Wait on it before the next save and before the end.
#
# .. versionadded:: 2.9
#    ``AsyncSaveResponse``, returned by ``async_save`` when the stager stages
#    asynchronously.
#
# The numbered comments are the rules from the top of the page. The
# ``timeline`` lines measure; take them out and the loop is the one to paste.
# The loop also keeps a copy of this rank's state at each save during training
# (``snapshots``), to compare the checkpoints with later.

NUM_STEPS, SAVE_EVERY = 10, 3  # saves after steps 0, 3, 6 and 9


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


def train_with_default_stager(checkpoint_root):
    model, optimizer = build_sharded_model(seed=0)
    app_state = AppState(model, optimizer)
    checkpoint_group = dist.new_group(backend="gloo")  # rule 1
    stager = DefaultStager(staging_options())
    device = device_for_this_rank()
    timeline, snapshots = Timeline(), {}
    response = None

    for step in range(NUM_STEPS + 1):
        if step > 0:
            batch = torch.rand(BATCH, WIDTH, device=device)
            optimizer.zero_grad()
            with timeline.measure("forward", step):
                loss = model(batch).pow(2).mean()  # overlaps the copy of the last save
            with timeline.measure("backward", step):
                loss.backward()  # so does this
            with timeline.measure("wait for staging", step):
                response.staging_completion.result()  # rule 6
            with timeline.measure("optimizer.step", step):
                optimizer.step()

        if step % SAVE_EVERY == 0:
            if response is not None:
                with timeline.measure("wait for upload", step):
                    response.upload_completion.result()  # rule 2
            if torch.accelerator.is_available():
                torch.accelerator.current_stream().synchronize()  # rule 3
            if step > 0:
                snapshots[step] = local_copy(app_state.state_dict())  # for the check below
            with timeline.measure_save(step) as save:
                response = dcp.async_save(
                    {"app": app_state},
                    checkpoint_id=os.path.join(checkpoint_root, f"step-{step}"),
                    process_group=checkpoint_group,
                    async_stager=stager,
                )
            timeline.follow(save, response)
            if step == 0:
                response.upload_completion.result()  # allocate the buffers, check the storage

    response.upload_completion.result()  # rule 7
    staging_threads = sorted(timeline.staging_threads, key=lambda thread: thread.name)
    running_before = [thread.is_alive() for thread in staging_threads]
    stager.close()  # rule 7: stops the staging thread, frees the host buffers
    running_after = [thread.is_alive() for thread in staging_threads]
    dist.destroy_process_group(checkpoint_group)  # rule 8

    names = ", ".join(thread.name for thread in staging_threads)
    print(
        f"staging ran on {names}; running before stager.close(): {running_before}, "
        f"after: {running_after}"
    )
    return {
        **timeline.report(),
        "snapshots": snapshots,
        "final": local_copy(app_state.state_dict()),
    }


default_stager_runs = run_on_ranks(train_with_default_stager, os.path.join(WORK_DIR, "overlapped"))


# %%
# For comparison, the same loop with plain ``async_save``: its built-in
# stager copies on the training thread, inside the call, and it returns a plain
# ``Future`` for the upload. There is nothing to wait for before the step.


def train_with_plain_async_save(checkpoint_root):
    model, optimizer = build_sharded_model(seed=0)
    app_state = AppState(model, optimizer)
    checkpoint_group = dist.new_group(backend="gloo")
    device = device_for_this_rank()
    timeline = Timeline()
    upload = None

    for step in range(NUM_STEPS + 1):
        if step > 0:
            batch = torch.rand(BATCH, WIDTH, device=device)
            optimizer.zero_grad()
            with timeline.measure("forward", step):
                loss = model(batch).pow(2).mean()
            with timeline.measure("backward", step):
                loss.backward()
            with timeline.measure("optimizer.step", step):
                optimizer.step()

        if step % SAVE_EVERY == 0:
            if upload is not None:
                with timeline.measure("wait for upload", step):
                    upload.result()
            with timeline.measure_save(step) as save:
                upload = dcp.async_save(
                    {"app": app_state},
                    checkpoint_id=os.path.join(checkpoint_root, f"step-{step}"),
                    process_group=checkpoint_group,
                )
            timeline.follow(save, upload)
            if step == 0:
                upload.result()

    upload.result()
    dist.destroy_process_group(checkpoint_group)
    return timeline.report()


plain_runs = run_on_ranks(train_with_plain_async_save, os.path.join(WORK_DIR, "plain"))
returned = [run[0]["saves"][0]["response"] for run in (plain_runs, default_stager_runs)]
print(f"async_save returned a {returned[0]} here, and an {returned[1]} with DefaultStager")


# %%
# The timeline
# ------------
# Rank 0's timeline of both runs, from the first step to the last upload. The
# top row of each run is the training thread, the rows below it the background
# work of each save. With ``DefaultStager`` the ``async_save`` call is short
# and the copy runs beside the next step's forward and backward pass; with
# plain ``async_save`` the copy is inside the call. Both upload in the
# background for several steps. The short gap before each ``DefaultStager``
# save is the copy of the state this page keeps for its check, not part of
# the loop you would paste.

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


# %%
# The numbers behind the figure, for each save after the first: times in ms
# since the ``async_save`` call, on rank 0. The copy (``staging``) starts
# inside the call. If it is still running when the call returns, the next
# step's forward and backward pass run beside it; either way that step's
# ``optimizer.step()`` starts only after it is done.


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


describe_saves(default_stager_runs[0])


# %%
# What the loop waits for at each save
# ------------------------------------
# The time a save blocks the training thread: the ``async_save`` call, plus
# the wait for the previous upload before it, plus (with ``DefaultStager``)
# the wait for staging before the next ``optimizer.step()``. The slowest rank
# counts, since collectives make the others wait for it.


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


measured = [save["step"] for save in default_stager_runs[0]["saves"][1:]]
print(f"{'blocked per save (ms, slowest rank)':<38} {'async_save':>10} {'DefaultStager':>14}")
for step in measured:
    plain, overlapped = slowest_rank(plain_runs, step), slowest_rank(default_stager_runs, step)
    print(f"{'save after step ' + str(step):<38} {plain:10.1f} {overlapped:14.1f}")
plain = statistics.median(slowest_rank(plain_runs, step) for step in measured)
overlapped = statistics.median(slowest_rank(default_stager_runs, step) for step in measured)
print(f"{'median':<38} {plain:10.1f} {overlapped:14.1f}")


def loop_seconds(run):
    steps = [(start, end) for _, step, start, end in run["blocks"] if step >= 1]
    return max(end for _, end in steps) - min(start for start, _ in steps)


print(
    f"steps 1 to {NUM_STEPS}, rank 0: {loop_seconds(plain_runs[0]):.2f} s with async_save, "
    f"{loop_seconds(default_stager_runs[0]):.2f} s with DefaultStager"
)


# %%
# Read the two numbers together. Taking the copy off the training thread
# shortens what the loop blocks on, but the copy still has to run somewhere.
# On a GPU machine it runs on the GPU's copy engine into pinned memory while
# the GPU computes, and the host has cores to spare. On this page's CPU
# machine the copy, the upload and training share two cores and one memory
# bus, so a step that runs beside a copy runs slower, and the whole loop may
# gain nothing at all: the copy's cost moves off the training thread, but it
# does not go away.


# %%
# The checkpoint is the state at the save
# ---------------------------------------
# In the loop above, ``optimizer.step()`` ran right after ``staging_completion``
# resolved, while the upload was still writing the checkpoint from the staged
# copy. Load each checkpoint saved during training into a freshly built model
# (different weights, so nothing matches by luck) and compare it, tensor by
# tensor and bit for bit, with the copy the loop kept at the save, and with the
# live state at the end of training.


def differing(expected, actual):
    assert expected.keys() == actual.keys(), "the checkpoint holds other tensors"
    return [name for name in expected if not torch.equal(expected[name], actual[name])]


def verify_checkpoints(checkpoint_root, runs):
    run = runs[dist.get_rank()]
    for step, expected in run["snapshots"].items():
        model, optimizer = build_sharded_model(seed=1)
        app_state = AppState(model, optimizer)
        dcp.load({"app": app_state}, checkpoint_id=os.path.join(checkpoint_root, f"step-{step}"))
        loaded = local_copy(app_state.state_dict())
        changed = differing(expected, loaded)
        moved_on = differing(run["final"], loaded)
        print(
            f"checkpoint at step {step}: {len(expected)} tensors compared with the state at the "
            f"save: {len(changed)} differ (from the live state at the end: {len(moved_on)} differ)"
        )
        assert not changed, f"step {step}: the checkpoint is not the state at the save: {changed}"


run_on_ranks(verify_checkpoints, os.path.join(WORK_DIR, "overlapped"), default_stager_runs)


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
# The same happens with a forward pass that updates buffers (rule 5), and a
# save started while the previous upload is still writing from the stager's
# buffers overwrites them (rule 2). Whether a given save is hit is a race
# between two threads, decided by timing and by the order in which the stager
# copies tensors: a broken loop can pass a check like the one above many times
# before it writes a torn checkpoint, so passing it proves nothing about a
# loop that breaks the rules.
# :ref:`sphx_glr_recipes_staging_pitfalls_recipe.py` makes each race land the
# same way every time, without faking the copy, shows what the broken loops
# write, and counts how often the race hits when left alone.


# %%
# Clean up
# --------

shutil.rmtree(WORK_DIR, ignore_errors=True)
print(f"removed {WORK_DIR}: {not os.path.exists(WORK_DIR)}")


# %%
# What to read next
# -----------------
# * :ref:`sphx_glr_recipes_staging_pitfalls_recipe.py`: each rule above broken
#   on purpose, what it writes into the checkpoint, and the fix.
# * :ref:`sphx_glr_recipes_checkpoint_stall_benchmark.py`: what each way of
#   checkpointing costs, measured at a larger size.
# * :doc:`/troubleshooting`: symptoms and fixes for the usual DCP failures.
