"""The run's first state by reference: a Hub model repository at a commit instead of an anchor in the root
(deltasync.sync.base): what run.json and the head say, what readers accept, and what they refuse."""

import dataclasses
import json
import logging

import pytest
import torch
from huggingface_hub import constants
from safetensors.torch import load_file, save

from deltasync.codec import fingerprint
from deltasync.errors import AnchorError, SyncError, TransientStorageError
from deltasync.storage import LocalStorage, open_storage
from deltasync.sync import base
from deltasync.sync.gc import collect_garbage
from deltasync.sync.protocol import Entry, Head, ManifestError, ModelReference, RunInfo, read_head, read_run
from deltasync.sync.publisher import Publisher, PublisherConfig
from deltasync.sync.subscriber import FileApplier, Subscriber, TensorsApplier
from tests.fakemodels import client_on
from tests.helpers import bf16, bitwise_equal, make_params, train_step

SHA = "0123456789abcdef0123456789abcdef01234567"
REF = ModelReference("user/tiny", SHA, ("model.safetensors",))


def run_json(**fields) -> bytes:
    raw = json.loads(RunInfo("user/tiny", {"w": [2, 3]}).to_json())
    return json.dumps(raw | fields).encode()


def test_run_json_names_the_base_model_and_is_unchanged_without_one():
    run = RunInfo("user/tiny", {"w": [2, 3]}, base=REF)
    assert RunInfo.from_json(run.to_json()) == run
    assert json.loads(run.to_json())["base"] == {
        "repo": "user/tiny",
        "revision": SHA,
        "files": ["model.safetensors"],
    }
    assert "base" not in json.loads(dataclasses.replace(run, base=None).to_json())  # as older runs wrote it


@pytest.mark.parametrize(
    ("base", "problem"),
    [
        ({"repo": "user/tiny", "revision": "main", "files": ["model.safetensors"]}, "is not a commit sha"),
        ({"repo": "../up", "revision": SHA, "files": ["model.safetensors"]}, "is not a model repository id"),
        ({"repo": "user/tiny", "revision": SHA, "files": []}, "names no weight files"),
        ({"repo": "user/tiny", "revision": SHA, "files": ["../x.safetensors"]}, "x.safetensors"),
        ({"repo": "user/tiny", "revision": SHA, "files": ["model.bin"]}, "is not a safetensors file"),
        ({"repo": "user/tiny", "revision": SHA}, "missing fields"),
    ],
)
def test_a_bad_base_reference_is_refused_in_one_line(base, problem):
    with pytest.raises(ManifestError, match=problem) as refused:
        RunInfo.from_json(run_json(base=base))
    assert "\n" not in str(refused.value)


def entry(step: int, kind: str, files: tuple[str, ...] = (), base_step: int | None = None) -> Entry:
    return Entry(step, kind, files, 10, "00000000000000aa", 0.0, 0, base_step)


def test_a_head_may_start_at_the_base_model_and_only_there():
    delta = entry(1, "delta", ("deltas/step-00000001.safetensors",), 0)
    head = Head(1, "00000000000000aa", (entry(0, "base"), delta))
    assert Head.from_json(head.to_json()) == head
    assert head.anchors == [head.entries[0]] and head.files() == {"deltas/step-00000001.safetensors"}
    anchor = entry(0, "anchor", ("anchors/step-00000000/model.safetensors",))
    for entries, problem in [
        ((anchor, dataclasses.replace(head.entries[0], step=1)), "the base model can only start the chain"),
        ((dataclasses.replace(head.entries[0], files=("model.safetensors",)),), "names no files of the root"),
    ]:
        bad = Head(entries[-1].step, "00000000000000aa", entries)
        with pytest.raises(ManifestError, match=problem):
            Head.from_json(bad.to_json())


@pytest.fixture
def hub(fake_hub, tmp_path, monkeypatch):
    """The fake Hub, its model repositories downloaded to a cache of this test's own."""
    client_on(fake_hub, monkeypatch, tmp_path / "hf-cache")
    return fake_hub


