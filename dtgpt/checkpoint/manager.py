"""Checkpointer: when to save, saving (sync or async) with DCP, and loading on construction.

A save writes a staging directory with DCP, then (rank 0, once every rank's data and `.metadata`
exist) the `complete` marker with each file's checksum (each rank's writer checksummed its own
files: integrity.py), renames it to `iter_N` (swapping in a
re-save), moves the pointer and prunes (only after a save that counts: dtgpt.state.RunHealth):
no `iter_N` is ever partial and an old one is never deleted first. Rank 0 locks the save
directory for the run (lock.py), and a run writes into another run's directory only when it
loaded from it or checkpoint.overwrite.
Loads read data only (safe.py), each rank checking the items it reads against the marker (one
found changed makes every rank fall back to an older checkpoint). An async save stages a copy, returns to training and completes
when its future is found done (polled every iteration); at most one is in flight. Directory
layout: layout.py; what is saved: stored.py and dtgpt/state.py.
"""

from __future__ import annotations

import shutil
import time
import uuid
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.staging import DefaultStager

from dtgpt.checkpoint import layout, megatron
from dtgpt.checkpoint.architecture import saved_difference
from dtgpt.checkpoint.integrity import ChecksummingWriter, CorruptCheckpoint, read_problem
from dtgpt.checkpoint.mesh import mesh_info, mesh_text, same_rng_coordinates
from dtgpt.checkpoint.resume_controls import fit_to_checkpoint, fresh_note, load_plan, resume_root, resume_schedule, start_from_scratch
from dtgpt.checkpoint.layout import CheckpointError
from dtgpt.checkpoint.rejoin import Rejoining
from dtgpt.checkpoint.retain import retire_previous
from dtgpt.checkpoint.rank_zero import RankZeroCalls
from dtgpt.checkpoint.lock import SaveDirLock, check_save_dir, claim_save_dir
from dtgpt.checkpoint.safe import SafeReader, trust_warning
from dtgpt.checkpoint.staging import stager_for_next_save
from dtgpt.checkpoint.stored import extra_problem, flat_keys, has_section, optimizer_problem, shape_problem, stored_items
from dtgpt.config import Config, to_toml
from dtgpt.distributed import Runtime
from dtgpt.faults.injection import NO_FAULTS, FaultHooks
from dtgpt.progress_log import build_progress_log
from dtgpt.parallel.rng import model_parallel_seed, stage_seed
from dtgpt.state import SaveVerdict, TrainState, rng_state, set_rng_state

FORMAT = layout.FORMAT


@dataclass
class PendingSave:
    iteration: int
    directory: Path
    """Where DCP writes: the iteration directory's staging directory."""
    future: Future
    started: float
    verdict: SaveVerdict
    writer: object
    """The DCP writer: a ChecksummingWriter's `records` go into the marker (a fault-injecting one has none)."""


