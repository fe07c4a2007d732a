"""TRL's rollout worker for replicas that follow a sync root: rollouts stamped with the weights that served
them, spread over several replicas, and generation held close to training.

A replica following the root labels every completion with the weight versions (published steps) it ran
under: the `x-weight-version` header (when the request arrived) and `x-weight-version-end` (when it was
complete; absent on a streamed response). TRL's worker ignores them and tags a rollout with the version the
TRAINER last sent, which says nothing about when the replica applied it. `VersionedRolloutLoop` keeps TRL's
loop and request body and:

- adds the bearer token (INFERENCE_API_TOKEN, read in the worker process, never logged or pickled),
- stamps each rollout's samples with the OLDEST version any of its turns ran under, as reported by the replica
  that served it, so TRL's `max_staleness` filter and its `sample/staleness_*` metrics measure real staleness,
- sends each rollout (all its turns) to the replica with the fewest rollouts in flight (`replica_urls`),
- applies back-pressure: a group of rollouts starts only while fewer than `max_ahead` rollouts are generating,
  waiting to be scored or waiting in the queue for the trainer (TRL's loop refills its in-flight slots as soon
  as a rollout ends and stops only once its queue AND its 16-group scoring queue are full, so generation runs
  steps ahead of training and its rollouts go stale),
- counts what it generated (`RolloutCounters`), so the trainer can tell per step how much of it was trained,
- optionally leaves out of the loss a final turn cut off by `max_completion_length` (`mask_truncated`: TRL's
  GRPOTrainer flag `mask_truncated_completions`, which the async trainer lacks); a sample with no turn left
  to train is not queued,
- optionally never reinforces giving up: `quit_early(messages)` (the task's) tells a rollout whose last
  turn ended it before its task did (e.g. no guess while the game was still on); where such a rollout's
  advantage is positive, that turn is left out of the loss. TRL trains every turn with its rollout's
  advantage, so an early quit in a game that beat its group was reinforced, and quitting spread until no game
  was played at all,
- in adapter mode (a transfer with a LoRA adapter), names each request's adapter version
  (`{lora_name}-v{step}`), which is then the turn's exact weight version, whatever the server.

`stamp_rollouts(trainer, transfer, ...)` installs it on an AsyncGRPOTrainer built with a BucketWeightTransfer.
"""

from __future__ import annotations

import asyncio
import contextvars
import faulthandler
import math
import multiprocessing
import os
import random
import re
import signal
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from deltasync.sync.protocol import MAX_INT, adapter_name
from deltasync.trl import compat
from deltasync.trl.compat import HookedRolloutLoop, RolloutGroup, RolloutSample, TrainingSequence
from deltasync.trl.preflight import TOKEN_ENV
from deltasync.trl.transfer import BucketWeightTransfer

VERSION_HEADERS = ("x-weight-version", "x-weight-version-end")
STEP_DIGITS = re.compile(r"[0-9]{1,19}")  # (str.isdigit() also takes "²", and int() of it raises)
# per-sample metric keys; TRL averages them per micro-batch in its collator
WEIGHT_VERSION = "deltasync/weight_version"
VERSION_KNOWN = "deltasync/version_known"
REWARD_SQ = "deltasync/reward_sq"

# The versions seen by the rollout running in the current asyncio task (each rollout is its own task).
_turn_versions: contextvars.ContextVar[list[int] | None] = contextvars.ContextVar(
    "turn_versions", default=None
)


def parse_version(value: str | None) -> int | None:
    """A published step, or None: a server that has not applied any step yet labels its weights `model`;
    anything but ASCII digits of a step a head can hold (see deltasync.sync.protocol) is no version."""
    if value is None or not STEP_DIGITS.fullmatch(value):
        return None
    step = int(value)
    return step if step <= MAX_INT else None


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


class ReplicaRouter:
    """Picks, for each new rollout, the replica with the fewest rollouts in flight (the first on a tie).

    A rollout keeps its replica for all its turns: the replica's prefix cache holds the conversation so far,
    and its requests go one at a time, so rollouts in flight are the replica's outstanding requests (plus
    those between two turns, waiting on a tool)."""

    def __init__(self, urls: Sequence[str]):
        if not urls:
            raise ValueError("ReplicaRouter: no replica URL")
        self.in_flight = {url.rstrip("/"): 0 for url in urls}

    def pick(self) -> str:
        url = min(self.in_flight, key=self.in_flight.__getitem__)
        self.in_flight[url] += 1
        return url

    def release(self, url: str) -> None:
        self.in_flight[url] -= 1


