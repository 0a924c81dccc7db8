"""Megatron-LM's checkpoint formats: finding a Megatron iteration directory, telling its format,
unpickling its files, and reading where its training stood.

Two formats, both under Megatron's `iter_XXXXXXX/` + `latest_checkpointed_iteration.txt`:

    torch_dist   iter_N/metadata.json ({"sharded_backend": "torch_dist"}), common.pt (megatron-core
                 >= 0.19: the bytes item common_state/shard_0_1 instead), .metadata and
                 __<rank>_<n>.distcp: DCP underneath, mesh-free keys, the layers stacked on a
                 leading dimension (decoder.layers.self_attention.linear_qkv.weight is (L, 3h, h))
    per-rank     iter_N/mp_rank_TT[_PPP]/model_optim_rng.pt: one torch.save dict per model-parallel
                 rank, per-layer keys numbered within the stage, split by TP rank
"""

from __future__ import annotations

import argparse
import io
import json
import re
from pathlib import Path

import torch

from dtgpt.checkpoint import layout
from dtgpt.checkpoint.layout import CheckpointError
from dtgpt.checkpoint.safe import load_problem

BACKEND_FILE = "metadata.json"
COMMON_FILE = "common.pt"
COMMON_ITEM = "common_state/shard_0_1"
"""Where megatron-core 0.19 keeps what common.pt held: one bytes item of the DCP checkpoint, a
torch.save of [that dict], read from its bytes by load_pickle (DCP's own reader would unpickle it)."""
PER_RANK_FILE = "model_optim_rng.pt"
_PER_RANK_DIR = re.compile(r"^mp_rank_(\d{2})(?:_(\d{3}))?(?:_(\d{3}))?$")

SAFE_GLOBALS = [argparse.Namespace]
"""What Megatron's pickles hold besides tensors and plain containers (its `args`)."""


def is_torch_dist(directory: Path) -> bool:
    try:
        return json.loads((directory / BACKEND_FILE).read_text()).get("sharded_backend") == "torch_dist"
    except (OSError, ValueError, AttributeError):
        return False


def per_rank_dirs(directory: Path, expert_parallel: bool = False) -> dict[tuple[int, int, int], Path]:
    """(tp_rank, pp_rank, ep_rank) -> mp_rank_TT[_PPP][_EEE] directory holding model_optim_rng.pt.

    Megatron-LM adds _PPP only with pp > 1 and _EEE only with ep > 1, so mp_rank_TT_NNN is a pp
    rank, or with `expert_parallel` (its args' expert_model_parallel_size > 1 and pp 1) an ep rank."""
    found = {}
    for sub in directory.iterdir() if directory.is_dir() else ():
        match = _PER_RANK_DIR.match(sub.name)
        if match and (sub / PER_RANK_FILE).is_file():
            tp, first, second = (int(g) if g else None for g in match.groups())
            if second is not None:
                found[(tp, first, second)] = sub
            elif expert_parallel:
                found[(tp, 0, first or 0)] = sub
            else:
                found[(tp, first or 0, 0)] = sub
    return found


def is_megatron_dir(directory: Path) -> bool:
    return is_torch_dist(directory) or bool(per_rank_dirs(directory))


def find(root: str | Path, iteration: int = 0) -> Path | None:
    """The Megatron iteration directory `root` names (itself, its pointer's, or `iteration`),
    or None when `root` holds no Megatron checkpoint (then it is dtgpt's, or nothing). A root
    of Megatron checkpoints whose pointer leads to none of them is one error saying why."""
    root = Path(root)
    if is_megatron_dir(root):
        return root
    pointed = iteration or layout.read_pointer(root)
    directory = None if pointed is None else layout.iteration_dir(root, pointed)
    if directory is not None and (is_megatron_dir(directory) or iteration or directory.is_dir()):
        return directory if is_megatron_dir(directory) else None  # else dtgpt's own checks say what is wrong
    found = [p for p in sorted(root.iterdir()) if p.name.startswith(("iter_", "release")) and is_megatron_dir(p)] if root.is_dir() else []
    if not found:
        return None
    missing = "" if directory is None else f", but there is no {directory.name}"
    raise CheckpointError(
        f"{root} holds Megatron checkpoints ({', '.join(p.name for p in found)}) and {layout.pointer_state(root)}{missing}: "
        f"name the directory to load itself, e.g. {found[-1]}"
    )


def is_zip(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == b"PK\x03\x04"


def load_pickle(path: Path, span: tuple[int, int] | None = None, mmap: bool = False):
    """A Megatron pickle, unpickled with only tensors, containers and argparse.Namespace allowed:
    the file `path`, or the `span` (offset, length) of its bytes that one DCP item takes. `mmap`:
    the tensors map the file, and only the bytes a caller touches are read."""
    try:
        source = path
        if span is not None:
            with open(path, "rb") as f:
                f.seek(span[0])
                source = io.BytesIO(f.read(span[1]))
        with torch.serialization.safe_globals(SAFE_GLOBALS):
            # torch maps only its zip archives: a legacy (pre-zip) torch.save file is read whole
            return torch.load(source, map_location="cpu", weights_only=True, mmap=mmap and span is None and is_zip(path))
    except Exception as e:  # noqa: BLE001 - any unpickling failure reads the same to the user
        raise CheckpointError(f"{path}: cannot be read as a Megatron checkpoint file: {load_problem(path, e)}") from None


# -- progress ----------------------------------------------------------------------------------


def progress_of(common: dict) -> dict:
    """What a Megatron-LM trainer stores about where it stands: iteration, consumed train and
    validation samples, the LR schedule's sample count and the loss scale, each only when present."""
    out = {}
    if "iteration" in common:
        out["iteration"] = _count(common["iteration"], "iteration")
    args = common.get("args")
    for ours, megatron_name in (("consumed_samples", "consumed_train_samples"), ("consumed_valid_samples", "consumed_valid_samples")):
        if getattr(args, megatron_name, None) is not None:
            out[ours] = _count(getattr(args, megatron_name), f"args.{megatron_name}")
    scheduler = common.get("opt_param_scheduler") or {}
    if "num_steps" in scheduler:
        out["lr_num_samples"] = _count(scheduler["num_steps"], "opt_param_scheduler.num_steps")
    scaler = grad_scaler(common.get("optimizer"))
    if scaler:
        out["loss_scale"] = scaler
    return out


def _count(value, name: str) -> int:
    """A count Megatron stored: a whole number >= 0, or one line naming the entry of common.pt."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0 or value != int(value):
        raise CheckpointError(f"Megatron's {COMMON_FILE} holds {name}={value!r}: not a count (a whole number >= 0)")
    return int(value)


def grad_scaler(optimizer) -> dict | None:
    """Megatron's grad_scaler dict ({scale, growth_tracker, hysteresis_tracker}) where its
    optimizer state keeps it: at the top, or one level down (chained optimizers: a list or dict)."""
    if isinstance(optimizer, dict) and isinstance(optimizer.get("grad_scaler"), dict):
        return optimizer["grad_scaler"]
    inner = optimizer.values() if isinstance(optimizer, dict) else optimizer if isinstance(optimizer, list) else ()
    for value in inner:
        if isinstance(value, dict) and isinstance(value.get("grad_scaler"), dict):
            return value["grad_scaler"]
    return None
