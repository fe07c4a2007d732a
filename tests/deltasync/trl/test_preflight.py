"""Preflight: a dead environment, a dead replica, a replica serving another model, in the other mode (full
weights or a LoRA adapter) or quantized otherwise than the trainer publishes, an unwritable root or a root
holding another model's run (or one quantized otherwise) each end in one line naming what and where (exit
status 2 from the scripts), and the root holds nothing new afterwards."""

import contextlib
import http.server
import json
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from fastapi import FastAPI, Response

from deltasync.codec.patch import schema_hash
from deltasync.sync.publisher import Publisher, PublisherConfig
from deltasync.trl.preflight import PROBE_PREFIX, preflight, schema_of
from tests.helpers import REPO
from trainer.processes import serving_in_thread
from trainer.tiny_model import default_model_dir, ensure_tiny_model

DEAD = "http://127.0.0.1:9"  # nothing listens there
MODEL = "tiny-model"
SCHEMA = {"model.embed_tokens.weight": [16, 8], "model.norm.weight": [8]}


@contextlib.contextmanager
def fake_replica(
    served: str = MODEL,
    schema: dict | None = None,
    models: object = None,
    lora: object = ...,
    quantization: object = ...,
) -> Iterator[str]:
    """Answers /v1/models with `served` (or `models` as the list's data) and, like the inference Space,
    /weights with its sync status (with `lora`: its vLLM `lora_config`; with `quantization`: the recipe it
    serves, None for bf16)."""
    app = FastAPI()

    @app.get("/v1/models")
    def listed():
        data = [{"id": served, "object": "model"}] if models is None else models
        return {"object": "list", "data": data}

    @app.get("/weights")
    def weights():
        status = {"model": served, "step": 4, "weight_version": "4"}
        status |= {"lora_config": lora} if lora is not ... else {}
        status |= {"quantization": quantization} if quantization is not ... else {}
        return status | ({"schema_hash": schema_hash(schema)} if schema is not None else {})

    @app.get("/health")
    def health():
        return {"status": "healthy"}

    with serving_in_thread(app) as url:
        yield url


