"""
Pitfalls of overlapped staging
==============================

With :class:`~torch.distributed.checkpoint.staging.DefaultStager` and
``use_async_staging=True``, ``dcp.async_save`` returns before the state has
been copied: a background thread copies ("stages") the live tensors while the
next forward and backward pass run. The contract is that nothing may change
what is being copied until ``staging_completion`` resolves, and the usual
advice, "wait for ``staging_completion`` right before ``optimizer.step()``",
covers only the optimizer. This recipe runs four training loops that break
the contract, and one that breaks it only on a GPU, shows what each writes
into its checkpoints, and proves each fix bit for bit.

.. grid:: 2

    .. grid-item-card:: :octicon:`mortar-board;1em;` What you will learn
       :class-card: card-prerequisites

       * Four hazards of overlapped staging: stepping early, a forward pass
         that updates buffers (BatchNorm), a reused stager's buffer overwritten
         by the next save, and Python values changed after the save call
       * The loop that fixes each one, proven bit-exact at every save
       * Where a GPU loop must synchronise before ``async_save``, and what it
         saves when it does not
       * How often each race hits when nothing decides it

    .. grid-item-card:: :octicon:`list-unordered;1em;` Prerequisites
       :class-card: card-prerequisites

       * PyTorch 2.9 or later, but not 2.11.0, whose ``DefaultStager`` cannot be reused
         (:ref:`reused-stager-keyerror`)
       * CPU (gloo) or one GPU per rank (NCCL, plus gloo for checkpointing)
       * :ref:`sphx_glr_recipes_default_stager_recipe.py`: ``DefaultStager``,
         ``StagingOptions`` and the loop this page takes apart

As on every page of this site, code that runs on every rank is launched by
``run_on_ranks``, which starts the ranks (or uses the ones ``torchrun`` made)
and prints what each rank printed, labelled ``[rankN]``. Every count below was
measured when this page was built, on the machine named at the top of the page.
"""

# %%
# Setup
# -----
# One rule for the staging options on every page of this site, chosen from the
# machine. On a GPU, pinned memory and non-blocking copies speed up the copy
# from the device (measured in
# :ref:`the async_save recipe <sphx_glr_recipes_async_save_recipe.py>`); on a
# CPU-only machine they do not apply (and
# non-blocking copies raise without an accelerator). Shared memory serves only
# a checkpoint *process*; this page uploads from a thread. What this page is
# about is ``use_async_staging=True``: the copy runs in a background thread.
#
# .. versionadded:: 2.9
#    ``DefaultStager``, ``StagingOptions`` and ``AsyncSaveResponse``.

import functools
import os
import shutil

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from rank_launcher import run_on_ranks, shared_tempdir
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict import get_state_dict

WORK_DIR = shared_tempdir("dcp-staging-pitfalls-")
SAVES = 5  # every loop below saves this many times


def staging_options():
    on_gpu = torch.accelerator.is_available()
    return StagingOptions(
        use_pinned_memory=on_gpu,  # page-locked memory only speeds up copies from a device
        use_shared_memory=False,  # only a checkpoint *process* reads shared memory in place
        use_async_staging=True,
        use_non_blocking_copy=on_gpu,
    )


print(f"torch {torch.__version__}; checkpoints go under {WORK_DIR}")


# %%
# The model, the data and the state
# ---------------------------------
# A small model trained with Adam, so the checkpoint holds weights, Adam's two
# moments and its step counters. One variant starts with a ``BatchNorm1d``,
# whose forward pass updates ``running_mean``, ``running_var`` and
# ``num_batches_tracked`` in place.
#
# Every rank holds the same replica and trains on the same batches (as
# data-parallel replicas stay equal), so a checkpoint has exactly one right
# answer; DCP writes each replicated tensor once, from one of the ranks. The
# checkpoints go through a gloo process group of their own, as they should in
# any loop that overlaps saves with training.

WIDTH, CLASSES, BATCH = 256, 8, 32


def device_for_this_rank():
    # The launcher (or your own set-up code) has already picked this rank's GPU.
    if torch.accelerator.is_available():
        return torch.accelerator.current_accelerator()
    return torch.device("cpu")


def make_model(batch_norm_first=False):
    layers = [nn.BatchNorm1d(WIDTH)] if batch_norm_first else []
    layers += [nn.Linear(WIDTH, WIDTH), nn.ReLU(), nn.Linear(WIDTH, CLASSES)]
    return nn.Sequential(*layers)


def build_model(batch_norm_first=False, seed=0):
    torch.manual_seed(seed)
    model = make_model(batch_norm_first).to(device_for_this_rank())
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    return model, optimizer


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
def checkpoint_group(index=0):
    # Created on first use, on every rank in the same order (a collective).
    return dist.new_group(backend="gloo")


print(make_model(batch_norm_first=True))


