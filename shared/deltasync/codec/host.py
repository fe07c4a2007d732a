"""The codec's host backend (deltasync.codec.backend): numba's compiled loops (deltasync.codec.kernels) on
`threads` host threads, in fixed spans of each tensor, so the results never depend on the thread count.
No torch op runs on the host tensors' elements inside the threads: torch's own thread pool would spin beside
ours. Like every module the inference Space imports, it loads numba only inside the functions that run its
loops (see deltasync.codec.kernels)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

import numpy as np
import torch

from deltasync.codec import compact, fingerprint, packed
from deltasync.codec.backend import Backend, Decoder, Move, Pairs, TensorChanges
from deltasync.codec.bf16 import bits
from deltasync.codec.parallel import parallel_map, spans
from deltasync.errors import PatchError

SCATTER_SPAN = 1 << 18  # changes per unit of `write`'s work


class HostBackend(Backend):
    def scan(self, pairs: Pairs, threads: int | None) -> tuple[dict[str, TensorChanges], dict[str, int]]:
        from deltasync.codec import kernels  # not at import time: see deltasync.codec.kernels

        on_host = {name: (a.numpy(), b.numpy()) for name, (a, b) in pairs.items()}

        def compare(work: tuple[str, int, int]) -> tuple[np.ndarray, np.ndarray, int]:
            name, lo, hi = work
            a, b = on_host[name]
            idx, values, moved = kernels.changed_positions(
                a[lo:hi], b[lo:hi], fingerprint.seed(name), fingerprint.R1, lo
            )
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
        return found, moves

    def state_fingerprint(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Each tensor's rows in one compiled pass, in spans of whole rows on every core: no temporaries."""
        from deltasync.codec import kernels  # not at import time: see deltasync.codec.kernels

        r1, total = fingerprint.R1.astype(np.int64), 0
        for name, t in tensors:
            flat, seed = bits(t).numpy(), fingerprint.seed(name)

            def rows(span: tuple[int, int], flat=flat, seed=seed) -> int:
                lo, hi = span
                return int(kernels.fingerprint_rows(flat[lo:hi], r1, seed, lo // fingerprint.ROW))

            total += sum(parallel_map(rows, spans(flat.size), None))
        return total & fingerprint.MASK64

    def compact_streams(
        self,
        changes: Mapping[str, TensorChanges],
        old: Mapping[str, torch.Tensor],
        chunk: int,
        threads: int | None,
    ) -> tuple[dict[str, bytes], compact.Models]:
        return host_streams(changes, old, chunk, threads)

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
        return HostDecoder(streams, windows, chunk, tables, old_values, threads)

    def moves(self, changes: list[Move]) -> int:
        return (
            sum(
                fingerprint.delta(name, positions.numpy(), before.numpy(), after.numpy())
                for name, positions, before, after in changes
            )
            & fingerprint.MASK64
        )

    def write(
        self, state: Mapping[str, torch.Tensor], changes: Mapping[str, TensorChanges], threads: int | None
    ) -> None:
        """In spans of each tensor's changes: one large tensor, an embedding, would otherwise hold one thread
        while the rest wait. A tensor not laid out flat in memory (or changes not on the host) takes torch's
        indexed write."""
        from deltasync.codec import kernels  # not at import time: see deltasync.codec.kernels

        def write(work: tuple[str, int, int]) -> None:
            name, lo, hi = work
            ch = changes[name]
            kernels.scatter(
                bits(state[name]).numpy(), ch.indices[lo:hi].numpy(), bits(ch.values[lo:hi]).cpu().numpy()
            )

        flat = {n for n in changes if state[n].is_contiguous() and changes[n].indices.device.type == "cpu"}
        for name in changes:
            if name not in flat:
                target, ch = state[name], changes[name]
                target.view(-1)[ch.indices.to(target.device)] = ch.values.to(target.device)
        work = [(n, lo, hi) for n in changes if n in flat for lo, hi in spans(len(changes[n]), SCATTER_SPAN)]
        parallel_map(write, work, threads)


class HostDecoder(Decoder):
    """Compact entries decoded chunk by chunk on host threads, one tensor when asked."""

    def __init__(
        self,
        streams: Mapping[str, list[bytes]],
        windows: Mapping[str, tuple[int, int]],
        chunk: int,
        tables: compact.Tables,
        old_values: Callable[[str], torch.Tensor],
        threads: int | None,
    ) -> None:
        self.streams, self.windows, self.chunk, self.tables = streams, windows, chunk, tables
        self.old_values, self.threads = old_values, threads

    def changes(self, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        old_bits = bits(self.old_values(name)).reshape(-1).numpy()
        start = self.windows[name][0]
        pieces = spans(old_bits.size, self.chunk)
        streams = self.streams[name]
        work = [(name, s, old_bits[lo:hi], start + lo) for s, (lo, hi) in zip(streams, pieces, strict=True)]
        parts = parallel_map(lambda w: decode_chunk(*w, self.tables), work, self.threads)
        idx = torch.from_numpy(np.concatenate([p[0] for p in parts]))
        return idx - start, torch.from_numpy(np.concatenate([p[1] for p in parts]).view(np.int16))


def decode_chunk(
    name: str, stream: bytes, old_bits: np.ndarray, offset: int, tables: compact.Tables
) -> tuple[np.ndarray, np.ndarray, int]:
    """One chunk of tensor `name`, elements offset.. of it: positions in the tensor, new patterns (uint16) and
    the fingerprint's move. Raises PatchError."""
    try:
        idx, new, moved = compact.decode_chunk(stream, old_bits, tables, int(fingerprint.seed(name)), offset)
    except compact.CompactDecodeError as e:
        raise PatchError(f"{name}: corrupt compact data at element {offset}: {e}") from None
    return idx + offset, new, moved


Chunk = tuple[str, tuple]  # (tensor name, (old bits, positions, new bits) of one chunk as numpy arrays)


def chunks(changes: Mapping[str, TensorChanges], old: Mapping[str, torch.Tensor], chunk: int) -> list[Chunk]:
    """Every changed tensor's chunks, in order, with positions relative to the chunk."""
    out = []
    for name, ch in changes.items():
        old_bits, idx, new_bits = bits(old[name]).cpu().numpy(), ch.indices.cpu().numpy(), bits(ch.values)
        cuts = np.searchsorted(idx, np.arange(0, old_bits.size + chunk, chunk)).tolist()
        for i, (lo, hi) in enumerate(spans(old_bits.size, chunk)):
            part = slice(cuts[i], cuts[i + 1])
            out.append((name, (old_bits[lo:hi], idx[part] - lo, new_bits[part].cpu().numpy())))
    return out


def _chunk_symbols(work: Chunk) -> compact.Symbols:
    return compact.to_symbols(*work[1])


def host_symbols(
    changes: Mapping[str, TensorChanges],
    old: Mapping[str, torch.Tensor],
    chunk: int,
    threads: int | None = None,
) -> dict[str, list[compact.Symbols]]:
    """The compact symbols of every chunk of every changed tensor, in order, on `threads` host threads."""
    symbols: dict[str, list[compact.Symbols]] = {}
    work = chunks(changes, old, chunk)
    for (name, _), s in zip(work, parallel_map(_chunk_symbols, work, threads), strict=True):
        symbols.setdefault(name, []).append(s)
    return symbols


def host_streams(
    changes: Mapping[str, TensorChanges],
    old: Mapping[str, torch.Tensor],
    chunk: int,
    threads: int | None = None,
) -> tuple[dict[str, bytes], compact.Models]:
    """The compact streams of the changed tensors worth coding so (compact.worth_coding; the others are
    left out, to be stored dense) and the models pooled over them, on `threads` host threads."""
    models = compact.Models()
    symbols = host_symbols(changes, old, chunk, threads)
    for name, parts in list(symbols.items()):
        if compact.worth_coding([s.estimated_bits for s in parts], old[name].numel()):
            for s in parts:
                compact.tally(models, s)
        else:
            del symbols[name]
    tables = models.tables()
    work = [s for parts in symbols.values() for s in parts]
    coded = iter(parallel_map(lambda s: compact.encode_chunk(s, tables), work, threads))
    streams = {name: compact.join_chunks([next(coded) for _ in parts]) for name, parts in symbols.items()}
    return streams, models


def warm_up() -> None:
    """Run this backend's loops of a publisher's steps once on a tiny state (the fingerprint, change
    detection, the compact coder, a packed anchor), so that numba loads (or compiles) them now, not on a
    run's first steps: a publisher does it at start, beside training."""
    g = torch.Generator().manual_seed(0)
    old = torch.randn(1 << 14, generator=g).bfloat16()
    new = old.clone()
    new[::64] += 1e-2  # sparse enough to be coded compact, as a training step's changes are
    HostBackend().state_fingerprint([("warm-up", old)])
    changes, _ = HostBackend().scan({"warm-up": (bits(old), bits(new))}, threads=1)
    host_streams(changes, {"warm-up": old}, 1 << 12, threads=1)
    packed.pack(new, threads=1)
