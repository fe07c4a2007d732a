"""A tiny Qwen3-MoE on stock vLLM (CPU) with the deltasync backend, followed by `deltasync follow`.

vLLM's CPU MoE kernel runs the experts from a prepacked copy (`deltasync.vllm.experts`); the experts here
are 48 wide, which the kernel pads to 64, so the layout follows vLLM's padding too. The unit tests call
vLLM's prepack directly; the served ones write expert weights through the engine, read them back bit for
bit, and check that generation uses them (the same tokens and logprobs as a fresh server at that step).
"""

import json
import shutil

import pytest
import requests
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from deltasync.codec.bf16 import bits
from deltasync.vllm import compat
from deltasync.vllm.experts import Packing, PackingError
from deltasync.vllm.follower import path_summary
from tests.deltasync.vllm.test_follow import following, stock_server
from tests.helpers import ServedRun, assert_bitwise_equal
from trainer.tiny_model import build_tiny_model

EXPERT_SIZE = 48  # not a multiple of the kernel's alignment (32): the experts are padded to 64
REPLICA = "follower-moe"
PROMPT = [5, 6, 7, 8, 9, 10, 11, 12]
FLAGS = ("--max-model-len", "512")
# vLLM compiles its logprob gathering with torch.compile even in eager mode, and inductor's C++ build needs a
# compiler this machine may lack; eager is exact here too.
ENV = {"TORCHDYNAMO_DISABLE": "1"}


def random_bits(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-(1 << 15), 1 << 15, shape, dtype=torch.int16, generator=g).view(torch.bfloat16)


@pytest.mark.parametrize("isa", ["vec", "amx"])
@pytest.mark.parametrize("shape", [(8, 2 * 64, 128), (8, 128, 64), (3, 96, 160)])
def test_packing_maps_each_element_through_the_prepack(isa, shape):
    weights = random_bits(shape, 0)
    packing = Packing.learn(compat.prepack_experts(weights, isa), isa)
    view = packing.flat.view(shape)  # addressed as the loader writes it, as a block's `dst` is
    assert torch.equal(bits(packing.read(view)), bits(weights))
    part = view[1:3, 5:40, 7:]
    index = (torch.tensor([0, 1, 1]), torch.tensor([3, 7, 34]), torch.tensor([2, 9, 0]))
    assert torch.equal(bits(packing.flat[packing.at(part, index)]), bits(weights[1:3, 5:40, 7:][index]))
    # Writing through the map gives what vLLM's prepack makes of the new weights.
    new = random_bits(part.shape, 1)
    packing.write(part, new)
    weights[1:3, 5:40, 7:] = new
    assert torch.equal(bits(packing.flat.view(shape)), bits(compat.prepack_experts(weights, isa)))


def test_packing_refuses_a_prepack_that_is_no_permutation(monkeypatch):
    weights = torch.zeros(4, 32, 48, dtype=torch.bfloat16)
    monkeypatch.setattr(compat, "prepack_experts", lambda w, isa: w * 2)
    with pytest.raises(PackingError, match="changes the values it moves"):
        Packing.learn(weights, "doubling")
    monkeypatch.setattr(compat, "prepack_experts", lambda w, isa: w.flip(0))  # experts swap places
    with pytest.raises(PackingError, match="not one permutation per expert"):
        Packing.learn(weights, "flipping")


# ------------------------------------------------------------------------------------ served by vLLM


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("moe")
    model_dir = build_tiny_model(tmp / "tiny-moe", moe=True, expert_size=EXPERT_SIZE)
    run = ServedRun(tmp, model_dir, anchor_every=8)
    run.step()  # the first anchor: the model folder's own weights
    yield run
    run.publisher.close()


@pytest.fixture(scope="module")
def server(run, tmp_path_factory):
    with stock_server(run.model_dir, tmp_path_factory.mktemp("server"), *FLAGS, env=ENV) as server:
        yield server


@pytest.fixture(scope="module")
def follower(run, server, tmp_path_factory):
    with following(run.served, server, tmp_path_factory.mktemp("follower") / "follower.log", REPLICA) as log:
        yield log


def greedy(server, model: str, salt: str) -> tuple[list[int], list[float]]:
    """Token ids and logprobs of a greedy completion (`salt`: no prefix cache shared with other requests)."""
    body = {"model": model, "prompt": PROMPT, "max_tokens": 8, "temperature": 0.0, "logprobs": 1}
    body |= {"return_token_ids": True, "cache_salt": salt}
    response = requests.post(f"{server.url}/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    return choice["token_ids"], choice["logprobs"]["token_logprobs"]


@pytest.mark.slow
def test_follows_three_steps_writing_the_experts_bitwise(run, server, follower, tmp_path):
    server.wait_applied(run, REPLICA, 0)
    for _ in range(3):
        step = run.step()
    server.wait_applied(run, REPLICA, step)
    expert = "model.layers.1.mlp.experts.5.down_proj.weight"
    assert not torch.equal(bits(run.states[step][expert]), bits(run.states[step - 1][expert]))
    response = server.update(step=-1, kind="readback", path=str(tmp_path))
    assert response.status_code == 200, response.text
    assert_bitwise_equal(load_file(tmp_path / "rank-0.safetensors"), run.states[step])
    with safe_open(tmp_path / "rank-0.safetensors", "pt") as held:
        paths = json.loads(held.metadata()["paths"])
    assert paths == {name: "packed" if ".experts." in name else "direct" for name in run.states[step]}
    # ... which the follower reports too (layer and expert numbers as `*`)
    line = next(line for line in follower.read_text().splitlines() if "tensors written in place" in line)
    assert json.loads(line.split("tensors written in place: ")[1]) == path_summary(paths)
    for s in range(step + 1):
        record = run.replica_record(REPLICA, s)
        assert record.verified and record.error is None
    # vLLM's own loader writes the unpacked layout: the engine refuses it as the write path for such a model.
    refused = server.post("/init_weight_transfer_engine", {"init_info": {"root": "x", "write": "vllm"}})
    assert refused.status_code == 500 and "prepacked MoE experts" in refused.text, refused.text


@pytest.mark.slow
def test_generation_uses_the_new_expert_weights(run, server, follower, tmp_path):
    model = str(run.model_dir)
    server.wait_applied(run, REPLICA, run.publisher.last_step)
    before = greedy(server, model, salt=f"step-{run.publisher.last_step}")
    step = run.step()
    assert not run.head().entry(step, "anchor")  # the replica writes it as a delta
    server.wait_applied(run, REPLICA, step)
    after = greedy(server, model, salt=f"step-{step}")
    assert after[1] != before[1]
    # A fresh server started on this step's full weights, in the same configuration.
    fresh = tmp_path / "fresh"
    shutil.copytree(run.model_dir, fresh, ignore=shutil.ignore_patterns("*.safetensors"))
    save_file(run.states[step], fresh / "model.safetensors", {"format": "pt"})
    with stock_server(fresh, tmp_path, *FLAGS, env=ENV) as other:
        assert greedy(other, str(fresh), salt=f"step-{step}") == after
