"""A LoRA run end to end: TRL's AsyncGRPOTrainer trains a PEFT LoRA on the tiny model (examples/grpo_bucket.py
--lora_r 8) against stock vLLM (CPU) whose only deltasync part is the LoRA resolver, turned on by the root in
its environment. Every request names its adapter version, which the resolver fetches from the root."""

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests
import torch

from deltasync import telemetry
from deltasync.storage import open_storage
from deltasync.sync.protocol import read_head
from deltasync.sync.publisher import Publisher
from deltasync.trl.preflight import preflight
from tests.deltasync.vllm.test_follow import Server, stock_server
from tests.deltasync.vllm.test_moe import ENV, PROMPT
from tests.trainer.test_example import STEPS, run_example
from tests.trainer.test_train_e2e import replica
from trainer.tiny_model import build_tiny_model

pytestmark = pytest.mark.slow  # starts vLLM and trains

FLAGS = ("--max-model-len", "512", "--enable-lora", "--max-lora-rank", "8", "--max-loras", "8")


def greedy(server: Server, model: str) -> dict:
    body = {"model": model, "prompt": PROMPT, "max_tokens": 12, "temperature": 0.0, "logprobs": 0}
    response = server.post("/v1/completions", {**body, "return_token_ids": True})
    assert response.status_code == 200, response.text
    return response.json()


def test_trl_trains_a_lora_that_stock_vllm_serves_by_version(tmp_path):
    model = build_tiny_model(tmp_path / "tiny", wordle=True)
    root, out = tmp_path / "root", tmp_path / "out"
    env = {**ENV, "DELTASYNC_LORA_ROOT": str(root), "DELTASYNC_LORA_CACHE": str(tmp_path / "cache")}
    env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "1"
    with stock_server(model, tmp_path, *FLAGS, env=env) as server:
        # a reward the tiny model earns, and a learning rate that moves a LoRA visibly in 3 steps
        script = Path(__file__).with_name("lora_example.py")
        run_example(model, root, server.url, out, "--lora_r", "8", "--learning_rate", "3e-2", script=script)
        assert read_head(open_storage(root)).step == STEPS  # the cold sync is step 0
        for step in range(1, STEPS + 1):  # every trained rollout named its adapter: its version is exact
            record = root / telemetry.TRAINER_DIR / f"step-{step:08d}.json"
            info = telemetry.from_json(telemetry.TrainerRecord, record.read_bytes()).info
            assert info["version_known"] == 1.0, info

        # The trainer's own adapter, saved by TRL at the last step, loaded from disk by the same server.
        saved = {"lora_name": "saved", "lora_path": str(out / f"checkpoint-{STEPS}")}
        assert server.post("/v1/load_lora_adapter", saved).status_code == 200
        ours, theirs = greedy(server, f"policy-v{STEPS}"), greedy(server, "saved")
        assert ours["choices"][0]["token_ids"] == theirs["choices"][0]["token_ids"]
        assert ours["choices"][0]["logprobs"] == theirs["choices"][0]["logprobs"]
        base = greedy(server, str(model))  # the adapter changes what the model says
        assert base["choices"][0]["logprobs"] != ours["choices"][0]["logprobs"]

        # Two versions at once, each answered by its own adapter and tagged with its name.
        with ThreadPoolExecutor(2) as pool:
            first, last = pool.map(lambda name: greedy(server, name), ["policy-v1", f"policy-v{STEPS}"])
        assert (first["model"], last["model"]) == ("policy-v1", f"policy-v{STEPS}")
        assert first["choices"][0]["logprobs"] != last["choices"][0]["logprobs"]
        assert last["choices"][0]["logprobs"] == ours["choices"][0]["logprobs"]

        # A version not published yet: 404, which a rollout worker retries; the server says why in one line.
        response = server.post("/v1/completions", {"model": "policy-v99", "prompt": PROMPT, "max_tokens": 1})
        assert response.status_code == 404, response.text
        assert (
            f"LoRA adapter policy-v99: step 99 is not in {root} yet (head {STEPS})" in server.log.read_text()
        )


def test_the_inference_space_serves_a_lora_root_by_version(tmp_path):
    model = build_tiny_model(tmp_path / "tiny", wordle=True)
    root, g = tmp_path / "root", torch.Generator().manual_seed(0)
    config = {"peft_type": "LORA", "r": 8, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]}
    shapes = {"q_proj": (8, 128, 128), "v_proj": (8, 128, 64)}  # rank, in, out: the tiny model's
    adapter = {}
    for layer in range(2):
        for module, (r, n_in, n_out) in shapes.items():
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            adapter[f"{prefix}.lora_A.weight"] = 0.3 * torch.randn(r, n_in, generator=g)
            adapter[f"{prefix}.lora_B.weight"] = 0.3 * torch.randn(n_out, r, generator=g)
    lora = {"name": "policy", "adapter_config": {**config, "base_model_name_or_path": str(model)}}
    with Publisher(root, model=str(model), lora=lora) as publisher:
        for step in range(2):
            publisher.publish({n: t * (1 + step) for n, t in adapter.items()}, step=step)
            publisher.flush()  # each step stored, none folded into the next

    with replica(tmp_path, root, model, name="lora-replica") as url:

        def complete(name: str) -> requests.Response:
            body = {"model": name, "prompt": PROMPT, "max_tokens": 8, "temperature": 0.0, "logprobs": 0}
            return requests.post(f"{url}/v1/completions", json=body, timeout=120)

        base, first, second = (complete(name) for name in (str(model), "policy-v0", "policy-v1"))
        assert [r.status_code for r in (base, first, second)] == [200] * 3, second.text
        assert (first.json()["model"], second.json()["model"]) == ("policy-v0", "policy-v1")
        logprobs = [r.json()["choices"][0]["logprobs"]["token_logprobs"] for r in (base, first, second)]
        assert logprobs[0] != logprobs[1] != logprobs[2]  # the base model and two adapters
        assert complete("policy-v2").status_code == 404  # not published yet
        status = requests.get(f"{url}/weights", timeout=10).json()
        assert status["adapters"] == ["policy-v0", "policy-v1"] and status["head_step"] == 1
        assert status["last_error"] == f"LoRA adapter policy-v2: step 2 is not in {root} yet (head 1)"
        # What a trainer's preflight reads there: the adapter's parameters, LoRA up to the adapter's rank.
        schema = {n: list(t.shape) for n, t in adapter.items()}
        assert preflight(root, schema, str(model), [url], lora_rank=8) is None
        # A trainer of all the weights: refused by the root (a LoRA run), and by the replica on a new root.
        assert "holds a LoRA run" in preflight(root, schema, str(model), [url])
        refused = preflight(tmp_path / "new-root", schema, str(model), [url])
        assert (
            refused
            == f"inference server {url} serves LoRA adapters, not full weights (a Space: unset MAX_LORA_RANK)"
        )
