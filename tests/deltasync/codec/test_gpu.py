"""The GPU kernels (deltasync.codec.gpu) against the CPU codec, bit for bit: on a GPU where there is one, else
through Triton's interpreter (small states: the interpreter runs each program in numpy)."""

import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest
import torch

from bench.cuda import canonical, compact_streams
from deltasync.codec import bf16, changes, compact, fingerprint
from deltasync.codec import patch as patches
from deltasync.codec.bf16 import bits
from tests.helpers import DEVICE


def states(seed: int, shapes: dict[str, tuple[int, ...]], density: float) -> tuple[dict, dict]:
    """A bf16 state (N(0, 0.02) matrices, ones for vectors, a few NaN, -0.0 and huge patterns) and one
    where about `density` of the elements moved by one ulp (small ones more often, as under Adam) and a few
    jumped anywhere."""
    rng = np.random.default_rng(seed)
    old, new = {}, {}
    for name, shape in shapes.items():
        n = int(np.prod(shape))
        t = torch.from_numpy(rng.normal(0, 0.02, n).astype(np.float32)).bfloat16() if len(shape) > 1 else None
        b = bits(t).clone() if t is not None else torch.full((n,), 0x3F80, dtype=torch.int16)
        odd = torch.from_numpy(rng.random(n) < 0.002)
        b[odd] = torch.from_numpy(rng.integers(-(1 << 15), 1 << 15, int(odd.sum()), dtype=np.int16))
        small = (0.002 / np.maximum(np.abs(b.view(torch.bfloat16).float().nan_to_num().numpy()), 1e-6)) ** 3
        moved = rng.random(n) < np.minimum(density * small, 1)  # small weights move more often
        step = torch.from_numpy(np.where(moved, rng.choice([-1, 1], n), 0).astype(np.int16))
        after = b + step
        jump = torch.from_numpy(rng.random(n) < density / 20)
        after[jump] = torch.from_numpy(rng.integers(-(1 << 15), 1 << 15, int(jump.sum()), dtype=np.int16))
        old[name] = b.view(torch.bfloat16).view(shape).to(DEVICE)
        new[name] = after.view(torch.bfloat16).view(shape).to(DEVICE)
    return old, new


SHAPES = {"embed": (70, 300), "norm": (300,), "q": (64, 100), "tiny": (3,), "one": (1,)}


def host(state: dict) -> dict:
    return {n: t.to("cpu", copy=True) for n, t in state.items()}


@pytest.mark.parametrize("density", [0.0, 0.01, 0.3, 1.0])
def test_scan_finds_the_host_diff_and_fingerprint_moves(gpu, density):
    """Called directly, and (on a GPU) through diff_and_moves and make_patch as the trainer calls them."""
    old, new = states(1, SHAPES, density)
    expected, expected_moves = changes.diff_and_moves(host(old), host(new), threads=1)
    for found, moves in (
        gpu.scan({n: (bits(old[n]), bits(new[n])) for n in old}),
        changes.diff_and_moves(old, new, threads=1),
    ):
        assert found.keys() == expected.keys() == moves.keys() == expected_moves.keys()
        for name, ch in expected.items():
            assert torch.equal(found[name].indices.cpu(), ch.indices), name
            assert torch.equal(bits(found[name].values).cpu(), bits(ch.values)), name
        assert moves == expected_moves
    assert patches.make_patch(old, new, 1, 0).fingerprint == fingerprint.state_fingerprint(host(new))


def test_state_fingerprint_is_the_host_one(gpu):
    old, new = states(2, SHAPES, 0.05)
    for state in (old, new, {}, {"odd": torch.arange(4097, dtype=torch.bfloat16).to(DEVICE)}):
        assert gpu.state_fingerprint(state) == fingerprint.state_fingerprint(host(state))
        assert fingerprint.state_fingerprint(state) == fingerprint.state_fingerprint(host(state))  # on a GPU


@pytest.mark.parametrize(
    ("chunk", "density"),
    [(1000, 0.01), (2048, 0.05), (compact.CHUNK, 0.01), (700, 0.3)],
)
def test_compact_streams_make_the_host_patch(gpu, chunk, density):
    """The same patch bytes (chunks across kernel blocks and tensor ends, one chunk per tensor, dense
    tensors), and the CPU decoder restores the new state from the GPU's bytes."""
    old, new = states(3, SHAPES | {"dense": (40, 30)}, density)
    anywhere = torch.from_numpy(np.random.default_rng(0).integers(-(1 << 15), 1 << 15, 1200, dtype=np.int16))
    new["dense"] = (anywhere | 1).view(torch.bfloat16).view(40, 30).to(DEVICE)  # stored dense
    patch = patches.make_patch(host(old), host(new), 1, 0, threads=1)
    expected = patches.encode(patch, host(old), "compact", threads=1, chunk=chunk)
    made = patches.encode(patch, old, "compact", threads=1, chunk=chunk, make_streams=gpu.compact_streams)
    assert canonical(made) == canonical(expected)
    assert canonical(patches.encode(patch, old, "compact", threads=1, chunk=chunk)) == canonical(expected)
    assert json.loads(canonical(made)[0]["__metadata__"]["dense"])["dense"] == 1200
    target = host(old)
    changes.apply_changes(target, patches.decode(made, target, threads=1).changes, threads=1)
    assert all(torch.equal(bits(target[n]), bits(new[n]).cpu()) for n in new)


