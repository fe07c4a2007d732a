"""Publishing a model whose weights are sharded over ranks (FSDP2: DTensor parameters sharded on dim 0)
without gathering the weights at every step.

`publish()` costs each rank a bf16 copy of its own shards (beside them or in host memory, as
`PublisherConfig.previous_copy` says: on CUDA the GPU codec then diffs and ranks them there); a background
thread per rank then finds the elements that changed since the last step and encodes them as the rank's own
part of the step: a patch over windows (deltasync.codec.patch), each shard one window [start, start + length)
of its flat tensor. The fingerprint is linear mod 2^64 (see deltasync.codec.fingerprint), so the parts' moves
add: the ranks exchange one int each, part r is a patch from the step's base plus the moves of parts < r, and
the last part reaches the step's fingerprint. Every rank uploads its part to `protocol.delta_paths(step,
world, tag)[rank]` under the writer's tag; the writer rank, once every part is stored, writes the head naming
them (Publisher.publish_stored: its fencing, acknowledgement, retention and telemetry). What crosses ranks per
step is a few small objects per rank, over a process group of the publisher's own, so it never interleaves
with the training's collectives.

The full weights are gathered to the writer (from the ranks' bf16 copies) only for anchors: the run's first
published state, and each step at which the writer's Publisher finds an anchor due (`anchor_every`, or once
the deltas since the last anchor outweigh it). Every step is published (no coalescing: all ranks must
publish the same steps): `publish()` waits while the step before the previous one is still going out.

    publisher = ShardedPublisher(root, model="my-model")      # on every rank
    ... after each optimizer step, on every rank:
    publisher.publish(model.named_parameters())
    publisher.close()
"""

from __future__ import annotations

import collections
import logging
import math
import pickle
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard

from deltasync.codec import fingerprint
from deltasync.codec.changes import TensorChanges
from deltasync.codec.patch import Patch, encode, window_changes
from deltasync.errors import EXPECTED
from deltasync.storage import Storage, open_storage, retry
from deltasync.sync.protocol import delta_paths
from deltasync.sync.publisher import Publisher, PublisherConfig, StoredDelta, info_problem, keeps_on_device
from deltasync.sync.signing import sha256_of
from deltasync.sync.worker import Worker

log = logging.getLogger(__name__)


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


@dataclass
class _Step:
    """What one rank hands over for a step: its shards' copies, or why it refused the step."""

    copies: dict[str, tuple[torch.Tensor, int]]  # name -> (bf16 copy of the local part, offset)
    info: dict[str, float]
    refused: str | None = None


def _problem(error: BaseException) -> str:
    """`error` in one line for the other ranks; a bug is also logged here, with its traceback."""
    if not isinstance(error, EXPECTED):
        log.error("sharded publishing failed on a bug", exc_info=error)
    return f"{type(error).__name__}: {error}"


@dataclass
class StepRecord:
    """What publishing one step cost this rank, measured by its background thread."""

    step: int
    sent_bytes: int  # to other ranks: pickled objects, and its shards when an anchor was gathered
    seconds: float  # diff, encode, upload and the exchanges with the other ranks
    gathered: bool  # the full weights were gathered for an anchor


