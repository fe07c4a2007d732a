"""VersionedRolloutLoop: TRL's rollout loop, stamping samples with the weight version the server reported,
routing rollouts over replicas and holding generation back.

The servers here are a few lines of HTTP that answer TRL's exact /v1/completions request the way the inference
Space labels it (x-weight-version, x-weight-version-end); the real Space is exercised in test_train_e2e.py.
"""

import contextlib
import multiprocessing
import queue
import threading
import time
from collections.abc import Iterator
from types import SimpleNamespace

import pytest
import torch
from accelerate import PartialState
from datasets import Dataset
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from transformers import AutoTokenizer

from deltasync.trl import compat
from deltasync.trl.rollout import (
    REWARD_SQ,
    VERSION_KNOWN,
    WEIGHT_VERSION,
    ReplicaRouter,
    RolloutCounters,
    VersionedRolloutLoop,
    mask_last_turn,
    parse_version,
)
from tests.helpers import wait_for
from trainer.processes import serving_in_thread
from trainer.tiny_model import build_tokenizer

TOKEN = "sekret"


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok")
    build_tokenizer().save_pretrained(path)
    return AutoTokenizer.from_pretrained(path)


@contextlib.contextmanager
def serving(token_ids: list[int], version: int = 5) -> Iterator[tuple[str, dict]]:
    """Answers each completion with `token_ids`, labelled as produced while `version` became the next step."""
    app = FastAPI()
    seen = {"auth": [], "calls": 0}

    @app.post("/v1/completions")
    async def completions(request: Request):
        seen["auth"].append(request.headers.get("authorization"))
        seen["calls"] += 1
        logprobs = {"token_logprobs": [-0.5] * len(token_ids)}
        choice = {"token_ids": token_ids, "logprobs": logprobs, "text": ""}
        headers = {"x-weight-version": str(version), "x-weight-version-end": str(version + 1)}
        return JSONResponse({"choices": [choice]}, headers=headers)

    with serving_in_thread(app) as url:
        yield url, seen


@pytest.fixture
def server(tokenizer):
    """Ends each turn at once: one EOS token."""
    with serving([tokenizer.eos_token_id]) as served:
        yield served


def reward_by_length(completions, **kwargs):
    return [float(i) for i in range(len(completions))]


def test_parse_version():
    assert [parse_version(v) for v in ("12", "0", "model", None, "-1")] == [12, 0, None, None, None]
    too_big = [str(2**63), "9" * 5000]  # past the step range (int() of 5,000 digits raises)
    assert [parse_version(v) for v in ["²", "١٢", " 1", "1\n", *too_big]] == [None] * 6
    assert parse_version(str(2**63 - 1)) == 2**63 - 1


def test_mask_last_turn_leaves_the_earlier_turns_trained():
    mask = [0, 0, 1, 1, 0, 0, 1, 1, 1]  # prompt, turn 1, tool reply, turn 2 (the cut-off one)
    mask_last_turn(mask)
    assert mask == [0, 0, 1, 1, 0, 0, 0, 0, 0]


@pytest.mark.parametrize("mask_truncated", [True, False])
def test_a_turn_cut_off_by_max_tokens_is_left_out_of_the_loss(tokenizer, mask_truncated):
    # Every turn runs into max_tokens (3 tokens, none an end of turn); a turn that ends on EOS is kept.
    ramble = [t for t in range(5, 50) if t not in (tokenizer.eos_token_id, tokenizer.pad_token_id)][:3]
    buffer, counters, scored = multiprocessing.get_context("spawn").Queue(), RolloutCounters(), 0.0

    def two_groups_scored() -> bool:
        nonlocal scored
        scored += counters.take()[0]
        return scored >= 4

    with serving(ramble) as (url, _):
        loop = rollout_loop(
            url, tokenizer, buffer, mask_truncated=mask_truncated, max_tokens=3, counters=counters
        )
        with running(loop):
            if mask_truncated:
                # Its one turn left out, a sample has nothing to train (and TRL's loss fails on a row of such
                # samples): it is not queued.
                wait_for(two_groups_scored, "two groups scored")
                with pytest.raises(queue.Empty):
                    buffer.get(timeout=3)
            else:
                for sample in [buffer.get(timeout=60) for _ in range(2)]:
                    assert sample.input_ids[-3:].tolist() == ramble
                    assert sample.completion_mask[-3:].tolist() == [1] * 3
    buffer = multiprocessing.get_context("spawn").Queue()  # the first loop may have queued more
    with serving([*ramble[:2], tokenizer.eos_token_id]) as (url, _):
        loop = rollout_loop(url, tokenizer, buffer, mask_truncated=True, max_tokens=3)
        with running(loop):
            samples = [buffer.get(timeout=60) for _ in range(2)]
    assert [sample.completion_mask[-3:].tolist() for sample in samples] == [[1] * 3] * 2


