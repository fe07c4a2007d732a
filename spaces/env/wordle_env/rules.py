"""Wordle rules: scoring, guess checks, the game's messages and rewards, and the shipped word lists.

Plain Python, shared by the environment Space, its play page and the trainer's tests. The messages follow
TextArena's Wordle (`Feedback:\\nC R A N E\\nG Y X X G`, "You attempted an invalid move. Reason: ..."), so
clients written for OpenEnv's TextArena Wordle parse ours unchanged.
"""

from __future__ import annotations

import random
import re
import secrets
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

WORD_LENGTH = 5
MAX_GUESSES = 6
# Invalid moves forgiven per game (TextArena's error_allowance): they use no guess; one more ends the game.
INVALID_MOVE_ALLOWANCE = 1


def load_words(name: str) -> tuple[str, ...]:
    """A word list shipped in wordle_env/words/ (see its README for the source and the build)."""
    return tuple((Path(__file__).parent / "words" / f"{name}.txt").read_text().split())


ANSWERS = load_words("answers")
ALLOWED = frozenset(load_words("allowed"))

PROMPT = (
    "You are Playing Wordle.\n"
    f"A secret {WORD_LENGTH}-letter word has been chosen. You have {MAX_GUESSES} attempts to guess it.\n"
    "For each guess, wrap your word in square brackets (e.g., '[apple]').\n"
    "Feedback for each letter will be given as follows:\n"
    "  - G (green): correct letter in the correct position\n"
    "  - Y (yellow): letter exists in the word but in the wrong position\n"
    "  - X (wrong): letter is not in the word\n"
    f"An invalid guess (no brackets, not {WORD_LENGTH} letters, not in the word list, or repeated) uses no "
    f"attempt, but only {INVALID_MOVE_ALLOWANCE} is forgiven: the next one ends the game.\n"
    "Enter your guess to begin.\n"
)

_BRACKETED = re.compile(r"\[([^\[\]]*)\]")


def answer_for_seed(seed: int) -> str:
    """The secret word of a seeded game: `ANSWERS[random.Random(seed).randrange(len(ANSWERS))]`.

    Python's Mersenne Twister gives the same draw for an integer seed on every platform and Python 3 version.
    """
    return ANSWERS[random.Random(seed).randrange(len(ANSWERS))]


def score(guess: str, answer: str) -> str:
    """One mark per letter: G right place, Y elsewhere in the answer, X absent.

    Two passes, as in Wordle: greens first; then, left to right, a letter is yellow only while the answer
    still has an unmatched copy of it (guess `babes` against `abbey` gives `YYGGX`).
    """
    unmatched = Counter(a for g, a in zip(guess, answer, strict=True) if g != a)
    marks = []
    for g, a in zip(guess, answer, strict=True):
        if g == a:
            marks.append("G")
        elif unmatched[g]:
            unmatched[g] -= 1
            marks.append("Y")
        else:
            marks.append("X")
    return "".join(marks)


def extract_word(text: str) -> str | None:
    """The first `[...]` of a move, lowercased and stripped; None without brackets."""
    match = _BRACKETED.search(text)
    return match.group(1).strip().lower() if match else None


def invalid_reason(word: str | None, previous: list[str]) -> str | None:
    """Why a word from `extract_word` is not a valid guess after the `previous` ones; None if it is."""
    if word is None:
        return "You tried submitting a word in the wrong format. Please wrap your guess in square brackets."
    if len(word) != WORD_LENGTH:
        return f"Your word must be exactly {WORD_LENGTH} letters."
    if not (word.isascii() and word.isalpha()):
        return "Your word must use only the letters a to z."
    if word in previous:
        return f"You have already guessed '{word}' before. Please try a different word."
    if word not in ALLOWED:
        return f"'{word}' is not in the word list."
    return None


# The game's last reply holds one of these: won, or over with the secret word revealed.
WON = "Congratulations! You guessed the word correctly!"
REVEALED = "The secret word was:"


def feedback(word: str, marks: str) -> str:
    """TextArena's feedback block: `Feedback:\\nC R A N E\\nG Y X X G`."""
    return f"Feedback:\n{' '.join(word.upper())}\n{' '.join(marks)}"


@dataclass
class Turn:
    """What one move did."""

    message: str  # the game's reply
    marks: str  # G/Y/X per letter; empty for an invalid move
    repeats: int  # earlier submissions of the same word in this game
    reward: float  # 1.0 for the winning guess, else 0.0
    done: bool

    @property
    def signals(self) -> dict[str, float]:
        """OpenEnv's TextArena Wordle shaped signals (same names): greens/5, yellows/5, repetition, win."""
        return {
            "wordle.greens": self.marks.count("G") / WORD_LENGTH,
            "wordle.yellows": self.marks.count("Y") / WORD_LENGTH,
            "wordle.repetitions": 1.0 - self.repeats,
            "wordle.correct": self.reward,
        }


class NoGameInProgress(RuntimeError):
    """A move sent when no game is running (never started, or over)."""


@dataclass
class Game:
    """One game of Wordle. The answer is private: only the end-of-game message reveals it."""

    answer: str = field(default_factory=lambda: secrets.choice(ANSWERS), repr=False)
    guesses: list[str] = field(default_factory=list)  # valid guesses, in order
    marks: list[str] = field(default_factory=list)  # their marks
    submitted: list[str] = field(default_factory=list)  # every bracketed word, valid or not
    invalid_moves: int = 0
    done: bool = False

    @classmethod
    def seeded(cls, seed: int) -> Game:
        return cls(answer=answer_for_seed(seed))

    @property
    def won(self) -> bool:
        return bool(self.marks) and self.marks[-1] == "G" * WORD_LENGTH

    def play(self, move: str) -> Turn:
        """Play one move: text holding the guess in square brackets, e.g. `I'll try [crane]`."""
        if self.done:
            raise NoGameInProgress("The game is over: start a new one.")
        word = extract_word(move)
        repeats = self.submitted.count(word) if word else 0
        if word:
            self.submitted.append(word)
        reason = invalid_reason(word, self.guesses)
        if reason:
            self.invalid_moves += 1
            self.done = self.invalid_moves > INVALID_MOVE_ALLOWANCE
            message = f"You attempted an invalid move. Reason: {reason} "
            if self.done:
                message += f"Too many invalid moves: the game is over. {REVEALED} **{self.answer}**."
            else:
                forgiven = f"{self.invalid_moves} of {INVALID_MOVE_ALLOWANCE} invalid moves forgiven"
                message += f"Please resubmit a valid move ({forgiven})."
            return Turn(message, "", repeats, 0.0, self.done)

        marks = score(word, self.answer)
        self.guesses.append(word)
        self.marks.append(marks)
        message = f"You submitted [{word}].\n{feedback(word, marks)}\n"
        if self.won:
            message += WON
        else:
            left = MAX_GUESSES - len(self.guesses)
            message += f"You have {left} guesses left."
            if not left:
                message += f"\nThe turn limit has been reached. {REVEALED} **{self.answer}**."
        self.done = self.won or len(self.guesses) == MAX_GUESSES
        return Turn(message, marks, repeats, float(self.won), self.done)
