"""
What DefaultStager copies, and when
===================================

A :class:`~torch.distributed.checkpoint.staging.DefaultStager` with
``use_async_staging=True`` copies the state to host memory in a thread of its
own, while your loop goes on (:ref:`sphx_glr_recipes_default_stager_recipe.py`
builds that loop and measures it). This recipe looks at the stager itself:
which of its four options your machine can use, which of the values you hand
``async_save`` are fixed at the call and which are copied later, when the
stager copies into the host buffers of the save before and when it allocates
new ones, whether host memory grows over 20 saves, and which of
``AsyncSaveResponse``'s two futures reports a copy that failed.

.. grid:: 2

    .. grid-item-card:: :octicon:`mortar-board;1em;` What you will learn
       :class-card: card-prerequisites

       * Choose ``StagingOptions`` from what the machine has, and what each
         option does
       * Which Python values are safe to change after ``async_save`` returns,
         and how to pass a container the loop keeps changing
       * When the stager reuses its host buffers, and when every save allocates
       * Whether host memory grows over 20 saves, with three strategies
       * Why ``upload_completion.result()``, not ``staging_completion``, is the
         wait that reports a staging error

    .. grid-item-card:: :octicon:`list-unordered;1em;` Prerequisites
       :class-card: card-prerequisites

       * PyTorch: see :doc:`/versions`
       * CPU (gloo) or one GPU per rank (NCCL, plus gloo for checkpointing)
       * :ref:`sphx_glr_recipes_default_stager_recipe.py`: the rules of an
         overlapped save
"""

# %%
# Setup
# -----

import gc
import os
import shutil
import warnings

import psutil
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from page_tools import faults, figures, machine, memory, proofs, results, timing
from rank_launcher import run_as_torchrun, run_on_ranks, shared_tempdir
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.fsdp import fully_shard

WORK_DIR = shared_tempdir("dcp-stager-copies-")
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
#   place instead of receiving another copy. A save that uploads from a thread
#   does not need it.
# * ``use_async_staging``: copy in a background thread of the stager (a thread
#   pool with one worker). ``async_save`` then returns an ``AsyncSaveResponse``
#   before the copy is done. It needs nothing but a thread.
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
# Once a stager has copied the state to the host, the writer has nothing to copy
# from a GPU. Built from a ``checkpoint_id`` it still copies 10 MB ahead
# (``per_thread_copy_ahead``) on a stream of the current device, GPU 0 in the
# upload thread or checkpoint process, creating a CUDA context there from every
# rank. ``host_writer`` sets it to 0, as a writer that stages itself does.
#
# Without an accelerator the defaults raise (below). The rule this site uses
# on every page, here with ``use_async_staging=True``:
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


def host_writer(path):
    """The writer for a state the stager has copied to the host: nothing to copy ahead."""
    return FileSystemWriter(path, per_thread_copy_ahead=0)  # no CUDA context on GPU 0


def device_for_this_rank():
    # The launcher (or your own set-up code) has already picked this rank's GPU.
    if torch.accelerator.is_available():
        return torch.accelerator.current_accelerator()
    return torch.device("cpu")


def show_staging_options():
    if dist.get_rank() != 0:
        return
    # Without CUDA the defaults first warn that pinning is ignored; the error is the point.
    warnings.filterwarnings("ignore", message="Ignoring pin_memory flag")
    try:
        DefaultStager().close()
        print("DefaultStager() with the default options: works on this machine")
    except AssertionError as err:
        print(f"DefaultStager() with the default options raised AssertionError:\n  {err}")
    print("this page stages with StagingOptions(")
    for name, value in vars(staging_options(use_async_staging=True)).items():
        print(f"    {name}={value},")
    print(")")


# %%
# A rank, not this process, tries the defaults: on a GPU machine a stager
# creates a CUDA stream, and the process that starts the ranks must not touch
# CUDA. The page records what ``DefaultStager.__init__`` raised:

with timing.timed(DefaultStager, "__init__", "DefaultStager()") as constructed:
    run_on_ranks(show_staging_options)
raised = timing.errors(constructed)
results.claim(
    "default-options-need-an-accelerator",
    len(raised) == 1 and (raised[0] is None) == torch.cuda.is_available(),
    f"{'with' if torch.cuda.is_available() else 'without'} an accelerator, DefaultStager() "
    f"with the default options {'raised ' + raised[0].split(':')[0] if raised[0] else 'works'}",
    raised=raised,
)


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


