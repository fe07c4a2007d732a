"""vLLM's `int8_per_channel_weight_only` expert quantization (online, `Int8OnlineMoEMethod`): the same torch
ops in the same order and dtypes, so its codes and scales are vLLM's bit for bit on the same device kind."""

from __future__ import annotations

import torch

CODE = torch.int8
INT8_MAX = torch.iinfo(CODE).max  # 127


def scales(amax: torch.Tensor) -> torch.Tensor:
    """fp32 scales of rows whose largest magnitude is `amax` (bf16): amax / 127, rounded to bf16 as vLLM
    computes it (stored as fp32, exactly)."""
    return (amax / INT8_MAX).to(torch.float32)


def codes(values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """int8 codes of bf16 `values` under `scales` (broadcast): round(value / scale), the divide in bf16 like
    vLLM's, clamped to +-127. An element's code depends on its value and scale alone."""
    return values.div(scales.to(torch.bfloat16)).round().clamp(-INT8_MAX, INT8_MAX).to(CODE)
