"""Where a sync root's files live: a local folder, a Hugging Face Hub bucket, or any fsspec URL.

One module per backend (`local`, `fsspec`, `hub`); `base` holds the interface they share (see its docstring:
paths, errors, redaction, retries). `open_storage` picks the backend for a URL.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from deltasync.storage.base import (
    POLL_BUDGET,
    TMP_MARK,
    RateLimited,
    Storage,
    TooLargeError,
    TransientStorageError,
    WriterConflict,
    WriterLock,
    check_path,
    open_regular,
    rate_limited_line,
    redact,
    retry,
)
from deltasync.storage.fsspec import FsspecStorage
from deltasync.storage.local import LocalStorage

if TYPE_CHECKING:
    from deltasync.storage.hub import HubBucketStorage

__all__ = [
    "POLL_BUDGET",
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
    "rate_limited_line",
    "redact",
    "retry",
]


def __getattr__(name: str) -> Any:
    # The Hub's client is imported with the first Hub root: the codec and the vLLM engine never need it.
    if name == "HubBucketStorage":
        from deltasync.storage.hub import HubBucketStorage

        return HubBucketStorage
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def open_storage(url: str | Path, token: str | None = None, poll_budget: int = POLL_BUDGET) -> Storage:
    """The storage behind a sync root: a folder (a path, file:/path or file:///path),
    `hf://buckets/<namespace>/<name>[/prefix]`, or any other fsspec URL. For the Hub only: `token` (None:
    HF_TOKEN or the login cache) and `poll_budget`, the requests per 5-minute window polling may spend
    without the change feed."""
    if isinstance(url, Path):
        return LocalStorage(url)
    # fsspec's names for a local folder (one folder, one lock), and RFC 8089's file:/abs/path
    for scheme in ("file://", "local://", "file:"):
        if url.startswith(scheme):
            return LocalStorage(url.removeprefix(scheme))
    if "://" not in url:
        return LocalStorage(url)
    if url.startswith("hf://buckets/"):
        namespace, _, rest = url.removeprefix("hf://buckets/").strip("/").partition("/")
        name, _, prefix = rest.partition("/")
        if not namespace or not name:
            raise ValueError(f"expected hf://buckets/<namespace>/<name>[/prefix], got {url!r}")
        from deltasync.storage.hub import HubBucketStorage

        return HubBucketStorage(f"{namespace}/{name}", prefix, token, poll_budget=poll_budget)
    if url.startswith("hf://") and not url.startswith(("hf://buckets", "hf://datasets/", "hf://spaces/")):
        # fsspec would read it as a model repository: as a sync root, a bucket URL missing its `buckets/`
        hint = f"hf://buckets/{url.removeprefix('hf://')}"
        raise ValueError(f"{redact(url)} is not a Hub bucket URL; did you mean {redact(hint)}?")
    return FsspecStorage(url)
