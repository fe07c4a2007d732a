"""Every private name of TRL (pinned: trl==1.16.0) that deltasync.trl uses, and nothing else.

TRL's public surface covers the weight transfer (`AsyncGRPOTrainer(weight_transfer=...)`) and whole rollout
workers (`rollout_worker=`), but stamping rollouts with the weight version that served them, routing them over
several replicas and holding generation back needs its rollout loop's request and scoring steps, and a step's
numbers for the sync root's telemetry come from the trainer's metric sink. Each name below has a canary in
tests/deltasync/trl/test_compat.py, so a TRL upgrade that moves one fails there, not silently here.
"""

from __future__ import annotations

import contextvars
import functools
import types
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import torch

# Importing TRL's async GRPO warns that its API is experimental (we pin trl==1.16.0 and use it knowingly) and,
# on vLLM 0.32, that TRL was tested with vLLM 0.22-0.31 (its rollouts only talk HTTP to vLLM's OpenAI server,
# which 0.32 serves unchanged: the end-to-end tests run it). Both are silenced for this import only.
with warnings.catch_warnings():
    warnings.filterwarnings("ignore", message="You are importing from 'trl.experimental'")
    warnings.filterwarnings("ignore", message="TRL currently supports vLLM versions", category=UserWarning)
    from trl.experimental.async_grpo import async_grpo_trainer, async_rollout_worker, packing
    from trl.experimental.async_grpo.async_rollout_worker import (
        AsyncRolloutWorker,
        RolloutGroup,
        RolloutSample,
        TrainingSequence,
        _AsyncRolloutLoop,
    )
    from trl.trainer import utils as trainer_utils

# The replica base URL serving the rollout running in the current asyncio task (each rollout is its own task).
_rollout_server: contextvars.ContextVar[str | None] = contextvars.ContextVar("rollout_server", default=None)


class HookedRolloutLoop(_AsyncRolloutLoop):
    """TRL's rollout loop (`_AsyncRolloutLoop`), unchanged but for public hooks around its private steps:

    - `await before_rollout(group_id)` before a rollout's first request, then `server_for_rollout()` picks the
      base URL all its requests go to (TRL's own `vllm_server_url` by default);
    - `request_headers()` adds headers to every request; `on_response(headers)` sees each answer's headers (in
      the rollout's task);
    - `after_rollout(completion_ids, sequences)` gets a finished rollout's tokens and training rows, and
      `rollout_finished(server)` is told when a rollout ends, finished or failed;
    - `after_scoring(group, samples)` gets a scored group's samples before TRL queues them, and returns those
      to queue;
    - `request_model()` names the model of each request (TRL's: the model, or `{lora_name}-v{model_version}`),
      read once per request, in the rollout's task.
    """

    @property
    def _request_model(self) -> str:
        return self.request_model()

    def request_model(self) -> str:
        return _AsyncRolloutLoop._request_model.fget(self)  # type: ignore[attr-defined]

    async def before_rollout(self, group_id: int) -> None:
        """Called in the rollout's own task before its first request."""

    def server_for_rollout(self) -> str:
        return self.vllm_server_url

    def request_headers(self) -> Mapping[str, str]:
        return {}

    def on_response(self, headers: Mapping[str, str]) -> None:
        """Called in the rollout's task with each answered request's response headers."""

    def after_rollout(self, completion_ids: list[int], sequences: list[TrainingSequence]) -> None:
        """Called in the rollout's task once it is complete."""

    def rollout_finished(self, server: str) -> None:
        """Called when a rollout served by `server` ends, complete or failed."""

    def after_scoring(self, group: RolloutGroup, samples: list[RolloutSample]) -> list[RolloutSample]:
        """Called with a scored group before TRL queues its samples (no await in between); returns those to
        queue."""
        return samples

    def stopping(self) -> bool:
        """Whether the loop was asked to stop: a hook that waits must then stop waiting, or the loop, which
        lets its rollouts in flight finish, never returns."""
        return self._stop_event.is_set()

    def stop_soon(self) -> None:
        """Ask `run()`, in whichever thread it runs, to return (TRL's worker process does this on stop)."""
        self._loop.call_soon_threadsafe(self._stop_event.set)

    def release_queues_at_exit(self) -> None:
        """Let the process exit with samples and metrics still buffered for a trainer that stopped reading
        (else it waits out TRL's 15 s join on stop, then gets killed)."""
        self.rollout_buffer.cancel_join_thread()
        self._metrics_queue.cancel_join_thread()

    async def _post(self, path: str, payload: dict, timeout: float, max_retries: int = 3) -> dict:
        import aiohttp

        client_timeout = aiohttp.ClientTimeout(total=timeout)
        server = _rollout_server.get() or self.vllm_server_url
        session = self.session
        assert session is not None  # TRL opens it before its first request

        async def post() -> dict:
            async with session.post(
                f"{server}{path}", json=payload, timeout=client_timeout, headers=dict(self.request_headers())
            ) as r:
                r.raise_for_status()
                content = await r.json()
                self.on_response(r.headers)
                return content or {}

        return await self._retry(post, label=f"POST {server}{path}", max_attempts=max_retries)

    async def _generate_one(self, prompt, tool_dict, tools, group_id: int = 0):
        await self.before_rollout(group_id)
        server = self.server_for_rollout()
        _rollout_server.set(server)  # this task's own context: concurrent rollouts do not mix
        try:
            result = await super()._generate_one(prompt, tool_dict, tools, group_id)
        finally:
            self.rollout_finished(server)
        self.after_rollout(result[1], result[2])  # (messages, completion_ids, sequences, ...)
        return result

    async def _score_group(self, group: RolloutGroup) -> list[RolloutSample]:
        return self.after_scoring(group, await super()._score_group(group))


