"""Subscriber: a replica's side of the sync root.

It polls the head, plans the cheapest path by bytes from what it holds to the newest step (replay deltas, or a
complete anchor plus the deltas after it), downloads with retries, decodes each patch against its own bf16
shadow of the state (HF names and layout), verifies the fingerprint, and only then hands the changes to an
`Applier`: the real target (a dict of tensors, a torch module's state dict). A `FileApplier` (a vLLM server,
whose workers decode against the weights they hold) takes the files instead, checked from their headers
alone: then the subscriber holds no weights. A file that fails
verification (or is not the size the head lists) is never retried; the subscriber waits on the last good
step until a path around it (a newer anchor) appears. It trusts fingerprints, not step numbers: a target
whose state is not the one the head names for its step is reloaded from an anchor.

A chain may start at the run's base model by reference (deltasync.sync.base): its weights come from the Hub
model repository run.json names (the local cache first), checked by fingerprint before any delta applies; a
FileApplier's target (a vLLM server started on that repository and commit) already holds them, which its
read-back checks. A repository that cannot be reached is planned around while another path exists.

While it holds the head step, each poll also asks for the delta the same writer would publish next (one
request beside the head's, in parallel): a delta that lands before its head is then already here when the
head names it, which saves the delta's round trip, and it is decoded while the head is awaited. Prefetched
bytes and their decoding are used only for the file the head names, at the size it lists, from the state
they were decoded against, and checked against the head's entry like any download.
"""

from __future__ import annotations

import bisect
import collections
import logging
import math
import tempfile
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from deltasync import telemetry
from deltasync.codec import fingerprint
from deltasync.codec.header import read_info, schema_hash
from deltasync.errors import AnchorError, PatchError, Refused, SyncError
from deltasync.storage import RateLimited, Storage, TooLargeError, TransientStorageError, open_storage, retry
from deltasync.sync.protocol import (
    RUN_PATH,
    Entry,
    Head,
    ManifestError,
    RunInfo,
    delta_path,
    parse_data_path,
    read_head_bytes,
    read_manifest,
)
from deltasync.sync.signing import Trust, sha256_of

if TYPE_CHECKING:  # the code that decodes imports torch where it runs: `deltasync follow` decodes nothing
    import torch

    from deltasync.codec.changes import TensorChanges
    from deltasync.codec.patch import Patch

log = logging.getLogger(__name__)
MAX_ERROR_CHARS = 500  # last_error and telemetry errors: one readable line, however long the cause


