"""Hostile and broken inputs: a replica fed a malformed file keeps following
and recovers, nothing is read whole before its size is checked, GC stays inside what it wrote, credentials
are never shown, and every CLI failure is one line."""

import importlib.util
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from deltasync.storage import TMP_MARK, LocalStorage, open_storage
from deltasync.sync import protocol
from deltasync.sync.gc import collect_garbage
from deltasync.sync.publisher import Publisher, PublisherConfig
from deltasync.sync.subscriber import MAX_ERROR_CHARS, Subscriber, SyncError
from tests.deltasync.codec.test_patch import DEEP, with_metadata
from tests.helpers import REPO, bf16, bitwise_equal, delta_file, make_params, run_steps, train_step, wait_for


def cli(*args, env=None):
    return subprocess.run(
        [sys.executable, "-m", "deltasync.cli", *map(str, args)],
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
    )


def one_line_error(r, *expected: str) -> None:
    assert r.returncode == 1, r.stdout
    assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr, r.stderr
    for text in expected:
        assert text in r.stderr, r.stderr


class Counting(LocalStorage):
    """A folder that counts head reads (polls) and the files it reads or copies out."""

    def __init__(self, root):
        super().__init__(root)
        self.polls, self.copied = 0, []

    def read_bytes(self, path, limit=None):
        self.polls += path == protocol.HEAD_PATH
        return super().read_bytes(path, limit)

    def _read_bytes(self, path, limit):
        data = super()._read_bytes(path, limit)
        self.copied.append(path)  # only once read: a refused file was not copied
        return data

    def _download_file(self, path, local):
        self.copied.append(path)
        super()._download_file(path, local)


def mirror(src: Path, dst: Path, head: bytes | None = None, files: dict[str, bytes] | None = None) -> None:
    """Copy the run in `src` to `dst` (data first, head last), with `files` and `head` replaced."""
    files = files or {}
    src_head = protocol.read_head(LocalStorage(src))
    for path in [protocol.RUN_PATH, *sorted(src_head.files())]:
        (dst / path).parent.mkdir(parents=True, exist_ok=True)
        if path in files:
            (dst / path).write_bytes(files[path])
        else:
            shutil.copyfile(src / path, dst / path)
    (dst / protocol.HEAD_PATH).parent.mkdir(parents=True, exist_ok=True)
    (dst / protocol.HEAD_PATH).write_bytes(
        head if head is not None else (src / protocol.HEAD_PATH).read_bytes()
    )


def huge_published_at(head: bytes) -> bytes:
    return re.sub(rb'"published_at": [0-9.e+]+', b'"published_at": 1' + b"0" * 400, head)


