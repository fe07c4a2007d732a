"""huggingface_hub's names that are not public API: the bucket change feed's client (huggingface_hub 2.3+).

`HfFileSystem(live_follow=True)` is the public face of the feed, but it keeps what it learns in its listing
cache, with no way to hear of a change; the thread behind it, `BucketFollower`, hands each batch of changes to
a callback, which is what a follower needs; its resume point (`_resume`) is what a first session asks for.
tests/deltasync/storage/test_compat.py checks every name here.
"""

from huggingface_hub._bucket_live_follow import BucketFileChange, BucketFollower

__all__ = ["BucketFileChange", "Follower"]


class Follower(BucketFollower):
    """A `BucketFollower` that says whether one of its sessions is open now (`in_session`): its `subscribed`
    stays True once any session was ready, though after a failed reconnect it waits up to 80 s between
    tries, and a follower that trusted it would hear of nothing meanwhile."""

    in_session = False

    def run(self) -> None:
        # The first session follows live changes only: BucketFollower would first ask the bucket's info (one
        # API call) to replay its last batch, which a new reader reads anyway (by resolver, outside the API
        # quota), and a fleet starting at once would spend a third of its start on it. Every later session
        # resumes as BucketFollower decides (its cursor; the bucket's info after a `reset`).
        if self._resume is None:
            self._resume = ("live", "")
        super().run()

    def _follow_once(self) -> bool:
        self.in_session = True
        try:
            return super()._follow_once()
        finally:
            self.in_session = False
