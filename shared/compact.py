"""The compact encoding: lossless sparse bf16 changes near their entropy, given the receiver's old weights.

Per tensor, every element falls in one of K <= 4 classes by the exponent of its OLD value, which both sides
hold. Small weights change far more often than large ones, so positions are coded per class:

- positions: per class, the gaps between the ranks (among that class's elements) of the changed elements,
  Rice-split into q = gap >> k (categorical model) and k low bits (uniform);
- values: zigzag(new_bits - old_bits), nearly always 1 or 2 (a one-ulp move), categorical model; the rare
  bigger jump escapes to the raw 16-bit pattern.

The categorical tables are pooled per class index over the whole patch (they are alike across tensors), so
a tensor only carries a few varints: its class bounds, changed count and Rice parameter per class.
Entropy stage: the ANS coder of `constriction`. A class "rank -> position" map costs one pass over the old
bits: a 16-bit lookup gives each element a one-hot class lane, and running counts per 64-element block
locate the n-th element of a class with a binary search plus one block scan.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import constriction
import numpy as np
import torch

from shared.bf16 import exponents

MAX_CLASSES = 4
BLOCK = 32  # elements per block of class counts; positions inside a block are found by a scan
Q_SYMBOLS = 32  # Rice quotients 0..30, 31 escapes to a raw 32-bit quotient
V_SYMBOLS = 16  # zigzag value steps 1..15, 16 escapes to the raw 16-bit new pattern
MAX_RICE = 23  # constriction's uniform model handles < 2^24
CLASS_COST_BITS = 48.0  # rough header + model cost of one more class, for choosing K
_CHUNK = 1 << 16  # elements resolved at once: bounds the [chunk, BLOCK] windows

_model = constriction.stream.model
_uniform16 = _model.Uniform(1 << 16)


class CompactDecodeError(ValueError):
    """A compact tensor stream that cannot be what an encoder wrote."""


@dataclass
class Models:
    """Categorical frequency tables pooled over a patch: Rice quotients and value steps, per class index."""

    q: np.ndarray = field(default_factory=lambda: np.zeros((MAX_CLASSES, Q_SYMBOLS), np.int64))
    v: np.ndarray = field(default_factory=lambda: np.zeros((MAX_CLASSES, V_SYMBOLS), np.int64))

    def to_json(self) -> dict:
        return {"q": self.q.tolist(), "v": self.v.tolist()}

    @classmethod
    def from_json(cls, obj: dict) -> Models:
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
        ):
            raise CompactDecodeError("bad compact model tables: wrong shape or negative counts")
        return cls(q, v)

    def categorical(self) -> tuple[list, list]:
        """ANS models. Frequencies are integers, so encoder and decoder build bit-identical tables."""
        return [_categorical(c) for c in self.q], [_categorical(c) for c in self.v]


def _categorical(counts: np.ndarray):
    return _model.Categorical(counts.astype(np.float64), perfect=False) if counts.sum() else None


# ----------------------------------------------------------------------------------------------- classes


class ClassLayout:
    """Where the n-th element of each class sits in a tensor, given the old bits and the class bounds.

    Class c holds the elements whose magnitude bits (bits & 0x7FFF, ordered like |value|) lie in
    [lower(c), upper(c)). Per-block class counts cost one compare-and-sum pass per bound; positions
    inside a block are resolved only for the elements asked about.
    """

    def __init__(self, old_bits: torch.Tensor, bounds: list[int]):
        self.k = len(bounds) + 1
        self.limits = [0] + [b << 7 for b in bounds]
        pad = -old_bits.numel() % BLOCK
        magnitude = old_bits & 0x7FFF
        if pad:  # -1 is below every class, so padding never counts
            magnitude = torch.nn.functional.pad(magnitude, (0, pad), value=-1)
        self.magnitude = magnitude.view(-1, BLOCK)
        at_least = [_count_per_block(self.magnitude >= t) for t in self.limits[1:]]
        valid = torch.full_like(self.magnitude[:, 0], BLOCK, dtype=torch.int64)
        valid[-1] -= pad
        bounds_counts = [valid, *at_least, torch.zeros_like(valid)]
        per_class = torch.stack([bounds_counts[c] - bounds_counts[c + 1] for c in range(self.k)])
        # prefix[c, b] = number of class-c elements before block b.
        self.prefix = torch.nn.functional.pad(per_class.cumsum(1), (1, 0))
        self.sizes = self.prefix[:, -1].tolist()

    def _in_class(self, blocks: torch.Tensor, c: int) -> torch.Tensor:
        window = self.magnitude[blocks]
        lower = window >= self.limits[c]  # limits[0] = 0 keeps the padding (-1) out of class 0
        return lower & (window < self.limits[c + 1]) if c + 1 < self.k else lower

    def ranks(self, idx: torch.Tensor, c: int) -> torch.Tensor:
        """Ranks of the class-`c` elements at sorted positions `idx` among all class-`c` elements."""
        out = []
        for chunk in idx.split(_CHUNK):
            block, offset = chunk // BLOCK, chunk % BLOCK
            before = self._in_class(block, c) & (torch.arange(BLOCK, device=chunk.device) < offset[:, None])
            out.append(self.prefix[c, block] + before.sum(1))
        return torch.cat(out) if out else idx

    def positions(self, c: int, ranks: torch.Tensor) -> torch.Tensor:
        """Flat positions of the class-`c` elements with the given ranks (valid and sorted)."""
        out = []
        for chunk in ranks.split(_CHUNK):
            block = torch.searchsorted(self.prefix[c], chunk, right=True) - 1
            within = chunk - self.prefix[c, block]
            seen = self._in_class(block, c).cumsum(1)
            out.append(block * BLOCK + (seen <= within[:, None]).sum(1))
        return torch.cat(out) if out else ranks


def _count_per_block(flags: torch.Tensor) -> torch.Tensor:
    """Row sums of a [blocks, 64] bool tensor. Summing eight flags per int64 word (one per byte, no carry)
    then folding the bytes is ~15x faster on CPU than a bool reduction."""
    words = flags.view(torch.uint8).view(torch.int64).view(-1, BLOCK // 8).sum(1)
    return ((words * 0x0101010101010101) >> 56) & 0xFF


def _binary_entropy_bits(k: np.ndarray, n: np.ndarray) -> np.ndarray:
    """Bits to code which k of n i.i.d. elements changed."""
    n = np.maximum(n, k).astype(np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        p = np.where(n > 0, k / np.maximum(n, 1), 0.0)
        bits = -(k * np.log2(np.where(p > 0, p, 1)) + (n - k) * np.log2(np.where(p < 1, 1 - p, 1)))
    return np.nan_to_num(bits)


def choose_bounds(old_bits: torch.Tensor, changed_exponents: np.ndarray) -> tuple[list[int], float]:
    """Exponent bounds of up to MAX_CLASSES contiguous classes that minimise the position cost (bits).

    An exact dynamic program over the exponent histogram; the population histogram comes from a
    strided sample of large tensors (only the choice depends on it, never correctness).
    """
    stride = max(1, old_bits.numel() >> 16)
    sample = exponents(old_bits[::stride])
    population = torch.bincount(sample, minlength=256).cpu().numpy().astype(np.float64) * stride
    changed = np.bincount(changed_exponents, minlength=256).astype(np.float64)
    bins = np.nonzero((population > 0) | (changed > 0))[0]
    cn = np.concatenate([[0.0], np.cumsum(population[bins])])
    ck = np.concatenate([[0.0], np.cumsum(changed[bins])])
    e = len(bins)
    # cost[i, j]: one class holding bins i..j-1.
    cost = _binary_entropy_bits(ck[None, :] - ck[:, None], cn[None, :] - cn[:, None]) + CLASS_COST_BITS
    cost[np.tril_indices(e + 1)] = np.inf
    best, arg = [cost[0]], []
    for _ in range(1, MAX_CLASSES):
        total = best[-1][:, None] + cost
        arg.append(total.argmin(0))
        best.append(total.min(0))
    k = int(np.argmin([b[e] for b in best]))
    bounds, j = [], e
    for g in range(k, 0, -1):
        j = int(arg[g - 1][j])
        bounds.append(int(bins[j]))
    return sorted(bounds), float(best[k][e])


# ----------------------------------------------------------------------------------------------- symbols


def _zigzag(d: np.ndarray) -> np.ndarray:
    return (d << 1) ^ (d >> 31)


def _unzigzag(z: np.ndarray) -> np.ndarray:
    return (z >> 1) ^ -(z & 1)


@dataclass
class TensorSymbols:
    """One tensor's changes turned into symbols, before the patch-wide models exist."""

    bounds: list[int]
    counts: list[int]
    rice: list[int]
    q: list[np.ndarray]
    r: list[np.ndarray]
    v: list[np.ndarray]
    estimated_bits: float


