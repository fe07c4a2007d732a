"""The single-writer claim on a sync root, and what it guarantees per backend.

One writer per sync root, in three layers:
- a claim held for the publisher's life: on a local folder (a path, `file://` or `local://`) an flock on
  `writer.lock`, exclusive between processes of this host and released by the kernel if the holder dies; on
  object stores and other fsspec URLs, which offer no conditional write through the APIs used here, a lease
  in `writer.lock` (holder, epoch, expiry; renewed every quarter of `lease_s`; left expired on release) that
  a second publisher reads and respects, then reads back after taking it;
- fencing: each publisher's claim takes an epoch larger than any before it, rewrites the head with it at
  once, and names its step files with its tag (`e<epoch>-<claim>`), so two writers never write the same data
  object. A claim that writes no head (`deltasync gc`) keeps the lease's epoch: readers, which look a lease's
  epoch up among the heads, find its head without a listing;
- acknowledgement: a publisher re-reads the head before writing it (it must be the head it wrote last), and
  acknowledges a step only after reading the head back (its own bytes) and, with a lease, the lease (still its
  own, same epoch, unexpired). Once its own clock says its lease may have lapsed (a long upload), it writes
  no head before taking the lease again like a new claim (written, read back): still its own, or
  WriterConflict.

What each backend guarantees:
- local folder: a second writer is refused outright; nothing below applies.
- object stores and fsspec URLs: at most one writer acknowledges a step, and a fenced writer's step files are
  garbage (GC removes them), never damage. The head itself is written without a condition: a writer that
  stops for longer than its lease inside the head write (after its last check) can still land its head on
  heads/latest.json. That hides nothing: each writer also writes its heads under its own epoch, a released
  lease stays behind (expired) naming its epoch, and readers take the head of the lease's epoch when it is
  newer than latest.json's (deltasync.sync.protocol.read_head_bytes); replicas never take a head older than
  one they have seen. The fenced writer finds the lease gone and never acknowledges; the current writer puts
  latest.json back at its next head write, lease renewal or close. Two claims racing within one request of
  each other can both read back their own lease; the acknowledgement's lease check then lets at most one of
  them acknowledge. Leases assume clocks that agree within a small fraction of `lease_s`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import socket
import time
import uuid

from deltasync.storage import Storage, TransientStorageError, WriterConflict
from deltasync.sync.config import LEASE_S
from deltasync.sync.protocol import WRITER_PATH

log = logging.getLogger(__name__)


def new_holder() -> str:
    """A writer's name, unique per claim, that tells a person where it runs."""
    return f"pid {os.getpid()} on {socket.gethostname()}, claim {uuid.uuid4().hex[:8]}"


class WriterClaim:
    """This process's claim to be the only writer of `storage` (see the module docstring): its lock where the
    backend has one, else a lease. Raises WriterConflict naming the holder when another writer has it.
    `fence`: take a new epoch, as a writer of heads and step files must; else the lease's is kept."""

    def __init__(
        self, storage: Storage, lease_s: float = LEASE_S, holder: str | None = None, fence: bool = False
    ):
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
            self.epoch = (lease["epoch"] if lease else 0) + (1 if fence else 0)
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
        kinds: dict[str, type | tuple[type, ...]] = {"holder": str, "epoch": int, "expires_at": (int, float)}
        ok = isinstance(lease, dict) and all(isinstance(lease.get(k), t) for k, t in kinds.items())
        return lease if ok and 0 <= lease["epoch"] < 1 << 62 and abs(lease["expires_at"]) < 1e12 else None

    @property
    def leased(self) -> bool:
        """Whether this claim is a lease (the backend has no lock)."""
        return self._lock is None

    @property
    def tag(self) -> str:
        """What this claim's step files are named with: no other claim writes objects of the same name."""
        return f"e{self.epoch}-{hashlib.blake2b(self.holder.encode(), digest_size=4).hexdigest()}"

    def raise_epoch(self, at_least: int) -> None:
        """Take epoch `at_least` if it is larger (past the head's), and put it in the lease."""
        if at_least > self.epoch:
            self.epoch = at_least
            self.renew()

    def renew_due(self) -> bool:
        return self._lock is None and time.time() - self._renewed_at > self.lease_s / 4

    def check_live(self) -> None:
        """Right before writing a head: if this process's clock says the lease may have lapsed (a long upload;
        another writer may be claiming the root now), take it again like a new claim (WriterConflict if
        another writer has it). Without a request while the lease runs."""
        if self._lock is None and time.time() >= self._renewed_at + self.lease_s:
            log.info(
                "%s: the writer lease lapsed in a long request (%.1f s since it was renewed, lease %g s): "
                "taking it again",
                self.storage.url,
                time.time() - self._renewed_at,
                self.lease_s,
            )
            self.renew()

    def confirm(self) -> None:
        """WriterConflict unless the lease is still this claim's, with its epoch, unexpired (a lock needs no
        check): the last check before a step is acknowledged."""
        if self._lock is None:
            lease = self._lease()
            mine = lease is not None and (lease["holder"], lease["epoch"]) == (self.holder, self.epoch)
            if lease is None or not mine or lease["expires_at"] <= time.time():
                other = lease["holder"] if lease else "a writer that removed the lease"
                raise WriterConflict(f"{self.storage.url}: another publisher ({other}) took over")

    def renewal(self) -> tuple[str, bytes, float] | None:
        """(path, content, when) of the lease that extends this claim, for the caller to write with its next
        request and then confirm with `renewed(when)`: the current lease was checked to be this claim's.
        None when nothing is due, or when the lease lapsed: then it was taken again here, with its read-back
        (WriterConflict if another writer has it)."""
        if not self.renew_due():
            return None
        if time.time() >= self._renewed_at + self.lease_s:
            self.renew()
            return None
        self._check_lease("took over")
        now = time.time()
        lease = {"holder": self.holder, "epoch": self.epoch, "expires_at": now + self.lease_s}
        return WRITER_PATH, json.dumps(lease).encode(), now

    def renewed(self, when: float) -> None:
        """The lease from `renewal()` (made at `when`) was written."""
        self._renewed_at = when

    def renew(self, taking: bool = False) -> None:
        """Extend the lease (a lock needs nothing); WriterConflict if another writer took it over. A lease
        that lapsed (a long step) but is still ours is taken again like a new claim: written, read back."""
        if self._lock is not None:
            return
        if not taking:
            taking = time.time() >= self._renewed_at + self.lease_s
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
            if (
                lease and lease["holder"] == self.holder
            ):  # expired at once, but its epoch stays: see read_head
                closed = {"holder": self.holder, "epoch": self.epoch, "expires_at": 0}
                self.storage.write_bytes(WRITER_PATH, json.dumps(closed).encode())
        except TransientStorageError as e:  # the lease then expires by itself
            log.warning("could not release the writer lease of %s: %s", self.storage.url, e)
