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


class AnchorError(Refused):
    """An anchor that is malformed, incomplete, or not the state its head entry promises."""


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


class WriterConflict(DeltasyncError, RuntimeError):
    """Another writer holds the sync root, or took it over: this one must not write (or acknowledge) there."""


class Stopped(DeltasyncError, RuntimeError):
    """A background worker stopped: closed, or failed (its cause is chained, and was logged with its
    traceback where it happened)."""


EXPECTED = (DeltasyncError, OSError, ValueError)  # what a caller reports in a line; anything else is a bug