# %%
# Running a loop, and checking what it saved
# ------------------------------------------
# Each loop below is a few steps of training with a save at every step, as
# you would write it (a real loop saves every few hundred steps; here every
# step, to have ``SAVES`` checkpoints to check). ``run_loop`` gives it a
# model with one step of training behind it (so that Adam has state), a data
# stream, and one ``DefaultStager`` reused for every save, as it should be:
# the stager keeps its host buffers from one save to the next. The loop then
# runs on every rank.
#
# How this page checks a loop: at every save call the build records a deep
# copy of the state (the snapshot); after the loop, rank 0 reads every
# checkpoint back and compares each entry with its snapshot, bit for bit.
# Whether a hazard corrupts a checkpoint depends on which thread gets there
# first, the staging thread copying a tensor or the training thread changing
# it, so with this page's small model some hazards show only now and then. A
# page that shows a bug only sometimes proves nothing, so the build also
# decides the race: a wrapper around the stager starts ``DefaultStager``'s own
# copy (for hazard 3, a checkpoint's writes) at a chosen line of the loop.
# In a hazard that is right after the line that changes the state, as happens
# whenever staging is slower than the loop (a large model on a busy host); in
# a fix, the worst moment the fix allows. That code serves the page only: it
# is hidden here and in the notebook, and runs in the build and in the ``.py``
# download. Without it, every loop below runs exactly as shown, nothing held;
# the last section runs the broken ones that way and counts how often they hit.

# sphinx_gallery_start_ignore
# Everything between these markers serves the page only: Sphinx-Gallery runs
# it in the build (and keeps it in the .py download) but shows it neither on
# the page nor in the notebook. Without it, every loop below runs as shown,
# with nothing held and nothing checked.
#
# The check: at every save call the loop records a deep copy of the state
# (the snapshot); afterwards rank 0 reads every checkpoint back
# (no_dist=True: one process reads all ranks' files) and compares each entry
# with the snapshot, bit for bit. dcp.load reads in place, so it gets blank
# tensors (NaN or -1, never a value the state could hold by accident) and
# None where a Python value goes.
#
# The hold: HeldStager wraps the real DefaultStager and decides when its copy
# starts (stage() returns at once, as async staging does, and hands the state
# to DefaultStager.stage only at let_copy_start()), and when a checkpoint's
# upload starts writing (FileSystemWriter.write_data waits for
# let_writes_start()). The copy, its thread, its cached buffers, the upload
# and the futures async_save returns are all DCP's; the hold only chooses
# when they start.

import copy
import statistics
import threading
import time
import warnings
from concurrent.futures import Future, ThreadPoolExecutor

from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.staging import AsyncStager

HOLD = True  # the race-counting section at the end turns the hold off
LOOPS_LEFT_TO_CHANCE_SAVE = 8  # saves per loop there

# label: (what is held, the outcome the page proves with the hold). "device": the
# compute stream is kept busy ahead of the step; without streams (CPU) nothing races.
EXPECTED = {
    "wait_before_step": ("copies", "bit-exact"),
    "save_without_synchronizing": ("device", "torn on a device"),
    "synchronize_before_save": ("device", "bit-exact"),
    "step_before_staging": ("copies", "torn"),
    "wait_before_step_with_batch_norm": ("copies", "torn"),
    "wait_before_forward": ("copies", "bit-exact"),
    "stage_buffers_at_save_call": ("copies", "bit-exact"),
    "next_save_before_upload": ("writes", "torn"),
    "wait_for_upload_before_next_save": ("writes", "bit-exact"),
    "progress_updated_after_save": ("copies", "torn"),
    "progress_copied_at_save_call": ("copies", "bit-exact"),
}
# The last save of a loop has no next save that could overwrite its buffers.
NEEDS_A_NEXT_SAVE = {"next_save_before_upload", "wait_for_upload_before_next_save"}
COUNTS = {}  # label -> entries that differ, per checkpoint, of the last run of the loop
DIFFERED = {}  # label -> (names that differed in any checkpoint, every tensor's name)
_held_writes = {}  # checkpoint path -> threading.Event: its upload writes once set
_file_system_write_data = FileSystemWriter.write_data


def _write_data_when_let(writer, plan, planner):
    gate = _held_writes.get(os.path.abspath(os.fspath(writer.path)))
    if gate is not None:
        gate.wait()
    return _file_system_write_data(writer, plan, planner)


FileSystemWriter.write_data = _write_data_when_let


