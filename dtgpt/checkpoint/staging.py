"""The stager of async saves, and the one private torch detail it depends on.

dcp.async_save's DefaultStager copies the state into CPU memory with a copier whose dispatch
table says how to copy each kind of object (torch/distributed/checkpoint/_state_dict_stager.py).
dtgpt keeps one stager for the run so that each save reuses the CPU buffers of the last one. On
torch 2.11 DefaultStager closes its copier after every copy, and closing empties that table: the
next save's copy then fails on the first container it meets (a dict's copy goes through its class:
`KeyError: <class 'type'>`). 2.13 keeps the copier open. So a stager whose table was emptied is
replaced by a new one before the next save (2.11 gives up the buffers' reuse; 2.13 keeps it).

Checked on torch 2.11 (the table is emptied after each copy) and 2.13 (it is not);
tests/test_staging.py copies dtgpt's own state twice through torch's stager both ways.
"""

from __future__ import annotations

from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions


def build_stager(cuda: bool) -> DefaultStager:
    """A DefaultStager that copies the state to CPU memory (pinned from CUDA) before async_save returns."""
    return DefaultStager(
        StagingOptions(use_pinned_memory=cuda, use_shared_memory=False, use_async_staging=False, use_non_blocking_copy=cuda)
    )


def stager_for_next_save(previous: DefaultStager | None, cuda: bool) -> DefaultStager:
    """The previous save's stager, whose CPU buffers the next copy reuses, unless its torch closed
    it after copying (torch 2.11: see the module docstring)."""
    if previous is not None and _can_copy_again(previous):
        return previous
    return build_stager(cuda)


def _can_copy_again(stager: DefaultStager) -> bool:
    return bool(stager._state_dict_stager._deepcopy_dispatch)  # torch private: see the module docstring
