"""Tensor-parallel ranks decode a compact patch against only the parts of each tensor they hold
(`deltasync.vllm.split`): two ranks (gloo, two processes) each hold half of a row-parallel weight (split by
columns) and of a column-parallel one (split by rows), with chunks that straddle their segments; together
they decode exactly what the whole-state decoder does."""

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from deltasync.codec.patch import decode, encode, make_patch, read_entries, read_info, read_tables
from deltasync.vllm.layout import Block
from deltasync.vllm.split import decode_held

SHAPES = {"o_proj": (64, 96), "gate": (96, 64)}
CHUNK = 1000  # not a multiple of a row: chunks begin and end inside segments


def states() -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    old = {n: (torch.randn(s, generator=g) * 0.05).to(torch.bfloat16) for n, s in SHAPES.items()}
    new = {}
    for n, t in old.items():
        moved = torch.rand(t.shape, generator=g) < 0.05
        new[n] = torch.where(
            moved, (t.float() * (1 + 0.02 * torch.randn(t.shape, generator=g))).to(t.dtype), t
        )
    return old, new


def halves(old: dict[str, torch.Tensor], rank: int) -> dict[str, list[Block]]:
    """What rank `rank` of two holds: `o_proj` by columns, `gate` by rows, each in a tensor of its own."""
    cols = old["o_proj"][:, 48 * rank : 48 * (rank + 1)].clone()
    rows = old["gate"][48 * rank : 48 * (rank + 1)].clone()
    return {
        "o_proj": [Block(cols, (64, 48), (96, 1), 48 * rank)],
        "gate": [Block(rows, (48, 64), (64, 1), 48 * 64 * rank)],
    }


def rank_main(rank: int, store: str, data: bytes, out: dict) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    old, _ = states()
    info, entries = read_info(data), read_entries(data)
    tables = read_tables(info)
    for name, blocks in halves(old, rank).items():
        n = old[name].numel()
        ch, problem, _ = decode_held(info, entries, name, n, tables, blocks, dist.group.WORLD)
        out[(rank, name)] = (ch.indices.clone(), ch.values.clone(), problem)
    dist.destroy_process_group()


def test_two_ranks_decode_their_parts_of_each_chunk(tmp_path):
    old, new = states()
    data = encode(make_patch(old, new, 1, 0), old, "compact", chunk=CHUNK)
    assert {t["mode"] for t in read_info(data).tensors.values()} == {"compact"}
    whole = decode(data, old)
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(rank_main, (str(tmp_path / "store"), data, out), nprocs=2)
        out = dict(out)
    for name in SHAPES:
        idx = torch.cat([out[(r, name)][0] for r in (0, 1)])
        values = torch.cat([out[(r, name)][1] for r in (0, 1)])
        order = torch.argsort(idx)
        assert out[(0, name)][2] is None and out[(1, name)][2] is None
        assert torch.equal(idx[order], whole.changes[name].indices.to(torch.int64))
        assert torch.equal(values[order].view(torch.int16), whole.changes[name].values.view(torch.int16))
        # Each rank places only changes that fall on what it holds.
        for rank in (0, 1):
            block = halves(old, rank)[name][0]
            assert set(out[(rank, name)][0].tolist()) <= set(block.positions().tolist())
