"""TRL's AsyncRolloutWorker, told which weights really produced each rollout.

The inference Space labels every completion with the weight versions (published steps) it ran under: the
`x-weight-version` header (when the request arrived) and `x-weight-version-end` (when the response began).
TRL's worker ignores them and tags a rollout with the version the TRAINER last sent, which says nothing about
when the replica applied it. `VersionedRolloutLoop` keeps TRL's loop and request body unchanged and only:

- adds the bearer token (INFERENCE_API_TOKEN, read in the worker process, never logged or pickled),
- records the versions of every turn of a rollout, and stamps its samples with the OLDEST one, so TRL's
  `max_staleness` filter and its `sample/staleness_*` metrics measure real staleness,
- adds per-sample metrics for the trainer's telemetry (see `step_info` in trainer/train.py),
- applies back-pressure: a group of rollouts starts only while fewer than `max_ahead` rollouts are
  generating, waiting to be scored or waiting in the queue for the trainer (TRL's loop refills its in-flight
  slots as soon as a rollout ends and stops only once its queue AND its 16-group scoring queue are full, so
  generation runs steps ahead of training and its rollouts go stale),
- counts what it generated (`RolloutCounters`), so the trainer can tell per step how much of it was trained,
- optionally leaves out of the loss a final turn cut off by `max_completion_length` (`mask_truncated`: TRL's
  GRPOTrainer flag `mask_truncated_completions`, which the async trainer lacks). Trained, the best games'
  cut-off last turns teach the policy to ramble instead of guessing (seen: a demo run collapsed to no guesses
  at step 101). Left out only where the game scored above its group's mean, the pushed-down rambles of the
  worse games took the valid turns' openings with them (seen: 3.7 guesses per game to 0.3 in four steps).

Install it with `use_versioned_loop(worker, base_step)`: `_loop_cls` is the worker's documented hook for loop
subclasses, and the child process imports this module by name (spawn).
"""

from __future__ import annotations

import asyncio
import contextvars
import faulthandler
import functools
import multiprocessing
import os
import random
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


class RolloutCounters:
    """Samples and completion tokens the rollout worker has generated (scored and handed to the queue), shared
    with the trainer's process; `take()` returns what was added since its last call."""

    def __init__(self) -> None:
        self._totals = multiprocessing.get_context("spawn").Array("d", 2)  # samples, tokens
        self._taken = (0.0, 0.0)

    def add(self, samples: int, tokens: int) -> None:
        with self._totals.get_lock():
            self._totals[0] += samples
            self._totals[1] += tokens

    def take(self) -> tuple[float, float]:
        with self._totals.get_lock():
            totals = (self._totals[0], self._totals[1])
        taken, self._taken = self._taken, totals
        return totals[0] - taken[0], totals[1] - taken[1]

    def __getstate__(self) -> dict:
        # The worker process gets the shared totals, not the trainer's bookmark. Shared memory pickles only
        # while a process is being spawned; TRL's start() first test-pickles its arguments, which gets None.
        spawning = multiprocessing.context.get_spawning_popen() is not None
        return {"_totals": self._totals if spawning else None, "_taken": (0.0, 0.0)}


class VersionedRolloutLoop(_AsyncRolloutLoop):
    """TRL's rollout loop, reading the weight version of every completion from the server's headers."""

    def __init__(
        self,
        *,
        version_base: int = 0,
        max_ahead: int = 0,
        counters: RolloutCounters | None = None,
        seed: int | None = None,
        mask_truncated: bool = False,
        **kwargs: Any,
    ):
        if multiprocessing.parent_process() is not None:  # TRL's spawned worker, not a test's main process
            # Ctrl-C reaches the whole process group: the trainer stops this process after its last step.
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1 <pid>`: where is it stuck?
        if seed is not None:  # TRL draws each request's vLLM sampling seed from `random`
            random.seed(seed)
        super().__init__(**kwargs)
        # When the trainer stops us it no longer reads: samples still buffered for the pipe must not hold this
        # process's exit (the trainer would wait out TRL's 15 s join, then kill us).
        self.rollout_buffer.cancel_join_thread()
        self._metrics_queue.cancel_join_thread()
        self._turn_ends = (*self.eos_token_ids, self.tokenizer.pad_token_id)
        self.version_base = version_base  # the published step TRL calls model version 1 (its first sync)
        token = os.environ.get(TOKEN_ENV)
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._rollout_versions: dict[str, int] = {}  # rollout id -> oldest weight version it used
        self.max_ahead = max_ahead  # 0: no bound beyond TRL's own
        self.counters = counters
        self.mask_truncated = mask_truncated
        self._ahead = 0  # rollouts of admitted groups not scored yet (then they are queued until trained)
        self._admitted: set[int] = set()

    async def _wait_for_room(self, group_id: int) -> None:
        """Back-pressure: a group starts only while fewer than `max_ahead` rollouts are generating, being
        scored or queued untrained; its other rollouts then start at once. Whole groups, because a group is
        scored only when all its rollouts are done: admitting rollouts one by one could fill the room with
        parts of groups that never complete (seen: a restarted e2e run hung after one step)."""
        while group_id not in self._admitted:
            if self.max_ahead and self._ahead + self.rollout_buffer.qsize() >= self.max_ahead:
                await asyncio.sleep(0.05)
            else:
                self._admitted.add(group_id)
                self._ahead += self.num_generations

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
        await self._wait_for_room(group_id)  # before the first request: its weight version is the rollout's
        versions: list[int] = []
        _turn_versions.set(versions)  # this task's own context: concurrent rollouts do not mix
        result = await super()._generate_one(prompt, tool_dict, tools, group_id)
        completion_ids, sequences = result[1], result[2]
        # truncated as TRL's clipped_ratio counts it: the last token is no end of turn
        if self.mask_truncated and completion_ids and completion_ids[-1] not in self._turn_ends:
            mask_last_turn(sequences[-1].completion_mask)
        if versions:
            for sequence in sequences:
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
        # No await between here and TRL putting these samples into the queue: they are counted there now.
        self._ahead -= self.num_generations
        self._admitted.discard(group.group_id)
        if self.counters is not None:
            self.counters.add(len(samples), sum(len(ids) for ids in group.completions_ids))
        return samples


def mask_last_turn(mask: list[int]) -> None:
    """Take a row's last turn (the trailing run of 1s of its `completion_mask`) out of the loss."""
    start = len(mask)
    while start and mask[start - 1]:
        start -= 1
    mask[start:] = [0] * (len(mask) - start)


def use_versioned_loop(worker: AsyncRolloutWorker, version_base: int, **loop_kwargs: Any) -> None:
    """Make `worker` (not started yet) run `VersionedRolloutLoop`; TRL's version 1 is step `version_base`.
    `loop_kwargs`: `max_ahead`, `counters`, `seed`, `mask_truncated` (see `VersionedRolloutLoop`)."""
    worker._loop_cls = VersionedRolloutLoop
    worker._loop_kwargs.update(version_base=version_base, **loop_kwargs)
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
