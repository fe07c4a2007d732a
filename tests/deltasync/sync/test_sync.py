"""The sync protocol end to end: Publisher -> storage -> Subscriber, with faults."""

import collections
import json
import logging
import os
import random
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch

from deltasync import telemetry
from deltasync.codec.fingerprint import state_fingerprint
from deltasync.codec.patch import decode
from deltasync.storage import LocalStorage, Storage, open_storage
from deltasync.sync import protocol
from deltasync.sync import subscriber as subscriber_module
from deltasync.sync.gc import collect_garbage
from deltasync.sync.publisher import Publisher, PublisherConfig
from deltasync.sync.subscriber import Subscriber, SyncError, TensorsApplier
from tests.helpers import (
    SHAPES,
    bf16,
    bitwise_equal,
    delta_file,
    make_params,
    run_steps,
    train_step,
    wait_for,
)


class Flaky(Storage):
    """Another storage whose data calls are slow, or time out at random with probability `fail`."""

    def __init__(self, inner: Storage, fail: float = 0.0, delay_s: float = 0.0, seed: int = 0):
        self.inner, self.url, self.fail, self.delay_s = inner, inner.url, fail, delay_s
        self.calls = 0
        self._random = random.Random(seed)
        self._lock = threading.Lock()

    def _call(self, method: str, *args):
        with self._lock:
            self.calls += 1
            fail = self._random.random() < self.fail
        time.sleep(self.delay_s)
        if fail:
            raise TimeoutError(f"{method}: injected timeout")
        return getattr(self.inner, method)(*args)

    def _read_bytes(self, path, limit):
        return self._call("_read_bytes", path, limit)

    def _write_bytes(self, path, data):
        return self._call("_write_bytes", path, data)

    def _upload_file(self, local, path):
        return self._call("_upload_file", local, path)

    def _download_file(self, path, local):
        return self._call("_download_file", path, local)

    def _sizes(self, paths):
        return self.inner._sizes(paths)

    def _list(self, prefix):
        return self.inner._list(prefix)

    def _delete(self, paths):
        return self.inner._delete(paths)


def test_every_step_reaches_the_subscriber_bitwise(tmp_path):
    params, target = make_params(), {n: torch.zeros(s) for n, s in SHAPES.items()}
    subscriber = Subscriber(tmp_path, TensorsApplier(target), replica="r1", verify_every=3)
    applied = []
    with Publisher(tmp_path, model="tiny", config=PublisherConfig(anchor_every=8)) as publisher:
        for step in range(20):
            if step:
                train_step(params, step)
            publisher.publish(params, info={"reward_mean": 0.5})
            publisher.flush()
            applied += subscriber.sync()
            assert subscriber.step == step
            assert bitwise_equal(bf16(target), bf16(params))
            assert bitwise_equal(subscriber.state, bf16(params))
    assert [a.step for a in applied] == list(range(20))  # no step skipped
    assert [a.kind for a in applied] == ["anchor"] + ["delta"] * 19  # replay beats anchors when following
    assert all(0 < a.changed < 0.1 * sum(t.numel() for t in params.values()) for a in applied[1:])
    records = [json.loads(p.read_text()) for p in sorted((tmp_path / "telemetry/replicas/r1").iterdir())]
    assert [r["step"] for r in records] == list(range(20)) and all(r["verified"] for r in records)
    trainer = [telemetry.from_json(telemetry.TrainerRecord, p.read_bytes()) for p in trainer_files(tmp_path)]
    assert [r.kind for r in trainer] == ["anchor"] + [
        "delta"
    ] * 19  # steps 8 and 16: a delta, an anchor beside
    assert [r.step for r in trainer if r.anchor_bytes] == [0, 8, 16]


def trainer_files(root) -> list:
    return sorted((root / "telemetry/trainer").iterdir())


