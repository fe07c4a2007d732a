"""The codec on several threads and in chunks: same bytes whatever the thread count, exact round trips."""

import json
import struct

import numpy as np
import pytest
import torch

from deltasync.codec import patch as patches
from deltasync.codec.bf16 import bits
from deltasync.codec.changes import apply_changes, diff
from tests.helpers import assert_bitwise_equal, random_state, step_state

SHAPES = {"embed": (300, 64), "w": (64, 48), "norm": (64,)}


def canonical(data: bytes) -> tuple[dict, bytes]:
    """A patch's header (parsed: safetensors writes its metadata in hash-map order) and its data."""
    (n,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8 : 8 + n]), data[8 + n :]


def states(density: float = 0.02, seed: int = 0) -> tuple[dict, dict]:
    rng = np.random.default_rng(seed)
    old = random_state(rng, SHAPES)
    return old, step_state(rng, old, density)


@pytest.mark.parametrize("chunk", [1000, 4096, 1 << 22])
def test_bytes_do_not_depend_on_the_thread_count(chunk):
    old, new = states()
    one = canonical(
        patches.encode(patches.make_patch(old, new, 1, 0, threads=1), old, threads=1, chunk=chunk)
    )
    for threads in (2, 3):
        patch = patches.make_patch(old, new, 1, 0, threads=threads)
        assert canonical(patches.encode(patch, old, threads=threads, chunk=chunk)) == one


@pytest.mark.parametrize("chunk", [1, 77, 1000, 19200])
@pytest.mark.parametrize("density", [0.0005, 0.02, 0.5])
def test_chunked_roundtrip_is_exact(chunk, density):
    old, new = states(density, seed=chunk)
    data = patches.encode(patches.make_patch(old, new, 1, 0), old, chunk=chunk)
    for threads in (1, 2):
        result = {n: t.clone() for n, t in old.items()}
        apply_changes(result, patches.decode(data, old, threads=threads).changes, threads)
        assert_bitwise_equal(result, new)


def test_diff_spans_a_tensor_in_pieces(monkeypatch):
    old, new = states()
    whole = diff(old, new, threads=1)
    monkeypatch.setattr(
        "deltasync.codec.host.spans", lambda n: [(lo, min(lo + 999, n)) for lo in range(0, n, 999)]
    )
    pieces = diff(old, new, threads=2)
    assert whole.keys() == pieces.keys()
    for name in whole:
        assert torch.equal(whole[name].indices, pieces[name].indices)
        assert torch.equal(bits(whole[name].values), bits(pieces[name].values))


def test_a_chunk_count_that_does_not_fit_the_tensor_is_refused():
    old, new = states()
    data = patches.encode(patches.make_patch(old, new, 1, 0), old, chunk=1000)
    bad = data.replace(b'"chunk":"1000"', b'"chunk":"2000"')
    assert bad != data
    with pytest.raises(patches.PatchError, match="chunks"):
        patches.decode(bad, old)
