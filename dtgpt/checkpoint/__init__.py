"""Checkpoints: DCP save/load (async too) in Megatron's directory layout, and export.

    layout.py   iter_XXXXXXX directories, the pointer file, completion markers, pruning
    state.py    the saved layout (mesh-free names); checks of a stored checkpoint against it
    manager.py  Checkpointer: saves and loads a TrainState (load on construction, due/save/finalize)
    export.py   one-process reading and writing of whole checkpoints (scripts, generation)
    gpt2.py     the Hugging Face GPT-2 layout
    megatron.py Megatron-LM checkpoints (torch_dist and per-rank): detection, key map, region reads
    megatron_load.py  a Megatron checkpoint (weights, Adam state, progress) into a TrainState at any mesh
    regions.py  DCP reads of sub-regions of stored tensors (a rank reads only what it holds)
    megatron_write.py  streaming conversion dtgpt <-> Megatron torch_dist
    hf_tokenizer.py  the run's tokenizer as Hugging Face tokenizer files
"""

from dtgpt.checkpoint.layout import CheckpointError
from dtgpt.checkpoint.manager import Checkpointer

__all__ = ["Checkpointer", "CheckpointError"]