class HeldStager(AsyncStager):
    """Page only: DefaultStager, with the start of its copy and of uploads held."""

    def __init__(self, stager, hold_copies=False, hold_writes=False, hold_device=False):
        self.stager, self.hold_copies, self.hold_writes = stager, hold_copies, hold_writes
        self.hold_device = hold_device
        self.snapshots = []  # (state at the save call, checkpoint path)
        self._copy_may_start = threading.Event()
        self._waiter = ThreadPoolExecutor(max_workers=1, thread_name_prefix="held-stager")
        self._gates = {}

    def snapshot(self, state, path):
        self.snapshots.append((copy.deepcopy(state), path))
        if self.hold_writes:
            self._gates[path] = _held_writes[os.path.abspath(path)] = threading.Event()

    def stage(self, state_dict):
        if not self.hold_copies:
            return self.stager.stage(state_dict)
        self._copy_may_start = copy_may_start = threading.Event()

        def copy_when_let():
            copy_may_start.wait()
            staged = self.stager.stage(state_dict)  # DefaultStager's own copy
            return staged.result() if isinstance(staged, Future) else staged

        return self._waiter.submit(copy_when_let)

    def let_copy_start(self):
        if self.hold_copies:
            if torch.accelerator.is_available():
                torch.accelerator.synchronize()  # the change has happened on the device
            self._copy_may_start.set()

    def keep_device_busy(self):
        """Queue about half a second of GPU work ahead of what the loop queues next.

        As a large model's kernels do: the step queued after it runs that much later,
        long after async_save has started the stager's copy on the stager's stream.
        """
        if self.hold_device and torch.cuda.is_available():
            torch.cuda._sleep(10**9)  # a spin kernel of 1e9 GPU clock cycles

    def warm_up(self, state):
        """Before the loop, once: whatever a save would otherwise allocate or create.

        The stager's buffers (the first save of a stager registers them, and registering can
        make CUDA wait for the device), the checkpoint group, and device memory for the
        snapshots (a new allocation from CUDA can wait for the device too). The saves in
        the loop then wait for nothing, as at every save of a long run but the first.
        """
        staged = self.stager.stage(state)
        if isinstance(staged, Future):
            staged.result()
        checkpoint_group()
        if torch.cuda.is_available():
            snapshots = [copy.deepcopy(state) for _ in range(SAVES + 1)]
            del snapshots  # the caching allocator keeps the memory for the real snapshots
            torch.cuda.synchronize()

    def let_writes_start(self, keep=None):
        """Let every held upload write, except the one of checkpoint ``keep``."""
        for path, gate in self._gates.items():
            if path != keep:
                gate.set()

    def close(self):
        self._copy_may_start.set()
        self.let_writes_start()
        self._waiter.shutdown(wait=True)
        self.stager.close()
        for path in self._gates:
            _held_writes.pop(os.path.abspath(path), None)


def blank_like(value):
    if isinstance(value, dict):
        return {key: blank_like(item) for key, item in value.items()}
    if isinstance(value, list):
        return [blank_like(item) for item in value]
    if isinstance(value, torch.Tensor):
        return torch.full_like(value, float("nan") if value.is_floating_point() else -1)
    return None


def flatten(value, prefix=""):
    """{"model.0.weight": tensor, ...}: every leaf of a nested state dict, by name."""
    if isinstance(value, dict):
        items = value.items()
    elif isinstance(value, list) and any(isinstance(item, dict) for item in value):
        items = enumerate(value)
    else:
        return {prefix.rstrip("."): value}
    leaves = {}
    for key, item in items:
        leaves.update(flatten(item, f"{prefix}{key}."))
    return leaves


def differences(snapshot, checkpoint_path):
    """(names that differ, what was compared) between a snapshot and a checkpoint."""
    loaded = blank_like(snapshot)
    with warnings.catch_warnings():
        # DCP warns that it assumes a single process even when no_dist=True says so.
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        dcp.load(loaded, checkpoint_id=checkpoint_path, no_dist=True)
    expected, actual = flatten(snapshot), flatten(loaded)
    differ = []
    for name, value in expected.items():
        same = torch.equal(value, actual[name]) if torch.is_tensor(value) else value == actual[name]
        if not same:
            differ.append(name)
    tensors = sum(torch.is_tensor(value) for value in expected.values())
    return differ, f"{len(expected)} entries ({tensors} tensors)"


def loop_label(loop, batch_norm_first):
    with_batch_norm = f"{loop.__name__}_with_batch_norm"
    return with_batch_norm if batch_norm_first and with_batch_norm in EXPECTED else loop.__name__


def report(label, stager):
    """Rank 0 compares every checkpoint with its snapshot; returns the counts."""
    if dist.get_rank() != 0:
        return None
    snapshots = stager.snapshots[:-1] if label in NEEDS_A_NEXT_SAVE else stager.snapshots
    counts, example, differed = [], [], set()
    for snapshot, path in snapshots:
        differ, compared = differences(snapshot, path)
        counts.append(len(differ))
        example = example or differ
        differed.update(differ)
    tensors = [name for name, value in flatten(snapshots[0][0]).items() if torch.is_tensor(value)]
    DIFFERED[label] = (differed, tensors)
    if HOLD:
        expect = EXPECTED[label][1]
        if expect == "torn on a device":
            expect = "torn" if torch.accelerator.is_available() else "bit-exact"
        torn = sum(count > 0 for count in counts)
        verdict = {0: "bit-exact every time", len(counts): "not the saved state, every time"}
        print(f"{label:<34} {counts} of {compared} differ: {verdict.get(torn)}")
        if example:
            print(f"{'':<34} e.g. {', '.join(example[:3])}{', ...' if len(example) > 3 else ''}")
        assert torn == (0 if expect == "bit-exact" else len(counts)), (label, counts)
    return counts


