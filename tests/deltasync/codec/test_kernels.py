"""The compiled loops against plain references, bit for bit: fingerprint moves found while comparing or
decoding, and the rANS coder's words."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from deltasync.codec import compact, fingerprint, kernels
from deltasync.codec.symbols import ANS_SCALE, MAX_CLASSES, Q_SYMBOLS, V_SYMBOLS


def moved_by(name: str, before: np.ndarray, after: np.ndarray) -> int:
    """F(after) - F(before) of one tensor's int16 patterns, from two full recomputations."""
    full = [
        fingerprint.tensor_fingerprint(name, torch.from_numpy(b.copy()).view(torch.bfloat16))
        for b in (before, after)
    ]
    return (full[1] - full[0]) & fingerprint.MASK64


def changed_copy(rng: np.random.Generator, b: np.ndarray, lo: int, hi: int, density: float) -> np.ndarray:
    new = b.copy()
    where = lo + np.flatnonzero(rng.random(hi - lo) < density)
    new[where] = rng.integers(-(1 << 15), 1 << 15, size=where.size, dtype=np.int16)
    return new


@settings(max_examples=40, deadline=None)
@given(
    numel=st.integers(1, 20_000),
    cut=st.tuples(st.floats(0, 1), st.floats(0, 1)),
    density=st.sampled_from([0.0, 0.001, 0.05, 1.0]),
    seed=st.integers(0, 2**32 - 1),
)
def test_changed_positions_finds_the_changes_and_their_fingerprint_move(numel, cut, density, seed):
    rng = np.random.default_rng(seed)
    b = rng.integers(-(1 << 15), 1 << 15, size=numel, dtype=np.int16)
    lo, hi = sorted(int(c * numel) for c in cut)  # a span of the tensor, as diff splits it
    new = changed_copy(rng, b, lo, hi, density)
    idx, values, moved = kernels.changed_positions(
        b[lo:hi], new[lo:hi], fingerprint.seed("w"), fingerprint.R1, lo
    )
    expected = np.flatnonzero(b[lo:hi] != new[lo:hi])
    assert np.array_equal(idx, expected)
    assert np.array_equal(values, new[lo:hi][expected])
    assert int(moved) == moved_by("w", b, new)


@pytest.mark.parametrize("density", [0.001, 0.3])
def test_changed_positions_across_pieces_and_a_grown_output(density):
    """Spans of several pieces (kernels.PIECE blocks) and more changes than the first guess holds."""
    rng = np.random.default_rng(7)
    numel = 2 * kernels.PIECE * kernels.BLOCK + 1000
    b = rng.integers(-(1 << 15), 1 << 15, size=numel, dtype=np.int16)
    new = changed_copy(rng, b, 0, numel, density)
    idx, values, moved = kernels.changed_positions(b, new, fingerprint.seed("w"), fingerprint.R1, 0)
    expected = np.flatnonzero(b != new)
    assert np.array_equal(idx, expected) and np.array_equal(values, new[expected])
    assert int(moved) == moved_by("w", b, new)


@settings(max_examples=40, deadline=None)
@given(numel=st.integers(1, 20_000), changes=st.integers(0, 300), seed=st.integers(0, 2**32 - 1))
def test_fingerprint_delta_in_any_position_order(numel, changes, seed):
    rng = np.random.default_rng(seed)
    b = rng.integers(-(1 << 15), 1 << 15, size=numel, dtype=np.int16)
    pos = rng.permutation(numel)[: min(changes, numel)]  # unsorted, as the layout's callers may pass them
    new = b.copy()
    new[pos] = rng.integers(-(1 << 15), 1 << 15, size=pos.size, dtype=np.int16)
    assert fingerprint.delta("w", pos, b[pos], new[pos]) == moved_by("w", b, new)


