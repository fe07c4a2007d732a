"""Where a sync root's files live: a local folder, a Hugging Face Hub bucket, or any fsspec URL.

One module per backend (`local`, `fsspec`, `hub`); `base` holds the interface they share (see its docstring:
paths, errors, redaction, retries). `open_storage` picks the backend for a URL.
"""

from __future__ import annotations

from pathlib import Path

from deltasync.storage.base import (
    TMP_MARK,
    RateLimited,
    Storage,
    TooLargeError,
    TransientStorageError,
    WriterConflict,
    WriterLock,
    check_path,
    open_regular,
    redact,
    retry,
)
from deltasync.storage.fsspec import FsspecStorage
from deltasync.storage.hub import HubBucketStorage
from deltasync.storage.local import LocalStorage

__all__ = [
    "TMP_MARK",
    "FsspecStorage",
    "HubBucketStorage",
    "LocalStorage",
    "RateLimited",
    "Storage",
    "TooLargeError",
    "TransientStorageError",
    "WriterConflict",
    "WriterLock",
    "check_path",
    "open_regular",
    "open_storage",
    "redact",
    "retry",
]


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