# sphinx_gallery_end_ignore


def run_loop(loop, batch_norm_first=False, checkpoints_under=WORK_DIR):
    model, optimizer = build_model(batch_norm_first)
    data = batches()
    train_step(model, optimizer, next(data))
    stager = DefaultStager(staging_options())  # after the launcher's torch.cuda.set_device
    name = f"{loop.__name__}-with-batch-norm" if batch_norm_first else loop.__name__
    checkpoint_dir = os.path.join(checkpoints_under, name)  # one new directory per save in it
    # sphinx_gallery_start_ignore
    label = loop_label(loop, batch_norm_first)
    held = EXPECTED[label][0] if HOLD else None
    stager = HeldStager(
        stager,
        hold_copies=held == "copies",
        hold_writes=held == "writes",
        hold_device=held == "device",
    )
    if held == "device":
        stager.warm_up(checkpoint_state(model, optimizer))
    saves = SAVES if HOLD else LOOPS_LEFT_TO_CHANCE_SAVE
    saves += label in NEEDS_A_NEXT_SAVE
    loop = functools.partial(loop, saves=saves)
    # sphinx_gallery_end_ignore
    try:
        loop(model, optimizer, data, stager, checkpoint_dir)
    finally:
        stager.close()
    # sphinx_gallery_start_ignore
    COUNTS[label] = report(label, stager)
    # sphinx_gallery_end_ignore


# %%
# The pattern that works, for a model without forward-mutated state
# ------------------------------------------------------------------
# The loop from the DefaultStager recipe: save, run the next forward and
# backward while staging runs, wait for ``staging_completion`` right before
# ``optimizer.step()``, the first line that changes the weights. Each step
# also waits for its upload, so that one save at most is in flight (hazard 3
# shows why that matters).
#
# On a GPU, the loop synchronises the compute stream right before
# ``async_save``: with non-blocking copies the stager copies on a stream of its
# own, which does not wait for the kernels your loop queued (the last
# ``optimizer.step()``), so without it the copy can read weights that are still
# being written. Build the state dict *before* that synchronisation: GPU work
# that ``async_save`` starts itself (a ``Stateful``'s ``state_dict()`` that
# clones, offloads or gathers) runs after it and is not covered. On CPU there is
# no stream, and no race of this kind.


def wait_before_step(model, optimizer, data, stager, checkpoint_dir, saves=SAVES):
    for save in range(saves):
        path = os.path.join(checkpoint_dir, f"save-{save}")
        state = checkpoint_state(model, optimizer)
        # sphinx_gallery_start_ignore
        stager.snapshot(state, path)
        # sphinx_gallery_end_ignore
        if torch.accelerator.is_available():
            torch.accelerator.current_stream().synchronize()  # the stager does not wait
        response = dcp.async_save(
            state, checkpoint_id=path, async_stager=stager, process_group=checkpoint_group()
        )
        optimizer.zero_grad()
        model(next(data)).pow(2).mean().backward()  # overlaps staging
        # sphinx_gallery_start_ignore
        stager.let_copy_start()  # the copy starts as late as this loop allows
        # sphinx_gallery_end_ignore
        response.staging_completion.result()
        optimizer.step()
        response.upload_completion.result()


def correct_pattern():
    if dist.get_rank() == 0:
        print(f"staging with {staging_options()}")
    run_loop(wait_before_step)


run_on_ranks(correct_pattern)


# %%
# On a GPU: the stager's stream does not wait for yours
# -----------------------------------------------------
# Drop that synchronisation, and on a GPU the stager can copy tensors before
# the kernels that compute them have run. ``optimizer.step()`` only queues its
# kernels on your stream and returns. With async staging and non-blocking
# copies (this site's choice on a GPU), the stager queues its copies on a
# stream of its own, and nothing orders them after yours. Whether a copy
# overtakes the step depends on how far the GPU is behind the host; in a real
# job it is often far behind, which is what keeps it busy. Here the build
# keeps the GPU half a second behind before each step, with a line the page
# does not show, and the stager has staged once before the loop, as it has at
# every save of a long run but the first.
#
# The race needs both options. Blocking copies in the stager's thread go on
# the device's default stream, behind the work queued there (where training
# runs unless you chose another stream), and synchronous staging waits for the
# whole device. On CPU there are no streams: the loop below is exact there.
# The second loop is the fix, the line every other loop on this page has.


def save_without_synchronizing(model, optimizer, data, stager, checkpoint_dir, saves=SAVES):
    for save in range(saves):
        path = os.path.join(checkpoint_dir, f"save-{save}")
        batch = next(data)
        # sphinx_gallery_start_ignore
        stager.keep_device_busy()  # the GPU is half a second behind the host
        # sphinx_gallery_end_ignore
        train_step(model, optimizer, batch)  # queues the step's kernels and returns
        state = checkpoint_state(model, optimizer)
        # sphinx_gallery_start_ignore
        stager.snapshot(state, path)
        # sphinx_gallery_end_ignore
        # BUG: nothing orders the stager's copies after the step's kernels.
        response = dcp.async_save(
            state, checkpoint_id=path, async_stager=stager, process_group=checkpoint_group()
        )
        response.staging_completion.result()
        response.upload_completion.result()


