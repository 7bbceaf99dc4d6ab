"""
Restarts under torchrun, and on another number of ranks
=======================================================

:ref:`sphx_glr_recipes_resume_recipe.py` resumes a job launched again on as
many ranks as before. Two other ways back need one precaution each.
``torchrun --max-restarts`` starts the workers again by itself: their group
must form on a store without the earlier attempts' keys, on one node and
across nodes. On more or fewer ranks DCP reshards model and optimizer, but
per-rank data positions no longer fit: they must not depend on the ranks. This page's loop
keeps only what these two need (model, optimizer, step, a global sample index,
``dcp.save``): it kills a worker under ``torchrun --max-restarts=1``, resumes
on 2, 3 and 1 ranks, and checks each resume bit for bit.

.. grid:: 2

    .. grid-item-card:: :octicon:`mortar-board;1em;` What you will learn
       :class-card: card-prerequisites

       * Restart under ``torchrun --max-restarts`` with a process group that
         forms again on one node and across nodes, and what fails there
       * Resume on more or fewer ranks: DCP reshards model and optimizer
       * A data position that fits any number of ranks: the global sample
         index, with a fixed global batch

    .. grid-item-card:: :octicon:`list-unordered;1em;` Prerequisites
       :class-card: card-prerequisites

       * PyTorch: see :doc:`/versions`
       * CPU (gloo) or one GPU per rank (NCCL)
       * :ref:`sphx_glr_recipes_resume_recipe.py`: what a resume needs
"""

# %%
# The rules, to paste into your loop
# ----------------------------------
#
# .. code-block:: python
#
#    # Restarts and other numbers of ranks:
#    # 1. Under torchrun --max-restarts, start torchrun with
#    #    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 and create the group with a plain
#    #    init_process_group(): each restart, on every node, gets a new store
#    #    that rank 0 serves. The agents' shared store keeps every earlier
#    #    attempt's keys, and TORCHELASTIC_RESTART_COUNT differs across nodes.
#    # 2. Keep the global batch fixed (a multiple of the number of ranks), and
#    #    save a global sample index: how many samples of one global order all
#    #    ranks together have trained on.
#    # 3. On another number of ranks, start the data there: per-rank positions
#    #    and per-rank RNG streams do not fit.

# %%
# Setup
# -----

import datetime
import itertools
import os
import re
import shutil
import signal
import subprocess
import sys
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
import torch.nn.functional as F
from page_tools import faults, figures, proofs, ranks, restarts, results
from rank_launcher import run_on_ranks, shared_tempdir, under_torchrun
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader, DistributedSampler, Sampler, TensorDataset
from torchdata.stateful_dataloader import StatefulDataLoader

print(f"torch {torch.__version__}")


# %%
# The model and the application state
# -----------------------------------
# The model, ``AppState`` and the helpers every page of this site uses; only
# the sizes change. ``BATCH`` is the global batch: all ranks together.

WIDTH, DEPTH, BATCH, LR = 32, 2, 12, 1e-2


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


# %%


def device_for_this_rank():
    # The launcher (or your own set-up code) has already picked this rank's GPU.
    if torch.accelerator.is_available():
        return torch.accelerator.current_accelerator()
    return torch.device("cpu")


def build_sharded_model(seed):
    torch.manual_seed(seed)
    model = ToyModel().to(device_for_this_rank())
    for module in (*model.layers, model):  # each layer, then the rest, as FSDP2 intends:
        fully_shard(module)  # parameters become DTensors; one all-gather per layer as it runs
    optimizer = torch.optim.Adam(model.parameters(), lr=LR)
    return model, optimizer


print(ToyModel())


# %%
# The data and its position
# -------------------------
# One shuffled pass over a small data set, cut into global batches of
# ``BATCH`` samples: at every step the ranks together take the next ``BATCH``
# samples of one global order, each rank ``BATCH / world_size`` of them. The
# data position is then one number that does not depend on the ranks: the
# global sample index, how many samples of that order all ranks have trained
# on. The data set also yields each sample's index, to count them. Ranks that
# do not divide ``BATCH`` are refused: on 8 ranks of 1 sample, 8 samples a step
# would train, 12 be counted, and a resume would skip the other 4.

NUM_SAMPLES, DATA_SEED, SAVE_EVERY = 720, 7, 10
NUM_STEPS = NUM_SAMPLES // BATCH  # one pass: 60 steps


def make_dataset():
    inputs = torch.randn(NUM_SAMPLES, WIDTH, generator=torch.Generator().manual_seed(DATA_SEED))
    return TensorDataset(inputs, inputs.roll(1, dims=1).sin(), torch.arange(NUM_SAMPLES))


