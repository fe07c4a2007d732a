"""Wordle environment Space: the OpenEnv server (WebSocket `/ws`, HTTP API, `/docs`) and a play page at `/`.

    python spaces/env/app.py

Serves the `wordle_env` package beside it (installed by `make setup` in the repo, by the Space's Dockerfile).

Environment: PORT (default 7860), HOST (default 0.0.0.0), MAX_CONCURRENT_ENVS (WebSocket sessions, 512),
SESSION_IDLE_S (a WebSocket that sends nothing for this long is closed and its session freed, 300).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import gradio as gr
from fastapi import Request
from fastapi.responses import JSONResponse
from openenv.core.env_server.http_server import create_app
from openenv.core.env_server.mcp_types import JsonRpcErrorCode, JsonRpcResponse
from openenv.core.env_server.types import WSErrorCode, WSErrorResponse
from pydantic import Field
from pydantic_settings import BaseSettings

from appkit.asgi import BodyLimit, serve
from appkit.settings import from_env
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


class FrameGuard:
    """Answer, with an error reply on a session that stays open, the WebSocket frames that OpenEnv 0.10's
    `/ws` and `/mcp` loops would end the session on (or that would leave it unable to answer): a binary
    frame, JSON Python cannot parse (an integer over 4300 digits, nesting past the recursion limit), JSON
    that is not an object, nesting deeper than MAX_MESSAGE_DEPTH, a string no UTF-8 can encode (a lone
    surrogate such as "\\ud800"). Other frames pass unchanged: OpenEnv answers the rest of malformed messages
    itself. A socket that sends nothing for `idle_s` seconds is closed, so its session frees its slot (OpenEnv
    would hold it until the client leaves)."""

    def __init__(self, app, idle_s: float):
        self.app, self.idle_s = app, idle_s

    async def __call__(self, scope, receive, send):
        reply = ERROR_REPLIES.get(scope["path"]) if scope["type"] == "websocket" else None
        if reply is None:
            return await self.app(scope, receive, send)
        closed = False

        async def checked_receive():
            nonlocal closed
            while True:
                try:
                    event = await asyncio.wait_for(receive(), self.idle_s)
                except TimeoutError:
                    closed = True
                    await send(
                        {"type": "websocket.close", "code": 1000, "reason": f"idle for {self.idle_s:g} s"}
                    )
                    return {"type": "websocket.disconnect", "code": 1000}
                problem = _frame_problem(event) if event["type"] == "websocket.receive" else None
                if problem is None:
                    return event
                # OpenEnv's loops send only between receives: this reply cannot interleave with theirs.
                await send({"type": "websocket.send", "text": reply(*problem)})

        async def guarded_send(message):
            if not closed:  # after an idle close, OpenEnv's own close would be a second one
                await send(message)

        await self.app(scope, checked_receive, guarded_send)


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
    try:
        json.dumps(message, ensure_ascii=False).encode()
    except UnicodeEncodeError as e:  # from an escape such as \ud800: JSON allows it, no reply can carry it
        return True, f"the message holds a lone surrogate ({e.object[e.start : e.end]!r}): not Unicode text"
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
    session_idle_s: float = Field(300.0, gt=0)  # a WebSocket silent this long is closed


settings = from_env(Settings)
app = create_app(
    WordleEnvironment,
    WordleAction,
    WordleObservation,
    env_name="wordle",
    max_concurrent_envs=settings.max_concurrent_envs,
    state_cls=WordleState,
)
app.add_middleware(BodyLimit, max_bytes=MAX_MESSAGE_BYTES)
app.add_middleware(FrameGuard, idle_s=settings.session_idle_s)


@app.exception_handler(NoGameInProgress)
async def no_game_in_progress(request: Request, exc: NoGameInProgress) -> JSONResponse:
    # HTTP /step builds a fresh environment per request (OpenEnv's stateless HTTP): games need the WebSocket.
    return JSONResponse({"detail": f"{exc} Games are played over the WebSocket at /ws."}, 409)


# Mounted last, so OpenEnv's routes (/ws, /reset, /step, /docs, ...) match before the page's catch-all "/".
app = gr.mount_gradio_app(app, build_page(), path="/")

if __name__ == "__main__":
    serve(
        app,
        "Wordle env",
        settings.host,
        settings.port,
        ws_max_size=MAX_MESSAGE_BYTES,
        log_level="warning",  # no line per request: serve() has said where the app is
        timeout_graceful_shutdown=5,  # an open play page holds a Gradio heartbeat stream that never ends
    )
