"""The deltasync engine at tensor parallel (two ranks, gloo, two processes, no vLLM server): whatever one rank
raises while checking or writing a step, every rank reaches the same verdict, none waits alone in a
collective, and a failure after the first write is reported as torn weights."""

import json
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from deltasync.codec.bf16 import bits
from deltasync.codec.fingerprint import format_fingerprint, state_fingerprint
from deltasync.codec.patch import encode, make_patch
from deltasync.sync.anchor import write_anchor
from deltasync.vllm.engine import DeltasyncEngine, DeltasyncUpdateInfo
from deltasync.vllm.layout import Layout
from tests.deltasync.vllm.test_split import SHAPES, halves, states

HANG_S = 60  # a rank left waiting in a collective fails after this, rather than hanging the suite


def engine_holding(state: dict[str, torch.Tensor], rank: int) -> DeltasyncEngine:
    """An engine on rank `rank` of two, holding its halves of `state` (as init_transfer_engine would)."""
    config = SimpleNamespace(parallel_config=None, model_config=None)
    engine = DeltasyncEngine(None, config, torch.device("cpu"), torch.nn.Module())  # type: ignore[arg-type]
    engine.group = dist.group.WORLD
    engine.layout = Layout(SHAPES, halves(state, rank), [])
    engine.layout._own(engine.group)
    engine.fingerprint = engine._read_fingerprint()
    return engine


def three_states() -> tuple[dict, dict, dict]:
    """The weights held, an anchor's (step 1) and a delta's after it (step 2)."""
    old, new = states(0.05)
    return old, new, new | {"gate": (new["gate"].float() * 1.01).to(torch.bfloat16)}


def out_of_memory(*_):
    raise RuntimeError("CUDA out of memory")


def failing(anchor, call: int, after: int):
    """`engine._anchor` that fails, out of memory, on its `call`-th read after `after` tensors (the check
    reads the anchor first, the write second)."""
    calls = []

    def read(info):
        calls.append(info)
        for i, item in enumerate(anchor(info)):
            if len(calls) == call and i == after:
                out_of_memory()
            yield item

    return read


def rank_main(rank: int, folder: Path, out: dict) -> None:
    store = f"file://{folder / 'store'}"
    dist.init_process_group(
        "gloo", init_method=store, rank=rank, world_size=2, timeout=timedelta(seconds=HANG_S)
    )
    old, new, newer = three_states()
    engine = engine_holding(old, rank)
    anchor = [str(f) for f, _ in write_anchor(new, 1, state_fingerprint(new), folder)]
    delta = folder / "delta.safetensors"
    delta.write_bytes(encode(make_patch(new, newer, 2, 1), new, "compact"))
    read = engine._anchor
    for case, (step, broken) in CASES.items():
        engine._anchor = read
        vars(engine.layout).pop("plan_patch", None)
        if rank == 0 and broken == "check":
            engine._anchor = failing(read, 1, 0)
        if rank == 0 and broken == "write":  # after its first tensor is written
            engine._anchor = failing(read, 2, 1)
        if rank == 0 and broken == "plan":
            engine.layout.plan_patch = out_of_memory  # type: ignore[method-assign]
        base, to = (old, new) if step == 1 else (new, newer)
        info = DeltasyncUpdateInfo(
            step=step,
            kind="anchor" if step == 1 else "delta",
            paths=anchor if step == 1 else [str(delta)],
            base=format_fingerprint(state_fingerprint(base)),
            fingerprint=format_fingerprint(state_fingerprint(to)),
            report=str(folder / f"report-{case}.json"),
        )
        try:
            engine.receive_weights(info)
            raised = None
        except Exception as e:
            raised = f"{type(e).__name__}: {e}"
        held = {n: bits(blocks[0].read()).clone() for n, blocks in engine.layout.blocks.items()}
        out[(case, rank)] = (raised, engine.fingerprint, held)
    dist.destroy_process_group()


CASES = {  # name: (step 1 is an anchor, step 2 a delta; where rank 0 fails)
    "anchor check fails": (1, "check"),
    "anchor write fails": (1, "write"),
    "anchor": (1, None),
    "delta plan fails": (2, "plan"),
    "delta": (2, None),
}


def test_every_rank_reaches_the_verdict_of_a_rank_that_failed(tmp_path):
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(rank_main, (tmp_path, out), nprocs=2)
        out = dict(out)
    old, new, newer = three_states()
    held = {  # what each case leaves on both ranks: its weights, and their fingerprint (None: torn)
        "anchor check fails": old,
        "anchor write fails": None,
        "anchor": new,
        "delta plan fails": new,
        "delta": newer,
    }
    for case, (_, broken) in CASES.items():
        (raised_0, fp_0, weights_0), (raised_1, fp_1, weights_1) = out[(case, 0)], out[(case, 1)]
        report = tmp_path / f"report-{case}.json"
        # The last rank reports every failure (deltasync.vllm.compat), rank 0 logged its own bug.
        assert raised_0 is None, case
        if broken is None:
            assert raised_1 is None and not report.exists(), case
        else:
            assert (
                raised_1.startswith("RankFailed: ")
                and "RuntimeError on rank 0: CUDA out of memory" in raised_1
            )
        if held[case] is None:  # part of the anchor written: the follower must keep generation paused
            assert fp_0 is None and fp_1 is None
            assert json.loads(report.read_text()) == {"torn": raised_1.removeprefix("RankFailed: ")}
            continue
        assert broken is None or not report.exists(), case
        assert fp_0 == fp_1 == state_fingerprint(held[case]), case
        for rank, weights in ((0, weights_0), (1, weights_1)):
            for name, blocks in halves(held[case], rank).items():
                assert torch.equal(bits(blocks[0].read()), weights[name]), (case, rank, name)
