"""Where a replica's records go: at once on storage without a request budget, in batches within it.

On a Hub bucket every write is an API call from the token's shared quota, and a fleet of replicas writing one
record per step would spend it all. So with a budget (`storage.budget`, its share: deltasync.storage.budget)
the records wait, and go out together as one file of several steps (`steps-<first>-<last>.json`, read by
deltasync.telemetry.reader) once the oldest has waited `max_delay_s`: the budget's API calls per window, less
the replica's own overhead, spread over the window. A refusal or error goes out at once, as far as the budget
allows (the storage refuses without a request when it does not). A write that fails keeps its records for
the next one; past MAX_WAITING the oldest are dropped, and said.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import weakref
from collections.abc import Callable

from deltasync.storage import Storage, TransientStorageError
from deltasync.storage.budget import REPLICA_OVERHEAD, WINDOW_S
from deltasync.telemetry import MAX_RECORD_BYTES, REPLICAS_DIR, ReplicaRecord, to_json, write_now

log = logging.getLogger(__name__)
BATCH_RECORDS = 100  # per file: ~400 bytes each, well under MAX_RECORD_BYTES
MAX_WAITING = 10 * BATCH_RECORDS  # records kept while writes fail


def batch_path(replica: str, records: list[ReplicaRecord]) -> str:
    return f"{REPLICAS_DIR}/{replica}/steps-{records[0].step:08d}-{records[-1].step:08d}.json"


def batch_json(records: list[ReplicaRecord]) -> bytes:
    data = b"[" + b",".join(to_json(r) for r in records) + b"]"
    assert len(data) <= MAX_RECORD_BYTES, "BATCH_RECORDS records always fit"
    return data


_sinks: weakref.WeakKeyDictionary[Storage, ReplicaSink] = weakref.WeakKeyDictionary()
_sinks_lock = threading.Lock()


def sink_for(storage: Storage) -> ReplicaSink:
    """The one sink of `storage` (a replica's records share its budget)."""
    with _sinks_lock:
        sink = _sinks.get(storage)
        if sink is None:
            sink = _sinks[storage] = ReplicaSink(storage)
        return sink


class ReplicaSink:
    """A replica's telemetry writer. `flush_due()` (or its timer) writes what has waited long enough."""

    def __init__(self, storage: Storage, timer: bool = True):
        self._storage = weakref.ref(storage)  # sink_for's registry forgets a storage no one else holds
        self.timer = timer
        self.clock: Callable[[], float] = getattr(storage, "clock", time.time)  # the storage's quota windows
        budget = getattr(storage, "budget", None)
        writes = None if budget is None else max(1, budget.api - REPLICA_OVERHEAD["api"])
        self.max_delay_s = None if writes is None else WINDOW_S / writes  # None: each record at once
        self.waiting: list[ReplicaRecord] = []
        self._since = 0.0  # when the oldest waiting record came (on `clock`)
        self._lock = threading.Lock()
        self._timer: threading.Timer | None = None

    def add(self, record: ReplicaRecord) -> None:
        if self.max_delay_s is None:
            self._write([record])
            return
        with self._lock:
            if not self.waiting:
                self._since = self.clock()
            self.waiting.append(record)
            del self.waiting[:-MAX_WAITING]
        if record.error is not None or not record.verified:
            self.flush()
        else:
            self.flush_due()
            self._arm()

    def flush_due(self) -> None:
        """Write the waiting records if the oldest has waited `max_delay_s`."""
        if self.waiting and self.max_delay_s is not None and self.clock() - self._since >= self.max_delay_s:
            self.flush()

    def flush(self) -> None:
        """Write every waiting record now (one call); kept for the next try if it fails."""
        with self._lock:
            records, self.waiting = self.waiting, []
            since, self._since = self._since, self.clock()
        if records and not self._write(records):
            with self._lock:
                self.waiting[:0] = records
                dropped = len(self.waiting) - MAX_WAITING
                if dropped > 0:
                    log.warning("telemetry: %d records dropped, the storage kept failing", dropped)
                    del self.waiting[:dropped]
                self._since = since

    def _write(self, records: list[ReplicaRecord]) -> bool:
        storage = self._storage()
        if storage is None:
            return True  # closed: no one reads its records
        try:
            if self.max_delay_s is None:
                write_now(storage, records[0])
            else:
                chunks = [records[i : i + BATCH_RECORDS] for i in range(0, len(records), BATCH_RECORDS)]
                storage.write_many([(batch_path(c[0].replica, c), batch_json(c)) for c in chunks])
            return True
        except TransientStorageError as e:
            log.warning("telemetry of steps %d-%d: write failed: %s", records[0].step, records[-1].step, e)
            return False

    def _arm(self) -> None:
        """A timer that writes what waits even if no step comes (real seconds; `flush_due` checks `clock`)."""
        if not self.timer or self.max_delay_s is None or (self._timer and self._timer.is_alive()):
            return
        self._timer = threading.Timer(self.max_delay_s, self._on_timer)
        self._timer.daemon = True
        self._timer.start()

    def _on_timer(self) -> None:
        self._timer = None
        self.flush_due()
        if self.waiting:
            self._arm()


def parse_batch(data: bytes) -> list:
    """The JSON objects of a batch file (each checked by the reader as a record)."""
    items = json.loads(data)
    if not isinstance(items, list):
        raise ValueError("a batch of records is a JSON list")
    return items
