"""The CPU shims for TRL's async trainer: installed through compat, and the attention stand-in is exact."""

import pytest
import torch
import torch.nn.functional as F
from transformers import Qwen3Config, Qwen3ForCausalLM
from trl.experimental.async_grpo import async_grpo_trainer, async_rollout_worker, packing
from trl.trainer import utils as trainer_utils

from deltasync.trl.cpu import apply_cpu_shims, varlen_sdpa

SHIMMED = [
    (packing, "_flash_attn"),
    (async_grpo_trainer, "get_peak_flops_per_device"),
    (async_rollout_worker, "is_vllm_available"),
    (trainer_utils, "_use_triton"),
]


@pytest.fixture
def restored(monkeypatch):
    """What apply_cpu_shims replaces, put back after the test."""
    for module, name in SHIMMED:
        monkeypatch.setattr(module, name, getattr(module, name))


def test_cpu_gets_the_attention_and_mfu_shims(restored):
    applied = apply_cpu_shims("cpu")
    assert {"attention", "peak_flops"} <= set(applied)
    assert packing._flash_attn().flash_attn_varlen_func is varlen_sdpa
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
    out = varlen_sdpa(q, k, v, cu_q, cu_k, 5, 8, softmax_scale=0.3)
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


def test_packed_tree_forward_matches_per_sample_forward(tmp_path, monkeypatch):
    # TRL's own packing path (a prefix trie, tree attention through the shim): each sample's log-probs in one
    # tree of shared prefixes equal those of the sample forwarded alone (a row of one chain), through the same
    # model, shim and fused head; varlen_sdpa itself is checked against plain SDPA above. The reference was a
    # separate HF "sdpa" model: about one fresh-clone suite in five then saw 8 of 33 log-probs off by 2.7e-4,
    # in float32 and float64 alike, which no run of this file alone or after any one test folder reproduced.
    import numpy as np
    from transformers import AutoModelForCausalLM
    from trl.trainer.utils import add_fused_lm_head

    from trainer.tiny_model import build_tiny_model

    monkeypatch.setattr(packing, "_flash_attn", packing._flash_attn)  # restored after the test
    apply_cpu_shims("cpu")
    packing.register_tree_attention()
    path = build_tiny_model(tmp_path / "tiny")
    # float64, so that summation orders cannot matter (here the tree and the chains agree bit for bit)
    model = AutoModelForCausalLM.from_pretrained(
        path, attn_implementation=packing.TREE_ATTENTION, dtype=torch.float64
    )
    add_fused_lm_head(model, outputs=("log_probs", "entropy"))

    def log_probs(samples: list[dict]) -> tuple[torch.Tensor, dict]:
        row = packing.TreeRow()
        for sample in samples:
            row.add(sample)
        p = row.pack()
        out = model(
            input_ids=p["input_ids"][None],
            position_ids=p["position_ids"][None],
            shift_labels=p["shift_labels"][None],
            fused_lm_head=True,
            tree_kv_index=p["tree_kv_index"],
            tree_cu_seqlens_q=p["tree_cu_seqlens_q"],
            tree_cu_seqlens_k=p["tree_cu_seqlens_k"],
            tree_max_seqlen_q=int(p["tree_max_seqlens"][0]),
            tree_max_seqlen_k=int(p["tree_max_seqlens"][1]),
        )
        return out.log_probs.flatten()[p["token_index"]], p

    g = torch.Generator().manual_seed(0)
    samples = []
    for group, prompt_len in enumerate((7, 5)):
        prompt = torch.randint(3, 300, (prompt_len,), generator=g).tolist()
        for i in range(3):  # three completions share the prompt; the third also part of the second's
            completion = torch.randint(
                3, 300, (int(torch.randint(2, 9, (1,), generator=g)),), generator=g
            ).tolist()
            if i == 2:
                completion = samples[-1]["input_ids"][prompt_len:][:2].tolist() + completion
            ids = np.array(prompt + completion)
            mask = np.array([0] * prompt_len + [1] * len(completion))
            samples.append(
                {"input_ids": ids, "completion_mask": mask, "old_log_probs": np.zeros(len(ids), np.float32)}
                | {"advantage": 1.0, "group_id": group}
            )
    packed, p = log_probs(samples)
    assert len(p["tree_cu_seqlens_q"]) - 1 > len(samples) // 2  # really a tree: shared prefixes, branches
    with torch.no_grad():
        alone = torch.cat([log_probs([sample])[0] for sample in samples])
    assert alone.numel() == sum(int(s["completion_mask"].sum()) for s in samples)
    assert torch.all(alone < 0) and alone.std() > 0.1  # real log-probs of a random model, not a constant
    torch.testing.assert_close(packed.detach(), alone, atol=1e-5, rtol=1e-5)
    packed.sum().backward()  # gradients flow through the shim
    assert model.model.embed_tokens.weight.grad.abs().sum() > 0


def test_cpu_scores_only_labelled_positions_with_the_same_log_probs(restored):
    """The fused LM head's log-probs and entropies at labelled positions are those of scoring every position;
    only their cost changes (the prompts' positions are skipped)."""
    config = Qwen3Config(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=16)  # fmt: skip
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(config)
    trainer_utils.add_fused_lm_head(model, outputs=("log_probs", "entropy"))
    ids = torch.randint(0, 300, (1, 40))
    labels = torch.full((1, 40), -100)
    labels[0, 25:] = ids[0, 25:]  # a prompt of 25 tokens, then the completion
    every = model(input_ids=ids, shift_labels=labels, fused_lm_head=True)
    assert "labelled_positions" in apply_cpu_shims("cpu")
    assert trainer_utils._use_triton(torch.device("cpu"))
    labelled = model(input_ids=ids, shift_labels=labels, fused_lm_head=True)
    torch.testing.assert_close(labelled.log_probs, every.log_probs)
    torch.testing.assert_close(labelled.entropy, every.entropy)
