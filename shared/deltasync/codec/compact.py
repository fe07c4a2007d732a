"""The compact encoding: lossless sparse bf16 changes near their entropy, given the receiver's old weights.

A tensor is coded in chunks of `chunk` elements (the patch's metadata says how many), each on its own, so
encoder and decoder work on all cores and the bytes never depend on the thread count. Per chunk, every
element falls in one of K <= 4 classes by the exponent of its OLD value, which both sides hold.
Small weights change far more often than large ones, so positions are coded per class:

- positions: per class, the gaps between the ranks (among that class's elements) of the changed elements,
  Rice-split into q = gap >> k (categorical model) and k low bits (raw);
- values: zigzag(new_bits - old_bits), nearly always 1 or 2 (a one-ulp move), categorical model; the rare
  bigger jump escapes to the raw 16-bit new pattern.

The categorical tables are pooled per class index over the whole patch (they are alike across tensors), so
a chunk only carries a few varints: its class bounds, changed count and Rice parameter per class.
Entropy stage: a static rANS coder compiled with numba (deltasync.codec.kernels), which releases the GIL.

Streams. A tensor: varint chunk count n, the byte lengths of chunks 1..n-1, the chunks. A chunk: varints
K, K-1 class bounds, K counts, K Rice parameters, the number of ANS words; the ANS words (u16 LE); the raw
bits (LSB first).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from deltasync.codec.symbols import ANS_SCALE, MAX_CLASSES, MAX_RICE, Q_SYMBOLS, V_SYMBOLS
from deltasync.errors import CompactDecodeError, PatchError

CHUNK = 1 << 22  # elements per chunk: ~40k changes at 1%, headers of a few bytes
MAX_CHUNK = 1 << 31  # raw escapes hold 32-bit quotients


@dataclass
class Tables:
    """Quantized rANS models (rows: quotients of class 0..3, then values of class 0..3): frequencies,
    cumulative frequencies, the symbol of each slot, and which rows exist."""

    freq: np.ndarray
    cum: np.ndarray
    slots: np.ndarray
    present: np.ndarray


@dataclass
class Models:
    """Categorical frequency tables pooled over a patch: Rice quotients and value steps, per class index."""

    q: np.ndarray = field(default_factory=lambda: np.zeros((MAX_CLASSES, Q_SYMBOLS), np.int64))
    v: np.ndarray = field(default_factory=lambda: np.zeros((MAX_CLASSES, V_SYMBOLS), np.int64))

    def to_json(self) -> dict:
        return {"q": self.q.tolist(), "v": self.v.tolist()}

    @classmethod
    def from_json(cls, obj: object) -> Models:
        """The tables `to_json` wrote, from untrusted JSON: CompactDecodeError if they are not."""
        if not isinstance(obj, dict):
            raise CompactDecodeError(f"bad compact model tables: not a JSON object ({type(obj).__name__})")
        try:
            q = np.asarray(obj["q"], dtype=np.int64)
            v = np.asarray(obj["v"], dtype=np.int64)
        except (KeyError, TypeError, ValueError, OverflowError) as e:
            raise CompactDecodeError(f"bad compact model tables: {e}") from None
        if (
            q.shape != (MAX_CLASSES, Q_SYMBOLS)
            or v.shape != (MAX_CLASSES, V_SYMBOLS)
            or (q < 0).any()
            or (v < 0).any()
            or q.sum() >= 1 << 48
            or v.sum() >= 1 << 48
        ):
            raise CompactDecodeError("bad compact model tables: wrong shape, negative or huge counts")
        return cls(q, v)

    def tables(self) -> Tables:
        """The rANS models. Integer arithmetic only, so encoder and decoder build identical tables."""
        counts = np.zeros((2 * MAX_CLASSES, Q_SYMBOLS), np.int64)
        counts[:MAX_CLASSES], counts[MAX_CLASSES:, :V_SYMBOLS] = self.q, self.v
        total = counts.sum(1, keepdims=True)
        freq = np.where(counts > 0, np.maximum(1, (counts << ANS_SCALE) // np.maximum(total, 1)), 0)
        present = total[:, 0] > 0
        rows = np.nonzero(present)[0]
        freq[rows, freq[rows].argmax(1)] += (1 << ANS_SCALE) - freq[rows].sum(1)  # rows sum to 2^14
        cum = np.zeros((2 * MAX_CLASSES, Q_SYMBOLS + 1), np.int64)
        cum[:, 1:] = freq.cumsum(1)
        slots = np.zeros((2 * MAX_CLASSES, 1 << ANS_SCALE), np.uint8)
        for m in rows:
            slots[m] = np.repeat(np.arange(Q_SYMBOLS, dtype=np.uint8), freq[m])
        return Tables(freq, cum, slots, present)


def _limits(bounds: list[int]) -> np.ndarray:
    """Magnitude thresholds (bits & 0x7FFF) of classes 1..3; unused ones are unreachable."""
    return np.array([b << 7 for b in bounds] + [1 << 15] * (MAX_CLASSES - 1 - len(bounds)), np.int64)


# ----------------------------------------------------------------------------------------------- symbols


@dataclass
class Symbols:
    """One chunk's changes turned into symbols, before the patch-wide models exist."""

    bounds: list[int]
    starts: np.ndarray  # class c's symbols are [starts[c], starts[c + 1])
    rice: np.ndarray
    q: np.ndarray
    r: np.ndarray
    v: np.ndarray
    q_hist: np.ndarray
    v_hist: np.ndarray
    estimated_bits: float


