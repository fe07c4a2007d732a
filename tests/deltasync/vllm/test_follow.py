"""Stock vLLM (CPU) with the deltasync weight-transfer backend, followed by `deltasync follow`.

The server command holds no code of ours (`python -m vllm.entrypoints.openai.api_server
--weight-transfer-config '{"backend":"deltasync"}'`): the backend comes from the installed
`vllm.general_plugins` entry point, and the follower drives vLLM's own RL routes. Weights are read back
through the engine (`kind="readback"`: each rank saves the HF tensors it holds) and compared bit for bit
with the trainer's states.
"""

import json
import os
import sys
import threading
from contextlib import contextmanager
from pathlib import Path

import pytest
import requests
import torch
from safetensors.torch import load_file, save_file
from transformers import Qwen3Config, Qwen3ForCausalLM

from deltasync import telemetry
from deltasync.codec.fingerprint import format_fingerprint
from deltasync.codec.patch import encode, make_patch, read_entries, read_info
from tests.helpers import CODE_UNDER_TEST, ServedRun, assert_bitwise_equal, wait_for
from trainer.processes import free_port, placement, start_process, stop_process, wait_healthy
from trainer.tiny_model import build_tiny_model

pytestmark = pytest.mark.slow  # starts vLLM

ANCHOR_EVERY = 4
REPLICA = "follower-a"
CPUS = placement()


class Server:
    def __init__(self, url: str, log: Path, tmp: Path):
        self.url, self.log, self.tmp, self.reads = url, log, tmp, 0

    def post(self, route: str, body: dict | None = None) -> requests.Response:
        return requests.post(self.url + route, json=body or {}, timeout=120)

    def version(self) -> str:
        return requests.get(f"{self.url}/weight_info", timeout=10).json()["weight_version"]

    def update(self, **update_info) -> requests.Response:
        """One update through vLLM's routes (start, update, finish): the response of /update_weights."""
        assert self.post("/start_weight_update").status_code == 200
        response = self.post("/update_weights", {"update_info": update_info})
        finish = self.post("/finish_weight_update")
        if response.status_code == 200:
            assert finish.status_code == 200, finish.text
        else:  # refused: the rank that reported it has left the update already (deltasync.vllm.compat)
            assert finish.status_code == 200 or "without a matching start" in finish.text, finish.text
        return response

    def readback(self) -> dict:
        """The weights the worker holds, in HF names and shapes."""
        self.reads += 1
        folder = self.tmp / f"readback-{self.reads}"
        response = self.update(step=-1, kind="readback", path=str(folder))
        assert response.status_code == 200, response.text
        return load_file(folder / "rank-0.safetensors")

    def verify(self, step: int, fingerprint: str) -> requests.Response:
        """The workers read their weights back and compare the whole state's fingerprint."""
        return self.update(step=step, kind="verify", fingerprint=fingerprint)

    def running(self) -> float:
        """vLLM's own count of running requests (its Prometheus gauge)."""
        text = requests.get(f"{self.url}/metrics", timeout=10).text
        lines = [line for line in text.splitlines() if line.startswith("vllm:num_requests_running")]
        return sum(float(line.split()[-1]) for line in lines)

    def wait_version(self, version: str) -> None:
        wait_for(lambda: self.version() == version, f"weight version {version}; log {self.log}", 180)

    def wait_applied(self, run: ServedRun, replica: str, step: int) -> None:
        """Until the follower has applied `step` and read it back (its telemetry record comes last), so
        that this test's own updates never overlap the follower's."""
        record = run.served / f"{telemetry.REPLICAS_DIR}/{replica}/step-{step:08d}.json"
        wait_for(record.exists, f"the record of step {step}; log {self.log}", 180)
        self.wait_version(str(step))


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("follow")
    run = ServedRun(tmp, build_tiny_model(tmp / "tiny-qwen3"), anchor_every=ANCHOR_EVERY)
    run.step()  # the first anchor: the model folder's own weights
    yield run
    run.publisher.close()


