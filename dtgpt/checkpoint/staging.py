"""The stager of async saves, and the one private torch detail it depends on.

dcp.async_save's DefaultStager deep-copies the state into CPU memory with its own copier
(torch/distributed/checkpoint/_state_dict_stager.py). A DTensor (every FSDP or TP parameter, and
the state of a fp16/bf16 run of one process) deep-copies through its reduce tuple, which holds
its class; the copier's dispatch table of torch 2.11 has no entry for classes and raises
`KeyError: <class 'type'>` on it (2.13's has one: a class is copied as itself, as
copy.deepcopy does). The state cannot leave the class out, since DCP needs the DTensors to write
each shard's place, so the stager is given the missing entry where its torch lacks it.

Checked on torch 2.11 (its stager raises that KeyError on a DTensor state) and 2.13 (the entry is
present: nothing is changed);
tests/test_staging.py fails if the copier moves or stops copying dtgpt's state.
"""

from __future__ import annotations

from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions


def build_stager(cuda: bool) -> DefaultStager:
    """A DefaultStager that copies the state to CPU memory (pinned from CUDA) before async_save
    returns, with classes copied as themselves on every torch dtgpt accepts."""
    stager = DefaultStager(
        StagingOptions(use_pinned_memory=cuda, use_shared_memory=False, use_async_staging=False, use_non_blocking_copy=cuda)
    )
    dispatch = stager._state_dict_stager._deepcopy_dispatch  # torch private: see the module docstring
    dispatch.setdefault(type, _deepcopy_atomic)
    return stager


def _deepcopy_atomic(x, memo, non_blocking=False):
    """A class is copied as itself. The copier calls an entry of this name with (x, memo), any
    other with non_blocking too: both are taken."""
    return x
