"""The dashboard Space: the incremental telemetry reader and its summary, the app's states and JSON API, and
the page itself in Debian's Chromium driven by Playwright (`python app.py` on a loopback port)."""

import functools
import html
import json
import os
import random
import re
import sys
import threading
import time
from pathlib import Path

import gradio as gr
import pytest
import requests

from deltasync.storage import Storage, TransientStorageError, open_storage
from deltasync.telemetry import MAX_INFO_KEYS, ReplicaRecord, TrainerRecord, write
from deltasync.telemetry.reader import TelemetryReader
from tests.deltasync.storage.test_hub import eventually
from trainer.deploy import build_bundle
from trainer.processes import serving

CHROMIUM = Path("/usr/bin/chromium")
NUMEL = 22_713_216  # all-MiniLM-L6-v2
REPLICAS = ("r0", "r1")
REFUSED = ("r1", 12)  # r1 refuses step 12 (fingerprint mismatch), then recovers
SKIPPED_STEP = 7  # uploads lagged: step 7 was folded into step 8


def write_run(storage: Storage, steps: range, t0: float, replicas=REPLICAS, seed: int = 0) -> None:
    """Telemetry of a short realistic run: step 0 is an anchor, then ~1% deltas, one skipped step, and each
    replica applying every published step 0.3-1.5 s after it was published (one refusal)."""
    rng = random.Random(seed + steps.start)
    for step in steps:
        published_at = t0 + 3.0 * step
        info = {
            "reward_mean": 0.1 + 0.02 * step + rng.uniform(-0.02, 0.02),
            "reward_std": 0.3,
            "staleness_steps_mean": 1 + rng.random(),
            "staleness_steps_max": 2 + rng.randrange(2),
            "rollouts_generated": 8 + rng.randrange(3),
            "rollouts_trained": 8,
            "rollouts_dropped": rng.randrange(2),
            "tokens_generated": 400 + rng.randrange(100),
            "tokens_trained": 400,
        }
        kind = "anchor" if step == 0 else "skipped" if step == SKIPPED_STEP else "delta"
        changed = {"anchor": NUMEL, "delta": int(NUMEL * rng.uniform(0.008, 0.017)), "skipped": 0}[kind]
        payload = {"anchor": 2 * NUMEL + 4096, "delta": int(changed * 0.9) + 2048, "skipped": 0}[kind]
        write(
            storage,
            TrainerRecord(
                step=step,
                kind=kind,
                published_at=published_at,
                numel=NUMEL if kind != "skipped" else 0,
                changed=changed,
                payload_bytes=payload,
                full_bytes=2 * NUMEL if kind != "skipped" else 0,
                encode_s=rng.uniform(0.05, 0.1) if kind != "skipped" else 0.0,
                upload_s=rng.uniform(0.2, 0.5) if kind != "skipped" else 0.0,
                blocked_s=rng.uniform(0.01, 0.03),
                base_step=step - 1 if kind == "delta" else None,
                info=info,
            ),
        )
        if kind == "skipped":
            continue
        for replica in replicas:
            refused = (replica, step) == REFUSED
            write(
                storage,
                ReplicaRecord(
                    replica=replica,
                    step=step,
                    kind=kind,
                    published_at=published_at,
                    applied_at=published_at + rng.uniform(0.3, 1.5),
                    download_s=rng.uniform(0.05, 0.2),
                    apply_s=rng.uniform(0.01, 0.05),
                    verified=not refused,
                    lag_steps=0,
                    payload_bytes=payload,
                    changed=changed,
                    pause_s=0.01,
                    error="target holds 0x1234 after step 12, expected 0xbeef: reloading from an anchor"
                    if refused
                    else None,
                ),
            )


def uploaded(record: dict) -> int:
    """What a trainer record's step uploaded: its delta, and an anchor beside it (older records: no field)."""
    return record["payload_bytes"] + record.get("anchor_bytes", 0)


def expected(storage: Storage) -> dict:
    """What the page should show, computed from the records on storage independently of the reader."""
    records = [json.loads(storage.read_bytes(p)) for p in storage.list("telemetry")]
    trainer = [r for r in records if "replica" not in r]
    published = [r for r in trainer if r["kind"] != "skipped"]
    deltas = [r for r in published if r["kind"] == "delta"]
    anchored = [r for r in published if r["kind"] == "anchor" or r.get("anchor_bytes")]  # beside a delta too
    applied = [r for r in records if "replica" in r and r["verified"]]
    lags = sorted(r["applied_at"] - r["published_at"] for r in applied)
    mid = len(lags) // 2
    return {
        "steps": len(published),
        "mean_payload": sum(r["payload_bytes"] for r in deltas) / len(deltas),
        "bytes_saved": sum(r["full_bytes"] - uploaded(r) for r in published),
        "median_latency": lags[mid] if len(lags) % 2 else (lags[mid - 1] + lags[mid]) / 2,
        # points per plot, trace by trace (traces with no points are left out)
        "plots": {
            "density": [len(deltas)],
            "payload": [len(deltas), len(anchored), len(published)],
            "staleness-seconds": [
                *(sum(r.get("replica") == name for r in applied) for name in REPLICAS),
                sum("replica" in r and not r["verified"] for r in records),
            ],
            "staleness-steps": [len(trainer), len(trainer)],
            "reward": [len(trainer), len(trainer)],  # per step and its rolling mean
            "rollouts": [len(trainer), len(trainer)],  # trained and dropped shares
            "tokens": [len(trainer), len(trainer)],
            "trainer-time": [len(trainer), len(published), len(published)],
        },
    }


