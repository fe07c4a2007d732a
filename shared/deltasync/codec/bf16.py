"""bf16 bit patterns: the unit everything in this project compares, hashes and encodes."""

from __future__ import annotations

import torch


def as_bf16(t: torch.Tensor) -> torch.Tensor:
    """`t` rounded to bf16 (round-to-nearest-even, what `.to(bfloat16)` does), flat and contiguous."""
    return t.detach().to(torch.bfloat16).contiguous().reshape(-1)


def bits(t: torch.Tensor) -> torch.Tensor:
    """The int16 bit patterns of a bf16 tensor, flat. Comparing these is exact for NaN payloads and -0.0."""
    if t.dtype != torch.bfloat16:
        raise TypeError(f"expected a bfloat16 tensor, got {t.dtype}")
    return t.detach().contiguous().reshape(-1).view(torch.int16)


def on_gpu(t: torch.Tensor) -> bool:
    """Whether the codec runs its passes over `t` in deltasync.codec.gpu's Triton kernels: where `t` is on
    CUDA. (The one place that decides it, so that tests can run the kernels on host tensors, interpreted.)"""
    return t.device.type == "cuda"
