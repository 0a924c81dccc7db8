"""Megatron-LM's pipeline split of a per-rank model: which stage's file holds which tensor.

Megatron splits the decoder layers evenly over the pp stages, or with
decoder_first_pipeline_num_layers (decoder_last_pipeline_num_layers) that many on the first (last)
and the rest evenly (dtgpt/config/pipeline_split.py); each stage numbers
its layers from 0. The embedding lives on the first stage, the final norm and the output layer on
the last. With tied embeddings and pp > 1 the last stage holds the head as `output_layer.weight`,
its own copy of the word embeddings (kept equal by an all-reduce over the embedding group); a
last stage with multi-token prediction blocks builds the embedding too (the blocks embed the
shifted tokens), so it holds `embedding.*` as well.
"""

from __future__ import annotations

from dtgpt.checkpoint.layout import CheckpointError
from dtgpt.config import ConfigError
from dtgpt.config.pipeline_split import split_layers

LAST_STAGE = ("decoder.final_layernorm.", "output_layer.", "mtp.")
WORD_EMBEDDINGS = "embedding.word_embeddings.weight"


def flag_name(key: str, value: object) -> str:
    """A split key as the converter's flag: --pp 2, --decoder-first-pipeline-num-layers 1."""
    return f"--{'pp' if key == 'pipeline_model_parallel_size' else key.replace('_', '-')} {value}"


def stage_counts(layers: int, pp: int, first: int | None = None, last: int | None = None) -> list[int]:
    """The decoder layers of each of `pp` stages (Megatron's rule), or one error naming the rule."""
    if pp < 1:
        raise CheckpointError(f"--pp {pp}: the pipeline parallel size must be at least 1")
    if first is not None or last is not None:
        try:
            return split_layers(layers, pp, 1, first, last, name=flag_name)
        except ConfigError as e:
            raise CheckpointError(str(e)) from None
    if layers % pp:
        raise CheckpointError(
            f"--pp {pp}: Megatron splits model.num_layers={layers} evenly over the pipeline stages "
            "(or give --decoder-first-pipeline-num-layers or --decoder-last-pipeline-num-layers)"
        )
    return [layers // pp] * pp


def stage_model(model: dict[str, object], counts: list[int], stage: int, tied: bool) -> dict[str, object]:
    """Stage `stage`'s part of one rank's whole per-rank model (layers numbered 0..), its layers
    renumbered within the stage."""
    first, last = sum(counts[:stage]), stage == len(counts) - 1
    mtp = any(key.startswith("mtp.") for key in model)
    own: dict[str, object] = {}
    for key, value in model.items():
        if key.startswith("decoder.layers."):
            layer, rest = key[len("decoder.layers."):].split(".", 1)
            if first <= int(layer) < first + counts[stage]:
                own[f"decoder.layers.{int(layer) - first}.{rest}"] = value
        elif key.startswith(LAST_STAGE):
            if last:
                own[key] = value
        elif stage == 0 or (last and mtp):  # the embedding
            own[key] = value
    if last and tied and len(counts) > 1:
        own["output_layer.weight"] = model[WORD_EMBEDDINGS].clone()
    return own
