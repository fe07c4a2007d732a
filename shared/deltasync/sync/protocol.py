"""The sync root's layout and its two manifests.

    run.json                                          the model: id, parameter schema (names, shapes; bf16),
                                                      maybe its first state by reference (`base`: a Hub model)
    anchors/step-00000000-e1-1a2b3c4d/model*.safetensors  complete bf16 states (HF names; sharded)
    deltas/step-00000001-e1-1a2b3c4d.safetensors      patches (codec.patch) from the previous published step
    deltas/step-00000002-e1-1a2b3c4d/part-00001-of-00002.safetensors  a step in parts, one per rank (sharded)
    deltas/step-00000003-e1-1a2b3c4d.quant.safetensors  a quantized root's quantized delta (deltasync.quant),
                                                      beside the bf16 patch of the tensors it leaves alone
    heads/latest.json                                 the newest step and every file a reader may use
    heads/epoch-00000001.json                         the same head, under its writer's epoch (fencing)
    telemetry/...                                     deltasync.telemetry
    writer.lock                                       who publishes (deltasync.sync.claim: lock or lease)

Step files carry their writer's tag (`e<epoch>-<claim>`, see deltasync.sync.claim), so two writers never
write the same object: a fenced writer leaves only garbage, never damage. Files without a tag (older
publishers) are still read. Writers upload data first and the head last; readers trust only what the head
names. The head lists the
retained anchors and the unbroken chain of deltas from the oldest of them to the newest step, with sizes and
fingerprints, so a reader plans its path without listing the bucket. Manifests are untrusted input on the
reader side: `read_head` and `read_run` bound the size, `Head.from_json` and `RunInfo.from_json` check
everything (types and ranges with pydantic, in strict mode; the chain and file names here) and raise
ManifestError. This module needs no torch: the dashboard Space reads manifests without it.
"""

from __future__ import annotations

import json
import math
import re
import reprlib
from collections.abc import Mapping
from concurrent import futures
from concurrent.futures import Executor
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Annotated, Any, TypeVar

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, with_config

from deltasync.codec.header import DTYPE as WEIGHT_DTYPE
from deltasync.errors import ManifestError, Refused, TooLargeError
from deltasync.storage import Storage, check_path

if TYPE_CHECKING:
    import torch

FORMAT_VERSION = 1
RUN_PATH = "run.json"
HEAD_PATH = "heads/latest.json"
WRITER_PATH = "writer.lock"  # who writes (deltasync.sync.claim): a lock's holder, or a lease with its epoch
ANCHOR_FORMAT = "deltasync.anchor"
MAX_MANIFEST_BYTES = 16 << 20
MAX_INT = (1 << 63) - 1  # steps, sizes, counts, dims: anything larger is corrupt
STARTS = ("anchor", "base")  # entries holding a complete state: a chain starts at one
_TAG = r"(?:-(e\d{1,19}-[0-9a-f]{8}))?"
STEP_DIR = re.compile(rf"step-\d{{8,}}{_TAG}")  # an anchor's or a sharded delta's folder
Count = Annotated[int, Field(ge=0, le=MAX_INT)]  # a step, size, count or dim a manifest may hold
# Untrusted JSON: no coercion (a bool is no int, "3" no number), no NaN or infinity where a number is meant.
STRICT = ConfigDict(strict=True, allow_inf_nan=False)
_DATA_FILE = re.compile(
    rf"deltas/step-(\d{{8,}}){_TAG}(\.quant)?(?:\.safetensors|/part-(\d{{5}})-of-(\d{{5}})\.safetensors)"
    rf"|anchors/step-(\d{{8,}}){_TAG}/model(?:-\d{{5}}-of-(\d{{5}}))?\.safetensors"
)


def _stem(step: int, tag: str) -> str:
    return f"step-{step:08d}" + (f"-{tag}" if tag else "")


def delta_path(step: int, tag: str = "") -> str:
    """Where the writer tagged `tag` puts its delta of `step` ("" : an untagged, older name)."""
    return f"deltas/{_stem(step, tag)}.safetensors"


def quant_delta_path(step: int, tag: str = "") -> str:
    """Where the writer tagged `tag` puts the quantized delta of `step` of a quantized root."""
    return f"deltas/{_stem(step, tag)}.quant.safetensors"


