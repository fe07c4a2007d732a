"""The compiled per-element loops (numba) of change detection, the fingerprint, the compact encoding (its
rANS coder included) and packed anchors. All release the GIL: the codec's thread pool runs them in parallel.

Import this module inside the functions that use it, never at module level: numba must not be loaded in the
inference Space before vLLM starts. vLLM's CPU worker, forked from the app (which imports shared.*), scans
every loaded module for Triton kernels at start-up and crashes on llvmlite's function wrappers.

The loops work on blocks of BLOCK elements and 64-bit masks (bit i: element start + i), each built by one
vector compare (`_ne_mask`, `_ge_mask`); only blocks that hold changes are looked at element by element.

Compact classes: class c of an element is how many of the three magnitude limits its old bit pattern reaches
(see deltasync.codec.compact). A rank is a position counted among the elements of one class.
"""

from __future__ import annotations

import math

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from deltasync.codec.symbols import ANS_SCALE, CLASS_COST_BITS, MAX_CLASSES, MAX_RICE, Q_SYMBOLS, V_SYMBOLS

BLOCK = 64
PIECE = 1 << 12  # blocks change detection reads twice while they stay in cache (512 kB of each array)
_jit = numba.njit(nogil=True, cache=True)
_inline = numba.njit(nogil=True, cache=True, inline="always")  # helpers of hot loops: keeps them vectorizable
_ONE = np.uint64(1)


@_inline
def _popcount(x):
    x = x - ((x >> _ONE) & np.uint64(0x5555555555555555))
    x = (x & np.uint64(0x3333333333333333)) + ((x >> np.uint64(2)) & np.uint64(0x3333333333333333))
    x = (x + (x >> np.uint64(4))) & np.uint64(0x0F0F0F0F0F0F0F0F)
    return np.int64((x * np.uint64(0x0101010101010101)) >> np.uint64(56))


def _block_lanes(context, builder, array_type, array, start):
    """The BLOCK int16 elements array[start:start + BLOCK] as one LLVM vector."""
    data = context.make_array(array_type)(context, builder, array).data
    vector = ir.VectorType(ir.IntType(16), BLOCK)
    return builder.load(builder.bitcast(builder.gep(data, [start]), vector.as_pointer()), align=2)


def _flat_int16(t) -> bool:
    return isinstance(t, types.Array) and t.ndim == 1 and t.layout == "C" and t.dtype == types.int16


# A whole block's mask as one vector compare, which LLVM lowers to a few instructions (vpcmpw into a mask
# register with AVX-512, compares and a pack with AVX2): its loop vectorizer turns `mask |= (cond) << i` into
# 64-bit lanes of shifts instead. Per 4M elements in cache: the three class masks 0.94 -> 0.22 ms, the
# comparison's 0.34 -> 0.24 ms. Loads are unaligned (align 2); the caller keeps start + BLOCK in the array.


@intrinsic
def _ne_mask(typingctx, a, b, start):
    """Bit i: a[start + i] != b[start + i], i < BLOCK (flat int16 arrays)."""
    if not (_flat_int16(a) and _flat_int16(b) and isinstance(start, types.Integer)):
        return None

    def codegen(context, builder, signature, args):
        x = _block_lanes(context, builder, signature.args[0], args[0], args[2])
        y = _block_lanes(context, builder, signature.args[1], args[1], args[2])
        return builder.bitcast(builder.icmp_unsigned("!=", x, y), ir.IntType(BLOCK))

    return types.uint64(a, b, start), codegen


@intrinsic
def _ge_mask(typingctx, a, start, limit):
    """Bit i: a[start + i] & 0x7FFF >= limit, i < BLOCK (a flat int16 array; 0 <= limit <= 2^15)."""
    if not (_flat_int16(a) and isinstance(start, types.Integer) and isinstance(limit, types.Integer)):
        return None

    def codegen(context, builder, signature, args):
        lanes = ir.VectorType(ir.IntType(16), BLOCK)
        x = builder.and_(
            _block_lanes(context, builder, signature.args[0], args[0], args[1]),
            ir.Constant(lanes, [0x7FFF] * BLOCK),
        )
        one = builder.insert_element(
            ir.Constant(lanes, ir.Undefined),
            builder.trunc(args[2], ir.IntType(16)) if signature.args[2].bitwidth > 16 else args[2],
            ir.Constant(ir.IntType(32), 0),
        )
        splat = builder.shuffle_vector(
            one,
            ir.Constant(lanes, ir.Undefined),
            ir.Constant(ir.VectorType(ir.IntType(32), BLOCK), [0] * BLOCK),
        )
        return builder.bitcast(builder.icmp_unsigned(">=", x, splat), ir.IntType(BLOCK))

    return types.uint64(a, start, limit), codegen


