"""Publisher: the trainer's side of the sync root.

`publish()` costs the caller one bf16 copy of its weights, into a buffer where `PublisherConfig.previous_copy`
says: beside the weights (on CUDA: a device-to-device copy; the GPU codec then diffs and ranks there and the
host gets O(changed elements)) or in pinned host memory (the host codec diffs). A background thread compares
it with the last published state, encodes the patch, uploads it and moves the head. When uploads lag, newer
states replace the pending one (the skipped step is folded into the next delta) instead of queueing without
bound. The last published state advances only once the head naming it is written and read back.

Only one publisher writes a root at a time: see `deltasync.sync.claim`.

Given `model_revision`, a run's first state that is exactly the weights of the Hub model `model` at that
revision (resolved to its commit; checked by fingerprint) goes out by reference to it, not as an anchor
(`deltasync.sync.base`); otherwise (other weights, or a repository that cannot be reached) one line says why
and it goes out as an anchor.
"""

from __future__ import annotations

import logging
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping
from concurrent import futures
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, TypeVar

import torch

from deltasync import telemetry
from deltasync.codec import bf16, fingerprint
from deltasync.codec.changes import SchemaError, name_difference
from deltasync.codec.host import warm_up
from deltasync.codec.patch import encode, make_patch
from deltasync.errors import AnchorError
from deltasync.quant.root import Held, QuantizedRoot
from deltasync.storage import (
    LocalStorage,
    Storage,
    TransientStorageError,
    WriterConflict,
    open_storage,
    retry,
)
from deltasync.sync import base
from deltasync.sync.anchor import anchor_due, anchor_encoding, retained, write_anchor
from deltasync.sync.claim import WriterClaim, new_holder
from deltasync.sync.config import PublisherConfig
from deltasync.sync.gc import collect_garbage, delete_emptied_folders
from deltasync.sync.protocol import (
    HEAD_PATH,
    RUN_PATH,
    Entry,
    Head,
    ManifestError,
    ModelReference,
    RunInfo,
    check_step,
    delta_files,
    delta_paths,
    epoch_head_path,
    read_head_bytes,
    read_manifest,
)
from deltasync.sync.signing import RunSigner, Trust, sha256_of, short
from deltasync.sync.worker import Worker

log = logging.getLogger(__name__)
Params = Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]
T = TypeVar("T")


@dataclass(frozen=True)
class StoredDelta:
    """A delta already in the sync root under this publisher's tag: the parts that the ranks of a sharded
    publisher encoded and uploaded (see deltasync.sync.sharded)."""

    files: tuple[str, ...]  # protocol.delta_paths of the step, in order
    bytes: int  # all parts together
    changed: int
    fingerprint: int  # of the state after the step
    encode_s: float = 0.0  # the slowest part's
    sha256: tuple[str, ...] | None = None  # of each part, in order: what a signed head names


@dataclass
class _Pending:
    state: dict[str, torch.Tensor]  # a stored delta's: the anchor to write, or empty
    step: int
    info: dict[str, float]
    blocked_s: float
    skipped: list[telemetry.TrainerRecord] = field(default_factory=list)  # steps this one replaced
    stored: StoredDelta | None = None


