"""The run's first steps against later ones: each step's time from publish() to its head, on a local root.

    python -m bench.first_step [--layers 2]      # Qwen3-0.6B shapes, N layers (bench.sync's trajectory)
    python -m bench.first_step --tiny            # ~1.1M elements, like the tests' tiny Qwen3

Each step is published and flushed before the next, so its time is its own: step 0 goes out as an anchor,
step 1 is the run's first delta, steps 2-5 are the steady state. The publisher's start-up work (loading the
codec's compiled loops) runs on its worker from construction, beside training; here nothing trains between
construction and step 0, so step 0's time includes it. Also per step: the caller's blocked time.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from bench.sync import trajectory
from deltasync.sync.publisher import Publisher

STEPS = 5


def tiny_states() -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    base = {f"w{i}": torch.randn(256, 1024, generator=g) * 0.02 for i in range(4)}
    base["norm"] = torch.ones(1024)
    return [
        {n: w + step * 2.5e-4 * torch.randn(w.shape, generator=g).sign() for n, w in base.items()}
        for step in range(STEPS + 1)
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--tiny", action="store_true")
    args = parser.parse_args()
    if args.tiny:
        states = tiny_states()
    else:
        states = [{n: w.clone() for n, w in m.items()} for m in trajectory(args.layers, STEPS, 2.5e-7)]
    with tempfile.TemporaryDirectory() as root:
        publisher = Publisher(Path(root), model="first-step")
        for step, state in enumerate(states):
            start = time.perf_counter()
            publisher.publish(state, step=step)
            blocked = time.perf_counter() - start
            publisher.flush()
            took = time.perf_counter() - start
            print(f"step {step}: publish() to head {took:.3f} s, blocked {blocked:.3f} s")
        publisher.close()


if __name__ == "__main__":
    main()