class VersionedRolloutLoop(HookedRolloutLoop):
    """TRL's rollout loop, reading the weight version of every completion from the replica's headers."""

    def __init__(
        self,
        *,
        version_base: int = 0,
        max_ahead: int = 0,
        counters: RolloutCounters | None = None,
        seed: int | None = None,
        mask_truncated: bool = False,
        quit_early: Callable[[list[dict]], bool] | None = None,
        replica_urls: Sequence[str] = (),
        **kwargs: Any,
    ):
        if multiprocessing.parent_process() is not None:  # TRL's spawned worker, not a test's main process
            # Ctrl-C reaches the whole process group: the trainer stops this process after its last step.
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1 <pid>`: where is it stuck?
        if seed is not None:  # TRL draws each request's vLLM sampling seed from `random`
            random.seed(seed)
        super().__init__(**kwargs)
        self.release_queues_at_exit()
        self._turn_ends = (*self.eos_token_ids, self.tokenizer.pad_token_id)
        self.version_base = version_base  # the published step TRL calls model version 1 (its first sync)
        token = os.environ.get(TOKEN_ENV)
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.router = ReplicaRouter(replica_urls or [self.vllm_server_url])
        self._rollout_versions: dict[str, int] = {}  # rollout id -> oldest weight version it used
        self.max_ahead = max_ahead  # 0: no bound beyond TRL's own
        self.counters = counters
        self.mask_truncated = mask_truncated
        self.quit_early = quit_early
        self._ahead = 0  # rollouts of admitted groups not scored yet (then they are queued until trained)
        self.held_back = 0  # times a group found no room and waited: generation running ahead of training
        self._admitted: set[int] = set()

    async def before_rollout(self, group_id: int) -> None:
        """Back-pressure: a group starts only while fewer than `max_ahead` rollouts are generating, being
        scored or queued untrained; its other rollouts then start at once. Whole groups, because a group is
        scored only when all its rollouts are done: admitting rollouts one by one could fill the room with
        parts of groups that never complete."""
        while group_id not in self._admitted and not self.stopping():  # at the end, nothing to hold back
            if self.max_ahead and self._ahead + self.rollout_buffer.qsize() >= self.max_ahead:
                self.held_back += 1
                await asyncio.sleep(0.05)
            else:
                self._admitted.add(group_id)
                self._ahead += self.num_generations
        _turn_versions.set([])  # before the first request: its weight version is the rollout's

    def server_for_rollout(self) -> str:
        return self.router.pick()

    def rollout_finished(self, server: str) -> None:
        self.router.release(server)

    def request_headers(self) -> Mapping[str, str]:
        return self._headers

    def request_model(self) -> str:
        """Adapter mode: the adapter of the published step TRL's version stands for, which is then this
        turn's weight version (exact, whatever the server)."""
        if self.lora_name is None:
            return self.model_name
        step = self.model_version - 1 + self.version_base
        seen = _turn_versions.get()
        if seen is not None:
            seen.append(step)
        return adapter_name(self.lora_name, step)

    def on_response(self, headers: Mapping[str, str]) -> None:
        seen = _turn_versions.get()
        if seen is not None:
            seen += [v for h in VERSION_HEADERS if (v := parse_version(headers.get(h))) is not None]

    def after_rollout(self, completion_ids: list[int], sequences: list[TrainingSequence]) -> None:
        # truncated as TRL's clipped_ratio counts it: the last token is no end of turn
        if self.mask_truncated and completion_ids and completion_ids[-1] not in self._turn_ends:
            mask_last_turn(sequences[-1].completion_mask)
        versions = _turn_versions.get()
        if versions:
            for sequence in sequences:
                self._rollout_versions[sequence.rollout_id] = min(versions)

    def after_scoring(self, group: RolloutGroup, samples: list[RolloutSample]) -> list[RolloutSample]:
        # TRL emits one sample per training row, conversation by conversation, row by row.
        rows = [sequence for sequences in group.completions_sequences for sequence in sequences]
        if self.quit_early is not None:
            self._mask_quits(group, samples)
        for sample, row in zip(samples, rows, strict=True):
            version = self._rollout_versions.pop(row.rollout_id, None)
            reward = sample.metrics["reward"]
            sample.metrics[REWARD_SQ] = reward * reward
            sample.metrics[VERSION_KNOWN] = float(version is not None)
            if version is not None:
                sample.metrics[WEIGHT_VERSION] = float(version)
                # TRL counts syncs: its version 1 is the first published step of this run.
                sample.model_version = version - self.version_base + 1
        # Counted as queued from here: TRL puts these samples into the queue with no await in between.
        self._ahead -= self.num_generations
        self._admitted.discard(group.group_id)
        if self.counters is not None:
            self.counters.add(len(samples), sum(len(ids) for ids in group.completions_ids))
        # A sample whose every turn the masks above took out has no loss term, and TRL's loss fails on a row
        # without one (`segment_id.max()` of nothing): such a sample is not queued.
        return [sample for sample in samples if np.any(sample.completion_mask)]

    def _mask_quits(self, group: RolloutGroup, samples: list[RolloutSample]) -> None:
        """Leave out of the loss the last turn of each rollout that quit early with a positive advantage."""
        assert self.quit_early is not None
        end = 0
        for messages, sequences in zip(group.completions, group.completions_sequences, strict=True):
            end += len(sequences)  # the rollout's rows end here; its last turn is in its last row
            last = samples[end - 1]
            if last.advantage > 0 and self.quit_early(messages):
                mask_last_turn(last.completion_mask)


def mask_last_turn(mask: list[int] | np.ndarray) -> None:
    """Take a row's last turn (the trailing run of 1s of its `completion_mask`) out of the loss."""
    start = len(mask)
    while start and mask[start - 1]:
        start -= 1
    mask[start:] = [0] * (len(mask) - start)


def rollouts_ahead(args, steps_ahead: float) -> int:
    """Back-pressure bound in rollouts for `steps_ahead` optimizer steps' worth of rollouts (0: none), in
    whole groups. Fills TRL's `max_inflight_tasks` and `queue_maxsize` where `args` (an AsyncGRPOConfig,
    before the trainer is built) leaves them at their defaults."""
    if steps_ahead <= 0:
        return 0
    per_step = args.per_device_train_batch_size * args.gradient_accumulation_steps * max(args.world_size, 1)
    # whole groups: a group is scored (and queued) only once all its rollouts are done
    groups = max(1, math.ceil(steps_ahead * per_step / args.num_generations))
    ahead = groups * args.num_generations
    if args.max_inflight_tasks < 0:
        args.max_inflight_tasks = ahead
    if args.queue_maxsize == type(args).__dataclass_fields__["queue_maxsize"].default:
        args.queue_maxsize = ahead
    return ahead


def step_info(trainer, counters: RolloutCounters | None = None) -> dict[str, float]:
    """The numbers of the step just finished for its telemetry record, from TRL's metric sink.

    At a sync the sink holds exactly this step's values (with logging_steps=1: `log()` empties it after the
    sync). Per micro-batch: the collator's means of the per-sample metrics; per sample: TRL's staleness, which
    the versioned loop bases on the weight version the replica reported. Rollouts (training rows) and tokens:
    generated by the rollout worker since the last step (`counters`), trained in this step, and dropped by TRL
    as too stale.
    """
    if trainer is None:
        return {}
    metrics = compat.metric_sink(trainer)
    info: dict[str, float] = {}
    staleness = [s for s in metrics.get("sample/staleness_mean", []) if not math.isnan(s)]
    if staleness:
        info["staleness_steps_mean"] = sum(staleness) / len(staleness)
        info["staleness_steps_max"] = max(staleness)
    counts = [n * trainer.accelerator.num_processes for n in metrics.get("batch/samples_per_row", [])]
    for key, name in (("reward", "reward_mean"), (REWARD_SQ, "_reward_sq"), (VERSION_KNOWN, "version_known")):
        pairs = [(v, n) for v, n in zip(metrics.get(key, []), counts, strict=False) if not math.isnan(v)]
        if pairs:
            info[name] = sum(v * n for v, n in pairs) / sum(n for _, n in pairs)
    if "_reward_sq" in info:
        info["reward_std"] = math.sqrt(max(info.pop("_reward_sq") - info["reward_mean"] ** 2, 0.0))
    info["rollouts_trained"] = float(sum(counts))
    info["rollouts_dropped"] = float(sum(metrics.get("sample/dropped_stale_total", [])))
    info["tokens_trained"] = compat.trained_tokens(trainer)
    if counters is not None:
        info["rollouts_generated"], info["tokens_generated"] = counters.take()
    return info


def stamp_rollouts(
    trainer,
    transfer: BucketWeightTransfer,
    replica_urls: Sequence[str] = (),
    model_name: str | None = None,
    **loop_kwargs: Any,
) -> RolloutCounters:
    """Make `trainer` (an AsyncGRPOTrainer built with `weight_transfer=transfer`, not trained yet) generate
    with `VersionedRolloutLoop` and publish each step's numbers (`step_info`) with its telemetry record, under
    the model's checkpoint names (`BucketWeightTransfer.use_model`).

    replica_urls: every replica's base URL (default: TRL's vllm_server_base_url alone); model_name: the name
    the replicas serve the model under (default TRL's, the model's id). `loop_kwargs`: `max_ahead`, `seed`,
    `mask_truncated` (see `VersionedRolloutLoop`). Returns the counters of generated rollouts and tokens.
    """
    counters = RolloutCounters()
    transfer.use_model(trainer.accelerator.unwrap_model(trainer.model))
    trainer.args.logging_steps = 1  # step_info reads TRL's metric sink, which every log() empties
    if transfer.info is None:
        transfer.info = lambda: step_info(trainer, counters)
    worker = trainer.rollout_worker
    if worker is None:  # not the main process: TRL builds the worker on rank 0 only
        return counters
    kwargs = {"replica_urls": [u.rstrip("/") for u in replica_urls], "counters": counters, **loop_kwargs}
    if model_name:
        kwargs["model_name"] = model_name
    if transfer.adapter is not None:  # adapter mode: each request names the adapter of its step
        kwargs["lora_name"] = transfer.lora_name
    # The base is the cold sync's step (TRL's model version 1), known before the worker starts.
    compat.use_loop(worker, VersionedRolloutLoop, version_base=0, **kwargs)
    previous = transfer.on_first_step

    def first_step(step: int) -> None:
        compat.loop_kwargs(worker)["version_base"] = step
        if previous is not None:
            previous(step)

    transfer.on_first_step = first_step
    return counters