def save_then_change(checkpoint_dir, pass_a_copy):
    stager = DefaultStager(staging_options(use_async_staging=True))
    step, progress = 3, {"samples_seen": 300}
    response = dcp.async_save(
        {"step": step, "progress": dict(progress) if pass_a_copy else progress},
        storage_writer=host_writer(checkpoint_dir),
        async_stager=stager,
    )
    step += 1  # rebinds the name: async_save already holds the int 3
    progress["samples_seen"] += 100  # changes the dict, which the stager may not have copied yet
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


# %%
# When the stager gets to the dict is a race with your loop. The page holds
# each copy back until the loop next waits on a future
# (``upload_completion.result()``), after both changes, so that the race lands
# the same way on every build; then it reads what each ``dcp.load`` filled in.

with faults.staging_held_until() as held, proofs.state_after(dcp, "load") as checkpoints:
    run_on_ranks(show_values_and_containers, os.path.join(WORK_DIR, "values"))
proofs.value_is(
    "int-fixed-at-the-call",
    checkpoints.nth(0),
    "step",
    3,
    "passed an int, saved as at the call (the loop has 4 now)",
    released=held.by_rank,
)
proofs.value_is(
    "dict-by-reference-copied-later",
    checkpoints.nth(0),
    "progress.samples_seen",
    400,
    "passed by reference, saved as changed after the call",
)
proofs.value_is(
    "copy-of-the-dict-fixed-at-the-call",
    checkpoints.nth(1),
    "progress.samples_seen",
    300,
    "passed dict(progress), saved as at the call",
)


# %%
# The step counter is saved as it was at the call, the dict passed by
# reference as it was after the change, and the copy as it was at the call.
# Tensors are the third kind: the stager copies them in its thread too, which
# is what rules 6 and 7 are about.
#
# When the stager reuses its buffers
# ----------------------------------
# The stager's host copies are not tied to ``use_pinned_memory``: on a CPU,
# with pinned and shared memory off, it still copies every save into the
# buffers of the first. The cache is keyed on the source tensor's storage, and
# holds it weakly (``StateDictStager`` in ``_state_dict_stager.py``): a
# ``state_dict()`` that returns the live tensors, as ``get_state_dict`` does by
# default, finds its buffers again at every save. One that returns new tensors
# each time, clones or a CPU offload (``StateDictOptions(cpu_offload=True)``),
# reuses nothing: every save allocates and fills a new host copy, and the entry
# goes when the clone is freed. Two saves of the same model each way:


def save_twice(checkpoint_root, fresh_tensors):
    model = nn.Linear(1024, 1024, device=device_for_this_rank())
    stager = DefaultStager(staging_options(use_async_staging=True))
    for save in range(2):
        state = model.state_dict()
        if fresh_tensors:
            state = {name: tensor.clone() for name, tensor in state.items()}
        if torch.accelerator.is_available():
            torch.accelerator.current_stream().synchronize()  # rule 4: the clones are done
        response = dcp.async_save(
            {"model": state},
            storage_writer=host_writer(os.path.join(checkpoint_root, f"save-{save}")),
            async_stager=stager,
        )
        response.upload_completion.result()
    stager.close()
    if dist.get_rank() == 0:
        what = "clones of the weights" if fresh_tensors else "the live weights"
        print(f"saved {what} twice: {sorted(os.listdir(checkpoint_root))}")


def show_buffer_reuse(checkpoint_root):
    save_twice(os.path.join(checkpoint_root, "live"), fresh_tensors=False)
    save_twice(os.path.join(checkpoint_root, "clones"), fresh_tensors=True)


# %%
# The page records, at each copy, the host storages it went into and how many
# entries the stager's cache held (and keeps every copy alive until the cell
# ends, so that an address seen once is not handed to a later copy):

with memory.host_copies() as copies, proofs.writers_given_to(dcp) as writers:
    run_on_ranks(show_buffer_reuse, os.path.join(WORK_DIR, "reuse"))
proofs.no_copy_ahead("host-writer-copies-nothing-ahead", writers)
live, clones = memory.save_pairs(copies)
memory.second_save_reused("live-tensors-reuse-host-buffers", live, True, "the live weights")
memory.second_save_reused("clones-get-new-host-buffers", clones, False, "clones")
memory.cache_holds_one_save("freed-clones-leave-the-cache", clones, "clones")
memory.pairs_table({"the live weights": live, "clones": clones})


