"""torch 2.11's DefaultStager, on the torch installed here (put on PYTHONPATH by a test).

torch 2.11's ``DefaultStager._stage`` ends by closing its ``StateDictStager``, which empties
the stager's caches: the next stage of the same stager raises ``KeyError: <class 'type'>``.
"""

from torch.distributed.checkpoint.staging import DefaultStager

_stage = DefaultStager._stage


def _stage_then_close(self, state_dict, **kwargs):
    staged = _stage(self, state_dict, **kwargs)
    self._state_dict_stager.close()
    return staged


DefaultStager._stage = _stage_then_close
