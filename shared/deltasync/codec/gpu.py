"""The codec's passes over every element, on the GPU that holds the weights (Triton kernels).

- `scan`: change detection, with the fingerprint's move summed as the changes are written (what `make_patch`
  needs): two passes, one host sync per device for all tensors;
- `state_fingerprint`: the full fingerprint in one pass;
- `compact_streams`: the compact encoding where the weights are on CUDA (deltasync.codec.patch.encode runs
  it): the classes of old values, the in-class ranks and symbols of the changed elements, then the rANS
  coder, a program per chunk for every chunk of the patch at once; the host chooses the classes and pools
  the models from per-chunk histograms, and gets the coded bytes;
- `PatchSymbols`: the replica's counterpart, against old weights on the GPU; `moves`: the fingerprint's
  move of changes there;
- `CudaBackend`: all of them as the codec's backend for CUDA tensors (deltasync.codec.backend).

The patch bytes and decoded changes are the CPU path's, which the tests check through Triton's interpreter
on machines with no GPU.

Why Triton: CUDA builds of torch depend on it, so every GPU image that runs torch (vLLM's included) has it;
it compiles at run time with no CUDA toolkit (numba's CUDA target needs NVVM from the toolkit, CuPy is one
more wheel per CUDA version); it takes torch tensors as they are; and its interpreter (TRITON_INTERPRET=1,
set before this module is imported) runs the same kernels on host tensors, which is how CI guards them.

It loads Triton: deltasync.codec.backend imports it where a GPU holds the weights.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Mapping

import numpy as np
import torch
import triton
import triton.language as tl

from deltasync.codec import compact, fingerprint
from deltasync.codec.accelerator import indexed_write
from deltasync.codec.backend import Backend, Decoder, Move, Pairs, TensorChanges
from deltasync.codec.bf16 import bits
from deltasync.codec.parallel import parallel_map
from deltasync.codec.symbols import ANS_SCALE, MAX_CLASSES, Q_SYMBOLS, V_SYMBOLS

BLOCK = 1024  # elements per program; divides fingerprint.ROW, so a block's elements share one row weight
ROW: tl.constexpr = tl.constexpr(fingerprint.ROW)
SCALE: tl.constexpr = tl.constexpr(ANS_SCALE)
SLOTS: tl.constexpr = tl.constexpr(1 << ANS_SCALE)
Q: tl.constexpr = tl.constexpr(Q_SYMBOLS)
V: tl.constexpr = tl.constexpr(V_SYMBOLS)
LOW: tl.constexpr = tl.constexpr(1 << 16)  # deltasync.codec.kernels.ANS_LOW (that module loads numba)
RENORM: tl.constexpr = tl.constexpr((1 << 16 >> ANS_SCALE) << 16)  # and its _ANS_RENORM
GROUP_CHANGES = 1 << 22  # changes PatchSymbols decodes at once (~200 B of temporaries each)
GROUP_ELEMENTS = 1 << 28  # and elements of their tensors (2 B of scratch each)
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
def _moves(positions, before, after, r1, partial, seed, k, BLOCK: tl.constexpr):
    """partial[b]: how changes b * BLOCK.. (positions in the tensor, old and new patterns) move the
    fingerprint, mod 2^64 as int64 bits."""
    pid = tl.program_id(0)
    j = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    valid = j < k
    p = tl.load(positions + j, mask=valid, other=0)
    step = tl.load(after + j, mask=valid, other=0).to(tl.int64) - tl.load(before + j, mask=valid, other=0)
    w = tl.load(r1 + (p & (ROW - 1))).to(tl.uint64, bitcast=True) * _row_weight(p // ROW, seed)
    tl.store(partial + pid, tl.sum((step.to(tl.uint64, bitcast=True) * w).to(tl.int64, bitcast=True), 0))


@triton.jit
def _word(data, at, end):
    """The little-endian 16-bit ANS word at byte `at` of data, 0 at or past `end`."""
    inside = at < end
    low = tl.load(data + at, mask=inside, other=0).to(tl.int64)
    return low | (tl.load(data + at + 1, mask=inside, other=0).to(tl.int64) << 8)


@triton.jit
def _ans_decode(data, chunks, freq, cum, slots, symbols, status, total):
    """deltasync.codec.kernels.ans_decode's coder for chunk pid, one program (one sequential state) per
    chunk: its ANS symbols at symbols[t] (quotient models) and symbols[total + t] (value models), t its
    changes' slots; status[pid] = 1 where the stream is truncated or does not end where its symbols do.
    chunks[pid]: byte offset of the ANS words, their end, then the slots where classes 0..4 start."""
    pid = tl.program_id(0)
    row = chunks + 7 * pid.to(tl.int64)
    at, end = tl.load(row), tl.load(row + 1)
    bad = end - at < 4
    x = (_word(data, at, end) << 16) | _word(data, at + 2, end)
    at += 4
    for half in tl.static_range(2):
        for c in tl.static_range(4):
            m = half * 4 + c
            for t in range(tl.load(row + 2 + c), tl.load(row + 3 + c)):
                slot = x & (SLOTS - 1)
                s = tl.load(slots + m * SLOTS + slot).to(tl.int64)
                x = tl.load(freq + m * Q + s) * (x >> SCALE) + slot - tl.load(cum + m * (Q + 1) + s)
                if x < LOW:
                    bad = bad | (at >= end)
                    x = (x << 16) | _word(data, at, end)
                    at += 2
                tl.store(symbols + half * total + t, s.to(tl.int8))
    tl.store(status + pid, (bad | (x != LOW) | (at != end)).to(tl.int8))


@triton.jit
def _ans_encode(q, r, v, rows, rice, freq, cum, words, raw, firsts):
    """deltasync.codec.kernels.ans_encode for chunk pid, one program per chunk: its ANS words pushed down
    from words[rows[pid, 0]] (firsts[pid]: where they begin) and its raw bits at raw[rows[pid, 1]]..; the
    chunk's symbols are q, r, v[rows[pid, 2 + c]..rows[pid, 3 + c]] for classes c = 0..3."""
    pid = tl.program_id(0)
    row = rows + 7 * pid.to(tl.int64)
    at = tl.load(row)
    x = tl.full([], LOW, tl.int64)
    for h in tl.static_range(2):  # ANS is a stack: the symbols are pushed in reverse
        for cc in tl.static_range(4):
            m = (1 - h) * 4 + 3 - cc
            lo, hi = tl.load(row + 5 - cc), tl.load(row + 6 - cc)
            for i in range(hi - lo):
                t = hi - 1 - i
                if h == 0:
                    s = tl.minimum(tl.load(v + t), V).to(tl.int64) - 1
                else:
                    s = tl.minimum(tl.load(q + t), Q - 1).to(tl.int64)
                f = tl.load(freq + m * Q + s)
                if x >= RENORM * f:
                    at -= 1
                    tl.store(words + at, x.to(tl.int16))
                    x = x >> 16
                x = (x // f) * SLOTS + x % f + tl.load(cum + m * (Q + 1) + s)
    tl.store(words + at - 1, x.to(tl.int16))
    tl.store(words + at - 2, (x >> 16).to(tl.int16))
    tl.store(firsts + pid, at - 2)
    out = tl.load(row + 1)
    held = tl.full([], 0, tl.int64)
    count = tl.full([], 0, tl.int64)
    for c in tl.static_range(4):  # each remainder and escaped quotient, then each escaped value
        bits = tl.load(rice + 4 * pid.to(tl.int64) + c)
        for t in range(tl.load(row + 2 + c), tl.load(row + 3 + c)):
            held |= tl.load(r + t).to(tl.int64) << count
            count += bits
            quotient = tl.load(q + t).to(tl.int64)
            if quotient >= Q - 1:
                held |= (quotient - (Q - 1)) << count
                count += 32
            while count >= 8:
                tl.store(raw + out, held.to(tl.uint8))
                out, held, count = out + 1, held >> 8, count - 8
    for c in tl.static_range(4):
        for t in range(tl.load(row + 2 + c), tl.load(row + 3 + c)):
            value = tl.load(v + t).to(tl.int64)
            if value >= V:
                held |= (value & 0xFFFF) << count
                count += 16
                while count >= 8:
                    tl.store(raw + out, held.to(tl.uint8))
                    out, held, count = out + 1, held >> 8, count - 8
    if count > 0:
        tl.store(raw + out, held.to(tl.uint8))


# ----------------------------------------------------------------------------------------------- host side


def _launch(kernel: triton.JITFunction, programs: int, *args, **meta) -> None:
    """`kernel` over `programs` programs, on the device of its first argument (a tensor): Triton launches on
    the current CUDA device, and a process may hold tensors on several."""
    device = args[0].device
    with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
        kernel[(programs,)](*args, **meta)


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
    """deltasync.codec.changes.diff_and_moves for {name: (old bits, new bits)} (int16, flat, each pair on one
    device): the changed elements of each tensor and how they move the fingerprint of the old state. Two
    kernel passes and one host sync per device for all tensors (to size the outputs)."""
    counts = {}
    for name, (a, b) in pairs.items():
        counts[name] = torch.empty(_blocks(a.numel()), dtype=torch.int32, device=a.device)
        _launch(_count_changes, counts[name].numel(), a, b, counts[name], a.numel(), BLOCK=BLOCK)
    if not counts:
        return {}, {}
    totals = [int(t) for t in fingerprint.to_host([c.sum(dtype=torch.int64) for c in counts.values()])]
    changes, halves = {}, []
    for (name, (a, b)), total in zip(pairs.items(), totals, strict=True):
        if not total:
            continue
        starts = counts[name].cumsum(0) - counts[name]
        positions = torch.empty(total, dtype=torch.int64, device=a.device)
        before, after = (torch.empty(total, dtype=torch.int16, device=a.device) for _ in range(2))
        moves = torch.empty(counts[name].numel(), dtype=torch.int64, device=a.device)
        seed = _signed(fingerprint.seed(name))
        _launch(
            _write_changes,
            moves.numel(),
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
    moved = fingerprint.to_host(halves)
    return changes, {name: _wrapped(h.tolist()) for name, h in zip(changes, moved, strict=True)}


def state_fingerprint(state: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]) -> int:
    """deltasync.codec.fingerprint.state_fingerprint: one kernel pass per tensor, one host sync per device."""
    halves = []
    for name, t in state.items() if isinstance(state, Mapping) else state:
        x = bits(t)
        partial = torch.empty(_blocks(x.numel(), fingerprint.ROW), dtype=torch.int64, device=x.device)
        seed = _signed(fingerprint.seed(name))
        _launch(_fingerprint_rows, partial.numel(), x, fingerprint.r1_on(x.device), partial, seed, x.numel())
        halves.append(_halves(partial))
    return total_move(halves)


def moves(name: str, positions: torch.Tensor, before: torch.Tensor, after: torch.Tensor) -> torch.Tensor:
    """How changes of tensor `name` (positions, int64; old and new patterns, int16; all on one device) move
    its fingerprint: two int64 halves on that device, for `total_move`."""
    device, seed = positions.device, _signed(fingerprint.seed(name))
    partial = torch.empty(_blocks(positions.numel()), dtype=torch.int64, device=device)
    _launch(
        _moves, partial.numel(), positions, before, after, fingerprint.r1_on(device), partial, seed,
        positions.numel(), BLOCK=BLOCK,
    )  # fmt: skip
    return _halves(partial)


def total_move(halves: list[torch.Tensor]) -> int:
    """The sum mod 2^64 of `moves` results (or fingerprints' halves): one host sync for all of them."""
    return sum(_wrapped(h.tolist()) for h in fingerprint.to_host(halves)) & fingerprint.MASK64


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
    patterns `x`, the chunks being split into classes by `limits` (int32 [chunks, 3]); and per chunk and
    class its size and its changes (int64, [chunks * 4] each, one after the other)."""
    n, chunks = x.numel(), limits.shape[0]
    per_chunk = _blocks(min(chunk, n))
    programs = chunks * per_chunk
    counts = torch.empty((programs, 4), dtype=torch.int32, device=x.device)
    _launch(_class_counts, programs, x, limits, counts, n, chunk, per_chunk, BLOCK=BLOCK)
    inclusive = counts.view(chunks, per_chunk, 4).cumsum(1, dtype=torch.int32)
    class_base = (inclusive.view(programs, 4) - counts).contiguous()
    per_block = torch.bincount((idx // chunk) * per_chunk + (idx % chunk) // BLOCK, minlength=programs)
    marks = torch.zeros(n, dtype=torch.int8, device=x.device)
    marks[idx] = 1
    classes = torch.empty(idx.numel(), dtype=torch.int8, device=x.device)
    ranks = torch.empty(idx.numel(), dtype=torch.int32, device=x.device)
    change_base = per_block.cumsum(0) - per_block
    _launch(
        _ranks, programs, x, marks, limits, class_base, change_base, classes, ranks, n, chunk, per_chunk,
        BLOCK=BLOCK,
    )  # fmt: skip
    sizes = inclusive[:, -1, :].to(torch.int64).reshape(-1)
    changed = torch.bincount((idx // chunk) * 4 + classes, minlength=4 * chunks)
    return classes, ranks, torch.cat([sizes, changed])


def _symbols(
    idx: torch.Tensor,
    cls: torch.Tensor,
    ranks: torch.Tensor,
    patterns: torch.Tensor,
    rice: torch.Tensor,
    chunk: int,
    out: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
) -> torch.Tensor:
    """kernels.ranked_symbols for every chunk of a tensor at once: the changes at `idx` (sorted) grouped by
    chunk and class (position order within), their Rice quotients, remainders and value symbols written to
    `out` (int32), and per chunk and class the histograms of the capped quotient and value symbols (int64
    [chunks * 4, 48]); `rice` per chunk and class (int64 [chunks * 4])."""
    group, order = torch.sort((idx // chunk) * 4 + cls, stable=True)
    rank = ranks[order].to(torch.int64)
    first_of_group = torch.ones_like(group, dtype=torch.bool)
    first_of_group[1:] = group[1:] != group[:-1]
    gap, k = rank - torch.where(first_of_group, -1, torch.roll(rank, 1)) - 1, rice[group]
    q, r = gap >> k, gap & ((torch.ones_like(k) << k) - 1)
    old, new = patterns[0, order].to(torch.int64), patterns[1, order].to(torch.int64)
    zigzag = ((new - old) << 1) ^ ((new - old) >> 63)
    v = torch.where(zigzag < V_SYMBOLS, zigzag, (new & 0xFFFF) + (V_SYMBOLS << 16))
    groups = rice.numel()
    q_hist = torch.bincount(group * Q_SYMBOLS + q.clamp(max=Q_SYMBOLS - 1), minlength=groups * Q_SYMBOLS)
    v_hist = torch.bincount(group * V_SYMBOLS + v.clamp(max=V_SYMBOLS) - 1, minlength=groups * V_SYMBOLS)
    for target, symbol in zip(out, (q, r, v), strict=True):
        target.copy_(symbol)
    return torch.cat([q_hist.view(groups, Q_SYMBOLS), v_hist.view(groups, V_SYMBOLS)], 1)


def _code(
    symbols: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    changed: np.ndarray,
    rice: np.ndarray,
    escapes: np.ndarray,
    tables: compact.Tables,
) -> list[tuple[np.ndarray, bytes]]:
    """kernels.ans_encode of every chunk at once, a program per chunk: each chunk's ANS words and raw bits.
    `symbols`: every chunk's quotients, remainders and values (_symbols); per chunk and class [chunks, 4]:
    `changed`, `rice`, and in `escapes` [chunks, 4, 2] the escaped quotients and values."""
    q, r, v = symbols
    device = q.device
    raw_bits = (changed * rice + escapes @ np.array([32, 16])).sum(1)  # remainders, escaped quotients, values
    raw_bytes = (raw_bits + 7) // 8
    raw_at = np.cumsum(raw_bytes) - raw_bytes
    k = changed.sum(1)
    word_ends = np.cumsum(2 * k + 2)  # a push emits at most one word
    class_starts = (np.cumsum(k) - k)[:, None] + np.pad(changed.cumsum(1), ((0, 0), (1, 0)))
    rows = np.column_stack([word_ends, raw_at, class_starts])
    on = {
        key: torch.from_numpy(np.ascontiguousarray(a)).to(device)
        for key, a in {"rows": rows, "rice": rice, "freq": tables.freq, "cum": tables.cum}.items()
    }
    words = torch.empty(int(word_ends[-1]), dtype=torch.int16, device=device)
    raw = torch.empty(int(raw_bytes.sum()), dtype=torch.uint8, device=device)
    firsts = torch.empty(len(k), dtype=torch.int64, device=device)
    _launch(
        _ans_encode, len(k), q, r, v, on["rows"], on["rice"], on["freq"], on["cum"], words, raw, firsts,
        num_warps=1,  # one scalar chain per program
    )  # fmt: skip
    first = firsts.tolist()
    used = torch.cat([words[a:b] for a, b in zip(first, word_ends.tolist(), strict=True)]).cpu().numpy()
    pieces = np.split(used, np.cumsum(word_ends - first)[:-1])
    raw_on_host = raw.cpu().numpy().tobytes()
    return [
        (w, raw_on_host[a : a + n])
        for w, a, n in zip(pieces, raw_at.tolist(), raw_bytes.tolist(), strict=True)
    ]


def compact_streams(
    changes: Mapping[str, TensorChanges],
    old: Mapping[str, torch.Tensor],
    chunk: int,
    threads: int | None = None,
) -> tuple[dict[str, bytes], compact.Models]:
    """deltasync.codec.patch.host_streams with the passes over all elements and the rANS coder on the device
    of each of `old`'s tensors (the same bytes): per chunk the classes chosen on the host (`threads`
    threads) from exponent histograms counted on the device; the ranks and symbols on the device; the
    models pooled on the host from per-chunk histograms; then one program per chunk, every chunk at once,
    codes its symbols, and the host gets the coded bytes (O(changes) of them, never the changes)."""
    from deltasync.codec import kernels  # not at import time: see deltasync.codec.kernels

    flat = {name: bits(old[name]) for name in changes}
    idx = {name: ch.indices.to(flat[name].device) for name, ch in changes.items()}
    chosen = _choose_classes(flat, idx, chunk, threads)
    ranked = {}
    for name, x in flat.items():
        limits = np.stack([compact._limits(bounds) for bounds, _ in chosen[name]]).astype(np.int32)
        patterns = torch.stack([x[idx[name]], bits(changes[name].values).to(x.device)])  # old, new
        ranked[name] = (*_ranked(x, idx[name], torch.from_numpy(limits).to(x.device), chunk), patterns)
    counts = fingerprint.to_host([ranked[name][2] for name in ranked])

    coded = {}  # the tensors worth coding: per chunk and class, their changes and Rice parameters
    for (name, parts), per_class in zip(chosen.items(), counts, strict=True):
        sizes, changed = per_class.reshape(2, -1, 4)
        estimated = [
            position_bits + 1.5 * k for (_, position_bits), k in zip(parts, changed.sum(1), strict=True)
        ]
        if compact.worth_coding(estimated, flat[name].numel()):
            rice = np.vectorize(kernels.rice_parameter, otypes=[np.int64])(sizes, changed)
            coded[name] = (changed, rice)
        else:  # stored dense
            del ranked[name]
    models = compact.Models()
    if not coded:
        return {}, models
    device = next(iter(flat.values())).device
    cuts = np.cumsum([changed.sum() for changed, _ in coded.values()])
    q, r, v = (torch.empty(int(cuts[-1]), dtype=torch.int32, device=device) for _ in range(3))
    per_chunk = []
    for (name, (_, rice)), end, size in zip(coded.items(), cuts, np.diff(cuts, prepend=0), strict=True):
        cls, ranks, _, patterns = ranked.pop(name)  # (freed as it goes)
        here = slice(end - size, end)
        rice_on = torch.from_numpy(rice.reshape(-1)).to(device)
        per_chunk.append(
            _symbols(idx[name], cls, ranks, patterns, rice_on, chunk, (q[here], r[here], v[here]))
        )
    hists = np.concatenate(fingerprint.to_host(per_chunk)).reshape(-1, 4, Q_SYMBOLS + V_SYMBOLS)
    models.q += hists[:, :, :Q_SYMBOLS].sum(0)
    models.v += hists[:, :, Q_SYMBOLS:].sum(0)
    changed, rice = (np.concatenate([c[i] for c in coded.values()]) for i in range(2))
    escapes = hists[:, :, [Q_SYMBOLS - 1, -1]]  # quotients of Q_SYMBOLS - 1 and up, values of V_SYMBOLS
    chunks = iter(_code((q, r, v), changed, rice, escapes, models.tables()))
    streams = {
        name: compact.join_chunks(
            [
                compact.chunk_stream(bounds, n.tolist(), k.tolist(), *next(chunks))
                for (bounds, _), n, k in zip(chosen[name], changed_of, rice_of, strict=True)
            ]
        )
        for name, (changed_of, rice_of) in coded.items()
    }
    return streams, models


# ----------------------------------------------------------------------------------------------- decode


Decoded = tuple[torch.Tensor, torch.Tensor] | compact.CompactDecodeError


def _segment_sums(values: torch.Tensor, segment: torch.Tensor, segments: int) -> tuple[torch.Tensor, ...]:
    """The running sum of `values` (along dim 0) up to and including each one within its segment (segments
    consecutive), and each segment's sum."""
    sums = torch.zeros((segments, *values.shape[1:]), dtype=values.dtype, device=values.device)
    sums.index_add_(0, segment, values)
    return values.cumsum(0) - (sums.cumsum(0) - sums)[segment], sums


