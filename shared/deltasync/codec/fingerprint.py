"""A 64-bit fingerprint of a full bf16 model state that a patch can update in O(changed elements).

    F(state) = sum over tensors t, flat positions i of  bits_t[i] * r(t, i)   (mod 2^64)

`bits` is the signed int16 pattern of the bf16 value and r(t, i) = R1[i % 4096] * R2(t, i // 4096) | 1 is a
pseudo-random odd weight. Because F is linear in the bit patterns, a patch moves it by
sum((new - old) * r) over the changed elements only, so sender and receiver track it per step for free.
Because r factors over rows of 4096, a full recomputation is one int64 multiply-and-row-sum pass
(exact: |bits * R1| < 2^47, so a row of 4096 sums below 2^59), then O(rows) modular arithmetic.
A single wrong element always changes F (odd weights, |difference| < 2^16).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator, Mapping
from functools import cache
from typing import TYPE_CHECKING

import numpy as np

from deltasync.codec.backend import backend, kind

if TYPE_CHECKING:  # torch where tensors are passed: `deltasync follow` only formats fingerprints
    import torch

ROW = 4096
MASK64 = (1 << 64) - 1
_ROWS_PER_CHUNK = 1024  # bounds the int64 temporary to 32 MB


def _splitmix64(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.uint64) + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


R1 = (_splitmix64(np.arange(ROW, dtype=np.uint64)) >> np.uint64(32)) | np.uint64(1)  # 32-bit odd


def seed(name: str) -> np.uint64:
    """The seed of tensor `name`'s row weights."""
    return np.uint64(int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "little"))


def _row_weights(name: str, rows: np.ndarray) -> np.ndarray:
    return _splitmix64(rows.astype(np.uint64) ^ seed(name)) | np.uint64(1)


def _weighted_sum(name: str, rows: np.ndarray, row_sums: np.ndarray) -> int:
    with np.errstate(over="ignore"):
        return int((row_sums.astype(np.uint64) * _row_weights(name, rows)).sum(dtype=np.uint64))


@cache
def r1_on(device: torch.device) -> torch.Tensor:
    """R1 (int64) on `device`."""
    import torch

    return torch.from_numpy(R1.astype(np.int64)).to(device)


def _row_sums(t: torch.Tensor) -> torch.Tensor:
    """sum(bits * R1) of each row of ROW elements of the bf16 tensor `t` (int64, on `t`'s device)."""
    import torch

    from deltasync.codec.bf16 import bits

    b = bits(t)
    n_rows = -(-b.numel() // ROW)
    padded = torch.nn.functional.pad(b, (0, n_rows * ROW - b.numel())) if b.numel() % ROW else b
    r1 = r1_on(b.device)
    sums = [(chunk.to(torch.int64) * r1).sum(1) for chunk in padded.view(n_rows, ROW).split(_ROWS_PER_CHUNK)]
    return torch.cat(sums) if sums else torch.zeros(0, dtype=torch.int64, device=b.device)


def to_host(tensors: list[torch.Tensor]) -> list[np.ndarray]:
    """`tensors` (one dtype) as numpy arrays: one copy per device for all of them, not a round trip each."""
    import torch

    out: list[np.ndarray] = [np.empty(0)] * len(tensors)
    by_device: dict[torch.device, list[int]] = {}
    for i, t in enumerate(tensors):
        by_device.setdefault(t.device, []).append(i)
    for which in by_device.values():
        flat = torch.cat([tensors[i].reshape(-1) for i in which]).cpu().numpy()
        cuts = np.cumsum([tensors[i].numel() for i in which])[:-1]
        for i, part in zip(which, np.split(flat, cuts), strict=True):
            out[i] = part.reshape(tensors[i].shape)
    return out


def tensor_fingerprint(name: str, t: torch.Tensor) -> int:
    """Fingerprint contribution of one bf16 tensor (a full pass over it)."""
    row_sums = _row_sums(t).cpu().numpy()
    return _weighted_sum(name, np.arange(row_sums.size), row_sums) & MASK64


def state_fingerprint(state: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]) -> int:
    """Fingerprint of a whole bf16 state, each tensor's pass run by its device's backend
    (deltasync.codec.backend), one tensor at a time: tensors made as they are asked for (a generator of
    converted copies) are freed after their pass, so the peak does not grow with the model."""
    items = iter(state.items() if isinstance(state, Mapping) else state)
    pending = next(items, None)

    def run(of_kind: str) -> Iterator[tuple[str, torch.Tensor]]:  # the tensors up to one of another kind
        nonlocal pending
        while pending is not None and kind(pending[1]) == of_kind:
            yield pending
            pending = next(items, None)

    total = 0
    while pending is not None:
        of_kind = kind(pending[1])
        total += backend(of_kind).state_fingerprint(run(of_kind))
    return total & MASK64


def row_fingerprint(tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
    """Fingerprint of bf16 `tensors` through torch's ops on their devices: their row sums, then one copy of
    them to the host per device."""
    names, sums = [], []
    for name, t in tensors:  # keeps row sums, not tensors
        names.append(name)
        sums.append(_row_sums(t))
    rows = to_host(sums)
    return sum(_weighted_sum(n, np.arange(r.size), r) for n, r in zip(names, rows, strict=True)) & MASK64


def delta(name: str, positions: np.ndarray, old: np.ndarray, new: np.ndarray) -> int:
    """How F moves when tensor `name` changes from `old` to `new` bit patterns (int16) at `positions`."""
    from deltasync.codec import kernels  # not at import time: see deltasync.codec.kernels

    return int(kernels.fingerprint_delta(seed(name), R1, positions.astype(np.int64, copy=False), old, new))


def format_fingerprint(fp: int) -> str:
    return f"{fp & MASK64:016x}"