class Publisher:
    """Publishes successive states of one model to the sync root `root` (URL, path or Storage), as its only
    writer: raises WriterConflict naming the holder if another publisher has the root. `model_revision`: the
    revision of the Hub model `model` training started from (see the module's docstring)."""

    def __init__(
        self,
        root: str | Path | Storage,
        model: str = "",
        config: PublisherConfig | None = None,
        lora: dict | None = None,
        model_revision: str | None = None,
    ):
        self.storage = root if isinstance(root, Storage) else open_storage(root)
        self.model, self.lora = model, lora  # lora: run.json's mark of a LoRA root (RunInfo.lora)
        self.model_revision = model_revision
        self.config = config or PublisherConfig()
        self._signer = RunSigner.load(self.config.signing_key, self.config.previous_signing_key)
        self._spare: dict[str, torch.Tensor] | None = None  # a buffer the worker gave back
        self._run: RunInfo | None = None
        self._head: Head | None = None
        self._published: dict[str, torch.Tensor] | None = None  # the state the head names (bf16)
        self._published_fp = 0
        self._stored = False  # publish_stored() was called: the ranks, not this publisher, hold the state
        self._quant: QuantizedRoot | None = None  # config.quantization's, once the schema is known
        self._head_bytes: set[bytes | None] = {None}  # what the head may be now: what we wrote (or none)
        # Telemetry of published steps and files no head names any more: sent with the next step's data (one
        # request on the Hub), or by flush(), close() and the idle loop.
        self._due: list[tuple[str, bytes | Path]] = []
        self._garbage: list[str] = []
        # Head reads that travel while the data uploads, and lease checks beside read-backs.
        self._background = futures.ThreadPoolExecutor(1, thread_name_prefix="deltasync-publisher-check")
        holder = new_holder()  # one name across retries: a lease written by a failed attempt is its own
        lease_s = self.config.lease_s
        self.claim = self._retrying(lambda: WriterClaim(self.storage, lease_s, holder, fence=True))
        try:
            self._retrying(self._resume)
        except BaseException:
            self.claim.release()
            self._background.shutdown()
            raise
        self.last_step = self._head.step if self._head else -1  # the newest step handed to publish()
        if self._head is not None:
            log.info("continuing run at step %d", self._head.step)
        self._worker: Worker[_Pending] = Worker(
            "deltasync-publisher",
            f"publisher to {self.storage.url}",
            self._publish_with_retries,
            idle=self._idle,  # on the worker: publish() never waits for it
            idle_s=self.config.lease_s / 8,
            start=warm_up,  # the codec's loops load now, not on the first steps
        )

    # ------------------------------------------------------------------------------------ caller's thread

    def publish(
        self, params: Params, step: int | None = None, info: Mapping[str, float] | None = None
    ) -> int:
        """Hand over the state after `step` (default: the next one); returns the step. Blocks only for a copy.

        `info` (the trainer's numbers for this step: rewards, staleness) goes into its telemetry record.
        """
        if self._stored:
            raise ValueError("publish(): this publisher publishes stored deltas; it holds no state to diff")
        return self._hand_over(params, step, info, None, "publish()")

    def publish_stored(
        self,
        delta: StoredDelta,
        step: int,
        anchor: Params | None = None,
        info: Mapping[str, float] | None = None,
    ) -> int:
        """Publish `step` as `delta`, whose files are already stored, from the last published step, with an
        anchor of the whole state `anchor` (which `delta.fingerprint` must be) when given; returns the step.
        Waits for the previous step's head first (a stored delta applies to exactly that step: never folded
        into another), then blocks only for the anchor's copy. After it, `publish()` is refused."""
        check_step(step, "publish_stored()")
        if self.config.quantization is not None:
            raise ValueError("publish_stored(): a quantized root's deltas are encoded by its publisher alone")
        if delta.files != tuple(delta_paths(step, len(delta.files), self.claim.tag)):  # as readers check it
            raise ValueError(
                f"publish_stored(): {list(delta.files)!r:.200} are not where this writer's delta of step "
                f"{step} lives"
            )
        if self._signer is not None and delta.sha256 is None:
            raise ValueError("publish_stored(): a signed root's head names each part's sha256: none given")
        self.flush()
        if self._head is None:
            raise ValueError("publish_stored(): no published step for the delta to start from")
        step = self._hand_over(anchor or {}, step, info, delta, "publish_stored()")
        self._stored = True
        return step

    def anchor_due(self, step: int, delta_bytes: int | None) -> bool:
        """Whether `step` also goes out as an anchor, beside a delta of `delta_bytes` (None: no delta), given
        the head as last written (see `flush`)."""
        return anchor_due(self._head, step, delta_bytes, self.config.anchor_every)

    def _hand_over(
        self,
        params: Params,
        step: int | None,
        info: Mapping[str, float] | None,
        stored: StoredDelta | None,
        where: str,
    ) -> int:
        start = time.perf_counter()
        params = dict(params.items() if isinstance(params, Mapping) else params)
        require_floats(params, where)
        problem = info_problem(info or {})
        if problem:  # else every dashboard would skip the step's record, or the worker fail on it
            raise ValueError(f"{where}: info {problem}")
        chosen = check_step(self.last_step + 1 if step is None else step, where)

        def job(pending: _Pending | None) -> _Pending:  # under the worker's lock: it takes the job whole
            if chosen <= self.last_step:
                raise ValueError(f"step {chosen} is not after the last published step {self.last_step}")
            if pending is not None:  # the worker has not taken it yet: overwrite it (coalesce)
                buffer, skipped = pending.state, [*pending.skipped, self._skipped_record(pending)]
            elif stored is not None and not params:
                buffer, skipped = {}, []
            else:
                buffer, skipped = self._spare or self._allocate(params), []
            if params:
                _copy_into(buffer, params)  # a refused state leaves the buffer (a pending step's) untouched
            if buffer is self._spare:
                self._spare = None
            self.last_step = chosen
            return _Pending(buffer, chosen, dict(info or {}), time.perf_counter() - start, skipped, stored)

        self._worker.submit(job)
        return chosen

    def flush(self, timeout: float | None = None) -> None:
        """Wait until every handed-over state is published, with its telemetry; raises the worker's error if
        it failed."""
        self._worker.flush(timeout)
        self._send_due()

    def _take_due(self) -> tuple[list[tuple[str, bytes | Path]], list[str]]:
        with self._worker.lock:
            due, garbage, self._due, self._garbage = self._due, self._garbage, [], []
        return due, garbage

    def _give_back(self, due: list[tuple[str, bytes | Path]], garbage: list[str]) -> None:
        with self._worker.lock:
            self._due, self._garbage = due + self._due, garbage + self._garbage

    def _send_due(self) -> None:
        """Write the telemetry and delete the garbage still due (best effort: the steps are published)."""
        due, garbage = self._take_due()
        if not (due or garbage):
            return
        try:
            self._write_many(due, garbage)
        except TransientStorageError as e:
            self._give_back(due, garbage)
            log.warning("telemetry or GC of published steps failed, retrying later: %s", e)

    def _write_many(self, files: list[tuple[str, bytes | Path]], garbage: list[str]) -> None:
        """Write `files` and delete `garbage` (one request on the Hub), then the step folders that emptied."""
        self.storage.write_many(files, garbage)
        delete_emptied_folders(self.storage, garbage)

    def close(self, timeout: float | None = None) -> None:
        """Publish what is pending, stop the worker and let the next writer in; publish() then raises, and
        so does close() if publishing failed (after letting the next writer in)."""
        try:
            self._worker.close(timeout)
        finally:
            if self._worker.stopped:
                if self._worker.error is None:
                    self._send_due()
                    self._restore_head()
                self.claim.release()
                self._background.shutdown()

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
            self._run = RunInfo.of(self.model, params, self.lora, self.config.quantization)
            self._run = self._signer.start(self._run) if self._signer else self._run
            self._quantize(self._run)
        on_device = keeps_on_device(self.config, params.values())
        pin = not on_device and any(t.is_cuda for t in params.values())  # D2H copies into it do not stall
        device = {n: t.device for n, t in params.items()} if on_device else {}  # (else: the host)
        return {
            n: torch.empty(s, dtype=torch.bfloat16, device=device.get(n), pin_memory=pin)
            for n, s in self._run.schema.items()
        }

    @staticmethod
    def _skipped_record(pending: _Pending) -> telemetry.TrainerRecord:
        nothing: dict[str, Any] = dict.fromkeys(("numel", "changed", "payload_bytes", "full_bytes"), 0)
        nothing |= dict.fromkeys(("encode_s", "upload_s"), 0.0)  # a skipped step measured nothing
        return telemetry.TrainerRecord(
            step=pending.step,
            kind="skipped",
            published_at=time.time(),
            blocked_s=pending.blocked_s,
            info=pending.info,
            **nothing,
        )

    # ------------------------------------------------------------------------------------ worker thread

    def _retrying(self, call: Callable[[], T]) -> T:
        """`call()`, retried a few times on transient storage errors (for the constructor's reads)."""
        return retry(call, self.config.retry_s, attempts=6, log_as=f"opening {self.storage.url}")

    def _idle(self) -> None:
        self._renew_lease()
        self._send_due()

    def _renew_lease(self) -> None:
        """Renew the lease when due; fenced (WriterConflict), the worker stops and publish() raises it."""
        if not self.claim.renew_due():
            return
        try:
            self.claim.renew()
            self._restore_head()
        except TransientStorageError as e:
            log.warning("lease renewal failed, retrying: %s", e)

    def _restore_head(self) -> None:
        """Put this writer's head back if a fenced writer replaced it (see deltasync.sync.claim)."""
        if not self.claim.leased or self._head is None:
            return
        try:
            current = self._current_head()
            if current not in self._head_bytes:
                self._write_head(self._head, current)
        except (TransientStorageError, WriterConflict) as e:
            log.warning("could not check the head of %s: %s", self.storage.url, e)

    def _publish_with_retries(self, job: _Pending) -> None:
        jobs = [job]  # the one being published: a newer state replaces it while a failed upload waits

        def wait(seconds: float) -> None:
            # A newer state arrived while this one failed: publish that instead, folding this step in.
            newer = self._worker.take_newer(seconds)
            if newer is not None:
                old = jobs[0]
                newer.skipped = [*old.skipped, self._skipped_record(old), *newer.skipped]
                with self._worker.lock:
                    self._spare, jobs[0] = old.state, newer

        retry(lambda: self._publish(jobs[0]), self.config.retry_s, log_as="publishing a step", sleep=wait)

    def _publish(self, job: _Pending) -> None:
        """Encode the step (a delta from the published state, an anchor when due), upload it, then write and
        read back the head naming it: from then on the step is acknowledged. Telemetry and GC follow."""
        start = time.perf_counter()
        head, old = self._head, self._published
        assert self._run is not None  # known before the first job
        if old is not None and any(old[n].device != t.device for n, t in job.state.items()):
            old = {n: old[n].to(t.device) for n, t in job.state.items()}  # resumed: read on the host
        delta, data, held = self._delta(job, head, old)
        fp = delta.fingerprint if delta else fingerprint.state_fingerprint(job.state)
        if self._quant is not None and held is None:  # a chain starts: its replicas quantize it at load
            held = self._quant.start(job.state)
        quantized = fingerprint.format_fingerprint(held.fingerprint) if held else None
        reference = self._reference(job, fp) if head is None else None
        if head is None:
            self._run = replace(self._run, base=reference[0] if reference else None)
            self.storage.write_bytes(RUN_PATH, self._run_json())
        with tempfile.TemporaryDirectory(prefix="deltasync-") as tmp:
            anchor_files = [] if reference else self._anchor(job, delta, fp, Path(tmp))
            encode_s = time.perf_counter() - start + (job.stored.encode_s if job.stored else 0.0)
            current = self._upload(delta.files if delta and data else (), data, anchor_files)
            anchor_bytes = sum(local.stat().st_size for local, _ in anchor_files)
            anchor_sha256 = self._digests(local for local, _ in anchor_files)
        now, fp_text = time.time(), fingerprint.format_fingerprint(fp)
        entries = []
        if delta is not None and head is not None:
            entries.append(
                Entry(
                    job.step,
                    "delta",
                    delta.files,
                    delta.bytes,
                    fp_text,
                    now,
                    delta.changed,
                    head.step,
                    quantized,
                    delta.sha256,
                )
            )
        if anchor_files:
            files = tuple(path for _, path in anchor_files)
            entries.append(
                Entry(
                    job.step,
                    "anchor",
                    files,
                    anchor_bytes,
                    fp_text,
                    now,
                    quantized=quantized,
                    sha256=anchor_sha256,
                )
            )
        if reference:  # the model repository's files: none of the root's
            entries.append(Entry(job.step, "base", (), reference[1], fp_text, now, quantized=quantized))
        # Without a delta the step starts a new chain (the run's first step, or a head whose state could not
        # be verified on resume): its anchor needs nothing before it.
        kept = retained([*(head.entries if head and delta else ()), *entries], self.config.keep_anchors)
        new_head = Head(job.step, fp_text, kept, self.claim.epoch, self.claim.holder, self._run_id)
        self._write_head(new_head, current)  # the step is acknowledged from here on
        upload_s = time.perf_counter() - start - encode_s
        with self._worker.lock:
            self._head, self._published_fp = new_head, fp
            if self._quant is not None and held is not None:
                self._quant.commit(held)
            if job.stored is None:
                self._spare = self._spare or old or _touched_like(job.state)  # (first touch: not in publish)
                self._published = job.state
            else:  # the ranks hold the state: keep no copy of it
                self._published = self._spare = None
        # What went out: a delta (its bytes are the payload), and/or an anchor of `anchor_bytes` beside it.
        record = telemetry.TrainerRecord(
            step=job.step,
            kind="delta" if delta else "base" if reference else "anchor",
            published_at=now,
            numel=self._run.numel,
            changed=delta.changed if delta else self._run.numel,
            payload_bytes=delta.bytes if delta else 0,
            anchor_bytes=anchor_bytes,
            full_bytes=2 * self._run.numel,
            encode_s=encode_s,
            upload_s=upload_s,
            blocked_s=job.blocked_s,
            base_step=head.step if head and delta else None,
            info=job.info,
        )
        sent = [f"anchor {anchor_bytes / 1e3:.1f} kB"] if anchor_files else []
        sent += [f"the base model {reference[0]} by reference: nothing uploaded"] if reference else []
        if delta:
            sent.insert(0, f"delta {delta.bytes / 1e3:.1f} kB, {100 * record.density:.2f}% changed")
        log.info("published step %d (%s)", job.step, "; ".join(sent))
        # The step is published: its telemetry and garbage go out with the next request (never undoing it).
        # What the head no longer names, and the step's own delta when retention already dropped it:
        written = {f for e in entries for f in e.files}
        with self._worker.lock:
            self._due += [(r.path(), telemetry.to_json(r)) for r in [*job.skipped, record]]
            self._garbage += sorted(((head.files() if head else set()) | written) - new_head.files())

    def _delta(
        self, job: _Pending, head: Head | None, old: dict[str, torch.Tensor] | None
    ) -> tuple[StoredDelta | None, list[bytes], Held | None]:
        """The step's delta (a stored one, or one encoded here from the published state `old`, with its
        files' bytes; on a quantized root, the quantized state it leads to), or none: the run's first state,
        which goes out as an anchor only."""
        if job.stored is not None or old is None:
            return job.stored, [], None
        assert head is not None  # the published state is the one the head names
        threads = self.config.threads
        patch = make_patch(old, job.state, job.step, head.step, self._published_fp, threads)
        held = None
        if self._quant is None:
            data = [encode(patch, old, self.config.encoding, threads)]
        else:  # the bf16 patch of the tensors the recipe leaves alone, then the quantized delta
            *data, held = self._quant.delta(patch, old, job.state, self.config.encoding, threads)
        # Only this claim writes them: a fenced writer never can.
        files = delta_files(job.step, self.claim.tag, quantized=held is not None)
        sha256 = self._digests(data)
        stored = StoredDelta(files, sum(map(len, data)), patch.changed, patch.fingerprint, sha256=sha256)
        return stored, data, held

    def _digests(self, files: Iterable[bytes | Path]) -> tuple[str, ...] | None:
        """The SHA-256 of each of a step's files (bytes, or local files), as a signed head names them; None
        for an unsigned root."""
        return tuple(map(sha256_of, files)) if self._signer else None

    @property
    def _run_id(self) -> str:
        signing = self._run.signing if self._run else None
        return signing.run if signing else ""

    def _run_json(self) -> bytes:
        assert self._run is not None  # known before the first write
        return self._signer.run_json(self._run) if self._signer else self._run.to_json()

    def _reference(self, job: _Pending, fp: int) -> tuple[ModelReference, int] | None:
        """The Hub model `model` at `model_revision`, pinned to its commit, and its weights' size, if the
        run's first state `job` (fingerprint `fp`) is exactly those weights; else None, said in one line."""
        if self.model_revision is None or self.lora is not None or job.stored is not None:
            return None
        assert self._run is not None  # known before the first job
        try:
            return base.reference_to(self.model, self.model_revision, self._run.schema, fp)
        except (AnchorError, TransientStorageError) as e:  # unreachable too: training must not wait on it
            wanted = f"{self.model}@{self.model_revision}"
            log.warning("step %d goes out as an anchor, not by reference to %s: %s", job.step, wanted, e)
            return None

    def _anchor(self, job: _Pending, delta: StoredDelta | None, fp: int, tmp: Path) -> list[tuple[Path, str]]:
        """The step's anchor files in `tmp` (local file, storage path), if one is due."""
        due = bool(job.state) if job.stored else self.anchor_due(job.step, delta.bytes if delta else None)
        if not due:
            return []
        encoding = anchor_encoding(self.config.anchor_encoding, isinstance(self.storage, LocalStorage))
        return write_anchor(
            {name: t.cpu() for name, t in job.state.items()},  # from a device copy: once per anchor
            job.step,
            fp,
            tmp,
            self.config.shard_bytes,
            encoding,
            self.config.threads,
            self.claim.tag,
        )

    def _upload(
        self, files: tuple[str, ...], data: list[bytes], anchor_files: list[tuple[Path, str]]
    ) -> bytes | None:
        """Upload the delta files this publisher encoded (`data` to `files`) and the anchor's files, in one
        request with the lease's renewal and earlier steps' telemetry and garbage; returns the head as read
        meanwhile (the check before the head write travels beside the data)."""
        lease = self.claim.renewal()  # written with the data: no request of its own
        current = self._background.submit(self._current_head)
        upload: list[tuple[str, bytes | Path]] = list(zip(files, data, strict=True))
        upload += [(path, local) for local, path in anchor_files]
        owed, garbage = self._take_due()
        try:
            self._write_many(upload + owed + ([lease[:2]] if lease else []), garbage)
        except BaseException:
            self._give_back(owed, garbage)
            raise
        finally:
            futures.wait([current])
        if lease:
            self.claim.renewed(lease[2])
        return current.result()

    def _write_head(self, head: Head, current: bytes | None) -> None:
        """Write `head` as the only writer (see deltasync.sync.claim). `current`, the head read just before,
        must be the one this publisher wrote last (or a fenced writer's); returning acknowledges the step:
        the head read back is what was written and the lease is still this claim's. Else WriterConflict."""
        data = self._signer.head_json(head) if self._signer else head.to_json()
        Head.from_json(data)  # a head readers would refuse is never written (ManifestError)
        self._check_current(current)
        self.claim.check_live()
        self._head_bytes.add(data)  # if the read-back fails transiently, a retry finds this head
        # Also under this writer's epoch, which only it writes: a fenced writer's late write to latest.json
        # cannot hide it from readers (deltasync.sync.protocol.read_head_bytes). latest.json first: where a
        # backend writes file by file, readers see the step one request sooner (readers of a head of the
        # lease's epoch never look for the epoch's own).
        self.storage.write_many([(HEAD_PATH, data), (epoch_head_path(self.claim.epoch), data)])
        confirmed = self._background.submit(self.claim.confirm)  # beside the read-back: one latency
        try:
            current = self._current_head()
        finally:
            futures.wait([confirmed])
        if current != data:
            raise WriterConflict(
                f"{self.storage.url}: another publisher overwrote step {head.step} ({_writer_of(current)})"
            )
        confirmed.result()
        self._head_bytes = {data}

    def _check_current(self, current: bytes | None) -> None:
        """WriterConflict unless the head is the one this publisher wrote last, or one written by a fenced
        writer (a smaller epoch) after it, or on a signed run one its key did not sign: that one is
        replaced."""
        if current in self._head_bytes:
            return
        forged = (
            current is not None and self._signer and self._run and not self._signer.signed(current, self._run)
        )
        if forged:  # not a publisher of this run: no conflict to stop for
            log.warning(
                "%s: replacing a head this run's key did not sign (%s)", self.storage.url, _writer_of(current)
            )
            return
        try:
            other = Head.from_json(current) if current is not None else None
        except ManifestError:
            other = None
        if other is None or other.epoch >= self.claim.epoch:
            raise WriterConflict(
                f"{self.storage.url}: another publisher moved the head ({_writer_of(current)})"
            )
        log.warning(
            "%s: replacing a head written by a fenced publisher (%s, epoch %d; this one has epoch %d)",
            self.storage.url,
            other.writer or "unnamed",
            other.epoch,
            self.claim.epoch,
        )

    def _quantize(self, run: RunInfo) -> None:
        """The quantized root's side for `run` if this publisher's config asks for one (run.json says the
        same, or the root is refused in one line)."""
        if run.quantization != self.config.quantization:
            raise ValueError(
                f"{self.storage.url}: the run is quantized {run.quantization}, this publisher's config says "
                f"{self.config.quantization}"
            )
        if run.quantization is not None:
            self._quant = QuantizedRoot(run.quantization, run.schema)

    def _signed_run(self, run: RunInfo, data: bytes) -> RunInfo:
        """`run` (read as `data`) as this publisher goes on with it: signed by its key (see RunSigner.resume);
        ValueError for a signed run and a publisher without a key."""
        if self._signer is not None:
            return self._signer.resume(run, data)
        if run.signing is not None:
            key = short(run.signing.keys[-1])
            raise ValueError(f"{self.storage.url}: the run is signed by {key}: pass its signing_key")
        return run

    def _current_head(self) -> bytes | None:
        try:
            return read_manifest(self.storage, HEAD_PATH)
        except FileNotFoundError:
            return None

    def _resume(self) -> None:
        """Continue a run already in the sync root: its schema, head and last published state (when it does
        not verify, the next step goes out as an anchor alone, starting a new chain). Then fence earlier
        writers: the head is rewritten with this claim's epoch, so their next head write fails."""
        from deltasync.sync.subscriber import Subscriber, SyncError  # the reader's verified path to the head

        try:  # the head readers take: a fenced writer's late write may hide the last writer's
            data: bytes | None = read_head_bytes(self.storage)
        except FileNotFoundError:
            data = None
        self._head_bytes = {data, self._current_head()}
        if data is None:
            return
        head = Head.from_json(data)
        run_data = read_manifest(self.storage, RUN_PATH)
        read = RunInfo.from_json(run_data)
        self._run = self._signed_run(read, run_data)
        self._quantize(self._run)
        trust = Trust(read.signing.keys[-1:] if read.signing else ())
        if self._signer is not None:
            try:  # the head as the run's key signed it: a forger's is not continued
                if read.signing is None:
                    raise ManifestError("its steps so far are unsigned")
                head = trust.head(data, read)
            except ManifestError as e:
                log.warning("%s: %s: the next step starts a signed chain with an anchor", self.storage.url, e)
                self.storage.write_bytes(RUN_PATH, self._run_json())
                return
        reader = Subscriber(self.storage, trust=trust)
        if self._run.quantization is not None:  # no bf16 chain past its anchors: the next step starts one
            log.info(
                "%s: quantized %s: the next step goes out as an anchor",
                self.storage.url,
                self._run.quantization,
            )
        else:
            try:
                reader.sync(head.step)
            except SyncError as e:  # a bad delta must not lock the root: an anchor needs nothing before it
                log.warning(
                    "%s: the head's step %d does not verify (%s): the next step goes out as an anchor alone",
                    self.storage.url,
                    head.step,
                    e,
                )
        if reader.head not in (None, head):
            raise WriterConflict(f"{self.storage.url}: another publisher moved the head while resuming")
        self.claim.raise_epoch(head.epoch + 1)
        self._head = replace(head, epoch=self.claim.epoch, writer=self.claim.holder)
        if self._signer is not None and run_data != self._run_json():  # rotated: the new key signs on
            self.storage.write_bytes(RUN_PATH, self._run_json())
        self._write_head(self._head, self._current_head())
        if reader.step == head.step:
            self._published, self._published_fp = reader.state, reader.fingerprint
        try:
            collect_garbage(self.storage)  # what a crashed predecessor left
        except TransientStorageError as e:
            log.warning("garbage collection of %s failed: %s", self.storage.url, e)


