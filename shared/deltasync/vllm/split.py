"""Decoding a tensor that tensor-parallel ranks hold in parts, none of them whole (see docs/gpu.md).

A compact chunk codes each change as a rank among the chunk's elements of one class (a range of exponents
of the OLD value). A rank holds only its own segments of the chunk (runs of consecutive elements: a
row-parallel weight cuts every row into one segment per rank, a column-parallel one gives each rank a run
of rows), so it lacks how many elements of each class the other ranks' segments before its own hold. Each
rank counts the classes of its segments, the ranks all-gather those counts (4 int32 and an int64 start per
segment), and each takes prefix sums in chunk order: it then knows the rank of every element it holds,
places the changes that fall on them, and leaves the rest to their holders. The rANS streams are decoded by
every rank (O(changes)), so every rank reaches the same verdict on them.
"""

from __future__ import annotations

import numpy as np
import torch

from deltasync.codec import compact
from deltasync.codec.bf16 import bits
from deltasync.codec.changes import TensorChanges
from deltasync.codec.header import PatchInfo
from deltasync.codec.parallel import parallel_map
from deltasync.codec.patch import chunk_size, chunk_streams, raw_changes
from deltasync.codec.symbols import MAX_CLASSES
from deltasync.errors import PatchError

SEGMENT_BYTES = 8 + 4 * MAX_CLASSES  # what a segment costs in the all-gather: its start and class counts


def held(blocks, lo: int, n: int) -> tuple[np.ndarray, np.ndarray]:
    """The elements of a tensor's window [lo, lo + n) that `blocks` hold: positions in the window (ascending
    int64) and their old patterns (int16)."""
    positions, patterns = [np.empty(0, np.int64)], [np.empty(0, np.int16)]
    for b in blocks:
        p = b.positions().numpy()
        keep = (p >= lo) & (p < lo + n)
        positions.append(p[keep] - lo)
        patterns.append(bits(b.read().cpu()).reshape(-1).numpy()[keep])
    p, v = np.concatenate(positions), np.concatenate(patterns)
    order = np.argsort(p, kind="stable")
    return p[order], v[order]


