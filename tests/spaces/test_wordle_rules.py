"""Wordle rules: two-pass scoring, guess checks, the game's messages, rewards and word lists."""

import random
import re
from collections import Counter

import pytest
from hypothesis import given
from hypothesis import strategies as st

from wordle_env.rules import (
    ALLOWED,
    ANSWERS,
    INVALID_MOVE_ALLOWANCE,
    MAX_GUESSES,
    Game,
    NoGameInProgress,
    answer_for_seed,
    extract_word,
    invalid_reason,
    score,
)

# A small alphabet makes repeated letters, the hard case, common.
words = st.text(alphabet="abey", min_size=5, max_size=5)


@pytest.mark.parametrize(
    ("answer", "guess", "marks"),
    [
        ("abbey", "babes", "YYGGX"),  # two b's guessed, two in the answer: one green, one yellow
        ("crane", "eerie", "XXYXG"),  # three e's guessed, one in the answer: green, and the others absent
        ("abbey", "kebab", "XYGYY"),
        ("eerie", "crane", "XYXXG"),
        ("crane", "crane", "GGGGG"),
    ],
)
def test_score_known_cases(answer, guess, marks):
    assert score(guess, answer) == marks


@given(words, words)
def test_score_marks_each_letter_as_often_as_the_answer_holds_it(guess, answer):
    marks = score(guess, answer)
    assert [m == "G" for m in marks] == [g == a for g, a in zip(guess, answer, strict=True)]
    for letter in set(guess):
        marked = [i for i, g in enumerate(guess) if g == letter and marks[i] != "X"]
        assert len(marked) == min(guess.count(letter), answer.count(letter))
        # Yellows go left to right: no absent copy of a letter comes before a yellow one.
        flags = [marks[i] for i, g in enumerate(guess) if g == letter and marks[i] != "G"]
        assert flags == sorted(flags, key=lambda m: m == "X")


@given(words)
def test_a_word_scored_against_itself_is_all_green(word):
    assert score(word, word) == "GGGGG"


@pytest.mark.parametrize(
    ("move", "word"),
    [
        ("[crane]", "crane"),
        ("I'd say [ CRANE ] or [slate]", "crane"),
        ("crane", None),
        ("[]", ""),
        ("[cr]ane]", "cr"),
    ],
)
def test_extract_word_takes_the_first_bracketed_word(move, word):
    assert extract_word(move) == word


@pytest.mark.parametrize(
    ("word", "reason"),
    [
        (None, "square brackets"),
        ("cranes", "exactly 5 letters"),
        ("", "exactly 5 letters"),
        ("crâne", "letters a to z"),
        ("cr4ne", "letters a to z"),
        ("slate", "already guessed 'slate'"),
        ("xyzzy", "'xyzzy' is not in the word list"),
    ],
)
def test_invalid_reason_explains_the_rule_broken(word, reason):
    assert reason in invalid_reason(word, ["slate"])


def test_valid_guesses_have_no_reason():
    assert invalid_reason("crane", ["slate"]) is None
    assert all(invalid_reason(w, []) is None for w in random.Random(0).sample(sorted(ALLOWED), 200))


def test_word_lists_are_five_lowercase_letters_and_every_answer_is_allowed():
    assert len(ANSWERS) > 2000 and len(ALLOWED) > 10000
    assert list(ANSWERS) == sorted(set(ANSWERS))
    assert all(re.fullmatch("[a-z]{5}", w) for w in ALLOWED)
    assert set(ANSWERS) <= ALLOWED
    assert {"xviii", "dogs", "boxes"}.isdisjoint(ANSWERS) and "crane" in ANSWERS


def test_seeds_pick_answers_with_the_documented_rng():
    assert [answer_for_seed(s) for s in range(3)] == [
        ANSWERS[random.Random(s).randrange(len(ANSWERS))] for s in range(3)
    ]
    assert len({answer_for_seed(s) for s in range(200)}) > 150


def test_a_win_ends_the_game_with_reward_one_and_full_signals():
    game = Game(answer="abbey")
    turn = game.play("[babes]")
    assert turn.message == "You submitted [babes].\nFeedback:\nB A B E S\nY Y G G X\nYou have 5 guesses left."
    assert (turn.reward, turn.done) == (0.0, False)
    assert turn.signals == {
        "wordle.greens": 0.4,
        "wordle.yellows": 0.4,
        "wordle.repetitions": 1.0,
        "wordle.correct": 0.0,
    }
    turn = game.play("it is [abbey]")
    assert turn.message.endswith("G G G G G\nCongratulations! You guessed the word correctly!")
    assert (turn.reward, turn.done, game.won) == (1.0, True, True)
    assert turn.signals["wordle.greens"] == 1.0 and turn.signals["wordle.correct"] == 1.0
    with pytest.raises(NoGameInProgress):
        game.play("[crane]")


def test_six_misses_lose_and_only_then_reveal_the_answer():
    game = Game(answer="abbey")
    for i, word in enumerate(["crane", "slate", "doubt", "fight", "mount", "pride"]):
        turn = game.play(f"[{word}]")
        assert turn.reward == 0.0
        assert ("abbey" in turn.message) == turn.done == (i == MAX_GUESSES - 1)
    assert turn.message.endswith(
        "You have 0 guesses left.\nThe turn limit has been reached. The secret word was: **abbey**."
    )
    assert not game.won


@pytest.mark.parametrize("invalid", ["crane", "[cranes]", "[xyzzy]", "[crâne]"])
def test_invalid_moves_use_no_guess_until_the_allowance_runs_out(invalid):
    game = Game(answer="abbey")
    for _ in range(INVALID_MOVE_ALLOWANCE):
        turn = game.play(invalid)
        assert turn.message.startswith("You attempted an invalid move. Reason: ")
        assert "Please resubmit a valid move" in turn.message
        assert (turn.marks, turn.reward, turn.done) == ("", 0.0, False)
    assert game.play("[crane]").message.endswith("You have 5 guesses left.")
    turn = game.play(invalid)
    assert (turn.reward, turn.done) == (0.0, True)
    assert turn.message.endswith("Too many invalid moves: the game is over. The secret word was: **abbey**.")


def test_a_repeated_guess_is_invalid_and_scores_zero_repetition():
    game = Game(answer="abbey")
    game.play("[crane]")
    turn = game.play("[crane]")
    assert "already guessed 'crane'" in turn.message
    assert turn.signals == {
        "wordle.greens": 0.0,
        "wordle.yellows": 0.0,
        "wordle.repetitions": 0.0,
        "wordle.correct": 0.0,
    }
    assert game.guesses == ["crane"]


def test_unseeded_games_draw_answers_at_random():
    assert len({Game().answer for _ in range(50)}) > 30
    assert Counter(Game.seeded(7).answer for _ in range(5)) == Counter({answer_for_seed(7): 5})