def keeps_on_device(config: PublisherConfig, params: Iterable[torch.Tensor]) -> bool:
    """Whether the copies of published states live beside `params` (on their devices) rather than in host
    memory: `config.previous_copy`, where "auto" means where the weights are on CUDA."""
    if config.previous_copy == "auto":
        return any(bf16.on_gpu(t) for t in params)
    return config.previous_copy == "device"


def require_floats(tensors: Mapping[str, torch.Tensor], where: str) -> None:
    """Refuse integer and bool tensors: carried as bf16 they would come back rounded (257 -> 256)."""
    for name, t in tensors.items():
        if not t.is_floating_point():
            raise ValueError(f"{where}: {name} is {t.dtype}: only float weights can be published (as bf16)")


def info_problem(info: Mapping[str, Any]) -> str | None:
    """Why a trainer record could not carry `info`, or None: telemetry's rules, and every value an int or a
    float (NaN and infinity included: readers show a diverged number as a gap), not a bool, a tensor or a
    string."""
    problem = telemetry.info_problem(info)
    if problem:
        return problem
    for key, value in info.items():
        number = isinstance(value, int | float) and not isinstance(value, bool)
        if not number or (isinstance(value, int) and abs(value) > telemetry.MAX_MAGNITUDE):
            return f"{key!r} is {type(value).__name__} {value!r:.60}, not a number (pass float(value))"
    return None


