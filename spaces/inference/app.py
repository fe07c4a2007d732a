"""Inference Space: vLLM's own OpenAI-compatible server, whose weights follow a deltasync root in place.

The weights are written by the `deltasync` weight-transfer backend (`deltasync.vllm.engine`), driven in this
process through the engine client's public weight-update methods by the same follower as `deltasync follow`
(`deltasync.vllm.follower`): one write path for this app and for any vLLM server.

    python spaces/inference/app.py        (or `python app.py` inside the Space bundle)

Configuration, from the environment:
    MODEL              HF id or local folder: the weights at the run's first anchor (required)
    SYNC_ROOT          local folder or hf://buckets/<namespace>/<name>[/prefix] (required)
    HOST, PORT         where to listen: 0.0.0.0 in a Space (SPACE_ID set), else 127.0.0.1; 7860
    API_TOKEN          bearer token for /v1/* and /inference/*, and the front page's password (unset: open)
    HF_TOKEN           read by huggingface_hub for the model and the bucket; this app never logs it
    REPLICA_ID         this replica's name in telemetry (default: stable per Space, else per host)
    SERVED_MODEL_NAME  comma-separated names clients may send as "model" (default: MODEL)
    POLL_S             seconds between polls of the head (1.0)
    POLL_BUDGET        Hub requests per 5-minute window polling may spend without the change feed (1000)
    VERIFY_EVERY       read the weights back from vLLM every N deltas to compare fingerprints (10)
    MAX_REQUEST_BYTES  largest request body accepted (4 MiB)
    KV_ON_UPDATE       "keep" (default): running requests keep their KV cache across an update; "recompute":
                       they are preempted and recompute their context on the new weights
    ENGINE_ARGS        more `vllm serve` flags, e.g. "--max-model-len 4096 --gpu-memory-utilization 0.85"
    MAX_LORA_RANK      serve a LoRA root, of adapters up to this rank, even before its trainer has written
                       run.json (unset or 0: a LoRA root if run.json says so when the Space starts)
    QUANTIZATION       serve a quantized root (vLLM's --quantization: fp8_per_channel or
                       int8_per_channel_weight_only) even before its trainer has written run.json (unset: the
                       recipe run.json names when the Space starts, else bf16); one that differs from
                       run.json's stops the Space in one line
    TRUSTED_KEYS       the trainer's public keys (`deltasync keygen`'s `ed25519:...` lines, or .pub files,
                       comma-separated): only run.json and steps they signed are served (a LoRA root's
                       versions too); an unsigned or another key's run.json stops the Space in one line
                       (unset: whoever can write SYNC_ROOT is trusted); /weights says which (`trust`)

A LoRA root (MAX_LORA_RANK set, or its run.json says so when the Space starts: a trainer in adapter mode
published to it) is served differently: vLLM runs with LoRA on (--max-lora-rank from MAX_LORA_RANK or the
adapter's r, --max-loras 6) and no follower; the `deltasync` LoRA resolver (`deltasync.vllm.lora`) fetches
and verifies each version `{lora_name}-v{N}` the first time a request names it, and tells it in the root's
telemetry as this replica's; GET /weights lists the adapters resolved. A version not published yet answers
404. LoRA is a setting of vLLM's engine, fixed when it starts: a Space started before its trainer (the demo)
needs MAX_LORA_RANK.

On CPU, unless VLLM_CPU_KVCACHE_SPACE or --kv-cache-memory-bytes says otherwise, the KV cache gets half the
memory left beside the weights, at most room for 4 sequences of --max-model-len (`cpu_kv_cache_bytes`).
SIGTERM and SIGINT stop the server and vLLM's engine processes.

Public routes: /health (vLLM's, saying "rate limited until T" while the Hub refuses this replica), /version,
/v1/models, /v1/completions, /v1/chat/completions, /inference/v1/generate
(vLLM's token-in/token-out API: its choices carry exact `weight_versions` spans), GET /weights (sync status,
with `write_paths`: how many tensors each write path takes, and which ones go other than directly) and the
Gradio page at /. vLLM's other routes (admin, dev, scaling, metrics, docs) answer 404. Completions
carry `x-weight-version` (the version when the request arrived) and, unless streamed, `x-weight-version-end`
(when it was complete): the versions that produced it lie in between.
Each generation request is salted with the weight version current when it arrives (vLLM's `cache_salt`), so no
request reuses prefix-cache blocks computed by other weights.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import hmac
import json
import logging
import os
import re
import shlex
import signal
import socket
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict
from typing import Annotated, get_args

import gradio as gr
import psutil
import torch
import uvicorn
from fastapi import Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import REGISTRY
from pydantic import AfterValidator, Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict
from transformers import AutoConfig, AutoModelForCausalLM
from vllm import SamplingParams
from vllm.config.lora import MaxLoRARanks
from vllm.lora.resolver import LoRAResolverRegistry
from vllm.platforms import current_platform

from appkit.asgi import BodyLimit
from appkit.settings import from_env
from deltasync.codec.patch import schema_hash
from deltasync.errors import ManifestError
from deltasync.quant.recipe import recipe
from deltasync.storage import POLL_BUDGET, open_storage, rate_limited_line, redact
from deltasync.sync.protocol import RUN_PATH, RunInfo, read_manifest
from deltasync.sync.signing import Trust, parse_keys
from deltasync.sync.subscriber import Subscriber
from deltasync.vllm import compat
from deltasync.vllm.follower import (
    AsyncEngine,
    EngineApplier,
    KvPolicy,
    log_applied,
    path_summary,
)
from deltasync.vllm.headers import WeightVersionHeaders
from deltasync.vllm.lora import RESOLVER, ROOT_ENV, TRUSTED_KEYS_ENV, DeltasyncLoRAResolver, register_resolver

log = logging.getLogger("deltasync.inference")
LORA_RANKS: tuple[int, ...] = get_args(MaxLoRARanks)  # the --max-lora-rank values vLLM accepts
GENERATION_ROUTES = ("/v1/completions", "/v1/chat/completions", "/inference/v1/generate")
PUBLIC_ROUTES = {
    "/health",
    "/version",
    "/v1/models",
    "/v1/completions",
    "/v1/chat/completions",
    "/inference/v1/generate",
}


class Settings(BaseSettings):
    """The Space's configuration, from the environment variables of the same names in upper case."""

    model_config = SettingsConfigDict(frozen=True)

    model: str
    sync_root: str
    space_id: str = ""  # set by the Hub in a Space
    # A Space is reached through the Hub's proxy; anywhere else, listening on every interface would open an
    # endpoint without a token to the network unasked.
    host: str = Field(default_factory=lambda data: "0.0.0.0" if data["space_id"] else "127.0.0.1")
    port: int = 7860
    api_token: SecretStr | None = None
    replica_id: str = Field(default_factory=lambda data: default_replica_id(data["space_id"]))
    served_model_name: str = ""
    poll_s: float = 1.0
    poll_budget: int = POLL_BUDGET
    verify_every: int = 10
    max_request_bytes: int = 4 << 20
    kv_on_update: KvPolicy = "keep"
    engine_args: str = ""
    # > 0: serve a LoRA root, whatever run.json says (or does not yet) at start
    max_lora_rank: int = Field(0, ge=0, le=max(LORA_RANKS))
    # a quantized root's recipe, whatever run.json says (or does not yet) at start; "": run.json's
    quantization: Annotated[str, AfterValidator(lambda name: name and recipe(name).name)] = ""  # one line
    # the trainer's public keys, as lines (a .pub file read once here); "": whoever can write the bucket
    trusted_keys: Annotated[str, AfterValidator(lambda text: ",".join(parse_keys(text)))] = ""

    @property
    def trust(self) -> Trust:
        return Trust(self.trusted_keys.split(",") if self.trusted_keys else ())

    @property
    def served_names(self) -> list[str]:
        return [n.strip() for n in self.served_model_name.split(",") if n.strip()] or [self.model]

    @property
    def token(self) -> str | None:
        return self.api_token.get_secret_value() if self.api_token else None


