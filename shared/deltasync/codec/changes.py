"""Change detection: exactly which bf16 elements differ between the last published state and now."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import numpy as np
import torch

from deltasync.codec import bf16, fingerprint
from deltasync.codec.bf16 import as_bf16, bits
from deltasync.codec.fingerprint import R1
from deltasync.codec.parallel import parallel_map, spans
from deltasync.errors import SchemaError

SCATTER_SPAN = 1 << 18  # changes per unit of apply_changes' work


@dataclass(frozen=True)
class TensorChanges:
    """The changed elements of one tensor: flat positions (int64, strictly increasing) and new bf16 values."""

    indices: torch.Tensor
    values: torch.Tensor

    def __len__(self) -> int:
        return self.indices.numel()


def name_difference(expected: Iterable[str], got: Iterable[str], shown: int = 5) -> str | None:
    """The tensor names `got` lacks and has beyond `expected`, the first `shown` of each; None if none.

    >>> name_difference(["a", "b"], ["b", "c"])
    'missing 1 (a), unexpected 1 (c)'
    """
    want, have = set(expected), set(got)

    def few(names: set[str]) -> str:
        listed = ", ".join(sorted(names)[:shown]) + (", ..." if len(names) > shown else "")
        return f"{len(names)} ({listed})" if names else "none"

    if want == have:
        return None
    return f"missing {few(want - have)}, unexpected {few(have - want)}"


def check_schema(old: Mapping[str, torch.Tensor], new: Mapping[str, torch.Tensor]) -> None:
    difference = name_difference(old, new)
    if difference:
        raise SchemaError(f"tensor sets differ: {difference}")
    for name, t in old.items():
        if tuple(t.shape) != tuple(new[name].shape):
            raise SchemaError(f"{name}: shape {tuple(new[name].shape)} != {tuple(t.shape)}")


def diff(
    old: Mapping[str, torch.Tensor],
    new: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor],
    threads: int | None = None,
) -> dict[str, TensorChanges]:
    """Elements of `new` (any float dtype, cast to bf16) whose bf16 bit pattern differs from `old` (bf16).

    Bitwise comparison, so NaN payloads and -0.0 count. On the host, spans of every tensor are compared on
    `threads` threads (see deltasync.codec.parallel); on CUDA (Triton's kernels: deltasync.codec.gpu) this
    syncs with the host once for all tensors (to size the outputs), not once per tensor.
    """
    return diff_and_moves(old, new, threads)[0]


def diff_and_moves(
    old: Mapping[str, torch.Tensor],
    new: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor],
    threads: int | None = None,
) -> tuple[dict[str, TensorChanges], dict[str, int]]:
    """`diff`, and how the changes of each host tensor move the fingerprint of `old` (see
    deltasync.codec.fingerprint; summed while comparing, when the old values are at hand). Tensors on
    accelerators other than CUDA have no entry in the moves."""
    from deltasync.codec import kernels  # not at import time: see deltasync.codec.kernels

    new = dict(new.items() if isinstance(new, Mapping) else new)
    check_schema(old, new)
    on_host, on_device = {}, {}  # name -> (old bits, new bits)
    for name, t in new.items():
        new_bits, old_bits = bits(as_bf16(t)), bits(old[name])
        if not bf16.on_gpu(old_bits) and old_bits.device.type == new_bits.device.type == "cpu":
            on_host[name] = (old_bits.numpy(), new_bits.numpy())
        else:
            on_device[name] = (old_bits, new_bits)

    def compare(work: tuple[str, int, int]) -> tuple[np.ndarray, np.ndarray, int]:
        name, lo, hi = work
        a, b = on_host[name]
        idx, values, moved = kernels.changed_positions(a[lo:hi], b[lo:hi], fingerprint.seed(name), R1, lo)
        return idx + lo, values, int(moved)

    work = [(name, lo, hi) for name, (a, _) in on_host.items() for lo, hi in spans(a.size)]
    pieces: dict[str, list] = {}
    for (name, _, _), piece in zip(work, parallel_map(compare, work, threads), strict=True):
        pieces.setdefault(name, []).append(piece)
    found, moves = {}, {}
    for name, parts in pieces.items():
        idx = np.concatenate([p[0] for p in parts]) if len(parts) > 1 else parts[0][0]
        values = np.concatenate([p[1] for p in parts]) if len(parts) > 1 else parts[0][1]
        found[name] = TensorChanges(torch.from_numpy(idx), torch.from_numpy(values).view(torch.bfloat16))
        moves[name] = sum(p[2] for p in parts) & fingerprint.MASK64
    cuda = {name: (a, b.to(a.device)) for name, (a, b) in on_device.items() if bf16.on_gpu(a)}
    if cuda:
        from deltasync.codec import gpu  # not at import time: it loads Triton

        found_on_cuda, moves_on_cuda = gpu.scan(cuda)
        found |= found_on_cuda  # (tensors with changes only)
        moves |= moves_on_cuda
    others = {name: pair for name, pair in on_device.items() if name not in cuda}
    if others:  # one host sync for all tensors, to size the outputs
        masks = [new_bits != old_bits for old_bits, new_bits in others.values()]
        counts = torch.stack([torch.count_nonzero(m) for m in masks]).tolist()
        for (name, (_, new_bits)), mask, count in zip(others.items(), masks, counts, strict=True):
            idx = torch.nonzero_static(mask, size=count).squeeze(1)
            found[name] = TensorChanges(idx, new_bits[idx].view(torch.bfloat16))
    changes = {name: found[name] for name in new if name in found and len(found[name])}
    return changes, {name: moves[name] for name in changes if name in moves}


def apply_changes(
    state: Mapping[str, torch.Tensor], changes: Mapping[str, TensorChanges], threads: int | None = None
) -> None:
    """Write `changes` into the bf16 tensors of `state` in place, host tensors on `threads` threads (in spans
    of their changes: one large tensor, an embedding, would otherwise hold one thread while the rest wait)."""

    from deltasync.codec import kernels  # not at import time: see deltasync.codec.kernels

    def on_host(name: str) -> bool:
        target = state[name]
        return target.device.type == changes[name].indices.device.type == "cpu" and target.is_contiguous()

    def write(work: tuple[str, int, int]) -> None:
        name, lo, hi = work
        ch = changes[name]  # no torch op: its thread pool would spin beside ours
        kernels.scatter(
            bits(state[name]).numpy(), ch.indices[lo:hi].numpy(), bits(ch.values[lo:hi]).cpu().numpy()
        )

    host = {name for name in changes if on_host(name)}
    for name in changes:  # on an accelerator: torch's indexed write there
        if name not in host:
            target, ch = state[name], changes[name]
            target.view(-1)[ch.indices.to(target.device)] = ch.values.to(target.device)
    work = [(n, lo, hi) for n in changes if n in host for lo, hi in spans(len(changes[n]), SCATTER_SPAN)]
    parallel_map(write, work, threads)