def test_the_fake_hub_serves_model_repositories_to_the_real_client(hub):
    fake_hub = hub
    first = fake_hub.models.commit("user/tiny", {"model.safetensors": b"one", "config.json": b"{}"})
    ref = base.resolve("user/tiny")  # the main branch, pinned to its commit
    assert ref == ModelReference("user/tiny", first, ("model.safetensors",))
    second = fake_hub.models.commit("user/tiny", {"model.safetensors": b"two"})
    assert base.resolve("user/tiny").revision == second != first
    assert [p.read_bytes() for p in base.download(ref)] == [b"one"]  # a commit's files never change
    before = len(fake_hub.requests)
    assert [p.read_bytes() for p in base.download(ref)] == [b"one"]
    assert len(fake_hub.requests) == before  # cached: a commit's files are never asked for again
    fake_hub.models.forget("user/tiny", second)
    with pytest.raises(AnchorError, match=rf"user/tiny@{second}: not on the Hub \(RevisionNotFoundError\)"):
        base.download(ModelReference("user/tiny", second, ("model.safetensors",)))
    with pytest.raises(AnchorError, match="user/gone@main: not on the Hub"):
        base.resolve("user/gone")
    index = {"weight_map": {"w": "../elsewhere.safetensors"}}
    fake_hub.models.commit("user/odd", {"model.safetensors.index.json": json.dumps(index).encode()})
    with pytest.raises(AnchorError, match="user/odd@main cannot be named in run.json: .*elsewhere"):
        base.resolve("user/odd")
    fake_hub.fail_status = 503
    with pytest.raises(TransientStorageError, match="cannot reach the model repository"):
        base.resolve("user/tiny")


ROOT = "hf://buckets/user/sync/run"


def checkpoint(params: dict[str, torch.Tensor]) -> bytes:
    """`params` as a model repository holds them: an fp32 checkpoint (the run publishes them as bf16)."""
    return save({n: t.contiguous() for n, t in params.items()})


def publish(steps: int, revision: str = "main", params=None, root=ROOT, **options) -> list[dict]:
    """The trainer: `steps` + 1 states from `params` (the model's weights) on; returns them as bf16."""
    params = params or make_params()
    states = []
    with Publisher(root, model="user/tiny", model_revision=revision, **options) as publisher:
        for step in range(steps + 1):
            if step:
                train_step(params, step)
            publisher.publish(params)
            publisher.flush()  # every step its own delta
            states.append(bf16(params))
    return states


def replica(states, applier=None) -> Subscriber:
    target = applier or TensorsApplier({n: torch.zeros_like(t) for n, t in states[0].items()})
    return Subscriber(ROOT, target, prefetch=False)


def test_a_replica_follows_a_root_whose_step_0_is_the_model_repository(hub, tmp_path, monkeypatch):
    files = {"model.safetensors": checkpoint(make_params()), "config.json": b"{}"}
    sha = hub.models.commit("user/tiny", files)
    states = publish(3)
    storage = open_storage(ROOT)
    assert storage.list("anchors") == []  # the trainer uploaded no anchor
    assert read_run(storage).base == ModelReference("user/tiny", sha, ("model.safetensors",))
    head = read_head(storage)
    assert [(e.step, e.kind) for e in head.entries] == [(0, "base"), (1, "delta"), (2, "delta"), (3, "delta")]
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "replica-cache"))  # another machine's
    follower = replica(states)
    applied = follower.sync()
    assert [(a.step, a.kind) for a in applied] == [(0, "base"), (1, "delta"), (2, "delta"), (3, "delta")]
    assert bitwise_equal({n: t.to(torch.bfloat16) for n, t in follower.applier.tensors.items()}, states[3])
    assert f"GET /user/tiny/resolve/{sha}/model.safetensors" in hub.requests  # from the repository, by commit
    pulled = Subscriber(ROOT)  # `deltasync pull` of step 0: the base model itself
    pulled.sync(0)
    assert bitwise_equal(pulled.state, states[0])


class HeldWeights(FileApplier):
    """A vLLM server's side as the subscriber sees it: what it holds is read back, nothing else is asked."""

    def __init__(self, state: dict[str, torch.Tensor]):
        self.held = fingerprint.state_fingerprint(state)

    def load_files(self, files, step, fp):
        raise AssertionError("the base model is never loaded from files")

    def patch_bytes(self, parts, step, base, fp):
        raise AssertionError("not reached in these tests")

    def fingerprint(self) -> int:
        return self.held


def test_a_moved_revision_is_refused_in_one_line(hub, caplog):
    first = hub.models.commit("user/tiny", {"model.safetensors": checkpoint(make_params())})
    states = publish(0, revision=first)
    moved = make_params(seed=1)  # someone pushes other weights to main
    hub.models.commit("user/tiny", {"model.safetensors": checkpoint(moved)})
    # A vLLM server started on main holds them: its read-back says so, nothing is applied.
    with pytest.raises(SyncError) as refused:
        replica(states, HeldWeights(bf16(moved))).sync()
    line = str(refused.value)
    assert "\n" not in line and f"start vLLM with --model user/tiny --revision {first}" in line, line
    replica(states, HeldWeights(states[0])).sync()  # started on the commit, it holds step 0: nothing to load
    # A trainer that names a branch: resolved when publishing, the branch's weights are not its state.
    with caplog.at_level(logging.WARNING, logger="deltasync"):
        publish(0, revision="main", params=make_params(), root=f"{ROOT}-2")  # the old weights, a new run
    (warning,) = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert warning.startswith("step 0 goes out as an anchor, not by reference to user/tiny@main: ") and (
        "its weights have fingerprint" in warning
    ), warning
    assert [e.kind for e in read_head(open_storage(f"{ROOT}-2")).entries] == ["anchor"]


