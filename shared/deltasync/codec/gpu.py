"""The codec's passes over every element, on the GPU that holds the weights (Triton kernels).

- `scan`: change detection, with the fingerprint's move summed as the changes are written (what `make_patch`
  needs): two passes, one host sync for all tensors;
- `state_fingerprint`: the full fingerprint in one pass;
- `chunk_symbols`: the compact encoding's per-element work (the classes of old values, the in-class ranks of
  the changed elements), which deltasync.codec.patch.encode runs where the weights are on CUDA.

The host gets O(changed elements) (positions, old and new patterns, classes, ranks) plus per-chunk histograms,
and runs the rest as the CPU path does (the choice of classes, the symbols, the rANS coder): the patch bytes
are the same, which the tests check through Triton's interpreter on machines with no GPU.

Why Triton: CUDA builds of torch depend on it, so every GPU image that runs torch (vLLM's included) has it;
it compiles at run time with no CUDA toolkit (numba's CUDA target needs NVVM from the toolkit, CuPy is one
more wheel per CUDA version); it takes torch tensors as they are; and its interpreter (TRITON_INTERPRET=1,
set before this module is imported) runs the same kernels on host tensors, which is how CI guards them.

Import this module inside the functions that use it (as deltasync.codec.kernels): it loads Triton.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import numpy as np
import torch
import triton
import triton.language as tl

from deltasync.codec import compact, fingerprint
from deltasync.codec.bf16 import bits
from deltasync.codec.changes import TensorChanges
from deltasync.codec.parallel import parallel_map
from deltasync.codec.symbols import V_SYMBOLS

BLOCK = 1024  # elements per program; divides fingerprint.ROW, so a block's elements share one row weight
ROW: tl.constexpr = tl.constexpr(fingerprint.ROW)
POPULATION_SAMPLE = 14  # log2 of the strided sample that kernels.exponent_histograms takes of a chunk


# ----------------------------------------------------------------------------------------------- kernels


@triton.jit
def _row_weight(row, seed):
    """splitmix64(row ^ seed) | 1 (uint64), as deltasync.codec.fingerprint weighs a row."""
    x = (row.to(tl.int64).to(tl.uint64, bitcast=True) ^ seed.to(tl.int64).to(tl.uint64, bitcast=True)) + (
        0x9E3779B97F4A7C15
    )
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9
    x = (x ^ (x >> 27)) * 0x94D049BB133111EB
    return (x ^ (x >> 31)) | 1


@triton.jit
def _weighted(within, row, seed):
    """An exact in-row sum (int64) times its row's weight, mod 2^64, as int64 bits."""
    return (within.to(tl.uint64, bitcast=True) * _row_weight(row, seed)).to(tl.int64, bitcast=True)


@triton.jit
def _count_changes(old, new, counts, n, BLOCK: tl.constexpr):
    """counts[b]: the changed elements of block b."""
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    valid = offs < n
    a = tl.load(old + offs, mask=valid, other=0)
    b = tl.load(new + offs, mask=valid, other=0)
    tl.store(counts + pid, tl.sum((a != b).to(tl.int32), 0))


