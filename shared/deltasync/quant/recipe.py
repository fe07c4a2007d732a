"""A quantization recipe, named as vLLM's `--quantization` names it and as run.json records it: which of a
checkpoint's tensors it quantizes and how."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from deltasync.errors import Refused
from deltasync.quant import fp8, int8

# Not quantized by any recipe although 2-D: embeddings and the LM head are vLLM embedding layers, and
# Qwen2-MoE's shared-expert gate is built with quant_config=None.
UNQUANTIZED = ("embed_tokens.weight", "lm_head.weight", "shared_expert_gate.weight")
EXPERTS = ".mlp.experts."  # a checkpoint's routed experts: model.layers.L.mlp.experts.E.{gate,up,down}_proj


def _linear_or_expert(name: str) -> bool:
    return not name.endswith(UNQUANTIZED)


def _expert(name: str) -> bool:
    return EXPERTS in name


def row_amax(weight: torch.Tensor) -> torch.Tensor:
    """The largest magnitude of each row of bf16 `weight` [N, K], bf16 [N] (exact, as any max is)."""
    lo, hi = weight.aminmax(dim=-1)
    return torch.maximum(lo.abs(), hi.abs())


@dataclass(frozen=True)
class Recipe:
    """`name` as vLLM's `--quantization` takes it; one fp32 scale per output row, `scales` from each row's
    largest magnitude (bf16), `codes` elementwise from values and their rows' scales; `selects`: whether a
    2-D `.weight` of the checkpoint is quantized."""

    name: str
    code: torch.dtype
    scales: Callable[[torch.Tensor], torch.Tensor]
    codes: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    selects: Callable[[str], bool]

    def quantize(self, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """bf16 `weight` [N, K] -> (codes [N, K], fp32 scales [N]), as vLLM quantizes it."""
        scales = self.scales(row_amax(weight))
        return self.codes(weight, scales.unsqueeze(1)), scales

    def quantized_names(self, shapes: Mapping[str, Sequence[int]]) -> list[str]:
        """The names in a checkpoint's schema this recipe quantizes (vLLM's rule: linear layers and routed
        experts, or the experts alone; never embeddings, the LM head, norms or biases)."""
        return [n for n, s in shapes.items() if len(s) == 2 and n.endswith(".weight") and self.selects(n)]


RECIPES = {
    # vLLM: every LinearBase (attention and MLP projections, a MoE router) and the routed experts; on CPU
    # vLLM serves it for dense models only (its CPU MoE backends refuse per-channel fp8).
    "fp8_per_channel": Recipe("fp8_per_channel", fp8.CODE, fp8.scales, fp8.codes, _linear_or_expert),
    # vLLM: the routed experts only; dense linear layers stay bf16.
    "int8_per_channel_weight_only": Recipe(
        "int8_per_channel_weight_only", int8.CODE, int8.scales, int8.codes, _expert
    ),
}


def recipe(name: str) -> Recipe:
    """The recipe called `name`, or Refused naming the known ones."""
    if name not in RECIPES:
        raise Refused(f"unknown quantization {name!r}: deltasync follows {', '.join(RECIPES)}")
    return RECIPES[name]