def synchronize_before_save(model, optimizer, data, stager, checkpoint_dir, saves=SAVES):
    for save in range(saves):
        path = os.path.join(checkpoint_dir, f"save-{save}")
        batch = next(data)
        # sphinx_gallery_start_ignore
        stager.keep_device_busy()  # the GPU is half a second behind the host
        # sphinx_gallery_end_ignore
        train_step(model, optimizer, batch)
        state = checkpoint_state(model, optimizer)
        # sphinx_gallery_start_ignore
        stager.snapshot(state, path)
        # sphinx_gallery_end_ignore
        if torch.accelerator.is_available():
            torch.accelerator.current_stream().synchronize()  # the stager does not wait
        response = dcp.async_save(
            state, checkpoint_id=path, async_stager=stager, process_group=checkpoint_group()
        )
        response.staging_completion.result()
        response.upload_completion.result()


def stream_race():
    run_loop(save_without_synchronizing)
    run_loop(synchronize_before_save)
    # sphinx_gallery_start_ignore
    if dist.get_rank() == 0:
        torn = sum(count > 0 for count in COUNTS["save_without_synchronizing"])
        where = f"on {device_for_this_rank().type}"
        why = "the stager copied before the step ran" if torn else "no stream to race with"
        print(f"without the synchronisation, {where}: {torn} of {SAVES} checkpoints torn ({why})")
        differed, tensors = DIFFERED["save_without_synchronizing"]
        kinds = {  # what a name ends with -> what it is
            ("weight", "bias"): "weights and biases",
            ("exp_avg", "exp_avg_sq"): "Adam's moments",
            ("step",): "Adam's step counters",
        }
        counted = []
        for endings, kind in kinds.items():
            names = [name for name in tensors if name.rsplit(".", 1)[-1] in endings]
            counted.append(f"{sum(name in differed for name in names)} of {len(names)} {kind}")
        print(f"  from before the step: {', '.join(counted)}")
        with open(os.path.join(WORK_DIR, "stream-race.txt"), "w") as summary:  # for the last cell
            fixed = sum(count > 0 for count in COUNTS["synchronize_before_save"])
            summary.write(
                f"stream race {where}: {torn} of {SAVES} checkpoints torn without the "
                f"synchronisation, {fixed} of {SAVES} with it; from before the step: "
                f"{', '.join(counted)}"
            )
    # sphinx_gallery_end_ignore


run_on_ranks(stream_race)


# %%
# The lines under the cell count, kind by kind, what the first loop's
# checkpoints hold from before the step. On a GPU, tensors on the device can
# be copied before the step's kernels write them, while Adam's step counters
# live on the CPU, where the step updates them at once: a checkpoint with
# some of each is a state no run ever had. Nothing fails; a resumed run just
# does not continue where it stopped. The synchronisation costs the
# loop the time the GPU needs for the work already queued, once per save.
#
# Build the state dict before you synchronise. GPU work that the state dict
# call itself queues (clones, an offload, gathering full tensors) is covered
# only if it comes first, and ``async_save`` calls each ``Stateful``'s
# ``state_dict()`` after your synchronisation, inside the call: a ``Stateful``
# that queues GPU work there must synchronise at the end of its own
# ``state_dict()``.


# %%
# Hazard 1: ``optimizer.step()`` before ``staging_completion``
# ------------------------------------------------------------
# Forget the wait, or put it after the step, and the optimizer updates the
# weights, Adam's moments and its step counters in place while (or before)
# they are copied. With the copy started right after the step, every tensor in
# the checkpoint is from the step after the save. Left to chance, a slow copy
# gives a mix: some tensors from before the step, some from after.
# The fix is the pattern above.


def step_before_staging(model, optimizer, data, stager, checkpoint_dir, saves=SAVES):
    for save in range(saves):
        path = os.path.join(checkpoint_dir, f"save-{save}")
        state = checkpoint_state(model, optimizer)
        # sphinx_gallery_start_ignore
        stager.snapshot(state, path)
        # sphinx_gallery_end_ignore
        if torch.accelerator.is_available():
            torch.accelerator.current_stream().synchronize()  # the stager does not wait
        response = dcp.async_save(
            state, checkpoint_id=path, async_stager=stager, process_group=checkpoint_group()
        )
        optimizer.zero_grad()
        model(next(data)).pow(2).mean().backward()
        optimizer.step()  # BUG: staging may still be copying these tensors
        # sphinx_gallery_start_ignore
        stager.let_copy_start()  # the copy starts right after the step
        # sphinx_gallery_end_ignore
        response.staging_completion.result()
        response.upload_completion.result()


run_on_ranks(run_loop, step_before_staging)