def listing(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*")) if root.exists() else []


@pytest.fixture
def root(tmp_path) -> Path:
    return tmp_path / "root"


def test_all_well(root):
    with fake_replica(schema=SCHEMA) as url:
        assert preflight(root, SCHEMA, MODEL, [url], env_url=url) is None
    assert listing(root) == []  # the write check's probe is gone again
    assert not any(PROBE_PREFIX in name for name in listing(root))


def test_dead_env(root):
    with fake_replica() as url:
        failure = preflight(root, SCHEMA, MODEL, [url], env_url=DEAD)
    assert failure == f"environment {DEAD}/health does not answer: ConnectionError"
    assert listing(root) == []


def test_dead_replica(root):
    with fake_replica() as url:
        failure = preflight(root, SCHEMA, MODEL, [url, DEAD])
    assert failure == f"inference server {DEAD}/v1/models does not answer: ConnectionError"
    assert listing(root) == []


def test_replica_serving_another_model(root):
    with fake_replica(served="other-model") as url:
        failure = preflight(root, SCHEMA, MODEL, [url])
    assert failure == (
        f"inference server {url} serves ['other-model'], not {MODEL} (names must match exactly: "
        f"start it with --served-model-name {MODEL})"
    )
    assert listing(root) == []


def test_replica_holding_other_parameters(root):
    other = {**SCHEMA, "model.norm.weight": [9]}
    with fake_replica(schema=other) as url:
        failure = preflight(root, SCHEMA, MODEL, [url])
    assert failure.startswith(f"inference server {url} holds other parameters than the trainer"), failure
    assert listing(root) == []


@pytest.mark.parametrize(
    "lora, lora_rank, problem",
    [
        (None, 16, "serves full weights, not a LoRA adapter (a Space: set MAX_LORA_RANK)"),
        (
            {"max_lora_rank": 8, "max_loras": 6},
            16,
            "serves LoRA adapters up to rank 8, below the trainer's 16",
        ),
        ({"max_lora_rank": 16, "max_loras": 6}, 0, "serves LoRA adapters, not full weights"),
        ({"max_lora_rank": 16, "max_loras": 6}, 16, None),
        (None, 0, None),
    ],
)
def test_replica_in_the_other_mode(root, lora, lora_rank, problem):
    with fake_replica(lora=lora) as url:
        failure = preflight(root, SCHEMA, MODEL, [url], lora_rank=lora_rank)
    if problem is None:
        assert failure is None
    else:
        assert failure.startswith(f"inference server {url} {problem}"), failure
    assert listing(root) == []


FP8, INT8 = "fp8_per_channel", "int8_per_channel_weight_only"


@pytest.mark.parametrize(
    "served, trainer, problem",
    [
        (
            None,
            FP8,
            f"serves bf16 weights, the trainer publishes weights quantized {FP8}: train without "
            f"--quantization, or restart the replica with QUANTIZATION={FP8} (a Space; deltasync follow and "
            f"vLLM: --quantization {FP8})",
        ),
        (
            FP8,
            None,
            f"serves weights quantized {FP8}, the trainer publishes bf16 weights: train with --quantization "
            f"{FP8}, or restart the replica without QUANTIZATION (a Space; deltasync follow and vLLM: "
            "without --quantization)",
        ),
        (INT8, FP8, f"serves weights quantized {INT8}, the trainer publishes weights quantized {FP8}: train"),
        (FP8, FP8, None),
        (None, None, None),
        (..., FP8, None),  # a replica that does not say what it serves (stock vLLM's /weights: none at all)
    ],
)
def test_replica_quantized_otherwise(root, served, trainer, problem):
    with fake_replica(schema=SCHEMA, quantization=served) as url:
        failure = preflight(root, SCHEMA, MODEL, [url], quantization=trainer)
    if problem is None:
        assert failure is None
    else:
        assert failure.startswith(f"inference server {url} {problem}"), failure
    assert listing(root) == []


@pytest.mark.parametrize("stored, trainer", [(FP8, None), (None, FP8)])
def test_root_holding_a_run_quantized_otherwise(root, stored, trainer):
    config = PublisherConfig(quantization=stored)
    with Publisher(root, model=MODEL, config=config) as publisher:
        publisher.publish({name: torch.zeros(shape) for name, shape in SCHEMA.items()})
    before = listing(root)
    failure = preflight(root, SCHEMA, MODEL, quantization=trainer)
    flag = f"with --quantization {FP8}" if stored else "without --quantization"
    assert failure == (
        f"sync root {root} holds a run of {MODEL} as "
        + (
            f"weights quantized {FP8}, and this run publishes bf16 weights"
            if stored
            else f"bf16 weights, and this run publishes weights quantized {FP8}"
        )
        + f": publish to another root (or prefix), or train {flag}"
    )
    assert listing(root) == before


def test_unwritable_root(tmp_path):
    (tmp_path / "file").write_text("a file, not a folder")
    root = tmp_path / "file" / "root"
    failure = preflight(root, SCHEMA, MODEL)
    assert failure.startswith(f"sync root {root} is not writable: "), failure
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]


def test_root_holding_a_run_of_another_model(root):
    with Publisher(root, model="other") as publisher:
        publisher.publish({"model.embed_tokens.weight": torch.zeros(16, 4)})
    before = listing(root)
    failure = preflight(root, SCHEMA, MODEL)
    assert failure == (
        f"sync root {root} holds a run of another model (other): model.embed_tokens.weight has shape "
        "[16, 4] there, [16, 8] here"
    )
    assert listing(root) == before


def test_schema_of_names_what_trl_sends():
    model = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.Linear(3, 1))
    model[1].weight.requires_grad_(False)  # frozen: TRL sends only trainable parameters
    assert schema_of(model) == {"0.weight": [3, 2], "0.bias": [3], "1.bias": [1]}


def run_script(argv: list[str], tmp_path: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *argv], cwd=REPO, capture_output=True, text=True, timeout=600, check=False
    )


def test_trainer_exits_2_on_a_dead_env_before_publishing(tmp_path, root):
    model = ensure_tiny_model(default_model_dir())
    with fake_replica(served=str(model)) as url:
        argv = ["-m", "trainer", "--sync_root", str(root), "--inference_url", url, "--env_url", DEAD]
        argv += ["--model", str(model), "--output_dir", str(tmp_path / "out"), "--no_progress"]
        proc = run_script(argv, tmp_path)
    assert proc.returncode == 2, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last == f"preflight failed: environment {DEAD}/health does not answer: ConnectionError"
    assert listing(root) == []


