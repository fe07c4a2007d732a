"""The compact encoding: lossless sparse bf16 changes near their entropy, given the receiver's old weights.

Per tensor, every element falls in one of K <= 4 classes by the exponent of its OLD value, which both sides
hold. Small weights change far more often than large ones, so positions are coded per class:

- positions: per class, the gaps between the ranks (among that class's elements) of the changed elements,
  Rice-split into q = gap >> k (categorical model) and k low bits (uniform);
- values: zigzag(new_bits - old_bits), nearly always 1 or 2 (a one-ulp move), categorical model; the rare
  bigger jump escapes to the raw 16-bit pattern.

The categorical tables are pooled per class index over the whole patch (they are alike across tensors), so
a tensor only carries a few varints: its class bounds, changed count and Rice parameter per class.
Entropy stage: the ANS coder of `constriction`. Ranks and positions cost one compiled pass (numba) over the
old bits, counting each class's elements as it goes; a patch with one class per tensor needs no pass.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

import constriction
import numpy as np
import torch

from shared.bf16 import exponents

MAX_CLASSES = 4
Q_SYMBOLS = 32  # Rice quotients 0..30, 31 escapes to a raw 32-bit quotient
V_SYMBOLS = 16  # zigzag value steps 1..15, 16 escapes to the raw 16-bit new pattern
MAX_RICE = 23  # constriction's uniform model handles < 2^24
CLASS_COST_BITS = 48.0  # rough header + model cost of one more class, for choosing K

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


def _limits(bounds: list[int]) -> np.ndarray:
    """Magnitude thresholds (bits & 0x7FFF) of classes 1..3; unused ones are unreachable."""
    return np.array([b << 7 for b in bounds] + [1 << 15] * (MAX_CLASSES - 1 - len(bounds)), np.int64)


def _jit(fn):
    """`fn` compiled by numba at its first call. Lazily, because numba must not be loaded in the inference
    Space before vLLM starts: vLLM's CPU worker, forked from the app (which imports this module), scans every
    loaded module for Triton kernels at start-up and crashes on llvmlite's function wrappers."""
    compiled = None

    @functools.wraps(fn)
    def call(*args):
        nonlocal compiled
        if compiled is None:
            import numba

            compiled = numba.njit(nogil=True, cache=True)(fn)
        return compiled(*args)

    return call


@_jit
def _class_ranks(old_bits, limits, idx):
    """Class and in-class rank of each sorted position in `idx`, and the size of each class."""
    sizes = np.zeros(MAX_CLASSES, np.int64)
    cls = np.empty(idx.size, np.int64)
    ranks = np.empty(idx.size, np.int64)
    j, nxt = 0, idx[0] if idx.size else -1
    for i in range(old_bits.size):
        m = old_bits[i] & 0x7FFF
        c = (m >= limits[0]) + (m >= limits[1]) + (m >= limits[2])
        if i == nxt:
            cls[j], ranks[j] = c, sizes[c]
            j += 1
            nxt = idx[j] if j < idx.size else -1
        sizes[c] += 1
    return cls, ranks, sizes


@_jit
def _class_positions(old_bits, limits, ranks, starts):
    """The inverse: class c's ranks are ranks[starts[c]:starts[c + 1]], ascending. Returns the positions in
    ascending order, for each the index of its rank in `ranks`, and whether every rank was found."""
    ptr, end = starts[:MAX_CLASSES].copy(), starts[1:].copy()
    sizes = np.zeros(MAX_CLASSES, np.int64)
    positions = np.empty(ranks.size, np.int64)
    source = np.empty(ranks.size, np.int64)
    found = 0
    for i in range(old_bits.size):
        if found == ranks.size:
            break
        m = old_bits[i] & 0x7FFF
        c = (m >= limits[0]) + (m >= limits[1]) + (m >= limits[2])
        p = ptr[c]
        if p < end[c] and ranks[p] == sizes[c]:
            positions[found], source[found] = i, p
            found += 1
            ptr[c] = p + 1
        sizes[c] += 1
    return positions[:found], source[:found], found == ranks.size


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
    stride = max(1, old_bits.numel() >> 14)
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
    old_bits, idx, new_bits = old_bits.cpu(), idx.cpu(), new_bits.cpu()
    old_at = old_bits[idx]
    bounds, position_bits = choose_bounds(old_bits, exponents(old_at).numpy())
    if bounds:
        cls, ranks, sizes = _class_ranks(old_bits.numpy(), _limits(bounds), idx.numpy())
    else:
        cls, ranks, sizes = np.zeros(idx.numel(), np.int64), idx.numpy(), [old_bits.numel()]
    steps = _zigzag(new_bits.numpy().astype(np.int32) - old_at.numpy().astype(np.int32))
    new_np = new_bits.numpy().astype(np.int32) & 0xFFFF
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
    device, old_bits = old_bits.device, old_bits.cpu()
    numel = old_bits.numel()
    for c, n in enumerate(counts):
        if n > numel:
            raise CompactDecodeError(f"class {c} claims {n} changes among {numel} elements")
        if n and (q_models[c] is None or v_models[c] is None):
            raise CompactDecodeError(f"class {c} has changes but the patch has no model for it")
    coder = constriction.stream.stack.AnsCoder(np.frombuffer(data, "<u4", offset=pos).astype(np.uint32))
    ranks, steps, raws = [], [], []
    for c, n in enumerate(counts):
        if not n:
            continue
        q = coder.decode(q_models[c], n).astype(np.int64)
        big = np.nonzero(q == Q_SYMBOLS - 1)[0]
        if big.size:
            halves = coder.decode(_uniform16, 2 * big.size).astype(np.int64).reshape(-1, 2)
            q[big] += (halves[:, 0] << 16) | halves[:, 1]
        r = coder.decode(_model.Uniform(1 << rice[c]), n).astype(np.int64) if rice[c] else 0
        ranks.append(np.cumsum((q << rice[c]) + r + 1) - 1)
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
    if not ranks:
        return torch.zeros(0, dtype=torch.int64, device=device), torch.zeros(
            0, dtype=torch.int16, device=device
        )
    all_ranks = np.concatenate(ranks)
    if k == 1:  # one class: ranks are positions
        if all_ranks[-1] >= numel:
            raise CompactDecodeError(f"position {int(all_ranks[-1])} beyond the tensor's {numel} elements")
        idx, order = all_ranks, slice(None)
    else:
        starts = np.zeros(MAX_CLASSES + 1, np.int64)
        starts[1 : k + 1] = np.cumsum(counts)
        starts[k + 1 :] = starts[k]
        idx, order, complete = _class_positions(old_bits.numpy(), _limits(bounds), all_ranks, starts)
        if not complete:
            raise CompactDecodeError("a class rank lies beyond that class's elements")
    step, raw = np.concatenate(steps)[order], np.concatenate(raws)[order]
    old = old_bits.numpy()[idx].astype(np.int32)
    new = np.where(step == V_SYMBOLS, raw, old + _unzigzag(step))
    if (new < -(1 << 15)).any() or (new >= 1 << 16).any() or ((new >= 1 << 15) & (step != V_SYMBOLS)).any():
        raise CompactDecodeError("a value step leaves the 16-bit range")
    new_bits = torch.from_numpy(new.astype(np.uint16).view(np.int16))
    return torch.from_numpy(idx).to(device), new_bits.to(device)
