"""A recipe that reuses one DefaultStager, as every training loop on the site does."""

import torch
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

stager = DefaultStager(StagingOptions(False, False, False, False))
weights = torch.arange(4.0)
for save in range(3):
    staged = stager.stage({"weights": weights, "step": save})
    assert torch.equal(staged["weights"], weights) and staged["step"] == save
stager.close()
from page_tools import results  # noqa: E402  (gpu-check puts it on the path; a plain run fails first)

results.record("headline", {"stages with one DefaultStager": 3})
