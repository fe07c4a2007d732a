"""The patch file: the exact changes from one bf16 model state to the next, as one safetensors file.

Layout (every patch is a valid safetensors file; the header's `__metadata__` holds strings only):

    format            "deltasync.patch"            version   "2"
    encoding          "compact" | "raw"
    dtype             "bf16": the weights' (optional: a patch without it is bf16; readers refuse any other)
    step, base_step   the state this patch produces, and the one it applies to
    numel, changed    elements in the whole model, elements this patch changes
    schema            16 hex digits: hash of every tensor's name and shape in the model (see schema_hash)
    fingerprint       16 hex digits: deltasync.codec.fingerprint of the full state after the patch
    base_fingerprint  the same for the state it applies to (a patch never applies anywhere else)
    models            (compact only) JSON of the pooled categorical tables, see deltasync.codec.compact
    dense             (compact only) JSON {name: changed} for the tensors stored dense
    chunk             (compact only) elements per independently coded chunk of a tensor
    windows           (optional) JSON {name: [start, length]}: the entry of `name` covers only flat elements
                      [start, start + length) of the tensor (one rank's shard, see deltasync.sync.sharded);
                      its positions, chunk grid and dense values are relative to that window

Entries, per changed tensor `name` (HF checkpoint names), by mode:
    raw      `name/indices` I32 flat positions (strictly increasing) and `name/values` BF16 new values:
             what vLLM's CheckpointWeightPatch takes
    compact  `name` U8: the tensor's compact stream (needs the old weights to decode)
    dense    `name` BF16 with the tensor's shape: all its new values (chosen when changes are dense)
The entries say which tensors changed and how; nothing else repeats their names.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from deltasync.codec import compact, fingerprint
from deltasync.codec.backend import Decoder, TensorChanges, backend_for, backend_on
from deltasync.codec.bf16 import bits
from deltasync.codec.changes import diff, diff_and_moves
from deltasync.codec.header import (
    DTYPE,
    ENCODINGS,
    FORMAT,
    VERSION,
    PatchInfo,
    metadata_json,
    read_info,
    schema_hash,
)
from deltasync.codec.host import decode_chunk, host_streams
from deltasync.codec.parallel import parallel_map, spans
from deltasync.errors import PatchError

Tables = compact.Tables  # a compact patch's rANS tables (read_tables), for decoders' signatures
FINGERPRINT_SPAN = 1 << 20  # changed elements per unit of fingerprint work


@dataclass
class Patch:
    step: int
    base_step: int
    numel: int
    base_fingerprint: int
    fingerprint: int
    changes: dict[str, TensorChanges]

    @property
    def changed(self) -> int:
        return sum(len(c) for c in self.changes.values())


def fingerprint_after(
    base_fingerprint: int, old: Mapping[str, torch.Tensor], changes: dict, threads: int | None = None
) -> int:
    """The fingerprint of `old` with `changes` applied, in O(changed elements), on `threads` threads."""
    from deltasync.codec import kernels  # not at import time: see deltasync.codec.kernels

    gathered = _gather_on_devices(old, changes)

    def moved(work: tuple[str, int, int]) -> int:
        name, lo, hi = work
        if name in gathered:
            idx, before, after = (a[lo:hi] for a in gathered[name])
            return fingerprint.delta(name, idx, before, after)
        ch = changes[name]  # old on the host: no torch op, its thread pool would spin beside ours
        idx = ch.indices[lo:hi].cpu().numpy()
        before = kernels.gather(bits(old[name]).numpy(), idx)
        return fingerprint.delta(name, idx, before, bits(ch.values[lo:hi]).cpu().numpy())

    work = [(n, lo, hi) for n, ch in changes.items() for lo, hi in spans(len(ch), FINGERPRINT_SPAN)]
    return (base_fingerprint + sum(parallel_map(moved, work, threads))) & fingerprint.MASK64


def _gather_on_devices(old: Mapping[str, torch.Tensor], changes: dict) -> dict[str, tuple[np.ndarray, ...]]:
    """Positions, old and new bit patterns of the changes to `old`'s accelerator tensors, on the host: one
    copy per device for all tensors, not a round trip per tensor."""
    names = [n for n in changes if old[n].device.type != "cpu"]
    rows = []
    for name in names:
        idx = changes[name].indices.to(old[name].device)
        after = bits(changes[name].values).to(idx.device)
        rows.append(torch.stack([idx.long(), bits(old[name])[idx].long(), after.long()]))
    return {
        n: (r[0], r[1].astype(np.int16), r[2].astype(np.int16))
        for n, r in zip(names, fingerprint.to_host(rows), strict=True)
    }


def make_patch(
    old: Mapping[str, torch.Tensor],
    new: Mapping[str, torch.Tensor],
    step: int,
    base_step: int,
    base_fingerprint: int | None = None,
    threads: int | None = None,
) -> Patch:
    """The patch from bf16 state `old` to `new` (any float dtype, compared as bf16), on `threads` threads."""
    changes, moves = diff_and_moves(old, new, threads)
    if base_fingerprint is None:
        base_fingerprint = fingerprint.state_fingerprint(old)
    numel = sum(t.numel() for t in old.values())
    on_device = {n: ch for n, ch in changes.items() if n not in moves}
    fp = fingerprint_after(base_fingerprint + sum(moves.values()), old, on_device, threads)
    return Patch(step, base_step, numel, base_fingerprint, fp, changes)


def window_changes(
    old: Mapping[str, torch.Tensor],
    new: Mapping[str, torch.Tensor],
    windows: Mapping[str, tuple[int, int]],
    threads: int | None = None,
) -> tuple[dict[str, TensorChanges], int]:
    """The changes from bf16 `old` to `new`, where a tensor with a window (start, length) holds only those
    flat elements of the whole tensor (a tensor without one is whole): positions count from the window's
    start, and the fingerprint's move (the second result, mod 2^64) uses the whole tensor's positions."""
    changes = diff(old, new, threads)
    moved = 0
    for name, ch in changes.items():
        idx = ch.indices.cpu().numpy()
        before = bits(old[name])[ch.indices.to(old[name].device)].cpu().numpy()  # O(changes) off the device
        moved += fingerprint.delta(
            name, idx + windows.get(name, (0, 0))[0], before, bits(ch.values).cpu().numpy()
        )
    return changes, moved & fingerprint.MASK64


# ----------------------------------------------------------------------------------------------- encode


def encode(
    patch: Patch,
    old: Mapping[str, torch.Tensor],
    encoding: str = "compact",
    threads: int | None = None,
    chunk: int = compact.CHUNK,
    windows: Mapping[str, tuple[int, int]] | None = None,
    shapes: Mapping[str, Sequence[int]] | None = None,
    make_streams: StreamsMaker | None = None,
) -> bytes:
    """Serialize `patch`, made against bf16 state `old`, as safetensors bytes. The compact encoding codes
    chunks of `chunk` elements on `threads` threads; the bytes do not depend on `threads`. `make_streams`
    codes them (by default the backend of the changed tensors' device, deltasync.codec.backend: the same
    bytes on every one).

    With `windows` ({name: (start, length)}), `old[name]` holds only those elements of the tensor and the
    patch's positions in it count from `start`; `shapes` (every tensor's whole shape) then gives the schema.
    """
    if encoding not in ENCODINGS:
        raise ValueError(f"unknown encoding {encoding!r}; choose from {', '.join(ENCODINGS)}")
    schema, old = _covered(old, windows or {}, shapes)
    extra: dict[str, str] = {}
    if encoding == "raw":
        entries = _raw_encoding(patch, old)
    else:
        entries, extra = _compact_encoding(patch, old, chunk, threads, make_streams)
    used = {name: list(w) for name in patch.changes if (w := (windows or {}).get(name)) is not None}
    if used:
        extra["windows"] = json.dumps(used, separators=(",", ":"))
    metadata = {
        "format": FORMAT,
        "version": VERSION,
        "encoding": encoding,
        "dtype": DTYPE,
        "step": str(patch.step),
        "base_step": str(patch.base_step),
        "numel": str(patch.numel),
        "changed": str(patch.changed),
        "schema": schema_hash(schema),
        "fingerprint": fingerprint.format_fingerprint(patch.fingerprint),
        "base_fingerprint": fingerprint.format_fingerprint(patch.base_fingerprint),
        **extra,
    }
    return save_safetensors(entries, metadata=metadata)


def _covered(
    old: Mapping[str, torch.Tensor],
    windows: Mapping[str, tuple[int, int]],
    shapes: Mapping[str, Sequence[int]] | None,
) -> tuple[dict[str, list[int]], Mapping[str, torch.Tensor]]:
    """The model's schema, and `old` with each windowed tensor flat (what its entry covers), checked."""
    if not windows:
        return {name: list(t.shape) for name, t in old.items()}, old
    if shapes is None:
        raise ValueError("a patch over windows needs every tensor's whole shape")
    schema = {name: list(shape) for name, shape in shapes.items()}
    for name, (start, length) in windows.items():
        if old[name].numel() != length or not 0 <= start <= start + length <= math.prod(schema[name]):
            raise ValueError(f"{name}: window ({start}, {length}) does not fit {old[name].numel()} values")
    return schema, {name: t.reshape(-1) if name in windows else t for name, t in old.items()}


