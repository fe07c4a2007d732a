"""The Wordle environment's wire format (OpenEnv models), shared by the Space's server and the trainer.

Field for field the shape of OpenEnv's TextArena environment (`TextArenaAction`, `TextArenaObservation`), so
clients written for either server work with both. The whole game so far is one cumulative message,
`messages[0].content`, as TextArena's Wordle server sends it: each move appends its text at the end.
"""

from __future__ import annotations

from typing import Any

from openenv.core.env_server.types import Action, Observation, State
from pydantic import BaseModel, Field

# Room for a sentence around the guess; longer moves are refused before they reach a game.
MAX_MOVE_CHARS = 4096


class WordleAction(Action):
    message: str = Field(max_length=MAX_MOVE_CHARS, description="The guess in square brackets, e.g. [crane]")


class WordleMessage(BaseModel):
    sender_id: int
    content: str
    category: str


class WordleObservation(Observation):
    prompt: str = Field(description="The game's rules")
    messages: list[WordleMessage] = Field(default_factory=list, description="The transcript, as one message")
    current_player_id: int = 0
    legal_players: list[int] = Field(default_factory=list)
    info: dict[str, Any] = Field(default_factory=dict, description="reward_signals of the last move")


class WordleState(State):
    guesses: list[str] = Field(default_factory=list, description="Valid guesses so far")
    invalid_moves: int = 0
    done: bool = False
