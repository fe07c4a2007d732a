"""The request-body limit the Spaces share: refused before the app reads a byte of the body."""

import asyncio
import json

import pytest

from appkit.asgi import BodyLimit

LIMIT = 1000


def call(headers: list[tuple[bytes, bytes]]) -> tuple[int, dict | None]:
    """(status, JSON body of a refusal) of a POST with `headers` through BodyLimit, over an app saying 200."""
    sent = []

    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    async def receive():
        raise AssertionError("the body was read")

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/", "headers": headers}
    asyncio.run(BodyLimit(app, LIMIT)(scope, receive, send))
    body = sent[1]["body"]
    return sent[0]["status"], json.loads(body) if body else None


@pytest.mark.parametrize(
    "length, status",
    [
        (b"0", 200),
        (b"1000", 200),
        (b"0001000", 200),
        (b"1001", 413),
        (b"9" * 5000, 413),  # refused without converting thousands of digits
        (b"abc", 400),
        (b"-1", 400),
        (b"+5", 400),
        (b"1e3", 400),
        (b"", 400),
        ("٣".encode(), 400),  # a digit, but not an ASCII one
    ],
)
def test_content_length_must_be_a_decimal_within_the_limit(length, status):
    got, body = call([(b"content-type", b"application/json"), (b"content-length", length)])
    assert got == status
    if status != 200:
        assert set(body) == {"detail"}


def test_two_content_lengths_that_differ_are_refused_and_chunked_bodies_too():
    assert call([(b"content-length", b"5"), (b"content-length", b"500")])[0] == 400
    assert call([(b"content-length", b"5"), (b"Content-Length", b"5")])[0] == 200
    status, body = call([(b"transfer-encoding", b"chunked")])
    assert status == 411 and "Content-Length" in body["detail"]
    assert call([])[0] == 200  # no body at all
