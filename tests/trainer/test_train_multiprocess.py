"""The trainer under `accelerate launch --multi_gpu --num_processes 2` on the CPU (gloo, DDP): one chain, from
the main process.

TRL's AsyncGRPOTrainer calls the weight transfer on the main process only; the trainer also reads the head (to
resume) there alone. Checked: both processes trained, every step was published once by one writer (the head's
writer epoch is the first, its writer the main process), and the replica ends bitwise equal to the trainer's
bf16 weights.
"""

import json
import sys

import pytest

from deltasync.sync.protocol import HEAD_PATH
from tests.helpers import REPO
from tests.trainer.test_train_e2e import services, wait_for_replica
from trainer.processes import log_tail, placement, start_process
from trainer.tiny_model import default_model_dir, ensure_tiny_model

pytestmark = pytest.mark.slow  # starts vLLM

STEPS = 3


def test_two_processes_publish_one_chain(tmp_path):
    model = ensure_tiny_model(default_model_dir())
    root = tmp_path / "root"
    cores = placement()
    with services(tmp_path, root, model) as (env_url, url):
        # accelerate's torchrun launcher (`--multi_gpu`); the trainer's --use_cpu (its CPU default) makes the
        # processes one gloo group on the CPU. (`--cpu` alone would start a single process.)
        argv = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2"]
        argv += ["--mixed_precision", "no", "--num_machines", "1", "--dynamo_backend", "no", "-m", "trainer"]
        argv += [
            "--sync_root",
            str(root),
            "--inference_url",
            url,
            "--env_url",
            env_url,
            "--model",
            str(model),
        ]
        argv += ["--max_steps", str(STEPS), "--output_dir", str(tmp_path / "out"), "--no_progress"]
        argv += ["--reward", "short", "--learning_rate", "2e-4", "--max_tool_calling_iterations", "1"]
        log = tmp_path / "trainer.log"
        proc = start_process(argv, log, cwd=REPO, cpus=cores.others)
        assert proc.wait(timeout=900) == 0, log_tail(log, 5000)
        summary = json.loads((tmp_path / "out" / "summary.json").read_text())
        status = wait_for_replica(url, STEPS)

    assert summary["num_processes"] == 2 and summary["error"] is None
    assert (summary["first_step"], summary["last_step"]) == (0, STEPS)
    # The replica's weights, read back from vLLM's memory, are bitwise the trainer's bf16 weights.
    assert status["readback"]["fingerprint"] == summary["fingerprint"] == summary["head_fingerprint"]
    head = json.loads((root / HEAD_PATH).read_text())
    # One writer ever held the root (a second publisher takes epoch 2), and it was the main process.
    assert head["epoch"] == 1 and head["writer"].startswith(f"pid {summary['writer_pid']} "), head["writer"]
    published = sorted(p.name for p in (root / "telemetry" / "trainer").glob("step-*.json"))
    assert published == [f"step-{s:08d}.json" for s in range(STEPS + 1)]
