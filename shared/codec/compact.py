"""The compact encoding: lossless sparse bf16 changes near their entropy, given the receiver's old weights.

Per tensor, every element falls in one of K <= 4 classes by the exponent of its OLD value, which both sides
hold. Small weights change far more often than large ones, so positions are coded per class:

- positions: per class, the gaps between the ranks (among that class's elements) of the changed elements,
  Rice-split into q = gap >> k (categorical model) and k low bits (uniform);
- values: zigzag(new_bits - old_bits), nearly always 1 or 2 (a one-ulp move), categorical model; the rare
  bigger jump escapes to the raw 16-bit pattern.

The categorical tables are pooled per class index over the whole patch (they are alike across tensors), so
a tensor only carries a few varints: its class bounds, changed count and Rice parameter per class.
Entropy stage: the ANS coder of `constriction`. The per-element loops are compiled (deltasync.codec.kernels):
ranks and positions cost one branch-free pass over the old bits plus a short walk per change; a tensor with
one class needs no pass.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import constriction
import numpy as np
import torch

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


# ----------------------------------------------------------------------------------------------- symbols


@dataclass
class TensorSymbols:
    """One tensor's changes turned into symbols, before the patch-wide models exist."""

    bounds: list[int]
    counts: list[int]
    rice: list[int]
    q: list[np.ndarray]
    r: list[np.ndarray]
    v: list[np.ndarray]
    q_hist: np.ndarray
    v_hist: np.ndarray
    estimated_bits: float


def to_symbols(old_bits: torch.Tensor, idx: torch.Tensor, new_bits: torch.Tensor) -> TensorSymbols:
    """Symbols for changed positions `idx` (sorted int64) with new patterns `new_bits` (int16)."""
    from deltasync.codec import kernels  # not at import time: see deltasync.codec.kernels

    old_np, idx_np = old_bits.cpu().numpy(), idx.cpu().numpy()
    bounds, position_bits = kernels.choose_bounds(*kernels.exponent_histograms(old_np, idx_np))
    bounds = bounds.tolist()
    starts, rice, q, r, v, q_hist, v_hist = kernels.encode_symbols(
        old_np, _limits(bounds), idx_np, new_bits.cpu().numpy()
    )
    classes = [slice(starts[c], starts[c + 1]) for c in range(len(bounds) + 1)]
    return TensorSymbols(
        bounds=bounds,
        counts=[int(starts[c + 1] - starts[c]) for c in range(len(classes))],
        rice=rice[: len(classes)].tolist(),
        q=[q[s] for s in classes],
        r=[r[s] for s in classes],
        v=[v[s] for s in classes],
        q_hist=q_hist,
        v_hist=v_hist,
        estimated_bits=position_bits + 1.5 * idx.numel(),
    )


def tally(models: Models, s: TensorSymbols) -> None:
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
    starts = np.zeros(MAX_CLASSES + 1, np.int64)
    starts[1 : k + 1] = np.cumsum(counts)
    starts[k + 1 :] = starts[k]
    q, r = np.empty(starts[-1], np.int64), np.zeros(starts[-1], np.int64)
    steps, raws = np.empty(starts[-1], np.int64), np.zeros(starts[-1], np.int64)
    classes = [slice(starts[c], starts[c + 1]) for c in range(k)]
    for c, sel in enumerate(classes):
        if not counts[c]:
            continue
        q[sel] = coder.decode(q_models[c], counts[c])
        big = np.nonzero(q[sel] == Q_SYMBOLS - 1)[0] + starts[c]
        if big.size:
            halves = coder.decode(_uniform16, 2 * big.size).astype(np.int64).reshape(-1, 2)
            q[big] += (halves[:, 0] << 16) | halves[:, 1]
        if rice[c]:
            r[sel] = coder.decode(_model.Uniform(1 << rice[c]), counts[c])
    for c, sel in enumerate(classes):
        if not counts[c]:
            continue
        steps[sel] = coder.decode(v_models[c], counts[c])
        steps[sel] += 1
        escaped = np.nonzero(steps[sel] == V_SYMBOLS)[0] + starts[c]
        if escaped.size:
            raws[escaped] = coder.decode(_uniform16, escaped.size)
    from deltasync.codec import kernels  # not at import time: see deltasync.codec.kernels

    rice = np.array(rice + [0] * (MAX_CLASSES - k), np.int64)
    idx, new, status = kernels.decode_symbols(
        old_bits.numpy(), _limits(bounds), starts, rice, q, r, steps, raws
    )
    if status:
        raise CompactDecodeError(kernels.DECODE_ERRORS[status])
    return torch.from_numpy(idx).to(device), torch.from_numpy(new.view(np.int16)).to(device)
