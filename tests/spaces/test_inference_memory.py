"""The inference app's CPU KV-cache default (`cpu_kv_cache_bytes`): half the memory left beside the weights
and the engine, at least one sequence of max-model-len and at most KV_SEQUENCES; one clear line when not even
one fits. Imports the app (and so vLLM) but starts no engine."""

from argparse import Namespace

import pytest
from safetensors.torch import load_file
from transformers import AutoConfig

LEN = 1024


@pytest.fixture(scope="module")
def sizes(model) -> tuple[int, int]:
    """The tiny model's bf16 weights and one LEN-token sequence's K and V, in bytes."""
    c = AutoConfig.from_pretrained(model)
    weights = 2 * sum(t.numel() for t in load_file(model / "model.safetensors").values())
    return weights, 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * 2 * LEN


def kv_bytes(app, model, available: int) -> int:
    return app.cpu_kv_cache_bytes(
        Namespace(model=str(model), trust_remote_code=False, max_model_len=LEN), available
    )


@pytest.mark.parametrize(("sequences_free", "expected"), [(1.5, 1), (6, 3), (1000, 4)])
def test_half_the_memory_left_between_one_and_four_sequences(app, model, sizes, sequences_free, expected):
    weights, one = sizes
    available = weights + app.ENGINE_HEADROOM + int(sequences_free * one)
    assert kv_bytes(app, model, available) == expected * one


def test_one_line_when_not_even_one_sequence_fits(app, model, sizes):
    weights, one = sizes
    with pytest.raises(SystemExit) as e:
        kv_bytes(app, model, weights + app.ENGINE_HEADROOM + one // 2)
    message = str(e.value)
    assert "\n" not in message and "not enough memory" in message and "--max-model-len" in message