def test_a_model_repository_the_trainer_cannot_reach_is_not_waited_for(hub, caplog):
    hub.models.commit("user/tiny", {"model.safetensors": checkpoint(make_params())})
    hub.models.fail_status = 503
    with caplog.at_level(logging.WARNING, logger="deltasync"):
        states = publish(1)
    (warning,) = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert "step 0 goes out as an anchor" in warning and "cannot reach the model repository" in warning
    assert [e.kind for e in read_head(open_storage(ROOT)).entries] == ["anchor", "delta"]
    assert replica(states).sync()[-1].step == 1


def test_a_base_model_that_does_not_verify_is_refused_in_one_line(hub, tmp_path, monkeypatch):
    hub.models.commit("user/tiny", {"model.safetensors": checkpoint(make_params())})
    states = publish(1)
    cache = tmp_path / "replica-cache"
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    (blob,) = [p for p in cache.rglob("*") if p.is_file() and "blobs" in p.parts] or [None]
    assert blob is None  # nothing cached yet: the replica downloads, then its cached copy is damaged
    replica(states).sync()
    (blob,) = [p for p in cache.rglob("*") if p.is_file() and "blobs" in p.parts]
    tensors = load_file(blob)
    tensors["lm.bias"][0] += 1.0
    blob.write_bytes(save(tensors))
    follower = replica(states)
    with pytest.raises(SyncError) as refused:
        follower.sync()
    line = str(refused.value)
    assert "\n" not in line and "its weights have fingerprint" in line and follower.step is None, line


def test_an_unreachable_model_repository_is_retried(hub, tmp_path, monkeypatch):
    hub.models.commit("user/tiny", {"model.safetensors": checkpoint(make_params())})
    states = publish(2)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "replica-cache"))
    hub.models.fail_status = 503  # the bucket answers, the model repository does not
    follower = replica(states)
    with pytest.raises(SyncError) as failed:
        follower.sync()
    line = str(failed.value)
    assert "\n" not in line and "cannot reach the model repository user/tiny@" in line, line
    hub.models.fail_status = None
    assert [a.step for a in follower.sync()] == [0, 1, 2]


def test_gc_deletes_nothing_it_did_not_write(hub, tmp_path):
    hub.models.commit("user/tiny", {"model.safetensors": checkpoint(make_params())})
    root = tmp_path / "root"
    theirs = [root / "model.safetensors", root / "anchors" / "model.safetensors"]  # named as the repo's
    for path in theirs:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"not the publisher's")
    states = publish(4, root=root, config=PublisherConfig(anchor_every=2, keep_anchors=1))
    storage = LocalStorage(root)
    head = read_head(storage)
    assert [(e.step, e.kind) for e in head.entries] == [(4, "anchor")]  # the base model left the head
    collect_garbage(storage, grace_s=0)
    assert all(path.read_bytes() == b"not the publisher's" for path in theirs)
    assert read_run(storage).base is not None  # still what step 0 was
    reader = Subscriber(root)
    reader.sync()
    assert bitwise_equal(reader.state, states[4])


def test_a_lora_root_publishes_its_adapter_as_before(hub, tmp_path):
    hub.models.commit("user/tiny", {"model.safetensors": checkpoint(make_params())})
    lora = {"name": "policy", "adapter_config": {"r": 8}}
    with Publisher(tmp_path, model="user/tiny", lora=lora, model_revision="main") as publisher:
        publisher.publish(make_params())  # an adapter that happens to hold the base's tensors
    assert [e.kind for e in publisher.head.entries] == ["anchor"] and publisher.head.step == 0
    assert read_run(LocalStorage(tmp_path)).base is None
    assert not [r for r in hub.requests if "/api/models/" in r]  # the model repository is not even asked


def test_a_run_whose_step_0_is_the_base_model_is_continued(hub):
    hub.models.commit("user/tiny", {"model.safetensors": checkpoint(make_params())})
    publish(1)
    params = make_params()
    train_step(params, 7)
    with Publisher(ROOT, model="user/tiny", model_revision="main") as publisher:  # a restarted trainer
        assert publisher.last_step == 1
        publisher.publish(params)
    assert [e.kind for e in read_head(open_storage(ROOT)).entries] == ["base", "delta", "delta"]
    reader = Subscriber(ROOT)
    reader.sync()
    assert bitwise_equal(reader.state, bf16(params))
