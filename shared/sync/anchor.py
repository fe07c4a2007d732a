"""Anchors: complete bf16 states as plain safetensors files with HF names, sharded like HF checkpoints.

Any safetensors reader (and vLLM's loader) can open a shard. Metadata: format, version, step, the fingerprint
of the whole state, and the shard's place. Reading checks the shards against the run's schema and fingerprint.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from deltasync.codec import fingerprint
from deltasync.sync.protocol import ANCHOR_FORMAT, FORMAT_VERSION, RunInfo, anchor_paths


class AnchorError(ValueError):
    """An anchor shard that is corrupt, incomplete or not the state the head promises."""


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
    state: Mapping[str, torch.Tensor], step: int, fp: int, folder: Path, shard_bytes: int = 2 << 30
) -> list[tuple[Path, str]]:
    """Save `state` (bf16) in shards of at most ~`shard_bytes`; returns (local file, sync-root path) pairs."""
    shards = shard(state, shard_bytes)
    out = []
    for i, (tensors, path) in enumerate(zip(shards, anchor_paths(step, len(shards)), strict=True)):
        meta = {"format": ANCHOR_FORMAT, "version": str(FORMAT_VERSION), "step": str(step)}
        meta |= {"fingerprint": fingerprint.format_fingerprint(fp), "shard": f"{i + 1}/{len(shards)}"}
        local = folder / path.replace("/", "_")
        save_file({n: t.contiguous() for n, t in tensors.items()}, local, metadata=meta)
        out.append((local, path))
    return out


def read_anchor(files: list[Path], run: RunInfo, step: int, fp: str) -> dict[str, torch.Tensor]:
    """Load and check the shards of the anchor of `step`, which must hold exactly `run`'s schema and have
    fingerprint `fp`."""
    state: dict[str, torch.Tensor] = {}
    for path in files:
        try:
            with safe_open(path, "pt") as f:
                meta = f.metadata() or {}
                if (meta.get("format"), meta.get("step")) != (ANCHOR_FORMAT, str(step)):
                    raise AnchorError(f"{path.name}: not an anchor of step {step} (metadata {meta!r:.200})")
                for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                    if name not in run.schema:
                        raise AnchorError(f"{path.name}: unknown tensor {name!r}")
                    if name in state:
                        raise AnchorError(f"{path.name}: tensor {name!r} appears twice")
                    t = f.get_tensor(name)
                    if t.dtype != torch.bfloat16 or list(t.shape) != run.schema[name]:
                        raise AnchorError(
                            f"{path.name}: {name} is {t.dtype} {list(t.shape)}, "
                            f"expected bf16 {run.schema[name]}"
                        )
                    state[name] = t
        except SafetensorError as e:
            raise AnchorError(f"{path.name}: corrupt safetensors file: {e}") from None
    missing = [n for n in run.schema if n not in state]
    if missing:
        raise AnchorError(f"anchor of step {step} lacks {len(missing)} tensors, e.g. {missing[0]!r}")
    state = {name: state[name] for name in run.schema}
    actual = fingerprint.format_fingerprint(fingerprint.state_fingerprint(state))
    if actual != fp:
        raise AnchorError(f"anchor of step {step} has fingerprint {actual}, the head promises {fp}")
    return state
