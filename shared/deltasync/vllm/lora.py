"""vLLM LoRA resolver for a LoRA sync root: a request naming `{lora_name}-v{N}` gets the adapter published
as step N, downloaded and verified bit for bit (the step's fingerprint) first.

A stock server turns it on with the root in its environment (the `vllm.general_plugins` entry point registers
it, `deltasync.vllm.plugin`):

    export DELTASYNC_LORA_ROOT=hf://buckets/me/run VLLM_ALLOW_RUNTIME_LORA_UPDATING=1
    python -m vllm.entrypoints.openai.api_server --model BASE --enable-lora --max-lora-rank 8 --max-loras 6

DELTASYNC_LORA_CACHE: where verified adapters are written in PEFT's format (adapter_model.safetensors and
adapter_config.json), one folder per name and fingerprint (default: a temporary folder). vLLM reads them when
it loads an adapter, also again after evicting it (`--max-loras`, `--max-cpu-loras`), so the last
DELTASYNC_LORA_KEEP folders it wrote stay (default 16: more than the versions rollouts may still name, vLLM's
--max-loras plus TRL's max_staleness); older ones are deleted. Nothing else in the folder is touched.

A name that is no adapter name (letters, digits, '.', '_' and '-': it names a folder), a name the root does
not publish, a root of another base model or of full weights resolve to nothing from run.json alone, before
anything is downloaded; so do a step not published yet (or no longer retained) and a file that fails
verification: vLLM answers 404 (the rollout worker retries), and the reason is logged as one line. Nothing is
ever served under a name but the verified step it names. DELTASYNC_LORA_TRUSTED_KEYS (public keys,
`ed25519:...` or .pub files, comma-separated): only a root whose run.json and steps those keys signed
resolves (`deltasync keygen`; unset: whoever can write the root is trusted). With a replica name
(`register_resolver(replica)`: the inference Space passes its REPLICA_ID), each version resolved is recorded
in the root's telemetry as that replica's: the versions it holds.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import shutil
import tempfile
import threading
from collections import OrderedDict
from dataclasses import asdict
from pathlib import Path

from safetensors.torch import save_file
from vllm.lora.request import LoRARequest
from vllm.lora.resolver import LoRAResolver, LoRAResolverRegistry

from deltasync import telemetry
from deltasync.codec.fingerprint import format_fingerprint
from deltasync.errors import EXPECTED, Refused  # Refused: why a name resolves to nothing (one line)
from deltasync.storage import TransientStorageError, redact
from deltasync.sync.protocol import RunInfo, adapter_name
from deltasync.sync.signing import Trust, parse_keys
from deltasync.sync.subscriber import Applied, Subscriber, SyncError

# Under vLLM's logger: a vLLM server's log shows what its handler writes, beside vLLM's own resolver lines.
log = logging.getLogger("vllm.deltasync.lora")
ROOT_ENV = "DELTASYNC_LORA_ROOT"
CACHE_ENV = "DELTASYNC_LORA_CACHE"
KEEP_ENV = "DELTASYNC_LORA_KEEP"
TRUSTED_KEYS_ENV = "DELTASYNC_LORA_TRUSTED_KEYS"
KEEP = 16
RESOLVER = "deltasync"  # its name in vLLM's registry
VERSIONED = re.compile(r"(.+)-v(\d{1,18})")
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")  # an adapter's name is also a folder's: never a path


class DeltasyncLoRAResolver(LoRAResolver):
    """Resolves `{lora_name}-v{N}` from the LoRA sync root `root` into folders under `cache`, keeping the
    last `keep` folders it wrote; `trust`: the keys whose signed steps alone resolve (None: any)."""

    def __init__(
        self,
        root: str,
        cache: Path | None = None,
        replica: str | None = None,
        keep: int = KEEP,
        trust: Trust | None = None,
    ):
        self.root, self.cache = root, cache  # None: a temporary folder, made when first needed
        self.replica = replica  # set: each version resolved is told in the root's telemetry under this name
        self.keep = keep
        self.where = redact(root)
        # One reader, kept between resolutions: the next version replays one delta from the last one. Its
        # run.json, read once, refuses every name this root does not serve without another request.
        self.reader = Subscriber(root, prefetch=False, trust=trust)
        self.lock = threading.Lock()
        self.resolved: list[str] = []  # the names resolved, oldest first
        self.written: OrderedDict[Path, None] = OrderedDict()  # folders this resolver wrote, last used last
        self.last_error: str | None = None  # why the last name that resolved to nothing did

    async def resolve_lora(self, base_model_name: str, lora_name: str) -> LoRARequest | None:
        match = VERSIONED.fullmatch(lora_name)
        if match is None:
            return None
        try:
            path = await asyncio.to_thread(self.fetch, base_model_name, match[1], int(match[2]))
        except EXPECTED as e:  # a refused root or file, the storage for now, the cache's disk (full)
            self.last_error = f"LoRA adapter {lora_name:.160}: {redact(str(e))}"  # VERSIONED took any newline
            log.warning("%s", self.last_error)
            return None
        self.resolved.append(lora_name)
        return LoRARequest(lora_name, 1, str(path), base_model_name=base_model_name)  # vLLM sets the id

    def fetch(self, base_model: str, lora_name: str, step: int) -> Path:
        """The folder holding step `step` of the root, verified, as the PEFT adapter `{lora_name}-v{step}`."""
        if not NAME.fullmatch(lora_name):
            raise Refused("not an adapter name (letters, digits, '.', '_' and '-', at most 128)")
        with self.lock:
            lora = self._served(self._run(), base_model, lora_name)
            try:
                applied = self.reader.sync(step)
            except SyncError as e:
                head = self.reader.head
                if head is not None and step > head.step:
                    raise Refused(f"step {step} is not in {self.where} yet (head {head.step})") from None
                raise Refused(str(e)) from None
            state = self.reader.state
            assert state is not None  # read by a successful sync
            name = adapter_name(lora_name, step)
            if self.cache is None:
                self.cache = Path(tempfile.mkdtemp(prefix="deltasync-lora-"))
            folder = self.cache / f"{name}-{format_fingerprint(self.reader.fingerprint)}"
            if not folder.is_dir():
                self._write(folder, state, lora["adapter_config"])
                self.written[folder] = None
            self._keep(folder)
            self._report([a for a in applied if a.step == step])
            log.info("LoRA adapter %s: step %d of %s, verified", name, step, self.where)
            return folder

    def _run(self) -> RunInfo:
        """The root's run.json, read once (the reader's: a sync checks its steps against it), as the reader's
        trust accepts it (with keys: signed by them)."""
        if self.reader.run is None:
            try:
                self.reader.run = self.reader.read_run()
            except FileNotFoundError:
                raise Refused(f"no run in {self.where} yet") from None
        return self.reader.run

    def _served(self, run: RunInfo, base_model: str, lora_name: str) -> dict:
        """`run`'s `lora` if it publishes the adapter `lora_name` of `base_model`, else Refused: why not."""
        if run.lora is None:
            raise Refused(f"{self.where} holds full weights of {run.model}, not a LoRA adapter")
        if run.lora["name"] != lora_name:
            raise Refused(f"{self.where} publishes the adapter {run.lora['name']!r:.140}, not {lora_name!r}")
        if run.model != base_model:
            raise Refused(f"{self.where} holds an adapter of {run.model}, not of {base_model}")
        return run.lora

    def _keep(self, folder: Path) -> None:
        """Mark `folder` used last; delete the folders this resolver wrote beyond the last `keep` used."""
        if folder in self.written:
            self.written.move_to_end(folder)
        while len(self.written) > self.keep:
            old, _ = self.written.popitem(last=False)
            shutil.rmtree(old, ignore_errors=True)

    def _report(self, applied: list[Applied]) -> None:
        """A replica record for the version resolved (none when the reader held it already: told before),
        so the root's telemetry lists the versions each replica holds."""
        if self.replica is None:
            return
        for a in applied:
            record = telemetry.ReplicaRecord(replica=self.replica, verified=True, **asdict(a))
            try:
                telemetry.write(self.reader.storage, record)
            except TransientStorageError as e:
                log.warning("telemetry of step %d lost: %s", a.step, e)

    def _write(self, folder: Path, state: dict, adapter_config: dict) -> None:
        """PEFT's format, written aside and renamed into place: vLLM never reads a half-written adapter."""
        staging = Path(tempfile.mkdtemp(prefix=".staging-", dir=self.cache))
        try:
            save_file(state, staging / "adapter_model.safetensors")
            (staging / "adapter_config.json").write_text(json.dumps(adapter_config, indent=1))
            staging.rename(folder)
        finally:
            shutil.rmtree(staging, ignore_errors=True)


