"""Rank 1 raises while rank 0 waits for it in a barrier: the launch must fail at once."""

import torch.distributed as dist
from rank_launcher import run_on_ranks


def train(step):
    print(f"rank {dist.get_rank()} reached step {step}")
    if dist.get_rank() == 1:
        raise ValueError("loss is NaN on purpose")
    dist.barrier()  # rank 0 waits here for a peer that is gone


run_on_ranks(train, 7)
