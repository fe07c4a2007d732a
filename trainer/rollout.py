"""TRL's AsyncRolloutWorker, told which weights really produced each rollout.

The inference Space labels every completion with the weight versions (published steps) it ran under: the
`x-weight-version` header (when the request arrived) and `x-weight-version-end` (when the response began).
TRL's worker ignores them and tags a rollout with the version the TRAINER last sent, which says nothing about
when the replica applied it. `VersionedRolloutLoop` keeps TRL's loop and request body unchanged and only:

- adds the bearer token (INFERENCE_API_TOKEN, read in the worker process, never logged or pickled),
- records the versions of every turn of a rollout, and stamps its samples with the OLDEST one, so TRL's
  `max_staleness` filter and its `sample/staleness_*` metrics measure real staleness,
- adds per-sample metrics for the trainer's telemetry (see `StepStats` in trainer/train.py).

Install it with `use_versioned_loop(worker, base_step)`: `_loop_cls` is the worker's documented hook for loop
subclasses, and the child process imports this module by name (spawn).
"""

from __future__ import annotations

import contextvars
import faulthandler
import functools
import multiprocessing
import os
import signal
from collections.abc import Callable
from typing import Any

from trl.experimental.async_grpo.async_rollout_worker import (
    AsyncRolloutWorker,
    RolloutGroup,
    RolloutSample,
    _AsyncRolloutLoop,
)

VERSION_HEADERS = ("x-weight-version", "x-weight-version-end")
TOKEN_ENV = "INFERENCE_API_TOKEN"
# per-sample metric keys; TRL averages them per micro-batch in its collator
WEIGHT_VERSION = "deltasync/weight_version"
VERSION_KNOWN = "deltasync/version_known"
REWARD_SQ = "deltasync/reward_sq"

# The versions seen by the rollout running in the current asyncio task (each rollout is its own task).
_turn_versions: contextvars.ContextVar[list[int] | None] = contextvars.ContextVar(
    "turn_versions", default=None
)


def parse_version(value: str | None) -> int | None:
    """A published step, or None: a server that has not applied any step yet labels its weights `model`."""
    return int(value) if value is not None and value.isdigit() else None


class VersionedRolloutLoop(_AsyncRolloutLoop):
    """TRL's rollout loop, reading the weight version of every completion from the server's headers."""

    def __init__(self, *, version_base: int = 0, **kwargs: Any):
        if multiprocessing.parent_process() is not None:  # TRL's spawned worker, not a test's main process
            # Ctrl-C reaches the whole process group: the trainer stops this process after its last step.
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1 <pid>`: where is it stuck?
        super().__init__(**kwargs)
        # When the trainer stops us it no longer reads: samples still buffered for the pipe must not hold this
        # process's exit (the trainer would wait out TRL's 15 s join, then kill us).
        self.rollout_buffer.cancel_join_thread()
        self._metrics_queue.cancel_join_thread()
        self.version_base = version_base  # the published step TRL calls model version 1 (its first sync)
        token = os.environ.get(TOKEN_ENV)
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._rollout_versions: dict[str, int] = {}  # rollout id -> oldest weight version it used

    async def _post(self, path: str, payload: dict, timeout: float, max_retries: int = 3) -> dict:
        import aiohttp

        client_timeout = aiohttp.ClientTimeout(total=timeout)

        async def post() -> dict:
            url = f"{self.vllm_server_url}{path}"
            async with self.session.post(
                url, json=payload, timeout=client_timeout, headers=self._headers
            ) as r:
                r.raise_for_status()
                content = await r.json()
                seen = _turn_versions.get()
                if seen is not None:
                    seen += [v for h in VERSION_HEADERS if (v := parse_version(r.headers.get(h))) is not None]
                return content or {}

        return await self._retry(post, label=f"POST {path}", max_attempts=max_retries)

    async def _generate_one(self, prompt, tool_dict, tools, group_id: int = 0):
        versions: list[int] = []
        _turn_versions.set(versions)  # this task's own context: concurrent rollouts do not mix
        result = await super()._generate_one(prompt, tool_dict, tools, group_id)
        if versions:
            for sequence in result[2]:
                self._rollout_versions[sequence.rollout_id] = min(versions)
        return result

    async def _score_group(self, group: RolloutGroup) -> list[RolloutSample]:
        samples = await super()._score_group(group)
        # TRL emits one sample per training row, conversation by conversation, row by row.
        rows = [sequence for sequences in group.completions_sequences for sequence in sequences]
        for sample, row in zip(samples, rows, strict=True):
            version = self._rollout_versions.get(row.rollout_id)
            reward = sample.metrics["reward"]
            sample.metrics[REWARD_SQ] = reward * reward
            sample.metrics[VERSION_KNOWN] = float(version is not None)
            if version is not None:
                sample.metrics[WEIGHT_VERSION] = float(version)
                # TRL counts syncs: its version 1 is the first published step of this run.
                sample.model_version = version - self.version_base + 1
        for row in rows:
            self._rollout_versions.pop(row.rollout_id, None)
        return samples


def use_versioned_loop(worker: AsyncRolloutWorker, version_base: int) -> None:
    """Make `worker` (not started yet) run `VersionedRolloutLoop`; TRL's version 1 is step `version_base`."""
    worker._loop_cls = VersionedRolloutLoop
    worker._loop_kwargs["version_base"] = version_base
    if not isinstance(worker.stop, functools.partial):
        worker.stop = functools.partial(_stop, worker, worker.stop)


def _stop(worker: AsyncRolloutWorker, stop: Callable[[], None]) -> None:
    """TRL's `stop()`, minus a hang: it sets a multiprocessing Event that a thread of the worker process waits
    on, and when that process has died (an unreachable env or inference server fails it), `Event.set()`
    blocks forever waiting for the dead waiter to wake. A dead worker needs no signal: reap it and go on."""
    process = worker._process
    if process is not None and not process.is_alive():
        worker._process = None
    stop()
