"""Megatron-LM's uneven pipeline split: the transformer layers each stage builds, from its keys
(dtgpt/config/pipeline_split_keys.py), and the rules of those keys.

Stages are numbered as dtgpt's looped schedules place them and as Megatron numbers its model
chunks: virtual stage v of pp rank r is stage v * pp + r, and stage i holds the layers after
those of stages 0 .. i-1. The counts equal megatron-core's get_num_layers_to_build for every
(pp rank, virtual stage) (tests/test_pipeline_split.py holds the two side by side):

- decoder_first/last_pipeline_num_layers: that many layers on the first (last) pp rank, shared
  equally by its virtual stages; the ranks between split the rest evenly.
- account_for_embedding/loss_in_pipeline_split: the embedding (the loss) counts as one layer in
  an even split, so stage 0 (the last stage) builds one transformer layer fewer.
- pipeline_model_parallel_layout: the layers of each stage, spelled out.

dtgpt's stages hold the embedding on stage 0 and the final norm, head and multi-token prediction
modules on the last stage, and every stage between holds at least one transformer layer: a layout
placing them otherwise is refused, as are the combinations Megatron refuses (its
TransformerConfig and argument checks). Each refusal is one line naming the key, its value and
the rule; `name` spells a key with its value as the caller's user typed it (a config key, or the
converter's flag).
"""

from __future__ import annotations

import re
from typing import Callable

from dtgpt.config.sections import Config, ConfigError
from dtgpt.config.sections import require as _require

Name = Callable[[str, object], str]
FIRST, LAST = "decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers"
EMBEDDING, LOSS = "account_for_embedding_in_pipeline_split", "account_for_loss_in_pipeline_split"
PER_VIRTUAL, LAYOUT = "num_layers_per_virtual_pipeline_stage", "pipeline_model_parallel_layout"
SPLIT_KEYS = (FIRST, LAST, EMBEDDING, LOSS, PER_VIRTUAL, LAYOUT)
PP, VP = "pipeline_model_parallel_size", "virtual_pipeline_stages_per_rank"
LAYERS = {"E": "the embedding", "t": "a transformer layer", "m": "a multi-token prediction module", "L": "the loss and head"}


def config_name(key: str, value: object) -> str:
    """A [parallel] key as a config error names it: parallel.key=value."""
    text = str(value).lower() if isinstance(value, bool) else repr(value)
    return f"parallel.{key}={text}"


# ---------------------------------------------------------------------------------------------
# The layout string


def parse_layout(text: str, name: Name = config_name) -> list[str]:
    """The layout's stages in stage order, each as its letters: 'E|(tt|)*2,L' -> ['E', 'tt', 'ttL'].
    Megatron's grammar: commas are dropped, then each `(group)*N` (not nested) and then each
    `x*N` is repeated N times, then `|` separates the stages."""
    flat = text.replace(",", "")
    flat = re.sub(r"\(([^)]+)\)\*(\d+)", lambda m: m.group(1) * int(m.group(2)), flat)
    flat = re.sub(r"(.)\*(\d+)", lambda m: m.group(1) * int(m.group(2)), flat)
    unknown = sorted(set(flat) - set(LAYERS) - {"|"})
    if unknown:
        letters = ", ".join(f"{k} ({v})" for k, v in LAYERS.items())
        raise ConfigError(f"{name(LAYOUT, text)}: {unknown[0]!r} is not a layer; a layout holds {letters}, "
                          "| between stages, and (...)*N or x*N to repeat")
    return flat.split("|")


def layout_layers(text: str, pp: int, num_layers: int, mtp_layers: int, name: Name = config_name) -> list[int]:
    """The transformer layers of each stage of a layout (pp * its virtual stages), checked
    against megatron-core's rules and against what dtgpt's stages hold."""
    stages = parse_layout(text, name)
    said, flat = name(LAYOUT, text), "".join(stages)
    _require(
        len(stages) % pp == 0,
        f"{said} has {len(stages)} stages, which must be a multiple of {name(PP, pp)} "
        "(pp ranks x virtual stages)",
    )
    _require(
        flat.count("E") == 1 and stages[0].startswith("E"),
        f"{said}: the embedding E must come once, first, on the first stage (dtgpt's stage 0 holds the embedding)",
    )
    _require(
        flat.count("L") == 1 and stages[-1].endswith("L"),
        f"{said}: the loss L must come once, last, on the last stage (dtgpt's last stage holds the final norm and head)",
    )
    _require(
        flat.count("t") == num_layers,
        f"{said} holds {flat.count('t')} transformer layers (t), but model.num_layers={num_layers}",
    )
    _require(
        flat.count("m") == mtp_layers,
        f"{said} holds {flat.count('m')} multi-token prediction modules (m), but model.mtp_num_layers={mtp_layers or None}",
    )
    _require(
        "m" not in flat or ("t" not in flat[flat.index("m"):] and flat.count("m") == stages[-1].count("m")),
        f"{said}: the multi-token prediction modules m must follow every transformer layer, on the last stage "
        "(dtgpt runs them beside the head)",
    )
    empty = [i for i, stage in enumerate(stages[1:-1], start=1) if "t" not in stage]
    _require(
        not empty,
        f"{said}: stage {empty[0] if empty else ''} holds no transformer layer (only the first stage may be just "
        "the embedding, the last just the head)",
    )
    return [stage.count("t") for stage in stages]


