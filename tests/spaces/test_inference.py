"""The inference Space end to end on CPU vLLM: `python spaces/inference/app.py` follows a local sync root that
the project's Publisher fills with a tiny Qwen3's states, and serves them through vLLM's OpenAI API.

Two engine starts: server A (the defaults: direct writes, KV_ON_UPDATE=keep) follows the run from its first
anchor (steps, readback, a request across an update, a corrupt delta, security); server B (vLLM's loader,
KV_ON_UPDATE=recompute) starts late, catches up from an anchor, answers a prompt after an update exactly as A
does (A cached its blocks under the old weights, B never saw it), takes a request across an update and feeds
TRL's rollout worker. The servers run on their own cores, this process on the others (`placement()`): vLLM's
CPU engine would otherwise slow this process ~5x, and an update would land whenever that allowed.
"""

import json
import os
import re
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import pytest
import requests

from deltasync.trl.preflight import preflight
from tests.helpers import REPO, ServedRun
from trainer.processes import placement, serving
from trainer.tiny_model import build_tiny_model

pytestmark = pytest.mark.slow  # starts vLLM

APP = REPO / "spaces" / "inference" / "app.py"
TOKEN = "test-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
PROMPT = [5, 6, 7, 8, 20, 30]
ANCHOR_EVERY = 10
BIG_STEP = 10  # a step that changes every weight a lot: greedy outputs must change with it
LONG = 8000  # tokens of the request that runs across an update (--max-model-len 8192)
CPUS = placement()
ADMIN_ROUTES = [
    "/pause",
    "/resume",
    "/is_paused",
    "/collective_rpc",
    "/reset_prefix_cache",
    "/update_weights",
    "/update_weight_version",
    "/init_weight_transfer_engine",
    "/sleep",
    "/wake_up",
    "/server_info",
    "/weight_checker",
    "/scale_elastic_ep",
    "/inference/v1/abort_requests",
    "/metrics",
    "/load",
    "/tokenize",
    "/invocations",
    "/docs",
    "/openapi.json",
]


def request_across_an_update(run: ServedRun, server: "Server") -> tuple[dict, dict, dict]:
    """A LONG-token request during which a step lands: the server's own record says the request was in
    flight when generation paused for the write; it completes with exactly its tokens, sampled by the two
    versions in turn (vLLM's `weight_versions` spans). Returns the status before and after, and the choice."""
    before, result = server.status(), {}
    assert before["requests_in_flight"] == 0, before

    def generate():
        params = {"max_tokens": LONG, "temperature": 0.0, "ignore_eos": True}
        body = {"model": server.model, "token_ids": PROMPT, "sampling_params": params}
        url = f"{server.url}/inference/v1/generate"
        result["response"] = requests.post(url, json=body, headers=server.headers, timeout=600)

    thread = threading.Thread(target=generate)
    thread.start()
    try:
        server.wait_for(lambda s: s["requests_in_flight"] == 1, "the request to start")
        step = run.step()
        status = server.wait_for(lambda s: s["step"] == step, f"step {step}")
    finally:
        thread.join()
    assert status["last_write"]["step"] == step and status["last_write"]["requests_in_flight"] == 1, status
    response = result["response"]
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    assert len(choice["token_ids"]) == LONG
    spans = choice["weight_versions"]  # vLLM's own record of which weights sampled which tokens
    assert [s["version"] for s in spans] == [str(before["step"]), str(step)], spans
    assert spans[0]["start"] == 0 and spans[0]["end"] == spans[1]["start"] and spans[1]["end"] == LONG
    return before, status, choice


class Server:
    def __init__(self, url: str, model: str, log: Path, headers: dict):
        self.url, self.model, self.log, self.headers = url, model, log, headers

    def status(self) -> dict:
        return requests.get(f"{self.url}/weights", headers=self.headers, timeout=10).json()

    def wait_for(self, condition, what: str, timeout: float = 60) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            status = self.status()
            if condition(status):
                return status
            time.sleep(0.1)
        raise AssertionError(f"timed out waiting for {what}; status {status}; log tail {self.tail()}")

    def tail(self) -> str:
        return self.log.read_text()[-3000:]

    def complete(self, **body) -> requests.Response:
        body = {"model": self.model, "prompt": PROMPT, "max_tokens": 10, "temperature": 0.0, **body}
        return requests.post(f"{self.url}/v1/completions", json=body, headers=self.headers, timeout=60)

    def greedy(self) -> list[int]:
        response = self.complete(return_token_ids=True)
        assert response.status_code == 200, response.text
        return response.json()["choices"][0]["token_ids"]


