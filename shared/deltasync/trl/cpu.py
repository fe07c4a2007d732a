"""Shims that let TRL's AsyncGRPOTrainer run where it expects CUDA, FA3 and a local vLLM (through
deltasync.trl.compat, which holds the private names they replace):

- tree attention calls FA3's `flash_attn_varlen_func`, fetched from the Hub by `kernels`: replaced by
  `varlen_sdpa`, in torch (on CPU, or on CUDA without `kernels`);
- the MFU metric asks `torch.cuda` for the device name: skipped on CPU, as TRL does for unknown devices;
- the rollout worker refuses to start without vLLM installed, although it only speaks HTTP to a remote
  server: claimed available when vLLM is absent.
"""

from __future__ import annotations

import importlib.util
import logging

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)


def varlen_sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    softmax_scale: float | None = None,
    causal: bool = True,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float | None = None,
    **_: object,
) -> torch.Tensor:
    """flash_attn_varlen_func in torch: q (Nq, H, D), k and v (Nk, Hkv, D) -> (Nq, H, D).

    Segment s: queries q[cu_q[s]:cu_q[s+1]] attend to keys k[cu_k[s]:cu_k[s+1]], the causal mask aligned
    bottom-right (query t of Lq sees key u of Lk iff u <= Lk - Lq + t), as in flash-attn >= 2.1. One SDPA call
    per segment: a packed tree repeats each segment's root path in k, so one dense (Nq x Nk) mask would cost
    far more than the segments' own Lq x Lk blocks.
    """
    if softcap:
        raise NotImplementedError("varlen_sdpa: softcap is not supported")
    starts_q, starts_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    lengths_q = [b - a for a, b in zip(starts_q, starts_q[1:], strict=False)]
    lengths_k = [b - a for a, b in zip(starts_k, starts_k[1:], strict=False)]
    # split, not slicing: its backward concatenates the pieces' gradients instead of zero-filling a full-size
    # gradient per segment. The last piece is what lies beyond the segments (padding), unused.
    pieces_q = q.split([*lengths_q, q.shape[0] - starts_q[-1]])
    pieces_k = k.split([*lengths_k, k.shape[0] - starts_k[-1]])
    pieces_v = v.split([*lengths_k, v.shape[0] - starts_k[-1]])
    gqa = k.shape[1] != q.shape[1]
    outputs = []
    for s in range(len(lengths_q)):  # cu_seqlens start at 0, so piece s is segment s
        qs, ks, vs = pieces_q[s].transpose(0, 1), pieces_k[s].transpose(0, 1), pieces_v[s].transpose(0, 1)
        lq, lk = qs.shape[1], ks.shape[1]
        mask = None
        if causal or window_size[0] >= 0:
            t = torch.arange(lq, device=q.device)[:, None]
            u = torch.arange(lk, device=q.device)[None, :]
            last = lk - lq + t  # the newest key query t may see
            mask = u <= last if causal else torch.ones(lq, lk, dtype=torch.bool, device=q.device)
            if window_size[0] >= 0:
                mask &= u >= last - window_size[0]
        out = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=softmax_scale, enable_gqa=gqa)
        outputs.append(out.transpose(0, 1))
    if starts_q[-1] < q.shape[0]:  # queries beyond the last segment attend to nothing
        outputs.append(q.new_zeros(q.shape[0] - starts_q[-1], *q.shape[1:]))
    return torch.cat(outputs)


def apply_cpu_shims(device: torch.device | str) -> list[str]:
    """Install the shims `device` needs; call before building AsyncGRPOTrainer. Returns what was replaced."""
    from deltasync.trl import compat

    device = torch.device(device)
    applied = []
    if device.type != "cuda" or importlib.util.find_spec("kernels") is None:
        compat.replace_flash_attn(varlen_sdpa)
        applied.append("attention")
    if device.type != "cuda":
        compat.skip_peak_flops()
        applied.append("peak_flops")
    if device.type == "cpu":
        compat.score_labelled_positions_only()
        applied.append("labelled_positions")
    if importlib.util.find_spec("vllm") is None:
        compat.claim_vllm_available()
        applied.append("vllm_available")
    if applied:
        log.debug("TRL shims for %s: %s", device, ", ".join(applied))
    return applied
