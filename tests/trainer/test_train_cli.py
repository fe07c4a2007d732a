"""`python -m trainer`: flags and config file, Ctrl-C handling, the numbers each step publishes."""

import signal
import subprocess
import sys
from collections import defaultdict
from types import SimpleNamespace

import pytest

from trainer.rollout import REWARD_SQ, VERSION_KNOWN
from trainer.train import GracefulStop, TrainConfig, main, step_info

REQUIRED = ["--sync-root", "root", "--inference-url", "http://infer", "--env-url", "http://env"]


def parse(argv: list[str]) -> TrainConfig:
    from trl import TrlParser

    (cfg, *_) = TrlParser((TrainConfig,)).parse_args_and_config(argv)
    return cfg.resolve()


def test_help_documents_every_flag():
    argv = [sys.executable, "-m", "trainer", "--help"]
    out = subprocess.run(argv, capture_output=True, text=True, check=True)
    for flag in ("--sync-root", "--inference-url", "--env-url", "--model", "--max-steps", "--output-dir"):
        assert flag in out.stdout
    assert "--config" in out.stdout and "INFERENCE_API_TOKEN" in out.stdout and "HF_TOKEN" in out.stdout


def test_flags_override_the_config_file(tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text("max_steps: 7\nlearning_rate: 3.0e-6\nreward: short\n")
    cfg = parse([*REQUIRED, "--config", str(config), "--max-steps", "9"])
    assert (cfg.max_steps, cfg.learning_rate, cfg.reward) == (9, 3e-6, "short")


def test_device_defaults_on_cpu():
    cfg = parse(REQUIRED)
    assert cfg.model == "tiny" and cfg.learning_rate == 1e-5 and cfg.bf16 is False
    assert (cfg.num_generations, cfg.batch_size, cfg.max_completion_length, cfg.max_inflight) == (4, 8, 64, 8)
    assert parse([*REQUIRED, "--model", "Qwen/Qwen3-0.6B"]).learning_rate == 1e-6


def test_required_flags(capsys):
    with pytest.raises(SystemExit, match="--inference-url, --env-url"):
        main(["--sync-root", "root"])


def test_first_ctrl_c_stops_after_the_step_second_aborts_but_never_inside_a_publish():
    stop = GracefulStop()
    stop._handle(signal.SIGINT, None)
    assert stop.requested  # training finishes the step in progress, publishes it, and stops
    with pytest.raises(KeyboardInterrupt):
        stop._handle(signal.SIGINT, None)
    with pytest.raises(KeyboardInterrupt), stop.guard():
        stop._handle(signal.SIGINT, None)  # deferred: the copy into the publisher's buffer completes first
        published = True
    assert published


def test_step_info_from_trls_metric_sink():
    metrics = defaultdict(list)
    # two micro-batches of 6 and 2 rollouts; the collator appends each one's means
    metrics["batch/samples_per_row"] += [6.0, 2.0]
    metrics["reward"] += [0.5, 1.0]
    metrics[REWARD_SQ] += [0.5, 1.0]  # rewards are 0 or 1
    metrics[VERSION_KNOWN] += [1.0, 0.5]
    metrics["sample/staleness_mean"] += [0.0, 1.0, 1.0, 2.0, 1.0, 1.0, 0.0, 2.0]  # one per rollout
    trainer = SimpleNamespace(_metrics={"train": metrics}, accelerator=SimpleNamespace(num_processes=1))
    info = step_info(trainer)
    assert info["reward_mean"] == pytest.approx(0.625) and info["samples"] == 8
    assert info["reward_std"] == pytest.approx((0.625 * 0.375) ** 0.5)
    assert info["staleness_steps_mean"] == 1.0 and info["staleness_steps_max"] == 2.0
    assert info["version_known"] == pytest.approx(0.875)
    assert step_info(None) == {}
