"""Incremental reading of a sync root's telemetry (deltasync.telemetry) for the dashboard and scripts.

A poll reads only files it has not seen. Where the storage follows a change feed (a Hub bucket), the feed
names the new files: a poll then lists nothing and, while nothing changes, sends no request; it lists once at
start and whenever the feed lost its place. Elsewhere, listing `telemetry/` costs as much as the history
(30,000 files at 10,000 steps; many paged requests on the Hub), so a poll lists only if listing keeps under
`listing_share` of the wall time (every poll for a short run, every few seconds for a long one); other polls
probe, with one `sizes()` call, the next few step names of each writer already known. Listings find the rest:
new replicas, a replica that jumped ahead to an anchor, stray files. Records are untrusted: a bad one
(malformed, huge, not a regular file) is skipped and reported in one line naming it, never fatal, and never
blocks a poll. A caller on a request quota passes `max_reads` to `fetch`: the newest records are read first
and the rest over later polls (`backlog`), so a dashboard started on a long run shows its latest steps at once
and never spends a window's quota in one poll.
"""

from __future__ import annotations

import collections
import heapq
import itertools
import json
import math
import os
import re
import stat
import statistics
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from deltasync.storage import LocalStorage, Storage, TooLargeError, TransientStorageError
from deltasync.sync.protocol import adapter_name
from deltasync.telemetry import (
    MAX_INFO_KEYS,
    MAX_RECORD_BYTES,
    REPLICAS_DIR,
    TRAINER_DIR,
    RecordError,
    ReplicaRecord,
    TrainerRecord,
    from_json,
)
from deltasync.telemetry.sink import parse_batch

TELEMETRY_DIR = "telemetry"
TRAINER_KINDS = {"anchor", "delta", "skipped"}
# head: a head the replica refused for its signature (a signed root; its error starts "head refused:")
REPLICA_KINDS = {"anchor", "delta", "head"}
REMOTE_READERS = 16  # parallel reads on object stores, where each read is a round trip
LISTING_SHARE = 0.1
PROBE_STEPS = 8  # next step names probed per writer; a faster writer is followed over successive polls
SUMMARY_PROBLEMS = 50  # newest problems listed in summary(); all are in `problems`
SERIES_REPLICAS = 64  # replicas in series(): those with the newest steps (a run has a handful)
CADENCE_STEPS = 20  # the trainer's step cadence is the median interval of its last this many records
FINISHED_AFTER_STEPS = 10  # a run with no new record for this many step intervals (and a minute) has stopped
FINISHED_AFTER_MIN_S = 60.0
STEP_NAME = re.compile(r"(?:step-|steps-(\d+)-)(\d+)\.json$")  # a record, or a batch: steps-<first>-<last>


# What reading one file gave: its records (a batch holds several) and its size, a bad record, a failure to
# retry, or nothing (removed).
Read = tuple[list[TrainerRecord | ReplicaRecord], int] | RecordError | TransientStorageError | None


@dataclass
class Poll:
    """What one poll found."""

    records: list[TrainerRecord | ReplicaRecord] = field(default_factory=list)
    problems: dict[str, str] = field(default_factory=dict)  # path -> why the file was skipped for good
    unread: dict[str, str] = field(default_factory=dict)  # path -> transient error: read again next poll


