"""The full fingerprint's pass over a state, one tensor at a time."""

import weakref

import numpy as np
import torch

from deltasync.codec.fingerprint import row_fingerprint, state_fingerprint
from deltasync.codec.host import HostBackend
from tests.helpers import random_state

SHAPES = {f"layer{i}": (64, 96) for i in range(6)} | {"norm": (96,)}


def test_a_generators_tensors_are_freed_as_the_pass_goes():
    state = random_state(np.random.default_rng(0), SHAPES)
    made: list[weakref.ref] = []

    def copies():
        for name, t in state.items():
            assert all(r() is None for r in made[:-1]), "an earlier tensor is still held"
            copy = t.clone()
            made.append(weakref.ref(copy))
            yield name, copy

    assert state_fingerprint(copies()) == state_fingerprint(state)
    assert len(made) == len(SHAPES)


def test_the_compiled_pass_is_the_row_sums_fingerprint():
    """The host backend's compiled pass and torch's row sums (the other accelerators'), bit for bit: short
    last rows, a tensor of more than one span of rows, an empty one, NaN, infinities and -0.0."""
    g = torch.Generator().manual_seed(1)
    shapes = [(3,), (4095,), (4096,), (4097,), (1000, 37), ((1 << 22) + 5000,), (0,)]
    state = [
        (f"t{i}", (torch.randn(s, generator=g) * 10.0 ** (i - 3)).bfloat16()) for i, s in enumerate(shapes)
    ]
    special = [float("nan"), -0.0, float("inf"), -float("inf"), -3e38, 3e38] * 1000
    state.append(("special", torch.tensor(special).bfloat16()))
    for name, t in state:
        assert HostBackend().state_fingerprint([(name, t)]) == row_fingerprint([(name, t)]), name
    assert HostBackend().state_fingerprint(state) == row_fingerprint(state)