def default_replica_id(space_id: str) -> str:
    """Stable across restarts: derived from the Space id, else the host name."""
    origin = space_id or socket.gethostname()
    readable = re.sub(r"[^A-Za-z0-9._-]+", "-", origin).strip("-._")[:40] or "replica"
    return f"{readable}-{hashlib.blake2b(origin.encode(), digest_size=4).hexdigest()}"


def sync_status(cfg: Settings, subscriber: Subscriber, applier: EngineApplier, in_flight: InFlight) -> dict:
    """What GET /weights and the front page report."""
    head, step, now = subscriber.head, subscriber.step, time.time()
    recent = list(subscriber.history)[-20:]
    waiting = [e.published_at for e in (head.entries if head else ()) if step is None or e.step > step]
    return {
        "replica": cfg.replica_id,
        "model": cfg.model,
        "step": step,
        "anchor": applier.anchor_step,
        "head_step": head.step if head else None,
        "lag_steps": head.step - step if head and step is not None else None,
        # behind: how long the oldest step not applied yet has waited; else publish-to-apply of this step
        "lag_s": now - min(waiting) if waiting else (recent[-1].lag_s if recent else None),
        "applied_at": recent[-1].applied_at if recent else None,
        "weight_version": applier.version,
        "schema_hash": schema_hash(subscriber.run.schema) if subscriber.run else None,  # checked by preflight
        "lora_config": None,  # full weights (a LoRA trainer's preflight refuses this replica)
        "quantization": applier.quantization,  # the recipe vLLM serves (None: bf16)
        "trust": str(subscriber.trust),  # who may say which weights it serves: keys, or the bucket
        "paused_until_anchor": applier.stuck,
        "last_error": subscriber.last_error,
        "rate_limited_until": subscriber.storage.rate_limited_until,  # the Hub refuses requests until then
        "readback": applier.readback,
        "last_write": applier.last_write,
        # how the workers write each tensor: in place ("direct", MoE experts "packed") or by vLLM's loader
        "write_paths": path_summary(applier.paths),
        "requests_in_flight": in_flight.count,
        "preemptions": preemptions(),
        "recent": [{**asdict(a), "lag_s": a.lag_s} for a in recent],
    }


