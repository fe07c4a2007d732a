"""Checks before a trainer publishes anything: the sync root, the replicas and the environment answer, and
they all hold the same model.

    failure = preflight(root, schema_of(model), model_name, replica_urls, env_url)   # None when all is well
    failure = preflight(root, schema_of(peft_model, adapter=True), ..., lora_rank=16)  # adapter mode
    failure = preflight(root, schema, ..., quantization="fp8_per_channel")  # a quantized root

Read-only checks come first; the root's write check (one probe object, deleted again) comes last, so a run
that fails preflight leaves the root as it found it. `check_or_exit` prints the failure as one line and exits
with status 2.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
import uuid
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

import requests
import torch
import urllib3

from deltasync.codec.patch import schema_hash
from deltasync.errors import EXPECTED
from deltasync.storage import Storage, open_storage, redact
from deltasync.sync.protocol import HEAD_PATH, RUN_PATH, read_head, read_run
from deltasync.trl.checkpoint import checkpoint_converter
from deltasync.trl.transfer import adapter_tensors

log = logging.getLogger(__name__)
TOKEN_ENV = "INFERENCE_API_TOKEN"  # the replicas' bearer token, if they demand one (rollouts send it too)
TIMEOUT_S = 15.0  # for each whole request, however slowly its answer trickles in
MAX_ANSWER_BYTES = 1 << 20
PROBE_PREFIX = "preflight-"


def schema_of(model: torch.nn.Module, adapter: bool = False) -> dict[str, list[int]]:
    """The tensors a BucketWeightTransfer publishes for `model` and their shapes: what the sync root's
    run.json records. They are the parameters TRL's AsyncGRPOTrainer sends (trainable ones, tied weights
    once), under their checkpoint names (`deltasync.trl.checkpoint`: MoE experts one tensor per expert), or
    with `adapter` (adapter mode) a PEFT model's adapter tensors."""
    if adapter:
        return {name: list(t.shape) for name, t in adapter_tensors(model)}
    sent = [
        (name.removeprefix("module.").replace("_checkpoint_wrapped_module.", ""), p.to("meta"))
        for name, p in model.named_parameters()
        if p.requires_grad
    ]
    convert = checkpoint_converter(model)
    return {name: list(t.shape) for name, t in (convert(sent) if convert else sent)}


def preflight(
    root: str | Path | Storage,
    schema: Mapping[str, Sequence[int]],
    model_name: str,
    replica_urls: Iterable[str] = (),
    env_url: str | None = None,
    lora_rank: int = 0,
    quantization: str | None = None,
) -> str | None:
    """None if training may start, else one line naming what failed and where. `lora_rank`: the adapter's
    rank in adapter mode (0: full weights), which a replica that reports its LoRA settings must serve.
    `quantization`: the recipe of a quantized root (the trainer's --quantization; None: bf16), which the
    root's run and every replica that reports what it serves must share."""
    storage = root if isinstance(root, Storage) else open_storage(root)
    where = redact(storage.url)
    try:
        storage.probe()
        stored = storage.sizes([RUN_PATH, HEAD_PATH])
    except EXPECTED as e:
        return f"sync root {where} cannot be read: {_reason(e)}"
    if stored[RUN_PATH] is not None:
        try:
            run = read_run(storage)
        except EXPECTED as e:
            return f"sync root {where}: {RUN_PATH} cannot be read: {_reason(e)}"
        if (run.lora is not None) != bool(lora_rank):
            return f"sync root {where} {_other_mode(run.lora is not None, run.model)}"
        if run.quantization != quantization:
            return (
                f"sync root {where} holds a run of {run.model} as {_served(run.quantization)}, and this run "
                f"publishes {_served(quantization)}: publish to another root (or prefix), or train "
                f"{_trainer_flag(run.quantization)}"
            )
        mismatch = _schema_mismatch(run.schema, schema)
        if mismatch:
            return f"sync root {where} holds a run of another model ({run.model}): {mismatch}"
        if stored[HEAD_PATH] is not None:
            try:
                read_head(storage)  # the publisher says it continues the run, once it opens the root
            except EXPECTED as e:
                return f"sync root {where}: {HEAD_PATH} cannot be read: {_reason(e)}"
    for url in replica_urls:
        problem = _check_replica(url.rstrip("/"), model_name, schema, lora_rank, quantization)
        if problem:
            return problem
    if env_url:
        problem = _get(f"{env_url.rstrip('/')}/health", "environment")[1]
        if problem:
            return problem
    probe = f"{PROBE_PREFIX}{uuid.uuid4().hex}.json"
    try:
        storage.write_bytes(probe, b"{}")
    except EXPECTED as e:
        return f"sync root {where} is not writable: {_reason(e)}"
    try:
        storage.delete([probe])
    except EXPECTED as e:
        return f"sync root {where}: could not delete the write check {probe}: {_reason(e)}"
    return None


