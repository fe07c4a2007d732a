"""vLLM's `fp8_per_channel` weight quantization (online, `Fp8PtpcOnlineLinearMethod`): the same torch ops in
the same order and dtypes, so its codes and scales are vLLM's bit for bit on the same kind of device."""

from __future__ import annotations

import torch

CODE = torch.float8_e4m3fn  # vLLM's fp8 dtype on CUDA and CPU (ROCm's e4m3fnuz, max 224, is another recipe)
FP8_MAX = torch.finfo(CODE).max  # 448


def _fp8_max(device: torch.device) -> torch.Tensor:
    # A 0-d tensor divisor divides truly, as vLLM's does (CUDA multiplies by a Python float's reciprocal).
    return torch.tensor(FP8_MAX, device=device, dtype=torch.float32)


def scales(amax: torch.Tensor) -> torch.Tensor:
    """fp32 scales of rows whose largest magnitude is `amax` (bf16): amax / 448, at least 1 / (448 * 512)."""
    fp8_max = _fp8_max(amax.device)
    return (amax.to(torch.float32) / fp8_max).clamp_min(1.0 / (fp8_max * 512))


def codes(values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """fp8 codes of bf16 `values` under fp32 `scales` (broadcast): clamp(value / scale, +-448) as e4m3fn. An
    element's code depends on its value and scale alone, so a subset's codes are the whole tensor's there."""
    return (values / scales).clamp_(-FP8_MAX, FP8_MAX).to(CODE)