def delta_files(step: int, tag: str = "", quantized: bool = False) -> tuple[str, ...]:
    """A one-part delta's files: the bf16 patch, and on a quantized root the quantized delta after it."""
    return (delta_path(step, tag), quant_delta_path(step, tag)) if quantized else (delta_path(step, tag),)


def delta_paths(step: int, parts: int, tag: str = "") -> list[str]:
    """Where the writer tagged `tag` puts its delta of `step` stored in `parts` parts (one per rank of a
    sharded publisher, see deltasync.sync.sharded), in order: one part is the single delta file."""
    if parts == 1:
        return [delta_path(step, tag)]
    return [_part_path(step, tag, i, parts) for i in range(1, parts + 1)]


def _part_path(step: int, tag: str, part: int, parts: int) -> str:
    return f"deltas/{_stem(step, tag)}/part-{part:05d}-of-{parts:05d}.safetensors"


def anchor_dir(step: int, tag: str = "") -> str:
    return f"anchors/{_stem(step, tag)}"


def anchor_paths(step: int, shards: int, tag: str = "") -> list[str]:
    folder = anchor_dir(step, tag)
    if shards == 1:
        return [f"{folder}/model.safetensors"]
    return [f"{folder}/model-{i:05d}-of-{shards:05d}.safetensors" for i in range(1, shards + 1)]


def parse_data_path(path: str) -> tuple[str, int, str, int] | None:
    """(kind, step, tag, shards) of a file exactly as a publisher names it, else None: what GC may delete and
    what a head may name."""
    match = _DATA_FILE.fullmatch(path)
    if match is None:
        return None
    if match[1] is not None:
        kind, step, tag, shards = "delta", int(match[1]), match[2] or "", int(match[5] or 1)
        part = int(match[4] or 1)
        if match[3] is not None:  # a quantized delta: one file, beside the step's bf16 patch
            canonical = quant_delta_path(step, tag) if match[4] is None else ""
        elif match[4] is None:
            canonical = delta_path(step, tag)
        else:  # part i of n > 1 (one part is the single file)
            canonical = _part_path(step, tag, part, shards) if 1 <= part <= shards > 1 else ""
    else:
        kind, step, tag, shards = "anchor", int(match[6]), match[7] or "", int(match[8] or 1)
        canonical = f"{anchor_dir(step, tag)}/{path.rsplit('/', 1)[1]}"
    return (kind, step, tag, shards) if path == canonical and step <= MAX_INT else None


def step_of(path: str) -> int | None:
    """The step of a file exactly as a publisher names it (None for anything else): what GC may delete."""
    parsed = parse_data_path(path)
    return parsed[1] if parsed else None


def adapter_name(lora_name: str, step: int) -> str:
    """What requests call the adapter a LoRA root publishes as `step` (TRL's `{lora_name}-v{version}`)."""
    return f"{lora_name}-v{step}"


def check_step(step: int, where: str) -> int:
    """`step` if a head can hold it (what `Head.from_json` accepts), else ValueError naming `where`."""
    if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step <= MAX_INT:
        raise ValueError(f"{where}: step {step!r} is not an integer from 0 to {MAX_INT}")
    return step


def schema_problem(name: object, shape: object) -> str | None:
    """Why (`name`, `shape`) cannot be a run.json schema entry, or None: readers and writers share it."""
    if not isinstance(name, str) or not name:
        return "a tensor name must be a non-empty string"
    if name == "__metadata__":  # safetensors' own header field: no file could hold the tensor
        return "the name is reserved by safetensors"
    ok = isinstance(shape, list) and all(
        isinstance(d, int) and not isinstance(d, bool) and 0 <= d <= MAX_INT for d in shape
    )
    return None if ok else "a shape must be a list of integers from 0 to 2**63 - 1"


def epoch_head_path(epoch: int) -> str:
    """Where the writer of `epoch` also puts each head it writes: a key no other writer writes."""
    return f"heads/epoch-{epoch:08d}.json"


def epoch_of_head(path: str) -> int | None:
    """The epoch of a head stored under its writer's epoch (epoch_head_path), else None."""
    match = re.fullmatch(r"heads/epoch-(\d{8,19})\.json", path)
    return int(match[1]) if match else None


def read_head(storage: Storage) -> Head:
    """The head of `storage`, size-checked before it is read; FileNotFoundError if there is none."""
    return Head.from_json(read_head_bytes(storage))


