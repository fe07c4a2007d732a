"""Where a sync root's files live: a local folder, a Hugging Face Hub bucket, or any fsspec URL.

Paths are relative POSIX keys ("deltas/step-00000001.safetensors"). They come from untrusted manifests, so
every public method passes them through `check_path` before a backend sees them.

Every backend gives readers the old or the new object, never a partial one. Errors tell callers what to do:
- FileNotFoundError (read_bytes, download_file): the object (or the whole bucket) is absent;
- ValueError: an unsafe path, raised before any I/O; retrying cannot help;
- TransientStorageError: anything else (network, timeout, server error, permissions): retry later.
"""

from __future__ import annotations

import os
import shutil
import stat
import tempfile
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

import fsspec
from huggingface_hub import HfApi
from huggingface_hub.errors import BucketNotFoundError, EntryNotFoundError

TMP_MARK = (
    ".deltasync-tmp-"  # in the names of files being written; list() hides them, check_path refuses them
)
# Object stores replace a whole object atomically on put, so writing there needs no temporary key.
OBJECT_STORE_PROTOCOLS = {"s3", "s3a", "gs", "gcs", "abfs", "abfss", "az", "adl", "oss", "hf"}
_HUB_MISSING = (BucketNotFoundError, EntryNotFoundError)


class TransientStorageError(Exception):
    """A storage call failed for a reason other than a missing object; the same call may succeed later."""


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


def _file_size(path: Path) -> int | None:
    try:
        st = path.stat()  # one call: a file deleted between two checks must read as absent, not raise
    except (FileNotFoundError, NotADirectoryError):
        return None
    return st.st_size if stat.S_ISREG(st.st_mode) else None


class Storage(ABC):
    """Objects under one root. Subclasses implement the `_` methods, which receive checked paths."""

    url: str

    def read_bytes(self, path: str) -> bytes:
        """The object's content; FileNotFoundError if absent."""
        check_path(path)
        with self._failures("read", path, absent_is_final=True):
            return self._read_bytes(path)

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

    def download_file(self, path: str, local: Path) -> None:
        """Copy the object to `local`, which appears complete or not at all; FileNotFoundError if absent."""
        check_path(path)
        with self._failures("download", path, absent_is_final=True):
            self._download_file(path, Path(local))

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

    def delete(self, paths: list[str]) -> None:
        """Delete the objects; absent ones are fine (GC may repeat itself)."""
        for path in paths:
            check_path(path)
        with self._failures("delete", f"{len(paths)} paths"):
            if paths:
                self._delete(paths)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"  # never the token

    @contextmanager
    def _failures(self, action: str, target: object, absent_is_final: bool = False) -> Iterator[None]:
        """Turn failures into TransientStorageError, except a read's FileNotFoundError: the object is absent.

        Elsewhere FileNotFoundError means a race (a folder removed mid-write) or a missing local file."""
        try:
            yield
        except Exception as e:
            if absent_is_final and isinstance(e, FileNotFoundError):
                raise
            raise TransientStorageError(f"{self.url}: {action} {target!r} failed: {e}") from e

    @abstractmethod
    def _read_bytes(self, path: str) -> bytes: ...
    @abstractmethod
    def _write_bytes(self, path: str, data: bytes) -> None: ...
    @abstractmethod
    def _upload_file(self, local: Path, path: str) -> None: ...
    @abstractmethod
    def _download_file(self, path: str, local: Path) -> None: ...
    @abstractmethod
    def _sizes(self, paths: list[str]) -> dict[str, int | None]: ...
    @abstractmethod
    def _list(self, prefix: str) -> list[str]: ...
    @abstractmethod
    def _delete(self, paths: list[str]) -> None: ...


class LocalStorage(Storage):
    """A folder. Writes fill a temporary file beside the target, fsync it, then rename it over the target."""

    def __init__(self, root: str | Path):
        self.root = Path(root).expanduser().absolute()
        self.url = str(self.root)

    def _read_bytes(self, path: str) -> bytes:
        return (self.root / path).read_bytes()

    def _write_bytes(self, path: str, data: bytes) -> None:
        with _atomic_file(self.root / path) as tmp:
            tmp.write_bytes(data)

    def _upload_file(self, local: Path, path: str) -> None:
        with _atomic_file(self.root / path) as tmp:
            shutil.copyfile(local, tmp)

    def _download_file(self, path: str, local: Path) -> None:
        with _atomic_file(local) as tmp:
            shutil.copyfile(self.root / path, tmp)

    def _sizes(self, paths: list[str]) -> dict[str, int | None]:
        return {p: _file_size(self.root / p) for p in paths}

    def _list(self, prefix: str) -> list[str]:
        # os.walk skips folders that vanish mid-walk (a concurrent GC) instead of raising.
        return [
            (Path(folder) / name).relative_to(self.root).as_posix()
            for folder, _, names in os.walk(self.root / prefix)
            for name in names
        ]

    def _delete(self, paths: list[str]) -> None:
        for path in paths:
            (self.root / path).unlink(missing_ok=True)


class FsspecStorage(Storage):
    """Any fsspec URL (`memory://`, `s3://`, ...). Object stores replace whole objects atomically on put; on
    other filesystems a write fills a temporary key and `mv`s it over the target (a rename there)."""

    def __init__(self, url: str):
        self.url = url.rstrip("/")
        self.fs, self.root = fsspec.core.url_to_fs(self.url)
        protocols = {self.fs.protocol} if isinstance(self.fs.protocol, str) else set(self.fs.protocol)
        self.atomic_puts = bool(protocols & OBJECT_STORE_PROTOCOLS)

    def _key(self, path: str) -> str:
        return f"{self.root}/{path}"

    def _read_bytes(self, path: str) -> bytes:
        return self.fs.cat_file(self._key(path))

    def _write_bytes(self, path: str, data: bytes) -> None:
        self._put(path, lambda key: self.fs.pipe_file(key, data))

    def _upload_file(self, local: Path, path: str) -> None:
        self._put(path, lambda key: self.fs.put_file(str(local), key))

    def _put(self, path: str, write: Callable[[str], None]) -> None:
        if self.atomic_puts:
            write(self._key(path))
            return
        tmp = f"{self._key(path)}{TMP_MARK}{uuid.uuid4().hex}"
        try:
            write(tmp)
            self.fs.mv(tmp, self._key(path))
        except BaseException:
            with suppress(Exception):  # best effort: list() hides a leftover anyway
                self.fs.rm_file(tmp)
            raise

    def _download_file(self, path: str, local: Path) -> None:
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

    def _create_bucket(self) -> None:
        if not self._bucket_exists:
            self.api.create_bucket(self.bucket_id, private=True, exist_ok=True)
            self._bucket_exists = True

    def _read_bytes(self, path: str) -> bytes:
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
    if url.startswith("file://"):
        return LocalStorage(url.removeprefix("file://"))
    if url.startswith("hf://buckets/"):
        namespace, _, rest = url.removeprefix("hf://buckets/").strip("/").partition("/")
        name, _, prefix = rest.partition("/")
        if not namespace or not name:
            raise ValueError(f"expected hf://buckets/<namespace>/<name>[/prefix], got {url!r}")
        return HubBucketStorage(f"{namespace}/{name}", prefix, token)
    return FsspecStorage(url)
