"""One writer per sync root: a second publisher is refused naming the holder, a
stale one is fenced and never acknowledges, and no acknowledged step is ever lost."""

import json
import os
import re
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from pathlib import Path

import pytest

from deltasync import cli
from deltasync.codec.fingerprint import format_fingerprint, state_fingerprint
from deltasync.storage import HubBucketStorage, LocalStorage, WriterConflict, open_storage
from deltasync.sync import protocol
from deltasync.sync.claim import WRITER_PATH, WriterClaim
from deltasync.sync.publisher import Publisher, PublisherConfig
from deltasync.sync.subscriber import Subscriber
from tests.deltasync.storage.test_hub import api_requests
from tests.helpers import bf16, bitwise_equal, delta_file, make_params, run_steps, train_step, wait_for

ROUNDS = 24

# One of two publisher processes: in each round (started when the test creates go-<round>), it opens the root,
# publishes its own state and closes; one JSON line per round says whether that step was acknowledged.
RACING_PUBLISHER = textwrap.dedent(
    """
    import json, sys, time
    from pathlib import Path
    sys.path[:0] = {paths!r}
    from tests.helpers import make_params
    from deltasync.sync.publisher import Publisher, PublisherConfig

    root, me, rounds, gate = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4])
    config = PublisherConfig(keep_anchors=10_000)  # retain every step: every acknowledged one can be pulled
    for r in range(rounds):
        while not (gate / f"go-{{r}}").exists():
            time.sleep(0.002)
        seed = 1000 * me + r
        try:
            with Publisher(root, model="tiny", config=config) as publisher:
                step = publisher.publish(make_params(seed))
            print(json.dumps({{"round": r, "seed": seed, "step": step}}), flush=True)
        except Exception as e:  # refused or fenced: not acknowledged
            print(json.dumps({{"round": r, "refused": str(e)}}), flush=True)
    """
)


def test_two_publisher_processes_lose_no_acknowledged_step(tmp_path):
    root, gate = tmp_path / "root", tmp_path / "gate"
    gate.mkdir()
    run_steps(root, 1)  # the run exists: both processes resume it in every round
    script = RACING_PUBLISHER.format(paths=[os.path.dirname(__file__), os.getcwd()])
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", script, str(root), str(me), str(ROUNDS), str(gate)],
            stdout=subprocess.PIPE,
            text=True,
        )
        for me in (1, 2)
    ]
    replica, stop = Subscriber(root), threading.Event()
    follower = threading.Thread(target=replica.follow, args=(stop, 0.01), daemon=True)
    follower.start()
    results = []
    try:
        for r in range(ROUNDS):
            (gate / f"go-{r}").touch()  # both start the round together
            for proc in procs:
                results.append(json.loads(proc.stdout.readline()))
    finally:
        for proc in procs:
            proc.wait(timeout=120)
    acked = [x for x in results if "step" in x]
    refused = [x for x in results if "refused" in x]
    assert len(results) == 2 * ROUNDS and all(p.returncode == 0 for p in procs)
    odd = [x for x in refused if not re.search("another publisher .*(pid|moved)", x["refused"])]
    assert not odd
    steps = [x["step"] for x in acked]
    assert len(set(steps)) == len(steps), "two publishers acknowledged the same step"
    head = protocol.read_head(LocalStorage(root))
    assert head.step == max(steps)
    for x in acked:  # every acknowledged step comes back bit for bit
        reader = Subscriber(root)
        reader.sync(x["step"])
        assert bitwise_equal(reader.state, bf16(make_params(x["seed"]))), x
    wait_for(lambda: replica.step == head.step, "the replica to reach the head")
    stop.set()
    follower.join()
    assert format_fingerprint(replica.fingerprint) == head.fingerprint
    assert bitwise_equal(
        replica.state, bf16(make_params(next(x["seed"] for x in acked if x["step"] == head.step)))
    )


def test_second_local_publisher_is_refused_naming_the_holder(tmp_path):
    with Publisher(tmp_path, model="tiny") as first:
        first.publish(make_params())
        first.flush()
        with pytest.raises(WriterConflict, match=f"another publisher.*pid {os.getpid()}"):
            Publisher(tmp_path)
        gc = subprocess.run(
            [sys.executable, "-m", "deltasync.cli", "gc", str(tmp_path)], capture_output=True, text=True
        )
        assert gc.returncode == 1 and gc.stderr.count("\n") == 1
        assert f"pid {os.getpid()}" in gc.stderr
    first.close()  # again: a no-op (a second close of the lock's fd could close someone else's file)
    with Publisher(tmp_path) as second:  # released on close
        assert second.publish(make_params(1)) == 1


def test_a_failed_publisher_lets_the_next_writer_in_when_closed(tmp_path, monkeypatch):
    first = Publisher(tmp_path, model="tiny")
    first.publish(make_params(0))
    first.flush()

    def fail(job):
        raise RuntimeError("the encoder failed")

    monkeypatch.setattr(first, "_publish", fail)  # a failure no retry helps (a bug, a fenced writer)
    first.publish(make_params(1))
    with pytest.raises(RuntimeError, match="the encoder failed"):
        first.close()  # raises the failure, after releasing the root
    with Publisher(tmp_path) as second:  # step 1 was never acknowledged: it continues from step 0
        assert second.publish(make_params(2)) == 1


