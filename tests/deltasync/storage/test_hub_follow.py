"""What a replica and the dashboard's reader cost on the Hub: on the change feed, nothing while nothing
changes and a step applied on the head's own event; without it, polls without an API call."""

import torch

from deltasync.storage import HubBucketStorage
from deltasync.sync.publisher import Publisher
from deltasync.sync.subscriber import Subscriber, TensorsApplier
from deltasync.telemetry.reader import TelemetryReader
from tests.deltasync.storage.test_hub import api_requests, eventually
from tests.helpers import bf16, bitwise_equal, following, make_params, train_step


def trainer():
    publisher = Publisher(HubBucketStorage("user/sync", "run", follow=False), model="tiny")
    params = make_params()
    publisher.publish(params, step=0)
    publisher.flush()
    return publisher, params


def replica(follow: bool, name: str | None = None):
    target = {n: torch.zeros(t.shape, dtype=torch.bfloat16) for n, t in make_params().items()}
    storage = HubBucketStorage("user/sync", "run", follow=follow)
    return Subscriber(storage, TensorsApplier(target), replica=name), target


def test_on_the_feed_a_step_is_applied_on_its_heads_event_and_idling_costs_nothing(fake_hub):
    publisher, params = trainer()
    subscriber, target = replica(follow=True, name="r1")
    reader = TelemetryReader(HubBucketStorage("user/sync", "run"))
    # A poll interval of an hour: only the feed can bring the step in time.
    with following(subscriber, 3600.0):
        eventually(lambda: subscriber.step == 0 and subscriber.storage.live)
        # The feed announces changes, not what was there before it: the replica's first read of the head once
        # live costs one stat, then the head is known.
        eventually(lambda: subscriber.storage.announced("heads/latest.json"))
        reader.poll()
        eventually(lambda: reader.poll() is not None and reader.storage.live)
        reader.poll()
        fake_hub.requests.clear()
        for _ in range(20):
            reader.poll()
        assert fake_hub.requests == []  # neither the waiting replica nor the dashboard's reader sent anything
        train_step(params, 1)
        publisher.publish(params, step=1)
        publisher.flush()
        eventually(lambda: subscriber.step == 1)
    assert bitwise_equal(target, bf16(params))
    eventually(lambda: any(r.step == 1 for r in reader.poll().records if getattr(r, "replica", "") == "r1"))
    assert not [r for r in api_requests(fake_hub) if "/paths-info" in r or "/tree" in r]  # no stat, no list
    publisher.close()


def test_while_the_feed_is_down_a_replica_polls_instead_of_waiting_for_its_reconnect(fake_hub):
    publisher, params = trainer()
    subscriber, target = replica(follow=True)
    with following(subscriber, 0.2):
        eventually(lambda: subscriber.step == 0 and subscriber.storage.live)
        fake_hub.feed_status = 503  # the session ends; huggingface_hub's follower retries in 10, 20, 40, 80 s
        eventually(lambda: not subscriber.storage.live)
        train_step(params, 1)
        publisher.publish(params, step=1)
        publisher.flush()
        eventually(lambda: subscriber.step == 1, timeout=8.0)  # polled: well before the follower's next try
        assert bitwise_equal(target, bf16(params))
    publisher.close()


def test_an_idle_poll_without_the_feed_costs_no_api_call(fake_hub):
    publisher, _ = trainer()
    subscriber, _ = replica(follow=False)
    subscriber.sync()
    fake_hub.requests.clear()
    subscriber.sync()
    assert api_requests(fake_hub) == [] and len(fake_hub.requests) <= 3  # the head, the lease, the next delta
    publisher.close()
