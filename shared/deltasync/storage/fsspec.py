"""A sync root at any fsspec URL (`memory://`, `s3://`, ...)."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from contextlib import suppress
from pathlib import Path

import fsspec
from fsspec.implementations.local import LocalFileSystem

from deltasync.storage.base import (
    TMP_MARK,
    Storage,
    TooLargeError,
    TransientStorageError,
    WriterLock,
    atomic_file,
    redact,
)
from deltasync.storage.local import LocalStorage

# Object stores replace a whole object atomically on put, so writing there needs no temporary key.
OBJECT_STORE_PROTOCOLS = {"s3", "s3a", "gs", "gcs", "abfs", "abfss", "az", "adl", "oss", "hf"}


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
        with atomic_file(local) as tmp:
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