def decode_held(
    info: PatchInfo, entries: dict, name: str, n: int, tables: compact.Tables | None, blocks, group
) -> tuple[TensorChanges, str | None, int]:
    """The changes of `name`'s entry (of `n` elements) that fall on the elements `blocks` hold (positions
    in the whole tensor), and the first problem only this rank can see (a new pattern out of range), which
    the caller must agree on with the other ranks before it raises: a collective runs per compact tensor.
    Also the bytes all-gathered (every rank's segments). Raises PatchError on what every rank sees alike."""
    from deltasync.codec import kernels  # numba: never at module level (see kernels)

    t = info.tensors[name]
    lo = info.windows.get(name, (0, 0))[0]
    positions, old = held(blocks, lo, n)
    device = blocks[0].dst.device if blocks else torch.device("cpu")
    if t["mode"] == "raw":
        parts = {f"{name}/{p}": entries[f"{name}/{p}"] for p in ("indices", "values")}
        ch = raw_changes(parts, {name: (n,)})[name]
        return TensorChanges(ch.indices.to(torch.int64) + lo, ch.values), None, 0
    if t["mode"] == "dense":
        dense = entries[name]
        if dense.dtype != torch.bfloat16 or dense.numel() != n:
            raise PatchError(f"{name}: dense entry must be bf16 of {n} elements")
        new = bits(dense).reshape(-1).numpy()[positions]
        moved = new != old
        return _changes(positions[moved] + lo, new[moved], device), None, 0
    assert tables is not None  # a compact patch's
    chunk = chunk_size(info)
    streams = chunk_streams(name, entries, n, chunk)
    sizes = [min(chunk, n - s) for s in range(0, n, chunk)]
    try:
        decoded = parallel_map(
            lambda w: compact.ranked_changes(*w, tables), list(zip(streams, sizes, strict=True))
        )
    except compact.CompactDecodeError as e:
        raise PatchError(f"{name}: corrupt compact data: {e}") from None
    limits = np.stack([d[0] for d in decoded])  # [chunks, 3]
    # This rank's segments: runs of consecutive positions, cut at chunk boundaries.
    which = positions // chunk
    first = np.ones(positions.size, bool)
    first[1:] = (np.diff(positions) != 1) | (which[1:] != which[:-1])
    segment = np.cumsum(first) - 1
    starts = positions[first]
    magnitude = (old.astype(np.int32) & 0x7FFF)[:, None]
    cls = (magnitude >= limits[which]).sum(1)
    counts = np.bincount(segment * MAX_CLASSES + cls, minlength=starts.size * MAX_CLASSES)
    counts = counts.reshape(-1, MAX_CLASSES).astype(np.int32)
    # Every rank's segments, in chunk order: how many elements of each class come before each segment.
    everyone: list = [None] * torch.distributed.get_world_size(group)
    torch.distributed.all_gather_object(everyone, (starts, counts), group=group)
    all_starts = np.concatenate([e[0] for e in everyone])
    all_counts = np.concatenate([e[1] for e in everyone]).astype(np.int64)
    order = np.argsort(all_starts, kind="stable")
    all_starts, all_counts = all_starts[order], all_counts[order]
    before = np.cumsum(all_counts, 0) - all_counts  # over the whole window; minus each chunk's first
    chunk_of = all_starts // chunk
    chunk_first = np.searchsorted(chunk_of, chunk_of)
    before -= before[chunk_first]
    totals = np.zeros((len(streams), MAX_CLASSES), np.int64)
    np.add.at(totals, chunk_of, all_counts)
    mine = np.searchsorted(all_starts, starts)
    # The in-class rank of each element held: its segment's start, plus those of its class before it there.
    key = segment * MAX_CLASSES + cls
    by_key = np.argsort(key, kind="stable")
    group_start = np.searchsorted(key[by_key], key[by_key])
    within = np.empty(positions.size, np.int64)
    within[by_key] = np.arange(positions.size) - group_start
    rank = before[mine[segment], cls] + within
    held_key = ((which * MAX_CLASSES + cls) << 32) + rank
    # The decoded changes: which ranks they name, and which of those this rank holds.
    d_chunk = np.repeat(np.arange(len(decoded)), [d[1].size for d in decoded])
    d_cls = np.concatenate([d[1] for d in decoded]).astype(np.int64)
    d_rank = np.concatenate([d[2] for d in decoded])
    if (d_rank >= totals[d_chunk, d_cls]).any():
        raise PatchError(f"{name}: corrupt compact data: a change past the end of its chunk")
    steps = np.concatenate([d[3] for d in decoded]).astype(np.int64)
    raws = np.concatenate([d[4] for d in decoded]).astype(np.int64)
    wanted = ((d_chunk * MAX_CLASSES + d_cls) << 32) + d_rank
    sorted_keys = np.argsort(held_key)
    at = np.searchsorted(held_key[sorted_keys], wanted).clip(max=max(positions.size - 1, 0))
    ours = positions.size > 0
    hit = held_key[sorted_keys[at]] == wanted if ours else np.zeros(wanted.size, bool)
    element = sorted_keys[at[hit]]
    new, in_range = kernels.new_patterns(old[element], steps[hit], raws[hit])
    problem = None if in_range else f"{name}: corrupt compact data: a value step leaves the bf16 range"
    order = np.argsort(positions[element])
    return (
        _changes(positions[element][order] + lo, new[order], device),
        problem,
        all_starts.size * SEGMENT_BYTES,
    )


def _changes(positions: np.ndarray, patterns: np.ndarray, device: torch.device) -> TensorChanges:
    values = torch.from_numpy(np.ascontiguousarray(patterns).view(np.int16)).view(torch.bfloat16)
    return TensorChanges(torch.from_numpy(positions).to(device), values.to(device))
