"""The trainer's Wordle rewards, scored on real game feedback."""

import pytest

from trainer.task import partial_reward, quit_early
from wordle_env.rules import Game


def played(answer: str, *words: str) -> list[dict]:
    """A rollout's messages as TRL holds them: each guess's tool reply is the game's new text."""
    game, messages = Game(answer=answer), []
    for word in words:
        reply = game.play(f"[{word}]").message
        messages += [
            {"role": "assistant", "content": ""},
            {"role": "tool", "name": "guess", "content": f"\n[Player 0] [{word}]\n[GAME] {reply}"},
        ]
    return messages


def test_partial_reward_counts_what_all_the_guesses_found():
    rewards = partial_reward(
        [
            played("slate", "crane"),  # a, e green: 2/5
            played("slate", "crane", "lusty"),  # + t green, l and s yellow: (3 + 2 / 2) / 5
            played("slate", "crane", "lusty", "slate"),  # solved
            played("slate", "lusty", "least"),  # a, t green; l, e, s yellow (t too, but found green)
            played("slate", "qwxyz", "crane"),  # an invalid move finds nothing
            [],
        ]
    )
    assert rewards == pytest.approx([0.4, 0.8, 1.0, 0.7, 0.4, 0.0])


def test_quit_early_is_a_last_turn_without_a_guess_in_a_game_still_on():
    answer = {"role": "assistant", "content": "I give up."}  # no tool call
    guesses = ["crane", "slate", "mound", "pilot", "brick", "fuzzy"]
    assert "plant" not in guesses
    assert quit_early([answer])  # no guess at all
    assert quit_early([*played("plant", "crane"), answer])
    assert quit_early([*played("plant", *guesses[:5]), answer])
    assert not quit_early([*played("plant", "crane", "plant"), answer])  # won
    assert not quit_early([*played("plant", *guesses), answer])  # out of guesses
    late = [{"role": "assistant", "content": ""}, {"role": "tool", "content": "Error: The game is over."}]
    assert not quit_early([*played("plant", "crane", "plant"), *late, answer])  # a guess after the end
    called = {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "guess"}}]}
    assert not quit_early([*played("plant", "crane"), called])  # the trainer's tool-call limit cut it off
