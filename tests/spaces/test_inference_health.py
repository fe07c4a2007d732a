"""The inference app's settings and /health without an engine: POLL_BUDGET reaches its storage, HOST is
loopback outside a Space, and /health says "rate limited until T" while the Hub refuses the replica, still
200 (it serves), with vLLM's 503 kept. Imports the app (and so vLLM) but starts no engine."""

import time

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import Response
from fastapi.testclient import TestClient


def test_poll_budget_is_read_from_the_environment(app, monkeypatch):
    monkeypatch.setenv("MODEL", "tiny")
    monkeypatch.setenv("SYNC_ROOT", "hf://buckets/user/sync")
    assert app.Settings().poll_budget == 1000
    monkeypatch.setenv("POLL_BUDGET", "30")
    assert app.Settings().poll_budget == 30


@pytest.mark.parametrize(("space_id", "host"), [(None, "127.0.0.1"), ("me/replica", "0.0.0.0")])
def test_only_a_space_listens_on_every_interface_unless_told(app, monkeypatch, space_id, host):
    monkeypatch.setenv("MODEL", "tiny")
    monkeypatch.setenv("SYNC_ROOT", "hf://buckets/user/sync")
    if space_id:
        monkeypatch.setenv("SPACE_ID", space_id)
    else:
        monkeypatch.delenv("SPACE_ID", raising=False)
    assert app.Settings().host == host
    monkeypatch.setenv("HOST", "::1")
    assert app.Settings().host == "::1"


@pytest.mark.parametrize("engine_status", [200, 503])
def test_health_says_rate_limited_until_and_keeps_vllms_status(app, engine_status):
    until: list[float | None] = [None]

    async def vllm_health(request: Request) -> Response:  # vLLM's: 200, or 503 once its engine is dead
        return Response(status_code=engine_status)

    server = FastAPI()
    server.add_api_route("/health", app.health_route(vllm_health, lambda: until[0]), methods=["GET"])
    client = TestClient(server)
    answer = client.get("/health")
    assert (answer.status_code, answer.text, answer.headers.get(app.RATE_LIMIT_HEADER)) == (
        engine_status,
        "",
        None,
    )
    until[0] = time.time() + 120
    answer = client.get("/health")
    at = time.strftime("%H:%M:%S UTC", time.gmtime(until[0]))
    assert (answer.status_code, answer.text) == (engine_status, f"rate limited until {at}\n")
    assert answer.headers[app.RATE_LIMIT_HEADER] == f"{until[0]:.0f}"