def read_head_bytes(storage: Storage, beside: Executor | None = None) -> bytes:
    """The current head's bytes: `heads/latest.json`, unless the writer lease names a newer epoch whose own
    head exists (a fenced writer's late write replaced latest.json after the writer that fenced it stopped
    writing): then that one. FileNotFoundError if there is no head. `beside`: where the lease is read while
    the head is (one request's latency for both; a poller keeps one thread for it)."""
    lease = beside.submit(_lease_epoch, storage) if beside else None
    try:
        data = read_manifest(storage, HEAD_PATH)
    finally:
        if lease is not None:
            futures.wait([lease])
    lease_epoch = lease.result() if lease else _lease_epoch(storage)
    head_epoch = _epoch(data)
    if lease_epoch is None or head_epoch is None or lease_epoch <= head_epoch:
        return data
    newest = _head_of(storage, lease_epoch)
    if newest is None:  # a new claim that has not written its head yet: the newest before it (rare)
        found = (epoch_of_head(p) for p in storage.list("heads"))
        between = [e for e in found if e is not None and head_epoch < e < lease_epoch]
        for epoch in sorted(between, reverse=True):
            newest = _head_of(storage, epoch)
            if newest is not None:
                break
    return newest or data


def _lease_epoch(storage: Storage) -> int | None:
    try:
        return _epoch(read_manifest(storage, WRITER_PATH))
    except FileNotFoundError:
        return None


def _head_of(storage: Storage, epoch: int) -> bytes | None:
    try:
        data = read_manifest(storage, epoch_head_path(epoch))
    except FileNotFoundError:
        return None
    return data if _epoch(data) == epoch else None


def _epoch(data: bytes) -> int | None:
    """The `epoch` field of a head or lease, None if unreadable (the head's parser says why)."""
    try:
        epoch = json.loads(data).get("epoch")
    except (ValueError, RecursionError, AttributeError):
        return None
    return epoch if isinstance(epoch, int) and not isinstance(epoch, bool) and 0 <= epoch <= MAX_INT else None


def read_run(storage: Storage) -> RunInfo:
    return RunInfo.from_json(read_manifest(storage, RUN_PATH))


def read_manifest(storage: Storage, path: str) -> bytes:
    """A manifest's bytes, refused (ManifestError) before reading when over MAX_MANIFEST_BYTES."""
    try:
        return storage.read_bytes(path, limit=MAX_MANIFEST_BYTES)
    except TooLargeError as e:
        raise ManifestError(str(e)) from None


T = TypeVar("T")
_SHOWN = reprlib.Repr()  # bounded, even for deep or huge values
_SHOWN.maxlevel, _SHOWN.maxstring, _SHOWN.maxother, _SHOWN.maxlist, _SHOWN.maxdict = 2, 60, 60, 4, 4


class _Versioned(BaseModel):
    version: Any = None


def parse_json(adapter: TypeAdapter[T], data: bytes, what: str, error: type[Refused]) -> T:
    """`data` validated by `adapter` (strict JSON); else `error` with one line saying what is wrong, where."""
    try:
        return adapter.validate_json(data)
    except ValidationError as e:
        raise error(f"{what}: {validation_line(e)}") from None


def validation_line(e: ValidationError) -> str:
    """A pydantic error as one short line: the first problem, its field and the value found there."""
    problems = e.errors(include_url=False)
    missing = [".".join(map(str, p["loc"])) for p in problems if p["type"] == "missing"]
    if missing:
        return f"missing fields {missing}"
    first = problems[0]
    if first["type"] == "json_invalid":  # bad JSON or UTF-8, a number out of range, deep nesting
        return f"not JSON: {first['ctx']['error']}"[:200]
    where = ".".join(map(str, first["loc"]))
    line = f"{first['msg']}, got {_SHOWN.repr(first['input'])}"
    line = f"field {where!r}: {line}" if where else line
    return line + (f" (and {len(problems) - 1} more problems)" if len(problems) > 1 else "")


