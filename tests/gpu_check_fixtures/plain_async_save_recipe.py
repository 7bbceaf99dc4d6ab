"""Plain async_save, with no stager of its own: no host copy may outlive its upload."""

import gc
import os
import shutil
import tempfile
import time

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._state_dict_stager import StateDictStager

gc.disable()  # a stager in a reference cycle must be closed, not collected
root = tempfile.mkdtemp(dir=os.getcwd())
for save in range(3):
    state = {"weights": torch.ones(1000)}
    dcp.async_save(state, checkpoint_id=os.path.join(root, str(save)), no_dist=True).result()


def stagers_holding_a_copy():
    copiers = (obj for obj in gc.get_objects() if isinstance(obj, StateDictStager))
    return [copier for copier in copiers if len(copier._cached_storage_mapping)]


deadline = time.monotonic() + 10  # the close runs in the upload's done callback
while stagers_holding_a_copy() and time.monotonic() < deadline:
    time.sleep(0.1)
print(f"plain_async_save_recipe: {len(stagers_holding_a_copy())} stagers hold a copy after 3 saves")
shutil.rmtree(root)
