"""The Wordle task as the trainer poses it: the prompt, the tool, the chat-template options and the rewards.

One place, because the tiny model's warm start (trainer/tiny_model.py) must render exactly the token
sequences TRL's rollout worker renders during RL. Reward functions live at module level: TRL's rollout worker
runs in a spawned process and pickles them by reference.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from wordle_env.rules import REVEALED, WON

# The user turn before the environment's opening text (TRL appends `WordleEnv.reset()`'s return to it).
USER_PROMPT = "Let's play Wordle. Make each guess with the `guess` tool."
# Qwen3 without thinking, as in TRL's Wordle examples: a guess is the whole answer.
CHAT_TEMPLATE_KWARGS: dict[str, Any] = {"enable_thinking": False}
SHORT_BUDGET = 80  # tokens: the `short` reward is 0 at and beyond this many completion tokens

_FEEDBACK = re.compile(r"Feedback:\n((?:[A-Z] ){4}[A-Z])\n((?:[GYX] ){4}[GYX])")


def quit_early(messages: list[dict]) -> bool:
    """The rollout ended on a turn without a guess while its game was still on (the game's reply says when it
    is over: won, out of guesses or of invalid moves; a guess after that only gets the tool's error).
    `stamp_rollouts(quit_early=...)` then never reinforces that turn."""
    if not messages or messages[-1].get("role") != "assistant" or messages[-1].get("tool_calls"):
        return False  # the trainer cut the tool loop off mid-game: that is no decision of the policy's
    replies = [str(m.get("content", "")) for m in messages if m.get("role") == "tool"]
    return not any(end in reply for reply in replies for end in (WON, REVEALED))  # once over, over


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
    """Partial credit for what the game's feedback (in the tool messages) has uncovered of the secret word:
    1/5 for each position found green by any guess, 1/10 for each other letter found present (yellow, never
    green). A solved game scores 1.0; a single guess scores its (greens + yellows / 2) / 5.

    Meant beside the environment's own win reward (1.0), which a small model almost never earns. Counting what
    all the guesses found, not the best guess alone, rewards what Wordle guesses are for: each guess should
    test letters the earlier ones did not.
    """
    return [_found(messages) for messages in completions]


def _found(messages: list[dict]) -> float:
    greens: set[int] = set()
    green_letters: set[str] = set()
    yellow_letters: set[str] = set()
    for m in messages:
        if m.get("role") != "tool":
            continue
        for letters, marks in _FEEDBACK.findall(str(m.get("content", ""))):
            for i, (letter, mark) in enumerate(zip(letters.split(), marks.split(), strict=True)):
                if mark == "G":
                    greens.add(i)
                    green_letters.add(letter)
                elif mark == "Y":
                    yellow_letters.add(letter)
    # a letter found yellow and never green sits at one of the positions not found yet: at most 5 in all
    return min(1.0, (len(greens) + 0.5 * len(yellow_letters - green_letters)) / 5)


# --reward choices: the reward functions beside the environment's own `get_reward` column
REWARDS: dict[str, list[Callable[..., list[float]]]] = {
    "wordle": [],
    "wordle-partial": [partial_reward],
    "short": [short_reward],
}
