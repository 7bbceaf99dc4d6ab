"""
Fully asynchronous staging with DefaultStager
=============================================

``dcp.async_save`` writes the checkpoint in the background, but before it
returns it copies the whole state to host memory ("staging"), and the training
loop waits for that copy. A
:class:`~torch.distributed.checkpoint.staging.DefaultStager` with
``use_async_staging=True`` moves the copy to a background thread as well:
``async_save`` returns once it has handed the copy to that thread, the copy
overlaps the next forward and backward pass, and the loop waits only if the
copy is still running when ``optimizer.step()`` is about to change the
weights. This recipe builds that
loop, measures its timeline beside plain ``async_save``, and proves that every
checkpoint holds the state of its step, bit for bit.

.. grid:: 2

    .. grid-item-card:: :octicon:`mortar-board;1em;` What you will learn
       :class-card: card-prerequisites

       * The rules of an overlapped save, short enough to paste into your loop
       * A training loop whose checkpoint copy runs during the next forward
         and backward pass, with ``AsyncSaveResponse``'s two futures
       * Read a measured timeline of that loop, and what it blocks per save
         compared with plain ``async_save``
       * Check that the checkpoint is the state at the save, although the
         optimizer stepped while it was being written
       * Profile the loop, and run it as a training script under ``torchrun``

    .. grid-item-card:: :octicon:`list-unordered;1em;` Prerequisites
       :class-card: card-prerequisites

       * PyTorch: see :doc:`/versions`
       * CPU (gloo) or one GPU per rank (NCCL, plus gloo for checkpointing)
       * :ref:`sphx_glr_recipes_async_save_recipe.py`: ``async_save``, a
         process group for checkpointing, one save in flight
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
#    #    the default group): a group destroyed in the upload's collectives
#    #    leaves no .metadata; the default group destroyed before the upload
#    #    starts, a .metadata over one rank's data, and no error.
#    # 10. Save through FileSystemWriter(path, per_thread_copy_ahead=0): the
#    #    copy is on the host, and the default copy-ahead has the upload thread
#    #    create a CUDA context on GPU 0 (on every rank).
#
# This page runs a loop that follows them and measures it;
# :ref:`sphx_glr_recipes_stager_copies_recipe.py` shows rules 5 and 8 and
# the stager's buffer reuse at work. :ref:`sphx_glr_recipes_staging_pitfalls_recipe.py`
# breaks rules 3, 5, 6 and 7 on purpose, shows what each break writes, and
# proves each fix; :ref:`sphx_glr_recipes_stager_stream_recipe.py` does the
# same for rule 4, on a GPU.


# %%
# Setup
# -----

import os
import shutil

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from page_tools import figures, machine, memory, proofs, results, timing
from rank_launcher import run_as_torchrun, run_on_ranks, shared_tempdir
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.fsdp import fully_shard

WORK_DIR = shared_tempdir("dcp-default-stager-")
print(f"torch {torch.__version__}; checkpoints go under {WORK_DIR}")


# %%
# The model and how it stages
# ---------------------------
# The same small model as on the other pages, at the size of the ``async_save``
# recipe: a few wide linear layers, sharded with FSDP2 and trained with Adam,
# so the checkpoint holds three tensors per parameter. ``AppState`` is the usual
# ``Stateful`` wrapper; DCP calls its ``state_dict()`` at every save, inside
# ``async_save`` and after the loop's synchronisation (rule 4). The first call
# launches device work: ``get_state_dict`` creates Adam's state with a zero-lr
# ``optimizer.step()`` when the optimizer has none yet, as at this page's save
# before training. So on an accelerator ``state_dict()`` waits for its own
# work before it returns.
#
# ``staging_options`` sets the stager's four switches from the machine: pinned
# memory and non-blocking copies only with an accelerator, shared memory only
# for a checkpoint process, and the copy in the stager's own thread
# (``use_async_staging=True``) on this page.
# :ref:`sphx_glr_recipes_stager_copies_recipe.py` says what each switch does,
# and shows that the defaults raise without an accelerator.
#
# .. versionadded:: 2.9
#    ``DefaultStager`` and ``StagingOptions``.

WIDTH, DEPTH, BATCH, LR = 1024, 3, 16, 1e-3


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


def staging_options(use_async_staging, checkpoint_process=False):
    """How every save on this page stages its copy, chosen from the machine."""
    on_gpu = torch.accelerator.is_available()
    return StagingOptions(
        use_pinned_memory=on_gpu,  # page-locked memory only speeds up copies from a device
        use_shared_memory=checkpoint_process,  # only a checkpoint *process* reads it in place
        use_async_staging=use_async_staging,
        use_non_blocking_copy=on_gpu,
    )


def build_sharded_model(seed):
    torch.manual_seed(seed)
    model = ToyModel().to(device_for_this_rank())
    for module in (*model.layers, model):  # each layer, then the rest, as FSDP2 intends:
        fully_shard(module)  # parameters become DTensors; one all-gather per layer as it runs
    optimizer = torch.optim.Adam(model.parameters(), lr=LR)
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
#   change them, so they run while the copy runs. (A custom stager whose copy
#   raises a ``BaseException`` leaves it unresolved for ever: ``async_save``
#   forwards ``Exception`` only.)
# * ``upload_completion`` resolves when the checkpoint is written, with
#   ``.metadata``, and raises if staging or writing failed. Wait on it before
#   the next save and before the end.
#
# .. versionadded:: 2.9
#    ``AsyncSaveResponse``, returned by ``async_save`` when the stager stages
#    asynchronously.
#
# The numbered comments are the rules from the top of the page. This is the
# loop to paste.

NUM_STEPS, SAVE_EVERY = 10, 3
SAVE_STEPS = list(range(0, NUM_STEPS + 1, SAVE_EVERY))  # saves after steps 0, 3, 6 and 9


def train_with_default_stager(checkpoint_root):
    model, optimizer = build_sharded_model(seed=0)
    app_state = AppState(model, optimizer)
    checkpoint_group = dist.new_group(backend="gloo")  # rule 1
    stager = DefaultStager(staging_options(use_async_staging=True))  # rule 2
    device = device_for_this_rank()
    torch.manual_seed(100 + dist.get_rank())  # each rank trains on its own data
    response = None

    for step in range(NUM_STEPS + 1):
        if step > 0:
            batch = torch.rand(BATCH, WIDTH, device=device)
            optimizer.zero_grad()
            loss = model(batch).pow(2).mean()  # overlaps the copy of the last save
            loss.backward()  # so does this
            response.staging_completion.result()  # rule 7
            optimizer.step()

        if step % SAVE_EVERY == 0:
            path = os.path.join(checkpoint_root, f"step-{step}")
            if response is not None:
                response.upload_completion.result()  # rule 3
            if torch.accelerator.is_available():
                torch.accelerator.current_stream().synchronize()  # rule 4
            response = dcp.async_save(
                {"app": app_state},
                storage_writer=dcp.FileSystemWriter(path, per_thread_copy_ahead=0),  # rule 10
                process_group=checkpoint_group,
                async_stager=stager,
            )
            if step == 0:
                response.upload_completion.result()  # allocates the buffers

    response.upload_completion.result()  # rule 8
    stager.close()  # rule 8: stops its thread and drops its buffer cache
    dist.destroy_process_group(checkpoint_group)  # rule 9
    row = [round(x, 4) for x in model.layers[0].weight.full_tensor()[0, :3].tolist()]
    print(f"after step {NUM_STEPS}: layers.0.weight[0, :3] = {row}")


# %%
# The page runs the loop with watches on the calls it makes
# (:doc:`/measuring`): when each forward and backward pass, wait,
# ``optimizer.step()``, save, copy and upload ran; the state each
# ``async_save`` was given; the host buffers each copy went into; the threads
# alive around ``stager.close()``. And ``torch.profiler`` records every thread
# from ``dist.new_group`` to ``dist.destroy_process_group``.

with (
    timing.checkpoint_loop(ToyModel) as overlapped,
    proofs.state_given_to(dcp, "async_save") as saved,
    memory.host_copies() as loop_copies,
    timing.threads_around(DefaultStager, "close") as closing,
    timing.profiled(
        (dist, "new_group"), (dist, "destroy_process_group"), "default_stager_recipe.trace.json"
    ) as trace,
):
    run_on_ranks(train_with_default_stager, os.path.join(WORK_DIR, "overlapped"))


# %%
# The stager copied on a thread of its own, which ``stager.close()`` stopped,
# and into the same host buffers at every save:

timing.copies_stopped_by("close-stops-the-staging-thread", overlapped, closing)
memory.reused_at_every_save("loop-reuses-host-buffers", loop_copies)


# %%
# For comparison, the same loop with plain ``async_save``: its built-in
# stager copies on the training thread, inside the call, and it returns a
# plain ``Future`` for the upload. There is nothing to wait for before the
# step.


def train_with_plain_async_save(checkpoint_root):
    model, optimizer = build_sharded_model(seed=0)
    app_state = AppState(model, optimizer)
    checkpoint_group = dist.new_group(backend="gloo")
    device = device_for_this_rank()
    torch.manual_seed(100 + dist.get_rank())
    upload = None

    for step in range(NUM_STEPS + 1):
        if step > 0:
            batch = torch.rand(BATCH, WIDTH, device=device)
            optimizer.zero_grad()
            loss = model(batch).pow(2).mean()
            loss.backward()
            optimizer.step()

        if step % SAVE_EVERY == 0:
            if upload is not None:
                upload.result()
            upload = dcp.async_save(
                {"app": app_state},
                checkpoint_id=os.path.join(checkpoint_root, f"step-{step}"),
                process_group=checkpoint_group,
            )
            if step == 0:
                upload.result()

    upload.result()
    dist.destroy_process_group(checkpoint_group)
    row = [round(x, 4) for x in model.layers[0].weight.full_tensor()[0, :3].tolist()]
    print(f"after step {NUM_STEPS}: layers.0.weight[0, :3] = {row}")


# %%
# The page watches it the same way (its trace stays with the checkpoints):

with (
    timing.checkpoint_loop(ToyModel) as plain,
    proofs.state_given_to(dcp, "async_save") as saved_plain,
    timing.profiled(
        (dist, "new_group"),
        (dist, "destroy_process_group"),
        os.path.join(WORK_DIR, "plain_async_save.trace.json"),
    ) as plain_trace,
):
    run_on_ranks(train_with_plain_async_save, os.path.join(WORK_DIR, "plain"))


# %%
# What ``async_save`` returned in each loop, and the state each loop gave its
# last save: the stager changes when the copy runs, not what the loop computes.

timing.returned_types(
    "async-save-returns-a-response",
    {"plain async_save": plain, "DefaultStager": overlapped},
    {"plain async_save": "Future", "DefaultStager": "AsyncSaveResponse"},
)
proofs.same_state(
    "same-training-in-both-loops",
    saved_plain.nth(-1),
    saved.nth(-1),
    f"step-{SAVE_STEPS[-1]} save, plain vs DefaultStager",
)


# %%
# Reading the timeline
# --------------------
# Rank 0's timeline of both runs, from the first step to the last upload: the
# top row of each run is the training thread, the rows below it the copy and
# the upload of each save. The short gap before each save is the page's own
# copy of the state (for the checks below), not the loop's.

figures.timelines(
    [
        ("DefaultStager(use_async_staging=True)", *overlapped.bars(0)),
        ("plain async_save", *plain.bars(0)),
    ],
    rows=timing.ROWS,
    colors=timing.COLORS,
    xlabel="ms since step 1 began (rank 0)",
    title=machine.title(),
)


# %%
# Each save after the first, on rank 0, in ms since its ``async_save`` call:
# when the call returned, when the copy (``staging``) ran, when the next
# step's forward pass, backward pass and ``optimizer.step()`` ran, and when the
# upload was done. The call hands the copy to the stager's thread, which
# starts it as soon as it runs; while it runs, the next forward and backward
# pass run beside it, and the next ``optimizer.step()`` starts only after it is
# done.

timing.steps_wait_for_staging("optimizer-step-waits-for-staging", overlapped)
timing.copy_beside_next_step("copy-runs-beside-the-next-step", overlapped)
figures.Table(timing.SAVE_COLUMNS, results.record("saves", overlapped.save_rows(0, SAVE_STEPS[1:])))


# %%
# What each save blocked: the ``async_save`` call, plus the wait for the
# previous upload right before it, plus (with ``DefaultStager``) the next
# step's wait for staging, on the slowest rank (collectives make the others
# wait for it); and each step's time on rank 0, saves and waits included.

comparison = timing.compare_loops(
    {"async_save": plain, "DefaultStager": overlapped}, SAVE_STEPS[1:]
)
figures.say(*comparison.sentences())
for name, value in comparison.record().items():
    results.record(name, value)
results.record(
    "headline",
    {
        "blocked_ms_async_save": comparison.median_blocked("async_save"),
        "blocked_ms_default_stager": comparison.median_blocked("DefaultStager"),
        "loop_s_async_save": comparison.loop_seconds("async_save"),
        "loop_s_default_stager": comparison.loop_seconds("DefaultStager"),
    },
)
timing.comparison_table(comparison)


# %%
# Taking the copy off the training thread moves its cost, it does not remove
# it: the copy still runs, beside the next forward and backward pass. On a GPU
# that is a device-to-host copy into pinned memory on the stager's stream,
# beside the compute kernels on yours, and the host's cores stay free for the
# upload. On a CPU-only machine the copy, the upload and training share the
# same cores and memory bus, so a step that runs beside a copy runs slower:
# the numbers above, with their noise, say what was left of the gain on the
# machine that built this page.
#
# The profiler's view
# -------------------
# The page ran both loops under ``torch.profiler``, every thread, each watched
# call in a ``torch.profiler.record_function`` range named after its phase.
# The DefaultStager loop's trace is the "Download the profiler trace" link at
# the top of this page: open it in https://ui.perfetto.dev or
# ``chrome://tracing``. A profile of your own job shows the same picture: the
# copy on a thread of the stager's and, on a GPU, the device-to-host copies on
# the stager's stream beside the compute kernels on yours. (One
# ``optimizer.step`` more than the ten steps: the zero-lr step that
# ``get_state_dict`` runs at the first save, to create Adam's state.)

traces = {
    "DefaultStager": timing.trace_summary(trace.path),
    "async_save": timing.trace_summary(plain_trace.path),
}
for run, summary in results.record("traces", traces).items():
    print(f"{run} loop's trace, rank 0: {summary['megabytes']:.1f} MB, {summary['events']} events")
timing.trace_holds_timeline(
    "trace-holds-the-timeline",
    traces,
    {"DefaultStager": overlapped, "async_save": plain},
    "DefaultStager",
)
timing.trace_table(traces)


# %%
# On a GPU the trace also has each kernel and copy with the stream it ran on:
# the page counts the kernels per stream, and the copies to host memory by
# stream and kind of memory.

timing.copies_off_the_compute_stream(
    "copies-to-pinned-memory-off-the-compute-stream",
    traces["DefaultStager"],
    on_gpu=torch.cuda.is_available(),
)


# %%
# The checkpoint is the state at the save
# ---------------------------------------
# In the loop, ``optimizer.step()`` ran right after ``staging_completion``
# resolved, while the upload was still writing the checkpoint from the staged
# copy. Load each checkpoint into a freshly built model (different weights, so
# nothing matches by luck), as a run that resumes would:


def load_each_checkpoint(checkpoint_root):
    for step in SAVE_STEPS:
        model, optimizer = build_sharded_model(seed=1)
        checkpoint_id = os.path.join(checkpoint_root, f"step-{step}")
        dcp.load({"app": AppState(model, optimizer)}, checkpoint_id=checkpoint_id)
        row = [round(x, 4) for x in model.layers[0].weight.full_tensor()[0, :3].tolist()]
        print(f"loaded step-{step}: layers.0.weight[0, :3] = {row}")


# %%
# The page compares each one, tensor by tensor and bit for bit, with the state
# the loop gave ``async_save`` at that step, and the first with the state of
# the next save, to show that the check can fail: training changed every
# tensor in between.

with proofs.state_after(dcp, "load") as loaded:
    run_on_ranks(load_each_checkpoint, os.path.join(WORK_DIR, "overlapped"))
for k, step in enumerate(SAVE_STEPS):
    proofs.same_state(
        f"checkpoint-step-{step}", saved.nth(k), loaded.nth(k), f"step-{step} loaded vs saved"
    )
proofs.differing_state(
    "training-changed-the-state", saved.nth(2), loaded.nth(1), "step-3 loaded vs step-6 saved"
)


# %%
# Every checkpoint is the state at its save, on every rank, although each
# ``optimizer.step()`` after a save changed those very tensors while the upload
# was still running (the times above). What makes it safe is the order: the
# step waited for ``staging_completion``, and the upload writes from the staged
# copy, never from the live tensors.
#
# Take the wait away, or put it after ``optimizer.step()``, and the step
# updates tensors the stager has not copied yet: the checkpoint is a mix of the
# state before and after the step. Nothing fails; only a comparison like the
# one above shows it, or a resumed run that does not continue where it stopped.
# The same happens with a forward pass that updates buffers (rule 6), and a
# save started while the previous upload is still writing from the stager's
# buffers overwrites them (rule 3). Whether a given save is hit is a race
# between two threads: a broken loop can pass a check like the one above many
# times before it writes a torn checkpoint, so passing it proves nothing about
# a loop that breaks the rules.
# :ref:`sphx_glr_recipes_staging_pitfalls_recipe.py` makes each race land the
# same way every time, shows what the broken loops write, and counts how often
# the race hits when left alone.
#
# The same, as a training script for ``torchrun``
# -----------------------------------------------
# In your own job ``torchrun`` starts the ranks, and ``main()`` does what
# ``run_on_ranks`` did above: set this rank's device, create the process group
# (the loop creates its checkpoint group in it), run the loop, and destroy the
# group once every rank's last upload is done (rule 9). The checkpoint
# directory is a path that every rank sees (``shared_tempdir`` made one here;
# on several machines, a shared file system). Save it as ``train.py`` with the
# functions above and ``if __name__ == "__main__": main(sys.argv[1])``, and:
#
# .. code-block:: bash
#
#    torchrun --nproc-per-node=2 train.py /shared/checkpoints
#
# The cell runs ``main()`` the way ``torchrun`` would, on ranks that have
# torchrun's environment and no process group yet.


def main(checkpoint_root):
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo")
    try:
        train_with_default_stager(checkpoint_root)
        dist.barrier()  # rule 9: every rank's uploads are done
    finally:
        dist.destroy_process_group()


run_as_torchrun(main, os.path.join(WORK_DIR, "torchrun"))


# %%
# Clean up
# --------

shutil.rmtree(WORK_DIR, ignore_errors=True)
print(f"removed {WORK_DIR}: {not os.path.exists(WORK_DIR)}")


# %%
# What to read next
# -----------------
# * :ref:`sphx_glr_recipes_stager_copies_recipe.py`: what the stager copies
#   when (rule 5), when it reuses its host buffers, and where a staging error
#   shows up (rule 8).
# * :ref:`sphx_glr_recipes_staging_pitfalls_recipe.py`: rules 3, 5, 6 and 7
#   broken on purpose, what each break writes into the checkpoint, and the fix.
# * :ref:`sphx_glr_recipes_resume_recipe.py`: this loop, checkpointing
#   everything a resume needs, killed in the middle of a save and resumed.
# * :ref:`sphx_glr_recipes_checkpoint_stall_benchmark.py`: what each way of
#   checkpointing costs, measured at a larger size.
# * :doc:`/troubleshooting`: symptoms and fixes for the usual DCP failures.
