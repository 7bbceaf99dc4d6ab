"""Rank 0 sleeps far past the deadline: the launch must fail when DCP_RECIPES_TIMEOUT runs out."""

import time

import torch.distributed as dist
from rank_launcher import run_on_ranks


def train():
    print("rank", dist.get_rank(), "started")
    if dist.get_rank() == 0:
        time.sleep(600)


run_on_ranks(train)
