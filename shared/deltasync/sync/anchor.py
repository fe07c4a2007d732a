"""Anchors: complete bf16 states as safetensors files with HF names, sharded like HF checkpoints.

Metadata: format, version, step, the fingerprint of the whole state, and the shard's place. Two encodings:

- plain: every tensor as BF16; any safetensors reader (and vLLM's loader) can open a shard;
- packed (metadata `encoding` "packed", `chunk`, `shapes`): every tensor as one U8 entry that
  deltasync.codec.packed decodes, lossless at ~2/3 of the bf16 bytes.

Reading takes either (anchors written before packing existed are plain) and checks the shards against the
run's schema and fingerprint, so a packed anchor is verified bit for bit like a plain one.

Which to write (`anchor_encoding`): packing saves a third of the bytes and costs an encode on the publisher
and a decode on every reader (each several hundred MB/s per core, far above the links anchors travel over),
so it pays whenever the link is slower than ~1/3 of the decode rate (measured on a 2-core replica with a
whole Qwen3-1.7B: ~170 MB/s): "auto" packs for every remote sync root and stays plain in a local folder, where
bytes cost nothing and vLLM's loader could read the shards directly. Set "plain" for faster links.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from deltasync.codec import fingerprint, packed
from deltasync.codec.parallel import parallel_map
from deltasync.errors import AnchorError
from deltasync.sync.config import ANCHOR_ENCODINGS
from deltasync.sync.protocol import ANCHOR_FORMAT, FORMAT_VERSION, STARTS, Entry, Head, RunInfo, anchor_paths


def anchor_due(head: Head | None, step: int, delta_bytes: int | None, anchor_every: int) -> bool:
    """Whether `step` also goes out as an anchor, beside a delta of `delta_bytes` (None: no delta), after
    `head`: `anchor_every` steps after the newest complete state, or sooner once the deltas since it outweigh
    it (a replica that starts then downloads less)."""
    if head is None or delta_bytes is None:
        return True
    last = head.anchors[-1]
    chain = sum(e.bytes for e in head.deltas if e.step > last.step) + delta_bytes
    return step - last.step >= anchor_every or chain > last.bytes


def retained(entries: Sequence[Entry], keep_anchors: int) -> tuple[Entry, ...]:
    """What a head keeps of `entries` (a chain, ascending): the newest `keep_anchors` complete states
    (anchors, the base model) and every delta after the oldest of them."""
    oldest = [e for e in entries if e.kind in STARTS][-keep_anchors:][0]
    return tuple(e for e in entries if e.step > oldest.step or e == oldest)


def anchor_encoding(setting: str, local: bool) -> str:
    """The encoding to write: `setting` ("auto", "plain" or "packed"), "auto" resolved for a sync root that is
    a local folder (`local`) or not. See the module's docstring for the rule."""
    if setting == "auto":
        return "plain" if local else "packed"
    if setting not in ANCHOR_ENCODINGS:
        raise ValueError(f"unknown anchor encoding {setting!r}; choose auto, {', '.join(ANCHOR_ENCODINGS)}")
    return setting


def shard(state: Mapping[str, torch.Tensor], shard_bytes: int) -> list[dict[str, torch.Tensor]]:
    """`state` split, in order, into groups of at most ~`shard_bytes` (a larger tensor gets a group alone)."""
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in state.items():
        if shards[-1] and size + t.nbytes > shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += t.nbytes
    return shards


def write_anchor(
    state: Mapping[str, torch.Tensor],
    step: int,
    fp: int,
    folder: Path,
    shard_bytes: int = 2 << 30,
    encoding: str = "plain",
    threads: int | None = None,
    tag: str = "",
) -> list[tuple[Path, str]]:
    """Save `state` (bf16) in shards of at most ~`shard_bytes` of bf16, plain or packed (on `threads`
    threads); returns (local file, sync-root path) pairs, the paths of the writer tagged `tag`."""
    if encoding not in ANCHOR_ENCODINGS:
        raise ValueError(f"unknown anchor encoding {encoding!r}; choose from {', '.join(ANCHOR_ENCODINGS)}")
    shards = shard(state, shard_bytes)
    out = []
    for i, (tensors, path) in enumerate(zip(shards, anchor_paths(step, len(shards), tag), strict=True)):
        meta = {"format": ANCHOR_FORMAT, "version": str(FORMAT_VERSION), "step": str(step)}
        meta |= {"fingerprint": fingerprint.format_fingerprint(fp), "shard": f"{i + 1}/{len(shards)}"}
        entries = {n: t.contiguous() for n, t in tensors.items()}
        if encoding == "packed":
            shapes = {n: list(t.shape) for n, t in entries.items()}
            meta |= {"encoding": "packed", "chunk": str(packed.CHUNK), "shapes": json.dumps(shapes)}
            entries = {n: _as_u8(packed.pack(t, threads)) for n, t in entries.items()}
        local = folder / path.replace("/", "_")
        save_file(entries, local, metadata=meta)
        out.append((local, path))
    return out


