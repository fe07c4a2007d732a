"""The subscriber's applier for a live vLLM engine: verified weights go through the worker extension
(`deltasync.vllm.worker`) by `collective_rpc`, with generation paused only for the in-place write.

A delta is written to a raw patch file and staged in the worker (read, checked, moved to its device) while
generation goes on; then generation pauses (`keep`: running requests freeze where they are), the worker makes
the indexed writes, the KV policy runs, the weight version moves to the step, and generation resumes.
"""

from __future__ import annotations

import asyncio
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Literal

import torch
from safetensors.torch import save_file

from deltasync.codec.changes import TensorChanges
from deltasync.codec.patch import raw_entries
from deltasync.sync.anchor import shard
from deltasync.sync.subscriber import Applier

SHARD_BYTES = 1 << 30  # an anchor reaches the worker in files of about this size, one stage + commit each

KvPolicy = Literal["keep", "recompute"]
WritePath = Literal["direct", "vllm"]


class WriteRefused(RuntimeError):
    """The worker refused a weights file. Unless `VllmApplier.stuck`, it wrote nothing."""


class VllmApplier(Applier):
    """Writes verified weights into the engine through the worker extension, called from the subscriber's
    thread while `loop` runs the engine.

    `write`: "direct" (indexed writes into the parameters; vLLM's loader only for tensors without one
    contiguous destination) or "vllm" (vLLM's loader for every tensor). `kv_on_update`: "keep" (running
    requests continue on the KV they have; their next tokens come from the new weights) or "recompute"
    (running requests are preempted and recompute their whole context on the new weights). Either way no
    request that arrives after an update reuses KV computed by older weights: each request is salted with
    the weight version current when it arrives, so requests never share prefix-cache blocks across versions.
    """

    def __init__(
        self,
        engine,
        loop: asyncio.AbstractEventLoop,
        layout: Mapping[str, list[int]],
        write: WritePath = "direct",
        kv_on_update: KvPolicy = "keep",
    ):
        self.engine, self.loop, self.layout = engine, loop, dict(layout)
        self.write, self.kv_on_update = write, kv_on_update
        self.names: list[str] = []  # the tensors of the run: what a readback covers
        self.step: int | None = None  # the step last written
        self.anchor_step: int | None = None
        self.version: str = "model"  # the weight version label generation runs under
        self.readback: dict | None = None  # the last fingerprint read back from the worker
        self.last_write: dict | None = None  # the last write: paths, timings, requests in flight
        # A write failed half-way: generation stays paused until an anchor loads. Never serve weights we
        # cannot vouch for; the subscriber goes for an anchor as soon as a write fails.
        self.stuck = False
        self.tmp = Path(tempfile.mkdtemp(prefix="deltasync-apply-"))
        add_request = engine.engine_core.add_request_async

        async def add_salted(request):
            request.cache_salt = f"deltasync-{self.version}/{request.cache_salt or ''}"
            return await add_request(request)

        engine.engine_core.add_request_async = add_salted

    def load(self, state: Mapping[str, torch.Tensor], step: int) -> float:
        wrong = [n for n, t in state.items() if self.layout.get(n) != list(t.shape)]
        if wrong:
            shape = list(state[wrong[0]].shape)
            raise ValueError(f"the served model has no tensor {wrong[0]!r} of shape {shape}")
        shards = shard(state, SHARD_BYTES)
        files = [self.tmp / f"anchor-{step}-{i}.safetensors" for i in range(len(shards))]
        for tensors, path in zip(shards, files, strict=True):
            save_file(tensors, path)
        # Anchors (start-up, recovery) are staged inside the pause, one shard at a time: the worker never
        # holds more than one shard beside the model.
        pause_s = self._write(files, step, sparse=False)
        self.names, self.anchor_step = list(state), step
        return pause_s

    def patch(self, changes: Mapping[str, TensorChanges], step: int) -> float:
        path = self.tmp / f"delta-{step}.safetensors"
        save_file(raw_entries(changes), path)  # the raw encoding's entries, without the patch's metadata
        return self._write([path], step, sparse=True)

    def fingerprint(self) -> int:
        results = self._run(self.engine.collective_rpc("deltasync_fingerprint", args=(self.names,)))
        failed = [r["error"] for r in results if not r["ok"]]
        if failed:
            raise RuntimeError(f"readback failed: {failed[0]}")
        self.readback = {"step": self.step, "at": time.time(), **results[0]}
        return int(results[0]["fingerprint"], 16)

    def _run(self, coroutine):
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result()

    def _write(self, files: list[Path], step: int, sparse: bool) -> float:
        try:
            return self._run(self._paused_write([str(f) for f in files], step, sparse))
        finally:
            for f in files:
                f.unlink(missing_ok=True)

    async def _rpc(self, method: str, *args, **kwargs) -> list[dict]:
        results = await self.engine.collective_rpc(method, args=args, kwargs=kwargs)
        errors = [r for r in results if not r["ok"]]
        if errors:
            self.stuck |= any(e["written"] for e in errors)
            raise WriteRefused(errors[0]["error"])
        return results

    async def _stage(self, path: str, sparse: bool) -> dict:
        return (await self._rpc("deltasync_stage", path, sparse, loader=self.write == "vllm"))[0]

    async def _paused_write(self, files: list[str], step: int, sparse: bool) -> float:
        staged_early = len(files) == 1  # a delta: read and moved to the device while generation goes on
        stage_start = time.perf_counter()
        staged = [await self._stage(files[0], sparse)] if staged_early else []
        stage_s = time.perf_counter() - stage_start
        # keep: running requests freeze where they are and nothing is aborted. The engine core's own call,
        # without AsyncLLM.pause_generation's trailing 20 ms sleep (output ordering only).
        await self.engine.engine_core.pause_scheduler_async(mode="keep", clear_cache=False)
        start = time.perf_counter()  # generation is paused from here
        in_flight = self.engine.output_processor.get_num_unfinished_requests()
        write_s, written = 0.0, 0
        try:
            for path in files:
                if not staged_early:
                    staged.append(await self._stage(path, sparse))
                write_s += max(r["seconds"] for r in await self._rpc("deltasync_commit", path))
                written += 1
        except WriteRefused:
            self.stuck |= written > 0  # an anchor's later shard refused: the earlier ones are written
            if not self.stuck:  # refused before any write: the last good weights are intact, serve on
                await self.engine.resume_generation()
            raise
        except BaseException:
            self.stuck = True  # the RPC itself failed: the worker may hold part of the write
            raise
        if self.kv_on_update == "recompute":  # running requests recompute their context on the new weights
            await self.engine.reset_prefix_cache(reset_running_requests=True)
        self.version, self.step, self.stuck = str(step), step, False
        await self.engine.update_weight_version(self.version)
        await self.engine.resume_generation()
        pause_s = time.perf_counter() - start
        self.last_write = {
            "step": step,
            "kind": "delta" if sparse else "anchor",
            "changed": sum(s["changed"] for s in staged),
            "tensors": {path: sum(s["paths"][path] for s in staged) for path in ("direct", "vllm")},
            "kv_on_update": self.kv_on_update,
            "requests_in_flight": in_flight,  # unfinished requests when generation paused
            "stage_s": stage_s if staged_early else None,  # the stage RPC, outside the pause
            "write_s": write_s,
            "pause_s": pause_s,
        }
        return pause_s
