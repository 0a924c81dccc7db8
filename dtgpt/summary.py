"""The few lines rank 0 prints before training: what data, what mesh, what model, and where the
run leaves its checkpoints and logs (or that it leaves none), so a run shows what it will do."""

from __future__ import annotations

from typing import Sequence

from dtgpt.config import Config
from dtgpt.config.split import no_test_note
from dtgpt.parallel import ParallelDims
from dtgpt.parallel.pipeline import stage_layer_counts


def data_source(cfg: Config, tokenizer) -> str:
    d = cfg.data
    if d.mock_data:
        source = "mock data"
    elif d.builtin_corpus:
        source = f"built-in corpus {d.builtin_corpus!r}"
    elif d.data_path:
        source = f"data_path {' '.join(d.data_path)} (split {d.split})"
    else:
        source = f"train/valid/test paths {d.train_data_path} / {d.valid_data_path} / {d.test_data_path}"
    kind = getattr(tokenizer, "kind", type(tokenizer).__name__)  # the SentencePiece class serves three types
    return f"{source}, {kind} ({tokenizer.vocab_size} ids), order {d.order!r}"


def _samples(dataset) -> str:
    return "none" if dataset is None else f"{len(dataset):,}"


def split_sizes(datasets: Sequence) -> str:
    """Samples per split, and the documents of each split's first corpus where there is one."""
    parts = []
    for name, dataset in zip(("train", "valid", "test"), datasets):
        text = f"{name} {_samples(dataset)}"
        documents = getattr(dataset, "description", {}).get("documents")
        if documents:
            text += f" ({documents[1] - documents[0]:,} documents)"
        parts.append(text)
    return ", ".join(parts)


def outputs(cfg: Config) -> str:
    c, log = cfg.checkpoint, cfg.logging
    if c.save:
        when = f"every {c.save_interval} iterations and at the end" if c.save_interval else "at the end"
        checkpoints = f"checkpoints {c.save} ({when})"
    else:
        checkpoints = "no checkpoints (checkpoint.save unset)"
    tensorboard = f"TensorBoard {log.tensorboard_dir}" if log.tensorboard_dir else "no TensorBoard"
    metrics = f"metrics {log.metrics_file}" if log.metrics_file else "no metrics file"
    return f"{checkpoints}; {tensorboard}; {metrics}"


def expert_mesh(cfg: Config, dims: ParallelDims) -> str:
    """An MoE run's experts over the mesh: ep ranks, each holding num_experts / ep of them."""
    experts = cfg.model.num_experts
    return f"; {experts} experts over ep={dims.ep} ({experts // dims.ep} per rank)" if experts else ""


def startup_summary(cfg: Config, dims: ParallelDims, n_params: int, vocab_size: int, tokenizer, datasets: Sequence) -> str:
    schedule = f", schedule {cfg.parallel.pipeline_schedule}" if dims.pp > 1 else ""
    counts = stage_layer_counts(cfg) if dims.pp > 1 else []
    if len(set(counts)) > 1:  # an uneven split, shown as the stages build it
        schedule += f", blocks per stage {' '.join(map(str, counts))}"
    note = no_test_note(cfg)
    return "\n".join([
        f"> data: {data_source(cfg, tokenizer)}",
        f"> samples (seq_length {cfg.model.seq_length}): {split_sizes(datasets)}",
        f"> mesh: pp={dims.pp} dp_replicate={dims.dp_replicate} dp_shard={dims.dp_shard} cp={dims.cp} tp={dims.tp} "
        f"({dims.world_size} rank{'s' if dims.world_size > 1 else ''}){schedule}{expert_mesh(cfg, dims)}",
        f"> model: {n_params:,} parameters on rank 0, padded vocabulary {vocab_size}",
        f"> output: {outputs(cfg)}",
        *([note] if note else []),
    ])  # fmt: skip
