"""Publisher: the trainer's side of the sync root.

`publish()` costs the caller one bf16 copy of its weights into a host buffer; a background thread compares
it with the last published state, encodes the patch, uploads it and moves the head. When uploads lag, newer
states replace the pending one (the skipped step is folded into the next delta) instead of queueing without
bound. The last published state advances only once the head naming it is written.
"""

from __future__ import annotations

import logging
import tempfile
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch

from deltasync import telemetry
from deltasync.codec import fingerprint
from deltasync.codec.changes import SchemaError
from deltasync.codec.patch import encode, make_patch
from deltasync.sync.anchor import write_anchor
from deltasync.sync.protocol import HEAD_PATH, RUN_PATH, Entry, Head, RunInfo, delta_path, step_of
from deltasync.sync.storage import Storage, TransientStorageError, open_storage

log = logging.getLogger(__name__)
Params = Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]


@dataclass
class PublisherConfig:
    encoding: str = "compact"
    anchor_every: int = 50  # steps between complete anchors (also earlier once the deltas outweigh one)
    keep_anchors: int = 2  # GC keeps this many newest anchors and every delta after the oldest of them
    shard_bytes: int = 2 << 30
    retry_s: tuple[float, float] = (0.5, 30.0)  # backoff of failed uploads: first and longest wait


@dataclass
class _Pending:
    state: dict[str, torch.Tensor]
    step: int
    info: dict[str, float]
    blocked_s: float
    skipped: list[telemetry.TrainerRecord] = field(default_factory=list)  # steps this one replaced