@contextmanager
def stock_server(model_dir: Path, tmp: Path, *flags: str, cpus=CPUS.server, env: dict | None = None):
    """vLLM's own OpenAI server, nothing of ours in its command but the backend's name."""
    port = free_port()
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir)]
    argv += ["--host", "127.0.0.1", "--port", str(port), "--dtype", "bfloat16", "--enforce-eager"]
    argv += ["--weight-transfer-config", json.dumps({"backend": "deltasync"}), *flags]
    env = {"VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_KVCACHE_SPACE": "1", **CPUS.server_env(), **(env or {})}
    env.update(CODE_UNDER_TEST)
    proc = start_process(argv, tmp / "server.log", env, cpus=cpus)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, f"{url}/health", tmp / "server.log", 600)
        yield Server(url, tmp / "server.log", tmp)
    finally:
        stop_process(proc, grace_s=30)


@contextmanager
def following(root: Path, server: Server, log: Path, replica: str):
    """`deltasync follow ROOT --vllm-url URL` beside the server; yields its log."""
    argv = [sys.executable, "-m", "deltasync.cli", "follow", str(root), "--vllm-url", server.url]
    argv += ["--replica", replica, "--poll-s", "0.2", "--verify-every", "1"]
    proc = start_process(argv, log, CODE_UNDER_TEST, cpus=CPUS.others)  # this tree's deltasync
    yield log
    stop_process(proc, grace_s=30)
    assert proc.returncode == 0, log.read_text()[-3000:]


@pytest.fixture(scope="module")
def server(run, tmp_path_factory):
    with stock_server(run.model_dir, tmp_path_factory.mktemp("server"), "--max-model-len", "512") as server:
        yield server


@pytest.fixture(scope="module")
def follower(run, server, tmp_path_factory):
    with following(run.served, server, tmp_path_factory.mktemp("follower") / "follower.log", REPLICA) as log:
        yield log


def test_follows_three_steps_bitwise(run, server, follower):
    server.wait_applied(run, REPLICA, 0)
    for _ in range(3):
        step = run.step()
    server.wait_applied(run, REPLICA, step)
    assert_bitwise_equal(server.readback(), run.states[step])
    for s in range(step + 1):
        record = run.replica_record(REPLICA, s)
        assert record.verified and record.pause_s is not None and record.error is None
    lines = [line for line in follower.read_text().splitlines() if " applied (" in line]
    assert [line.split("step ")[1].split()[0] for line in lines] == [str(s) for s in range(step + 1)]
    assert all("bytes" in line and "paused" in line for line in lines)


def patch_file(path: Path, data: bytes, rename: dict[str, str] | None = None, **metadata: str) -> str:
    """`data`, a patch, saved to `path` with some metadata replaced and entries renamed."""
    meta = read_info(data).metadata | metadata
    entries = {(rename or {}).get(n, n): t for n, t in read_entries(data).items()}
    save_file(entries, path, metadata=meta)
    return str(path)


def test_refused_update_writes_nothing_and_tells_why(run, server, follower, tmp_path):
    step = run.publisher.last_step
    server.wait_applied(run, REPLICA, step)
    before = server.readback()
    fingerprint = run.fingerprints[step]
    name = "model.layers.0.mlp.up_proj.weight"
    after = dict(before)
    after[name] = before[name].clone()
    after[name].view(-1)[:3] += 1
    patch = make_patch(before, after, step + 100, step)
    data = encode(patch, before, "compact")
    new = format_fingerprint(patch.fingerprint)
    good = patch_file(tmp_path / "good.safetensors", data)
    # A patch whose header promises another state than its changes reach: refused once decoded.
    lying = patch_file(tmp_path / "lying.safetensors", data, fingerprint="0" * 16)
    unknown = patch_file(tmp_path / "unknown.safetensors", data, {name: "no.such.weight"})
    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not a header")
    cases = [
        ({"paths": [good], "base": "0" * 16, "fingerprint": new}, "this server holds"),
        ({"paths": [lying], "base": fingerprint, "fingerprint": "0" * 16}, "refused, nothing written"),
        ({"paths": [good], "base": fingerprint, "fingerprint": "0" * 16}, f"its files lead to {new}"),
        ({"paths": [unknown], "base": fingerprint, "fingerprint": new}, "no.such.weight"),
        ({"paths": [str(garbage)], "base": fingerprint, "fingerprint": new}, "corrupt"),
        ({"paths": [str(tmp_path / "absent")], "base": fingerprint, "fingerprint": new}, "cannot read"),
    ]
    for info, reason in cases:
        response = server.update(step=step + 100, kind="delta", **info)
        assert response.status_code == 500 and reason in response.text, response.text
    assert server.version() == str(step)
    assert_bitwise_equal(server.readback(), before)