def to_symbols(old_bits: np.ndarray, idx: np.ndarray, new_bits: np.ndarray) -> Symbols:
    """Symbols for the changes of one chunk: old patterns `old_bits` (int16), changed positions `idx`
    (sorted int64, within the chunk), new patterns `new_bits` (int16)."""
    from deltasync.codec import kernels  # not at import time: see deltasync.codec.kernels

    bounds, position_bits = kernels.choose_bounds(*kernels.exponent_histograms(old_bits, idx))
    bounds = bounds.tolist()
    starts, rice, q, r, v, q_hist, v_hist = kernels.encode_symbols(old_bits, _limits(bounds), idx, new_bits)
    if not v.all():  # a value step of 0, which no symbol codes: make_patch never makes such a change
        raise PatchError("a change whose new bf16 pattern equals the old one: not a change, cannot be coded")
    return Symbols(bounds, starts, rice, q, r, v, q_hist, v_hist, position_bits + 1.5 * idx.size)


def worth_coding(estimated_bits: list[float], numel: int) -> bool:
    """Whether a tensor of `numel` elements whose chunks' symbols are estimated at `estimated_bits` is coded
    compact (else its new values are stored dense, 16 bits each)."""
    return sum(estimated_bits) < 16 * numel


def tally(models: Models, s: Symbols) -> None:
    models.q += s.q_hist
    models.v += s.v_hist


# ----------------------------------------------------------------------------------------------- streams


def _varints(values: list[int]) -> bytes:
    out = bytearray()
    for v in values:
        while True:
            out.append((v & 0x7F) | (0x80 if v > 0x7F else 0))
            v >>= 7
            if not v:
                break
    return bytes(out)


def _read_varints(data: bytes, count: int, pos: int = 0) -> tuple[list[int], int]:
    values = []
    for _ in range(count):
        v = shift = 0
        while True:
            if pos >= len(data) or shift > 35:
                raise CompactDecodeError("truncated or overlong header")
            byte = data[pos]
            pos += 1
            v |= (byte & 0x7F) << shift
            shift += 7
            if not byte & 0x80:
                break
        values.append(v)
    return values, pos