def _load(adapter: TypeAdapter[T], data: bytes, what: str) -> T:
    """A manifest of this format version, validated by `adapter`; else ManifestError."""
    if len(data) > MAX_MANIFEST_BYTES:
        raise ManifestError(f"{what}: {len(data)} bytes, more than {MAX_MANIFEST_BYTES}")
    version = parse_json(_VERSIONED, data, what, ManifestError).version
    if version != FORMAT_VERSION:
        raise ManifestError(
            f"{what}: format version {_SHOWN.repr(version)}, this reader knows {FORMAT_VERSION}"
        )
    return parse_json(adapter, data, what, ManifestError)


_VERSIONED = TypeAdapter(_Versioned)


_RECIPE_NAME = re.compile(r"[a-z0-9_]{1,64}")  # deltasync.quant.recipe knows which ones a replica serves
_PUBLIC_KEY = re.compile(r"ed25519:[A-Za-z0-9+/]{43}=")  # deltasync.sync.signing's one-line form
_SIGNATURE = re.compile(r"[A-Za-z0-9+/]{86}==")
_SHA256 = re.compile(r"[0-9a-f]{64}")
RUN_ID = re.compile(r"[0-9a-f]{32}")
_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]{0,95}(?:/[A-Za-z0-9][\w.-]{0,95})?")
_COMMIT = re.compile(r"[0-9a-f]{40}")


@with_config(STRICT)
@dataclass(frozen=True)
class ModelReference:
    """A Hub model repository at one commit and the safetensors files holding its weights: a run's step 0
    by reference, in place of an anchor (deltasync.sync.base)."""

    repo: str
    revision: str  # a commit sha: what it names never changes
    files: tuple[str, ...]

    def __str__(self) -> str:
        return f"{self.repo}@{self.revision}"

    def problem(self) -> str | None:
        """Why a reader refuses this reference, or None."""
        if not _REPO_ID.fullmatch(self.repo) or ".." in self.repo:
            return f"{self.repo!r:.100} is not a model repository id"
        if not _COMMIT.fullmatch(self.revision):
            return f"revision {self.revision!r:.60} is not a commit sha"
        if not self.files or len(self.files) > 100_000:
            return "it names no weight files"
        for name in self.files:
            try:
                check_path(name)
            except ValueError as e:
                return str(e)
            if not name.endswith(".safetensors"):
                return f"{name!r:.100} is not a safetensors file"
        return None


@with_config(STRICT)
@dataclass(frozen=True)
class Signing:
    """A signed run (deltasync.sync.signing): its id, when it began (a restored older run began earlier),
    and the keys that signed it, oldest first; the last signs run.json and the heads, each endorses the
    next (`endorsements[i]`: keys[i]'s signature naming keys[i + 1])."""

    run: str
    started_at: float
    keys: tuple[str, ...]
    endorsements: tuple[str, ...] = ()

    def problem(self) -> str | None:
        if not RUN_ID.fullmatch(self.run):
            return f"run id {self.run!r:.60} is not 32 hex digits"
        if not 1 <= len(self.keys) <= 100 or not all(_PUBLIC_KEY.fullmatch(k) for k in self.keys):
            return "its keys are not 1 to 100 public keys (ed25519:<base64>)"
        if len(self.endorsements) != len(self.keys) - 1 or not all(
            _SIGNATURE.fullmatch(e) for e in self.endorsements
        ):
            return "each key after the first needs one endorsement (a base64 signature) by the key before"
        return None


def _checked_lora(lora: dict | None) -> dict | None:
    if lora is not None and not (
        isinstance(lora.get("name"), str) and isinstance(lora.get("adapter_config"), dict)
    ):
        raise ValueError(
            "a LoRA root names its adapter ('name', a string) and its 'adapter_config' (an object)"
        )
    return lora


