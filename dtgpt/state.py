"""The train state: one Stateful bundle of everything a checkpoint restores.

    model        this rank's model parts            optimizer    AdamW per part
    lr_schedule  where the LR schedule stands       scaler       the fp16 loss scale
    progress     iteration, consumed train and validation samples, skipped and NaN iterations
    health       whether the run still trains: what the checkpointer asks before pruning (never saved)
    timers       the phase timers train_step reads (logging.timers_log_level; never saved)

`state_dict()` is the dict DCP saves: its keys name the whole model's parameters, never the
mesh (layout in dtgpt/checkpoint/stored.py), so any mesh reads any other mesh's checkpoint.
train.py and the library API (dtgpt.api) both build this object and save it, so a checkpoint
from either resumes the same way. The checkpoint checks of a stored layout live in dtgpt.checkpoint.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Callable, Iterable, NamedTuple

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.tensor import DTensor

from dtgpt.config import Config
from dtgpt.loss_scaler import LossScaler, build_loss_scaler
from dtgpt.model import OUTPUT_WEIGHT, WORD_EMBEDDING
from dtgpt.optim import LRSchedule, PartOptimizers
from dtgpt.parallel import ModelParts
from dtgpt.parallel.rng import rng_coordinate
from dtgpt.timers import Timers

FLAT_OPTIM = StateDictOptions(flatten_optimizer_state_dict=True)


@dataclass
class Progress(Stateful):
    """How far training has come (saved as the `train_state` section)."""

    iteration: int = 0
    consumed_samples: int = 0
    skipped_iters: int = 0
    nan_iters: int = 0
    consumed_valid_samples: int = 0
    """Validation samples read by the evaluations so far (Megatron's consumed_valid_samples):
    a resumed run continues the validation stream from here."""

    def state_dict(self) -> dict:
        return dataclasses.asdict(self)

    def load_state_dict(self, state: dict) -> None:
        # A key missing from an older checkpoint (consumed_valid_samples) keeps its default, 0.
        for f in dataclasses.fields(self):
            setattr(self, f.name, int(state.get(f.name, f.default)))


class SaveVerdict(NamedTuple):
    """Whether a checkpoint counts toward checkpoint.keep_last (`why_not` None) and may prune older ones."""

    weights_finite: bool
    why_not: str | None

    @property
    def counts(self) -> bool:
        return self.why_not is None


@dataclass
class RunHealth:
    """Whether the run was still training when it saves, as train_step records it (this
    process's view, never saved). A run gone bad (a huge learning rate: finite but exploding
    weights) may save finite weights whose loss is NaN; such a save must not prune the good
    checkpoints before it. Every rank records the same (the loss is reduced over the world)."""

    stepped_since_save: bool = True
    """An iteration took its optimizer step (finite loss and gradients) since the last save; a
    fresh or loaded state counts as one."""
    last_loss_finite: bool = True

    def record(self, skipped: bool, loss_finite: bool) -> None:
        self.stepped_since_save |= not skipped
        self.last_loss_finite = loss_finite

    def verdict(self, weights_finite: bool) -> SaveVerdict:
        """The verdict on a save of the current weights (the checkpointer asks once per save,
        which starts the next interval)."""
        why = None
        if not weights_finite:
            why = "saved non-finite weights"
        elif not self.last_loss_finite:
            why = "follows a non-finite loss"
        elif not self.stepped_since_save:
            why = "follows only skipped iterations"
        self.stepped_since_save = False
        return SaveVerdict(weights_finite, why)


_TEXT_BYTES = 16  # fixed, so a load request has the stored shape whatever the text


def scalars_to_tensors(state: dict) -> dict[str, torch.Tensor]:
    """A Stateful's dict of ints, floats and short strings as tensors DCP stores without pickling."""
    out = {}
    for key, value in state.items():
        if isinstance(value, str):
            data = value.encode()
            if len(data) > _TEXT_BYTES:
                raise ValueError(f"{key}={value!r} is longer than {_TEXT_BYTES} bytes")
            out[key] = torch.tensor(list(data.ljust(_TEXT_BYTES, b"\0")), dtype=torch.uint8)
        elif isinstance(value, (bool, int)):
            out[key] = torch.tensor(int(value), dtype=torch.int64)
        else:
            out[key] = torch.tensor(float(value), dtype=torch.float64)
    return out


def tensors_to_scalars(state: dict[str, torch.Tensor]) -> dict:
    """The inverse of scalars_to_tensors."""
    out = {}
    for key, value in state.items():
        if value.dtype == torch.uint8:
            out[key] = bytes(value.tolist()).rstrip(b"\0").decode(errors="replace")
        else:
            out[key] = value.item()
    return out


def tied_source(key: str) -> str | None:
    """For the last stage's copy of the tied weight (or its optimizer state): the key it loads from."""
    if key == OUTPUT_WEIGHT:
        return WORD_EMBEDDING
    prefix = f"state.{OUTPUT_WEIGHT}."
    if key.startswith(prefix):
        return f"state.{WORD_EMBEDDING}." + key[len(prefix):]
    return None


def _is_state_key(key: str) -> bool:
    return key.startswith("state.")


def rng_state(model: ModelParts) -> dict[str, torch.Tensor]:
    """This rank's generator states under its (pp, tp) coordinate: dp peers hold equal states
    (Megatron seeds them alike), so DCP stores each coordinate once."""
    prefix = rng_coordinate(model.dims)
    state = {f"{prefix}.cpu": torch.get_rng_state()}
    if model.device.type == "cuda":
        state[f"{prefix}.cuda"] = torch.cuda.get_rng_state(model.device)
    if model.rng is not None:
        state[f"{prefix}.model_parallel"] = model.rng.state
    return state


def set_rng_state(states: dict[str, torch.Tensor], model: ModelParts) -> None:
    prefix = rng_coordinate(model.dims)
    torch.set_rng_state(states[f"{prefix}.cpu"])
    if model.device.type == "cuda" and f"{prefix}.cuda" in states:
        torch.cuda.set_rng_state(states[f"{prefix}.cuda"], model.device)
    if model.rng is not None:
        model.rng.state = states[f"{prefix}.model_parallel"].clone()


@torch.no_grad()
def _copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    if isinstance(dst, DTensor) and isinstance(src, DTensor):
        if dst.placements != src.placements or dst.to_local().shape != src.to_local().shape:
            raise RuntimeError(f"tied copies are laid out differently: {dst.placements} vs {src.placements}")
        dst, src = dst.to_local(), src.to_local()
    if dst.data_ptr() != src.data_ptr():
        dst.copy_(src)


@dataclass(eq=False)
class TrainState(Stateful):
    """Everything a resumed run needs, owned in one place (see the module doc)."""

    model: ModelParts
    optimizer: PartOptimizers
    lr_schedule: LRSchedule | None
    scaler: LossScaler | None
    progress: Progress = field(default_factory=Progress)
    health: RunHealth = field(default_factory=RunHealth)
    timers: Timers = field(default_factory=lambda: Timers(0, torch.device("cpu")))

    STATEFUL = {"train_state": "progress", "lr_schedule": "lr_schedule", "loss_scaler": "scaler"}
    """Sections saved through the objects' own state_dict (checkpoint key -> attribute)."""

    @property
    def resumable(self) -> bool:
        """False for a bare model and optimizer of the library API: without a schedule and a
        scaler of ours, only weights, optimizer moments and RNG are saved or loaded."""
        return self.lr_schedule is not None and self.scaler is not None

    @property
    def tied(self) -> bool:
        return self.model.parts[0].tied

    def _model_dicts(self) -> list[dict]:
        return [get_model_state_dict(part) for part in self.model.parts]

    def _optimizer_dicts(self) -> list[dict]:
        """Flattened optimizer state per part. Careful: on an optimizer with no state yet this runs
        a zero-lr step to create it (torch's way), so save it only once a step happened."""
        pairs = zip(self.model.parts, self.optimizer.optimizers)
        return [get_optimizer_state_dict(part, opt, options=FLAT_OPTIM) for part, opt in pairs]

    def _merge(self, dicts: list[dict], keep: Callable[[str], bool], into_copy: bool) -> dict:
        """One dict over all parts (keys are disjoint across stages). The tied copy is left out
        (it equals the embedding, stored once), except that a rank holding only the copy reads
        the stored embedding straight into it (`into_copy`, when loading)."""
        merged, copies = {}, []
        for d in dicts:
            for key, value in d.items():
                if not keep(key):
                    continue
                source = tied_source(key) if self.tied else None
                if source is None:
                    merged[key] = value
                elif into_copy:
                    copies.append((source, value))
        for source, value in copies:
            merged.setdefault(source, value)
        return merged

    def has_optimizer_state(self) -> bool:
        # Steps are skipped on every rank together, so either all optimizers have state or none.
        return all(opt.state for opt in self.optimizer.optimizers)

    def state_dict(self, optimizer: bool = True, rng: bool = True) -> dict:
        """The nested dict handed to dcp.save / dcp.async_save (values alias live tensors);
        without `optimizer`, no AdamW state, LR schedule or loss scale (Megatron's --no-save-optim);
        without `rng`, no generator states (--no-save-rng)."""
        state = {"model": self._merge(self._model_dicts(), lambda k: True, into_copy=False)}
        for section, attr in self.STATEFUL.items() if self.resumable else ():
            if optimizer or section == "train_state":
                state[section] = scalars_to_tensors(getattr(self, attr).state_dict())
        if rng:
            state["rng"] = rng_state(self.model)
        if optimizer and self.has_optimizer_state():
            state["optimizer"] = self._merge(self._optimizer_dicts(), _is_state_key, into_copy=False)
        return state

    def load_request(self, optimizer: bool, sections: Iterable[str] = ()) -> dict:
        """A dict in state_dict()'s layout whose tensors alias the live state, for dcp.load to
        fill in place (the weights, the AdamW state if `optimizer`, and these STATEFUL
        `sections`); hand it to load_state_dict() afterwards."""
        request = {"model": self._merge(self._model_dicts(), lambda k: True, into_copy=True)}
        if optimizer:
            request["optimizer"] = self._merge(self._optimizer_dicts(), _is_state_key, into_copy=True)
        for section in sections:
            request[section] = scalars_to_tensors(getattr(self, self.STATEFUL[section]).state_dict())
        return request

    def load_state_dict(self, state: dict) -> None:
        """Take the sections present in `state` (the RNG is the caller's: see Checkpointer.restore_rng)."""
        for part, live in zip(self.model.parts, self._model_dicts()):
            self._fill(live, state["model"])
            set_model_state_dict(part, live)
        if "optimizer" in state:
            for part, opt, live in zip(self.model.parts, self.optimizer.optimizers, self._optimizer_dicts()):
                self._fill(live, state["optimizer"], keep=_is_state_key)
                set_optimizer_state_dict(part, opt, live, options=FLAT_OPTIM)
        for section, attr in self.STATEFUL.items():
            if section in state:
                getattr(self, attr).load_state_dict(tensors_to_scalars(state[section]))

    def _fill(self, live: dict, saved: dict, keep: Callable[[str], bool] = lambda k: True) -> None:
        """Copy saved values into a part's live dict (a no-op where they already alias it)."""
        for key, value in live.items():
            if not keep(key):
                continue
            source = saved[(tied_source(key) if self.tied else None) or key]
            if isinstance(value, torch.Tensor):
                _copy(value, source)
            else:
                live[key] = source

    def record(self, skipped: bool, nan: bool, global_batch_size: int, loss_finite: bool = True) -> None:
        """Advance past one iteration: samples are consumed even when it was skipped (as in
        Megatron), the LR schedule moves only when the optimizer stepped."""
        p = self.progress
        p.iteration += 1
        p.consumed_samples += global_batch_size
        p.skipped_iters += skipped
        p.nan_iters += nan
        self.health.record(skipped, loss_finite and not nan)
        if not skipped:
            self.lr_schedule.step(global_batch_size)

    def pass_over(self, global_batch_size: int) -> None:
        """Advance past an iteration left out (training.iterations_to_skip, as Megatron leaves it
        out): its samples are consumed; no update, no LR schedule step, no skipped-iteration count."""
        self.progress.iteration += 1
        self.progress.consumed_samples += global_batch_size

    @torch.no_grad()
    def weights_finite(self, group: dist.ProcessGroup | None = None) -> bool:
        """Whether every rank's weights are finite (a collective: every rank of `group` calls it)."""
        bad = torch.zeros((), device=self.model.device)
        for p in self.model.parameters():
            bad += (~torch.isfinite((p.to_local() if isinstance(p, DTensor) else p).detach())).any()
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(bad, op=dist.ReduceOp.MAX, group=group)
        return not bool(bad)


def build_train_state(cfg: Config, model: ModelParts) -> TrainState:
    """AdamW per part, LR schedule, loss scaler and phase timers of cfg around `model`, at iteration 0."""
    optimizer = PartOptimizers(model.parts, cfg.optimizer, fused=model.device.type == "cuda")
    timers = Timers(cfg.logging.timers_log_level, model.device)
    return TrainState(model, optimizer, LRSchedule(cfg), build_loss_scaler(cfg), timers=timers)
