"""Adapter mode: a PEFT LoRA model's syncs publish its adapter (not TRL's merged weights) to a LoRA root,
which the `deltasync` resolver turns back into the very adapter; rollouts name each request's adapter
version, which is then their exact weight version."""

import asyncio
import multiprocessing

import peft
import pytest
import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from deltasync.sync.subscriber import Subscriber
from deltasync.trl import BucketWeightTransfer
from deltasync.trl.rollout import VERSION_KNOWN, WEIGHT_VERSION
from deltasync.vllm.lora import DeltasyncLoRAResolver
from tests.deltasync.trl.test_rollout import rollout_loop, running, tokenizer  # noqa: F401 (a fixture)
from tests.deltasync.trl.test_transfer import optimizer_step, small_qwen3
from tests.helpers import assert_bitwise_equal, bf16
from trainer.processes import serving_in_thread


def lora_model() -> torch.nn.Module:
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    return peft.get_peft_model(small_qwen3(tied=True, dtype=torch.float32, device="cpu"), config)


def trl_sync(transfer: BucketWeightTransfer, model) -> None:
    """What AsyncGRPOTrainer does with an injected weight transfer and a PEFT model: merge, send the base
    weights under their checkpoint names, unmerge."""
    model.merge_adapter()
    try:
        base = model.base_model.model
        transfer.send_weights((n.replace(".base_layer", ""), p.detach()) for n, p in base.named_parameters())
    finally:
        model.unmerge_adapter()


def adapter_state(model) -> dict[str, torch.Tensor]:
    return bf16(peft.get_peft_model_state_dict(model, save_embedding_layers=False))


def test_syncs_publish_the_adapter_which_resolves_to_a_peft_adapter(tmp_path):
    model = lora_model()
    transfer = BucketWeightTransfer(tmp_path / "root", model_id="tiny-base", lora_name="policy")
    transfer.use_model(model)
    states = []
    for step in range(3):
        if step:
            optimizer_step(model, lr=1e-2)  # the base weights too: they are not what is published
        trl_sync(transfer, model)
        transfer.publisher.flush()
        states.append(adapter_state(model))
    transfer.destroy()

    reader = Subscriber(str(tmp_path / "root"))
    reader.sync(1)
    assert_bitwise_equal(reader.state, states[1])
    assert reader.run.model == "tiny-base"
    config = reader.run.lora["adapter_config"]
    assert reader.run.lora["name"] == "policy" and config["base_model_name_or_path"] == "tiny-base"
    assert (config["peft_type"], config["r"]) == ("LORA", 4)
    assert sorted(config["target_modules"]) == ["q_proj", "v_proj"]

    (tmp_path / "cache").mkdir()
    resolver = DeltasyncLoRAResolver(str(tmp_path / "root"), tmp_path / "cache")
    request = asyncio.run(resolver.resolve_lora("tiny-base", "policy-v2"))
    # PEFT loads what the resolver wrote as an adapter of the base model, holding step 2's tensors
    loaded = peft.PeftModel.from_pretrained(small_qwen3(True, torch.float32, "cpu"), request.lora_path)
    assert_bitwise_equal(adapter_state(loaded), states[2])


def test_adapter_mode_needs_a_peft_model(tmp_path):
    transfer = BucketWeightTransfer(tmp_path / "root", model_id="tiny-base", lora_name="policy")
    with pytest.raises(ValueError, match="train with peft_config"):
        transfer.use_model(small_qwen3(tied=True, dtype=torch.float32, device="cpu"))


def test_adapters_vllm_cannot_serve_are_refused(tmp_path):
    config = peft.LoraConfig(r=4, target_modules=["q_proj"], use_dora=True)
    model = peft.get_peft_model(small_qwen3(tied=True, dtype=torch.float32, device="cpu"), config)
    with pytest.raises(ValueError, match="DoRA"):
        BucketWeightTransfer(tmp_path / "root", model_id="tiny-base", lora_name="policy").use_model(model)


def test_rollouts_name_their_adapter_version_which_stamps_them(tokenizer):  # noqa: F811
    app, models = FastAPI(), []

    @app.post("/v1/completions")
    async def completions(request: Request):  # stock vLLM: no version headers
        models.append((await request.json())["model"])
        choice = {"token_ids": [tokenizer.eos_token_id], "logprobs": {"token_logprobs": [-0.5]}, "text": ""}
        return JSONResponse({"choices": [choice]})

    buffer = multiprocessing.get_context("spawn").Queue()
    with serving_in_thread(app) as url:
        # TRL's version 1 is published step 2: the adapter policy-v2
        loop = rollout_loop(url, tokenizer, buffer, version_base=2, lora_name="policy", max_inflight_tasks=2)
        with running(loop):
            samples = [buffer.get(timeout=60) for _ in range(4)]
    assert set(models) == {"policy-v2"}
    for sample in samples:
        assert sample.metrics[WEIGHT_VERSION] == 2.0 and sample.metrics[VERSION_KNOWN] == 1.0
        assert sample.model_version == 1