# %%
# So keep the stager and return the live tensors from ``state_dict()``; if it
# must build new ones, the stager's cache cannot help, and each save costs an
# allocation of the whole host copy (with pinned memory, pinning it too). If
# those new tensors are made on the GPU, synchronize at the end of
# ``state_dict()`` (rule 4).

# %%
# Host memory over 20 saves
# -------------------------
# Reports of "host memory grows with every async save" are common. Each rank
# saves its shard of a 34 MB model 20 times with each of three strategies and
# reads its resident memory (RSS) once each save is on disk: ``dcp.save`` writes
# from the model's tensors; ``async_save`` copies into new host memory, a reused
# ``DefaultStager`` into the same buffers, every time.

STRATEGIES = ("dcp.save", "async_save", "async_save + reused DefaultStager")
SAVES = 20


def save_twenty_times(strategy, checkpoint_root):
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(1024, 1024) for _ in range(8))).to(device_for_this_rank())
    fully_shard(model)  # each rank saves and stages its shard
    group = dist.new_group(backend="gloo")  # background saves: a group of their own
    reuse = "DefaultStager" in strategy
    stager = DefaultStager(staging_options(use_async_staging=True)) if reuse else None
    process = psutil.Process()
    rss_before, rss, previous = process.memory_info().rss, [], None
    for save_number in range(1, SAVES + 1):
        path = os.path.join(checkpoint_root, strategy.replace(" ", "-"), f"save-{save_number}")
        state_dict = {"model": model.state_dict()}
        if strategy == "dcp.save":
            dcp.save(state_dict, checkpoint_id=path, process_group=group)
        elif stager is None:
            dcp.async_save(state_dict, checkpoint_id=path, process_group=group).result()
        else:
            if torch.accelerator.is_available():
                torch.accelerator.current_stream().synchronize()  # the stager does not wait
            response = dcp.async_save(
                state_dict,
                storage_writer=host_writer(path),
                process_group=group,
                async_stager=stager,
            )
            response.upload_completion.result()  # a training loop would train meanwhile
        rss.append(process.memory_info().rss)
        if previous is not None and dist.get_rank() == 0:
            shutil.rmtree(previous)  # keep the latest checkpoint only
        previous = path
    if stager is not None:
        stager.close()
    dist.destroy_process_group(group)
    rss_at_end = process.memory_info().rss
    gc.collect()
    rss_after_gc = process.memory_info().rss
    dcp.load({"model": model.state_dict()}, checkpoint_id=previous)  # resume from the latest
    shown = {f"save {n}": rss[n - 1] for n in (1, SAVES // 2, SAVES)} | {"gc": rss_after_gc}
    print(f"{strategy}: RSS above the start, MB")
    print("  after " + ", ".join(f"{at} {(r - rss_before) / 1e6:+.1f}" for at, r in shown.items()))
    shard_bytes = sum(p.to_local().nbytes for p in model.parameters())
    rss_at = {"rss_before": rss_before, "rss": rss, "rss_at_end": rss_at_end}
    return {"bytes": shard_bytes, **rss_at, "rss_after_gc": rss_after_gc}


# %%
# The page reads glibc's heap counters whenever the recipe reads its RSS:

with (
    memory.heap_at(psutil.Process, "memory_info") as heap,
    proofs.checkpoints_checked(dcp, where=proofs.checkpoint_matches(f"/save-{SAVES}$")) as checked,
):
    memory_runs = {s: run_on_ranks(save_twenty_times, s, f"{WORK_DIR}/rss") for s in STRATEGIES}
proofs.loads_match_saves("memory-checkpoints-load-back", checked, f"save {SAVES}, resumed")

# %%
# Does RSS grow? The first saves fill caches and pools: the page compares saves
# 6-10 with 16-20, and a difference within either window's spread is noise.
# One copy of a rank's share held after the save is no leak: the reused stager
# keeps it on purpose, plain ``async_save`` or glibc keep the last (``gc.collect()``).

MEMORY = results.record("memory", memory.summarize(memory_runs, heap))
results.record("memory_runs", memory_runs)
results.record("headline", memory.headline(MEMORY))
memory.table(MEMORY, SAVES)

# %%
# Where glibc's heap changed from save 6 to 20, on that rank. Growth *in use*:
# something keeps each staged copy alive (a list of futures: drop them, or reuse
# a ``DefaultStager``); *free kept*: glibc keeps freed buffers (reuse a stager,
# or start the job with ``MALLOC_MMAP_THRESHOLD_=1048576``).

memory.heap_table({strategy: m["heap_change"] for strategy, m in MEMORY.items()})

# %%
# RSS above the start after each save, on the rank that is highest there:

figures.save_with_results(memory.rss_figure(memory_runs, machine.title(WORK_DIR)))

# %%
# Where a staging error shows up (rule 8)
# ---------------------------------------
# A value the stager cannot copy fails the copy in the stager's thread: here a
# generator (say, a data iterator put into the state by mistake), which cannot
# be pickled. ``async_save`` wraps the stager's future into
# ``staging_completion``, and it looks only once: if staging has already
# failed when it looks, it reports success (``state_dict_saver.py``:
# ``if not staging_future.done(): staging_future.add_done_callback(callback)``
# ``else: return_staging_future.set_result(None)``). The upload starts from
# the stager's future itself, so ``upload_completion`` raises the error every
# time.


def save_something_the_stager_cannot_copy(checkpoint_dir):
    stager = DefaultStager(staging_options(use_async_staging=True))
    state = {"model": nn.Linear(8, 8).state_dict(), "batches": (n for n in range(3))}
    writer = host_writer(checkpoint_dir)
    response = dcp.async_save(state, storage_writer=writer, async_stager=stager)
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


# %%
# A copy that fails at once has usually failed by the time ``async_save``
# looks; the page makes sure of it (``stage()`` returns once its copy is done),
# and records what each wait on the two futures returned or raised:

with (
    faults.staging_done_before_returning(),
    timing.checkpoint_loop() as failing,
):
    run_on_ranks(save_something_the_stager_cannot_copy, os.path.join(WORK_DIR, "unstageable"))
timing.wait_outcome(
    "staging-completion-reports-success",
    failing,
    "wait for staging",
    None,
    "staging_completion.result()",
)
timing.wait_outcome(
    "upload-completion-raises-the-staging-error",
    failing,
    "wait for upload",
    "TypeError: cannot pickle 'generator' object",
    "upload_completion.result()",
)


# %%
# Wait on ``upload_completion.result()`` after every save, not only on
# ``staging_completion``: it is the one that always raises. Here every rank
# failed the same way before the upload started, so nothing waits. A rank
# that fails alone never joins the save's first collective (its upload stops
# at the stager's future, ``save_wrapper`` in ``_async_thread_executor.py``),
# so the other ranks' uploads would wait there until the group's timeout.
#
# The same, as a training script for ``torchrun``
# -----------------------------------------------
# In your own job ``torchrun`` starts the ranks, and ``main()`` does what
# ``run_on_ranks`` did above: set this rank's device, create the process
# group, save the ways this page recommends (a copy of a dict the loop keeps
# changing, rule 5; the live tensors, so that the stager copies into the same
# host buffers every time), each save awaited with ``upload_completion``
# (rule 8), and destroy the group. The checkpoint directory is a path that every
# rank sees (``shared_tempdir`` made one here; on several machines, a shared
# file system). Save it as ``train.py`` with the functions above, and:
#
# .. code-block:: bash
#
#    torchrun --nproc-per-node=2 train.py
#
# The cell runs ``main()`` the way ``torchrun`` would, on ranks that have
# torchrun's environment and no process group yet.


def main(checkpoint_root):
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo")
    try:
        save_then_change(os.path.join(checkpoint_root, "a-copy"), pass_a_copy=True)  # rule 5
        save_twice(os.path.join(checkpoint_root, "live"), fresh_tensors=False)  # one host copy
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
# * :ref:`sphx_glr_recipes_default_stager_recipe.py`: the training loop that
#   overlaps this copy with the next forward and backward pass, measured.
# * :ref:`sphx_glr_recipes_staging_pitfalls_recipe.py`: rules 3, 5, 6 and 7
#   broken on purpose, what each break writes into the checkpoint, and the fix.
# * :doc:`/troubleshooting`: symptoms and fixes for the usual DCP failures.
