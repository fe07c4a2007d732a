"""Telemetry records: one small JSON object per step per writer, under `telemetry/` in the sync root.

Object stores have no appends, so each record is its own file; readers (the dashboard) list the folder and
read only the files they have not seen. Records are untrusted on the reader side: `from_json` checks them
(pydantic, strict: no bool for a number, no NaN where a number is meant).
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Annotated, Any

from pydantic import AfterValidator, BeforeValidator, Field, TypeAdapter, with_config

from deltasync.errors import RecordError
from deltasync.storage import Storage
from deltasync.sync.protocol import STRICT, parse_json

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
# info keys the readers know to be sizes: a finite number from 0 (others may be NaN: a diverged reward)
SIZE_INFO_KEYS = ("merged_payload_bytes",)

Number = Annotated[float, Field(ge=-MAX_MAGNITUDE, le=MAX_MAGNITUDE)]  # finite (STRICT)
Count = Annotated[int, Field(ge=0, le=MAX_MAGNITUDE)]
Signed = Annotated[int, Field(ge=-MAX_MAGNITUDE, le=MAX_MAGNITUDE)]
Time = Annotated[float, Field(ge=TIME_RANGE[0], le=TIME_RANGE[1])]


def _checked_info(info: dict[str, float]) -> dict[str, float]:
    problem = info_problem(info)
    if problem:
        raise ValueError(problem)
    return info


def _bounded(value: Any) -> Any:
    """An integer that no float holds exactly enough is refused before it becomes one (or an infinity)."""
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) > MAX_MAGNITUDE:
        raise ValueError(f"integer larger than {MAX_MAGNITUDE}")
    return value


# The trainer's own numbers may be NaN or infinite (a diverged reward): readers show those as gaps.
InfoNumber = Annotated[float, Field(allow_inf_nan=True), BeforeValidator(_bounded)]
Info = Annotated[dict[str, InfoNumber], AfterValidator(_checked_info)]


@with_config(STRICT)
@dataclass
class TrainerRecord:
    """What the publisher did with one trainer step. kind: anchor | delta | skipped (folded into a later step
    because uploads lagged; then only `info` and `blocked_s` are meaningful). A step may upload a delta
    (`payload_bytes`) and an anchor beside it (`anchor_bytes`); records of older publishers counted an anchor
    step's anchor in `payload_bytes`. What went out is their sum, `uploaded_bytes`."""

    step: Count
    kind: str
    published_at: Time
    numel: Count
    changed: Count
    payload_bytes: Count
    full_bytes: Count
    encode_s: Number
    upload_s: Number
    blocked_s: Number
    base_step: Count | None = None
    info: Info = field(default_factory=dict)  # the trainer's own numbers: reward stats, staleness
    anchor_bytes: Count = 0

    @property
    def uploaded_bytes(self) -> int:
        return self.payload_bytes + self.anchor_bytes

    @property
    def anchored(self) -> bool:
        """Whether the step published an anchor (alone, or beside its delta)."""
        return self.kind == "anchor" or self.anchor_bytes > 0

    @property
    def density(self) -> float:
        """Fraction of bf16 elements that changed."""
        return self.changed / self.numel if self.numel else 0.0

    def path(self) -> str:
        return f"{TRAINER_DIR}/step-{self.step:08d}.json"


@with_config(STRICT)
@dataclass
class ReplicaRecord:
    """One step a replica applied (or refused: verified False and `error` says why)."""

    replica: str
    step: Count
    kind: str  # anchor | delta | head (a head refused for its signature: verified False)
    published_at: Time
    applied_at: Time
    download_s: Number
    apply_s: Number
    verified: bool
    lag_steps: Signed  # head step minus this step when it was applied
    payload_bytes: Count = 0
    changed: Count = 0
    pause_s: Number | None = None  # generation paused for the write (inference servers only)
    error: str | None = None
    rate_limited_until: Time | None = None  # the storage's request quota held this step back until then
    bugs: Count = 0  # the replica's syncs so far that failed on a bug (each logged with its traceback)

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
    record = parse_json(_ADAPTERS[cls], data, where, RecordError)
    if isinstance(record, ReplicaRecord) and not REPLICA_ID.fullmatch(record.replica):
        raise RecordError(f"{where}: bad replica id {record.replica!r:.80}")
    return record


def info_problem(info: Mapping[str, Any]) -> str | None:
    """Why readers would skip a trainer record with this `info` (too many keys, an empty or overlong key), or
    None: writers check it before they publish."""
    if len(info) > MAX_INFO_KEYS:
        return f"has {len(info)} keys, more than {MAX_INFO_KEYS}"
    if any(not isinstance(key, str) or not 0 < len(key) <= MAX_INFO_KEY_CHARS for key in info):
        return f"has an empty key, or one that is not a string or over {MAX_INFO_KEY_CHARS} characters"
    for key in SIZE_INFO_KEYS:
        value = info.get(key)
        if value is not None and not (isinstance(value, int | float) and math.isfinite(value) and value >= 0):
            return f"{key!r} is {value!r:.40}, not a size in bytes"
    return None


_ADAPTERS: dict[type, TypeAdapter] = {cls: TypeAdapter(cls) for cls in (TrainerRecord, ReplicaRecord)}


def write(storage: Storage, record: Record) -> None:
    """Write `record`; a replica's go through its storage's sink (deltasync.telemetry.sink): batched where the
    storage has a request budget."""
    if isinstance(record, ReplicaRecord):
        from deltasync.telemetry.sink import sink_for

        sink_for(storage).add(record)
    else:
        write_now(storage, record)


def write_now(storage: Storage, record: Record) -> None:
    storage.write_bytes(record.path(), to_json(record))