def _raw_encoding(patch: Patch, old: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    too_big = [name for name in patch.changes if old[name].numel() >= 1 << 31]
    if too_big:
        raise ValueError(
            f"{too_big[0]}: raw encoding needs int32 positions, tensor has {old[too_big[0]].numel()}"
        )
    return raw_entries(patch.changes)


def _compact_encoding(
    patch: Patch,
    old: Mapping[str, torch.Tensor],
    chunk: int,
    threads: int | None,
    make_streams: StreamsMaker | None,
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The compact encoding's entries (a stream per tensor, or its new values dense where that is smaller)
    and metadata: symbols per chunk, the tables pooled over every coded tensor, then the coded chunks."""
    if not 1 <= chunk <= compact.MAX_CHUNK:
        raise ValueError(f"chunk {chunk} not in 1..{compact.MAX_CHUNK}")
    streams, models = (make_streams or _streams_maker(patch.changes, old))(patch.changes, old, chunk, threads)
    entries: dict[str, torch.Tensor] = {}
    dense_changed: dict[str, int] = {}
    for name, ch in patch.changes.items():
        stream = streams.get(name)
        if stream is not None and len(stream) < 2 * old[name].numel():
            entries[name] = torch.frombuffer(bytearray(stream), dtype=torch.uint8)
        else:  # dense is never beaten by more than a few header bytes
            dense = old[name].detach().clone().reshape(-1)
            dense[ch.indices.to(dense.device)] = ch.values.to(dense.device)
            entries[name] = dense.view(old[name].shape).cpu()
            dense_changed[name] = len(ch)
    extra = {
        "models": json.dumps(models.to_json(), separators=(",", ":")),
        "dense": json.dumps(dense_changed, separators=(",", ":")),
        "chunk": str(chunk),
    }
    return entries, extra


def _streams_maker(changes: Mapping[str, TensorChanges], old: Mapping[str, torch.Tensor]) -> StreamsMaker:
    """The backend of the device that holds every changed tensor, else the host's (the same bytes)."""
    devices = {old[name].device for name in changes}
    if len(devices) == 1:
        return backend_for(old[next(iter(changes))]).compact_streams
    return host_streams


StreamsMaker = Callable[
    [Mapping[str, TensorChanges], Mapping[str, torch.Tensor], int, int | None],
    tuple[dict[str, bytes], compact.Models],
]


def raw_entries(changes: Mapping[str, TensorChanges]) -> dict[str, torch.Tensor]:
    """The raw encoding's entries (host tensors): `name/indices` I32 and `name/values` BF16 per tensor.

    >>> raw_entries({"w": TensorChanges(torch.tensor([3]), torch.tensor([1.0], dtype=torch.bfloat16))})
    {'w/indices': tensor([3], dtype=torch.int32), 'w/values': tensor([1.], dtype=torch.bfloat16)}
    """
    entries = {}
    for name, ch in changes.items():
        entries[f"{name}/indices"] = ch.indices.to(torch.int32).cpu()
        entries[f"{name}/values"] = ch.values.cpu()
    return entries


def raw_changes(
    entries: Mapping[str, torch.Tensor], shapes: Mapping[str, tuple[int, ...] | list[int]]
) -> dict[str, TensorChanges]:
    """Read raw entries (see `raw_entries`) as changes to tensors of `shapes`, checking everything first:
    known names, both parts, 1-D I32 indices with one BF16 value each, positions strictly increasing inside
    the tensor. Raises PatchError naming the entry. Used by `decode` and by the vLLM engine."""
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in entries.items():
        name, _, part = key.rpartition("/")
        if part not in ("indices", "values"):
            raise PatchError(f"raw entry {key!r} is not name/indices or name/values")
        if name not in shapes:
            raise PatchError(f"raw entry {key!r} names unknown tensor {name!r}")
        parts.setdefault(name, {})[part] = t
    changes = {}
    for name, p in parts.items():
        idx, values = p.get("indices"), p.get("values")
        if idx is None or values is None:
            raise PatchError(f"raw patch lacks {name}/indices or {name}/values")
        if (
            idx.dtype != torch.int32
            or values.dtype != torch.bfloat16
            or idx.dim() != 1
            or idx.shape != values.shape
        ):
            raise PatchError(f"{name}: raw entries must be 1-D I32 indices and BF16 values of one length")
        idx = idx.to(torch.int64)
        _check_positions(name, idx, math.prod(shapes[name]))
        changes[name] = TensorChanges(idx, values)
    return changes


def _check_positions(name: str, idx: torch.Tensor, numel: int, start: int = 0) -> None:
    if idx.numel() and bool((idx[0] < start) | (idx[-1] >= start + numel) | (idx[1:] <= idx[:-1]).any()):
        where = f"the tensor ({numel} elements)" if not start else f"its window [{start}, {start + numel})"
        raise PatchError(f"{name}: positions must increase strictly and lie inside {where}")


# ----------------------------------------------------------------------------------------------- decode


def decode(
    data: bytes,
    base: Mapping[str, torch.Tensor],
    base_fingerprint: int | None = None,
    threads: int | None = None,
) -> Patch:
    """Decode and verify a patch against the bf16 state `base` it must apply to, on `threads` threads.

    `base_fingerprint` is the caller's fingerprint of `base` (computed in full when None). Raises PatchError
    unless the patch was made from exactly this state and reproduces its recorded fingerprint.
    """
    info = read_info(data)
    local = _check_base(info, base)
    if base_fingerprint is None:
        base_fingerprint = fingerprint.state_fingerprint(base)
    if info.base_fingerprint != base_fingerprint:
        raise PatchError(
            f"patch applies to state {fingerprint.format_fingerprint(info.base_fingerprint)} "
            f"(step {info.base_step}), base is {fingerprint.format_fingerprint(base_fingerprint)}"
        )
    changes, moved = _changes(info, read_entries(data), local, threads)
    others = {n: ch for n, ch in changes.items() if info.tensors[n]["mode"] != "compact"}
    fp = fingerprint_after(base_fingerprint + moved, base, others, threads)
    if fp != info.fingerprint:
        raise PatchError(
            f"fingerprint mismatch: decoded state is {fingerprint.format_fingerprint(fp)}, "
            f"patch promises {fingerprint.format_fingerprint(info.fingerprint)}"
        )
    numel = sum(t.numel() for t in base.values())
    return Patch(info.step, info.base_step, numel, base_fingerprint, fp, changes)


def _check_base(info: PatchInfo, base: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What each entry of the patch covers in `base` (the whole tensor, or the flat window it names), once
    the patch is checked to be for `base`'s model: its size, names, windows, shapes, counts and schema."""
    numel = sum(t.numel() for t in base.values())
    if info.numel != numel:
        raise PatchError(f"patch is for a model of {info.numel} elements, base has {numel}")
    for name in info.tensors:
        if name not in base:
            raise PatchError(f"patch names unknown tensor {name!r}")
    for name, (start, length) in info.windows.items():
        if start + length > base[name].numel():
            raise PatchError(
                f"{name}: window [{start}, {start + length}) is outside its {base[name].numel()} elements"
            )
    local = {
        name: base[name].reshape(-1)[info.windows[name][0] : sum(info.windows[name])]
        if name in info.windows
        else base[name]
        for name in info.tensors
    }
    for name, t in info.tensors.items():
        if t["mode"] == "dense" and t["shape"] != list(local[name].shape):
            raise PatchError(f"{name}: patch shape {t['shape']} != base shape {list(local[name].shape)}")
        if not 0 < t["changed"] <= local[name].numel():
            raise PatchError(f"{name}: {t['changed']} changes for {local[name].numel()} elements")
    if info.metadata.get("schema") != schema_hash({name: t.shape for name, t in base.items()}):
        raise PatchError(
            "patch was made for another model schema (tensor names or shapes differ from the base)"
        )
    return local


def _changes(
    info: PatchInfo, entries: dict, local: Mapping[str, torch.Tensor], threads: int | None
) -> tuple[dict[str, TensorChanges], int]:
    """Every entry's changes, positions in the whole tensor, and the fingerprint's move (mod 2^64) that the
    compact entries made while decoding (the others' is computed from their changes)."""
    chunks: list[ChunkStream] = []
    decoded: list[tuple[np.ndarray, np.ndarray, int]] = []
    if info.encoding == "compact":
        chunks = _compact_chunks(info, entries, local)
        tables = read_tables(info)
        decoded = parallel_map(lambda work: decode_chunk(*work, tables), chunks, threads)
    changes = {}
    for name, t in info.tensors.items():
        start = info.windows.get(name, (0, 0))[0]
        try:
            if t["mode"] == "compact":
                parts = [d for (n, *_), d in zip(chunks, decoded, strict=True) if n == name]
                idx = torch.from_numpy(np.concatenate([p[0] for p in parts]))
                new_bits = torch.from_numpy(np.concatenate([p[1] for p in parts]).view(np.int16))
                changes[name] = _checked(name, t, local[name], idx, new_bits.view(torch.bfloat16), start)
            else:
                ch = _decode_tensor(name, t, entries, local[name])
                changes[name] = TensorChanges(ch.indices + start, ch.values) if start else ch
        except PatchError:
            raise
        except (compact.CompactDecodeError, ValueError, RuntimeError, OverflowError) as e:
            raise PatchError(f"{name}: corrupt {t['mode']} data: {e}") from None
    return changes, sum(d[2] for d in decoded)


def decode_parts(
    parts: Sequence[bytes],
    base: Mapping[str, torch.Tensor],
    base_fingerprint: int | None = None,
    threads: int | None = None,
) -> Patch:
    """Decode and verify one step stored as several patches over disjoint parts of the model (one per rank:
    see deltasync.sync.sharded), as one Patch. Part i applies to `base` with the fingerprint part i - 1
    reached, so the last part's fingerprint is the step's. Raises PatchError naming the part if any is wrong.
    """
    if base_fingerprint is None:
        base_fingerprint = fingerprint.state_fingerprint(base)
    decoded: list[Patch] = []
    for i, data in enumerate(parts):
        try:
            part = decode(data, base, decoded[-1].fingerprint if decoded else base_fingerprint, threads)
        except PatchError as e:
            raise PatchError(f"part {i + 1} of {len(parts)}: {e}") from None
        if decoded and (part.step, part.base_step) != (decoded[0].step, decoded[0].base_step):
            raise PatchError(f"part {i + 1} is step {part.step}, part 1 is step {decoded[0].step}")
        decoded.append(part)
    if not decoded:
        raise PatchError("a step of no parts")
    changes = merge_changes([p.changes for p in decoded])
    first, last = decoded[0], decoded[-1]
    return Patch(first.step, first.base_step, first.numel, first.base_fingerprint, last.fingerprint, changes)


def merge_changes(parts: Sequence[Mapping[str, TensorChanges]]) -> dict[str, TensorChanges]:
    """The changes of the parts of one step as one set; PatchError if two parts change the same element."""
    changes: dict[str, TensorChanges] = {}
    for name in dict.fromkeys(n for p in parts for n in p):
        pieces = [p[name] for p in parts if name in p]
        if len(pieces) == 1:
            changes[name] = pieces[0]
            continue
        idx, values = torch.cat([c.indices for c in pieces]), torch.cat([c.values for c in pieces])
        if (idx[1:] < idx[:-1]).any():  # parts listed out of position order
            idx, order = torch.sort(idx, stable=True)
            values = values[order]
        if (idx[1:] == idx[:-1]).any():
            raise PatchError(f"{name}: parts change the same element")
        changes[name] = TensorChanges(idx, values)
    return changes


ChunkStream = tuple[str, bytes, np.ndarray, int]  # (tensor name, chunk stream, old bits, offset)


def _compact_chunks(info: PatchInfo, entries: dict, local: Mapping[str, torch.Tensor]) -> list[ChunkStream]:
    """(name, chunk stream, old bits, offset) of every chunk of the compact tensors of a patch; `local` holds
    what each entry covers, and offsets count from the tensor's start."""
    chunk = chunk_size(info)
    out = []
    for name, t in info.tensors.items():
        if t["mode"] != "compact":
            continue
        old_bits = bits(local[name]).cpu().numpy()
        streams = chunk_streams(name, entries, old_bits.size, chunk)
        pieces, start = spans(old_bits.size, chunk), info.windows.get(name, (0, 0))[0]
        out += [(name, s, old_bits[lo:hi], start + lo) for s, (lo, hi) in zip(streams, pieces, strict=True)]
    return out


def read_entries(data: bytes) -> dict[str, torch.Tensor]:
    """A patch's entries (after `read_info` accepted its header); a local failure (MemoryError) is not the
    patch's fault and is raised as it is."""
    try:
        return load_safetensors(data)
    except (SafetensorError, KeyError) as e:  # corrupt bytes; KeyError: a dtype torch does not have
        raise PatchError(f"corrupt patch payload: {e}") from None


def read_tables(info: PatchInfo) -> compact.Tables:
    """The rANS tables of a compact patch."""
    models = metadata_json(info.metadata, "models", "null") or {}
    try:
        return compact.Models.from_json(models).tables()
    except compact.CompactDecodeError as e:
        raise PatchError(f"bad compact models: {e}") from None


def chunk_size(info: PatchInfo) -> int:
    """Elements per chunk of a compact patch."""
    try:
        chunk = int(info.metadata["chunk"])
    except (KeyError, ValueError):
        raise PatchError("compact patch lacks a valid chunk size") from None
    if not 1 <= chunk <= compact.MAX_CHUNK:
        raise PatchError(f"chunk size {chunk} not in 1..{compact.MAX_CHUNK}")
    return chunk


def chunk_streams(name: str, entries: dict, numel: int, chunk: int) -> list[bytes]:
    """The chunk streams of `name`'s compact entry, which covers `numel` elements."""
    stream = entries[name]
    if stream.dtype != torch.uint8 or stream.dim() != 1:
        raise PatchError(f"{name}: compact entry must be 1-D uint8")
    try:
        streams = compact.split_chunks(stream.numpy().tobytes())
    except compact.CompactDecodeError as e:
        raise PatchError(f"{name}: corrupt compact data: {e}") from None
    needed = -(-numel // chunk)
    if len(streams) != needed:  # (before listing the spans: `chunk` comes from the patch)
        raise PatchError(f"{name}: {len(streams)} chunks, {numel} elements need {needed}")
    return streams


def compact_decoder(
    info: PatchInfo,
    entries: dict,
    windows: Mapping[str, tuple[int, int]],
    tables: compact.Tables,
    device: torch.device,
    old_values: Callable[[str], torch.Tensor],
    threads: int | None = None,
) -> Decoder:
    """The compact entries named in `windows` (each covering elements start.. start + length of its tensor),
    to be decoded against `old_values(name)` by the backend of `device` (deltasync.codec.backend; on a GPU
    their rANS stage runs here, for all of them at once), for decode_entry. Raises PatchError."""
    chunk = chunk_size(info)
    streams = {name: chunk_streams(name, entries, length, chunk) for name, (_, length) in windows.items()}
    try:
        return backend_on(device).decoder(streams, windows, chunk, tables, device, old_values, threads)
    except compact.CompactDecodeError as e:
        raise PatchError(f"{e.tensor}: corrupt compact data: {e}") from None


def decode_entry(
    info: PatchInfo,
    entries: dict,
    name: str,
    old: torch.Tensor,
    tables: compact.Tables | None,
    threads: int | None = None,
    symbols: Decoder | None = None,
) -> TensorChanges:
    """The changes of `name`'s entry (positions in the whole tensor, on `old`'s device) decoded against
    `old`, the old values of what the entry covers (the tensor, or its window), wherever they live: one
    tensor at a time, so that a caller holding the weights in place (a vLLM worker) needs no copy of the
    model. Compact entries decode by the backend of `old`'s device (through `symbols`, where
    compact_decoder made them for the whole patch). Raises PatchError."""
    t = info.tensors[name]
    start = info.windows.get(name, (0, 0))[0]
    if t["mode"] != "compact":
        try:
            ch = _decode_tensor(name, t, entries, old)
        except PatchError:
            raise
        except (ValueError, RuntimeError, OverflowError) as e:
            raise PatchError(f"{name}: corrupt {t['mode']} data: {e}") from None
        return TensorChanges(ch.indices + start, ch.values) if start else ch
    assert tables is not None  # a compact patch's
    if symbols is None:
        windows = {name: (start, old.numel())}
        symbols = compact_decoder(info, entries, windows, tables, old.device, lambda _: old, threads)
    try:
        idx, new_bits = symbols.changes(name)
        return _checked(name, t, old, idx + start if start else idx, new_bits.view(torch.bfloat16), start)
    except PatchError:
        raise
    except (compact.CompactDecodeError, ValueError, RuntimeError, OverflowError) as e:
        raise PatchError(f"{name}: corrupt compact data: {e}") from None


def _checked(
    name: str, t: dict, old: torch.Tensor, idx: torch.Tensor, values: torch.Tensor, start: int = 0
) -> TensorChanges:
    if idx.numel() != t["changed"]:
        raise ValueError(f"{idx.numel()} changes decoded, metadata says {t['changed']}")
    _check_positions(name, idx, old.numel(), start)
    return TensorChanges(idx.to(old.device), values.to(old.device))


def _decode_tensor(name: str, t: dict, entries: dict, old: torch.Tensor) -> TensorChanges:
    """The changes of a raw or dense entry."""
    old_bits = bits(old)
    if t["mode"] == "raw":
        raw = {f"{name}/{part}": entries[f"{name}/{part}"] for part in ("indices", "values")}
        ch = raw_changes(raw, {name: old.shape})[name]
        idx, values = ch.indices.to(old.device), ch.values.to(old.device)
    else:
        dense = entries[name]
        if dense.dtype != torch.bfloat16 or list(dense.shape) != list(old.shape):
            raise ValueError(f"dense entry must be bf16 {list(old.shape)}")
        dense = bits(dense.to(old.device))
        idx = torch.nonzero(dense != old_bits).squeeze(1)
        values = dense[idx].view(torch.bfloat16)
    return _checked(name, t, old, idx, values)


@dataclass(frozen=True)
class RankedEntry:
    """A compact entry's changes by place, for decoders that hold the old values elsewhere (tensor-parallel
    ranks, deltasync.vllm.split): each chunk's class limits (int16 magnitudes, [chunks, classes - 1]) and per
    change its chunk, class, rank among the chunk's elements of that class, value step and escaped raw
    pattern (see deltasync.codec.compact)."""

    chunk: int  # elements per chunk
    limits: np.ndarray
    chunk_of: np.ndarray
    cls: np.ndarray
    rank: np.ndarray
    steps: np.ndarray
    raws: np.ndarray

    @property
    def classes(self) -> int:
        return self.limits.shape[1] + 1

    def new_patterns(self, old: np.ndarray, which: np.ndarray) -> tuple[np.ndarray, bool]:
        """The new patterns (int16) of changes `which` (a mask) from their `old` patterns, and whether every
        one stays in the bf16 range."""
        from deltasync.codec import kernels  # not at import time: see deltasync.codec.kernels

        new, in_range = kernels.new_patterns(old, self.steps[which], self.raws[which])
        return new, bool(in_range)


def held_entry(
    info: PatchInfo,
    entries: dict,
    name: str,
    n: int,
    tables: compact.Tables | None,
    threads: int | None = None,
) -> TensorChanges | torch.Tensor | RankedEntry:
    """`name`'s entry (of `n` elements) as a decoder that holds only parts of its old values needs it: a raw
    entry's changes (positions in the entry), a dense entry's new values (bf16, flat), or a compact entry's
    changes by place. Raises PatchError."""
    t = info.tensors[name]
    if t["mode"] == "raw":
        parts = {f"{name}/{p}": entries[f"{name}/{p}"] for p in ("indices", "values")}
        return raw_changes(parts, {name: (n,)})[name]
    if t["mode"] == "dense":
        dense = entries[name]
        if dense.dtype != torch.bfloat16 or dense.numel() != n:
            raise PatchError(f"{name}: dense entry must be bf16 of {n} elements")
        return dense.reshape(-1)
    assert tables is not None  # a compact patch's
    chunk = chunk_size(info)
    streams = chunk_streams(name, entries, n, chunk)
    sizes = [min(chunk, n - s) for s in range(0, n, chunk)]
    try:
        decoded = parallel_map(
            lambda w: compact.ranked_changes(*w, tables), list(zip(streams, sizes, strict=True)), threads
        )
    except compact.CompactDecodeError as e:
        raise PatchError(f"{name}: corrupt compact data: {e}") from None
    return RankedEntry(
        chunk,
        np.stack([d[0] for d in decoded]),
        np.repeat(np.arange(len(decoded)), [d[1].size for d in decoded]),
        *(np.concatenate([d[i] for d in decoded]).astype(np.int64) for i in range(1, 5)),
    )
