"""Reading sub-regions of tensors stored with DCP: a rank asks for just the part it holds.

DCP's default load asks for whole tensors (or a DTensor's own shard). Here a request names a
stored key and the offsets of a region; the destination tensor gives the region's shape. DCP's
resharding then works out which stored chunks overlap it, and its reader touches only those
(each overlapping chunk is read whole, then narrowed: a checkpoint stored in per-layer chunks,
as Megatron-LM stores its stacked tensors, costs one layer per layer asked for).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex
from torch.distributed.checkpoint.planner import LoadPlan
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from dtgpt.checkpoint import layout
from dtgpt.checkpoint.safe import SafeReader


class RegionPlanner(DefaultLoadPlanner):
    """DCP reads of sub-regions of stored tensors. `regions` maps a request to (stored key,
    offsets); the state dict maps the request to its destination, whose shape is the region's.
    DCP's reader then touches only the stored chunks the region overlaps."""

    def __init__(self, regions: dict[str, tuple[str, tuple[int, ...]]]):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self._regions = regions

    def create_local_plan(self) -> LoadPlan:
        items = []
        for request, (key, offsets) in self._regions.items():
            chunk = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=self.state_dict[request].shape)
            for item in create_read_items_for_chunk_list(key, self.metadata.state_dict_metadata[key], [chunk]):
                items.append(dataclasses.replace(item, dest_index=MetadataIndex(request)))  # a plain tensor: no offset
        return LoadPlan(items)


def read_regions(directory: Path, requests: dict[str, tuple[str, tuple[int, ...], torch.Tensor]]) -> None:
    """Fill each request's destination (request -> (stored key, offsets, destination)) with that
    region of `directory`'s tensors, in one DCP load on this process alone."""
    destinations = {request: target for request, (_, _, target) in requests.items()}
    planner = RegionPlanner({request: (key, offsets) for request, (key, offsets, _) in requests.items()})
    with layout.single_process():
        reader = SafeReader(directory)  # the allowlisted .metadata; tensors only
        dcp.load(destinations, checkpoint_id=str(directory), storage_reader=reader, planner=planner, no_dist=True)