def _bounded(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= MAX_ERROR_CHARS else text[: MAX_ERROR_CHARS - 3] + "..."


class Applier(ABC):
    """Where a Subscriber writes verified weights: bf16 values in HF checkpoint names and flat indices."""

    @abstractmethod
    def load(self, state: Mapping[str, torch.Tensor], step: int, fingerprint: int) -> float | None:
        """Replace the whole state with the anchor of `step`, whose fingerprint is `fingerprint`. Returns the
        seconds serving was paused, if it serves."""

    @abstractmethod
    def patch(
        self, changes: Mapping[str, TensorChanges], step: int, base: int, fingerprint: int
    ) -> float | None:
        """Write new values at flat indices: step `step` leads from the state `base` (fingerprint) to
        `fingerprint`. Returns the seconds serving was paused, if it serves."""

    def fingerprint(self) -> int | None:
        """Fingerprint of what the target really holds, read back from its memory; None if it cannot tell."""
        return None


class FileApplier(ABC):
    """Where a Subscriber hands a step's files undecoded, their headers checked against the head: the target
    decodes and verifies them against the weights it holds, so the subscriber keeps no copy of them. Raises
    `Refused` (before writing anything) when the files themselves are bad: never asked for again."""

    # The recipe the target serves (vLLM's --quantization, deltasync.quant): it follows a root quantized
    # so; its fingerprints are the entries' `quantized` ones, and a delta's parts are its two files.
    quantization: str | None = None

    @abstractmethod
    def load_files(self, files: list[Path], step: int, fingerprint: int) -> float | None:
        """Replace the whole state with the anchor of `step` in `files` (its shards, unchecked), whose
        fingerprint must be `fingerprint`. Returns the seconds serving was paused, if it serves."""

    @abstractmethod
    def patch_bytes(self, parts: list[bytes], step: int, base: int, fingerprint: int) -> float | None:
        """Apply the patch of `step` (its parts: one, or one per rank of a sharded publisher), from the state
        `base` (fingerprint) to `fingerprint`. Returns the seconds serving was paused, if it serves."""

    def fingerprint(self) -> int | None:
        """Fingerprint of what the target really holds, read back from its memory; None if it cannot tell."""
        return None


class TensorsApplier(Applier):
    """Patches tensors in place: a dict of tensors, or `module.state_dict()` to patch a torch module (its
    tensors share storage with the parameters). Tensors of other dtypes hold the bf16 values cast."""

    def __init__(self, tensors: Mapping[str, torch.Tensor]):
        self.tensors = tensors
        self.names: list[str] = []

    def load(self, state: Mapping[str, torch.Tensor], step: int, fingerprint: int) -> None:
        import torch

        missing = [name for name in state if name not in self.tensors]
        if missing:
            raise KeyError(f"target has no tensor {missing[0]!r}")
        with torch.no_grad():
            for name, t in state.items():
                self.tensors[name].copy_(t)
        self.names = list(state)

    def patch(self, changes: Mapping[str, TensorChanges], step: int, base: int, fingerprint: int) -> None:
        import torch

        from deltasync.codec.changes import apply_changes

        # Contiguous bf16 tensors take the codec's scatter (torch's index_put_ costs ~50 ns an element).
        bf16 = torch.bfloat16
        flat = {n for n in changes if self.tensors[n].dtype == bf16 and self.tensors[n].is_contiguous()}
        with torch.no_grad():
            apply_changes({n: self.tensors[n] for n in flat}, {n: changes[n] for n in flat})
            for name, ch in changes.items():
                if name in flat:
                    continue
                t = self.tensors[name]
                indices, values = ch.indices.to(t.device), ch.values.to(t.device, t.dtype)
                if t.is_contiguous():
                    t.view(-1)[indices] = values
                else:  # e.g. a transposed parameter: flat indices count in the HF shape's row-major order
                    t[torch.unravel_index(indices, t.shape)] = values

    def fingerprint(self) -> int:
        import torch

        return fingerprint.state_fingerprint((n, self.tensors[n].to(torch.bfloat16)) for n in self.names)


@dataclass(frozen=True)
class Ahead:
    """A delta read before its head: its bytes, and their decoding against `state` at fingerprint `base`."""

    data: bytes
    patch: Patch | None
    state: dict[str, torch.Tensor] | None
    base: int


def _ask_again(read: Future[Ahead]) -> bool:
    """Whether a finished read found nothing yet (or failed transiently): worth asking again at the next
    poll. A refused read (an object over the limit) is not repeated."""
    return read.done() and isinstance(read.exception(), (FileNotFoundError, TransientStorageError))


def _names(entry: Entry) -> tuple[str, ...]:
    """What a step's files are known by (refused, missing): its files, or run.json's base model."""
    return entry.files or (f"{RUN_PATH}#base",)


@dataclass
class Applied:
    """One step the subscriber applied and verified."""

    step: int
    kind: str  # anchor | delta
    payload_bytes: int
    changed: int
    published_at: float
    applied_at: float
    download_s: float
    apply_s: float
    pause_s: float | None
    lag_steps: int  # head step minus this step when applied

    @property
    def lag_s(self) -> float:
        return self.applied_at - self.published_at


class Subscriber:
    """Follows the sync root `root` into `applier` (None: the subscriber's own `state` is the target; a
    FileApplier: the subscriber holds no state)."""

    def __init__(
        self,
        root: str | Path | Storage,
        applier: Applier | FileApplier | None = None,
        replica: str | None = None,
        *,
        retries: int = 4,
        backoff_s: float = 0.5,
        verify_every: int = 10,
        threads: int | None = None,
        prefetch: bool = True,
        trust: Trust | None = None,
    ):
        if replica is not None and not telemetry.REPLICA_ID.fullmatch(replica):
            raise ValueError(f"replica id {replica!r} must match {telemetry.REPLICA_ID.pattern}")
        self.storage = root if isinstance(root, Storage) else open_storage(root)
        self.applier, self.replica = applier, replica
        self.retries, self.backoff_s, self.verify_every = retries, backoff_s, verify_every
        self.threads = threads  # codec threads; None: every core this process may run on
        self.prefetch = prefetch  # read the next delta ahead of its head (off for readers that jump to steps)
        # Who may say what the target serves: with keys, only steps the trainer signed (signing.Trust).
        self.trust = trust or Trust()
        self._ahead: tuple[str, Future[Ahead]] | None = None  # the next delta's path and its read
        self.run: RunInfo | None = None
        self.head: Head | None = None
        self._head_data: bytes | None = None  # what `head` was parsed from: an unchanged poll parses nothing
        self._untrusted: bytes | None = None  # the last head refused for its signature (reported once)
        # Reads the writer lease while a poll reads the head (one thread: its HTTP client is kept).
        self._beside = ThreadPoolExecutor(1, thread_name_prefix="deltasync-lease-read")
        self.decodes = not isinstance(applier, FileApplier)  # else the target decodes: no shadow here
        self.state: dict[str, torch.Tensor] | None = None  # bf16 shadow of the target, HF names
        self.step: int | None = None  # the step the target holds, verified; None: unknown
        self.fingerprint = 0
        self.last_error: str | None = None  # why the last sync() failed; None once a step applies
        self._refusal: str | None = None  # why the last file was refused (kept while waiting for an anchor)
        self.history: collections.deque[Applied] = collections.deque(maxlen=256)
        self._bad: set[tuple[str, int]] = set()  # (file, bytes) that failed verification
        self._missing: set[tuple[str, int]] = set()  # (file, bytes) absent though a head named them
        self._unverified_deltas = 0
        self.bugs = 0  # sync() failures that were no refusal, storage failure or applier refusal (logged)
        self.rate_limited_until: float | None = None  # when the last rate limit met ended (or ends)

    # ---------------------------------------------------------------------------------------------- API

    def sync(self, target: int | None = None) -> list[Applied]:
        """Reach `target` (default: the head step). Returns the steps applied; raises SyncError when it cannot
        get there (whatever the cause), with the target left on its last verified step."""
        applied: list[Applied] = []
        try:
            self._sync(target, applied)
        except SyncError as e:
            self.last_error = _bounded(str(e))
            raise
        except (OSError, MemoryError) as e:  # this machine's (disk, memory, open files): no file is at fault
            self.last_error = _bounded(f"local failure, retried at the next poll: {type(e).__name__}: {e}")
            raise SyncError(self.last_error) from e
        except Exception as e:  # a bug: never a bad file, and a poll must never kill its caller's thread
            log.exception("sync of %s failed on a bug", self.storage.url)
            self.bugs += 1
            self.last_error = _bounded(f"bug: {type(e).__name__}: {e}")
            raise SyncError(self.last_error) from e
        self.last_error = None
        return applied

    def follow(
        self,
        stop: threading.Event,
        interval: float = 1.0,
        on_applied: Callable[[Applied], None] | None = None,
    ) -> None:
        """Sync at every change the storage reports (or every `interval` seconds where it reports none) until
        `stop` is set; errors are logged and kept in `last_error`. `on_applied` is called for each step
        applied; its errors are logged and skip nothing else. An error that repeats poll after poll (no run
        yet, a path still missing) is logged once, then quietly."""
        if not math.isfinite(interval) or interval < 0:
            raise ValueError(f"poll interval must be a number of seconds >= 0, got {interval}")
        said = None
        while not stop.is_set():
            try:
                applied = self.sync()
                said = None
            except SyncError as e:  # the next poll tries again
                message = _bounded(str(e))
                log.log(logging.DEBUG if message == said else logging.WARNING, "sync: %s", message)
                applied, said = [], message
            for a in applied:
                try:
                    if on_applied is not None:
                        on_applied(a)
                except Exception:
                    log.exception("on_applied for step %d failed", a.step)
            if self.last_error is None:  # on a change feed: the next head or delta, without a request
                self.storage.wait_for_change(stop, interval, under=("heads/", "deltas/"))
            else:  # a failure is retried, but not before a rate limit ends
                stop.wait(max(interval, (self.storage.rate_limited_until or 0.0) - time.time()))

    # ------------------------------------------------------------------------------------------ planning

    def _sync(self, target: int | None, applied: list[Applied]) -> None:
        for attempt in range(2):  # a second plan when the head moved under us (GC removed a file)
            self._fetch_ahead()
            head = self._read_head()
            goal = head.step if target is None else target
            here = fingerprint.format_fingerprint(self.fingerprint)
            if self.step == goal and any(e.step == goal and self._held(e) == here for e in head.entries):
                return  # the very state the head names (a step number alone could be another writer's)
            path = self._plan(head, goal)
            try:
                for entry in path:
                    applied.append(self._apply(entry, head))
                return
            except FileNotFoundError as e:
                if attempt:
                    raise SyncError(f"{e}, though the head names it") from None

    def _read_head(self) -> Head:
        """The head: one bounded read per poll, parsed only when its bytes changed; never one older (by writer
        epoch, then step) than the newest seen, so a replica never goes backwards. With trusted keys, only a
        head the run's key signed, of the newest run seen."""
        data = None
        try:
            data = self._retry(lambda: read_head_bytes(self.storage, self._beside))
            if self.run is None:
                self.run = self.read_run()
            head = self.head if data == self._head_data and self.head else self._parse_head(data)
        except FileNotFoundError:
            raise SyncError(f"no run in {self.storage.url} yet") from None
        except ManifestError as e:
            if self.trust.keys and data is not None:
                self._report_untrusted(data, str(e))
            raise SyncError(f"refused the head of {self.storage.url}: {e}") from None
        served = self.applier.quantization if isinstance(self.applier, FileApplier) else None
        if self.run is not None and self.run.quantization != served:
            raise SyncError(
                f"{self.storage.url} is a root quantized {self.run.quantization}, this target serves "
                f"{served or 'bf16'}: start it with --quantization {self.run.quantization}"
                if self.run.quantization
                else f"{self.storage.url} is a bf16 root, this target serves {served}: start it without it"
            )
        if self.head is not None and (head.epoch, head.step) < (self.head.epoch, self.head.step):
            if self.trust.keys:  # signed, yet older than one seen: a replayed head (or a stale read)
                replayed = f"step {head.step} (epoch {head.epoch}) is older than step {self.head.step} "
                replayed += f"(epoch {self.head.epoch}): a replayed head"
                raise SyncError(f"refused the head of {self.storage.url}: {replayed}")
            return self.head  # older than one seen: a stale read, or a fenced writer's late write
        self.head, self._head_data = head, data
        return head

    def read_run(self) -> RunInfo:
        """The root's run.json as `trust` accepts it (ManifestError otherwise; FileNotFoundError if none)."""
        return self.trust.run(self._retry(lambda: read_manifest(self.storage, RUN_PATH)))

    def _parse_head(self, data: bytes) -> Head:
        """The head `data`, as `self.trust` accepts it for the run followed; a head that is not that run's
        key's makes run.json be read again: the key rotated, or a new run began (never an older one)."""
        assert self.run is not None  # read before the head
        try:
            return self.trust.head(data, self.run)
        except ManifestError:
            if not self.trust.keys:
                raise
        run = self.read_run()
        head = self.trust.head(data, run)
        held, new = self.run.signing, run.signing
        assert held is not None and new is not None  # Trust.run refuses unsigned runs
        if new.run != held.run:
            if new.started_at <= held.started_at:
                raise ManifestError(
                    f"{RUN_PATH}: run {new.run} began before run {held.run}, which this replica follows: "
                    "a restored older run"
                )
            log.info("%s: a new run %s follows run %s", self.storage.url, new.run, held.run)
            self.head, self._head_data = None, None  # its epochs and steps start afresh
        self.run = run
        return head

    def _plan(self, head: Head, goal: int) -> list[Entry]:
        """The cheapest verified-file path (by bytes, then files) to step `goal`, in time linear in the
        head: every path is a start (an anchor, or what the target holds) and all the deltas after it."""
        if not any(e.step == goal for e in head.entries):
            steps = sorted({e.step for e in head.entries})
            raise SyncError(
                f"step {goal} is not retained in {self.storage.url} (from {steps[0]} to {steps[-1]})"
            )
        deltas = [d for d in head.deltas if d.step <= goal]  # ascending: the head holds one unbroken chain
        steps = [d.step for d in deltas]
        after = [0] * (len(deltas) + 1)  # after[i]: bytes of deltas[i:]
        for i in range(len(deltas) - 1, -1, -1):
            after[i] = after[i + 1] + deltas[i].bytes
        # A path crosses every delta after its start: it may start no earlier than the last refused one,
        # and one that starts before the last missing one comes last (the file may yet appear).
        floor = max((d.step for d in deltas if self._refused(d)), default=-1)
        self._missing &= {(f, e.bytes) for e in head.entries for f in _names(e)}  # what may still matter
        gap = max((d.step for d in deltas if self._absent(d)), default=-1)
        starts: list[tuple[Entry | None, int]]
        starts = [(a, a.step) for a in head.anchors if floor <= a.step <= goal and not self._refused(a)]
        here = fingerprint.format_fingerprint(self.fingerprint)
        held = self.step
        if (
            held is not None
            and floor <= held <= goal
            and any(e.step == held and self._held(e) == here for e in head.entries)  # quantized: its own
        ):
            starts.append((None, held))  # replay from what the target holds
        best = None
        for start, since in starts:
            i = bisect.bisect_right(steps, since)
            crosses_gap = since < gap or (start is not None and self._absent(start))
            cost = (
                crosses_gap,
                (self._cost(start) if start else 0) + after[i],
                len(deltas) - i + (start is not None),
            )
            if best is None or cost < best[0]:
                best = (cost, start, i)
        if best is None:
            raise SyncError(
                f"no verified path to step {goal} yet: waiting for a newer anchor (refused: {self._refusal})"
            )
        _, start, i = best
        return ([start] if start else []) + deltas[i:]

    def _refused(self, entry: Entry) -> bool:
        return any((f, entry.bytes) in self._bad for f in _names(entry))

    def _absent(self, entry: Entry) -> bool:
        return any((f, entry.bytes) in self._missing for f in _names(entry))

    def _cost(self, start: Entry) -> int:
        """Bytes to download for the complete state `start`: none for the base model a FileApplier's target
        holds (its read-back checks it)."""
        return 0 if start.kind == "base" and not self.decodes else start.bytes

    # ------------------------------------------------------------------------------------------ applying

    def _apply(self, entry: Entry, head: Head) -> Applied:
        assert self.run is not None  # read with the head
        start = time.perf_counter()
        with tempfile.TemporaryDirectory(prefix="deltasync-") as tmp:
            local = [Path(tmp) / f"{i}.safetensors" for i in range(len(entry.files))]
            try:
                decoded = None  # a delta decoded while its head was awaited
                if entry.kind == "delta":  # a read per part, no stat: each at most what the size leaves
                    parts, decoded = self._prefetched(entry)
                    size = sum(map(len, parts))
                    for path in entry.files[len(parts) :]:
                        left = entry.bytes - size
                        parts.append(self._retry(lambda p=path, n=left: self.storage.read_bytes(p, n)))
                        size += len(parts[-1])
                elif entry.kind == "base":
                    local, size = self._base_files(entry)
                else:
                    for path, dest in zip(entry.files, local, strict=True):  # each at most the entry's size
                        self._retry(lambda p=path, d=dest: self.storage.download_file(p, d, entry.bytes))
                    size = sum(f.stat().st_size for f in local)
                if size != entry.bytes:
                    raise Refused(f"its files hold {size} bytes, the head lists {entry.bytes}")
                self._check_digests(entry, parts if entry.kind == "delta" else local)
                download_s = time.perf_counter() - start
                apply_start = time.perf_counter()  # apply_s: decode, verify and write
                state, patch = None, None
                if not self.decodes:
                    pause_s = self._hand(entry, local, parts if entry.kind == "delta" else [])
                elif entry.kind == "anchor":
                    from deltasync.sync.anchor import read_anchor

                    state = read_anchor(local, self.run, entry.step, entry.fingerprint, self.threads)
                elif entry.kind == "base":
                    from deltasync.sync import base

                    state = base.read_state(local, self.run.schema, str(self.run.base))
                    base.verify(state, entry.fingerprint, f"the base model {self.run.base}")
                else:
                    patch = self._decode(parts, entry, decoded)
            except FileNotFoundError:  # planned around from now on, while another path exists
                self._missing.update((f, entry.bytes) for f in _names(entry))
                raise
            except Refused as e:  # PatchError, AnchorError, TooLargeError, a size mismatch: not this file
                self._bad.update((f, entry.bytes) for f in _names(entry))
                self._refusal = _bounded(f"{entry.kind} of step {entry.step}: {e}")
                self._report_refused(entry, head, str(e))
                raise SyncError(f"refused {self._refusal}") from None
        self._missing.difference_update((f, entry.bytes) for f in _names(entry))
        if self.decodes:
            pause_s = self._write(entry, state, patch)
            if patch is None:
                self.state = state
            else:
                assert self.state is not None  # a delta applies to the state held
                from deltasync.codec.changes import apply_changes

                apply_changes(self.state, patch.changes, self.threads)
        fp = int(self._held(entry), 16)  # verified above: by the anchor's content or the patch's promise
        self.last_error = None  # before the step moves: a status read must not pair the new step with it
        self.step, self.fingerprint = entry.step, fp
        self._verify_target(entry)
        applied = Applied(
            step=entry.step,
            kind=entry.kind,
            payload_bytes=entry.bytes,
            changed=entry.changed if entry.kind == "delta" else self.run.numel,
            published_at=entry.published_at,
            applied_at=time.time(),
            download_s=download_s,
            apply_s=time.perf_counter() - apply_start,
            pause_s=pause_s,
            lag_steps=head.step - entry.step,
        )
        self.history.append(applied)
        self._report(applied)
        return applied

    def _base_files(self, entry: Entry) -> tuple[list[Path], int]:
        """The base model's files and their size (a FileApplier's target holds it: none, and the size the
        head lists). Unreachable, it is planned around from now on while another path exists."""
        assert self.run is not None  # read with the head
        if self.run.base is None:
            raise ManifestError(f"the head starts at a base model, {RUN_PATH} names none")
        if not self.decodes:
            return [], entry.bytes
        from deltasync.sync import base

        try:
            files = base.download(self.run.base)
        except TransientStorageError as e:
            self._missing.update((f, entry.bytes) for f in _names(entry))
            raise SyncError(f"{e} (retried while no other path is there)") from None
        return files, base.state_bytes(files)

    def _fetch_ahead(self) -> None:
        """Start reading the delta that would follow the head step, in the background, if this subscriber
        is at the head and that read is not already under way or done."""
        head, run = self.head, self.run
        if not self.prefetch or head is None or run is None or self.step != head.step:
            return
        if head.deltas and len(head.deltas[-1].files) > 1:  # a sharded writer: its next step comes in parts
            return
        if not head.entries[-1].files:  # the base model alone: no file of the writer names its tag yet
            return
        parsed = parse_data_path(head.entries[-1].files[0])  # the head's writer names its next step alike
        path = delta_path(head.step + 1, parsed[2] if parsed else "")
        if self._ahead is not None and self._ahead[0] == path and not _ask_again(self._ahead[1]):
            return
        if self.storage.announced(path) is False:  # the feed names it once written, and wakes this reader
            return
        limit = 6 * run.numel + 512 * len(run.schema) + (1 << 20)  # a raw patch of every element, at most
        # Decoding allocates per claimed change: ahead of the head, only as many as recent steps changed.
        most = 2 * max((d.changed for d in head.deltas), default=0)
        state, base = self.state, self.fingerprint
        future: Future[Ahead] = Future()

        def read() -> None:
            try:
                data = self.storage.read_bytes(path, limit)
                future.set_result(self._decode_ahead(data, state, base, most))
            except BaseException as e:  # the normal read after the head names it reports what went wrong
                if not isinstance(e, (OSError, TransientStorageError, TooLargeError)):
                    log.exception("reading %s ahead failed", path)  # a bug: not a refused file
                future.set_exception(e)

        threading.Thread(target=read, name="deltasync-prefetch", daemon=True).start()
        self._ahead = (path, future)

    def _decode_ahead(
        self, data: bytes, state: dict[str, torch.Tensor] | None, base: int, most: int
    ) -> Ahead:
        """`data` and, where it can be, its decoding against `state` before any head names it. Bytes that
        are no patch are not kept (a head naming them gets them read again, and refused); a patch that does
        not decode is left to the decoding once a head names it."""
        try:
            changed = read_info(data).changed
        except PatchError:
            return Ahead(b"", None, state, base)
        if not (state and 0 < changed <= most):  # (a FileApplier's subscriber: it never decodes)
            return Ahead(data, None, state, base)
        from deltasync.codec.patch import decode

        try:
            patch = decode(data, state, base, self.threads)
        except PatchError:
            patch = None
        return Ahead(data, patch, state, base)

    def _prefetched(self, entry: Entry) -> tuple[list[bytes], Patch | None]:
        """The prefetched bytes of `entry`'s single file if they are its listed size (else none), and their
        decoding if it was made from the state held now."""
        pending, self._ahead = self._ahead, None
        if pending is None or entry.files != (pending[0],):
            return [], None
        try:
            ahead = pending[1].result()
        except Exception:
            return [], None
        if len(ahead.data) != entry.bytes:
            return [], None
        same_base = ahead.state is self.state and ahead.base == self.fingerprint
        return [ahead.data], ahead.patch if same_base else None

    def _decode(self, parts: list[bytes], entry: Entry, decoded: Patch | None = None) -> Patch:
        """One patch, or a step stored in parts (one per rank of a sharded publisher): decoded (unless
        `decoded` already holds `parts` decoded from the state held), verified and merged into one set of
        changes before anything is written."""
        from deltasync.codec.patch import decode, decode_parts

        claimed = sum(read_info(d).changed for d in parts)  # headers alone: decoding allocates per change
        if claimed != entry.changed:
            raise PatchError(f"patch claims {claimed} changes, the head lists {entry.changed}")
        assert self.state is not None  # a delta applies to the state held
        if decoded is not None:
            patch = decoded
        elif len(parts) == 1:
            patch = decode(parts[0], self.state, self.fingerprint, self.threads)
        else:
            patch = decode_parts(parts, self.state, self.fingerprint, self.threads)
        if (patch.step, fingerprint.format_fingerprint(patch.fingerprint)) != (entry.step, entry.fingerprint):
            raise PatchError(
                f"patch is step {patch.step}, the head names step {entry.step} with another state"
            )
        return patch

    def _check_digests(self, entry: Entry, files: Sequence[bytes | Path]) -> None:
        """That each file is the one a signed head names, by its SHA-256: else Refused, before any write."""
        if entry.sha256 is None:
            return
        for path, data, digest in zip(entry.files, files, entry.sha256, strict=True):
            if sha256_of(data) != digest:
                raise Refused(f"{path}: its SHA-256 is not the one the signed head names: changed since")

    def _check(self, parts: list[bytes], entry: Entry) -> None:
        """What can be checked of a delta's parts without the weights (their headers): that they are the
        step the head names, for this run's model, from the state held to the one the head promises."""
        assert self.run is not None  # read with the head
        base, changed, schema = self.fingerprint, 0, schema_hash(self.run.schema)
        for i, data in enumerate(parts):
            info = read_info(data)
            where = f"part {i + 1} of {len(parts)}" if len(parts) > 1 else "patch"
            if info.metadata.get("schema") != schema or info.numel != self.run.numel:
                raise PatchError(f"{where} was made for another model schema than the run's")
            if (info.step, info.base_fingerprint) != (entry.step, base):
                was, held = (fingerprint.format_fingerprint(f) for f in (info.base_fingerprint, base))
                raise PatchError(
                    f"{where} is step {info.step} from {was}; the head: step {entry.step} from {held}"
                )
            base, changed = info.fingerprint, changed + info.changed
        if changed != entry.changed:
            raise PatchError(f"patch claims {changed} changes, the head lists {entry.changed}")
        if fingerprint.format_fingerprint(base) != entry.fingerprint:
            reached = fingerprint.format_fingerprint(base)
            raise PatchError(f"patch leads to state {reached}, the head names {entry.fingerprint}")

    def _held(self, entry: Entry) -> str:
        """The fingerprint the target holds at `entry`'s step: a quantized one on a quantized root."""
        if self.run is None or self.run.quantization is None:
            return entry.fingerprint
        if entry.quantized is None:
            raise SyncError(f"step {entry.step} of a quantized root has no quantized fingerprint")
        return entry.quantized

    def _hand(self, entry: Entry, files: list[Path], parts: list[bytes]) -> float | None:
        """Hand a step's files to the FileApplier, which decodes them; Refused if it finds them bad."""
        assert isinstance(self.applier, FileApplier)
        fp = int(self._held(entry), 16)
        if entry.kind == "delta" and self.applier.quantization is None:  # else the target checks both files
            self._check(parts, entry)
        if entry.kind == "base":
            self._check_held_base(entry)
            return None
        try:
            if entry.kind == "anchor":
                return self.applier.load_files(files, entry.step, fp)
            return self.applier.patch_bytes(parts, entry.step, self.fingerprint, fp)
        except Refused:
            raise  # the files, refused before anything was written
        except Exception as e:
            self.step = None  # the target may hold part of the write: only an anchor can fix it
            raise SyncError(f"applying {entry.kind} of step {entry.step} failed: {e}") from e

    def _check_held_base(self, entry: Entry) -> None:
        """That the FileApplier's target holds the base model (read back); else AnchorError, one line."""
        assert isinstance(self.applier, FileApplier) and self.run is not None and self.run.base is not None
        held = self.applier.fingerprint()
        if held is None or fingerprint.format_fingerprint(held) != self._held(entry):
            ref = self.run.base
            holds = "weights it cannot read back" if held is None else fingerprint.format_fingerprint(held)
            raise AnchorError(
                f"the target holds {holds}, not the base model {ref} ({entry.fingerprint}) that step "
                f"{entry.step} is: start vLLM with --model {ref.repo} --revision {ref.revision}"
            )

    def _write(
        self, entry: Entry, state: dict[str, torch.Tensor] | None, patch: Patch | None
    ) -> float | None:
        if not isinstance(self.applier, Applier):
            return None
        try:
            if patch is None:
                assert state is not None  # an anchor's
                return self.applier.load(state, entry.step, int(entry.fingerprint, 16))
            return self.applier.patch(patch.changes, entry.step, patch.base_fingerprint, patch.fingerprint)
        except Exception as e:
            self.step = None  # the target may hold part of the write: only an anchor can fix it
            raise SyncError(f"applying {entry.kind} of step {entry.step} failed: {e}") from e

    def _verify_target(self, entry: Entry) -> None:
        """Read the target back at anchors and every `verify_every` deltas: catches what the shadow cannot."""
        self._unverified_deltas = 0 if entry.kind != "delta" else self._unverified_deltas + 1
        if self.applier is None or (entry.kind == "delta" and self._unverified_deltas < self.verify_every):
            return
        self._unverified_deltas = 0
        actual = self.applier.fingerprint()
        if actual is not None and actual != self.fingerprint:
            self.step = None
            raise SyncError(
                f"target holds {fingerprint.format_fingerprint(actual)} after step {entry.step}, "
                f"expected {self._held(entry)}: reloading from an anchor"
            )

    def _retry(self, call):
        try:
            return retry(call, (self.backoff_s, float("inf")), self.retries + 1, wait_out_limits=False)
        except RateLimited as e:  # said at once (status, telemetry); follow() waits until it ends
            self.rate_limited_until = e.until
            raise SyncError(str(e)) from None
        except TransientStorageError as e:
            raise SyncError(f"storage keeps failing: {e}") from None

    # ----------------------------------------------------------------------------------------- telemetry

    def _report(self, a: Applied) -> None:
        if self.replica is not None:
            limited = self.rate_limited_until  # a rate limit held this step back
            limited = limited if limited is not None and limited > a.published_at else None
            self._write_record(
                telemetry.ReplicaRecord(
                    replica=self.replica,
                    verified=True,
                    rate_limited_until=limited,
                    bugs=self.bugs,
                    **asdict(a),
                )
            )

    def _report_refused(self, entry: Entry, head: Head, error: str) -> None:
        if self.replica is None:
            return
        now = time.time()
        self._write_record(
            telemetry.ReplicaRecord(
                replica=self.replica,
                step=entry.step,
                kind=entry.kind,
                published_at=entry.published_at,
                applied_at=now,
                download_s=0.0,
                apply_s=0.0,
                verified=False,
                lag_steps=head.step - entry.step,
                payload_bytes=entry.bytes,
                error=_bounded(error),
                bugs=self.bugs,
            )
        )

    def _report_untrusted(self, data: bytes, error: str) -> None:
        """A head refused for its signature, in telemetry once per head (the dashboard lists refusals), as a
        record of the step it names if that is past the step held (the real step of that number replaces it
        once applied); any other (a replay, or no head at all) is said in the status alone, never over an
        applied step's record."""
        if self.replica is None or data == self._untrusted:
            return
        self._untrusted = data
        try:
            step = Head.from_json(data).step
        except ManifestError:
            return
        if self.step is not None and step <= self.step:
            return
        now = time.time()  # the head's own times are a forger's to choose
        self._write_record(
            telemetry.ReplicaRecord(
                replica=self.replica,
                step=step,
                kind="head",
                published_at=now,
                applied_at=now,
                download_s=0.0,
                apply_s=0.0,
                verified=False,
                lag_steps=0,
                error=_bounded(f"head refused: {error}"),
                bugs=self.bugs,
            )
        )

    def _write_record(self, record: telemetry.ReplicaRecord) -> None:
        try:
            telemetry.write(self.storage, record)
        except TransientStorageError as e:
            log.warning("telemetry of step %d lost: %s", record.step, e)
