"""The poll budget (Hub requests per window that polling may spend without the change feed) reaches the
storage from each place a user sets it: `open_storage` and `deltasync follow --poll-budget`. (The Spaces'
POLL_BUDGET: tests/spaces/test_dashboard.py, tests/spaces/test_inference_health.py.)"""

import pytest

from deltasync import cli
from deltasync.storage import HubBucketStorage, open_storage
from deltasync.storage.hub import POLL_REQUESTS, WINDOW_S
from deltasync.vllm import follower


def test_open_storage_passes_the_poll_budget_to_the_hub(fake_hub):
    storage = open_storage("hf://buckets/user/sync/run", poll_budget=30)
    assert isinstance(storage, HubBucketStorage) and storage.poll_budget == 30
    assert storage.poll_s == WINDOW_S * POLL_REQUESTS / 30
    with pytest.raises(ValueError, match="poll budget must be at least 1"):
        open_storage("hf://buckets/user/sync", poll_budget=0)


def test_deltasync_follow_polls_within_its_poll_budget(fake_hub, monkeypatch):
    HubBucketStorage("user/sync").write_bytes("run.json", b"{}")  # the root exists: the CLI probes it
    followed = []

    class Applier:  # no vLLM server: the follower's own parts are not under test here
        def __init__(self, engine, root, quantization=None):
            pass

        def attach(self, subscriber):
            pass

        def close(self):
            pass

    class Subscriber:
        def __init__(self, storage, applier, trust=None, **kwargs):
            followed.append(storage)
            self.trust = trust

        def follow(self, stop, interval, on_applied):
            pass

    monkeypatch.setattr(follower, "EngineApplier", Applier)
    monkeypatch.setattr(follower, "Subscriber", Subscriber)
    argv = ["follow", "hf://buckets/user/sync", "--vllm-url", "http://127.0.0.1:9", "--poll-budget", "30"]
    assert cli.main(argv) == 0
    assert [s.poll_budget for s in followed] == [30]