def test_trainer_records_count_every_byte_uploaded(tmp_path):
    run_steps(tmp_path, 7, PublisherConfig(anchor_every=3, keep_anchors=10_000))  # every file retained
    records = [telemetry.from_json(telemetry.TrainerRecord, p.read_bytes()) for p in trainer_files(tmp_path)]
    uploaded = sum(
        f.stat().st_size for d in ("anchors", "deltas") for f in (tmp_path / d).rglob("*.safetensors")
    )
    assert sum(r.payload_bytes + r.anchor_bytes for r in records) == uploaded
    head = protocol.read_head(LocalStorage(tmp_path))
    for r in records:  # the delta's bytes are the payload; an anchor's beside it
        delta, anchor = head.entry(r.step, "delta"), head.entry(r.step, "anchor")
        assert (r.payload_bytes, r.anchor_bytes) == (
            delta.bytes if delta else 0,
            anchor.bytes if anchor else 0,
        )
    assert [r.step for r in records if r.anchor_bytes] == [0, 3, 6]


def test_late_subscriber_catches_up_through_the_cheapest_path(tmp_path):
    states = run_steps(tmp_path, 56, PublisherConfig(anchor_every=20, keep_anchors=2))
    head = protocol.Head.from_json((tmp_path / protocol.HEAD_PATH).read_bytes())
    assert [a.step for a in head.anchors] == [20, 40]
    late = Subscriber(tmp_path)
    applied = late.sync()
    assert [(a.kind, a.step) for a in applied] == [("anchor", 40)] + [("delta", s) for s in range(41, 56)]
    assert bitwise_equal(late.state, states[-1])
    old = Subscriber(tmp_path)
    assert old.sync(25)[-1].step == 25 and bitwise_equal(old.state, states[25])  # any retained step
    with pytest.raises(SyncError, match="not retained"):
        Subscriber(tmp_path).sync(3)


def test_coalesces_when_uploads_lag_and_blocks_only_for_the_copy(tmp_path):
    slow = Flaky(LocalStorage(tmp_path), delay_s=0.05)
    params = make_params()
    with Publisher(slow, model="tiny") as publisher:
        for step in range(30):
            if step:
                train_step(params, step)
            publisher.publish(params, info={"reward_mean": float(step)})
    head = protocol.Head.from_json((tmp_path / protocol.HEAD_PATH).read_bytes())
    assert head.step == 29
    assert len(head.deltas) < 20  # steps were folded together instead of queueing
    subscriber = Subscriber(tmp_path)
    subscriber.sync()
    assert bitwise_equal(subscriber.state, bf16(params))
    records = [
        telemetry.from_json(telemetry.TrainerRecord, p.read_bytes())
        for p in sorted((tmp_path / "telemetry/trainer").iterdir())
    ]
    assert [r.step for r in records] == list(range(30))  # every trainer step has a record, skipped or not
    assert {r.step for r in records if r.kind != "skipped"} == {e.step for e in head.entries}
    assert [r.info["reward_mean"] for r in records] == list(range(30))
    assert max(r.blocked_s for r in records) < 0.05  # never waited for an upload


def test_flaky_storage_only_delays_sync(tmp_path):
    flaky = Flaky(LocalStorage(tmp_path), fail=0.3)
    config = PublisherConfig(anchor_every=6, retry_s=(0.01, 0.05))
    states = run_steps(flaky, 15, config)
    subscriber = Subscriber(Flaky(LocalStorage(tmp_path), fail=0.3, seed=1), backoff_s=0.01)
    subscriber.sync()
    assert subscriber.step == 14 and bitwise_equal(subscriber.state, states[-1])
    assert flaky.calls > 30