# %%
# Hazard 2: a forward pass that changes the state
# -----------------------------------------------
# In training mode ``BatchNorm`` updates ``running_mean``, ``running_var`` and
# ``num_batches_tracked`` in place, in the forward pass, and they are in the
# state dict. The pattern above overlaps staging with the next forward, so
# with a ``BatchNorm`` model the very same loop races with those updates,
# although it waits before ``optimizer.step()``. So does any module that
# updates a buffer in ``forward`` (a running statistic, a step counter, an EMA
# kept as a buffer). Whether a real run is hit depends on timing and on the
# layout: here the BatchNorm layer comes first, so the forward pass updates its
# buffers moments after ``async_save`` returns; a buffer deep in the model is
# updated later.

run_on_ranks(run_loop, wait_before_step, True)  # the same loop, a BatchNorm model


# %%
# Two fixes. The simple one: in the step after a save, wait for staging before
# the forward pass. Staging then overlaps nothing on this step's training
# thread but what runs before the forward (data loading, logging); it still
# overlaps the upload, which is most of a save.


def wait_before_forward(model, optimizer, data, stager, checkpoint_dir, saves=SAVES):
    for save in range(saves):
        path = os.path.join(checkpoint_dir, f"save-{save}")
        state = checkpoint_state(model, optimizer)
        # sphinx_gallery_start_ignore
        stager.snapshot(state, path)
        # sphinx_gallery_end_ignore
        if torch.accelerator.is_available():
            torch.accelerator.current_stream().synchronize()  # the stager does not wait
        response = dcp.async_save(
            state, checkpoint_id=path, async_stager=stager, process_group=checkpoint_group()
        )
        batch = next(data)  # overlaps staging
        # sphinx_gallery_start_ignore
        stager.let_copy_start()  # the copy starts as late as this loop allows
        # sphinx_gallery_end_ignore
        response.staging_completion.result()  # before anything changes the state
        train_step(model, optimizer, batch)
        response.upload_completion.result()


run_on_ranks(run_loop, wait_before_forward, True)


# %%
# The other keeps the overlap: clone the few tensors the forward pass changes
# at the save call, and hand the stager the clones. Buffers are small next to
# the weights and Adam's moments. On a GPU the clones are queued on the
# compute stream, and the stager's stream does not wait for it: the
# synchronisation before ``async_save`` is what makes the clones complete
# before the stager copies them, so it must come after the cloning. (A third
# way: leave such buffers out of the checkpoint and recompute them after
# loading, for BatchNorm with a few forward passes in training mode.)


def stage_buffers_at_save_call(model, optimizer, data, stager, checkpoint_dir, saves=SAVES):
    for save in range(saves):
        path = os.path.join(checkpoint_dir, f"save-{save}")
        state = checkpoint_state(model, optimizer)
        for name, buffer in model.named_buffers():
            state["model"][name] = buffer.clone()  # the forward pass cannot touch these
        # sphinx_gallery_start_ignore
        stager.snapshot(state, path)
        # sphinx_gallery_end_ignore
        if torch.accelerator.is_available():
            torch.accelerator.current_stream().synchronize()  # the clones are done, too
        response = dcp.async_save(
            state, checkpoint_id=path, async_stager=stager, process_group=checkpoint_group()
        )
        optimizer.zero_grad()
        loss = model(next(data)).pow(2).mean()  # overlaps staging again
        # sphinx_gallery_start_ignore
        stager.let_copy_start()  # the copy starts right after the forward pass
        # sphinx_gallery_end_ignore
        loss.backward()
        response.staging_completion.result()
        optimizer.step()
        response.upload_completion.result()


run_on_ranks(run_loop, stage_buffers_at_save_call, True)


# %%
# Hazard 3: the next save before ``upload_completion``
# ----------------------------------------------------
# A reused ``DefaultStager`` keeps one host buffer per tensor and copies into
# it again on every save. That is why reusing it is cheap, and why
# ``upload_completion`` matters for correctness, not only for memory: the
# upload of a save reads that buffer while it writes. Start the next save with
# the same stager before the previous upload has finished, and the next
# staging overwrites data the previous upload has not written yet. Below, each
# upload writes only once the next save has staged, as happens whenever
# writing a checkpoint takes longer than the steps between two saves (a large
# model, a slow file system, saves every few steps). The last checkpoint of
# the loop has no next save to overwrite it; the page checks the ones before.
#
# Uploads in flight at the same time also run their collectives at the same
# time. On one process group they could pair up wrongly between ranks (a hang,
# or one save's plan handed to the other), so in this broken loop each save
# gets a group of its own; the fixed loop below needs only one.