def test_hub_lease_refuses_a_second_writer_and_fences_a_stale_one(fake_hub):
    root = "hf://buckets/user/sync/run"
    config = PublisherConfig(lease_s=3600)  # no renewal during the test: the takeover below is deterministic
    first = Publisher(root, model="tiny", config=config)
    first.publish(make_params(0))
    first.flush()
    with pytest.raises(WriterConflict, match=re.escape(first.claim.holder)):
        Publisher(root, config=config)
    # The first writer stalls (a long GC pause, a partition) past its lease: a new writer takes over.
    storage = open_storage(root)
    stale = {"holder": first.claim.holder, "epoch": first.claim.epoch, "expires_at": time.time() - 1}
    storage.write_bytes(WRITER_PATH, json.dumps(stale).encode())
    second = Publisher(root, config=config)
    assert second.claim.epoch > first.claim.epoch
    first.publish(make_params(1))  # the stale writer wakes up: fenced, its step is never acknowledged
    with pytest.raises(RuntimeError, match="another publisher moved the head"):
        first.flush()
    with pytest.raises(RuntimeError, match="another publisher moved the head"):
        first.close()  # stops the fenced writer, leaving the new writer's lease alone (checked below)
    assert second.publish(make_params(2)) == 1
    second.close()
    reader = Subscriber(root)
    reader.sync()
    assert reader.step == 1 and bitwise_equal(reader.state, bf16(make_params(2)))
    closed = json.loads(storage.read_bytes(WRITER_PATH))  # released: expired, naming the last epoch
    assert closed == {"holder": second.claim.holder, "epoch": second.claim.epoch, "expires_at": 0}


def test_gc_on_a_hub_root_leaves_replica_polls_without_an_api_call(fake_hub):
    root = "hf://buckets/user/sync/run"
    with Publisher(root, model="tiny", config=PublisherConfig(anchor_every=2, keep_anchors=1)) as publisher:
        for seed in range(3):
            publisher.publish(make_params(seed))
    replica = Subscriber(HubBucketStorage("user/sync", "run", follow=False))
    replica.sync()
    assert cli.main(["gc", root]) == 0
    lease = json.loads(open_storage(root).read_bytes(WRITER_PATH))
    assert lease["epoch"] == protocol.read_head(open_storage(root)).epoch  # GC wrote no head: no new epoch
    fake_hub.requests.clear()
    replica.sync()
    assert api_requests(fake_hub) == []
    with Publisher(root) as publisher:  # the next writer still fences every one before it
        assert publisher.claim.epoch > lease["epoch"]
        publisher.publish(make_params(3))
    replica.sync()
    assert replica.step == 3 and bitwise_equal(replica.state, bf16(make_params(3)))


class Stalling(LocalStorage):
    """A folder whose head write for step `step` waits until `release` is set (an upload in progress)."""

    def __init__(self, root: Path, step: int):
        super().__init__(root)
        self.step, self.reached, self.release = step, threading.Event(), threading.Event()

    def _write_bytes(self, path, data):
        if path == protocol.HEAD_PATH and f'"step": {self.step},'.encode() in data:
            self.reached.set()
            self.release.wait(60)
        super()._write_bytes(path, data)


def test_publisher_starting_during_a_publish_deletes_nothing(tmp_path):
    """A publisher starting during another's publish is refused, and deletes nothing the head will name."""
    params = make_params()
    storage = Stalling(tmp_path, step=3)
    with Publisher(storage, model="tiny") as publisher:
        for step in range(3):
            if step:
                train_step(params, step)
            publisher.publish(params)
            publisher.flush()
        train_step(params, 3)
        publisher.publish(params)
        assert storage.reached.wait(60)  # step 3's delta is uploaded, its head not yet written
        with pytest.raises(WriterConflict):
            Publisher(tmp_path)
        assert delta_file(tmp_path, 3).exists()
        storage.release.set()
    reader = Subscriber(tmp_path)
    reader.sync()
    assert reader.step == 3 and bitwise_equal(reader.state, bf16(params))


def test_replica_trusts_fingerprints_not_step_numbers(tmp_path):
    """A replica holding another writer's step N reloads the head's step N."""
    ours, theirs = tmp_path / "ours", tmp_path / "theirs"
    run_steps(ours, 3)
    params = make_params(7)  # another run with the same schema and step numbers
    with Publisher(theirs, model="tiny") as publisher:
        for step in range(3):
            if step:
                train_step(params, step)
            publisher.publish(params)
    replica = Subscriber(ours)
    replica.sync()
    assert replica.step == 2
    replica.storage = LocalStorage(theirs)  # the root now holds the other writer's step 2
    applied = replica.sync()
    assert applied[0].kind == "anchor"  # its own state is not in this chain: only an anchor is a start
    assert replica.step == 2 and bitwise_equal(replica.state, bf16(params))
    assert format_fingerprint(state_fingerprint(replica.state)) == replica.head.fingerprint


def test_lease_renewal_extends_it_and_detects_a_takeover():
    storage = open_storage(f"memory://{uuid.uuid4().hex}/run")
    claim = WriterClaim(storage, lease_s=60)
    first = json.loads(storage.read_bytes(WRITER_PATH))
    claim.renew()
    assert json.loads(storage.read_bytes(WRITER_PATH))["expires_at"] >= first["expires_at"]
    with pytest.raises(WriterConflict, match=re.escape(claim.holder)):
        WriterClaim(storage)
    other = {"holder": "someone else", "epoch": 9, "expires_at": time.time() + 60}
    storage.write_bytes(WRITER_PATH, json.dumps(other).encode())
    with pytest.raises(WriterConflict, match="someone else"):
        claim.renew()
    claim.release()  # not its lease any more: left alone
    assert json.loads(storage.read_bytes(WRITER_PATH))["holder"] == "someone else"


def test_replica_goes_back_to_an_older_retained_step(tmp_path):
    states = run_steps(tmp_path, 4)
    replica = Subscriber(tmp_path)
    replica.sync()
    replica.sync(1)  # from an anchor: deltas only lead forward
    assert replica.step == 1 and bitwise_equal(replica.state, states[1])