def use_loop(worker: AsyncRolloutWorker, loop_cls: type[HookedRolloutLoop], **loop_kwargs: Any) -> None:
    """Make `worker` (not started yet) run `loop_cls` in its process, with `loop_kwargs` added to TRL's."""
    worker._loop_cls = loop_cls
    worker._loop_kwargs.update(loop_kwargs)
    if not isinstance(worker.stop, functools.partial):
        worker.stop = functools.partial(_stop, worker, worker.stop)  # type: ignore[method-assign]


def loop_kwargs(worker: AsyncRolloutWorker) -> dict[str, Any]:
    """The keyword arguments TRL hands the worker's loop (model_name, vllm_server_url, ...), editable."""
    return worker._loop_kwargs


def _stop(worker: AsyncRolloutWorker, stop: Callable[[], None]) -> None:
    """TRL's `stop()`, minus a hang: it sets a multiprocessing Event that a thread of the worker process waits
    on, and when that process has died (an unreachable env or inference server fails it), `Event.set()`
    blocks forever waiting for the dead waiter to wake. A dead worker needs no signal: reap it and go on."""
    process = worker._process
    if process is not None and worker._failed_event.is_set():
        process.join(timeout=30)  # a failed worker is on its way out: signalling it while it dies would hang
    if process is not None and not process.is_alive():
        worker._process = None
    stop()


def metric_sink(trainer) -> dict[str, list]:
    """The trainer's per-step metric lists (`_metrics["train"]`), which every `log()` empties."""
    return trainer._metrics["train"]


def trained_tokens(trainer) -> float:
    """Tokens trained in the current step (TRL's own counter, read before its flush)."""
    return float(getattr(trainer, "_step_trained_tokens", 0.0))


def replace_flash_attn(varlen: Callable[..., torch.Tensor]) -> None:
    """Tree attention calls `packing._flash_attn().flash_attn_varlen_func` (FA3, from the Hub): `varlen`."""
    packing._flash_attn = lambda: types.SimpleNamespace(flash_attn_varlen_func=varlen)  # type: ignore[assignment]


def skip_peak_flops() -> None:
    """`get_peak_flops_per_device` asks torch.cuda for the device; None skips MFU, as for unknown devices."""
    async_grpo_trainer.get_peak_flops_per_device = lambda *args, **kwargs: None


def score_labelled_positions_only() -> None:
    """TRL's fused LM head (`add_fused_lm_head`) projects and scores only the positions with a label (the
    completions) where `trainer_utils._use_triton(device)`, and every position elsewhere, so that tile shapes
    stay fixed for compilers such as Neuron's. A CPU compiles nothing: there it scores the labelled ones too,
    skipping the LM head and its softmax over the prompts. The kernels' own choice of Triton is unchanged."""
    triton = trainer_utils._use_triton
    trainer_utils._use_triton = lambda device: device.type == "cpu" or triton(device)


def claim_vllm_available() -> None:
    """The rollout worker refuses to start without vLLM installed, though it only speaks HTTP to a server."""
    async_rollout_worker.is_vllm_available = lambda *args, **kwargs: True
