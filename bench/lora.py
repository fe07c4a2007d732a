"""What a LoRA run publishes per step: its adapter alone (adapter mode) against the merged weights (TRL's
merged path), measured on the same training steps.

    python -m bench.lora [--layers 4] [--rank 16] [--steps 6] [--lr 1e-4]

A Qwen3 with Qwen3-0.6B's layer shapes (first `--layers` layers, a 8192-token vocabulary: the embeddings are
no LoRA target), random weights, built locally; a PEFT LoRA of rank `--rank` on every linear layer, trained by
AdamW on a next-token loss over random tokens. After each step the same model is published twice, the way
AsyncGRPOTrainer hands it to a `BucketWeightTransfer`: the adapter (adapter mode, `lora_name` set) to one
sync root, the merged weights (`merge_adapter`, the base weights, `unmerge_adapter`) to another. Per step:
elements published, the share of bf16 elements changed, and the payload (the step's files), from each root's
telemetry.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model
from transformers import Qwen3Config, Qwen3ForCausalLM

from deltasync import telemetry
from deltasync.storage import open_storage
from deltasync.trl.transfer import BucketWeightTransfer
from deltasync.units import format_bytes


def model(layers: int, rank: int) -> torch.nn.Module:
    config = Qwen3Config(
        vocab_size=8192,
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=layers,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    lora = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules="all-linear")
    return get_peft_model(Qwen3ForCausalLM(config), lora)


def send_merged(transfer: BucketWeightTransfer, peft_model) -> None:
    """TRL's merged path: the adapter folded into the base weights, sent under checkpoint names."""
    peft_model.merge_adapter()
    try:
        params = peft_model.base_model.model.named_parameters()
        base = ((n.replace(".base_layer", ""), p.detach()) for n, p in params if "lora_" not in n)
        transfer.send_weights(base)
    finally:
        peft_model.unmerge_adapter()


def records(root: Path) -> list[telemetry.TrainerRecord]:
    storage = open_storage(str(root))
    return [
        telemetry.from_json(telemetry.TrainerRecord, storage.read_bytes(path))
        for path in sorted(p for p in storage.list(telemetry.TRAINER_DIR) if p.endswith(".json"))
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--lr", type=float, default=1e-4)
    args = parser.parse_args()

    peft_model = model(args.layers, args.rank)
    optimizer = torch.optim.AdamW([p for p in peft_model.parameters() if p.requires_grad], lr=args.lr)
    tokens = torch.randint(0, 8192, (4, 64), generator=torch.Generator().manual_seed(1))
    with tempfile.TemporaryDirectory() as tmp:
        roots = {"adapter": Path(tmp) / "adapter", "merged": Path(tmp) / "merged"}
        adapter = BucketWeightTransfer(roots["adapter"], model_id="bench", lora_name="policy")
        adapter.use_model(peft_model)
        merged = BucketWeightTransfer(roots["merged"], model_id="bench")
        for step in range(args.steps + 1):
            if step:
                loss = peft_model(input_ids=tokens, labels=tokens).loss
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
            adapter.send_weights(iter(()))  # adapter mode reads the adapter from the model
            send_merged(merged, peft_model)
            for transfer in (adapter, merged):
                assert transfer.publisher is not None
                transfer.publisher.flush()
        for transfer in (adapter, merged):
            transfer.destroy()
        published = {mode: records(root) for mode, root in roots.items()}

    print(f"Qwen3-0.6B layer shapes, {args.layers} layers, LoRA r={args.rank} (all linear), lr {args.lr}")
    print("step | adapter: elements, changed, payload | merged: elements, changed, payload | merged/adapter")
    for a, m in zip(published["adapter"], published["merged"], strict=True):
        adapter_row = f"{a.numel:,}, {a.sparsity:.1%}, {format_bytes(a.payload_bytes)}"
        merged_row = f"{m.numel:,}, {m.sparsity:.1%}, {format_bytes(m.payload_bytes)}"
        ratio = m.payload_bytes / max(a.payload_bytes, 1)
        print(f"{a.step} ({a.kind}/{m.kind}) | {adapter_row} | {merged_row} | {ratio:.1f}x")


if __name__ == "__main__":
    main()
