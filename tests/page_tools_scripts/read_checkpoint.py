"""Two forked ranks save a sharded tensor; the page reads the checkpoint back from disk."""

import os
import tempfile

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from page_tools import proofs, results
from rank_launcher import run_on_ranks
from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

directory = tempfile.mkdtemp()


def save(path, offset):
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    whole = torch.arange(12.0).reshape(4, 3) + offset
    dcp.save({"w": distribute_tensor(whole, mesh, [Shard(0)]), "step": 3}, checkpoint_id=path)


first, second = os.path.join(directory, "a"), os.path.join(directory, "b")
with proofs.state_given_to(dcp, "save") as saved:
    run_on_ranks(save, first, 0.0)
run_on_ranks(save, second, 1.0)
proofs.same_state("read", saved, proofs.checkpoint_state(first), "on disk vs saved")
proofs.differing_state("changed", saved, proofs.checkpoint_state(second), "changed on disk")
try:
    proofs.same_state("other", saved, proofs.checkpoint_state(second), "other")
except results.ClaimFailed:
    print("a different checkpoint fails the claim")
import shutil  # noqa: E402

shutil.rmtree(directory)