# ------------------------------------------------------------------------------------------------ reader


@pytest.fixture(params=["local", "memory", "hub"])
def storage(request, tmp_path):
    if request.param == "hub":
        request.getfixturevalue("fake_hub")
    url = {
        "local": str(tmp_path / "run"),
        "memory": f"memory://{tmp_path.name}",
        "hub": "hf://buckets/user/sync",
    }
    return open_storage(url[request.param])


def test_reader_reads_only_new_records(storage):
    t0 = time.time() - 100
    write_run(storage, range(0, 5), t0)
    reader = TelemetryReader(storage)
    first = reader.poll()
    assert len(first.records) == 5 + 2 * 5 and not first.problems and not first.unread
    assert reader.poll().records == []
    write_run(storage, range(5, 8), t0)
    second = reader.poll()
    assert sorted((type(r).__name__, r.step) for r in second.records) == sorted(
        [("TrainerRecord", s) for s in (5, 6, 7)] + [("ReplicaRecord", s) for s in (5, 6) for _ in REPLICAS]
    )
    assert sorted(reader.trainer) == list(range(8))
    assert sorted(reader.replicas["r0"]) == [0, 1, 2, 3, 4, 5, 6]


def test_reader_probes_between_listings(tmp_path, monkeypatch):
    storage = open_storage(tmp_path)
    t0 = time.time()
    write_run(storage, range(0, 3), t0)
    reader = TelemetryReader(storage, listing_share=0)  # never lists again
    reader.poll()
    listings = []
    monkeypatch.setattr(storage, "list", lambda prefix="": listings.append(prefix) or [])
    write_run(storage, range(3, 5), t0)  # the next steps of known writers: found by probing
    write_run(storage, range(40, 41), t0, replicas=("r2",))  # a jump and a new replica: need a listing
    assert sorted(r.step for r in reader.poll().records) == [3, 3, 3, 4, 4, 4]
    assert listings == []
    monkeypatch.undo()
    reader.listing_share = float("inf")  # lists on every poll
    assert sorted((getattr(r, "replica", ""), r.step) for r in reader.poll().records) == [
        ("", 40),
        ("r2", 40),
    ]


def test_reader_skips_and_reports_bad_records(tmp_path):
    storage = open_storage(tmp_path)
    write_run(storage, range(0, 3), time.time())
    good = storage.read_bytes("telemetry/trainer/step-00000001.json")
    bad = {
        "telemetry/trainer/step-00000010.json": b"{not json",
        "telemetry/trainer/step-00000011.json": good,  # step 1's record under step 11's name
        "telemetry/trainer/step-00000012.json": good.replace(b'"step":1', b'"step":12').replace(
            b'"kind":"delta"', b'"kind":"weird"'
        ),
        "telemetry/trainer/step-00000013.json": good.replace(b'"changed":', b'"changed":-'),
        "telemetry/replicas/r0/step-00000014.json": b'{"replica": "r0", "step": 14}',
        "telemetry/notes.txt": b"hello",
    }
    for path, data in bad.items():
        storage.write_bytes(path, data)
    reader = TelemetryReader(storage)
    poll = reader.poll()
    assert set(poll.problems) == set(bad) == set(reader.problems)
    assert (
        "holds the record of telemetry/trainer/step-00000001.json"
        in poll.problems["telemetry/trainer/step-00000011.json"]
    )
    assert "missing fields" in poll.problems["telemetry/replicas/r0/step-00000014.json"]
    assert sorted(reader.trainer) == [0, 1, 2]
    reader.listing_share = float("inf")
    assert reader.poll().problems == {}  # reported once, not read again


def test_reader_retries_unreadable_files_and_rereads_recovered_refusals(tmp_path, monkeypatch):
    storage = open_storage(tmp_path)
    write_run(storage, range(11, 13), time.time())
    reader = TelemetryReader(storage)
    read_bytes = storage.read_bytes
    flaky = "telemetry/trainer/step-00000011.json"

    def failing_once(path, limit=None):
        if path == flaky:
            monkeypatch.setattr(storage, "read_bytes", read_bytes)
            raise TransientStorageError("timeout")
        return read_bytes(path, limit)

    monkeypatch.setattr(storage, "read_bytes", failing_once)
    assert list(reader.poll().unread) == [flaky]
    assert [r.step for r in reader.poll().records] == [11]
    assert reader.replicas["r1"][12].verified is False
    # r1 recovered from an anchor and re-applied step 12: the refusal's file is replaced by a verified record
    refusal = reader.replicas["r1"][12]
    write(storage, ReplicaRecord(**{**vars(refusal), "verified": True, "error": None}))
    assert [r.verified for r in reader.poll().records] == [True]
    assert reader.replicas["r1"][12].verified is True


