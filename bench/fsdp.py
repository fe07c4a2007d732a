"""Sharded publishing under FSDP2 on the CPU (gloo): what a step costs each rank, beside a full gather.

    python -m torch.distributed.run --nproc_per_node 2 -m bench.fsdp [--steps 6] [--layers 8] [--width 1024]

A stack of linear layers, each `fully_shard`ed (parameters are DTensors, each rank holds half the rows),
trains with AdamW on random data. After every optimizer step all ranks publish through ShardedPublisher
(each copies its shards; its background thread diffs and encodes them and uploads its part; rank 0 writes
the head), and, in the same run, gather the full weights the way TRL's weight sync does (`full_tensor()` per
parameter). Per step and rank: bytes sent to other ranks and time blocked, for both, and the time the
publisher's background thread took (waited for here before the gather, so the two do not share the cores).
The first step (the run's anchor) and steps at which an anchor was due (marked "a": they gather the full
weights by design) are left out of the medians.

--check FILE: rank 0 also writes the final full bf16 state to FILE (safetensors) for a test to compare.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

from deltasync.sync.publisher import PublisherConfig
from deltasync.sync.sharded import ShardedPublisher


def build(layers: int, width: int) -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    return model


def full_gather(model: torch.nn.Module) -> tuple[float, int]:
    """Every parameter gathered whole on every rank, as a weight sync without sharding does; returns the
    time and the bytes this rank sent."""
    start, sent = time.perf_counter(), 0
    world = dist.get_world_size()
    for _, p in model.named_parameters():
        p.full_tensor()
        sent += p.to_local().numel() * p.element_size() * (world - 1)  # its shard, to every other rank
    return time.perf_counter() - start, sent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--root", help="sync root (default: a temporary folder)")
    ap.add_argument("--check", help="rank 0 writes the final full bf16 state here (safetensors)")
    a = ap.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    model = build(a.layers, a.width)
    optimizer = torch.optim.AdamW(model.parameters(), lr=a.lr)
    with tempfile.TemporaryDirectory() as tmp:
        root = a.root or tmp
        publisher = ShardedPublisher(root, model="bench-fsdp", config=PublisherConfig(threads=1))
        rows = []
        g = torch.Generator().manual_seed(rank)
        for step in range(a.steps + 1):
            if step:
                x = torch.randn(16, a.width, generator=g)
                loss = model(x).square().mean()
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
            dist.barrier()
            publisher.publish(model.named_parameters())
            blocked = publisher.blocked_s
            publisher.flush()
            record = publisher.records[-1]
            dist.barrier()
            rows.append(
                (step, blocked, record.sent_bytes, record.gathered, record.seconds, *full_gather(model))
            )
        if a.check:
            state = {n: p.full_tensor().to(torch.bfloat16) for n, p in model.named_parameters()}
        publisher.close()
        if a.check and rank == 0:
            from safetensors.torch import save_file

            save_file(state, a.check, metadata={"fingerprint": f"{publisher.fingerprint:016x}"})
    numel = sum(p.numel() for p in model.parameters())
    report = [f"rank {rank} of {world}: {numel / 1e6:.1f}M parameters, fp32 shards, {a.steps} steps"]
    report.append(" step  sharded: sent B  blocked s  background s   full gather: sent B  blocked s")
    for step, s_time, s_bytes, gathered, b_time, f_time, f_bytes in rows:
        mark = "a" if gathered else " "
        report.append(
            f"{step:4d}{mark}  {s_bytes:15,d}  {s_time:9.3f}  {b_time:12.3f}   {f_bytes:19,d}  {f_time:9.3f}"
        )
    later = [r for r in rows if not r[3]]
    if later:
        medians = [statistics.median(r[i] for r in later) for i in (1, 2, 4, 5, 6)]
        blocked, sent, background, gather_s, gather_b = medians
        report.append(
            f"median of {len(later)} delta steps: sharded {sent:,.0f} B, blocked {blocked:.3f} s (background "
            f"{background:.3f} s); full gather {gather_b:,.0f} B in {gather_s:.3f} s; "
            f"bytes x{gather_b / max(sent, 1):.0f}, blocked x{gather_s / max(blocked, 1e-9):.1f} less"
        )
    for r in range(world):  # one rank's table at a time
        if r == rank:
            print("\n".join(report), flush=True)
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
