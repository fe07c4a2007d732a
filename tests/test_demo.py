"""`make demo`'s pieces that run in seconds: the summary read from a sync root's telemetry (and, with
`DEMO_QUANT`, the recipe the replicas serve), and the process helpers (their own session, stopped whole). The
whole demo (vLLM, trainer) is run by `make demo`, not here."""

import dataclasses
import os
import sys
import time

import pytest

from deltasync.storage import open_storage
from deltasync.telemetry import ReplicaRecord, TrainerRecord, write
from trainer import demo
from trainer.demo import format_summary, summarize
from trainer.processes import start_process, stop_process, wait_healthy

NUMEL, FULL = 1000, 2000


def trainer_record(step: int, kind: str, changed: int, payload: int, reward: float | None) -> TrainerRecord:
    info = {} if reward is None else {"reward_mean": reward}
    return TrainerRecord(step, kind, 100.0 + step, NUMEL, changed, payload, FULL, 0.01, 0.02, 0.0, info=info)


def test_summary_from_telemetry(tmp_path):
    storage = open_storage(tmp_path)
    write(storage, trainer_record(0, "anchor", NUMEL, FULL, None))
    write(storage, trainer_record(1, "delta", 10, 20, 0.25))
    write(storage, trainer_record(2, "skipped", 0, 0, 0.4))  # folded into step 3: not published
    write(storage, trainer_record(3, "delta", 30, 40, 0.5))
    for step, lag in [(0, 1.0), (1, 0.5), (3, 2.0)]:
        write(storage, ReplicaRecord("r", step, "delta", 100.0 + step, 100.0 + step + lag, 0.1, 0.1, True, 0))
    write(storage, ReplicaRecord("late", 0, "anchor", 100.0, 101.0, 0.1, 0.1, True, 0))
    refused = ReplicaRecord("late", 1, "delta", 101.0, 104.0, 0.1, 0.1, False, 0, error="bad fingerprint")
    write(storage, refused)

    s = summarize(tmp_path)
    assert (s["steps"], s["anchors"], s["skipped_steps"], s["latest_step"]) == (3, 1, 1, 3)
    assert s["mean_density"] == pytest.approx((10 + 30) / 2 / NUMEL)
    assert (s["mean_payload_bytes"], s["full_bytes"], s["payload_share"]) == (30, FULL, 30 / FULL)
    assert s["median_sync_latency_s"] == pytest.approx(1.0)  # verified applies: 1.0, 0.5, 2.0 and 1.0
    assert s["unverified_steps"] == {"late": [1, 3], "r": []}
    assert (s["final_reward"], s["final_reward_step"]) == (0.5, 3)
    text = format_summary(s)
    assert "3 (1 anchors; 1 more folded into later ones)" in text
    assert "30 B = 1.50% of the full bf16 model (2.0 kB)" in text
    assert "3/3 steps (r)" in text and "1/3 steps (late); not verified: [1, 3]" in text
    assert "0.500 (reward_mean at step 3)" in text


def test_freshness_and_reward_quarters(tmp_path):
    storage = open_storage(tmp_path)
    write(storage, trainer_record(0, "anchor", NUMEL, FULL, None))
    for step in range(1, 9):  # staleness 3 in the first steps (skipped), then 1 and 2 alternating
        record = trainer_record(step, "delta", 10, 20, 0.1 * step)
        stale = 3.0 if step < 3 else 1.0 + step % 2
        counts = {"rollouts_generated": 10.0, "rollouts_trained": 8.0, "rollouts_dropped": 1.0}
        record.info.update(staleness_steps_mean=stale, staleness_steps_max=stale, **counts)
        write(storage, record)
    s = summarize(tmp_path)
    assert s["staleness_mean"] == pytest.approx(1.5) and s["staleness_max"] == 2.0  # steps 3..8
    assert (s["rollouts_generated"], s["rollouts_trained"], s["rollouts_dropped"]) == (80, 64, 8)
    assert (s["dropped_share"], s["trained_share"]) == (0.1, 0.8)
    assert (s["reward_first_quarter"], s["reward_last_quarter"]) == pytest.approx((0.15, 0.75))
    assert s["mean_step_s"] == pytest.approx(1.0)  # published_at 100 + step
    text = format_summary(s)
    assert "80 generated, 64 trained (80.00%), 8 dropped as stale (10.00%)" in text
    assert "mean 1.50 steps after the first 3, max 2.0" in text and "first 0.150, last 0.750" in text


def test_summary_of_a_lora_root(tmp_path):
    import torch

    from deltasync.sync.publisher import Publisher

    lora = {"name": "policy", "adapter_config": {"r": 16}}
    with Publisher(tmp_path, model="tiny", lora=lora) as publisher:  # run.json: a LoRA root; step 0
        publisher.publish({"w": torch.ones(4, 4)})
    storage = open_storage(tmp_path)
    for step, merged in [(1, 300), (2, 500)]:
        record = trainer_record(step, "anchor", NUMEL, 100, 0.1)
        record.info["merged_payload_bytes"] = merged
        write(storage, record)
    for step in (1, 2):  # the versions requests named, resolved and verified
        write(storage, ReplicaRecord("r", step, "anchor", 100.0 + step, 101.0 + step, 0.1, 0.1, True, 0))

    s = summarize(tmp_path)
    assert s["lora"] == {"name": "policy", "rank": 16}
    assert [v["version"] for v in s["versions"]] == ["policy-v0", "policy-v1", "policy-v2"]
    assert (s["mean_adapter_payload_bytes"], s["mean_merged_payload_bytes"]) == (100, 400)
    assert s["versions_held"] == {"r": [1, 2]}
    text = format_summary(s)
    assert "policy-v0 .. policy-v2 (LoRA rank 16)" in text and "versions held         2 by r: 1-2" in text
    assert "adapter 100 B, merged path 400 B (4.0x" in text and "verified by replica" not in text


