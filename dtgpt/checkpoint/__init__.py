"""Checkpoints: DCP save/load (async too) in Megatron's directory layout, and export.

    layout.py   iter_XXXXXXX directories, the pointer file, completion markers, pruning
    state.py    what is saved, under mesh-free names; building load targets; shape checks
    manager.py  Checkpointer: the trainer's interface (load on construction, due/save/finalize)
    export.py   one-process reading and writing of whole checkpoints (scripts, generation)
    gpt2.py     the Hugging Face GPT-2 layout
    hf_tokenizer.py  the run's tokenizer as Hugging Face tokenizer files
"""

from dtgpt.checkpoint.layout import CheckpointError
from dtgpt.checkpoint.manager import Checkpointer

__all__ = ["Checkpointer", "CheckpointError"]