def test_a_rank_encodes_its_window_as_the_host_does(gpu, monkeypatch):
    """A sharded rank's part of a step (deltasync.sync.sharded, previous copy beside its shard): the changes,
    the fingerprint's move in the whole tensor's positions and the patch bytes over the window."""
    old, new = states(6, {"w": (64, 100), "v": (50, 64)}, 0.03)
    old["w"], new["w"] = old["w"].reshape(-1), new["w"].reshape(-1)  # the rank's shard: flat
    windows, shapes = {"w": (6400, 6400)}, {"w": (128, 100), "v": (50, 64)}  # w: the second half of its rows
    expected, moved = patches.window_changes(host(old), host(new), windows, threads=1)
    patch = patches.Patch(1, 0, 16000, 0, moved, expected)
    want = patches.encode(patch, host(old), threads=1, chunk=1000, windows=windows, shapes=shapes)
    if DEVICE == "cpu":
        monkeypatch.setattr(bf16, "on_gpu", lambda t: True)  # the kernels on host tensors, interpreted
    found, found_moved = patches.window_changes(old, new, windows, threads=1)
    assert found_moved == moved and found.keys() == expected.keys() == {"w", "v"}
    for name, ch in expected.items():
        assert torch.equal(found[name].indices.cpu(), ch.indices), name
        assert torch.equal(bits(found[name].values).cpu(), bits(ch.values)), name
    got = patches.encode(patch, old, threads=1, chunk=1000, windows=windows, shapes=shapes)
    assert canonical(got) == canonical(want)


def test_compact_streams_are_the_host_streams(gpu):
    """Stream by stream and model by model, with chunks of one class (a tensor of ones) to four, chunks with
    no changes, escaped quotients (a lone change far into a chunk) and escaped values (jumps)."""
    old, new = states(4, SHAPES, 0.02)
    new["embed"].view(-1)[10500:] = old["embed"].view(-1)[10500:]  # a chunk without changes, and
    tiny = bits(old["embed"]).view(-1)  # a lone change of a tiny weight, far after the others of its class
    tiny[13999] = 0x3000
    bits(new["embed"]).view(-1)[13999] = 0x3001
    patch = patches.make_patch(host(old), host(new), 1, 0, threads=1)
    expected, expected_models = patches.host_streams(patch.changes, host(old), 7000, threads=1)
    made, models = gpu.compact_streams(patch.changes, old, 7000, threads=1)
    assert made == expected
    assert np.array_equal(models.q, expected_models.q) and np.array_equal(models.v, expected_models.v)
    tables = expected_models.tables()
    layouts = [compact.chunk_layout(c, 7000, tables) for s in made.values() for c in compact.split_chunks(s)]
    assert any(len(lay.bounds) == 0 for lay in layouts) and any(len(lay.bounds) == 3 for lay in layouts)
    assert any(lay.starts[-1] == 0 for lay in layouts)
    assert models.q[:, -1].sum() and models.v[:, -1].sum()  # both escapes were coded


def host_decode(name: str, parts: list[bytes], old: torch.Tensor, chunk: int, tables) -> tuple:
    """The CPU decoder's positions, new patterns (int16) and fingerprint move of one compact tensor."""
    x = bits(old).cpu().numpy()
    starts = range(0, x.size, chunk)
    seed = int(fingerprint.seed(name))
    done = [
        compact.decode_chunk(s, x[lo : lo + chunk], tables, seed, lo)
        for s, lo in zip(parts, starts, strict=True)
    ]
    positions = np.concatenate([idx + lo for (idx, _, _), lo in zip(done, starts, strict=True)])
    return (
        positions,
        np.concatenate([new for _, new, _ in done]).view(np.int16),
        sum(m for *_, m in done) & fingerprint.MASK64,
    )


def same(got: tuple, expected: tuple) -> bool:
    positions, after, moved = got
    return (
        np.array_equal(positions.cpu().numpy(), expected[0])
        and np.array_equal(after.cpu().numpy(), expected[1])
        and moved == expected[2]
    )


def decoded(gpu, symbols, name: str, old: torch.Tensor) -> tuple:
    """A tensor's changes as the GPU replica decodes them, and their fingerprint move (`gpu.moves`)."""
    positions, after = symbols.changes(name)
    return positions, after, gpu.total_move([gpu.moves(name, positions, bits(old)[positions], after)])


def gpu_decode(gpu, name: str, parts: list[bytes], old: torch.Tensor, chunk: int, tables) -> tuple:
    symbols = gpu.PatchSymbols({name: parts}, {name: old.numel()}, chunk, tables, old.device, lambda _: old)
    return decoded(gpu, symbols, name, old)


