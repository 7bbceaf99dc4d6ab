"""Checkpoint and resume with DCP: a whole training script for torchrun.

    torchrun --nproc-per-node=2 train.py CHECKPOINT_ROOT

Every 10 steps each rank saves its shards into CHECKPOINT_ROOT/step-N. Run it again
and it resumes from the newest complete checkpoint (one with .metadata, which DCP
writes last), with the same model, optimizer and step.
"""

import os
import re
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import fully_shard

STEPS_PER_RUN, SAVE_EVERY = 20, 10


def newest_complete_checkpoint(root):
    steps = [int(m[1]) for m in (re.fullmatch(r"step-(\d+)", n) for n in os.listdir(root)) if m]
    complete = [s for s in steps if os.path.exists(os.path.join(root, f"step-{s}", ".metadata"))]
    return max(complete, default=None)


def main(root):
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo")
    device = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else "cpu"
    torch.manual_seed(0)  # the same initial model on every rank
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1)).to(device)
    fully_shard(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)

    os.makedirs(root, exist_ok=True)
    latest, start = newest_complete_checkpoint(root), 0
    if latest is not None:  # dcp.load fills the state dict in place, each rank its shards
        model_state, optim_state = get_state_dict(model, optimizer)
        state = {"model": model_state, "optim": optim_state, "step": 0}
        dcp.load(state, checkpoint_id=os.path.join(root, f"step-{latest}"))
        set_state_dict(
            model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
        )
        start = state["step"]  # plain values come back too
    if dist.get_rank() == 0:
        print(f"resuming from step-{start}" if start else "no checkpoint: starting at step 0")

    for step in range(start + 1, start + STEPS_PER_RUN + 1):
        batch = torch.Generator().manual_seed(1000 * step + dist.get_rank())  # this rank's data
        x = torch.randn(16, 32, generator=batch).to(device)
        loss = (model(x) - x.sum(dim=1, keepdim=True)).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step % SAVE_EVERY == 0:
            model_state, optim_state = get_state_dict(model, optimizer)
            state = {"model": model_state, "optim": optim_state, "step": step}
            dcp.save(state, checkpoint_id=os.path.join(root, f"step-{step}"))
            if dist.get_rank() == 0:
                print(f"step {step}: loss {loss.item():.4f}; saved step-{step}")
    dist.barrier()  # no rank tears gloo down while another one still sends
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
    # gloo's worker threads outlive destroy_process_group() (the device mesh fully_shard
    # made, which DTensor caches, holds the group) and can free a tensor after Python began
    # to shut down, which aborts the process ("terminate called without an active
    # exception", exit code -6). Leave without that shutdown.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