def to_symbols(old_bits: torch.Tensor, idx: torch.Tensor, new_bits: torch.Tensor) -> TensorSymbols:
    """Symbols for changed positions `idx` (sorted int64) with new patterns `new_bits` (int16)."""
    old_at = old_bits[idx]
    changed_exp = exponents(old_at)
    bounds, position_bits = choose_bounds(old_bits, changed_exp.cpu().numpy())
    cls = torch.bucketize(changed_exp, torch.tensor(bounds, dtype=torch.int32, device=idx.device), right=True)
    layout = ClassLayout(old_bits, bounds) if bounds else None
    sizes = layout.sizes if layout else [old_bits.numel()]
    ranks = torch.empty_like(idx)
    for c in range(len(bounds) + 1):
        sel = cls == c
        ranks[sel] = layout.ranks(idx[sel], c) if layout else idx[sel]
    cls, ranks = cls.cpu().numpy(), ranks.cpu().numpy()
    steps = _zigzag(new_bits.cpu().numpy().astype(np.int32) - old_at.cpu().numpy().astype(np.int32))
    new_np = new_bits.cpu().numpy().astype(np.int32) & 0xFFFF
    out = TensorSymbols(bounds, [], [], [], [], [], position_bits + 1.5 * idx.numel())
    for c in range(len(bounds) + 1):
        sel = cls == c
        r_c = ranks[sel]  # ascending: idx is sorted and ranks are monotone within a class
        gaps = np.diff(r_c, prepend=-1) - 1
        k = int(r_c.size)
        rice = 0 if k == 0 else min(MAX_RICE, max(0, int(math.log2(max(1.0, sizes[c] * math.log(2) / k)))))
        q = gaps >> rice
        out.counts.append(k)
        out.rice.append(rice)
        out.q.append(q)
        out.r.append(gaps & ((1 << rice) - 1))
        out.v.append(np.where(steps[sel] < V_SYMBOLS, steps[sel], new_np[sel] + (V_SYMBOLS << 16)))
    return out


