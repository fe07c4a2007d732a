"""deltasync: exact sparse bf16 weight patches for async RL, synced through a Hub bucket.

A trainer publishes each step's weights to a sync root (a folder, `hf://buckets/NS/NAME[/prefix]` or an fsspec
URL) as its only writer; replicas follow the root and apply only the bf16 elements that changed, verified bit
for bit against the trainer's fingerprint::

    import deltasync

    # trainer: a complete anchor now and then, sparse deltas between (uploads run in the background)
    with deltasync.Publisher("hf://buckets/me/run-1", model="Qwen/Qwen3-0.6B") as publisher:
        for step in range(steps):
            train_one_step(model)
            publisher.publish(model.state_dict(), step=step)

    # replica: patch a model's tensors in place up to the newest published step
    subscriber = deltasync.Subscriber("hf://buckets/me/run-1", deltasync.TensorsApplier(model.state_dict()))
    subscriber.sync()  # or subscriber.follow(stop_event) in a thread

Importing this package is light: the names below load their modules on first use (a Space that only reads
telemetry needs no torch).
"""

from __future__ import annotations

import importlib
from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING, Any

try:
    __version__ = version("deltasync")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0+unknown"

# name -> (module, attribute): imported when first asked for
_EXPORTS = {
    "Publisher": ("deltasync.sync.publisher", "Publisher"),
    "PublisherConfig": ("deltasync.sync.publisher", "PublisherConfig"),
    "ShardedPublisher": ("deltasync.sync.sharded", "ShardedPublisher"),
    "Subscriber": ("deltasync.sync.subscriber", "Subscriber"),
    "Applier": ("deltasync.sync.subscriber", "Applier"),
    "TensorsApplier": ("deltasync.sync.subscriber", "TensorsApplier"),
    "Applied": ("deltasync.sync.subscriber", "Applied"),
    "SyncError": ("deltasync.sync.subscriber", "SyncError"),
    "open_storage": ("deltasync.storage", "open_storage"),
    "Storage": ("deltasync.storage", "Storage"),
    "WriterConflict": ("deltasync.storage", "WriterConflict"),
    "TransientStorageError": ("deltasync.storage", "TransientStorageError"),
    "TooLargeError": ("deltasync.storage", "TooLargeError"),
    "ManifestError": ("deltasync.sync.protocol", "ManifestError"),
    "AnchorError": ("deltasync.sync.anchor", "AnchorError"),
    "TensorChanges": ("deltasync.codec.changes", "TensorChanges"),
    "diff": ("deltasync.codec.changes", "diff"),
    "apply_changes": ("deltasync.codec.changes", "apply_changes"),
    "SchemaError": ("deltasync.codec.changes", "SchemaError"),
    "Patch": ("deltasync.codec.patch", "Patch"),
    "make_patch": ("deltasync.codec.patch", "make_patch"),
    "encode_patch": ("deltasync.codec.patch", "encode"),
    "decode_patch": ("deltasync.codec.patch", "decode"),
    "PatchError": ("deltasync.codec.patch", "PatchError"),
    "state_fingerprint": ("deltasync.codec.fingerprint", "state_fingerprint"),
}

__all__ = ["__version__", *_EXPORTS]  # the names are listed once, in _EXPORTS

if TYPE_CHECKING:  # the same names for type checkers (tests/deltasync/test_package.py keeps them equal)
    from deltasync.codec.changes import SchemaError, TensorChanges, apply_changes, diff
    from deltasync.codec.fingerprint import state_fingerprint
    from deltasync.codec.patch import Patch, PatchError, make_patch
    from deltasync.codec.patch import decode as decode_patch
    from deltasync.codec.patch import encode as encode_patch
    from deltasync.storage import Storage, TooLargeError, TransientStorageError, WriterConflict, open_storage
    from deltasync.sync.anchor import AnchorError
    from deltasync.sync.protocol import ManifestError
    from deltasync.sync.publisher import Publisher, PublisherConfig
    from deltasync.sync.sharded import ShardedPublisher
    from deltasync.sync.subscriber import Applied, Applier, Subscriber, SyncError, TensorsApplier


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'deltasync' has no attribute {name!r}")
    module, attribute = _EXPORTS[name]
    value = getattr(importlib.import_module(module), attribute)
    globals()[name] = value  # the next lookup is a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})
