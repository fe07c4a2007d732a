"""Publishing a model whose weights are sharded over ranks (FSDP2: DTensor parameters sharded on dim 0)
without gathering the weights at every step.

Every rank keeps a bf16 copy of its own shards, finds the elements of its shards that changed since the last
step, and encodes them as its own part of the step: a patch over windows (deltasync.codec.patch), each shard
one window [start, start + length) of its flat tensor. The fingerprint is linear mod 2^64 (see
deltasync.codec.fingerprint), so the parts' moves add: the ranks exchange one int each, part r is a patch
from the step's base plus the moves of parts < r, and the last part reaches the step's fingerprint. Every
rank uploads its part to `protocol.delta_paths(step, world, tag)[rank]` under the writer's tag; the writer
rank, once every part is stored, writes the head naming them (Publisher.publish_stored: its fencing,
acknowledgement, retention and telemetry). What crosses ranks per step is a few small objects per rank.

The full weights are gathered (`full_tensor()`, collective) only for anchors: the run's first published
state, and each step at which the writer's Publisher finds an anchor due (`anchor_every`, or once the deltas
since the last anchor outweigh it).

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

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard

from deltasync.codec import fingerprint
from deltasync.codec.changes import apply_changes
from deltasync.codec.patch import Patch, encode, window_changes
from deltasync.storage import Storage, open_storage, retry
from deltasync.sync.protocol import delta_paths
from deltasync.sync.publisher import Publisher, PublisherConfig, StoredDelta


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
    """One step publisher over all ranks of `group` (default: the whole world); the constructor, `publish`
    and `close` are collective. Every rank writes its part of each step to the root; `writer_rank` also
    claims the root and writes run.json, anchors and the head.

    After each `publish`: `sent_bytes` (what this rank sent to other ranks for the step: pickled objects,
    and its shards when an anchor was gathered), `blocked_s` (how long the call held this rank) and
    `gathered` (whether the step gathered the full weights for an anchor)."""

    def __init__(
        self,
        root: str | Path | Storage,
        model: str = "",
        config: PublisherConfig | None = None,
        group: dist.ProcessGroup | None = None,
        writer_rank: int = 0,
    ):
        self.group, self.writer_rank = group, writer_rank
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        self._src = writer_rank if group is None else dist.get_global_rank(group, writer_rank)
        self.is_writer = self.rank == writer_rank
        self.config = config or PublisherConfig()
        self.publisher: Publisher | None = None
        self.sent_bytes = 0
        self.blocked_s = 0.0
        self.gathered = False
        tag, error = None, None
        try:
            if self.is_writer:
                self.publisher = Publisher(root, model=model, config=self.config)
                tag = self.publisher.claim.tag
        except Exception as e:  # the other ranks must not wait for a writer that is gone
            error = e
        self.tag: str = self._from_writer(tag, error)  # every part carries the writer's tag
        if self.publisher is not None:
            self.storage = self.publisher.storage
        else:
            self.storage = root if isinstance(root, Storage) else open_storage(root)
        self.shards: dict[str, tuple[torch.Tensor, int]] = {}  # name -> (bf16 copy of the local part, offset)
        self.shapes: dict[str, list[int]] = {}  # every tensor's whole shape
        self.step: int | None = None  # the last published step
        self.fingerprint: int | None = None  # of the full bf16 state at `step`, from the parts

    @torch.no_grad()
    def publish(self, params: Iterable[tuple[str, torch.Tensor]], info: Mapping[str, float] | None = None):
        """Publish the state after this step; returns the step on every rank."""
        start = time.perf_counter()
        self.sent_bytes, self.gathered = 0, False
        params = list(params)
        step = self._first(params, info) if self.fingerprint is None else self._next(params, info)
        self.blocked_s = time.perf_counter() - start
        return step

    def close(self) -> None:
        if self.publisher is not None:
            self.publisher.close()
        dist.barrier(group=self.group)

    # ------------------------------------------------------------------------------------------ steps

    def _first(self, params: list[tuple[str, torch.Tensor]], info) -> int:
        """The run's first state goes to the writer's Publisher whole (an anchor, or a delta from the state
        a resumed root holds)."""
        for name, p in params:
            self.shapes[name] = list(p.shape)
            part = local_shard(p, self.rank)
            if part is not None:
                self.shards[name] = (part[0].to(torch.bfloat16).cpu().clone().reshape(-1), part[1])
        full = self._gather(params)
        result, error = None, None
        if self.publisher is not None:
            assert full is not None  # the writer's
            try:
                result = (self.publisher.publish(full, info=info), fingerprint.state_fingerprint(full))
            except Exception as e:
                error = e
        self.step, self.fingerprint = self._from_writer(result, error)
        return self.step

    def _next(self, params: list[tuple[str, torch.Tensor]], info) -> int:
        assert self.step is not None and self.fingerprint is not None  # set by _first
        start = time.perf_counter()
        old, new, windows = {}, {}, {}
        for name, p in params:
            part = local_shard(p, self.rank)
            if part is None:
                continue
            copy, offset = self.shards[name]
            old[name], new[name] = copy, part[0].reshape(-1)
            if copy.numel() != math.prod(self.shapes[name]):
                windows[name] = (offset, copy.numel())
        changes, moved = window_changes(old, new, windows, self.config.threads)
        moves = self._all_gather(moved)
        base = (self.fingerprint + sum(moves[: self.rank])) & fingerprint.MASK64
        fp = (self.fingerprint + sum(moves)) & fingerprint.MASK64
        step = self.step + 1
        numel = sum(math.prod(shape) for shape in self.shapes.values())
        patch = Patch(step, self.step, numel, base, (base + moved) & fingerprint.MASK64, changes)
        path = delta_paths(step, self.world, self.tag)[self.rank]
        stored, failure = None, None
        try:
            data = encode(
                patch,
                {n: old[n] for n in changes},
                self.config.encoding,
                self.config.threads,
                windows={n: w for n, w in windows.items() if n in changes},
                shapes=self.shapes,
            )
            retry(lambda: self.storage.write_bytes(path, data), self.config.retry_s, attempts=6)
            stored = (path, len(data), patch.changed, time.perf_counter() - start)
        except Exception as e:
            failure = f"rank {self.rank}: {type(e).__name__}: {e}"
        parts = self._to_writer((stored, failure))
        due, error = False, None
        if self.publisher is not None:
            assert parts is not None  # the writer's
            try:
                failed = [e for _, e in parts if e]
                if failed:
                    raise RuntimeError(f"a part of step {step} was not stored: {failed[0]}")
                self.publisher.flush()  # the head of the previous step: the anchor rule reads it
                due = self.publisher.anchor_due(step, sum(s[1] for s, _ in parts))
            except Exception as e:
                error = e
        full = self._gather(params) if self._from_writer(due, error) else None
        error = None
        if self.publisher is not None:
            assert parts is not None  # the writer's
            stored_parts = [s for s, _ in parts]
            files, sizes, changed, seconds = (list(column) for column in zip(*stored_parts, strict=True))
            try:
                delta = StoredDelta(tuple(files), sum(sizes), sum(changed), fp, max(seconds))
                self.publisher.publish_stored(delta, step, full, info)
            except Exception as e:
                error = e
        self._from_writer(None, error)  # handed to the writer's Publisher, which writes the head
        apply_changes(old, changes)  # the copies follow the shards
        self.step, self.fingerprint = step, fp
        return step

    # ---------------------------------------------------------------------------------- collectives

    def _gather(self, params: list[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor] | None:
        """The full bf16 weights on the writer rank (None on the others): collective per parameter."""
        full, self.gathered = {}, True
        for name, p in params:
            if isinstance(p, DTensor):
                whole = p.full_tensor()
                self.sent_bytes += p.to_local().numel() * p.element_size() * (self.world - 1)
            else:
                whole = p.detach()
            if self.is_writer:
                full[name] = whole.to(torch.bfloat16).cpu()
        return full if self.is_writer else None

    def _all_gather(self, value: Any) -> list[Any]:
        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, value, group=self.group)
        self.sent_bytes += len(pickle.dumps(value)) * (self.world - 1)
        return out

    def _to_writer(self, value: Any) -> list[Any] | None:
        out: list[Any] | None = [None] * self.world if self.is_writer else None
        dist.gather_object(value, out, dst=self._src, group=self.group)
        if not self.is_writer:
            self.sent_bytes += len(pickle.dumps(value))
        return out

    def _from_writer(self, value: Any, error: BaseException | None) -> Any:
        """The writer's `value` on every rank; if the writer failed (`error`), every rank raises."""
        box = [(value, f"{type(error).__name__}: {error}" if error else None)]
        dist.broadcast_object_list(box, src=self._src, group=self.group)
        if self.is_writer:
            self.sent_bytes += len(pickle.dumps(box[0])) * (self.world - 1)
        value, problem = box[0]
        if error is not None:
            raise error
        if problem is not None:
            raise RuntimeError(f"sharded publishing: the writer rank failed: {problem}")
        return value
