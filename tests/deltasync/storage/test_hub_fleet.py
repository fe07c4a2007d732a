"""A fleet on one token: reads by Xet hash from the CAS with a kept token, and budgets that back off before
the Hub answers 429 (fake Hub, huggingface_hub's and hf_xet's real clients)."""

import pytest

from deltasync.storage import HubBucketStorage, RateLimited
from deltasync.storage.budget import FREE_TIER, PRO_TIER, Budget, fleet_shares
from deltasync.storage.hub import XET_TOKEN_MARGIN_S
from tests.deltasync.storage.test_hub import Clock, eventually, follow


def token_requests(hub) -> list[str]:
    return [r for r in hub.requests if r.endswith("-token")]


def own_requests(hub) -> list[str]:
    """The requests of this test's storages: an earlier test's follower may reconnect (its feed session, and
    the bucket's info after the reset between tests)."""
    return [r for r in hub.requests if "/events" not in r and r != "GET /api/buckets/user/sync"]


def test_reads_on_the_feed_fetch_by_hash_from_the_cas_with_one_token_while_it_lasts(fake_hub):
    fake_hub.clock = clock = Clock()
    writer = HubBucketStorage("user/sync", follow=False)
    writer.write_bytes("heads/latest.json", b"head 1")
    reader = HubBucketStorage("user/sync", token=fake_hub.token, clock=clock)
    follow(reader)
    writer.write_many([("deltas/a", b"a" * 1000), ("deltas/b", b"b" * 70_000)])
    eventually(lambda: reader.announced("deltas/b"))
    fake_hub.requests.clear()
    cas = fake_hub.total("cas")
    assert reader.read_bytes("deltas/a") == b"a" * 1000
    assert reader.read_bytes("deltas/b") == b"b" * 70_000
    assert fake_hub.requests == ["GET /api/buckets/user/sync/xet-read-token"]  # no resolver call
    assert fake_hub.total("cas") == cas + 2

    clock.advance(fake_hub.xet_token_s - XET_TOKEN_MARGIN_S)  # about to expire: asked again, once
    assert reader.read_bytes("deltas/b") == b"b" * 70_000  # over MEMO_BYTES: read again
    assert reader.read_bytes("deltas/b") == b"b" * 70_000
    assert len(token_requests(fake_hub)) == 2

    for token in list(fake_hub.xet_tokens)[1:]:  # the CAS refuses the kept token: a new one, the same bytes
        fake_hub.xet_tokens[token] = ("", 0.0)
    assert reader.read_bytes("deltas/b") == b"b" * 70_000
    assert len(token_requests(fake_hub)) == 3


def test_an_anchor_is_downloaded_by_hash_without_a_resolver_call(fake_hub, tmp_path):
    writer = HubBucketStorage("user/sync", follow=False)
    writer.write_bytes("run.json", b"{}")
    reader = HubBucketStorage("user/sync")
    follow(reader)
    writer.write_bytes("anchors/1/shard.safetensors", bytes(range(256)) * 1000)
    eventually(lambda: reader.announced("anchors/1/shard.safetensors"))
    fake_hub.requests.clear()
    reader.download_file("anchors/1/shard.safetensors", tmp_path / "shard")
    assert (tmp_path / "shard").read_bytes() == bytes(range(256)) * 1000
    assert [r for r in fake_hub.requests if "/resolve/" in r] == []


def test_writes_keep_their_xet_token_one_api_call_a_write(fake_hub):
    writer = HubBucketStorage("user/sync", follow=False)
    writer.write_bytes("a", b"1")
    fake_hub.requests.clear()
    for i in range(3):
        writer.write_bytes(f"telemetry/{i}", b"record")
    writes = own_requests(fake_hub)
    assert writes == ["POST /api/buckets/user/sync/batch"] * 3


def test_a_budget_backs_off_without_a_request_until_its_window_ends(fake_hub):
    fake_hub.clock = clock = Clock()
    HubBucketStorage("user/sync", follow=False).write_bytes("run.json", b"{}")
    storage = HubBucketStorage("user/sync", follow=False, budget=Budget(api=1, resolvers=2), clock=clock)
    fake_hub.requests.clear()
    assert storage.read_bytes("run.json") == b"{}"
    assert storage.read_bytes("run.json") == b"{}"
    with pytest.raises(RateLimited, match="rate limited until"):
        storage.read_bytes("run.json")
    reads = own_requests(fake_hub)
    assert len(reads) == 2 and fake_hub.limited() == 0
    assert storage.rate_limited_until is not None
    clock.advance(300)  # the next window
    assert storage.read_bytes("run.json") == b"{}"


def test_everyone_backs_off_when_the_hub_says_the_users_window_is_nearly_spent(fake_hub):
    fake_hub.clock = Clock()
    fake_hub.quotas["resolvers"] = 40
    HubBucketStorage("user/sync", follow=False).write_bytes("run.json", b"{}")
    storage = HubBucketStorage("user/sync", follow=False, clock=fake_hub.clock)
    with pytest.raises(RateLimited):
        for _ in range(40):
            storage.read_bytes("run.json")
    assert fake_hub.counts("resolvers") == [38] and fake_hub.limited() == 0  # 2 of 40 left: the reserve


def test_fleet_shares_split_a_tier_and_refuse_a_fleet_that_does_not_fit():
    free, pro = fleet_shares(FREE_TIER, 100), fleet_shares(PRO_TIER, 1000)
    for tier, shares, n in ((FREE_TIER, free, 100), (PRO_TIER, pro, 1000)):
        for cls in ("api", "resolvers"):
            spent = shares["trainer"].of(cls) + shares["dashboard"].of(cls) + n * shares["replica"].of(cls)
            assert spent <= tier[cls]
    with pytest.raises(ValueError, match="3000 replicas do not fit"):
        fleet_shares(PRO_TIER, 3000)
