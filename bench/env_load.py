"""Load test of the Wordle environment Space: many WebSocket sessions at once play full games, on loopback.

    python -m bench.env_load [--sessions 256] [--games 8] [--timeout 180]

Starts `spaces/env/app.py` on a free 127.0.0.1 port, opens every session first (all are held open together),
then each plays `--games` seeded games through OpenEnv's client: random valid guesses, half the games won on
a random turn, a quarter opening with a forgiven invalid move. Every result is checked against the rules
computed locally (reward, end of game); a mismatch or an exception counts as an error. Prints one table row:
errors (must be 0) and the step latency seen by the clients. Client and server share this machine's cores.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

from trainer.processes import serving
from wordle_env.client import WordleEnvClient
from wordle_env.models import WordleAction
from wordle_env.rules import ALLOWED, MAX_GUESSES, answer_for_seed

APP = Path(__file__).resolve().parents[1] / "spaces" / "env" / "app.py"
WORDS = sorted(ALLOWED)


def moves_for(seed: int) -> list[str]:
    """The moves of one game and, implicitly, its outcome: it is won iff the answer is among them."""
    rng = random.Random(seed)
    answer = answer_for_seed(seed)
    guesses = [w for w in rng.sample(WORDS, MAX_GUESSES + 1) if w != answer][:MAX_GUESSES]
    if rng.random() < 0.5:
        guesses = guesses[: rng.randrange(MAX_GUESSES)] + [answer]
    moves = [f"[{w}]" for w in guesses]
    return ["no brackets here"] + moves if rng.random() < 0.25 else moves


async def session(
    url: str, index: int, args, ready: asyncio.Barrier, latencies: list[float]
) -> tuple[int, int]:
    """Hold one session and play its games; returns (errors, wins)."""
    errors = wins = 0
    client = WordleEnvClient(base_url=url, message_timeout_s=args.timeout)
    try:
        await client.connect()
        await ready.wait()
        for game in range(args.games):
            seed = index * args.games + game
            await client.reset(seed=seed)
            moves = moves_for(seed)
            for i, move in enumerate(moves):
                start = time.perf_counter()
                result = await client.step(WordleAction(message=move))
                latencies.append(time.perf_counter() - start)
                won = move == f"[{answer_for_seed(seed)}]"
                errors += result.reward != float(won) or result.done != (i == len(moves) - 1)
                wins += won
    except Exception as e:  # counted, and the first few shown, but the run goes on
        errors += 1
        if errors <= 3:
            print(f"session {index}: {type(e).__name__}: {e}", file=sys.stderr)
    finally:
        await client.close()
    return errors, wins


async def load(url: str, args) -> None:
    latencies: list[float] = []
    ready = asyncio.Barrier(args.sessions)
    start = time.perf_counter()
    results = await asyncio.wait_for(
        asyncio.gather(*(session(url, i, args, ready, latencies) for i in range(args.sessions))), args.timeout
    )
    wall = time.perf_counter() - start
    errors, wins = (sum(column) for column in zip(*results, strict=True))
    q = statistics.quantiles(latencies, n=100)
    row = {
        "sessions": args.sessions,
        "games": args.sessions * args.games,
        "steps": len(latencies),
        "errors": errors,
        "wins": wins,
        "step p50 ms": f"{q[49] * 1e3:.1f}",
        "step p99 ms": f"{q[98] * 1e3:.1f}",
        "step max ms": f"{max(latencies) * 1e3:.1f}",
        "steps/s": f"{len(latencies) / wall:.0f}",
        "wall s": f"{wall:.1f}",
    }
    print("| " + " | ".join(row) + " |")
    print("|" + "---|" * len(row))
    print("| " + " | ".join(str(v) for v in row.values()) + " |")
    if errors:
        sys.exit(1)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sessions", type=int, default=256)
    parser.add_argument("--games", type=int, default=8, help="full games per session")
    parser.add_argument("--timeout", type=float, default=180, help="seconds for the whole run")
    args = parser.parse_args()

    env = {"MAX_CONCURRENT_ENVS": str(args.sessions)}
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "env.log"
        with serving([sys.executable, str(APP)], log, env, timeout=60, grace_s=0) as url:
            asyncio.run(load(url, args))


if __name__ == "__main__":
    main()