def shapeless_raw_entry(patch: bytes) -> bytes:
    """The raw patch with its first tensor's indices and values turned into 0-d tensors (shape [])."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "p.safetensors"
        path.write_bytes(patch)
        with safe_open(path, "pt") as f:
            meta, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
        name = next(iter(tensors)).rpartition("/")[0]
        tensors[f"{name}/indices"] = torch.tensor(0, dtype=torch.int32)
        tensors[f"{name}/values"] = torch.tensor(0.0, dtype=torch.bfloat16)
        save_file(tensors, path, metadata=meta)
        return path.read_bytes()


HEAD_FAULTS = {
    "published_at 10**400": huge_published_at,
    "deep nesting": lambda head: b"[" * 100_000 + b"]" * 100_000,
    "a 5000-digit integer": lambda head: b'{"version": 1, "step": ' + b"7" * 5000 + b"}",
    "not UTF-8": lambda head: b"\xff\xfe" + head,
}


def test_follower_survives_every_malformed_file_and_recovers(tmp_path):
    """Each malformed file leaves the follow thread alive and last_error short, cleared on recovery."""
    src, dst = tmp_path / "src", tmp_path / "dst"
    dst.mkdir()
    params = make_params()
    publisher = Publisher(src, model="tiny", config=PublisherConfig(encoding="raw", anchor_every=1000))

    def publish() -> int:
        if publisher.last_step >= 0:
            train_step(params, publisher.last_step + 1)
        step = publisher.publish(params)
        publisher.flush()
        return step

    storage = Counting(dst)
    replica, stop = Subscriber(storage, backoff_s=0.001), threading.Event()
    for _ in range(2):
        publish()
    mirror(src, dst)
    follower = threading.Thread(target=replica.follow, args=(stop, 0.005), daemon=True)
    follower.start()
    try:
        wait_for(lambda: replica.step == 1, "the replica to follow")

        def polls_later(n: int = 3) -> None:
            seen = storage.polls
            wait_for(lambda: storage.polls >= seen + n, "more polls")

        for fault, edit in HEAD_FAULTS.items():
            step = publish()
            mirror(src, dst, head=edit((src / protocol.HEAD_PATH).read_bytes()))
            wait_for(lambda: replica.last_error and "refused the head" in replica.last_error, fault)
            polls_later()
            assert follower.is_alive() and replica.step == step - 1, fault
            assert "refused the head" in replica.last_error and len(replica.last_error) <= MAX_ERROR_CHARS
            mirror(src, dst)  # fixed
            recovered = lambda step=step: replica.step == step and replica.last_error is None  # noqa: E731
            wait_for(recovered, f"recovery from {fault}")

        step = publish()
        delta = delta_file(src, step)
        bad = shapeless_raw_entry(delta.read_bytes())
        head = json.loads((src / protocol.HEAD_PATH).read_bytes())
        head["entries"][-1]["bytes"] = len(bad)  # the head lists the bad file's size: it is decoded
        mirror(src, dst, json.dumps(head).encode(), {delta.relative_to(src).as_posix(): bad})
        wait_for(lambda: replica.last_error and "waiting for a newer anchor" in replica.last_error, "refusal")
        first = replica.last_error
        polls_later()
        assert follower.is_alive() and replica.step == step - 1
        assert replica.last_error == first and first.count("waiting") == 1 and len(first) <= MAX_ERROR_CHARS
        assert "expected 1-D" in first
        publisher.config.anchor_every = 1  # superseded: the next step comes with an anchor
        step = publish()
        mirror(src, dst)
        wait_for(lambda: replica.step == step and replica.last_error is None, "recovery from the anchor")
        assert bitwise_equal(replica.state, bf16(params))
    finally:
        stop.set()
        follower.join()
        publisher.close()


def test_sync_turns_any_exception_into_a_bounded_sync_error(tmp_path):
    run_steps(tmp_path, 2)

    class Broken(LocalStorage):
        def read_bytes(self, path, limit=None):
            raise KeyError("x" * 10_000)  # a bug, or anything a backend may raise

    replica = Subscriber(Broken(tmp_path))
    with pytest.raises(SyncError, match="KeyError"):
        replica.sync()
    assert len(replica.last_error) <= MAX_ERROR_CHARS


def test_head_and_deltas_over_their_size_are_refused_before_reading(tmp_path):
    """A head over its limit, or a delta larger than the head lists, is refused before a byte is read."""
    states = run_steps(tmp_path, 3)
    storage = Counting(tmp_path)
    head_path, delta = tmp_path / protocol.HEAD_PATH, delta_file(tmp_path, 2)
    good_head = head_path.read_bytes()
    with open(head_path, "r+b") as f:
        f.truncate(protocol.MAX_MANIFEST_BYTES + 1)  # sparse: no disk used
    replica = Subscriber(storage)
    with pytest.raises(SyncError, match="refused the head.*more than"):
        replica.sync()
    assert protocol.HEAD_PATH not in storage.copied  # refused before a byte was copied (the lease is read)
    head_path.write_bytes(good_head)
    replica.sync(1)
    with open(delta, "r+b") as f:
        f.truncate(600 << 20)
    storage.copied.clear()
    with pytest.raises(SyncError, match="refused delta of step 2: .* more than the"):
        replica.sync()
    assert delta.relative_to(tmp_path).as_posix() not in storage.copied
    assert replica.step == 1 and bitwise_equal(replica.state, states[1])


def test_gc_stays_inside_the_root_and_removes_crash_leftovers(tmp_path):
    """GC follows no symlink out of the root, and removes temporary files that crashed writers left."""
    root, outside = tmp_path / "root", tmp_path / "outside"
    run_steps(root, 3)
    shutil.move(root / "anchors", outside)
    (root / "anchors").symlink_to(outside)
    (outside / "step-00000001").mkdir()
    (outside / "step-00000001" / "model.safetensors").write_bytes(b"someone else's")
    old, fresh = time.time() - 3600, time.time()
    leftovers = {
        f"deltas/step-00000009.safetensors{TMP_MARK}dead": old,
        f"heads/latest.json{TMP_MARK}live": fresh,
    }
    for path, mtime in leftovers.items():
        (root / path).write_bytes(b"partial")
        os.utime(root / path, (mtime, mtime))
    (root / "deltas" / "README").write_bytes(b"not ours")
    deleted = collect_garbage(LocalStorage(root), grace_s=600)
    assert deleted == [f"deltas/step-00000009.safetensors{TMP_MARK}dead"]
    assert (outside / "step-00000001" / "model.safetensors").exists()
    assert (root / f"heads/latest.json{TMP_MARK}live").exists() and (root / "deltas" / "README").exists()
    (root / "anchors").unlink()
    shutil.move(outside, root / "anchors")
    (root / "anchors" / "step-00000001" / "model.safetensors").unlink()
    os.utime(root / "anchors" / "step-00000001", (old, old))  # an empty anchor folder a crash left
    parts = root / "deltas" / "step-00000002-e1-1a2b3c4d"  # a sharded step's folder, its parts collected
    parts.mkdir()
    os.utime(parts, (old, old))
    assert collect_garbage(LocalStorage(root), grace_s=600) == [
        "anchors/step-00000001",
        "deltas/step-00000002-e1-1a2b3c4d",
    ]
    assert not (root / "anchors" / "step-00000001").exists() and not parts.exists()


def test_int_tensors_are_refused_not_rounded(tmp_path):
    """An integer tensor is refused: bf16 would round it (257 -> 256)."""
    publisher = Publisher(tmp_path / "root")
    with pytest.raises(ValueError, match="position_ids is torch.int64"):
        publisher.publish({**make_params(), "position_ids": torch.arange(512)})
    publisher.close()
    folder = tmp_path / "model"
    folder.mkdir()
    save_file({"w": torch.randn(4, 4), "position_ids": torch.arange(512)}, folder / "model.safetensors")
    one_line_error(cli("push", tmp_path / "root2", folder), "position_ids is torch.int64")
    assert not (tmp_path / "root2").exists()  # refused before the root was touched


def test_credentials_in_urls_are_never_shown():
    """A password in an fsspec URL is redacted by the CLI and the dashboard."""
    url = f"http://user:S3cretPW@127.0.0.1:{closed_port()}/root"
    r = cli("ls", url)
    one_line_error(r, "http://***@127.0.0.1")
    assert "S3cretPW" not in r.stderr
    assert "S3cretPW" not in repr(open_storage(url)) and "S3cretPW" not in open_storage(url).url
    spec = importlib.util.spec_from_file_location("dashboard_app", REPO / "spaces" / "dashboard" / "app.py")
    app = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(app)
    board = app.Board(url)
    board.refresh()
    summary = board.summary()
    shown = json.dumps(summary) + app.status_markdown(summary, 2.0)
    assert "S3cretPW" not in shown and "***@" in shown


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_cli_errors_are_one_line(tmp_path):
    """Bad patches, missing files, corrupt heads, absent fsspec backends, an unreachable Hub: one line."""
    root = tmp_path / "root"
    run_steps(root, 3, PublisherConfig(encoding="raw"))
    patch = tmp_path / "bad.safetensors"
    patch.write_bytes(shapeless_raw_entry(delta_file(root, 1).read_bytes()))
    pulled = tmp_path / "pulled"
    assert cli("pull", root, "-o", pulled, "--step", "0").returncode == 0
    one_line_error(cli("inspect", patch), "expected 1-D")
    one_line_error(cli("apply", pulled / "model.safetensors", patch, "-o", tmp_path / "o"), "expected 1-D")

    missing = delta_file(root, 2)
    missing.unlink()
    one_line_error(cli("pull", root, "-o", tmp_path / "o"), missing.relative_to(root).as_posix(), "missing")

    good = (root / protocol.HEAD_PATH).read_bytes()
    (root / protocol.HEAD_PATH).write_bytes(huge_published_at(good))
    for args in (["pull", root, "-o", tmp_path / "o"], ["ls", root], ["gc", root], ["push", root, pulled]):
        one_line_error(cli(*args), "published_at")

    for url, package in [("s3://b/r", "s3fs"), ("gs://b/r", "gcsfs"), ("sftp://h/r", "paramiko")]:
        if importlib.util.find_spec(package) is None:
            one_line_error(cli("ls", url), package)

    env = {"HF_ENDPOINT": f"http://127.0.0.1:{closed_port()}", "HF_TOKEN": "hf_" + "x" * 30}
    r = cli("pull", "hf://buckets/user/sync", "-o", tmp_path / "o", env=env)
    one_line_error(r, "cannot reach")
    assert "x" * 30 not in r.stderr


def test_patch_claiming_more_changes_than_the_head_lists_is_refused_before_decoding(tmp_path, monkeypatch):
    """Decoding allocates per claimed change: a patch that claims more than its head entry says is refused
    from its headers alone."""
    states = run_steps(tmp_path, 3)
    head = json.loads((tmp_path / protocol.HEAD_PATH).read_bytes())
    head["entries"][-1]["changed"] = 1  # the file claims its real count: more than the head lists
    (tmp_path / protocol.HEAD_PATH).write_text(json.dumps(head))
    replica = Subscriber(tmp_path)
    replica.sync(1)

    def never(*args, **kwargs):
        raise AssertionError("decoded a patch whose claim does not match its head entry")

    monkeypatch.setattr("deltasync.codec.patch.decode", never)
    with pytest.raises(SyncError, match="refused delta of step 2: patch claims .* changes, the head lists 1"):
        replica.sync()
    assert replica.step == 1 and bitwise_equal(replica.state, states[1])


def test_an_unreachable_fsspec_root_is_named_unreachable(tmp_path):
    """Not "no run yet" or "missing": one line saying so, before any retries."""
    url = f"http://127.0.0.1:{closed_port()}/root"
    for args in (["ls", url], ["pull", url, "-o", tmp_path / "o"], ["gc", url]):
        r = cli(*args)
        one_line_error(r, f"{url} is unreachable")
        assert "missing" not in r.stderr and "no run" not in r.stderr


def test_push_refuses_what_would_brick_the_root_before_touching_it(tmp_path):
    checkpoint = tmp_path / "model.safetensors"
    save_file({"w": torch.ones(3)}, checkpoint)
    for step in (str(protocol.MAX_INT + 1), "1" + "0" * 30):
        one_line_error(cli("push", tmp_path / "root", checkpoint, "--step", step), "--step")
    save_file({"": torch.ones(2), "w": torch.ones(3)}, checkpoint)
    one_line_error(cli("push", tmp_path / "root", checkpoint), "tensor ''")
    assert not (tmp_path / "root").exists()


def test_a_missing_delta_is_planned_around_through_a_newer_anchor(tmp_path):
    """A replica on step 2 whose next delta is gone takes, in the same poll, the path a fresh replica takes
    (the newer anchor), instead of retrying the missing file at every poll."""
    states = run_steps(tmp_path, 8, PublisherConfig(anchor_every=4))
    head = protocol.read_head(LocalStorage(tmp_path))
    assert [a.step for a in head.anchors] == [0, 4]
    reader = Subscriber(tmp_path)
    reader.sync(2)
    delta_file(tmp_path, 3).unlink()
    assert [(a.kind, a.step) for a in reader.sync()] == [
        ("anchor", 4),
        ("delta", 5),
        ("delta", 6),
        ("delta", 7),
    ]
    assert bitwise_equal(reader.state, states[7])


@pytest.mark.parametrize("field", ["dense", "models", "windows"])
def test_a_delta_with_metadata_nested_too_deeply_is_refused_once_not_counted_as_a_bug(tmp_path, field):
    src, dst = tmp_path / "src", tmp_path / "dst"
    run_steps(src, 2)
    delta = delta_file(src, 1)
    path = delta.relative_to(src).as_posix()
    bad = with_metadata(delta.read_bytes(), **{field: DEEP})
    head = json.loads((src / protocol.HEAD_PATH).read_bytes())
    (entry,) = [e for e in head["entries"] if e["kind"] == "delta" and e["step"] == 1]
    entry["bytes"] = len(bad)  # the head lists the bad file's size: it is decoded
    dst.mkdir()
    mirror(src, dst, json.dumps(head).encode(), {path: bad})
    storage = Counting(dst)
    replica = Subscriber(storage)
    with pytest.raises(SyncError, match=f"refused delta of step 1: .*'{field}': JSON nested too deeply"):
        replica.sync()
    reads = storage.copied.count(path)
    with pytest.raises(SyncError, match="waiting for a newer anchor"):
        replica.sync()
    assert storage.copied.count(path) == reads == 1 and replica.bugs == 0 and replica.step == 0
