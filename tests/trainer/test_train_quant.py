"""`python -m trainer --quantization fp8_per_channel`: TRL's AsyncGRPOTrainer, through `BucketWeightTransfer`,
publishes a quantized root that the inference Space (QUANTIZATION, set before run.json exists) follows in
stock vLLM started with --quantization fp8_per_channel: 3 steps, each applied and verified on the replica,
whose fp8 codes, scales and bf16 tensors read back are the head's quantized fingerprint, and every trained
rollout's weight version known. test_train_e2e's run, with the recipe added (the tiny dense Qwen3)."""

import pytest

from deltasync import telemetry
from deltasync.storage import open_storage
from deltasync.sync.protocol import read_head
from tests.trainer import test_train_e2e
from tests.trainer.test_train_e2e import RESUME_STEPS, records, run_trainer, services, wait_for_replica
from trainer.tiny_model import default_model_dir, ensure_tiny_model

pytestmark = pytest.mark.slow  # starts vLLM

RECIPE = "fp8_per_channel"


def test_trainer_into_a_quantized_replica(tmp_path, monkeypatch):
    model, root = ensure_tiny_model(default_model_dir()), tmp_path / "root"
    monkeypatch.setenv("QUANTIZATION", RECIPE)  # the Space's, inherited: it starts before the trainer
    flags = [*test_train_e2e.TRAINER_FLAGS, "--quantization", RECIPE]
    monkeypatch.setattr(test_train_e2e, "TRAINER_FLAGS", flags)
    with services(tmp_path, root, model) as (env_url, inference_url):
        summary = run_trainer(root, inference_url, env_url, model, tmp_path / "run", RESUME_STEPS)
        status = wait_for_replica(inference_url, RESUME_STEPS)
    head = read_head(open_storage(root))
    assert (summary["first_step"], summary["last_step"], summary["error"]) == (0, RESUME_STEPS, None)
    # read back from vLLM's memory: the codes and scales of the trainer's bf16 weights, quantized
    assert status["quantization"] == RECIPE
    assert status["readback"]["fingerprint"] == head.entries[-1].quantized != head.fingerprint
    applied = records(root, telemetry.ReplicaRecord, f"{telemetry.REPLICAS_DIR}/{test_train_e2e.REPLICA}")
    assert sorted(applied) == list(range(RESUME_STEPS + 1))
    assert all(r.verified and r.error is None for r in applied.values()), applied
    trained = records(root, telemetry.TrainerRecord, telemetry.TRAINER_DIR)
    infos = [trained[step].info for step in range(1, RESUME_STEPS + 1)]
    assert all(info["version_known"] == 1.0 for info in infos), infos
