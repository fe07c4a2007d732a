"""The TRL 1.16 shims: the private names they replace still exist, and the attention stand-in is exact."""

import torch
import torch.nn.functional as F
from trl.experimental.async_grpo import async_grpo_trainer, async_rollout_worker, packing

from trainer import cpu_shims


def test_the_replaced_names_exist():
    # If TRL moves these, the shims would silently do nothing: fail here instead.
    assert callable(packing._flash_attn) and callable(packing.tree_attention)
    assert callable(async_grpo_trainer.get_peak_flops_per_device)
    assert callable(async_rollout_worker.is_vllm_available)
    assert hasattr(async_rollout_worker.AsyncRolloutWorker, "_loop_cls")


def test_cpu_gets_the_attention_and_mfu_shims(monkeypatch):
    for module, name in [
        (packing, "_flash_attn"),
        (async_grpo_trainer, "get_peak_flops_per_device"),
        (async_rollout_worker, "is_vllm_available"),
    ]:
        monkeypatch.setattr(module, name, getattr(module, name))  # restored after the test
    applied = cpu_shims.apply("cpu")
    assert {"packing._flash_attn", "async_grpo_trainer.get_peak_flops_per_device"} <= set(applied)
    assert packing._flash_attn().flash_attn_varlen_func is cpu_shims.varlen_sdpa
    assert async_grpo_trainer.get_peak_flops_per_device(None, "float32") is None


def test_varlen_sdpa_matches_per_segment_attention():
    # Three segments of a packed tree: a prompt, then two branches that also see the prompt's keys.
    g = torch.Generator().manual_seed(0)
    heads, kv_heads, dim = 4, 2, 16
    lengths_q, lengths_k = [5, 3, 2], [5, 8, 7]
    q = torch.randn(sum(lengths_q), heads, dim, generator=g)
    k = torch.randn(sum(lengths_k), kv_heads, dim, generator=g)
    v = torch.randn(sum(lengths_k), kv_heads, dim, generator=g)
    cu_q = torch.tensor([0, 5, 8, 10], dtype=torch.int32)
    cu_k = torch.tensor([0, 5, 13, 20], dtype=torch.int32)
    out = cpu_shims.varlen_sdpa(q, k, v, cu_q, cu_k, 5, 8, softmax_scale=0.3)
    for s in range(3):
        qs, ks, vs = q[cu_q[s] : cu_q[s + 1]], k[cu_k[s] : cu_k[s + 1]], v[cu_k[s] : cu_k[s + 1]]
        lq, lk = len(qs), len(ks)
        mask = torch.arange(lk)[None, :] <= torch.arange(lq)[:, None] + (lk - lq)  # bottom-right causal
        ref = F.scaled_dot_product_attention(
            qs.transpose(0, 1),
            ks.repeat_interleave(heads // kv_heads, 1).transpose(0, 1),
            vs.repeat_interleave(heads // kv_heads, 1).transpose(0, 1),
            attn_mask=mask,
            scale=0.3,
        ).transpose(0, 1)
        torch.testing.assert_close(out[cu_q[s] : cu_q[s + 1]], ref, atol=1e-5, rtol=1e-5)