def next_save_before_upload(model, optimizer, data, stager, checkpoint_dir, saves=SAVES):
    uploads = []
    for save in range(saves):
        path = os.path.join(checkpoint_dir, f"save-{save}")
        state = checkpoint_state(model, optimizer)
        # sphinx_gallery_start_ignore
        stager.snapshot(state, path)
        # sphinx_gallery_end_ignore
        if torch.accelerator.is_available():
            torch.accelerator.current_stream().synchronize()  # the stager does not wait
        # BUG: the previous upload may still be reading the stager's buffers.
        response = dcp.async_save(
            state, checkpoint_id=path, async_stager=stager, process_group=checkpoint_group(save)
        )
        response.staging_completion.result()
        # sphinx_gallery_start_ignore
        stager.let_writes_start(keep=path)  # the previous upload writes only now
        # sphinx_gallery_end_ignore
        train_step(model, optimizer, next(data))
        uploads.append(response.upload_completion)
    # sphinx_gallery_start_ignore
    stager.let_writes_start()
    # sphinx_gallery_end_ignore
    for upload in uploads:
        upload.result()


run_on_ranks(run_loop, next_save_before_upload)


# %%
# The fix: wait for the previous upload right before the next save. The
# upload still overlaps training, all the steps between two saves.


def wait_for_upload_before_next_save(model, optimizer, data, stager, checkpoint_dir, saves=SAVES):
    previous = None
    for save in range(saves):
        path = os.path.join(checkpoint_dir, f"save-{save}")
        state = checkpoint_state(model, optimizer)
        # sphinx_gallery_start_ignore
        stager.let_writes_start()  # the previous upload writes as late as this loop allows
        stager.snapshot(state, path)
        # sphinx_gallery_end_ignore
        if previous is not None:
            previous.upload_completion.result()  # the stager's buffers are free again
        if torch.accelerator.is_available():
            torch.accelerator.current_stream().synchronize()  # the stager does not wait
        previous = dcp.async_save(
            state, checkpoint_id=path, async_stager=stager, process_group=checkpoint_group()
        )
        previous.staging_completion.result()
        train_step(model, optimizer, next(data))
    # sphinx_gallery_start_ignore
    stager.let_writes_start()
    # sphinx_gallery_end_ignore
    previous.upload_completion.result()


run_on_ranks(run_loop, wait_for_upload_before_next_save)


# %%
# Hazard 4: Python values in the state dict
# -----------------------------------------
# The stager deep-copies the whole state dict in its background thread, not
# only the tensors: a dict of training progress passed by reference is copied
# when the stager reaches it, after every tensor before it. A loop that
# updates that dict in place right after the save call (a sample counter
# advanced when the next batch arrives, say) checkpoints the new value, and a
# run resumed from it skips data. The fix is to hand ``async_save`` a copy of
# such values (or a fresh dict each time), never the object the loop updates.
# A plain ``int`` at the top level is safe: ``async_save`` copies the top level
# of the dict during the call.


def progress_updated_after_save(model, optimizer, data, stager, checkpoint_dir, saves=SAVES):
    progress = {"step": 1, "samples_seen": BATCH}
    for save in range(saves):
        path = os.path.join(checkpoint_dir, f"save-{save}")
        state = {**checkpoint_state(model, optimizer), "progress": progress}
        # sphinx_gallery_start_ignore
        stager.snapshot(state, path)
        # sphinx_gallery_end_ignore
        if torch.accelerator.is_available():
            torch.accelerator.current_stream().synchronize()  # the stager does not wait
        response = dcp.async_save(
            state, checkpoint_id=path, async_stager=stager, process_group=checkpoint_group()
        )
        batch = next(data)
        progress["samples_seen"] += len(batch)  # BUG: the stager may not have copied it yet
        # sphinx_gallery_start_ignore
        stager.let_copy_start()  # the copy starts right after the update
        # sphinx_gallery_end_ignore
        optimizer.zero_grad()
        model(batch).pow(2).mean().backward()
        response.staging_completion.result()
        optimizer.step()
        progress["step"] += 1
        response.upload_completion.result()


run_on_ranks(run_loop, progress_updated_after_save)


# %%
# The fix: a copy of the dict at the save call, ``dict(progress)``.


def progress_copied_at_save_call(model, optimizer, data, stager, checkpoint_dir, saves=SAVES):
    progress = {"step": 1, "samples_seen": BATCH}
    for save in range(saves):
        path = os.path.join(checkpoint_dir, f"save-{save}")
        state = {**checkpoint_state(model, optimizer), "progress": dict(progress)}
        # sphinx_gallery_start_ignore
        stager.snapshot(state, path)
        # sphinx_gallery_end_ignore
        if torch.accelerator.is_available():
            torch.accelerator.current_stream().synchronize()  # the stager does not wait
        response = dcp.async_save(
            state, checkpoint_id=path, async_stager=stager, process_group=checkpoint_group()
        )
        batch = next(data)
        progress["samples_seen"] += len(batch)  # the checkpoint has its own copy
        # sphinx_gallery_start_ignore
        stager.let_copy_start()  # the copy starts right after the update
        # sphinx_gallery_end_ignore
        optimizer.zero_grad()
        model(batch).pow(2).mean().backward()
        response.staging_completion.result()
        optimizer.step()
        progress["step"] += 1
        response.upload_completion.result()


