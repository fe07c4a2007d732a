"""vLLM's `fp8_per_channel` weight quantization (online, `Fp8PtpcOnlineLinearMethod`): the same torch ops in
the same order and dtypes, so its codes and scales are vLLM's bit for bit on the same kind of device."""

from __future__ import annotations

import torch

CODE = torch.float8_e4m3fn  # vLLM's fp8 dtype on CUDA and CPU (ROCm's e4m3fnuz, max 224, is another recipe)
FP8_MAX = torch.finfo(CODE).max  # 448
CHUNK_ELEMENTS = 16 * 1024 * 1024  # vLLM's chunking of the divide; rows are independent, so only memory


def quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """bf16 `weight` [N, K] -> (fp8 codes [N, K], fp32 scales [N]): scale = max|row| / 448, at least
    1 / (448 * 512); code = clamp(row / scale, +-448) rounded to e4m3fn."""
    # A 0-d tensor divisor divides truly, as vLLM's does (CUDA multiplies by a Python float's reciprocal).
    fp8_max = torch.tensor(FP8_MAX, device=weight.device, dtype=torch.float32)
    lo, hi = weight.aminmax(dim=-1, keepdim=True)
    amax = torch.maximum(lo.abs(), hi.abs())
    scale = (amax.to(torch.float32) / fp8_max).clamp_min(1.0 / (fp8_max * 512))
    codes = torch.empty_like(weight, dtype=CODE)
    rows = max(1, CHUNK_ELEMENTS // weight.shape[-1])
    for start in range(0, weight.shape[0], rows):
        part = slice(start, start + rows)
        codes[part] = (weight[part] / scale[part]).clamp_(-FP8_MAX, FP8_MAX).to(CODE)
    return codes, scale.reshape(-1)
