"""Canaries: each private huggingface_hub name deltasync.storage.compat relies on is still there, in the shape
it expects. An upgrade that renames or reshapes one fails here, instead of replicas silently polling."""

import dataclasses
import inspect
import threading

from huggingface_hub._bucket_live_follow import _resume_params

from deltasync.storage.compat import BucketFileChange, Follower


def test_bucket_follower():
    assert issubclass(Follower, threading.Thread)
    keywords = ["endpoint", "bucket_id", "token", "on_changes", "on_reconcile", "is_alive"]
    assert list(inspect.signature(Follower.__init__).parameters)[1:] == keywords
    # One call per session, returning whether it was healthy: Follower.in_session wraps it.
    assert list(inspect.signature(Follower.__mro__[1]._follow_once).parameters) == ["self"]
    follower = Follower(
        endpoint="http://x", bucket_id="a/b", on_changes=print, on_reconcile=print, is_alive=lambda: False
    )
    assert follower.daemon and follower.subscribed is False  # True once a session reached `ready`
    assert follower.in_session is False
    # Its first session's resume point (Follower.run sets it): None, and a bare request follows live changes.
    assert follower._resume is None
    assert _resume_params(("live", "")) == {}


def test_bucket_file_change():
    fields = [f.name for f in dataclasses.fields(BucketFileChange)]
    assert fields == ["path", "op", "size", "xet_hash", "uploaded_at", "mtime"]


def test_feed_timestamps():
    """bench.hub swaps the feed's `parse_datetime` for `datetime.fromisoformat` in its own process (1,000
    replicas' followers in one process would queue on strptime's lock): the name must exist, and both must
    read the feed's timestamps alike."""
    from datetime import datetime

    from huggingface_hub import _bucket_live_follow

    stamp = "2026-11-29T12:34:56.789Z"
    assert _bucket_live_follow.parse_datetime(stamp) == datetime.fromisoformat(stamp)