def preemptions() -> int:
    """Requests vLLM has preempted since it started (its Prometheus counter, read in this process)."""
    return int(
        sum(
            sample.value
            for metric in REGISTRY.collect()
            if metric.name == "vllm:num_preemptions"
            for sample in metric.samples
            if sample.name.endswith("_total")
        )
    )


class InFlight:
    """Counts the generation requests being answered (from their arrival to the end of their response)."""

    def __init__(self, app):
        self.app, self.count = app, 0

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] not in GENERATION_ROUTES:
            return await self.app(scope, receive, send)
        self.count += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.count -= 1


class VersionSalt:
    """Sets each generation request's `cache_salt` to the weight version current when it arrives (with the
    client's own salt kept inside it), so requests never share prefix-cache blocks across versions."""

    def __init__(self, app, version: Callable[[], str]):
        self.app, self.version = app, version

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] != "POST" or scope["path"] not in GENERATION_ROUTES:
            return await self.app(scope, receive, send)
        chunks, more = [], True
        while more:  # the whole body: BodyLimit bounds it
            message = await receive()
            if message["type"] != "http.request":
                return await self.app(scope, _replay([message], receive), send)
            chunks.append(message.get("body", b""))
            more = message.get("more_body", False)
        body = b"".join(chunks)
        try:
            request = json.loads(body)
        except ValueError:
            request = None  # vLLM answers it with its own error
        except RecursionError:  # nested deeper than Python's stack: vLLM's parser would fail the same way
            return await bad_request("the request body's JSON is nested too deeply")(scope, receive, send)
        if isinstance(request, dict):
            request["cache_salt"] = version_salt(self.version(), request.get("cache_salt"))
            body = json.dumps(request).encode()
            scope = {**scope, "headers": _with_length(scope["headers"], len(body))}
        replayed = _replay([{"type": "http.request", "body": body, "more_body": False}], receive)
        await self.app(scope, replayed, send)


def bad_request(message: str) -> JSONResponse:
    """A 400 in the shape of vLLM's own errors."""
    error = {"message": message, "type": "BadRequestError", "param": None, "code": 400}
    return JSONResponse({"error": error}, status_code=400)


def version_salt(version: str, salt: object) -> str:
    """A valid vLLM cache salt for `version` and the client's `salt` (which vLLM checks as usual if it is
    not a string)."""
    if salt is None:
        return f"deltasync-{version}"
    client = salt if isinstance(salt, str) else json.dumps(salt)
    return f"deltasync-{version}-{hashlib.blake2b(client.encode(), digest_size=16).hexdigest()}"


