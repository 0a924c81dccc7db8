"""A dtgpt checkpoint as Megatron-LM's per-rank format: mp_rank_TT[_PPP][_EEE]/model_optim_rng.pt.

What Megatron-LM's legacy save writes at tp x pp x ep: each file holds its pipeline stage's layers,
numbered within the stage (stages.py: the embedding on the first stage; the final norm, the output
layer and the multi-token prediction blocks, `mtp.layers.<k>.`, on the last), under the local spec's names, its TP split
of each tensor (column-parallel rows, row-parallel columns; SwiGLU's linear_fc1 as [its gate rows;
its fc1 rows]; per_rank.TP_DIM), and of each MoE block's routed
experts only its ep rank's, numbered from 0 as `mlp.experts.local_experts.<K>.` (ep rank r holds
global experts r * E / ep ...). Every linear layer has its `_extra_state` (None for the local
spec), which megatron-core's strict load_state_dict asks for, the output layer's too. An Adam run's
state goes into each file's "optimizer" as Megatron's non-distributed optimizers save it
(write_per_rank_optim.py: run Megatron without --use-distributed-optimizer to load it), each
file's model then in megatron-core's module order, by which the state is indexed; an SGD run's
momentum, and the state of a model outside the dense GPT whose order dtgpt knows (MoE: Megatron
chains an optimizer for its experts; multi-latent attention; MTP blocks), are left out.
Unlike the torch_dist conversion this holds the whole model in memory (the format is per
rank, each file a slice of every tensor).
"""

from __future__ import annotations

from pathlib import Path

import torch

from dtgpt.checkpoint import export, layout
from dtgpt.checkpoint.layout import CheckpointError
from dtgpt.checkpoint.megatron.formats import PER_RANK_FILE
from dtgpt.checkpoint.megatron.keys import (
    EXPERT_KEY, LOCAL_NORM_NAMES, VOCAB_KEYS, half_of, is_buffer, megatron_name, resize_vocab, stores_per_layer,
)  # fmt: skip
from dtgpt.checkpoint.megatron.per_rank import BLOCK, LOCAL_EXPERTS, tp_dim
from dtgpt.checkpoint.megatron.stages import stage_counts, stage_model
from dtgpt.checkpoint.megatron.write import megatron_optimizer_common, stored_adam_step, trainer_common
from dtgpt.checkpoint.megatron.write_per_rank_optim import in_megatron_order, per_rank_optimizer
from dtgpt.checkpoint.stored import stored_optimizer
from dtgpt.config import Config, padded_vocab_size


def _full_megatron_tensors(state: dict[str, torch.Tensor], cfg: Config, rows: int) -> dict[tuple[str, int | None], torch.Tensor]:
    """(torch_dist key, layer or None) -> the full tensor of that layer, in Megatron's layout
    (the decoder layers apart where torch_dist keeps them apart, see keys.stores_per_layer), from
    dtgpt's tensors by name (the weights, or one Adam slot of each)."""
    names = [n for n in state if not (n == "output.weight" and not cfg.model.untie_embeddings_and_output_weights)]
    mla, apart = cfg.model.multi_latent_attention, stores_per_layer(cfg.model)
    out: dict[tuple[str, int | None], list[torch.Tensor]] = {}
    for name in sorted(names, key=lambda n: half_of(n, names) or 0):  # a gate before its fc1
        value = resize_vocab(state[name], rows) if name in VOCAB_KEYS else state[name]
        out.setdefault(megatron_name(name, mla, apart), []).append(value)
    return {key: torch.cat(parts) if len(parts) > 1 else parts[0] for key, parts in out.items()}


def _adam_slots(src: Path, weights: dict, cfg: Config, rows: int) -> dict[str, dict]:
    """{"exp_avg", "exp_avg_sq"} -> the full Megatron tensors of that AdamW slot (as the weights')."""
    optimizer = export.read_sections(src, ("optimizer",))["optimizer"]
    tied = not cfg.model.untie_embeddings_and_output_weights
    names = [n for n in weights if not is_buffer(n) and not (tied and n == "output.weight")]  # a tied head's state is the embedding's
    return {slot: _full_megatron_tensors({name: optimizer[f"state.{name}.{slot}"] for name in names}, cfg, rows) for slot in ("exp_avg", "exp_avg_sq")}


def _tp_part(key: str, value: torch.Tensor, tp: int, rank: int, swiglu: bool) -> torch.Tensor:
    """Rank `rank`'s part of a full tensor under Megatron's TP split (per_rank.TP_DIM: the
    local layer spec's, which megatron-core's strict load of these files checks)."""
    dim = tp_dim(key)
    if dim is None or tp == 1:
        return value.clone()
    if value.shape[dim] % (2 * tp if swiglu and ".linear_fc1." in key else tp):
        raise CheckpointError(f"--tp {tp} does not split {key} ({value.shape[dim]} along dim {dim}) evenly: Megatron's tp ranks hold equal parts")
    if swiglu and ".linear_fc1." in key:  # [gate; fc1]: each rank holds [its gate rows; its fc1 rows]
        gate, fc1 = value.chunk(2, dim=0)
        return torch.cat([gate.chunk(tp, dim=0)[rank], fc1.chunk(tp, dim=0)[rank]]).clone()
    return value.chunk(tp, dim=dim)[rank].clone()


