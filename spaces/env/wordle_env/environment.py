"""Wordle as an OpenEnv `Environment`: one instance per WebSocket session, one game per reset."""

from __future__ import annotations

from typing import Any
from uuid import uuid4

from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import EnvironmentMetadata

from wordle_env.models import WordleAction, WordleMessage, WordleObservation, WordleState
from wordle_env.rules import PROMPT, Game, NoGameInProgress, Turn


class WordleEnvironment(Environment[WordleAction, WordleObservation, WordleState]):
    """Wordle with TextArena's messages. Reward 1.0 for the winning guess, else 0.0; shaped signals in
    `metadata["reward_signals"]` (and `info`, like TextArena). The secret word is in no observation or state
    until the game ends."""

    SUPPORTS_CONCURRENT_SESSIONS = True  # every session has its own instance, and instances share nothing

    def __init__(self) -> None:
        super().__init__()
        self._game: Game | None = None
        self._episode_id: str | None = None
        self._steps = 0
        self._transcript = ""

    def reset(
        self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any
    ) -> WordleObservation:
        # WebSocket resets reach here unvalidated (HTTP ones went through OpenEnv's ResetRequest): check
        # before changing anything, so that a refused reset leaves the session's game and state as they were.
        if seed is not None and (type(seed) is not int or seed < 0):
            raise ValueError(f"seed must be a non-negative integer, got {seed!r:.80}")
        if episode_id is not None and not isinstance(episode_id, str):
            raise ValueError(f"episode_id must be a string, got {episode_id!r:.80}")
        self._game = Game.seeded(seed) if seed is not None else Game()
        self._episode_id = episode_id or str(uuid4())
        self._steps = 0
        # TextArena's transcript: "\n[SENDER] text" per message, the whole game in one string.
        self._transcript = f"\n[GAME] {PROMPT}"
        return self._observation()

    def step(self, action: WordleAction, timeout_s: float | None = None, **kwargs: Any) -> WordleObservation:
        if self._game is None:
            raise NoGameInProgress("No game in progress: reset first.")
        turn = self._game.play(action.message)
        self._steps += 1
        self._transcript += f"\n[Player 0] {action.message}\n[GAME] {turn.message}"
        return self._observation(turn)

    # A move takes microseconds: play it on the server's event loop rather than hop to the session's thread.
    async def reset_async(
        self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any
    ) -> WordleObservation:
        return self.reset(seed, episode_id, **kwargs)

    async def step_async(
        self, action: WordleAction, timeout_s: float | None = None, **kwargs: Any
    ) -> WordleObservation:
        return self.step(action, timeout_s, **kwargs)

    @property
    def state(self) -> WordleState:
        if self._game is None:
            return WordleState()
        return WordleState(
            episode_id=self._episode_id,
            step_count=self._steps,
            guesses=list(self._game.guesses),
            invalid_moves=self._game.invalid_moves,
            done=self._game.done,
        )

    def get_metadata(self) -> EnvironmentMetadata:
        return EnvironmentMetadata(
            name="wordle",
            description="Wordle (5 letters, 6 guesses) with TextArena's messages; reward 1.0 for a win",
            version="1.0.0",
        )

    def _observation(self, turn: Turn | None = None) -> WordleObservation:
        signals = {"reward_signals": turn.signals} if turn else {}
        return WordleObservation(
            prompt=PROMPT,
            messages=[WordleMessage(sender_id=-1, content=self._transcript, category="MESSAGE")],
            legal_players=[0],
            info=signals,
            metadata=signals,
            reward=turn.reward if turn else 0.0,
            done=turn.done if turn else False,
        )
