"""Wordle environment Space: the OpenEnv server (WebSocket `/ws`, HTTP API, `/docs`) and a play page at `/`.

    python spaces/env/app.py

Serves the `wordle_env` package beside it (installed by `make setup` in the repo, by the Space's Dockerfile).

Environment: PORT (default 7860), HOST (default 0.0.0.0), MAX_CONCURRENT_ENVS (WebSocket sessions, 512).
"""

from __future__ import annotations

import json
from typing import Any

import gradio as gr
import uvicorn
from fastapi import Request
from fastapi.responses import JSONResponse
from openenv.core.env_server.http_server import create_app
from openenv.core.env_server.mcp_types import JsonRpcErrorCode, JsonRpcResponse
from openenv.core.env_server.types import WSErrorCode, WSErrorResponse
from pydantic_settings import BaseSettings

from wordle_env.environment import WordleEnvironment
from wordle_env.models import WordleAction, WordleObservation, WordleState
from wordle_env.play_page import build_page
from wordle_env.rules import NoGameInProgress

# Largest HTTP body and WebSocket message accepted: a move is at most 4096 characters, nothing else is larger.
MAX_MESSAGE_BYTES = 64 * 1024
# Deepest JSON nesting of a WebSocket message: OpenEnv's messages nest 2 levels (MCP's JSON-RPC a few more);
# a much deeper one cannot be echoed back in an error reply, which ends the session.
MAX_MESSAGE_DEPTH = 32
JSON_TYPES = {
    list: "an array",
    str: "a string",
    int: "a number",
    float: "a number",
    bool: "a boolean",
    type(None): "null",
}


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


class FrameGuard:
    """Answer, with an error reply on a session that stays open, the WebSocket frames that OpenEnv 0.10's
    `/ws` and `/mcp` loops would end the session on: a binary frame, JSON Python cannot parse (an integer
    over 4300 digits, nesting past the recursion limit), JSON that is not an object, nesting deeper than
    MAX_MESSAGE_DEPTH. Other frames pass unchanged: OpenEnv answers the rest of malformed messages itself."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        reply = ERROR_REPLIES.get(scope["path"]) if scope["type"] == "websocket" else None
        if reply is None:
            return await self.app(scope, receive, send)

        async def checked_receive():
            while True:
                event = await receive()
                problem = _frame_problem(event) if event["type"] == "websocket.receive" else None
                if problem is None:
                    return event
                # OpenEnv's loops send only between receives: this reply cannot interleave with theirs.
                await send({"type": "websocket.send", "text": reply(*problem)})

        await self.app(scope, checked_receive, send)


def _frame_problem(event: dict[str, Any]) -> tuple[bool, str] | None:
    """None for a frame OpenEnv can take, else (parsed, why): whether it was JSON at all, what is wrong."""
    text = event.get("text")
    if text is None:
        return False, "binary frames are not accepted: send the message as JSON text"
    try:
        message = json.loads(text)
    except (ValueError, RecursionError) as e:  # JSONDecodeError, an integer over 4300 digits, deep nesting
        return False, f"Invalid JSON: {e}"
    if not isinstance(message, dict):
        return True, f"the message must be a JSON object, got {JSON_TYPES[type(message)]}"
    if _depth(message) > MAX_MESSAGE_DEPTH:
        return True, f"the message nests deeper than {MAX_MESSAGE_DEPTH} levels"
    return None


def _depth(value: Any) -> int:
    """Nesting depth of parsed JSON (1 for a scalar), counted iteratively up to MAX_MESSAGE_DEPTH + 1."""
    depth, level = 0, [value]
    while level and depth <= MAX_MESSAGE_DEPTH:
        depth += 1
        level = [
            v for x in level if isinstance(x, dict | list) for v in (x.values() if isinstance(x, dict) else x)
        ]
    return depth


def _ws_error(parsed: bool, why: str) -> str:
    code = WSErrorCode.VALIDATION_ERROR if parsed else WSErrorCode.INVALID_JSON
    return WSErrorResponse(data={"message": why, "code": code}).model_dump_json()


def _rpc_error(parsed: bool, why: str) -> str:
    code = JsonRpcErrorCode.INVALID_REQUEST if parsed else JsonRpcErrorCode.PARSE_ERROR
    return JsonRpcResponse.error_response(code, why).model_dump_json()


ERROR_REPLIES = {"/ws": _ws_error, "/mcp": _rpc_error}  # OpenEnv's WebSocket routes and their error formats


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
app.add_middleware(FrameGuard)


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
