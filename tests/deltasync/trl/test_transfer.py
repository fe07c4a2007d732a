"""BucketWeightTransfer: TRL's weight-transfer calls, published to a sync root exactly (bf16) and in order."""

import pytest
import torch
from huggingface_hub import constants as hf_constants
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, Qwen3Config, Qwen3ForCausalLM

from deltasync import telemetry
from deltasync.codec.fingerprint import format_fingerprint, state_fingerprint
from deltasync.storage import open_storage
from deltasync.sync.protocol import HEAD_PATH, read_run
from deltasync.sync.publisher import PublisherConfig
from deltasync.sync.subscriber import Subscriber
from deltasync.trl.preflight import schema_of
from deltasync.trl.transfer import BucketWeightTransfer
from tests.deltasync.sync.test_single_writer import Stalling
from tests.fakemodels import client_on
from trainer.tiny_model import build_tiny_model

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def small_qwen3(tied: bool, dtype: torch.dtype, device: str) -> torch.nn.Module:
    config = Qwen3Config(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        tie_word_embeddings=tied,
    )
    torch.manual_seed(0)
    return Qwen3ForCausalLM(config).to(device=device, dtype=dtype)


def trl_stream(model: torch.nn.Module):
    """What AsyncGRPOTrainer._streaming_iter yields: live parameters (tied ones once), HF names."""
    return ((name, p.detach()) for name, p in model.named_parameters())


def sync(transfer: BucketWeightTransfer, model: torch.nn.Module) -> None:
    transfer.pause()
    transfer.send_weights(trl_stream(model))
    transfer.resume()


def optimizer_step(model: torch.nn.Module, lr: float = 2e-5) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.add_(lr * torch.randn_like(p))


def published_state(root) -> dict[str, torch.Tensor]:
    reader = Subscriber(str(root))
    reader.sync()
    return reader.state


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_sync_is_published_exactly(tmp_path, device, tied, dtype):
    model = small_qwen3(tied, dtype, device)
    infos = iter([{"reward_mean": 0.5}, {"reward_mean": 0.75}, {"reward_mean": 1.0}])
    transfer = BucketWeightTransfer(tmp_path / "root", model_id="small", info=lambda: next(infos))
    transfer.init_weight_transfer()
    sync(transfer, model)  # the cold sync before step 1
    for _ in range(2):
        transfer.publisher.flush()  # as slow as a real step: no coalescing of pending steps
        optimizer_step(model)
        sync(transfer, model)
    transfer.destroy()
    transfer.destroy()  # TRL's finally, then the trainer's: the second does nothing

    assert (transfer.first_step, transfer.last_step) == (0, 2) and len(transfer.blocked_s) == 3
    state = published_state(tmp_path / "root")
    names = [n for n, _ in model.named_parameters()]
    assert list(state) == names and ("lm_head.weight" in names) != tied  # tied: the embedding only
    for name, p in model.named_parameters():
        assert torch.equal(state[name], p.detach().cpu().to(torch.bfloat16)), name
    assert format_fingerprint(transfer.fingerprint_now()) == transfer.publisher.head.fingerprint
    files = [tmp_path / "root" / telemetry.TRAINER_DIR / f"step-{s:08d}.json" for s in range(3)]
    records = [telemetry.from_json(telemetry.TrainerRecord, f.read_bytes()) for f in files]
    assert records[0].kind == "anchor" and [r.kind for r in records[1:]] == ["delta", "delta"]
    assert [r.info["reward_mean"] for r in records] == [0.5, 0.75, 1.0]
    assert all(r.blocked_s > 0 for r in records)


def test_moe_experts_are_published_under_checkpoint_names(tmp_path):
    # transformers holds each layer's experts fused (mlp.experts.gate_up_proj); the checkpoint, vLLM's loader
    # and the sync root hold one tensor per expert and projection.
    folder = build_tiny_model(tmp_path / "moe", moe=True)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    assert "model.layers.0.mlp.experts.gate_up_proj" in dict(model.named_parameters())
    transfer = BucketWeightTransfer(tmp_path / "root")
    transfer.use_model(model)
    sync(transfer, model)
    transfer.publisher.flush()
    optimizer_step(model)
    sync(transfer, model)
    transfer.destroy()

    model.save_pretrained(tmp_path / "saved")
    saved = load_file(tmp_path / "saved" / "model.safetensors")
    state = published_state(tmp_path / "root")
    assert "model.layers.0.mlp.experts.7.down_proj.weight" in state
    assert {n: list(t.shape) for n, t in state.items()} == schema_of(model)
    assert state.keys() == saved.keys()
    assert all(torch.equal(state[n], saved[n].to(torch.bfloat16)) for n in state)
    assert format_fingerprint(transfer.fingerprint_now()) == transfer.publisher.head.fingerprint


def test_dense_models_are_published_as_handed(tmp_path):
    transfer = BucketWeightTransfer(tmp_path / "root")
    transfer.use_model(small_qwen3(True, torch.float32, "cpu"))
    assert transfer.to_checkpoint is None  # no conversion, no copy