def check_or_exit(*args, **kwargs) -> None:
    """`preflight(...)`; on a failure, print it as one line to stderr and exit with status 2."""
    failure = preflight(*args, **kwargs)
    if failure:
        print(f"preflight failed: {failure}", file=sys.stderr, flush=True)
        raise SystemExit(2)


def _check_replica(
    url: str,
    model_name: str,
    schema: Mapping[str, Sequence[int]],
    lora_rank: int,
    quantization: str | None,
) -> str | None:
    """The replica answers, serves `model_name` and, if it reports its sync status (`/weights`, as the
    project's inference Space does), the same parameters, in the same mode (vLLM's `lora_config`: None, or
    its max_lora_rank at least the adapter's) and quantized by the same recipe (`quantization`: None, bf16);
    logs its weight version."""
    body, problem = _get(f"{url}/v1/models", "inference server")
    if problem:
        return problem
    models = body.get("data") if isinstance(body, dict) else None
    if not isinstance(models, list):
        return f"inference server {redact(url)}/v1/models lists no models: {str(body)[:80]}"
    served = [m.get("id") for m in models if isinstance(m, dict)]
    if model_name not in served:
        return (
            f"inference server {redact(url)} serves {served}, not {model_name} (names must match exactly: "
            f"start it with --served-model-name {model_name})"
        )
    status, problem = _get(f"{url}/weights", "inference server", optional=True)
    if problem:
        return problem
    if isinstance(status, dict):
        problem = _mode_mismatch(status["lora_config"], lora_rank) if "lora_config" in status else None
        if problem:
            return f"inference server {redact(url)} {problem}"
        problem = _recipe_mismatch(status["quantization"], quantization) if "quantization" in status else None
        if problem:
            return f"inference server {redact(url)} {problem}"
        reported = status.get("schema_hash")
        if reported is not None and reported != schema_hash(schema):
            return (
                f"inference server {redact(url)} holds other parameters than the trainer "
                f"(schema {reported}, the trainer's {schema_hash(schema)})"
            )
        version = status.get("weight_version")
        log.info("replica %s: model %s, weight version %s", redact(url), status.get("model"), version)
    else:  # a stock vLLM server: its weights are whatever it loaded
        log.info("replica %s: serves %s (no sync status)", redact(url), model_name)
    return None