def test_corrupt_delta_refused_then_recovered_from_next_anchor(run, server, follower):
    good = run.publisher.last_step
    server.wait_applied(run, REPLICA, good)
    bad = run.step(corrupt=True)
    refusal = run.served / f"{telemetry.REPLICAS_DIR}/{REPLICA}/step-{bad:08d}.json"
    wait_for(lambda: refusal.exists(), "the refusal")
    record = run.replica_record(REPLICA, bad)
    assert not record.verified and record.error
    assert server.version() == str(good)
    assert_bitwise_equal(server.readback(), run.states[good])
    step = run.step()
    while not run.head().entry(step, "anchor"):  # deltas based on the refused one cannot apply
        step = run.step()
    server.wait_applied(run, REPLICA, step)
    assert_bitwise_equal(server.readback(), run.states[step])
    assert run.replica_record(REPLICA, step).verified


# ------------------------------------------------------------------------------ tensor parallel: two ranks


LONG = 3000  # tokens of the request that runs across an update


@pytest.fixture(scope="module")
def tp_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("follow-tp")
    run = ServedRun(tmp, build_tiny_model(tmp / "tiny-qwen3"), anchor_every=ANCHOR_EVERY)
    run.step()
    yield run
    run.publisher.close()


@pytest.fixture(scope="module")
def tp_server(tp_run, tmp_path_factory):
    # One rank per core: every core of this machine goes to the server, the follower and this test share them.
    cores = sorted(os.sched_getaffinity(0))[:2]
    flags = ["--tensor-parallel-size", "2", "--max-model-len", "4096", "--enable-scale-out"]
    # TORCHDYNAMO_DISABLE: vLLM compiles its vocab-parallel embedding mask with torch.compile even in eager
    # mode, and inductor's C++ build needs a compiler this machine may lack; eager is exact here too.
    env = {"VLLM_CPU_OMP_THREADS_BIND": "|".join(map(str, cores)), "TORCHDYNAMO_DISABLE": "1"}
    with stock_server(tp_run.model_dir, tmp_path_factory.mktemp("tp"), *flags, cpus=cores, env=env) as server:
        yield server


