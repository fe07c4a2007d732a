"""A sync root in a local folder."""

from __future__ import annotations

import fcntl
import os
import shutil
import stat
import time
from collections.abc import Callable
from contextlib import suppress
from pathlib import Path

from deltasync.storage.base import (
    TMP_MARK,
    Storage,
    WriterConflict,
    WriterLock,
    atomic_file,
    check_path,
    open_regular,
)


def _through_symlink(root: Path, path: str) -> bool:
    """Whether `root/path` or a folder on the way is a symlink (which may lead outside the root)."""
    here = root
    for part in path.split("/") if path else []:
        here = here / part
        if here.is_symlink():
            return True
    return False


def _untouched(path: Path, kind: int, cutoff: float) -> bool:
    """Whether `path` is of `kind` (not a link to one) and unmodified since `cutoff`."""
    with suppress(FileNotFoundError):
        st = path.lstat()
        return stat.S_IFMT(st.st_mode) == kind and st.st_mtime < cutoff
    return False


def _file_size(path: Path) -> int | None:
    try:
        st = path.stat()  # one call: a file deleted between two checks must read as absent, not raise
    except (FileNotFoundError, NotADirectoryError):
        return None
    return st.st_size if stat.S_ISREG(st.st_mode) else None


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
        with atomic_file(self.root / path) as tmp:
            tmp.write_bytes(data)

    def _upload_file(self, local: Path, path: str) -> None:
        with atomic_file(self.root / path) as tmp:
            shutil.copyfile(local, tmp)

    def _download_file(self, path: str, local: Path) -> None:
        with open_regular(self.root / path) as src, atomic_file(local) as tmp, open(tmp, "wb") as dest:
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
        for folder, _, names in os.walk(self.root):  # does not follow symlinked folders
            for name in names:
                path = Path(folder) / name
                if TMP_MARK in name and _untouched(path, stat.S_IFREG, cutoff):
                    path.unlink(missing_ok=True)
                    removed.append(path.relative_to(self.root).as_posix())
        return sorted(removed)

    def delete_empty_folders(
        self, folder: str, older_than_s: float, names: Callable[[str], object]
    ) -> list[str]:
        check_path(folder)
        cutoff, removed, parent = time.time() - older_than_s, [], self.root / folder
        if parent.is_dir() and not _through_symlink(self.root, folder):
            for child in parent.iterdir():
                if names(child.name) and _untouched(child, stat.S_IFDIR, cutoff):
                    with suppress(OSError):  # not empty (or gone): not a leftover
                        child.rmdir()
                        removed.append(f"{folder}/{child.name}")
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
