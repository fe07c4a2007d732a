"""What deltasync raises, by what the caller should do about it.

- `Refused`: input that is wrong and stays wrong (a corrupt patch, anchor or manifest, an object over its
  limit, a bad telemetry record, tensors that do not match the run): name it, never retry it, never apply it.
- `TransientStorageError`: the storage failed for now; the same call may succeed later: retry.
- `WriterConflict`: another publisher holds the sync root, or took it over: stop writing there.

Anything else is a bug: it is logged with its traceback where it is caught, never read as a bad file.
`Refused` is a ValueError, so callers that catch ValueError for bad input keep working.
"""

from __future__ import annotations


class DeltasyncError(Exception):
    """Base of every error deltasync raises on purpose."""


class Refused(DeltasyncError, ValueError):
    """Input that is malformed, corrupt, unsafe or made for something else; retrying cannot help."""


class PatchError(Refused):
    """A patch that is malformed, corrupt, or made for another base state. Nothing was applied."""


class CompactDecodeError(Refused):
    """A compact tensor stream that cannot be what an encoder wrote (`tensor`: whose, where a caller
    decodes several tensors' streams at once)."""

    tensor: str | None = None


class AnchorError(Refused):
    """An anchor that is malformed, incomplete, or not the state its head entry promises."""


class PackedError(Refused):
    """Bytes that are not a packed tensor of the expected size."""


class ManifestError(Refused):
    """A run.json or head that is malformed or unsafe."""


class TooLargeError(Refused):
    """An object larger than the reader's limit, or not a regular file (its size is unknown): hostile or
    corrupt; retrying cannot help."""


class RecordError(Refused):
    """A telemetry file that is not a valid record."""


class SchemaError(Refused):
    """Tensor names or shapes that differ from the run's (or from the other state's)."""


class TransientStorageError(DeltasyncError):
    """A storage call failed for a reason other than a missing object; the same call may succeed later."""


class RateLimited(TransientStorageError):
    """The server refused a request over the caller's request quota: nothing succeeds before `until`."""

    def __init__(self, message: str, until: float):
        super().__init__(message)
        self.until = until


class WriterConflict(DeltasyncError, RuntimeError):
    """Another writer holds the sync root, or took it over: this one must not write (or acknowledge) there."""


class Stopped(DeltasyncError, RuntimeError):
    """A background worker stopped: closed, or failed (its cause is chained, and was logged with its
    traceback where it happened)."""


class SyncError(DeltasyncError, RuntimeError):
    """Sync could not reach the requested step; the target still holds the last verified step (or nothing)."""


class WriteRefused(DeltasyncError, RuntimeError):
    """The server refused an update (its reason is the message). Unless `EngineApplier.stuck`, it wrote
    nothing."""


class FilesRefused(WriteRefused, Refused):
    """The workers found the step's files bad (corrupt, or not the state they promise); nothing written."""


class Unreachable(DeltasyncError, ConnectionError):
    """The vLLM server could not be sent a request (not listening, unknown host): it did nothing."""


class PackingError(ValueError):
    """The prepack is not a per-expert permutation of the elements: these weights cannot be written in
    place."""


class RankFailed(RuntimeError):
    """An update that failed on a rank for a reason other than a refusal (out of memory, a bug): not
    expected, so not a DeltasyncError; that rank logged its traceback, every rank raises this."""


EXPECTED = (DeltasyncError, OSError, ValueError)  # what a caller reports in a line; anything else is a bug
