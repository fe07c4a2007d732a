"""ASGI middleware the Spaces share (plain ASGI: no web framework needed to import it)."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]


class BodyLimit:
    """Refuses an HTTP request before the app reads any of its body: 413 when its Content-Length is over
    `max_bytes`, 400 when the Content-Length is not one non-negative decimal number, 411 when the body comes
    chunked (its length unannounced). Answers `{"detail": why}`; the server discards the unread body (a
    client still sending it then reads the answer, where closing the connection would reset it)."""

    def __init__(self, app: App, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        refusal = self.refusal(scope["headers"]) if scope["type"] == "http" else None
        if refusal is None:
            return await self.app(scope, receive, send)
        status, why = refusal
        body = json.dumps({"detail": why}).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    def refusal(self, headers: list[tuple[bytes, bytes]]) -> tuple[int, str] | None:
        """(status, why) for a request with these headers that must not reach the app, else None."""
        lengths = {value.strip() for name, value in headers if name.lower() == b"content-length"}
        if any(name.lower() == b"transfer-encoding" for name, _ in headers):
            return 411, "send the body with a Content-Length, not chunked"
        if not lengths:
            return None
        (length,) = lengths if len(lengths) == 1 else (b"",)
        if not length or any(c not in b"0123456789" for c in length):
            return 400, "Content-Length must be one non-negative decimal number"
        digits = length.lstrip(b"0")  # no int() of thousands of digits
        if len(digits) > len(str(self.max_bytes)) or int(digits or b"0") > self.max_bytes:
            return 413, f"request body over {self.max_bytes} bytes"
        return None


def serve(app: App, name: str, host: str, port: int, **options: Any) -> None:
    """Run `app` with uvicorn (`options` go to uvicorn.run), after one line saying where to open it."""
    import uvicorn  # the apps' dependency, not the library's

    local = "localhost" if host in ("0.0.0.0", "::") else host  # every interface: this machine's is one
    print(f"{name} listening on {host}:{port}: open http://{local}:{port}/", flush=True)
    uvicorn.run(app, host=host, port=port, **options)
