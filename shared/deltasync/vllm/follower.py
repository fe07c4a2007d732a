"""Follow a sync root into a vLLM server whose weight-transfer backend is deltasync (`deltasync.vllm.engine`).

The subscriber polls the root, downloads each step once and checks its files' headers against the head;
`EngineApplier` hands the files (their local paths) to the server's workers through vLLM's weight-update
protocol. Each worker decodes them against the weights it holds, checks that the ranks together reach the
promised fingerprint, and writes in place, with generation paused (`keep`: running requests freeze where
they are) only around the writes (a delta is decoded and planned, `stage`, while generation runs), in one
update session:

    start_weight_update -> update_weights(stage) -> pause(keep) -> update_weights(files)
        -> finish_weight_update(step) -> resume

The follower decodes nothing and keeps no copy of the weights: its memory is the patch bytes and the
interpreter.

The protocol is reached either over vLLM's RL routes (`HttpEngine`: `deltasync follow ROOT --vllm-url URL`,
beside any server started with VLLM_SERVER_DEV_MODE=1 on a private address) or in-process through the engine
client's public methods (`AsyncEngine`: the inference Space). One engine, one write path.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import math
import re
import shutil
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Literal, Protocol

from deltasync.codec.fingerprint import format_fingerprint
from deltasync.errors import FilesRefused, Unreachable, WriteRefused
from deltasync.storage import POLL_BUDGET, open_storage, redact
from deltasync.sync.signing import Trust
from deltasync.sync.subscriber import Applied, FileApplier, Subscriber
from deltasync.vllm import compat

log = logging.getLogger(__name__)
KvPolicy = Literal["keep", "recompute"]
WritePath = Literal["direct", "vllm"]
PATHS = ("direct", "packed", "loader")  # how the workers write a tensor: `deltasync.vllm.layout.Layout.paths`
NUMBER = re.compile(r"\.\d+(?=\.)")  # a layer's or an expert's number in a tensor name
MAX_ANSWER_BYTES = 1 << 20  # the RL routes answer a few small JSON fields: anything longer is refused
DEV_MODE_HINT = (
    "start the server with VLLM_SERVER_DEV_MODE=1 (on a private address) and "
    """--weight-transfer-config '{"backend": "deltasync"}'"""
)


class Engine(Protocol):
    """vLLM's weight-update protocol, called from the subscriber's thread; failures raise WriteRefused."""

    def init(self, init_info: dict[str, Any]) -> None: ...
    def pause(self) -> None: ...
    def start(self) -> None: ...
    def update(self, update_info: dict[str, Any]) -> None: ...
    def finish(self, version: str | None) -> None: ...  # None: the weights keep their version
    def resume(self) -> None: ...
    def recompute_running(self) -> None: ...


class HttpEngine:
    """vLLM's RL routes on `url` (VLLM_SERVER_DEV_MODE=1); `api_key`: the server's --api-key, if any (or
    credentials in `url`, for a proxy with basic authentication: never shown). `stop`: once set, a server
    that does not answer yet is no longer waited for; it is tried again every `retry_s` seconds."""

    def __init__(
        self,
        url: str,
        api_key: str | None = None,
        timeout_s: float = 600.0,
        stop: threading.Event | None = None,
        retry_s: float = 2.0,
    ):
        parts = urllib.parse.urlsplit(url.rstrip("/"))
        self.url = parts._replace(netloc=parts.netloc.rpartition("@")[2]).geturl()  # shown in every line
        if parts.scheme not in ("http", "https") or not parts.hostname or not _valid_port(parts):
            raise ValueError(f"vLLM server URL {self.url!r}: expected http://HOST:PORT or https://HOST:PORT")
        self.authorization = f"Bearer {api_key}" if api_key else None
        if parts.username is not None:
            if api_key:
                raise ValueError(f"vLLM server URL {self.url}: both credentials in it and an API key")
            user, password = (urllib.parse.unquote(p or "") for p in (parts.username, parts.password))
            self.authorization = f"Basic {base64.b64encode(f'{user}:{password}'.encode()).decode()}"
        self.timeout_s, self.retry_s = timeout_s, retry_s
        self.stop = stop or threading.Event()

    def _post(self, route: str, body: dict[str, Any] | None = None) -> dict:
        headers = {"content-type": "application/json"}
        if self.authorization:
            headers["authorization"] = self.authorization
        data = json.dumps(body or {}).encode()
        request = urllib.request.Request(self.url + route, data=data, headers=headers, method="POST")
        where = route.split("?")[0]
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                answer = _bounded_read(response, where)
        except urllib.error.HTTPError as e:
            if e.code == 404:
                raise WriteRefused(f"{where}: the server has no such route: {DEV_MODE_HINT}") from None
            raise WriteRefused(f"{where}: {_reason(_bounded_read(e, where))}") from None
        except urllib.error.URLError as e:  # the request was not sent (urllib wraps only that)
            raise Unreachable(f"cannot reach the vLLM server at {self.url}: {e.reason}") from None
        try:
            return json.loads(answer or b"{}")
        except ValueError:
            raise WriteRefused(f"{where}: the server's answer is not JSON: {answer[:80]!r}") from None

    def init(self, init_info: dict[str, Any]) -> None:
        """Initialize the engine, waiting until `stop` for a server that does not answer yet, with a line
        each time why changes (and once it answers)."""
        said = None
        while True:
            try:
                self._post("/init_weight_transfer_engine", {"init_info": init_info})
                break
            except Unreachable as e:
                if str(e) != said:
                    log.warning("%s: trying again every %g s", e, self.retry_s)
                    said = str(e)
                if self.stop.wait(self.retry_s):
                    raise ConnectionError(
                        f"stopped while waiting for the vLLM server at {self.url}"
                    ) from None
        if said is not None:
            log.info("the vLLM server at %s answers", self.url)

    def pause(self) -> None:
        self._post("/pause?mode=keep&clear_cache=false")

    def start(self) -> None:
        self._post("/start_weight_update")

    def update(self, update_info: dict[str, Any]) -> None:
        self._post("/update_weights", {"update_info": update_info})

    def finish(self, version: str | None) -> None:
        self._post("/finish_weight_update", {"weight_version": version})

    def resume(self) -> None:
        self._post("/resume")

    def recompute_running(self) -> None:
        self._post("/reset_prefix_cache?reset_running_requests=true")


def _valid_port(parts: urllib.parse.SplitResult) -> bool:
    try:
        return parts.port is None or parts.port > 0
    except ValueError:  # not a number, or out of range
        return False


def _bounded_read(response, where: str) -> bytes:
    """The body of an answer, refused past MAX_ANSWER_BYTES rather than read into memory whole."""
    body = response.read(MAX_ANSWER_BYTES + 1)
    if len(body) > MAX_ANSWER_BYTES:
        raise WriteRefused(f"{where}: the server's answer is over {MAX_ANSWER_BYTES} bytes")
    return body


def _reason(body: bytes) -> str:
    """The worker's own message out of vLLM's error JSON."""
    try:
        error = json.loads(body)
        message = error.get("error", error)
        message = message.get("message", message) if isinstance(message, dict) else message
    except (ValueError, AttributeError):
        message = body.decode(errors="replace")
    return compat.worker_error(str(message))


class AsyncEngine:
    """The engine client's public methods (`AsyncLLM` in this process), driven from another thread while
    `loop` runs the engine."""

    def __init__(self, engine, loop: asyncio.AbstractEventLoop):
        self.engine, self.loop = engine, loop

    def _run(self, coroutine):
        try:
            return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result()
        except Exception as e:  # the worker's error, through vLLM's RPC
            raise WriteRefused(_reason(str(e).encode())) from None

    def init(self, init_info: dict[str, Any]) -> None:
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

        self._run(self.engine.init_weight_transfer_engine(WeightTransferInitRequest(init_info=init_info)))

    def pause(self) -> None:
        self._run(self.engine.pause_generation(mode="keep", clear_cache=False))

    def start(self) -> None:
        self._run(self.engine.start_weight_update())

    def update(self, update_info: dict[str, Any]) -> None:
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        self._run(self.engine.update_weights(WeightTransferUpdateRequest(update_info=update_info)))

    def finish(self, version: str | None) -> None:
        self._run(self.engine.finish_weight_update(version))

    def resume(self) -> None:
        self._run(self.engine.resume_generation())

    def recompute_running(self) -> None:
        self._run(self.engine.reset_prefix_cache(reset_running_requests=True))


class EngineApplier(FileApplier):
    """Writes the subscriber's verified steps through `engine`; each update carries the fingerprints the
    step starts from and leads to, which the workers check again.

    `write`: the engine's write path ("direct" or "vllm", see `DeltasyncInitInfo`). `kv_on_update`: "keep"
    (running requests continue on the KV they have; their next tokens come from the new weights) or
    "recompute" (running requests are preempted and recompute their context on the new weights).
    `in_flight`: how many requests are running, recorded when generation pauses. `quantization`: the recipe
    the server was started with (`--quantization`, deltasync.quant), for a quantized root: the workers refuse
    another, and so does the subscriber a root whose run.json names another."""

    def __init__(
        self,
        engine: Engine,
        root: str,
        write: WritePath = "direct",
        kv_on_update: KvPolicy = "keep",
        in_flight: Callable[[], int] | None = None,
        quantization: str | None = None,
    ):
        self.engine, self.root, self.write, self.kv_on_update = engine, root, write, kv_on_update
        self.quantization = quantization
        self.in_flight, self.update_s, self.stage_s = in_flight, 0.0, 0.0
        self.paused_with: int | None = None
        self.step: int | None = None  # the step last written
        self.anchor_step: int | None = None
        self.version = "model"  # the weight version label generation runs under
        self.readback: dict | None = None  # the last fingerprint the workers confirmed
        self.last_write: dict | None = None
        # An update failed after part of it was written: generation stays paused until an anchor loads.
        self.stuck = False
        self.tmp = Path(tempfile.mkdtemp(prefix="deltasync-follow-"))
        try:
            self._init()
            self.paths = self._read_paths()  # how the workers write each tensor (Layout.paths)
        except BaseException:
            self.close()
            raise
        log.info("tensors written in place: %s", json.dumps(path_summary(self.paths)))

    def close(self) -> None:
        shutil.rmtree(self.tmp, ignore_errors=True)

    def load_files(self, files: list[Path], step: int, fingerprint: int) -> float:
        """Have the workers check and write the anchor of `step` in `files`; the seconds paused."""
        info = {"step": step, "kind": "anchor", "paths": [str(f) for f in files]}
        info |= {"fingerprint": format_fingerprint(fingerprint), "report": str(self.tmp / "report.json")}
        pause_s = self._write(info, "anchor", sum(f.stat().st_size for f in files))
        self.anchor_step = step
        return pause_s

    def patch_bytes(self, parts: list[bytes], step: int, base: int, fingerprint: int) -> float:
        """Have the workers decode and write the patch of `step`, from weights `base` to `fingerprint`; the
        seconds paused. They decode, check and plan it while generation goes on (`stage`); the pause covers
        the writes."""
        files = [self.tmp / f"delta-{step}-{i}.safetensors" for i in range(len(parts))]
        info = {
            "step": step,
            "kind": "delta",
            "paths": [str(f) for f in files],
            "base": format_fingerprint(base),
        }
        info |= {"fingerprint": format_fingerprint(fingerprint), "report": str(self.tmp / "report.json")}
        try:
            for data, path in zip(parts, files, strict=True):
                path.write_bytes(data)
            return self._write(info, "delta", sum(map(len, parts)), stage={**info, "kind": "stage"})
        finally:
            for path in files:
                path.unlink(missing_ok=True)

    def fingerprint(self) -> int:
        """The fingerprint of the weights the workers hold, read back from their memory."""
        report = self.tmp / "fingerprint.json"
        self._paused([{"step": -1, "kind": "fingerprint", "path": str(report)}], pause=False)  # a read
        try:
            held = json.loads(report.read_text())["fingerprint"]
            report.unlink()
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise WriteRefused(f"the server's workers reported no fingerprint in {report}: {e}") from None
        self.readback = {"step": self.step, "at": time.time(), "fingerprint": held}
        return int(held, 16)

    def _read_paths(self) -> dict[str, str]:
        """`Layout.paths` of the workers; a tensor any rank writes other than directly counts as such."""
        folder = self.tmp / "paths"
        self._paused([{"step": -1, "kind": "paths", "path": str(folder)}], pause=False)  # a read
        files = sorted(folder.glob("rank-*.json"))
        if not files:  # another backend, or workers that do not share this machine's files
            raise WriteRefused(
                f"the server's workers wrote no layout into {folder}: they must run the deltasync "
                "weight-transfer backend, on this machine"
            )
        paths: dict[str, str] = {}
        for file in files:
            for name, path in json.loads(file.read_text()).items():
                if paths.get(name, "direct") == "direct":
                    paths[name] = path
        shutil.rmtree(folder)
        return paths

    def use_write(self, write: WritePath) -> None:
        """Switch the engine's write path (its layout is kept)."""
        self.write = write
        self._init()

    def _init(self) -> None:
        """Initialise the engine for this root, write path and recipe (again after a server restart)."""
        quantized = {"quantization": self.quantization} if self.quantization else {}
        self.engine.init({"root": self.root, "write": self.write, **quantized})

    def _paused(
        self, infos: list[dict], version: str | None = None, pause: bool = True, stage: dict | None = None
    ) -> float:
        """One update session: start, `stage` (checked and planned while generation goes on), pause, the
        updates, finish (labelling the weights `version`; None keeps their label) and resume; the seconds
        generation was paused (`pause` False: a read, the seconds it took). A refused update resumes
        generation on the unchanged weights, unless the workers hold part of a write: then generation stays
        paused until an anchor loads (`stuck`). Each call to the engine waits for the forward step under way:
        one session, not one for the stage and one for the writes."""
        start = time.perf_counter()
        self.paused_with, paused, written = None, False, 0
        try:
            self.engine.start()
            if stage is not None:
                self.engine.update(stage)
                self.stage_s = time.perf_counter() - start
            if pause:
                self.engine.pause()
                start, paused = time.perf_counter(), True
                self.paused_with = self.in_flight() if self.in_flight else None
            for info in infos:
                self.engine.update(info)
                written += 1
            self.engine.finish(version)
            self.update_s = time.perf_counter() - start
            if pause and self.kv_on_update == "recompute":
                self.engine.recompute_running()
        except WriteRefused as e:
            report = self._take_report()
            # An update after the first refused (the earlier ones are written), or one the workers left
            # part written: only an anchor restores the weights.
            self.stuck |= written > 0 or "torn" in report
            self._close_refused_update()
            if compat.NOT_INITIALIZED in str(e):  # a server restarted on its own weights: the next try works
                self._init()
            if paused and not self.stuck:
                self.engine.resume()
            elif self.stuck:
                log.warning("generation stays paused until an anchor loads: %s", e)
            if "refused" in report:
                raise FilesRefused(str(e)) from None
            raise
        except Unreachable:  # nothing sent, nothing written
            raise
        except BaseException:
            self.stuck = True  # the call itself failed: the workers may hold part of the write
            raise
        if paused:
            self.engine.resume()
        return time.perf_counter() - start

    def _close_refused_update(self) -> None:
        """Close the update on the ranks that did not report the refusal (compat.reports_errors); the rank
        that did has closed it already and refuses this, as a single rank does."""
        try:
            self.engine.finish(None)
        except WriteRefused as e:
            if not compat.update_not_open(str(e)):
                raise

    def _take_report(self) -> dict:
        """What the workers reported of a refused update (`deltasync.vllm.engine`): `refused`, the files
        themselves are bad; `torn`, the weights hold part of its writes."""
        report = self.tmp / "report.json"
        try:
            text = report.read_text()
        except FileNotFoundError:
            return {}
        report.unlink()
        try:
            answer = json.loads(text)
        except ValueError:
            answer = None
        if not isinstance(answer, dict):
            raise WriteRefused(f"the server's workers wrote a malformed report: {text[:80]!r}")
        return answer

    def _write(self, info: dict, kind: str, nbytes: int, stage: dict | None = None) -> float:
        step = info["step"]
        pause_s = self._paused([info], str(step), stage=stage)
        self.version, self.step, self.stuck = str(step), step, False
        self.last_write = {
            "step": step,
            "kind": kind,
            "bytes": nbytes,
            "write": self.write,
            "kv_on_update": self.kv_on_update,
            "requests_in_flight": self.paused_with,  # running when generation paused
            "update_s": self.update_s,  # update and finish: the workers' write and its round trips
            "pause_s": pause_s,
        }
        if stage is not None:
            self.last_write["stage_s"] = self.stage_s  # decoded, checked and planned before the pause
        return pause_s


