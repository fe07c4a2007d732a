"""A quantized replica (stock vLLM on CPU, `--quantization fp8_per_channel`, the deltasync backend) follows a
bf16 trainer's quantized root for 3 steps: its fp8 codes and scales, read back, equal bit for bit those of a
fresh server started with the same quantization on the trainer's step-3 checkpoint, and greedy tokens and
logprobs match; a corrupt, foreign or mismatched update is refused in one line with nothing written."""

import shutil
import sys
from pathlib import Path

import pytest
import requests
import torch
from safetensors.torch import load_file, save_file

from deltasync import telemetry
from deltasync.quant.recipe import recipe
from deltasync.quant.state import SCALE, quantize_state
from deltasync.storage import open_storage
from deltasync.sync.protocol import read_head
from deltasync.sync.publisher import Publisher, PublisherConfig
from tests.deltasync.vllm.test_follow import CPUS, Server, stock_server
from tests.helpers import CODE_UNDER_TEST, perturb, wait_for
from trainer.processes import start_process, stop_process
from trainer.tiny_model import default_model_dir, ensure_tiny_model

pytestmark = pytest.mark.slow  # starts vLLM, twice
RECIPE = "fp8_per_channel"
FLAGS = ("--quantization", RECIPE, "--max-model-len", "256")
REPLICA = "quantized-a"
PROMPT = [1, 17, 230, 45, 9, 301, 77, 12]
# vLLM compiles its logprob gathering with torch.compile even in eager mode, and inductor's C++ build needs a
# compiler this machine may lack; eager is exact here too (as in test_moe).
ENV = {"TORCHDYNAMO_DISABLE": "1"}


