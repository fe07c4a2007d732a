"""What every storage backend shares: the Storage interface, its errors, path checks, redaction and retries.

Paths are relative POSIX keys ("deltas/step-00000001.safetensors"). They come from untrusted manifests, so
every public method passes them through `check_path` before a backend sees them.

Every backend gives readers the old or the new object, never a partial one. Errors tell callers what to do:
- FileNotFoundError (read_bytes, download_file): the object (or the whole bucket) is absent;
- ValueError: an unsafe path, raised before any I/O; retrying cannot help;
- TooLargeError: the object is larger than the caller's limit; it was not read into memory;
- TransientStorageError: anything else (network, timeout, server error, permissions): retry later.

URLs may carry credentials (`http://user:password@host/...`): `url` and every error message are redacted.
`retry` is the one backoff loop for transient errors.
"""

from __future__ import annotations

import builtins
import itertools
import logging
import os
import re
import stat
import threading
import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO, TypeVar

from deltasync.errors import RateLimited, TooLargeError, TransientStorageError
from deltasync.errors import WriterConflict as WriterConflict  # (the backends' name for it)

log = logging.getLogger(__name__)
T = TypeVar("T")

# Hub roots: resolver calls per 5-minute window a poller may spend without the change feed (free tier: 5,000).
POLL_BUDGET = 1000

TMP_MARK = (
    ".deltasync-tmp-"  # in the names of files being written; list() hides them, check_path refuses them
)
_CREDENTIALS = [
    # user:password@ in a URL, whatever the password holds ("/", "@", ":"): up to the last "@" before a space
    (re.compile(r"([A-Za-z][A-Za-z0-9+.-]*://)\S*@"), r"\1***@"),
    (re.compile(r"hf_[A-Za-z0-9]{8,}"), "hf_***"),  # a Hub token anywhere
]


def rate_limited_line(until: float) -> str:
    """How a rate limit is said wherever it is shown (errors, /health)."""
    return f"rate limited until {time.strftime('%H:%M:%S UTC', time.gmtime(until))}"


def redact(text: str) -> str:
    """`text` with URL credentials and Hub tokens replaced by `***`: for anything shown or logged."""
    for pattern, replacement in _CREDENTIALS:
        text = pattern.sub(replacement, text)
    return text


def retry(
    call: Callable[[], T],
    waits: tuple[float, float],
    attempts: int | None = None,
    log_as: str | None = None,
    sleep: Callable[[float], object] = time.sleep,
    wait_out_limits: bool = True,
) -> T:
    """`call()`, called again after each TransientStorageError: first after `waits[0]` seconds, then twice as
    long each time up to `waits[1]`, and never before a rate limit ends (RateLimited); after `attempts` calls
    (None: never) the last error is raised, and at once on RateLimited unless `wait_out_limits`. With `log_as`
    each retry logs a warning; `sleep` waits (a caller may wake up early with other work)."""
    wait = waits[0]
    for attempt in itertools.count(1):
        try:
            return call()
        except TransientStorageError as e:
            limited = isinstance(e, RateLimited)
            if (attempts is not None and attempt >= attempts) or (limited and not wait_out_limits):
                raise
            pause = max(wait, e.until - time.time()) if isinstance(e, RateLimited) else wait
            if log_as:
                log.warning("%s failed, retrying in %.1f s: %s", log_as, pause, e)
        sleep(pause)
        wait = min(2 * wait, waits[1])
    raise AssertionError("unreachable")


def check_path(path: str) -> str:
    """Return `path` if it is a safe relative POSIX key, else raise ValueError naming it."""
    problem = _path_problem(path)
    if problem:
        raise ValueError(f"unsafe storage path {path!r}: {problem}")
    return path


def _path_problem(path: str) -> str | None:
    if not isinstance(path, str) or not path:
        return "empty or not a string"
    if path.startswith("/"):
        return "absolute"
    if "\\" in path:
        return "backslash"
    if not path.isprintable():  # control, format (bidi override), separator and unassigned characters
        return "non-printable character"
    if any(part in ("", ".", "..") for part in path.split("/")):
        return "empty, '.' or '..' segment"
    if TMP_MARK in path:
        return "reserved for temporary files"
    return None


