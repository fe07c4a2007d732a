"""A quantized root: the publisher's steps (bf16 patch of the tensors the recipe leaves alone, plus the
quantized delta) take a replica's quantized state to the quantization of each published bf16 state, bit for
bit; a corrupt or foreign file is refused in one line before anything is written."""

import json

import pytest
import torch
from safetensors.torch import load_file

from deltasync.errors import ManifestError, PatchError
from deltasync.quant.delta import FORMAT
from deltasync.quant.recipe import recipe
from deltasync.quant.root import Replica
from deltasync.quant.state import quantize_state
from deltasync.storage import open_storage
from deltasync.sync.protocol import Head, RunInfo, parse_data_path, read_head, read_run
from deltasync.sync.publisher import Publisher, PublisherConfig
from deltasync.sync.subscriber import FileApplier, Subscriber, SyncError
from tests.helpers import assert_bitwise_equal, bf16, make_params, train_step

RECIPE = "fp8_per_channel"


def publish(root, steps: int) -> list[dict[str, torch.Tensor]]:
    """`steps` states through a quantized root (step 0 an anchor); every step's bf16 state."""
    params, states = make_params(), []
    config = PublisherConfig(quantization=RECIPE, encoding="compact")
    with Publisher(root, model="tiny", config=config) as publisher:
        for step in range(steps):
            if step:
                train_step(params, step, density=0.05)
            publisher.publish(params, step=step)
            publisher.flush()
            states.append(bf16(params))
    return states


def test_replica_follows_three_steps_bit_for_bit(tmp_path):
    states = publish(tmp_path, 4)
    storage, head, run = (
        open_storage(tmp_path),
        read_head(open_storage(tmp_path)),
        read_run(open_storage(tmp_path)),
    )
    assert run.quantization == RECIPE
    anchor = head.anchors[0]
    replica = Replica(load_file(tmp_path / anchor.files[0]), recipe(RECIPE))
    assert replica.fingerprint == int(anchor.quantized, 16)  # a load through vLLM's recipe, as a replica's
    assert len(head.deltas) == 3
    for entry in head.deltas:
        assert entry.files[1].endswith(".quant.safetensors")
        assert parse_data_path(entry.files[1]) == (
            "delta",
            entry.step,
            entry.files[0].split("-", 2)[2][:-12],
            1,
        )
        replica.apply(*(storage.read_bytes(f) for f in entry.files))
        assert replica.fingerprint == int(entry.quantized, 16)
        expected = quantize_state(states[entry.step], recipe(RECIPE))
        for name, q in expected.items():  # codes and scales, bit for bit
            assert torch.equal(replica.quantized[name].codes.view(torch.uint8), q.codes.view(torch.uint8))
            assert torch.equal(replica.quantized[name].scales.view(torch.int32), q.scales.view(torch.int32))
        assert_bitwise_equal(replica.rest, {n: t for n, t in states[entry.step].items() if n not in expected})
    assert set(replica.quantized) == {"model.layers.0.mlp.up_proj.weight"}  # not the embedding, not a bias


class ReplicaApplier(FileApplier):
    """A Subscriber's target that holds a quantized replica (`quant.root.Replica`) as vLLM's engine does."""

    quantization = RECIPE

    def __init__(self) -> None:
        self.replica: Replica | None = None
        self.anchors = 0

    def load_files(self, files, step, fingerprint):
        self.replica, self.anchors = Replica(load_file(files[0]), recipe(RECIPE)), self.anchors + 1
        assert self.replica.fingerprint == fingerprint

    def patch_bytes(self, parts, step, base, fingerprint):
        assert self.replica is not None and self.replica.fingerprint == base
        self.replica.apply(*parts)
        assert self.replica.fingerprint == fingerprint

    def fingerprint(self):
        return self.replica.fingerprint if self.replica else None


def test_subscriber_continues_from_the_quantized_state_it_holds(tmp_path):
    """Each new step applies to the replica's quantized state (its fingerprint is the entries' `quantized`),
    not replayed from the anchor."""
    target, params = ReplicaApplier(), make_params()
    subscriber = Subscriber(tmp_path, target, verify_every=1)
    with Publisher(tmp_path, model="tiny", config=PublisherConfig(quantization=RECIPE)) as publisher:
        for step in range(3):
            if step:
                train_step(params, step, density=0.05)
            publisher.publish(params, step=step)
            publisher.flush()
            assert [a.step for a in subscriber.sync()] == [step]
    assert target.anchors == 1