@with_config(STRICT)
@dataclass(frozen=True)
class RunInfo:
    """What every step of the run is a state of: the model id and its bf16 parameter schema."""

    model: str
    schema: dict[str, list[Count]]  # HF name -> shape, in the trainer's order
    # A LoRA root (its states are adapters of `model`): {"name": the adapter's name, "adapter_config": PEFT's
    # adapter_config.json}. None: full weights.
    lora: Annotated[dict | None, AfterValidator(_checked_lora)] = None
    dtype: str = WEIGHT_DTYPE  # of every weight (the seam another dtype, FP8, would use; older runs: none)
    # The Hub model whose weights the head's "base" entry is (the run's first state, by reference); None:
    # every chain starts at an anchor in the root (older runs: none).
    base: ModelReference | None = None
    # A quantized root (deltasync.quant): the recipe, as vLLM's --quantization names it, its replicas serve;
    # its deltas are the bf16 patch of the tensors the recipe leaves alone plus a quantized delta. None: bf16.
    quantization: str | None = None
    signing: Signing | None = None  # a signed run (deltasync.sync.signing); None: unsigned

    @classmethod
    def of(
        cls,
        model: str,
        state: Mapping[str, torch.Tensor],
        lora: dict | None = None,
        quantization: str | None = None,
    ) -> RunInfo:
        """The run of `state`; ValueError naming the tensor if a reader would refuse its schema."""
        schema = {name: list(t.shape) for name, t in state.items()}
        for name, shape in schema.items():
            problem = schema_problem(name, shape)
            if problem:
                raise ValueError(f"tensor {name!r}: {problem}")
        return cls(model, schema, lora, quantization=quantization)

    @property
    def numel(self) -> int:
        return sum(math.prod(shape) for shape in self.schema.values())

    def to_json(self) -> bytes:
        raw = {"version": FORMAT_VERSION, **asdict(self)}
        # Without them: the run.json it always had.
        for optional in ("lora", "base", "quantization", "signing"):
            if raw[optional] is None:
                del raw[optional]
        return json.dumps(raw, indent=1).encode()

    @classmethod
    def from_json(cls, data: bytes) -> RunInfo:
        run = _load(_RUN, data, RUN_PATH)
        if run.dtype != WEIGHT_DTYPE:
            raise ManifestError(
                f"{RUN_PATH}: weights are {run.dtype!r:.40}; this reader handles {WEIGHT_DTYPE} only"
            )
        for name, shape in run.schema.items():
            problem = schema_problem(name, shape)
            if problem:
                raise ManifestError(f"{RUN_PATH}: bad schema entry {name!r:.80}: {shape!r:.80}: {problem}")
        problem = run.base.problem() if run.base else None
        if problem:
            raise ManifestError(f"{RUN_PATH}: bad base model: {problem}")
        if run.quantization is not None and not _RECIPE_NAME.fullmatch(run.quantization):
            raise ManifestError(f"{RUN_PATH}: quantization {run.quantization!r:.60} is not a recipe name")
        if run.quantization is not None and run.lora is not None:
            raise ManifestError(f"{RUN_PATH}: a LoRA root cannot be quantized")
        problem = run.signing.problem() if run.signing else None
        if problem:
            raise ManifestError(f"{RUN_PATH}: bad signing block: {problem}")
        return run


@with_config(STRICT)
@dataclass(frozen=True)
class Entry:
    """One published file set: a complete anchor or a delta from `base_step`; or the run's base model by
    reference (kind "base": run.json's `base`, no files in the root)."""

    step: Count
    kind: str  # "anchor" | "delta" | "base"
    files: tuple[str, ...]  # a delta's parts or an anchor's shards, in order; none for "base"
    bytes: Count  # all its files together
    fingerprint: str  # of the full bf16 state at `step` (deltasync.codec.fingerprint.format_fingerprint)
    published_at: float
    changed: Count = 0  # deltas: elements changed since base_step
    base_step: Count | None = None  # deltas only
    # A quantized root's: the fingerprint of a quantized replica's state at `step` (deltasync.quant.state:
    # the bf16 tensors the recipe leaves alone plus the codes and scales); its deltas are two files (the bf16
    # patch of those tensors, then the quantized delta, protocol.delta_files).
    quantized: str | None = None
    sha256: tuple[str, ...] | None = None  # a signed root's: of each file, in order (deltasync.sync.signing)


