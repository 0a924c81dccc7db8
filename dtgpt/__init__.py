"""dtgpt: Megatron-LM's GPT pretraining on PyTorch's native distributed primitives.

The library API (see README, "Library API", and dtgpt/api.py): make_config, init_distributed,
build_model, build_train_iterator, build_data_iterators, num_microbatches, forward_backward,
build_train_state, train_step, evaluate, save_checkpoint, load_checkpoint, shutdown, and pretrain
(the whole train.py flow, built from them). Imported lazily, so `import dtgpt.config` stays light.
"""

__version__ = "0.1.0"

_API = (
    "make_config", "init_distributed", "build_model", "build_train_iterator", "build_data_iterators",
    "num_samples_needed", "num_microbatches", "forward_backward", "build_train_state", "train_step", "evaluate",
    "save_checkpoint", "load_checkpoint", "shutdown",
)  # fmt: skip
__all__ = [*_API, "pretrain"]


def __getattr__(name):
    if name in _API:
        from dtgpt import api

        return getattr(api, name)
    if name == "pretrain":
        from dtgpt.training import pretrain

        return pretrain
    raise AttributeError(f"module 'dtgpt' has no attribute {name!r}")
