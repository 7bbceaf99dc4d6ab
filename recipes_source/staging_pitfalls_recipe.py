"""
Pitfalls of overlapped staging
==============================

With :class:`~torch.distributed.checkpoint.staging.DefaultStager` and
``use_async_staging=True``, ``dcp.async_save`` returns before the state has
been copied: a background thread copies ("stages") the live tensors while the
next forward and backward pass run. The contract is that nothing may change
what is being copied until ``staging_completion`` resolves, and the usual
advice, "wait for ``staging_completion`` right before ``optimizer.step()``",
covers only the optimizer. This recipe runs four ways a training loop breaks
the contract, shows what each writes into the checkpoint, and proves each fix
bit for bit.

.. grid:: 2

    .. grid-item-card:: :octicon:`mortar-board;1em;` What you will learn
       :class-card: card-prerequisites

       * Check that a checkpoint holds the state at the save call, by comparing
         it with a copy taken at the call
       * Four hazards of overlapped staging: stepping early, a forward pass
         that updates buffers (BatchNorm), a reused stager's buffer overwritten
         by the next save, and Python values changed after the save call
       * The fix for each, proven bit-exact over repeated trials
       * How to make a race land the same way every time, without faking it

    .. grid-item-card:: :octicon:`list-unordered;1em;` Prerequisites
       :class-card: card-prerequisites

       * PyTorch 2.9 or later
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
# The staging options depend on the machine. The defaults (pinned memory,
# shared memory, non-blocking copies on a side stream) need an accelerator; on
# a CPU-only machine keep only ``use_async_staging``, which is what this page
# is about: the copy runs in a background thread. (The ranks choose; the
# process that launches them never touches the GPU.)

import copy
import functools
import os
import shutil
import statistics
import threading
import time
import warnings
from concurrent.futures import Future, ThreadPoolExecutor

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from rank_launcher import run_on_ranks, shared_tempdir
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.staging import AsyncStager, DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict import get_state_dict

WORK_DIR = shared_tempdir("dcp-staging-pitfalls-")
TRIALS = 5  # every demonstration and every fix runs this many times


def staging_options():
    if torch.accelerator.is_available():
        return StagingOptions()  # pinned + shared memory, async, non-blocking copies
    return StagingOptions(
        use_pinned_memory=False,
        use_shared_memory=False,
        use_async_staging=True,
        use_non_blocking_copy=False,
    )


print(f"torch {torch.__version__}; checkpoints go under {WORK_DIR}")


# %%
# Did the checkpoint capture the state at the save call?
# ------------------------------------------------------
# The test this page applies to every checkpoint: take a deep copy of the
# state dict at the save call (the snapshot), let the loop run on, wait for
# the upload, read the checkpoint back and compare every tensor and value with
# the snapshot, bit for bit. ``dcp.load`` reads in place, so it gets blank
# tensors of the right shapes (NaN or -1, never a value the state could hold by
# accident) and ``None`` where a plain Python value goes.


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


example_model = make_model(batch_norm_first=True)
print(example_model)
print(torch.optim.Adam(example_model.parameters(), lr=1e-2))


# %%
# Making a race land the same way every time
# ------------------------------------------
# Whether a hazard corrupts a checkpoint depends on which thread gets there
# first: the staging thread copying a tensor, or the training thread changing
# it. That depends on the size of the state, the load on the machine and the
# thread scheduler, so with this page's small model some hazards show only
# now and then (the last section counts how often). A page, or a test, that
# shows a bug only sometimes proves nothing, so the demonstrations below
# decide the race explicitly:
#
# * ``HeldStager`` wraps the real ``DefaultStager``. ``stage`` returns at once,
#   as async staging does, but it hands the state dict to the real stager only
#   when the training loop calls ``let_copy_start()``. The copy itself, its
#   thread, its cached buffers and the futures ``async_save`` returns are all
#   ``DefaultStager``'s; the wrapper only chooses *when* the copy starts.
# * ``HeldWriter`` does the same for the upload: a ``FileSystemWriter`` that
#   starts writing only when the loop calls ``let_write_start()``.
#
# In a hazard, the loop calls ``let_copy_start()`` right after the operation
# that changes the state, so the copy sees the change every time (as it does
# whenever staging is slower than the loop, for example with a large model on
# a busy host). In a fix, the loop calls it at the worst moment the fix
# allows: at the same point, or, where the fix waits for staging before that
# point, right before the wait. The lines that drive the hold are marked
# ``# demo``; a real loop has none of them. With ``hold=False`` the wrappers
# pass everything straight through.


class HeldStager(AsyncStager):
    """Demo only: a stager whose real copy starts when the training loop says so."""

    def __init__(self, stager, hold=True):
        self.stager, self.hold = stager, hold
        self._copy_may_start = threading.Event()
        self._waiter = ThreadPoolExecutor(max_workers=1, thread_name_prefix="held-stager")

    def stage(self, state_dict):
        if not self.hold:
            return self.stager.stage(state_dict)
        self._copy_may_start = copy_may_start = threading.Event()

        def copy_when_released():
            copy_may_start.wait()
            staged = self.stager.stage(state_dict)  # DefaultStager's own copy
            return staged.result() if isinstance(staged, Future) else staged

        return self._waiter.submit(copy_when_released)

    def let_copy_start(self):
        if self.hold:
            if torch.accelerator.is_available():
                torch.accelerator.synchronize()  # the change has happened on the device
            self._copy_may_start.set()

    def close(self):
        self._copy_may_start.set()
        self._waiter.shutdown(wait=True)
        self.stager.close()


class HeldWriter(FileSystemWriter):
    """Demo only: a FileSystemWriter that writes when the training loop says so."""

    def __init__(self, path, hold=True):
        super().__init__(path)
        self._write_may_start = threading.Event()
        if not hold:
            self._write_may_start.set()

    def write_data(self, plan, planner):
        self._write_may_start.wait()
        return super().write_data(plan, planner)

    def let_write_start(self):
        self._write_may_start.set()


# %%
# Each demonstration below is one function: the lines of a training loop
# around one save, exactly as they run, returning the snapshot taken at the
# save call and the checkpoint's path. ``run_trials`` runs it several times in
# one short training run (one warm-up step first, so that Adam has state),
# with one stager reused for every save, as it should be (it caches its host
# buffers). After each trial rank 0 reads the whole checkpoint back
# (``no_dist=True``: one process reads every rank's files), counts the entries
# that differ from the snapshot, and checks the outcome the demonstration
# expects: ``"bit-exact"`` for a fix, ``"torn"`` for a hazard.


def run_trials(case, expect, batch_norm_first=False, hold=True, trials=TRIALS):
    model, optimizer = build_model(batch_norm_first)
    data = batches()
    train_step(model, optimizer, next(data))
    stager = HeldStager(DefaultStager(staging_options()), hold=hold)
    counts, example = [], []
    try:
        for trial in range(trials):
            workdir = os.path.join(WORK_DIR, f"{case.__name__}-{hold}-{trial}")
            snapshot, path = case(model, optimizer, data, stager, workdir)
            if dist.get_rank() == 0:
                differ, compared = differences(snapshot, path)
                counts.append(len(differ))
                example = example or differ
    finally:
        stager.close()
    if dist.get_rank() != 0:
        return None
    torn = sum(count > 0 for count in counts)
    if expect is not None:
        verdict = {0: "bit-exact every time", trials: "not the saved state, every time"}
        print(f"{case.__name__:<34} {counts} of {compared} differ: {verdict.get(torn)}")
        if example:
            print(f"{'':<34} e.g. {', '.join(example[:3])}{', ...' if len(example) > 3 else ''}")
        assert torn == (0 if expect == "bit-exact" else trials), (case.__name__, counts)
    return counts


# %%
# The pattern that works, for a model without forward-mutated state
# ------------------------------------------------------------------
# The loop from the DefaultStager recipe: save, run the next forward and
# backward while staging runs, wait for ``staging_completion`` right before
# ``optimizer.step()``, the first line that changes the weights. Even with the
# copy held back until the last moment, every checkpoint is the state at the
# save call.


def wait_before_step(model, optimizer, data, stager, workdir):
    state = checkpoint_state(model, optimizer)
    snapshot = copy.deepcopy(state)  # the state at the save call
    response = dcp.async_save(
        state, checkpoint_id=workdir, async_stager=stager, process_group=checkpoint_group()
    )
    optimizer.zero_grad()
    model(next(data)).pow(2).mean().backward()  # overlaps staging
    stager.let_copy_start()  # demo: the copy starts as late as this loop allows
    response.staging_completion.result()
    optimizer.step()
    response.upload_completion.result()
    return snapshot, workdir


def correct_pattern():
    if dist.get_rank() == 0:
        print(f"staging with {staging_options()}")
    run_trials(wait_before_step, expect="bit-exact")


run_on_ranks(correct_pattern)


# %%
# Hazard 1: ``optimizer.step()`` before ``staging_completion``
# ------------------------------------------------------------
# Forget the wait, or put it after the step, and the optimizer updates the
# weights, Adam's moments and its step counters in place while (or before)
# they are copied. With the copy started right after the step, every tensor in
# the checkpoint is from the step after the save. Left to chance, a slow copy
# gives a mix: some tensors from before the step, some from after.
# The fix is the pattern above.


def step_before_staging(model, optimizer, data, stager, workdir):
    state = checkpoint_state(model, optimizer)
    snapshot = copy.deepcopy(state)
    response = dcp.async_save(
        state, checkpoint_id=workdir, async_stager=stager, process_group=checkpoint_group()
    )
    optimizer.zero_grad()
    model(next(data)).pow(2).mean().backward()
    optimizer.step()  # BUG: staging may still be copying these tensors
    stager.let_copy_start()  # demo: the copy starts right after the step
    response.staging_completion.result()
    response.upload_completion.result()
    return snapshot, workdir


def hazard_step_before_staging():
    run_trials(step_before_staging, expect="torn")


run_on_ranks(hazard_step_before_staging)


# %%
# Hazard 2: a forward pass that changes the state
# -----------------------------------------------
# In training mode ``BatchNorm`` updates ``running_mean``, ``running_var`` and
# ``num_batches_tracked`` in place, in the forward pass, and they are in the
# state dict. Overlapping staging with the next forward, as the pattern above
# recommends, races with those updates although the loop waits before
# ``optimizer.step()``. So does any module that updates a buffer in
# ``forward`` (a running statistic, a step counter, an EMA kept as a buffer).
# Whether a real run is hit depends on timing and on the layout: here the
# BatchNorm layer comes first, so the forward pass updates its buffers moments
# after ``async_save`` returns; a buffer deep in the model is updated later.


def wait_before_step_with_batch_norm(model, optimizer, data, stager, workdir):
    state = checkpoint_state(model, optimizer)
    snapshot = copy.deepcopy(state)
    response = dcp.async_save(
        state, checkpoint_id=workdir, async_stager=stager, process_group=checkpoint_group()
    )
    optimizer.zero_grad()
    loss = model(next(data)).pow(2).mean()  # BUG: updates BatchNorm's buffers in place
    stager.let_copy_start()  # demo: the copy starts right after the forward pass
    loss.backward()
    response.staging_completion.result()
    optimizer.step()
    response.upload_completion.result()
    return snapshot, workdir


# %%
# Two fixes. The simple one: in the step after a save, wait for staging before
# the forward pass. Staging then overlaps nothing on this step's training
# thread but what runs before the forward (data loading, logging); it still
# overlaps the upload, which is most of a save.


def wait_before_forward(model, optimizer, data, stager, workdir):
    state = checkpoint_state(model, optimizer)
    snapshot = copy.deepcopy(state)
    response = dcp.async_save(
        state, checkpoint_id=workdir, async_stager=stager, process_group=checkpoint_group()
    )
    batch = next(data)  # overlaps staging
    stager.let_copy_start()  # demo: the copy starts as late as this loop allows
    response.staging_completion.result()  # before anything changes the state
    optimizer.zero_grad()
    model(batch).pow(2).mean().backward()
    optimizer.step()
    response.upload_completion.result()
    return snapshot, workdir


# %%
# The other keeps the overlap: copy the few tensors the forward pass changes
# synchronously, at the save call, and hand the stager the copies. Buffers
# are small next to the weights and Adam's moments; on a GPU the clone is a
# device-to-device copy that the forward pass waits for in stream order.
# (A third way: leave such buffers out of the checkpoint and recompute them
# after loading, for BatchNorm with a few forward passes in training mode.)


def stage_buffers_at_save_call(model, optimizer, data, stager, workdir):
    state = checkpoint_state(model, optimizer)
    for name, buffer in model.named_buffers():
        state["model"][name] = buffer.clone()  # the forward pass cannot touch these
    snapshot = copy.deepcopy(state)
    response = dcp.async_save(
        state, checkpoint_id=workdir, async_stager=stager, process_group=checkpoint_group()
    )
    optimizer.zero_grad()
    loss = model(next(data)).pow(2).mean()  # overlaps staging again
    stager.let_copy_start()  # demo: the copy starts right after the forward pass
    loss.backward()
    response.staging_completion.result()
    optimizer.step()
    response.upload_completion.result()
    return snapshot, workdir


def forward_mutated_buffers():
    run_trials(wait_before_step_with_batch_norm, expect="torn", batch_norm_first=True)
    run_trials(wait_before_forward, expect="bit-exact", batch_norm_first=True)
    run_trials(stage_buffers_at_save_call, expect="bit-exact", batch_norm_first=True)


run_on_ranks(forward_mutated_buffers)


# %%
# Hazard 3: the next save before ``upload_completion``
# ----------------------------------------------------
# A reused ``DefaultStager`` keeps one host buffer per tensor and copies into
# it again on every save. That is why reusing it is cheap, and why
# ``upload_completion`` matters for correctness, not only for memory: the
# upload of a save reads that buffer while it writes. Start the next save with
# the same stager before the previous upload has finished, and the next
# staging overwrites data the previous upload has not written yet. Below, the
# first upload is held until the second save has staged, as happens whenever
# writing a checkpoint takes longer than the steps between two saves (a large
# model, a slow file system, saves every few steps).
#
# Two uploads in flight also run their collectives at the same time. On one
# process group they could pair up wrongly between ranks (a hang, or one
# save's plan handed to the other), so each save here gets a group of its own.


def next_save_before_upload(model, optimizer, data, stager, workdir):
    first_path, second_path = f"{workdir}-a", f"{workdir}-b"
    state = checkpoint_state(model, optimizer)
    snapshot = copy.deepcopy(state)
    writer = HeldWriter(first_path, hold=stager.hold)
    first = dcp.async_save(
        state, storage_writer=writer, async_stager=stager, process_group=checkpoint_group(0)
    )
    stager.let_copy_start()  # demo
    first.staging_completion.result()
    train_step(model, optimizer, next(data))
    # BUG: the first upload may still be reading the stager's buffers.
    second = dcp.async_save(
        checkpoint_state(model, optimizer),
        checkpoint_id=second_path,
        async_stager=stager,
        process_group=checkpoint_group(1),
    )
    stager.let_copy_start()  # demo
    second.staging_completion.result()
    writer.let_write_start()  # demo: the first upload writes only now
    train_step(model, optimizer, next(data))
    first.upload_completion.result()
    second.upload_completion.result()
    return snapshot, first_path


def wait_for_upload_before_next_save(model, optimizer, data, stager, workdir):
    first_path, second_path = f"{workdir}-a", f"{workdir}-b"
    state = checkpoint_state(model, optimizer)
    snapshot = copy.deepcopy(state)
    writer = HeldWriter(first_path, hold=stager.hold)
    first = dcp.async_save(
        state, storage_writer=writer, async_stager=stager, process_group=checkpoint_group(0)
    )
    stager.let_copy_start()  # demo
    first.staging_completion.result()
    train_step(model, optimizer, next(data))
    writer.let_write_start()  # demo: the first upload writes as late as this loop allows
    first.upload_completion.result()  # the stager's buffers are free again
    second = dcp.async_save(
        checkpoint_state(model, optimizer),
        checkpoint_id=second_path,
        async_stager=stager,
        process_group=checkpoint_group(0),
    )
    stager.let_copy_start()  # demo
    second.staging_completion.result()
    train_step(model, optimizer, next(data))
    second.upload_completion.result()
    return snapshot, first_path


def reused_stager():
    run_trials(next_save_before_upload, expect="torn")
    run_trials(wait_for_upload_before_next_save, expect="bit-exact")


run_on_ranks(reused_stager)


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


def progress_updated_after_save(model, optimizer, data, stager, workdir):
    progress = {"step": 3, "samples_seen": 3 * BATCH}
    state = {**checkpoint_state(model, optimizer), "progress": progress}
    snapshot = copy.deepcopy(state)
    response = dcp.async_save(
        state, checkpoint_id=workdir, async_stager=stager, process_group=checkpoint_group()
    )
    batch = next(data)
    progress["samples_seen"] += len(batch)  # BUG: the stager may not have copied it yet
    stager.let_copy_start()  # demo: the copy starts right after the update
    optimizer.zero_grad()
    model(batch).pow(2).mean().backward()
    response.staging_completion.result()
    optimizer.step()
    progress["step"] += 1
    response.upload_completion.result()
    return snapshot, workdir


def progress_copied_at_save_call(model, optimizer, data, stager, workdir):
    progress = {"step": 3, "samples_seen": 3 * BATCH}
    state = {**checkpoint_state(model, optimizer), "progress": dict(progress)}
    snapshot = copy.deepcopy(state)
    response = dcp.async_save(
        state, checkpoint_id=workdir, async_stager=stager, process_group=checkpoint_group()
    )
    batch = next(data)
    progress["samples_seen"] += len(batch)  # the checkpoint has its own copy
    stager.let_copy_start()  # demo: the copy starts right after the update
    optimizer.zero_grad()
    model(batch).pow(2).mean().backward()
    response.staging_completion.result()
    optimizer.step()
    progress["step"] += 1
    response.upload_completion.result()
    return snapshot, workdir


def python_values():
    run_trials(progress_updated_after_save, expect="torn")
    run_trials(progress_copied_at_save_call, expect="bit-exact")


run_on_ranks(python_values)


# %%
# How often the races hit without the hold
# ----------------------------------------
# The same four broken loops with ``hold=False``: the plain ``DefaultStager``
# and ``FileSystemWriter``, nothing deciding the race. What these trials count
# is luck and timing on the machine that built this page (named at the top)
# with this small model, so the cell also measures the durations that decide
# the races: a training step, how long the copy was still running after
# ``async_save`` returned (the head start the training thread has to beat),
# and a whole save, from the call to ``upload_completion``.
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

HONEST_TRIALS = 8
HAZARDS = [
    (step_before_staging, False),
    (wait_before_step_with_batch_norm, True),
    (next_save_before_upload, False),
    (progress_updated_after_save, False),
]


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


def race_without_hold():
    hits = {}
    for case, batch_norm_first in HAZARDS:
        counts = run_trials(case, None, batch_norm_first, hold=False, trials=HONEST_TRIALS)
        if dist.get_rank() == 0:
            hits[case.__name__] = sum(count > 0 for count in counts)
    return time_one_save(), hits


durations, hits = run_on_ranks(race_without_hold)[0]  # rank 0 measured and compared
print(durations)
for name, count in hits.items():
    print(f"{name:<34} not the saved state in {count:>2} of {HONEST_TRIALS} trials")


# %%
# The rules, in short
# -------------------
# * Wait for ``staging_completion`` before the first line that changes any
#   tensor in the saved state: ``optimizer.step()`` for most models, the
#   forward pass for models whose forward updates buffers (or clone those
#   buffers at the save call).
# * Wait for the previous ``upload_completion`` before the next save that uses
#   the same stager: its upload still reads the stager's buffers.
# * Pass copies of Python values the loop keeps updating.
#
# The DefaultStager recipe, :ref:`sphx_glr_recipes_default_stager_recipe.py`,
# has the whole loop and the full list of rules to paste into yours;
# :doc:`/troubleshooting` starts from the symptoms.
#
# Clean up
# --------

shutil.rmtree(WORK_DIR, ignore_errors=True)
print(f"removed {WORK_DIR}: {not os.path.exists(WORK_DIR)}")
