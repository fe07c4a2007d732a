"""Lossless bf16 tensors at ~2/3 of their size, for anchors: the exponent bytes through zstd, the rest raw.

A bf16 weight's 8 exponent bits carry ~2.7 bits of information (weights cluster within a few octaves), its
sign and 7 mantissa bits ~8. So each element is split into its exponent byte and its sign | mantissa byte;
the exponent bytes of each chunk of CHUNK elements go through zstd (level 1: its Huffman stage does the work,
at several hundred MB/s), the other bytes are stored as they are. Chunks are independent, so both directions
run on `threads` threads (the compiled loops and zstd release the GIL). ZipNN and DFloat11 use the same split.

A packed tensor: for each chunk, the byte length of its zstd frame (u64 LE); the frames; the sign | mantissa
bytes of the whole tensor.
"""

from __future__ import annotations

import math
import struct

import numpy as np
import torch
import zstandard

from deltasync.codec.bf16 import bits
from deltasync.codec.parallel import parallel_map, spans
from deltasync.errors import PackedError

CHUNK = 1 << 22
LEVEL = 1


def pack(t: torch.Tensor, threads: int | None = None, chunk: int = CHUNK) -> bytes:
    """The bf16 tensor `t`, packed."""
    from deltasync.codec import kernels  # not at import time: see deltasync.codec.kernels

    patterns = bits(t).cpu().numpy().view(np.uint16)
    rest = np.empty(patterns.size, np.uint8)

    def frame(span: tuple[int, int]) -> bytes:
        lo, hi = span
        exponents = np.empty(hi - lo, np.uint8)
        kernels.split_exponents(patterns[lo:hi], exponents, rest[lo:hi])
        return zstandard.ZstdCompressor(level=LEVEL).compress(exponents.data)

    frames = parallel_map(frame, spans(patterns.size, chunk), threads)
    return struct.pack(f"<{len(frames)}Q", *map(len, frames)) + b"".join(frames) + rest.tobytes()


def unpack(
    data: bytes | memoryview, shape: list[int], threads: int | None = None, chunk: int = CHUNK
) -> torch.Tensor:
    """The bf16 tensor of `shape` that `data` packs. Raises PackedError when it cannot be, before allocating
    more than the tensor and `data` need (each frame must declare the exact size of its chunk)."""
    from deltasync.codec import kernels  # not at import time: see deltasync.codec.kernels

    if not isinstance(shape, list) or not all(type(n) is int and n >= 0 for n in shape):
        raise PackedError(f"shape {shape!r:.80} is not a list of non-negative integers")
    if not isinstance(chunk, int) or chunk < 1:
        raise PackedError(f"chunk {chunk!r:.80} is not a positive integer")
    numel = math.prod(shape)
    table = 8 * max(1, -(-numel // chunk))  # a u64 frame length per chunk (an empty tensor has one)
    if len(data) < table + numel:  # (before listing the chunks: `chunk` comes from the file)
        raise PackedError(f"{len(data)} bytes cannot pack {numel} elements in chunks of {chunk}")
    pieces = spans(numel, chunk)
    lengths = struct.unpack_from(f"<{len(pieces)}Q", data)
    if table + sum(lengths) + numel != len(data):
        held = len(data) - table - numel
        raise PackedError(f"frame lengths add up to {sum(lengths)}, the data holds {held}")
    view = memoryview(data)
    rest = np.frombuffer(view, np.uint8, numel, len(data) - numel)
    starts = np.cumsum([table, *lengths]).tolist()
    out = torch.empty(numel, dtype=torch.bfloat16)
    patterns = bits(out).numpy().view(np.uint16)

    def fill(i: int) -> None:
        lo, hi = pieces[i]
        frame = view[starts[i] : starts[i + 1]]
        try:
            # zstd allocates what the frame header declares (up to 2**64 bytes): check it first
            declared = zstandard.frame_content_size(frame)
            if declared != hi - lo:
                size = "no size" if declared < 0 else f"{declared} bytes"
                raise PackedError(f"elements {lo}..{hi}: the zstd frame declares {size}, not {hi - lo}")
            exponents = zstandard.ZstdDecompressor().decompress(frame, max_output_size=hi - lo)
        except zstandard.ZstdError as e:
            raise PackedError(f"elements {lo}..{hi}: corrupt zstd frame: {e}") from None
        if len(exponents) != hi - lo:
            raise PackedError(f"elements {lo}..{hi}: {len(exponents)} exponents decoded")
        kernels.merge_exponents(np.frombuffer(exponents, np.uint8), rest[lo:hi], patterns[lo:hi])

    parallel_map(fill, range(len(pieces)), threads)
    return out.view(shape)