def _rank_model(full: dict, cfg: Config, tp: int, tp_rank: int, ep: int, ep_rank: int) -> dict[str, object]:
    swiglu = cfg.model.swiglu
    model: dict[str, object] = {}
    for (key, layer), value in full.items():
        if layer is not None:  # one layer of a stacked key
            key = f"decoder.layers.{layer}.{key.removeprefix('decoder.layers.')}"
        match = BLOCK.match(key)
        if match is None:  # outside the blocks
            model[key] = _tp_part(key, value, tp, tp_rank, swiglu)
            continue
        prefix, rest = match.group(0), key[match.end():]
        if rest.startswith(EXPERT_KEY):  # (E, ...): this ep rank's experts, numbered locally
            local = value.shape[0] // ep
            suffix = rest[len(EXPERT_KEY):]
            for k in range(local):
                name = f"{prefix}{LOCAL_EXPERTS}{k}.{suffix}"
                model[name] = _tp_part(name, value[ep_rank * local + k], tp, tp_rank, swiglu)
        else:
            name = prefix + LOCAL_NORM_NAMES.get(rest, rest)
            model[name] = _tp_part(name, value, tp, tp_rank, swiglu)
    for name in [n for n in model if n.endswith(".weight") and (".linear_" in n or n.endswith(".eh_proj.weight"))]:
        model[name.removesuffix(".weight") + "._extra_state"] = None
    model["output_layer._extra_state"] = None  # the head module exists, weight or not (tied at pp 1), and saves its own
    return model


def to_megatron_per_rank(src: Path, cfg: Config, out_root: str | Path, tp: int = 1, ep: int = 1, pp: int = 1,
                         first_stage_layers: int | None = None, last_stage_layers: int | None = None) -> Path:
    """Write dtgpt checkpoint `src` as Megatron-LM's per-rank iteration at tensor parallel size
    `tp`, pipeline parallel size `pp` (its layers split evenly, or with `first_stage_layers` on the
    first stage and/or `last_stage_layers` on the last and the rest evenly, Megatron's
    decoder_first/last_pipeline_num_layers) and expert
    parallel size `ep`, its vocabulary padded as Megatron pads at `tp`. Returns the iteration directory."""
    for key, count in (("model.num_attention_heads", cfg.model.num_attention_heads), ("model.num_query_groups", cfg.model.query_groups)):
        if count % tp:  # an even split of the rows could still cut a head in two
            raise CheckpointError(f"--tp {tp} must divide {key}={count}: Megatron's tp ranks hold whole heads and key/value groups")
    experts = cfg.model.num_experts or 0
    if ep < 1 or (ep > 1 and experts % ep):
        what = f"model.num_experts={experts}" if experts else "a model without experts (model.num_experts unset)"
        raise CheckpointError(f"--ep {ep}: the expert-parallel ranks must split {what} evenly")
    counts = stage_counts(cfg.model.num_layers, pp, first_stage_layers, last_stage_layers)
    marker = layout.read_marker(src) if (src / layout.MARKER).is_file() else {}
    iteration = int(marker.get("iteration", 0))
    export.refuse_run_root(out_root)  # never replace a save or move a run's pointer
    rows = padded_vocab_size(export.model_vocab_size(src), cfg.model.make_vocab_size_divisible_by * tp)
    weights = export.load_model(src, cfg).state_dict()
    full = _full_megatron_tensors(weights, cfg, rows)
    metadata = layout.read_metadata(src)
    stored = metadata.state_dict_metadata
    progress = export.read_sections(src, ("train_state", "lr_schedule")) if any(k.startswith("train_state.") for k in stored) else {}
    common = trainer_common(iteration, progress, cfg, tp, rows)
    vars(common["args"]).update(expert_model_parallel_size=ep, expert_tensor_parallel_size=tp, pipeline_model_parallel_size=pp)
    vars(common["args"]).update(decoder_first_pipeline_num_layers=first_stage_layers, decoder_last_pipeline_num_layers=last_stage_layers)
    tied = not cfg.model.untie_embeddings_and_output_weights
    directory = layout.iteration_dir(out_root, iteration)
    adam = stored_optimizer(metadata) == "adam" and not experts
    slots = _adam_slots(src, weights, cfg, rows) if adam else {}
    groups = megatron_optimizer_common(cfg.optimizer, stored_adam_step(src, metadata))["optimizer"]["optimizer"]["param_groups"] if adam else []
    first = _rank_model(full, cfg, tp, 0, ep, 0)  # every rank's split has its shapes: an uneven one fails before a file is written
    for tp_rank in range(tp):
        for ep_rank in range(ep):
            model = first if tp_rank == ep_rank == 0 else _rank_model(full, cfg, tp, tp_rank, ep, ep_rank)
            slot_models = {slot: _rank_model(value, cfg, tp, tp_rank, ep, ep_rank) for slot, value in slots.items()}
            for pp_rank in range(pp):
                name = f"mp_rank_{tp_rank:02d}" + (f"_{pp_rank:03d}" if pp > 1 else "") + (f"_{ep_rank:03d}" if ep > 1 else "")
                (directory / name).mkdir(parents=True, exist_ok=True)
                stage = (lambda m: stage_model(m, counts, pp_rank, tied)) if pp > 1 else (lambda m: m)  # noqa: E731
                own = stage(model)
                ordered = in_megatron_order(own) if adam else None
                saved = {"model": ordered or own, **common}
                if ordered:
                    saved["optimizer"] = per_rank_optimizer(ordered, {slot: stage(m) for slot, m in slot_models.items()}, cfg, groups)
                torch.save(saved, directory / name / PER_RANK_FILE)
    layout.write_pointer(out_root, iteration)
    return directory
