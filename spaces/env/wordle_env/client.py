"""Trainer side of the Wordle environment: OpenEnv's WebSocket client, and a TRL `environment_factory` class.

    from functools import partial
    trainer = AsyncGRPOTrainer(..., environment_factory=partial(WordleEnv, base_url="https://<user>-wordle.hf.space"))

Both speak TextArena's wire format, so they work with this repo's Space and with OpenEnv's own Wordle servers.
"""

from __future__ import annotations

import os
from typing import Any

from openenv.core.client_types import StepResult
from openenv.core.env_client import EnvClient

from wordle_env.models import WordleAction, WordleObservation, WordleState

DEFAULT_URL = "http://localhost:7860"  # `python spaces/env/app.py`


class WordleEnvClient(EnvClient[WordleAction, WordleObservation, WordleState]):
    """OpenEnv's `EnvClient` (one WebSocket session per client) typed with the Wordle models."""

    def _step_payload(self, action: WordleAction) -> dict[str, Any]:
        return {"message": action.message}

    def _parse_result(self, payload: dict[str, Any]) -> StepResult[WordleObservation]:
        observation = WordleObservation.model_validate(
            {
                **payload.get("observation", {}),
                "reward": payload.get("reward"),
                "done": payload.get("done", False),
            }
        )
        return StepResult(observation=observation, reward=observation.reward, done=observation.done)

    def _parse_state(self, payload: dict[str, Any]) -> WordleState:
        return WordleState.model_validate(payload)


class WordleEnv:
    """One Wordle game per rollout, for TRL's `environment_factory` (GRPOTrainer and AsyncGRPOTrainer).

    The model plays with the `guess` tool. The reward (1.0 for a win, else 0.0) is kept in `self.reward` and
    returned by `get_reward`, through which TRL scores the rollout: add no reward function that reads
    `env.reward` too, or the win counts twice. A dataset row with a `seed` column replays that game.
    Only `reset`, `guess` and `get_reward` are public, because TRL offers every other public method as a tool.
    """

    def __init__(self, base_url: str | None = None):
        url = base_url or os.environ.get("WORDLE_ENV_URL", DEFAULT_URL)
        self._client = WordleEnvClient(base_url=url).sync()  # connects on first use
        self._transcript = ""
        self.reward = 0.0
        self.done = False

    def reset(self, seed: int | None = None, **kwargs: Any) -> str:
        """Start a new game and return its opening text (TRL appends it to the prompt)."""
        result = self._client.reset(seed=seed)
        self._transcript = result.observation.messages[0].content
        self.reward, self.done = 0.0, False
        return self._transcript

    def guess(self, guess: str) -> str:
        """
        Make a guess in the Wordle game.

        Args:
            guess: The guessed word, formatted as '[abcde]'.

        Returns:
            The game's feedback on the guess.
        """
        if self.done:
            raise ValueError("The game is over.")
        result = self._client.step(WordleAction(message=guess))
        # The transcript is cumulative: the new text is what this move appended.
        transcript = result.observation.messages[0].content
        feedback = transcript[len(self._transcript) :]
        self._transcript = transcript
        # TextArena's servers repeat the previous reward after an invalid move: an invalid move earns nothing.
        self.reward = 0.0 if "You attempted an invalid move" in feedback else float(result.reward or 0.0)
        self.done = result.done
        return feedback

    def get_reward(self) -> float:
        return self.reward