def test_send_weights_copies_the_live_tensors(tmp_path):
    # The trainer goes on updating its parameters right after send_weights returns.
    model = small_qwen3(True, torch.float32, "cpu")
    transfer = BucketWeightTransfer(tmp_path / "root", config=PublisherConfig(encoding="raw"))
    sync(transfer, model)
    expected = {n: p.detach().to(torch.bfloat16).clone() for n, p in model.named_parameters()}
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(-3.0)  # while the publisher may still be encoding
    transfer.destroy()
    state = published_state(tmp_path / "root")
    assert all(torch.equal(state[n], t) for n, t in expected.items())


def test_restart_continues_the_chain_from_the_head(tmp_path):
    root = tmp_path / "root"
    model = small_qwen3(True, torch.float32, "cpu")
    first = BucketWeightTransfer(root)
    for _ in range(3):
        sync(first, model)
        optimizer_step(model)
    first.destroy()  # head: step 2; the model has moved on once more since

    # A restart whose weights are the head's (what the trainer loads on resume): the cold sync adds no step.
    resumed = small_qwen3(True, torch.float32, "cpu")
    state = published_state(root)
    with torch.no_grad():
        for name, p in resumed.named_parameters():
            p.copy_(state[name])
    second = BucketWeightTransfer(root)
    sync(second, resumed)
    assert second.first_step == 2 and second.last_step == 2
    optimizer_step(resumed)
    sync(second, resumed)
    assert second.last_step == 3
    # Different weights on restart are a new step of their own.
    third_model = small_qwen3(True, torch.float32, "cpu")
    second.destroy()
    third = BucketWeightTransfer(root)
    sync(third, third_model)
    third.destroy()
    assert third.first_step == 4
    reader = Subscriber(str(root))
    reader.sync()
    expected = state_fingerprint(
        {n: p.detach().to(torch.bfloat16) for n, p in third_model.named_parameters()}
    )
    assert reader.step == 4 and reader.fingerprint == expected


def test_pause_and_resume_never_block(tmp_path):
    """pause() and resume() return while a step's upload is in progress: inference never waits for it."""
    model = small_qwen3(tied=False, dtype=torch.float32, device="cpu")
    storage = Stalling(tmp_path, step=0)  # the cold sync's head write waits for `release`
    transfer = BucketWeightTransfer(storage)
    transfer.pause()  # nothing published yet: nothing to wait for either
    transfer.send_weights(trl_stream(model))
    assert storage.reached.wait(60)
    transfer.pause()  # had either waited for the upload, the stall would have ended and the head be written
    transfer.resume()
    assert transfer.publisher.head is None and storage.sizes([HEAD_PATH])[HEAD_PATH] is None
    storage.release.set()
    transfer.destroy()
    transfer.destroy()  # TRL's finally and the CLI may both close it
    reader = Subscriber(tmp_path)
    reader.sync()
    assert reader.step == 0 and transfer.publisher.head.step == 0


def test_send_weights_after_destroy_raises(tmp_path):
    """Else the step number would advance for weights that are never written."""
    model = small_qwen3(tied=True, dtype=torch.float32, device="cpu")
    transfer = BucketWeightTransfer(tmp_path / "root")
    sync(transfer, model)
    transfer.destroy()
    with pytest.raises(RuntimeError, match="closed"):
        sync(transfer, model)
    assert transfer.last_step == 0
    assert Subscriber(str(tmp_path / "root")).sync()[-1].step == 0


@pytest.mark.parametrize("kind", ["tied", "moe"])
def test_the_cold_sync_of_a_hub_model_goes_out_by_reference(fake_hub, tmp_path, monkeypatch, kind):
    # The model as the Hub holds it (its own save_pretrained), and the trainer that loaded it from there.
    if kind == "moe":
        folder = build_tiny_model(tmp_path / "moe", moe=True)  # experts fused in transformers, not on disk
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    else:
        model = small_qwen3(True, torch.float32, "cpu")  # the head tied to the embedding: stored once
        model.save_pretrained(folder := tmp_path / "saved")
    client_on(fake_hub, monkeypatch, tmp_path / "hf-cache")
    files = {p.name: p.read_bytes() for p in folder.iterdir() if p.suffix in (".json", ".safetensors")}
    commit = fake_hub.models.commit("user/model", files)
    root = "hf://buckets/user/sync/run"
    transfer = BucketWeightTransfer(root, model_id="user/model", model_revision="main")
    transfer.use_model(model)
    sync(transfer, model)
    for _ in range(2):
        transfer.publisher.flush()
        optimizer_step(model)
        sync(transfer, model)
    transfer.destroy()

    head = transfer.publisher.head
    assert [e.kind for e in head.entries] == ["base", "delta", "delta"]
    assert read_run(open_storage(root)).base.revision == commit
    assert not [r for r in fake_hub.requests if "/anchors/" in r]
    monkeypatch.setattr(hf_constants, "HF_HUB_CACHE", str(tmp_path / "replica-cache"))
    state = published_state(root)
    assert format_fingerprint(state_fingerprint(state)) == head.fingerprint
    assert format_fingerprint(transfer.fingerprint_now()) == head.fingerprint