def test_corrupt_delta_is_refused_and_recovered_from_the_next_anchor(tmp_path):
    config = PublisherConfig(anchor_every=5)
    target = {n: torch.zeros(s) for n, s in SHAPES.items()}
    subscriber = Subscriber(tmp_path, TensorsApplier(target), replica="r1")
    params, states = make_params(), []
    with Publisher(tmp_path, model="tiny", config=config) as publisher:

        def publish(step):
            if step:
                train_step(params, step)
            publisher.publish(params, step=step)
            publisher.flush()
            states.append(bf16(params))

        for step in range(5):
            publish(step)
            if step == 2:
                subscriber.sync()
        path = delta_file(tmp_path, 3)
        data = bytearray(path.read_bytes())
        data[-20] ^= 0x40  # one bit of the payload
        path.write_bytes(bytes(data))
        with pytest.raises(SyncError, match="refused delta of step 3"):
            subscriber.sync()
        with pytest.raises(SyncError, match="waiting for a newer anchor"):  # the bad file is not retried
            subscriber.sync()
        assert subscriber.step == 2 and bitwise_equal(bf16(target), states[2])  # last good weights kept
        refused = json.loads((tmp_path / "telemetry/replicas/r1/step-00000003.json").read_text())
        assert refused["verified"] is False and "step 3" not in refused["error"] and refused["error"]
        publish(5)  # anchor_every=5: a complete anchor
        publish(6)
    seen, report = [], subscriber._report  # what a status reader sees once each step is in place
    subscriber._report = lambda a: seen.append((subscriber.step, subscriber.last_error)) or report(a)
    applied = subscriber.sync()
    assert [(a.kind, a.step) for a in applied] == [("anchor", 5), ("delta", 6)]
    assert seen == [(5, None), (6, None)]  # never a new step beside the old refusal
    assert bitwise_equal(bf16(target), states[6]) and subscriber.last_error is None


class Recording(LocalStorage):
    """A folder that records each path it reads; `tamper(path, data)` may change what a read returns."""

    def __init__(self, root, tamper=lambda path, data: data):
        super().__init__(root)
        self.reads: list[str] = []
        self.read_done = threading.Event()
        self.tamper = tamper

    def _read_bytes(self, path, limit):
        data = self.tamper(path, super()._read_bytes(path, limit))
        self.reads.append(path)
        self.read_done.set()
        return data


def delta_before_its_head(root) -> tuple[bytes, dict[str, torch.Tensor]]:
    """Steps 0-2 published with step 2's delta stored but the head still at step 1, as between a writer's
    data upload and its head write. Returns step 2's head and state."""
    params = make_params()
    with Publisher(root, model="tiny") as publisher:
        for step in range(3):
            if step:
                train_step(params, step)
            publisher.publish(params, step=step)
            publisher.flush()
            if step == 1:
                head_1 = (root / protocol.HEAD_PATH).read_bytes()
    head_2 = (root / protocol.HEAD_PATH).read_bytes()
    (root / protocol.HEAD_PATH).write_bytes(head_1)
    return head_2, bf16(params)


def wait_for_a_read_of(storage: Recording, path: str) -> None:
    while path not in storage.reads:
        assert storage.read_done.wait(10), f"nothing read {path}"
        storage.read_done.clear()


def test_a_delta_stored_before_its_head_is_read_once(tmp_path):
    head_2, state_2 = delta_before_its_head(tmp_path)
    storage = Recording(tmp_path)
    target = {n: torch.zeros(s) for n, s in SHAPES.items()}
    subscriber = Subscriber(storage, TensorsApplier(target))
    assert [a.step for a in subscriber.sync()] == [0, 1]
    assert subscriber.sync() == []  # at the head: this poll also asks for step 2's delta
    delta = str(delta_file(tmp_path, 2).relative_to(tmp_path))
    wait_for_a_read_of(storage, delta)
    (tmp_path / protocol.HEAD_PATH).write_bytes(head_2)
    assert [a.step for a in subscriber.sync()] == [2]
    assert storage.reads.count(delta) == 1
    assert bitwise_equal(bf16(target), state_2)


def test_a_delta_stored_before_its_head_is_decoded_while_the_head_is_awaited(tmp_path, monkeypatch):
    head_2, state_2 = delta_before_its_head(tmp_path)
    decoded_on = []  # the thread of each decoding

    def recording_decode(*args):
        decoded_on.append(threading.current_thread().name)
        return decode(*args)

    monkeypatch.setattr("deltasync.codec.patch.decode", recording_decode)
    storage = Recording(tmp_path)
    target = {n: torch.zeros(s) for n, s in SHAPES.items()}
    subscriber = Subscriber(storage, TensorsApplier(target))
    subscriber.sync()
    decoded_on.clear()
    subscriber.sync()
    wait_for_a_read_of(storage, str(delta_file(tmp_path, 2).relative_to(tmp_path)))
    (tmp_path / protocol.HEAD_PATH).write_bytes(head_2)
    assert [a.step for a in subscriber.sync()] == [2]
    assert decoded_on == ["deltasync-prefetch"]  # once, before the head named it
    assert bitwise_equal(bf16(target), state_2)


