"""Megatron checkpoints of the GPT family loaded by dtgpt at pp2 and tp2 + SP, for
tests/test_megatron_family.py.

torchrun, 2 ranks (or a run of tests/batch_worker.py calling main): for each (checkpoint root,
[model] fields) given as JSON in argv[1], a pp2
dtgpt model loads the checkpoint through the library API and runs tests/megatron_gpt.py's
tokens() through its two stages by hand (stage 0 sends its hidden states to stage 1); the last
stage writes its logits to <root>/pp2_logits.pt. Then a tp2 + SP model loads it and rank 0
writes its logits (gathered over the vocabulary) to <root>/tp2_logits.pt. An entry may name its
layouts as a third element (default ["pp2", "tp2"]; "ep2": experts split over 2 ranks of dp_shard 2),
and [parallel] fields of its own by layout as a fourth (e.g. {"pp2": {"pipeline_layers_per_stage": [1, 2]}}).
A model with multi-token prediction runs in training mode (dropout is 0), so its logits are
(1 + depths, B, T, V): the main model's, then each depth's (on the last stage at pp2, which embeds
the tokens it is given as input_ids).
"""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.megatron_gpt, run as a script

import dtgpt  # noqa: E402
from tests.megatron_gpt import SEQ, VOCAB, tokens  # noqa: E402


LAYOUTS = {"pp2": dict(pipeline_model_parallel_size=2), "tp2": dict(tensor_model_parallel_size=2, sequence_parallel=True),
           "ep2": dict(data_parallel_shard_size=2, expert_model_parallel_size=2)}  # fmt: skip


def loaded(root: str, model_fields: dict, layout: str, parallel: dict):
    cfg = dtgpt.make_config(
        model={**dict(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=SEQ, hidden_dropout=0.0,
                      attention_dropout=0.0), **model_fields},
        data=dict(mock_data=True, tokenizer_type="NullTokenizer", vocab_size=VOCAB),
        training=dict(micro_batch_size=1 if layout == "ep2" else 2, global_batch_size=2),  # ep2: 2 data-parallel ranks
        parallel={**LAYOUTS[layout], **parallel.get(layout, {})},
    )  # fmt: skip
    runtime = dtgpt.init_distributed(cfg)
    state = dtgpt.build_train_state(cfg, dtgpt.build_model(cfg, runtime, VOCAB))
    dtgpt.load_checkpoint(root, cfg, runtime, state)
    return state.model.parts[0].eval()


@torch.no_grad()
def logits_of(model, x: torch.Tensor, **inputs) -> torch.Tensor:
    """The model's (or last stage's) logits of x, gathered whole; with multi-token prediction
    stacked with each depth's, which the model gives in training mode."""
    if model.mtp is None:
        return whole(model(x, **inputs))
    model.train()
    out = model(x, **inputs)
    model.eval()
    return torch.stack([whole(logits) for logits in out])


def whole(logits: torch.Tensor) -> torch.Tensor:
    return logits.full_tensor() if isinstance(logits, DTensor) else logits  # vocabulary-sharded for the loss


@torch.no_grad()
def pp2_logits(stage, hidden_size: int) -> torch.Tensor | None:
    """The last stage's logits (None on the first, which sends its hidden states on)."""
    if dist.get_rank() == 0:
        dist.send(stage(tokens()).contiguous(), dst=1)
        return None
    hidden = torch.empty(2, tokens().shape[1], hidden_size)
    dist.recv(hidden, src=0)
    return logits_of(stage, hidden, input_ids=tokens())


def main(argv: list[str]) -> int:
    for root, model_fields, *rest in json.loads(argv[0]):
        layouts = rest[0] if rest else ["pp2", "tp2"]
        parallel = rest[1] if len(rest) > 1 else {}
        if "pp2" in layouts:
            logits = pp2_logits(loaded(root, model_fields, "pp2", parallel), model_fields.get("hidden_size", 64))
            if logits is not None:
                torch.save(logits, Path(root) / "pp2_logits.pt")
        for layout in (name for name in layouts if name != "pp2"):  # every rank runs the whole model
            logits = logits_of(loaded(root, model_fields, layout, parallel), tokens())
            if dist.get_rank() == 0:
                torch.save(logits, Path(root) / f"{layout}_logits.pt")
            dist.barrier()
    dtgpt.shutdown()
    return 0


if __name__ == "__main__":
    main(sys.argv[1:])