@contextmanager
def running_server(run: ServedRun, log: Path, **env):
    env = {
        "MODEL": str(run.model_dir),
        "SYNC_ROOT": str(run.served),
        "POLL_S": "0.2",
        "VERIFY_EVERY": "1",  # read the weights back from vLLM after every step
        "ENGINE_ARGS": "--enforce-eager --max-model-len 8192 --max-num-seqs 8",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        **env,
    }
    env |= CPUS.server_env()
    with serving([sys.executable, str(APP)], log, env, timeout=600, cpus=CPUS.server) as url:
        yield Server(url, str(run.model_dir), log, AUTH if env.get("API_TOKEN") else {})


@pytest.fixture(scope="module")
def pinned():
    """This process (and the threads it starts, the publisher's included) on the cores the servers leave."""
    before = os.sched_getaffinity(0)
    CPUS.pin_self()
    yield
    os.sched_setaffinity(0, before)


@pytest.fixture(scope="module")
def run(pinned, tmp_path_factory) -> ServedRun:
    tmp = tmp_path_factory.mktemp("inference")
    run = ServedRun(tmp, build_tiny_model(tmp / "tiny-qwen3"), anchor_every=ANCHOR_EVERY, big_step=BIG_STEP)
    yield run
    run.publisher.close()


# ---------------------------------------------------------------------------------- server A: follows the run


@pytest.fixture(scope="module")  # still up beside server B, as the fresh server's counterpart
def server(run, tmp_path_factory):
    run.step()  # the first anchor: MODEL's weights
    log = tmp_path_factory.mktemp("server-a") / "server.log"
    with running_server(run, log, API_TOKEN=TOKEN, REPLICA_ID="replica-a") as server:
        yield server