def test_prefetched_bytes_that_are_not_the_listed_file_are_read_again(tmp_path):
    head_2, state_2 = delta_before_its_head(tmp_path)
    delta = str(delta_file(tmp_path, 2).relative_to(tmp_path))
    truncated = []  # the first read of the delta returns part of it, as a half-uploaded object would

    def tamper(path, data):
        if path == delta and not truncated:
            truncated.append(path)
            return data[:-100]
        return data

    storage = Recording(tmp_path, tamper)
    target = {n: torch.zeros(s) for n, s in SHAPES.items()}
    subscriber = Subscriber(storage, TensorsApplier(target))
    subscriber.sync()
    subscriber.sync()
    wait_for_a_read_of(storage, delta)
    (tmp_path / protocol.HEAD_PATH).write_bytes(head_2)
    assert [a.step for a in subscriber.sync()] == [2]
    assert storage.reads.count(delta) == 2 and subscriber.last_error is None
    assert bitwise_equal(bf16(target), state_2)


def test_missing_delta_is_an_error_not_a_warning(tmp_path):
    run_steps(tmp_path, 4)
    delta_file(tmp_path, 2).unlink()
    subscriber = Subscriber(tmp_path)
    subscriber.sync(1)
    with pytest.raises(SyncError, match="missing"):
        subscriber.sync()
    assert subscriber.step == 1 and "missing" in subscriber.last_error


@pytest.mark.parametrize(
    "edit",
    [
        lambda h: h["entries"][1].update(files=["../../etc/passwd"]),
        lambda h: h["entries"][1].update(files=["deltas/step-00000009.safetensors"]),
        lambda h: h["entries"][0].update(files=["anchors/step-00000000/../../x.safetensors"]),
        lambda h: h["entries"][2].update(base_step=0),
        lambda h: h.update(step=7),
        lambda h: h["entries"].pop(0),
        lambda h: h.update(version=99),
        lambda h: h["entries"][1].update(bytes=-1),
    ],
)
def test_bad_heads_are_rejected(tmp_path, edit):
    run_steps(tmp_path, 3)
    head = json.loads((tmp_path / protocol.HEAD_PATH).read_text())
    edit(head)
    (tmp_path / protocol.HEAD_PATH).write_text(json.dumps(head))
    subscriber = Subscriber(tmp_path)
    with pytest.raises(SyncError, match="refused the head"):
        subscriber.sync()
    assert subscriber.step is None


def test_unknown_tensor_or_wrong_shape_is_refused(tmp_path):
    run_steps(tmp_path, 2)
    storage = LocalStorage(tmp_path)
    run = json.loads(storage.read_bytes(protocol.RUN_PATH))
    run["schema"]["lm.bias"] = [8]
    storage.write_bytes(protocol.RUN_PATH, json.dumps(run).encode())
    with pytest.raises(SyncError, match="lm.bias is torch.bfloat16 \\[7\\], expected bf16 \\[8\\]"):
        Subscriber(tmp_path).sync()
    del run["schema"]["lm.bias"]
    storage.write_bytes(protocol.RUN_PATH, json.dumps(run).encode())
    with pytest.raises(SyncError, match="unknown tensor 'lm.bias'"):
        Subscriber(tmp_path).sync()


