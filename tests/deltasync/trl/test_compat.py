"""Canaries: each private TRL name deltasync.trl.compat relies on is still there, in the shape it expects.

A TRL upgrade that renames or reshapes one fails here, instead of the integration silently doing nothing."""

import inspect
import re

from trl.experimental.async_grpo import async_grpo_trainer, async_rollout_worker, packing
from trl.experimental.async_grpo.async_grpo_trainer import AsyncGRPOTrainer
from trl.experimental.async_grpo.async_rollout_worker import AsyncRolloutWorker, _AsyncRolloutLoop


def params(function) -> list[str]:
    return list(inspect.signature(function).parameters)


def assigns(function, attribute: str) -> bool:
    return re.search(rf"self\.{attribute}(: [^=]+)? =", inspect.getsource(function)) is not None


def test_rollout_loop_class():
    assert inspect.isclass(_AsyncRolloutLoop) and inspect.isclass(AsyncRolloutWorker)


def test_rollout_loop_post():
    assert params(_AsyncRolloutLoop._post) == ["self", "path", "payload", "timeout", "max_retries"]
    assert inspect.iscoroutinefunction(_AsyncRolloutLoop._post)


def test_rollout_loop_generate_one():
    assert params(_AsyncRolloutLoop._generate_one) == ["self", "prompt", "tool_dict", "tools", "group_id"]
    # HookedRolloutLoop reads the completion ids and the training rows at positions 1 and 2
    returns = str(inspect.signature(_AsyncRolloutLoop._generate_one).return_annotation)
    assert re.match(r"tuple\[list\[dict\[str, str\]\], list\[int\], list\[[\w.]*TrainingSequence\]", returns)


def test_rollout_loop_score_group():
    assert params(_AsyncRolloutLoop._score_group) == ["self", "group"]


def test_rollout_loop_retry():
    assert params(_AsyncRolloutLoop._retry) == ["self", "coro_factory", "label", "max_attempts"]


def test_rollout_loop_session_and_server_url():
    assert "self.session = session" in inspect.getsource(_AsyncRolloutLoop._run_loops)
    assert assigns(_AsyncRolloutLoop.__init__, "vllm_server_url")


def test_rollout_loop_request_model():
    # a property, read once per request to name its model; adapter mode names `{lora_name}-v{version}`
    assert isinstance(_AsyncRolloutLoop._request_model, property)
    assert '"model": self._request_model,' in inspect.getsource(_AsyncRolloutLoop._generate_one_turn)


def test_rollout_loop_metrics_queue():
    assert assigns(_AsyncRolloutLoop.__init__, "_metrics_queue")


def test_rollout_loop_event_loop_and_stop_event():
    assert assigns(_AsyncRolloutLoop.__init__, "_loop") and assigns(_AsyncRolloutLoop.__init__, "_stop_event")


def test_worker_loop_cls():
    assert AsyncRolloutWorker._loop_cls is _AsyncRolloutLoop
    assert "self._loop_cls," in inspect.getsource(AsyncRolloutWorker.start)


def test_worker_loop_kwargs():
    assert assigns(AsyncRolloutWorker.__init__, "_loop_kwargs")


def test_worker_process():
    assert assigns(AsyncRolloutWorker.__init__, "_process")
    assert "self._stop_event_mp.set()" in inspect.getsource(AsyncRolloutWorker.stop)


def test_worker_failed_event():
    assert assigns(AsyncRolloutWorker.__init__, "_failed_event")


def test_trainer_metrics():
    assert 'self._metrics["train"]' in inspect.getsource(AsyncGRPOTrainer.log)


def test_trainer_step_trained_tokens():
    assert assigns(AsyncGRPOTrainer.__init__, "_step_trained_tokens")


def test_packing_flash_attn():
    assert callable(packing._flash_attn) and callable(packing.tree_attention)
    assert "_flash_attn().flash_attn_varlen_func" in inspect.getsource(packing)


def test_peak_flops_per_device():
    assert callable(async_grpo_trainer.get_peak_flops_per_device)


def test_is_vllm_available():
    assert callable(async_rollout_worker.is_vllm_available)
    assert "is_vllm_available()" in inspect.getsource(AsyncRolloutWorker.__init__)
