"""Open a folder exported by hf_interop_recipe the way a user of the model would.

Run as ``python tests/hf_open_export.py FOLDER`` in a fresh process: no process
group, no DCP. Prints one JSON line with what it found; exits non-zero if
``from_pretrained`` or ``safetensors`` cannot read the folder.
"""

from __future__ import annotations

import json
import os
import sys

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from safetensors.torch import load_file  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402


def main(folder: str) -> None:
    with open(os.path.join(folder, "model.safetensors.index.json")) as index_file:
        weight_map = json.load(index_file)["weight_map"]
    files = sorted(f for f in os.listdir(folder) if f.endswith(".safetensors"))
    tensors = {}
    for name in files:
        tensors.update(load_file(os.path.join(folder, name)))

    model = AutoModelForCausalLM.from_pretrained(folder)
    state_dict = model.state_dict()
    differ = [n for n, t in tensors.items() if not torch.equal(t, state_dict.get(n, t + 1))]
    with torch.no_grad():
        logits = model(torch.arange(16).reshape(2, 8)).logits
    print(
        json.dumps(
            {
                "process_group": dist.is_available() and dist.is_initialized(),
                "files": files,
                "index_files": sorted(set(weight_map.values())),
                "index_names": sorted(weight_map),
                "file_names": sorted(tensors),
                "model_names": sorted(state_dict),
                "differ": differ,
                "dtype": str(model.dtype),
                "logits_finite": bool(torch.isfinite(logits).all()),
                "shapes": {n: list(t.shape) for n, t in tensors.items()},
                "config_shapes": {n: list(t.shape) for n, t in state_dict.items()},
            }
        )
    )


if __name__ == "__main__":
    main(sys.argv[1])
