"""Megatron-LM checkpoints (torch_dist and per-rank) in and out, in one home.

    formats.py  finding a Megatron iteration directory, its format, its pickles, its progress
    keys.py     the key map between Megatron's names and dtgpt's, full shapes, vocabulary rows
    reader.py   MegatronReader: tensors or sub-regions of either format by dtgpt name
    per_rank.py PerRankModel: the per-rank files (tp, pp and ep ranks) glued into torch_dist's tensors
    per_rank_optim.py  the per-rank files' Adam state, by each file's parameter names
    regions.py  DCP reads of sub-regions of stored tensors (a rank reads only what it holds)
    load.py     a Megatron checkpoint into a TrainState at any mesh, or into a one-device GPT
    write.py    streaming conversion dtgpt <-> Megatron torch_dist
    write_muon.py  a Muon run's state as megatron-core's Muon chain saves it (torch_dist)
    write_per_rank.py  dtgpt -> Megatron's per-rank files at tp x ep
"""

from dtgpt.checkpoint.megatron.formats import find
from dtgpt.checkpoint.megatron.load import load_into_state, load_megatron_model
from dtgpt.checkpoint.megatron.write import from_megatron, to_megatron
from dtgpt.checkpoint.megatron.write_per_rank import to_megatron_per_rank

__all__ = ["find", "from_megatron", "load_into_state", "load_megatron_model", "to_megatron", "to_megatron_per_rank"]
