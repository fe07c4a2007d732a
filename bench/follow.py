"""`deltasync follow`'s memory: the follower process beside vLLM's own server (CPU) on the tiny model.

    python -m bench.follow [--steps 3]

The follower's RSS once it polls the (still empty) root, and its peak (VmHWM) after it has applied `--steps`
steps (an anchor, then deltas) and read them back, as in tests/deltasync/vllm/test_follow.py. The follower and
the server run the deltasync on PYTHONPATH (the tests' CODE_UNDER_TEST): another tree is measured with its
`shared/` there, e.g. `PYTHONPATH=/tmp/old/shared python -m bench.follow`.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from tests.deltasync.vllm.test_follow import CPUS, REPLICA, memory_kb, stock_server
from tests.helpers import CODE_UNDER_TEST, ServedRun, wait_for
from trainer.processes import start_process, stop_process
from trainer.tiny_model import build_tiny_model


def measure(tmp: Path, steps: int) -> tuple[int, int]:
    """The follower's RSS while polling and its peak after `steps` steps, in kB."""
    run = ServedRun(tmp, build_tiny_model(tmp / "tiny-qwen3"), anchor_every=4)
    with stock_server(run.model_dir, tmp / "server", "--max-model-len", "512") as server:
        log = tmp / "follower.log"
        argv = [sys.executable, "-m", "deltasync.cli", "follow", str(run.served), "--vllm-url", server.url]
        argv += ["--replica", REPLICA, "--poll-s", "0.2"]
        proc = start_process(argv, log, CODE_UNDER_TEST, cpus=CPUS.others)
        try:
            wait_for(lambda: "no run in" in log.read_text(), "the follower to poll")
            polling = memory_kb(proc.pid, "VmRSS")
            for _ in range(steps):
                step = run.step()
            server.wait_applied(run, REPLICA, step)
            return polling, memory_kb(proc.pid, "VmHWM")
        finally:
            stop_process(proc, grace_s=30)
            run.publisher.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        polling, peak = measure(Path(tmp), args.steps)
    code = CODE_UNDER_TEST.get("PYTHONPATH", "this checkout")
    print(f"deltasync follow ({code}): RSS {polling / 1024:.0f} MB polling, peak {peak / 1024:.0f} MB")


if __name__ == "__main__":
    main()
