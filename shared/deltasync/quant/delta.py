"""The quantized delta between two steps: the codes and scales that differ, and its file.

A step of a quantized root changes codes where the bf16 value moved across a rounding boundary of the code,
and a row's scale where the row's largest magnitude changed (every code of such a row is compared again, so
the changed ones travel, not the row). Applying the delta to the previous quantized state gives the
quantization of the new bf16 state exactly, because it is the difference of the two quantized states.

File (safetensors; entries uint8, zstd): per changed tensor `NAME:gaps` (uint32 gaps between changed flat
positions, minus one), `NAME:steps` (the code bytes' steps, new - old mod 256: mostly +-1, so they compress),
and where scales changed `NAME:rows` (uint32 row gaps) and `NAME:scale` (the new fp32 scales). Metadata:
format, recipe, the fingerprints (deltasync.quant.state) of the state before and after, and per tensor
[changed codes, changed scales].
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch
import zstandard
from safetensors import SafetensorError
from safetensors.torch import load, save

from deltasync.errors import PatchError
from deltasync.quant.recipe import Recipe, row_amax
from deltasync.quant.state import (
    SCALE,
    Changes,
    Quantized,
    apply,
    fingerprint,
    fingerprint_after,
    format_fingerprint,
    quantize_state,
)

FORMAT = "deltasync.quant-delta/1"
MAGNITUDE = np.int16(0x7FFF)  # a bf16 pattern without its sign bit


def diff(old: Mapping[str, Quantized], new: Mapping[str, Quantized]) -> dict[str, Changes]:
    """The codes and scales of `new` that differ from `old` (tensors without a change left out)."""
    out = {}
    for name, q in new.items():
        new_bytes = q.code_bytes()
        positions = np.flatnonzero(old[name].code_bytes() != new_bytes)
        rows = np.flatnonzero(old[name].scales.numpy().view(np.int32) != q.scales.numpy().view(np.int32))
        if positions.size or rows.size:
            out[name] = Changes(positions, new_bytes[positions], rows, q.scales.numpy()[rows])
    return out


@dataclass(frozen=True)
class QuantStep:
    """A quantized delta computed by `Quantizer.delta`: its file, changes, and the state it leads to (each
    row's largest magnitude and the fingerprint)."""

    data: bytes
    changes: dict[str, Changes]
    amax: dict[str, torch.Tensor]
    fingerprint: int


class Quantizer:
    """The trainer's side of a quantized root: the replicas' quantized state, exactly, kept current from each
    step's bf16 changes alone, with each row's largest magnitude (bf16); and each step's delta file.

    A code moves only where its bf16 value or its row's scale did; a scale only where the row's largest
    magnitude did, which a changed element can raise, or lower where it held the largest (that row alone is
    read again). So a step costs O(changed elements + rows whose scale moved x row width)."""

    def __init__(self, state: Mapping[str, torch.Tensor], recipe: Recipe) -> None:
        self.recipe = recipe
        self.state = quantize_state(state, recipe)
        self.amax = {n: row_amax(state[n]) for n in self.state}
        self.fingerprint = fingerprint(self.state)

    def step(
        self,
        old: Mapping[str, torch.Tensor],
        new: Mapping[str, torch.Tensor],
        changed: Mapping[str, torch.Tensor],
    ) -> tuple[bytes, dict[str, Changes]]:
        """`delta`, then `advance` to it: returns its file and changes."""
        step = self.delta(old, new, changed)
        self.advance(step)
        return step.data, step.changes

    def delta(
        self,
        old: Mapping[str, torch.Tensor],
        new: Mapping[str, torch.Tensor],
        changed: Mapping[str, torch.Tensor],
    ) -> QuantStep:
        """The delta (file and changes) from the quantization of bf16 `old`, which this holds, to that of
        `new`, given each tensor's `changed` flat positions (int64, increasing: a bf16 patch's). Changes
        nothing here: a publisher advances once the step is published (an upload may fail and be retried)."""
        amax, changes = {}, {}
        for name in self.state:
            positions = changed.get(name, torch.zeros(0, dtype=torch.int64))
            amax[name], tensor_changes = self._tensor_step(name, old[name], new[name], positions)
            if tensor_changes is not None:
                changes[name] = tensor_changes
        target = fingerprint_after(self.fingerprint, self.state, changes)
        data = encode(changes, self.state, self.recipe.name, self.fingerprint, target)
        return QuantStep(data, changes, amax, target)

    def advance(self, step: QuantStep) -> None:
        """Hold the state `step` (a `delta` of the state held) leads to."""
        apply(self.state, step.changes)
        self.amax, self.fingerprint = step.amax, step.fingerprint

    def _tensor_step(
        self, name: str, old: torch.Tensor, new: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, Changes | None]:
        # On bf16 bit patterns in numpy (gathers there are fast): a magnitude is the pattern without its sign,
        # and magnitudes order as their patterns do.
        q, (height, width) = self.state[name], old.shape
        pos, old_bits, new_bits = positions.numpy(), _bits(old), _bits(new)
        rows_of = pos // width
        largest = self.amax[name].view(torch.int16).numpy()
        amax = largest.copy()
        np.maximum.at(amax, rows_of, new_bits[pos] & MAGNITUDE)
        lowered = np.zeros(height, dtype=bool)
        lowered[rows_of[(old_bits[pos] & MAGNITUDE) == largest[rows_of]]] = True
        lowered_rows = np.flatnonzero(lowered)
        amax[lowered_rows] = (new_bits.reshape(height, width)[lowered_rows] & MAGNITUDE).max(1, initial=0)
        scales = self.recipe.scales(torch.from_numpy(amax).view(torch.bfloat16)).numpy()
        rows = np.flatnonzero(scales.view(np.int32) != q.scales.numpy().view(np.int32))
        in_rows = np.zeros(height, dtype=bool)
        in_rows[rows] = True
        alone = ~in_rows[rows_of]
        whole_rows = (rows[:, None] * width + np.arange(width)).reshape(-1)
        parts = [
            self._moved_codes(q, new_bits, scales, p, r)
            for p, r in ((pos[alone], rows_of[alone]), (whole_rows, whole_rows // width))
        ]
        changed = np.concatenate([p for p, _ in parts])
        order = np.argsort(changed, kind="stable")  # two increasing runs: a merge
        amax_bf16 = torch.from_numpy(amax).view(torch.bfloat16)
        if not changed.size and not rows.size:
            return amax_bf16, None
        return amax_bf16, Changes(
            changed[order], np.concatenate([c for _, c in parts])[order], rows, scales[rows]
        )

    def _moved_codes(
        self, q: Quantized, new_bits: np.ndarray, scales: np.ndarray, positions: np.ndarray, rows: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """Of `positions` (in `rows`), those whose code the new values move, and their new code bytes."""
        values = torch.from_numpy(new_bits[positions]).view(torch.bfloat16)
        codes = self.recipe.codes(values, torch.from_numpy(scales[rows])).view(torch.uint8).numpy()
        moved = np.flatnonzero(codes != q.code_bytes()[positions])
        return positions[moved], codes[moved]


def _bits(t: torch.Tensor) -> np.ndarray:
    """The bf16 tensor `t`'s bit patterns, flat int16, sharing its memory."""
    return t.view(torch.int16).view(-1).numpy()


def changed_positions(
    old: Mapping[str, torch.Tensor], new: Mapping[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """Each tensor's flat positions whose bf16 bits differ (for callers without a bf16 patch at hand)."""
    return {
        n: torch.nonzero((old[n].view(torch.int16) != new[n].view(torch.int16)).view(-1)).squeeze(1)
        for n in old
    }


def _pack(a: np.ndarray) -> torch.Tensor:
    return torch.frombuffer(
        bytearray(zstandard.ZstdCompressor(level=3).compress(a.tobytes())), dtype=torch.uint8
    )


def _gaps(positions: np.ndarray) -> np.ndarray:
    return np.diff(positions, prepend=-1).astype(np.uint32) - np.uint32(1)


def encode(
    changes: Mapping[str, Changes], old: Mapping[str, Quantized], recipe: str, base_fp: int, target_fp: int
) -> bytes:
    """The delta file of `changes` to quantized state `old` (fingerprint `base_fp`), reaching `target_fp`."""
    entries: dict[str, torch.Tensor] = {}
    counts: dict[str, list[int]] = {}
    for name, d in changes.items():
        steps = d.codes - old[name].code_bytes()[d.positions]  # uint8: mod 256
        entries |= {f"{name}:gaps": _pack(_gaps(d.positions)), f"{name}:steps": _pack(steps)}
        if d.rows.size:
            entries |= {f"{name}:rows": _pack(_gaps(d.rows)), f"{name}{SCALE}": _pack(d.scales)}
        counts[name] = [int(d.positions.size), int(d.rows.size)]
    meta = {
        "format": FORMAT,
        "recipe": recipe,
        "base_fingerprint": format_fingerprint(base_fp),
        "fingerprint": format_fingerprint(target_fp),
        "tensors": json.dumps(counts),
    }
    return save(entries, metadata=meta)


def _read(data: bytes) -> tuple[dict, dict[str, torch.Tensor]]:
    """The metadata and entries of a delta file; PatchError if it is not one."""
    try:
        entries = load(data)  # safetensors checks the layout, the header's size included
        meta = json.loads(data[8 : 8 + int.from_bytes(data[:8], "little")]).get("__metadata__")
    except (SafetensorError, ValueError, RecursionError, AttributeError) as e:
        raise PatchError(f"not a safetensors file: {e}") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        found = meta.get("format") if isinstance(meta, dict) else None
        raise PatchError(f"not a quantized delta (format {found!r:.60})")
    return meta, entries


def _unpack(entries: dict, key: str, count: int, dtype: type) -> np.ndarray:
    size = count * np.dtype(dtype).itemsize
    try:
        raw = zstandard.ZstdDecompressor().decompress(
            entries.pop(key).numpy().tobytes(), max_output_size=size
        )
    except KeyError:
        raise PatchError(f"entry {key!r} is missing") from None
    except zstandard.ZstdError as e:
        raise PatchError(f"entry {key!r} is corrupt: {e}") from None
    if len(raw) != size:
        raise PatchError(f"entry {key!r} holds {len(raw)} bytes, its count says {size}")
    return np.frombuffer(raw, dtype)


def _positions(entries: dict, key: str, count: int, limit: int) -> np.ndarray:
    positions = np.cumsum(_unpack(entries, key, count, np.uint32).astype(np.int64) + 1) - 1
    if positions.size and positions[-1] >= limit:
        raise PatchError(f"entry {key!r} reaches position {positions[-1]}, beyond its tensor's {limit}")
    return positions


def _is_count_pair(v: object) -> bool:
    return isinstance(v, list) and len(v) == 2 and all(type(x) is int for x in v)


def decode(
    data: bytes, state: Mapping[str, Quantized], recipe: str, base_fp: int
) -> tuple[dict[str, Changes], int]:
    """The delta in `data` and the fingerprint it reaches, checked against quantized `state` (fingerprint
    `base_fp`) before anything is written: PatchError in one line if the file is corrupt, made for another
    recipe or state, or does not reach the fingerprint it promises."""
    meta, entries = _read(data)
    if meta.get("recipe") != recipe:
        raise PatchError(
            f"a delta for quantization {meta.get('recipe')!r:.60}, this replica serves {recipe!r}"
        )
    try:
        base, target = int(meta["base_fingerprint"], 16), int(meta["fingerprint"], 16)
        counts = json.loads(meta["tensors"])
    except (KeyError, ValueError, TypeError, RecursionError) as e:
        raise PatchError(f"bad quantized delta metadata or entries: {e!r:.200}") from None
    if base != base_fp:
        held = format_fingerprint(base_fp)
        raise PatchError(f"made for state {format_fingerprint(base)}, this replica holds {held}")
    if not isinstance(counts, dict) or not all(_is_count_pair(v) for v in counts.values()):
        raise PatchError("bad quantized delta metadata: 'tensors' is not {name: [codes, scales]}")
    delta = {}
    for name, (changed, rows) in counts.items():
        if name not in state:
            raise PatchError(f"changes {name!r:.200}, which this replica does not hold quantized")
        q = state[name]
        if not 0 <= changed <= q.codes.numel() or not 0 <= rows <= q.scales.numel():
            raise PatchError(f"{name}: {changed} codes and {rows} scales changed, beyond its shape")
        positions = _positions(entries, f"{name}:gaps", changed, q.codes.numel())
        codes = _unpack(entries, f"{name}:steps", changed, np.uint8) + q.code_bytes()[positions]
        row_idx = (
            _positions(entries, f"{name}:rows", rows, q.scales.numel()) if rows else np.zeros(0, np.int64)
        )
        scales = _unpack(entries, name + SCALE, rows, np.float32) if rows else np.zeros(0, np.float32)
        delta[name] = Changes(positions, codes, row_idx, scales)
    if entries:
        raise PatchError(f"entries no tensor count names: {sorted(entries)[:3]}")
    reached = fingerprint_after(base_fp, state, delta)
    if reached != target:
        raise PatchError(
            f"reaches {format_fingerprint(reached)}, not the {format_fingerprint(target)} it promises"
        )
    return delta, target