def test_summary_matches_records(tmp_path):
    storage = open_storage(tmp_path)
    now = time.time()
    write_run(storage, range(0, 20), now - 60)
    reader = TelemetryReader(storage)
    reader.poll()
    summary = reader.summary(now)
    want = expected(storage)
    assert summary["steps"] == want["steps"] == 19
    assert summary["latest_step"] == 19 and summary["anchors"] == 1 and summary["skipped_steps"] == 1
    assert summary["mean_delta_payload_bytes"] == pytest.approx(want["mean_payload"])
    assert summary["bytes_saved"] == want["bytes_saved"]
    assert summary["median_sync_latency_s"] == pytest.approx(want["median_latency"])
    r0, r1 = summary["replicas"]
    assert (r0["replica"], r0["step"], r0["behind_steps"], r0["status"]) == ("r0", 19, 0, "ok")
    assert (r1["applied"], r1["refused"]) == (18, 1) and "expected 0xbeef" in r1["last_error"]
    # r1 goes silent while the trainer goes on
    write_run(storage, range(20, 25), now - 60, replicas=("r0",))
    reader.poll()
    r0, r1 = reader.summary(now + 300, stale_after_s=120)["replicas"]
    assert (r1["status"], r1["step"], r1["behind_steps"]) == ("stopped reporting", 19, 5)
    assert r0["status"] == "ok"  # silent too, but it holds the newest step: the run has simply not moved


def test_run_of_the_real_publisher_and_subscribers(tmp_path, dashboard):
    """The dashboard reads what the real publisher and subscribers write, without a problem, and its bytes
    saved are what the root's files say: every anchor and delta uploaded (anchors beside deltas too)."""
    torch = pytest.importorskip("torch")
    from deltasync.sync.publisher import Publisher, PublisherConfig
    from deltasync.sync.subscriber import Subscriber

    g = torch.Generator().manual_seed(0)
    params = {
        "model.w": 0.05 * torch.randn(256, 64, generator=g),
        "model.b": 0.05 * torch.randn(64, generator=g),
    }
    subscribers = [Subscriber(tmp_path, replica=name) for name in REPLICAS]
    config = PublisherConfig(anchor_every=3, keep_anchors=10)  # GC deletes nothing: the files are the uploads
    with Publisher(tmp_path, model="tiny", config=config) as publisher:
        for step in range(8):
            for t in params.values():  # ~2% of the elements move by more than a bf16 step
                t += (torch.rand(t.shape, generator=g) < 0.02) * t.abs().clamp_min(1e-3) * 0.05
            publisher.publish(params, step=step, info={"reward_mean": step / 10, "staleness_steps_mean": 1.0})
            publisher.flush()
            for subscriber in subscribers:
                subscriber.sync()
    reader = TelemetryReader(open_storage(tmp_path))
    assert reader.poll().problems == {}
    summary = reader.summary(time.time())
    want = expected(reader.storage)
    assert summary["steps"] == want["steps"] == 8 and summary["latest_step"] == 7
    assert summary["bytes_saved"] == want["bytes_saved"] > 0
    files = [p for folder in ("anchors", "deltas") for p in (tmp_path / folder).rglob("*") if p.is_file()]
    assert summary["uploaded_bytes"] == sum(p.stat().st_size for p in files)
    assert summary["anchors"] == len(list((tmp_path / "anchors").iterdir())) > 1
    assert [(r["step"], r["behind_steps"], r["applied"], r["status"]) for r in summary["replicas"]] == [
        (7, 0, 8, "ok")
    ] * len(REPLICAS)
    figures = dashboard.build_figures(reader.series())
    points = [[len(trace.x) for trace in figure.data] for figure in figures]
    assert points[:3] == [want["plots"]["density"], want["plots"]["payload"], [8, 8]]


