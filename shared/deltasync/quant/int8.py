"""vLLM's `int8_per_channel_weight_only` expert quantization (online, `Int8OnlineMoEMethod`): the same torch
ops in the same order and dtypes, so its codes and scales are vLLM's bit for bit on the same device kind."""

from __future__ import annotations

import torch

CODE = torch.int8
INT8_MAX = torch.iinfo(CODE).max  # 127


def quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """bf16 `weight` [N, K] -> (int8 codes [N, K], fp32 scales [N]): scale = max|row| / 127 rounded to bf16;
    code = round(row / scale in bf16), clamped to +-127."""
    # In bf16 like vLLM: the scale and the divide round to bf16 (the scale is stored as fp32, exactly).
    scale = weight.abs().amax(dim=1) / INT8_MAX
    codes = weight.div(scale.unsqueeze(1)).round().clamp(-INT8_MAX, INT8_MAX).to(CODE)
    return codes, scale.to(torch.float32)