def _take_bits(data: torch.Tensor, at: torch.Tensor, n: torch.Tensor | int) -> torch.Tensor:
    """The n (<= 32) bits of the LSB-first bit stream `data` (uint8, 8 bytes of padding) from bit `at`."""
    byte = (at >> 3).clamp(0, data.numel() - 5)
    word = sum(data[byte + i].to(torch.int64) << (8 * i) for i in range(5))
    return (word >> (at & 7)) & ((torch.ones_like(at) << n) - 1)


class PatchSymbols(Decoder):
    """deltasync.codec.patch.decode's compact tensors, decoded on `device` against old values where they live.

    The rANS stage first, for every chunk of the patch: the headers on the host, then the coder in one program
    per chunk, every chunk side by side (a chunk is one sequential state: the GPU's width comes from running
    them all at once), 2 bytes per change kept. Then on demand (`changes`), a run of tensors at a time
    (GROUP_CHANGES, GROUP_ELEMENTS): their raw bits and ranks, two passes over each one's old values, and
    every change's position and new pattern, in one set of launches and one host sync for the run, since a
    patch has hundreds of small tensors. Errors are the host decoder's (CompactDecodeError, with the tensor
    in its `tensor` attribute), each raised when its tensor is asked for."""

    def __init__(
        self,
        streams: Mapping[str, list[bytes]],
        numels: Mapping[str, int],
        chunk: int,
        tables: compact.Tables,
        device: torch.device,
        old_values: Callable[[str], torch.Tensor],
    ) -> None:
        layouts, sizes, self.spans = [], [], {}
        for name, parts in streams.items():
            try:
                need = -(-numels[name] // chunk)
                if len(parts) != need:
                    message = f"{len(parts)} chunks, {numels[name]} elements need {need}"
                    raise compact.CompactDecodeError(message)
                for c, part in enumerate(parts):
                    sizes.append(min(chunk, numels[name] - c * chunk))
                    layouts.append(compact.chunk_layout(part, sizes[-1], tables))
            except compact.CompactDecodeError as e:
                e.tensor = name
                raise
        counts = np.array([np.diff(lay.starts) for lay in layouts], np.int64).reshape(-1, MAX_CLASSES)
        firsts = np.cumsum(counts.sum(1)) - counts.sum(1)
        c0 = 0
        for name, parts in streams.items():
            c1 = c0 + len(parts)
            self.spans[name] = (c0, c1, int(firsts[c0]) if c1 > c0 else 0, int(counts[c0:c1].sum()))
            c0 = c1
        lengths = np.array([len(part) for parts in streams.values() for part in parts], np.int64)
        words_at = np.cumsum(lengths) - lengths + np.array([lay.words_at for lay in layouts], np.int64)
        raw_at = words_at + 2 * np.array([lay.n_words for lay in layouts], np.int64)
        starts = np.stack([lay.starts for lay in layouts]).reshape(-1, MAX_CLASSES + 1) + firsts[:, None]
        self.total = total = int(counts.sum())

        buffer = torch.empty(int(lengths.sum()) + 8, dtype=torch.uint8, pin_memory=device.type == "cuda")
        buffer[-8:] = 0
        flat, at = buffer.numpy(), 0
        for parts in streams.values():
            for part in parts:
                flat[at : at + len(part)] = np.frombuffer(part, np.uint8)
                at += len(part)
        on = {
            k: torch.from_numpy(np.ascontiguousarray(v)).to(device, non_blocking=True)
            for k, v in {
                "rows": np.column_stack([words_at, raw_at, starts]),
                "counts": counts.reshape(-1),
                "rice": np.stack([lay.rice for lay in layouts]).reshape(-1),
                "sizes": np.array(sizes, np.int64),
                "ends": np.cumsum(lengths),
                "freq": tables.freq,
                "cum": tables.cum,
                "slots": tables.slots,
            }.items()
        }
        on["data"] = buffer.to(device, non_blocking=True)  # from pinned memory, where the device is a GPU
        self.on, self.device, self.chunk, self.numels, self.old_values = (
            on,
            device,
            chunk,
            dict(numels),
            old_values,
        )
        self.pending: dict[str, Decoded] = {}  # decoded, not yet asked for
        self.limits = np.stack([compact._limits(lay.bounds) for lay in layouts]).astype(np.int32)
        self.symbols = torch.empty(2 * total + 1, dtype=torch.int8, device=device)
        self.ans_bad = torch.empty(len(layouts), dtype=torch.int8, device=device)
        if layouts:
            _launch(
                _ans_decode, len(layouts), on["data"], on["rows"], on["freq"], on["cum"], on["slots"],
                self.symbols, self.ans_bad, total, num_warps=1,  # one scalar chain per program
            )  # fmt: skip

    def changes(self, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        """Tensor `name`'s changed positions (int64, ascending) and new patterns (int16), against its old
        values (`old_values(name)`: bf16, on the device, as many as `numels` says). The tensors after it in
        the streams are decoded with it, up to the budgets."""
        if name not in self.pending:
            names = list(self.spans)
            group, changes, elements = [name], self.spans[name][3], self.numels[name]
            for other in names[names.index(name) + 1 :]:
                changes, elements = changes + self.spans[other][3], elements + self.numels[other]
                if other in self.pending or changes > GROUP_CHANGES or elements > GROUP_ELEMENTS:
                    break
                group.append(other)
            self.pending.update(self._decode(group, [bits(self.old_values(n)) for n in group]))
        result = self.pending.pop(name)
        if isinstance(result, compact.CompactDecodeError):
            raise result
        return result

    def _decode(self, names: list[str], xs: list[torch.Tensor]) -> dict[str, Decoded]:
        """Tensors `names` (consecutive in the streams) decoded against their old patterns `xs`."""
        from deltasync.codec import kernels  # not at import time: see deltasync.codec.kernels

        c0, c1, s0 = self.spans[names[0]][0], self.spans[names[-1]][1], self.spans[names[0]][2]
        on, total, device = self.on, self.total, self.device
        chunks, k = c1 - c0, sum(self.spans[n][3] for n in names)
        rows, sizes, ends = on["rows"][c0:c1], on["sizes"][c0:c1], on["ends"][c0:c1]
        group = torch.repeat_interleave(
            torch.arange(4 * chunks, device=device), on["counts"][4 * c0 : 4 * c1], output_size=k
        )
        which, cls = group // 4, group % 4  # each change's chunk (of the run) and class, chunk by chunk
        rice = on["rice"][4 * c0 : 4 * c1][group]
        q = self.symbols[s0 : s0 + k].to(torch.int64)
        steps = self.symbols[total + s0 : total + s0 + k].to(torch.int64) + 1
        escaped_q, escaped_v = q == Q_SYMBOLS - 1, steps == V_SYMBOLS
        # The raw bits of a chunk: each change's remainder and escaped quotient, then each escaped value.
        first = rice + 32 * escaped_q
        first_end, first_bits = _segment_sums(first, which, chunks)
        second = 16 * escaped_v.to(torch.int64)
        second_end, second_bits = _segment_sums(second, which, chunks)
        at_first = rows[:, 1][which] * 8 + first_end - first
        r = _take_bits(on["data"], at_first, rice)
        q = torch.where(escaped_q, q + _take_bits(on["data"], at_first + rice, 32), q)
        at_second = (rows[:, 1] * 8 + first_bits)[which] + second_end - second
        raws = torch.where(escaped_v, _take_bits(on["data"], at_second, 16), 0)
        used = first_bits + second_bits
        last = on["data"][(rows[:, 1] + used // 8).clamp(max=on["data"].numel() - 1)].to(torch.int64)
        raw_bad = ((used + 7) // 8 != ends - rows[:, 1]) | ((used % 8 != 0) & ((last >> (used % 8)) != 0))
        gaps = (q << rice) + r + 1
        ranks = _segment_sums(gaps, group, 4 * chunks)[0] - 1
        too_far = (gaps > sizes[which]) | (ranks >= sizes[which])  # (a sum of huge gaps may wrap)
        far = torch.zeros(chunks, dtype=torch.int32, device=device).index_add_(
            0, which, too_far.to(torch.int32)
        )
        code = torch.where(self.ans_bad[c0:c1] != 0, 3, torch.where(raw_bad, 4, torch.where(far > 0, 1, 0)))

        # Each tensor's old values: per block of BLOCK elements its count of each class, and its elements in
        # class order (2 bytes of scratch per element of the run).
        tensor_chunks = [self.spans[n][1] - self.spans[n][0] for n in names]
        per_chunk = [_blocks(min(self.chunk, x.numel())) for x in xs]
        programs = sum(c * b for c, b in zip(tensor_chunks, per_chunk, strict=True))
        counts = torch.empty((programs, 4), dtype=torch.int32, device=device)
        order = torch.empty(programs * BLOCK, dtype=torch.int16, device=device)
        limits = torch.from_numpy(self.limits[c0:c1]).to(device)
        p0, g0 = 0, 0
        for x, n_chunks, blocks in zip(xs, tensor_chunks, per_chunk, strict=True):
            p1, g1 = p0 + n_chunks * blocks, g0 + n_chunks
            args, shape = (x, limits[g0:g1], counts[p0:p1]), (x.numel(), self.chunk, blocks)
            _launch(_class_counts, p1 - p0, *args, *shape, BLOCK=BLOCK)
            _launch(_class_order, p1 - p0, *args, order[p0 * BLOCK : p1 * BLOCK], *shape, BLOCK=BLOCK)
            p0, g0 = p1, g1
        blocks_of = torch.from_numpy(np.repeat(per_chunk, tensor_chunks)).to(device)  # per chunk of the run
        chunk_of = torch.repeat_interleave(
            torch.arange(chunks, device=device), blocks_of, output_size=programs
        )
        inclusive, in_chunk = _segment_sums(counts.to(torch.int64), chunk_of, chunks)
        # The block of each change: the first of its chunk whose running count of its class passes its rank.
        keys = ((torch.arange(4, device=device)[:, None] * chunks + chunk_of) << 32) + inclusive.T
        cls64 = cls.to(torch.int64)
        found = torch.searchsorted(keys.reshape(-1), ((cls64 * chunks + which) << 32) + ranks, right=True)
        beyond = ranks >= in_chunk[which, cls64]  # past its class in its chunk
        program = found.clamp(max=keys.numel() - 1) % programs
        within = ranks - (inclusive - counts)[program, cls64]
        below = (counts.cumsum(1) - counts)[program, cls64]
        slot = (program * BLOCK + below + within).clamp(0, order.numel() - 1)
        first_program = blocks_of.cumsum(0) - blocks_of
        offset = ((program - first_program[which]) * BLOCK + order[slot]).clamp(0, self.chunk - 1)
        key, sort = torch.sort(which * self.chunk + offset)  # a chunk's changes stay in its place
        tensor_of = torch.from_numpy(np.repeat(np.arange(len(names)), tensor_chunks)).to(device)[which]
        first_chunk = torch.from_numpy(np.cumsum(tensor_chunks) - tensor_chunks).to(device)
        positions = key - first_chunk[tensor_of] * self.chunk
        before = torch.empty(k, dtype=torch.int16, device=device)
        e0 = 0
        for x, name in zip(xs, names, strict=True):
            e1 = e0 + self.spans[name][3]
            before[e0:e1] = x[positions[e0:e1].clamp(0, x.numel() - 1)]
            e0 = e1
        step, raw = steps[sort], raws[sort]
        value = before.to(torch.int64) + ((step >> 1) ^ -(step & 1))
        escaped = step == V_SYMBOLS
        out_of_range = ~escaped & ((value < -(1 << 15)) | (value >= 1 << 15))
        after = torch.where(escaped, raw - ((raw & 0x8000) << 1), value).to(torch.int16)  # signed patterns
        # Per chunk, the host decoder's verdict: the rANS stage's, else a value out of range among the changes
        # placed, else a change past its class.
        flags = torch.zeros((chunks, 2), dtype=torch.int32, device=device).index_add_(
            0, which, torch.stack([out_of_range & ~beyond[sort], beyond], 1).to(torch.int32)
        )
        code = torch.where(
            code != 0, code, torch.where(flags[:, 0] > 0, 2, torch.where(flags[:, 1] > 0, 1, 0))
        )
        codes = code.tolist()  # the run's one host sync
        out: dict[str, Decoded] = {}
        e0 = 0
        for name in names:
            a, b, _, n = self.spans[name]
            e1 = e0 + n
            failed = next((c for c in codes[a - c0 : b - c0] if c), 0)  # its first chunk's, as on the host
            if failed:
                error = compact.CompactDecodeError({**kernels.DECODE_ERRORS, **kernels.ANS_ERRORS}[failed])
                error.tensor = name
                out[name] = error
            else:
                out[name] = (positions[e0:e1], after[e0:e1])
            e0 = e1
        return out


# ----------------------------------------------------------------------------------------------- backend


class CudaBackend(Backend):
    """The passes above, for tensors on CUDA (each call looks them up here, where tests may count them)."""

    decodes_whole_patches = True  # the rANS stage of every chunk of a patch runs side by side

    def scan(self, pairs: Pairs, threads: int | None) -> tuple[dict[str, TensorChanges], dict[str, int]]:
        return scan(pairs)

    def state_fingerprint(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        return state_fingerprint(tensors)

    def compact_streams(
        self,
        changes: Mapping[str, TensorChanges],
        old: Mapping[str, torch.Tensor],
        chunk: int,
        threads: int | None,
    ) -> tuple[dict[str, bytes], compact.Models]:
        return compact_streams(changes, old, chunk, threads)

    def decoder(
        self,
        streams: Mapping[str, list[bytes]],
        windows: Mapping[str, tuple[int, int]],
        chunk: int,
        tables: compact.Tables,
        device: torch.device,
        old_values: Callable[[str], torch.Tensor],
        threads: int | None,
    ) -> Decoder:
        numels = {name: length for name, (_, length) in windows.items()}
        return PatchSymbols(streams, numels, chunk, tables, device, old_values)

    def moves(self, changes: list[Move]) -> int:
        return total_move([moves(*change) for change in changes])

    def write(
        self, state: Mapping[str, torch.Tensor], changes: Mapping[str, TensorChanges], threads: int | None
    ) -> None:
        indexed_write(state, changes)
