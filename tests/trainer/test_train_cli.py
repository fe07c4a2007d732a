"""`python -m trainer`: flags and config file, Ctrl-C handling, the numbers each step publishes."""

import signal
import subprocess
import sys
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from deltasync.sync.signing import SigningKey
from deltasync.sync.subscriber import SyncError
from deltasync.trl import RolloutCounters, rollouts_ahead, step_info
from deltasync.trl.rollout import REWARD_SQ, VERSION_KNOWN
from tests.deltasync.sync.test_signing import Trainer, forge_step
from tests.helpers import SHAPES, assert_bitwise_equal
from trainer.train import GracefulStop, continue_from_head, failure_line, main, parse_args, pinned_revision

REQUIRED = ["--sync_root", "root", "--inference_url", "http://infer", "--env_url", "http://env"]


def test_help_shows_trls_own_flags_and_ours():
    argv = [sys.executable, "-m", "trainer", "--help"]
    out = subprocess.run(argv, capture_output=True, text=True, check=True)
    for flag in ("--sync_root", "--inference_url", "--env_url", "--model", "--reward", "--encoding"):
        assert flag in out.stdout  # ours
    for flag in ("--max_steps", "--output_dir", "--learning_rate", "--max_grad_norm", "--max_staleness"):
        assert flag in out.stdout  # TRL's AsyncGRPOConfig, unchanged
    assert "--config" in out.stdout and "INFERENCE_API_TOKEN" in out.stdout and "HF_TOKEN" in out.stdout


def test_a_trl_flag_the_project_never_mentions_reaches_the_config():
    ours, args = parse_args([*REQUIRED, "--max_grad_norm", "0.3", "--adam_beta2", "0.98"])
    assert (args.max_grad_norm, args.adam_beta2) == (0.3, 0.98)
    assert ours.sync_root == "root"


def test_flags_override_the_config_file(tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text("max_steps: 7\nlearning_rate: 3.0e-6\nreward: short\nmax_grad_norm: 0.5\n")
    ours, args = parse_args([*REQUIRED, "--config", str(config), "--max-steps", "9"])
    assert (args.max_steps, args.learning_rate, ours.reward, args.max_grad_norm) == (9, 3e-6, "short", 0.5)


def test_project_defaults_on_cpu_unless_set():
    ours, args = parse_args(REQUIRED)
    assert ours.model == "tiny" and args.learning_rate == 1e-5 and args.bf16 is False and args.use_cpu
    assert (args.num_generations, args.per_device_train_batch_size, args.max_completion_length) == (4, 8, 64)
    assert (args.output_dir, args.max_steps, args.token_budget) == ("runs/trainer", 200, 0)
    assert args.save_strategy == "no"
    assert parse_args([*REQUIRED, "--model", "Qwen/Qwen3-0.6B"])[1].learning_rate == 1e-6
    _, args = parse_args([*REQUIRED, "--learning_rate", "3e-4", "--num_generations", "6"])
    assert (args.learning_rate, args.num_generations) == (3e-4, 6)


def test_back_pressure_bounds_trls_queue_and_inflight_tasks():
    # 16 rollouts per step, groups of 8: half a step ahead is one group
    ours, args = parse_args([*REQUIRED, "--per_device_train_batch_size", "16", "--num_generations", "8"])
    assert rollouts_ahead(args, ours.rollouts_ahead) == 8
    assert (args.max_inflight_tasks, args.queue_maxsize) == (8, 8)
    ours, args = parse_args([*REQUIRED, "--rollouts_ahead", "1.2", "--queue_maxsize", "100"])
    assert rollouts_ahead(args, ours.rollouts_ahead) == 12
    assert (args.max_inflight_tasks, args.queue_maxsize) == (12, 100)
    ours, args = parse_args([*REQUIRED, "--rollouts_ahead", "0"])  # TRL's own bounds
    assert rollouts_ahead(args, ours.rollouts_ahead) == 0
    assert (args.max_inflight_tasks, args.queue_maxsize) == (-1, 1024)


def test_several_inference_urls():
    argv = ["--sync_root", "root", "--env_url", "http://env", "--inference_url", "http://a/", "http://b"]
    assert parse_args(argv)[0].inference_url == ["http://a", "http://b"]
    argv = ["--sync_root", "root", "--env_url", "http://env", "--inference_url", "http://a,http://b"]
    assert parse_args(argv)[0].inference_url == ["http://a", "http://b"]
    assert parse_args(REQUIRED)[0].inference_url == ["http://infer"]


def test_quantization_names_a_recipe_the_publisher_gets(capsys):
    assert parse_args(REQUIRED)[0].quantization is None  # bf16
    assert parse_args([*REQUIRED, "--quantization", "fp8_per_channel"])[0].quantization == "fp8_per_channel"
    with pytest.raises(SystemExit):
        parse_args([*REQUIRED, "--quantization", "fp8"])
    assert "invalid choice: 'fp8'" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="^--quantization and --lora_r: a LoRA root is never quantized$"):
        parse_args([*REQUIRED, "--quantization", "fp8_per_channel", "--lora_r", "8"])


