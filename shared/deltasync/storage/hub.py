"""A sync root in a Hugging Face Hub bucket, through huggingface_hub's bucket API."""

from __future__ import annotations

import tempfile
from pathlib import Path

from huggingface_hub import HfApi, get_session
from huggingface_hub.errors import BucketNotFoundError, EntryNotFoundError

from deltasync.storage.base import Storage, TransientStorageError, atomic_file, check_path

_HUB_MISSING = (BucketNotFoundError, EntryNotFoundError)


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
            with atomic_file(local) as tmp:
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
