"""The sync protocol on a Hub that lags and loses answers: stale reads of overwritten paths (the head, the
lease) and writes that land while the client sees an error. No acknowledged step is lost, no replica applies
out of order or goes backwards, and fencing holds."""

import time

import pytest
import torch

from deltasync import telemetry
from deltasync.storage import HubBucketStorage, LocalStorage, RateLimited, WriterConflict, hub
from deltasync.storage.compat import BucketFileChange
from deltasync.sync.protocol import HEAD_PATH, read_head
from deltasync.sync.publisher import Publisher, PublisherConfig
from deltasync.sync.subscriber import Subscriber, SyncError, TensorsApplier
from tests.deltasync.storage.test_hub import Clock, eventually
from tests.helpers import bf16, bitwise_equal, following, make_params, run_steps, train_step


def replica(follow: bool):
    target = {n: torch.zeros(t.shape, dtype=torch.bfloat16) for n, t in make_params().items()}
    return Subscriber(HubBucketStorage("user/sync", "run", follow=follow), TensorsApplier(target)), target


def monotonic(subscriber: Subscriber) -> bool:
    steps = [a.step for a in subscriber.history]
    return steps == sorted(set(steps))


def test_a_lagging_head_never_moves_a_polling_replica_backwards(fake_hub):
    """Polls read the head up to `stale_s` (four poll intervals) behind, fresh and stale by turns. The
    trainer reads its own writes at once (its head checks need that: see docs/protocol.md), here with a token
    of its own."""
    fake_hub.tokens.add("hf_trainer")
    fake_hub.fresh_tokens = {"hf_trainer"}
    params = make_params()
    trainer = HubBucketStorage("user/sync", "run", token="hf_trainer", follow=False)
    with Publisher(trainer, model="tiny", config=PublisherConfig(anchor_every=4)) as publisher:
        publisher.publish(params, step=0)
        publisher.flush()
        subscriber, target = replica(follow=False)
        subscriber.sync()
        fake_hub.clock = clock = Clock()
        fake_hub.stale_s, fake_hub.stale_every = 2.0, 2  # fresh and stale reads alternate for 2 s

        for step in range(1, 9):
            train_step(params, step)
            publisher.publish(params, step=step)
            publisher.flush()
            for _ in range(4):  # polls half a second apart: some see the head before, after a newer one
                clock.advance(0.5)
                subscriber.sync()
                assert subscriber.step is not None and subscriber.step <= step and monotonic(subscriber)
    clock.advance(2.0)
    subscriber.sync()
    assert subscriber.step == 8 and bitwise_equal(target, bf16(params)) and monotonic(subscriber)


def test_a_replica_on_the_feed_never_applies_what_a_stale_read_returns(fake_hub):
    fake_hub.tokens.add("hf_trainer")
    fake_hub.fresh_tokens = {"hf_trainer"}
    params = make_params()
    trainer = HubBucketStorage("user/sync", "run", token="hf_trainer", follow=False)
    fake_hub.clock = clock = Clock()
    with Publisher(trainer, model="tiny") as publisher:
        publisher.publish(params, step=0)
        publisher.flush()
        subscriber, target = replica(follow=True)
        with following(subscriber, 0.2):
            eventually(lambda: subscriber.step == 0 and subscriber.storage.live)
            fake_hub.stale_s = 5.0
            for step in range(1, 4):
                train_step(params, step)
                publisher.publish(params, step=step)
                publisher.flush()
            assert subscriber.step == 0 or monotonic(subscriber)  # the stale head is refused, not applied
            clock.advance(5.0)  # the lag ends: the replica's retries read what the feed announced
            eventually(lambda: subscriber.step == 3, timeout=30)
    assert bitwise_equal(target, bf16(params)) and monotonic(subscriber)


def test_a_head_write_that_lands_unacknowledged_is_published_again_never_lost(fake_hub):
    params = make_params()
    storage = HubBucketStorage("user/sync", "run", follow=False)
    subscriber, target = replica(follow=False)
    with Publisher(storage, model="tiny", config=PublisherConfig(retry_s=(0.05, 0.2))) as publisher:
        for step in range(0, 6):
            if step:
                train_step(params, step)
            if step in (2, 4):
                fake_hub.lose_responses(1, status=403)  # the next batch lands; the client sees an error
            publisher.publish(params, step=step)
            publisher.flush()  # returns once acknowledged: the step is in the head
            assert read_head(storage).step == step
            subscriber.sync()
            assert subscriber.step == step and monotonic(subscriber)
    assert bitwise_equal(target, bf16(params))