def per_rank_batch(world_size):
    if BATCH % world_size:
        raise ValueError(f"{world_size} ranks cannot share a global batch of {BATCH} evenly")
    return BATCH // world_size


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


# %%
# On 2 and 3 ranks each rank takes 6 and 4 samples a step; 8 ranks are refused:

for world_size in (2, 3, 8):
    try:
        print(f"{world_size} ranks: {per_rank_batch(world_size)} samples each a step")
    except ValueError as error:
        print(f"{world_size} ranks: ValueError: {error}")
        refused = error

# %%

results.claim(
    "uneven-world-size-refused",
    str(refused) == "8 ranks cannot share a global batch of 12 evenly",
    f"8 ranks refused: {refused}",
    error=str(refused),
)


# %%
# What a resume needs here, the same on every rank: the step, the global
# sample index, and the number of ranks that saved.


class Progress(Stateful):
    def __init__(self):
        self.step, self.samples_seen, self.world_size = 0, 0, dist.get_world_size()

    def state_dict(self):
        return {"step": self.step, "samples_seen": self.samples_seen, "world_size": self.world_size}

    def load_state_dict(self, state_dict):
        self.step, self.samples_seen = state_dict["step"], state_dict["samples_seen"]
        self.world_size = state_dict["world_size"]


def step_dir(checkpoint_root, step):
    return os.path.join(checkpoint_root, f"step-{step:08d}")


def newest_complete_step(checkpoint_root):
    """The newest step directory with ``.metadata``: DCP writes it last."""
    steps = [int(name[5:]) for name in os.listdir(checkpoint_root) if name.startswith("step-")]
    done = [
        s for s in steps if os.path.exists(os.path.join(step_dir(checkpoint_root, s), ".metadata"))
    ]
    return max(done, default=None)


# %%
# The training loop
# -----------------
# Rank 0 picks the newest complete checkpoint and every rank loads it: DCP
# reshards model and optimizer to however many ranks load them. The data
# starts at the global sample index; each rank counts the samples it trains on.


def train(checkpoint_root, num_steps=NUM_STEPS):
    rank, world_size = dist.get_rank(), dist.get_world_size()
    batch_size = per_rank_batch(world_size)  # before any collective: every rank raises
    model, optimizer = build_sharded_model(seed=0)
    progress = Progress()
    state = {"app": AppState(model, optimizer), "progress": progress}
    newest = [newest_complete_step(checkpoint_root) if rank == 0 else None]
    dist.broadcast_object_list(newest, src=0)
    if newest[0] is not None:
        dcp.load(state, checkpoint_id=step_dir(checkpoint_root, newest[0]))
        if rank == 0:
            print(f"resuming from step {newest[0]}, saved on {progress.world_size} ranks, ", end="")
            print(f"now {world_size}: data from global sample {progress.samples_seen}")
    progress.world_size = world_size
    sampler = GlobalOrderSampler(NUM_SAMPLES, rank, world_size, start=progress.samples_seen)
    data = iter(DataLoader(make_dataset(), batch_size=batch_size, sampler=sampler))
    device, losses, trained_on = device_for_this_rank(), {}, []
    for step in range(progress.step + 1, num_steps + 1):
        inputs, targets, indices = next(data)
        loss = F.mse_loss(model(inputs.to(device)), targets.to(device))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        progress.step, progress.samples_seen = step, progress.samples_seen + BATCH
        mean_loss = loss.detach().clone()
        dist.all_reduce(mean_loss)
        losses[step], trained_on = mean_loss.item() / world_size, trained_on + indices.tolist()
        if step % SAVE_EVERY == 0:
            dcp.save(state, checkpoint_id=step_dir(checkpoint_root, step))
            if rank == 0:
                print(f"step {step}: loss {losses[step]:.4f}; saved")
    return {"losses": losses, "resumed_from": newest[0], "trained_on": trained_on}


# %%
# The loop as a torchrun script, restarted
# ----------------------------------------
# Under ``torchrun --max-restarts``, when a worker dies its agent stops the
# others and all agents meet again (a new rendezvous round), then start their
# workers again. By default the agents share one store, which outlives the
# workers: a plain ``dist.init_process_group()`` finds the previous attempt's
# keys in it, and gloo fails with ``Connection refused`` now and then (counted
# below). A prefix of ``TORCHELASTIC_RESTART_COUNT`` holds on one node only:
# the count is per agent, and an agent whose own workers were healthy (busy, or
# stuck in a collective) restarts them without counting ("membership changes
# do not count as retries", ``elastic/agent/server/api.py``), so across nodes
# the ranks look for each other under different prefixes until the group
# times out. Started with ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``, every round
# publishes a new ``MASTER_PORT`` (free on node 0) to every node, where worker
# rank 0 serves a new store (``env://``): no earlier attempt's keys (rule 1).

