"""The Space's front page: a person plays Wordle in the browser, under the same rules as the API."""

from __future__ import annotations

import gradio as gr

from wordle_env.rules import MAX_GUESSES, WORD_LENGTH, Game

BOARD_CSS = """
.row { display: flex; }
.tile { display: flex; align-items: center; justify-content: center; width: 2.6em; height: 2.6em; margin: 2px;
        font: bold 1.4em sans-serif; border: 2px solid #d3d6da; }
.G { background: #6aaa64; color: #fff; }
.Y { background: #c9b458; color: #fff; }
.X { background: #787c7e; color: #fff; }
"""
INTRO = f"""# Wordle
Guess the {WORD_LENGTH}-letter word in {MAX_GUESSES} tries. After each guess the tiles show
green (right place), yellow (in the word, elsewhere) or grey (not in the word).

This Space is also an [OpenEnv](https://github.com/huggingface/OpenEnv) environment server on the same
port: WebSocket sessions at `/ws`, HTTP `/reset`, `/step`, `/state`, `/schema`, `/health`, API docs at
[/docs](/docs).
"""


def board_html(game: Game | None) -> str:
    """The grid of tiles. Only validated guesses (letters a-z) and G/Y/X marks reach the HTML."""
    played = list(zip(game.guesses, game.marks, strict=True)) if game else []
    empty = [(" " * WORD_LENGTH, " " * WORD_LENGTH)] * (MAX_GUESSES - len(played))
    rows = (
        "".join(f'<span class="tile {m}">{c.upper()}</span>' for c, m in zip(word, marks, strict=True))
        for word, marks in played + empty
    )
    return "".join(f'<div class="row">{row}</div>' for row in rows)


def new_game(seed: str) -> tuple[Game, str, str, str]:
    """A random game, or with a seed the same game as the API's `reset(seed=...)`."""
    seed = seed.strip()
    if seed and not (seed.isascii() and seed.isdigit()):
        raise gr.Error(f"The seed must be a whole number, or empty for a random word (got {seed!r}).")
    game = Game.seeded(int(seed)) if seed else Game()
    return game, board_html(game), f"New game: type a {WORD_LENGTH}-letter word.", ""


def play(game: Game | None, text: str) -> tuple[Game | None, str, str, str]:
    if game is None or game.done:
        return game, board_html(game), "The game is over: press New game.", text
    turn = game.play(text if "[" in text else f"[{text}]")  # people type the word; the API wants brackets
    return game, board_html(game), turn.message, ""


def build_page() -> gr.Blocks:
    with gr.Blocks(title="Wordle (OpenEnv)") as page:
        gr.Markdown(INTRO)
        game = gr.State()
        board = gr.HTML(board_html(None), css_template=BOARD_CSS)
        message = gr.Textbox(label="Game", lines=4, interactive=False)
        with gr.Row():
            guess = gr.Textbox(label="Your guess", placeholder="crane", max_length=64, scale=3)
            submit = gr.Button("Guess", variant="primary", scale=1)
        with gr.Row():
            seed = gr.Textbox(
                label="Seed (a seed always gives the same word)", placeholder="random", max_length=20
            )
            restart = gr.Button("New game")
        outputs = [game, board, message, guess]
        gr.on([page.load, restart.click], new_game, seed, outputs)
        gr.on([submit.click, guess.submit], play, [game, guess], outputs)
    return page