def register_resolver(replica: str | None = None) -> None:
    """Register the resolver when the server's environment names a root (DELTASYNC_LORA_ROOT); `replica`: its
    name in the root's telemetry (None: it writes none)."""
    root = os.environ.get(ROOT_ENV)
    if not root or RESOLVER in LoRAResolverRegistry.get_supported_resolvers():  # loaded before
        return
    cache = os.environ.get(CACHE_ENV)
    if cache:
        Path(cache).mkdir(parents=True, exist_ok=True)
    keep = keep_setting(os.environ.get(KEEP_ENV))
    trust = trust_setting(os.environ.get(TRUSTED_KEYS_ENV))
    LoRAResolverRegistry.register_resolver(
        RESOLVER, DeltasyncLoRAResolver(root, Path(cache) if cache else None, replica, keep, trust)
    )
    log.info("LoRA adapters of %s, trusting %s", redact(root), trust)


def keep_setting(value: str | None) -> int:
    """DELTASYNC_LORA_KEEP as a number of folders (unset: KEEP); SystemExit with one line if it is none."""
    if not value:
        return KEEP
    try:
        keep = int(value)
    except ValueError:
        keep = 0
    if keep < 1:
        raise SystemExit(f"{KEEP_ENV}={value!r:.40}: not a whole number of adapter folders, at least 1")
    return keep


def trust_setting(value: str | None) -> Trust:
    """DELTASYNC_LORA_TRUSTED_KEYS as the resolver's Trust (unset: none); SystemExit with one line naming the
    item that is no public key."""
    try:
        return Trust(parse_keys(value or ""))
    except ValueError as e:
        raise SystemExit(f"{TRUSTED_KEYS_ENV}: {e}") from None