def rollout_loop(url: str, tokenizer, buffer, **kwargs) -> VersionedRolloutLoop:
    PartialState()  # TRL logs through accelerate
    ctx = multiprocessing.get_context("spawn")
    return VersionedRolloutLoop(
        model_name="tiny",
        dataset=Dataset.from_dict({"prompt": [[{"role": "user", "content": "Play."}]] * 4}),
        reward_funcs=[reward_by_length],
        processing_class=tokenizer,
        eos_token_ids=[tokenizer.eos_token_id],
        rollout_buffer=buffer,
        model_version_value=ctx.Value("i", 1),
        heartbeat_value=ctx.Value("d", 0.0),
        failed_event=ctx.Event(),
        exception_info_queue=ctx.Queue(maxsize=1),
        metrics_queue=ctx.Queue(),
        num_generations=2,
        vllm_server_url=url,
        **{"max_tokens": 1} | kwargs,
    )


@contextlib.contextmanager
def running(loop: VersionedRolloutLoop) -> Iterator[None]:
    thread = threading.Thread(target=loop.run, daemon=True)
    thread.start()
    try:
        yield
    finally:
        loop.stop_soon()
        thread.join(30)


def test_samples_carry_the_servers_weight_version(server, tokenizer, monkeypatch):
    url, seen = server
    monkeypatch.setenv("INFERENCE_API_TOKEN", TOKEN)
    buffer = multiprocessing.get_context("spawn").Queue()
    # TRL's version 1 is published step 2
    loop = rollout_loop(url, tokenizer, buffer, version_base=2, max_inflight_tasks=2)
    with running(loop):
        samples = [buffer.get(timeout=60) for _ in range(4)]
    assert seen["auth"] and set(seen["auth"]) == {f"Bearer {TOKEN}"}
    for sample in samples:  # the oldest version that produced any of its tokens
        assert sample.metrics[WEIGHT_VERSION] == 5.0 and sample.metrics[VERSION_KNOWN] == 1.0
        assert sample.model_version == 5 - 2 + 1  # so TRL's staleness counts real versions
        assert sample.metrics[REWARD_SQ] == sample.metrics["reward"] ** 2


def test_generation_stays_at_most_max_ahead_rollouts_ahead_of_training(server, tokenizer):
    # TRL alone would fill all 16 slots and its queue; with max_ahead=4 a rollout starts only while fewer than
    # 4 are generating, being scored or waiting in the queue untrained.
    url, seen = server
    buffer = multiprocessing.get_context("spawn").Queue()
    counters = RolloutCounters()
    loop = rollout_loop(url, tokenizer, buffer, max_ahead=4, counters=counters, max_inflight_tasks=16)
    with running(loop):
        first = [buffer.get(timeout=60) for _ in range(2)]  # the trainer takes one group ...
        deadline = time.monotonic() + 60
        while seen["calls"] < 6:  # ... which makes room for exactly one more
            assert time.monotonic() < deadline, seen
            time.sleep(0.05)
        wait_for(lambda: buffer.qsize() == 4, "the new group queued")
        held = loop.held_back  # from here nothing changes until the trainer takes more: a 7th must not start
        wait_for(lambda: loop.held_back > held, "the next group held back")
        assert seen["calls"] == 6 and buffer.qsize() == 4 and len(first) == 2
        assert counters.take() == (6.0, 6.0)  # six one-token rollouts
        assert counters.take() == (0.0, 0.0)


def test_back_pressure_admits_whole_groups(server, tokenizer):
    # max_ahead 3 with groups of 2: a second group starts whole. One rollout of it alone would wait, unscored,
    # for a partner the bound never lets start (with rollouts that fork into two samples, a hung trainer).
    url, seen = server
    buffer = multiprocessing.get_context("spawn").Queue()
    loop = rollout_loop(url, tokenizer, buffer, max_ahead=3, max_inflight_tasks=16)
    with running(loop):
        deadline = time.monotonic() + 60
        while buffer.qsize() < 4:  # both groups complete and queued, with nothing taken
            assert time.monotonic() < deadline, (seen, buffer.qsize())
            time.sleep(0.05)
        held = loop.held_back  # nothing changes until the trainer takes some: a 5th request must not start
        wait_for(lambda: loop.held_back > held, "the next group held back")
        assert seen["calls"] == 4 and buffer.qsize() == 4


def test_stop_ends_the_loop_while_groups_are_held_back(server, tokenizer):
    # Training ended with the queue full (nobody takes from it): held-back groups must stop waiting, else
    # TRL's loop waits for them forever and its worker process is killed after 15 s ("Child did not exit").
    url, _ = server
    buffer = multiprocessing.get_context("spawn").Queue()
    loop = rollout_loop(url, tokenizer, buffer, max_ahead=2, max_inflight_tasks=4)
    thread = threading.Thread(target=loop.run, daemon=True)
    thread.start()
    wait_for(lambda: loop.held_back > 0, "a group held back")
    loop.stop_soon()
    thread.join(60)
    assert not thread.is_alive()