class TelemetryReader:
    """The telemetry of one sync root, read incrementally. Not thread-safe: callers serialise `poll()`."""

    def __init__(self, storage: Storage, readers: int | None = None, listing_share: float = LISTING_SHARE):
        self.storage = storage
        self.readers = readers or (1 if isinstance(storage, LocalStorage) else REMOTE_READERS)
        self.listing_share = listing_share
        self._listed_at = 0.0
        self._listing_s: float | None = None  # how long the last listing took
        self.trainer: dict[int, TrainerRecord] = {}
        self._info_keys: collections.Counter[str] = collections.Counter()  # trainer records reporting each
        self.replicas: dict[str, dict[int, ReplicaRecord]] = {}
        self.problems: dict[str, str] = {}
        self._seen: set[str] = set()
        self._unread: set[str] = set()  # failed to read: retried on the next poll
        self.backlog: list[str] = []  # found but not read yet (fetch's max_reads): read on later polls
        # A replica that refuses a step and then recovers rewrites that step's record: watch refusals' sizes.
        self._refused_sizes: dict[str, int] = {}

    def poll(self) -> Poll:
        """Read the records written since the last poll. Raises TransientStorageError if the storage fails."""
        return self.apply(self.fetch())

    def fetch(self, max_reads: int | None = None) -> list[tuple[str, Read]]:
        """poll()'s I/O: the new files and what reading each gave, at most `max_reads` of them (the newest
        steps first; None: all). It changes no records, so other threads may read them meanwhile (a slow
        bucket blocks no one); one thread at a time fetches and applies."""
        paths, probes = [], []
        start = time.monotonic()
        changed = self.storage.changes(TELEMETRY_DIR)
        if changed is not None:  # the change feed names what is new: no listing, no probe, no request
            paths = [p for p in changed if p not in self._seen or p in self._refused_sizes]
        elif (
            self._listing_s is None
            or self.storage.follows_changes  # the feed lost its place (or starts): list once, then follow it
            or (start - self._listed_at) * self.listing_share >= self._listing_s
        ):
            paths = [p for p in self.storage.list(TELEMETRY_DIR) if p not in self._seen]
            self._listed_at = time.monotonic()
            self._listing_s = self._listed_at - start
        else:
            probes = [p for p in self._next_paths() if p not in self._seen]
        if changed is None:
            sizes = self.storage.sizes(probes + list(self._refused_sizes))
            paths += [p for p in probes if sizes[p] is not None]
            paths += [p for p, size in self._refused_sizes.items() if sizes[p] not in (None, size)]
        paths = list(dict.fromkeys([*self._unread, *self.backlog, *paths]))
        self._unread.clear()
        if max_reads is not None and len(paths) > max_reads:
            paths.sort(key=_step_of_name, reverse=True)
            paths, self.backlog = paths[:max_reads], paths[max_reads:]
        else:
            self.backlog = []
        if self.readers > 1 and len(paths) > 1:
            with ThreadPoolExecutor(min(self.readers, len(paths))) as pool:
                return list(zip(paths, pool.map(self._read, paths), strict=True))
        return [(p, self._read(p)) for p in paths]

    def apply(self, fetched: list[tuple[str, Read]]) -> Poll:
        """Take in what fetch() read."""
        poll = Poll()
        for path, result in fetched:
            if isinstance(result, TransientStorageError):
                poll.unread[path] = str(result)
                self._unread.add(path)
                continue
            self._seen.add(path)
            self._refused_sizes.pop(path, None)
            if isinstance(result, RecordError):
                poll.problems[path] = str(result)
            elif result is not None:
                records, size = result
                for record in records:
                    self._add(record)
                poll.records += records
                single = records[0] if len(records) == 1 and "/step-" in path else None
                if isinstance(single, ReplicaRecord) and not single.verified:
                    self._refused_sizes[path] = size
        self.problems.update(poll.problems)
        return poll

    def _next_paths(self) -> list[str]:
        """The names each known writer (and a trainer not yet seen) would write next."""
        writers = [(TRAINER_DIR, max(self.trainer, default=-1))]
        writers += [(f"{REPLICAS_DIR}/{name}", max(steps)) for name, steps in self.replicas.items()]
        return [
            f"{folder}/step-{step:08d}.json"
            for folder, last in writers
            for step in range(last + 1, last + 1 + PROBE_STEPS)
        ]

    def _read(self, path: str) -> Read:
        cls: type[TrainerRecord] | type[ReplicaRecord]
        if path.startswith(TRAINER_DIR + "/"):
            cls = TrainerRecord
        elif path.startswith(REPLICAS_DIR + "/"):
            cls = ReplicaRecord
        else:
            return RecordError(f"{path}: not a telemetry record path")
        try:
            if isinstance(self.storage, LocalStorage):
                _check_local_file(self.storage.root / path, path)
            data = self.storage.read_bytes(path, limit=MAX_RECORD_BYTES)
            batch = STEP_NAME.search(path)
            if cls is ReplicaRecord and batch is not None and batch[1] is not None:
                records = [from_json(cls, json.dumps(item).encode(), path) for item in parse_batch(data)]
                for record in records:
                    _check(record, path, batch_of=(int(batch[1]), int(batch[2])))
            else:
                records = [from_json(cls, data, path)]
                _check(records[0], path)
        except FileNotFoundError:
            return None  # removed since the listing
        except (RecordError, TransientStorageError) as e:
            return e
        except TooLargeError as e:
            return RecordError(str(e))
        except Exception as e:  # the file is untrusted: whatever it makes reading raise skips it alone
            return RecordError(f"{path}: unreadable: {type(e).__name__}: {e}")
        return records, len(data)

    def _add(self, record: TrainerRecord | ReplicaRecord) -> None:
        if isinstance(record, TrainerRecord):
            old = self.trainer.get(record.step)
            if old is not None:
                self._info_keys.subtract(old.info)
                for key in old.info:
                    if self._info_keys[key] <= 0:
                        del self._info_keys[key]
            self._info_keys.update(record.info)
            self.trainer[record.step] = record
        else:
            self.replicas.setdefault(record.replica, {})[record.step] = record

    def series(self, since: int = -1) -> dict[str, Any]:
        """Per-step columns (JSON-ready) of records with step > `since`, sorted by step. Bounded whatever the
        root holds: of the trainer's own numbers the MAX_INFO_KEYS keys the most records report (a run's keys
        recur at every step), of the replicas the SERIES_REPLICAS that reached the highest steps."""
        trainer = [self.trainer[s] for s in sorted(self.trainer) if s > since]
        info_keys = sorted(self.info_keys())
        return {
            "trainer": {
                "step": [r.step for r in trainer],
                "kind": [r.kind for r in trainer],
                "published_at": [r.published_at for r in trainer],
                "density": [r.density for r in trainer],
                "changed": [r.changed for r in trainer],
                "numel": [r.numel for r in trainer],
                "payload_bytes": [r.payload_bytes for r in trainer],
                "anchor_bytes": [r.anchor_bytes for r in trainer],
                "full_bytes": [r.full_bytes for r in trainer],
                "encode_s": [r.encode_s for r in trainer],
                "upload_s": [r.upload_s for r in trainer],
                "blocked_s": [r.blocked_s for r in trainer],
                **{f"info.{k}": [_finite(r.info.get(k)) for r in trainer] for k in info_keys},
            },
            "replicas": {
                name: _replica_columns([steps[s] for s in sorted(steps) if s > since])
                for name, steps in sorted(self._newest_replicas())
            },
        }

    def _newest_replicas(self) -> list[tuple[str, dict[int, ReplicaRecord]]]:
        """The SERIES_REPLICAS replicas that reached the highest steps (ties: by name)."""
        ranked = ((-max(steps), name, steps) for name, steps in self.replicas.items())
        return [(name, steps) for _, name, steps in heapq.nsmallest(SERIES_REPLICAS, ranked)]

    def info_keys(self) -> list[str]:
        """The MAX_INFO_KEYS info keys the most trainer records report (ties: by name)."""
        counts = ((-n, key) for key, n in self._info_keys.items())
        return [key for _, key in heapq.nsmallest(MAX_INFO_KEYS, counts)]

    def summary(self, now: float, stale_after_s: float = 120.0) -> dict[str, Any]:
        """Headline numbers and one row per replica. A replica behind the newest step that has not reported
        for `stale_after_s` seconds is marked as stopped reporting; the run is `finished` once the trainer
        wrote nothing for FINISHED_AFTER_STEPS of its step intervals (and at least FINISHED_AFTER_MIN_S)."""
        published = [r for r in self.trainer.values() if r.kind != "skipped"]
        deltas = [r for r in published if r.kind == "delta"]
        head = max((r.step for r in published), default=None)
        latencies = [r.lag_s for steps in self.replicas.values() for r in steps.values() if r.verified]
        uploaded = sum(r.uploaded_bytes for r in published)  # an anchor step's delta and anchor both count
        full = sum(r.full_bytes for r in published)
        # A replica may report a step before the trainer's record of it is read: nobody is behind by < 0.
        newest = max([head if head is not None else -1, *(max(s) for s in self.replicas.values())])
        cadence = self._cadence_s()
        last = max((r.published_at for r in self.trainer.values()), default=None)
        silent_s = now - last if last is not None else None
        finished_after_s = max(FINISHED_AFTER_MIN_S, FINISHED_AFTER_STEPS * (cadence or 0.0))
        return {
            "root": self.storage.url,
            "rate_limited_until": self.storage.rate_limited_until,  # this reader's own requests are refused
            "steps": len(published),
            "latest_step": head,
            "anchors": sum(r.anchored for r in published),
            "skipped_steps": len(self.trainer) - len(published),
            "full_bytes": max(published, key=lambda r: r.step).full_bytes if published else None,
            "mean_delta_payload_bytes": statistics.fmean(r.payload_bytes for r in deltas) if deltas else None,
            "mean_delta_density": statistics.fmean(r.density for r in deltas) if deltas else None,
            "numel": max(published, key=lambda r: r.step).numel if published else None,
            "uploaded_bytes": uploaded,
            "bytes_saved": full - uploaded,  # against uploading the full bf16 model at every published step
            "saved_fraction": (full - uploaded) / full if full else None,
            "median_sync_latency_s": statistics.median(latencies) if latencies else None,
            "verified_applies": len(latencies),
            "step_interval_s": cadence,
            "trainer_silent_s": silent_s,
            "finished": silent_s is not None and silent_s > finished_after_s,
            "unread_records": len(self.backlog),  # found, not read yet: the numbers above lack them
            "replicas": [
                _replica_row(name, records, newest if newest >= 0 else None, now, stale_after_s)
                for name, records in sorted(self.replicas.items())
            ],
            "problems": list(self.problems.values())[-SUMMARY_PROBLEMS:],  # each line names its file
            "problem_count": len(self.problems),
        }

    def _cadence_s(self) -> float | None:
        """The median interval between the trainer's last CADENCE_STEPS records (None: fewer than two)."""
        times = sorted(r.published_at for r in self.trainer.values())[-CADENCE_STEPS:]
        return statistics.median(b - a for a, b in itertools.pairwise(times)) if len(times) > 1 else None

    def adapter_summary(self, lora: Mapping[str, Any]) -> dict[str, Any]:
        """For a LoRA root (`lora`: its run.json's `lora`): each published step's adapter version and payload
        beside what the merged path would have published for it (`merged_payload_bytes`, measured by a trainer
        with BucketWeightTransfer(measure_merged=True)), and the versions each replica holds: resolved and
        verified (a replica resolves only the versions requests name; one it refuses is logged, not
        recorded)."""
        published = [self.trainer[s] for s in sorted(self.trainer) if self.trainer[s].kind != "skipped"]
        compared = [r for r in published if "merged_payload_bytes" in r.info]
        replicas = sorted(self.replicas.items())
        rank = lora["adapter_config"].get("r")  # run.json is untrusted: PEFT's config may lack it
        return {
            "lora": {"name": lora["name"], "rank": rank if isinstance(rank, int) else None},
            "versions": [
                {
                    "version": adapter_name(lora["name"], r.step),
                    "kind": "anchor" if r.anchored else "delta",
                    "payload_bytes": r.uploaded_bytes,
                    "merged_payload_bytes": r.info.get("merged_payload_bytes"),
                }
                for r in published
            ],
            "mean_adapter_payload_bytes": statistics.fmean(r.uploaded_bytes for r in compared)
            if compared
            else None,
            "mean_merged_payload_bytes": (
                statistics.fmean(r.info["merged_payload_bytes"] for r in compared) if compared else None
            ),
            "versions_held": {
                name: sorted(s for s, r in steps.items() if r.verified) for name, steps in replicas
            },
        }


