"""The run's first state by reference: a Hub model repository at a commit instead of an anchor in the root
(deltasync.sync.base): what run.json and the head say, what readers accept, and what they refuse."""

import dataclasses
import json

import pytest

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
