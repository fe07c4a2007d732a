"""examples/grpo_bucket.py, a TRL script with a task of its own, run as its docstring prints it for the CPU,
trains 2 steps against a vLLM replica following its sync root; the replica ends bitwise equal to the
trainer's weights. Once with the tiny dense Qwen3 against the inference Space (each step logged once and
changing weights), once with a tiny Qwen3-MoE against stock vLLM followed by `deltasync follow`
(transformers trains its experts fused; the sync root and vLLM hold one tensor per expert).

The trainer's final weights are read from the checkpoint the script saves at its last step (TRL's own
--save_strategy), independently of the publisher's running fingerprint.
"""

import ast
import json
import os
import shlex
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from deltasync import telemetry
from deltasync.codec.fingerprint import format_fingerprint, state_fingerprint
from deltasync.storage import open_storage
from deltasync.sync.protocol import read_head, read_run
from tests.deltasync.vllm.test_follow import following, stock_server
from tests.deltasync.vllm.test_moe import ENV, EXPERT_SIZE, FLAGS
from tests.helpers import REPO, assert_bitwise_equal, wait_for
from tests.trainer.test_train_e2e import PLACEMENT, replica, wait_for_replica
from trainer.processes import log_tail, start_process
from trainer.tiny_model import build_tiny_model, default_model_dir, ensure_tiny_model

pytestmark = pytest.mark.slow  # starts vLLM

STEPS = 2
EXAMPLE = REPO / "examples" / "grpo_bucket.py"


def printed_cpu_command() -> list[str]:
    """The CPU command the example's docstring prints, as argv (its continuation lines joined)."""
    doc = ast.get_docstring(ast.parse(EXAMPLE.read_text()))
    text = doc.replace("\\\n", " ")
    (line,) = (ln for ln in text.splitlines() if "grpo_bucket.py" in ln and "--use_cpu" in ln)
    return shlex.split(line)


def run_example(model: Path, root: Path, url: str, out: Path, *flags: str, script: Path = EXAMPLE) -> str:
    """The example's printed CPU command with this test's model, root, replica and output folder, for STEPS
    steps, saving the model at the last one (`script` in the example's place, `flags` added); its log."""
    argv = printed_cpu_command()
    assert argv[:2] == ["python", "examples/grpo_bucket.py"], argv
    ours = {"--model_name_or_path": str(model), "--sync_root": str(root), "--inference_url": url}
    ours["--output_dir"] = str(out)
    for i, arg in enumerate(argv):
        if arg in ours:
            argv[i + 1] = ours.pop(arg)
    assert not ours, f"the printed command lacks {sorted(ours)}"
    argv = [sys.executable, str(script), *argv[2:], "--max_steps", str(STEPS), "--num_prompts", "64"]
    argv += ["--seed", "1", "--save_strategy", "steps", "--save_steps", str(STEPS), *flags]
    log = out.parent / f"{out.name}.log"
    env = {k: v for k, v in os.environ.items() if k not in ("TRL_EXPERIMENTAL_SILENCE", "PYTHONWARNINGS")}
    proc = start_process(argv, log, env, cwd=REPO, cpus=PLACEMENT.others)
    assert proc.wait(timeout=900) == 0, log_tail(log, 5000)
    return log.read_text()


def assert_each_step_logged_and_trained(log: str, root: Path) -> None:
    """One deltasync line and one reward line per step, no TRL version-range warning, no Triton notice, no
    metrics dict (TRL's go to metrics.jsonl), TRL's rollout worker gone at the end without being killed; every
    delta changed weights."""
    assert "TRL currently supports vLLM" not in log and "Child did not exit" not in log, log[-5000:]
    lines = log.splitlines()
    assert "Triton" not in log and not any(line.startswith("{'") for line in lines), log[-5000:]
    rewards = [line.split("step ")[1].split(":")[0] for line in lines if "grpo_bucket: step" in line]
    assert rewards == [str(step) for step in range(1, STEPS + 1)], log[-5000:]
    published = [line for line in log.splitlines() if "deltasync.sync.publisher: published step" in line]
    assert [line.split("published step ")[1].split(" ")[0] for line in published] == ["0", "1", "2"], log
    for step in range(1, STEPS + 1):
        record = telemetry.from_json(
            telemetry.TrainerRecord, (root / telemetry.TRAINER_DIR / f"step-{step:08d}.json").read_bytes()
        )
        assert record.kind == "delta" and record.changed > 0, record


def test_example_script_trains_against_a_replica(tmp_path):
    model = ensure_tiny_model(default_model_dir())
    root, out = tmp_path / "root", tmp_path / "out"
    with replica(tmp_path, root, model) as url:
        log = run_example(model, root, url, out)
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
    assert_each_step_logged_and_trained(log, root)


def test_example_script_trains_a_moe_model_against_a_follower(tmp_path):
    model = build_tiny_model(tmp_path / "tiny-moe", wordle=True, moe=True, expert_size=EXPERT_SIZE)
    root, out, name = tmp_path / "root", tmp_path / "out", "follower-moe-example"
    # vLLM's own --middleware labels completions with the weight version the follower sets at each step
    flags = (*FLAGS, "--middleware", "deltasync.vllm.headers.WeightVersionHeaders")
    with (
        stock_server(model, tmp_path, *flags, env=ENV) as server,
        following(root, server, tmp_path / "follower.log", name) as follower_log,
    ):
        log = run_example(model, root, server.url, out)
        head = read_head(open_storage(root))
        assert head.step == STEPS  # the cold sync is step 0
        record = root / telemetry.REPLICAS_DIR / name / f"step-{STEPS:08d}.json"
        wait_for(record.exists, f"the follower's record of step {STEPS}; log {follower_log}", 180)
        held = server.readback()  # the HF tensors vLLM's worker holds, read back through the engine
        body = {"model": str(model), "prompt": [5, 6, 7], "max_tokens": 1}
        labels = server.post("/v1/completions", body).headers
    assert telemetry.from_json(telemetry.ReplicaRecord, record.read_bytes()).verified
    assert (labels["x-weight-version"], labels["x-weight-version-end"]) == (str(STEPS), str(STEPS))
    for step in range(1, STEPS + 1):  # every trained rollout's version came from the server
        info = telemetry.from_json(
            telemetry.TrainerRecord, (root / telemetry.TRAINER_DIR / f"step-{step:08d}.json").read_bytes()
        ).info
        assert info["version_known"] == 1.0, info

    trained = load_file(out / f"checkpoint-{STEPS}" / "model.safetensors")  # save_pretrained's names
    assert "model.layers.1.mlp.experts.7.gate_proj.weight" in trained
    state = {n: t.to(torch.bfloat16) for n, t in trained.items()}
    assert_bitwise_equal(held, state)
    assert head.fingerprint == format_fingerprint(state_fingerprint(state))
    assert_each_step_logged_and_trained(log, root)
    # The follower says how each tensor is written: the experts through vLLM's prepacked layout.
    line = next(line for line in follower_log.read_text().splitlines() if "tensors written in place" in line)
    summary = json.loads(line.split("tensors written in place: ")[1])
    experts = sum(".experts." in n for n in state)  # 2 layers x 8 experts x 3 projections
    assert summary["counts"] == {"direct": len(state) - experts, "packed": experts, "loader": 0}
