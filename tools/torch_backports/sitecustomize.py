"""A backport ``make gpu-check`` puts on PYTHONPATH when the torch under test needs it.

torch 2.11's ``DefaultStager._stage`` closes the stager's ``StateDictStager`` after
every copy, which empties its buffer cache and its copy table: a reused stager then
raises ``KeyError: <class 'type'>`` at its second save, and never reuses a buffer.
torch 2.13, which this site pins, does not. The recipes reuse one stager per run, as a
training loop should, so on such a torch ``make gpu-check`` runs them with this backport
and says so in its summary: the GPU paths under test (streams, pinned memory, NCCL)
are torch's own; only that close is skipped.

With it skipped, the stager that ``async_save`` creates for itself when it is given
none would keep its host copy until the garbage collector breaks its reference cycle
(torch 2.11 relied on that close): the backport closes that one when its upload is
done, as torch 2.13's ``async_save`` does.

Python imports one ``sitecustomize`` at start-up, the first on ``sys.path``; this one
runs the next one it shadows first (a distribution's own), then patches.
"""

import functools
import importlib.machinery
import importlib.util
import os
import sys
from concurrent.futures import Future


def _run_the_sitecustomize_this_one_shadows() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    others = [path for path in sys.path if os.path.abspath(path or os.curdir) != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", others)
    if spec is not None and spec.loader is not None:
        spec.loader.exec_module(importlib.util.module_from_spec(spec))


def _keep_the_stager_buffers() -> None:
    from torch.distributed.checkpoint.staging import DefaultStager

    stage = DefaultStager._stage

    def _stage_keeping_buffers(self, state_dict, **kwargs):
        state_dict_stager = self._state_dict_stager
        state_dict_stager.close = lambda: None  # the close inside _stage; DefaultStager.close
        try:  # still closes it, once the stager is done
            return stage(self, state_dict, **kwargs)
        finally:
            del state_dict_stager.close

    DefaultStager._stage = _stage_keeping_buffers


def _close_the_stager_async_save_makes() -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import state_dict_saver
    from torch.distributed.checkpoint.staging import AsyncStager, DefaultStager, StagingOptions

    async_save = state_dict_saver.async_save

    @functools.wraps(async_save)
    def async_save_closing_its_stager(state_dict, *, async_stager=None, **kwargs):
        if async_stager is not None or isinstance(kwargs.get("storage_writer"), AsyncStager):
            return async_save(state_dict, async_stager=async_stager, **kwargs)
        own = DefaultStager(StagingOptions(False, False, False, False))  # async_save's own
        try:
            response = async_save(state_dict, async_stager=own, **kwargs)
        except BaseException:
            own.close()
            raise
        upload = response if isinstance(response, Future) else response.upload_completion
        upload.add_done_callback(lambda _: own.close())
        return response

    state_dict_saver.async_save = dcp.async_save = async_save_closing_its_stager


_run_the_sitecustomize_this_one_shadows()
_keep_the_stager_buffers()
_close_the_stager_async_save_makes()
