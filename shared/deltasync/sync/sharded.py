"""Publishing a model whose weights are sharded over ranks (FSDP2: DTensor parameters sharded on dim 0)
without gathering the weights at every step.

Every rank keeps a bf16 copy of its own shards, finds the elements of its shards that changed since the last
step, and sends only those (global flat positions and new bf16 bits) with its part of the fingerprint's move
to the writer rank: the fingerprint is linear mod 2^64 (see deltasync.codec.fingerprint), so the parts add.
The writer rank keeps a bf16 copy of the whole model, writes every rank's changes into it, and hands it to
its Publisher, which encodes and uploads the step and then writes the head. The first step gathers the full
weights once: the run's first anchor needs them.

    publisher = ShardedPublisher(root, model="my-model")      # on every rank
    ... after each optimizer step, on every rank:
    publisher.publish(model.named_parameters())
    publisher.close()
"""

from __future__ import annotations

import math
import pickle
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard

from deltasync.codec import fingerprint
from deltasync.codec.bf16 import bits
from deltasync.codec.changes import diff
from deltasync.storage import Storage
from deltasync.sync.publisher import Publisher, PublisherConfig

# name -> (offset of the rank's part in the flat tensor, positions in the part, new bf16 bits as int16) of
# the elements a rank saw change; positions as int32 where the part allows (4 bytes less per change)
Changes = dict[str, tuple[int, np.ndarray, np.ndarray]]


def local_shard(param: torch.Tensor, rank: int) -> tuple[torch.Tensor, int] | None:
    """This rank's part of `param` and its offset in the flat full tensor; None where another rank holds
    what this one would send (a replicated parameter is sent by rank 0 alone)."""
    if not isinstance(param, DTensor):
        return (param.detach(), 0) if rank == 0 else None
    placements = param.placements
    if all(isinstance(p, Replicate) for p in placements):
        return (param.to_local().detach(), 0) if rank == 0 else None
    if param.device_mesh.ndim != 1 or placements != (Shard(0),):
        raise ValueError(f"sharded publishing needs dim-0 shards on a 1-D mesh, got {placements}")
    mesh = param.device_mesh
    rows, world, coordinate = param.shape[0], mesh.size(), mesh.get_local_rank()
    start = min(coordinate * math.ceil(rows / world), rows)  # torch.chunk's split, as FSDP2 shards
    local = param.to_local().detach()
    return local, start * (param.numel() // rows if rows else 0)


class ShardedPublisher:
    """One step publisher over all ranks of `group` (default: the whole world); `publish` and `close` are
    collective. Only `writer_rank` touches the sync root.

    After each `publish`: `sent_bytes` (what this rank sent to the writer for the step) and `blocked_s` (how
    long the call held this rank)."""

    def __init__(
        self,
        root: str | Path | Storage,
        model: str = "",
        config: PublisherConfig | None = None,
        group: dist.ProcessGroup | None = None,
        writer_rank: int = 0,
    ):
        self.group, self.writer_rank = group, writer_rank
        self.rank = dist.get_rank(group)
        self.is_writer = self.rank == writer_rank
        self.publisher = Publisher(root, model=model, config=config) if self.is_writer else None
        self.shards: dict[str, tuple[torch.Tensor, int]] = {}  # name -> (bf16 copy of the local part, offset)
        self.full: dict[str, torch.Tensor] | None = None  # the writer's bf16 copy of the whole model
        self.fingerprint: int | None = None  # of the full bf16 state after the last step, from the parts
        self.sent_bytes = 0
        self.blocked_s = 0.0

    @torch.no_grad()
    def publish(self, params: Iterable[tuple[str, torch.Tensor]], info: Mapping[str, float] | None = None):
        """Publish the state after this step; returns the step on the writer rank, None on the others."""
        start = time.perf_counter()
        params = list(params)
        if self.full is None and not self.shards:
            step = self._first(params, info)
        else:
            step = self._next(params, info)
        self.blocked_s = time.perf_counter() - start
        return step

    def close(self) -> None:
        if self.publisher is not None:
            self.publisher.close()
        dist.barrier(group=self.group)

    def _first(self, params: list[tuple[str, torch.Tensor]], info) -> int | None:
        full = {}
        for name, p in params:  # collective per parameter: every rank takes part
            whole = p.full_tensor() if isinstance(p, DTensor) else p.detach()
            if self.is_writer:
                full[name] = whole.to(torch.bfloat16).cpu().clone()
            part = local_shard(p, self.rank)
            if part is not None:
                self.shards[name] = (part[0].to(torch.bfloat16).cpu().clone(), part[1])
        self.sent_bytes = 0
        if not self.is_writer:
            return None
        self.full = full
        self.fingerprint = fingerprint.state_fingerprint(full)
        assert self.publisher is not None  # the writer rank's
        return self.publisher.publish(full, info=info)

    def _next(self, params: list[tuple[str, torch.Tensor]], info) -> int | None:
        changes: Changes = {}
        moved = 0
        for name, p in params:
            part = local_shard(p, self.rank)
            if part is None:
                continue
            old, offset = self.shards[name]
            new = part[0].to(torch.bfloat16).cpu()
            found = diff({name: old}, {name: new}).get(name)
            if found is None:
                continue
            local_idx = found.indices.numpy()
            old_bits = bits(old).reshape(-1).numpy()[local_idx]
            new_bits = bits(found.values).numpy()
            moved += fingerprint.delta(name, local_idx + offset, old_bits, new_bits)
            narrow = local_idx.astype(np.int32) if old.numel() < 1 << 31 else local_idx
            changes[name] = (offset, narrow, new_bits)
            old.reshape(-1)[found.indices] = found.values  # the copy follows the shard
        message = (changes, moved & fingerprint.MASK64)
        self.sent_bytes = 0 if self.is_writer else len(pickle.dumps(message))
        gathered: list[Any] | None = [None] * dist.get_world_size(self.group) if self.is_writer else None
        dist.gather_object(message, gathered, dst=self.writer_rank, group=self.group)
        if not self.is_writer:
            return None
        assert gathered is not None and self.full is not None and self.publisher is not None  # the writer's
        for rank_changes, rank_moved in gathered:
            for name, (offset, positions, new_bits) in rank_changes.items():
                flat = bits(self.full[name]).reshape(-1)
                flat[torch.from_numpy(positions.astype(np.int64) + offset)] = torch.from_numpy(new_bits)
            self.fingerprint = (self.fingerprint + rank_moved) & fingerprint.MASK64
        return self.publisher.publish(self.full, info=info)