run_on_ranks(run_loop, progress_copied_at_save_call)


# %%
# How often the races hit without the hold
# ----------------------------------------
# The four broken loops of the hazards, with nothing deciding the race: the
# plain ``DefaultStager`` and ``FileSystemWriter``, exactly the code shown
# above. (The stream race, which needs a GPU, is left out: how often it hits
# depends on how far your GPU runs behind the host, which this page's small
# model says nothing about.)
# What these runs count is luck and timing on the machine that built this page
# (named at the top) with this small model, so the cell also measures the
# durations that decide the races: a training step, how long the copy was
# still running after ``async_save`` returned (the head start the training
# thread has to beat), and a whole save, from the call to
# ``upload_completion``.
#
# * Stepping early and updating Python values race with the copy: they are
#   hit when the copy has not finished by the time the loop gets there.
# * BatchNorm in the first layer is updated at the very start of the forward
#   pass, right after the save call returns.
# * The next save races with the previous upload: it is hit whenever a save
#   takes longer than the steps between two saves.
#
# A larger state widens every window: the copy takes longer, and so does the
# upload.

BROKEN_LOOPS = [
    (step_before_staging, False),
    (wait_before_step, True),  # with BatchNorm
    (next_save_before_upload, False),
    (progress_updated_after_save, False),
]

# sphinx_gallery_start_ignore
HOLD = False


def time_one_save(saves=5):
    """Milliseconds: a training step, the copy left when async_save returns, a save."""

    def now():
        if torch.accelerator.is_available():
            torch.accelerator.synchronize()
        return time.perf_counter()

    model, optimizer = build_model()
    data = batches()
    stager = DefaultStager(staging_options())
    step_ms, copy_left_ms, save_ms = [], [], []
    for save in range(saves):
        start = now()
        train_step(model, optimizer, next(data))
        step_ms.append(1000 * (now() - start))
        start = now()
        response = dcp.async_save(
            checkpoint_state(model, optimizer),
            checkpoint_id=os.path.join(WORK_DIR, f"timed-{save}"),
            async_stager=stager,
            process_group=checkpoint_group(),
        )
        returned = now()
        response.staging_completion.result()
        copy_left_ms.append(1000 * (now() - returned))
        response.upload_completion.result()
        save_ms.append(1000 * (now() - start))
    stager.close()
    median = statistics.median
    return (
        f"over {saves} saves: a training step {median(step_ms):.1f} ms; the copy was still "
        f"running {median(copy_left_ms):.1f} ms (at most {max(copy_left_ms):.1f} ms) "
        f"after async_save returned; a save took {median(save_ms):.1f} ms (medians)"
    )


# sphinx_gallery_end_ignore


def broken_loops_left_to_chance():
    for loop, batch_norm_first in BROKEN_LOOPS:
        run_loop(loop, batch_norm_first, os.path.join(WORK_DIR, "left-to-chance"))
    # sphinx_gallery_start_ignore
    durations = time_one_save()
    if dist.get_rank() == 0:
        print(durations)
        for loop, batch_norm_first in BROKEN_LOOPS:
            label = loop_label(loop, batch_norm_first)
            counts = COUNTS[label]
            torn = sum(count > 0 for count in counts)
            print(f"{label:<34} not the saved state in {torn:>2} of {len(counts)} trials")
    # sphinx_gallery_end_ignore


run_on_ranks(broken_loops_left_to_chance)


# %%
# The rules, in short
# -------------------
# * On a GPU with non-blocking copies, synchronise the compute stream right
#   before every ``async_save``, after building the state dict (clones
#   included): the stager's copy stream does not wait for yours.
# * Wait for ``staging_completion`` before the first line that changes any
#   tensor in the saved state: ``optimizer.step()`` for most models, the
#   forward pass for models whose forward updates buffers (or clone those
#   buffers at the save call).
# * Wait for the previous ``upload_completion`` before the next save that uses
#   the same stager: its upload still reads the stager's buffers.
# * Pass copies of Python values the loop keeps updating.
#
# Clean up
# --------

# sphinx_gallery_start_ignore
with open(os.path.join(WORK_DIR, "stream-race.txt")) as summary:
    STREAM_RACE = summary.read()
# sphinx_gallery_end_ignore
shutil.rmtree(WORK_DIR, ignore_errors=True)
print(f"removed {WORK_DIR}: {not os.path.exists(WORK_DIR)}")
# sphinx_gallery_start_ignore
print(f"staging_pitfalls_recipe: {STREAM_RACE}")  # the line `make gpu-check` collects
# sphinx_gallery_end_ignore


# %%
# What to read next
# -----------------
# * :ref:`sphx_glr_recipes_default_stager_recipe.py`: the whole loop and the
#   full list of rules to paste into yours.
# * :ref:`sphx_glr_recipes_async_save_recipe.py`: ``async_save`` without a
#   stager of your own, and a checkpoint process.
# * :doc:`/troubleshooting`: the same failures, starting from the symptoms.