def _writer_of(head: bytes | None) -> str:
    if head is None:
        return "the head was removed"
    try:
        parsed = Head.from_json(head)
    except ManifestError:
        return "the head is not readable"
    return f"now step {parsed.step}, written by {parsed.writer or 'an older publisher'}"


def _touched_like(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A buffer like `state` (pinned where it is), its pages already touched: the run's second publish() then
    costs the caller a copy, as every later one does, and no page faults."""
    return {
        n: torch.zeros(t.shape, dtype=t.dtype, device=t.device, pin_memory=t.is_pinned())
        for n, t in state.items()
    }


def _copy_into(buffer: dict[str, torch.Tensor], params: dict[str, torch.Tensor]) -> None:
    """Copy `params` into `buffer`, once all of them are checked: SchemaError leaves `buffer` as it was."""
    difference = name_difference(buffer, params)  # (the buffer keeps the run's order whatever the params')
    if difference:
        raise SchemaError(f"tensor sets differ from the first published state: {difference}")
    for name, t in params.items():
        if buffer[name].shape != t.shape:
            raise SchemaError(f"{name}: shape {tuple(t.shape)} != {tuple(buffer[name].shape)}")
    for name, t in params.items():
        buffer[name].copy_(t.detach(), non_blocking=True)  # casts to bf16; from CUDA into pinned memory
    if any(t.is_cuda for t in params.values()):
        torch.cuda.synchronize()