@pytest.mark.parametrize(("chunk", "density"), [(1000, 0.02), (7000, 0.02), (compact.CHUNK, 0.3)])
def test_patch_symbols_decode_as_the_host_does(gpu, chunk, density):
    """Positions, new patterns and fingerprint moves of every compact tensor, as the CPU decodes them."""
    old, new = states(4, SHAPES, density)
    patch = patches.make_patch(host(old), host(new), 1, 0, threads=1)
    streams, tables, _ = compact_streams(patches.encode(patch, host(old), "compact", threads=1, chunk=chunk))
    assert streams
    for name, parts in streams.items():
        got = gpu_decode(gpu, name, parts, old[name], chunk, tables)
        assert same(got, host_decode(name, parts, old[name], chunk, tables)), name


def test_patch_symbols_refuse_what_the_host_refuses(gpu):
    """Streams with a bit flipped: each is refused by both decoders, with the same message, or decoded by
    both to the same changes."""
    old, new = states(5, {"w": (40, 100)}, 0.05)
    patch = patches.make_patch(host(old), host(new), 1, 0, threads=1)
    streams, tables, chunk = compact_streams(
        patches.encode(patch, host(old), "compact", threads=1, chunk=1500)
    )
    rng = np.random.default_rng(0)
    refused = 0
    for _ in range(30):
        parts = list(streams["w"])
        k = int(rng.integers(len(parts)))
        broken = bytearray(parts[k])
        broken[int(rng.integers(len(broken)))] ^= 1 << int(rng.integers(8))
        parts[k] = bytes(broken)
        try:
            expected = host_decode("w", parts, old["w"], chunk, tables)
        except compact.CompactDecodeError as e:
            with pytest.raises(compact.CompactDecodeError) as caught:
                gpu_decode(gpu, "w", parts, old["w"], chunk, tables)
            assert str(caught.value) == str(e)
            refused += 1
            continue
        assert same(gpu_decode(gpu, "w", parts, old["w"], chunk, tables), expected)
    assert 0 < refused < 30


@pytest.mark.parametrize("budget", [1, 1000, 1 << 22])  # a tensor at a time, a few, the whole patch at once
def test_a_patchs_tensors_decoded_together_are_each_ones_own(gpu, monkeypatch, budget):
    """Every chunk of a patch in one rANS launch, then runs of tensors decoded together up to a budget of
    changes: each tensor's changes are what its own streams decode to, and a broken stream, or old values
    it cannot have been made from, is refused as its own tensor's, whichever tensors are decoded with it."""
    monkeypatch.setattr(gpu, "GROUP_CHANGES", budget)
    old, new = states(6, SHAPES, 0.05)
    patch = patches.make_patch(host(old), host(new), 1, 0, threads=1)
    streams, tables, chunk = compact_streams(
        patches.encode(patch, host(old), "compact", threads=1, chunk=900)
    )
    assert len(streams) >= 3
    numels = {name: old[name].numel() for name in streams}
    broken = "q"  # (several classes: the streams' order varies with str hashing)
    cut = dict(streams, **{broken: [*streams[broken][:-1], streams[broken][-1][:-1]]})  # raw bits cut short
    zeros = dict(old, **{broken: torch.zeros_like(old[broken])})  # one class: ranks in the others lie beyond
    for parts_of, old_of in [(streams, old), (cut, old), (streams, zeros)]:
        symbols = gpu.PatchSymbols(parts_of, numels, chunk, tables, torch.device(DEVICE), old_of.__getitem__)
        for name, parts in streams.items():
            if name == broken and (old_of is not old or parts_of is not streams):
                with pytest.raises(compact.CompactDecodeError) as expected:
                    host_decode(name, parts_of[name], old_of[name], chunk, tables)
                with pytest.raises(
                    compact.CompactDecodeError, match=re.escape(str(expected.value))
                ) as caught:
                    symbols.changes(name)
                assert caught.value.tensor == broken
                continue
            got = decoded(gpu, symbols, name, old[name])
            assert same(got, host_decode(name, parts, old[name], chunk, tables)), name


def test_the_rans_kernels_compile_for_an_h100():
    """The interpreter runs any Python; this compiles the kernels with data-dependent control flow (a scalar
    loop per chunk) to cubins for sm_90, as on a GPU, with the ptxas that Triton ships."""
    script = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from deltasync.codec import gpu
kernels = {
    gpu._ans_decode: ["*u8", "*i64", "*i64", "*i64", "*u8", "*i8", "*i8", "i64"],
    gpu._ans_encode: ["*i32", "*i32", "*i32", "*i64", "*i64", "*i64", "*i64", "*i16", "*u8", "*i64"],
}
for kernel, types in kernels.items():
    signature = dict(zip(kernel.arg_names, types, strict=True))
    compiled = triton.compile(
        ASTSource(kernel, signature, {}, {}), target=GPUTarget("cuda", 90, 32), options={"num_warps": 1}
    )
    print(len(compiled.asm["cubin"]))
"""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, text=True, capture_output=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert [int(n) > 0 for n in done.stdout.split()] == [True, True]