@contextmanager
def atomic_file(dest: Path) -> Iterator[Path]:
    """A temporary path beside `dest` that replaces `dest` only once the block has filled it."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f"{dest.name}{TMP_MARK}{uuid.uuid4().hex}")
    try:
        yield tmp
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())  # else a crash could persist the rename before the data
        os.replace(tmp, dest)
    finally:
        tmp.unlink(missing_ok=True)


class WriterLock:
    """A held lock; `release()` (also on process exit) lets the next writer in. Releasing twice is a no-op
    (a second close of the lock's fd could close another file that reused its number)."""

    def __init__(self, release: Callable[[], None]):
        self._release: Callable[[], None] | None = release

    def release(self) -> None:
        release, self._release = self._release, None
        if release is not None:
            release()


def open_regular(file: str | os.PathLike) -> BinaryIO:
    """`file` opened for reading; TooLargeError if it is not a regular file: reading a FIFO would wait for a
    writer, reading /dev/zero (or a symlink to it) would never end, a folder is no file. Opening a FIFO does
    not wait."""
    fd = os.open(file, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    if not stat.S_ISREG(os.fstat(fd).st_mode):  # checked before open(), which names a folder by its fd
        os.close(fd)
        raise TooLargeError(f"{file} is not a regular file")
    return open(fd, "rb")


class Storage(ABC):
    """Objects under one root. Subclasses implement the `_` methods, which receive checked paths."""

    url: str

    def read_bytes(self, path: str, limit: int | None = None) -> bytes:
        """The object's content; FileNotFoundError if absent, TooLargeError if over `limit` bytes: at most
        `limit` + 1 bytes are ever read, in one request where the backend can read a range (a poll)."""
        check_path(path)
        with self._failures("read", path, absent_is_final=True):
            data = self._read_bytes(path, limit)
        if limit is not None and len(data) > limit:
            raise TooLargeError(
                f"{self.url}: {path} has at least {len(data)} bytes, more than the {limit} expected"
            )
        return data

    def write_bytes(self, path: str, data: bytes) -> None:
        """Create or replace the object."""
        check_path(path)
        with self._failures("write", path):
            self._write_bytes(path, data)

    def upload_file(self, local: Path, path: str) -> None:
        """Create or replace the object with a local file's content, streamed (for big files)."""
        check_path(path)
        with self._failures("upload", path):
            self._upload_file(Path(local), path)

    def write_many(self, files: builtins.list[tuple[str, bytes | Path]], delete: Iterable[str] = ()) -> None:
        """Create or replace each (path, bytes or local file), then delete `delete` (absent ones are fine):
        one request where the backend batches (a Hub bucket: one Xet upload, one batch call); not atomic."""
        delete = list(delete)
        for path in [p for p, _ in files] + delete:
            check_path(path)
        with self._failures("write", f"{len(files)} files"):
            self._write_many(files, delete)

    def _write_many(self, files: builtins.list[tuple[str, bytes | Path]], delete: builtins.list[str]) -> None:
        for path, source in files:
            if isinstance(source, bytes):
                self._write_bytes(path, source)
            else:
                self._upload_file(Path(source), path)
        if delete:
            self._delete(delete)

    def download_file(self, path: str, local: Path, limit: int | None = None) -> None:
        """Copy the object to `local`, which appears complete or not at all; FileNotFoundError if absent,
        TooLargeError (and no `local`) if it is over `limit` bytes."""
        check_path(path)
        local = Path(local)
        with self._failures("download", path, absent_is_final=True):
            if limit is not None:  # refused before a byte is fetched (one stat on remote backends)
                self._refuse_over(path, self._download_size(path), limit)
            self._download_file(path, local)
        size = local.stat().st_size
        if limit is not None and size > limit:  # it grew since the stat: fetched, but refused
            local.unlink()
            self._refuse_over(path, size, limit)

    def _download_size(self, path: str) -> int | None:
        """The size a download's limit is checked against before it starts (None: absent)."""
        return self._sizes([path])[path]

    def _refuse_over(self, path: str, size: int | None, limit: int) -> None:
        if size is not None and size > limit:
            raise TooLargeError(f"{self.url}: {path} has {size} bytes, more than the {limit} expected")

    def sizes(self, paths: list[str]) -> dict[str, int | None]:
        """Size of each object, None where absent: the cheap poll (one request on the Hub, no listing)."""
        for path in paths:
            check_path(path)
        with self._failures("stat", paths):
            return self._sizes(paths) if paths else {}

    def list(self, prefix: str = "") -> list[str]:
        """Every path under the folder `prefix` ("" for all), sorted, without writers' temporary files."""
        if prefix:
            check_path(prefix)
        with self._failures("list", prefix):
            found = self._list(prefix)
        under = prefix + "/" if prefix else ""
        return sorted(p for p in found if p.startswith(under) and TMP_MARK not in p)

    def delete(self, paths: builtins.list[str]) -> None:
        """Delete the objects; absent ones are fine (GC may repeat itself)."""
        for path in paths:
            check_path(path)
        with self._failures("delete", f"{len(paths)} paths"):
            if paths:
                self._delete(paths)

    def delete_leftovers(self, older_than_s: float) -> builtins.list[str]:
        """Delete the temporary files crashed writers left untouched for `older_than_s`; returns them. Only
        backends that write through temporary files have any."""
        return []

    def delete_empty_folders(
        self, folder: str, older_than_s: float, names: Callable[[str], object]
    ) -> builtins.list[str]:
        """Delete the empty subfolders of `folder` whose names pass `names`, untouched for `older_than_s`;
        returns them. Only backends with real folders have any (object stores have keys only)."""
        return []

    def wait_for_change(self, stop: threading.Event, poll_s: float, under: tuple[str, ...] = ("",)) -> None:
        """Return when something under the folders `under` may have changed, or `stop` is set: at once if a
        change came since the last return, else as soon as one comes where the backend hears of changes (a
        change feed), else after `poll_s` seconds (or longer, where the backend's request budget says so)."""
        stop.wait(poll_s)

    @property
    def poll_s(self) -> float:
        """The shortest interval between polls that keeps within the backend's request budget (0: none)."""
        return 0.0

    @property
    def follows_changes(self) -> bool:
        """Whether `changes` can name what changed (a change feed is followed, or about to be)."""
        return False

    def changes(self, under: str) -> builtins.list[str] | None:
        """The paths under the folder `under` created, replaced or deleted since the last call for it, where
        the backend hears of changes (a change feed); None where it cannot say (no feed, a first call, or the
        feed lost its place): then list."""
        return None

    def announced(self, path: str) -> bool | None:
        """Whether a followed change feed has said that `path` exists (then a read costs no stat); None where
        no feed is followed now."""
        return None

    @property
    def rate_limited_until(self) -> float | None:
        """Unix time until which the server refuses this client's requests (a quota), or None."""
        return None

    def probe(self) -> None:
        """Fail fast (TransientStorageError) if the storage cannot be reached at all: for one-shot commands,
        which should not sit through a client's retries. Only remote backends with retries check anything."""
        return None

    def lock(self, name: str, holder: str) -> WriterLock | None:
        """Hold the exclusive lock `name` until released or this process dies; None where the backend has no
        such lock (object stores: see deltasync.sync.publisher's lease). Raises WriterConflict naming the
        holder when another process holds it."""
        return None

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"  # never the token

    @contextmanager
    def _failures(self, action: str, target: object, absent_is_final: bool = False) -> Iterator[None]:
        """Turn failures into TransientStorageError, except a read's FileNotFoundError: the object is absent.

        Elsewhere FileNotFoundError means a race (a folder removed mid-write) or a missing local file."""
        try:
            yield
        except (TooLargeError, TransientStorageError):  # already says what and where
            raise
        except Exception as e:
            if absent_is_final and isinstance(e, FileNotFoundError):
                raise FileNotFoundError(f"{self.url}: {target} is missing") from None
            raise TransientStorageError(redact(f"{self.url}: {action} {target!r} failed: {e}")) from e

    @abstractmethod
    def _read_bytes(self, path: str, limit: int | None) -> bytes:
        """The content; with a `limit`, at most its first `limit` + 1 bytes (TooLargeError if larger)."""

    @abstractmethod
    def _write_bytes(self, path: str, data: bytes) -> None: ...
    @abstractmethod
    def _upload_file(self, local: Path, path: str) -> None: ...
    @abstractmethod
    def _download_file(self, path: str, local: Path) -> None: ...
    @abstractmethod
    def _sizes(self, paths: builtins.list[str]) -> dict[str, int | None]: ...
    @abstractmethod
    def _list(self, prefix: str) -> builtins.list[str]: ...
    @abstractmethod
    def _delete(self, paths: builtins.list[str]) -> None: ...
