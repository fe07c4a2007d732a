"""Run under `torch.distributed.run --nproc_per_node 2`: one rank raises at one point of ShardedPublisher's
publish(), for every point and either rank, while the training loop carries on (it catches what the
publisher raises and publishes the next steps). Rank 0 prints one line per case:

    OK <point> <rank> stopped|published     or     BAD <point> <rank> <why>

"stopped": every rank was told the cause; "published": no rank was, and every retained step pulls back
bit-exact equal to the model's state at the step it names. After each flush() that raised nothing, the head
names the step just published (the writer's head is written and read back before flush() returns).
"""

from __future__ import annotations

import argparse
import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from unittest import mock

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

from deltasync.storage import LocalStorage
from deltasync.sync import sharded
from deltasync.sync.protocol import read_head
from deltasync.sync.publisher import Publisher, PublisherConfig
from deltasync.sync.subscriber import Subscriber
from tests.helpers import bf16, bitwise_equal, train_step

STEPS, FAULT_STEP = 6, 2
SHAPES = {"a.weight": (64, 32), "b.weight": (9, 16), "c.bias": (7,)}  # c.bias: a plain tensor, from rank 0
CAUSE = "injected fault"


def fail(*args, **kwargs):
    raise OSError(CAUSE)


def part_writes_fail(storage):
    write = storage.write_bytes

    def write_bytes(path, data):
        if path.startswith("deltas/"):
            fail()
        write(path, data)

    return write_bytes


@contextlib.contextmanager
def fault(point: str, publisher: sharded.ShardedPublisher) -> Iterator[dict[str, float]]:
    """Inside the block, `point` raises on this rank; yields the info to publish."""
    patches = {
        "info": None,
        "shard": mock.patch.object(sharded, "local_shard", fail),
        "diff": mock.patch.object(sharded, "window_changes", fail),
        "encode": mock.patch.object(sharded, "encode", fail),
        "store": mock.patch.object(publisher.storage, "write_bytes", part_writes_fail(publisher.storage)),
        "anchor_due": mock.patch.object(Publisher, "anchor_due", fail),
        "publish_stored": mock.patch.object(Publisher, "publish_stored", fail),
        "head": mock.patch.object(Publisher, "_write_head", fail),
    }
    with patches[point] or contextlib.nullcontext():
        yield {"": 1.0} if point == "info" else {"reward_mean": 0.5}
        if point in ("diff", "encode", "store", "anchor_due", "publish_stored", "head"):
            with contextlib.suppress(Exception):  # the fault lives in the background thread: let it run
                publisher._worker.flush()
                if publisher.publisher is not None:
                    publisher.publisher.flush()


def shard(t: torch.Tensor, mesh) -> DTensor:
    """This rank's rows of `t` (torch.chunk's split, as FSDP2 shards)."""
    local = t.chunk(mesh.size())[mesh.get_local_rank()].clone()
    return DTensor.from_local(local, mesh, [Shard(0)], shape=t.shape, stride=t.stride())


def run_case(root: Path, point: str, fault_rank: int, mesh) -> str:
    rank = dist.get_rank()
    full = {
        n: 0.05 * torch.randn(s, generator=torch.Generator().manual_seed(i))
        for i, (n, s) in enumerate(SHAPES.items())
    }
    publisher = sharded.ShardedPublisher(root, "faults", PublisherConfig(threads=1, anchor_every=3))
    states, errors, heads_ok = [], [], True
    for step in range(STEPS):
        if step:
            train_step(full, step, density=0.1)
        states.append(bf16(full))
        params = [(n, t if t.dim() < 2 else shard(t, mesh)) for n, t in full.items()]
        try:
            if step == FAULT_STEP and rank == fault_rank:
                with fault(point, publisher) as info:
                    publisher.publish(params, info=info)
            else:
                publisher.publish(params, info={"reward_mean": 0.5})
            publisher.flush()
            if publisher.publisher is not None:  # flush() returned: the head names the step
                heads_ok &= read_head(LocalStorage(root)).step == publisher.step
        except Exception as e:
            errors.append(str(e))
    try:
        publisher.close()
    except Exception as e:
        errors.append(str(e))
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, errors)
    cause = "empty key" if point == "info" else CAUSE
    told = [any(cause in e for e in errs) for errs in everyone]
    if rank != 0:
        return ""
    if not heads_ok:
        return "BAD flush() returned before the head named the step"
    if all(told):
        return "stopped"
    if any(everyone):
        return f"BAD told {told}: {everyone}"
    head = read_head(LocalStorage(root))
    for step in sorted({e.step for e in head.entries}):
        reader = Subscriber(root)
        reader.sync(step)
        if not bitwise_equal(reader.state, states[step]):
            wrong = [n for n in states[step] if not torch.equal(reader.state[n], states[step][n])]
            return f"BAD step {step} is not the model's state at step {step}: {wrong}"
    return "published"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", type=Path, required=True)
    ap.add_argument("--points", default="none,info,shard,diff,encode,store,anchor_due,publish_stored,head")
    a = ap.parse_args()
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (2,))
    for point in a.points.split(","):
        for fault_rank in (0, 1) if point != "none" else (-1,):  # none: no rank raises
            outcome = run_case(a.root / f"{point}{fault_rank}", point, fault_rank, mesh)
            if dist.get_rank() == 0:
                verdict = "BAD" if outcome.startswith("BAD") else "OK"
                print(f"{verdict} {point} {fault_rank} {outcome.removeprefix('BAD ')}", flush=True)
            dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
