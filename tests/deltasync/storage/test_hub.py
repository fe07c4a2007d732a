"""The Hub bucket backend on the Hub's terms: the fake Hub's quotas, 429s, pages, change feed and faults,
through huggingface_hub's real client and the storage layer."""

import os
import threading
import time

import httpx2
import pytest
from huggingface_hub.utils import parse_ratelimit_headers

from deltasync.storage import HubBucketStorage, RateLimited, TooLargeError, TransientStorageError


class Clock:
    """A test clock for the fake Hub: its windows, feed sessions and stale reads move only when told."""

    def __init__(self, t: float = 1_800_000_000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t

    def advance(self, seconds: float) -> None:
        self.t += seconds


def eventually(condition, timeout: float = 30.0) -> None:
    """Wait for `condition()` (a thread's work) or fail: a bound on a hang, not a timing assertion."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.01)


def api_requests(hub) -> list[str]:
    return [r for r in hub.requests if " /api/" in r]


@pytest.fixture
def storage(fake_hub):
    storage = HubBucketStorage("user/sync")
    storage.write_bytes("run.json", b"{}")
    fake_hub.requests.clear()
    return storage


def follow(storage) -> threading.Event:
    """Start the storage's change feed (as a waiting reader does) and wait until it follows."""
    stop = threading.Event()
    stop.set()
    storage.wait_for_change(stop, 0.0)
    eventually(lambda: storage.live)
    storage.wait_for_change(stop, 0.0)  # takes the news of the feed's start
    return stop


def test_quota_answers_429_with_the_headers_the_client_parses(fake_hub, storage):
    fake_hub.clock = clock = Clock(300 * 6_000_000 - 1.5)  # 1.5 s before a window ends
    fake_hub.quotas["api"] = 2
    storage.sizes(["a"])
    response = httpx2.post(
        f"{fake_hub.endpoint}/api/buckets/user/sync/paths-info",
        json={"paths": []},
        headers={"authorization": f"Bearer {fake_hub.token}"},
    )
    limit = parse_ratelimit_headers(response.headers)
    assert limit is not None and (limit.resource_type, limit.remaining, limit.limit) == ("api", 0, 2)
    assert (limit.reset_in_seconds, limit.window_seconds) == (2, 300)
    with pytest.raises(RateLimited, match="rate limited until") as refused:
        storage.sizes(["a"])
    assert fake_hub.limited() == 1 and storage.rate_limited_until == refused.value.until
    sent = len(fake_hub.requests)
    with pytest.raises(RateLimited):  # until the window ends, nothing is sent
        storage.read_bytes("run.json")
    with pytest.raises(RateLimited):
        storage.write_bytes("x", b"x")
    assert len(fake_hub.requests) == sent
    clock.advance(1.5)
    eventually(lambda: storage.rate_limited_until is None)
    assert storage.sizes(["run.json"]) == {"run.json": 2} and fake_hub.counts("api")[-2:] == [3, 1]


def test_requests_are_counted_per_class_and_window(fake_hub, storage):
    fake_hub.clock = clock = Clock()
    storage.sizes(["run.json"])
    storage.read_bytes("run.json")
    clock.advance(300)
    storage.read_bytes("run.json")
    assert fake_hub.counts("api")[-2:] == [1, 0] and fake_hub.counts("resolvers")[-2:] == [1, 1]


def test_the_cas_refuses_a_shard_naming_a_xorb_it_never_received(fake_hub, storage):
    """A client's dedup cache can name xorbs this CAS lacks (one kept from an earlier fake on the same port):
    the write fails, as on the Hub, instead of landing a file whose reads fail."""
    data = os.urandom(1000)
    storage.write_bytes("a", data)
    for term in fake_hub._files[fake_hub.buckets["user/sync"]["a"]["xetHash"]]:
        (fake_hub._xorbs / term.xorb).unlink()
    with pytest.raises(TransientStorageError, match="400"):
        storage.write_bytes("b", data)  # deduplicated against the xorb the CAS lost
    assert "b" not in fake_hub.buckets["user/sync"]


def test_tree_listings_come_in_pages(fake_hub, storage):
    fake_hub.page_size = 2
    for i in range(4):
        storage.write_bytes(f"telemetry/trainer/step-{i:08d}.json", b"{}")
    fake_hub.requests.clear()
    assert storage.list("telemetry") == [f"telemetry/trainer/step-{i:08d}.json" for i in range(4)]
    assert fake_hub.requests == ["GET /api/buckets/user/sync/tree/telemetry"] * 2


def test_reads_cost_one_resolver_call_and_no_api_call(fake_hub, storage):
    assert storage.read_bytes("run.json", limit=100) == b"{}"
    assert fake_hub.requests == ["GET /buckets/user/sync/resolve/run.json"]
    with pytest.raises(FileNotFoundError):
        storage.read_bytes("heads/latest.json", limit=100)


def test_the_feed_serves_stats_and_unchanged_reads_without_requests(fake_hub, storage):
    follow(storage)
    storage.write_bytes("heads/latest.json", b"head 1")
    eventually(lambda: storage.sizes(["heads/latest.json"])["heads/latest.json"] == 6)
    fake_hub.requests.clear()
    assert storage.read_bytes("heads/latest.json", limit=100) == b"head 1"  # by the hash the feed gave
    assert storage.read_bytes("heads/latest.json", limit=100) == b"head 1"  # the same hash: no request
    assert storage.sizes(["heads/latest.json"]) == {"heads/latest.json": 6}
    # From Xet's CAS by hash: a read token (one API call while it lasts), no resolver call.
    assert fake_hub.requests == ["GET /api/buckets/user/sync/xet-read-token"]
    with pytest.raises(FileNotFoundError):  # asked once, then known absent until the feed says otherwise
        storage.read_bytes("deltas/next", limit=100)
    with pytest.raises(FileNotFoundError):
        storage.read_bytes("deltas/next", limit=100)
    # One resolver read (no API call: the resolver's quota is five times larger), then known absent.
    assert fake_hub.requests[1:] == ["GET /buckets/user/sync/resolve/deltas/next"]
    HubBucketStorage("user/sync", follow=False).write_bytes("deltas/next", b"delta")  # another writer
    eventually(lambda: storage.sizes(["deltas/next"])["deltas/next"] == 5)
    fake_hub.requests.clear()
    cas = fake_hub.total("cas")
    assert storage.read_bytes("deltas/next", limit=4 + 1) == b"delta"
    assert fake_hub.requests == [] and fake_hub.total("cas") == cas + 1  # the token kept: one CAS call
    with pytest.raises(ValueError, match="more than the 4"):  # a size from the feed is checked like a stat
        storage.read_bytes("deltas/next", limit=4)


def test_a_waiting_reader_wakes_on_a_change_under_its_folders(fake_hub, storage):
    stop = follow(storage)
    stop.clear()
    woke = threading.Event()

    def wait():
        storage.wait_for_change(stop, 3600, under=("heads/",))
        woke.set()

    threading.Thread(target=wait, daemon=True).start()
    other = HubBucketStorage("user/sync", follow=False)
    other.write_bytes("telemetry/x.json", b"{}")
    time.sleep(0.5)
    assert not woke.is_set()  # not its folder
    other.write_bytes("heads/latest.json", b"head")
    eventually(woke.is_set)
    stop.set()


def test_idle_follower_sends_nothing_for_a_window_but_reconnects(fake_hub, storage):
    fake_hub.clock = clock = Clock()
    fake_hub.feed_session_s = 120.0
    follow(storage)
    fake_hub.requests.clear()
    for _ in range(30):  # a 5-minute window on the test clock
        clock.advance(10)
        time.sleep(0.1)
    eventually(lambda: len(fake_hub.requests) >= 1)  # the server ends a session every 120 s
    time.sleep(0.5)
    assert set(fake_hub.requests) == {"GET /api/buckets/user/sync/events"} and len(fake_hub.requests) <= 3
    assert storage.live


def events(hub, **params) -> str:
    """The feed's answer, read until its `ready` (or its end)."""
    text = ""
    with httpx2.stream(
        "GET",
        f"{hub.endpoint}/api/buckets/user/sync/events",
        params=params,
        headers={"authorization": f"Bearer {hub.token}", "accept": "text/event-stream"},
    ) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        for chunk in response.iter_text():
            text += chunk
            if "event: ready" in text:
                break
    return text


def test_feed_wire_format_replay_ready_and_reset(fake_hub, storage):
    fake_hub.feed_buffer = 2
    for data in (b"1", b"22", b"333"):
        storage.write_bytes("a", data)
    replay = events(fake_hub, cursor="2")  # the changes after cursor 2 (run.json is 1), then ready
    assert replay.startswith("event: changes\ndata: {") and '"op": "update"' in replay
    assert '"size": 3' in replay and '"size": 2' in replay
    assert replay.endswith('event: ready\ndata: {"cursor": "4"}\n\n')
    assert events(fake_hub, cursor="0") == 'event: reset\ndata: {"reason": "cursor too old"}\n\n'
    assert events(fake_hub).startswith("event: ready")  # no resume point: live changes only


def test_a_feed_not_served_leaves_readers_polling(fake_hub, storage):
    fake_hub.feed = False
    stop = threading.Event()
    stop.set()
    storage.wait_for_change(stop, 0.0)
    eventually(lambda: not storage._feed.follower.is_alive())
    assert not storage.live
    storage.wait_for_change(stop, 0.0)  # takes the news of the feed's start
    stop.clear()
    start = time.monotonic()
    storage.wait_for_change(stop, 0.2)  # a poll interval, at least what the budget allows
    assert time.monotonic() - start >= storage.poll_s


def test_stale_reads_are_never_returned_as_what_the_feed_announced(fake_hub, storage):
    fake_hub.clock = clock = Clock()
    fake_hub.stale_s = 10.0
    follow(storage)
    storage.write_bytes("heads/latest.json", b"old")
    storage.write_bytes("heads/latest.json", b"newer")
    eventually(lambda: storage.sizes(["heads/latest.json"])["heads/latest.json"] == 5)  # the feed said so
    poller = HubBucketStorage("user/sync", follow=False)
    assert poller.read_bytes("heads/latest.json") == b"old"  # the Hub's resolver lags on overwrites
    assert storage.read_bytes("heads/latest.json") == b"newer"  # by the hash the feed announced, from Xet
    clock.advance(10)
    assert storage.read_bytes("heads/latest.json") == b"newer" == poller.read_bytes("heads/latest.json")


def test_a_feed_event_that_beats_the_write_answer_is_kept(fake_hub, storage, monkeypatch):
    # The feed may announce a write before its writer has the commit's answer: what the feed said then is
    # news of that write, not old news to drop (dropping it sent the next stat to a lagging paths-info).
    fake_hub.clock = Clock()
    fake_hub.stale_s = 10.0
    follow(storage)
    storage.write_bytes("heads/latest.json", b"old")
    eventually(lambda: storage.sizes(["heads/latest.json"])["heads/latest.json"] == 3)
    request = storage._request

    def announced() -> bool:
        stat = storage._feed.stats.get("heads/latest.json", (None,))[0]
        return stat is not None and stat.size == 5

    def answered_after_the_feed(method, url, *args, **kwargs):
        response = request(method, url, *args, **kwargs)
        if url.endswith("/batch"):
            eventually(announced)
        return response

    monkeypatch.setattr(storage, "_request", answered_after_the_feed)
    storage.write_bytes("heads/latest.json", b"newer")
    fake_hub.requests.clear()
    assert storage.sizes(["heads/latest.json"]) == {"heads/latest.json": 5}
    assert api_requests(fake_hub) == []  # from the feed, not from a paths-info that still sees "old"


def test_a_lost_write_response_is_an_error_though_the_write_landed(fake_hub, storage):
    fake_hub.lose_responses(1, status=403)
    with pytest.raises(TransientStorageError):
        storage.write_bytes("heads/latest.json", b"landed")
    assert storage.read_bytes("heads/latest.json") == b"landed"


def test_an_object_over_the_limit_is_refused_without_being_read_into_memory(fake_hub, storage, monkeypatch):
    """Whatever a stat said before (the object may have grown since), the read stops at the limit: the bytes
    taken from the answer's body are counted where the client takes them."""
    storage.write_bytes("deltas/big.safetensors", b"x" * (16 << 20))
    taken = []
    iter_bytes = httpx2.Response.iter_bytes

    def counted(response, *args, **kwargs):
        for chunk in iter_bytes(response, *args, **kwargs):
            taken.append(len(chunk))
            yield chunk

    monkeypatch.setattr(httpx2.Response, "iter_bytes", counted)
    with pytest.raises(TooLargeError, match="deltas/big.safetensors"):
        storage.read_bytes("deltas/big.safetensors", limit=1000)
    assert sum(taken) <= 1000 + (1 << 20), sum(taken)
