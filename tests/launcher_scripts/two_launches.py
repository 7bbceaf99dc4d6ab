"""Two launches of one page, at 2 and then 3 ranks: the page's run stamp is the first's."""

import os

from rank_launcher import run_on_ranks


def a_rank():
    pass


run_on_ranks(a_rank)
os.environ["DCP_RECIPES_WORLD_SIZE"] = "3"
run_on_ranks(a_rank)