def test_signing_keys_reach_the_publisher_and_the_trainer_resumes_only_from_its_own_heads(tmp_path):
    """--signing_key and --previous_signing_key go into PublisherConfig; a trainer that signs continues from
    a head its keys signed, never from a bucket writer's (whose weights it would otherwise train and sign)."""
    paths, publics = [], []
    for name in ("trainer", "next"):
        key = SigningKey.generate()
        key.save(tmp_path / f"{name}.key")
        paths.append(str(tmp_path / f"{name}.key"))
        publics.append(key.public)
    ours = parse_args([*REQUIRED, "--signing_key", paths[0]])[0]
    config = ours.publisher_config()
    assert (config.signing_key, config.previous_signing_key) == (paths[0], None)
    rotated = parse_args([*REQUIRED, "--signing_key", paths[1], "--previous_signing_key", paths[0]])[0]
    assert rotated.publisher_config().previous_signing_key == paths[0]
    assert rotated.own_keys().keys == (publics[1], publics[0])
    assert parse_args(REQUIRED)[0].publisher_config().signing_key is None
    assert parse_args(REQUIRED)[0].own_keys().keys == ()
    with pytest.raises(SystemExit, match="^--previous_signing_key rotates to a --signing_key: give both$"):
        parse_args([*REQUIRED, "--previous_signing_key", paths[0]])

    class Model:  # what continue_from_head reads of a model: its parameters by name
        def __init__(self):
            self.params = {n: torch.nn.Parameter(torch.zeros(s)) for n, s in SHAPES.items()}

        def named_parameters(self):
            return iter(self.params.items())

    trainer = Trainer(tmp_path / "root", paths[0])
    for step in range(2):
        trainer.step(step)
    model = Model()
    continue_from_head(model, str(tmp_path / "root"), adapter=False, trust=ours.own_keys())
    assert_bitwise_equal({n: p.data.bfloat16() for n, p in model.params.items()}, trainer.states[1])
    forge_step(tmp_path / "root", trainer, SigningKey.generate())
    model = Model()
    with pytest.raises(SyncError, match="a key this replica does not trust"):
        continue_from_head(model, str(tmp_path / "root"), adapter=False, trust=ours.own_keys())
    assert all(not p.data.any() for p in model.params.values())
    trainer.publisher.close()


def test_a_failure_is_named_by_its_root_cause():
    try:
        try:
            raise RuntimeError("ClientConnectorError: Cannot connect to host 127.0.0.1:9\nTraceback ...")
        except RuntimeError as cause:
            raise RuntimeError("Rollout worker child has failed; see chained exception.") from cause
    except RuntimeError as e:
        assert failure_line(e) == "ClientConnectorError: Cannot connect to host 127.0.0.1:9"


def test_required_flags(capsys):
    with pytest.raises(SystemExit, match="--inference_url, --env_url"):
        main(["--sync_root", "root"])


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
    metrics["sample/dropped_stale_total"] += [1.0, 1.0]
    trainer = SimpleNamespace(_metrics={"train": metrics}, accelerator=SimpleNamespace(num_processes=1))
    trainer._step_trained_tokens = 300.0  # TRL's per-step sum, flushed after the sync
    counters = RolloutCounters()
    counters.add(samples=8, tokens=400)
    counters.add(samples=4, tokens=150)
    info = step_info(trainer, counters)
    assert (info["rollouts_generated"], info["rollouts_trained"], info["rollouts_dropped"]) == (12, 8, 2)
    assert (info["tokens_generated"], info["tokens_trained"]) == (550, 300)
    assert step_info(trainer, counters)["rollouts_generated"] == 0  # counted once
    assert info["reward_mean"] == pytest.approx(0.625)
    assert info["reward_std"] == pytest.approx((0.625 * 0.375) ** 0.5)
    assert info["staleness_steps_mean"] == 1.0 and info["staleness_steps_max"] == 2.0
    assert info["version_known"] == pytest.approx(0.875)
    assert step_info(None) == {}


def test_a_hub_model_is_pinned_to_its_commit_and_a_local_folder_is_not(fake_hub, tmp_path, caplog):
    commit = fake_hub.models.commit("user/tiny", {"model.safetensors": b"", "config.json": b"{}"})
    args = SimpleNamespace(model_init_kwargs={"revision": "main", "dtype": "float32"})
    assert pinned_revision("user/tiny", args) == commit  # what TRL then loads, and step 0 names
    assert args.model_init_kwargs == {"revision": commit, "dtype": "float32"}
    local = SimpleNamespace(model_init_kwargs=None)
    assert pinned_revision(str(tmp_path), local) is None and local.model_init_kwargs is None
    assert pinned_revision("user/gone", local) is None and local.model_init_kwargs is None
    assert "the first step goes out as an anchor: user/gone@main: not on the Hub" in caplog.text