def test_lora_root_shows_versions_payload_against_merged_and_versions_held(tmp_path, dashboard):
    """A real adapter-mode run (BucketWeightTransfer measuring the merged path) and the real LoRA resolver of
    one replica, which resolves two of its versions: the board shows the versions, the adapter's payload
    beside the merged path's, and the versions the replica holds."""
    torch = pytest.importorskip("torch")
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from bench.lora import send_merged
    from deltasync.sync.publisher import PublisherConfig
    from deltasync.trl.transfer import BucketWeightTransfer
    from deltasync.vllm.lora import DeltasyncLoRAResolver

    config = Qwen3Config(
        vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, head_dim=64,
    )  # fmt: skip
    torch.manual_seed(0)
    model = get_peft_model(Qwen3ForCausalLM(config), LoraConfig(r=8, target_modules="all-linear"))
    root = tmp_path / "root"
    config = PublisherConfig(keep_anchors=4)  # an adapter's steps are anchors: keep the versions to resolve
    transfer = BucketWeightTransfer(root, "tiny", config, lora_name="policy", measure_merged=True)
    transfer.use_model(model)
    board = dashboard.Board(str(root))
    for step in range(4):
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_" in name:
                    p += 0.05 * torch.randn_like(p)
        send_merged(
            transfer, model
        )  # TRL's call: the merged weights, of which adapter mode sends the adapter
        transfer.publisher.flush()
        if step == 0:
            board.refresh()  # the first record is in: the board reads run.json now
    transfer.destroy()
    resolver = DeltasyncLoRAResolver(str(root), tmp_path, replica="r0")
    for step in (3, 1):
        resolver.fetch("tiny", "policy", step)

    board.refresh()
    adapters = board.summary()["adapters"]
    assert adapters["lora"] == {"name": "policy", "rank": 8}
    assert [v["version"] for v in adapters["versions"]] == [f"policy-v{s}" for s in range(4)]
    assert adapters["versions_held"] == {"r0": [1, 3]}
    merged = [v["merged_payload_bytes"] for v in adapters["versions"]]
    assert merged[0] is None and all(
        m > v["payload_bytes"] for m, v in zip(merged[1:], adapters["versions"][1:], strict=True)
    )
    headline = dashboard.headline_html(board.summary())
    assert 'data-key="adapter-versions" data-value="4"' in headline and "policy-v0 .. policy-v3" in headline
    assert 'data-key="merged-payload"' in headline
    assert "holds 2 adapter versions: steps 1, 3" in dashboard.status_markdown(board.summary(), 2)
    payload = board.figures()[dashboard.PLOTS.index("payload")]
    assert [t.name for t in payload.data][-1] == "merged path (measured)"
    assert list(payload.data[-1].y) == merged[1:]


@pytest.mark.parametrize("quantization", ["fp8_per_channel", None])
def test_a_quantized_root_says_the_recipe_its_replicas_serve(tmp_path, dashboard, quantization):
    """A real quantized root (the publisher's run.json names the recipe): the summary's `run` and the status
    say what the replicas serve; a bf16 root's says nothing of it. Before the trainer's first record the board
    has not read run.json, and says nothing either."""
    torch = pytest.importorskip("torch")
    from deltasync.sync.publisher import Publisher, PublisherConfig

    board = dashboard.Board(str(tmp_path))
    board.refresh()
    assert "run" not in board.summary()
    params = {"model.layers.0.mlp.up_proj.weight": torch.ones(16, 8), "model.norm.weight": torch.ones(8)}
    config = PublisherConfig(quantization=quantization)
    with Publisher(tmp_path, model="tiny", config=config) as publisher:
        for step in range(2):
            params["model.layers.0.mlp.up_proj.weight"][step] += 1.0
            publisher.publish(params, step=step)
            publisher.flush()
    board.refresh()
    summary = json.loads(json.dumps(board.summary()))  # what /api/summary answers
    assert summary["run"] == {
        "model": "tiny",
        "quantization": quantization,
        "signed_by": None,
        "signature_error": None,
    }
    assert summary["steps"] == 2 and "adapters" not in summary
    status = dashboard.status_markdown(summary, 2)
    if quantization:
        assert "Replicas serve **fp8\\_per\\_channel** (a quantized root)" in status
    else:
        assert "Replicas serve" not in status
    assert "Unsigned: replicas trust whoever can write this bucket" in status


def test_a_signed_root_says_its_key_and_every_head_a_replica_refused(tmp_path, dashboard):
    """A real signed root: the status says which key signs it (checked against run.json's own chain: a
    run.json naming the key with a signature that does not hold is flagged); a replica trusting the key
    refuses a bucket writer's forged head, and the board lists that refusal."""
    pytest.importorskip("torch")
    from deltasync.sync.signing import SigningKey, short
    from deltasync.sync.subscriber import SyncError
    from tests.deltasync.sync.test_signing import Trainer, forge_step, replica

    key = SigningKey.generate()
    key.save(tmp_path / "trainer.key")
    root = tmp_path / "root"
    trainer = Trainer(root, str(tmp_path / "trainer.key"))
    subscriber, _ = replica(root, key.public, name="r1")
    for step in range(2):
        trainer.step(step)
        subscriber.sync()
    forge_step(root, trainer, SigningKey.generate())
    with pytest.raises(SyncError):
        subscriber.sync()
    trainer.publisher.close()
    board = dashboard.Board(str(root))
    board.refresh()
    summary = json.loads(json.dumps(board.summary()))  # what /api/summary answers
    assert summary["run"]["signed_by"] == key.public and summary["run"]["signature_error"] is None
    (refusal,) = summary["head_refusals"].values()
    assert list(summary["head_refusals"]) == ["r1"] and refusal["count"] == 1
    assert (
        refusal["last_error"].startswith("head refused: ")
        and "a key this replica does not trust" in (refusal["last_error"])
    )
    assert summary["problem_count"] == 0  # a head record is a replica record like any other
    (row,) = summary["replicas"]
    assert (row["status"], row["step"], row["refused"]) == ("refused last step", 1, 1)
    status = dashboard.status_markdown(summary, 2)
    assert f"Signed by **{dashboard.markdown_text(short(key.public))}**: replicas given this key" in status
    assert "⚠ Replica **r1** refused 1 head for their signature (serving its last good step)" in status

    run = json.loads((root / "run.json").read_bytes())
    run["model"] = "another"  # the key and the signature kept: a bucket writer's run.json
    (root / "run.json").write_text(json.dumps(run))
    board = dashboard.Board(str(root))
    board.refresh()
    summary = board.summary()
    assert "does not match its content" in summary["run"]["signature_error"]
    status = dashboard.status_markdown(summary, 2)
    assert f"⚠ run.json names the key **{dashboard.markdown_text(short(key.public))}**, but its" in status
    assert "Signed by" not in status