@triton.jit
def _write_changes(old, new, starts, positions, old_out, new_out, moves, r1, seed, n, BLOCK: tl.constexpr):
    """The changes of block b at slots starts[b].. (position order), and in moves[b] how they move the
    fingerprint: sum((new - old) * r1[p % ROW]) is exact in int64 (|step| < 2^16, r1 < 2^32), times the
    block's row weight mod 2^64."""
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    valid = offs < n
    a = tl.load(old + offs, mask=valid, other=0)
    b = tl.load(new + offs, mask=valid, other=0)
    changed = a != b
    flag = changed.to(tl.int32)
    slot = tl.load(starts + pid) + (tl.cumsum(flag, 0) - flag)
    tl.store(positions + slot, offs, mask=changed)
    tl.store(old_out + slot, a, mask=changed)
    tl.store(new_out + slot, b, mask=changed)
    r = tl.load(r1 + (offs & (ROW - 1)))
    within = tl.sum((b.to(tl.int64) - a.to(tl.int64)) * r, 0)
    tl.store(moves + pid, _weighted(within, pid.to(tl.int64) * BLOCK // ROW, seed))


@triton.jit
def _fingerprint_rows(x, r1, partial, seed, n):
    """partial[row]: the row's term of the fingerprint (see deltasync.codec.fingerprint)."""
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * ROW + tl.arange(0, ROW)
    v = tl.load(x + offs, mask=offs < n, other=0).to(tl.int64)
    within = tl.sum(v * tl.load(r1 + tl.arange(0, ROW)), 0)  # exact: |v * r1| < 2^47, ROW terms
    tl.store(partial + pid, _weighted(within, pid, seed))


@triton.jit
def _chunk_block(pid, n, chunk, per_chunk, BLOCK: tl.constexpr):
    """Program pid's elements (block pid % per_chunk of chunk c = pid // per_chunk), the valid ones, c."""
    c = (pid // per_chunk).to(tl.int64)
    start = c * chunk + (pid % per_chunk).to(tl.int64) * BLOCK
    offs = start + tl.arange(0, BLOCK)
    valid = offs < tl.minimum(c * chunk + chunk, n)
    return offs, valid, c


@triton.jit
def _classes(x, limits, c):
    """The compact classes of patterns x under chunk c's limits (see deltasync.codec.kernels._class)."""
    m = x.to(tl.int32) & 0x7FFF
    l0, l1, l2 = tl.load(limits + 3 * c), tl.load(limits + 3 * c + 1), tl.load(limits + 3 * c + 2)
    return (m >= l0).to(tl.int32) + (m >= l1).to(tl.int32) + (m >= l2).to(tl.int32)


@triton.jit
def _class_counts(old, limits, counts, n, chunk, per_chunk, BLOCK: tl.constexpr):
    """counts[pid, c]: the elements of class c in program pid's block."""
    pid = tl.program_id(0)
    offs, valid, c = _chunk_block(pid, n, chunk, per_chunk, BLOCK)
    cls = _classes(tl.load(old + offs, mask=valid, other=0), limits, c)
    for k in tl.static_range(4):
        tl.store(counts + 4 * pid + k, tl.sum(((cls == k) & valid).to(tl.int32), 0))


@triton.jit
def _ranks(
    old, marks, limits, class_base, change_base, classes, ranks, n, chunk, per_chunk, BLOCK: tl.constexpr
):
    """The class and in-class rank within its chunk of each changed (marked) element, at its slot in position
    order: class_base[pid, c] class-c elements of the chunk precede the block, change_base[pid] changes."""
    pid = tl.program_id(0)
    offs, valid, c = _chunk_block(pid, n, chunk, per_chunk, BLOCK)
    cls = _classes(tl.load(old + offs, mask=valid, other=0), limits, c)
    changed = (tl.load(marks + offs, mask=valid, other=0) != 0) & valid
    rank = tl.zeros([BLOCK], tl.int32)
    for k in tl.static_range(4):
        member = ((cls == k) & valid).to(tl.int32)
        rank += tl.where(cls == k, tl.load(class_base + 4 * pid + k) + tl.cumsum(member, 0) - member, 0)
    flag = changed.to(tl.int32)
    slot = tl.load(change_base + pid) + (tl.cumsum(flag, 0) - flag)
    tl.store(classes + slot, cls.to(tl.int8), mask=changed)
    tl.store(ranks + slot, rank, mask=changed)


@triton.jit
def _class_order(old, limits, counts, order, n, chunk, per_chunk, BLOCK: tl.constexpr):
    """order[pid, s + i] = the in-block index of the i-th class-c element of program pid's block, s its
    elements of classes below c (counts[pid]): the block's elements sorted by class, stably."""
    pid = tl.program_id(0)
    offs, valid, c = _chunk_block(pid, n, chunk, per_chunk, BLOCK)
    cls = _classes(tl.load(old + offs, mask=valid, other=0), limits, c)
    slot = tl.zeros([BLOCK], tl.int32)
    below = tl.zeros([], tl.int32)
    for k in tl.static_range(4):
        member = ((cls == k) & valid).to(tl.int32)
        slot += tl.where(cls == k, below + tl.cumsum(member, 0) - member, 0)
        below += tl.load(counts + 4 * pid + k)
    tl.store(order + pid.to(tl.int64) * BLOCK + slot, tl.arange(0, BLOCK).to(tl.int16), mask=valid)


@triton.jit
def _moves(positions, before, after, r1, partial, seed, offset, k, BLOCK: tl.constexpr):
    """partial[b]: how changes b * BLOCK.. (positions, old and new patterns; the tensor's positions from
    `offset`) move the fingerprint, mod 2^64 as int64 bits."""
    pid = tl.program_id(0)
    j = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    valid = j < k
    p = tl.load(positions + j, mask=valid, other=0) + offset
    step = tl.load(after + j, mask=valid, other=0).to(tl.int64) - tl.load(before + j, mask=valid, other=0)
    w = tl.load(r1 + (p & (ROW - 1))).to(tl.uint64, bitcast=True) * _row_weight(p // ROW, seed)
    tl.store(partial + pid, tl.sum((step.to(tl.uint64, bitcast=True) * w).to(tl.int64, bitcast=True), 0))


# ----------------------------------------------------------------------------------------------- host side


def _halves(partial: torch.Tensor) -> torch.Tensor:
    """The sums of the low and high 32 bits of `partial` (int64): exact below 2^31 terms, so the host can add
    them mod 2^64 (a plain int64 sum would rely on the device's overflow)."""
    return torch.stack([(partial & 0xFFFFFFFF).sum(), ((partial >> 32) & 0xFFFFFFFF).sum()])


def _wrapped(halves: list[int]) -> int:
    return (halves[0] + (halves[1] << 32)) & fingerprint.MASK64


def _signed(seed: np.uint64) -> int:
    """A uint64 seed as the int64 with its bits, the kernels' argument type."""
    return int(seed) - (1 << 64) if seed >= 1 << 63 else int(seed)


def _blocks(n: int, block: int = BLOCK) -> int:
    return max(1, triton.cdiv(n, block))


def scan(
    pairs: Mapping[str, tuple[torch.Tensor, torch.Tensor]],
) -> tuple[dict[str, TensorChanges], dict[str, int]]:
    """deltasync.codec.changes.diff_and_moves for {name: (old bits, new bits)} (int16, flat, one device):
    the changed elements of each tensor and how they move the fingerprint of the old state. Two kernel passes
    and one host sync for all tensors (to size the outputs)."""
    counts = {}
    for name, (a, b) in pairs.items():
        counts[name] = torch.empty(_blocks(a.numel()), dtype=torch.int32, device=a.device)
        _count_changes[(counts[name].numel(),)](a, b, counts[name], a.numel(), BLOCK=BLOCK)
    if not counts:
        return {}, {}
    totals = torch.stack([c.sum(dtype=torch.int64) for c in counts.values()]).tolist()
    changes, halves = {}, []
    for (name, (a, b)), total in zip(pairs.items(), totals, strict=True):
        if not total:
            continue
        starts = counts[name].cumsum(0) - counts[name]
        positions = torch.empty(total, dtype=torch.int64, device=a.device)
        before, after = (torch.empty(total, dtype=torch.int16, device=a.device) for _ in range(2))
        moves = torch.empty(counts[name].numel(), dtype=torch.int64, device=a.device)
        seed = _signed(fingerprint.seed(name))
        grid = (moves.numel(),)
        _write_changes[grid](
            a,
            b,
            starts,
            positions,
            before,
            after,
            moves,
            fingerprint.r1_on(a.device),
            seed,
            a.numel(),
            BLOCK=BLOCK,
        )
        changes[name] = TensorChanges(positions, after.view(torch.bfloat16))
        halves.append(_halves(moves))
    moved = torch.stack(halves).tolist() if halves else []
    return changes, {name: _wrapped(h) for name, h in zip(changes, moved, strict=True)}


def state_fingerprint(state: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]) -> int:
    """deltasync.codec.fingerprint.state_fingerprint in one kernel pass per tensor and one host sync."""
    halves = []
    for name, t in state.items() if isinstance(state, Mapping) else state:
        x = bits(t)
        partial = torch.empty(_blocks(x.numel(), fingerprint.ROW), dtype=torch.int64, device=x.device)
        _fingerprint_rows[(partial.numel(),)](
            x, fingerprint.r1_on(x.device), partial, _signed(fingerprint.seed(name)), x.numel()
        )
        halves.append(_halves(partial))
    if not halves:
        return 0
    return sum(_wrapped(h) for h in torch.stack(halves).tolist()) & fingerprint.MASK64


# ----------------------------------------------------------------------------------------------- compact


def _histograms(x: torch.Tensor, idx: torch.Tensor, chunk: int) -> torch.Tensor:
    """Per chunk, the exponent counts of the strided sample of its old values that
    kernels.exponent_histograms takes (not yet scaled by the stride) and of its changed old values:
    int64 [chunks, 2, 256]."""
    n = x.numel()
    chunks = -(-n // chunk)
    samples = []
    for first, count, size in (
        (0, n // chunk, chunk),
        (n // chunk, chunks - n // chunk, n - n // chunk * chunk),
    ):
        if count:  # the full chunks, then a shorter last one
            stride = max(1, size >> POPULATION_SAMPLE)
            within = torch.arange(0, size, stride, device=x.device)
            starts = torch.arange(first, first + count, device=x.device) * chunk
            samples.append((starts[:, None] + within[None, :]).reshape(-1))
    sample = torch.cat(samples)
    population = torch.bincount((sample // chunk) * 256 + ((x[sample] >> 7) & 0xFF), minlength=chunks * 256)
    changed = torch.bincount((idx // chunk) * 256 + ((x[idx] >> 7) & 0xFF), minlength=chunks * 256)
    return torch.stack([population.view(chunks, 256), changed.view(chunks, 256)], 1)


def _choose_classes(
    flat: Mapping[str, torch.Tensor], idx: Mapping[str, torch.Tensor], chunk: int, threads: int | None
) -> dict[str, list[tuple[list[int], float]]]:
    """Per tensor, per chunk: the class bounds kernels.choose_bounds picks and their cost, from the exponent
    histograms that kernels.exponent_histograms would count, counted on the device (one copy to the host)."""
    from deltasync.codec import kernels  # not at import time: see deltasync.codec.kernels

    def choose(work: tuple[np.ndarray, np.ndarray]) -> tuple[list[int], float]:
        bounds, position_bits = kernels.choose_bounds(*work)
        return bounds.tolist(), float(position_bits)

    hists = fingerprint.to_host([_histograms(x, idx[name], chunk) for name, x in flat.items()])
    work = []
    for x, h in zip(flat.values(), hists, strict=True):
        sizes = np.minimum(chunk, x.numel() - np.arange(0, x.numel(), chunk))
        strides = np.maximum(1, sizes >> POPULATION_SAMPLE).astype(np.float64)
        work += [
            (population * stride, changed.astype(np.float64))
            for (population, changed), stride in zip(h, strides, strict=True)
        ]
    chosen = iter(parallel_map(choose, work, threads))
    return {name: [next(chosen) for _ in h] for name, h in zip(flat, hists, strict=True)}


def _ranked(x: torch.Tensor, idx: torch.Tensor, limits: torch.Tensor, chunk: int) -> tuple[torch.Tensor, ...]:
    """The class (int8) and in-class rank within its chunk (int32) of each change at `idx` (sorted) to the
    patterns `x`, the chunks being split into classes by `limits` (int32 [chunks, 3]); and per chunk the
    class sizes (int64 [chunks, 4]) and the number of changes, flat (int64)."""
    n, chunks = x.numel(), limits.shape[0]
    per_chunk = _blocks(min(chunk, n))
    programs = chunks * per_chunk
    counts = torch.empty((programs, 4), dtype=torch.int32, device=x.device)
    _class_counts[(programs,)](x, limits, counts, n, chunk, per_chunk, BLOCK=BLOCK)
    inclusive = counts.view(chunks, per_chunk, 4).cumsum(1, dtype=torch.int32)
    class_base = (inclusive.view(programs, 4) - counts).contiguous()
    per_block = torch.bincount((idx // chunk) * per_chunk + (idx % chunk) // BLOCK, minlength=programs)
    marks = torch.zeros(n, dtype=torch.int8, device=x.device)
    marks[idx] = 1
    classes = torch.empty(idx.numel(), dtype=torch.int8, device=x.device)
    ranks = torch.empty(idx.numel(), dtype=torch.int32, device=x.device)
    change_base = per_block.cumsum(0) - per_block
    _ranks[(programs,)](
        x, marks, limits, class_base, change_base, classes, ranks, n, chunk, per_chunk, BLOCK=BLOCK
    )
    sizes = inclusive[:, -1, :].to(torch.int64).reshape(-1)
    return classes, ranks, torch.cat([sizes, torch.bincount(idx // chunk, minlength=chunks)])


def chunk_symbols(
    changes: Mapping[str, TensorChanges],
    old: Mapping[str, torch.Tensor],
    chunk: int,
    threads: int | None = None,
) -> dict[str, list[compact.Symbols]]:
    """The compact symbols of every chunk of every changed tensor, as deltasync.codec.patch.host_symbols
    makes them, with the passes over all elements on the device of each of `old`'s tensors; the host gets
    O(changes) and the per-chunk exponent histograms, and finds the symbols on `threads` threads."""
    flat = {name: bits(old[name]) for name in changes}
    idx = {name: ch.indices.to(flat[name].device) for name, ch in changes.items()}
    chosen = _choose_classes(flat, idx, chunk, threads)
    found = []
    for name, x in flat.items():
        limits = np.stack([compact._limits(bounds) for bounds, _ in chosen[name]]).astype(np.int32)
        patterns = torch.stack([x[idx[name]], bits(changes[name].values).to(x.device)])  # old, new
        found.append((*_ranked(x, idx[name], torch.from_numpy(limits).to(x.device), chunk), patterns))
    on_host = zip(*(fingerprint.to_host(list(part)) for part in zip(*found, strict=True)), strict=True)

    pieces = []  # (bounds, position bits, classes, ranks, class sizes, old, new) of every chunk
    for (cls, ranks, counts, patterns), parts in zip(on_host, chosen.values(), strict=True):
        sizes, cuts = counts[: 4 * len(parts)].reshape(-1, 4), np.cumsum(counts[4 * len(parts) :])
        for c, (bounds, position_bits) in enumerate(parts):
            part = slice(cuts[c - 1] if c else 0, cuts[c])
            pieces.append((bounds, position_bits, cls[part], ranks[part], sizes[c], *patterns[:, part]))
    made = iter(parallel_map(lambda piece: compact.ranked_symbols(*piece), pieces, threads))
    return {name: [next(made) for _ in parts] for name, parts in chosen.items()}


# ----------------------------------------------------------------------------------------------- decode


def decode_compact(
    name: str,
    streams: list[bytes],
    old: torch.Tensor,
    chunk: int,
    tables: compact.Tables,
    threads: int | None = None,
    offset: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """What deltasync.codec.patch.decode makes of tensor `name`'s compact chunk streams against its old
    values `old` (bf16, on their device; elements offset.. of the tensor for the fingerprint): the changed
    positions (int64, ascending), their new patterns (int16) and the fingerprint's move. The rANS streams are
    decoded on `threads` host threads (O(changes)); classes and positions on the device. Raises
    CompactDecodeError where a stream cannot be what an encoder wrote."""
    from deltasync.codec import kernels  # not at import time: see deltasync.codec.kernels

    x = bits(old)
    n, device = x.numel(), x.device
    if len(streams) != -(-n // chunk):
        raise compact.CompactDecodeError(f"{len(streams)} chunks, {n} elements need {-(-n // chunk)}")
    sizes = [min(chunk, n - lo) for lo in range(0, n, chunk)]
    chunks = parallel_map(
        lambda work: compact.ranked_changes(*work, tables), list(zip(streams, sizes, strict=True)), threads
    )
    limits, cls, ranks, steps, raws = (np.concatenate(part) for part in zip(*chunks, strict=True))
    which = np.repeat(np.arange(len(chunks)), [c[1].size for c in chunks])
    limits_on, cls_on, ranks_on, steps_on, raws_on, which_on = (
        torch.from_numpy(a).to(device) for a in (limits.astype(np.int32), cls, ranks, steps, raws, which)
    )
    per_chunk = _blocks(min(chunk, n))
    programs = len(chunks) * per_chunk
    counts = torch.empty((programs, 4), dtype=torch.int32, device=device)
    _class_counts[(programs,)](x, limits_on, counts, n, chunk, per_chunk, BLOCK=BLOCK)
    inclusive = counts.view(len(chunks), per_chunk, 4).cumsum(1)
    order = torch.empty(programs * BLOCK, dtype=torch.int16, device=device)
    _class_order[(programs,)](x, limits_on, counts, order, n, chunk, per_chunk, BLOCK=BLOCK)
    # The block of each change: the first of its chunk whose running count of its class passes its rank.
    cls64 = cls_on.to(torch.int64)
    group = cls64 * len(chunks) + which_on
    keys = (
        (torch.arange(4 * len(chunks), device=device)[:, None] << 32)
        + inclusive.permute(2, 0, 1).reshape(4 * len(chunks), per_chunk)
    ).reshape(-1)
    found = torch.searchsorted(keys, (group << 32) + ranks_on, right=True)
    beyond = ranks_on >= inclusive[which_on, -1, cls64]  # past its class in its chunk
    program = which_on * per_chunk + found.clamp(max=keys.numel() - 1) % per_chunk
    within = ranks_on - (inclusive.view(programs, 4) - counts)[program, cls64]
    below = (counts.cumsum(1) - counts)[program, cls64]
    slot = (program * BLOCK + below + within).clamp(0, order.numel() - 1)
    positions = which_on * chunk + (program % per_chunk) * BLOCK + order[slot].to(torch.int64)
    positions, sort = torch.sort(positions)
    before = x[positions.clamp(0, n - 1)]
    step, raw = steps_on[sort], raws_on[sort]
    value = before.to(torch.int64) + ((step >> 1) ^ -(step & 1))
    escaped = step == V_SYMBOLS
    out_of_range = ~escaped & ((value < -(1 << 15)) | (value >= 1 << 15))
    status = torch.stack([beyond.any(), out_of_range.any()]).tolist()
    for code, failed in enumerate(status, 1):
        if failed:
            raise compact.CompactDecodeError(kernels.DECODE_ERRORS[code])
    after = torch.where(escaped, raw - ((raw & 0x8000) << 1), value).to(torch.int16)  # signed patterns
    partial = torch.empty(_blocks(positions.numel()), dtype=torch.int64, device=device)
    _moves[(partial.numel(),)](
        positions, before, after, fingerprint.r1_on(device), partial, _signed(fingerprint.seed(name)), offset,
        positions.numel(), BLOCK=BLOCK,
    )  # fmt: skip
    return positions, after, _wrapped(_halves(partial).tolist())
