"""huggingface_hub's names that are not public API: the bucket change feed's client (huggingface_hub 2.3+).

`HfFileSystem(live_follow=True)` is the public face of the feed, but it keeps what it learns in its listing
cache, with no way to hear of a change; the thread behind it, `BucketFollower`, hands each batch of changes to
a callback, which is what a follower needs. tests/deltasync/storage/test_compat.py checks every name here.
"""

from huggingface_hub._bucket_live_follow import BucketFileChange, BucketFollower

__all__ = ["BucketFileChange", "Follower"]


class Follower(BucketFollower):
    """A `BucketFollower` that says whether one of its sessions is open now (`in_session`): its `subscribed`
    stays True once any session was ready, though after a failed reconnect it waits up to 80 s between
    tries, and a follower that trusted it would hear of nothing meanwhile."""

    in_session = False

    def _follow_once(self) -> bool:
        self.in_session = True
        try:
            return super()._follow_once()
        finally:
            self.in_session = False
