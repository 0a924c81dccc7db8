"""Checkpoints: DCP save/load (async too) in Megatron's directory layout, and export.

    layout.py   iter_XXXXXXX directories, the pointer file, completion markers, pruning
    stored.py   the saved layout (mesh-free names); checks of a stored checkpoint against it
    manager.py  Checkpointer: saves and loads a TrainState (load on construction, due/save/finalize)
    export.py   one-process reading and writing of whole checkpoints (scripts, generation)
    hf_files.py a Hugging Face model directory, and what its layouts share
    gpt2.py     the Hugging Face GPT-2 layout (GPT2LMHeadModel)
    hf_llama.py the Hugging Face Llama layout (LlamaForCausalLM)
    hf_tokenizer.py  the run's tokenizer as Hugging Face tokenizer files
    megatron/   Megatron-LM checkpoints (torch_dist and per-rank): formats, key map, reader,
                region reads, load into a TrainState at any mesh, conversion both ways
"""

from dtgpt.checkpoint.layout import CheckpointError
from dtgpt.checkpoint.manager import Checkpointer

__all__ = ["Checkpointer", "CheckpointError"]