def test_a_lost_lease_answer_still_fences_a_second_writer(fake_hub):
    """A claim whose lease write landed but answered an error retries as the same holder: a second
    publisher is still refused, and the first one's steps go on."""
    fake_hub.lose_responses(1, status=403)
    storage = HubBucketStorage("user/sync", "run", follow=False)
    with Publisher(storage, model="tiny", config=PublisherConfig(retry_s=(0.05, 0.2))) as publisher:
        publisher.publish(make_params(), step=0)
        publisher.flush()
        with pytest.raises(WriterConflict, match="another publisher"):
            Publisher(HubBucketStorage("user/sync", "run", follow=False), model="tiny")
        assert read_head(storage).step == 0


class LimitedOnce(LocalStorage):
    """A root whose first head read is refused over a quota until `until`."""

    def __init__(self, root, until: float):
        super().__init__(root)
        self.until: float | None = until

    def _read_bytes(self, path, limit):
        if path == HEAD_PATH and self.until is not None:
            until, self.until = self.until, None
            raise RateLimited(f"{self.url}: rate limited until {until:.0f}", until)
        return super()._read_bytes(path, limit)


def test_a_rate_limit_is_said_at_once_and_in_the_record_of_the_step_it_held_back(tmp_path):
    run_steps(tmp_path, 2)
    until = time.time() + 60
    subscriber = Subscriber(LimitedOnce(tmp_path, until), replica="r1", retries=4, backoff_s=30)
    with pytest.raises(SyncError, match="rate limited until"):  # at once: no retry inside the quota window
        subscriber.sync()
    assert subscriber.rate_limited_until == until and "rate limited until" in subscriber.last_error
    subscriber.sync()
    files = [tmp_path / f"telemetry/replicas/r1/step-{s:08d}.json" for s in (0, 1)]
    records = [telemetry.from_json(telemetry.ReplicaRecord, f.read_bytes()) for f in files]
    assert [r.rate_limited_until for r in records] == [until, until] and subscriber.last_error is None


def test_a_stalled_hub_fails_each_poll_of_a_replica_instead_of_blocking_it(fake_hub, monkeypatch):
    """A Hub that takes requests and never answers: the replica's sync thread says so in last_error (it
    does not wait for ever), and syncs once the Hub answers again."""
    monkeypatch.setattr(hub, "READ_TIMEOUT_S", 0.2)
    with Publisher(HubBucketStorage("user/sync", "run", follow=False), model="tiny") as publisher:
        publisher.publish(make_params(), step=0)
    subscriber, _ = replica(follow=False)
    subscriber.retries = 0
    fake_hub.stall = True
    with following(subscriber, 0.05):
        try:
            eventually(lambda: subscriber.last_error is not None)
        finally:
            fake_hub.stall = False
        assert "storage keeps failing" in subscriber.last_error and subscriber.step is None
        eventually(lambda: subscriber.step == 0 and subscriber.last_error is None)
    assert subscriber.bugs == 0


def test_the_feeds_memory_of_paths_is_bounded_and_a_forgotten_change_still_counts(monkeypatch):
    monkeypatch.setattr(hub, "FEED_PATHS", 10)
    feed = hub._Feed()

    def add(path: str, xet_hash: str = "h") -> None:
        feed.on_changes([BucketFileChange(op="add", path=path, size=1, xet_hash=xet_hash)])

    for step in range(1000):  # a long run: every step a new delta, and GC deletes an old one
        add(f"deltas/{step}")
        feed.on_changes([BucketFileChange(op="delete", path=f"deltas/{step - 5}")])
    assert len(feed.stats) <= 10 and len(feed.touched) <= 10
    asked_at = feed.generation  # a paths-info of deltas/999 leaves now...
    add("deltas/999", "h2")  # ...the feed says it changed...
    for i in range(10):
        add(f"telemetry/{i}")  # ...and forgets it: its answer must not be kept as news
    assert "deltas/999" not in feed.touched
    with feed.cond:
        assert feed.changed_since("deltas/999", asked_at)
        assert not feed.changed_since("telemetry/9", feed.generation)
