"""The workaround for torch 2.11 and 2.12, whose reused ``DefaultStager`` fails: a fresh stager
per save. ``make versions`` runs this in every torch's venv, beside the recipes, as the row
"fresh DefaultStager per save" of the page "PyTorch versions".

It saves three times with ``dcp.async_save`` and one ``DefaultStager`` (what the recipes do),
then three times with a new ``DefaultStager`` for each save, closed once that save's upload
is done (the fix in the troubleshooting entry ``reused-stager-keyerror``), and loads the last
checkpoint of each back. It prints what happened to both and exits 0 when the workaround
saved and loaded back exactly, whether or not the reused stager failed on this torch.
It needs torch only: one process, gloo.
"""

import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions


def staging_options():
    on_gpu = torch.accelerator.is_available()
    return StagingOptions(
        use_pinned_memory=on_gpu,
        use_shared_memory=False,
        use_async_staging=True,
        use_non_blocking_copy=on_gpu,
    )


def save_three_times(model, root, fresh_stager_per_save):
    """Three async saves, one stager for all or a new one each; the last one loaded back."""
    stager = None if fresh_stager_per_save else DefaultStager(staging_options())
    try:
        for step in range(3):
            with torch.no_grad():
                for parameter in model.parameters():
                    parameter.add_(1.0)
            this_save = DefaultStager(staging_options()) if fresh_stager_per_save else stager
            response = dcp.async_save(
                {"model": model.state_dict()},
                checkpoint_id=os.path.join(root, f"step-{step}"),
                async_stager=this_save,
            )
            response.upload_completion.result()
            if fresh_stager_per_save:
                this_save.close()  # its upload is done: nothing reads its copy any more
    finally:
        if stager is not None:
            stager.close()
    loaded = {"model": {k: torch.zeros_like(v) for k, v in model.state_dict().items()}}
    dcp.load(loaded, checkpoint_id=os.path.join(root, "step-2"))
    same = all(torch.equal(loaded["model"][k], v) for k, v in model.state_dict().items())
    return f"3 saves, the last loaded back {'equal' if same else 'DIFFERENT'}", same


def main():
    with tempfile.TemporaryDirectory(prefix="dcp-fresh-stager-") as root:
        store = dist.FileStore(os.path.join(root, "store"), 1)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
        print(f"torch {torch.__version__}")
        try:
            said, _ = save_three_times(model, os.path.join(root, "reused"), False)
            print(f"one DefaultStager for every save: {said}")
        except Exception as error:  # the failure this check is about, on 2.11 and 2.12
            first = str(error).splitlines()[0] if str(error) else ""
            print(f"one DefaultStager for every save: {type(error).__name__}: {first}")
        said, same = save_three_times(model, os.path.join(root, "fresh"), True)
        print(f"a fresh DefaultStager per save: {said}")
        dist.destroy_process_group()
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
