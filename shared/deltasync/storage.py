"""Where a sync root's files live: a local folder, a Hugging Face Hub bucket, or any fsspec URL.

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
import fcntl
import itertools
import logging
import os
import re
import shutil
import stat
import tempfile
import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import BinaryIO, TypeVar

import fsspec
from fsspec.implementations.local import LocalFileSystem
from huggingface_hub import HfApi, get_session
from huggingface_hub.errors import BucketNotFoundError, EntryNotFoundError

from deltasync.errors import TooLargeError, TransientStorageError, WriterConflict

log = logging.getLogger(__name__)
T = TypeVar("T")

TMP_MARK = (
    ".deltasync-tmp-"  # in the names of files being written; list() hides them, check_path refuses them
)
# Object stores replace a whole object atomically on put, so writing there needs no temporary key.
OBJECT_STORE_PROTOCOLS = {"s3", "s3a", "gs", "gcs", "abfs", "abfss", "az", "adl", "oss", "hf"}
_HUB_MISSING = (BucketNotFoundError, EntryNotFoundError)
_STEP_DIR = re.compile(r"step-\d{8,}(-e\d+-[0-9a-f]{8})?")  # as deltasync.sync.protocol names them
_CREDENTIALS = [
    # user:password@ in a URL, whatever the password holds ("/", "@", ":"): up to the last "@" before a space
    (re.compile(r"([A-Za-z][A-Za-z0-9+.-]*://)\S*@"), r"\1***@"),
    (re.compile(r"hf_[A-Za-z0-9]{8,}"), "hf_***"),  # a Hub token anywhere
]


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
) -> T:
    """`call()`, called again after each TransientStorageError: first after `waits[0]` seconds, then twice as
    long each time up to `waits[1]`; after `attempts` calls (None: never) the last error is raised. With
    `log_as` each retry logs a warning; `sleep` waits (a caller may wake up early with other work)."""
    wait = waits[0]
    for attempt in itertools.count(1):
        try:
            return call()
        except TransientStorageError as e:
            if attempts is not None and attempt >= attempts:
                raise
            if log_as:
                log.warning("%s failed, retrying in %.1f s: %s", log_as, wait, e)
        sleep(wait)
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
def _atomic_file(dest: Path) -> Iterator[Path]:
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


def _through_symlink(root: Path, path: str) -> bool:
    """Whether `root/path` or a folder on the way is a symlink (which may lead outside the root)."""
    here = root
    for part in path.split("/") if path else []:
        here = here / part
        if here.is_symlink():
            return True
    return False


def open_regular(file: str | os.PathLike) -> BinaryIO:
    """`file` opened for reading; TooLargeError if it is not a regular file: reading a FIFO would wait for a
    writer, reading /dev/zero (or a symlink to it) would never end, a folder is no file. Opening a FIFO does
    not wait."""
    fd = os.open(file, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    if not stat.S_ISREG(os.fstat(fd).st_mode):  # checked before open(), which names a folder by its fd
        os.close(fd)
        raise TooLargeError(f"{file} is not a regular file")
    return open(fd, "rb")


def _file_size(path: Path) -> int | None:
    try:
        st = path.stat()  # one call: a file deleted between two checks must read as absent, not raise
    except (FileNotFoundError, NotADirectoryError):
        return None
    return st.st_size if stat.S_ISREG(st.st_mode) else None


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

    def download_file(self, path: str, local: Path, limit: int | None = None) -> None:
        """Copy the object to `local`, which appears complete or not at all; FileNotFoundError if absent,
        TooLargeError (and no `local`) if it is over `limit` bytes."""
        check_path(path)
        local = Path(local)
        with self._failures("download", path, absent_is_final=True):
            if limit is not None:  # refused before a byte is fetched (one stat on remote backends)
                self._refuse_over(path, self._sizes([path])[path], limit)
            self._download_file(path, local)
        size = local.stat().st_size
        if limit is not None and size > limit:  # it grew since the stat: fetched, but refused
            local.unlink()
            self._refuse_over(path, size, limit)

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
        """Delete what crashed writers and GC left (temporary files, empty step folders) untouched for
        `older_than_s`; returns them. Only backends that write through temporary files have any."""
        return []

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
        except TooLargeError:
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


class LocalStorage(Storage):
    """A folder. Writes fill a temporary file beside the target, fsync it, then rename it over the target."""

    def __init__(self, root: str | Path):
        self.root = Path(root).expanduser().absolute()
        self.url = str(self.root)

    def _read_bytes(self, path: str, limit: int | None) -> bytes:
        with open_regular(self.root / path) as f:  # a FIFO, device or folder planted at `path` is refused
            if limit is None:
                return f.read()
            self._refuse_over(path, os.fstat(f.fileno()).st_size, limit)
            return f.read(limit + 1)  # bounded if it grew meanwhile

    def _write_bytes(self, path: str, data: bytes) -> None:
        with _atomic_file(self.root / path) as tmp:
            tmp.write_bytes(data)

    def _upload_file(self, local: Path, path: str) -> None:
        with _atomic_file(self.root / path) as tmp:
            shutil.copyfile(local, tmp)

    def _download_file(self, path: str, local: Path) -> None:
        with open_regular(self.root / path) as src, _atomic_file(local) as tmp, open(tmp, "wb") as dest:
            shutil.copyfileobj(src, dest, 1 << 20)  # from the checked descriptor: it cannot be swapped

    def _sizes(self, paths: list[str]) -> dict[str, int | None]:
        return {p: _file_size(self.root / p) for p in paths}

    def _list(self, prefix: str) -> list[str]:
        # Symlinks are not ours and may lead outside the root: never listed, so GC never follows them.
        # os.walk skips folders that vanish mid-walk (a concurrent GC) instead of raising.
        if _through_symlink(self.root, prefix):
            return []
        return [
            (Path(folder) / name).relative_to(self.root).as_posix()
            for folder, _, names in os.walk(self.root / prefix)
            for name in names
            if not (Path(folder) / name).is_symlink()
        ]

    def _delete(self, paths: list[str]) -> None:
        for path in paths:
            if not _through_symlink(self.root, path):  # never delete through or at a link: not ours
                (self.root / path).unlink(missing_ok=True)

    def delete_leftovers(self, older_than_s: float) -> list[str]:
        cutoff, removed = time.time() - older_than_s, []

        def stale(path: Path, kind: int) -> bool:
            with suppress(FileNotFoundError):
                st = path.lstat()
                return stat.S_IFMT(st.st_mode) == kind and st.st_mtime < cutoff
            return False

        for folder, _, names in os.walk(self.root):  # does not follow symlinked folders
            for name in names:
                path = Path(folder) / name
                if TMP_MARK in name and stale(path, stat.S_IFREG):
                    path.unlink(missing_ok=True)
                    removed.append(path.relative_to(self.root).as_posix())
        for kind in ("anchors", "deltas"):  # a step's folder: an anchor's shards, a sharded delta's parts
            steps = self.root / kind
            if steps.is_dir() and not steps.is_symlink():
                for step_dir in steps.iterdir():
                    if _STEP_DIR.fullmatch(step_dir.name) and stale(step_dir, stat.S_IFDIR):
                        with suppress(OSError):  # not empty (or gone): not a leftover
                            step_dir.rmdir()
                            removed.append(f"{kind}/{step_dir.name}")
        return sorted(removed)

    def lock(self, name: str, holder: str) -> WriterLock:
        """An flock on the file `name`: exclusive between processes on this host (and on network filesystems
        whose flock is coherent), released by the kernel when the holder dies. The file names the holder."""
        path = self.root / check_path(name)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            current = ""
            for _ in range(100):  # the holder writes its name right after locking: give it that moment
                current = os.pread(fd, 4096, 0).decode(errors="replace").strip()
                if current:
                    break
                time.sleep(0.005)
            os.close(fd)
            raise WriterConflict(
                f"{self.url} is being written by another publisher ({current or 'holder unknown'})"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, holder.encode() + b"\n", 0)
        return WriterLock(lambda: os.close(fd))


class FsspecStorage(Storage):
    """Any fsspec URL (`memory://`, `s3://`, ...). Object stores replace whole objects atomically on put; on
    other filesystems a write fills a temporary key and `mv`s it over the target (a rename there)."""

    def __init__(self, url: str):
        self.url = redact(url.rstrip("/"))
        try:
            self.fs, self.root = fsspec.core.url_to_fs(url.rstrip("/"))
        except ImportError as e:  # e.g. s3:// without s3fs: fsspec names the package to install
            raise ValueError(f"{self.url}: {str(e).splitlines()[0]}") from None
        protocols = {self.fs.protocol} if isinstance(self.fs.protocol, str) else set(self.fs.protocol)
        self.atomic_puts = bool(protocols & OBJECT_STORE_PROTOCOLS)

    def _key(self, path: str) -> str:
        return f"{self.root}/{path}"

    def probe(self) -> None:
        if self.atomic_puts or self.fs.protocol in ("memory", ("memory",)) or self._local:
            return  # object stores' clients answer a missing root quickly; in-process roots are always there
        try:  # a ranged read of the root: absent or a folder means the server answered
            self.fs.cat_file(self.root, start=0, end=1)
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError, PermissionError):
            return
        except Exception as e:
            raise TransientStorageError(redact(f"{self.url} is unreachable: {e}")) from None

    @property
    def _local(self) -> bool:
        return isinstance(self.fs, LocalFileSystem)

    def lock(self, name: str, holder: str) -> WriterLock | None:
        """A local folder under another spelling: the same flock as its plain path (one folder, one lock)."""
        return LocalStorage(self.root).lock(name, holder) if self._local else None

    def _read_bytes(self, path: str, limit: int | None) -> bytes:
        if limit is None:
            return self.fs.cat_file(self._key(path))
        return self.fs.cat_file(self._key(path), start=0, end=limit + 1)  # one ranged request, no stat

    def _write_bytes(self, path: str, data: bytes) -> None:
        self._put(path, lambda key: self.fs.pipe_file(key, data))

    def _upload_file(self, local: Path, path: str) -> None:
        self._put(path, lambda key: self.fs.put_file(str(local), key))

    def _put(self, path: str, write: Callable[[str], None]) -> None:
        if self.atomic_puts:
            write(self._key(path))
            return
        self.fs.makedirs(self._key(path).rsplit("/", 1)[0], exist_ok=True)  # folders exist before their files
        tmp = f"{self._key(path)}{TMP_MARK}{uuid.uuid4().hex}"
        try:
            write(tmp)
            self.fs.mv(tmp, self._key(path))
        except BaseException:
            with suppress(Exception):  # best effort: list() hides a leftover anyway
                self.fs.rm_file(tmp)
            raise

    def _download_file(self, path: str, local: Path) -> None:
        # A filesystem (not an object store) may hold a FIFO or a device under the name: never copied.
        if not self.atomic_puts and self.fs.info(self._key(path))["type"] != "file":
            raise TooLargeError(f"{self.url}: {path} is not a regular file")
        with _atomic_file(local) as tmp:
            self.fs.get_file(self._key(path), str(tmp))

    def _sizes(self, paths: list[str]) -> dict[str, int | None]:
        self.fs.invalidate_cache()  # cached listings would hide newer objects from the poll
        return {p: self._size(p) for p in paths}

    def _size(self, path: str) -> int | None:
        try:
            info = self.fs.info(self._key(path))
        except FileNotFoundError:
            return None
        return info["size"] if info["type"] == "file" else None

    def _list(self, prefix: str) -> list[str]:
        self.fs.invalidate_cache()
        base = self.root + "/"
        return [
            key[len(base) :]
            for key in self.fs.find(self._key(prefix) if prefix else self.root)
            if key.startswith(base)
        ]

    def _delete(self, paths: list[str]) -> None:
        for path in paths:
            with suppress(FileNotFoundError):
                self.fs.rm_file(self._key(path))

    def delete_leftovers(self, older_than_s: float) -> list[str]:
        if self.atomic_puts:  # object stores never hold temporary keys
            return []
        cutoff, removed = time.time() - older_than_s, []
        with self._failures("list", "temporary files"):
            self.fs.invalidate_cache()
            found = self.fs.find(self.root, detail=True)
        for key, info in found.items():
            modified = info.get("mtime", info.get("created"))  # the filesystems differ; undated: kept
            if hasattr(modified, "timestamp"):
                modified = modified.timestamp()
            name = key.rsplit("/", 1)[-1]
            dated = isinstance(modified, float | int) and modified < cutoff
            if TMP_MARK in name and info.get("type") == "file" and dated and key.startswith(self.root + "/"):
                with self._failures("delete", name), suppress(FileNotFoundError):
                    self.fs.rm_file(key)
                removed.append(key[len(self.root) + 1 :])
        return sorted(removed)


class HubBucketStorage(Storage):
    """A Hugging Face Hub bucket, or a folder in one, through huggingface_hub's bucket API.

    A write uploads through Xet, then one batch call points the path at the new content, so readers see the
    old or the new file. The bucket is created (private) on the first write. `token` goes to HfApi and nowhere
    else; None means HF_TOKEN or the login cache.
    """

    def __init__(self, bucket_id: str, prefix: str = "", token: str | None = None):
        self.bucket_id = check_path(bucket_id)
        self.prefix = check_path(prefix) + "/" if prefix else ""
        self.url = f"hf://buckets/{bucket_id}" + (f"/{prefix}" if prefix else "")
        self.api = HfApi(token=token)
        self._bucket_exists = False

    def _key(self, path: str) -> str:
        return self.prefix + path

    def probe(self) -> None:
        try:  # any HTTP answer means reachable; huggingface_hub's own calls retry connection errors for ~25 s
            get_session().head(self.api.endpoint, timeout=10)
        except Exception as e:
            raise TransientStorageError(f"{self.url}: cannot reach {self.api.endpoint}: {e}") from None

    def _create_bucket(self) -> None:
        if not self._bucket_exists:
            self.api.create_bucket(self.bucket_id, private=True, exist_ok=True)
            self._bucket_exists = True

    def _read_bytes(self, path: str, limit: int | None) -> bytes:
        if limit is not None:  # the bucket API reads no ranges: a stat first, so nothing large is fetched
            size = self._sizes([path])[path]
            if size is None:
                raise FileNotFoundError(path)
            self._refuse_over(path, size, limit)
        with tempfile.TemporaryDirectory() as tmp:
            local = Path(tmp) / "object"
            self._download_file(path, local)
            return local.read_bytes()

    def _write_bytes(self, path: str, data: bytes) -> None:
        self._create_bucket()
        self.api.batch_bucket_files(self.bucket_id, add=[(data, self._key(path))])

    def _upload_file(self, local: Path, path: str) -> None:
        self._create_bucket()
        self.api.batch_bucket_files(self.bucket_id, add=[(local, self._key(path))])

    def _download_file(self, path: str, local: Path) -> None:
        try:
            with _atomic_file(local) as tmp:
                # By default a missing file only warns and leaves nothing behind.
                self.api.download_bucket_files(
                    self.bucket_id, [(self._key(path), tmp)], raise_on_missing_files=True
                )
        except _HUB_MISSING as e:
            raise FileNotFoundError(f"{self.url}/{path}") from e

    def _sizes(self, paths: list[str]) -> dict[str, int | None]:
        try:
            found = {
                f.path: f.size for f in self.api.get_bucket_paths_info(self.bucket_id, map(self._key, paths))
            }
        except BucketNotFoundError:
            found = {}
        return {p: found.get(self._key(p)) for p in paths}

    def _list(self, prefix: str) -> list[str]:
        # The server may match the prefix as a plain string ("run1" also matches "run10/..."): filter here.
        folder = (self.prefix + prefix).rstrip("/")
        try:
            entries = list(self.api.list_bucket_tree(self.bucket_id, folder or None, recursive=True))
        except _HUB_MISSING:
            return []
        return [
            e.path[len(self.prefix) :] for e in entries if e.type == "file" and e.path.startswith(self.prefix)
        ]

    def _delete(self, paths: list[str]) -> None:
        # The batch reports paths that are already gone as failures: delete only those present.
        present = [p for p, size in self._sizes(paths).items() if size is not None]
        if present:
            self.api.batch_bucket_files(self.bucket_id, delete=[self._key(p) for p in present])


def open_storage(url: str | Path, token: str | None = None) -> Storage:
    """The storage behind a sync root: a folder (path or file:// URL), `hf://buckets/<namespace>/<name>[/prefix]`,
    or any other fsspec URL. `token` is for the Hub only (None: HF_TOKEN or the login cache)."""
    if isinstance(url, Path) or "://" not in url:
        return LocalStorage(url)
    for scheme in ("file://", "local://"):  # fsspec's names for a local folder: one folder, one lock
        if url.startswith(scheme):
            return LocalStorage(url.removeprefix(scheme))
    if url.startswith("hf://buckets/"):
        namespace, _, rest = url.removeprefix("hf://buckets/").strip("/").partition("/")
        name, _, prefix = rest.partition("/")
        if not namespace or not name:
            raise ValueError(f"expected hf://buckets/<namespace>/<name>[/prefix], got {url!r}")
        return HubBucketStorage(f"{namespace}/{name}", prefix, token)
    if url.startswith("hf://") and not url.startswith(("hf://buckets", "hf://datasets/", "hf://spaces/")):
        # fsspec would read it as a model repository: as a sync root, a bucket URL missing its `buckets/`
        hint = f"hf://buckets/{url.removeprefix('hf://')}"
        raise ValueError(f"{redact(url)} is not a Hub bucket URL; did you mean {redact(hint)}?")
    return FsspecStorage(url)