@_inline
def _lowest_bit(x):
    """Index of the lowest set bit of x (x != 0)."""
    return _popcount((x & (~x + _ONE)) - _ONE)


# ----------------------------------------------------------------------------------------------- changes


@_jit
def changed_positions(old_bits, new_bits, seed, r1, offset):
    """Positions (ascending) where two int16 pattern arrays differ, the new patterns there, and how the
    changes move the fingerprint (the arrays being elements offset.. of the tensor whose seed is `seed`).

    In pieces of PIECE blocks, each read for its masks and then for its changes while it is still in cache:
    a pass over all elements and then one over their changes read memory twice (87 against 63 ms for the
    bench.sync step's 187M elements on one thread)."""
    n = old_bits.size
    blocks = (n + BLOCK - 1) // BLOCK
    masks = np.empty(min(PIECE, blocks), np.uint64)
    positions, values = np.empty(max(1024, n >> 5), np.int64), np.empty(max(1024, n >> 5), np.int16)
    shift, row, row_weight, moved = _row_shift(r1), ~np.uint64(0), np.uint64(0), np.uint64(0)
    j = 0
    for first in range(0, blocks, PIECE):
        last, total = min(first + PIECE, blocks), j
        for b in range(first, last):
            start, mask = b * BLOCK, np.uint64(0)
            if start + BLOCK <= n:
                mask = _ne_mask(old_bits, new_bits, start)
            else:
                for i in range(n - start):
                    mask |= np.uint64(old_bits[start + i] != new_bits[start + i]) << np.uint64(i)
            masks[b - first] = mask
            total += _popcount(mask)
        if total > positions.size:  # (rarely: the first guess holds 1 change in 32)
            grown = max(total, 2 * positions.size)
            positions = np.concatenate((positions[:j], np.empty(grown - j, np.int64)))
            values = np.concatenate((values[:j], np.empty(grown - j, np.int16)))
        for b in range(first, last):
            mask = masks[b - first]
            while mask:
                p = b * BLOCK + _lowest_bit(mask)
                positions[j], values[j] = p, new_bits[p]
                w, row, row_weight = _weight(seed, r1, shift, np.uint64(offset + p), row, row_weight)
                moved += np.uint64(np.int64(new_bits[p]) - np.int64(old_bits[p])) * w
                mask &= mask - _ONE
                j += 1
    return positions[:j], values[:j], moved


@_jit
def gather(source, positions):
    """source[positions] (numpy's fancy indexing, without the GIL)."""
    out = np.empty(positions.size, source.dtype)
    for j in range(positions.size):
        out[j] = source[positions[j]]
    return out


@_jit
def scatter(target, positions, values):
    """target[positions] = values (numpy's fancy assignment, without the GIL)."""
    for j in range(positions.size):
        target[positions[j]] = values[j]


@_jit
def split_exponents(patterns, exponents, rest):
    """bf16 patterns (uint16) -> their exponent bytes and their sign | mantissa bytes."""
    for i in range(patterns.size):
        x = patterns[i]
        exponents[i] = (x >> 7) & 0xFF
        rest[i] = ((x >> 8) & 0x80) | (x & 0x7F)


@_jit
def merge_exponents(exponents, rest, patterns):
    """The inverse of split_exponents, into `patterns` (uint16)."""
    for i in range(patterns.size):
        r = np.uint16(rest[i])
        patterns[i] = ((r & 0x80) << 8) | (np.uint16(exponents[i]) << 7) | (r & 0x7F)


# ----------------------------------------------------------------------------------------------- fingerprint


@_inline
def _splitmix64(x):
    x = x + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


