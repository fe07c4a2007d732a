"""examples/grpo_bucket.py with a reward the tiny random model earns (the share of its completion's tokens
with an odd id), instead of exact sums, which it never writes: every step then moves the LoRA adapter."""

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO / "examples"))  # TRL's spawned rollout worker inherits the path

import grpo_bucket  # noqa: E402


def odd_tokens(completion_ids: list[list[int]], **kwargs) -> list[float]:
    return [sum(t % 2 for t in ids) / max(len(ids), 1) for ids in completion_ids]


grpo_bucket.exact_sum = odd_tokens  # main() passes the module's reward to the trainer

if __name__ == "__main__":
    grpo_bucket.main()
