"""A tiny random Qwen3 and a byte-level BPE tokenizer, built locally (no Hub): the model tests and demos run.

head_dim 64 because vLLM's CPU attention rejects smaller heads; tied embeddings like Qwen3-0.6B. Weights are
drawn with std 0.1: at the usual 0.02 the layers barely move the residual stream and greedy decoding just
repeats the prompt's last token, whatever the weights.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# ChatML without a default system prompt: enough for apply_chat_template(add_generation_prompt=True)
CHAT_TEMPLATE = (
    "{%- for m in messages %}{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
CORPUS = ["What is 2 + 3? The answer is 5.", "Guess the five-letter word: crane, slate.", "user assistant"]


def build_tiny_model(path: str | Path, seed: int = 0, tied: bool = True) -> Path:
    """Save a random bf16 Qwen3 (hidden 128, 2 layers, head_dim 64) and its tokenizer into `path`."""
    path = Path(path)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(
        CORPUS * 50,
        trainers.BpeTrainer(
            vocab_size=320, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
        ),
    )
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        padding_side="left",
        chat_template=CHAT_TEMPLATE,
    )
    hf_tok.save_pretrained(path)
    torch.manual_seed(seed)
    cfg = Qwen3Config(
        vocab_size=len(hf_tok),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
        max_position_embeddings=8192,
        initializer_range=0.1,
        tie_word_embeddings=tied,
        eos_token_id=hf_tok.eos_token_id,
        pad_token_id=hf_tok.pad_token_id,
        bos_token_id=None,
    )
    model = Qwen3ForCausalLM(cfg).to(torch.bfloat16)
    model.generation_config.eos_token_id = hf_tok.eos_token_id
    model.save_pretrained(path)
    return path


if __name__ == "__main__":
    print(build_tiny_model(sys.argv[1] if len(sys.argv) > 1 else "tiny-qwen3"))