@_inline
def _row_shift(r1):
    """log2 of the fingerprint's row length (a power of two): positions split into rows by a shift."""
    shift = np.uint64(0)
    while (_ONE << shift) < r1.size:
        shift += _ONE
    return shift


@_inline
def _weight(seed, r1, shift, p, row, row_weight):
    """The weight r(t, p) of position p (uint64), and the cache of its row's weight: (weight, row, row
    weight). Changes come in position order, so the row's splitmix64 runs once per row, not per change."""
    if p >> shift != row:
        row = p >> shift
        row_weight = _splitmix64(row ^ seed) | _ONE
    return r1[p & ((_ONE << shift) - _ONE)] * row_weight, row, row_weight


@_jit
def fingerprint_delta(seed, r1, positions, old, new):
    """sum((new - old) * r1[p % ROW] * (splitmix64(p // ROW ^ seed) | 1)) mod 2^64: see codec.fingerprint."""
    shift, row, row_weight, total = _row_shift(r1), ~np.uint64(0), np.uint64(0), np.uint64(0)
    for j in range(positions.size):
        w, row, row_weight = _weight(seed, r1, shift, np.uint64(positions[j]), row, row_weight)
        total += np.uint64(np.int64(new[j]) - np.int64(old[j])) * w
    return total


@_jit
def fingerprint_rows(bits, r1, seed, first_row):
    """sum over rows of r1.size elements of int16 `bits` (the last may be short) of sum(bits * r1) *
    (splitmix64(row ^ seed) | 1), rows counted from `first_row`, mod 2^64: see codec.fingerprint. A row's
    sum is exact in int64 (|bits * r1| < 2^47)."""
    n, width, total = bits.size, r1.size, np.uint64(0)
    for r in range((n + width - 1) // width):
        start, row_sum = r * width, np.int64(0)
        if start + width <= n:  # a constant trip count lets the compiler vectorize
            for j in range(width):
                row_sum += np.int64(bits[start + j]) * r1[j]
        else:
            for j in range(n - start):
                row_sum += np.int64(bits[start + j]) * r1[j]
        total += np.uint64(row_sum) * (_splitmix64(np.uint64(first_row + r) ^ seed) | _ONE)
    return total


# ----------------------------------------------------------------------------------------------- compact


@_jit
def exponent_histograms(old_bits, idx):
    """Exponent histograms of the whole tensor (from a strided sample of 2^14 elements, scaled back) and of
    the old values at the changed positions `idx`. Only the choice of classes depends on the sample."""
    stride = max(1, old_bits.size >> 14)
    population = np.zeros(256, np.float64)
    changed = np.zeros(256, np.float64)
    for i in range(0, old_bits.size, stride):
        population[(old_bits[i] >> 7) & 0xFF] += stride
    for p in idx:
        changed[(old_bits[p] >> 7) & 0xFF] += 1
    return population, changed


@_jit
def _subset_bits(k, n):
    """Bits to code which k of n i.i.d. elements changed."""
    n = max(n, k)
    if k == 0 or k == n:
        return 0.0
    p = k / n
    return -(k * math.log2(p) + (n - k) * math.log2(1 - p))


@_jit
def choose_bounds(population, changed):
    """Exponent bounds of up to MAX_CLASSES contiguous classes that minimise the position cost (bits): an
    exact dynamic program over the exponent histograms. Returns the ascending bounds and the cost."""
    bins = np.nonzero((population > 0) | (changed > 0))[0]
    e = bins.size
    cn = np.zeros(e + 1)
    ck = np.zeros(e + 1)
    for i in range(e):
        cn[i + 1] = cn[i] + population[bins[i]]
        ck[i + 1] = ck[i] + changed[bins[i]]
    cost = np.full((e + 1, e + 1), np.inf)  # cost[i, j]: one class holding bins i..j-1
    for i in range(e + 1):
        for j in range(i + 1, e + 1):
            cost[i, j] = _subset_bits(ck[j] - ck[i], cn[j] - cn[i]) + CLASS_COST_BITS
    best = np.full((MAX_CLASSES, e + 1), np.inf)  # best[g, j]: bins 0..j-1 in g + 1 classes
    arg = np.zeros((MAX_CLASSES, e + 1), np.int64)
    best[0] = cost[0]
    for g in range(1, MAX_CLASSES):
        for j in range(e + 1):
            for i in range(e + 1):
                total = best[g - 1, i] + cost[i, j]
                if total < best[g, j]:
                    best[g, j], arg[g, j] = total, i
    k = 0
    for g in range(1, MAX_CLASSES):
        if best[g, e] < best[k, e]:
            k = g
    bounds = np.empty(k, np.int64)
    j = e
    for g in range(k, 0, -1):
        j = arg[g, j]
        bounds[g - 1] = bins[j]
    return bounds, best[k, e]


@_inline
def _class(x, limits):
    m = x & 0x7FFF
    return int(m >= limits[0]) + int(m >= limits[1]) + int(m >= limits[2])


@_inline
def _block_classes(old_bits, limits, start):
    """Masks of the block's elements in class 0, 1, 2, 3."""
    count = min(BLOCK, old_bits.size - start)
    l0, l1, l2 = limits[0], limits[1], limits[2]
    m0 = m1 = m2 = np.uint64(0)  # elements reaching limit 0, 1, 2
    if count == BLOCK:
        m0, m1, m2 = (
            _ge_mask(old_bits, start, l0),
            _ge_mask(old_bits, start, l1),
            _ge_mask(old_bits, start, l2),
        )
        valid = ~np.uint64(0)
    else:
        for i in range(count):
            m = np.int32(old_bits[start + i]) & 0x7FFF
            m0 |= np.uint64(m >= l0) << np.uint64(i)
            m1 |= np.uint64(m >= l1) << np.uint64(i)
            m2 |= np.uint64(m >= l2) << np.uint64(i)
        valid = (_ONE << np.uint64(count)) - _ONE
    return (valid & ~m0, m0 & ~m1, m1 & ~m2, m2)


@_jit
def _ranks(old_bits, limits, idx):
    """Class, in-class rank and old pattern at each sorted position in `idx`, and each class's size.

    Led by the changes: each counts the blocks up to its own (a loop that mostly runs once), which mispredicts
    less than a walk over blocks asking each whether it holds changes (0.66 against 1.29 ms a 4M chunk)."""
    k = idx.size
    cls, ranks, old = np.empty(k, np.int64), np.empty(k, np.int64), np.empty(k, np.int64)
    counted = np.zeros(MAX_CLASSES, np.int64)  # per class, elements of the blocks before block b
    classes = np.empty(
        MAX_CLASSES, np.uint64
    )  # block b - 1's class masks: an array, indexed without branches
    b = 0
    for j in range(k + 1):
        last = idx[j] // BLOCK if j < k else (old_bits.size + BLOCK - 1) // BLOCK - 1
        while b <= last:
            classes[0], classes[1], classes[2], classes[3] = _block_classes(old_bits, limits, b * BLOCK)
            for c in range(MAX_CLASSES):
                counted[c] += _popcount(classes[c])
            b += 1
        if j < k:
            old[j] = old_bits[idx[j]]
            c = _class(old[j], limits)
            cls[j] = c
            ranks[j] = counted[c] - _popcount(
                classes[c] & ~((_ONE << np.uint64(idx[j] & (BLOCK - 1))) - _ONE)
            )
    return cls, ranks, counted, old


@_jit
def encode_symbols(old_bits, limits, idx, new_bits):
    """Symbols of the changes at sorted positions `idx` (new patterns `new_bits`), grouped by class.

    Returns starts (class c's symbols are [starts[c], starts[c + 1])), Rice parameters, Rice quotients and
    remainders of the rank gaps, value symbols (zigzag step, or V_SYMBOLS << 16 | raw pattern), and the
    per-class histograms of the capped quotient and value symbols that the patch-wide models pool.
    """
    k = idx.size
    if limits[0] >= 1 << 15:  # one class: ranks are positions
        cls, ranks, old = np.zeros(k, np.int64), idx, np.empty(k, np.int64)
        for j in range(k):
            old[j] = old_bits[idx[j]]
        sizes = np.zeros(MAX_CLASSES, np.int64)
        sizes[0] = old_bits.size
    else:
        cls, ranks, sizes, old = _ranks(old_bits, limits, idx)
    return ranked_symbols(cls, ranks, sizes, old, new_bits)


@_inline  # (callable from Python too)
def rice_parameter(size, count):
    """The Rice parameter of the rank gaps of `count` changes among a class of `size` elements (0 if none)."""
    if not count:
        return 0
    return min(MAX_RICE, max(0, int(math.log2(max(1.0, size * math.log(2) / count)))))


@_inline
def ranked_symbols(cls, ranks, sizes, old, new_bits):
    """encode_symbols' results from each change's class, in-class rank and old pattern (in position order)
    and each class's size (deltasync.codec.gpu._symbols does the same on a GPU, with rice_parameter)."""
    k = cls.size
    starts = np.zeros(MAX_CLASSES + 1, np.int64)
    for j in range(k):
        starts[cls[j] + 1] += 1
    rice = np.zeros(MAX_CLASSES, np.int64)
    for c in range(MAX_CLASSES):
        rice[c] = rice_parameter(sizes[c], starts[c + 1])
        starts[c + 1] += starts[c]
    fill, last = starts[:MAX_CLASSES].copy(), np.full(MAX_CLASSES, -1)
    q, r, v = np.empty(k, np.int64), np.empty(k, np.int64), np.empty(k, np.int64)
    q_hist = np.zeros((MAX_CLASSES, Q_SYMBOLS), np.int64)
    v_hist = np.zeros((MAX_CLASSES, V_SYMBOLS), np.int64)
    for j in range(k):
        c = cls[j]
        t = fill[c]
        fill[c] += 1
        gap = ranks[j] - last[c] - 1
        last[c] = ranks[j]
        q[t], r[t] = gap >> rice[c], gap & ((1 << rice[c]) - 1)
        step = np.int64(new_bits[j]) - old[j]
        zigzag = (step << 1) ^ (step >> 63)
        v[t] = zigzag if zigzag < V_SYMBOLS else (new_bits[j] & 0xFFFF) + (V_SYMBOLS << 16)
        q_hist[c, min(q[t], Q_SYMBOLS - 1)] += 1
        v_hist[c, min(v[t], V_SYMBOLS) - 1] += 1
    return starts, rice, q, r, v, q_hist, v_hist


DECODE_ERRORS = {
    1: "a position lies beyond its class or the tensor",
    2: "a value step leaves the 16-bit range",
}


@_inline
def _new_pattern(old, step, raw):
    """The new pattern (as 0..65535), or -1 when a step leaves the 16-bit range."""
    if step == V_SYMBOLS:
        return raw
    value = np.int64(old) + ((step >> 1) ^ -(step & 1))
    return value & 0xFFFF if -(1 << 15) <= value < 1 << 15 else -1


@_jit
def new_patterns(old, steps, raws):
    """The new patterns (uint16) of changes by step from old patterns (int16; raws where a step is
    V_SYMBOLS), and whether every step stays in the 16-bit range."""
    new = np.empty(old.size, np.uint16)
    for j in range(old.size):
        pattern = _new_pattern(old[j], steps[j], raws[j])
        if pattern < 0:
            return new, False
        new[j] = pattern
    return new, True


@_inline
def _pattern_step(old, pattern):
    """new - old of the signed patterns (old int16, pattern 0..65535), as the fingerprint weighs it."""
    return np.uint64(pattern - ((pattern & 0x8000) << 1) - np.int64(old))


@_jit
def decode_symbols(old_bits, limits, starts, rice, q, r, steps, raws, seed, r1, offset):
    """The inverse of encode_symbols (escapes already resolved: q the full quotients, raws the raw patterns
    where steps == V_SYMBOLS). Returns ascending positions, new patterns (uint16), how the changes move the
    fingerprint (old_bits being elements offset.. of the tensor whose seed is `seed`) and a status: 0, or a
    key of DECODE_ERRORS."""
    n, k = old_bits.size, q.size
    positions, new = np.empty(k, np.int64), np.empty(k, np.uint16)
    shift, row, row_weight, moved = _row_shift(r1), ~np.uint64(0), np.uint64(0), np.uint64(0)
    ranks = np.empty(k, np.int64)
    for c in range(MAX_CLASSES):
        rank = -1
        for t in range(starts[c], starts[c + 1]):
            rank += (q[t] << rice[c]) + r[t] + 1  # q < 2^33, rice <= MAX_RICE: no overflow below n
            if rank >= n:
                return positions, new, moved, 1
            ranks[t] = rank
    if limits[0] >= 1 << 15:  # one class: ranks are positions
        for j in range(k):
            p = ranks[j]
            positions[j], pattern = p, _new_pattern(old_bits[p], steps[j], raws[j])
            if pattern < 0:
                return positions, new, moved, 2
            new[j] = pattern
            w, row, row_weight = _weight(seed, r1, shift, np.uint64(offset + p), row, row_weight)
            moved += _pattern_step(old_bits[p], pattern) * w
        return positions, new, moved, 0
    pending = starts[:MAX_CLASSES].copy()  # per class, the next rank to place
    before = np.zeros(MAX_CLASSES, np.int64)  # per class, elements before the block
    source = np.empty(BLOCK, np.int64)  # the symbol index of each changed element of the block
    j = 0
    for b in range((n + BLOCK - 1) // BLOCK):
        start = b * BLOCK
        classes = _block_classes(old_bits, limits, start)
        hits = np.uint64(0)
        for c in range(MAX_CLASSES):
            # Walk the block's class-c elements (set bits, lowest first) up to each rank in the block.
            mask, counted, t = classes[c], before[c], pending[c]
            before[c] += _popcount(mask)
            while t < starts[c + 1] and ranks[t] < before[c]:
                while counted < ranks[t]:  # ranks ascend, so counted never passes one
                    mask &= mask - _ONE
                    counted += 1
                bit = _lowest_bit(mask)
                source[bit], hits = t, hits | (_ONE << np.uint64(bit))
                mask &= mask - _ONE
                counted, t = counted + 1, t + 1
            pending[c] = t
        while hits:  # in position order
            bit = _lowest_bit(hits)
            t, p = source[bit], start + bit
            positions[j], pattern = p, _new_pattern(old_bits[p], steps[t], raws[t])
            if pattern < 0:
                return positions, new, moved, 2
            new[j] = pattern
            w, row, row_weight = _weight(seed, r1, shift, np.uint64(offset + p), row, row_weight)
            moved += _pattern_step(old_bits[p], pattern) * w
            hits &= hits - _ONE
            j += 1
    if j < k:
        return positions, new, moved, 1
    return positions, new, moved, 0


# ----------------------------------------------------------------------------------------------- rANS

ANS_LOW = 1 << 16  # the coder's state stays in [2^16, 2^32) and moves 16-bit words
_ANS_RENORM = (ANS_LOW >> ANS_SCALE) << 16  # times a frequency: the state bound before a symbol is pushed
ANS_ERRORS = {
    3: "the ANS stream is truncated or does not end where its symbols do",
    4: "the raw bit stream is truncated or longer than its symbols need",
}


@_inline
def _put_bits(out, at, value, n):
    """Append the n low bits of value to the bit stream out (at: [next byte, held bits, count held])."""
    at[1] |= (value & ((1 << n) - 1)) << at[2]
    at[2] += n
    while at[2] >= 8:
        out[at[0]] = at[1] & 0xFF
        at[0], at[1], at[2] = at[0] + 1, at[1] >> 8, at[2] - 8


@_inline
def _take_bits(data, at, n):
    """The next n bits of data (at: [next byte, held bits, count held]), or -1 past its end."""
    while at[2] < n:
        if at[0] >= data.size:
            return -1
        at[1] |= np.int64(data[at[0]]) << at[2]
        at[0], at[2] = at[0] + 1, at[2] + 8
    value = at[1] & ((1 << n) - 1)
    at[1], at[2] = at[1] >> n, at[2] - n
    return value


@_jit
def ans_encode(starts, rice, q, r, v, freq, cum):
    """One chunk's symbols (as encode_symbols returns them) as rANS words (uint16) and raw bits (uint8).

    Decoding order of the ANS symbols: per class c the capped Rice quotients (model c), then per class the
    value symbols (model MAX_CLASSES + c). Raw bits, per class: each remainder (rice[c] bits) and escaped
    quotient (32 bits), then per class each escaped value's pattern (16 bits). ANS is a stack, so the
    symbols are pushed in reverse.
    """
    k = q.size
    words = np.empty(2 * k + 2, np.uint16)  # a push emits at most one word
    # Unsigned state (< 2^32): its division is the loop's cost, and an unsigned one is the cheaper.
    at_word, x = words.size, np.uint32(ANS_LOW)
    for half in range(1, -1, -1):
        for c in range(MAX_CLASSES - 1, -1, -1):
            m = half * MAX_CLASSES + c
            for t in range(starts[c + 1] - 1, starts[c] - 1, -1):
                s = min(q[t], Q_SYMBOLS - 1) if half == 0 else min(v[t], V_SYMBOLS) - 1
                f = np.uint32(freq[m, s])
                if np.uint64(x) >= np.uint64(_ANS_RENORM) * np.uint64(f):
                    at_word -= 1
                    words[at_word] = x & np.uint32(0xFFFF)
                    x >>= np.uint32(16)
                x = ((x // f) << np.uint32(ANS_SCALE)) + x % f + np.uint32(cum[m, s])
    words[at_word - 1], words[at_word - 2] = x & np.uint32(0xFFFF), x >> np.uint32(16)
    n_bits = 0
    for c in range(MAX_CLASSES):
        for t in range(starts[c], starts[c + 1]):
            n_bits += rice[c] + 32 * (q[t] >= Q_SYMBOLS - 1) + 16 * (v[t] >= V_SYMBOLS)
    raw = np.zeros((n_bits + 7) // 8, np.uint8)
    at = np.zeros(3, np.int64)
    for c in range(MAX_CLASSES):
        for t in range(starts[c], starts[c + 1]):
            _put_bits(raw, at, r[t], rice[c])
            if q[t] >= Q_SYMBOLS - 1:
                _put_bits(raw, at, q[t] - (Q_SYMBOLS - 1), 32)
    for c in range(MAX_CLASSES):
        for t in range(starts[c], starts[c + 1]):
            if v[t] >= V_SYMBOLS:
                _put_bits(raw, at, v[t], 16)
    if at[2]:
        raw[at[0]] = at[1]
    return words[at_word - 2 :], raw


@_jit
def ans_decode(words, raw, starts, rice, freq, cum, slots):
    """The inverse of ans_encode: full Rice quotients, remainders, value steps (1..V_SYMBOLS) and the raw
    patterns of escaped values, as decode_symbols takes them. Returns them and a status: 0, or a key of
    ANS_ERRORS."""
    k = starts[MAX_CLASSES]
    q, r = np.empty(k, np.int64), np.zeros(k, np.int64)
    steps, raws = np.empty(k, np.int64), np.zeros(k, np.int64)
    if words.size < 2:
        return q, r, steps, raws, 3
    x, at_word = (np.int64(words[0]) << 16) | np.int64(words[1]), 2
    mask = (1 << ANS_SCALE) - 1
    for half in range(2):
        for c in range(MAX_CLASSES):
            m = half * MAX_CLASSES + c
            for t in range(starts[c], starts[c + 1]):
                slot = x & mask
                s = slots[m, slot]
                x = freq[m, s] * (x >> ANS_SCALE) + slot - cum[m, s]
                if x < ANS_LOW:
                    if at_word >= words.size:
                        return q, r, steps, raws, 3
                    x = (x << 16) | np.int64(words[at_word])
                    at_word += 1
                if half == 0:
                    q[t] = s
                else:
                    steps[t] = s + 1
    if x != ANS_LOW or at_word != words.size:
        return q, r, steps, raws, 3
    at = np.zeros(3, np.int64)
    for c in range(MAX_CLASSES):
        for t in range(starts[c], starts[c + 1]):
            r[t] = _take_bits(raw, at, rice[c])
            if q[t] == Q_SYMBOLS - 1:
                extra = _take_bits(raw, at, 32)
                q[t] = -1 if extra < 0 else q[t] + extra
            if r[t] < 0 or q[t] < 0:
                return q, r, steps, raws, 4
    for c in range(MAX_CLASSES):
        for t in range(starts[c], starts[c + 1]):
            if steps[t] == V_SYMBOLS:
                raws[t] = _take_bits(raw, at, 16)
                if raws[t] < 0:
                    return q, r, steps, raws, 4
    if at[0] != raw.size or at[1]:
        return q, r, steps, raws, 4
    return q, r, steps, raws, 0
