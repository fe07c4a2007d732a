"""Tensor-parallel ranks decode a compact patch against only the parts of each tensor they hold
(`deltasync.vllm.split`): two ranks (gloo, two processes) each hold half of a row-parallel weight (split by
columns) and of a column-parallel one (split by rows), with chunks that straddle their segments; together
they decode exactly what the whole-state decoder does."""

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from deltasync.codec.bf16 import bits
from deltasync.codec.fingerprint import state_fingerprint
from deltasync.codec.patch import encode, make_patch, read_entries, read_info, read_tables
from deltasync.vllm import layout
from deltasync.vllm.layout import BUDGET, Block, Layout
from deltasync.vllm.split import decode_held
from tests.helpers import window_parts

SHAPES = {"o_proj": (64, 96), "gate": (96, 64)}
CHUNK = 1000  # not a multiple of a row: chunks begin and end inside segments


CASES = {  # name: (share of elements moved, window of the patch, budget)
    "compact": (0.05, None, BUDGET),
    "segments cut in chunks": (0.05, None, 37),  # batches of several segments, segments cut every 37
    "window": (0.05, (1000, 5000), 37),
    "dense": (1.0, None, 37),  # every element moved far: new values cost less than steps
}


def states(moved_share: float) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    old = {n: (torch.randn(s, generator=g) * 0.05).to(torch.bfloat16) for n, s in SHAPES.items()}
    new = {}
    for n, t in old.items():
        moved = torch.rand(t.shape, generator=g) < moved_share
        jitter = 0.02 if moved_share < 1 else 10
        new[n] = torch.where(
            moved, (t.float() * (1 + jitter * torch.randn(t.shape, generator=g))).to(t.dtype), t
        )
    return old, new


def patch_of(case: str) -> bytes:
    share, window, _ = CASES[case]
    old, new = states(share)
    if window is None:
        return encode(make_patch(old, new, 1, 0), old, "compact", chunk=CHUNK)
    return window_parts(old, new, [window], chunk=CHUNK)[0]


def halves(old: dict[str, torch.Tensor], rank: int) -> dict[str, list[Block]]:
    """What rank `rank` of two holds: `o_proj` by columns, `gate` by rows, each in a tensor of its own."""
    cols = old["o_proj"][:, 48 * rank : 48 * (rank + 1)].clone()
    rows = old["gate"][48 * rank : 48 * (rank + 1)].clone()
    return {
        "o_proj": [Block(cols, (64, 48), (96, 1), 48 * rank)],
        "gate": [Block(rows, (48, 64), (64, 1), 48 * 64 * rank)],
    }


def rank_main(rank: int, store: str, out: dict) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    for case, (share, _, budget) in CASES.items():
        data = patch_of(case)
        info, entries = read_info(data), read_entries(data)
        tables = read_tables(info)
        for name, blocks in halves(states(share)[0], rank).items():
            n = info.windows.get(name, (0, SHAPES[name][0] * SHAPES[name][1]))[1]
            ch, problem, _ = decode_held(info, entries, name, n, tables, blocks, dist.group.WORLD, budget)
            out[(case, rank, name)] = (ch.indices.clone(), ch.values.clone(), problem)
    dist.destroy_process_group()


def test_two_ranks_decode_their_parts_of_each_chunk(tmp_path):
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(rank_main, (str(tmp_path / "store"), out), nprocs=2)
        out = dict(out)
    for case, (share, window, _) in CASES.items():
        old, new = states(share)
        modes = {t["mode"] for t in read_info(patch_of(case)).tensors.values()}
        assert modes == {"dense" if case == "dense" else "compact"}, case
        for name in SHAPES:
            lo, hi = window or (0, old[name].numel())
            moved = torch.nonzero(bits(old[name]) != bits(new[name]))[:, 0]
            moved = moved[(moved >= lo) & (moved < hi)]
            idx = torch.cat([out[(case, r, name)][0] for r in (0, 1)])
            values = torch.cat([out[(case, r, name)][1] for r in (0, 1)])
            order = torch.argsort(idx)
            assert out[(case, 0, name)][2] is None and out[(case, 1, name)][2] is None
            assert torch.equal(idx[order], moved), (case, name)
            assert torch.equal(bits(values[order]), bits(new[name])[moved]), (case, name)
            # Each rank places only changes that fall on what it holds.
            for rank in (0, 1):
                block = halves(old, rank)[name][0]
                assert set(out[(case, rank, name)][0].tolist()) <= set(block.positions().tolist())


def test_ranks_fingerprints_of_their_parts_sum_to_the_whole(monkeypatch):
    # The read-back's check at TP: each rank fingerprints what it holds, a batch of segments at a time.
    monkeypatch.setattr(layout, "BUDGET", 37)
    old, _ = states(0.05)
    shares = [Layout(SHAPES, halves(old, rank), []).partial_fingerprint() for rank in (0, 1)]
    assert sum(shares) % (1 << 64) == state_fingerprint(old)
