"""A patch's header (see deltasync.codec.patch for the layout): what the patch says about itself, parsed and
checked without its base and without decoding any tensor. Needs no torch: `deltasync inspect` reads it."""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from deltasync.errors import PatchError

FORMAT = "deltasync.patch"
VERSION = "2"
ENCODINGS = ("compact", "raw")
DTYPE = "bf16"  # the weight dtype run.json and every patch record; readers refuse any other
MAX_HEADER_BYTES = 64 << 20


def schema_hash(shapes: Mapping[str, Sequence[int]]) -> str:
    """Hash of the model's tensor names and shapes: flat positions only mean something within one schema.

    >>> schema_hash({"w": [2, 3]})
    '137e2a413b77794a'
    """
    listing = json.dumps(sorted((name, list(shape)) for name, shape in shapes.items()))
    return hashlib.blake2b(listing.encode(), digest_size=8).hexdigest()


@dataclass
class PatchInfo:
    """What a patch says about itself, read without its base."""

    encoding: str
    step: int
    base_step: int
    numel: int
    changed: int
    fingerprint: int
    base_fingerprint: int
    tensors: dict[str, dict]
    metadata: dict[str, str]
    payload_bytes: int
    windows: dict[str, tuple[int, int]] = field(default_factory=dict)  # name -> (start, length), see encode


def read_info(data: bytes) -> PatchInfo:
    """Parse and check a patch's header. Raises PatchError naming what is wrong."""
    if len(data) < 8:
        raise PatchError(f"not a safetensors file: {len(data)} bytes")
    (header_len,) = struct.unpack("<Q", data[:8])
    if header_len > min(MAX_HEADER_BYTES, len(data) - 8):
        raise PatchError(f"truncated or corrupt: header claims {header_len} bytes, file has {len(data)}")
    try:
        header = json.loads(data[8 : 8 + header_len])
        meta = header.get("__metadata__")
    except (ValueError, RecursionError, AttributeError) as e:  # bad JSON or UTF-8, huge ints, deep nesting
        raise PatchError(f"corrupt safetensors header: {e}") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise PatchError(
            f"not a deltasync patch (format {meta.get('format') if isinstance(meta, dict) else None!r})"
        )
    if meta.get("version") != VERSION:
        raise PatchError(f"patch format version {meta.get('version')!r}, this reader understands {VERSION!r}")
    if meta.get("encoding") not in ENCODINGS:
        raise PatchError(f"unknown encoding {meta.get('encoding')!r}")
    if meta.get("dtype", DTYPE) != DTYPE:
        raise PatchError(f"weights are {meta.get('dtype')!r:.40}; this reader handles {DTYPE} only")
    try:
        tensors = _tensor_list(meta, header, data[8 + header_len :])
        info = PatchInfo(
            encoding=meta["encoding"],
            step=int(meta["step"]),
            base_step=int(meta["base_step"]),
            numel=int(meta["numel"]),
            changed=int(meta["changed"]),
            fingerprint=int(meta["fingerprint"], 16),
            base_fingerprint=int(meta["base_fingerprint"], 16),
            tensors=tensors,
            metadata=meta,
            payload_bytes=len(data),
        )
        info.windows = _windows(meta, tensors)
    except PatchError:
        raise
    except (KeyError, ValueError, TypeError, AttributeError) as e:
        raise PatchError(f"bad patch metadata or entries: {e!r}") from None
    if sum(t["changed"] for t in info.tensors.values()) != info.changed:
        raise PatchError(f"per-tensor changed counts do not add up to {info.changed}")
    return info


def metadata_json(meta: dict, key: str, default: str) -> Any:
    """The JSON value of metadata `key` (`default` where absent); PatchError if it is not valid JSON or is
    nested too deeply to parse (Python's recursion limit)."""
    try:
        return json.loads(meta.get(key, default))
    except RecursionError:
        raise PatchError(f"bad patch metadata {key!r}: JSON nested too deeply") from None
    except (ValueError, TypeError) as e:
        raise PatchError(f"bad patch metadata {key!r}: not valid JSON: {e}") from None


def _windows(meta: dict, tensors: dict[str, dict]) -> dict[str, tuple[int, int]]:
    """The metadata's windows, each [start >= 0, length >= 1] of a tensor the patch changes."""
    raw = metadata_json(meta, "windows", "{}")
    if not isinstance(raw, dict):
        raise PatchError(f"windows must be a JSON object, got {raw!r:.80}")
    windows = {}
    for name, w in raw.items():
        if name not in tensors:
            raise PatchError(f"window for {name!r:.80}, which the patch does not change")
        ints = isinstance(w, list) and len(w) == 2 and all(type(v) is int for v in w)
        if not ints or w[0] < 0 or w[1] < 1:
            raise PatchError(f"{name}: window {w!r:.80} is not [start >= 0, length >= 1]")
        windows[name] = (w[0], w[1])
    return windows


def _tensor_list(meta: dict, header: dict, body: bytes) -> dict[str, dict]:
    """{name: {"mode", "changed", "shape"}} from the entries, without decoding any tensor."""
    tensors: dict[str, dict] = {}
    dense = metadata_json(meta, "dense", "{}")
    for key, entry in header.items():
        if key == "__metadata__":
            continue
        name, _, part = key.rpartition("/") if meta["encoding"] == "raw" else (key, "", "")
        if meta["encoding"] == "raw":
            if part not in ("indices", "values") or entry["dtype"] != (
                "I32" if part == "indices" else "BF16"
            ):
                raise PatchError(
                    f"raw entry {key!r} ({entry.get('dtype')}) is not name/indices I32 or name/values BF16"
                )
            if len(entry["shape"]) != 1:
                raise PatchError(f"raw entry {key!r} has shape {entry['shape']!r:.40}, expected 1-D")
            tensors.setdefault(name, {"mode": "raw", "changed": 0, "parts": set()})
            tensors[name]["parts"].add(part)
            tensors[name]["changed"] = entry["shape"][0]
        elif entry["dtype"] == "U8":
            start, end = entry["data_offsets"]
            from deltasync.codec import compact  # (numpy: not for the command line's help)

            changed = compact.stream_changed(body[start:end])
            tensors[name] = {"mode": "compact", "changed": changed}
        elif entry["dtype"] == "BF16" and name in dense:
            tensors[name] = {"mode": "dense", "changed": int(dense[name]), "shape": entry["shape"]}
        else:
            raise PatchError(
                f"entry {key!r} ({entry.get('dtype')}) is neither a compact stream nor a listed dense tensor"
            )
    for name, t in tensors.items():
        if t.pop("parts", {"indices", "values"}) != {"indices", "values"}:
            raise PatchError(f"raw patch lacks {name}/indices or {name}/values")
    return tensors
