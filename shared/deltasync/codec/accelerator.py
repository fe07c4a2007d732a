"""The codec's backend for accelerators other than CUDA (deltasync.codec.backend): torch's own ops where the
tensors are, and the host backend's coder for the compact streams, which come to the host anyway."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

import numpy as np
import torch

from deltasync.codec import compact, fingerprint
from deltasync.codec.backend import Decoder, Move, Pairs, TensorChanges
from deltasync.codec.host import HostBackend, HostDecoder


class TorchBackend(HostBackend):
    """The host backend's fingerprint and coder (torch's ops on the device, the coder on copies), torch's
    own ops for the rest."""

    def scan(self, pairs: Pairs, threads: int | None) -> tuple[dict[str, TensorChanges], dict[str, int]]:
        """No fingerprint moves: they are computed from the changes (one host sync for all tensors, to size
        the outputs)."""
        if not pairs:
            return {}, {}
        masks = [new_bits != old_bits for old_bits, new_bits in pairs.values()]
        counts = torch.stack([torch.count_nonzero(m) for m in masks]).tolist()
        found = {}
        for (name, (_, new_bits)), mask, count in zip(pairs.items(), masks, counts, strict=True):
            idx = torch.nonzero_static(mask, size=count).squeeze(1)
            found[name] = TensorChanges(idx, new_bits[idx].view(torch.bfloat16))
        return found, {}

    def state_fingerprint(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        return fingerprint.row_fingerprint(tensors)  # torch's ops where the tensors are

    def decoder(
        self,
        streams: Mapping[str, list[bytes]],
        windows: Mapping[str, tuple[int, int]],
        chunk: int,
        tables: compact.Tables,
        device: torch.device,
        old_values: Callable[[str], torch.Tensor],
        threads: int | None,
    ) -> Decoder:
        return HostDecoder(streams, windows, chunk, tables, lambda name: old_values(name).cpu(), threads)

    def moves(self, changes: list[Move]) -> int:
        rows = fingerprint.to_host([torch.stack([p, b.long(), a.long()]) for _, p, b, a in changes])
        return (
            sum(
                fingerprint.delta(name, r[0], r[1].astype(np.int16), r[2].astype(np.int16))
                for (name, *_), r in zip(changes, rows, strict=True)
            )
            & fingerprint.MASK64
        )

    def write(
        self, state: Mapping[str, torch.Tensor], changes: Mapping[str, TensorChanges], threads: int | None
    ) -> None:
        indexed_write(state, changes)


def indexed_write(state: Mapping[str, torch.Tensor], changes: Mapping[str, TensorChanges]) -> None:
    """`changes` written into `state` by torch's indexed write, on each tensor's device."""
    for name, ch in changes.items():
        target = state[name]
        target.view(-1)[ch.indices.to(target.device)] = ch.values.to(target.device)
