"""Change detection: exactly which bf16 elements differ between the last published state and now."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch

from deltasync.codec.backend import TensorChanges, backend, kind
from deltasync.codec.bf16 import as_bf16, bits
from deltasync.errors import SchemaError


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

    Bitwise comparison, so NaN payloads and -0.0 count. Each device's backend compares its tensors
    (deltasync.codec.backend): on the host, spans of every tensor on `threads` threads (see
    deltasync.codec.parallel); on CUDA, Triton's kernels, with one host sync for all tensors (to size the
    outputs), not one per tensor.
    """
    return diff_and_moves(old, new, threads)[0]


def diff_and_moves(
    old: Mapping[str, torch.Tensor],
    new: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor],
    threads: int | None = None,
) -> tuple[dict[str, TensorChanges], dict[str, int]]:
    """`diff`, and how the changes of each tensor move the fingerprint of `old` (see
    deltasync.codec.fingerprint; summed while comparing, when the old values are at hand). Each tensor is
    compared by the backend of `old`'s device (deltasync.codec.backend); tensors on accelerators other than
    CUDA have no entry in the moves."""
    new = dict(new.items() if isinstance(new, Mapping) else new)
    check_schema(old, new)
    by_kind: dict[str, dict[str, tuple[torch.Tensor, torch.Tensor]]] = {}
    for name, t in new.items():
        old_bits = bits(old[name])
        by_kind.setdefault(kind(old_bits), {})[name] = (old_bits, bits(as_bf16(t)).to(old_bits.device))
    found: dict[str, TensorChanges] = {}
    moves: dict[str, int] = {}
    for k, pairs in by_kind.items():
        found_here, moves_here = backend(k).scan(pairs, threads)
        found |= found_here
        moves |= moves_here
    changes = {name: found[name] for name in new if name in found and len(found[name])}
    return changes, {name: moves[name] for name in changes if name in moves}


def apply_changes(
    state: Mapping[str, torch.Tensor], changes: Mapping[str, TensorChanges], threads: int | None = None
) -> None:
    """Write `changes` into the bf16 tensors of `state` in place, each by the backend of its device (on the
    host: on `threads` threads)."""
    by_kind: dict[str, dict[str, TensorChanges]] = {}
    for name, ch in changes.items():
        by_kind.setdefault(kind(state[name]), {})[name] = ch
    for k, part in by_kind.items():
        backend(k).write(state, part, threads)
