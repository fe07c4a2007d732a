"""Telemetry records: one small JSON object per step per writer, under `telemetry/` in the sync root.

Object stores have no appends, so each record is its own file; readers (the dashboard) list the folder and
read only the files they have not seen. Records are untrusted on the reader side: `from_json` checks them.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from deltasync.errors import RecordError
from deltasync.storage import Storage

TRAINER_DIR = "telemetry/trainer"
REPLICAS_DIR = "telemetry/replicas"
REPLICA_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
MAX_RECORD_BYTES = 64 << 10
MAX_MAGNITUDE = 2**63  # largest number a record may hold: any count, size, time or trainer number is smaller
# The trainer's own numbers: a run reports about ten; each key becomes a column of every reader's series.
MAX_INFO_KEYS = 64
MAX_INFO_KEY_CHARS = 128
# published_at and applied_at, unix seconds: from 1970 to 2286, a range every date formatter can show.
TIME_RANGE = (0.0, 1e10)
TIME_FIELDS = ("published_at", "applied_at", "rate_limited_until")


@dataclass
class TrainerRecord:
    """What the publisher did with one trainer step. kind: anchor | delta | skipped (folded into a later step
    because uploads lagged; then only `info` and `blocked_s` are meaningful)."""

    step: int
    kind: str
    published_at: float
    numel: int
    changed: int
    payload_bytes: int
    full_bytes: int
    encode_s: float
    upload_s: float
    blocked_s: float
    base_step: int | None = None
    info: dict[str, float] = field(default_factory=dict)  # the trainer's own numbers: reward stats, staleness

    @property
    def density(self) -> float:
        """Fraction of bf16 elements that changed."""
        return self.changed / self.numel if self.numel else 0.0

    def path(self) -> str:
        return f"{TRAINER_DIR}/step-{self.step:08d}.json"


@dataclass
class ReplicaRecord:
    """One step a replica applied (or refused: verified False and `error` says why)."""

    replica: str
    step: int
    kind: str  # anchor | delta
    published_at: float
    applied_at: float
    download_s: float
    apply_s: float
    verified: bool
    lag_steps: int  # head step minus this step when it was applied
    payload_bytes: int = 0
    changed: int = 0
    pause_s: float | None = None  # generation paused for the write (inference servers only)
    error: str | None = None
    rate_limited_until: float | None = None  # the storage's request quota held this step back until then
    bugs: int = 0  # the replica's syncs so far that failed on a bug (each logged with its traceback)

    @property
    def lag_s(self) -> float:
        """Seconds from publish to verified apply."""
        return self.applied_at - self.published_at

    def path(self) -> str:
        return f"{REPLICAS_DIR}/{self.replica}/step-{self.step:08d}.json"


Record = TrainerRecord | ReplicaRecord


def to_json(record: Record) -> bytes:
    return json.dumps(dataclasses.asdict(record), separators=(",", ":")).encode()


def from_json(cls: type[Record], data: bytes, where: str = "record") -> Record:
    """Parse and check a record of type `cls`; RecordError says what is wrong and where."""
    if len(data) > MAX_RECORD_BYTES:
        raise RecordError(f"{where}: {len(data)} bytes, more than {MAX_RECORD_BYTES}")
    try:
        raw = json.loads(data)
    except (ValueError, RecursionError) as e:  # also an integer over 4300 digits, or deep nesting
        raise RecordError(f"{where}: not JSON: {e}") from None
    if not isinstance(raw, dict):
        raise RecordError(f"{where}: not a JSON object")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    missing = [n for n, f in fields.items() if n not in raw and f.default is dataclasses.MISSING]
    missing = [n for n in missing if fields[n].default_factory is dataclasses.MISSING]
    if missing:
        raise RecordError(f"{where}: missing fields {missing}")
    values = {}
    for name, value in raw.items():
        if name in fields:  # newer writers may add fields: ignore them
            values[name] = _check(cls, name, str(fields[name].type), value, where)
    for name in TIME_FIELDS:
        if values.get(name) is not None and not TIME_RANGE[0] <= values[name] <= TIME_RANGE[1]:
            raise RecordError(f"{where}: field {name!r} is {values[name]!r}, not a unix time in {TIME_RANGE}")
    problem = info_problem(values.get("info", {}))
    if problem:
        raise RecordError(f"{where}: field 'info' {problem}")
    record = cls(**values)
    if isinstance(record, ReplicaRecord) and not REPLICA_ID.fullmatch(record.replica):
        raise RecordError(f"{where}: bad replica id {record.replica!r}")
    return record


def info_problem(info: Mapping[str, Any]) -> str | None:
    """Why readers would skip a trainer record with this `info` (too many keys, an empty or overlong key), or
    None: writers check it before they publish."""
    if len(info) > MAX_INFO_KEYS:
        return f"has {len(info)} keys, more than {MAX_INFO_KEYS}"
    if any(not isinstance(key, str) or not 0 < len(key) <= MAX_INFO_KEY_CHARS for key in info):
        return f"has an empty key, or one that is not a string or over {MAX_INFO_KEY_CHARS} characters"
    return None


def _check(cls: type, name: str, annotation: str, value: Any, where: str) -> Any:
    ok = {
        "int": lambda v: _number(v) and isinstance(v, int),
        "float": _number,  # finite too
        "str": lambda v: isinstance(v, str),
        "bool": lambda v: isinstance(v, bool),
        # the trainer's own numbers may be NaN or infinite (a diverged reward): readers show those as gaps
        "dict[str, float]": lambda v: (
            isinstance(v, dict) and all(_number(x) or isinstance(x, float) for x in v.values())
        ),
    }
    base, _, optional = annotation.partition(" | ")
    if (optional == "None" and value is None) or ok[base](value):
        return value
    raise RecordError(f"{where}: field {name!r} should be {annotation}, got {value!r:.80}")


def _number(v: Any) -> bool:
    """An int or float (not a bool) of magnitude at most MAX_MAGNITUDE: sums, means and differences of such
    numbers stay finite floats (a larger integer may not even convert to one)."""
    return isinstance(v, int | float) and not isinstance(v, bool) and abs(v) <= MAX_MAGNITUDE


def write(storage: Storage, record: Record) -> None:
    storage.write_bytes(record.path(), to_json(record))
