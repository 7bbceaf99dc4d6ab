"""Two forked ranks save a tensor sharded over them, inside a watch of dcp.save.

The page (this script) gets each rank's snapshot back and reassembles the whole tensor.
"""

import os
import tempfile

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from page_tools import proofs
from rank_launcher import run_on_ranks
from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

original = dcp.save
directory = tempfile.mkdtemp()


def save_a_sharded_tensor(path):
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    whole = torch.arange(12.0).reshape(4, 3)
    dcp.save({"w": distribute_tensor(whole, mesh, [Shard(0)])}, checkpoint_id=path)


with proofs.state_given_to(dcp, "save") as saved:
    run_on_ranks(save_a_sharded_tensor, os.path.join(directory, "ckpt"))

print("ranks recorded:", sorted(saved.by_rank))
pieces = [snap["w"] for snap in saved.last()]
print("shards:", [piece.offset for piece in pieces], "of", pieces[0].global_shape)
reassembled = proofs.whole_state(saved)["w"]
print("reassembled equals arange:", torch.equal(reassembled, torch.arange(12.0).reshape(4, 3)))
print("dcp.save restored:", dcp.save is original)
import shutil  # noqa: E402

shutil.rmtree(directory)
