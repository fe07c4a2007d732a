"""Completions labelled with the weight versions that produced them, for any vLLM server.

    python -m vllm.entrypoints.openai.api_server ... --middleware deltasync.vllm.headers.WeightVersionHeaders

`x-weight-version` is the server's weight version when the request arrived: no token of the response came
from older weights. A non-streamed response also carries `x-weight-version-end`, the version when it was
complete: no token came from newer ones. A streamed response (`text/event-stream`) sends its headers before
its tokens, so it has no end: its later tokens may come from newer versions (vLLM records which version
sampled which token only in its token-in/token-out route's `weight_versions` spans). Beside `deltasync
follow`, which sets the version to each step it applies (vLLM's `finish_weight_update(weight_version)`),
these are published steps: `deltasync.trl` stamps rollouts with the oldest.
"""

from __future__ import annotations

from collections.abc import Callable

from starlette.datastructures import MutableHeaders

GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions")


class WeightVersionHeaders:
    """ASGI middleware; `version` gives the current version (default: the app's vLLM engine client's)."""

    def __init__(self, app, version: Callable[[], str] | None = None):
        self.app, self.version = app, version

    async def current(self, scope) -> str:
        if self.version is not None:
            return self.version()
        return await scope["app"].state.engine_client.get_weight_version()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] not in GENERATION_PATHS:
            return await self.app(scope, receive, send)
        first = await self.current(scope)

        async def send_labelled(message):
            if message["type"] == "http.response.start":
                headers = MutableHeaders(scope=message)
                headers["x-weight-version"] = first
                if not headers.get("content-type", "").startswith("text/event-stream"):  # complete
                    headers["x-weight-version-end"] = await self.current(scope)
            await send(message)

        await self.app(scope, receive, send_labelled)