@pytest.fixture(scope="module")
def tp_follower(tp_run, tp_server, tmp_path_factory):
    log = tmp_path_factory.mktemp("tp-follower") / "follower.log"
    with following(tp_run.served, tp_server, log, "follower-tp") as log:
        yield log


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="tensor parallel on CPU needs a core per rank")
def test_tensor_parallel_follows_three_steps(tp_run, tp_server, tp_follower):
    tp_server.wait_applied(tp_run, "follower-tp", 0)
    for _ in range(3):
        step = tp_run.step()
    tp_server.wait_applied(tp_run, "follower-tp", step)
    # Each rank reads back the elements it holds; their shares of the fingerprint sum to the whole state's.
    assert tp_server.verify(step, tp_run.fingerprints[step]).status_code == 200
    wrong = tp_server.verify(step, tp_run.fingerprints[step - 1])
    assert wrong.status_code == 500 and f"hold {tp_run.fingerprints[step]}" in wrong.text, wrong.text
    assert tp_server.verify(step, tp_run.fingerprints[step]).status_code == 200  # the ranks still agree
    for s in range(step + 1):
        assert tp_run.replica_record("follower-tp", s).verified


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="tensor parallel on CPU needs a core per rank")
def test_tensor_parallel_request_across_an_update(tp_run, tp_server, tp_follower):
    before = tp_run.publisher.last_step
    tp_server.wait_applied(tp_run, "follower-tp", before)
    chunks, started, result = [], threading.Event(), {}

    def generate():  # streamed: its first tokens say it runs, however slowly the machine polls
        params = {"max_tokens": LONG, "temperature": 0.0, "ignore_eos": True}
        body = {"model": str(tp_run.model_dir), "token_ids": [5, 6, 7, 8], "sampling_params": params}
        url = f"{tp_server.url}/inference/v1/generate"
        try:
            with requests.post(url, json={**body, "stream": True}, timeout=600, stream=True) as response:
                result["status"] = response.status_code
                for line in response.iter_lines():
                    if line.startswith(b"data: {"):
                        chunks.append(json.loads(line[len(b"data: ") :]))
                        started.set()
        finally:
            started.set()  # an error or an empty answer: the checks below say what

    thread = threading.Thread(target=generate)
    thread.start()
    try:
        assert started.wait(120), "the request did not start"
        # Freeze the request where it is (vLLM's own pause, kept), so the update lands inside it however
        # slowly the step is published and staged; the follower's resume lets it go on with the new weights.
        requests.post(f"{tp_server.url}/pause?mode=keep&clear_cache=false", timeout=60).raise_for_status()
        assert tp_server.running() >= 1, "the request finished before the pause"
        step = tp_run.step()
        tp_server.wait_applied(tp_run, "follower-tp", step)
    finally:
        requests.post(f"{tp_server.url}/resume", timeout=60)  # done by the follower, unless it failed
        thread.join()
    assert result["status"] == 200, chunks
    choices = [c for chunk in chunks for c in chunk["choices"]]
    assert sum(len(c["token_ids"] or []) for c in choices) == LONG, chunks[-1:]
    spans = next(c["weight_versions"] for c in reversed(choices) if c.get("weight_versions"))
    assert [s["version"] for s in spans] == [str(before), str(step)], spans  # vLLM's own record
    assert spans[0]["end"] == spans[1]["start"] and spans[1]["end"] == LONG
    assert tp_server.verify(step, tp_run.fingerprints[step]).status_code == 200


# ------------------------------------------------------------------ the follower holds no copy of the weights


def build_model(path: Path) -> Path:
    """A random bf16 Qwen3 of ~107M elements (214 MB): the tiny model's tokenizer, larger shapes, so that a
    copy of the weights in the follower would stand far above the noise of its memory."""
    build_tiny_model(path)
    config = Qwen3Config.from_pretrained(path)
    for key, value in dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=8).items():
        setattr(config, key, value)
    config.num_attention_heads, config.num_key_value_heads, config.initializer_range = 16, 8, 0.02
    config.layer_types = [config.layer_types[0]] * config.num_hidden_layers
    Qwen3ForCausalLM(config).to(torch.bfloat16).save_pretrained(path)
    return path


def memory_kb(pid: int, field: str) -> int:
    """`VmRSS` (now) or `VmHWM` (peak) of process `pid`, in kB."""
    line = next(x for x in Path(f"/proc/{pid}/status").read_text().splitlines() if x.startswith(field + ":"))
    return int(line.split()[1])


def test_the_follower_holds_no_copy_of_the_weights(tmp_path):
    run = ServedRun(tmp_path, build_model(tmp_path / "model"), anchor_every=ANCHOR_EVERY)
    model_kb = sum(t.nbytes for t in run.state.values()) // 1024
    with stock_server(run.model_dir, tmp_path / "server", "--max-model-len", "512") as server:
        log = tmp_path / "follower.log"
        argv = [sys.executable, "-m", "deltasync.cli", "follow", str(run.served), "--vllm-url", server.url]
        proc = start_process(
            [*argv, "--replica", REPLICA, "--poll-s", "0.2"], log, CODE_UNDER_TEST, cpus=CPUS.others
        )
        try:
            # Started and polling an empty root: what it holds before any weights move.
            wait_for(lambda: "no run in" in log.read_text(), "the follower to poll")
            before = memory_kb(proc.pid, "VmRSS")
            for _ in range(3):  # an anchor, then deltas
                step = run.step()
            server.wait_applied(run, REPLICA, step)
            peak = memory_kb(proc.pid, "VmHWM")
        finally:
            stop_process(proc, grace_s=30)
        assert_bitwise_equal(server.readback(), run.states[step])
    assert peak - before < model_kb / 5, (
        f"the follower grew by {peak - before} kB, the model is {model_kb} kB"
    )