class Checkpointer(Rejoining, RankZeroCalls):
    """Saves `state` every checkpoint.save_interval iterations; loads it on construction (see
    module doc), unless `joining` (rejoin.py). `faults` may make a save fail on purpose (dtgpt.faults.injection)."""

    def __init__(self, state: TrainState, cfg: Config, runtime: Runtime, faults: FaultHooks = NO_FAULTS, joining: bool = False):
        self.state, self.run_cfg, self.runtime = state, cfg, runtime
        self.cfg = cfg.checkpoint
        self.distributed = dist.is_available() and dist.is_initialized()
        self._saved: set[int] = set()
        self._pending: PendingSave | None = None
        self._failures: dict[int, str] = {}
        """Background saves that failed, by iteration (raised by finalize() unless saved again)."""
        self._rng: dict | None = None  # loaded states, applied by restore_rng()
        self._derive_rng_at: int | None = None
        self.blocked_s: list[float] = []
        """Seconds each save kept training waiting (for logs and the benchmark)."""
        self._async_group = self._background_group()
        # Copies the state to CPU memory before async_save returns, so training may then change it;
        # kept from save to save to reuse its CPU buffers (dtgpt/checkpoint/staging.py).
        self._stager: DefaultStager | None = None
        self._faults = faults
        self.run_id = uuid.uuid4().hex[:12]
        self._lock: SaveDirLock | None = None  # rank 0's, while it runs
        self._progress = None  # logging.log_progress's file, rank 0's (dtgpt/progress_log.py)
        if joining:
            return self._join()
        if self.cfg.save:
            self._from_rank0(self._take_save_dir)
        try:
            self._check_save_dir(self._load())
        except BaseException:
            self.release()  # a failed start leaves no lock (nor a directory it created) behind
            raise
        if runtime.is_main:
            self._progress = build_progress_log(cfg, runtime.world_size, state.model.parts[0].vocab_size, state.progress.consumed_samples)

    # -- helpers -----------------------------------------------------------------------------

    def _log(self, message: str, prefix: str = "> ") -> None:
        if self.runtime.is_main:
            print(f"{prefix}{message}", flush=True)

    def _take_save_dir(self) -> None:
        self._lock = claim_save_dir(self.cfg.save, self.run_id)

    def _check_save_dir(self, loaded_from: str) -> None:
        save, start = self.cfg.save, self.state.progress.iteration
        if save:
            self._from_rank0(lambda: check_save_dir(save, start, self.run_cfg, layout.same_path(loaded_from, save)))

    def release(self) -> None:
        """Give up the save directory's lock (finalize() does; a dead process does too)."""
        if self._lock is not None:
            self._lock.release()
            self._lock = None

    # -- loading -----------------------------------------------------------------------------

    def _load(self) -> str:
        """Load per the config; returns the root loaded from ("" when none)."""
        c = self.cfg
        root = resume_root(c)
        if not root:
            return ""
        if c.trust_pickles:
            self._log(trust_warning(Path(root)), "WARNING: ")
        # Megatron-LM checkpoints: detected by their files, read by dtgpt/checkpoint/megatron/load.py
        megatron_dir = self._from_rank0(lambda: megatron.find(root, c.load_iteration))
        if megatron_dir is not None:
            self._load_megatron(megatron_dir)
            return ""
        root, iteration, note = self._from_rank0(lambda: layout.load_root(root, c.load_iteration))
        if note:
            self._log(note)
        fresh_ok = c.auto_resume or layout.same_path(root, c.save)
        bad: dict[int, str] = {}  # checkpoints whose bytes a rank found changed: skipped as partial
        while True:
            found = self._from_rank0(lambda: layout.resolve(root, iteration, fresh_ok, trust_pickles=c.trust_pickles, data=False, bad=bad))
            for warning in found.warnings:
                self._log(warning, "WARNING: ")
            if found.directory is None:
                self._log(start_from_scratch(c, found.note))
                return root
            start = time.perf_counter()
            try:
                self._load_from(found.directory)
                break
            except CorruptCheckpoint as e:
                bad[found.iteration] = str(e)
        s = self.state.progress
        self._log(
            f"loaded checkpoint {found.directory} in {time.perf_counter() - start:.2f} s: iteration {s.iteration}, "
            f"consumed samples {s.consumed_samples}" + fresh_note(c)
        )
        if layout.same_path(root, c.save):
            self._saved.add(s.iteration)
        return root

    def _load_megatron(self, directory: Path) -> None:
        plan = load_plan(self.cfg, self.state.resumable)  # what Megatron's load keys take: see resume_controls.py
        notes = megatron.load_into_state(self.state, directory, self.run_cfg, "lr_schedule" in plan.sections, bool(plan.sections))
        for note in notes:
            self._log(f"Megatron checkpoint: {note}")
        if not self.state.weights_finite():  # Megatron's files carry no checksums: a damaged shard shows here
            raise CheckpointError(f"Megatron checkpoint {directory} holds non-finite weights (NaN or inf): a damaged file?")
        s = self.state.progress
        if plan.rng:  # Megatron's RNG states belong to its own ranks and generators
            self._derive_rng_at = s.iteration
        self._log(f"loaded Megatron checkpoint {directory}: iteration {s.iteration}, consumed samples {s.consumed_samples}")

    def _load_from(self, directory: Path) -> None:
        c, progress = self.cfg, self.state.progress
        metadata = layout.read_metadata(directory, c.trust_pickles)
        marker = layout.read_marker(directory)
        where, saved = f"checkpoint {directory} does not fit this model: ", layout.stored_config(directory)

        plan, notes = fit_to_checkpoint(load_plan(c, self.state.resumable), metadata)
        for note in notes:
            self._log(note)
        stateful = "lr_schedule" in plan.sections
        if stateful and not has_section(metadata, "train_state"):
            raise CheckpointError(
                f"checkpoint {directory} holds no training state (LR schedule, loss scale, progress): a converted "
                "checkpoint, or one saved by dtgpt.save_checkpoint from a bare model; set "
                "checkpoint.finetune=true (or checkpoint.load_optimizer=false) to start training from its weights"
            )
        request = self.state.load_request(optimizer=plan.optimizer and has_section(metadata, "optimizer"), sections=plan.sections)
        request = stored_items(request, TrainState.STATEFUL, metadata)
        model_request = flat_keys("model", request["model"])
        problem = saved_difference(saved, self.run_cfg) or shape_problem(model_request, metadata, "model")
        keys = [set(model_request)]
        if self.distributed:
            keys = [None] * dist.get_world_size()
            dist.all_gather_object(keys, set(model_request))
        problem = problem or extra_problem(set().union(*keys), metadata)
        self._agree(problem and where + problem)
        if "optimizer" in request:
            problem = optimizer_problem(request["optimizer"], metadata, self.run_cfg.optimizer.optimizer)
            self._agree(problem and where + problem)
        elif plan.optimizer:
            self._log("the checkpoint has no optimizer state (saved before the first optimizer step, or by SGD without momentum): fresh optimizer state")

        here = mesh_info(self.run_cfg, self.state.model.dims)
        if plan.rng:
            wanted = {k: v.clone() for k, v in rng_state(self.state.model).items()}
            stored = {k: v for k, v in wanted.items() if f"rng.{k}" in metadata.state_dict_metadata}
            if same_rng_coordinates(marker.get("mesh"), here) and len(stored) == len(wanted):
                request["rng"] = stored

        # Each rank checks the items it is about to read (an older marker's files were checked whole).
        items = marker.get("item_checksums")
        self._agree(read_problem(directory, request, metadata, items) if isinstance(items, dict) else None, CorruptCheckpoint)
        with layout.single_process():
            reader = SafeReader(directory, c.trust_pickles)
            dcp.load(request, checkpoint_id=str(directory), storage_reader=reader, no_dist=not self.distributed)
        self.state.load_state_dict(request)
        if "train_state" in plan.sections and not has_section(metadata, "train_state") and marker.get("converted_from"):
            progress.iteration, progress.consumed_samples = int(marker["iteration"]), int(marker.get("consumed_samples", 0))  # converted: the marker's
        if stateful and (note := resume_schedule(saved, self.run_cfg, self.state)):
            self._log(note)
        if plan.rng:
            if "rng" in request:
                self._rng = request["rng"]
            else:
                self._derive_rng_at = progress.iteration
                self._log(
                    f"RNG: the checkpoint was saved on another mesh ({mesh_text(marker.get('mesh'))}; now "
                    f"{mesh_text(here)}): each rank's generators are re-derived from training.seed, "
                    f"its pipeline stage, its tp rank and iteration {progress.iteration}"
                )

    def restore_rng(self) -> None:
        """Put the loaded (or re-derived) generator states in place. The trainer calls this after
        building the data loaders, whose iterators draw from the global generator."""
        model = self.state.model
        if self._rng is not None:
            set_rng_state(self._rng, model)
        elif self._derive_rng_at is not None:
            seed, dims, iteration = self.run_cfg.training.seed, model.dims, self._derive_rng_at
            torch.manual_seed(stage_seed(seed, dims.pp_rank, iteration))
            if model.rng is not None:
                model.rng.reseed(model_parallel_seed(seed, dims.pp_rank, dims.tp_rank, iteration))
        self._rng, self._derive_rng_at = None, None

    # -- saving ------------------------------------------------------------------------------

    def due(self, iteration: int) -> bool:
        self._poll(wait=False)
        return bool(self.cfg.save) and self.cfg.save_interval > 0 and iteration % self.cfg.save_interval == 0

    def saved(self, iteration: int) -> bool:
        return not self.cfg.save or iteration in self._saved

    def save_final(self, iteration: int) -> None:
        """Wait for a save in flight; if `iteration` is not saved then (its background save failed), save it now."""
        self._poll(wait=True)
        if iteration and not self.saved(iteration):
            self.save(iteration, background=False)

    def save(self, iteration: int, background: bool | None = None) -> None:
        """Save `iteration`, in the background when checkpoint.async_save (or `background`)."""
        if not self.cfg.save:
            return
        start = time.perf_counter()
        self._poll(wait=True)  # at most one save in flight
        verdict = self.state.health.verdict(self.state.weights_finite())
        directory = self._from_rank0(lambda: self._prepare(iteration))
        state = self.state.state_dict(optimizer=self.cfg.save_optimizer, rng=self.cfg.save_rng)
        writer = self._faults.storage_writer(directory, iteration) or ChecksummingWriter(directory)
        if self.cfg.async_save if background is None else background:
            self._stager = stager_for_next_save(self._stager, cuda=self.runtime.device.type == "cuda")
            # The stager has copied every tensor when async_save returns: training may go on.
            with layout.single_process():  # (the background thread may still warn once)
                future = dcp.async_save(
                    state, checkpoint_id=str(directory), storage_writer=writer, process_group=self._async_group,
                    async_stager=self._stager, no_dist=not self.distributed,
                )  # fmt: skip
            future = getattr(future, "upload_completion", future)
            self._pending = PendingSave(iteration, directory, future, start, verdict, writer)  # saved once complete
            blocked = time.perf_counter() - start
            self.blocked_s.append(blocked)
            self._log(f"saving checkpoint {layout.iteration_dir(self.cfg.save, iteration)} in the background: training blocked {blocked:.3f} s")
        else:
            try:
                with layout.single_process():
                    dcp.save(state, checkpoint_id=str(directory), storage_writer=writer, no_dist=not self.distributed)
            except CheckpointException as e:  # a BaseException: give it a plain message
                raise CheckpointError(
                    f"saving checkpoint {layout.iteration_dir(self.cfg.save, iteration)} failed: {layout.describe(e)}; "
                    f"{layout.POINTER} not moved"
                ) from None
            self._complete(iteration, directory, verdict, getattr(writer, "records", None))
            self._saved.add(iteration)
            self._failures.pop(iteration, None)  # a failed background save of it, retried
            elapsed = time.perf_counter() - start
            self.blocked_s.append(elapsed)
            self._log(f"saved checkpoint {layout.iteration_dir(self.cfg.save, iteration)} in {elapsed:.3f} s")

    def save_over(self, iteration: int, group: dist.ProcessGroup, rng: dict | None) -> Path:
        """Save `iteration` synchronously over `group` alone, the survivors of a hard failure
        (dtgpt/faults/last_words.py), with the generators `rng` (None: the live ones)."""
        leader = dist.get_rank(group) == 0
        verdict = self.state.health.verdict(self.state.weights_finite(group))
        box = [self._prepare(iteration) if leader else None]
        dist.broadcast_object_list(box, group=group, group_src=0)
        state = self.state.state_dict(optimizer=self.cfg.save_optimizer, rng=self.cfg.save_rng)
        if rng is not None and self.cfg.save_rng:
            state["rng"] = rng
        writer = ChecksummingWriter(box[0])
        dcp.save(state, checkpoint_id=str(box[0]), storage_writer=writer, process_group=group)
        self._complete(iteration, box[0], verdict, writer.records, leader=leader)
        self._saved.add(iteration)
        return layout.iteration_dir(self.cfg.save, iteration)

    def _prepare(self, iteration: int) -> Path:
        """Rank 0, before any rank writes: the staging directory `iter_N.saving` (no load looks at
        it) with the config in it; _complete() renames it to `iter_N` after the marker. A complete
        `iter_N` stays until then; a partial one (left by an older dtgpt) is garbage."""
        final = layout.iteration_dir(self.cfg.save, iteration)
        staging = layout.staging_dir(final)
        if staging.exists():  # left by a save that did not finish
            shutil.rmtree(staging)
        if (final / layout.MARKER).exists():
            self._log(f"replacing the checkpoint {final}; it stays until the new one is complete", "WARNING: ")
        elif final.exists():
            shutil.rmtree(final)
        try:
            staging.mkdir(parents=True)
            layout.write_atomic(staging / layout.CONFIG, to_toml(self.run_cfg))
        except OSError as e:
            raise CheckpointError(f"cannot write checkpoint {staging}: {e}") from None
        return staging

    def _complete(self, iteration: int, directory: Path, verdict: SaveVerdict, records: dict | None, leader: bool | None = None) -> None:
        """Every rank's data and DCP's .metadata exist: mark complete (with the checksums the ranks
        `records`ed), swap a staging directory in, move the pointer, prune (only when this save
        counts toward keep_last). Done by `leader` (rank 0 unless given)."""
        if not (self.runtime.is_main if leader is None else leader):
            return
        layout.write_marker(directory, {
            "format": FORMAT, "iteration": iteration, "consumed_samples": self.state.progress.consumed_samples,
            "mesh": mesh_info(self.run_cfg, self.state.model.dims), "tied": self.state.tied, "time": time.time(),
            "run_id": self.run_id, "weights_finite": verdict.weights_finite, "counts_for_keep_last": verdict.counts,
        }, records)  # fmt: skip
        layout.swap_in(directory, layout.iteration_dir(self.cfg.save, iteration))
        previous = layout.read_pointer(self.cfg.save)
        layout.write_pointer(self.cfg.save, iteration)
        if self._progress is not None:
            self._progress.saved(iteration, self.state.progress.consumed_samples)
        layout.remove_stale_staging(self.cfg.save, iteration)
        if not verdict.counts:
            if self.cfg.keep_last:
                self._log(f"iteration {iteration} {verdict.why_not}: no older checkpoint is pruned, nor does it count "
                          "toward checkpoint.keep_last", "WARNING: ")  # fmt: skip
            return
        removed = dict.fromkeys(layout.prune(self.cfg.save, self.cfg.keep_last, iteration), "keep_last")
        removed |= dict.fromkeys(retire_previous(self.cfg.save, previous, iteration, self.cfg.save_retain_interval), "save_retain_interval")
        for path, key in removed.items():
            self._log(f"removed old checkpoint {path} (checkpoint.{key}={getattr(self.cfg, key)})")
            if self._progress is not None:
                self._progress.deleted(int(path.name.removeprefix("iter_")))

    def _poll(self, wait: bool) -> None:
        pending = self._pending
        if pending is None or not (wait or pending.future.done()):
            return
        self._pending = None
        wait_start = time.perf_counter()
        try:
            pending.future.result()
        except (Exception, CheckpointException) as e:  # noqa: BLE001 - reported now, raised by finalize()
            message = f"async checkpoint save of {layout.iteration_dir(self.cfg.save, pending.iteration)} failed: {layout.describe(e)}"
            self._failures[pending.iteration] = message
            self._log(message + f" ({layout.POINTER} not moved)", "WARNING: ")
            return
        self._complete(pending.iteration, pending.directory, pending.verdict, getattr(pending.writer, "records", None))
        self._saved.add(pending.iteration)
        waited = f", training waited {time.perf_counter() - wait_start:.3f} s for it" if wait else ""
        self._log(f"checkpoint {layout.iteration_dir(self.cfg.save, pending.iteration)} complete ({time.perf_counter() - pending.started:.2f} s after it started{waited})")

    def wait(self) -> None:
        """Block until the save in flight (if any) has been written and completed."""
        self._poll(wait=True)

    def finalize(self) -> None:
        """Wait for a save in flight and complete it; raise if any background save failed."""
        self._poll(wait=True)
        if self._stager is not None:
            self._stager.close()
            self._stager = None
        self.release()
        if self._failures:
            raise CheckpointError("; ".join(self._failures.values()))