class TestFollowingServer:
    def test_starts_from_the_first_anchor(self, run, server, monkeypatch, tmp_path):
        status = server.wait_for(lambda s: s["readback"] and s["readback"]["step"] == 0, "the first anchor")
        assert status["anchor"] == 0 and status["weight_version"] == "0" and status["last_error"] is None
        assert status["step"] == 0 and status["readback"]["fingerprint"] == run.fingerprints[0]
        # a dense model: every tensor written in place, straight into vLLM's parameter views
        direct = {"direct": len(run.states[0]), "packed": 0, "loader": 0}
        assert status["write_paths"] == {"counts": direct, "other": {}}
        # What a trainer's preflight reads there: the run's parameters, full weights.
        monkeypatch.setenv("INFERENCE_API_TOKEN", TOKEN)
        schema = {n: list(t.shape) for n, t in run.states[0].items()}
        assert preflight(run.served, schema, server.model, [server.url]) is None
        # A LoRA trainer, on a fresh root (the served root would refuse it first: it holds full weights)
        refused = preflight(tmp_path / "fresh", schema, server.model, [server.url], lora_rank=16)
        assert refused == f"inference server {server.url} serves full weights, not a LoRA adapter " + (
            "(a Space: set MAX_LORA_RANK)"
        )
        other = {name: [1, *shape] for name, shape in schema.items()}  # another model, on a fresh root
        refused = preflight(tmp_path / "fresh", other, server.model, [server.url])
        assert refused.startswith(f"inference server {server.url} holds other parameters than the trainer")

    def test_every_step_applied_verified_and_served(self, run, server):
        outputs = {0: server.greedy()}
        for _ in range(20):
            step = run.step()
            # After each step, the vLLM worker reads its weights back and confirms their fingerprint.
            status = server.wait_for(lambda s, step=step: s["readback"]["step"] == step, f"step {step}")
            assert status["step"] == step and status["readback"]["fingerprint"] == run.fingerprints[step]
            assert status["lag_steps"] == 0 and status["weight_version"] == str(step)
            outputs[step] = server.greedy()
        assert status["last_write"]["write"] == "direct"  # the default path
        applied = [a for a in server.status()["recent"] if a["step"] > 0]
        assert [a["step"] for a in applied] == list(range(1, 21))
        assert all(a["pause_s"] < a["apply_s"] for a in applied)
        logged = re.findall(r"follower: step (\d+) applied \(delta\)", server.log.read_text())
        assert set(range(1, 21)) <= set(map(int, logged))  # the Space's log says each step
        for step in range(21):
            record = run.replica_record("replica-a", step)
            assert record.verified and record.pause_s is not None and record.lag_steps == 0
        # Small steps rarely flip a greedy token; the big one changes every weight, and the outputs with it.
        assert outputs[BIG_STEP] != outputs[BIG_STEP - 1], outputs

    def test_request_running_across_an_update_keeps_its_kv(self, run, server):
        before, status, choice = request_across_an_update(run, server)
        assert status["last_write"]["kv_on_update"] == "keep"
        assert server.status()["preemptions"] == before["preemptions"]  # vLLM kept the request running

    def test_trl_rollout_request_shape(self, run, server):
        # The exact body TRL 1.16's AsyncRolloutWorker._generate_one_turn posts.
        body = {"top_p": 1.0, "top_k": 0, "repetition_penalty": 1.0, "n": 1, "return_token_ids": True}
        response = server.complete(temperature=1.0, logprobs=0, seed=1234, **body)
        assert response.status_code == 200, response.text
        choice = response.json()["choices"][0]
        assert len(choice["token_ids"]) == len(choice["logprobs"]["token_logprobs"]) > 0
        step = str(server.status()["step"])
        assert response.headers["x-weight-version"] == response.headers["x-weight-version-end"] == step

    def test_security(self, run, server):
        for path, body in [
            ("/v1/completions", {"model": server.model, "prompt": PROMPT, "max_tokens": 2}),
            (
                "/v1/chat/completions",
                {"model": server.model, "messages": [{"role": "user", "content": "hi"}]},
            ),
            ("/inference/v1/generate", {"model": server.model, "token_ids": PROMPT, "sampling_params": {}}),
        ]:
            assert requests.post(server.url + path, json=body, timeout=30).status_code == 401, path
            wrong = {"Authorization": "Bearer nope"}
            assert requests.post(server.url + path, json=body, headers=wrong, timeout=30).status_code == 401
            assert requests.post(server.url + path, json=body, headers=AUTH, timeout=30).status_code == 200
        assert requests.get(f"{server.url}/v1/models", timeout=10).status_code == 401
        assert requests.get(f"{server.url}/health", timeout=10).status_code == 200
        # The front page asks for the token; its API refuses anonymous calls.
        api = requests.post(f"{server.url}/gradio_api/call/complete", json={"data": ["hi", 4]}, timeout=10)
        assert api.status_code == 401
        for path in ADMIN_ROUTES:
            for method in ("GET", "POST"):
                response = requests.request(method, server.url + path, json={}, headers=AUTH, timeout=10)
                assert response.status_code == 404, (method, path, response.status_code)
        huge = b'{"prompt": "' + b"x" * (5 << 20) + b'"}'
        headers = {**AUTH, "Content-Type": "application/json"}
        # The server answers before reading the body and closes the connection: read the status line only.
        url = f"{server.url}/v1/completions"
        with requests.post(url, data=huge, headers=headers, timeout=30, stream=True) as response:
            assert response.status_code == 413

    def test_corrupt_delta_refused_then_recovered_from_next_anchor(self, run, server):
        good = server.status()["step"]
        bad = run.step(corrupt=True)
        status = server.wait_for(lambda s: s["last_error"] and "refused" in s["last_error"], "the refusal")
        assert status["step"] == good and status["readback"]["fingerprint"] == run.fingerprints[good]
        response = server.complete()  # still serving the last good step
        assert response.status_code == 200 and response.headers["x-weight-version"] == str(good)
        record = run.replica_record("replica-a", bad)
        assert not record.verified and record.error
        assert re.search(r"WARNING deltasync\.[\w.]+: sync: .*refused", server.log.read_text())  # in its log
        step = run.step()
        while not run.head().entry(step, "anchor"):  # deltas based on the refused one cannot apply
            time.sleep(0.3)
            assert server.status()["step"] == good
            step = run.step()
        # The step moves before the subscriber reads the anchor back: wait for the readback.
        status = server.wait_for(lambda s: s["readback"]["step"] == step, "recovery from the next anchor")
        assert status["step"] == status["anchor"] == step and status["last_error"] is None
        assert status["readback"]["fingerprint"] == run.fingerprints[step]
        assert status["recent"][-1]["kind"] == "anchor"


# --------------------------------------------------------------------------- server B: starts late, feeds TRL