def tally(models: Models, s: TensorSymbols) -> None:
    for c, (q, v) in enumerate(zip(s.q, s.v, strict=True)):
        models.q[c] += np.bincount(np.minimum(q, Q_SYMBOLS - 1), minlength=Q_SYMBOLS)
        models.v[c] += np.bincount(np.minimum(v - 1, V_SYMBOLS - 1), minlength=V_SYMBOLS)


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


def stream_changed(data: bytes) -> int:
    """Changed elements in a tensor stream, from its header alone."""
    (k,), pos = _read_varints(data, 1)
    if not 1 <= k <= MAX_CLASSES:
        raise CompactDecodeError(f"class count {k} not in 1..{MAX_CLASSES}")
    fields, _ = _read_varints(data, 2 * k - 1, pos)
    return sum(fields[k - 1 :])


def encode_stream(s: TensorSymbols, q_models: list, v_models: list) -> bytes:
    """One tensor's stream: varint header (K, bounds, counts, Rice), then ANS words (little-endian u32)."""
    coder = constriction.stream.stack.AnsCoder()
    # ANS is a stack: push in the reverse of the decoding order (positions per class, then values per class).
    for c in reversed(range(len(s.counts))):
        if not s.counts[c]:
            continue
        v = s.v[c]
        escaped = v >= (V_SYMBOLS << 16)
        if escaped.any():
            coder.encode_reverse((v[escaped] & 0xFFFF).astype(np.int32), _uniform16)
        coder.encode_reverse((np.minimum(v, V_SYMBOLS) - 1).astype(np.int32), v_models[c])
    for c in reversed(range(len(s.counts))):
        if not s.counts[c]:
            continue
        q = s.q[c]
        if s.rice[c]:
            coder.encode_reverse(s.r[c].astype(np.int32), _model.Uniform(1 << s.rice[c]))
        big = q[q >= Q_SYMBOLS - 1] - (Q_SYMBOLS - 1)
        if big.size:
            halves = np.stack([big >> 16, big & 0xFFFF], 1).reshape(-1)
            coder.encode_reverse(halves.astype(np.int32), _uniform16)
        coder.encode_reverse(np.minimum(q, Q_SYMBOLS - 1).astype(np.int32), q_models[c])
    header = _varints([len(s.counts), *s.bounds, *s.counts, *s.rice])
    return header + coder.get_compressed().astype("<u4").tobytes()