def test_series_since(tmp_path):
    storage = open_storage(tmp_path)
    write_run(storage, range(0, 10), time.time())
    reader = TelemetryReader(storage)
    reader.poll()
    series = reader.series(since=5)
    assert series["trainer"]["step"] == [6, 7, 8, 9]
    assert series["trainer"]["kind"][1] == "skipped"
    assert series["replicas"]["r0"]["step"] == [6, 8, 9]
    assert len(series["trainer"]["info.reward_mean"]) == 4
    diverged = reader.trainer[9]
    diverged.info["reward_mean"] = float("nan")
    assert reader.series(since=8)["trainer"]["info.reward_mean"] == [None]  # JSON has no NaN


# ----------------------------------------------------------------------------------------- app (in process)


def test_board_states(dashboard, tmp_path, monkeypatch):
    unset = dashboard.Board("")
    assert dashboard.markdown_text("SYNC_ROOT is not set") in dashboard.status_markdown(unset.summary(), 2)
    assert len(unset.figures()) == len(dashboard.PLOTS)

    board = dashboard.Board(str(tmp_path))
    board.refresh()
    assert "No run yet" in dashboard.status_markdown(board.summary(), 2)
    assert all(f.layout.annotations[0].text == "no data yet" for f in board.figures())

    write_run(board.reader.storage, range(0, 3), time.time())
    version = board.refresh()
    assert version == 1 and board.refresh() == 1  # nothing new: same version, figures reused
    assert board.figures() is board.figures()
    first = dashboard.update(board, -1, 2)  # a new page gets the figures, a page that shows them gets none
    assert first[0] == version and all(f.data for f in first[-len(dashboard.PLOTS) :])
    assert dashboard.update(board, version, 2)[-len(dashboard.PLOTS) :] == [gr.skip()] * len(dashboard.PLOTS)
    assert "Live" in dashboard.status_markdown(board.summary(), 2)

    def unreadable(*args):
        raise TransientStorageError(f"{tmp_path}: request failed: 503 Service Unavailable")

    monkeypatch.setattr(board.reader.storage, "list", unreadable)
    monkeypatch.setattr(board.reader.storage, "sizes", unreadable)
    board.refresh()
    status = dashboard.status_markdown(board.summary(), 2)
    assert "Cannot read the sync root" in status and "503" in status and "3 steps" in status
    assert board.summary()["steps"] == 3  # the last data stays on the page


def test_board_polls_within_its_poll_budget_without_the_feed(dashboard, fake_hub, monkeypatch):
    fake_hub.feed = False  # not served: the board polls, each poll costing requests
    write_run(open_storage("hf://buckets/user/sync"), range(0, 2), time.time())
    monkeypatch.setenv("POLL_BUDGET", "8")  # a poll every 112 s; the first one and its 6 reads fit
    cfg = dashboard.Settings()
    built = []
    monkeypatch.setattr(dashboard, "build_app", lambda *args: built.append(args))
    monkeypatch.setattr(dashboard, "serve", lambda *args, **kwargs: None)
    dashboard.main()
    assert built[0][-1] == cfg.poll_budget == 8
    board = dashboard.Board("hf://buckets/user/sync", poll_budget=cfg.poll_budget)
    board.refresh()
    eventually(lambda: not board.reader.storage.follows_changes)  # the feed was tried and is not served
    polls = []
    fetch = board.reader.fetch
    monkeypatch.setattr(board.reader, "fetch", lambda: polls.append(1) or fetch())
    for _ in range(3):
        time.sleep(0.05)  # far shorter than this budget's interval (a budget of 10**6 polls each time)
        board.refresh()
    assert polls == [] and board.summary()["steps"] == 2  # the window's one poll is spent


def test_board_names_a_replica_that_stopped_reporting(dashboard, tmp_path):
    board = dashboard.Board(str(tmp_path), stale_after_s=60)
    write_run(board.reader.storage, range(0, 5), time.time() - 600)
    write_run(board.reader.storage, range(5, 6), time.time() - 600, replicas=("r0",))
    board.refresh()
    summary = board.summary()
    assert "Replica **r1** stopped reporting" in dashboard.status_markdown(summary, 2)
    assert "holds step 4, 1 behind" in dashboard.status_markdown(summary, 2)
    assert list(dashboard.replicas_frame(summary)["status"]) == ["ok", "stopped reporting"]


