"""Change detection and the fingerprint that vouches for a whole bf16 state."""

import numpy as np
import torch

from deltasync.codec import fingerprint
from deltasync.codec.bf16 import bits
from deltasync.codec.changes import apply_changes, diff


def test_diff_finds_exactly_the_elements_whose_bf16_pattern_changed():
    torch.manual_seed(0)
    params = {"w": torch.randn(300, 70), "b": torch.randn(70)}  # fp32 trainer weights
    published = {n: p.bfloat16() for n, p in params.items()}
    snapshot = {n: p.clone() for n, p in published.items()}
    with torch.no_grad():
        params["w"] += torch.randn(300, 70) * 1e-3 * (torch.rand(300, 70) < 0.1)
        params["b"][3] *= 1.5
    changes = diff(snapshot, params.items())
    apply_changes(snapshot, changes)
    for name, p in params.items():
        expected = torch.nonzero(bits(p.bfloat16()) != bits(published[name])).squeeze(1)
        assert torch.equal(changes[name].indices, expected)
        assert torch.equal(bits(changes[name].values), bits(p.bfloat16())[expected])
        assert torch.equal(bits(snapshot[name]), bits(p.bfloat16()))
    assert changes["b"].indices.tolist() == [3]
    assert diff(snapshot, params) == {}


def test_diff_is_bitwise():
    new = {"w": torch.tensor([0.0, float("nan"), 1.0, float("inf")])}
    old = {"w": new["w"].bfloat16()}
    new["w"][0] = -0.0
    changes = diff(old, new)
    assert changes["w"].indices.tolist() == [0]  # -0.0 differs from 0.0; identical NaN and inf do not


def test_incremental_fingerprint_matches_a_full_recomputation():
    rng = np.random.default_rng(0)
    b = rng.integers(-(1 << 15), 1 << 15, size=10_000, dtype=np.int16)
    t = torch.from_numpy(b.copy()).view(torch.bfloat16)
    full = fingerprint.tensor_fingerprint("w", t)
    pos = np.sort(rng.choice(b.size, 500, replace=False))
    new = b.copy()
    new[pos] = rng.integers(-(1 << 15), 1 << 15, size=pos.size, dtype=np.int16)
    moved = (full + fingerprint.delta("w", pos, b[pos], new[pos])) & fingerprint.MASK64
    assert moved == fingerprint.tensor_fingerprint("w", torch.from_numpy(new).view(torch.bfloat16))


def test_any_single_element_change_moves_the_fingerprint():
    t = torch.zeros(5000, dtype=torch.bfloat16)
    base = fingerprint.state_fingerprint({"w": t})
    seen = {base}
    for i in (0, 1, 4095, 4096, 4999):
        for delta in (1, -1, 1 << 15 - 1):
            u = t.clone()
            bits(u)[i] += delta
            seen.add(fingerprint.state_fingerprint({"w": u}))
    assert len(seen) == 1 + 5 * 3
    # Same bits under another name, or swapped between positions, fingerprint differently too.
    a = torch.arange(10, dtype=torch.bfloat16)
    assert fingerprint.tensor_fingerprint("a", a) != fingerprint.tensor_fingerprint("b", a)
    assert fingerprint.tensor_fingerprint("a", a) != fingerprint.tensor_fingerprint("a", a.flip(0))


def test_apply_changes_splits_a_tensor_across_threads_exactly(monkeypatch):
    from deltasync.codec import host

    monkeypatch.setattr(host, "SCATTER_SPAN", 7)  # many spans per tensor, finishing in any order
    rng = np.random.default_rng(0)
    old = {
        n: torch.from_numpy(rng.integers(-(1 << 15), 1 << 15, k, dtype=np.int16)).view(torch.bfloat16)
        for n, k in (("a", 1000), ("b", 5), ("c", 3))
    }
    new = {n: t.clone() for n, t in old.items()}
    for t in new.values():
        bits(t)[torch.from_numpy(rng.random(t.numel()) < 0.3)] += 1
    state = {n: t.clone() for n, t in old.items()}
    apply_changes(state, diff(old, new), threads=3)
    assert all(torch.equal(bits(state[n]), bits(new[n])) for n in new)