def decode_stream(
    data: bytes, old_bits: torch.Tensor, q_models: list, v_models: list
) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions (sorted int64) and new bit patterns (int16) of one tensor's changes."""
    (k,), pos = _read_varints(data, 1)
    if not 1 <= k <= MAX_CLASSES:
        raise CompactDecodeError(f"class count {k} not in 1..{MAX_CLASSES}")
    fields, pos = _read_varints(data, (k - 1) + 2 * k, pos)
    bounds, counts, rice = fields[: k - 1], fields[k - 1 : 2 * k - 1], fields[2 * k - 1 :]
    if bounds != sorted(set(bounds)) or any(b > 255 for b in bounds) or any(r > MAX_RICE for r in rice):
        raise CompactDecodeError(f"bad class header: bounds {bounds}, rice {rice}")
    if (len(data) - pos) % 4:
        raise CompactDecodeError("ANS payload is not a whole number of 32-bit words")
    layout = ClassLayout(old_bits, bounds) if bounds else None
    sizes = layout.sizes if layout else [old_bits.numel()]
    for c, n in enumerate(counts):
        if n > sizes[c]:
            raise CompactDecodeError(f"class {c} claims {n} changes among {sizes[c]} elements")
        if n and (q_models[c] is None or v_models[c] is None):
            raise CompactDecodeError(f"class {c} has changes but the patch has no model for it")
    coder = constriction.stream.stack.AnsCoder(np.frombuffer(data, "<u4", offset=pos).astype(np.uint32))
    positions, steps, raws = [], [], []
    for c, n in enumerate(counts):
        if not n:
            continue
        q = coder.decode(q_models[c], n).astype(np.int64)
        big = np.nonzero(q == Q_SYMBOLS - 1)[0]
        if big.size:
            halves = coder.decode(_uniform16, 2 * big.size).astype(np.int64).reshape(-1, 2)
            q[big] += (halves[:, 0] << 16) | halves[:, 1]
        r = coder.decode(_model.Uniform(1 << rice[c]), n).astype(np.int64) if rice[c] else 0
        ranks = np.cumsum((q << rice[c]) + r + 1) - 1
        if ranks[-1] >= sizes[c]:
            raise CompactDecodeError(f"class {c} rank {int(ranks[-1])} beyond its {sizes[c]} elements")
        ranks_t = torch.from_numpy(ranks).to(old_bits.device)
        positions.append(layout.positions(c, ranks_t) if layout else ranks_t)
    for c, n in enumerate(counts):
        if not n:
            continue
        step = coder.decode(v_models[c], n).astype(np.int32) + 1
        escaped = np.nonzero(step == V_SYMBOLS)[0]
        raw = np.zeros(n, np.int32)
        if escaped.size:
            raw[escaped] = coder.decode(_uniform16, escaped.size)
        steps.append(step)
        raws.append(raw)
    if not positions:
        empty = torch.zeros(0, dtype=torch.int64, device=old_bits.device)
        return empty, empty.to(torch.int16)
    idx = torch.cat(positions)
    step = np.concatenate(steps)
    old = old_bits[idx].cpu().numpy().astype(np.int32)
    new = np.where(step == V_SYMBOLS, np.concatenate(raws), old + _unzigzag(step))
    if (new < -(1 << 15)).any() or (new >= 1 << 16).any() or ((new >= 1 << 15) & (step != V_SYMBOLS)).any():
        raise CompactDecodeError("a value step leaves the 16-bit range")
    new_t = torch.from_numpy(new.astype(np.uint16).view(np.int16)).to(old_bits.device)
    order = torch.argsort(idx)
    return idx[order], new_t[order]