def test_board_renders_while_a_poll_hangs(dashboard, tmp_path, monkeypatch):
    board = dashboard.Board(str(tmp_path))
    entered, release = threading.Event(), threading.Event()

    def hanging_list(prefix: str = "") -> list[str]:
        entered.set()
        release.wait(10)
        return []

    monkeypatch.setattr(board.reader.storage, "list", hanging_list)
    poller = threading.Thread(target=board.refresh)
    poller.start()
    assert entered.wait(10)  # the first viewer's poll hangs now
    start = time.monotonic()
    assert board.refresh() == 0  # another viewer: does not wait for the hanging poll
    assert "for the first time" in dashboard.status_markdown(board.summary(), 2)
    assert time.monotonic() - start < 1
    release.set()
    poller.join()
    assert "No run yet" in dashboard.status_markdown(board.summary(), 2)


HOSTILE_NAMES = [
    "telemetry/trainer/x`<img src=x onerror=alert(1)>`.json",
    "telemetry/trainer/[click](http://example.com).json",
    "telemetry/trainer/**bold** _it_ $x^2$ <b>b</b> https://example.com a@b.co\n- item.json",
]


def test_skipped_file_names_and_errors_show_as_plain_text(dashboard):
    from markdown_it import MarkdownIt

    shown = dashboard.problems_markdown({name: f"{name}: not JSON" for name in HOSTILE_NAMES})
    rendered = MarkdownIt("commonmark").enable("strikethrough").render(shown)
    assert rendered.count("<li>") == len(HOSTILE_NAMES)
    tags = {tag for tag in re.findall(r"</?([a-z]+)", rendered)}
    assert tags <= {"ul", "li"}, tags
    for name in HOSTILE_NAMES:
        text = html.escape(name.replace("\n", "\\n"), quote=False)
        assert f"<li>{text}: {text}: not JSON</li>" in rendered


def test_a_tick_over_records_with_thousands_of_info_keys_stays_bounded(dashboard, tmp_path):
    storage = open_storage(tmp_path)
    for step in range(220):  # 200 valid records with 63 keys of their own each, 20 with 3,000 keys
        keys = 3000 if step >= 200 else MAX_INFO_KEYS - 1
        info = {"reward_mean": 0.5} | {f"s{step}.k{i}": 1.0 for i in range(keys)}
        write(storage, TrainerRecord(step, "delta", 1e9 + step, 10, 1, 1, 2, 0.0, 0.0, 0.0, info=info))
    board = dashboard.Board(str(tmp_path))
    version, status, _, _, _, problems, *figures = dashboard.update(board, -1, 2)
    assert len(board.reader.trainer) == 200
    assert len(board.reader.problems) == 20 and "20 invalid telemetry files skipped" in status
    assert all("3001 keys, more than 64" in why for why in board.reader.problems.values())
    columns = board.series()["trainer"]
    assert sum(key.startswith("info.") for key in columns) == MAX_INFO_KEYS
    assert sum(len(fig.data) for fig in figures) <= 2 * len(dashboard.PLOTS)  # traces per plot, not per key


# ---------------------------------------------------------------------------------------- the Space, live


@pytest.fixture(scope="module")
def space(tmp_path_factory):
    """The dashboard started from its Space bundle (as the deploy builds it: app.py with a copy of shared/
    beside it) over a sync root holding a 20-step run. Yields (base URL, sync root storage, run start)."""
    base = tmp_path_factory.mktemp("dashboard")
    bundle = build_bundle("dashboard", base / "bundle")
    storage = open_storage(base / "root")
    t0 = time.time() - 3 * 25  # steps are 3 s apart: the 5 appended later are not in the future either
    write_run(storage, range(0, 20), t0)
    env = {"SYNC_ROOT": str(base / "root"), "REFRESH_S": "1"}
    argv, log = [sys.executable, "app.py"], base / "server.log"
    with serving(argv, log, env, timeout=90, health="/api/summary", cwd=bundle, grace_s=10) as url:
        yield url, storage, t0


def test_json_api(space):
    url, storage, _ = space
    summary = requests.get(f"{url}/api/summary", timeout=10).json()
    want = expected(storage)
    assert summary["error"] is None
    assert summary["steps"] == want["steps"]
    assert summary["bytes_saved"] == want["bytes_saved"]
    assert [r["replica"] for r in summary["replicas"]] == list(REPLICAS)
    series = requests.get(f"{url}/api/series", params={"since": 17}, timeout=10).json()
    assert series["trainer"]["step"] == [18, 19]
    assert series["replicas"]["r1"]["verified"] == [True, True]