class Publisher:
    """Publishes successive states of one model to the sync root `root` (URL, path or Storage)."""

    def __init__(self, root: str | Path | Storage, model: str = "", config: PublisherConfig | None = None):
        self.storage = root if isinstance(root, Storage) else open_storage(root)
        self.model = model
        self.config = config or PublisherConfig()
        self._cond = threading.Condition()
        self._pending: _Pending | None = None
        self._spare: dict[str, torch.Tensor] | None = None  # a buffer the worker gave back
        self._busy = False
        self._closed = False
        self._error: BaseException | None = None
        self._run: RunInfo | None = None
        self._head: Head | None = None
        self._published: dict[str, torch.Tensor] | None = None  # the state the head names, bf16 on the host
        self._published_fp = 0
        self._resume()
        self.last_step = self._head.step if self._head else -1  # the newest step handed to publish()
        self._thread = threading.Thread(target=self._work, name="deltasync-publisher", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------------------------ caller's thread

    def publish(
        self, params: Params, step: int | None = None, info: Mapping[str, float] | None = None
    ) -> int:
        """Hand over the state after `step` (default: the next one); returns the step. Blocks only for a copy.

        `info` (the trainer's numbers for this step: rewards, staleness) goes into its telemetry record.
        """
        start = time.perf_counter()
        params = dict(params.items() if isinstance(params, Mapping) else params)
        with self._cond:
            self._raise_if_failed()
            step = self.last_step + 1 if step is None else step
            if step <= self.last_step:
                raise ValueError(f"step {step} is not after the last published step {self.last_step}")
            pending = self._pending
            if pending is not None:  # the worker has not taken it yet: overwrite it (coalesce)
                buffer, skipped = pending.state, [*pending.skipped, self._skipped_record(pending)]
            else:
                buffer, skipped = self._spare or self._allocate(params), []
                self._spare = None
            _copy_into(buffer, params)
            self._pending = _Pending(buffer, step, dict(info or {}), 0.0, skipped)
            self.last_step = step
            self._pending.blocked_s = time.perf_counter() - start
            self._cond.notify_all()
        return step

    def flush(self, timeout: float | None = None) -> None:
        """Wait until every handed-over state is published; raises the worker's error if it failed."""
        with self._cond:
            ok = self._cond.wait_for(lambda: self._error or not (self._pending or self._busy), timeout)
            self._raise_if_failed()
            if not ok:
                raise TimeoutError(f"publisher still uploading after {timeout} s")

    def close(self, timeout: float | None = None) -> None:
        """Publish what is pending, then stop the worker."""
        try:
            self.flush(timeout)
        finally:
            with self._cond:
                self._closed = True
                self._cond.notify_all()
            self._thread.join(timeout)

    def __enter__(self) -> Publisher:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def head(self) -> Head | None:
        """The head as last written."""
        return self._head

    def _allocate(self, params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if self._run is None:
            self._run = RunInfo.of(self.model, params)
        pin = any(t.is_cuda for t in params.values())  # D2H copies into pinned memory do not stall
        return {n: torch.empty(s, dtype=torch.bfloat16, pin_memory=pin) for n, s in self._run.schema.items()}

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"publisher to {self.storage.url} failed: {self._error}") from self._error

    @staticmethod
    def _skipped_record(pending: _Pending) -> telemetry.TrainerRecord:
        return telemetry.TrainerRecord(
            step=pending.step,
            kind="skipped",
            published_at=time.time(),
            numel=0,
            changed=0,
            payload_bytes=0,
            full_bytes=0,
            encode_s=0.0,
            upload_s=0.0,
            blocked_s=pending.blocked_s,
            info=pending.info,
        )

    # ------------------------------------------------------------------------------------ worker thread

    def _work(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._pending or self._closed)
                if self._pending is None:
                    return
                job, self._pending, self._busy = self._pending, None, True
            try:
                self._publish_with_retries(job)
            except BaseException as e:  # kept for the caller: publish() and flush() raise it
                log.exception("publisher failed")
                with self._cond:
                    self._error = e
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()
            if self._error is not None:
                return

    def _publish_with_retries(self, job: _Pending) -> None:
        wait = self.config.retry_s[0]
        while True:
            try:
                self._publish(job)
                return
            except TransientStorageError as e:
                log.warning("upload of step %d failed, retrying in %.1f s: %s", job.step, wait, e)
            with self._cond:
                # A newer state arrived while this one failed: publish that instead, folding this step in.
                if self._cond.wait_for(lambda: self._pending is not None, wait):
                    newer, self._pending = self._pending, None
                    newer.skipped = [*job.skipped, self._skipped_record(job), *newer.skipped]
                    self._spare, job = job.state, newer
            wait = min(2 * wait, self.config.retry_s[1])

    def _publish(self, job: _Pending) -> None:
        start = time.perf_counter()
        head, old = self._head, self._published
        if head is None:
            self.storage.write_bytes(RUN_PATH, self._run.to_json())
        patch = data = None
        if old is not None:
            patch = make_patch(old, job.state, job.step, head.step, self._published_fp)
            data = encode(patch, old, self.config.encoding)
        fp = patch.fingerprint if patch else fingerprint.state_fingerprint(job.state)
        fp_text = fingerprint.format_fingerprint(fp)
        with tempfile.TemporaryDirectory(prefix="deltasync-") as tmp:
            anchor_files = []
            if self._anchor_due(job.step, len(data) if data is not None else None):
                anchor_files = write_anchor(job.state, job.step, fp, Path(tmp), self.config.shard_bytes)
            encode_s = time.perf_counter() - start
            if patch is not None:
                self.storage.write_bytes(delta_path(job.step), data)
            for local, path in anchor_files:
                self.storage.upload_file(local, path)
            anchor_bytes = sum(local.stat().st_size for local, _ in anchor_files)
        now = time.time()
        entries = []
        if patch is not None:
            files = (delta_path(job.step),)
            entries.append(Entry(job.step, "delta", files, len(data), fp_text, now, patch.changed, head.step))
        if anchor_files:
            files = tuple(path for _, path in anchor_files)
            entries.append(Entry(job.step, "anchor", files, anchor_bytes, fp_text, now))
        new_head = self._retained(head, entries, job.step, fp_text)
        self.storage.write_bytes(HEAD_PATH, new_head.to_json())  # the step exists from here on
        upload_s = time.perf_counter() - start - encode_s
        with self._cond:
            self._head, self._published_fp = new_head, fp
            self._spare = self._spare or old
            self._published = job.state
        record = telemetry.TrainerRecord(
            step=job.step,
            kind="anchor" if anchor_files else "delta",
            published_at=now,
            numel=self._run.numel,
            changed=patch.changed if patch else self._run.numel,
            payload_bytes=len(data) if data is not None else anchor_bytes,
            full_bytes=2 * self._run.numel,
            encode_s=encode_s,
            upload_s=upload_s,
            blocked_s=job.blocked_s,
            base_step=head.step if head else None,
            info=job.info,
        )
        try:  # the step is published: losing telemetry or leaving garbage must not undo that
            for r in [*job.skipped, record]:
                telemetry.write(self.storage, r)
            self.storage.delete(sorted((head.files() if head else set()) - new_head.files()))
        except TransientStorageError as e:
            log.warning("step %d published, but telemetry or GC failed: %s", job.step, e)

    def _anchor_due(self, step: int, delta_bytes: int | None) -> bool:
        head = self._head
        if head is None or delta_bytes is None:
            return True
        last = head.anchors[-1]
        chain = sum(e.bytes for e in head.deltas if e.step > last.step) + delta_bytes
        return step - last.step >= self.config.anchor_every or chain > last.bytes

    def _retained(self, head: Head | None, new: list[Entry], step: int, fp: str) -> Head:
        """The head after `new`: the newest `keep_anchors` anchors and the deltas after the oldest of them."""
        entries = [*(head.entries if head else ()), *new]
        oldest = [e for e in entries if e.kind == "anchor"][-self.config.keep_anchors :][0]
        kept = [e for e in entries if e.step > oldest.step or e == oldest]
        return Head(step, fp, tuple(kept))

    def _resume(self) -> None:
        """Continue a run already in the sync root: its schema, head and last published state."""
        from deltasync.sync.subscriber import Subscriber  # the reader's verified path to the head state

        try:
            head = Head.from_json(self.storage.read_bytes(HEAD_PATH))
        except FileNotFoundError:
            return
        self._run = RunInfo.from_json(self.storage.read_bytes(RUN_PATH))
        reader = Subscriber(self.storage)
        reader.sync(head.step)
        if reader.step != head.step:
            raise RuntimeError(f"cannot resume {self.storage.url}: {reader.last_error}")
        self._head, self._published, self._published_fp = head, reader.state, reader.fingerprint
        collect_garbage(self.storage, head, newer_too=True)


def collect_garbage(storage: Storage, head: Head, newer_too: bool = False) -> list[str]:
    """Delete data files the head does not name; returns them. Files of steps after the head belong to an
    upload in progress unless `newer_too` (only the publisher itself knows there is none)."""
    garbage = [
        path
        for path in storage.list("deltas") + storage.list("anchors")
        if path not in head.files() and (step_of(path) or 0) <= (float("inf") if newer_too else head.step)
    ]
    storage.delete(garbage)
    return garbage


def _copy_into(buffer: dict[str, torch.Tensor], params: dict[str, torch.Tensor]) -> None:
    if list(buffer) != list(params):
        raise SchemaError("parameter names differ from the first published state")
    for name, t in params.items():
        if buffer[name].shape != t.shape:
            raise SchemaError(f"{name}: shape {tuple(t.shape)} != {tuple(buffer[name].shape)}")
        buffer[name].copy_(t.detach(), non_blocking=True)  # casts to bf16; from CUDA into pinned memory
    if any(t.is_cuda for t in params.values()):
        torch.cuda.synchronize()
