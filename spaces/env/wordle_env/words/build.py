"""Build answers.txt and allowed.txt from two Debian SCOWL word lists (run once; see README.md here).

    python spaces/env/wordle_env/words/build.py SMALL_LIST HUGE_LIST

SMALL_LIST (wamerican-small: common words) gives the answers, HUGE_LIST (wamerican-huge) the allowed guesses.
Both keep only 5-letter words of lowercase a-z (no proper nouns, abbreviations or apostrophes), minus Roman
numerals. Answers also drop plurals and past tenses whose stem is in the list (like Wordle's own answers) and
a few crude words (the answer is shown to a person at the end of a game). Allowed guesses hold every answer.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

LENGTH = 5
ROMAN_NUMERAL = re.compile(r"m{0,4}(cm|cd|d?c{0,3})(xc|xl|l?x{0,3})(ix|iv|v?i{0,3})")
CRUDE = {"bitch", "booby", "horny", "penis", "pussy", "semen", "whore"}


def words(path: str) -> set[str]:
    text = Path(path).read_text(encoding="utf-8")
    return {w for w in text.split() if re.fullmatch(r"[a-z]+", w) and not ROMAN_NUMERAL.fullmatch(w)}


def inflected(word: str, vocabulary: set[str]) -> bool:
    """A plural or past tense of another word in the vocabulary (dogs, boxes, baked, ended)."""
    stems = {"s": [word[:-1]], "es": [word[:-2]], "ed": [word[:-1], word[:-2]]}
    return any(word.endswith(end) and any(s in vocabulary for s in found) for end, found in stems.items())


def main(small: str, huge: str) -> None:
    common = words(small)
    answers = sorted(w for w in common if len(w) == LENGTH and not inflected(w, common) and w not in CRUDE)
    allowed = sorted({w for w in words(huge) if len(w) == LENGTH} | set(answers))
    out = Path(__file__).parent
    (out / "answers.txt").write_text("\n".join(answers) + "\n")
    (out / "allowed.txt").write_text("\n".join(allowed) + "\n")
    print(f"{len(answers)} answers, {len(allowed)} allowed guesses")


if __name__ == "__main__":
    main(*sys.argv[1:])
