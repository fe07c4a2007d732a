"""The Wordle task as the trainer poses it: the prompt, the tool, the chat-template options and the rewards.

One place, because the tiny model's warm start (trainer/tiny_model.py) must render exactly the token
sequences TRL's rollout worker renders during RL. Reward functions live at module level: TRL's rollout worker
runs in a spawned process and pickles them by reference.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

# The user turn before the environment's opening text (TRL appends `WordleEnv.reset()`'s return to it).
USER_PROMPT = "Let's play Wordle. Make each guess with the `guess` tool."
# Qwen3 without thinking, as in TRL's Wordle examples: a guess is the whole answer.
CHAT_TEMPLATE_KWARGS: dict[str, Any] = {"enable_thinking": False}
SHORT_BUDGET = 80  # tokens: the `short` reward is 0 at and beyond this many completion tokens

_FEEDBACK = re.compile(r"Feedback:\n(?:[A-Z] ){4}[A-Z]\n((?:[GYX] ){4}[GYX])")


def dataset_rows(n: int, seed: int = 0) -> dict[str, list]:
    """`n` identical prompts, each with the seed of its game (the env's reset takes the row's `seed`).

    A group's rollouts share their row, so they play the same secret word: GRPO's advantages then compare
    guesses, not how hard each rollout's word happened to be. The seeds make a run's games reproducible."""
    return {
        "prompt": [[{"role": "user", "content": USER_PROMPT}] for _ in range(n)],
        "seed": [seed * n + i for i in range(n)],
    }


def short_reward(completion_ids: list[list[int]], **kwargs: Any) -> list[float]:
    """Sanity reward: shorter completions score higher (1 for none, 0 at SHORT_BUDGET tokens or more).

    A policy learns it quickly and visibly, so it proves the loop closes: rollouts sampled by the inference
    server improve only if the trainer's updates really reach the server's weights. The warm-started tiny
    model prefaces half its guesses with a sentence: dropping it is one early decision per turn.
    """
    return [1.0 - min(len(ids), SHORT_BUDGET) / SHORT_BUDGET for ids in completion_ids]


def partial_reward(completions: list[list[dict]], **kwargs: Any) -> list[float]:
    """Partial credit from the game's feedback in the tool messages: the best (greens + yellows / 2) / 5.

    Meant beside the environment's own win reward (1.0), which a small model almost never earns.
    """
    scores = []
    for messages in completions:
        best = 0.0
        for m in messages:
            if m.get("role") == "tool":
                for marks in _FEEDBACK.findall(str(m.get("content", ""))):
                    best = max(best, (marks.count("G") + 0.5 * marks.count("Y")) / 5)
        scores.append(best)
    return scores


# --reward choices: the reward functions beside the environment's own `get_reward` column
REWARDS: dict[str, list[Callable[..., list[float]]]] = {
    "wordle": [],
    "wordle-partial": [partial_reward],
    "short": [short_reward],
}