def test_stop_returns_when_the_worker_process_died(server, tokenizer):
    # An unreachable env server fails the worker process; TRL's stop() would then block forever on its
    # multiprocessing stop event (the waiter is gone). The trainer must still get to publish and exit.
    from functools import partial

    from trl.experimental.async_grpo.async_rollout_worker import AsyncRolloutWorker

    from wordle_env.client import WordleEnv

    url, _ = server
    PartialState()
    worker = AsyncRolloutWorker(
        model_name="tiny",
        dataset=Dataset.from_dict({"prompt": [[{"role": "user", "content": "Play."}]] * 4}),
        reward_funcs=[],
        processing_class=tokenizer,
        eos_token_ids=[tokenizer.eos_token_id],
        environment_factory=partial(WordleEnv, base_url="http://127.0.0.1:9"),  # nothing listens there
        num_generations=2,
        max_inflight_tasks=2,
        vllm_server_url=url,
        max_tokens=1,
    )
    compat.use_loop(worker, VersionedRolloutLoop)
    worker.start()

    def failed() -> bool:
        try:
            worker.check_health(300)
        except RuntimeError as e:
            assert "child has failed" in str(e)
            return True
        return False

    wait_for(failed, "the worker process to fail")
    stopper = threading.Thread(target=worker.stop, daemon=True)
    stopper.start()
    stopper.join(30)
    assert not stopper.is_alive(), "stop() hung on a dead worker"


def test_router_sends_each_rollout_to_the_replica_with_fewest_in_flight():
    router = ReplicaRouter(["http://a/", "http://b"])
    assert [router.pick() for _ in range(3)] == ["http://a", "http://b", "http://a"]
    router.release("http://a")
    router.release("http://a")
    assert [router.pick() for _ in range(3)] == ["http://a", "http://a", "http://b"]  # a tie: the first
    assert router.in_flight == {"http://a": 2, "http://b": 2}


def test_rollouts_spread_over_replicas_each_stamped_with_its_own_version(tokenizer):
    # Two replicas at different weight versions: each sample carries the version of the one that served it.
    buffer = multiprocessing.get_context("spawn").Queue()
    eos = [tokenizer.eos_token_id]
    with serving(eos, 5) as (a, seen_a), serving(eos, 9) as (b, seen_b):
        loop = rollout_loop(a, tokenizer, buffer, replica_urls=[a, b], max_inflight_tasks=4, version_base=5)
        with running(loop):
            samples = [buffer.get(timeout=60) for _ in range(8)]
    assert seen_a["calls"] >= 2 and seen_b["calls"] >= 2
    versions = {sample.metrics[WEIGHT_VERSION] for sample in samples}
    assert versions == {5.0, 9.0}
    assert all(s.model_version == s.metrics[WEIGHT_VERSION] - 5 + 1 for s in samples)


def test_stamp_rollouts_wires_the_worker_and_the_transfer(tokenizer, tmp_path):
    from trl.experimental.async_grpo.async_rollout_worker import AsyncRolloutWorker

    from deltasync.trl import BucketWeightTransfer, stamp_rollouts

    PartialState()
    worker = AsyncRolloutWorker(
        model_name="tiny",
        dataset=Dataset.from_dict({"prompt": [[{"role": "user", "content": "Play."}]] * 4}),
        reward_funcs=[reward_by_length],
        processing_class=tokenizer,
        eos_token_ids=[tokenizer.eos_token_id],
        num_generations=2,
        vllm_server_url="http://a",
    )
    trainer = SimpleNamespace(
        args=SimpleNamespace(logging_steps=10),
        rollout_worker=worker,
        model=torch.nn.Linear(2, 2),
        accelerator=SimpleNamespace(unwrap_model=lambda model: model),
    )
    told = []
    transfer = BucketWeightTransfer(tmp_path / "root", on_first_step=told.append)
    stamp_rollouts(
        trainer, transfer, replica_urls=["http://a/", "http://b"], model_name="served", max_ahead=4
    )
    kwargs = compat.loop_kwargs(worker)
    assert kwargs["replica_urls"] == ["http://a", "http://b"]
    assert (kwargs["model_name"], kwargs["max_ahead"]) == ("served", 4)
    assert trainer.args.logging_steps == 1  # step_info reads TRL's metric sink once per step
    transfer.on_first_step(7)  # the cold sync published step 7: TRL's model version 1
    assert kwargs["version_base"] == 7 and told == [7]
    assert transfer.info is not None
    assert transfer.to_checkpoint is None  # told the model: its parameters are its checkpoint's tensors