def test_the_summary_says_the_recipe_the_replicas_serve(tmp_path, monkeypatch):
    """`DEMO_QUANT=fp8_per_channel make demo`: the setting is read, and the summary says what the replicas
    serve, from run.json; a bf16 root's says nothing of it."""
    import torch

    from deltasync.sync.publisher import Publisher, PublisherConfig

    monkeypatch.setenv("DEMO_QUANT", "fp8_per_channel")
    assert demo.Settings().demo_quant == "fp8_per_channel"
    config = PublisherConfig(quantization="fp8_per_channel")
    with Publisher(tmp_path / "fp8", model="tiny", config=config) as publisher:
        publisher.publish({"model.layers.0.mlp.up_proj.weight": torch.ones(8, 8)})
    text = format_summary(summarize(tmp_path / "fp8"))
    assert "replicas serve        fp8_per_channel (vLLM's codes and scales, verified)" in text
    with Publisher(tmp_path / "bf16", model="tiny") as publisher:
        publisher.publish({"w": torch.ones(8, 8)})
    assert "replicas serve" not in format_summary(summarize(tmp_path / "bf16"))


def test_summary_of_an_empty_root(tmp_path):
    s = summarize(tmp_path)
    assert (s["steps"], s["final_reward"], s["unverified_steps"]) == (0, None, {})
    assert "no replica reported" in format_summary(s)


def test_stop_process_ends_the_whole_group(tmp_path):
    # A parent that ignores SIGTERM and a child of its own: both must be gone after stop_process.
    script = (
        "import signal, subprocess, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); "
        "print(child.pid, flush=True); time.sleep(600)"
    )
    log = tmp_path / "parent.log"
    proc = start_process([sys.executable, "-c", script], log)
    deadline = time.monotonic() + 30
    while not log.read_text().strip():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    child = int(log.read_text())
    assert os.getpgid(child) == proc.pid  # the child is in the parent's own session and group
    stop_process(proc, grace_s=0.5)
    assert proc.returncode is not None
    deadline = time.monotonic() + 10
    while alive(child):
        assert time.monotonic() < deadline, "the child survived"
        time.sleep(0.05)


def alive(pid: int) -> bool:
    """Running, and not a zombie waiting for a reaper."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_wait_healthy_reports_an_early_exit(tmp_path):
    log = tmp_path / "broken.log"
    proc = start_process([sys.executable, "-c", "raise SystemExit('no model here')"], log)
    with pytest.raises(RuntimeError, match="(?s)broken exited with status 1.*no model here"):
        wait_healthy(proc, "http://127.0.0.1:9/health", log, timeout=30)


def test_the_pace_of_the_last_steps():
    # steps 0..10 published 5 s apart: 90 steps of 100 left
    assert demo.pace_line([100.0 + 5 * i for i in range(11)], 100) == "  pace 5.0 s per step: ~7.5 min left"
    # the first step waited 60 s for the trainer to start, steps 2..5 came 5 s apart
    assert demo.pace_line([0.0, 60.0, 65.0, 70.0, 75.0, 80.0], 100) == "  pace 5.0 s per step: ~7.9 min left"
    # the last 10 steps' pace, not the whole run's
    slow_then_fast = [0.0] + [20.0 * i for i in range(1, 11)] + [200.0 + 5 * i for i in range(1, 11)]
    assert demo.pace_line(slow_then_fast, 100) == "  pace 5.0 s per step: ~6.7 min left"


def test_a_steps_publish_line_comes_before_its_replica_lines():
    progress = demo.Progress(total_steps=10)
    verified = ReplicaRecord("r", 3, "delta", 103.0, 103.5, 0.1, 0.1, True, 0)
    # the replica's record of step 3 lands in the root before the trainer's
    first = progress.lines([trainer_record(2, "delta", 10, 20, 0.3), verified])
    assert [line.split()[:2] for line in first] == [["step", "2/10"]]
    second = progress.lines([trainer_record(3, "delta", 10, 20, 0.4)])
    assert second[0].startswith("step 3/10") and "replica verified step 3" in second[1]
    assert progress.rest() == []
    orphan = ReplicaRecord("r", 9, "delta", 109.0, 109.5, 0.1, 0.1, True, 0)  # its trainer record never came
    assert progress.lines([orphan]) == [] and "replica verified step 9" in progress.rest()[0]


def test_a_cached_tiny_model_is_used_without_a_word(tmp_path, monkeypatch, capsys):
    import trainer.tiny_model

    (tmp_path / trainer.tiny_model.READY).write_text("{}")
    monkeypatch.setattr(trainer.tiny_model, "default_model_dir", lambda: tmp_path)
    assert demo.policy_model(demo.Settings()) == tmp_path
    assert capsys.readouterr().out == ""


def test_a_steps_line_counts_the_anchor_uploaded_beside_its_delta():
    record = dataclasses.replace(trainer_record(5, "delta", 10, 20_000, None), anchor_bytes=500_000)
    line = demo.progress_line(record, 20)
    assert line.startswith("step 5/20  delta+anchor") and f"{demo.format_bytes(520_000)} published" in line
