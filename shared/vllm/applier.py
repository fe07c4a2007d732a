"""The subscriber's applier for a live vLLM engine: verified weights go through the worker extension
(`deltasync.vllm.worker`) by `collective_rpc`, one file per RPC, with generation paused only for the write."""

from __future__ import annotations

import asyncio
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors.torch import save_file

from deltasync.codec.changes import TensorChanges
from deltasync.codec.patch import raw_entries
from deltasync.sync.anchor import shard
from deltasync.sync.subscriber import Applier

SHARD_BYTES = 1 << 30  # an anchor reaches the worker in files of about this size, one RPC each


class WriteRefused(RuntimeError):
    """The worker refused a weights file. Unless `VllmApplier.stuck`, it wrote nothing."""


class VllmApplier(Applier):
    """Writes verified weights into the engine through the worker extension (`worker`), called from the
    subscriber's thread. Files are written before generation pauses: the pause covers the write only."""

    def __init__(
        self, engine, loop: asyncio.AbstractEventLoop, layout: Mapping[str, list[int]], direct=False
    ):
        self.engine, self.loop, self.layout, self.direct = engine, loop, dict(layout), direct
        self.names: list[str] = []  # the tensors of the run: what a readback covers
        self.step: int | None = None  # the step last written
        self.anchor_step: int | None = None
        self.version: str = "model"  # the weight version label generation runs under
        self.readback: dict | None = None  # the last fingerprint read back from the worker
        self.last_write: dict | None = None  # the last write's timings: in the worker, and generation paused
        # A write failed half-way: generation stays paused until an anchor loads. Never serve weights we
        # cannot vouch for; the subscriber goes for an anchor as soon as a write fails.
        self.stuck = False
        self.tmp = Path(tempfile.mkdtemp(prefix="deltasync-apply-"))

    def load(self, state: Mapping[str, torch.Tensor], step: int) -> float:
        wrong = [n for n, t in state.items() if self.layout.get(n) != list(t.shape)]
        if wrong:
            shape = list(state[wrong[0]].shape)
            raise ValueError(f"the served model has no tensor {wrong[0]!r} of shape {shape}")
        shards = shard(state, SHARD_BYTES)
        files = [self.tmp / f"anchor-{step}-{i}.safetensors" for i in range(len(shards))]
        for tensors, path in zip(shards, files, strict=True):
            save_file(tensors, path)
        pause_s = self._write("deltasync_load", files, step)
        self.names, self.anchor_step = list(state), step
        return pause_s

    def patch(self, changes: Mapping[str, TensorChanges], step: int) -> float:
        path = self.tmp / f"delta-{step}.safetensors"
        save_file(raw_entries(changes), path)  # the raw encoding's entries, without the patch's metadata
        return self._write("deltasync_patch", [path], step, direct=self.direct)

    def fingerprint(self) -> int:
        results = self._run(self.engine.collective_rpc("deltasync_fingerprint", args=(self.names,)))
        failed = [r["error"] for r in results if not r["ok"]]
        if failed:
            raise RuntimeError(f"readback failed: {failed[0]}")
        self.readback = {"step": self.step, "at": time.time(), **results[0]}
        return int(results[0]["fingerprint"], 16)

    def _run(self, coroutine):
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result()

    def _write(self, method: str, files: list[Path], step: int, **kwargs) -> float:
        try:
            return self._run(self._paused_write(method, [str(f) for f in files], step, kwargs))
        finally:
            for f in files:
                f.unlink(missing_ok=True)

    async def _paused_write(self, method: str, files: list[str], step: int, kwargs: dict) -> float:
        start = time.perf_counter()
        # keep: running requests freeze and continue on the new weights; nothing is aborted
        await self.engine.pause_generation(mode="keep", clear_cache=False)
        write_s = 0.0
        try:
            for i, path in enumerate(files):
                results = await self.engine.collective_rpc(method, args=(path,), kwargs=kwargs)
                errors = [r for r in results if not r["ok"]]
                if errors:
                    self.stuck |= i > 0 or any(e["written"] for e in errors)
                    raise WriteRefused(errors[0]["error"])
                write_s += max(r["seconds"] for r in results)
        except WriteRefused:
            if not self.stuck:  # refused before any write: the last good weights are intact, serve on
                await self.engine.resume_generation()
            raise
        except BaseException:
            self.stuck = True  # the RPC itself failed: the worker may hold part of the write
            raise
        # KV computed by the old weights must not be reused: running requests are preempted and recompute
        # their context on resume, and no new request can hit a stale prefix.
        await self.engine.reset_prefix_cache(reset_running_requests=True)
        self.version, self.step, self.stuck = str(step), step, False
        await self.engine.update_weight_version(self.version)
        await self.engine.resume_generation()
        pause_s = time.perf_counter() - start
        self.last_write = {"step": step, "method": method, "write_s": write_s, "pause_s": pause_s}
        return pause_s