def _check_local_file(file: os.PathLike, path: str) -> None:
    """Refuse, before opening it, what a folder can hold under a record's name but a record never is: a FIFO
    (opening one blocks until a writer comes), a device, a folder, a symlink, or more than MAX_RECORD_BYTES.
    FileNotFoundError if it is gone."""
    st = os.lstat(file)
    if not stat.S_ISREG(st.st_mode):
        raise RecordError(f"{path}: not a regular file")
    if st.st_size > MAX_RECORD_BYTES:
        raise RecordError(f"{path}: {st.st_size} bytes, more than {MAX_RECORD_BYTES}")


def _check(record: TrainerRecord | ReplicaRecord, path: str, batch_of: tuple[int, int] | None = None) -> None:
    """What from_json leaves to the reader: the record belongs at `path` (in a batch of steps `batch_of`: in
    its writer's folder, a step within the name's), and its numbers make sense."""
    if batch_of is None and record.path() != path:
        raise RecordError(f"{path}: holds the record of {record.path()}")
    in_folder = record.path().rsplit("/", 1)[0] == path.rsplit("/", 1)[0]
    if batch_of is not None and not (in_folder and batch_of[0] <= record.step <= batch_of[1]):
        raise RecordError(f"{path}: holds the record of {record.path()}")
    kinds = TRAINER_KINDS if isinstance(record, TrainerRecord) else REPLICA_KINDS
    if record.kind not in kinds:
        raise RecordError(f"{path}: kind {record.kind!r} is not one of {sorted(kinds)}")
    if isinstance(record, TrainerRecord) and not 0 <= record.changed <= record.numel:
        raise RecordError(f"{path}: changed {record.changed} outside [0, numel {record.numel}]")
    if record.payload_bytes < 0 or getattr(record, "full_bytes", 0) < 0:
        raise RecordError(f"{path}: negative byte count")


