"""The run's first state by reference: a Hub model repository at a commit instead of an anchor in the root
(deltasync.sync.base): what run.json and the head say, what readers accept, and what they refuse."""

import dataclasses
import json

import pytest
from huggingface_hub import constants

from deltasync.errors import AnchorError, TransientStorageError
from deltasync.sync import base
from deltasync.sync.protocol import Entry, Head, ManifestError, ModelReference, RunInfo

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
    # huggingface_hub builds file URLs from the endpoint it found at import (the fake's is set after)
    template = fake_hub.endpoint + "/{repo_id}/resolve/{revision}/{filename}"
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", template)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf-cache"))
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
    fake_hub.fail_status = 503
    with pytest.raises(TransientStorageError, match="cannot reach the model repository"):
        base.resolve("user/tiny")