# Points per trace of each plot, keyed by the gr.Plot's elem_id. Plotly decodes binary arrays (numpy columns)
# into `x._inputArray`.
PLOT_POINTS = """() => Object.fromEntries([...document.querySelectorAll('.js-plotly-plot')].map(plot => [
    plot.closest('[id]').id,
    (plot.data || []).map(trace => trace.x ? trace.x.length ?? trace.x._inputArray.length : 0),
]))"""


def _headline(page) -> dict[str, float]:
    cards = page.locator("#headline .card")
    return {
        cards.nth(i).get_attribute("data-key"): float(cards.nth(i).get_attribute("data-value"))
        for i in range(cards.count())
    }


@pytest.mark.skipif(not CHROMIUM.exists(), reason=f"{CHROMIUM} is not installed (apt-get install chromium)")
def test_page_in_chromium(space, tmp_path):
    from playwright import sync_api  # with Debian's Chromium: `make setup` installs both

    url, storage, t0 = space
    artifacts = Path(os.environ.get("TEST_ARTIFACTS", tmp_path))
    artifacts.mkdir(parents=True, exist_ok=True)
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), headless=True)
        page = browser.new_page(viewport={"width": 1400, "height": 1800})
        page.goto(url)

        def shows(want: dict) -> None:
            deadline = time.monotonic() + 30
            while page.evaluate(PLOT_POINTS) != want["plots"] and time.monotonic() < deadline:
                page.wait_for_timeout(200)
            assert page.evaluate(PLOT_POINTS) == want["plots"]
            headline = _headline(page)
            assert headline["steps"] == want["steps"]
            assert headline["mean-payload"] == pytest.approx(want["mean_payload"])
            assert headline["bytes-saved"] == want["bytes_saved"]
            assert headline["median-latency"] == pytest.approx(want["median_latency"])

        shows(expected(storage))
        assert "Live" in page.inner_text("#status")
        table = page.inner_text("#replicas")
        assert "r1" in table and "expected 0xbeef" in table
        page.screenshot(path=artifacts / "dashboard-20-steps.png", full_page=True)

        page.evaluate("window.notReloaded = true")
        write_run(storage, range(20, 25), t0)
        shows(expected(storage))
        assert page.evaluate("window.notReloaded") is True
        shot = artifacts / "dashboard-25-steps.png"
        page.screenshot(path=shot, full_page=True)
        print(f"screenshot: {shot}")
        browser.close()


# ---------------------------------------------------------------------------------- what a person reads


def test_a_replica_ahead_of_the_trainer_records_read_is_not_behind(tmp_path):
    storage = open_storage(tmp_path)
    now = time.time()
    write_run(storage, range(0, 5), now - 20)
    r0_step_5 = ReplicaRecord("r0", 5, "delta", now - 2, now - 1, 0.1, 0.1, True, 0)
    write(storage, r0_step_5)  # the trainer's record of step 5 goes out with its next request
    reader = TelemetryReader(storage)
    reader.poll()
    summary = reader.summary(now)
    assert summary["latest_step"] == 4
    assert [(r["replica"], r["step"], r["behind_steps"]) for r in summary["replicas"]] == [
        ("r0", 5, 0),
        ("r1", 4, 1),
    ]


def test_a_run_that_stopped_is_finished_not_live(dashboard, tmp_path):
    board = dashboard.Board(str(tmp_path))
    write_run(board.reader.storage, range(0, 10), time.time() - 30 - 14 * 60)  # steps 3 s apart, 14 min ago
    board.refresh()
    status = dashboard.status_markdown(board.summary(), 2)
    assert "**Finished**" in status and "Live" not in status and "steps came every 3.0 s" in status
    write_run(board.reader.storage, range(10, 11), time.time() - 30 - 10 * 3)  # it goes on
    board.refresh()
    assert "**Live**" in dashboard.status_markdown(board.summary(), 2)


def test_plots_share_integer_steps_payload_ticks_can_be_read_and_outliers_do_not_flatten(dashboard, tmp_path):
    storage = open_storage(tmp_path)
    write_run(storage, range(0, 40), time.time())
    reader = TelemetryReader(storage)
    reader.poll()
    reader.trainer[0].blocked_s = 28.0  # a first step that compiled kernels
    anchor_beside_delta = reader.trainer[20]
    anchor_beside_delta.anchor_bytes = 2 * NUMEL + 4096
    figures = dict(zip(dashboard.PLOTS, dashboard.build_figures(reader.series()), strict=True))
    for name, figure in figures.items():
        axis = figure.layout.xaxis
        assert (tuple(axis.range), axis.dtick, axis.tickformat) == ((-0.5, 39.5), 5, "d"), name
    payload = figures["payload"]
    assert payload.layout.yaxis.type == "log" and len(payload.layout.yaxis.ticktext) >= 4
    assert {"200 kB", "500 kB", "1 MB", "50 MB"} <= set(payload.layout.yaxis.ticktext)
    anchors = next(t for t in payload.data if t.name == "anchor")
    assert dict(zip(anchors.x, anchors.y, strict=True)) == {0: 2 * NUMEL + 4096, 20: 2 * NUMEL + 4096}
    delta = next(t for t in payload.data if t.name == "delta")
    assert 20 in list(delta.x)  # its delta went out too
    times = figures["trainer-time"]
    top = times.layout.yaxis.range[1]
    assert 0.5 < top < 1  # the other steps' times fill the plot
    clipped = times.data[-1]
    assert (list(clipped.x), list(clipped.y), list(clipped.customdata)) == ([0], [top], [28.0])