def _with_length(headers: list[tuple[bytes, bytes]], length: int) -> list[tuple[bytes, bytes]]:
    return [(k, v) for k, v in headers if k.lower() != b"content-length"] + [
        (b"content-length", str(length).encode())
    ]


def _replay(messages: list[dict], receive):
    """`messages` first, then the client's own (its disconnect, which streaming responses wait for)."""
    pending = list(messages)

    async def replayed():
        return pending.pop(0) if pending else await receive()

    return replayed


def front_page(cfg: Settings, engine, status: Callable[[], dict]) -> gr.Blocks:
    """Gradio page: sync status, recent apply timings, a small greedy completion box."""

    def refresh():
        s = status()
        lag_s = "-" if s["lag_s"] is None else f"{s['lag_s']:.1f} s"
        summary = (
            f"**step** {s['step']} (anchor {s['anchor']}) · **head** {s['head_step']} · "
            f"**lag** {s['lag_steps']} steps, {lag_s} · **weight version** {s['weight_version']}"
        ) + (f" · **quantized** {s['quantization']}" if s.get("quantization") else "")
        summary += f" · **trusts** {s['trust']}"
        rows = [
            [a["step"], a["kind"], a["changed"], a["payload_bytes"], round(a["download_s"], 3)]
            + [round(1e3 * a["apply_s"], 1), round(1e3 * (a["pause_s"] or 0), 1), round(a["lag_s"], 2)]
            for a in reversed(s["recent"])
        ]
        return summary, s["last_error"] or "", rows

    async def complete(prompt: str, max_tokens: float):
        if not prompt.strip():
            return "", ""
        params = SamplingParams(max_tokens=min(max(int(max_tokens), 1), 256), temperature=0.0)
        request = {"prompt": prompt[:4000], "cache_salt": version_salt(status()["weight_version"], None)}
        final = None
        async for out in engine.generate(request, params, request_id=f"ui-{uuid.uuid4().hex}"):
            final = out
        choice = final.outputs[0]
        spans = ", ".join(f"{v.version}: tokens {v.start}-{v.end}" for v in choice.weight_versions or [])
        return choice.text, spans

    with gr.Blocks(title="deltasync inference") as page:
        gr.Markdown(f"# {cfg.model}\nvLLM replica `{cfg.replica_id}`, patched in place at each verified step")
        summary = gr.Markdown()
        error = gr.Textbox(label="last error", max_lines=3)
        headers = ["step", "kind", "changed", "bytes", "download s", "apply ms", "paused ms", "lag s"]
        table = gr.Dataframe(headers=headers, label="recent steps")
        with gr.Row():
            prompt = gr.Textbox(label="prompt", lines=3, max_length=4000)
            max_tokens = gr.Slider(1, 256, value=48, step=1, label="max tokens")
        button = gr.Button("complete (greedy)")
        output = gr.Textbox(label="completion")
        versions = gr.Textbox(label="weight versions that produced it")
        button.click(complete, [prompt, max_tokens], [output, versions], concurrency_limit=4)
        gr.Timer(2.0).tick(refresh, outputs=[summary, error, table], api_visibility="private")
        page.load(refresh, outputs=[summary, error, table], api_visibility="private")
    return page


def health_route(vllm_health, rate_limited_until: Callable[[], float | None]):
    """vLLM's /health, which also says when the Hub rate-limits this replica. Still 200 then: the replica
    serves its last verified step, and the quota is per user, so every replica of a run is limited at once;
    a 503 would make a load balancer or the Space's health check drop them all, an outage instead of stale
    weights. The line is in the body, the time (unix s) in a header; 503 still means vLLM's engine is dead."""

    async def health(request: Request) -> Response:
        response = await vllm_health(request)
        until = rate_limited_until()
        if until is None:
            return response
        headers = {RATE_LIMIT_HEADER: f"{until:.0f}"}
        return PlainTextResponse(rate_limited_line(until) + "\n", response.status_code, headers=headers)

    return health


RATE_LIMIT_HEADER = "x-rate-limited-until"