class ShardedPublisher:
    """One step publisher over the ranks of `group`; the constructor, `publish`, `flush` and `close` are
    collective (every rank calls them, in the same order). Every rank writes its part of each step to the
    root; `writer_rank` also claims the root and writes run.json, anchors and the head.

    `group` carries only the publisher's exchanges (default: a new gloo group of the whole world, which every
    process creates). After each `publish`, `blocked_s` says how long it held the caller; `records` lists
    what the last published steps cost this rank's background thread."""

    def __init__(
        self,
        root: str | Path | Storage,
        model: str = "",
        config: PublisherConfig | None = None,
        group: dist.ProcessGroup | None = None,
        writer_rank: int = 0,
    ):
        self.group = group if group is not None else dist.new_group(backend="gloo")
        self.writer_rank = writer_rank
        self.rank, self.world = dist.get_rank(self.group), dist.get_world_size(self.group)
        self._src = dist.get_global_rank(self.group, writer_rank)
        self.is_writer = self.rank == writer_rank
        self.config = config or PublisherConfig()
        self.publisher: Publisher | None = None
        self.blocked_s = 0.0
        self.records: collections.deque[StepRecord] = collections.deque(maxlen=256)
        self._sent = 0
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
        self._worker: Worker[_Step] = Worker("deltasync-sharded", "sharded publishing", self._publish_step)

    @torch.no_grad()
    def publish(
        self, params: Iterable[tuple[str, torch.Tensor]], info: Mapping[str, float] | None = None
    ) -> None:
        """Hand over the state after this step: a bf16 copy of this rank's shards. Waits while an
        earlier step is still queued behind the one going out; raises if publishing failed. `info` (the
        writer rank's is kept) goes into the step's telemetry record.

        A rank that refuses the step (it raises here) still hands it over, as refused: every rank's thread
        then stops with the cause, instead of the ranks publishing from then on a step apart."""
        start = time.perf_counter()
        try:
            problem = info_problem(info or {})
            if problem:  # here, on every rank, rather than from the writer's Publisher a step later
                raise ValueError(f"publish(): info {problem}")
            parts = {}
            for name, p in params:
                self.shapes.setdefault(name, list(p.shape))
                part = local_shard(p, self.rank)
                if part is not None:
                    parts[name] = part
            on_device = keeps_on_device(self.config, (t for t, _ in parts.values()))
            # (a clone even of a bf16 host shard: the optimizer changes it in place)
            copies = {
                name: (t.to(t.device if on_device else "cpu", torch.bfloat16, copy=True).reshape(-1), offset)
                for name, (t, offset) in parts.items()
            }
            if any(t.is_cuda for t, _ in parts.values()):
                torch.cuda.synchronize()  # the copies are whole when publish() returns
        except BaseException as e:
            refused = _Step({}, {}, _problem(e))
            self._worker.submit(lambda _: refused, wait=True)
            raise
        self._worker.submit(lambda _: _Step(copies, dict(info or {})), wait=True)
        self.blocked_s = time.perf_counter() - start

    def flush(self) -> None:
        """Wait until every handed-over step is published, its head written and read back (the writer rank
        waits for its Publisher); raises if publishing failed."""
        self._worker.flush()
        if self.publisher is not None:
            self.publisher.flush()

    def close(self) -> None:
        """Publish what is pending, stop the thread and (writer rank) let the next writer in."""
        try:
            try:
                self._worker.close()
            finally:
                if self.publisher is not None:
                    self.publisher.close()
        finally:
            dist.barrier(group=self.group)

    # ------------------------------------------------------------------------------------ worker thread

    def _publish_step(self, job: _Step) -> None:
        start, self._sent = time.perf_counter(), 0
        self._all_gather(None, job.refused)  # the ranks publish this step together, or none does
        publish_step = self._first if self.fingerprint is None else self._next
        gathered = publish_step(job.copies, job.info)
        assert self.step is not None  # set by the step
        self.records.append(StepRecord(self.step, self._sent, time.perf_counter() - start, gathered))

    def _first(self, copies: dict[str, tuple[torch.Tensor, int]], info: dict[str, float]) -> bool:
        """The run's first state goes to the writer's Publisher whole (an anchor, or a delta from the state
        a resumed root holds)."""
        full = self._gather(copies)
        result, error = None, None
        if self.publisher is not None:
            assert full is not None  # the writer's
            try:
                result = (self.publisher.publish(full, info=info), fingerprint.state_fingerprint(full))
            except Exception as e:
                error = e
        self.step, self.fingerprint = self._from_writer(result, error)
        self.shards = copies
        return True

    def _next(self, copies: dict[str, tuple[torch.Tensor, int]], info: dict[str, float]) -> bool:
        assert self.step is not None and self.fingerprint is not None  # set by _first
        start = time.perf_counter()
        old = {name: copy for name, (copy, _) in self.shards.items()}
        new = {name: copy for name, (copy, _) in copies.items()}
        windows = {
            name: (offset, copy.numel())
            for name, (copy, offset) in copies.items()
            if copy.numel() != math.prod(self.shapes[name])
        }
        changes: dict[str, TensorChanges] = {}
        moved, problem = 0, None
        try:
            changes, moved = window_changes(old, new, windows, self.config.threads)
        except Exception as e:
            problem = _problem(e)
        moves = self._all_gather(moved, problem)
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
            digest = sha256_of(data) if self.config.signing_key else None  # what a signed head names
            stored = (path, len(data), patch.changed, time.perf_counter() - start, digest)
        except Exception as e:
            failure = f"rank {self.rank}: {_problem(e)}"
        parts = self._to_writer((stored, failure))
        due, error = False, None
        if self.publisher is not None:
            assert parts is not None  # the writer's
            try:
                failed = [f for _, f in parts if f]
                if failed:
                    raise RuntimeError(f"a part of step {step} was not stored: {failed[0]}")
                self.publisher.flush()  # the head of the previous step: the anchor rule reads it
                due = self.publisher.anchor_due(step, sum(s[1] for s, _ in parts))
            except Exception as e:
                error = e
        full = self._gather(copies) if self._from_writer(due, error) else None
        error = None
        if self.publisher is not None:
            assert parts is not None  # the writer's
            files, sizes, changed, seconds, digests = zip(*[s for s, _ in parts], strict=True)
            sha256 = None if None in digests else tuple(digests)
            try:
                delta = StoredDelta(files, sum(sizes), sum(changed), fp, max(seconds), sha256)
                self.publisher.publish_stored(delta, step, full, info)
            except Exception as e:
                error = e
        self._from_writer(None, error)  # handed to the writer's Publisher, which writes the head
        self.shards = copies  # the copies of this step are the next one's base
        self.step, self.fingerprint = step, fp
        return full is not None

    # ---------------------------------------------------------------------------------- collectives

    def _gather(self, copies: dict[str, tuple[torch.Tensor, int]]) -> dict[str, torch.Tensor] | None:
        """The full bf16 weights on the writer rank (None on the others), from every rank's copies."""
        size = sum(copy.numel() * copy.element_size() for copy, _ in copies.values())
        parts = self._to_writer({name: (copy.cpu(), offset) for name, (copy, offset) in copies.items()}, size)
        if parts is None:
            return None
        full = {name: torch.empty(shape, dtype=torch.bfloat16) for name, shape in self.shapes.items()}
        for rank_copies in parts:
            for name, (copy, offset) in rank_copies.items():
                full[name].view(-1)[offset : offset + copy.numel()] = copy
        return full

    def _all_gather(self, value: Any, problem: str | None) -> list[Any]:
        """Every rank's `value` on every rank; if any rank has a `problem`, every rank raises it."""
        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, (value, problem), group=self.group)
        self._sent += len(pickle.dumps((value, problem))) * (self.world - 1)
        failed = [(rank, p) for rank, (_, p) in enumerate(out) if p is not None]
        if failed:
            rank, first = failed[0]
            raise RuntimeError(f"rank {rank} failed: {first}")
        return [v for v, _ in out]

    def _to_writer(self, value: Any, size: int | None = None) -> list[Any] | None:
        """Every rank's `value` on the writer rank (None on the others); `size`: its bytes, if known."""
        out: list[Any] | None = [None] * self.world if self.is_writer else None
        dist.gather_object(value, out, dst=self._src, group=self.group)
        if not self.is_writer:
            self._sent += len(pickle.dumps(value)) if size is None else size
        return out

    def _from_writer(self, value: Any, error: BaseException | None) -> Any:
        """The writer's `value` on every rank; if the writer failed (`error`), every rank raises."""
        box = [(value, _problem(error) if error else None)]
        dist.broadcast_object_list(box, src=self._src, group=self.group)
        if self.is_writer:
            self._sent += len(pickle.dumps(box[0])) * (self.world - 1)
        value, problem = box[0]
        if error is not None:
            raise error
        if problem is not None:
            raise RuntimeError(f"the writer rank failed: {problem}")
        return value