def test_gc_keeps_what_readers_need_and_nothing_else(tmp_path):
    states = run_steps(tmp_path, 33, PublisherConfig(anchor_every=10, keep_anchors=2))
    storage = LocalStorage(tmp_path)
    head = protocol.Head.from_json(storage.read_bytes(protocol.HEAD_PATH))
    assert [a.step for a in head.anchors] == [20, 30]
    data_files = set(storage.list("deltas") + storage.list("anchors"))
    assert data_files == head.files()
    assert min(protocol.step_of(p) for p in data_files) == 20
    for anchor in head.anchors:  # every retained anchor still reaches the head
        subscriber = Subscriber(tmp_path)
        assert subscriber.sync(anchor.step)[0].kind == "anchor"
        subscriber.sync()
        assert bitwise_equal(subscriber.state, states[-1])
    # An upload in progress (a step after the head) is not garbage; an orphan before it is.
    storage.write_bytes(protocol.delta_path(40), b"in progress")
    storage.write_bytes(protocol.delta_path(15), b"orphan")
    assert collect_garbage(storage) == [protocol.delta_path(15)]
    assert storage.sizes([protocol.delta_path(40)])[protocol.delta_path(40)] == len(b"in progress")


def test_gc_removes_the_step_folders_it_emptied_and_nothing_else(tmp_path):
    theirs = {"notes", "step-00000099-e9-deadbeef"}  # empty folders that no GC emptied: left alone
    for name in theirs:
        (tmp_path / "anchors" / name).mkdir(parents=True)
    run_steps(tmp_path, 7, PublisherConfig(anchor_every=2, keep_anchors=1))
    storage = LocalStorage(tmp_path)
    head = protocol.read_head(storage)
    retained = {Path(f).parent.name for a in head.anchors for f in a.files}
    assert {p.name for p in (tmp_path / "anchors").iterdir()} == retained | theirs  # the publisher's GC
    (shard,) = head.anchors[0].files
    fenced = protocol.anchor_paths(2, 1, "e0-0000abcd")[0]  # a fenced writer's anchor: garbage
    storage.write_bytes(fenced, storage.read_bytes(shard))
    assert collect_garbage(storage) == [fenced, str(Path(fenced).parent)]  # `deltasync gc`
    assert {p.name for p in (tmp_path / "anchors").iterdir()} == retained | theirs


CRASHING_PUBLISHER = textwrap.dedent(
    """
    import sys, time
    sys.path[:0] = {paths!r}
    from tests.helpers import make_params, train_step
    from deltasync.sync.publisher import Publisher
    from deltasync.storage import LocalStorage

    class Stalling(LocalStorage):  # the head write of step 5 never finishes: killed there
        def _write_bytes(self, path, data):
            if path == "heads/latest.json" and b'"step": 5,' in data:
                print("stalled", flush=True)
                time.sleep(600)
            super()._write_bytes(path, data)

    params = make_params()
    publisher = Publisher(Stalling(sys.argv[1]), model="tiny")
    for step in range(6):
        if step:
            train_step(params, step)
        publisher.publish(params, step=step)
        publisher.flush() if step < 5 else time.sleep(600)
    """
)


