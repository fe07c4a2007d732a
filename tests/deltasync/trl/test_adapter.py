"""Adapter mode: a PEFT LoRA model's syncs publish its adapter (not TRL's merged weights) to a LoRA root,
which the `deltasync` resolver turns back into the very adapter; rollouts name each request's adapter
version, which is then their exact weight version."""

import asyncio
import multiprocessing
from pathlib import Path

import peft
import pytest
import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from safetensors.torch import load_file

from deltasync.sync.publisher import PublisherConfig
from deltasync.sync.subscriber import Subscriber
from deltasync.trl import BucketWeightTransfer
from deltasync.trl.rollout import VERSION_KNOWN, WEIGHT_VERSION
from deltasync.vllm.lora import DeltasyncLoRAResolver
from tests.deltasync.sync.test_single_writer import Stalling
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


def test_every_step_handed_over_is_published_while_uploads_lag(tmp_path, monkeypatch):
    """Rollouts name `policy-v{step}` for each step a sync was handed: none may be folded into the next."""
    model = lora_model()
    storage = Stalling(tmp_path / "root", step=0)  # the cold sync's upload lasts until `release`
    config = PublisherConfig(keep_anchors=3)  # every step of the three retained
    transfer = BucketWeightTransfer(storage, model_id="tiny-base", config=config, lora_name="policy")
    transfer.use_model(model)
    transfer.init_weight_transfer()
    flush = transfer.publisher.flush

    def wait_for_upload(*args, **kwargs):  # a trainer that waits for the upload lets it end
        storage.release.set()
        flush(*args, **kwargs)

    monkeypatch.setattr(transfer.publisher, "flush", wait_for_upload)
    handed = {}
    for step in range(3):
        if step:
            optimizer_step(model, lr=1e-2)
        trl_sync(transfer, model)
        handed[transfer.last_step] = adapter_state(model)
    storage.release.set()
    transfer.destroy()

    (tmp_path / "cache").mkdir()
    resolver = DeltasyncLoRAResolver(str(tmp_path / "root"), tmp_path / "cache")
    for step, state in handed.items():
        request = asyncio.run(resolver.resolve_lora("tiny-base", f"policy-v{step}"))
        assert request is not None, resolver.last_error
        assert_bitwise_equal(load_file(Path(request.lora_path) / "adapter_model.safetensors"), state)