TIMEOUT = datetime.timedelta(seconds=120)  # this page's choice, not torch's default


def init_process_group_for_restarts():
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        raise RuntimeError("start torchrun with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1")
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend, timeout=TIMEOUT)  # env://: MASTER_ADDR, MASTER_PORT
    return os.environ["TORCHELASTIC_RESTART_COUNT"]  # this agent's count: for the log


# %%
# ``main()`` is what ``torchrun`` runs on every worker: the group, the loop
# (from the newest complete checkpoint), and the teardown. Save it as
# ``train.py`` with the functions above and start it on one node, or on every
# node of a job (the same ``--rdzv-endpoint`` everywhere), with:
#
# .. code-block:: bash
#
#    export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
#    torchrun --nproc-per-node=2 --max-restarts=1 train.py
#    torchrun --nnodes=2 --nproc-per-node=8 --max-restarts=3 \
#        --rdzv-backend=c10d --rdzv-endpoint=node0.example:29400 train.py
#
# ``torchrun`` replaces ``run_on_ranks``; the checkpoint root is a directory
# every worker sees. Below, this page starts itself under torchrun (the ``if``).

CHECKPOINTS_ENV = "TORCHRUN_RESTART_RECIPE_CHECKPOINTS"


def main(checkpoint_root):
    attempt = init_process_group_for_restarts()
    rank = dist.get_rank()
    print(f"[rank{rank}] attempt {attempt}", flush=True)
    result = train(checkpoint_root)
    print(f"[rank{rank}] attempt {attempt} resumed from step {result['resumed_from']}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__" and under_torchrun() and os.environ.get(CHECKPOINTS_ENV):
    main(os.environ[CHECKPOINTS_ENV])
    # gloo's threads outlive destroy_process_group() and can free a tensor while Python
    # shuts down: the worker aborts ("terminate called without an active exception").
    sys.stdout.flush()
    os._exit(0)


# %%
# While the cells below run, the page measures in the background how often a
# restarted group forms again (the counts are shown further down):

restart_probe = restarts.start(3)

# %%
# Where the checkpoints go, and the run to compare with: 60 steps on this
# machine's ranks, a save every 10.

WORK_DIR = shared_tempdir("dcp-torchrun-restart-")


def new_root(name):
    path = os.path.join(WORK_DIR, name)
    os.makedirs(path, exist_ok=True)  # under torchrun every rank runs this
    return path


print(f"checkpoints go under {WORK_DIR}")
uninterrupted_root = new_root("uninterrupted")
uninterrupted = run_on_ranks(train, uninterrupted_root)

# %%
# A restart under torchrun
# ------------------------
# The same job, now as this file under ``torchrun --max-restarts=1``, started here as a
# subprocess. Attempt 0 loses its last worker at step 45, after step 40 was saved; the
# agent restarts both workers (attempt 1), which resume from step 40. A notebook has no
# file to hand to torchrun: run this cell from the recipe's ``.py`` file.


def run_torchrun(checkpoint_root, nproc):
    script = sys.argv[0]  # this file, under Sphinx-Gallery, python and torchrun
    if under_torchrun() or not script.endswith(".py") or "ipykernel" in script:
        print("skipped: run the recipe's .py file (not under torchrun) to start torchrun from it")
        return None, ""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += [f"--nproc-per-node={nproc}", "--max-restarts=1", script]
    env = dict(os.environ, **{CHECKPOINTS_ENV: checkpoint_root}, OMP_NUM_THREADS="1")
    env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"  # rule 1
    with open(checkpoint_root + ".log", "w") as log:  # a new session: on a timeout, kill all
        job = subprocess.Popen(command, env=env, stdout=log, stderr=log, start_new_session=True)
    try:
        job.wait(timeout=150)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
    with open(checkpoint_root + ".log") as log:
        output = log.read()
    for line in output.splitlines():
        if re.search(r"attempt|resuming|Restarting|exitcode", line):
            print(line.split("] ", 1)[-1].split(" (pid")[0] if "torch/" in line else line)
    print(f"torchrun exited with {job.returncode}")
    return job.returncode, output


torchrun_root = new_root("torchrun")

# %%
# The page kills the worker in attempt 0 only (through a ``sitecustomize`` that
# it puts on ``PYTHONPATH`` for this cell):

with faults.kill_at_step(
    45, once_exists=os.path.join(step_dir(torchrun_root, 40), ".metadata"), new_processes=True
) as torchrun_kill:
    torchrun_exit, torchrun_log = run_torchrun(torchrun_root, len(uninterrupted))

# %%
# The kill happened where it was planned, every worker came back in attempt 1
# and resumed from step 40, and the job's last checkpoint is the uninterrupted
# run's, bit for bit:

faults.crashed_as_planned(
    "torchrun-crash", torchrun_kill, torchrun_log, torchrun_root, complete=[40]
)
results.claim(
    "torchrun-restart",
    torchrun_exit == 0
    and sorted(re.findall(r"\[rank(\d+)\] attempt 1 resumed from step (\d+)", torchrun_log))
    == [(str(rank), "40") for rank in range(len(uninterrupted))],
    f"torchrun exited with {torchrun_exit}; attempt 1 resumed from step 40 on every rank",
    resumed=re.findall(r"\[rank(\d+)\] attempt 1 resumed from step (\d+)", torchrun_log),
)
proofs.same_state(
    "torchrun-same-state",
    proofs.checkpoint_state(step_dir(uninterrupted_root, 60)),
    proofs.checkpoint_state(step_dir(torchrun_root, 60)),
    "restarted vs uninterrupted, step 60",
)

# %%
# Restarts on one node and across nodes
# -------------------------------------
# While the cells above ran, three minimal jobs ran under torch's elastic
# agent as ``torchrun --max-restarts=3`` runs them (from a fork server: a
# restart takes a moment). In each, two workers create
# the group with a plain ``dist.init_process_group("gloo")``; after the first
# barrier of every attempt but the last, the last worker is killed while the
# other stays busy, out of any collective, so that every restart has to form
# the group again:
#
# * ``plain``: one agent, two workers, on the agents' shared store;
# * ``own-store``: the same, started with ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``;
# * ``own-store-2-agents``: that, with two agents (two "nodes" of one worker
#   on this machine, a c10d rendezvous on a loopback port): node 1's worker is
#   killed, and node 0's agent restarts its busy worker without counting (its
#   restart count stays 0: an ``attempt-N`` prefix would differ across nodes).
#
# The plain job's counts vary (a race; 15 s without a group count as hung).
# ``tools/restart_trials.py`` counts these and the attempt prefix with real
# ``torchrun``, over many restarts.

counts = results.record("restart-probe", restarts.finish(restart_probe))
for mode in ("own-store", "own-store-2-agents"):
    results.claim(
        f"{mode}-restarts",
        counts[mode]["formed_after_restart"] == 3 and counts[mode]["exit"] == 0,
        f"{mode}: formed at {counts[mode]['formed_after_restart']} of 3 restarts, "
        f"each agent's restart count {counts[mode]['restart_counts']}",
        **counts[mode],
    )
figures.Table(
    ["job", "agents", "restarts", "formed again", "connect failed", "hung", "exit"],
    [
        [mode]
        + [c[k] for k in ("agents", "restarts", "formed_after_restart", "connect_failed")]
        + [c["hung"], c["exit"]]
        for mode, c in counts.items()
    ],
    caption="torchrun --max-restarts=3, a plain init_process_group: the agents' store or a new one",
)

# %%
# Resume on another number of ranks
# ---------------------------------
# DCP reshards model and optimizer on load: their keys and shapes do not
# depend on the number of ranks. A job stopped after step 30 on 2 ranks goes on
# on 3 ranks to step 40, then on 1 rank to the end. Under torchrun, that is
# ``--nproc-per-node`` of each new launch; here each launch of the page is
# given its number of ranks (on CPU ranks where the machine has fewer GPUs:
# resharding is DCP's planning, the same on any device).

reshard_root = new_root("reshard")

# %%
# The page keeps the state each save was given and each load filled in:

with ranks.exactly(2), proofs.state_given_to(dcp, "save") as saved_on_2:
    on_2 = run_on_ranks(train, reshard_root, 30)
with (
    ranks.exactly(3),
    proofs.state_after(dcp, "load") as loaded_on_3,
    proofs.state_given_to(dcp, "save") as saved_on_3,
):
    on_3 = run_on_ranks(train, reshard_root, 40)
with ranks.exactly(1), proofs.state_after(dcp, "load") as loaded_on_1:
    on_1 = run_on_ranks(train, reshard_root, 60)

# %%
# What 3 ranks loaded is what 2 saved, and what 1 loaded is what 3 saved (model,
# optimizer, step, sample index, ranks that saved), and the job trained on
# every sample once:

proofs.same_state("reshard-2-to-3", saved_on_2, loaded_on_3, "saved on 2, loaded on 3")
proofs.same_state("reshard-3-to-1", saved_on_3, loaded_on_1, "saved on 3, loaded on 1")
results.claim(
    "every-sample-once",
    sorted(i for run in (on_2, on_3, on_1) for rank in run for i in rank["trained_on"])
    == list(range(NUM_SAMPLES)),
    f"the 2 -> 3 -> 1 rank job trained on each of the {NUM_SAMPLES} samples once",
    ranks=[len(on_2), len(on_3), len(on_1)],
    trained=sum(len(rank["trained_on"]) for run in (on_2, on_3, on_1) for rank in run),
)

# %%
# Why not per-rank positions? The resume page saves each rank's
# ``StatefulDataLoader`` state: torchdata 0.11 records how many samples that
# rank's loader yielded (``samples_yielded``) and on load skips that many of
# the rank's share, whatever the number of ranks. Rank 0 of 2 saves 180 after
# 30 batches of 6; as rank 0 of 3 it skips 180 of every third sample: it starts
# at global position 540, not 360. Rank 2 has no state and starts over:


def torchdata_loader(rank, world_size):
    dataset = make_dataset()
    sampler = DistributedSampler(dataset, world_size, rank, shuffle=True, seed=DATA_SEED)
    with warnings.catch_warnings():  # torchdata 0.11 calls torch.set_vital, deprecated in 2.13
        warnings.filterwarnings("ignore", message="'set_vital' is deprecated")
        return StatefulDataLoader(dataset, batch_size=BATCH // world_size, sampler=sampler)


saved = {}
for rank in range(2):
    loader = torchdata_loader(rank, 2)
    trained_to_step_30 = list(itertools.islice(loader, 30))
    saved[rank] = loader.state_dict()
print(f"rank 0 of 2 saved {saved[0]['_sampler_iter_state']} after 30 batches")

# %%
# Steps 31 to 40 on 3 ranks, from the torchdata states and from the global
# sample index (positions in the order both samplers shuffle the same way):

order = GlobalOrderSampler(NUM_SAMPLES, 0, 1).order
position, due = {sample: at for at, sample in enumerate(order)}, set(range(360, 480))
trained = {"torchdata state": [], "global sample index": []}
for rank in range(3):
    loader = torchdata_loader(rank, 3)
    if rank in saved:
        loader.load_state_dict(saved[rank])
    batches = itertools.islice(loader, 10)
    mine = [position[i] for _, _, indices in batches for i in indices.tolist()]
    from_index = list(GlobalOrderSampler(NUM_SAMPLES, rank, 3, start=360))[:40]
    trained["torchdata state"] += mine
    trained["global sample index"] += [position[i] for i in from_index]
    print(f"rank {rank} of 3: torchdata from position {mine[0]}, the index from {360 + rank}")
for way, seen in trained.items():
    again = sum(at < 360 for at in seen)
    print(f"{way}: {again} samples trained twice, {len(due - set(seen))} of 120 due not trained")

# %%

results.claim(
    "global-index-repeats-nothing",
    sorted(trained["global sample index"]) == sorted(due)
    and sum(at < 360 for at in trained["torchdata state"]) > 0
    and trained["torchdata state"][0] == 540,
    figures.wrap(
        "on 3 ranks after 2, rank 0's torchdata state starts at global position "
        f"{trained['torchdata state'][0]}; the global sample index trains steps 31-40 exactly"
    ),
    samples_yielded=saved[0]["_sampler_iter_state"]["samples_yielded"],
    starts=[trained["torchdata state"][k] for k in (0, 40, 80)],
    again=sum(at < 360 for at in trained["torchdata state"]),
)

# %%
# Clean up
# --------

shutil.rmtree(WORK_DIR, ignore_errors=True)
print(f"removed {WORK_DIR}: {not os.path.exists(WORK_DIR)}")


# %%
# What to read next
# -----------------
# * :ref:`sphx_glr_recipes_resume_recipe.py`: everything else a resume needs,
#   with the kills in the middle of a save.
# * :ref:`sphx_glr_recipes_staging_pitfalls_recipe.py`: what a save writes
#   when the rules of the overlapped save are broken.
# * :doc:`/troubleshooting`: symptoms and fixes for the usual DCP failures.
