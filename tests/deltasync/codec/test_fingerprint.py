"""The full fingerprint's pass over a state, one tensor at a time."""

import weakref

import numpy as np

from deltasync.codec.fingerprint import state_fingerprint
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