def _get(url: str, what: str, optional: bool = False) -> tuple[object, str | None]:
    token = os.environ.get(TOKEN_ENV) if what == "inference server" else None
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    deadline = time.monotonic() + TIMEOUT_S
    body = bytearray()
    try:
        with requests.get(url, headers=headers, timeout=TIMEOUT_S, stream=True) as r:
            if optional and r.status_code == 404:
                return None, None
            if not r.ok:
                return None, f"{what} {redact(url)} answers HTTP {r.status_code}"
            # read1: whatever has arrived (a read that waits for a whole chunk would never end on an answer
            # that trickles in); each read waits up to TIMEOUT_S, the whole at most one read longer
            while chunk := r.raw.read1(1 << 16, decode_content=True):
                body += chunk
                if time.monotonic() > deadline:
                    return None, f"{what} {redact(url)} does not answer within {TIMEOUT_S:g} s"
                if len(body) > MAX_ANSWER_BYTES:
                    return None, f"{what} {redact(url)} answers more than {MAX_ANSWER_BYTES} bytes"
    except (requests.RequestException, urllib3.exceptions.HTTPError) as e:
        return None, f"{what} {redact(url)} does not answer: {type(e).__name__}"
    try:
        return json.loads(body), None
    except (ValueError, RecursionError):  # RecursionError: JSON nested deeper than Python's stack
        return None, None if what == "environment" else f"{what} {redact(url)} answers no JSON it can read"


def _other_mode(lora_root: bool, model: str) -> str:
    """What to do about a root holding a run in the other mode (full weights or a LoRA adapter)."""
    if lora_root:
        return (
            f"holds a LoRA run (an adapter of {model}), and this run trains full weights: publish to another "
            "root (or prefix), or train the adapter (--lora_r)"
        )
    return (
        f"holds a full-weight run (of {model}), and this run trains a LoRA adapter: publish to another root "
        "(or prefix), or train full weights (without --lora_r)"
    )


def _schema_mismatch(stored: Mapping[str, Sequence[int]], ours: Mapping[str, Sequence[int]]) -> str | None:
    for name, shape in ours.items():
        if name not in stored:
            return f"it has no parameter {name}"
        if list(stored[name]) != list(shape):
            return f"{name} has shape {list(stored[name])} there, {list(shape)} here"
    extra = next((name for name in stored if name not in ours), None)
    return f"the model here has no parameter {extra}" if extra else None


def _mode_mismatch(lora_config: object, lora_rank: int) -> str | None:
    """Why a replica with these LoRA settings (vLLM's `lora_config`) cannot serve the trainer, if so."""
    if lora_config is None:
        return "serves full weights, not a LoRA adapter (a Space: set MAX_LORA_RANK)" if lora_rank else None
    if not lora_rank:
        return "serves LoRA adapters, not full weights (a Space: unset MAX_LORA_RANK)"
    served = lora_config.get("max_lora_rank", 0) if isinstance(lora_config, dict) else 0
    if not isinstance(served, int) or isinstance(served, bool):
        return f"reports max_lora_rank {str(served)[:40]!r}, not a number"
    if served < lora_rank:
        return (
            f"serves LoRA adapters up to rank {served}, below the trainer's {lora_rank} (raise MAX_LORA_RANK)"
        )
    return None


def _recipe_mismatch(served: object, quantization: str | None) -> str | None:
    """Why a replica serving `served` (its status's `quantization`: a recipe, None for bf16) cannot follow a
    trainer publishing `quantization`, and which flag to change, if so."""
    if served is not None and not isinstance(served, str):
        return f"reports quantization {str(served)[:40]!r}, not a recipe name"
    if served == quantization:
        return None
    space = f"with QUANTIZATION={quantization}" if quantization else "without QUANTIZATION"
    cli = f"--quantization {quantization}" if quantization else "without --quantization"
    return (
        f"serves {_served(served)}, the trainer publishes {_served(quantization)}: train "
        f"{_trainer_flag(served)}, or restart the replica {space} (a Space; deltasync follow and vLLM: {cli})"
    )


def _served(quantization: str | None) -> str:
    return f"weights quantized {quantization}" if quantization else "bf16 weights"


def _trainer_flag(quantization: str | None) -> str:
    """The trainer's flag that publishes `quantization` (None: bf16)."""
    return f"with --quantization {quantization}" if quantization else "without --quantization"


def _reason(e: BaseException) -> str:
    return redact(str(e).splitlines()[0] if str(e) else type(e).__name__)