def test_corrupt_or_foreign_quantized_delta_is_refused_before_any_write(tmp_path):
    publish(tmp_path, 2)
    storage, head = open_storage(tmp_path), read_head(open_storage(tmp_path))
    bf16_patch, quantized = (storage.read_bytes(f) for f in head.deltas[0].files)

    def fresh() -> Replica:
        return Replica(load_file(tmp_path / head.anchors[0].files[0]), recipe(RECIPE))

    header = int.from_bytes(quantized[:8], "little")
    meta = json.loads(quantized[8 : 8 + header])
    foreign = dict(meta, __metadata__=dict(meta["__metadata__"], recipe="int8_per_channel_weight_only"))
    text = json.dumps(foreign).encode().ljust(header)
    cases = {
        "corrupt": quantized[:-7] + bytes(7),
        "foreign": quantized[:8] + text + quantized[8 + header :],
        "not a delta": bf16_patch,
    }
    for what, data in cases.items():
        replica = fresh()
        before = {n: (q.codes.clone(), q.scales.clone()) for n, q in replica.quantized.items()}
        rest = {n: t.clone() for n, t in replica.rest.items()}
        with pytest.raises(PatchError) as refused:
            replica.apply(bf16_patch, data)
        assert "\n" not in str(refused.value), what
        for name, (codes, scales) in before.items():  # nothing written: neither file's changes
            assert torch.equal(replica.quantized[name].codes.view(torch.uint8), codes.view(torch.uint8))
            assert torch.equal(replica.quantized[name].scales, scales)
        assert_bitwise_equal(replica.rest, rest)
    assert FORMAT in json.dumps(meta)


def test_bf16_reader_and_other_recipe_refuse_in_one_line(tmp_path):
    publish(tmp_path, 2)
    with pytest.raises(SyncError, match="quantized fp8_per_channel"):
        Subscriber(tmp_path).sync()
    with pytest.raises(
        ValueError, match="the run is quantized fp8_per_channel, this publisher's config says None"
    ):
        Publisher(tmp_path, model="tiny")


def test_resumed_quantized_root_starts_a_chain_at_an_anchor(tmp_path):
    states = publish(tmp_path, 2)
    params = make_params()
    config = PublisherConfig(quantization=RECIPE)
    with Publisher(tmp_path, model="tiny", config=config) as publisher:
        train_step(params, 1, density=0.05)
        train_step(params, 2, density=0.05)
        publisher.publish(params, step=2)
        publisher.flush()
        publisher.publish({n: t + 0.01 for n, t in params.items()}, step=3)
    head = read_head(open_storage(tmp_path))
    assert [(e.step, e.kind) for e in head.entries][-2:] == [(2, "anchor"), (3, "delta")]
    assert states  # the first run's chain is garbage once the new anchor is retained


def test_manifests_check_the_quantized_fields():
    run = RunInfo.of("tiny", {"w": torch.zeros(2, 2)}, quantization="Fp8!")
    with pytest.raises(ManifestError, match="is not a recipe name"):
        RunInfo.from_json(run.to_json())
    entry = {"step": 1, "kind": "delta", "files": ["deltas/step-00000001.safetensors"], "bytes": 1}
    entry |= {"fingerprint": "0" * 16, "published_at": 0.0, "base_step": 0, "quantized": "0" * 16}
    anchor = {"step": 0, "kind": "anchor", "files": ["anchors/step-00000000/model.safetensors"], "bytes": 1}
    anchor |= {"fingerprint": "0" * 16, "published_at": 0.0}
    head = {"version": 1, "step": 1, "fingerprint": "0" * 16, "entries": [anchor, entry]}
    with pytest.raises(ManifestError, match="are not where a delta of step 1 lives"):
        Head.from_json(json.dumps(head).encode())  # a quantized delta is two files
    entry["files"].append("deltas/step-00000001.quant.safetensors")
    assert Head.from_json(json.dumps(head).encode()).entries[1].quantized == "0" * 16
