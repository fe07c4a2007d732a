"""Decoding a tensor that tensor-parallel ranks hold in parts, none of them whole (see docs/gpu.md).

A compact chunk codes each change as a rank among the chunk's elements of one class (a range of exponents
of the OLD value). A rank holds only its own segments of the chunk (runs of consecutive elements: a
row-parallel weight cuts every row into one segment per rank, a column-parallel one gives each rank a run
of rows), so it lacks how many elements of each class the other ranks' segments before its own hold. Each
rank counts the classes of its segments, the ranks all-gather those counts (4 int32 and an int64 start per
segment), and each takes prefix sums in chunk order: every change then names the segment it falls in and
its place among that segment's elements of its class, and each rank places those of its own segments.
The rANS streams are decoded by every rank (O(changes)), so every rank reaches the same verdict on them.

The segments follow from the blocks' shapes (no list of held positions), and the held values are read where
they live, `budget` elements at a time: beyond the weights, a rank's memory is O(changes + segments).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

from deltasync.codec.backend import TensorChanges
from deltasync.codec.patch import PatchInfo, RankedEntry, Tables, held_entry
from deltasync.errors import PatchError
from deltasync.vllm.layout import BUDGET, Segments


class _Held:
    """The old patterns a rank holds of one tensor's window, segment by segment, read where they live."""

    def __init__(self, blocks, lo: int, n: int, chunk: int, budget: int):
        self.segments = Segments.of(blocks, lo, n, chunk, budget)
        # flat int16 patterns: views where the weights are contiguous
        self.flats = [b.read().reshape(-1).view(torch.int16) for b in blocks]
        self.chunk, self.budget = chunk, budget
        self.device = blocks[0].dst.device if blocks else torch.device("cpu")

    def batches(self) -> Iterator[tuple[int, int, torch.Tensor]]:
        """(first, last, the old patterns of segments [first, last)) for every batch of segments."""
        s = self.segments
        for first, last in s.batches(self.budget, self.chunk):
            e0, e1 = s.span(first, last)
            yield first, last, self.flats[s.block[first]][e0:e1]

    def _limits(self, limits: np.ndarray, first: int) -> list[int]:
        """The class limits (of `limits`, each chunk's) that segment `first`'s elements can reach: a class
        is the number of them its magnitude reaches."""
        return [
            limit for limit in limits[self.segments.start[first] // self.chunk].tolist() if limit <= 0x7FFF
        ]

    def class_counts(self, limits: np.ndarray) -> np.ndarray:
        """[segments, classes]: how many of each segment's elements are of each class (`limits`: each
        chunk's)."""
        s = self.segments
        at_least = np.zeros((s.start.size, limits.shape[1] + 1), np.int64)  # elements of class >= k
        at_least[:, 0] = s.length
        for first, last, old in self.batches():
            magnitude = old & 0x7FFF
            ends = torch.from_numpy(np.cumsum(s.length[first:last]) - 1).to(self.device)
            for k, limit in enumerate(self._limits(limits, first), 1):
                upto = torch.cumsum(magnitude >= limit, 0, dtype=torch.int32)[ends].cpu().numpy()
                at_least[first:last, k] = np.diff(upto, prepend=0)
        return at_least - np.append(at_least[:, 1:], np.zeros((s.start.size, 1), np.int64), 1)

    def place(
        self, limits: np.ndarray, counts: np.ndarray, segment: np.ndarray, cls: np.ndarray, within: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """The window positions and old patterns of the elements that are the `within`-th of class `cls` in
        this rank's segments `segment` (one per change), from their `counts` of each class."""
        positions, old_patterns = np.empty(segment.size, np.int64), np.empty(segment.size, np.int16)
        by_segment = np.argsort(segment, kind="stable")
        ordered = segment[by_segment]
        for first, last, old in self.batches():
            a, b = np.searchsorted(ordered, [first, last])
            if a == b:
                continue
            changes = by_segment[a:b]
            magnitude = old & 0x7FFF
            classes = torch.zeros(old.shape, dtype=torch.uint8, device=self.device)
            for limit in self._limits(limits, first):
                classes += magnitude >= limit
            before = np.cumsum(counts[first:last], 0) - counts[first:last]  # in the batch, per class
            element = np.empty(changes.size, np.int64)
            for k in range(
                counts.shape[1]
            ):  # the batch's elements of class k, in order: the change's is there
                of_class = np.flatnonzero(cls[changes] == k)
                if of_class.size:
                    at = before[segment[changes[of_class]] - first, k] + within[changes[of_class]]
                    members = torch.nonzero(classes == k)[:, 0]
                    element[of_class] = members[torch.from_numpy(at).to(self.device)].cpu().numpy()
            s = segment[changes]
            positions[changes] = (
                self.segments.start[s] + element - (self.segments.element[s] - self.segments.element[first])
            )
            old_patterns[changes] = old[torch.from_numpy(element).to(self.device)].cpu().numpy()
        return positions, old_patterns


@dataclass
class _ChunkOrder:
    """Every rank's segments of a tensor, sorted by start: the chunk of each, how many elements of each class
    come before it in its chunk, its class counts, and its index among this rank's (-1: another's)."""

    chunk: np.ndarray
    before: np.ndarray
    counts: np.ndarray
    local: np.ndarray

    @classmethod
    def gather(cls, starts: np.ndarray, counts: np.ndarray, chunk: int, group) -> _ChunkOrder:
        """All-gather (a collective) every rank's segment starts and class counts."""
        everyone: list = [None] * torch.distributed.get_world_size(group)
        torch.distributed.all_gather_object(everyone, (starts, counts.astype(np.int32)), group=group)
        me = torch.distributed.get_rank(group)
        all_starts = np.concatenate([e[0] for e in everyone])
        all_counts = np.concatenate([e[1] for e in everyone]).astype(np.int64)
        local = np.concatenate([np.where(r == me, np.arange(e[0].size), -1) for r, e in enumerate(everyone)])
        order = np.argsort(all_starts, kind="stable")
        all_counts, chunk_of = all_counts[order], all_starts[order] // chunk
        before = np.cumsum(all_counts, 0) - all_counts  # over the whole window; minus each chunk's first
        before -= before[np.searchsorted(chunk_of, chunk_of)]
        return cls(chunk_of, before, all_counts, local[order])

    def totals(self, chunks: int) -> np.ndarray:
        """[chunks, classes]: the elements of each class in each chunk."""
        totals = np.zeros((chunks, self.counts.shape[1]), np.int64)
        np.add.at(totals, self.chunk, self.counts)
        return totals

    def locate(self, chunk: np.ndarray, cls: np.ndarray, rank: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """For changes by (chunk, class, in-class rank), each inside its chunk: the segment it falls in (the
        last of its chunk to begin at or before its rank among those with elements of its class) and its
        place among that segment's elements of its class."""
        segment = np.empty(rank.size, np.int64)
        for k in range(self.counts.shape[1]):
            of_class = cls == k
            holding = np.flatnonzero(self.counts[:, k] > 0)
            keys = (self.chunk[holding] << 32) + self.before[holding, k]
            wanted = (chunk[of_class] << 32) + rank[of_class]
            segment[of_class] = holding[np.searchsorted(keys, wanted, "right") - 1]
        return segment, rank - self.before[segment, cls]


def decode_held(
    info: PatchInfo,
    entries: dict,
    name: str,
    n: int,
    tables: Tables | None,
    blocks,
    group,
    budget: int = BUDGET,
) -> tuple[TensorChanges, str | None, int]:
    """The changes of `name`'s entry (of `n` elements) that fall on the elements `blocks` hold (positions
    in the whole tensor), and the first problem only this rank can see (a new pattern out of range), which
    the caller must agree on with the other ranks before it raises: a collective runs per compact tensor.
    Also the bytes all-gathered (every rank's segments). Raises PatchError on what every rank sees alike.
    The held values are read `budget` elements at a time (about that many times 10 B of temporaries)."""
    lo = info.windows.get(name, (0, 0))[0]
    entry = held_entry(info, entries, name, n, tables)
    if isinstance(entry, TensorChanges):  # raw
        return TensorChanges(entry.indices.to(torch.int64) + lo, entry.values), None, 0
    if isinstance(entry, torch.Tensor):  # dense: the new values of every element
        new_all, held = entry.view(torch.int16).numpy(), _Held(blocks, lo, n, n, budget)
        moved_at, moved_to = [], []
        for first, last, old in held.batches():
            at = held.segments.positions(first, last)
            moved = new_all[at] != old.cpu().numpy()
            moved_at.append(at[moved])
            moved_to.append(new_all[at][moved])
        return _changes(moved_at, moved_to, lo, held.device), None, 0
    assert isinstance(entry, RankedEntry)
    held = _Held(blocks, lo, n, entry.chunk, budget)
    counts = held.class_counts(entry.limits)
    order = _ChunkOrder.gather(held.segments.start, counts, entry.chunk, group)
    chunks = entry.limits.shape[0]
    if (entry.rank >= order.totals(chunks)[entry.chunk_of, entry.cls]).any():
        raise PatchError(f"{name}: corrupt compact data: a change past the end of its chunk")
    segment, within = order.locate(entry.chunk_of, entry.cls, entry.rank)
    ours = order.local[segment] >= 0
    positions, old_patterns = held.place(
        entry.limits, counts, order.local[segment[ours]], entry.cls[ours], within[ours]
    )
    new, in_range = entry.new_patterns(old_patterns, ours)
    problem = None if in_range else f"{name}: corrupt compact data: a value step leaves the bf16 range"
    gathered = order.chunk.size * (8 + 4 * entry.classes)  # every segment's start and class counts
    return _changes([positions], [new], lo, held.device), problem, gathered


def _changes(
    positions: list[np.ndarray], patterns: list[np.ndarray], lo: int, device: torch.device
) -> TensorChanges:
    p = np.concatenate(positions) if positions else np.empty(0, np.int64)
    v = np.concatenate(patterns) if patterns else np.empty(0, np.int16)
    order = np.argsort(p)
    values = torch.from_numpy(np.ascontiguousarray(v[order]).view(np.int16)).view(torch.bfloat16)
    return TensorChanges(torch.from_numpy(p[order] + lo).to(device), values.to(device))
