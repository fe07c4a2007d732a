"""Quantized deltas: applied to the previous quantized state they give the quantization of the new bf16 state,
bit for bit; a corrupt, foreign or stale delta is refused and nothing is written."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import save

from deltasync.errors import PatchError
from deltasync.quant import delta as deltas
from deltasync.quant.recipe import RECIPES, recipe, row_amax
from deltasync.quant.state import Changes, Quantized, apply, fingerprint, quantize_state

SHAPES = {
    "model.layers.0.mlp.experts.0.up_proj.weight": (48, 64),
    "model.layers.0.mlp.experts.1.down_proj.weight": (64, 48),
    "model.layers.0.self_attn.q_proj.weight": (32, 40),
    "model.layers.0.input_layernorm.weight": (64,),
    "model.embed_tokens.weight": (100, 64),
}


def adam_steps(seed: int, lr: float, steps: int) -> list[dict[str, torch.Tensor]]:
    """bf16 states of fp32 master weights moved by ~lr per element per step (Adam's normalized update)."""
    g = torch.Generator().manual_seed(seed)
    master = {n: torch.randn(s, generator=g) * 0.02 for n, s in SHAPES.items()}
    states = [{n: w.bfloat16() for n, w in master.items()}]
    for _ in range(steps):
        for w in master.values():
            w.add_(torch.randn(w.shape, generator=g).sign_(), alpha=-lr)
        states.append({n: w.bfloat16() for n, w in master.items()})
    return states


def copy(state: dict[str, Quantized]) -> dict[str, Quantized]:
    return {n: Quantized(q.codes.clone(), q.scales.clone()) for n, q in state.items()}


def assert_same(a: dict[str, Quantized], b: dict[str, Quantized]) -> None:
    assert a.keys() == b.keys()
    for n in a:
        assert torch.equal(a[n].codes.view(torch.uint8), b[n].codes.view(torch.uint8)), n
        assert torch.equal(a[n].scales.view(torch.int32), b[n].scales.view(torch.int32)), n


def step_file(old: dict, new: dict, name: str) -> tuple[bytes, dict[str, Quantized], int]:
    """The delta file from `old` to `new` (bf16 states), the old quantized state and its fingerprint."""
    r = recipe(name)
    q_old, q_new = quantize_state(old, r), quantize_state(new, r)
    base = fingerprint(q_old)
    data = deltas.encode(deltas.diff(q_old, q_new), q_old, name, base, fingerprint(q_new))
    return data, q_old, base


def assert_same_changes(a: dict[str, Changes], b: dict[str, Changes]) -> None:
    assert a.keys() == b.keys()
    for n in a:
        for field in ("positions", "codes", "rows", "scales"):
            x, y = getattr(a[n], field), getattr(b[n], field)
            assert x.dtype.itemsize == y.dtype.itemsize and np.array_equal(
                x.view(f"u{x.itemsize}"), y.view(f"u{y.itemsize}")
            ), (n, field)


@settings(max_examples=25, deadline=None)
@given(
    name=st.sampled_from(sorted(RECIPES)),
    seed=st.integers(0, 2**16),
    lr=st.sampled_from([1e-6, 3e-6, 1e-5, 1e-4]),
    steps=st.integers(1, 3),
)
def test_applied_deltas_equal_quantizing_the_new_state(name, seed, lr, steps):
    """The trainer's path (changes found from the bf16 step's changes alone, applied to its quantized state)
    and the replica's (the delta file decoded, verified, applied) both reach the new state's quantization."""
    r = recipe(name)
    states = adam_steps(seed, lr, steps)
    trainer = deltas.Quantizer(states[0], r)
    replica, base = copy(trainer.state), trainer.fingerprint
    for old, new in zip(states, states[1:], strict=False):
        expected, before = quantize_state(new, r), copy(trainer.state)
        data, changes = trainer.step(old, new, deltas.changed_positions(old, new))
        assert_same_changes(changes, deltas.diff(before, expected))
        delta, reached = deltas.decode(data, replica, name, base)
        apply(replica, delta)
        assert_same(trainer.state, expected)
        assert_same(replica, expected)
        assert reached == trainer.fingerprint == fingerprint(expected) == fingerprint(replica)
        assert all(torch.equal(trainer.amax[n], row_amax(new[n])) for n in trainer.amax)
        base = reached


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_a_scale_that_moves_up_or_down_travels_with_the_codes_it_moves(name):
    old, new = adam_steps(0, 1e-6, 1)
    tensor = "model.layers.0.mlp.experts.0.up_proj.weight"
    new[tensor] = old[tensor].clone()
    for row, factor in ((3, 1.5), (5, 0.25)):  # the row's largest magnitude, hence its scale, up and down
        new[tensor][row, int(new[tensor][row].abs().argmax())] *= factor
    trainer = deltas.Quantizer(old, recipe(name))
    before = copy(trainer.state)
    _, changes = trainer.step(old, new, deltas.changed_positions(old, new))
    assert_same_changes(changes, deltas.diff(before, quantize_state(new, recipe(name))))
    d = changes[tensor]
    assert d.rows.tolist() == [3, 5]
    assert set(d.positions // SHAPES[tensor][1]) == {3, 5} and d.positions.size > 2


def test_only_the_recipes_tensors_are_quantized():
    fp8 = recipe("fp8_per_channel").quantized_names(SHAPES)
    int8 = recipe("int8_per_channel_weight_only").quantized_names(SHAPES)
    assert fp8 == list(SHAPES)[:3]
    assert int8 == list(SHAPES)[:2]
    with pytest.raises(ValueError, match="unknown quantization 'fp8'"):
        recipe("fp8")


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_corrupt_foreign_or_stale_deltas_are_refused_and_nothing_is_written(name):
    old, new = adam_steps(1, 1e-5, 1)
    data, q_old, base = step_file(old, new, name)
    other = next(n for n in RECIPES if n != name)
    flipped = bytearray(data)
    flipped[-5] ^= 0x10  # inside the last zstd entry
    truncated_count = data.replace(b'"tensors"', b'"tensorz"')
    cases = {
        "foreign recipe": (data, other, base, "a delta for quantization"),
        "stale base": (data, name, base ^ 1, "made for state"),
        "flipped payload bit": (bytes(flipped), name, base, r"corrupt|reaches|holds"),
        "bad metadata": (truncated_count, name, base, "bad quantized delta metadata"),
        "not a delta": (b"\x08" + bytes(20), name, base, "not a safetensors file"),
        "a bf16 patch": (
            save({"x": torch.zeros(1)}, {"format": "deltasync.patch"}),
            name,
            base,
            "not a quantized",
        ),
    }
    for blob, recipe_name, base_fp, message in cases.values():
        target = copy(q_old)
        with pytest.raises(PatchError, match=message):
            deltas.decode(blob, target, recipe_name, base_fp)
        assert_same(target, q_old)  # nothing written


def test_a_delta_that_misses_a_change_is_refused():
    old, new = adam_steps(2, 1e-5, 1)
    name = "fp8_per_channel"
    q_old, q_new = (quantize_state(s, recipe(name)) for s in (old, new))
    delta = deltas.diff(q_old, q_new)
    tensor, d = next(iter(delta.items()))
    delta[tensor] = Changes(d.positions[1:], d.codes[1:], d.rows, d.scales)  # one change dropped
    data = deltas.encode(delta, q_old, name, fingerprint(q_old), fingerprint(q_new))
    with pytest.raises(PatchError, match="reaches .*, not the .* it promises"):
        deltas.decode(data, q_old, name, fingerprint(q_old))


def test_an_unchanged_step_is_an_empty_delta():
    state = adam_steps(3, 1e-6, 0)[0]
    data, q_old, base = step_file(state, state, "fp8_per_channel")
    delta, target = deltas.decode(data, q_old, "fp8_per_channel", base)
    assert delta == {} and target == base
    assert np.frombuffer(data[:8], "<u8")[0] < 400  # a header and nothing else
