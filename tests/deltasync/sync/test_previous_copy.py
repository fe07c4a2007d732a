"""Where the publisher keeps the previous step's bf16 copy (PublisherConfig.previous_copy): beside the
weights, where on CUDA the GPU codec (deltasync.codec.gpu) diffs and ranks, or in host memory, where the host
codec does. Both settings publish the same bytes. Without a GPU the kernels run interpreted on host
tensors."""

import collections

import pytest
import torch

from bench.cuda import canonical
from deltasync.codec import bf16
from deltasync.sync.publisher import Publisher, PublisherConfig, keeps_on_device
from deltasync.sync.subscriber import Subscriber
from tests.helpers import DEVICE, assert_bitwise_equal, delta_file, make_params, train_step
from tests.helpers import bf16 as as_bf16

STEPS = 6  # 0: the anchor; 3: an anchor beside its delta (anchor_every); from 4 on: a resumed publisher


@pytest.fixture
def kernels(gpu, monkeypatch) -> collections.Counter:
    """The GPU codec on the publisher's tensors: on CUDA as they are, else interpreted on host tensors; the
    Counter counts the calls of its passes."""
    if DEVICE == "cpu":
        monkeypatch.setattr(bf16, "on_gpu", lambda t: True)
    calls: collections.Counter = collections.Counter()

    def counted(name: str, passes):
        def call(*args):
            calls[name] += 1
            return passes(*args)

        return call

    for name in ("scan", "compact_streams", "state_fingerprint"):
        monkeypatch.setattr(gpu, name, counted(name, getattr(gpu, name)))
    return calls


def publish(root, setting: str) -> tuple[list[dict], list]:
    """STEPS states of one model on DEVICE, each flushed, by two publishers one after the other (the second
    resumes from what the root holds); returns every step's bf16 state and where each publisher's previous
    copy was."""
    params, states, placement = make_params(), [], []
    config = PublisherConfig(anchor_every=3, previous_copy=setting)
    for steps in (range(4), range(4, STEPS)):
        with Publisher(root, model="tiny", config=config) as publisher:
            for step in steps:
                if step:
                    train_step(params, step)
                publisher.publish({n: t.to(DEVICE) for n, t in params.items()}, step=step)
                publisher.flush()
                states.append(as_bf16(params))
            assert publisher._published is not None
            placement.append({t.device.type for t in publisher._published.values()})
    return states, placement


def test_device_and_host_copies_publish_the_same_bytes(tmp_path, kernels):
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(bf16, "on_gpu", lambda t: t.device.type == "cuda")  # the host codec, even on a GPU
        expected, on_host = publish(tmp_path / "host", "host")
    assert not kernels
    states, on_device = publish(tmp_path / "device", "device")
    assert kernels["scan"] == kernels["compact_streams"] == STEPS - 1 and kernels["state_fingerprint"]
    assert on_host == [{"cpu"}] * 2 and on_device == [{DEVICE}] * 2
    for step in range(1, STEPS):
        made = delta_file(tmp_path / "device", step).read_bytes()
        assert canonical(made) == canonical(delta_file(tmp_path / "host", step).read_bytes()), step
    assert_bitwise_equal(states[-1], expected[-1])
    follower = Subscriber(tmp_path / "device")
    follower.sync()
    assert follower.step == STEPS - 1
    assert_bitwise_equal(follower.state, expected[-1])


def test_auto_keeps_the_copy_beside_cuda_weights_only():
    assert PublisherConfig().previous_copy == "auto"
    assert not keeps_on_device(PublisherConfig(), [torch.zeros(2)])
    assert keeps_on_device(PublisherConfig(), [torch.zeros(2, device=DEVICE)]) == (DEVICE == "cuda")
    assert keeps_on_device(PublisherConfig(previous_copy="device"), [torch.zeros(2)])
    assert not keeps_on_device(PublisherConfig(previous_copy="host"), [torch.zeros(2, device=DEVICE)])


def test_an_unknown_setting_is_refused_in_one_line():
    with pytest.raises(ValueError, match=r"^previous_copy 'gpu': choose from auto, device, host$"):
        PublisherConfig(previous_copy="gpu")