def path_summary(paths: Mapping[str, str]) -> dict:
    """`Layout.paths` of a whole model in brief: how many tensors take each path, and under `other` the
    tensors written other than directly, by path, with layer and expert numbers as `*` (an MoE model has
    thousands of expert tensors)."""
    other: dict[str, list[str]] = {}
    for name, path in paths.items():
        if path != "direct":
            pattern = NUMBER.sub(".*", name)
            if pattern not in other.setdefault(path, []):
                other[path].append(pattern)
    counts = {path: sum(p == path for p in paths.values()) for path in PATHS}
    return {"counts": counts, "other": other}


def log_applied(a: Applied) -> None:
    """The replica's one line per applied step."""
    pause_ms = "-" if a.pause_s is None else f"{1e3 * a.pause_s:.1f}"
    log.info(
        "step %d applied (%s): %d bytes, %d changed, paused %s ms, lag %.2f s",
        a.step,
        a.kind,
        a.payload_bytes,
        a.changed,
        pause_ms,
        a.lag_s,
    )


def follow(
    root: str,
    engine: Engine,
    stop: threading.Event,
    *,
    replica: str | None = None,
    poll_s: float = 1.0,
    poll_budget: int = POLL_BUDGET,
    verify_every: int = 10,
    quantization: str | None = None,
    trust: Trust | None = None,
) -> Subscriber:
    """Follow `root` into `engine` until `stop` is set (blocks); `poll_budget`: see `open_storage`;
    `quantization`: the server's `--quantization` (see EngineApplier); `trust`: the keys whose signed steps
    alone are applied (None: whoever can write the root)."""
    if not (math.isfinite(poll_s) and poll_s > 0):
        raise ValueError(f"poll interval must be a positive number of seconds, not {poll_s}")
    applier = EngineApplier(engine, root, quantization=quantization)
    storage = open_storage(root, poll_budget=poll_budget)
    subscriber = Subscriber(storage, applier, replica=replica, verify_every=verify_every, trust=trust)
    log.info("following %s, trusting %s", redact(root), subscriber.trust)
    try:
        subscriber.follow(stop, poll_s, on_applied=log_applied)
    finally:
        applier.close()
    return subscriber
