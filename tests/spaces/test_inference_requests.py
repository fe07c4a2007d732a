"""The inference app's request checks without an engine: every generation request is salted with the weight
version (`VersionSalt`), and a body whose JSON nests deeper than Python's stack gets a 400 in vLLM's error
shape with one line, as other malformed bodies do from vLLM, not a 500. Imports the app (and so vLLM) but
starts no engine."""

from fastapi import FastAPI, Request
from fastapi.testclient import TestClient


def client(app) -> TestClient:
    inner = FastAPI()

    @inner.post("/v1/completions")
    async def completions(request: Request):  # vLLM's place: echoes what it was sent
        return {"sent": (await request.body()).decode()}

    return TestClient(app.VersionSalt(inner, lambda: "7"))


def test_json_nested_too_deeply_is_a_400_with_one_line_and_other_bodies_go_to_vllm_salted(app):
    answer = client(app).post("/v1/completions", json={"prompt": "hi"})
    assert answer.status_code == 200
    assert answer.json()["sent"] == '{"prompt": "hi", "cache_salt": "deltasync-7"}'
    nested = b"[" * 100_000
    answer = client(app).post("/v1/completions", content=nested, headers={"content-type": "application/json"})
    assert answer.status_code == 400
    error = answer.json()["error"]
    assert error["message"] == "the request body's JSON is nested too deeply" and error["code"] == 400
