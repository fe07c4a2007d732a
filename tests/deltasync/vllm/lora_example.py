"""examples/grpo_bucket.py rewarding short completions (trainer.task.short_reward) instead of exact sums,
which a tiny random model never writes: with a reward it earns, every step moves the LoRA adapter."""

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
sys.path[:0] = [str(REPO), str(REPO / "examples")]  # TRL's spawned rollout worker inherits the path

import grpo_bucket  # noqa: E402

from trainer.task import short_reward  # noqa: E402

grpo_bucket.exact_sum = short_reward  # main() passes the module's reward to the trainer

if __name__ == "__main__":
    grpo_bucket.main()