def _class_header(data: bytes, extra: int = 0) -> tuple[int, list[int], list[int], list[int], list[int], int]:
    """K, bounds, counts, Rice parameters, `extra` more fields, and where the header ends."""
    (k,), pos = _read_varints(data, 1)
    if not 1 <= k <= MAX_CLASSES:
        raise CompactDecodeError(f"class count {k} not in 1..{MAX_CLASSES}")
    fields, pos = _read_varints(data, (k - 1) + 2 * k + extra, pos)
    bounds, counts = fields[: k - 1], fields[k - 1 : 2 * k - 1]
    rice, rest = fields[2 * k - 1 : 3 * k - 1], fields[3 * k - 1 :]
    if bounds != sorted(set(bounds)) or any(b > 255 for b in bounds) or any(r > MAX_RICE for r in rice):
        raise CompactDecodeError(f"bad class header: bounds {bounds}, rice {rice}")
    return k, bounds, counts, rice, rest, pos


def join_chunks(chunks: list[bytes]) -> bytes:
    """A tensor's stream from its chunks' streams."""
    return _varints([len(chunks), *(len(c) for c in chunks[:-1])]) + b"".join(chunks)


def split_chunks(data: bytes) -> list[bytes]:
    """The chunk streams of a tensor's stream."""
    (n,), pos = _read_varints(data, 1)
    if not 1 <= n <= len(data):
        raise CompactDecodeError(f"chunk count {n} for a stream of {len(data)} bytes")
    lengths, pos = _read_varints(data, n - 1, pos)
    if sum(lengths) > len(data) - pos:
        raise CompactDecodeError("chunk lengths exceed the stream")
    chunks = []
    for length in [*lengths, len(data) - pos - sum(lengths)]:
        chunks.append(data[pos : pos + length])
        pos += length
    return chunks


def stream_changed(data: bytes) -> int:
    """Changed elements in a tensor stream, from its headers alone."""
    return sum(sum(_class_header(chunk)[2]) for chunk in split_chunks(data))


def chunk_stream(
    bounds: list[int], counts: list[int], rice: list[int], words: np.ndarray, raw: bytes
) -> bytes:
    """A chunk's stream from its class bounds, per class its change count and Rice parameter (all
    MAX_CLASSES of them: the unused classes are dropped), its ANS words (16-bit) and raw bits."""
    k = len(bounds) + 1
    header = _varints([k, *bounds, *counts[:k], *rice[:k], words.size])
    return header + words.astype("<u2").tobytes() + raw


def encode_chunk(s: Symbols, tables: Tables) -> bytes:
    from deltasync.codec import kernels  # not at import time: see deltasync.codec.kernels

    words, raw = kernels.ans_encode(s.starts, s.rice, s.q, s.r, s.v, tables.freq, tables.cum)
    return chunk_stream(s.bounds, np.diff(s.starts).tolist(), s.rice.tolist(), words, raw.tobytes())


def _starts(counts: list[int], numel: int, present: list[bool]) -> np.ndarray:
    # Decoding allocates ~50 B per claimed change before the stream can prove the claim false.
    if sum(counts) > numel:
        raise CompactDecodeError(f"classes claim {sum(counts)} changes among {numel} elements")
    for c, n in enumerate(counts):
        if n and not present[c]:
            raise CompactDecodeError(f"class {c} has changes but the patch has no model for it")
    starts = np.zeros(MAX_CLASSES + 1, np.int64)
    starts[1 : len(counts) + 1] = np.cumsum(counts)
    starts[len(counts) + 1 :] = starts[len(counts)]
    return starts


@dataclass
class ChunkLayout:
    """A chunk stream's checked header: class bounds, where each class's symbols start, Rice parameters (one
    per class), the number of ANS words and the byte offset where they start (the raw bits follow them)."""

    bounds: list[int]
    starts: np.ndarray
    rice: np.ndarray
    n_words: int
    words_at: int


