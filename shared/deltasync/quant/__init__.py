"""Quantized replicas, exact: vLLM's online quantization recipes run on the trainer, and the quantized
state's deltas between steps (changed codes and scales), so a quantized replica follows a bf16 trainer bit
for bit without a bf16 copy of its own. See docs/protocol.md, "Quantized replicas"."""