# ---------------------------------------------------------------------------------------------
# decoder_first/last_pipeline_num_layers and account_for_*_in_pipeline_split


def split_layers(num_layers: int, pp: int, vp: int, first: int | None = None, last: int | None = None,
                 embedding: bool = False, loss: bool = False, name: Name = config_name) -> list[int]:  # fmt: skip
    """The transformer layers of each of pp * vp stages under Megatron's uneven-split keys."""
    if first is not None or last is not None:
        return _first_last(num_layers, pp, vp, first, last, embedding or loss, name)
    total = num_layers + embedding + loss
    said = " and ".join(name(k, True) for k, on in ((EMBEDDING, embedding), (LOSS, loss)) if on)
    _require(
        total % pp == 0,
        f"{said}: model.num_layers={num_layers} + {embedding + loss} = {total} must be divisible by "
        f"{name(PP, pp)}",
    )
    _require(
        total // pp % vp == 0,
        f"{said}: the {total // pp} layers of each pp rank (model.num_layers={num_layers} + {embedding + loss}) must be "
        f"divisible by {name(VP, vp)}",
    )
    counts = [total // pp // vp] * (pp * vp)
    counts[0] -= embedding
    counts[-1] -= loss
    return counts


def _first_last(num_layers: int, pp: int, vp: int, first: int | None, last: int | None, accounted: bool, name: Name) -> list[int]:
    given = {key: n for key, n in ((FIRST, first), (LAST, last)) if n is not None}
    said = " and ".join(name(key, n) for key, n in given.items())
    _require(
        not accounted,
        f"{said} cannot be combined with parallel.{EMBEDDING} or parallel.{LOSS} (Megatron's rule): keep one way of splitting",
    )
    _require(pp > 1, f"{said} splits a pipeline, but {name(PP, pp)}: it must be > 1")
    for key, n in given.items():
        _require(n > 0, f"{name(key, n)} must be > 0")
        _require(
            n % vp == 0,
            f"{name(key, n)} must be divisible by {name(VP, vp)} "
            "(the rank's virtual stages hold equal shares)",
        )
    rest, ranks = num_layers - sum(given.values()), pp - len(given)
    they, them = ("it", "it") if len(given) == 1 else ("they", "them")
    _require(
        rest >= 0 and bool(rest) == bool(ranks),
        f"{said}: with {name(PP, pp)} {they} must leave model.num_layers={num_layers} minus {them}, {rest}, "
        + (f"at least 1, split evenly over the other {ranks} pp ranks" if ranks else "0: no other pp rank holds layers"),
    )
    _require(
        ranks == 0 or (rest % ranks == 0 and rest // ranks % vp == 0),
        f"{said}: the {rest} other layers must split evenly over the other {ranks} pp ranks"
        + (f", and each rank's share over its {name(VP, vp)} virtual stages" if vp > 1 else ""),
    )
    per_rank = [rest // ranks if ranks else 0] * pp
    if first is not None:
        per_rank[0] = first
    if last is not None:
        per_rank[-1] = last
    return [per_rank[stage % pp] // vp for stage in range(pp * vp)]


def virtual_stages_of_layers(num_layers: int, pp: int, per_stage: int, embedding: bool = False, loss: bool = False,
                             name: Name = config_name) -> int:  # fmt: skip
    """Virtual stages per rank from num_layers_per_virtual_pipeline_stage (Megatron's arguments)."""
    total = num_layers + embedding + loss
    _require(per_stage >= 1, f"{name(PER_VIRTUAL, per_stage)} must be >= 1")
    _require(
        total % pp == 0 and total // pp % per_stage == 0,
        f"{name(PER_VIRTUAL, per_stage)}: the layers of each pp rank (model.num_layers={num_layers}"
        + (f" + {embedding + loss} accounted" if embedding or loss else "")
        + f", over {name(PP, pp)}) must be a whole multiple of it",
    )
    return total // pp // per_stage


# ---------------------------------------------------------------------------------------------
# On a config


def split_keys_set(cfg: Config) -> list[str]:
    """The uneven-split keys a config sets, in SPLIT_KEYS order."""
    p = cfg.parallel
    return [key for key in SPLIT_KEYS if getattr(p, key) is not None and getattr(p, key) is not False and getattr(p, key) != ""]


def derived_virtual_stages(cfg: Config) -> int | None:
    """The virtual stages per rank a layout or num_layers_per_virtual_pipeline_stage sets; None: neither."""
    p, m = cfg.parallel, cfg.model
    pp = p.pipeline_model_parallel_size
    if p.pipeline_model_parallel_layout:
        stages = len(parse_layout(p.pipeline_model_parallel_layout))
        return stages // pp if stages % pp == 0 else None  # layout_layers names a bad count
    if p.num_layers_per_virtual_pipeline_stage is not None:
        embedding, loss = p.account_for_embedding_in_pipeline_split, p.account_for_loss_in_pipeline_split
        return virtual_stages_of_layers(m.num_layers, pp, p.num_layers_per_virtual_pipeline_stage, embedding, loss)
    return None


def keyed_stage_layers(keys: object, num_layers: int, pp: int, vp: int, mtp_layers: int) -> list[int] | None:
    """The transformer layers of each of pp * vp stages under the uneven-split keys that `keys`
    holds as attributes (a [parallel] section, or Megatron's saved args); None when it sets none
    that makes the split uneven."""
    layout = getattr(keys, LAYOUT, None)
    if layout:
        return layout_layers(str(layout), pp, num_layers, mtp_layers)
    first, last, embedding, loss = (getattr(keys, key, None) for key in (FIRST, LAST, EMBEDDING, LOSS))
    if first is None and last is None and not embedding and not loss:
        return None
    return split_layers(num_layers, pp, vp, first, last, bool(embedding), bool(loss))


def megatron_stage_layers(cfg: Config) -> list[int] | None:
    """The transformer layers of each stage under Megatron's split keys; None when none is set."""
    p, m = cfg.parallel, cfg.model
    return keyed_stage_layers(p, m.num_layers, p.pipeline_model_parallel_size, p.virtual_pipeline_stages_per_rank, m.mtp_depth)


def check_pipeline_split(cfg: Config, v_shaped: tuple[str, ...]) -> None:
    """The rules of the split keys together and with dtgpt's own keys (the counts' own rules are
    checked by computing them)."""
    p = cfg.parallel
    keys = split_keys_set(cfg)
    if not keys:
        return
    said = ", ".join(config_name(key, getattr(p, key)) for key in keys)
    _require(
        not p.pipeline_layers_per_stage,
        f"parallel.pipeline_layers_per_stage={p.pipeline_layers_per_stage} and {said} both choose the pipeline split; keep one",
    )
    _require(
        not (p.pipeline_model_parallel_layout and len(keys) > 1),
        f"{said}: parallel.{LAYOUT} spells out every stage and cannot be combined with the other split keys (Megatron's rule)",
    )
    _require(
        not (p.num_layers_per_virtual_pipeline_stage is not None and (FIRST in keys or LAST in keys)),
        f"{said}: with an uneven first or last pp rank give the virtual stages as parallel.virtual_pipeline_stages_per_rank, "
        f"not parallel.{PER_VIRTUAL} (Megatron's rule)",
    )
    _require(
        p.pipeline_schedule not in v_shaped or keys == [PER_VIRTUAL],  # an even split is the same either way
        f"{said}: Megatron's split numbers the stages looped (pp rank r holds stages r, r + pp, ...), but "
        f"parallel.pipeline_schedule={p.pipeline_schedule!r} places them in a V; give parallel.pipeline_layers_per_stage instead",
    )
    vp = derived_virtual_stages(cfg)
    _require(
        vp is None or vp == p.virtual_pipeline_stages_per_rank,
        f"{said} gives {vp} virtual stages per pp rank, but parallel.virtual_pipeline_stages_per_rank="
        f"{p.virtual_pipeline_stages_per_rank}; set it to {vp} or leave it unset",
    )
    megatron_stage_layers(cfg)


def apply_virtual_stages(cfg: Config, levels: dict[str, int]) -> None:
    """When the config is read: a layout or num_layers_per_virtual_pipeline_stage sets the
    virtual stages per rank (Megatron derives them the same way) and, with more than one and no
    schedule chosen, Megatron's schedule for them, Interleaved1F1B. A different
    virtual_pipeline_stages_per_rank given beside them is refused by check_pipeline_split."""
    try:
        vp = derived_virtual_stages(cfg)
    except ConfigError:  # validation names it (or a caller that does not validate has its reasons)
        return
    if vp is None or "parallel.virtual_pipeline_stages_per_rank" in levels:
        return
    cfg.parallel.virtual_pipeline_stages_per_rank = vp
    if vp > 1 and "parallel.pipeline_schedule" not in levels:
        cfg.parallel.pipeline_schedule = "Interleaved1F1B"