def chunk_layout(data: bytes, size: int, tables: Tables) -> ChunkLayout:
    """The header of a chunk stream of `size` elements, checked against the patch's `tables`."""
    k, bounds, counts, rice, (n_words,), pos = _class_header(data, extra=1)
    if 2 * n_words > len(data) - pos:
        raise CompactDecodeError(f"{n_words} ANS words claimed, {len(data) - pos} bytes left")
    present = [bool(tables.present[c]) and bool(tables.present[MAX_CLASSES + c]) for c in range(k)]
    starts = _starts(counts, size, present)
    return ChunkLayout(bounds, starts, np.array(rice + [0] * (MAX_CLASSES - k), np.int64), n_words, pos)


def read_symbols(
    data: bytes, size: int, tables: Tables
) -> tuple[list[int], np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """A chunk stream of `size` elements read up to its symbols, before the old values are needed: the class
    bounds, where each class's symbols start, Rice parameters, full quotients, remainders, value steps and
    escaped raw patterns (as kernels.decode_symbols takes them)."""
    from deltasync.codec import kernels  # not at import time: see deltasync.codec.kernels

    layout = chunk_layout(data, size, tables)
    bounds, starts, rice_all, pos = layout.bounds, layout.starts, layout.rice, layout.words_at
    words = np.frombuffer(data, "<u2", layout.n_words, pos).astype(np.uint16)
    raw = np.frombuffer(data, np.uint8, offset=pos + 2 * layout.n_words).copy()
    q, r, steps, raws, status = kernels.ans_decode(
        words, raw, starts, rice_all, tables.freq, tables.cum, tables.slots
    )
    if status:
        raise CompactDecodeError(kernels.ANS_ERRORS[status])
    return bounds, starts, rice_all, q, r, steps, raws


def decode_chunk(
    data: bytes, old_bits: np.ndarray, tables: Tables, seed: int = 0, offset: int = 0
) -> tuple[np.ndarray, np.ndarray, int]:
    """Positions (sorted int64, within the chunk) and new patterns (uint16) of one chunk's changes, and how
    they move the fingerprint when the chunk is elements offset.. of a tensor whose fingerprint seed is
    `seed` (deltasync.codec.fingerprint.seed): computed while the old values are at hand."""
    from deltasync.codec import kernels  # not at import time: see deltasync.codec.kernels
    from deltasync.codec.fingerprint import R1

    bounds, *symbols = read_symbols(data, old_bits.size, tables)
    idx, new, moved, status = kernels.decode_symbols(
        old_bits, _limits(bounds), *symbols, np.uint64(seed), R1, offset
    )
    if status:
        raise CompactDecodeError(kernels.DECODE_ERRORS[status])
    return idx, new, int(moved)


def ranked_changes(data: bytes, size: int, tables: Tables) -> tuple[np.ndarray, ...]:
    """One chunk stream's changes, grouped by class: class bounds as limits, then per change its class,
    in-class rank, value step and escaped raw pattern (kernels.decode_symbols' first loop, in numpy), for
    decoders that place ranks among old values held elsewhere (a GPU's, or tensor-parallel ranks')."""
    from deltasync.codec import kernels  # not at import time: see deltasync.codec.kernels

    bounds, starts, rice, q, r, steps, raws = read_symbols(data, size, tables)
    cls = np.repeat(np.arange(len(starts) - 1, dtype=np.int8), np.diff(starts))
    gaps = (q << rice[cls]) + r + 1  # q < 2^33, rice <= MAX_RICE: no overflow
    if (gaps > size).any():  # (and below, the cumulative sums of at most 2^31 gaps <= 2^31 stay exact)
        raise CompactDecodeError(kernels.DECODE_ERRORS[1])
    ranks = np.concatenate([np.cumsum(gaps[a:b]) - 1 for a, b in zip(starts[:-1], starts[1:], strict=True)])
    return _limits(bounds), cls, ranks, steps, raws
