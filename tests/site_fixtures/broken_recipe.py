"""
A broken recipe
===============

It raises on purpose: the build must fail with rank 1's traceback.
"""

import torch.distributed as dist
from rank_launcher import run_on_ranks


def train():
    print("about to fail on rank", dist.get_rank())
    if dist.get_rank() == 1:
        raise RuntimeError("checkpoint directory vanished")


run_on_ranks(train)