@settings(max_examples=40, deadline=None)
@given(
    numel=st.integers(1, 30_000),
    chunk=st.sampled_from([1, 64, 1000, 4096, 1 << 22]),
    density=st.sampled_from([0.001, 0.02, 0.5, 1.0]),
    seed=st.integers(0, 2**32 - 1),
)
def test_decoding_a_chunk_gives_its_fingerprint_move(numel, chunk, density, seed):
    rng = np.random.default_rng(seed)
    b = (rng.standard_normal(numel) * 0.02).astype(np.float32).view(np.int32) >> 16
    b = b.astype(np.int16)
    lo = int(rng.integers(0, -(-numel // chunk))) * chunk  # one chunk of the tensor
    hi = min(lo + chunk, numel)
    new = changed_copy(rng, b, lo, hi, density)
    idx = np.flatnonzero(b[lo:hi] != new[lo:hi])
    symbols = compact.to_symbols(b[lo:hi], idx, new[lo:hi][idx])
    models = compact.Models()
    compact.tally(models, symbols)
    tables = models.tables()
    stream = compact.encode_chunk(symbols, tables)
    got, patterns, moved = compact.decode_chunk(stream, b[lo:hi], tables, fingerprint.seed("w"), lo)
    assert np.array_equal(got, idx)
    assert np.array_equal(patterns.view(np.int16), new[lo:hi][idx])
    assert moved == moved_by("w", b, new)


def test_new_patterns_steps_old_patterns_and_refuses_a_step_out_of_the_16_bit_range():
    old = np.array([0, 5, -3, 32767], np.int16)
    steps = np.array([2, 1, V_SYMBOLS, 2], np.int64)  # zigzag: +1, -1, a raw pattern, +1
    raws = np.array([0, 0, 0x8001, 0], np.int64)
    new, in_range = kernels.new_patterns(old[:3], steps[:3], raws[:3])
    assert in_range and new.tolist() == [1, 4, 0x8001]
    assert not kernels.new_patterns(old, steps, raws)[1]  # 32767 + 1


def ans_words(starts, q, v, freq, cum) -> list[int]:
    """The rANS words of ans_encode, in Python integers (the coder as specified, no machine types)."""
    words, x, low, renorm = [], 1 << 16, 1 << 16, ((1 << 16) >> ANS_SCALE) << 16
    for half in (1, 0):
        for c in reversed(range(MAX_CLASSES)):
            m = half * MAX_CLASSES + c
            for t in reversed(range(starts[c], starts[c + 1])):
                s = min(q[t], Q_SYMBOLS - 1) if half == 0 else min(v[t], V_SYMBOLS) - 1
                f = int(freq[m, s])
                if x >= renorm * f:
                    words.append(x & 0xFFFF)
                    x >>= 16
                x = ((x // f) << ANS_SCALE) + x % f + int(cum[m, s])
    assert low <= x < 1 << 32
    return [x >> 16, x & 0xFFFF, *reversed(words)]


@settings(max_examples=60, deadline=None)
@given(
    counts=st.lists(st.integers(0, 400), min_size=MAX_CLASSES, max_size=MAX_CLASSES),
    skew=st.floats(0.01, 0.99),
    seed=st.integers(0, 2**32 - 1),
)
def test_ans_encode_matches_the_coder_in_plain_integers(counts, skew, seed):
    rng = np.random.default_rng(seed)
    k = sum(counts)
    starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    rice = rng.integers(0, 5, MAX_CLASSES).astype(np.int64)
    q = np.minimum(rng.geometric(skew, k) - 1, Q_SYMBOLS + 5).astype(np.int64)  # some escapes
    v = np.where(rng.random(k) < 0.05, (V_SYMBOLS << 16) + 123, rng.geometric(skew, k) % V_SYMBOLS + 1)
    r = (rng.integers(0, 1 << 20, k) & ((1 << rice[np.repeat(np.arange(MAX_CLASSES), counts)]) - 1)).astype(
        np.int64
    )
    models = compact.Models()
    for c in range(MAX_CLASSES):
        part = slice(starts[c], starts[c + 1])
        np.add.at(models.q[c], np.minimum(q[part], Q_SYMBOLS - 1), 1)
        np.add.at(models.v[c], np.minimum(v[part], V_SYMBOLS) - 1, 1)
    tables = models.tables()
    words, _ = kernels.ans_encode(starts, rice, q, r, v.astype(np.int64), tables.freq, tables.cum)
    assert words.tolist() == ans_words(starts, q, v, tables.freq, tables.cum)


@settings(max_examples=40, deadline=None)
@given(
    numel=st.integers(1, 300),
    bounds=st.lists(st.integers(0, 255), max_size=MAX_CLASSES - 1, unique=True),
    seed=st.integers(0, 2**32 - 1),
)
def test_block_class_masks_hold_each_elements_class(numel, bounds, seed):
    """The vector compares of whole blocks and the loop of a short last block, against numpy."""
    rng = np.random.default_rng(seed)
    b = rng.integers(-(1 << 15), 1 << 15, size=numel, dtype=np.int16)
    b[rng.random(numel) < 0.2] = rng.choice(np.array([0, -1, 0x7FFF, -0x8000, 0x7F80], np.int16))  # edges
    limits = compact._limits(sorted(bounds))
    classes = ((b.astype(np.int64) & 0x7FFF)[:, None] >= limits).sum(1)
    for start in range(0, numel, kernels.BLOCK):
        masks = kernels._block_classes(b, limits, start)
        for i in range(min(kernels.BLOCK, numel - start)):
            assert [(int(m) >> i) & 1 for m in masks] == [
                int(classes[start + i] == c) for c in range(MAX_CLASSES)
            ]
        assert all(int(m) >> (numel - start) == 0 for m in masks if numel - start < kernels.BLOCK)


@settings(max_examples=40, deadline=None)
@given(
    numel=st.integers(1, 3_000),
    density=st.sampled_from([0.0, 0.01, 0.3, 1.0]),
    bounds=st.lists(st.integers(100, 130), min_size=1, max_size=MAX_CLASSES - 1, unique=True),
    seed=st.integers(0, 2**32 - 1),
)
def test_ranks_count_each_changes_class_before_it(numel, density, bounds, seed):
    rng = np.random.default_rng(seed)
    b = ((rng.standard_normal(numel) * 0.02).astype(np.float32).view(np.int32) >> 16).astype(np.int16)
    idx = np.flatnonzero(rng.random(numel) < density)
    limits = compact._limits(sorted(bounds))
    classes = ((b.astype(np.int64) & 0x7FFF)[:, None] >= limits).sum(1)
    cls, ranks, sizes, old = kernels._ranks(b, limits, idx)
    in_class = classes[None, :] == np.arange(MAX_CLASSES)[:, None]  # (class, element)
    assert np.array_equal(cls, classes[idx]) and np.array_equal(old, b[idx])
    assert np.array_equal(ranks, (np.cumsum(in_class, 1) - in_class)[classes[idx], idx])
    assert np.array_equal(sizes, in_class.sum(1))