@pytest.fixture(scope="class")
def late_server(run, tmp_path_factory):
    while run.step() < run.head().anchors[-1].step + 2:  # the head moves past the newest anchor
        pass
    log = tmp_path_factory.mktemp("server-b") / "server.log"
    # Running requests recompute their context after an update.
    env = {"REPLICA_ID": "replica-b", "KV_ON_UPDATE": "recompute"}
    with running_server(run, log, **env) as server:
        yield server


class TestLateServer:
    def test_catches_up_from_the_newest_anchor(self, run, late_server):
        head = run.head().step
        # The step moves before the subscriber reads the weights back and records it: wait for the record.
        recorded = lambda s: s["recent"] and s["recent"][-1]["step"] == head  # noqa: E731
        status = late_server.wait_for(recorded, f"step {head}")
        anchor = run.head().anchors[-1].step
        expected = [(anchor, "anchor"), (anchor + 1, "delta"), (anchor + 2, "delta")]
        assert [(a["step"], a["kind"]) for a in status["recent"]] == expected
        assert status["readback"]["fingerprint"] == run.fingerprints[head]
        assert run.replica_record("replica-b", head).verified

    def test_no_prefix_cache_reuse_across_versions(self, run, server, late_server):
        """After an update, server A answers a prompt whose blocks it cached under the old weights exactly as
        server B, which never saw that prompt, answers it on the same weights (token ids and logprobs)."""
        prompt = list(range(100, 164))  # 64 tokens: whole KV blocks, which the prefix cache keeps

        def ask(on: Server) -> tuple:
            body = {"prompt": prompt, "max_tokens": 8, "logprobs": 1, "return_token_ids": True}
            response = on.complete(**body)
            assert response.status_code == 200, response.text
            choice, version = response.json()["choices"][0], response.headers["x-weight-version"]
            return choice["token_ids"], choice["logprobs"]["token_logprobs"], version

        ask(server)  # cached under the current weights
        step = run.step()
        for each in (server, late_server):
            each.wait_for(lambda s: s["readback"] and s["readback"]["step"] == step, f"step {step}")
        again, fresh = ask(server), ask(late_server)
        assert again == fresh and again[2] == str(step), (again, fresh)

    def test_request_running_across_an_update_recomputes(self, run, late_server):
        before, status, choice = request_across_an_update(run, late_server)
        assert status["last_write"]["kv_on_update"] == "recompute"
        assert late_server.status()["preemptions"] > before["preemptions"]  # preempted, then recomputed

    def test_front_page_completion_box(self, late_server):
        assert "gradio" in requests.get(late_server.url, timeout=10).text.lower()
        call = f"{late_server.url}/gradio_api/call/complete"
        event = requests.post(call, json={"data": ["What is 2 + 3?", 5]}, timeout=30).json()["event_id"]
        lines = requests.get(f"{call}/{event}", timeout=60).text.splitlines()
        assert "event: complete" in lines, lines
        text, versions = json.loads(lines[lines.index("event: complete") + 1].removeprefix("data: "))
        assert versions == f"{late_server.status()['step']}: tokens 0-5"

    def test_trl_async_rollout_worker_unchanged(self, run, late_server):
        from accelerate import PartialState
        from datasets import Dataset
        from transformers import AutoTokenizer
        from trl.chat_template_utils import qwen3_template
        from trl.experimental.async_grpo.async_rollout_worker import AsyncRolloutWorker
        from trl.rewards import think_format_reward

        PartialState()  # TRL logs through accelerate, which the trainer would have set up
        tokenizer = AutoTokenizer.from_pretrained(run.model_dir)
        tokenizer.response_template = (
            qwen3_template  # our tiny tokenizer's ChatML is not a template TRL knows
        )
        prompts = [[{"role": "user", "content": f"What is {i} + {i + 1}?"}] for i in range(4)]
        worker = AsyncRolloutWorker(
            model_name=late_server.model,
            dataset=Dataset.from_dict({"prompt": prompts}),
            reward_funcs=[think_format_reward],
            processing_class=tokenizer,
            eos_token_ids=[tokenizer.eos_token_id],
            num_generations=2,
            max_inflight_tasks=2,
            vllm_server_url=late_server.url,
            max_tokens=8,
        )
        worker.start()
        try:
            sample = worker.rollout_buffer.get(timeout=120)
        finally:
            worker.stop()
        completion = sum(sample.completion_mask)
        assert completion > 0 and any(lp != 0 for lp in sample.old_log_probs), sample