def test_example_exits_2_on_a_dead_replica_before_publishing(tmp_path, root):
    model = ensure_tiny_model(default_model_dir())
    argv = [str(REPO / "examples" / "grpo_bucket.py"), "--model_name_or_path", str(model)]
    argv += ["--sync_root", str(root), "--inference_url", DEAD, "--output_dir", str(tmp_path / "out")]
    argv += ["--use_cpu", "--bf16", "false", "--token_budget", "0", "--report_to", "none"]
    proc = run_script(argv, tmp_path)
    assert proc.returncode == 2, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last == f"preflight failed: inference server {DEAD}/v1/models does not answer: ConnectionError"
    assert listing(root) == []


@pytest.mark.parametrize("models", [[1], None, {"m": 1}, ["m"]])
def test_a_malformed_model_list_is_one_line(root, models):
    with fake_replica(models=models if models is not None else "null") as url:
        failure = preflight(root, SCHEMA, MODEL, [url])
    assert failure is not None and "\n" not in failure
    assert failure.startswith(f"inference server {url}"), failure


class Trickling(http.server.BaseHTTPRequestHandler):
    """Answers 200 with a valid model list, one byte every 0.2 s."""

    def do_GET(self):
        body = json.dumps({"data": [{"id": MODEL}]}).encode()
        self.send_response(200)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        for byte in body:
            try:
                self.wfile.write(bytes([byte]))
                self.wfile.flush()
            except OSError:  # the client gave up
                return
            time.sleep(0.2)

    def log_message(self, *args):
        pass


@pytest.mark.parametrize(
    "lora, lora_rank, problem",
    [
        (None, 8, "holds a full-weight run (of tiny-model), and this run trains a LoRA adapter: publish to"),
        (
            {"name": "policy", "adapter_config": {"r": 8}},
            0,
            "holds a LoRA run (an adapter of tiny-model), and",
        ),
    ],
)
def test_a_root_holding_a_run_in_the_other_mode_says_so_and_what_to_do(root, lora, lora_rank, problem):
    with Publisher(root, model=MODEL, lora=lora) as publisher:
        publisher.publish({name: torch.zeros(shape) for name, shape in SCHEMA.items()})
    failure = preflight(
        root,
        {"base_model.model.x.lora_A.weight": [8, 8]} if lora_rank else SCHEMA,
        MODEL,
        lora_rank=lora_rank,
    )
    assert failure.startswith(f"sync root {root} {problem}"), failure
    assert "another root (or prefix)" in failure and "--lora_r" in failure


@contextlib.contextmanager
def replica_reporting(weights: bytes) -> Iterator[str]:
    """A replica whose /weights answers `weights`, as they are."""
    app = FastAPI()
    app.get("/v1/models")(lambda: {"data": [{"id": MODEL}]})
    app.get("/weights")(lambda: Response(weights, media_type="application/json"))
    with serving_in_thread(app) as url:
        yield url


@pytest.mark.parametrize(
    "weights",
    [b'{"lora_config": {"max_lora_rank": "sixteen"}}', b'{"quantization": 8}', b"[" * 200_000],
)
def test_a_replica_status_that_makes_no_sense_is_one_line(root, weights):
    with replica_reporting(weights) as url:
        failure = preflight(root, SCHEMA, MODEL, [url], lora_rank=8)
    assert failure is not None and "\n" not in failure
    assert failure.startswith(f"inference server {url}"), failure
    assert listing(root) == []


class TricklingForEver(http.server.BaseHTTPRequestHandler):
    """Promises a long model list, then sends one byte every 0.05 s (at most 400: the test's bound) until the
    client leaves."""

    def do_GET(self):
        self.send_response(200)
        self.send_header("content-length", str(1 << 20))
        self.end_headers()
        for _ in range(400):
            try:
                self.wfile.write(b" ")
                self.wfile.flush()
            except OSError:  # the client gave up
                return
            time.sleep(0.05)

    def log_message(self, *args):
        pass


@pytest.mark.parametrize("handler", [Trickling, TricklingForEver])
def test_a_replica_that_trickles_its_answer_is_bounded_as_a_whole(root, monkeypatch, handler):
    monkeypatch.setattr(sys.modules[preflight.__module__], "TIMEOUT_S", 1.0)
    server = http.server.HTTPServer(("127.0.0.1", 0), handler)  # one request, answered in its thread
    serving = threading.Thread(target=server.serve_forever)
    serving.start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        failure = preflight(root, SCHEMA, MODEL, [url])
    finally:
        server.shutdown()
        serving.join()
        server.server_close()
    assert failure == f"inference server {url}/v1/models does not answer within 1 s"