def _step_of_name(path: str) -> int:
    """The step a record's file name gives (-1 for any other name): newest first."""
    match = STEP_NAME.search(path)
    return int(match[2]) if match else -1


def _finite(value: float | None) -> float | None:
    """None for what JSON cannot carry: a trainer may well report a NaN reward."""
    return value if value is not None and math.isfinite(value) else None


def _replica_columns(records: list[ReplicaRecord]) -> dict[str, list]:
    return {
        "step": [r.step for r in records],
        "kind": [r.kind for r in records],
        "verified": [r.verified for r in records],
        "published_at": [r.published_at for r in records],
        "applied_at": [r.applied_at for r in records],
        "lag_s": [r.lag_s for r in records],
        "lag_steps": [r.lag_steps for r in records],
        "download_s": [r.download_s for r in records],
        "apply_s": [r.apply_s for r in records],
        "pause_s": [r.pause_s for r in records],
        "error": [r.error for r in records],
    }


def _replica_row(
    name: str, steps: dict[int, ReplicaRecord], head: int | None, now: float, stale_after_s: float
) -> dict[str, Any]:
    last_report = max(steps.values(), key=lambda r: r.applied_at)
    applied = [r for r in steps.values() if r.verified]
    current = max(applied, key=lambda r: r.step, default=None)
    refused = [r for r in steps.values() if not r.verified]
    last_refusal = max(refused, key=lambda r: r.applied_at, default=None)
    behind = head - current.step if head is not None and current else None
    silent_s = now - last_report.applied_at
    if behind != 0 and silent_s > stale_after_s:
        status = "stopped reporting"
    elif last_report is last_refusal:
        status = "refused last step"
    else:
        status = "ok"
    return {
        "replica": name,
        "status": status,
        "step": current.step if current else None,
        "behind_steps": behind,
        "last_lag_s": current.lag_s if current else None,
        "last_applied_at": max((r.applied_at for r in applied), default=None),
        "last_report_at": last_report.applied_at,
        "silent_s": silent_s,
        "applied": len(applied),
        "refused": len(refused),
        "last_error": last_refusal.error if last_refusal else None,
        "rate_limited_until": last_report.rate_limited_until,  # its last step was held back until then
    }
