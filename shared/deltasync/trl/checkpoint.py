"""The trainer's tensors under their checkpoint names.

transformers holds some models' weights in another layout than their checkpoints store them: a Qwen3-MoE
layer's experts as two fused parameters (`mlp.experts.gate_up_proj` [E, 2I, H], `mlp.experts.down_proj`),
where the checkpoint, and so vLLM's loader and the sync root, hold one tensor per expert and projection
(`mlp.experts.0.gate_proj.weight`). TRL hands a weight transfer the parameters under the model's names; they
are published under the names `save_pretrained` writes, through transformers' own conversion mapping.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from transformers import PreTrainedModel
from transformers.core_model_loading import revert_weight_conversion

Pairs = list[tuple[str, torch.Tensor]]
Converter = Callable[[Iterable[tuple[str, torch.Tensor]]], Pairs]


def checkpoint_converter(model: torch.nn.Module) -> Converter | None:
    """A function turning (parameter name, tensor) pairs of `model` into the checkpoint's pairs, or None where
    the parameters are the checkpoint's tensors already (dense models: nothing to convert, nothing copied)."""
    if not isinstance(model, PreTrainedModel):
        return None
    held = {name: torch.empty(p.shape, device="meta") for name, p in model.named_parameters()}
    stored = revert_weight_conversion(model, held)
    if {n: t.shape for n, t in stored.items()} == {n: t.shape for n, t in held.items()}:
        return None

    def convert(pairs: Iterable[tuple[str, torch.Tensor]]) -> Pairs:
        # Tensors under unchanged names pass through as they are; converted ones may be copies.
        return list(revert_weight_conversion(model, dict(pairs)).items())

    return convert
