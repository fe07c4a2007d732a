"""A stock vLLM server started on the base model follows a root whose step 0 is that model by reference: the
follower downloads nothing for step 0 (the server's read-back shows it holds it), then applies the deltas and
reads back the trainer's weights bit for bit."""

import pytest
from safetensors.torch import load_file

from deltasync import telemetry
from deltasync.codec.fingerprint import format_fingerprint, state_fingerprint
from deltasync.storage import LocalStorage
from deltasync.sync.protocol import read_head
from deltasync.sync.publisher import Publisher
from tests.deltasync.vllm.test_follow import following, stock_server
from tests.fakemodels import client_on
from tests.helpers import assert_bitwise_equal, perturb, wait_for
from trainer.tiny_model import build_tiny_model

pytestmark = pytest.mark.slow  # starts vLLM

REPLICA = "replica-a"


def test_a_vllm_replica_started_on_the_base_model_follows_it_by_reference(fake_hub, tmp_path, monkeypatch):
    client_on(fake_hub, monkeypatch, tmp_path / "hf-cache")
    folder = build_tiny_model(tmp_path / "tiny-qwen3")
    files = {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()}
    commit = fake_hub.models.commit("user/tiny", files)
    root = tmp_path / "root"
    state = load_file(folder / "model.safetensors")
    states = []
    with Publisher(root, model="user/tiny", model_revision=commit) as publisher:
        for step in range(4):
            state = perturb(state, step, big=False) if step else state
            publisher.publish(state)
            publisher.flush()
            states.append(state)
    assert [e.kind for e in read_head(LocalStorage(root)).entries] == ["base", "delta", "delta", "delta"]
    fake_hub.requests.clear()  # (the publisher read the model's files)
    # The server on the commit's files (as `--model user/tiny --revision COMMIT` would load them)
    (tmp_path / "server").mkdir()
    with (
        stock_server(folder, tmp_path / "server", "--max-model-len", "512") as server,
        following(root, server, tmp_path / "follower.log", REPLICA),
    ):
        record = root / telemetry.REPLICAS_DIR / REPLICA / "step-00000003.json"
        wait_for(record.exists, f"step 3 applied; log {tmp_path / 'follower.log'}", 300)
        server.wait_version("3")
        assert_bitwise_equal(server.readback(), states[3])
    records = root / telemetry.REPLICAS_DIR / REPLICA
    first = telemetry.from_json(telemetry.ReplicaRecord, (records / "step-00000000.json").read_bytes())
    assert (first.kind, first.verified, first.error) == ("base", True, None)
    assert format_fingerprint(state_fingerprint(states[3])) == read_head(LocalStorage(root)).fingerprint
    assert not [r for r in fake_hub.requests if "user/tiny" in r]  # nothing asked of the model repository