def generate(server: Server) -> tuple[list[int], list[float]]:
    """Greedy token ids and their logprobs for PROMPT."""
    body = {"model": server.model, "prompt": PROMPT, "max_tokens": 12, "temperature": 0.0, "logprobs": 1}
    body |= {"return_token_ids": True, "ignore_eos": True}
    response = requests.post(f"{server.url}/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    return choice["token_ids"], choice["logprobs"]["token_logprobs"]


def served(server: Server, model_dir: Path) -> Server:
    server.model = str(model_dir)  # type: ignore[attr-defined]
    return server


def init(server: Server, quantization: str | None) -> requests.Response:
    info = {"root": "test", "quantization": quantization}
    return server.post("/init_weight_transfer_engine", {"init_info": info})


def assert_same_bits(actual: dict, expected: dict) -> None:
    assert actual.keys() == expected.keys()
    for name, t in expected.items():
        assert actual[name].dtype == t.dtype and actual[name].shape == t.shape, name
        assert torch.equal(actual[name].view(torch.uint8), t.view(torch.uint8)), name


def publish(model_dir: Path, root: Path) -> list[dict[str, torch.Tensor]]:
    """Steps 0 (the model folder's weights, an anchor) to 3 through a quantized root; their bf16 states."""
    states = [load_file(model_dir / "model.safetensors")]
    with Publisher(root, model="tiny", config=PublisherConfig(quantization=RECIPE)) as publisher:
        for step in range(4):
            if step:
                states.append(perturb(states[-1], step, big=False))
            publisher.publish(states[-1], step)
            publisher.flush()
    return states


def test_quantized_replica_follows_three_steps_bit_for_bit(tmp_path):
    model_dir = ensure_tiny_model(default_model_dir())
    root = tmp_path / "root"
    states = publish(model_dir, root)
    head = read_head(open_storage(root))
    anchor, deltas = head.anchors[0], head.deltas
    assert [e.step for e in deltas] == [1, 2, 3] and anchor.step == 0

    with stock_server(model_dir, tmp_path / "replica", *FLAGS, env=ENV) as server:
        server = served(server, model_dir)
        refused = init(server, None)  # a replica of another quantization than the root's: one line
        assert refused.status_code != 200 and "this server serves fp8_per_channel" in refused.text
        assert init(server, RECIPE).status_code == 200, "init"
        # Loaded by vLLM from the bf16 checkpoint, the replica holds what the trainer's recipe made of it.
        assert server.verify(0, anchor.quantized).status_code == 200
        held = anchor.quantized
        for entry in deltas:
            paths = [str(root / f) for f in entry.files]
            if entry.step == 3:  # first a corrupt and a foreign quantized delta: refused, nothing written
                before = server.readback()
                data = (root / entry.files[1]).read_bytes()
                corrupt, foreign = tmp_path / "corrupt.safetensors", tmp_path / "foreign.safetensors"
                corrupt.write_bytes(data[:-64] + bytes(b ^ 0x5A for b in data[-64:]))
                foreign.write_bytes(data.replace(RECIPE.encode(), b"int8_per_channel"[: len(RECIPE)]))
                for bad, reasons in (
                    (corrupt, ("corrupt", "reaches")),
                    (foreign, ("a delta for quantization",)),
                ):
                    update = {"base": held, "fingerprint": entry.quantized, "paths": [paths[0], str(bad)]}
                    response = server.update(step=3, kind="delta", **update)
                    assert response.status_code == 500, response.text
                    assert any(r in response.text for r in reasons), response.text
                assert_same_bits(server.readback(), before)
            response = server.update(
                step=entry.step, kind="delta", paths=paths, base=held, fingerprint=entry.quantized
            )
            assert response.status_code == 200, response.text
            assert server.verify(entry.step, entry.quantized).status_code == 200
            held = entry.quantized
        followed, followed_out = server.readback(), generate(server)

    checkpoint = tmp_path / "step-3"
    shutil.copytree(model_dir, checkpoint, ignore=shutil.ignore_patterns("model.safetensors"))
    save_file(states[3], checkpoint / "model.safetensors", metadata={"format": "pt"})
    with stock_server(checkpoint, tmp_path / "fresh", *FLAGS, env=ENV) as fresh:
        fresh = served(fresh, checkpoint)
        assert init(fresh, RECIPE).status_code == 200
        fresh_weights, fresh_out = fresh.readback(), generate(fresh)

    quantized = quantize_state(states[3], recipe(RECIPE))
    assert {n for n in followed if n.endswith(SCALE)} == {n + SCALE for n in quantized}
    assert_same_bits(followed, fresh_weights)  # codes, scales and the bf16 tensors, bit for bit
    for name, q in quantized.items():  # and the trainer's recipe made the same
        assert torch.equal(followed[name].view(torch.uint8), q.codes.view(torch.uint8))
        assert torch.equal(followed[name + SCALE], q.scales)
    assert followed_out == fresh_out


def test_deltasync_follow_keeps_a_quantized_replica_on_the_root(tmp_path):
    model_dir = ensure_tiny_model(default_model_dir())
    root = tmp_path / "root"
    states = publish(model_dir, root)
    with stock_server(model_dir, tmp_path / "replica", *FLAGS, env=ENV) as server:
        argv = [sys.executable, "-m", "deltasync.cli", "follow", str(root), "--vllm-url", server.url]
        argv += ["--replica", REPLICA, "--poll-s", "0.2", "--verify-every", "1"]
        bf16 = start_process(argv, tmp_path / "bf16.log", CODE_UNDER_TEST, cpus=CPUS.others)
        bf16.wait(timeout=120)  # a follower that does not say the server's quantization: refused at once
        assert (
            bf16.returncode != 0
            and "this server serves fp8_per_channel" in (tmp_path / "bf16.log").read_text()
        )
        argv += ["--quantization", RECIPE]
        follower = start_process(argv, tmp_path / "follow.log", CODE_UNDER_TEST, cpus=CPUS.others)
        try:
            record = root / f"{telemetry.REPLICAS_DIR}/{REPLICA}/step-{3:08d}.json"
            wait_for(record.exists, f"step 3 applied; log {tmp_path / 'follow.log'}", 300)
            weights = server.readback()
        finally:
            stop_process(follower, grace_s=30)
    for step in range(4):  # the anchor through the engine, then each delta, each read back and verified
        path = root / f"{telemetry.REPLICAS_DIR}/{REPLICA}/step-{step:08d}.json"
        record = telemetry.from_json(telemetry.ReplicaRecord, path.read_bytes(), str(path))
        assert record.verified and record.error is None, step
    quantized = quantize_state(states[3], recipe(RECIPE))
    for name, t in weights.items():
        if name.endswith(SCALE):
            assert torch.equal(t, quantized[name.removesuffix(SCALE)].scales), name
        elif name in quantized:
            assert torch.equal(t.view(torch.uint8), quantized[name].codes.view(torch.uint8)), name
        else:
            assert torch.equal(t.view(torch.int16), states[3][name].view(torch.int16)), name
    assert set(quantized) < set(weights)
