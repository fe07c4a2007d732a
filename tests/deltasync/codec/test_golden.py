"""The patch bytes, pinned: the digests below were made by the codec before its device backends
(deltasync.codec.backend, commit c172202), so a change to the codec that moves a single byte of a patch fails
here. Change a digest only with a new format version."""

import hashlib
import json
import struct

import numpy as np
import pytest
import torch

from deltasync.codec import patch as patches
from deltasync.codec.bf16 import bits

SHAPES = {"embed": (300, 70), "q": (64, 100), "norm": (100,), "one": (1,)}
GOLDEN = {  # (encoding, density, chunk): digest
    ("compact", 0.002, 1000): "406737c863da558941bd7491aa1b57ec",
    ("compact", 0.02, 1000): "dfc26991878068b7c4169bc3bff9822d",
    ("compact", 0.3, 4096): "67cb78988abda6a5bcc43e77beb2e9a9",
    ("compact", 1.0, 1 << 22): "2160e124bf435d15f7934a1aba87c61c",  # every tensor stored dense
    ("raw", 0.02, 1 << 22): "80f9e7039c3f985d94e1b1059eb53a25",
}
WINDOWED = "f3850ef9d76ea8a314eb0eb980216256"


def states(density: float, seed: int = 0) -> tuple[dict, dict]:
    """A bf16 state (N(0, 0.02), a few NaN, -0.0 and huge patterns) and one where `density` of the elements
    moved by one ulp and a twentieth of that jumped anywhere."""
    rng = np.random.default_rng(seed)
    old, new = {}, {}
    for name, shape in SHAPES.items():
        n = int(np.prod(shape))
        b = bits(torch.from_numpy(rng.normal(0, 0.02, n).astype(np.float32)).bfloat16()).clone()
        odd = torch.from_numpy(rng.random(n) < 0.002)
        b[odd] = torch.from_numpy(rng.integers(-(1 << 15), 1 << 15, int(odd.sum()), dtype=np.int16))
        step = np.where(rng.random(n) < density, rng.choice([-1, 1], n), 0).astype(np.int16)
        after = b + torch.from_numpy(step)
        jump = torch.from_numpy(rng.random(n) < density / 20)
        after[jump] = torch.from_numpy(rng.integers(-(1 << 15), 1 << 15, int(jump.sum()), dtype=np.int16))
        old[name], new[name] = b.view(torch.bfloat16).view(shape), after.view(torch.bfloat16).view(shape)
    return old, new


def digest(data: bytes) -> str:
    """The patch's bytes, its header's keys sorted (safetensors writes `__metadata__` in no fixed order)."""
    (n,) = struct.unpack("<Q", data[:8])
    header = json.dumps(json.loads(data[8 : 8 + n]), sort_keys=True).encode()
    return hashlib.blake2b(header + data[8 + n :], digest_size=16).hexdigest()


@pytest.mark.parametrize(("encoding", "density", "chunk"), list(GOLDEN))
def test_patch_bytes_are_pinned(encoding, density, chunk):
    old, new = states(density)
    patch = patches.make_patch(old, new, 7, 6, threads=2)
    data = patches.encode(patch, old, encoding, threads=2, chunk=chunk)
    assert digest(data) == GOLDEN[encoding, density, chunk]


def test_a_windowed_part_is_pinned():
    """A sharded rank's part: the second half of `embed`'s elements and the whole of the rest."""
    old, new = states(0.02, seed=1)
    windows = {"embed": (10500, 10500)}
    shapes = {name: list(t.shape) for name, t in old.items()}
    old["embed"], new["embed"] = old["embed"].reshape(-1)[10500:], new["embed"].reshape(-1)[10500:]
    changes, moved = patches.window_changes(old, new, windows, threads=2)
    patch = patches.Patch(3, 2, 27401, 0, moved, changes)
    data = patches.encode(patch, old, threads=2, chunk=2000, windows=windows, shapes=shapes)
    assert digest(data) == WINDOWED