async def public_app(
    cfg: Settings,
    args,
    engine,
    status: Callable[[], dict],
    version: Callable[[], str],
    in_flight: InFlight,
    rate_limited_until: Callable[[], float | None],
):
    app = await compat.openai_app(engine, args)
    vllm_health = next(r.endpoint for r in app.router.routes if getattr(r, "path", None) == "/health")
    # vLLM also registers maintenance and scaling routes (abort, elastic EP, metrics, render, docs): keep only
    # the public API, so anything else falls through to Gradio's 404.
    kept = PUBLIC_ROUTES - {"/health"}  # ours, below
    app.router.routes = [r for r in app.router.routes if getattr(r, "path", None) in kept]
    app.add_api_route("/health", health_route(vllm_health, rate_limited_until), methods=["GET"])
    app.add_api_route("/weights", status, methods=["GET"])
    token = cfg.token
    auth = (lambda user, password: hmac.compare_digest(password.encode(), token.encode())) if token else None
    no_docs = {"docs_url": None, "redoc_url": None, "openapi_url": None}
    app = gr.mount_gradio_app(app, front_page(cfg, engine, status), path="/", auth=auth, app_kwargs=no_docs)
    # Outside the app: vLLM's app has already built its middleware stack.
    in_flight.app = VersionSalt(WeightVersionHeaders(app, version), version)
    return BodyLimit(in_flight, cfg.max_request_bytes)


def server_args(cfg: Settings, lora: dict | None = None, quantization: str | None = None):
    """vLLM's arguments; `lora`: the root's `RunInfo.lora` (a LoRA root), which turns LoRA serving on;
    `quantization`: the recipe of a quantized root (`quantization_of`)."""
    argv = ["--model", cfg.model, "--dtype", "bfloat16", "--served-model-name", *cfg.served_names]
    if quantization:
        argv += ["--quantization", quantization]
    if lora is not None:  # room for the versions rollouts may still name (TRL's max_staleness 4, plus 1)
        rank = served_rank(cfg.max_lora_rank, lora_rank(lora))
        argv += ["--enable-lora", "--max-lora-rank", str(rank), "--max-loras", str(MAX_LORAS)]
    argv += ["--weight-transfer-config", json.dumps({"backend": "deltasync"}), "--disable-fastapi-docs"]
    argv += ["--enable-scale-out"]  # for /inference/v1/generate; the other scale-out routes are dropped
    if current_platform.is_cpu():  # vLLM 0.32's CPU engine crashes on a seeded request (TRL seeds them all)
        argv += ["--no-enable-chunked-prefill"]  # whose prefill is split across steps; ENGINE_ARGS may undo
    args = compat.parse_server_args([*argv, *shlex.split(cfg.engine_args)])
    args.api_key = [cfg.token] if cfg.token else None  # vLLM's own bearer check, kept out of argv
    if current_platform.is_cpu() and args.kv_cache_memory_bytes is None and not os.environ.get(KV_ENV):
        args.kv_cache_memory_bytes = cpu_kv_cache_bytes(args, psutil.virtual_memory().available)
    return args


KV_ENV = "VLLM_CPU_KVCACHE_SPACE"
MAX_LORAS = 6
ENGINE_HEADROOM = 2 << 30  # the engine's processes and activations, beside the weights and the KV cache
KV_SEQUENCES = 4  # the KV cache need not hold more than this many sequences of max-model-len


