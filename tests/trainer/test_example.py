"""examples/grpo_bucket.py, a TRL script with a task of its own, trains 3 steps on the CPU against a vLLM
replica following its sync root; the replica ends bitwise equal to the trainer's weights.

The trainer's final weights are read from the checkpoint the script saves at its last step (TRL's own
--save_strategy), independently of the publisher's running fingerprint.
"""

import sys

import pytest
import torch
from transformers import AutoModelForCausalLM

from deltasync.codec.fingerprint import format_fingerprint, state_fingerprint
from deltasync.storage import open_storage
from deltasync.sync.protocol import read_head, read_run
from tests.helpers import REPO
from tests.trainer.test_train_e2e import PLACEMENT, replica, wait_for_replica
from trainer.processes import log_tail, start_process
from trainer.tiny_model import default_model_dir, ensure_tiny_model

pytestmark = pytest.mark.slow  # starts vLLM

STEPS = 3


def test_example_script_trains_against_a_replica(tmp_path):
    model = ensure_tiny_model(default_model_dir())
    root, out = tmp_path / "root", tmp_path / "out"
    with replica(tmp_path, root, model) as url:
        argv = [sys.executable, str(REPO / "examples" / "grpo_bucket.py"), "--model_name_or_path", str(model)]
        argv += ["--sync_root", str(root), "--inference_url", url, "--output_dir", str(out)]
        argv += ["--max_steps", str(STEPS), "--save_strategy", "steps", "--save_steps", str(STEPS)]
        argv += ["--use_cpu", "--bf16", "false", "--gradient_checkpointing", "false", "--token_budget", "0"]
        argv += ["--num_generations", "4", "--per_device_train_batch_size", "8", "--num_prompts", "64"]
        argv += ["--max_completion_length", "16", "--learning_rate", "1e-4", "--seed", "1"]
        argv += ["--report_to", "none"]
        log = tmp_path / "example.log"
        proc = start_process(argv, log, cwd=REPO, cpus=PLACEMENT.others)
        assert proc.wait(timeout=900) == 0, log_tail(log, 5000)
        storage = open_storage(root)
        head = read_head(storage)
        assert head.step == STEPS  # the cold sync is step 0
        status = wait_for_replica(url, STEPS)

    trained = AutoModelForCausalLM.from_pretrained(out / f"checkpoint-{STEPS}", dtype=torch.float32)
    params = dict(trained.named_parameters())
    state = ((name, params[name].detach().to(torch.bfloat16)) for name in read_run(storage).schema)
    # The replica's weights, read back from vLLM's memory, are bitwise the trainer's bf16 weights.
    trainer_fingerprint = format_fingerprint(state_fingerprint(state))
    assert status["readback"]["fingerprint"] == head.fingerprint == trainer_fingerprint
