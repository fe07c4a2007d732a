"""The single-writer claim on a sync root.

One writer per sync root, enforced in two layers:
- a claim held for the publisher's life: on a local folder an flock on `writer.lock` (exclusive between
  processes of this host, released by the kernel if the holder dies); on object stores and fsspec URLs, which
  offer no conditional write through the APIs used here, a lease in `writer.lock` (holder, expiry; renewed
  while the publisher lives) that a second publisher reads and respects, then reads back after taking it;
- fencing: each claim takes an epoch larger than any before it and the publisher rewrites the head with it at
  once; before writing a head the publisher re-reads the current one, and after writing reads it back: a head
  with another writer's epoch, or not the bytes it wrote, stops it with WriterConflict, and the step is never
  acknowledged.
Guarantees: on a local folder a second writer is refused outright. On object stores a second writer is
refused while the lease is live, and one that raced past it is fenced at its next head write; what remains is
a window of one request between a writer's re-read and its write, in which two heads can cross (detected by
the read-back, but one of them may already be acknowledged). Leases also assume clocks within `lease_s`.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
import uuid

from deltasync.storage import Storage, TransientStorageError, WriterConflict

log = logging.getLogger(__name__)
WRITER_PATH = "writer.lock"
LEASE_S = 120.0  # object stores: a writer's lease lasts this long unless renewed (every quarter)


def new_holder() -> str:
    """A writer's name, unique per claim, that tells a person where it runs."""
    return f"pid {os.getpid()} on {socket.gethostname()}, claim {uuid.uuid4().hex[:8]}"


class WriterClaim:
    """This process's claim to be the only writer of `storage` (see the module docstring): its lock where the
    backend has one, else a lease. Raises WriterConflict naming the holder when another writer has it."""

    def __init__(self, storage: Storage, lease_s: float = LEASE_S, holder: str | None = None):
        self.storage, self.lease_s = storage, lease_s
        self.holder = holder or new_holder()
        self._renewed_at, self._released = 0.0, False
        since = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
        self._lock = storage.lock(WRITER_PATH, f"{self.holder}, since {since}")
        self.epoch = 1  # raised past the head's by Publisher; past the last lease's here
        if self._lock is None:
            lease = self._lease()
            if lease and lease["holder"] != self.holder and lease["expires_at"] > time.time():
                raise WriterConflict(
                    f"{storage.url} is being written by another publisher ({lease['holder']}, lease until "
                    f"{time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime(lease['expires_at']))})"
                )
            self.epoch = (lease["epoch"] + 1) if lease else 1
            self.renew(taking=True)

    def _lease(self) -> dict | None:
        """The current lease; None if there is none or it is unreadable (then it protects nothing)."""
        try:
            lease = json.loads(self.storage.read_bytes(WRITER_PATH, limit=4096))
        except FileNotFoundError:
            return None
        except (ValueError, RecursionError):
            log.warning("ignoring an unreadable lease in %s", self.storage.url)
            return None
        kinds = {"holder": str, "epoch": int, "expires_at": (int, float)}
        ok = isinstance(lease, dict) and all(isinstance(lease.get(k), t) for k, t in kinds.items())
        return lease if ok and 0 <= lease["epoch"] < 1 << 62 and abs(lease["expires_at"]) < 1e12 else None

    def renew_due(self) -> bool:
        return self._lock is None and time.time() - self._renewed_at > self.lease_s / 4

    def renew(self, taking: bool = False) -> None:
        """Extend the lease (a lock needs nothing); WriterConflict if another writer took it over."""
        if self._lock is not None:
            return
        if not taking:
            self._check_lease("took over")
        now = time.time()
        lease = {"holder": self.holder, "epoch": self.epoch, "expires_at": now + self.lease_s}
        self.storage.write_bytes(WRITER_PATH, json.dumps(lease).encode())
        self._renewed_at = now
        if taking:  # two claims racing both wrote: only the last one reads itself back
            self._check_lease("claimed it at the same time")

    def _check_lease(self, what: str) -> None:
        lease = self._lease()
        if lease is None or lease["holder"] != self.holder:
            other = lease["holder"] if lease else "a writer that removed the lease"
            raise WriterConflict(f"{self.storage.url}: another publisher ({other}) {what}")

    def release(self) -> None:
        """Let the next writer in; again is a no-op."""
        if self._lock is not None:
            self._lock.release()
            return
        if self._released:
            return
        self._released = True
        try:
            lease = self._lease()
            if lease and lease["holder"] == self.holder:
                self.storage.delete([WRITER_PATH])
        except TransientStorageError as e:  # the lease then expires by itself
            log.warning("could not release the writer lease of %s: %s", self.storage.url, e)