def test_publisher_killed_mid_upload_leaves_the_last_complete_step(tmp_path):
    paths = [os.path.dirname(__file__), os.getcwd()]
    script = CRASHING_PUBLISHER.format(paths=paths)
    proc = subprocess.Popen([sys.executable, "-c", script, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "stalled"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert delta_file(tmp_path, 5).exists()  # uploaded, but no head names it
    states = run_steps(tmp_path / "reference", 5)
    subscriber = Subscriber(tmp_path)
    subscriber.sync()
    assert subscriber.step == 4 and bitwise_equal(subscriber.state, states[4])
    params = make_params()  # a restarted trainer resumes the chain and drops the orphan
    for step in range(1, 6):
        train_step(params, step)
    with Publisher(tmp_path) as publisher:
        assert publisher.last_step == 4
        assert publisher.publish(params) == 5
    subscriber.sync()
    assert subscriber.step == 5 and bitwise_equal(subscriber.state, bf16(params))


FOLLOWER = textwrap.dedent(
    """
    import sys, threading
    from deltasync.sync.subscriber import Subscriber
    root, last, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    subscriber, stop = Subscriber(root, replica=out.rsplit("/", 1)[-1]), threading.Event()
    subscriber.follow(stop, interval=0.05, on_applied=lambda a: a.step == last and stop.set())
    from safetensors.torch import save_file
    save_file(subscriber.state, out)
    """
)


def test_four_subscriber_processes_end_bitwise_equal(tmp_path):
    root = tmp_path / "root"
    run_steps(root, 1)
    followers = [
        subprocess.Popen([sys.executable, "-c", FOLLOWER, str(root), "24", str(tmp_path / f"replica-{i}")])
        for i in range(4)
    ]
    params = make_params()
    with Publisher(root, config=PublisherConfig(anchor_every=10)) as publisher:
        for step in range(1, 25):
            train_step(params, step)
            publisher.publish(params)
            time.sleep(0.05)
    for proc in followers:
        assert proc.wait(timeout=120) == 0
    from safetensors.torch import load_file

    for i in range(4):
        assert bitwise_equal(load_file(tmp_path / f"replica-{i}"), bf16(params))
        steps = [int(p.stem[5:]) for p in (root / f"telemetry/replicas/replica-{i}").iterdir()]
        assert max(steps) == 24


def test_hub_bucket_round_trip(fake_hub):
    root = "hf://buckets/user/sync/run1"
    states = run_steps(root, 4, PublisherConfig(anchor_every=3))
    subscriber = Subscriber(root)
    subscriber.sync()
    assert subscriber.step == 3 and bitwise_equal(subscriber.state, states[-1])
    assert state_fingerprint(subscriber.state) == subscriber.fingerprint
    assert open_storage(root).sizes([protocol.HEAD_PATH])[protocol.HEAD_PATH] > 0


def test_schema_change_is_refused_on_the_callers_thread(tmp_path):
    with Publisher(tmp_path) as publisher:
        publisher.publish(make_params())
        with pytest.raises(ValueError, match="lm.bias"):
            publisher.publish({**make_params(), "lm.bias": torch.zeros(8)})
        with pytest.raises(ValueError, match="not after"):
            publisher.publish(make_params(), step=0)


def test_transient_errors_surface_after_retries(tmp_path):
    run_steps(tmp_path, 2)
    subscriber = Subscriber(Flaky(LocalStorage(tmp_path), fail=1.0), retries=2, backoff_s=0.001)
    with pytest.raises(SyncError, match="storage keeps failing"):
        subscriber.sync()


def test_parameter_order_does_not_matter_after_the_first_step(tmp_path):
    """A checkpoint's tensors may load in another order in another process (zero-size tensors sharing an
    offset do): publishing by name, a resumed run takes any order."""
    params = {**make_params(), "empty.a": torch.zeros(0), "empty.b": torch.zeros(0, 4)}
    with Publisher(tmp_path, model="tiny") as publisher:
        publisher.publish(params)
    train_step(params, 1)
    with Publisher(tmp_path, model="tiny") as publisher:
        publisher.publish(dict(reversed(params.items())))
    reader = Subscriber(tmp_path)
    reader.sync()
    assert reader.step == 1 and bitwise_equal(reader.state, bf16(params))


class CountingSet(set):
    """A set that counts membership tests."""

    lookups = 0

    def __contains__(self, item):
        CountingSet.lookups += 1
        return super().__contains__(item)


def test_planning_is_linear_in_the_head(tmp_path):
    """A head of thousands of anchors and deltas: the plan is right, and costs a few lookups per entry."""
    n, fp = 3000, lambda step: f"{step:016x}"
    entries = [protocol.Entry(0, "anchor", tuple(protocol.anchor_paths(0, 1)), 1000, fp(0), 0.0)]
    for step in range(1, n + 1):
        delta = protocol.Entry(step, "delta", (protocol.delta_path(step),), 10, fp(step), 0.0, 1, step - 1)
        anchor = protocol.Entry(step, "anchor", tuple(protocol.anchor_paths(step, 1)), 1000, fp(step), 0.0)
        entries += [delta, anchor]
    head = protocol.Head.from_json(protocol.Head(n, fp(n), tuple(entries)).to_json())
    reader = Subscriber(tmp_path)
    reader._bad = CountingSet(reader._bad)
    assert reader._plan(head, n) == [head.entries[-1]]  # the newest anchor alone
    assert reader._plan(head, n - 1) == [head.entries[-3]]  # any retained step
    reader._bad.update((f, 1000) for f in head.entries[-1].files)  # refused: the anchor before, one delta
    assert reader._plan(head, n) == [head.entries[-3], head.entries[-2]]
    reader.step, reader.fingerprint = n - 3, int(fp(n - 3), 16)  # held: three deltas on top are cheapest
    assert [e.step for e in reader._plan(head, n)] == [n - 2, n - 1, n]
    reader._bad.add((head.entries[-4].files[0], 10))  # delta n - 1 refused: only anchor n - 1 + delta n
    assert [(e.kind, e.step) for e in reader._plan(head, n)] == [("anchor", n - 1), ("delta", n)]
    assert CountingSet.lookups < 5 * 4 * len(entries)  # five plans, each a few lookups per entry


class Counting(LocalStorage):
    """A folder that counts the reads asked of it, by path (refused ones too)."""

    def __init__(self, root):
        super().__init__(root)
        self.asked: collections.Counter[str] = collections.Counter()

    def read_bytes(self, path, limit=None):
        self.asked[path] += 1
        return super().read_bytes(path, limit)


@pytest.mark.parametrize("foreign", ["too large", "not a patch"])
def test_a_refused_read_ahead_is_remembered(tmp_path, foreign):
    """A foreign object where the next delta would go: one over the read-ahead's limit is asked for once,
    not at every poll; bytes that are no patch are not held until the head moves."""
    run_steps(tmp_path, 2)
    storage = Counting(tmp_path)
    subscriber = Subscriber(storage)
    subscriber.sync()
    tag = protocol.parse_data_path(subscriber.head.entries[-1].files[0])[2]
    predicted = protocol.delta_path(2, tag)
    run = subscriber.run
    limit = 6 * run.numel + 512 * len(run.schema) + (1 << 20)
    (tmp_path / predicted).write_bytes(b"\0" * (limit + 1) if foreign == "too large" else b"not a patch")
    for _ in range(10):
        subscriber.sync()
        wait_for(lambda: subscriber._ahead[1].done(), "the read ahead")
    assert storage.asked[predicted] == 1
    if foreign == "not a patch":
        assert subscriber._ahead[1].result().data == b""


def test_a_repeated_sync_error_is_logged_once(tmp_path, caplog):
    """Following an empty root says "no run yet" once, then quietly, however many polls it makes."""
    storage = Counting(tmp_path)
    subscriber, stop = Subscriber(storage), threading.Event()
    caplog.set_level(logging.DEBUG, logger=subscriber_module.__name__)
    thread = threading.Thread(target=subscriber.follow, args=(stop, 0.001))
    thread.start()
    wait_for(lambda: storage.asked[protocol.HEAD_PATH] >= 5, "five polls")
    stop.set()
    thread.join()
    said = [r for r in caplog.records if "no run in" in r.getMessage()]
    assert [r.levelno for r in said][:5] == [logging.WARNING] + [logging.DEBUG] * 4


def test_a_bug_while_decoding_is_a_bug_not_a_bad_file(tmp_path, monkeypatch, caplog):
    """numpy raises ValueError too: a programming error in decoding is logged with its traceback and counted,
    and the file is not refused (the next sync applies it)."""
    states = run_steps(tmp_path, 3)
    subscriber = Subscriber(tmp_path, replica="r")
    subscriber.sync(1)

    def broken(*args):
        raise ValueError("operands could not be broadcast together")

    monkeypatch.setattr("deltasync.codec.patch.decode", broken)
    with pytest.raises(SyncError, match="bug: ValueError: operands could not be broadcast"):
        subscriber.sync()
    assert subscriber.bugs == 1
    assert any(r.exc_info and "bug" in r.getMessage() for r in caplog.records)
    monkeypatch.undo()
    assert [a.step for a in subscriber.sync()] == [2]
    assert bitwise_equal(subscriber.state, states[2])
    record = tmp_path / telemetry.REPLICAS_DIR / "r" / "step-00000002.json"
    assert telemetry.from_json(telemetry.ReplicaRecord, record.read_bytes()).bugs == 1  # counted in telemetry
