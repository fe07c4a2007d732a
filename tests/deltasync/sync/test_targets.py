"""What a subscriber writes into and calls back: tensors in any memory layout, callbacks that fail."""

import threading

import pytest
import torch

from deltasync.sync.subscriber import Subscriber, TensorsApplier
from tests.helpers import bitwise_equal, run_steps


def test_tensors_applier_patches_transposed_tensors(tmp_path):
    states = run_steps(tmp_path, 4)
    # Each 2-d target is the transpose of a tensor laid out the other way: not contiguous.
    target = {n: torch.zeros(t.shape[::-1]).t() for n, t in states[0].items()}
    assert not all(t.is_contiguous() for t in target.values())
    subscriber = Subscriber(tmp_path, TensorsApplier(target), verify_every=1)
    for step in range(4):
        subscriber.sync(step)
        assert subscriber.step == step
        assert bitwise_equal({n: t.bfloat16() for n, t in target.items()}, states[step])


def test_tensors_applier_patches_bf16_fp32_and_transposed_tensors_alike(tmp_path):
    states = run_steps(tmp_path, 4)
    embed, up, bias = states[0]  # contiguous bf16 (the codec's scatter), transposed bf16, fp32 (cast)
    target = {
        embed: torch.zeros(states[0][embed].shape, dtype=torch.bfloat16),
        up: torch.zeros(states[0][up].shape[::-1], dtype=torch.bfloat16).t(),
        bias: torch.zeros(states[0][bias].shape),
    }
    subscriber = Subscriber(tmp_path, TensorsApplier(target), verify_every=1)
    for step in range(4):
        subscriber.sync(step)
        assert subscriber.step == step
        assert bitwise_equal({n: t.bfloat16() for n, t in target.items()}, states[step])


def test_a_failing_on_applied_callback_skips_no_other_step(tmp_path, caplog):
    run_steps(tmp_path, 4)
    seen, stop = [], threading.Event()

    def on_applied(a):
        seen.append(a.step)
        if len(seen) == 1:
            stop.set()  # this poll is the last one
            raise RuntimeError("the caller's bug")

    Subscriber(tmp_path).follow(stop, interval=0, on_applied=on_applied)
    assert seen == [0, 1, 2, 3]
    assert "on_applied for step 0 failed" in caplog.text
    assert "the caller's bug" in caplog.text


@pytest.mark.parametrize("interval", [-1.0, float("nan"), float("inf")])
def test_a_poll_interval_that_is_no_wait_is_refused(tmp_path, interval):
    with pytest.raises(ValueError, match="poll interval"):
        Subscriber(tmp_path).follow(threading.Event(), interval=interval)
