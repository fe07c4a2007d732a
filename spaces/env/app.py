"""Wordle environment Space: the OpenEnv server (WebSocket `/ws`, HTTP API, `/docs`) and a play page at `/`.

    python spaces/env/app.py

Serves the `wordle_env` package beside it (installed by `make setup` in the repo, by the Space's Dockerfile).

Environment: PORT (default 7860), HOST (default 0.0.0.0), MAX_CONCURRENT_ENVS (WebSocket sessions, 512).
"""

from __future__ import annotations

import gradio as gr
import uvicorn
from fastapi import Request
from fastapi.responses import JSONResponse
from openenv.core.env_server.http_server import create_app
from pydantic_settings import BaseSettings

from wordle_env.environment import WordleEnvironment
from wordle_env.models import WordleAction, WordleObservation, WordleState
from wordle_env.play_page import build_page
from wordle_env.rules import NoGameInProgress

# Largest HTTP body and WebSocket message accepted: a move is at most 4096 characters, nothing else is larger.
MAX_MESSAGE_BYTES = 64 * 1024


class BodyLimit:
    """Refuse oversized HTTP bodies (413) and bodies of undeclared length (411) before anything reads them."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            headers = dict(scope["headers"])
            length = headers.get(b"content-length")
            if length is not None and int(length) > MAX_MESSAGE_BYTES:
                refusal = JSONResponse({"detail": f"Request body over {MAX_MESSAGE_BYTES} bytes"}, 413)
                return await refusal(scope, receive, send)
            if length is None and b"transfer-encoding" in headers:
                return await JSONResponse({"detail": "Content-Length required"}, 411)(scope, receive, send)
        await self.app(scope, receive, send)


class Settings(BaseSettings):
    """The Space's configuration, from the environment variables of the same names in upper case."""

    host: str = "0.0.0.0"
    port: int = 7860
    max_concurrent_envs: int = 512  # WebSocket sessions


settings = Settings()
app = create_app(
    WordleEnvironment,
    WordleAction,
    WordleObservation,
    env_name="wordle",
    max_concurrent_envs=settings.max_concurrent_envs,
    state_cls=WordleState,
)
app.add_middleware(BodyLimit)


@app.exception_handler(NoGameInProgress)
async def no_game_in_progress(request: Request, exc: NoGameInProgress) -> JSONResponse:
    # HTTP /step builds a fresh environment per request (OpenEnv's stateless HTTP): games need the WebSocket.
    return JSONResponse({"detail": f"{exc} Games are played over the WebSocket at /ws."}, 409)


# Mounted last, so OpenEnv's routes (/ws, /reset, /step, /docs, ...) match before the page's catch-all "/".
app = gr.mount_gradio_app(app, build_page(), path="/")

if __name__ == "__main__":
    uvicorn.run(
        app,
        host=settings.host,
        port=settings.port,
        ws_max_size=MAX_MESSAGE_BYTES,
        timeout_graceful_shutdown=5,  # an open play page holds a Gradio heartbeat stream that never ends
    )