def cpu_kv_cache_bytes(args, available: int) -> int:
    """vLLM's CPU engine otherwise wants --gpu-memory-utilization (0.92) of the machine's memory free at
    start-up. Half the memory left beside the weights and the engine, at least one sequence of
    max-model-len, at most KV_SEQUENCES of them; SystemExit with one line when not even one fits."""
    config = AutoConfig.from_pretrained(args.model, trust_remote_code=args.trust_remote_code)
    text = config.get_text_config()
    with torch.device("meta"):
        weights = 2 * sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    max_len = args.max_model_len or text.max_position_embeddings
    one = 2 * text.num_hidden_layers * kv_heads * head_dim * 2 * max_len  # K and V, bf16
    left = available - weights - ENGINE_HEADROOM
    if left < one:
        gib = 1 << 30
        raise SystemExit(
            f"not enough memory for {args.model}: {available / gib:.1f} GiB available, the weights need "
            f"{weights / gib:.1f} GiB, the engine ~{ENGINE_HEADROOM / gib:.0f} GiB and one {max_len}-token "
            f"sequence's KV cache {one / gib:.1f} GiB; lower --max-model-len in ENGINE_ARGS or free memory"
        )
    return max(one, min(left // 2, KV_SEQUENCES * one))


def lora_of(cfg: Settings) -> dict | None:
    """How to serve the root: its `RunInfo.lora` if it is a LoRA root, {} for one MAX_LORA_RANK announces
    before its run.json exists, None for full weights. Started before its trainer, a Space cannot wait for
    run.json to choose: LoRA is a setting of vLLM's engine, fixed when it starts. SystemExit (one line) when
    run.json contradicts MAX_LORA_RANK."""
    try:
        run = run_of(cfg)
    except FileNotFoundError:
        return {} if cfg.max_lora_rank else None
    where = redact(cfg.sync_root)
    if run.lora is not None:
        served_rank(
            cfg.max_lora_rank, lora_rank(run.lora, where), where
        )  # one line now if vLLM cannot serve it
    if cfg.max_lora_rank and run.lora is None:
        raise SystemExit(
            f"MAX_LORA_RANK is set, but {where} holds full weights of {run.model}, not an adapter"
        )
    if run.lora is not None and cfg.max_lora_rank and lora_rank(run.lora) > cfg.max_lora_rank:
        raise SystemExit(
            f"{where} holds an adapter of rank {lora_rank(run.lora)}, above MAX_LORA_RANK {cfg.max_lora_rank}"
        )
    return run.lora


def quantization_of(cfg: Settings) -> str | None:
    """The recipe vLLM serves (--quantization) and the follower follows: run.json's, or QUANTIZATION before
    run.json exists (vLLM quantizes at load, so a Space started before its trainer cannot wait); None: bf16.
    SystemExit (one line) when QUANTIZATION differs from run.json's or is asked of a LoRA root."""
    if cfg.quantization and cfg.max_lora_rank:
        raise SystemExit("QUANTIZATION and MAX_LORA_RANK are both set: a LoRA root is never quantized")
    try:
        run = run_of(cfg)
    except FileNotFoundError:
        return cfg.quantization or None
    if cfg.quantization and cfg.quantization != run.quantization:
        raise SystemExit(
            f"QUANTIZATION is {cfg.quantization}, but {redact(cfg.sync_root)} holds weights of {run.model} "
            f"quantized {run.quantization or 'not at all (bf16)'}: unset QUANTIZATION or set it to that"
        )
    return run.quantization


def run_of(cfg: Settings) -> RunInfo:
    """The root's run.json as TRUSTED_KEYS accept it (any, without keys); FileNotFoundError before there is
    one. SystemExit (one line) for one they refuse, or a malformed one: run.json decides how vLLM starts,
    and the Space serves nothing it cannot trust."""
    try:
        return cfg.trust.run(read_manifest(open_storage(cfg.sync_root), RUN_PATH))
    except ManifestError as e:
        raise SystemExit(f"refused {redact(cfg.sync_root)}: {e}") from None


def subscriber_of(cfg: Settings, applier: EngineApplier) -> Subscriber:
    """The follower's subscriber of SYNC_ROOT into `applier`, trusting TRUSTED_KEYS."""
    storage = open_storage(cfg.sync_root, poll_budget=cfg.poll_budget)
    return Subscriber(
        storage, applier, replica=cfg.replica_id, verify_every=cfg.verify_every, trust=cfg.trust
    )


def lora_rank(lora: dict, where: str = "the root") -> int:
    """The rank of a LoRA root's adapter ({}: MAX_LORA_RANK's root, not written yet, counts as 0); SystemExit
    with one line when its adapter_config holds no rank."""
    rank = lora.get("adapter_config", {}).get("r", 0)
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 0:
        raise SystemExit(
            f"{where} holds an adapter whose adapter_config says r {str(rank)[:40]!r}: not a rank"
        )
    return rank


def served_rank(max_lora_rank: int, rank: int, where: str = "the root") -> int:
    """vLLM's --max-lora-rank for an adapter of `rank` and MAX_LORA_RANK (at most LORA_RANKS' largest): the
    least vLLM offers that holds both; SystemExit with one line when the adapter's is above them all."""
    if rank > max(LORA_RANKS):
        raise SystemExit(
            f"{where} holds an adapter of rank {rank}, above the largest vLLM serves ({max(LORA_RANKS)})"
        )
    return min(r for r in LORA_RANKS if r >= max(max_lora_rank, rank))


def lora_status(cfg: Settings, resolver: DeltasyncLoRAResolver, in_flight: InFlight, args) -> dict:
    """GET /weights for a LoRA root: each request names its adapter version, resolved when first named."""
    head, run = resolver.reader.head, resolver.reader.run
    return {
        "replica": cfg.replica_id,
        "model": cfg.model,
        "step": resolver.reader.step,  # the adapter version resolved last
        "anchor": None,
        "head_step": head.step if head else None,
        "lag_steps": None,
        "lag_s": None,
        "weight_version": "model",  # the base model's: an adapter's version is its name
        "schema_hash": schema_hash(run.schema) if run else None,
        "lora_config": {"max_lora_rank": args.max_lora_rank, "max_loras": args.max_loras},  # vLLM's names
        "trust": str(resolver.reader.trust),
        "adapters": resolver.resolved,
        "last_error": resolver.last_error,
        "requests_in_flight": in_flight.count,
        "preemptions": preemptions(),
        "recent": [],
    }


async def serve_adapters(cfg: Settings, engine, args, sock: socket.socket) -> None:
    """Serve a LoRA root: no follower, the `deltasync` LoRA resolver fetches each version a request names."""
    resolver = LoRAResolverRegistry.get_resolver(RESOLVER)
    assert isinstance(resolver, DeltasyncLoRAResolver)  # registered by serve()
    in_flight = InFlight(None)
    status = functools.partial(lora_status, cfg, resolver, in_flight, args)
    limited = lambda: resolver.reader.storage.rate_limited_until  # noqa: E731
    app = await public_app(cfg, args, engine, status, lambda: "model", in_flight, limited)
    await uvicorn.Server(uvicorn.Config(app)).serve(sockets=[sock])


async def serve(cfg: Settings) -> None:
    lora = lora_of(cfg)
    if lora is not None:  # read by vLLM's serving layer and our plugin (deltasync.vllm.lora)
        os.environ.update(
            {
                ROOT_ENV: cfg.sync_root,
                TRUSTED_KEYS_ENV: cfg.trusted_keys,
                "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1",
            }
        )
        register_resolver(cfg.replica_id)
    quantization = quantization_of(cfg)
    args = server_args(cfg, lora, quantization)
    # The public port is bound before the engine starts: a port chosen free cannot go to vLLM's internal ones.
    sock = socket.create_server((cfg.host, cfg.port), reuse_port=False)
    async with compat.engine_client(args) as engine:
        if lora is not None:
            return await serve_adapters(cfg, engine, args, sock)
        loop = asyncio.get_running_loop()
        in_flight = InFlight(None)
        applier = await asyncio.to_thread(
            EngineApplier,
            AsyncEngine(engine, loop),
            cfg.sync_root,
            kv_on_update=cfg.kv_on_update,
            in_flight=lambda: in_flight.count,
            quantization=quantization,
        )
        await engine.update_weight_version(applier.version)
        subscriber = subscriber_of(cfg, applier)
        log.info("following %s, trusting %s", redact(cfg.sync_root), subscriber.trust)
        app = await public_app(
            cfg,
            args,
            engine,
            lambda: sync_status(cfg, subscriber, applier, in_flight),
            lambda: applier.version,
            in_flight,
            lambda: subscriber.storage.rate_limited_until,
        )
        stop = threading.Event()
        follower = threading.Thread(
            target=subscriber.follow, args=(stop, cfg.poll_s, log_applied), name="deltasync"
        )
        follower.start()
        try:
            await uvicorn.Server(uvicorn.Config(app)).serve(sockets=[sock])
        finally:
            stop.set()
            await asyncio.to_thread(follower.join)  # it may wait on a write that needs this loop
            applier.close()


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # Our loggers' own level: building vLLM's app imports model_hosting_container_standards, which sets the
    # root logger to ERROR, and every line after it (each applied step, each refusal) would be lost.
    logging.getLogger("deltasync").setLevel(logging.INFO)
    cfg = from_env(Settings)
    log.info("starting %s", cfg)  # the repr leaves out API_TOKEN; HF_TOKEN is never read here
    # SIGTERM (docker stop, systemd, kill) stops like Ctrl-C: KeyboardInterrupt unwinds serve(), and leaving
    # vLLM's engine client stops its engine processes. (Left at the default, the SIGTERM that uvicorn
    # re-raises once it has stopped would end this process before that, leaving the engine running.)
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        asyncio.run(serve(cfg))
    except KeyboardInterrupt:
        log.info("stopped")


if __name__ == "__main__":
    main()