def _as_u8(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)


def read_anchor(
    files: list[Path], run: RunInfo, step: int, fp: str, threads: int | None = None
) -> dict[str, torch.Tensor]:
    """Load and check the shards of the anchor of `step` (plain or packed, unpacked on `threads` threads),
    which must hold exactly `run`'s schema and have fingerprint `fp`."""
    state = dict(anchor_tensors(files, run.schema, step, threads))
    missing = [n for n in run.schema if n not in state]
    if missing:
        raise AnchorError(f"anchor of step {step} lacks {len(missing)} tensors, e.g. {missing[0]!r}")
    state = {name: state[name] for name in run.schema}
    fps = parallel_map(lambda item: fingerprint.tensor_fingerprint(*item), state.items(), threads)
    actual = fingerprint.format_fingerprint(sum(fps) & fingerprint.MASK64)
    if actual != fp:
        raise AnchorError(f"anchor of step {step} has fingerprint {actual}, the head promises {fp}")
    return state


def anchor_tensors(
    files: list[Path], schema: Mapping[str, list[int]], step: int, threads: int | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors of the shards of the anchor of `step`, one at a time (a reader that writes each where it
    goes holds one tensor at a time), each checked to be a bf16 tensor of `schema` seen once. Whether all
    of `schema` is there, and the fingerprint, are the caller's to check."""
    seen: set[str] = set()
    for path in files:
        try:
            with safe_open(path, "pt") as f:
                meta = f.metadata() or {}
                if (meta.get("format"), meta.get("step")) != (ANCHOR_FORMAT, str(step)):
                    raise AnchorError(f"{path.name}: not an anchor of step {step} (metadata {meta!r:.200})")
                unpack = _unpacker(path, meta, schema, threads)
                for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                    if name not in schema:
                        raise AnchorError(f"{path.name}: unknown tensor {name!r}")
                    if name in seen:
                        raise AnchorError(f"{path.name}: tensor {name!r} appears twice")
                    t = unpack(name, f.get_tensor(name))
                    if t.dtype != torch.bfloat16 or list(t.shape) != list(schema[name]):
                        raise AnchorError(
                            f"{path.name}: {name} is {t.dtype} {list(t.shape)}, "
                            f"expected bf16 {list(schema[name])}"
                        )
                    seen.add(name)
                    yield name, t
        except SafetensorError as e:  # the bytes; a local failure (OSError, MemoryError) is not the file's
            raise AnchorError(f"{path.name}: corrupt safetensors file: {e}") from None


def _unpacker(
    path: Path, meta: dict, schema: Mapping[str, list[int]], threads: int | None
) -> Callable[[str, torch.Tensor], torch.Tensor]:
    """name, stored entry -> the bf16 tensor, for the shard's encoding; a packed entry must list the shape
    `schema` gives its name (checked before unpacking allocates for it)."""
    encoding = meta.get("encoding", "plain")
    if encoding == "plain":
        return lambda name, t: t
    try:
        if encoding != "packed":
            raise ValueError(f"unknown encoding {encoding!r}")
        chunk, shapes = int(meta["chunk"]), json.loads(meta["shapes"])
        if not isinstance(shapes, dict) or chunk < 1:
            raise ValueError("bad chunk or shapes")
    except (KeyError, ValueError, TypeError) as e:
        raise AnchorError(f"{path.name}: bad packed anchor metadata: {e}") from None
    except RecursionError:
        raise AnchorError(f"{path.name}: bad packed anchor metadata: shapes nested too deeply") from None

    def unpack(name: str, t: torch.Tensor) -> torch.Tensor:
        shape = shapes.get(name)
        if t.dtype != torch.uint8 or t.dim() != 1 or not isinstance(shape, list):
            raise AnchorError(f"{path.name}: {name} is not a packed tensor with a listed shape")
        if shape != schema[name]:
            raise AnchorError(f"{path.name}: {name} lists shape {shape!r:.80}, expected {schema[name]}")
        try:
            return packed.unpack(t.numpy().data, shape, threads, chunk)
        except (packed.PackedError, ValueError, TypeError) as e:
            raise AnchorError(f"{path.name}: {name}: {e}") from None

    return unpack