def test_density_note_only_where_a_run_changes_far_more_than_real_models(dashboard, tmp_path):
    storage = open_storage(tmp_path)
    write_run(storage, range(0, 5), time.time())
    reader = TelemetryReader(storage)
    reader.poll()
    assert dashboard.density_markdown(reader.summary(time.time())) == ""  # ~1% per step
    for record in reader.trainer.values():
        record.changed = record.numel // 2
    note = dashboard.density_markdown(reader.summary(time.time()))
    assert "Why 50% of the elements change per step" in note and "docs/benchmarks.md" in note


def test_lora_summary_stays_up_without_a_rank_and_with_a_nan_merged_payload(dashboard, tmp_path):
    storage = open_storage(tmp_path)
    run = {
        "version": 1,
        "model": "tiny",
        "schema": {"w": [4]},
        "lora": {"name": "policy", "adapter_config": {}},
    }
    storage.write_bytes("run.json", json.dumps(run).encode())
    write_run(storage, range(0, 3), time.time())
    nan = json.loads(storage.read_bytes("telemetry/trainer/step-00000002.json"))
    nan["info"]["merged_payload_bytes"] = float("nan")
    storage.write_bytes("telemetry/trainer/step-00000002.json", json.dumps(nan).encode())
    board = dashboard.Board(str(tmp_path))
    board.refresh()
    summary = json.loads(json.dumps(board.summary(), allow_nan=False))  # what /api/summary answers
    assert summary["adapters"]["lora"] == {"name": "policy", "rank": None}
    assert "merged_payload_bytes" in summary["problems"][0] and summary["steps"] == 2
    assert "LoRA rank not given" in dashboard.headline_html(summary)


def test_board_reads_a_long_history_within_its_poll_budget_newest_first(dashboard, tmp_path, monkeypatch):
    now = [0.0]
    board = dashboard.Board(f"memory://{tmp_path.name}", poll_budget=20, clock=lambda: now[0])
    storage = board.reader.storage
    write_run(storage, range(0, 30), time.time() - 100)
    records = storage.list("telemetry")
    requests, reads = [], []

    def counted(call, *args, **kwargs):
        requests.extend([args[0]] if args[0] else [])  # (a stat of no names sends nothing)
        if call.__name__ == "read_bytes":
            reads.append(args[0])
        return call(*args, **kwargs)

    for name in ("list", "sizes", "read_bytes"):
        monkeypatch.setattr(storage, name, functools.partial(counted, getattr(storage, name)))
    board.refresh()
    summary = board.summary()
    assert len(requests) <= 20 and summary["latest_step"] == 29  # the newest records first
    assert summary["unread_records"] == len(records) - len(reads) + 1 > 0  # (one read was run.json)
    assert "records to go" in dashboard.status_markdown(summary, 2)
    for _ in range(len(records)):
        if not board.summary()["unread_records"]:
            break
        now[0] += dashboard.WINDOW_S
        requests.clear()
        board.refresh()
        board.refresh()  # the window is spent (or the history read): this one reads nothing new
        assert len(requests) <= 20
    assert set(reads) >= set(records)
    summary, want = board.summary(), expected(storage)
    assert (summary["steps"], summary["bytes_saved"]) == (want["steps"], want["bytes_saved"])


def test_an_unreachable_root_holds_no_request_and_is_said_once(dashboard, tmp_path, monkeypatch, caplog):
    board = dashboard.Board(str(tmp_path), wait_s=0.05)
    entered, release, ended = threading.Event(), threading.Event(), threading.Event()

    def hanging_list(prefix: str = "") -> list[str]:
        entered.set()
        release.wait(30)
        ended.set()
        raise TransientStorageError(f"{tmp_path}: request failed: connection refused")

    monkeypatch.setattr(board.reader.storage, "list", hanging_list)
    assert board.refresh() == 0  # returns while the poll it started still waits on the root
    assert entered.is_set() and not ended.is_set()
    assert "for the first time" in dashboard.status_markdown(board.summary(), 2)
    release.set()
    eventually(lambda: board.error is not None)

    def refused(prefix: str = "") -> list[str]:
        raise TransientStorageError(f"{tmp_path}: request failed: connection refused")

    monkeypatch.setattr(board.reader.storage, "list", refused)
    board.wait_s = None
    for _ in range(3):
        board.refresh()
    lines = [r.getMessage() for r in caplog.records if r.name == "deltasync.dashboard"]
    assert lines == [f"cannot read {tmp_path}: {tmp_path}: request failed: connection refused"]
