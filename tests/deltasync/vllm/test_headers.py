"""`--middleware deltasync.vllm.headers.WeightVersionHeaders` on a vLLM server: completions carry the engine's
weight version when the request arrived and, unless streamed, when the response was complete (the
stock-server run is in tests/trainer/test_example.py)."""

import asyncio

from fastapi import FastAPI
from fastapi.responses import StreamingResponse
from fastapi.testclient import TestClient

from deltasync.vllm.headers import WeightVersionHeaders


class Engine:
    """The part of vLLM's engine client the middleware reads; the version moves while a request runs."""

    def __init__(self):
        self.version = "3"

    async def get_weight_version(self) -> str:
        return self.version


def test_completions_carry_the_engines_weight_versions():
    app, engine = FastAPI(), Engine()
    app.state.engine_client = engine  # where vLLM's API server keeps it

    @app.post("/v1/completions")
    async def completions():
        engine.version = "4"  # an update lands while this request runs
        await asyncio.sleep(0)
        return {"choices": []}

    @app.get("/v1/models")
    async def models():
        return {"data": []}

    app.add_middleware(WeightVersionHeaders)  # as vLLM adds a --middleware class
    client = TestClient(app)
    labelled = client.post("/v1/completions").headers
    assert (labelled["x-weight-version"], labelled["x-weight-version-end"]) == ("3", "4")
    assert "x-weight-version" not in client.get("/v1/models").headers


def test_a_streamed_completion_names_no_end_its_headers_cannot_know():
    app, engine = FastAPI(), Engine()
    app.state.engine_client = engine

    @app.post("/v1/chat/completions")
    async def chat():
        async def tokens():
            yield "data: {}\n\n"
            engine.version = "4"  # an update lands after the headers went out: later tokens come from it
            yield "data: {}\n\n"

        return StreamingResponse(tokens(), media_type="text/event-stream")

    app.add_middleware(WeightVersionHeaders)
    labelled = TestClient(app).post("/v1/chat/completions").headers
    assert labelled["x-weight-version"] == "3" and "x-weight-version-end" not in labelled
