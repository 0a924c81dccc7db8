"""Reading a Megatron-LM checkpoint (torch_dist or per-rank) as dtgpt's tensors, by name.

Both formats become dtgpt's full tensors by name (`model.<fqn>`), or any sub-region of one (one
layer of a stacked tensor, one shard's rows); load.py reads each rank's slice into its (possibly
sharded) parameters, so a Megatron checkpoint loads at any mesh. The formats are
described in formats.py, the key map in keys.py.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import torch
from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata

from dtgpt.checkpoint import layout
from dtgpt.checkpoint.layout import CheckpointError
from dtgpt.checkpoint.architecture import megatron_architecture, require_same
from dtgpt.checkpoint.megatron.buckets import BucketLayout, Parallel, agrees, bucket_layout
from dtgpt.checkpoint.megatron.grad_buffers import BUCKET
from dtgpt.checkpoint.megatron.formats import COMMON_FILE, COMMON_ITEM, is_torch_dist, load_pickle
from dtgpt.checkpoint.megatron.keys import OPTIMIZER_PREFIX, VOCAB_KEYS, half_of, is_mla, megatron_name, stored_alias
from dtgpt.checkpoint.megatron.per_rank import PerRankModel, args_split
from dtgpt.checkpoint.megatron.regions import read_regions
from dtgpt.config import ModelConfig

PER_LAYER = re.compile(r"decoder\.layers\.(\d+)\.")
CHAINED = re.compile(r"chained_\d+\.")
"""megatron-core's prefix of each chained optimizer's tensors (the dense one, then the experts')
where Megatron-LM did not yet set chained_optim_avoid_prefix (before July 2025)."""


def unchained(key: str) -> str:
    """A stored key without a chained optimizer's prefix: the key Megatron-LM writes today."""
    found = CHAINED.match(key)
    return key[found.end():] if found else key


def _mismatch(directory: Path, key: str, stored, wanted, name: str) -> CheckpointError:
    return CheckpointError(
        f"Megatron checkpoint {directory} does not fit this model: {key} has shape {tuple(stored)} in the "
        f"checkpoint but this model's {name} needs {tuple(wanted)}"
    )


class MegatronReader:
    """Full dtgpt tensors by name from a Megatron checkpoint, one Megatron tensor read at a time."""

    def __init__(self, directory: Path):
        self.directory = directory
        self.torch_dist = is_torch_dist(directory)
        if self.torch_dist:
            # Megatron keeps each layer's Transformer Engine state as a pickled `_extra_state`, and
            # the distributed optimizer's dp_reshardable layout pickled objects: dtgpt never hands
            # them to DCP. COMMON_ITEM and the dp_reshardable param groups are read from their
            # bytes, with load_pickle's allowlist (_item).
            metadata = layout.read_metadata(
                directory, unread=lambda key: "._extra_state" in key or unchained(key).startswith("optimizer.") or key == COMMON_ITEM
            )
            short = layout.short_data_file(directory, metadata)  # Megatron's format has no checksums
            if short:
                raise CheckpointError(f"Megatron checkpoint {directory}: {short}: the copy is incomplete or damaged")
            self.shapes = {k: tuple(v.size) for k, v in metadata.state_dict_metadata.items()
                           if isinstance(v, TensorStorageMetadata)}  # fmt: skip
            self.dtypes = {k: v.properties.dtype for k, v in metadata.state_dict_metadata.items()
                           if isinstance(v, TensorStorageMetadata)}  # fmt: skip
            self._storage = metadata.storage_data
            common = directory / COMMON_FILE
            if common.is_file():
                self.common = load_pickle(common)
            else:  # megatron-core >= 0.19 keeps it as an item
                self.common = self._item(COMMON_ITEM) or {}
        else:
            self._per_rank = PerRankModel(directory)
            self.common = self._per_rank.common
            self.shapes = self._per_rank.shapes()
            self.dtypes = {}
        self._chained = {unchained(key): key for key in self.shapes if CHAINED.match(key)}
        self._model_names: frozenset[str] | None = None  # set by check()
        self._mla = False  # set by check(): the model's blocks have multi-latent attention
        # megatron-core keeps the decoder layers apart (decoder.layers.<i>.) when they are not all alike
        self._per_layer = any(PER_LAYER.match(key) for key in self.shapes)
        self._buckets: tuple[BucketLayout | None, str] | None = None  # set by bucket_layout()

    def _item(self, key: str):
        """A pickled item of the DCP checkpoint, read from its bytes with load_pickle's allowlist
        (a list of one object), or None when there is none."""
        item = self._storage.get(MetadataIndex(key))
        return None if item is None else load_pickle(self.directory / item.relative_path, (item.offset, item.length))[0]

    def bucket_layout(self) -> tuple[BucketLayout | None, str]:
        """The distributed optimizer's dp_reshardable layout (buckets.py) and the layer spec it
        matched, or (None, why not; "" when the checkpoint has no such buckets)."""
        if self._buckets is None:
            model_keys = [k for k in self.shapes if self._is_model_key(k)]
            found = self.torch_dist and any(BUCKET.match(key) for key in self.shapes)
            args, parallel = self.common.get("args"), self._parallel()
            groups = getattr(args, "num_query_groups", None) if getattr(args, "group_query_attention", False) else None
            if found and parallel and groups and groups < parallel.tp:
                self._buckets = (None, f"each of its tp {parallel.tp} ranks holds a copy of the key/value heads (num_query_groups={groups} "
                                       "< tp), which dtgpt does not map yet")  # fmt: skip
            else:
                self._buckets = bucket_layout(self.directory, self.shapes, self.dtypes, model_keys, parallel, self._chunk_starts()) if found else (None, "")
        return self._buckets

    def _chunk_starts(self) -> dict[str, list[int]]:
        """Where each stored 1-D tensor's chunks start (a bucket's: its dp shares)."""
        starts: dict[str, list[int]] = {}
        for index in sorted(self._storage, key=lambda index: (index.fqn, tuple(index.offset or ()))):
            if index.offset is not None and len(index.offset) == 1:
                starts.setdefault(index.fqn, []).append(index.offset[0])
        return starts

    def _parallel(self) -> Parallel | None:
        """The tp size and pipeline split (over pp x vp stages with virtual ones) the checkpoint's
        args say it was saved with (None: no args, or a split they do not give)."""
        args = self.common.get("args")
        tp, pp = getattr(args, "tensor_model_parallel_size", None), getattr(args, "pipeline_model_parallel_size", 1) or 1
        if not isinstance(tp, int):
            return None
        ep = getattr(args, "expert_model_parallel_size", 1) or 1
        etp = getattr(args, "expert_tensor_parallel_size", None) or tp  # unset: tp, as Megatron-LM's arguments.py sets it
        if pp == 1:
            return Parallel(tp, (), ep, etp)
        vp = getattr(args, "virtual_pipeline_model_parallel_size", None) or 1  # Megatron-LM derives it from its flags
        split = args_split(args, pp, vp)
        return None if split is None else Parallel(tp, tuple(split), ep, etp, vp)

    def optimizer_common(self):
        """Megatron's optimizer state besides the tensors (its param groups, step included): in
        common.pt, or with dp_reshardable in the dp group's pickled item; per-rank: the step its
        files hold (per_rank_optim.py)."""
        if not self.torch_dist:
            step = self._per_rank.optimizer.first[1]
            return None if step is None else {"common_step": step}
        if self.bucket_layout()[0] is not None:  # an MoE model's: the dense optimizer's and the experts' (chained_1)
            items = [self._item(f"{chain}optimizer.distributed.dp_group_idx_0.optimizer/shard_0_1") for chain in ("", "chained_0.", "chained_1.")]
            return [item for item in items if item is not None]
        return self.common.get("optimizer")

    def holds(self, name: str, slot: str) -> bool:
        """Whether the checkpoint stores optimizer state `slot` of dtgpt tensor `name`."""
        layout = self.bucket_layout()[0]
        if layout is not None:
            return slot in ("param", "exp_avg", "exp_avg_sq") and self._bucket_param(name) in layout.pieces
        return self.stored_key(name, slot) in self.shapes

    def holds_slot(self, slot: str) -> bool:
        """Whether the checkpoint stores optimizer state `slot` of any tensor in model space."""
        return any(unchained(key).startswith(f"{OPTIMIZER_PREFIX}{slot}.") for key in self.shapes)

    def per_rank_optimizer_problem(self) -> str:
        """Why the per-rank files' optimizer state is not mapped ("" when it is, or for torch_dist)."""
        return "" if self.torch_dist else self._per_rank.optimizer.first[2]

    def masters_agree(self, slot: str) -> bool:
        """Whether the model-space master weights (optimizer.state.<slot>.*) equal the model
        weights they belong to. They may not: megatron-core 0.16.1's fully_reshardable save of a
        grad buffer cut into several buckets writes a later bucket's state at shifted offsets.

        Compared (agrees): the 1-D tensors (norms, biases) outside the layers and of layer 0, whole
        on both sides: at most 2 + 10 small tensors (one layer's chunk each), whatever the layer
        count and the parallelism it was saved with. Layer 0 sits in the buffer's last bucket
        (reverse module order), the one the shift hits, and its 1-D tensors between its matrices."""
        checks = []
        for key, shape in self.shapes.items():
            master = self._chained.get(f"{OPTIMIZER_PREFIX}{slot}.{key}", f"{OPTIMIZER_PREFIX}{slot}.{key}")
            per_layer = PER_LAYER.match(key)
            stacked = key.startswith("decoder.layers.") and not self._per_layer
            if not self._is_model_key(key) or master not in self.shapes or len(shape) != 1 + stacked or (per_layer and per_layer[1] != "0"):
                continue
            region = ((0, 0), (1, shape[1])) if stacked else ((0,), shape)
            checks.append(((key, *region), (master, *region)))
        return not self.torch_dist or agrees(self.directory, self.dtypes, checks)

    @property
    def layers_key(self) -> str:
        """The stacked tensor whose leading dimension tells the layer count."""
        return f"decoder.layers.self_attention.{'linear_kv_down_proj' if self._mla else 'linear_qkv'}.weight"

    @property
    def num_layers(self) -> int:
        if self._per_layer:
            return len({match.group(1) for match in map(PER_LAYER.match, self.shapes) if match})
        return self.shapes.get(self.layers_key, (0,))[0]

    def _name(self, name: str) -> tuple[str, int | None]:
        """dtgpt FQN -> (the Megatron key under this checkpoint's layer spec and layout, layer or None)."""
        return megatron_name(name, self._mla, self._per_layer)

    def check_architecture(self, cfg: ModelConfig) -> None:
        """One clear error for the first architecture key on which common.pt's args and `cfg` differ."""
        args = self.common.get("args")
        if args is not None:
            require_same(megatron_architecture(args), cfg, f"Megatron checkpoint {self.directory}")

    def check(self, wanted: dict[str, tuple[int, ...]], model_names: list[str]) -> None:
        """One clear error for the first tensor whose shape (or presence) differs, the vocabulary
        rows included (see vocab_problem). `wanted` may be one stage's share of the model whose
        names are `model_names`. Must run before regions()."""
        self._model_names = frozenset(model_names)
        self._mla = is_mla(model_names)
        num_layers = sum(1 for n in model_names if n.startswith("layers.") and n.endswith(("attention.proj.weight", "attention.linear_proj.weight")))
        if self.num_layers != num_layers:
            key = self.layers_key
            stored = (f"keeps {self.num_layers} layers apart (decoder.layers.<i>.)" if self._per_layer else
                      f"{key} stacks {self.num_layers} layers {self.shapes.get(key, '(none stored)')}")  # fmt: skip
            raise CheckpointError(
                f"Megatron checkpoint {self.directory} does not fit this model: {stored} but model.num_layers={num_layers}"
            )
        used = {self.stored_key(n) for n in model_names}
        for name, shape in wanted.items():
            key, layer = self.stored_key(name), self._name(name)[1]
            if key not in self.shapes:
                hint = " (the model's head is untied; is the checkpoint's tied?)" if name == "output.weight" else ""
                raise CheckpointError(
                    f"Megatron checkpoint {self.directory} has no {key}, which this model's {name} {tuple(shape)} needs{hint}"
                )
            stored = self.shapes[key]
            if layer is not None:
                stored = stored[1:]
            if half_of(name, self._model_names) is not None:  # one of SwiGLU's two halves
                stored = (stored[0] // 2, *stored[1:]) if stored[0] % 2 == 0 else stored
            if name in VOCAB_KEYS and tuple(stored[1:]) == tuple(shape)[1:] and stored[0] != shape[0]:
                raise CheckpointError(self.vocab_problem(key, shape[0]))
            if tuple(stored) != tuple(shape):
                raise _mismatch(self.directory, key, self.shapes[key], wanted[name], name)
        for key, shape in self.shapes.items():
            if key == "output_layer.weight" and self._tied_head_copy(used):
                continue
            if key not in used and not key.endswith("_extra_state") and self._is_model_key(key):
                raise CheckpointError(
                    f"Megatron checkpoint {self.directory}: its tensor {key} {tuple(shape)} has no counterpart in this model"
                )

    def _tied_head_copy(self, used) -> bool:
        """Whether output_layer.weight is the last stage's copy of the tied word embeddings, which
        Megatron-LM's per-rank files hold at pp > 1 (the model reads the embedding itself)."""
        return (not self.torch_dist and self._per_rank.pp > 1 and "output_layer.weight" not in used
                and "embedding.word_embeddings.weight" in used)  # fmt: skip

    def vocab_problem(self, key: str, rows: int) -> str:
        """Megatron pads the vocabulary to a multiple of make_vocab_size_divisible_by x tp, dtgpt to
        make_vocab_size_divisible_by alone. Every row, padding included, is in each softmax's
        denominator, so rows dropped or added (zeros: exp(0) each) would change the loss: the
        model must have the checkpoint's own rows. The advice is Megatron's multiple (from its
        args), else the row count itself (a tokenizer that fits pads to exactly that many)."""
        stored = self.shapes[key][0]
        args = self.common.get("args")
        multiple = getattr(args, "make_vocab_size_divisible_by", 0) * getattr(args, "tensor_model_parallel_size", 0)
        advice = multiple if multiple and stored % multiple == 0 else stored
        return (
            f"Megatron checkpoint {self.directory} pads the vocabulary to {stored} rows ({key} {self.shapes[key]}) "
            f"but this model has {rows}: every padding row is in the softmax, so other rows would change the loss; "
            f"set model.make_vocab_size_divisible_by={advice} to load it with its own padded vocabulary"
        )

    @staticmethod
    def _is_model_key(key: str) -> bool:
        return key.startswith(("embedding.", "decoder.", "output_layer.", "mtp."))

    def stored_key(self, name: str, slot: str | None = None) -> str:
        """The Megatron key of dtgpt tensor `name`, or of its optimizer state `slot` (exp_avg, ...)."""
        key = self._name(name)[0]
        alias = stored_alias(key)
        if key not in self.shapes and alias in self.shapes:  # another layer spec's name for it
            key = alias
        if slot is None:
            return key
        optimizer_key = f"{OPTIMIZER_PREFIX}{slot}.{key}"
        return self._chained.get(optimizer_key, optimizer_key)

    def regions(self, wanted: dict[str, tuple[str, str | None, tuple[int, ...], tuple[int, ...]]]) -> dict[str, torch.Tensor]:
        """Sub-regions of dtgpt tensors: request -> (dtgpt name, optimizer slot or None, offsets,
        sizes) in dtgpt's coordinates (checked against the stored shapes by check()). Only the
        stored chunks that overlap a region are read (one layer of a stacked tensor, one shard's
        rows), in one DCP load."""
        out, dcp_requests, narrow = {}, {}, []
        if self._model_names is None:
            raise RuntimeError("MegatronReader.check must run before regions")
        for request, (name, slot, offsets, sizes) in wanted.items():
            layer = self._name(name)[1]
            key = self.stored_key(name, slot)
            half = half_of(name, self._model_names)
            if half:  # the second half of linear_fc1's rows
                rows = self.shapes[self.stored_key(name)][0 if layer is None else 1]  # linear_fc1's rows (one layer's)
                offsets = (offsets[0] + half * rows // 2, *offsets[1:])
            target = out[request] = torch.empty(sizes, dtype=self.dtypes.get(key, torch.float32))
            at = tuple(offsets) if layer is None else (layer, *offsets)
            target_at = target if layer is None else target.unsqueeze(0)
            if slot is not None and key not in self.shapes and self.bucket_layout()[0] is not None:
                for i, (bucket, at, rows, within, into) in enumerate(self._bucket_reads(name, slot, offsets, sizes)):
                    dcp_requests[f"{request}#{i}"] = (bucket, at, rows.view(-1))
                    narrow.append((target, into, rows, within))
            elif self.torch_dist:
                dcp_requests[request] = (key, at, target_at)
            else:
                target_at.copy_(self._per_rank.region(key, at, tuple(target_at.shape)))
        if dcp_requests:
            read_regions(self.directory, dcp_requests)
        for target, into, rows, within in narrow:
            target[into].copy_(rows[within])
        return out

    def _bucket_reads(self, name: str, slot: str, offsets: tuple[int, ...], sizes: tuple[int, ...]):
        """A region (Megatron's global coordinates, one layer's) of a parameter's state in
        dp_reshardable buckets: for each stored piece it overlaps, the flat run of the piece's rows
        it spans (stored key, offset, destination), the overlap within those rows, and where the
        overlap goes in the region."""
        for piece in self.bucket_layout()[0].pieces[self._bucket_param(name)]:
            lows = [max(o, p) for o, p in zip(offsets, piece.offsets)]
            highs = [min(o + n, p + m) for o, n, p, m in zip(offsets, sizes, piece.offsets, piece.shape)]
            if any(low >= high for low, high in zip(lows, highs)):
                continue
            bucket = f"{piece.prefix}.{slot}"
            rows = torch.empty((highs[0] - lows[0], *piece.shape[1:]), dtype=self.dtypes.get(bucket, torch.float32))
            at = piece.start + (lows[0] - piece.offsets[0]) * math.prod(piece.shape[1:])
            within = (slice(None), *(slice(low - p, high - p) for low, high, p in zip(lows[1:], highs[1:], piece.offsets[1:])))
            into = tuple(slice(low - o, high - o) for low, high, o in zip(lows, highs, offsets))
            yield bucket, (at,), rows, within, into

    def _bucket_param(self, name: str) -> tuple[str, int | None]:
        """dtgpt FQN -> its (stored key, layer) in the bucket layout (the name this checkpoint's spec gives it)."""
        return self.stored_key(name), self._name(name)[1]

    def tensor(self, name: str, shape: tuple[int, ...], slot: str | None = None) -> torch.Tensor:
        """dtgpt tensor `name` (or its optimizer state `slot`), full (`shape`)."""
        return self.regions({name: (name, slot, (0,) * len(shape), tuple(shape))})[name]

    def model(self, wanted: dict[str, tuple[int, ...]], model_names: list[str]):
        """(name, full tensor) for every wanted name, one layer's tensor read at a time."""
        self.check(wanted, model_names)
        for name in sorted(wanted, key=lambda n: megatron_name(n)):
            yield name, self.tensor(name, tuple(wanted[name]))
