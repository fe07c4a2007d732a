"""GRPO on a task of your own (sums, checked exactly) with TRL's AsyncGRPOTrainer. Every step goes to a sync
root that vLLM replicas follow (the inference Space, or `deltasync follow` beside a vLLM server); rollouts
are sampled from those replicas.

    python examples/grpo_bucket.py --model_name_or_path Qwen/Qwen3-0.6B --sync_root hf://buckets/me/sums \
        --inference_url https://me-infer.hf.space --output_dir runs/sums

With `--lora_r 8` it trains a LoRA adapter: each step publishes the adapter alone, and replicas (vLLM with
`--enable-lora` and DELTASYNC_LORA_ROOT set to the root) serve each step N as the adapter `policy-vN`.
"""

import random
from dataclasses import dataclass, field

import torch
from datasets import Dataset
from transformers import AutoTokenizer
from trl import TrlParser
from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer

import deltasync.trl as ds


@dataclass
class BucketArguments:
    model_name_or_path: str = field(metadata={"help": "The model the replicas serve (HF id or folder)."})
    sync_root: str = field(metadata={"help": "A folder, hf://buckets/<namespace>/<name>, an fsspec URL."})
    inference_url: list[str] = field(metadata={"help": "Each replica's base URL.", "nargs": "+"})
    num_prompts: int = field(default=1000, metadata={"help": "How many sums to generate."})
    rollouts_ahead: float = field(default=0.5, metadata={"help": "Steps' worth of rollouts generated ahead."})
    lora_r: int = field(default=0, metadata={"help": "Train a LoRA adapter of this rank (0: all weights)."})


def sums(n: int, seed: int) -> Dataset:
    rng = random.Random(seed)
    pairs = [(rng.randint(0, 99), rng.randint(0, 99)) for _ in range(n)]
    prompts = [[{"role": "user", "content": f"What is {a} + {b}? Answer with the sum."}] for a, b in pairs]
    return Dataset.from_dict({"prompt": prompts, "answer": [str(a + b) for a, b in pairs]})


def exact_sum(completions: list[list[dict]], answer: list[str], **kwargs) -> list[float]:
    return [float(c[-1]["content"].strip() == a) for c, a in zip(completions, answer, strict=True)]


def main() -> None:
    ours, args = TrlParser((BucketArguments, AsyncGRPOConfig)).parse_args_and_config()
    ds.apply_cpu_shims("cuda" if torch.cuda.is_available() and not args.use_cpu else "cpu")
    name, urls = ours.model_name_or_path, ours.inference_url
    args.vllm_server_base_url = urls[0]
    max_ahead = ds.rollouts_ahead(args, ours.rollouts_ahead)  # sets TRL's queue bounds: before the trainer
    lora = None
    if ours.lora_r:
        from peft import LoraConfig  # only LoRA runs need peft

        lora = LoraConfig(r=ours.lora_r, target_modules="all-linear")
    transfer = ds.BucketWeightTransfer(ours.sync_root, model_id=name, lora_name="policy" if lora else None)
    trainer = AsyncGRPOTrainer(
        model=name, reward_funcs=exact_sum, args=args, train_dataset=sums(ours.num_prompts, args.seed),
        processing_class=AutoTokenizer.from_pretrained(name), weight_transfer=transfer, peft_config=lora,
    )  # fmt: skip
    if trainer.accelerator.is_main_process:  # nothing is published unless all is usable
        schema = ds.schema_of(trainer.model, adapter=lora is not None)
        ds.check_or_exit(ours.sync_root, schema, name, urls)
    ds.stamp_rollouts(trainer, transfer, replica_urls=urls, max_ahead=max_ahead, seed=args.seed)
    trainer.train()


if __name__ == "__main__":
    main()