@with_config(STRICT)
@dataclass(frozen=True)
class Head:
    """The newest published step and the entries (ascending by step) that reach it. `epoch` and `writer`
    name the publisher that wrote it (fencing, see deltasync.sync.publisher): a newer one, a larger epoch."""

    step: Count
    fingerprint: str
    entries: tuple[Entry, ...]
    epoch: Count = 0
    writer: str = ""
    run: str = ""  # a signed run's id (RunInfo.signing): binds the head to that run.json

    @property
    def anchors(self) -> list[Entry]:
        """The complete states: anchors, and the base model by reference."""
        return [e for e in self.entries if e.kind in STARTS]

    @property
    def deltas(self) -> list[Entry]:
        return [e for e in self.entries if e.kind == "delta"]

    def entry(self, step: int, kind: str) -> Entry | None:
        return next((e for e in self.entries if e.step == step and e.kind == kind), None)

    def files(self) -> set[str]:
        return {f for e in self.entries for f in e.files}

    def to_json(self) -> bytes:
        entries = [{k: v for k, v in asdict(e).items() if v is not None} for e in self.entries]
        return json.dumps(
            {
                "version": FORMAT_VERSION,
                "step": self.step,
                "fingerprint": self.fingerprint,
                "epoch": self.epoch,
                "writer": self.writer,
                **({"run": self.run} if self.run else {}),
                "entries": entries,
            },
            indent=1,
        ).encode()

    @classmethod
    def from_json(cls, data: bytes) -> Head:
        head = _load(_HEAD, data, HEAD_PATH)
        for index, entry in enumerate(head.entries):
            _check_entry(entry, index)
        head._check_chain()
        return head

    def _check_chain(self) -> None:
        if self.run and not RUN_ID.fullmatch(self.run):
            raise ManifestError(f"{HEAD_PATH}: run id {self.run!r:.60} is not 32 hex digits")
        if not self.entries or self.entries[0].kind not in STARTS:
            raise ManifestError(f"{HEAD_PATH}: the chain must start at an anchor")
        if any(e.kind == "base" for e in self.entries[1:]):
            raise ManifestError(f"{HEAD_PATH}: the base model can only start the chain")
        first, last = self.entries[0], self.entries[-1]
        if (last.step, last.fingerprint) != (self.step, self.fingerprint):
            raise ManifestError(f"{HEAD_PATH}: the last entry is not the head step {self.step}")
        chain = first  # where the deltas have reached so far
        for entry in self.entries[1:]:
            if entry.kind == "delta":
                if entry.base_step != chain.step:
                    raise ManifestError(
                        f"{HEAD_PATH}: delta {entry.step} is based on step {entry.base_step}, "
                        f"the chain is at step {chain.step}"
                    )
                chain = entry
            elif (entry.step, entry.fingerprint) != (chain.step, chain.fingerprint):
                raise ManifestError(
                    f"{HEAD_PATH}: anchor {entry.step} does not match the chain at step {chain.step}"
                )


def _check_entry(entry: Entry, index: int) -> None:
    """What types do not say: the kind, the base step, and that the files are where a writer puts them."""
    what, kind, step, files = f"{HEAD_PATH} entry {index}", entry.kind, entry.step, entry.files
    if entry.sha256 is not None and (
        len(entry.sha256) != len(files) or not all(_SHA256.fullmatch(d) for d in entry.sha256)
    ):
        raise ManifestError(f"{what}: sha256 must hold one digest (64 hex digits) per file")
    if kind == "delta":
        if entry.base_step is None:
            raise ManifestError(f"{what}: a delta without a base step")
        if entry.base_step >= step:
            raise ManifestError(f"{what}: base step {entry.base_step} is not before step {step}")
    elif kind == "base":  # its files are the model repository's (run.json), none of the root's
        if files or entry.base_step is not None:
            raise ManifestError(f"{what}: the base model names no files of the root and no base step")
        return
    elif kind != "anchor":
        raise ManifestError(f"{what}: kind {kind!r:.40} is none of 'anchor', 'delta', 'base'")
    for path in files:
        try:
            check_path(path)
        except ValueError as e:
            raise ManifestError(f"{what}: {e}") from None
    # Where a writer (tagged or not) puts the files of this step: every part of one delta (one file unless a
    # sharded publisher wrote it), or every shard of one anchor.
    first = parse_data_path(files[0]) if files else None
    expected_ok = first is not None and first[:2] == (kind, step) and len(files) < 100_000
    if expected_ok and first is not None and kind == "delta" and entry.quantized is not None:
        expected_ok = files == delta_files(step, first[2], quantized=True)
    elif expected_ok and first is not None:
        where = delta_paths if kind == "delta" else anchor_paths
        expected_ok = files == tuple(where(step, len(files), first[2]))
    if not expected_ok:
        raise ManifestError(f"{what}: files {list(files)!r:.200} are not where a {kind} of step {step} lives")


_RUN = TypeAdapter(RunInfo)
_HEAD = TypeAdapter(Head)
